//! Bad model input through the binary: unknown architecture, missing tensor, shape mismatch
//! between config and file, token id >= vocab. Each must exit 1 with one line on stderr that
//! says what is wrong, and never panic. The broken models are rewrites of the default model.

use sluice::format::{GgufWriter, MetaValue, ModelFiles};
use std::path::{Path, PathBuf};
use std::process::Command;

fn tmpdir(tag: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("model-errors-{tag}"));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Copy the default model to `out`, letting `meta` edit metadata and `keep` drop tensors.
fn rewrite(
    out: &Path,
    meta: impl Fn(&str, &MetaValue) -> Option<MetaValue>,
    keep: impl Fn(&str) -> bool,
) {
    std::env::set_var("SLUICE_CACHE_DIR", tmpdir("cache"));
    let src = sluice::default_model::ensure().unwrap();
    let files = ModelFiles::open(&src).unwrap();
    let mut w = GgufWriter::new(out).unwrap();
    for k in files.meta_keys() {
        let v = files.meta(k).unwrap();
        if let Some(v) = meta(k, v) {
            w.add_meta(k, v).unwrap();
        }
    }
    let kept: Vec<_> = files.tensors().iter().filter(|t| keep(&t.name)).collect();
    for t in &kept {
        w.add_tensor_info(&t.name, t.dtype, &t.shape).unwrap();
    }
    for t in &kept {
        w.write_tensor_data(files.bytes(t).unwrap()).unwrap();
    }
    w.finish().unwrap();
}

fn sluice(args: &[&str]) -> (i32, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).to_string(),
    )
}

fn assert_clean_failure(args: &[&str], needle: &str) {
    let (code, err) = sluice(args);
    assert_eq!(code, 1, "exit code for {args:?}; stderr: {err}");
    assert!(!err.contains("panicked"), "panic for {args:?}: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "stderr not one line for {args:?}: {err}"
    );
    assert!(
        err.contains(needle),
        "stderr for {args:?} lacks {needle:?}: {err}"
    );
}

#[test]
fn unknown_architecture() {
    let p = tmpdir("arch").join("m.gguf");
    rewrite(
        &p,
        |k, v| {
            Some(if k == "general.architecture" {
                MetaValue::String("frobnicator".into())
            } else {
                v.clone()
            })
        },
        |_| true,
    );
    assert_clean_failure(
        &[
            "logits",
            p.to_str().unwrap(),
            "--tokens",
            "1,2",
            "--out",
            "/dev/null",
        ],
        "unknown architecture \"frobnicator\"",
    );
}

#[test]
fn missing_tensor() {
    let p = tmpdir("missing").join("m.gguf");
    rewrite(&p, |_, v| Some(v.clone()), |n| n != "blk.1.attn_k.weight");
    assert_clean_failure(
        &[
            "logits",
            p.to_str().unwrap(),
            "--tokens",
            "1,2",
            "--out",
            "/dev/null",
        ],
        "missing tensor blk.1.attn_k.weight",
    );
}

#[test]
fn shape_mismatch() {
    let p = tmpdir("shape").join("m.gguf");
    rewrite(
        &p,
        |k, v| {
            Some(if k == "qwen3moe.expert_feed_forward_length" {
                MetaValue::U32(512)
            } else {
                v.clone()
            })
        },
        |_| true,
    );
    assert_clean_failure(
        &[
            "logits",
            p.to_str().unwrap(),
            "--tokens",
            "1,2",
            "--out",
            "/dev/null",
        ],
        "shape mismatch",
    );
}

#[test]
fn token_out_of_range() {
    std::env::set_var("SLUICE_CACHE_DIR", tmpdir("cache"));
    let src = sluice::default_model::ensure().unwrap();
    let out = tmpdir("tok").join("l.npy");
    assert_clean_failure(
        &[
            "logits",
            src.to_str().unwrap(),
            "--tokens",
            "1,99999",
            "--out",
            out.to_str().unwrap(),
        ],
        "token id 99999 is out of range",
    );
    assert!(!out.exists(), "no output file on failure");
}

/// GPU flags: a bad value, or `--gpu on` where no GPU can run (this machine has no CUDA
/// device, or the build has no `cuda` feature), is one line and exit 1, never a silent CPU run.
#[test]
fn gpu_flags_fail_cleanly() {
    std::env::set_var("SLUICE_CACHE_DIR", tmpdir("cache"));
    let src = sluice::default_model::ensure().unwrap();
    let out = tmpdir("gpu").join("l.npy");
    let (m, o) = (src.to_str().unwrap(), out.to_str().unwrap());
    let base = ["logits", m, "--tokens", "1,2", "--out", o];
    let with = |extra: &[&'static str]| -> Vec<&str> {
        base.iter().copied().chain(extra.iter().copied()).collect()
    };
    assert_clean_failure(&with(&["--gpu", "maybe"]), "--gpu \"maybe\"");
    assert_clean_failure(
        &with(&["--gpu", "on", "--gpu-staging", "zero-copy"]),
        "--gpu-staging",
    );
    assert_clean_failure(&with(&["--gpu", "on", "--vram", "12Q"]), "12Q");
    if !Path::new("/dev/nvidia0").exists() {
        assert_clean_failure(&with(&["--gpu", "on"]), "--gpu on");
    }
    assert!(!out.exists(), "no output file on failure");
}
