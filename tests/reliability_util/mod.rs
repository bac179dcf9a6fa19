//! Shared by tests/reliability_*.rs: scratch directories, broken copies of the committed
//! Qwen3-MoE fixture (GGUF rewrites, safetensors/config.json edits), and running the binary
//! expecting a clean one-line failure.

#![allow(dead_code)]

use sluice::format::{GgufWriter, MetaValue, ModelFiles};
use std::path::{Path, PathBuf};
use std::process::Command;

pub fn tmpdir(tag: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("reliability-{tag}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(rel)
}

/// The fixture's GGUF rewritten to `out` with `meta` editing (or dropping) metadata.
pub fn rewrite_gguf(out: &Path, meta: impl Fn(&str, &MetaValue) -> Option<MetaValue>) {
    rewrite_gguf_with(out, meta, &[]);
}

pub fn rewrite_gguf_with(
    out: &Path,
    meta: impl Fn(&str, &MetaValue) -> Option<MetaValue>,
    extra: &[(&str, MetaValue)],
) {
    let files = ModelFiles::open(&fixture("qwen3_moe/model-f32.gguf")).unwrap();
    let mut w = GgufWriter::new(out).unwrap();
    for k in files.meta_keys() {
        if let Some(v) = meta(k, files.meta(k).unwrap()) {
            w.add_meta(k, v).unwrap();
        }
    }
    for (k, v) in extra {
        w.add_meta(k, v.clone()).unwrap();
    }
    for t in files.tensors() {
        w.add_tensor_info(&t.name, t.dtype, &t.shape).unwrap();
    }
    for t in files.tensors() {
        w.write_tensor_data(files.bytes(t).unwrap()).unwrap();
    }
    w.finish().unwrap();
}

/// A copy of the safetensors fixture (config.json, model.safetensors, tokenizer files) in a
/// scratch directory, with `edit` applied to config.json.
pub fn safetensors_copy(tag: &str, edit: impl Fn(&mut serde_json::Value)) -> PathBuf {
    let d = tmpdir(tag);
    let src = fixture("qwen3_moe");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), d.join(f)).unwrap();
    }
    d
}

/// Run the binary; (exit code, stdout, stderr). A death by signal reads as -1.
pub fn sluice(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .env(
            "SLUICE_CACHE_DIR",
            Path::new(env!("CARGO_TARGET_TMPDIR")).join("reliability-cache"),
        )
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).to_string(),
        String::from_utf8_lossy(&o.stderr).to_string(),
    )
}

/// `args` must exit 1 with one line on stderr containing `needle`, and no panic.
pub fn assert_clean_failure(args: &[&str], needle: &str) {
    let (code, _, err) = sluice(args);
    assert_eq!(code, 1, "exit code for {args:?}; stderr: {err}");
    assert!(!err.contains("panicked"), "panic for {args:?}: {err}");
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| !l.starts_with("[sluice] warning"))
        .collect();
    assert_eq!(lines.len(), 1, "stderr not one line for {args:?}: {err}");
    assert!(
        err.contains(needle),
        "stderr for {args:?} lacks {needle:?}: {err}"
    );
}

/// `logits MODEL --tokens 1,2 --out /dev/null` plus `more`.
pub fn logits_args<'a>(m: &'a str, more: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["logits", m, "--tokens", "1,2", "--out", "/dev/null"];
    a.extend_from_slice(more);
    a
}
