//! Qwen3-MoE (GGUF `qwen3moe`, HF `Qwen3MoeForCausalLM`): GQA attention with a per-head
//! RMSNorm on q and k, half-split RoPE, softmax top-k routing (renormalised when
//! `norm_topk_prob`), SwiGLU experts, no shared expert. Qwen3 technical report:
//! <https://arxiv.org/abs/2505.09388>.

use super::names::{Role, HF_MLP_MOE};

/// HF names of the MoE block, in preference order.
pub const HF_MOE: &[(Role, &str)] = HF_MLP_MOE;
