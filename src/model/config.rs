//! Hyperparameters of a model, read from GGUF metadata or an HF `config.json` into one shape.
//!
//! Owns: `ModelConfig` and the two readers. Does not own: tensor names (see `names.rs`).
//! Invariant: every field the forward pass uses is filled and checked here, so the forward pass
//! never meets a missing or inconsistent hyperparameter.

use super::family::{self, BiasRule, FamilySpec, GgufKeys, HfKeys};
use super::ModelError;
use crate::format::{MetaValue, ModelFiles};
use serde_json::Value;

/// Architecture families sluice runs; what each one reads and names lives in its own file
/// (`FamilySpec`, family.rs).
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
    /// GLM-5 (GGUF `glm-dsa`, HF `GlmMoeDsaForCausalLM`): DeepSeek-V3.2's MLA and DSA with the
    /// indexer rotated interleaved and shared across layers (see glmdsa.rs).
    GlmDsa,
    /// OpenAI gpt-oss (GGUF `gpt-oss`, HF `GptOssForCausalLM`): attention sinks, alternating
    /// sliding-window / full layers, biases everywhere, clamped SwiGLU experts (see gptoss.rs).
    GptOss,
    /// DeepSeek-V4 (HF `deepseek_v4`): hyper-connection streams, compressed sparse / heavily
    /// compressed attention, hash routing (see deepseek_v4.rs).
    DeepseekV4,
    /// Qwen3-Next (GGUF `qwen3next`): hybrid Gated DeltaNet / gated full attention layers,
    /// shared expert with a sigmoid gate (see qwen3next.rs).
    Qwen3Next,
    /// Qwen3.5-MoE (text): Qwen3-Next's hybrid with separate DeltaNet input projections.
    Qwen35Moe,
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
    /// Per main layer, whether it runs its own indexer (true) or reuses the top-k of the
    /// previous layer that did (GLM-5's `indexer_types` "shared"); empty: every layer runs it.
    pub indexer_full: Vec<bool>,
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
    /// DeepSeek-V4's own hyperparameters (deepseek_v4.rs).
    pub v4: Option<Box<super::deepseek_v4::V4Params>>,
    /// Qwen3-Next / Qwen3.5's hybrid layer pattern and Gated DeltaNet shape (qwen3next.rs).
    pub hybrid: Option<Box<super::qwen3next::Hybrid>>,
}

/// Shape of DeepSeek-V3.2's lightning indexer: `heads` query heads of `head_dim` (the first
/// `rotary_dim` of them rotate, half-split) against one shared key per token; each query
/// attends to its `topk` best-scoring positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexerDims {
    pub heads: usize,
    pub head_dim: usize,
    pub topk: usize,
    /// How the indexer's q and k rotate: half-split (DeepSeek-V3.2), interleaved (GLM-5).
    pub rope: RopeLayout,
}

pub(super) fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
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
    keys: &HfKeys<'_>,
    spec: &FamilySpec,
) -> Result<(Option<usize>, Option<f32>), ModelError> {
    let cfg = keys.cfg;
    let refuse = |m: String| Err(ModelError::Config(format!("config.json: {m}")));
    let act = cfg
        .get("hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("silu");
    if act != "silu" {
        return refuse(format!("hidden_act {act:?} is not supported (silu only)"));
    }
    if spec.hf_attention_bias == BiasRule::Refused && keys.flag("attention_bias") {
        return refuse(format!(
            "attention_bias true is not supported for {}",
            spec.name
        ));
    }
    let sliding = (spec.hf_sliding_window)(keys)?;
    let clip = match cfg.get("clip_qkv") {
        None | Some(Value::Null) => None,
        Some(v) => match (spec.clip_qkv, v.as_f64()) {
            (true, Some(c)) if c > 0.0 => Some(c as f32),
            (true, _) => return refuse(format!("clip_qkv {v} is not a positive number")),
            _ => return refuse(format!("clip_qkv is not supported for {}", spec.name)),
        },
    };
    Ok((sliding, clip))
}

impl ModelConfig {
    pub fn from_files(files: &ModelFiles) -> Result<ModelConfig, ModelError> {
        let c = match files.config() {
            Some(cfg) => Self::from_hf(cfg)?,
            None => Self::from_gguf(files)?,
        };
        c.validate_sizes(files)?;
        Ok(c)
    }

    /// Sizes checked against the tensor bytes the files really hold, before anything is sized
    /// by them: every layer needs at least one tensor, and each weight matrix the dimensions
    /// imply (at no less than one bit per element) must fit in the files. A corrupt count then
    /// gives an error naming the field instead of a huge allocation.
    fn validate_sizes(&self, files: &ModelFiles) -> Result<(), ModelError> {
        let n_tensors = files.tensors().len();
        let layers = self.n_layers.saturating_add(self.n_mtp_layers);
        if layers > n_tensors {
            return Err(ModelError::Config(format!(
                "layer count {} (+{} MTP) is more than the {n_tensors} tensors in the file",
                self.n_layers, self.n_mtp_layers
            )));
        }
        let bytes: u64 = files
            .tensors()
            .iter()
            .fold(0u64, |a, t| a.saturating_add(t.range.len));
        let bits = bytes.saturating_mul(8);
        let (q_lora, kv_lora) = match self.attn {
            AttnKind::Mla {
                q_lora, kv_lora, ..
            } => (q_lora.unwrap_or(0), kv_lora),
            AttnKind::Gqa => (0, 0),
        };
        let checks: [(&str, &[usize]); 8] = [
            ("vocabulary x hidden size", &[self.vocab, self.hidden]),
            (
                "heads x head dimension x hidden size",
                &[self.n_heads, self.head_dim, self.hidden],
            ),
            (
                "kv heads x head dimension x hidden size",
                &[self.n_kv_heads, self.head_dim, self.hidden],
            ),
            (
                "heads x value dimension x hidden size",
                &[self.n_heads, self.v_head_dim, self.hidden],
            ),
            (
                "experts x expert width x hidden size",
                &[self.n_experts, self.expert_ffn, self.hidden],
            ),
            ("dense width x hidden size", &[self.dense_ffn, self.hidden]),
            (
                "shared-expert width x hidden size",
                &[self.shared_ffn, self.hidden],
            ),
            (
                "latent ranks x hidden size",
                &[q_lora.max(kv_lora), self.hidden],
            ),
        ];
        for (what, dims) in checks {
            let n = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64));
            if n.is_none_or(|n| n > bits) {
                return Err(ModelError::Config(format!(
                    "{what} ({}) is larger than the {bytes} bytes of tensors in the file could hold",
                    dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(" x ")
                )));
            }
        }
        Ok(())
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
        let spec = family::by_gguf_arch(&arch, n_experts)?;
        let family = spec.family;
        let hidden = req_u("embedding_length")?;
        let n_heads = req_u("attention.head_count")?;
        let n_kv_heads = opt_u("attention.head_count_kv").unwrap_or(n_heads);
        let head_dim = opt_u("attention.key_length").unwrap_or(hidden / n_heads.max(1));
        let v_head_dim = opt_u("attention.value_length").unwrap_or(head_dim);
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
                // GGUF has no key for rounding the correction range: rounded, unless the
                // family's hook says otherwise (gpt-oss).
                truncate: true,
                // ggml's YaRN scales cos/sin by attn_factor * (1 + 0.1 ln factor) (attn_factor
                // 1 here; keys that change it are refused below), except for deepseek2 and
                // deepseek32, whose graphs cancel it (mscale == mscale_all_dim).
                attention_factor: if spec.gguf_yarn_cancelled {
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
        if matches!(rope_scaling, RopeScaling::Yarn { .. }) && !spec.gguf_yarn_cancelled {
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
        let rotary_dim = opt_u("rope.dimension_count").unwrap_or(head_dim);
        let attn_scale = 1.0 / (head_dim as f64).sqrt();
        let sigmoid = spec.sigmoid_router && opt_u("expert_gating_func").unwrap_or(2) == 2;
        // Attention features llama.cpp writes as keys: a window in every layer (a per-layer
        // pattern is refused), and OLMo's q/k/v clamp.
        if get("attention.sliding_window_pattern").is_some() && !spec.gguf_window_pattern {
            return Err(ModelError::Config(format!(
                "{}: per-layer sliding-window patterns are not supported",
                key("attention.sliding_window_pattern")
            )));
        }
        let sliding_window = opt_u("attention.sliding_window").filter(|w| *w > 0);
        let clip_qkv = opt_f("attention.clamp_kqv").filter(|c| *c > 0.0);
        if clip_qkv.is_some() && !spec.clip_qkv {
            return Err(ModelError::Config(format!(
                "{}: q/k/v clamping is only supported for olmoe",
                key("attention.clamp_kqv")
            )));
        }
        let default_norm = spec.gguf_norm_topk;
        let mut cfg = ModelConfig {
            family,
            vocab,
            hidden,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            v_head_dim,
            attn: AttnKind::Gqa,
            attn_bias: files.tensor("blk.0.attn_q.bias").is_some(),
            rms_eps: opt_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-6) as f32,
            rope_theta: opt_f("rope.freq_base").unwrap_or(10000.0),
            rope_layout: spec.gguf_rope_layout,
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
            dense_attn_limit: None,
            indexer: None,
            indexer_full: Vec::new(),
            sliding_layers: None,
            attn_sinks: false,
            o_bias: false,
            expert_act: ExpertAct::Silu,
            expert_bias: false,
            v4: None,
            hybrid: None,
        };
        (spec.gguf_hparams)(&GgufKeys { files, arch: &arch }, &mut cfg)?;
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
        let spec = family::by_hf_arch(arch)?;
        let family = spec.family;
        let keys = HfKeys { cfg };
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
            .unwrap_or(spec.hf_default_rope_theta);
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
        let (sliding_window, clip_qkv) = hf_attention_features(&keys, spec)?;
        // transformers 5 writes `num_local_experts` for some families; others `num_experts`
        // or DeepSeek's `n_routed_experts`.
        let n_experts = ["num_experts", "num_local_experts", "n_routed_experts"]
            .iter()
            .find_map(|k| opt_u(k))
            .ok_or_else(|| ModelError::Config("config.json: none of num_experts / num_local_experts / n_routed_experts is set".into()))?;
        let expert_ffn = req_u(spec.hf_expert_ffn_key)?;
        let head_dim = opt_u("head_dim").unwrap_or(hidden / n_heads.max(1));
        let n_kv_heads = opt_u("num_key_value_heads").unwrap_or(n_heads);
        let partial = rget("partial_rotary_factor")
            .or_else(|| opt_f("partial_rotary_factor"))
            .unwrap_or(1.0);
        let rotary_dim = (head_dim as f64 * partial) as usize;
        let attn_scale = 1.0 / (head_dim as f64).sqrt();
        let sigmoid = spec.sigmoid_router;
        let n_shared = opt_u("n_shared_experts").unwrap_or(0);
        let mut c = ModelConfig {
            family,
            vocab: req_u("vocab_size")?,
            hidden,
            n_layers: req_u("num_hidden_layers")?,
            n_heads,
            n_kv_heads,
            head_dim,
            v_head_dim: head_dim,
            attn: AttnKind::Gqa,
            attn_bias: spec.hf_attention_bias == BiasRule::Read && keys.flag("attention_bias"),
            rms_eps: opt_f("rms_norm_eps").unwrap_or(1e-6) as f32,
            rope_theta,
            rope_layout: RopeLayout::HalfSplit,
            rope_scaling,
            rotary_dim,
            attn_scale: attn_scale as f32,
            qk_norm: (spec.hf_qk_norm)(&keys),
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
                norm_topk_prob: spec
                    .hf_norm_topk
                    .unwrap_or_else(|| keys.flag("norm_topk_prob")),
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
            dense_ffn: opt_u("intermediate_size").unwrap_or(0),
            n_mtp_layers: opt_u("num_nextn_predict_layers").unwrap_or(0),
            train_ctx: max_pos,
            tie_embeddings: cfg
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            sliding_window,
            clip_qkv,
            dense_attn_limit: None,
            indexer: None,
            indexer_full: Vec::new(),
            sliding_layers: None,
            attn_sinks: false,
            o_bias: false,
            expert_act: ExpertAct::Silu,
            expert_bias: false,
            v4: None,
            hybrid: None,
        };
        (spec.hf_hparams)(&keys, &mut c)?;
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Config(m));
        // Values the reference implementations would turn into NaN or infinities.
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!(
                "rope theta (rope_theta / rope.freq_base) is {}; it must be a positive number",
                self.rope_theta
            ));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return bad(format!(
                "RMS norm epsilon (rms_norm_eps / attention.layer_norm_rms_epsilon) is {}; it must be a positive number",
                self.rms_eps
            ));
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        match self.rope_scaling {
            RopeScaling::None => {}
            RopeScaling::Linear(f) if !positive(f) => {
                return bad(format!(
                    "rope scaling factor is {f}; it must be a positive number"
                ))
            }
            RopeScaling::Linear(_) => {}
            RopeScaling::Yarn {
                factor,
                orig_ctx,
                beta_fast,
                beta_slow,
                attention_factor,
                ..
            } => {
                if !positive(factor)
                    || !positive(orig_ctx)
                    || !beta_fast.is_finite()
                    || !beta_slow.is_finite()
                    || !attention_factor.is_finite()
                {
                    return bad(format!(
                        "YaRN rope scaling: factor {factor}, original context {orig_ctx}, beta_fast {beta_fast}, beta_slow {beta_slow}, attention factor {attention_factor}: factor and original context must be positive and all finite"
                    ));
                }
            }
        }
        if !self.routing.scale.is_finite() {
            return bad(format!(
                "routed_scaling_factor is {}; it must be finite",
                self.routing.scale
            ));
        }
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
        if let Some(v) = &self.v4 {
            return (v.k_width(self.head_dim), v.v_width(self.head_dim));
        }
        match self.attn {
            AttnKind::Gqa => (self.kv_dim(), self.n_kv_heads * self.v_head_dim),
            AttnKind::Mla { kv_lora, rope, .. } => {
                (kv_lora + rope, self.indexer.map_or(0, |i| i.head_dim))
            }
        }
    }

    /// KV-cache bytes per token with the cache's element types `kv` (as `kv_types` settles
    /// them): per layer, MLA keeps the compressed latent and the rope key (`kv_lora + rope`
    /// elements, not full K/V), GQA keys and values. `mtp`: with the one MTP layer `--mtp`
    /// runs (cached only then).
    pub fn kv_bytes_per_token(&self, mtp: bool, kv: crate::model::KvTypes) -> usize {
        let (k, v) = self.cache_dims();
        let layers = self.kv_layers() + usize::from(mtp && self.n_mtp_layers > 0);
        layers * (kv.k.row_bytes(k) + kv.v.row_bytes(v))
    }

    /// The cache's element types this model runs with when `want` is asked for (`-ctk`,
    /// `-ctv`), and, where a side does not follow its flag, why (the run prints it). GQA
    /// caches follow both flags; MLA's latent + rope key follows `-ctk` (as llama.cpp's), its
    /// value side is V3.2's indexer keys (f32) or nothing; DeepSeek-V4's caches stay f32.
    /// q8_0 needs every slice a head reads in whole 32-element blocks: refused otherwise,
    /// naming the width.
    pub fn kv_types(
        &self,
        want: crate::model::KvTypes,
    ) -> Result<(crate::model::KvTypes, Option<String>), ModelError> {
        use crate::kernels::kv::KvType;
        use crate::model::KvTypes;
        if self.v4.is_some() {
            let why = (want != KvTypes::F32).then(|| super::deepseek_v4::KV_F32.to_string());
            return Ok((KvTypes::F32, why));
        }
        let q8_fits = |flag: &str, t: KvType, widths: &[(&str, usize)]| {
            match widths.iter().find(|(_, w)| !w.is_multiple_of(t.block())) {
                Some((name, w)) if t == KvType::Q8_0 => Err(ModelError::Config(format!(
                    "{flag} q8_0: this model's {name} is {w}, not a multiple of q8_0's 32-element blocks; use f16, bf16 or f32"
                ))),
                _ => Ok(()),
            }
        };
        match self.attn {
            AttnKind::Mla { kv_lora, rope, .. } => {
                q8_fits(
                    "-ctk",
                    want.k,
                    &[("kv_lora_rank", kv_lora), ("qk_rope_head_dim", rope)],
                )?;
                let why = (want.v != KvType::F32).then(|| {
                    if self.indexer.is_some() {
                        format!("-ctv {}: {}", want.v, super::deepseek2::KV_INDEXER_F32)
                    } else {
                        format!("-ctv {}: {}", want.v, super::deepseek2::KV_NO_VALUES)
                    }
                });
                Ok((
                    KvTypes {
                        k: want.k,
                        v: KvType::F32,
                    },
                    why,
                ))
            }
            AttnKind::Gqa => {
                q8_fits("-ctk", want.k, &[("head_dim", self.head_dim)])?;
                q8_fits("-ctv", want.v, &[("v_head_dim", self.v_head_dim)])?;
                Ok((want, None))
            }
        }
    }

    /// Main layers that keep a KV cache: every layer, except in a hybrid model, whose linear
    /// layers keep a recurrent state instead (`qwen3next::Hybrid::kv_slot`).
    pub fn kv_layers(&self) -> usize {
        self.hybrid
            .as_ref()
            .map_or(self.n_layers, |h| h.linear.len() - h.n_linear())
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
            && self
                .hybrid
                .as_ref()
                .is_none_or(|h| !h.dense.get(l).copied().unwrap_or(false))
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
        // The reader alone: the file holds no tensors for `validate_sizes`.
        let c = ModelConfig::from_gguf(&files).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        c
    }

    #[test]
    fn next_families_are_refused_by_name() {
        let (arch, name, missing) = (
            "Qwen3_5MoeForConditionalGeneration",
            "Qwen3.5-MoE",
            "only the text model",
        );
        let cfg = serde_json::json!({"architectures": [arch], "hidden_size": 64});
        let e = ModelConfig::from_hf(&cfg).unwrap_err().to_string();
        assert!(
            e.contains(name) && e.contains(missing) && !e.contains("unknown"),
            "{e}"
        );
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
