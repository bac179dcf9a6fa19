//! GGUF reading against the `gguf` Python package: every fixture's metadata and tensor table
//! (names, types, shapes outermost-first, absolute offsets, lengths) must equal what GGUFReader
//! read (recorded in tests/fixtures/format/expected.json by scripts/make_format_fixtures.py),
//! and tensor bytes, expert slices and dequantized values must have the same checksums.

mod format_util;

use format_util::*;
use serde_json::Value;
use sluice::dtype::DType;
use sluice::format::{FileKind, FormatError, MetaValue, ModelFiles};
use sluice::kernels;

/// GGUF value type name (as gguf.GGUFValueType names it) of a value.
fn type_name(v: &MetaValue) -> &'static str {
    match v {
        MetaValue::U8(_) => "UINT8",
        MetaValue::I8(_) => "INT8",
        MetaValue::U16(_) => "UINT16",
        MetaValue::I16(_) => "INT16",
        MetaValue::U32(_) => "UINT32",
        MetaValue::I32(_) => "INT32",
        MetaValue::U64(_) => "UINT64",
        MetaValue::I64(_) => "INT64",
        MetaValue::F32(_) => "FLOAT32",
        MetaValue::F64(_) => "FLOAT64",
        MetaValue::Bool(_) => "BOOL",
        MetaValue::String(_) => "STRING",
        MetaValue::Array(_) => "ARRAY",
    }
}

/// Compare one value with its JSON form exactly (floats bit for bit, sign of zero included).
fn same(v: &MetaValue, j: &Value) -> bool {
    match v {
        MetaValue::F32(x) => j
            .as_f64()
            .is_some_and(|y| (*x as f64).to_bits() == y.to_bits()),
        MetaValue::F64(x) => j.as_f64().is_some_and(|y| x.to_bits() == y.to_bits()),
        MetaValue::Bool(b) => j.as_bool() == Some(*b),
        MetaValue::String(s) => j.as_str() == Some(s.as_str()),
        MetaValue::Array(items) => j.as_array().is_some_and(|a| {
            a.len() == items.len() && items.iter().zip(a).all(|(x, y)| same(x, y))
        }),
        MetaValue::U64(x) => j.as_u64() == Some(*x),
        other => other.as_i64().is_some() && j.as_i64() == other.as_i64(),
    }
}

fn check_model(rel: &str) -> ModelFiles {
    let all = expected();
    let exp = &all["gguf"][rel];
    assert!(exp.is_object(), "no expectations for {rel}");
    let m = ModelFiles::open(&fixture(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
    assert_eq!(m.kind(), FileKind::Gguf);
    let files: Vec<_> = exp["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| fixture(f.as_str().unwrap()))
        .collect();
    assert_eq!(m.paths(), &files[..], "{rel}: files");
    assert_eq!(m.dir(), fixture(rel).parent().unwrap());
    assert_eq!(
        m.gguf_version(),
        Some(as_u64(&exp["version"]) as u32),
        "{rel}: version"
    );
    assert_eq!(
        m.alignment(),
        Some(as_u64(&exp["alignment"])),
        "{rel}: alignment"
    );
    if let Some(d) = exp.get("data_offset") {
        assert_eq!(m.data_offset(0), Some(as_u64(d)), "{rel}: data offset");
    }
    assert!(m.config().is_none());

    // Metadata: same keys, same order, same types, same values.
    let meta = exp["metadata"].as_array().unwrap();
    let keys: Vec<&str> = m.meta_keys().collect();
    let want: Vec<&str> = meta.iter().map(|e| e["key"].as_str().unwrap()).collect();
    assert_eq!(keys, want, "{rel}: metadata keys");
    for e in meta {
        let key = e["key"].as_str().unwrap();
        let v = m.meta(key).unwrap();
        assert_eq!(
            type_name(v),
            e["type"].as_str().unwrap(),
            "{rel}: type of {key}"
        );
        if let MetaValue::Array(items) = v {
            if let Some(first) = items.first() {
                assert_eq!(
                    Some(type_name(first)),
                    e["elem"].as_str(),
                    "{rel}: element type of {key}"
                );
            }
        }
        let j = if e["value"].is_null() {
            &exp["nested"][key]
        } else {
            &e["value"]
        };
        assert!(same(v, j), "{rel}: value of {key}: {v:?} vs {j}");
    }

    // Tensor table, bytes, expert slices, dequantization.
    let tensors = exp["tensors"].as_array().unwrap();
    assert_eq!(m.tensors().len(), tensors.len(), "{rel}: tensor count");
    for (t, e) in m.tensors().iter().zip(tensors) {
        let name = e["name"].as_str().unwrap();
        assert_eq!(t.name, name);
        assert_eq!(m.tensor(name), Some(t));
        assert_eq!(
            t.dtype,
            DType::from_ggml_id(as_u64(&e["type_id"]) as u32),
            "{name}"
        );
        assert_eq!(m.dtype_name(t), e["type"].as_str().unwrap(), "{name}");
        assert_eq!(t.shape, shape(&e["shape"]), "{name}: shape");
        assert_eq!(t.range.file as u64, as_u64(&e["file"]), "{name}: file");
        assert_eq!(t.range.offset, as_u64(&e["offset"]), "{name}: offset");
        assert_eq!(t.range.len, as_u64(&e["n_bytes"]), "{name}: length");
        if let Some(f) = e.get("fnv") {
            assert_eq!(
                fnv1a64(m.bytes(t).unwrap()),
                f.as_str().unwrap(),
                "{name}: bytes"
            );
        }
        if let Some(experts) = e.get("experts_fnv") {
            let experts = experts.as_array().unwrap();
            assert_eq!(experts.len() as u64, t.shape[0]);
            let mut next = t.range.offset;
            for (i, f) in experts.iter().enumerate() {
                let r = m.expert_range(t, i).unwrap();
                assert_eq!(
                    (r.file, r.offset),
                    (t.range.file, next),
                    "{name}: expert {i} follows expert {}",
                    i.max(1) - 1
                );
                next += r.len;
                assert_eq!(
                    fnv1a64(m.range_bytes(r).unwrap()),
                    f.as_str().unwrap(),
                    "{name}: expert {i}"
                );
            }
            assert_eq!(next, t.range.offset + t.range.len);
            assert!(m.expert_range(t, experts.len()).is_err());
        }
        if let Some(f) = e.get("dequant_fnv") {
            // gguf.quants.dequantize's output. Types whose kernels this build lacks must say so.
            match m.dequantize(t) {
                Ok(v) => assert_eq!(
                    fnv1a64(&f32_bytes(&v)),
                    f.as_str().unwrap(),
                    "{name}: dequantized"
                ),
                Err(FormatError::UnsupportedDType { .. })
                    if kernels::kernels_for(t.dtype).is_err() =>
                {
                    eprintln!(
                        "note: no {} kernels in this build; {name} not dequantized",
                        t.dtype
                    )
                }
                Err(err) => panic!("{name}: {err}"),
            }
        }
    }
    m
}

#[test]
fn tiny_moe_matches_gguf_reader() {
    let m = check_model("tiny-moe.gguf");
    assert_eq!(
        m.meta("general.architecture").and_then(|v| v.as_str()),
        Some("qwen3moe")
    );
    assert_eq!(
        m.meta("qwen3moe.expert_count").and_then(|v| v.as_u64()),
        Some(8)
    );
    // 2-D tensors have no experts.
    let t = m.tensor("blk.0.attn_q.weight").unwrap();
    assert!(m
        .expert_range(t, 0)
        .unwrap_err()
        .to_string()
        .contains("not [n_expert, rows, cols]"));
}

#[test]
fn split_gguf_matches_gguf_reader() {
    let m = check_model("format/split-00001-of-00003.gguf");
    assert_eq!(m.paths().len(), 3);
    // Any shard opens the whole model.
    let m2 = ModelFiles::open(&fixture("format/split-00002-of-00003.gguf")).unwrap();
    assert_eq!(m2.paths(), m.paths());
    assert_eq!(m2.tensors(), m.tensors());
}

#[test]
fn every_value_type_v3() {
    check_model("format/all-types.gguf");
}

#[test]
fn every_value_type_v2() {
    check_model("format/all-types-v2.gguf");
}

#[test]
fn unknown_tensor_type_fails_only_when_used() {
    let m = check_model("format/unknown-type.gguf");
    let t = m.tensor("b.weight").unwrap();
    assert_eq!(t.dtype, DType::Unknown(99));
    let e = m.bytes(t).unwrap_err();
    assert!(matches!(e, FormatError::UnsupportedDType { .. }));
    let msg = e.to_string();
    assert!(
        msg.contains("unknown-type.gguf") && msg.contains("b.weight") && msg.contains("#99"),
        "{msg}"
    );
    assert!(m.dequantize(t).is_err());
    // Its neighbours are fine.
    assert!(m.dequantize(m.tensor("c.weight").unwrap()).is_ok());
}

#[test]
fn directory_with_one_gguf_opens_it() {
    let d = scratch("gguf-dir");
    std::fs::copy(fixture("tiny-moe.gguf"), d.join("tiny-moe.gguf")).unwrap();
    let m = ModelFiles::open(&d).unwrap();
    assert_eq!(m.kind(), FileKind::Gguf);
    assert_eq!(m.tensors().len(), 27);
}

#[test]
fn model_files_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ModelFiles>();
    assert_send_sync::<FormatError>();
}
