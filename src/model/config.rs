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
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Qwen3Moe => "qwen3moe",
            Family::Mixtral => "mixtral",
            Family::Olmoe => "olmoe",
        }
    }
}

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs (i, i + d/2): HF `rotate_half`, llama.cpp NEOX.
    HalfSplit,
    /// Pairs (2i, 2i+1): llama.cpp's normal mode (its converter permutes llama q/k to suit).
    Interleaved,
}

/// Where the q/k RMSNorm applies, if the family has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// One weight of `head_dim`, applied to each head (Qwen3).
    PerHead,
    /// One weight over all heads' concatenation (OLMoE).
    Whole,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub family: Family,
    pub vocab: usize,
    pub hidden: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_theta: f64,
    pub rope_layout: RopeLayout,
    /// Linear position scaling factor (1.0 = none).
    pub rope_linear_factor: f64,
    pub qk_norm: QkNorm,
    pub n_experts: usize,
    pub n_experts_used: usize,
    /// Intermediate size of one routed expert.
    pub expert_ffn: usize,
    /// Renormalise the top-k routing weights to sum to one.
    pub norm_topk_prob: bool,
    /// Context length the model was trained for (the run's `-c` may differ).
    pub train_ctx: usize,
    pub tie_embeddings: bool,
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
                .ok_or_else(|| ModelError::Config(format!("GGUF metadata {} is missing or not an integer", key(k))))
        };
        let opt_u = |k: &str| get(k).and_then(MetaValue::as_u64).map(|v| v as usize);
        let opt_f = |k: &str| get(k).and_then(MetaValue::as_f64);

        let n_experts = opt_u("expert_count").unwrap_or(0);
        let family = match arch.as_str() {
            "qwen3moe" => Family::Qwen3Moe,
            "olmoe" => Family::Olmoe,
            "llama" if n_experts > 0 => Family::Mixtral,
            "llama" => return Err(ModelError::Config("GGUF architecture llama without experts (dense models are not supported)".into())),
            other => return Err(ModelError::Config(format!("unknown architecture {other:?} (supported: qwen3moe, llama with experts (Mixtral), olmoe)"))),
        };
        let hidden = req_u("embedding_length")?;
        let n_heads = req_u("attention.head_count")?;
        let n_kv_heads = opt_u("attention.head_count_kv").unwrap_or(n_heads);
        let head_dim = opt_u("attention.key_length").unwrap_or(hidden / n_heads.max(1));
        let vocab = match opt_u("vocab_size") {
            Some(v) => v,
            None => files
                .tensor("token_embd.weight")
                .and_then(|t| t.shape.first().copied())
                .map(|v| v as usize)
                .ok_or_else(|| ModelError::Config("cannot tell the vocabulary size: no vocab_size and no token_embd.weight".into()))?,
        };
        let expert_ffn = match opt_u("expert_feed_forward_length") {
            Some(v) => v,
            None => req_u("feed_forward_length")?,
        };
        let scaling = get("rope.scaling.type").and_then(MetaValue::as_str).unwrap_or("none");
        let rope_linear_factor = match scaling {
            "none" => 1.0,
            "linear" => opt_f("rope.scaling.factor").unwrap_or(1.0),
            other => return Err(ModelError::Config(format!("{}: rope scaling {other:?} is not supported for {arch}", key("rope.scaling.type")))),
        };
        let default_norm = !matches!(family, Family::Olmoe);
        let cfg = ModelConfig {
            family,
            vocab,
            hidden,
            n_layers: req_u("block_count")?,
            n_heads,
            n_kv_heads,
            head_dim,
            rms_eps: opt_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-6) as f32,
            rope_theta: opt_f("rope.freq_base").unwrap_or(10000.0),
            rope_layout: match family {
                Family::Mixtral => RopeLayout::Interleaved,
                Family::Qwen3Moe | Family::Olmoe => RopeLayout::HalfSplit,
            },
            rope_linear_factor,
            qk_norm: QkNorm::None, // decided from tensor shapes by the loader
            n_experts,
            n_experts_used: req_u("expert_used_count")?,
            expert_ffn,
            norm_topk_prob: get("expert_weights_norm").and_then(MetaValue::as_bool).unwrap_or(default_norm),
            train_ctx: opt_u("context_length").unwrap_or(4096),
            tie_embeddings: files.tensor("output.weight").is_none(),
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
            .ok_or_else(|| ModelError::Config("config.json: no architectures or model_type".into()))?;
        let family = match arch {
            "Qwen3MoeForCausalLM" | "qwen3_moe" => Family::Qwen3Moe,
            "MixtralForCausalLM" | "mixtral" => Family::Mixtral,
            "OlmoeForCausalLM" | "olmoe" => Family::Olmoe,
            other => {
                return Err(ModelError::Config(format!(
                    "config.json: unknown architecture {other:?} (supported: Qwen3MoeForCausalLM, MixtralForCausalLM, OlmoeForCausalLM)"
                )))
            }
        };
        let req_u = |k: &str| -> Result<usize, ModelError> {
            cfg.get(k)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| ModelError::Config(format!("config.json: {k} is missing or not an integer")))
        };
        let opt_u = |k: &str| cfg.get(k).and_then(Value::as_u64).map(|v| v as usize);
        let opt_f = |k: &str| cfg.get(k).and_then(Value::as_f64);
        let hidden = req_u("hidden_size")?;
        let n_heads = req_u("num_attention_heads")?;
        // transformers 5 moved rope settings into `rope_parameters`; older configs have them top-level.
        let rope = cfg.get("rope_parameters").or_else(|| cfg.get("rope_scaling")).filter(|v| v.is_object());
        let rope_theta = rope
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .or_else(|| opt_f("rope_theta"))
            .unwrap_or(10000.0);
        let rope_type = rope
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let rope_linear_factor = match rope_type {
            "default" => 1.0,
            "linear" => rope.and_then(|r| r.get("factor")).and_then(Value::as_f64).unwrap_or(1.0),
            other => return Err(ModelError::Config(format!("config.json: rope type {other:?} is not supported for {}", family.name()))),
        };
        // transformers 5 writes `num_local_experts` for every family; older configs `num_experts`.
        let n_experts = match opt_u("num_experts").or_else(|| opt_u("num_local_experts")) {
            Some(n) => n,
            None => return Err(ModelError::Config("config.json: neither num_experts nor num_local_experts is set".into())),
        };
        let expert_ffn = match family {
            Family::Qwen3Moe => req_u("moe_intermediate_size")?,
            Family::Mixtral | Family::Olmoe => req_u("intermediate_size")?,
        };
        if family == Family::Qwen3Moe {
            let step = opt_u("decoder_sparse_step").unwrap_or(1);
            let dense_layers = cfg.get("mlp_only_layers").and_then(Value::as_array).map(|a| a.len()).unwrap_or(0);
            if step != 1 || dense_layers != 0 {
                return Err(ModelError::Config("config.json: Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported".into()));
            }
        }
        let c = ModelConfig {
            family,
            vocab: req_u("vocab_size")?,
            hidden,
            n_layers: req_u("num_hidden_layers")?,
            n_heads,
            n_kv_heads: opt_u("num_key_value_heads").unwrap_or(n_heads),
            head_dim: opt_u("head_dim").unwrap_or(hidden / n_heads.max(1)),
            rms_eps: opt_f("rms_norm_eps").unwrap_or(1e-6) as f32,
            rope_theta,
            rope_layout: RopeLayout::HalfSplit,
            rope_linear_factor,
            qk_norm: match family {
                Family::Qwen3Moe => QkNorm::PerHead,
                Family::Olmoe => QkNorm::Whole,
                Family::Mixtral => QkNorm::None,
            },
            n_experts,
            n_experts_used: req_u("num_experts_per_tok")?,
            expert_ffn,
            norm_topk_prob: match family {
                Family::Mixtral => true,
                _ => cfg.get("norm_topk_prob").and_then(Value::as_bool).unwrap_or(false),
            },
            train_ctx: opt_u("max_position_embeddings").unwrap_or(4096),
            tie_embeddings: cfg.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
        };
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Config(m));
        if self.hidden == 0 || self.n_layers == 0 || self.n_heads == 0 || self.head_dim == 0 || self.vocab == 0 {
            return bad(format!("degenerate dimensions: hidden {}, layers {}, heads {}, head_dim {}, vocab {}", self.hidden, self.n_layers, self.n_heads, self.head_dim, self.vocab));
        }
        if self.n_kv_heads == 0 || self.n_heads % self.n_kv_heads != 0 {
            return bad(format!("{} attention heads is not a multiple of {} key/value heads", self.n_heads, self.n_kv_heads));
        }
        if self.head_dim % 2 != 0 {
            return bad(format!("head_dim {} is odd; rotary embeddings need pairs", self.head_dim));
        }
        if self.n_experts == 0 || self.n_experts_used == 0 || self.n_experts_used > self.n_experts {
            return bad(format!("{} experts used per token out of {}", self.n_experts_used, self.n_experts));
        }
        if self.expert_ffn == 0 {
            return bad("expert intermediate size is 0".into());
        }
        Ok(())
    }

    /// Query width (all heads) and key/value width (all kv heads).
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}
