//! Tensor types and shapes the model loader must refuse, at load and in one line: a model whose
//! weights use a type sluice has no kernels for, or a ggml type id it does not know at all, or a
//! tensor whose shape is not whole blocks of its type. `sluice logits` loads every weight
//! before it computes anything, so each case must exit 1 with one `error:` line naming the file,
//! the tensor and (for types) the ggml type id, and must write no output file.
//! Each corrupt file is tiny-moe.gguf with one tensor info patched.

mod format_util;

use std::path::{Path, PathBuf};
use std::process::Command;

use format_util::*;

/// Offset of the `n_dims` field of tensor `name`'s info in a GGUF, and its `n_dims`.
fn tensor_info(g: &[u8], name: &str) -> (usize, usize) {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend(name.as_bytes());
    let at = g
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("tensor in fixture")
        + needle.len();
    let nd = u32::from_le_bytes(g[at..at + 4].try_into().unwrap()) as usize;
    (at, nd)
}

/// tiny-moe.gguf with tensor `name`'s ggml type id and/or innermost dimension replaced.
fn patched(tag: &str, name: &str, type_id: Option<u32>, dim0: Option<u64>) -> PathBuf {
    let mut g = std::fs::read(fixture("tiny-moe.gguf")).unwrap();
    let (at, nd) = tensor_info(&g, name);
    if let Some(d) = dim0 {
        g[at + 4..at + 12].copy_from_slice(&d.to_le_bytes());
    }
    if let Some(t) = type_id {
        let o = at + 4 + 8 * nd;
        g[o..o + 4].copy_from_slice(&t.to_le_bytes());
    }
    let p = scratch("load-bad-types").join(format!("{tag}.gguf"));
    std::fs::write(&p, g).unwrap();
    p
}

/// `sluice logits` on `model` fails with exit 1 and one error line holding every needle.
fn refused(model: &Path, needles: &[&str]) {
    let out = model.with_extension("npy");
    let _ = std::fs::remove_file(&out);
    let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["logits", model.to_str().unwrap(), "--tokens", "1,2,3"])
        .arg("--out")
        .arg(&out)
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run sluice");
    let err = String::from_utf8_lossy(&o.stderr);
    let line = err.trim_end();
    assert_eq!(
        o.status.code(),
        Some(1),
        "exit status {:?}: {err}",
        o.status
    );
    assert!(!line.contains('\n'), "stderr is not one line:\n{err}");
    assert!(!err.contains("panicked"), "panic:\n{err}");
    assert!(line.starts_with("error: "), "{line}");
    for n in needles {
        assert!(line.contains(n), "error lacks {n:?}: {line}");
    }
    assert!(!out.exists(), "{} was written", out.display());
}

#[test]
fn type_without_kernels_is_refused_at_load() {
    // I32 (ggml id 26) has the same bytes per element as the F32 router it replaces.
    let p = patched("i32-router", "blk.1.ffn_gate_inp.weight", Some(26), None);
    refused(
        &p,
        &[
            "i32-router.gguf",
            "blk.1.ffn_gate_inp.weight",
            "I32",
            "ggml type id 26",
            "no kernels",
        ],
    );
}

#[test]
fn unknown_type_id_in_routed_experts_is_refused_at_load() {
    // Routed experts are streamed at decode time; their type is still checked at load.
    let p = patched(
        "unknown-experts",
        "blk.1.ffn_down_exps.weight",
        Some(99),
        None,
    );
    refused(
        &p,
        &["unknown-experts.gguf", "blk.1.ffn_down_exps.weight", "#99"],
    );
}

#[test]
fn shape_not_whole_blocks_is_one_line() {
    let p = patched("partial-block", "blk.0.attn_output.weight", None, Some(120));
    refused(
        &p,
        &[
            "partial-block.gguf",
            "blk.0.attn_output.weight",
            "120",
            "block of 32",
        ],
    );
}

#[test]
fn shape_not_matching_config_is_one_line() {
    // Shrinking a tensor's shape in the header leaves its bytes where they were: the reader's
    // layout check (tensors packed one after another, as llama.cpp requires) names the first
    // tensor whose data no longer starts where the shapes say, before any shape is bound.
    let p = patched("short-shape", "blk.0.attn_output.weight", None, Some(96));
    refused(
        &p,
        &["short-shape.gguf", "data offset", "general.alignment"],
    );
}
