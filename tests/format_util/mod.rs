//! Helpers shared by the format/inspect integration tests: fixture paths, the reference JSON
//! written by scripts/make_format_fixtures.py, FNV-1a checksums, scratch directories.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub fn fixture(rel: &str) -> PathBuf {
    fixtures().join(rel)
}

/// tests/fixtures/format/expected.json: what the `gguf` and `safetensors` packages read.
pub fn expected() -> serde_json::Value {
    let p = fixture("format/expected.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).expect("expected.json parses")
}

/// FNV-1a 64, as hex (the fixture script computes the same).
pub fn fnv1a64(data: &[u8]) -> String {
    let mut h: u64 = 0xCBF29CE484222325;
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001B3);
    }
    format!("{h:016x}")
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A fresh, empty scratch directory under cargo's per-target temp dir.
pub fn scratch(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create scratch dir");
    d
}

pub fn as_u64(v: &serde_json::Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a u64: {v}"))
}

pub fn shape(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .expect("shape list")
        .iter()
        .map(as_u64)
        .collect()
}
