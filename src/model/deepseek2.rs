//! DeepSeek-V3/R1/V3.1 and Kimi-K2 (GGUF `deepseek2`, HF `DeepseekV3ForCausalLM`): multi-head
//! latent attention (q and kv low-rank projections; the cache keeps the kv latent and one
//! shared rope key per token; decode runs in latent space with the up-projections folded
//! into q and the output), YaRN rope with mscale, dense first layers, a shared expert, and
//! sigmoid routing with a selection-only bias, group-limited top-k and a routed scale.
//! Paper: <https://arxiv.org/abs/2412.19437>.

use super::names::{Role, HF_MLP_MOE};

pub const HF_MOE: &[(Role, &str)] = HF_MLP_MOE;
