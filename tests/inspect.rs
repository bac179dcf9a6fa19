//! `sluice inspect` numbers against the ones scripts/make_format_fixtures.py computed from the
//! reference readers' tensor tables (GGUFReader for GGUF, the safetensors package for HF).
//! KV bytes per token against config fields (DeepSeek-V3, GLM-4.5) and, on small synth files of
//! the DeepSeek-V4, gpt-oss, Qwen3-Next and Qwen3.5 presets, KV and recurrent-state bytes
//! against each architecture's cache written out in the test, with the presets' expert counts.

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

/// A synth preset of the 2026 families, kept to `layers` layers and shrunk where the figures
/// below do not look (hidden 32, routed experts of width 32, the byte-level vocabulary, fewer
/// query heads and smaller low ranks for DeepSeek-V4) so the file is a few MB; every width a
/// KV cache or recurrent state is made of, and the expert counts, stay the preset's own.
fn family_preset(preset: &str, layers: usize) -> sluice::synth::MoeSpec {
    use sluice::synth::{MoeSpec, SynthArch};
    let mut s = MoeSpec::preset(preset).unwrap();
    (s.hidden, s.expert_ffn, s.vocab) = (32, 32, 0);
    match &mut s.arch {
        SynthArch::DeepseekV4(v) => {
            // One KV head of head_dim; the query heads and the low ranks only size weights.
            (s.heads, v.q_lora, v.o_lora) = (8, 64, 64);
        }
        SynthArch::Qwen3Next { shared_ffn, .. } => *shared_ffn = 32,
        _ => {}
    }
    s.cut_layers(layers).unwrap();
    s
}

/// `sluice inspect --json` on small synth files of the DeepSeek-V4-Flash, gpt-oss-20b,
/// Qwen3-Next-80B-A3B and Qwen3.5-397B-A17B presets: the KV bytes per token of context and the
/// hybrids' recurrent + conv state bytes against the formulas written out here from each
/// architecture's cache, with the preset's widths; the expert counts as the presets say; and
/// a state made for the file holds ctx x those KV bytes.
#[test]
fn new_family_presets_kv_state_and_experts() {
    use sluice::synth::SynthArch;
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("inspect-families");
    std::fs::create_dir_all(&dir).unwrap();
    // (preset, layers kept, shared experts in the preset's config)
    for (preset, layers, shared) in [
        // 2 sliding layers, then CSA, HCA: every layer kind.
        ("deepseek-v4-flash", 4, 1),
        // A sliding-window layer and a full one.
        ("gpt-oss-20b", 2, 0),
        // Three Gated DeltaNet layers, then gated full attention; twice.
        ("qwen3-next-80b-a3b", 8, 1),
        ("qwen3.5-397b-a17b", 4, 1),
    ] {
        let spec = family_preset(preset, layers);
        let path = dir.join(format!("{preset}.gguf"));
        sluice::synth::write_random(&path, &spec, &mut |_, _| {}).unwrap();
        let (code, out, err) = sluice(&["inspect", path.to_str().unwrap(), "--json"]);
        assert_eq!(code, 0, "{preset}: {err}");
        let v: Value = serde_json::from_str(&out).unwrap();
        let l = layers as u64;
        let (f16, f32) = (2u64, 4u64);
        // Bytes per token of context, and of one sequence's recurrent state.
        let (kv, types, state) = match &spec.arch {
            SynthArch::DeepseekV4(x) => {
                // DeepSeek-V4 caches per position and layer, in f32 (deepseek_v4.rs's module
                // doc): the K row holds the rotated shared KV (one head of head_dim), the
                // compressed entry pooled at a closed window's last position (head_dim) and the
                // indexer's pooled key (index_head_dim); the V row the raw projections the next
                // windows pool: the compressor's kv and gate, 2 head_dim each (the CSA windows
                // overlap, so each projection is two heads wide), and the indexer's kv and gate,
                // 2 index_head_dim each. Every layer keeps both rows, whatever its kind.
                let (hd, idx) = (spec.head_dim as u64, x.idx_dim as u64);
                assert_eq!((hd, idx), (512, 128), "{preset}");
                let k_row = hd + hd + idx;
                let v_row = 2 * (2 * hd) + 2 * (2 * idx);
                (l * (k_row + v_row) * f32, "keys f32, values f32", None)
            }
            SynthArch::GptOss { .. } => {
                // GQA: keys and values of every KV head in every layer, f16 by default (the
                // sliding-window layers are sized for the whole context too).
                let per_layer = 2 * (spec.kv_heads * spec.head_dim) as u64 * f16;
                assert_eq!((spec.kv_heads, spec.head_dim), (8, 64), "{preset}");
                (l * per_layer, "keys f16, values f16", None)
            }
            SynthArch::Qwen3Next {
                linear, interval, ..
            } => {
                // Layer i is gated full attention when (i + 1) % interval == 0 (GQA keys and
                // values, f16), else a Gated DeltaNet with no KV cache and a fixed state: the
                // causal conv1d over [q; k; v] (2 k_heads k_dim + v_heads v_dim channels) keeps
                // its last conv - 1 inputs, and the delta rule one k_dim x v_dim matrix per value
                // head, all f32.
                let full = (0..layers).filter(|i| (i + 1) % interval == 0).count() as u64;
                let linear_layers = l - full;
                assert!(full > 0 && linear_layers > 0, "{preset}");
                let kv_layer = 2 * (spec.kv_heads * spec.head_dim) as u64 * f16;
                let channels =
                    (2 * linear.k_heads * linear.k_dim + linear.v_heads * linear.v_dim) as u64;
                let conv = (linear.conv as u64 - 1) * channels;
                let delta = (linear.v_heads * linear.k_dim * linear.v_dim) as u64;
                (
                    full * kv_layer,
                    "keys f16, values f16",
                    Some(linear_layers * (conv + delta) * f32),
                )
            }
            other => panic!("{preset}: not a new family: {other:?}"),
        };
        eprintln!(
            "{preset} ({layers} layers, {} MB): KV {kv} B/token, state {state:?} B",
            std::fs::metadata(&path).unwrap().len() >> 20
        );
        assert_eq!(v["kv_bytes_per_token"], kv, "{preset}: KV bytes per token");
        assert_eq!(v["kv_cache_types"], types, "{preset}: KV cache types");
        assert_eq!(
            v["recurrent_state_bytes"],
            state.map_or(Value::Null, Value::from),
            "{preset}: recurrent + conv state bytes"
        );
        assert_eq!(v["layers"], l, "{preset}: layers");
        assert_eq!(v["moe_layers"], l, "{preset}: every layer is MoE");
        assert_eq!(v["experts_per_layer"], spec.experts, "{preset}: experts");
        assert_eq!(v["experts_used_per_token"], spec.experts_used, "{preset}");
        assert_eq!(v["shared_experts"], shared, "{preset}: shared experts");
        assert_eq!(v["mtp_layers"], 0, "{preset}: no MTP layer written");
        assert_eq!(
            v["resident_bytes"].as_u64().unwrap() + v["routed_expert_bytes"].as_u64().unwrap(),
            v["total_bytes"].as_u64().unwrap(),
            "{preset}"
        );

        // What sluice allocates: ctx x the figure, at the default cache types.
        let files = ModelFiles::open(&path).unwrap();
        let model = sluice::model::Model::load(
            &files,
            &sluice::model::LoadOptions {
                kv: sluice::model::KvTypes::default(),
                threads: 1,
                ctx: 64,
            },
        )
        .unwrap();
        let st = model.new_state(64, 1, 1).unwrap();
        assert_eq!(st.kv_bytes() as u64, 64 * kv, "{preset}: allocated KV");
    }
}
