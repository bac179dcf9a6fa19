//! GLM-4.5/4.6/4.7 MoE (GGUF `glm4moe`, HF `Glm4MoeForCausalLM`): GQA with q/k/v biases, an
//! optional per-head q/k RMSNorm, partial rotary (half-split within the rotating part), dense
//! first layers, a shared expert, and DeepSeek-style sigmoid group routing. GGUF calls the
//! pre-FFN norm `post_attention_norm`. Model card: <https://huggingface.co/zai-org/GLM-4.5>.

use super::names::{Role, HF_MLP_MOE};

pub const HF_MOE: &[(Role, &str)] = HF_MLP_MOE;
