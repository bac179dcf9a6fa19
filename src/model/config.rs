//! Hyperparameters of a model, read from GGUF metadata or an HF `config.json` into one shape.
//!
//! Owns: `ModelConfig` and the two readers. Does not own: tensor names (see `names.rs`).
//! Invariant: every field the forward pass uses is filled and checked here, so the forward pass
//! never meets a missing or inconsistent hyperparameter.

use super::ModelError;
use crate::format::{MetaValue, ModelFiles};
use serde_json::Value;

/// Architecture families sluice runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Qwen3Moe,
    /// Mixtral, written by llama.cpp as GGUF architecture `llama` with experts.
    Mixtral,
    Olmoe,
    /// DeepSeek-V3/R1 and Kimi-K2 (GGUF `deepseek2`): MLA attention, sigmoid group routing.
    DeepseekV3,
    /// GLM-4.5/4.6/4.7 MoE (GGUF `glm4moe`).
    Glm4Moe,
    /// OpenAI gpt-oss (GGUF `gpt-oss`, HF `GptOssForCausalLM`): attention sinks, alternating
    /// sliding-window / full layers, biases everywhere, clamped SwiGLU experts (see gptoss.rs).
    GptOss,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Qwen3Moe => "qwen3moe",
            Family::Mixtral => "mixtral",
            Family::Olmoe => "olmoe",
            Family::DeepseekV3 => "deepseek2",
            Family::Glm4Moe => "glm4moe",
            Family::GptOss => "gpt-oss",
        }
    }
}

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs (i, i + d/2): HF `rotate_half`, llama.cpp NEOX.
    HalfSplit,
    /// Pairs (2i, 2i+1): llama.cpp's normal mode (its converter permutes llama q/k to suit),
    /// and DeepSeek-V3's `rope_interleave`.
    Interleaved,
}

/// Position scaling of the rotary frequencies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    Linear(f64),
    /// YaRN (as transformers' `_compute_yarn_parameters`): frequencies blended between
    /// interpolation and extrapolation; cos/sin scaled by `attention_factor`.
    Yarn {
        factor: f64,
        orig_ctx: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        /// Round the correction range to whole dimensions (transformers' `truncate`, default
        /// true; gpt-oss sets false).
        truncate: bool,
    },
}

/// The activation of the routed experts' gated FFN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertAct {
    /// silu(gate) * up.
    Silu,
    /// gpt-oss: gate clamped above at `limit`, up clamped to [-limit, limit], then
    /// (up + 1) * gate * sigmoid(alpha * gate).
    ClampedSwiglu { alpha: f32, limit: f32 },
}

/// Where the q/k RMSNorm applies, if the family has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// One weight of `head_dim`, applied to each head (Qwen3, GLM).
    PerHead,
    /// One weight over all heads' concatenation (OLMoE).
    Whole,
}

/// Attention variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    /// Grouped-query attention over full K/V.
    Gqa,
    /// Multi-head latent attention: the cache holds `kv_lora` latent + `rope` key values per
    /// token; decode runs in latent space (up-projections folded into q and the output).
    Mla {
        q_lora: Option<usize>,
        kv_lora: usize,
        nope: usize,
        rope: usize,
        v_dim: usize,
    },
}

/// How router logits become expert choices and weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Routing {
    /// Sigmoid scores (DeepSeek-V3, GLM) instead of softmax.
    pub sigmoid: bool,
    /// Group-limited selection: keep the `topk_group` best of `n_group` groups (1 = off).
    pub n_group: usize,
    pub topk_group: usize,
    /// Renormalise the chosen weights to sum to one.
    pub norm_topk_prob: bool,
    /// Multiply the final weights (DeepSeek's `routed_scaling_factor`).
    pub scale: f32,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub family: Family,
    pub vocab: usize,
    pub hidden: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Per-head width of q and k (MLA: nope + rope).
    pub head_dim: usize,
    /// Per-head width of v (= head_dim except MLA).
    pub v_head_dim: usize,
    pub attn: AttnKind,
    /// Bias on q/k/v projections (GLM).
    pub attn_bias: bool,
    pub rms_eps: f32,
    pub rope_theta: f64,
    pub rope_layout: RopeLayout,
    pub rope_scaling: RopeScaling,
    /// Dimensions of a head that rotate (partial rotary; MLA: the rope part).
    pub rotary_dim: usize,
    /// Softmax scale of attention scores.
    pub attn_scale: f32,
    pub qk_norm: QkNorm,
    pub n_experts: usize,
    pub n_experts_used: usize,
    /// Intermediate size of one routed expert.
    pub expert_ffn: usize,
    pub routing: Routing,
    /// Shared experts' total intermediate size (0 = none).
    pub shared_ffn: usize,
    /// The first `n_dense_layers` layers have a dense FFN of `dense_ffn` instead of experts.
    pub n_dense_layers: usize,
    pub dense_ffn: usize,
    /// Multi-token-prediction layers after the main stack (not run by the main forward pass).
    pub n_mtp_layers: usize,
    /// Context length the model was trained for (the run's `-c` may differ).
    pub train_ctx: usize,
    pub tie_embeddings: bool,
    /// Sliding-window attention in every layer: a query attends to the last `W` positions,
    /// itself included (transformers' `kv_idx > q_idx - W`; llama.cpp's `p1 - p0 < n_swa`).
    /// `None` = full causal attention. The KV cache still keeps the whole context.
    pub sliding_window: Option<usize>,
    /// OLMoE `clip_qkv`: q, k and v clamped to [-c, c] after the q/k norm, before RoPE.
    pub clip_qkv: Option<f32>,
    /// DeepSeek-V3.2: sparse attention keeps the `index_topk` best tokens per query; up to that
    /// many positions it is exactly dense attention (all a backend without the indexer runs).
    pub dense_attn_limit: Option<usize>,
    /// DeepSeek-V3.2's lightning indexer (DSA), which picks the attended tokens.
    pub indexer: Option<IndexerDims>,
    /// Which layers use `sliding_window` (`None`: every layer); gpt-oss alternates.
    pub sliding_layers: Option<Vec<bool>>,
    /// One learned logit per head that joins each softmax of attention scores and takes its
    /// share of the probability mass (gpt-oss `sinks`).
    pub attn_sinks: bool,
    /// Bias on the attention output projection (gpt-oss).
    pub o_bias: bool,
    /// Routed experts' activation.
    pub expert_act: ExpertAct,
    /// Router logits and every expert projection carry a bias (gpt-oss).
    pub expert_bias: bool,
}

/// Shape of DeepSeek-V3.2's lightning indexer: `heads` query heads of `head_dim` (the first
/// `rotary_dim` of them rotate, half-split) against one shared key per token; each query
/// attends to its `topk` best-scoring positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexerDims {
    pub heads: usize,
    pub head_dim: usize,
    pub topk: usize,
}

/// 2026 families sluice recognises but does not run yet, by HF architecture / model_type or
/// GGUF architecture, with what is missing: they are refused by name, not as unknown.
fn not_yet_supported(arch: &str) -> Option<String> {
    let hybrid = "its Gated DeltaNet linear-attention layers (recurrent and convolution state), gated full attention and shared-expert gate are not implemented";
    let (name, missing) = match arch {
        "Qwen3NextForCausalLM" | "qwen3_next" | "qwen3next" => ("Qwen3-Next", hybrid),
        "Qwen3_5MoeForCausalLM"
        | "Qwen3_5MoeForConditionalGeneration"
        | "qwen3_5_moe"
        | "qwen3_5_moe_text"
        | "qwen35moe" => ("Qwen3.5-MoE", hybrid),
        "DeepseekV4ForCausalLM" | "deepseek_v4" | "deepseek4" => (
            "DeepSeek-V4",
            "its compressed and sparse attention with their cache variants are not implemented",
        ),
        "GlmMoeDsaForCausalLM" | "glm_moe_dsa" | "glm-dsa" => (
            "GLM-5 (glm_moe_dsa)",
            "its DSA sparse attention is not implemented",
        ),
        _ => return None,
    };
    Some(format!("{arch}: {name} is not supported yet: {missing}"))
}

fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// Attention features of an HF config that change what is computed, read where the family's
/// transformers model reads them; ones sluice does not implement are refused by name.
/// Returns (sliding window, clip_qkv).
fn hf_attention_features(
    cfg: &Value,
    family: Family,
) -> Result<(Option<usize>, Option<f32>), ModelError> {
    let refuse = |m: String| Err(ModelError::Config(format!("config.json: {m}")));
    let flag = |k: &str| cfg.get(k).and_then(Value::as_bool).unwrap_or(false);
    let act = cfg
        .get("hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("silu");
    if act != "silu" {
        return refuse(format!("hidden_act {act:?} is not supported (silu only)"));
    }
    // Qwen3-MoE and OLMoE would add q/k/v/o biases; Mixtral's model never reads the flag.
    if matches!(family, Family::Qwen3Moe | Family::Olmoe) && flag("attention_bias") {
        return refuse(format!(
            "attention_bias true is not supported for {}",
            family.name()
        ));
    }
    let window = |k: &str| -> Result<Option<usize>, ModelError> {
        match cfg.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(w) if w > 0 => Ok(Some(w as usize)),
                _ => Err(ModelError::Config(format!(
                    "config.json: {k} {v} is not a positive integer"
                ))),
            },
        }
    };
    // transformers 5.17: Mixtral masks every layer with `sliding_window` when it is set;
    // Qwen3-MoE does the same when `use_sliding_window` is true (its config then defaults the
    // window to 4096) and ignores `max_window_layers`. Other families' models never read it.
    let sliding = match family {
        Family::Mixtral => window("sliding_window")?,
        Family::Qwen3Moe if flag("use_sliding_window") => {
            Some(window("sliding_window")?.unwrap_or(4096))
        }
        _ => None,
    };
    let clip = match cfg.get("clip_qkv") {
        None | Some(Value::Null) => None,
        Some(v) => match (family, v.as_f64()) {
            (Family::Olmoe, Some(c)) if c > 0.0 => Some(c as f32),
            (Family::Olmoe, _) => return refuse(format!("clip_qkv {v} is not a positive number")),
            _ => return refuse(format!("clip_qkv is not supported for {}", family.name())),
        },
    };
    Ok((sliding, clip))
}

impl ModelConfig {
    pub fn from_files(files: &ModelFiles) -> Result<ModelConfig, ModelError> {
        match files.config() {
            Some(cfg) => Self::from_hf(cfg),
            None => Self::from_gguf(files),
        }
    }

    fn from_gguf(files: &ModelFiles) -> Result<ModelConfig, ModelError> {
        let arch = files
            .meta("general.architecture")
            .and_then(MetaValue::as_str)
            .ok_or_else(|| ModelError::Config("GGUF has no general.architecture".into()))?
            .to_string();
        let key = |k: &str| format!("{arch}.{k}");
        let get = |k: &str| files.meta(&key(k));
        let req_u = |k: &str| -> Result<usize, ModelError> {
            get(k)
                .and_then(MetaValue::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| {
                    ModelError::Config(format!(
                        "GGUF metadata {} is missing or not an integer",
                        key(k)
                    ))
                })
        };
        let opt_u = |k: &str| get(k).and_then(MetaValue::as_u64).map(|v| v as usize);
        let opt_f = |k: &str| get(k).and_then(MetaValue::as_f64);

        let n_experts = opt_u("expert_count").unwrap_or(0);
        let family = match arch.as_str() {
            "qwen3moe" => Family::Qwen3Moe,
            "olmoe" => Family::Olmoe,
            "deepseek2" | "deepseek32" => Family::DeepseekV3,
            "glm4moe" => Family::Glm4Moe,
            "gpt-oss" => Family::GptOss,
            other if not_yet_supported(other).is_some() => {
                return Err(ModelError::Config(format!(
                    "GGUF architecture {}",
                    not_yet_supported(other).unwrap_or_default()
                )))
            }
            "llama" if n_experts > 0 => Family::Mixtral,
            "llama" => return Err(ModelError::Config("GGUF architecture llama without experts (dense models are not supported)".into())),
            other => {
                return Err(ModelError::Config(format!(
                    "unknown architecture {other:?} (supported: qwen3moe, llama with experts (Mixtral), olmoe, deepseek2, deepseek32, glm4moe, gpt-oss)"
                )))
            }
        };
        let hidden = req_u("embedding_length")?;
        let n_heads = req_u("attention.head_count")?;
        let mut n_kv_heads = opt_u("attention.head_count_kv").unwrap_or(n_heads);
        let mut head_dim = opt_u("attention.key_length").unwrap_or(hidden / n_heads.max(1));
        let mut v_head_dim = opt_u("attention.value_length").unwrap_or(head_dim);
        let vocab = match opt_u("vocab_size") {
            Some(v) => v,
            None => files
                .tensor("token_embd.weight")
                .and_then(|t| t.shape.first().copied())
                .map(|v| v as usize)
                .ok_or_else(|| {
                    ModelError::Config(
                        "cannot tell the vocabulary size: no vocab_size and no token_embd.weight"
                            .into(),
                    )
                })?,
        };
        let expert_ffn = match opt_u("expert_feed_forward_length") {
            Some(v) => v,
            None => req_u("feed_forward_length")?,
        };
        let n_mtp_layers = opt_u("nextn_predict_layers").unwrap_or(0);
        let n_layers = req_u("block_count")?.saturating_sub(n_mtp_layers);
        let scaling = get("rope.scaling.type")
            .and_then(MetaValue::as_str)
            .unwrap_or("none");
        let factor = opt_f("rope.scaling.factor").unwrap_or(1.0);
        let rope_scaling = match scaling {
            "none" => RopeScaling::None,
            "linear" => RopeScaling::Linear(opt_f("rope.scaling.factor").ok_or_else(|| {
                ModelError::Config(format!(
                    "{} is linear but {} is missing",
                    key("rope.scaling.type"),
                    key("rope.scaling.factor")
                ))
            })?),
            "yarn" => RopeScaling::Yarn {
                factor,
                orig_ctx: opt_f("rope.scaling.original_context_length").unwrap_or(4096.0),
                beta_fast: opt_f("rope.scaling.yarn_beta_fast").unwrap_or(32.0),
                beta_slow: opt_f("rope.scaling.yarn_beta_slow").unwrap_or(1.0),
                // gpt-oss's own YaRN does not round the correction range (its config says
                // truncate false); GGUF has no key for it, so the family decides.
                truncate: family != Family::GptOss,
                // ggml's YaRN scales cos/sin by attn_factor * (1 + 0.1 ln factor) (attn_factor
                // 1 here; keys that change it are refused below), except for deepseek2 and
                // deepseek32, whose graphs cancel it (mscale == mscale_all_dim).
                attention_factor: if family == Family::DeepseekV3 {
                    1.0
                } else {
                    yarn_mscale(factor, 1.0)
                },
            },
            other => {
                return Err(ModelError::Config(format!(
                    "{}: rope scaling {other:?} is not supported for {arch}",
                    key("rope.scaling.type")
                )))
            }
        };
        if matches!(rope_scaling, RopeScaling::Yarn { .. }) && family != Family::DeepseekV3 {
            // Keys that change llama.cpp's YaRN magnitude or mix: not implemented, refused.
            for k in [
                "rope.scaling.attn_factor",
                "rope.scaling.yarn_attn_factor",
                "rope.scaling.yarn_ext_factor",
            ] {
                if get(k).is_some() {
                    return Err(ModelError::Config(format!(
                        "{}: not supported with YaRN for {arch}",
                        key(k)
                    )));
                }
            }
        }
        let mut attn = AttnKind::Gqa;
        let mut rotary_dim = opt_u("rope.dimension_count").unwrap_or(head_dim);
        let mut attn_scale = 1.0 / (head_dim as f64).sqrt();
        if family == Family::DeepseekV3 {
            let kv_lora = req_u("attention.kv_lora_rank")?;
            let rope = req_u("rope.dimension_count")?;
            let qk = opt_u("attention.key_length_mla").unwrap_or(head_dim);
            let v_dim = opt_u("attention.value_length_mla").unwrap_or(v_head_dim);
            let q_lora = opt_u("attention.q_lora_rank").filter(|r| *r > 0);
            attn = AttnKind::Mla {
                q_lora,
                kv_lora,
                nope: qk.saturating_sub(rope),
                rope,
                v_dim,
            };
            (head_dim, v_head_dim, n_kv_heads, rotary_dim) = (qk, v_dim, n_heads, rope);
            attn_scale = 1.0 / (qk as f64).sqrt();
            if let RopeScaling::Yarn { factor, .. } = rope_scaling {
                // yarn_log_multiplier = 0.1 * mscale_all_dim; a file without the key gets no
                // scaling, as in llama.cpp (its default multiplier is 0).
                let m = yarn_mscale(
                    factor,
                    opt_f("rope.scaling.yarn_log_multiplier").unwrap_or(0.0) / 0.1,
                );
                attn_scale *= m * m;
            }
        }
        // DeepSeek-V3.2 (llama.cpp's `deepseek32`): the indexer's shape from its keys, or from
        // its tensors' shapes, and its top-k (DeepSeek's 2048 when a file omits it).
        let has_indexer = files.tensor("blk.0.indexer.attn_k.weight").is_some();
        let indexer = if family == Family::DeepseekV3 && (arch == "deepseek32" || has_indexer) {
            let dim_of = |name: &str, axis: usize| {
                files
                    .tensor(name)
                    .and_then(|t| t.shape.get(axis).copied())
                    .map(|v| v as usize)
            };
            let head_dim = opt_u("attention.indexer.key_length")
                .or_else(|| dim_of("blk.0.indexer.attn_k.weight", 0))
                .ok_or_else(|| {
                    ModelError::Config(format!(
                        "{} is missing and there is no blk.0.indexer.attn_k.weight",
                        key("attention.indexer.key_length")
                    ))
                })?;
            let heads = opt_u("attention.indexer.head_count")
                .or_else(|| dim_of("blk.0.indexer.proj.weight", 0))
                .ok_or_else(|| {
                    ModelError::Config(format!(
                        "{} is missing and there is no blk.0.indexer.proj.weight",
                        key("attention.indexer.head_count")
                    ))
                })?;
            Some(IndexerDims {
                heads,
                head_dim,
                topk: opt_u("attention.indexer.top_k").unwrap_or(2048),
            })
        } else {
            None
        };
        let sigmoid = matches!(family, Family::DeepseekV3 | Family::Glm4Moe)
            && opt_u("expert_gating_func").unwrap_or(2) == 2;
        // Attention features llama.cpp writes as keys: a window in every layer (a per-layer
        // pattern is refused), and OLMo's q/k/v clamp.
        if get("attention.sliding_window_pattern").is_some() && family != Family::GptOss {
            return Err(ModelError::Config(format!(
                "{}: per-layer sliding-window patterns are not supported",
                key("attention.sliding_window_pattern")
            )));
        }
        let sliding_window = opt_u("attention.sliding_window").filter(|w| *w > 0);
        let clip_qkv = opt_f("attention.clamp_kqv").filter(|c| *c > 0.0);
        if clip_qkv.is_some() && family != Family::Olmoe {
            return Err(ModelError::Config(format!(
                "{}: q/k/v clamping is only supported for olmoe",
                key("attention.clamp_kqv")
            )));
        }
        // llama.cpp's graphs renormalise the top-k weights always for qwen3moe and Mixtral,
        // never for olmoe, and for deepseek2/deepseek32/glm4moe only when
        // `expert_weights_norm` says so: their loaders read a missing key as false (the
        // converter omits it when the checkpoint's `norm_topk_prob` is false).
        let default_norm = matches!(family, Family::Qwen3Moe | Family::Mixtral);
        let cfg = ModelConfig {
            family,
            vocab,
            hidden,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            v_head_dim,
            attn,
            attn_bias: files.tensor("blk.0.attn_q.bias").is_some(),
            rms_eps: opt_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-6) as f32,
            rope_theta: opt_f("rope.freq_base").unwrap_or(10000.0),
            rope_layout: match family {
                Family::Mixtral | Family::DeepseekV3 => RopeLayout::Interleaved,
                Family::Qwen3Moe | Family::Olmoe | Family::Glm4Moe | Family::GptOss => {
                    RopeLayout::HalfSplit
                }
            },
            rope_scaling,
            rotary_dim,
            attn_scale: attn_scale as f32,
            qk_norm: QkNorm::None, // decided from tensor shapes by the loader
            n_experts,
            n_experts_used: req_u("expert_used_count")?,
            expert_ffn,
            routing: Routing {
                sigmoid,
                n_group: opt_u("expert_group_count").unwrap_or(1).max(1),
                topk_group: opt_u("expert_group_used_count").unwrap_or(1).max(1),
                norm_topk_prob: get("expert_weights_norm")
                    .and_then(MetaValue::as_bool)
                    .unwrap_or(default_norm),
                scale: opt_f("expert_weights_scale").unwrap_or(1.0) as f32,
            },
            shared_ffn: opt_u("expert_shared_count").unwrap_or(0) * expert_ffn,
            n_dense_layers: opt_u("leading_dense_block_count").unwrap_or(0),
            dense_ffn: opt_u("feed_forward_length").unwrap_or(0),
            n_mtp_layers,
            train_ctx: opt_u("context_length").unwrap_or(4096),
            tie_embeddings: files.tensor("output.weight").is_none(),
            sliding_window,
            clip_qkv: clip_qkv.map(|c| c as f32),
            dense_attn_limit: indexer.map(|i| i.topk),
            indexer,
            sliding_layers: None,
            attn_sinks: false,
            o_bias: false,
            expert_act: ExpertAct::Silu,
            expert_bias: false,
        };
        let cfg = if family == Family::GptOss {
            super::gptoss::gguf_config(cfg, files)?
        } else {
            cfg
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn from_hf(cfg: &Value) -> Result<ModelConfig, ModelError> {
        let arch = cfg
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .or_else(|| cfg.get("model_type").and_then(Value::as_str))
            .ok_or_else(|| {
                ModelError::Config("config.json: no architectures or model_type".into())
            })?;
        let family = match arch {
            "Qwen3MoeForCausalLM" | "qwen3_moe" => Family::Qwen3Moe,
            "MixtralForCausalLM" | "mixtral" => Family::Mixtral,
            "OlmoeForCausalLM" | "olmoe" => Family::Olmoe,
            // V3.2 is V3 plus DSA's lightning indexer (`indexer`).
            "DeepseekV3ForCausalLM" | "deepseek_v3" | "DeepseekV32ForCausalLM" | "deepseek_v32" => Family::DeepseekV3,
            "Glm4MoeForCausalLM" | "glm4_moe" => Family::Glm4Moe,
            "GptOssForCausalLM" | "gpt_oss" => Family::GptOss,
            other if not_yet_supported(other).is_some() => {
                return Err(ModelError::Config(format!(
                    "config.json: architecture {}",
                    not_yet_supported(other).unwrap_or_default()
                )))
            }
            other => {
                return Err(ModelError::Config(format!(
                    "config.json: unknown architecture {other:?} (supported: Qwen3MoeForCausalLM, MixtralForCausalLM, OlmoeForCausalLM, DeepseekV3ForCausalLM, Glm4MoeForCausalLM, GptOssForCausalLM)"
                )))
            }
        };
        let req_u = |k: &str| -> Result<usize, ModelError> {
            cfg.get(k)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| {
                    ModelError::Config(format!("config.json: {k} is missing or not an integer"))
                })
        };
        let opt_u = |k: &str| cfg.get(k).and_then(Value::as_u64).map(|v| v as usize);
        let opt_f = |k: &str| cfg.get(k).and_then(Value::as_f64);
        let hidden = req_u("hidden_size")?;
        let n_heads = req_u("num_attention_heads")?;
        let max_pos = opt_u("max_position_embeddings").unwrap_or(4096);
        // transformers 5 moved rope settings into `rope_parameters`; older configs have them top-level.
        let rope = cfg
            .get("rope_parameters")
            .or_else(|| cfg.get("rope_scaling"))
            .filter(|v| v.is_object());
        let rget = |k: &str| rope.and_then(|r| r.get(k)).and_then(Value::as_f64);
        // transformers' default when the config has none: Mixtral's `default_theta` 1e6.
        let rope_theta = rget("rope_theta")
            .or_else(|| opt_f("rope_theta"))
            .unwrap_or(if family == Family::Mixtral {
                1e6
            } else {
                10000.0
            });
        let rope_type = rope
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let factor = rget("factor").unwrap_or(1.0);
        let rope_scaling = match rope_type {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear(factor),
            "yarn" => {
                // As transformers 5.17 (`standardize_rope_params`, `_compute_yarn_parameters`):
                // the original context is the top-level `original_max_position_embeddings`, else
                // the rope dict's, else max_position_embeddings; the factor is the dict's own
                // (the ratio of the two lengths only when it has none); cos/sin scale by the
                // mscale ratio.
                let orig = opt_f("original_max_position_embeddings")
                    .or_else(|| rget("original_max_position_embeddings"))
                    .unwrap_or(max_pos as f64);
                let f = rget("factor").unwrap_or(max_pos as f64 / orig);
                let truncate = rope
                    .and_then(|r| r.get("truncate"))
                    .and_then(Value::as_bool)
                    .unwrap_or(true);
                let attention_factor = match (
                    rget("attention_factor"),
                    rget("mscale"),
                    rget("mscale_all_dim"),
                ) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(ma)) if m != 0.0 && ma != 0.0 => {
                        yarn_mscale(f, m) / yarn_mscale(f, ma)
                    }
                    _ => yarn_mscale(f, 1.0),
                };
                RopeScaling::Yarn {
                    factor: f,
                    orig_ctx: orig,
                    beta_fast: rget("beta_fast").unwrap_or(32.0),
                    beta_slow: rget("beta_slow").unwrap_or(1.0),
                    attention_factor,
                    truncate,
                }
            }
            other => {
                return Err(ModelError::Config(format!(
                    "config.json: rope_type {other:?} is not supported for {} (supported: default, linear, yarn)",
                    family.name()
                )))
            }
        };
        let (sliding_window, clip_qkv) = hf_attention_features(cfg, family)?;
        // transformers 5 writes `num_local_experts` for some families; others `num_experts`
        // or DeepSeek's `n_routed_experts`.
        let n_experts = ["num_experts", "num_local_experts", "n_routed_experts"]
            .iter()
            .find_map(|k| opt_u(k))
            .ok_or_else(|| ModelError::Config("config.json: none of num_experts / num_local_experts / n_routed_experts is set".into()))?;
        let expert_ffn = match family {
            Family::Mixtral | Family::Olmoe | Family::GptOss => req_u("intermediate_size")?,
            _ => req_u("moe_intermediate_size")?,
        };
        if family == Family::Qwen3Moe {
            let step = opt_u("decoder_sparse_step").unwrap_or(1);
            let dense_layers = cfg
                .get("mlp_only_layers")
                .and_then(Value::as_array)
                .map(|a| a.len())
                .unwrap_or(0);
            if step != 1 || dense_layers != 0 {
                return Err(ModelError::Config("config.json: Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported".into()));
            }
        }
        let mut head_dim = opt_u("head_dim").unwrap_or(hidden / n_heads.max(1));
        let mut v_head_dim = head_dim;
        let mut n_kv_heads = opt_u("num_key_value_heads").unwrap_or(n_heads);
        let partial = rget("partial_rotary_factor")
            .or_else(|| opt_f("partial_rotary_factor"))
            .unwrap_or(1.0);
        let mut rotary_dim = (head_dim as f64 * partial) as usize;
        let mut attn = AttnKind::Gqa;
        let mut attn_scale = 1.0 / (head_dim as f64).sqrt();
        let mut layout = RopeLayout::HalfSplit;
        if family == Family::DeepseekV3 {
            let (nope, rope_d, v_dim, kv_lora) = (
                req_u("qk_nope_head_dim")?,
                req_u("qk_rope_head_dim")?,
                req_u("v_head_dim")?,
                req_u("kv_lora_rank")?,
            );
            attn = AttnKind::Mla {
                q_lora: opt_u("q_lora_rank"),
                kv_lora,
                nope,
                rope: rope_d,
                v_dim,
            };
            (head_dim, v_head_dim, n_kv_heads, rotary_dim) =
                (nope + rope_d, v_dim, n_heads, rope_d);
            attn_scale = 1.0 / (head_dim as f64).sqrt();
            if rope_type != "default" {
                let ma = rget("mscale_all_dim").unwrap_or(0.0);
                if ma != 0.0 {
                    let m = yarn_mscale(factor, ma);
                    attn_scale *= m * m;
                }
            }
            if cfg
                .get("rope_interleave")
                .and_then(Value::as_bool)
                .unwrap_or(true)
            {
                layout = RopeLayout::Interleaved;
            }
            let scoring = cfg
                .get("scoring_func")
                .and_then(Value::as_str)
                .unwrap_or("sigmoid");
            if scoring != "sigmoid" {
                return Err(ModelError::Config(format!(
                    "config.json: scoring_func {scoring:?} is not supported (sigmoid only)"
                )));
            }
        }
        let sigmoid = matches!(family, Family::DeepseekV3 | Family::Glm4Moe);
        let n_shared = opt_u("n_shared_experts").unwrap_or(0);
        // DeepSeek-V3.2: defaults as transformers' DeepseekV32Config.
        let indexer = match (family, opt_u("index_topk")) {
            (Family::DeepseekV3, Some(topk)) => Some(IndexerDims {
                heads: opt_u("index_n_heads").unwrap_or(64),
                head_dim: opt_u("index_head_dim").unwrap_or(128),
                topk,
            }),
            _ => None,
        };
        let c = ModelConfig {
            family,
            vocab: req_u("vocab_size")?,
            hidden,
            n_layers: req_u("num_hidden_layers")?,
            n_heads,
            n_kv_heads,
            head_dim,
            v_head_dim,
            attn,
            attn_bias: family == Family::Glm4Moe
                && cfg
                    .get("attention_bias")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            rms_eps: opt_f("rms_norm_eps").unwrap_or(1e-6) as f32,
            rope_theta,
            rope_layout: layout,
            rope_scaling,
            rotary_dim,
            attn_scale: attn_scale as f32,
            qk_norm: match family {
                Family::Qwen3Moe => QkNorm::PerHead,
                Family::Glm4Moe
                    if cfg
                        .get("use_qk_norm")
                        .and_then(Value::as_bool)
                        .unwrap_or(false) =>
                {
                    QkNorm::PerHead
                }
                Family::Olmoe => QkNorm::Whole,
                _ => QkNorm::None,
            },
            n_experts,
            n_experts_used: req_u("num_experts_per_tok")?,
            expert_ffn,
            routing: Routing {
                sigmoid,
                n_group: if sigmoid {
                    opt_u("n_group").unwrap_or(1).max(1)
                } else {
                    1
                },
                topk_group: if sigmoid {
                    opt_u("topk_group").unwrap_or(1).max(1)
                } else {
                    1
                },
                norm_topk_prob: match family {
                    // gpt-oss: softmax over the chosen logits = renormalised softmax.
                    Family::Mixtral | Family::GptOss => true,
                    _ => cfg
                        .get("norm_topk_prob")
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                },
                scale: if sigmoid {
                    opt_f("routed_scaling_factor").unwrap_or(1.0) as f32
                } else {
                    1.0
                },
            },
            shared_ffn: n_shared * expert_ffn,
            n_dense_layers: if sigmoid {
                opt_u("first_k_dense_replace").unwrap_or(0)
            } else {
                0
            },
            dense_ffn: if family == Family::GptOss {
                0
            } else {
                opt_u("intermediate_size").unwrap_or(0)
            },
            n_mtp_layers: opt_u("num_nextn_predict_layers").unwrap_or(0),
            train_ctx: max_pos,
            tie_embeddings: cfg
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            sliding_window,
            clip_qkv,
            dense_attn_limit: indexer.map(|i| i.topk),
            indexer,
            sliding_layers: None,
            attn_sinks: false,
            o_bias: false,
            expert_act: ExpertAct::Silu,
            expert_bias: false,
        };
        let c = if family == Family::GptOss {
            super::gptoss::hf_config(c, cfg)?
        } else {
            c
        };
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Config(m));
        if self.hidden == 0
            || self.n_layers == 0
            || self.n_heads == 0
            || self.head_dim == 0
            || self.vocab == 0
        {
            return bad(format!(
                "degenerate dimensions: hidden {}, layers {}, heads {}, head_dim {}, vocab {}",
                self.hidden, self.n_layers, self.n_heads, self.head_dim, self.vocab
            ));
        }
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} attention heads is not a multiple of {} key/value heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            return bad(format!(
                "rotary dimension {} must be even and at most head_dim {}",
                self.rotary_dim, self.head_dim
            ));
        }
        if self.n_experts == 0 || self.n_experts_used == 0 || self.n_experts_used > self.n_experts {
            return bad(format!(
                "{} experts used per token out of {}",
                self.n_experts_used, self.n_experts
            ));
        }
        if self.expert_ffn == 0 {
            return bad("expert intermediate size is 0".into());
        }
        let r = &self.routing;
        if !self.n_experts.is_multiple_of(r.n_group)
            || r.topk_group > r.n_group
            || r.topk_group * (self.n_experts / r.n_group) < self.n_experts_used
        {
            return bad(format!(
                "expert groups: {} experts in {} groups, {} groups kept, {} experts used",
                self.n_experts, r.n_group, r.topk_group, self.n_experts_used
            ));
        }
        if self.attn != AttnKind::Gqa && (self.sliding_window.is_some() || self.clip_qkv.is_some())
        {
            return bad("sliding-window attention and clip_qkv are only supported with grouped-query attention".into());
        }
        if self.n_dense_layers > self.n_layers || (self.n_dense_layers > 0 && self.dense_ffn == 0) {
            return bad(format!(
                "{} dense layers of width {} in a {}-layer model",
                self.n_dense_layers, self.dense_ffn, self.n_layers
            ));
        }
        if let Some(ix) = self.indexer {
            let has_q_lora = matches!(
                self.attn,
                AttnKind::Mla {
                    q_lora: Some(_),
                    ..
                }
            );
            if ix.heads == 0 || ix.topk == 0 || ix.head_dim < self.rotary_dim || !has_q_lora {
                return bad(format!(
                    "sparse attention indexer: {} heads of {} dims (rotary {}), top-k {}{}",
                    ix.heads,
                    ix.head_dim,
                    self.rotary_dim,
                    ix.topk,
                    if has_q_lora {
                        ""
                    } else {
                        ", and no q_lora_rank (the indexer's query reads the q latent)"
                    }
                ));
            }
        }
        Ok(())
    }

    /// Width of all heads' queries.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of GQA keys/values (all kv heads).
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Width of all heads' attention outputs (o_proj input).
    pub fn att_dim(&self) -> usize {
        self.n_heads * self.v_head_dim
    }

    /// Floats per token per layer in the key cache and the value cache. MLA caches its latent
    /// and rope key as the "key"; its "value" row is the V3.2 indexer's key (else nothing).
    pub fn cache_dims(&self) -> (usize, usize) {
        match self.attn {
            AttnKind::Gqa => (self.kv_dim(), self.n_kv_heads * self.v_head_dim),
            AttnKind::Mla { kv_lora, rope, .. } => {
                (kv_lora + rope, self.indexer.map_or(0, |i| i.head_dim))
            }
        }
    }

    /// KV-cache bytes per token (sluice's cache is f32): per layer, MLA keeps the compressed
    /// latent and the rope key (`kv_lora + rope` floats, not full K/V), GQA keys and values.
    /// `mtp`: with the one MTP layer `--mtp` runs (cached only then).
    pub fn kv_bytes_per_token(&self, mtp: bool) -> usize {
        let (k, v) = self.cache_dims();
        let layers = self.n_layers + usize::from(mtp && self.n_mtp_layers > 0);
        layers * (k + v) * std::mem::size_of::<f32>()
    }

    /// The sliding window of layer `l`, if it has one.
    pub fn window(&self, l: usize) -> Option<usize> {
        match &self.sliding_layers {
            Some(on) if !on.get(l).copied().unwrap_or(false) => None,
            _ => self.sliding_window,
        }
    }

    /// Whether layer `l` routes to experts (else it has a dense FFN).
    pub fn is_moe_layer(&self, l: usize) -> bool {
        l >= self.n_dense_layers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The base Qwen3-MoE fixture's config with `edit` applied.
    fn qwen3(edit: impl Fn(&mut Value)) -> Result<ModelConfig, ModelError> {
        let p = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/models/qwen3_moe/config.json"
        );
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        edit(&mut v);
        ModelConfig::from_hf(&v)
    }

    /// A metadata-only GGUF of `arch` (enough keys for the config reader) plus `extra`.
    fn gguf_config(arch: &str, extra: &[(&str, MetaValue)]) -> ModelConfig {
        use crate::format::GgufWriter;
        let dir = std::env::temp_dir().join(format!(
            "sluice-config-test-{}-{arch}-{}",
            std::process::id(),
            extra.len()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.gguf");
        let mut w = GgufWriter::new(&path).unwrap();
        w.add_meta("general.architecture", MetaValue::String(arch.into()))
            .unwrap();
        let u = |x: u32| MetaValue::U32(x);
        let mut keys: Vec<(&str, MetaValue)> = vec![
            ("block_count", u(2)),
            ("embedding_length", u(32)),
            ("feed_forward_length", u(64)),
            ("expert_feed_forward_length", u(32)),
            ("attention.head_count", u(4)),
            ("attention.head_count_kv", u(4)),
            ("attention.key_length", u(48)),
            ("attention.value_length", u(32)),
            ("expert_count", u(8)),
            ("expert_used_count", u(2)),
            ("vocab_size", u(320)),
            ("rope.dimension_count", u(16)),
        ];
        if arch == "deepseek2" {
            keys.push(("attention.kv_lora_rank", u(32)));
        }
        keys.extend(extra.iter().cloned());
        for (k, v) in keys {
            w.add_meta(&format!("{arch}.{k}"), v).unwrap();
        }
        w.finish().unwrap();
        let files = ModelFiles::open(&path).unwrap();
        let c = ModelConfig::from_files(&files).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        c
    }

    #[test]
    fn next_families_are_refused_by_name() {
        for (arch, name, missing) in [
            ("Qwen3NextForCausalLM", "Qwen3-Next", "Gated DeltaNet"),
            (
                "Qwen3_5MoeForConditionalGeneration",
                "Qwen3.5-MoE",
                "Gated DeltaNet",
            ),
            (
                "DeepseekV4ForCausalLM",
                "DeepSeek-V4",
                "compressed and sparse attention",
            ),
            ("GlmMoeDsaForCausalLM", "GLM-5", "DSA"),
        ] {
            let cfg = serde_json::json!({"architectures": [arch], "hidden_size": 64});
            let e = ModelConfig::from_hf(&cfg).unwrap_err().to_string();
            assert!(
                e.contains(name) && e.contains(missing) && !e.contains("unknown"),
                "{e}"
            );
        }
    }

    #[test]
    fn gguf_expert_weights_norm_defaults_as_llama_cpp() {
        // deepseek2 / glm4moe: llama.cpp reads a missing `expert_weights_norm` as false (its
        // converter leaves the key out when norm_topk_prob is false).
        for arch in ["deepseek2", "glm4moe"] {
            assert!(!gguf_config(arch, &[]).routing.norm_topk_prob, "{arch}");
            let on = gguf_config(arch, &[("expert_weights_norm", MetaValue::Bool(true))]);
            assert!(on.routing.norm_topk_prob, "{arch}");
        }
        // qwen3moe always renormalises in llama.cpp's graph; olmoe never does.
        assert!(gguf_config("qwen3moe", &[]).routing.norm_topk_prob);
        assert!(!gguf_config("olmoe", &[]).routing.norm_topk_prob);
    }

    #[test]
    fn qwen3_sliding_window_follows_use_sliding_window() {
        // As transformers 5.17's Qwen3MoeConfig: the window only counts when switched on,
        // defaults to 4096, and max_window_layers does not narrow it to some layers.
        let off = qwen3(|v| v["sliding_window"] = 64.into()).unwrap();
        assert_eq!(off.sliding_window, None);
        let on = qwen3(|v| {
            v["use_sliding_window"] = true.into();
            v["sliding_window"] = 64.into();
            v["max_window_layers"] = 1.into();
        })
        .unwrap();
        assert_eq!(on.sliding_window, Some(64));
        let default = qwen3(|v| v["use_sliding_window"] = true.into()).unwrap();
        assert_eq!(default.sliding_window, Some(4096));
    }

    #[test]
    fn yarn_factor_is_the_configs_own() {
        // Qwen3's documented YaRN set-up: factor 4 over 32768, max_position_embeddings 40960.
        // transformers 5.17 uses factor 4 (not 40960 / 32768) and mscale 0.1 ln 4 + 1.
        let c = qwen3(|v| {
            v["max_position_embeddings"] = 40960.into();
            v["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "rope_theta": 1e6,
                "factor": 4.0, "original_max_position_embeddings": 32768});
        })
        .unwrap();
        let RopeScaling::Yarn {
            factor,
            orig_ctx,
            attention_factor,
            ..
        } = c.rope_scaling
        else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!((factor, orig_ctx), (4.0, 32768.0));
        assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        let t = qwen3(|v| {
            v["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "rope_theta": 1e6,
                "factor": 4.0, "truncate": false});
        })
        .unwrap();
        assert!(matches!(
            t.rope_scaling,
            RopeScaling::Yarn {
                truncate: false,
                ..
            }
        ));
        assert!(matches!(
            c.rope_scaling,
            RopeScaling::Yarn { truncate: true, .. }
        ));
    }

    #[test]
    fn features_the_family_lacks_are_refused_by_name() {
        let e = qwen3(|v| v["clip_qkv"] = 1.0.into())
            .unwrap_err()
            .to_string();
        assert!(e.contains("clip_qkv"), "{e}");
        let e = qwen3(|v| v["rope_parameters"]["rope_type"] = "llama3".into())
            .unwrap_err()
            .to_string();
        assert!(e.contains("rope_type \"llama3\""), "{e}");
        let e = qwen3(|v| v["attention_bias"] = true.into())
            .unwrap_err()
            .to_string();
        assert!(e.contains("attention_bias"), "{e}");
        // null means "off" for both.
        let ok = qwen3(|v| {
            v["clip_qkv"] = Value::Null;
            v["sliding_window"] = Value::Null;
        })
        .unwrap();
        assert_eq!((ok.sliding_window, ok.clip_qkv), (None, None));
    }
}
