//! Helpers shared by the tests that hold model outputs against the transformers fixtures in
//! tests/fixtures/models: fixture paths, cases.json fields, and the logits comparison.
#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};

/// tests/fixtures/models/NAME.
pub fn dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

pub fn json(p: &Path) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// A JSON array of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Index of the largest value, the lowest index on ties.
pub fn argmax(x: &[f32]) -> usize {
    let mut b = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[b] {
            b = i;
        }
    }
    b
}

/// Worst max|a-b| / max|b| over rows of `v`, and whether every row's argmax agrees.
pub fn compare(ours: &[f32], refr: &[f32], v: usize) -> (f32, bool) {
    let (mut worst, mut same) = (0f32, true);
    for (a, b) in ours.chunks(v).zip(refr.chunks(v)) {
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        worst = worst.max(err / scale);
        same &= argmax(a) == argmax(b);
    }
    (worst, same)
}
