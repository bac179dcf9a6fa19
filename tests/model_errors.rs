//! Bad model input through the binary: unknown architecture, missing tensor, shape mismatch
//! between config and file, token id >= vocab, `-c` beyond the model's context length, config
//! features sluice does not implement. Each must exit 1 with one line on stderr that says what
//! is wrong, and never panic. The broken GGUF models are rewrites of the default model; the
//! broken config.json models are copies of a fixture directory with one field changed.

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
    rewrite_with(out, meta, keep, &[]);
}

/// `rewrite`, adding the metadata `extra`.
fn rewrite_with(
    out: &Path,
    meta: impl Fn(&str, &MetaValue) -> Option<MetaValue>,
    keep: impl Fn(&str) -> bool,
    extra: &[(&str, MetaValue)],
) {
    std::env::set_var("SLUICE_CACHE_DIR", tmpdir("cache"));
    let src = sluice::default_model::ensure_random().unwrap();
    let files = ModelFiles::open(&src).unwrap();
    let mut w = GgufWriter::new(out).unwrap();
    for k in files.meta_keys() {
        let v = files.meta(k).unwrap();
        if let Some(v) = meta(k, v) {
            w.add_meta(k, v).unwrap();
        }
    }
    for (k, v) in extra {
        w.add_meta(k, v.clone()).unwrap();
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
    let src = sluice::default_model::ensure_random().unwrap();
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
    let src = sluice::default_model::ensure_random().unwrap();
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

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

/// A copy of fixture `base` (config.json + model.safetensors) with `edit` applied to its config.
fn config_variant(tag: &str, base: &str, edit: impl Fn(&mut serde_json::Value)) -> PathBuf {
    let d = tmpdir(&format!("cfg-{tag}"));
    let src = fixture(base);
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(src.join("model.safetensors"), d.join("model.safetensors")).unwrap();
    d
}

fn logits_args(m: &Path) -> Vec<String> {
    [
        "logits",
        m.to_str().unwrap(),
        "--tokens",
        "1,2",
        "--out",
        "/dev/null",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn fails_with(m: &Path, needle: &str) {
    let a = logits_args(m);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    assert_clean_failure(&a, needle);
}

#[test]
fn unknown_hf_architecture() {
    let d = config_variant("arch", "qwen3_moe", |c| {
        c["architectures"] = serde_json::json!(["FrobnicatorForCausalLM"]);
    });
    fails_with(&d, "unknown architecture \"FrobnicatorForCausalLM\"");
}

/// Config features sluice does not implement fail by name, never run silently.
#[test]
fn unimplemented_config_features_are_refused() {
    let d = config_variant("rope", "qwen3_moe", |c| {
        c["rope_parameters"]["rope_type"] = "dynamic".into();
        c["rope_parameters"]["factor"] = 2.0.into();
    });
    fails_with(&d, "rope_type \"dynamic\"");
    let d = config_variant("clip", "qwen3_moe", |c| c["clip_qkv"] = 8.0.into());
    fails_with(&d, "clip_qkv");
    let d = config_variant("act", "mixtral", |c| c["hidden_act"] = "gelu".into());
    fails_with(&d, "hidden_act \"gelu\"");
    let d = config_variant("bias", "olmoe", |c| c["attention_bias"] = true.into());
    fails_with(&d, "attention_bias");
    let d = config_variant("swa", "mixtral", |c| c["sliding_window"] = 0.into());
    fails_with(&d, "sliding_window 0");
    let d = config_variant("sparse", "qwen3_moe", |c| {
        c["decoder_sparse_step"] = 2.into()
    });
    fails_with(&d, "decoder_sparse_step");
}

/// config.json dimensions that disagree with the safetensors file.
#[test]
fn safetensors_shape_mismatch() {
    let d = config_variant("stshape", "qwen3_moe", |c| {
        c["moe_intermediate_size"] = 48.into()
    });
    fails_with(&d, "shape mismatch");
    let d = config_variant("stvocab", "mixtral", |c| c["vocab_size"] = 400.into());
    fails_with(&d, "shape mismatch");
}

#[test]
fn gguf_features_not_implemented_are_refused() {
    let p = tmpdir("clamp").join("m.gguf");
    rewrite_with(
        &p,
        |_, v| Some(v.clone()),
        |_| true,
        &[("qwen3moe.attention.clamp_kqv", MetaValue::F32(8.0))],
    );
    fails_with(&p, "qwen3moe.attention.clamp_kqv");
    let p = tmpdir("ropetype").join("m.gguf");
    rewrite_with(
        &p,
        |_, v| Some(v.clone()),
        |_| true,
        &[(
            "qwen3moe.rope.scaling.type",
            MetaValue::String("longrope".into()),
        )],
    );
    fails_with(&p, "qwen3moe.rope.scaling.type");
    let p = tmpdir("swapat").join("m.gguf");
    rewrite_with(
        &p,
        |_, v| Some(v.clone()),
        |_| true,
        &[(
            "qwen3moe.attention.sliding_window_pattern",
            MetaValue::U32(4),
        )],
    );
    fails_with(&p, "sliding_window_pattern");
}

/// `-c` beyond the model's context length (512 in the fixture) runs with a one-line warning, as
/// in llama.cpp; `-c 0` is refused.
#[test]
fn context_beyond_the_model_warns() {
    let m = fixture("qwen3_moe");
    let m = m.to_str().unwrap();
    let (code, err) = sluice(&["run", m, "-c", "1000", "-n", "1", "-p", "hi"]);
    assert_eq!(code, 0, "stderr: {err}");
    let warn: Vec<&str> = err.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warn.len(), 1, "stderr: {err}");
    assert!(
        warn[0].contains("context 1000 is more than") && warn[0].contains("512"),
        "{err}"
    );
    assert_clean_failure(&["run", m, "-c", "0", "-n", "1"], "-c 0");
}

/// `--route-trace` needs the streamed expert cache: with resident experts `run` refuses it
/// (after its `[plan]` lines, which say why experts are resident) rather than writing nothing.
#[test]
fn route_trace_with_resident_experts_is_refused() {
    let m = fixture("qwen3_moe");
    let trace = std::env::temp_dir().join("sluice-never-written.trace");
    let (code, err) = sluice(&[
        "run",
        m.to_str().unwrap(),
        "-n",
        "1",
        "-p",
        "hi",
        "--experts",
        "resident",
        "--route-trace",
        trace.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let last = err.trim_end().lines().last().unwrap_or("");
    assert!(
        last.contains("--route-trace") && last.contains("add --experts stream"),
        "{err}"
    );
    assert!(!trace.exists());
}

/// The 2026 families sluice does not run yet are refused by name (what is missing), not as an
/// unknown architecture; gpt-oss's safetensors experts (MXFP4 blocks) likewise.
#[test]
fn next_families_refused_by_name() {
    let d = tmpdir("qwen3next");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/models/gpt_oss/model.safetensors"),
        d.join("model.safetensors"),
    )
    .unwrap();
    std::fs::write(
        d.join("config.json"),
        r#"{"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "hidden_size": 64}"#,
    )
    .unwrap();
    let args = [
        "logits",
        d.to_str().unwrap(),
        "--tokens",
        "1,2",
        "--out",
        "/dev/null",
    ];
    assert_clean_failure(
        &args,
        "Qwen3.5-MoE (the multimodal checkpoint) is not supported yet",
    );
    assert_clean_failure(&args, "only the text model");
    // Qwen3-Next runs; a config feature it does not implement is refused by name.
    let q = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen3_next");
    std::fs::copy(q.join("model.safetensors"), d.join("model.safetensors")).unwrap();
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(q.join("config.json")).unwrap()).unwrap();
    c["use_sliding_window"] = serde_json::json!(true);
    std::fs::write(d.join("config.json"), c.to_string()).unwrap();
    assert_clean_failure(&args, "use_sliding_window is not supported for qwen3next");
    let g = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/gpt_oss");
    assert_clean_failure(
        &[
            "logits",
            g.to_str().unwrap(),
            "--tokens",
            "1,2",
            "--out",
            "/dev/null",
        ],
        "gpt-oss experts from safetensors",
    );
}
