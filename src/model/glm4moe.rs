//! GLM-4.5/4.6/4.7 MoE (GGUF `glm4moe`, HF `Glm4MoeForCausalLM`): GQA with q/k/v biases, an
//! optional per-head q/k RMSNorm, partial rotary (half-split within the rotating part), dense
//! first layers, a shared expert, and DeepSeek-style sigmoid group routing. GGUF calls the
//! pre-FFN norm `post_attention_norm`. Model card: <https://huggingface.co/zai-org/GLM-4.5>.

use super::config::{Family, QkNorm, RopeLayout};
use super::family::{self, BiasRule, FamilySpec};
use super::names::{Role, HF_MLP_MOE};

pub const HF_MOE: &[(Role, &str)] = HF_MLP_MOE;

pub static SPEC: FamilySpec = FamilySpec {
    family: Family::Glm4Moe,
    name: "glm4moe",
    gguf_archs: &["glm4moe"],
    hf_archs: &["Glm4MoeForCausalLM", "glm4_moe"],
    hf_moe: HF_MOE,
    gguf_rope_layout: RopeLayout::HalfSplit,
    sigmoid_router: true,
    // llama.cpp reads a missing expert_weights_norm as false.
    gguf_norm_topk: false,
    hf_norm_topk: None,
    hf_expert_ffn_key: "moe_intermediate_size",
    hf_default_rope_theta: 10000.0,
    hf_attention_bias: BiasRule::Read,
    clip_qkv: false,
    gguf_yarn_cancelled: false,
    hf_qk_norm: |k| {
        if k.flag("use_qk_norm") {
            QkNorm::PerHead
        } else {
            QkNorm::None
        }
    },
    hf_sliding_window: family::no_sliding_window,
    gguf_window_pattern: false,
    hf_experts_refused: None,
    gpu_validated: true,
    gguf_hparams: family::no_gguf_hparams,
    hf_hparams: family::no_hf_hparams,
};
