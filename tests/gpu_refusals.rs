//! What the CUDA backend cannot run is refused in one place (`EngineOptions::check`, from the
//! one list `gpu::refusal`) before any weight is bound or any device is opened: `--gpu on` on
//! such a model exits 1 with one line naming the flag and the missing feature, in every build
//! (with or without the `cuda` feature, with or without a GPU), so this runs everywhere.

use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

/// `sluice logits MODEL --tokens 1,2 --out F --gpu on EXTRA..`: exit code and stderr.
fn logits_gpu_on(model: &Path, extra: &[&str]) -> (Option<i32>, String, PathBuf) {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "gpu-refusal-{}.npy",
        model.file_name().unwrap().to_string_lossy()
    ));
    let _ = std::fs::remove_file(&out);
    let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "logits",
            model.to_str().unwrap(),
            "--tokens",
            "1,2",
            "--gpu",
            "on",
        ])
        .arg("--out")
        .arg(&out)
        .args(extra)
        .output()
        .unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        out,
    )
}

/// DeepSeek-V4 runs on the device (gpu/v4.rs): `--gpu on` is not refused for it (without a GPU
/// it fails for that reason instead). No fixture family is refused any more; the hybrid shapes
/// past the kernels are refused by name (gpu/mod.rs's unit test).
#[test]
fn deepseek_v4_is_not_refused_for_the_gpu() {
    let (_, err, _) = logits_gpu_on(&fixture("deepseek_v4"), &[]);
    assert!(
        !err.contains("has not been validated"),
        "deepseek_v4: {err}"
    );
}

/// The device runs DSA's lightning indexer (gpu/ops.rs): DeepSeek-V3.2 and GLM-5 are not
/// refused past index_topk (4 in these fixtures; without a GPU it fails for that reason).
#[test]
fn dsa_past_index_topk_is_not_refused_for_the_gpu() {
    for name in ["deepseek_v32_sparse", "glm_moe_dsa"] {
        let (_, err, _) = logits_gpu_on(&fixture(name), &["-c", "64"]);
        for n in ["index_topk", "indexer", "has not been validated"] {
            assert!(!err.contains(n), "{name}: {err}");
        }
    }
}

/// Sliding windows, clip_qkv and gpt-oss run on the device (gpu/ops.rs): `--gpu on` is not
/// refused for them (without a GPU it fails for that reason instead).
#[test]
fn sliding_window_clip_qkv_and_gptoss_are_not_refused_for_the_gpu() {
    for name in ["mixtral_swa", "qwen3_moe_swa", "olmoe_clip"] {
        let (_, err, _) = logits_gpu_on(&fixture(name), &[]);
        for n in ["sliding-window", "clip_qkv", "has not been validated"] {
            assert!(!err.contains(n), "{name}: {err}");
        }
    }
}

/// Qwen3-Next and Qwen3.5-MoE's hybrid layers run on the device (gpu/hybrid.rs): `--gpu on` is
/// not refused for them (without a GPU it fails for that reason instead).
#[test]
fn hybrid_families_are_not_refused_for_the_gpu() {
    for name in ["qwen3_next", "qwen3_5_moe"] {
        let (_, err, _) = logits_gpu_on(&fixture(name), &[]);
        for n in ["has not been validated", "Qwen3-Next", "hybrid"] {
            assert!(!err.contains(n), "{name}: {err}");
        }
    }
}
