//! Mixtral (GGUF `llama` with `llama.expert_count` > 0, HF `MixtralForCausalLM`): Llama
//! attention without q/k norm, top-2 of 8 experts with softmax over the chosen logits.
//! llama.cpp's converter permutes q/k rows for its interleaved RoPE, so GGUF files use the
//! interleaved layout and HF files the half-split one. Paper: <https://arxiv.org/abs/2401.04088>.

use super::config::{Family, RopeLayout};
use super::family::{self, BiasRule, FamilySpec, HfKeys};
use super::names::{Role, HF_MLP_MOE};
use super::ModelError;

/// Mixtral's own names (`block_sparse_moe`, w1 = gate, w3 = up, w2 = down) first, then the
/// `mlp` names transformers 5 may write.
pub const HF_MOE: &[(Role, &str)] = &[
    (
        Role::Router,
        "model.layers.{l}.block_sparse_moe.gate.weight",
    ),
    (
        Role::ExpGate,
        "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
    ),
    (
        Role::ExpUp,
        "model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight",
    ),
    (
        Role::ExpDown,
        "model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight",
    ),
    HF_MLP_MOE[0],
    HF_MLP_MOE[1],
    HF_MLP_MOE[2],
    HF_MLP_MOE[3],
    HF_MLP_MOE[4],
    HF_MLP_MOE[5],
];

pub static SPEC: FamilySpec = FamilySpec {
    family: Family::Mixtral,
    name: "mixtral",
    gguf_archs: &["llama"],
    hf_archs: &["MixtralForCausalLM", "mixtral"],
    hf_moe: HF_MOE,
    gguf_rope_layout: RopeLayout::Interleaved,
    sigmoid_router: false,
    gguf_norm_topk: true,
    // Softmax over the chosen logits = renormalised top-k, whatever the config says.
    hf_norm_topk: Some(true),
    hf_expert_ffn_key: "intermediate_size",
    // transformers' `default_theta` for Mixtral.
    hf_default_rope_theta: 1e6,
    hf_attention_bias: BiasRule::Ignored,
    clip_qkv: false,
    gguf_yarn_cancelled: false,
    hf_qk_norm: family::no_qk_norm,
    hf_sliding_window,
    gguf_window_pattern: false,
    hf_experts_refused: None,
    gpu_validated: true,
    gguf_hparams: family::no_gguf_hparams,
    hf_hparams: family::no_hf_hparams,
};

/// transformers 5.17 masks every layer with `sliding_window` when it is set.
fn hf_sliding_window(k: &HfKeys<'_>) -> Result<Option<usize>, ModelError> {
    k.window("sliding_window")
}
