//! safetensors reading against the `safetensors` Python package (dtype, shape, header offsets
//! recorded by scripts/make_format_fixtures.py), FP8 E4M3 block-scaled dequantization against
//! numpy + ml_dtypes, and fused 3-D expert slices against numpy's `arr[e]`.

mod format_util;

use format_util::*;
use sluice::dtype::DType;
use sluice::format::{FileKind, FormatError, ModelFiles};

fn check_model(rel: &str, m: &ModelFiles) {
    let all = expected();
    let exp = &all["safetensors"][rel];
    assert_eq!(m.kind(), FileKind::Safetensors);
    let files: Vec<_> = exp["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| fixture(f.as_str().unwrap()))
        .collect();
    assert_eq!(m.paths(), &files[..], "{rel}: files");
    assert_eq!(m.meta_keys().count(), 0);
    assert!(m.meta("general.architecture").is_none());
    assert_eq!(m.gguf_version(), None);
    let tensors = exp["tensors"].as_array().unwrap();
    assert_eq!(m.tensors().len(), tensors.len(), "{rel}: tensor count");
    for (t, e) in m.tensors().iter().zip(tensors) {
        let name = e["name"].as_str().unwrap();
        assert_eq!(t.name, name, "{rel}: tensor order");
        assert_eq!(m.tensor(name), Some(t));
        assert_eq!(m.dtype_name(t), e["dtype"].as_str().unwrap(), "{name}");
        assert_eq!(t.shape, shape(&e["shape"]), "{name}: shape");
        assert_eq!(t.range.file as u64, as_u64(&e["file"]), "{name}: file");
        assert_eq!(t.range.offset, as_u64(&e["offset"]), "{name}: offset");
        assert_eq!(t.range.len, as_u64(&e["n_bytes"]), "{name}: length");
        assert_eq!(
            fnv1a64(m.bytes(t).unwrap()),
            e["fnv"].as_str().unwrap(),
            "{name}: bytes"
        );
        if let Some(f) = e.get("dequant_fnv") {
            match m.dequantize(t) {
                Ok(v) => assert_eq!(
                    fnv1a64(&f32_bytes(&v)),
                    f.as_str().unwrap(),
                    "{name}: dequantized"
                ),
                // BF16 kernels come from kernels/float.rs; F8 from kernels/fp8.rs: both present.
                Err(err) => panic!("{name}: {err}"),
            }
        }
        if let Some(experts) = e.get("experts_fnv") {
            for (i, f) in experts.as_array().unwrap().iter().enumerate() {
                let r = m.expert_range(t, i).unwrap();
                assert_eq!(
                    fnv1a64(m.range_bytes(r).unwrap()),
                    f.as_str().unwrap(),
                    "{name}: expert {i}"
                );
            }
        }
    }
}

#[test]
fn deepseek_sharded_fp8_matches_reference() {
    let m = ModelFiles::open(&fixture("format/hf-deepseek")).unwrap();
    check_model("format/hf-deepseek", &m);
    assert_eq!(m.dir(), fixture("format/hf-deepseek"));
    let cfg = m.config().expect("config.json");
    assert_eq!(cfg["model_type"], "deepseek_v3");
    // Weights are FP8 with a sibling scale tensor; scales are plain F32.
    let w = m
        .tensor("model.layers.1.mlp.experts.3.down_proj.weight")
        .unwrap();
    assert_eq!(w.dtype, DType::F8E4M3);
    assert_eq!(
        m.tensor("model.layers.1.mlp.experts.3.down_proj.weight_scale_inv")
            .unwrap()
            .dtype,
        DType::F32
    );
    // The index file itself opens the same model.
    let m2 = ModelFiles::open(&fixture("format/hf-deepseek/model.safetensors.index.json")).unwrap();
    assert_eq!(m2.tensors(), m.tensors());
}

#[test]
fn fp8_block_scaled_dequantization_is_bit_identical() {
    let all = expected();
    let r = &all["fp8_reference"];
    let m = ModelFiles::open(&fixture(r["model"].as_str().unwrap())).unwrap();
    let t = m.tensor(r["tensor"].as_str().unwrap()).unwrap();
    assert_eq!(t.shape, shape(&r["shape"]));
    // 144 x 136 in 128x128 tiles: a full tile, two partial ones and a small corner.
    assert_eq!(t.shape, vec![144, 136]);
    let got = m.dequantize(t).unwrap();
    let want: Vec<f32> = std::fs::read(fixture(r["file"].as_str().unwrap()))
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(got.len(), want.len());
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "element {i} (row {}, col {}): {a} vs {b}",
            i / 136,
            i % 136
        );
    }
}

#[test]
fn fused_experts_single_file_matches_reference() {
    let p = fixture("format/hf-fused/model.safetensors");
    let m = ModelFiles::open(&p).unwrap();
    check_model("format/hf-fused/model.safetensors", &m);
    assert_eq!(m.dir(), fixture("format/hf-fused"));
    assert_eq!(m.config().unwrap()["model_type"], "qwen3_moe");
    let t = m.tensor("model.layers.1.mlp.experts.gate_up_proj").unwrap();
    assert_eq!(t.shape, vec![4, 64, 64]);
    let r = m.expert_range(t, 3).unwrap();
    assert_eq!(r.len, 64 * 64 * 2);
    assert_eq!(r.offset, t.range.offset + 3 * r.len);
    // A directory holding the one file opens the same.
    let m2 = ModelFiles::open(&fixture("format/hf-fused")).unwrap();
    assert_eq!(m2.tensors(), m.tensors());
}

/// Write a small safetensors file by hand.
fn write_st(path: &std::path::Path, header: &str, data: &[u8]) {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend(header.as_bytes());
    b.extend(data);
    std::fs::write(path, b).unwrap();
}

#[test]
fn unsupported_dtypes_fail_when_used() {
    let d = scratch("st-dtypes");
    let p = d.join("model.safetensors");
    let h = r#"{"u":{"dtype":"U16","shape":[2],"data_offsets":[0,4]},"i":{"dtype":"I32","shape":[1],"data_offsets":[4,8]},"f":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
    write_st(&p, h, &[0u8; 12]);
    let m = ModelFiles::open(&p).unwrap();
    assert!(m.config().is_none());
    let u = m.tensor("u").unwrap();
    assert_eq!(m.dtype_name(u), "U16");
    let e = m.bytes(u).unwrap_err().to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("`u`") && e.contains("U16"),
        "{e}"
    );
    // I32 has a layout (bytes work) but no kernels.
    let i = m.tensor("i").unwrap();
    assert_eq!(m.bytes(i).unwrap().len(), 4);
    let e = m.dequantize(i).unwrap_err();
    assert!(matches!(e, FormatError::UnsupportedDType { .. }), "{e}");
    assert!(e.to_string().contains("I32"));
    assert_eq!(m.dequantize(m.tensor("f").unwrap()).unwrap(), vec![0.0]);
}

#[test]
fn fp8_scale_shape_mismatch_is_an_error() {
    let d = scratch("st-fp8");
    let p = d.join("model.safetensors");
    // 2x3 FP8 of 1.0 (0x38); scales should be 1x1 for 128-tiles but are 1x2.
    // (Contiguous data: the safetensors library refuses gaps between tensors.)
    let h = r#"{"w.weight":{"dtype":"F8_E4M3","shape":[2,3],"data_offsets":[0,6]},"w.weight_scale_inv":{"dtype":"F32","shape":[1,2],"data_offsets":[6,14]},"p.weight":{"dtype":"F8_E4M3","shape":[2,3],"data_offsets":[14,20]}}"#;
    let mut data = vec![0x38u8; 6];
    data.extend(2.0f32.to_le_bytes());
    data.extend(2.0f32.to_le_bytes());
    data.extend([0x38u8, 0xB8, 0x7E, 0x01, 0x00, 0x80]);
    write_st(&p, h, &data);
    let m = ModelFiles::open(&p).unwrap();
    let e = m
        .dequantize(m.tensor("w.weight").unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("w.weight_scale_inv") && e.contains("[1, 2]"),
        "{e}"
    );
    // Without a scale tensor: plain E4M3 values.
    let v = m.dequantize(m.tensor("p.weight").unwrap()).unwrap();
    assert_eq!(v, vec![1.0, -1.0, 448.0, 2f32.powi(-9), 0.0, -0.0]);
}
