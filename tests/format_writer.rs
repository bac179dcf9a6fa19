//! GgufWriter against the `gguf` Python package's GGUFWriter: re-writing a fixture that
//! GGUFWriter made (same metadata, same tensors, same order) must give the same bytes, so
//! anything GGUFReader / llama.cpp reads from theirs they read from ours.

mod format_util;

use format_util::*;
use sluice::dtype::DType;
use sluice::format::{GgufWriter, MetaValue, ModelFiles};

/// Copy `m` into a new GGUF at `out` with our writer, feeding tensor bytes in `chunk`-byte pieces.
fn rewrite(m: &ModelFiles, out: &std::path::Path, chunk: usize) {
    let mut w = GgufWriter::new(out).unwrap();
    for k in m.meta_keys() {
        w.add_meta(k, m.meta(k).unwrap().clone()).unwrap();
    }
    for t in m.tensors() {
        w.add_tensor_info(&t.name, t.dtype, &t.shape).unwrap();
    }
    for t in m.tensors() {
        for piece in m.bytes(t).unwrap().chunks(chunk) {
            w.write_tensor_data(piece).unwrap();
        }
    }
    assert_eq!(w.finish().unwrap(), out);
}

fn check_identical(rel: &str, chunk: usize) {
    let src = fixture(rel);
    let m = ModelFiles::open(&src).unwrap();
    let d = scratch("writer");
    let out = d.join("copy.gguf");
    rewrite(&m, &out, chunk);
    let (a, b) = (std::fs::read(&src).unwrap(), std::fs::read(&out).unwrap());
    assert_eq!(a.len(), b.len(), "{rel}: size");
    if let Some(i) = a.iter().zip(&b).position(|(x, y)| x != y) {
        panic!("{rel}: first difference at byte {i}");
    }
    assert!(!d.join("copy.gguf.tmp").exists());
    // And our reader reads ours back the same.
    let m2 = ModelFiles::open(&out).unwrap();
    assert_eq!(m2.tensors().len(), m.tensors().len());
    for (x, y) in m.tensors().iter().zip(m2.tensors()) {
        assert_eq!(
            (&x.name, x.dtype, &x.shape, x.range.offset),
            (&y.name, y.dtype, &y.shape, y.range.offset)
        );
    }
}

#[test]
fn rewrite_of_tiny_moe_is_byte_identical() {
    check_identical("tiny-moe.gguf", 1000);
}

#[test]
fn rewrite_of_all_value_types_is_byte_identical() {
    // general.alignment = 64, nested arrays, every scalar type.
    check_identical("format/all-types.gguf", 7);
}

#[test]
fn writer_refuses_misuse_and_leaves_no_file() {
    let d = scratch("writer-misuse");
    let out = d.join("m.gguf");
    let tmp = d.join("m.gguf.tmp");
    let mut w = GgufWriter::new(&out).unwrap();
    assert!(tmp.exists());
    w.add_meta("general.architecture", MetaValue::String("x".into()))
        .unwrap();
    assert!(w
        .add_meta("general.architecture", MetaValue::String("y".into()))
        .is_err());
    assert!(w
        .add_meta(
            "a",
            MetaValue::Array(vec![MetaValue::U8(1), MetaValue::I8(1)])
        )
        .is_err());
    assert!(w.add_meta("general.alignment", MetaValue::U32(48)).is_err());
    assert!(w
        .add_tensor_info(&"n".repeat(64), DType::F32, &[4])
        .is_err());
    assert!(w.add_tensor_info("fp8", DType::F8E4M3, &[4]).is_err());
    assert!(w.add_tensor_info("q", DType::Q4_K, &[2, 100]).is_err());
    assert!(w.add_tensor_info("u", DType::Unknown(99), &[4]).is_err());
    assert!(w
        .add_tensor_info("big", DType::F32, &[1, 1, 1, 1, 1])
        .is_err());
    w.add_tensor_info("a", DType::F32, &[2]).unwrap();
    w.add_tensor_info("b", DType::F16, &[3]).unwrap();
    assert!(
        w.write_tensor_data(&[0u8; 9]).is_err(),
        "runs into the next tensor"
    );
    w.write_tensor_data(&[0u8; 8]).unwrap();
    assert!(w.add_meta("late", MetaValue::U8(1)).is_err());
    assert!(w.add_tensor_info("late", DType::F32, &[1]).is_err());
    w.write_tensor_data(&[0u8; 2]).unwrap();
    let e = w.finish().unwrap_err().to_string();
    assert!(e.contains("m.gguf") && e.contains("`b`"), "{e}");
    assert!(!out.exists() && !tmp.exists());

    // Dropped unfinished: the .tmp goes too.
    let w = GgufWriter::new(&out).unwrap();
    drop(w);
    assert!(!out.exists() && !tmp.exists());
}

#[test]
fn writer_output_reads_back() {
    let d = scratch("writer-small");
    let out = d.join("s.gguf");
    let mut w = GgufWriter::new(&out).unwrap();
    w.add_meta("general.alignment", MetaValue::U32(128))
        .unwrap();
    w.add_meta("k.empty", MetaValue::Array(vec![])).unwrap();
    w.add_meta("k.f", MetaValue::F64(-1.5)).unwrap();
    w.add_tensor_info("w", DType::Q8_0, &[2, 3, 32]).unwrap();
    w.add_tensor_info("v", DType::F32, &[5]).unwrap();
    let q: Vec<u8> = (0..6 * 34).map(|i| i as u8).collect();
    w.write_tensor_data(&q).unwrap();
    let v: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    w.write_tensor_data(&v).unwrap();
    w.finish().unwrap();

    let m = ModelFiles::open(&out).unwrap();
    assert_eq!(m.alignment(), Some(128));
    assert_eq!(m.meta("k.empty"), Some(&MetaValue::Array(vec![])));
    assert_eq!(m.meta("k.f"), Some(&MetaValue::F64(-1.5)));
    let t = m.tensor("w").unwrap();
    assert_eq!(t.shape, vec![2, 3, 32]);
    assert_eq!(t.range.offset % 128, 0);
    assert_eq!(m.bytes(t).unwrap(), &q[..]);
    let e1 = m.expert_range(t, 1).unwrap();
    assert_eq!(m.range_bytes(e1).unwrap(), &q[3 * 34..]);
    assert_eq!(
        m.dequantize(m.tensor("v").unwrap()).unwrap(),
        vec![1.0, 2.0, 3.0, 4.0, 5.0]
    );
    assert_eq!(std::fs::metadata(&out).unwrap().len() % 128, 0);
}
