//! Qwen3-MoE (GGUF `qwen3moe`, HF `Qwen3MoeForCausalLM`): GQA attention with a per-head
//! RMSNorm on q and k, half-split RoPE, softmax top-k routing (renormalised when
//! `norm_topk_prob`), SwiGLU experts, no shared expert. Qwen3 technical report:
//! <https://arxiv.org/abs/2505.09388>.

use super::config::{Family, ModelConfig, QkNorm, RopeLayout};
use super::family::{self, BiasRule, FamilySpec, HfKeys};
use super::names::{Role, HF_MLP_MOE};
use super::ModelError;
use serde_json::Value;

/// HF names of the MoE block, in preference order.
pub const HF_MOE: &[(Role, &str)] = HF_MLP_MOE;

pub static SPEC: FamilySpec = FamilySpec {
    family: Family::Qwen3Moe,
    name: "qwen3moe",
    gguf_archs: &["qwen3moe"],
    hf_archs: &["Qwen3MoeForCausalLM", "qwen3_moe"],
    hf_moe: HF_MOE,
    gguf_rope_layout: RopeLayout::HalfSplit,
    sigmoid_router: false,
    gguf_norm_topk: true,
    hf_norm_topk: None,
    hf_expert_ffn_key: "moe_intermediate_size",
    hf_default_rope_theta: 10000.0,
    hf_attention_bias: BiasRule::Refused,
    clip_qkv: false,
    gguf_yarn_cancelled: false,
    hf_qk_norm: |_| QkNorm::PerHead,
    hf_sliding_window,
    gguf_window_pattern: false,
    hf_experts_refused: None,
    gpu_validated: true,
    gguf_hparams: family::no_gguf_hparams,
    hf_hparams,
};

/// transformers 5.17: the window masks every layer when `use_sliding_window` is true (the
/// config then defaults it to 4096); `max_window_layers` does not narrow it.
fn hf_sliding_window(k: &HfKeys<'_>) -> Result<Option<usize>, ModelError> {
    if k.flag("use_sliding_window") {
        Ok(Some(k.window("sliding_window")?.unwrap_or(4096)))
    } else {
        Ok(None)
    }
}

/// Dense layers (`decoder_sparse_step` != 1 or `mlp_only_layers`) are refused.
fn hf_hparams(k: &HfKeys<'_>, _: &mut ModelConfig) -> Result<(), ModelError> {
    let step = k.opt_u("decoder_sparse_step").unwrap_or(1);
    let dense_layers = k
        .cfg
        .get("mlp_only_layers")
        .and_then(Value::as_array)
        .map(|a| a.len())
        .unwrap_or(0);
    if step != 1 || dense_layers != 0 {
        return Err(ModelError::Config("config.json: Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported".into()));
    }
    Ok(())
}
