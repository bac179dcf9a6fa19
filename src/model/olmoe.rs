//! OLMoE (GGUF `olmoe`, HF `OlmoeForCausalLM`): like Qwen3-MoE but the q/k RMSNorm spans all
//! heads at once (weights of n_heads*head_dim and n_kv_heads*head_dim), and routing weights are
//! not renormalised by default. Paper: <https://arxiv.org/abs/2409.02060>.

use super::config::{Family, QkNorm, RopeLayout};
use super::family::{self, BiasRule, FamilySpec};
use super::names::{Role, HF_MLP_MOE};

pub const HF_MOE: &[(Role, &str)] = HF_MLP_MOE;

pub static SPEC: FamilySpec = FamilySpec {
    family: Family::Olmoe,
    name: "olmoe",
    gguf_archs: &["olmoe"],
    hf_archs: &["OlmoeForCausalLM", "olmoe"],
    hf_moe: HF_MOE,
    gguf_rope_layout: RopeLayout::HalfSplit,
    sigmoid_router: false,
    gguf_norm_topk: false,
    hf_norm_topk: None,
    hf_expert_ffn_key: "intermediate_size",
    hf_default_rope_theta: 10000.0,
    hf_attention_bias: BiasRule::Refused,
    clip_qkv: true,
    gguf_yarn_cancelled: false,
    hf_qk_norm: |_| QkNorm::Whole,
    hf_sliding_window: family::no_sliding_window,
    gguf_window_pattern: false,
    hf_experts_refused: None,
    gpu_validated: true,
    gguf_hparams: family::no_gguf_hparams,
    hf_hparams: family::no_hf_hparams,
};
