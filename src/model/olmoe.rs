//! OLMoE (GGUF `olmoe`, HF `OlmoeForCausalLM`): like Qwen3-MoE but the q/k RMSNorm spans all
//! heads at once (weights of n_heads*head_dim and n_kv_heads*head_dim), and routing weights are
//! not renormalised by default. Paper: <https://arxiv.org/abs/2409.02060>.

use super::names::{Role, HF_MLP_MOE};

pub const HF_MOE: &[(Role, &str)] = HF_MLP_MOE;
