//! `sluice inspect` numbers against the ones scripts/make_format_fixtures.py computed from the
//! reference readers' tensor tables (GGUFReader for GGUF, the safetensors package for HF).

mod format_util;

use std::process::Command;

use format_util::*;
use serde_json::Value;
use sluice::format::ModelFiles;
use sluice::inspect::{summarize, ModelSummary};

fn check(rel: &str, s: &ModelSummary) {
    let all = expected();
    let e = &all["inspect"][rel];
    assert!(e.is_object(), "no expectations for {rel}");
    assert_eq!(
        s.architecture.as_deref(),
        e["architecture"].as_str(),
        "{rel}: architecture"
    );
    assert_eq!(s.layers, e["layers"].as_u64(), "{rel}: layers");
    assert_eq!(s.moe_layers, as_u64(&e["moe_layers"]), "{rel}: moe layers");
    assert_eq!(
        s.experts_per_layer,
        e["experts_per_layer"].as_u64(),
        "{rel}: experts"
    );
    assert_eq!(
        s.experts_used_per_token,
        e["experts_used_per_token"].as_u64(),
        "{rel}: used"
    );
    assert_eq!(
        s.shared_experts,
        as_u64(&e["shared_experts"]),
        "{rel}: shared"
    );
    assert_eq!(s.tensors as u64, as_u64(&e["tensors"]), "{rel}: tensors");
    let qt = e["quant_types"].as_object().unwrap();
    assert_eq!(s.quant_types.len(), qt.len(), "{rel}: quant types");
    for q in &s.quant_types {
        let want = &qt[&q.dtype];
        assert_eq!(
            q.tensors as u64,
            as_u64(&want["tensors"]),
            "{rel}: {} count",
            q.dtype
        );
        assert_eq!(q.bytes, as_u64(&want["bytes"]), "{rel}: {} bytes", q.dtype);
    }
    assert!(s.quant_types.windows(2).all(|w| w[0].bytes >= w[1].bytes));
    // The per-type split adds up to the reference's resident and routed totals.
    for q in &s.quant_types {
        assert_eq!(
            q.resident_bytes + q.routed_bytes,
            q.bytes,
            "{rel}: {}",
            q.dtype
        );
    }
    let routed: u64 = s.quant_types.iter().map(|q| q.routed_bytes).sum();
    assert_eq!(
        routed,
        as_u64(&e["routed_expert_bytes"]),
        "{rel}: routed by type"
    );
    assert_eq!(
        s.resident_bytes,
        as_u64(&e["resident_bytes"]),
        "{rel}: resident"
    );
    assert_eq!(
        s.routed_expert_bytes,
        as_u64(&e["routed_expert_bytes"]),
        "{rel}: routed"
    );
    assert_eq!(s.resident_bytes + s.routed_expert_bytes, s.total_bytes);
    assert_eq!(
        s.one_expert_bytes_per_layer,
        as_u64(&e["one_expert_bytes_per_layer"]),
        "{rel}: one expert"
    );
    assert_eq!(
        s.routed_bytes_per_token,
        as_u64(&e["routed_bytes_per_token"]),
        "{rel}: per token"
    );
}

const MODELS: [&str; 3] = [
    "tiny-moe.gguf",
    "format/hf-deepseek",
    "format/hf-fused/model.safetensors",
];

#[test]
fn summaries_match_reference() {
    for rel in MODELS {
        let m = ModelFiles::open(&fixture(rel)).unwrap();
        check(rel, &summarize(&m));
    }
}

fn sluice(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .output()
        .expect("run sluice");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

#[test]
fn cli_json_matches_library() {
    for rel in MODELS {
        let p = fixture(rel);
        let (code, out, err) = sluice(&["inspect", p.to_str().unwrap(), "--json"]);
        assert_eq!(code, 0, "{rel}: {err}");
        let v: Value = serde_json::from_str(&out).unwrap();
        let lib = serde_json::to_value(summarize(&ModelFiles::open(&p).unwrap())).unwrap();
        assert_eq!(v, lib, "{rel}");
    }
}

#[test]
fn cli_text_names_the_essentials() {
    let p = fixture("tiny-moe.gguf");
    let (code, out, err) = sluice(&["inspect", p.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(err.is_empty(), "{err}");
    for needle in [
        "qwen3moe",
        "8 per layer, 2 used per token, 0 shared",
        "Q4_K",
        "Q6_K",
        "Q8_0",
        "(71680 bytes)",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
}

#[test]
fn cli_tensor_list_and_check() {
    let p = fixture("format/hf-deepseek");
    let (code, out, err) = sluice(&[
        "inspect",
        p.to_str().unwrap(),
        "--json",
        "--tensors",
        "--check",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["checked"], true);
    let list = v["tensor_list"].as_array().unwrap();
    assert_eq!(list.len(), 115);
    let all = expected();
    let first = &all["safetensors"]["format/hf-deepseek"]["tensors"][0];
    assert_eq!(list[0]["name"], first["name"]);
    assert_eq!(list[0]["offset"], first["offset"]);
}

fn model_dir(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

fn config(name: &str) -> Value {
    let text = std::fs::read_to_string(model_dir(name).join("config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// KV-cache bytes per token against config.json's own fields: MLA (DeepSeek-V3) caches the
/// compressed latent and the rope key per layer, (kv_lora_rank + qk_rope_head_dim) f32s, not
/// the full per-head K/V; GQA (GLM-4.5) keys and values of every kv head. The MTP layer adds
/// one more layer's worth, only to a state made for `--mtp`; and the state's allocation is
/// ctx x that figure (what `-c` and the planner use).
#[test]
fn kv_bytes_per_token_from_config_fields() {
    let u = |c: &Value, k: &str| c[k].as_u64().unwrap();
    let ds = config("deepseek_v3");
    let ds_layer = (u(&ds, "kv_lora_rank") + u(&ds, "qk_rope_head_dim")) * 4;
    let ds_full_kv = u(&ds, "num_attention_heads")
        * (u(&ds, "qk_nope_head_dim") + u(&ds, "qk_rope_head_dim") + u(&ds, "v_head_dim"))
        * 4;
    assert!(ds_layer < ds_full_kv);
    let glm = config("glm4_moe");
    let glm_layer = 2 * u(&glm, "num_key_value_heads") * u(&glm, "head_dim") * 4;
    for (name, file, c, per_layer) in [
        ("deepseek_v3", None, &ds, ds_layer),
        ("deepseek_v3", Some("model-f32.gguf"), &ds, ds_layer),
        ("glm4_moe", None, &glm, glm_layer),
        ("glm4_moe", Some("model-f32.gguf"), &glm, glm_layer),
    ] {
        let path = match file {
            Some(f) => model_dir(name).join(f),
            None => model_dir(name),
        };
        let files = ModelFiles::open(&path).unwrap();
        let s = summarize(&files);
        let layers = u(c, "num_hidden_layers");
        assert_eq!(s.layers, Some(layers), "{name} {file:?}: main layers");
        // `inspect` counts the default cache types (f16: half the f32 bytes; MLA's latent
        // follows -ctk too) and says so.
        assert_eq!(
            s.kv_bytes_per_token,
            Some(layers * per_layer / 2),
            "{name} {file:?}"
        );
        assert_eq!(
            s.kv_cache_types.as_deref(),
            Some(if name == "glm4_moe" {
                "keys f16, values f16"
            } else {
                "keys f16, values none"
            }),
            "{name} {file:?}"
        );
        // llama.cpp's converter drops DeepSeek's MTP layer, keeps GLM's.
        let mtp = if file.is_some() && name == "deepseek_v3" {
            0
        } else {
            u(c, "num_nextn_predict_layers")
        };
        assert_eq!(s.mtp_layers, mtp, "{name} {file:?}: MTP layers");
        assert_eq!(
            s.mtp_kv_bytes_per_token,
            (mtp > 0).then_some(per_layer / 2),
            "{name} {file:?}"
        );

        let model = sluice::model::Model::load(
            &files,
            &sluice::model::LoadOptions {
                kv: sluice::model::KvTypes::F32,
                threads: 1,
                ctx: 64,
            },
        )
        .unwrap();
        let st = model.new_state(64, 4, 1).unwrap();
        assert_eq!(st.kv_bytes() as u64, 64 * layers * per_layer, "{name}");
        assert!(!st.has_mtp());
        if mtp > 0 {
            let st = model.new_state_mtp(64, 4, 2).unwrap();
            assert_eq!(
                st.kv_bytes() as u64,
                64 * (layers + 1) * per_layer,
                "{name}: with --mtp"
            );
        } else {
            assert!(model.new_state_mtp(64, 4, 2).is_err());
        }
    }

    // The CLI prints both, in text and JSON.
    let p = model_dir("glm4_moe").join("model-f32.gguf");
    let (code, out, err) = sluice(&["inspect", p.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let layers = u(&glm, "num_hidden_layers");
    assert_eq!(v["kv_bytes_per_token"], layers * glm_layer / 2);
    assert_eq!(v["kv_cache_types"], "keys f16, values f16");
    assert_eq!(v["mtp_layers"], 1);
    assert_eq!(v["mtp_kv_bytes_per_token"], glm_layer / 2);
    let (code, out, err) = sluice(&["inspect", p.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!(
            "kv cache      {} B per token of context (keys f16, values f16, the default -ctk/-ctv",
            layers * glm_layer / 2
        )),
        "{out}"
    );
    assert!(out.contains("mtp           1 layer(s)"), "{out}");
}
