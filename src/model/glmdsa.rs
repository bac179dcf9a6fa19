//! GLM-5 (GGUF `glm-dsa`, HF `GlmMoeDsaForCausalLM` / `glm_moe_dsa`): DeepSeek-V3.2's graph —
//! MLA, DSA's lightning indexer, sigmoid routing with a selection bias, a shared expert, dense
//! first layers, an MTP (NextN) layer — with two differences, as transformers'
//! `modeling_glm_moe_dsa.py` computes them:
//! - the indexer rotates its q and k **interleaved** (V3.2: half-split);
//! - **shared indexer layers**: `indexer_types[l]` is "full" (the layer runs its indexer) or
//!   "shared" (it has no indexer weights and each query attends to the positions the previous
//!   full layer chose for it). HF derives the list from `indexer_types`, else
//!   `index_topk_pattern` ("F"/"S" letters), else `index_topk_freq` / `index_skip_topk_offset`;
//!   llama.cpp writes `glm-dsa.attention.indexer.types` (bools, true = full) and files without
//!   the key tell by their tensors (a shared layer has no `blk.N.indexer.*`).
//!
//! Everything else is `deepseek2.rs` (its hyperparameter readers run first); the graph's only
//! GLM-5 branch is `Mla::shares_indexer`, which the CPU backend's `attend_mla` honours.

use super::config::{Family, ModelConfig, RopeLayout};
use super::deepseek2;
use super::family::{self, BiasRule, FamilySpec, GgufKeys, HfKeys};
use super::ModelError;
use serde_json::Value;

pub static SPEC: FamilySpec = FamilySpec {
    family: Family::GlmDsa,
    name: "glm-dsa",
    gguf_archs: &["glm-dsa"],
    hf_archs: &["GlmMoeDsaForCausalLM", "glm_moe_dsa"],
    hf_moe: deepseek2::HF_MOE,
    gguf_rope_layout: RopeLayout::Interleaved,
    sigmoid_router: true,
    // llama.cpp reads a missing expert_weights_norm as false (its deepseek2 loader, reused).
    gguf_norm_topk: false,
    hf_norm_topk: None,
    hf_expert_ffn_key: "moe_intermediate_size",
    hf_default_rope_theta: 10000.0,
    hf_attention_bias: BiasRule::Ignored,
    clip_qkv: false,
    gguf_yarn_cancelled: true,
    hf_qk_norm: family::no_qk_norm,
    hf_sliding_window: family::no_sliding_window,
    gguf_window_pattern: false,
    hf_experts_refused: None,
    gpu_validated: true,
    gguf_hparams,
    hf_hparams,
};

fn gguf_hparams(k: &GgufKeys<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    deepseek2::gguf_hparams(k, c)?;
    let Some(ix) = &mut c.indexer else {
        return Ok(());
    };
    ix.rope = RopeLayout::Interleaved;
    let key = k.key("attention.indexer.types");
    c.indexer_full = match k.get("attention.indexer.types") {
        Some(v) => {
            let types = v
                .as_array()
                .ok_or_else(|| ModelError::Config(format!("{key} is not an array")))?;
            types
                .iter()
                .map(|t| {
                    t.as_bool()
                        .or_else(|| t.as_u64().map(|u| u != 0))
                        .ok_or_else(|| {
                            ModelError::Config(format!("{key}: {t:?} is not a bool (true = full)"))
                        })
                })
                .collect::<Result<_, _>>()?
        }
        // Without the key, a layer's own indexer tensors say it is full.
        None => (0..c.n_layers)
            .map(|l| {
                k.files
                    .tensor(&format!("blk.{l}.indexer.attn_k.weight"))
                    .is_some()
            })
            .collect(),
    };
    check_types(&c.indexer_full, c.n_layers, &key)
}

fn hf_hparams(k: &HfKeys<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    deepseek2::hf_hparams(k, c)?;
    let Some(ix) = &mut c.indexer else {
        return Ok(());
    };
    ix.rope = RopeLayout::Interleaved;
    c.indexer_full = hf_indexer_types(k.cfg, c.n_layers)?;
    check_types(&c.indexer_full, c.n_layers, "config.json: indexer_types")
}

/// `GlmMoeDsaConfig.__post_init__`'s list, as full (true) / shared (false) per layer.
fn hf_indexer_types(cfg: &Value, n_layers: usize) -> Result<Vec<bool>, ModelError> {
    let bad = |what: &str| ModelError::Config(format!("config.json: {what}"));
    if let Some(v) = cfg.get("indexer_types").filter(|v| !v.is_null()) {
        let list = v
            .as_array()
            .ok_or_else(|| bad("indexer_types is not a list"))?;
        return list
            .iter()
            .map(|t| match t.as_str() {
                Some("full") => Ok(true),
                Some("shared") => Ok(false),
                _ => Err(bad(&format!(
                    "indexer_types entry {t} is not \"full\" or \"shared\""
                ))),
            })
            .collect();
    }
    if let Some(p) = cfg.get("index_topk_pattern").filter(|v| !v.is_null()) {
        let letters: Vec<String> = match p {
            Value::String(s) => s.chars().map(String::from).collect(),
            Value::Array(a) => a
                .iter()
                .map(|x| x.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| bad("index_topk_pattern entries are not strings"))?,
            _ => return Err(bad("index_topk_pattern is not a string or a list")),
        };
        return letters
            .iter()
            .map(|t| match t.as_str() {
                "F" | "full" => Ok(true),
                "S" | "shared" => Ok(false),
                other => Err(bad(&format!(
                    "index_topk_pattern entry {other:?} is not F or S"
                ))),
            })
            .collect();
    }
    let int = |key: &str, default: i64| cfg.get(key).and_then(Value::as_i64).unwrap_or(default);
    let freq = int("index_topk_freq", 1).max(1);
    let offset = int("index_skip_topk_offset", 2);
    Ok((0..n_layers as i64)
        .map(|i| (i - offset + 1).max(0) % freq == 0)
        .collect())
}

/// One entry per main layer, and the first layer full (a shared layer needs one before it).
fn check_types(types: &[bool], n_layers: usize, what: &str) -> Result<(), ModelError> {
    if types.len() != n_layers {
        return Err(ModelError::Config(format!(
            "{what}: {} entries for {n_layers} layers",
            types.len()
        )));
    }
    if types.first() == Some(&false) {
        return Err(ModelError::Config(format!(
            "{what}: layer 0 is \"shared\", but a shared layer reuses an earlier full layer's choice"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn hf_indexer_types_follow_the_config_rules() {
        let t = |v: Value, n| hf_indexer_types(&v, n).unwrap();
        assert_eq!(
            t(json!({"indexer_types": ["full", "shared", "full"]}), 3),
            [true, false, true]
        );
        assert_eq!(
            t(json!({"index_topk_pattern": "FFS"}), 3),
            [true, true, false]
        );
        // Defaults (freq 1): every layer full.
        assert_eq!(t(json!({}), 3), [true, true, true]);
        // freq 4, offset 2: full at 0, 1, then every 4th from 5 (as transformers computes it).
        let got = t(json!({"index_topk_freq": 4}), 10);
        let want: Vec<bool> = (0..10i64).map(|i| (i - 1).max(0) % 4 == 0).collect();
        assert_eq!(got, want);
        assert!(hf_indexer_types(&json!({"indexer_types": ["dense"]}), 1).is_err());
        assert!(check_types(&[false, true], 2, "x").is_err());
        assert!(check_types(&[true], 2, "x").is_err());
    }
}
