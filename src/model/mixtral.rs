//! Mixtral (GGUF `llama` with `llama.expert_count` > 0, HF `MixtralForCausalLM`): Llama
//! attention without q/k norm, top-2 of 8 experts with softmax over the chosen logits.
//! llama.cpp's converter permutes q/k rows for its interleaved RoPE, so GGUF files use the
//! interleaved layout and HF files the half-split one. Paper: <https://arxiv.org/abs/2401.04088>.

use super::names::{Role, HF_MLP_MOE};

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
