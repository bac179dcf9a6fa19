//! DeepSeek-V4 (HF `DeepseekV4ForCausalLM`, `model_type` `deepseek_v4`): its config, its
//! tensors, its graph over `Backend` operations and the CPU arithmetic of those operations.
//!
//! What V4 computes (transformers 5.25 `models/deepseek_v4/modeling_deepseek_v4.py`, the
//! reference of tests/family_deepseek_v4.rs):
//! - Residual as `hc_mult` streams (manifold-constrained hyper-connections): before each
//!   sub-block a `HyperConnection` turns the (unweighted-RMS-normed) streams into `pre` (sigmoid
//!   plus eps: collapse weights), `post` (2 sigmoid: where the output goes) and `comb` (row
//!   softmax plus eps, then Sinkhorn column/row normalisation); after it, streams = post x out
//!   plus comb^T x streams. A `HyperHead` collapses the streams before the final norm.
//! - Attention: shared-KV MQA (one `head_dim` KV head read as key and value), q through a
//!   low-rank `q_a -> q_a_norm -> q_b` and a per-head unweighted RMSNorm, partial *interleaved*
//!   RoPE on the trailing `qk_rope_head_dim` values of each head, one sink logit per head, the
//!   output's rope slice rotated back by the query's angle, a grouped low-rank output
//!   projection (`o_a` per head group, then `o_b`). Every layer has a sliding window; CSA
//!   layers add compressed entries (overlapping windows of `2 m` tokens with stride `m`, a
//!   per-channel softmax pool with a learned position bias, RMSNorm, RoPE at the window start),
//!   of which a Lightning Indexer (its own smaller pool; `sum_h w_h relu(q_h . k)`) keeps the
//!   top `index_topk` per query; HCA layers add every compressed entry of windows of `m'`.
//!   A query sees an entry once its window has closed (`entry < (t + 1) / m`). Sliding layers
//!   rotate with the `main` rope, compressed layers with the `compress` one (YaRN possible,
//!   attention factor 1).
//! - MoE: `sqrtsoftplus` (or sigmoid / softmax) scores; top-k on score + selection bias, or on
//!   the first `hash` layers the frozen `tid2eid[token]` table; weights renormalised and scaled
//!   by `routed_scaling_factor`; routed and shared experts both use the SwiGLU with gate
//!   clamped above and up clamped both sides at `swiglu_limit`.
//! - MTP (not in transformers, which drops `mtp.*`): DeepSeek's own `MTPBlock`
//!   (inference/model.py), `V4Mtp` below, run by mtp.rs under `--mtp`.
//!
//! The cache: every position of every layer keeps one K row (its rotated KV, and, at the last
//! position of a closed window, the pooled entry and the indexer's pooled key) and one V row
//! (the compressor's and indexer's raw projections, which the next windows pool). So the
//! whole state is positional: truncation, snapshots and `--kv-dir` keep any prefix exactly.
//!
//! Owns: `SPEC`, `V4Params` (read from config.json or from llama.cpp's `deepseek4` GGUF keys,
//! unsupported features and unknown keys refused by name), the tensor names (DeepSeek's and
//! llama.cpp's, as tables), `V4Weights`, the graph (`Model::forward_v4`) and the CPU arithmetic of the V4
//! backend operations (`cpu_*`, called by cpu.rs's `// DeepSeek V4` block).
//! Does not own: the generic config reading (config.rs), the shared forward pieces.
//! Invariant: a config feature of V4 that changes the computation is implemented here or refused
//! with its name.

use super::backend::{At, Backend, Buf, Rows};
use super::blocks::{dot, rope_inv_freq, silu};
use super::config::{Family, ModelConfig, RopeLayout, RopeScaling};
use super::family::{self, BiasRule, FamilySpec, GgufKeys, HfKeys};
use super::gptoss::softmax_with_sink;
use super::{Model, ModelError, State};
use crate::dtype::DType;
use crate::format::{ByteRange, FileKind, ModelFiles, TensorInfo};
use crate::kernels::{self, Acts, Isa, WeightView};
use serde_json::Value;

/// Why `-ctk` / `-ctv` leave V4's caches f32: its compressed and sliding-window caches are read
/// as f32 rows by this file's attention and by the CUDA backend.
pub const KV_F32: &str =
    "DeepSeek-V4's compressed and window caches stay f32 (its attention reads f32 rows)";

pub static SPEC: FamilySpec = FamilySpec {
    family: Family::DeepseekV4,
    name: "deepseek4",
    // llama.cpp's name (gguf-py MODEL_ARCH.DEEPSEEK4; keys and tensors: `GGUF_KEYS`, `names`).
    gguf_archs: &["deepseek4"],
    hf_archs: &["DeepseekV4ForCausalLM", "deepseek_v4"],
    hf_moe: &[],
    gguf_rope_layout: RopeLayout::Interleaved,
    sigmoid_router: false,
    gguf_norm_topk: true,
    hf_norm_topk: Some(true),
    hf_expert_ffn_key: "moe_intermediate_size",
    hf_default_rope_theta: 10000.0,
    hf_attention_bias: BiasRule::Refused,
    clip_qkv: false,
    // llama.cpp's deepseek4 graph cancels YaRN's magnitude (attention factor 1).
    gguf_yarn_cancelled: true,
    hf_qk_norm: family::no_qk_norm,
    hf_sliding_window: family::no_sliding_window,
    gguf_window_pattern: false,
    hf_experts_refused: None,
    gpu_validated: true,
    gguf_hparams,
    hf_hparams,
};

/// The attention kind of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Sliding window only (`main` rope).
    Sliding,
    /// Compressed sparse attention: overlapping windows, indexer top-k (`compress` rope).
    Csa,
    /// Heavily compressed attention: every closed window's entry (`compress` rope).
    Hca,
}

/// Router scores from logits (`scoring_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Score {
    SqrtSoftplus,
    Sigmoid,
    Softmax,
}

/// V4's own hyperparameters (the shared ones live in `ModelConfig`).
#[derive(Clone, Debug, PartialEq)]
pub struct V4Params {
    pub kinds: Vec<LayerKind>,
    /// Layers routed by `tid2eid` (hash_moe).
    pub hash: Vec<bool>,
    pub csa_rate: usize,
    pub hca_rate: usize,
    pub window: usize,
    pub q_lora: usize,
    pub o_groups: usize,
    pub o_lora: usize,
    pub idx_heads: usize,
    pub idx_dim: usize,
    pub idx_topk: usize,
    pub hc: usize,
    pub hc_iters: usize,
    pub hc_eps: f32,
    pub limit: f32,
    pub rope_dim: usize,
    pub score: Score,
    pub routed_scale: f32,
    pub main_theta: f64,
    pub compress_theta: f64,
    pub compress_scaling: RopeScaling,
}

impl V4Params {
    /// Floats of one cached position's K row: [kv (hd) | pooled entry (hd) | indexer key].
    pub fn k_width(&self, hd: usize) -> usize {
        2 * hd + self.idx_dim
    }

    /// Floats of one cached position's V row: compressor kv and gate (2 hd each), indexer kv
    /// and gate (2 idx_dim each), all raw projections.
    pub fn v_width(&self, hd: usize) -> usize {
        4 * hd + 4 * self.idx_dim
    }

    /// Layer `l`'s attention kind; the MTP block (`l` = the layer count) is a sliding-window
    /// layer (no compressor tensors), as DeepSeek's `MTPBlock` is.
    pub fn kind(&self, l: usize) -> LayerKind {
        self.kinds.get(l).copied().unwrap_or(LayerKind::Sliding)
    }

    fn rate(&self, l: usize) -> usize {
        match self.kind(l) {
            LayerKind::Csa => self.csa_rate,
            LayerKind::Hca => self.hca_rate,
            LayerKind::Sliding => 0,
        }
    }
}

fn refuse<T>(m: String) -> Result<T, ModelError> {
    Err(ModelError::Config(m))
}

/// Every `deepseek4.` key llama.cpp's converter writes (DeepseekV4Model.set_gguf_parameters and
/// the generic text-model keys); any other is refused by name, since it could change the
/// computation. `rope.scaling.yarn_attn_factor` is read by neither: llama.cpp's deepseek4 graph
/// cancels YaRN's magnitude on the compressed layers (as transformers' attention factor 1 does).
const GGUF_KEYS: &[&str] = &[
    "block_count",
    "context_length",
    "embedding_length",
    "embedding_length_out",
    "feed_forward_length",
    "vocab_size",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "attention.q_lora_rank",
    "attention.sliding_window",
    "attention.indexer.head_count",
    "attention.indexer.key_length",
    "attention.indexer.top_k",
    "attention.output_group_count",
    "attention.output_lora_rank",
    "attention.compress_ratios",
    "attention.compress_rope_freq_base",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.yarn_attn_factor",
    "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
    "expert_count",
    "expert_used_count",
    "expert_gating_func",
    "expert_feed_forward_length",
    "expert_shared_count",
    "expert_weights_scale",
    "expert_weights_norm",
    "expert_group_count",
    "expert_group_used_count",
    "swiglu_clamp_exp",
    "swiglu_clamp_shexp",
    "hyper_connection.count",
    "hyper_connection.sinkhorn_iterations",
    "hyper_connection.epsilon",
    "hash_layer_count",
    "nextn_predict_layers",
];

/// V4Params from llama.cpp's `deepseek4` keys (llama.cpp's src/models/deepseek4.cpp reads the
/// same ones); the generic keys were read into `c` already.
fn gguf_hparams(k: &GgufKeys<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    let prefix = format!("{}.", k.arch);
    for key in k.files.meta_keys() {
        if let Some(rest) = key.strip_prefix(&prefix) {
            if !GGUF_KEYS.contains(&rest) {
                return refuse(format!(
                    "GGUF metadata {key}: not a DeepSeek-V4 key sluice knows (it may change the computation)"
                ));
            }
        }
    }
    let u = |s: &str| k.req_u(s);
    let f = |s: &str| {
        k.opt_f(s).ok_or_else(|| {
            ModelError::Config(format!(
                "GGUF metadata {} is missing or not a number",
                k.key(s)
            ))
        })
    };
    let arr = |s: &str| -> Result<&[crate::format::MetaValue], ModelError> {
        k.get(s)
            .and_then(crate::format::MetaValue::as_array)
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "GGUF metadata {} is missing or not an array",
                    k.key(s)
                ))
            })
    };
    let n = c.n_layers;
    // compress_ratios: 0 sliding, 4 CSA (with the indexer), any other HCA (llama.cpp itself
    // loads 128 only); one entry per block, MTP blocks included.
    let ratios = arr("attention.compress_ratios")?;
    if ratios.len() < n {
        return refuse(format!(
            "GGUF metadata {}: {} entries for {n} layers",
            k.key("attention.compress_ratios"),
            ratios.len()
        ));
    }
    let mut kinds = Vec::with_capacity(n);
    let mut hca_rate = None;
    for (l, r) in ratios.iter().take(n).enumerate() {
        kinds.push(match r.as_u64() {
            Some(0) => LayerKind::Sliding,
            Some(4) => LayerKind::Csa,
            Some(m) if m > 0 && m <= 512 && hca_rate.is_none_or(|h| h == m as usize) => {
                hca_rate = Some(m as usize);
                LayerKind::Hca
            }
            _ => {
                return refuse(format!(
                    "GGUF metadata {}[{l}] {r:?}: 0, 4 or one HCA rate (at most 512) per model are supported",
                    k.key("attention.compress_ratios")
                ))
            }
        });
    }
    let hashed = u("hash_layer_count")?;
    let score = match k.opt_u("expert_gating_func") {
        Some(4) => Score::SqrtSoftplus,
        Some(2) => Score::Sigmoid,
        Some(1) => Score::Softmax,
        x => {
            return refuse(format!(
                "GGUF metadata {} {x:?}: 4 (sqrtsoftplus), 2 (sigmoid) or 1 (softmax) expected",
                k.key("expert_gating_func")
            ))
        }
    };
    // One clamp for routed and shared experts in every layer (what the converter writes).
    let clamp = |s: &str| -> Result<Option<f32>, ModelError> {
        let Some(v) = k.get(s) else { return Ok(None) };
        let vals: Vec<f64> = match v.as_array() {
            Some(a) => a
                .iter()
                .filter_map(crate::format::MetaValue::as_f64)
                .collect(),
            None => v.as_f64().into_iter().collect(),
        };
        match vals.first() {
            Some(&x) if vals.iter().all(|y| *y == x) => Ok(Some(x as f32)),
            _ => refuse(format!(
                "GGUF metadata {}: one clamp for every layer is supported",
                k.key(s)
            )),
        }
    };
    let limit = clamp("swiglu_clamp_exp")?.ok_or_else(|| {
        ModelError::Config(format!(
            "GGUF metadata {} is missing",
            k.key("swiglu_clamp_exp")
        ))
    })?;
    if clamp("swiglu_clamp_shexp")?.is_some_and(|s| s != limit) {
        return refuse(format!(
            "GGUF metadata {}: a shared-expert clamp other than the routed one is not supported",
            k.key("swiglu_clamp_shexp")
        ));
    }
    if k.get("expert_weights_norm")
        .and_then(crate::format::MetaValue::as_bool)
        != Some(true)
    {
        return refuse(format!(
            "GGUF metadata {}: DeepSeek-V4 renormalises its top-k weights (true expected)",
            k.key("expert_weights_norm")
        ));
    }
    if u("expert_shared_count")? != 1 {
        return refuse(format!(
            "GGUF metadata {}: one shared expert is supported",
            k.key("expert_shared_count")
        ));
    }
    for key in ["expert_group_count", "expert_group_used_count"] {
        if k.opt_u(key).is_some_and(|g| g != 1) {
            return refuse(format!(
                "GGUF metadata {}: grouped routing is not part of DeepSeek-V4",
                k.key(key)
            ));
        }
    }
    if c.n_kv_heads != 1 || c.v_head_dim != c.head_dim {
        return refuse(format!(
            "GGUF metadata {} / {}: DeepSeek-V4 is shared-KV MQA (1 KV head, value_length = key_length)",
            k.key("attention.head_count_kv"),
            k.key("attention.value_length")
        ));
    }
    let hc = u("hyper_connection.count")?;
    if let Some(o) = k.opt_u("embedding_length_out") {
        if o != hc * c.hidden {
            return refuse(format!(
                "GGUF metadata {} {o}: hyper_connection.count x embedding_length = {} expected",
                k.key("embedding_length_out"),
                hc * c.hidden
            ));
        }
    }
    let v = V4Params {
        kinds,
        hash: (0..n).map(|l| l < hashed).collect(),
        csa_rate: 4,
        hca_rate: hca_rate.unwrap_or(128),
        window: u("attention.sliding_window")?,
        q_lora: u("attention.q_lora_rank")?,
        o_groups: u("attention.output_group_count")?,
        o_lora: u("attention.output_lora_rank")?,
        idx_heads: u("attention.indexer.head_count")?,
        idx_dim: u("attention.indexer.key_length")?,
        idx_topk: u("attention.indexer.top_k")?,
        hc,
        hc_iters: u("hyper_connection.sinkhorn_iterations")?,
        hc_eps: f("hyper_connection.epsilon")? as f32,
        limit,
        rope_dim: u("rope.dimension_count")?,
        score,
        routed_scale: f("expert_weights_scale")? as f32,
        main_theta: c.rope_theta,
        compress_theta: f("attention.compress_rope_freq_base")?,
        // llama.cpp applies rope.scaling.* to the compressed layers only, the sliding ones
        // rotate unscaled.
        compress_scaling: c.rope_scaling,
    };
    check_params(&v, c, "GGUF metadata")?;
    apply(v, c);
    Ok(())
}

/// What both formats set in the shared config once V4Params are read.
fn apply(v: V4Params, c: &mut ModelConfig) {
    c.n_dense_layers = 0;
    c.dense_ffn = 0;
    c.shared_ffn = c.expert_ffn;
    c.rotary_dim = v.rope_dim;
    c.rope_layout = RopeLayout::Interleaved;
    c.attn_sinks = true;
    c.routing.sigmoid = false;
    c.routing.norm_topk_prob = true;
    c.routing.scale = v.routed_scale;
    c.routing.n_group = 1;
    c.routing.topk_group = 1;
    // V4 keeps its window in V4Params (every layer has it), not in the shared field.
    c.sliding_window = None;
    // `num_nextn_predict_layers` stays as read: the MTP block (`mtp.0.*`, not part of
    // transformers' model) is loaded when the checkpoint has it (`load`) and runs under --mtp.
    c.v4 = Some(Box::new(v));
}

fn hf_hparams(k: &HfKeys<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    let v = read_params(k.cfg, c)?;
    apply(v, c);
    Ok(())
}

fn read_params(cfg: &Value, c: &ModelConfig) -> Result<V4Params, ModelError> {
    let n = c.n_layers;
    let u = |k: &str, d: usize| -> Result<usize, ModelError> {
        match cfg.get(k) {
            None | Some(Value::Null) => Ok(d),
            Some(x) => match x.as_u64() {
                Some(v) => Ok(v as usize),
                None => refuse(format!("config.json: {k} {x} is not an integer")),
            },
        }
    };
    let f = |k: &str, d: f64| -> Result<f64, ModelError> {
        match cfg.get(k) {
            None | Some(Value::Null) => Ok(d),
            Some(x) => match x.as_f64() {
                Some(v) if v.is_finite() => Ok(v),
                _ => refuse(format!("config.json: {k} {x} is not a number")),
            },
        }
    };
    for (key, what) in [
        ("quantization_config", "quantized (FP8/FP4) checkpoints"),
        ("attention_bias", "attention biases"),
        ("mlp_bias", "MLP biases"),
    ] {
        match cfg.get(key) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => {}
            Some(x) => {
                return refuse(format!(
                    "config.json: {key} {x}: {what} are not supported for DeepSeek-V4"
                ))
            }
        }
    }
    if u("num_key_value_heads", 1)? != 1 {
        return refuse(
            "config.json: num_key_value_heads must be 1 for DeepSeek-V4 (shared-KV MQA)".into(),
        );
    }
    if u("n_shared_experts", 1)? != 1 {
        return refuse(format!(
            "config.json: n_shared_experts {} is not supported for DeepSeek-V4 (transformers builds one shared expert)",
            u("n_shared_experts", 1)?
        ));
    }
    let rates = cfg.get("compress_rates");
    let rate = |name: &str, d: usize| -> Result<usize, ModelError> {
        match rates.and_then(|r| r.get(name)) {
            None => Ok(d),
            Some(x) => match x.as_u64() {
                Some(v) if v > 0 => Ok(v as usize),
                _ => refuse(format!(
                    "config.json: compress_rates.{name} {x} is not a positive integer"
                )),
            },
        }
    };
    let csa_rate = rate("compressed_sparse_attention", u("compress_rate_csa", 4)?)?;
    let hca_rate = rate("heavily_compressed_attention", u("compress_rate_hca", 128)?)?;
    if csa_rate > 256 || hca_rate > 512 {
        return refuse(format!(
            "config.json: compress_rates {csa_rate} (CSA) / {hca_rate} (HCA): at most 256 / 512 are supported"
        ));
    }
    let kinds: Vec<LayerKind> = match cfg.get("layer_types") {
        Some(Value::Array(a)) if a.len() == n => {
            let mut out = Vec::with_capacity(n);
            for (l, t) in a.iter().enumerate() {
                out.push(match t.as_str() {
                    Some("sliding_attention") => LayerKind::Sliding,
                    Some("compressed_sparse_attention") => LayerKind::Csa,
                    Some("heavily_compressed_attention") => LayerKind::Hca,
                    _ => {
                        return refuse(format!(
                            "config.json: layer_types[{l}] {t} is not a DeepSeek-V4 layer type"
                        ))
                    }
                });
            }
            out
        }
        None | Some(Value::Null) => match cfg.get("compress_ratios") {
            Some(Value::Array(a)) if a.len() >= n => {
                let mut out = Vec::with_capacity(n);
                for (l, r) in a.iter().take(n).enumerate() {
                    out.push(match r.as_u64() {
                        Some(0) => LayerKind::Sliding,
                        Some(4) => LayerKind::Csa,
                        Some(128) => LayerKind::Hca,
                        _ => {
                            return refuse(format!(
                                "config.json: compress_ratios[{l}] {r} is not 0, 4 or 128"
                            ))
                        }
                    });
                }
                out
            }
            _ => (0..n)
                .map(|l| match l {
                    0 | 1 => LayerKind::Hca,
                    l if (l - 2) % 2 == 1 => LayerKind::Csa,
                    _ => LayerKind::Hca,
                })
                .collect(),
        },
        Some(x) => {
            return refuse(format!(
                "config.json: layer_types {x} is not a list of {n} layer types"
            ))
        }
    };
    let hash: Vec<bool> = match cfg.get("mlp_layer_types") {
        Some(Value::Array(a)) if a.len() == n => {
            let mut out = Vec::with_capacity(n);
            for (l, t) in a.iter().enumerate() {
                out.push(match t.as_str() {
                    Some("hash_moe") => true,
                    Some("moe") => false,
                    _ => {
                        return refuse(format!(
                            "config.json: mlp_layer_types[{l}] {t} is not hash_moe or moe"
                        ))
                    }
                });
            }
            out
        }
        None | Some(Value::Null) => {
            let h = u("num_hash_layers", 3)?;
            (0..n).map(|l| l < h).collect()
        }
        Some(x) => {
            return refuse(format!(
                "config.json: mlp_layer_types {x} is not a list of {n} MoE layer types"
            ))
        }
    };
    let score = match cfg
        .get("scoring_func")
        .and_then(Value::as_str)
        .unwrap_or("sqrtsoftplus")
    {
        "sqrtsoftplus" => Score::SqrtSoftplus,
        "sigmoid" => Score::Sigmoid,
        "softmax" => Score::Softmax,
        s => {
            return refuse(format!(
                "config.json: scoring_func {s:?} is not supported for DeepSeek-V4 (sqrtsoftplus, sigmoid, softmax)"
            ))
        }
    };
    let hd = c.head_dim;
    let partial = match cfg.get("partial_rotary_factor") {
        Some(x) if !x.is_null() => x.as_f64().unwrap_or(-1.0),
        _ => match cfg.get("qk_rope_head_dim").and_then(Value::as_u64) {
            Some(r) => r as f64 / hd as f64,
            None => 64.0 / 512.0,
        },
    };
    let rope_dim = (hd as f64 * partial) as usize;
    if rope_dim == 0 || !rope_dim.is_multiple_of(2) || rope_dim > hd {
        return refuse(format!(
            "config.json: partial_rotary_factor {partial} gives {rope_dim} rotary dimensions of {hd}: must be even and within the head"
        ));
    }
    // Rope: `rope_parameters` nested as {main, compress} (saved configs), or flat YaRN keys
    // for the compressed layers (as DeepseekV4Config folds them).
    let rp = cfg
        .get("rope_parameters")
        .or_else(|| cfg.get("rope_scaling"));
    let main_theta = f("rope_theta", 10000.0)?;
    let compress_theta = f("compress_rope_theta", 160000.0)?;
    let (main, compress) = match rp {
        Some(r) if r.get("main").is_some_and(Value::is_object) => {
            (r.get("main"), r.get("compress"))
        }
        Some(r) if r.is_object() => (None, Some(r)),
        _ => (None, None),
    };
    let theta_of = |d: Option<&Value>, dflt: f64| {
        d.and_then(|d| d.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(dflt)
    };
    let rtype = |d: Option<&Value>| {
        d.and_then(|d| d.get("rope_type").or_else(|| d.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_string()
    };
    if rtype(main) != "default" {
        return refuse(format!(
            "config.json: rope_parameters.main.rope_type {:?} is not supported for DeepSeek-V4 (default)",
            rtype(main)
        ));
    }
    let main_theta = theta_of(main, main_theta);
    let compress_theta = theta_of(compress, compress_theta);
    let compress_scaling = match rtype(compress).as_str() {
        "default" => RopeScaling::None,
        "yarn" => {
            let r = compress.expect("yarn implies a dict");
            let g = |k: &str| r.get(k).and_then(Value::as_f64);
            let factor = g("factor").unwrap_or(1.0);
            let orig = g("original_max_position_embeddings")
                .or_else(|| cfg.get("original_max_position_embeddings").and_then(Value::as_f64))
                .unwrap_or(c.train_ctx as f64);
            RopeScaling::Yarn {
                factor,
                orig_ctx: orig,
                beta_fast: g("beta_fast").unwrap_or(32.0),
                beta_slow: g("beta_slow").unwrap_or(1.0),
                // DeepseekV4Config forces attention_factor 1.0 for the compressed layers.
                attention_factor: g("attention_factor").unwrap_or(1.0),
                truncate: r.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            }
        }
        t => {
            return refuse(format!(
                "config.json: rope_parameters.compress.rope_type {t:?} is not supported for DeepSeek-V4 (default, yarn)"
            ))
        }
    };
    let p = V4Params {
        kinds,
        hash,
        csa_rate,
        hca_rate,
        window: u("sliding_window", 128)?,
        q_lora: u("q_lora_rank", 1024)?,
        o_groups: u("o_groups", 8)?,
        o_lora: u("o_lora_rank", 1024)?,
        idx_heads: u("index_n_heads", 64)?,
        idx_dim: u("index_head_dim", 128)?,
        idx_topk: u("index_topk", 512)?,
        hc: u("hc_mult", 4)?,
        hc_iters: u("hc_sinkhorn_iters", 20)?,
        hc_eps: f("hc_eps", 1e-6)? as f32,
        limit: f("swiglu_limit", 10.0)? as f32,
        rope_dim,
        score,
        routed_scale: f("routed_scaling_factor", 1.5)? as f32,
        main_theta,
        compress_theta,
        compress_scaling,
    };
    check_params(&p, c, "config.json")?;
    Ok(p)
}

/// Shape checks shared by both formats (`what` names the source in errors).
fn check_params(p: &V4Params, c: &ModelConfig, what: &str) -> Result<(), ModelError> {
    let heads = c.n_heads;
    let rope_dim = p.rope_dim;
    if rope_dim == 0 || !rope_dim.is_multiple_of(2) || rope_dim > c.head_dim {
        return refuse(format!(
            "{what}: {rope_dim} rotary dimensions of {}: must be even and within the head",
            c.head_dim
        ));
    }
    if p.hc > 6 {
        return refuse(format!(
            "{what}: hc_mult {}: at most 6 hyper-connection streams are supported",
            p.hc
        ));
    }
    if p.window == 0
        || p.q_lora == 0
        || p.o_groups == 0
        || !heads.is_multiple_of(p.o_groups)
        || p.hc == 0
        || p.hc_iters == 0
        || p.idx_heads == 0
        || p.idx_dim < rope_dim
        || p.idx_topk == 0
    {
        return refuse(format!(
            "{what}: inconsistent DeepSeek-V4 shape: sliding_window {}, q_lora_rank {}, o_groups {} of {heads} heads, hc_mult {}, hc_sinkhorn_iters {}, index_n_heads {}, index_head_dim {} (rope {rope_dim}), index_topk {}",
            p.window, p.q_lora, p.o_groups, p.hc, p.hc_iters, p.idx_heads, p.idx_dim, p.idx_topk
        ));
    }
    if p.hash.iter().any(|h| *h) && c.n_experts_used > c.n_experts {
        return refuse(format!("{what}: more experts per token than experts"));
    }
    Ok(())
}

/// Tensor names: DeepSeek's own (what transformers' `save_pretrained` writes back and the
/// released checkpoints use), under `model.` or at the top level; `{l}` the layer, `{e}` the
/// expert. Each entry lists alternatives tried in order.
pub mod names {
    pub const EMBED: &[&str] = &["embed_tokens.weight", "embed.weight"];
    pub const HEAD: &[&str] = &["head.weight", "lm_head.weight"];
    pub const NORM: &[&str] = &["norm.weight"];
    pub const HC_HEAD_FN: &[&str] = &["hc_head.hc_fn", "hc_head_fn"];
    pub const HC_HEAD_BASE: &[&str] = &["hc_head.hc_base", "hc_head_base"];
    pub const HC_HEAD_SCALE: &[&str] = &["hc_head.hc_scale", "hc_head_scale"];
    /// The first MTP block's prefix (DeepSeek's checkpoint); its block tensors follow with the
    /// per-layer names below, plus `e_proj`, `h_proj`, `enorm`, `hnorm`, `norm` (`.weight`)
    /// and `hc_head_fn` / `_base` / `_scale`.
    pub const MTP: &str = "mtp.0.";
    /// Per layer, after `layers.{l}.`.
    pub const ATTN_NORM: &str = "attn_norm.weight";
    pub const FFN_NORM: &str = "ffn_norm.weight";
    /// `hc_attn_` / `hc_ffn_` + fn, base, scale.
    pub const HC: [&str; 2] = ["hc_attn_", "hc_ffn_"];
    pub const ATTN: &str = "attn.";
    pub const Q_A: &str = "wq_a.weight";
    pub const Q_A_NORM: &str = "q_norm.weight";
    pub const Q_B: &str = "wq_b.weight";
    pub const KV: &str = "wkv.weight";
    pub const KV_NORM: &str = "norm.weight";
    pub const O_A: &str = "wo_a.weight";
    pub const O_B: &str = "wo_b.weight";
    pub const SINKS: &str = "attn_sink";
    /// A compressor (under `attn.compressor.` or `attn.indexer.compressor.`).
    pub const POOL_KV: &str = "wkv.weight";
    pub const POOL_GATE: &str = "wgate.weight";
    pub const POOL_BIAS: &str = "ape";
    pub const POOL_NORM: &str = "norm.weight";
    pub const IDX_Q_B: &str = "indexer.wq_b.weight";
    pub const IDX_W: &str = "indexer.weights_proj.weight";
    pub const ROUTER: &str = "ffn.gate.weight";
    pub const ROUTER_BIAS: &str = "ffn.gate.bias";
    pub const TID2EID: &str = "ffn.gate.tid2eid";
    /// `ffn.experts.{e}.` + w1 (gate), w3 (up), w2 (down).
    pub const EXPERT: &str = "ffn.experts.{e}.";
    pub const SHARED: &str = "ffn.shared_experts.";

    /// llama.cpp's `deepseek4` names (gguf-py MODEL_ARCH.DEEPSEEK4, as its converter's
    /// `_map_dsv4_tensor_name` maps DeepSeek's): ours -> GGUF, outside the layers.
    pub const GGUF_ROOT: &[(&str, &str)] = &[
        ("embed_tokens.weight", "token_embd.weight"),
        ("embed.weight", "token_embd.weight"),
        ("head.weight", "output.weight"),
        ("lm_head.weight", "output.weight"),
        ("norm.weight", "output_norm.weight"),
        ("hc_head.hc_fn", "output_hc_fn.weight"),
        ("hc_head.hc_base", "output_hc_base.weight"),
        ("hc_head.hc_scale", "output_hc_scale.weight"),
    ];
    /// Ours after `layers.{l}.` -> GGUF after `blk.{l}.`.
    pub const GGUF_LAYER: &[(&str, &str)] = &[
        ("attn_norm.weight", "attn_norm.weight"),
        ("ffn_norm.weight", "ffn_norm.weight"),
        ("hc_attn_fn", "hc_attn_fn.weight"),
        ("hc_attn_base", "hc_attn_base.weight"),
        ("hc_attn_scale", "hc_attn_scale.weight"),
        ("hc_ffn_fn", "hc_ffn_fn.weight"),
        ("hc_ffn_base", "hc_ffn_base.weight"),
        ("hc_ffn_scale", "hc_ffn_scale.weight"),
        ("attn.wq_a.weight", "attn_q_a.weight"),
        ("attn.q_norm.weight", "attn_q_a_norm.weight"),
        ("attn.wq_b.weight", "attn_q_b.weight"),
        ("attn.wkv.weight", "attn_kv.weight"),
        ("attn.norm.weight", "attn_kv_a_norm.weight"),
        ("attn.wo_a.weight", "attn_output_a.weight"),
        ("attn.wo_b.weight", "attn_output_b.weight"),
        ("attn.attn_sink", "attn_sinks.weight"),
        ("attn.compressor.wkv.weight", "attn_compressor_kv.weight"),
        (
            "attn.compressor.wgate.weight",
            "attn_compressor_gate.weight",
        ),
        ("attn.compressor.ape", "attn_compressor_ape.weight"),
        ("attn.compressor.norm.weight", "attn_compressor_norm.weight"),
        (
            "attn.indexer.compressor.wkv.weight",
            "indexer_compressor_kv.weight",
        ),
        (
            "attn.indexer.compressor.wgate.weight",
            "indexer_compressor_gate.weight",
        ),
        (
            "attn.indexer.compressor.ape",
            "indexer_compressor_ape.weight",
        ),
        (
            "attn.indexer.compressor.norm.weight",
            "indexer_compressor_norm.weight",
        ),
        ("attn.indexer.wq_b.weight", "indexer.attn_q_b.weight"),
        ("attn.indexer.weights_proj.weight", "indexer.proj.weight"),
        ("ffn.gate.weight", "ffn_gate_inp.weight"),
        ("ffn.gate.bias", "exp_probs_b.bias"),
        ("ffn.gate.tid2eid", "ffn_gate_tid2eid.weight"),
        ("ffn.shared_experts.w1.weight", "ffn_gate_shexp.weight"),
        ("ffn.shared_experts.w3.weight", "ffn_up_shexp.weight"),
        ("ffn.shared_experts.w2.weight", "ffn_down_shexp.weight"),
    ];
    /// Routed experts stacked `[n_expert, rows, cols]`: gate (w1), up (w3), down (w2).
    pub const GGUF_EXPERTS: [&str; 3] = [
        "blk.{l}.ffn_gate_exps.weight",
        "blk.{l}.ffn_up_exps.weight",
        "blk.{l}.ffn_down_exps.weight",
    ];

    /// The GGUF name of one of ours (`layers.{l}.…` or a root name).
    pub fn gguf(rel: &str) -> Option<String> {
        if let Some(rest) = rel.strip_prefix("layers.") {
            let (l, rest) = rest.split_once('.')?;
            let g = GGUF_LAYER.iter().find(|(ours, _)| *ours == rest)?.1;
            return Some(format!("blk.{l}.{g}"));
        }
        GGUF_ROOT
            .iter()
            .find(|(ours, _)| *ours == rel)
            .map(|(_, g)| g.to_string())
    }
}

/// A hyper-connection's parameters (f32, small).
pub struct Hc {
    /// ((2 + hc) * hc, hc * hidden)
    pub fn_: Vec<f32>,
    pub base: Vec<f32>,
    pub scale: [f32; 3],
}

/// The final stream collapse.
pub struct HcHead {
    /// (hc, hc * hidden)
    pub fn_: Vec<f32>,
    pub base: Vec<f32>,
    pub scale: f32,
}

/// A compressor (CSA's main or indexer pool, or HCA's): projections to `coff * dim` and the
/// pool's position bias and norm.
pub struct Pool<'a> {
    pub kv: WeightView<'a>,   // (coff * dim, hidden)
    pub gate: WeightView<'a>, // (coff * dim, hidden)
    pub bias: Vec<f32>,       // (rate, coff * dim)
    pub norm: Vec<f32>,       // (dim)
}

/// CSA's Lightning Indexer.
pub struct Indexer<'a> {
    pub pool: Pool<'a>,
    pub q_b: WeightView<'a>, // (idx_heads * idx_dim, q_lora)
    pub w: WeightView<'a>,   // (idx_heads, hidden)
}

pub struct Attn<'a> {
    pub q_a: WeightView<'a>, // (q_lora, hidden)
    pub q_a_norm: Vec<f32>,  // (q_lora)
    pub q_b: WeightView<'a>, // (heads * hd, q_lora)
    pub kv: WeightView<'a>,  // (hd, hidden)
    pub kv_norm: Vec<f32>,   // (hd)
    pub o_a: WeightView<'a>, // (groups * o_lora, heads * hd / groups)
    pub o_b: WeightView<'a>, // (hidden, groups * o_lora)
    pub sinks: Vec<f32>,     // (heads)
    pub comp: Option<Pool<'a>>,
    pub indexer: Option<Indexer<'a>>,
}

pub struct Experts<'a> {
    /// Per expert: gate, up (ffn, hidden), down (hidden, ffn).
    pub gate: Vec<WeightView<'a>>,
    pub up: Vec<WeightView<'a>>,
    pub down: Vec<WeightView<'a>>,
    /// Where each expert's gate, up and down are in the files (what the streaming cache reads).
    pub ranges: Vec<[ByteRange; 3]>,
}

pub struct MoeW<'a> {
    pub router: WeightView<'a>, // (n_experts, hidden)
    pub bias: Vec<f32>,         // (n_experts) selection bias (zeros on hash layers)
    /// (vocab, k) expert ids of hash layers.
    pub tid2eid: Option<Vec<u32>>,
    pub experts: Experts<'a>,
    pub sh_gate: WeightView<'a>,
    pub sh_up: WeightView<'a>,
    pub sh_down: WeightView<'a>,
}

pub struct LayerW<'a> {
    pub attn_hc: Hc,
    pub ffn_hc: Hc,
    pub attn_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub attn: Attn<'a>,
    pub moe: MoeW<'a>,
}

/// Everything of V4 beyond the embedding, the final norm and the head (those are `Weights`'s).
pub struct V4Weights<'a> {
    pub layers: Vec<LayerW<'a>>,
    pub head: HcHead,
    /// The first MTP block (`mtp.0.*`), when the checkpoint has it.
    pub mtp: Option<V4Mtp<'a>>,
    /// (rope_dim / 2) inverse frequencies of the `main` and `compress` ropes, and their cos/sin
    /// scale.
    pub main_freq: (Vec<f32>, f32),
    pub compress_freq: (Vec<f32>, f32),
}

/// DeepSeek's `MTPBlock` (inference/model.py): slot s takes the main model's hc streams after
/// its last block at position s and the token of position s + 1:
/// `x_j = e_proj(enorm(embed(t))) + h_proj(hnorm(stream_j))` for each stream j, then a full V4
/// block (cache layer `n_layers`, sliding-window attention, top-k MoE), then its own HyperHead,
/// `norm` and the main head. Chained drafts feed the block's output streams back in.
pub struct V4Mtp<'a> {
    pub e_proj: WeightView<'a>, // (hidden, hidden)
    pub h_proj: WeightView<'a>, // (hidden, hidden)
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    pub norm: Vec<f32>,
    pub head: HcHead,
    pub layer: LayerW<'a>,
}

struct Loader<'a, 'c> {
    files: &'a ModelFiles,
    c: &'c ModelConfig,
}

impl<'a> Loader<'a, '_> {
    /// The first of `rels` present under `model.` or at the top level.
    fn t_any(&self, rels: &[&str]) -> Result<&'a TensorInfo, ModelError> {
        if self.gguf() {
            let gname = |r: &str| {
                names::gguf(r).ok_or_else(|| {
                    ModelError::MissingTensor(format!("{r} (no deepseek4 GGUF name)"))
                })
            };
            for r in rels {
                if let Some(t) = self.files.tensor(&gname(r)?) {
                    return Ok(t);
                }
            }
            return Err(ModelError::MissingTensor(gname(rels[0])?));
        }
        for r in rels {
            for pre in ["model.", ""] {
                if let Some(t) = self.files.tensor(&format!("{pre}{r}")) {
                    return Ok(t);
                }
            }
        }
        Err(ModelError::MissingTensor(format!("model.{}", rels[0])))
    }

    fn gguf(&self) -> bool {
        self.files.kind() == FileKind::Gguf
    }

    fn t(&self, rel: &str) -> Result<&'a TensorInfo, ModelError> {
        self.t_any(&[rel])
    }

    fn shape(&self, t: &TensorInfo, want: &[usize]) -> Result<(), ModelError> {
        if t.shape.len() == want.len() && t.shape.iter().zip(want).all(|(a, b)| *a == *b as u64) {
            Ok(())
        } else {
            Err(ModelError::Shape(format!(
                "{}: shape {:?} in the file, config implies {want:?}",
                t.name, t.shape
            )))
        }
    }

    fn mat_any(
        &self,
        rels: &[&str],
        rows: usize,
        cols: usize,
    ) -> Result<WeightView<'a>, ModelError> {
        let t = self.t_any(rels)?;
        self.shape(t, &[rows, cols])?;
        kernels::kernels_for(t.dtype).map_err(|_| {
            ModelError::Unsupported(format!(
                "tensor `{}` has type {}, which sluice has no kernels for",
                t.name, t.dtype
            ))
        })?;
        WeightView::new(t.dtype, self.files.bytes(t)?, rows, cols)
            .map_err(|e| ModelError::Shape(format!("{}: {e}", t.name)))
    }

    fn mat(&self, rel: &str, rows: usize, cols: usize) -> Result<WeightView<'a>, ModelError> {
        self.mat_any(&[rel], rows, cols)
    }

    /// A small tensor of `shape` as f32.
    fn vec_any(&self, rels: &[&str], shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let t = self.t_any(rels)?;
        self.shape(t, shape)?;
        let n: usize = shape.iter().product();
        let mut out = vec![0f32; n];
        kernels::dequantize(t.dtype, self.files.bytes(t)?, &mut out)?;
        Ok(out)
    }

    fn vec(&self, rel: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        self.vec_any(&[rel], shape)
    }

    fn v(&self) -> &V4Params {
        self.c
            .v4
            .as_deref()
            .expect("a DeepSeek-V4 config has V4Params")
    }

    fn hc(&self, p: &str) -> Result<Hc, ModelError> {
        let (h, hc) = (self.c.hidden, self.v().hc);
        let mix = (2 + hc) * hc;
        let s = self.vec(&format!("{p}scale"), &[3])?;
        Ok(Hc {
            fn_: self.vec(&format!("{p}fn"), &[mix, hc * h])?,
            base: self.vec(&format!("{p}base"), &[mix])?,
            scale: [s[0], s[1], s[2]],
        })
    }

    fn pool(&self, p: &str, coff: usize, dim: usize, rate: usize) -> Result<Pool<'a>, ModelError> {
        let h = self.c.hidden;
        Ok(Pool {
            kv: self.mat(&format!("{p}{}", names::POOL_KV), coff * dim, h)?,
            gate: self.mat(&format!("{p}{}", names::POOL_GATE), coff * dim, h)?,
            bias: self.vec(&format!("{p}{}", names::POOL_BIAS), &[rate, coff * dim])?,
            norm: self.vec(&format!("{p}{}", names::POOL_NORM), &[dim])?,
        })
    }

    fn tid2eid(&self, rel: &str) -> Result<Vec<u32>, ModelError> {
        let (vocab, k, e) = (self.c.vocab, self.c.n_experts_used, self.c.n_experts);
        let t = self.t(rel)?;
        self.shape(t, &[vocab, k])?;
        let b = self.files.bytes(t)?;
        let ids: Vec<i64> = match t.dtype {
            DType::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
            DType::I32 => b
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64)
                .collect(),
            d => {
                return Err(ModelError::Unsupported(format!(
                    "{}: type {d}, expected I64 or I32 expert ids",
                    t.name
                )))
            }
        };
        let mut out = Vec::with_capacity(ids.len());
        for (i, id) in ids.into_iter().enumerate() {
            if id < 0 || id as usize >= e {
                return Err(ModelError::Config(format!(
                    "{}: entry {i} is expert {id}, outside 0..{e}",
                    t.name
                )));
            }
            out.push(id as u32);
        }
        Ok(out)
    }

    fn experts(&self, p: &str) -> Result<Experts<'a>, ModelError> {
        let (h, f, e) = (self.c.hidden, self.c.expert_ffn, self.c.n_experts);
        let mut x = Experts {
            gate: Vec::with_capacity(e),
            up: Vec::with_capacity(e),
            down: Vec::with_capacity(e),
            ranges: Vec::with_capacity(e),
        };
        if self.gguf() {
            // One [n_expert, rows, cols] tensor per projection; each expert is a slice.
            let l = p.trim_start_matches("layers.").trim_end_matches('.');
            let dims = [(f, h), (f, h), (h, f)];
            for (j, pat) in names::GGUF_EXPERTS.iter().enumerate() {
                let name = pat.replace("{l}", l);
                let t = self
                    .files
                    .tensor(&name)
                    .ok_or_else(|| ModelError::MissingTensor(name.clone()))?;
                let (rows, cols) = dims[j];
                self.shape(t, &[e, rows, cols])?;
                kernels::kernels_for(t.dtype).map_err(|_| {
                    ModelError::Unsupported(format!(
                        "tensor `{name}` has type {}, which sluice has no kernels for",
                        t.dtype
                    ))
                })?;
                let all = self.files.bytes(t)?;
                for i in 0..e {
                    let r = self.files.expert_range(t, i)?;
                    let start = (r.offset - t.range.offset) as usize;
                    let bytes = all.get(start..start + r.len as usize).ok_or_else(|| {
                        ModelError::Shape(format!("{name}: expert {i} lies outside the tensor"))
                    })?;
                    let view = WeightView::new(t.dtype, bytes, rows, cols)
                        .map_err(|err| ModelError::Shape(format!("{name}: {err}")))?;
                    [&mut x.gate, &mut x.up, &mut x.down][j].push(view);
                    if j == 0 {
                        x.ranges.push([r; 3]);
                    } else {
                        x.ranges[i][j] = r;
                    }
                }
            }
            return Ok(x);
        }
        for i in 0..e {
            let q = format!("{p}{}", names::EXPERT.replace("{e}", &i.to_string()));
            let n = [
                format!("{q}w1.weight"),
                format!("{q}w3.weight"),
                format!("{q}w2.weight"),
            ];
            x.gate.push(self.mat(&n[0], f, h)?);
            x.up.push(self.mat(&n[1], f, h)?);
            x.down.push(self.mat(&n[2], h, f)?);
            x.ranges.push([
                self.t(&n[0])?.range,
                self.t(&n[1])?.range,
                self.t(&n[2])?.range,
            ]);
        }
        Ok(x)
    }

    fn layer(&self, l: usize) -> Result<LayerW<'a>, ModelError> {
        let v = self.v();
        self.block(&format!("layers.{l}."), v.kinds[l], v.hash[l])
    }

    /// A block's weights under prefix `p` (`layers.{l}.`, or the MTP block's `mtp.0.`).
    fn block(&self, p: &str, kind: LayerKind, hash: bool) -> Result<LayerW<'a>, ModelError> {
        let c = self.c;
        let v = self.v();
        let (h, hd, heads) = (c.hidden, c.head_dim, c.n_heads);
        let a = format!("{p}{}", names::ATTN);
        let (comp, indexer) = match kind {
            LayerKind::Sliding => (None, None),
            LayerKind::Hca => (
                Some(self.pool(&format!("{a}compressor."), 1, hd, v.hca_rate)?),
                None,
            ),
            LayerKind::Csa => (
                Some(self.pool(&format!("{a}compressor."), 2, hd, v.csa_rate)?),
                Some(Indexer {
                    pool: self.pool(
                        &format!("{a}indexer.compressor."),
                        2,
                        v.idx_dim,
                        v.csa_rate,
                    )?,
                    q_b: self.mat(
                        &format!("{a}{}", names::IDX_Q_B),
                        v.idx_heads * v.idx_dim,
                        v.q_lora,
                    )?,
                    w: self.mat(&format!("{a}{}", names::IDX_W), v.idx_heads, h)?,
                }),
            ),
        };
        let attn = Attn {
            q_a: self.mat(&format!("{a}{}", names::Q_A), v.q_lora, h)?,
            q_a_norm: self.vec(&format!("{a}{}", names::Q_A_NORM), &[v.q_lora])?,
            q_b: self.mat(&format!("{a}{}", names::Q_B), heads * hd, v.q_lora)?,
            kv: self.mat(&format!("{a}{}", names::KV), hd, h)?,
            kv_norm: self.vec(&format!("{a}{}", names::KV_NORM), &[hd])?,
            o_a: self.mat(
                &format!("{a}{}", names::O_A),
                v.o_groups * v.o_lora,
                heads * hd / v.o_groups,
            )?,
            o_b: self.mat(&format!("{a}{}", names::O_B), h, v.o_groups * v.o_lora)?,
            sinks: self.vec(&format!("{a}{}", names::SINKS), &[heads])?,
            comp,
            indexer,
        };
        let e = c.n_experts;
        let (bias, tid2eid) = if hash {
            (
                vec![0.0; e],
                Some(self.tid2eid(&format!("{p}{}", names::TID2EID))?),
            )
        } else {
            (self.vec(&format!("{p}{}", names::ROUTER_BIAS), &[e])?, None)
        };
        let f = c.expert_ffn;
        let sh = format!("{p}{}", names::SHARED);
        let moe = MoeW {
            router: self.mat(&format!("{p}{}", names::ROUTER), e, h)?,
            bias,
            tid2eid,
            experts: self.experts(p)?,
            sh_gate: self.mat(&format!("{sh}w1.weight"), f, h)?,
            sh_up: self.mat(&format!("{sh}w3.weight"), f, h)?,
            sh_down: self.mat(&format!("{sh}w2.weight"), h, f)?,
        };
        Ok(LayerW {
            attn_hc: self.hc(&format!("{p}{}", names::HC[0]))?,
            ffn_hc: self.hc(&format!("{p}{}", names::HC[1]))?,
            attn_norm: self.vec(&format!("{p}{}", names::ATTN_NORM), &[h])?,
            ffn_norm: self.vec(&format!("{p}{}", names::FFN_NORM), &[h])?,
            attn,
            moe,
        })
    }
}

/// The embedding, final norm and head, and V4's own weights.
#[allow(clippy::type_complexity)]
pub fn load<'a>(
    files: &'a ModelFiles,
    c: &ModelConfig,
) -> Result<(WeightView<'a>, Vec<f32>, WeightView<'a>, V4Weights<'a>), ModelError> {
    let b = Loader { files, c };
    let v = b.v();
    let (h, vocab) = (c.hidden, c.vocab);
    let embed = b.mat_any(names::EMBED, vocab, h)?;
    let output = if c.tie_embeddings {
        embed
    } else {
        b.mat_any(names::HEAD, vocab, h)?
    };
    let norm = b.vec_any(names::NORM, &[h])?;
    let layers = (0..c.n_layers)
        .map(|l| b.layer(l))
        .collect::<Result<Vec<_>, _>>()?;
    let hc = v.hc;
    let head = HcHead {
        fn_: b.vec_any(names::HC_HEAD_FN, &[hc, hc * h])?,
        base: b.vec_any(names::HC_HEAD_BASE, &[hc])?,
        scale: b.vec_any(names::HC_HEAD_SCALE, &[1])?[0],
    };
    // The MTP block: DeepSeek's names (`mtp.0.`); llama.cpp's deepseek4 converter drops it, so
    // a GGUF has none.
    let p = names::MTP;
    let mtp = if c.n_mtp_layers > 0 && !b.gguf() && b.t(&format!("{p}e_proj.weight")).is_ok() {
        Some(V4Mtp {
            e_proj: b.mat(&format!("{p}e_proj.weight"), h, h)?,
            h_proj: b.mat(&format!("{p}h_proj.weight"), h, h)?,
            enorm: b.vec(&format!("{p}enorm.weight"), &[h])?,
            hnorm: b.vec(&format!("{p}hnorm.weight"), &[h])?,
            norm: b.vec(&format!("{p}norm.weight"), &[h])?,
            head: HcHead {
                fn_: b.vec(&format!("{p}hc_head_fn"), &[hc, hc * h])?,
                base: b.vec(&format!("{p}hc_head_base"), &[hc])?,
                scale: b.vec(&format!("{p}hc_head_scale"), &[1])?[0],
            },
            layer: b.block(p, LayerKind::Sliding, false)?,
        })
    } else {
        None
    };
    let main_freq = rope_inv_freq(v.rope_dim, v.main_theta, RopeScaling::None);
    let compress_freq = rope_inv_freq(v.rope_dim, v.compress_theta, v.compress_scaling);
    Ok((
        embed,
        norm,
        output,
        V4Weights {
            layers,
            head,
            mtp,
            main_freq,
            compress_freq,
        },
    ))
}

impl V4Weights<'_> {
    /// Byte ranges of every routed expert, `[layer][expert]`.
    pub fn expert_locs(&self) -> Vec<Vec<crate::experts::ExpertLoc>> {
        self.layers
            .iter()
            .map(|l| {
                l.moe
                    .experts
                    .ranges
                    .iter()
                    .map(|r| crate::experts::ExpertLoc { parts: *r })
                    .collect()
            })
            .collect()
    }
}

/// Per-sequence scratch of the V4 operations (empty for other families).
#[derive(Default)]
pub struct Scratch {
    /// (batch, hc, hidden) the residual streams.
    streams: Vec<f32>,
    /// (batch, hc) post weights and (batch, hc, hc) comb of the last `hc_pre`.
    post: Vec<f32>,
    comb: Vec<f32>,
    tmp: Vec<f32>,
    qr: Vec<f32>,
    kv: Vec<f32>,
    oa: Vec<f32>,
    grp: Vec<f32>,
    ckv: Vec<f32>,
    cgate: Vec<f32>,
    iq: Vec<f32>,
    iw: Vec<f32>,
    /// Per query: index scores and logits over the attended rows.
    iscore: Vec<f32>,
    isel: Vec<usize>,
    logits: Vec<f32>,
    rows: Vec<usize>,
    /// MoE: router logits / scores (batch, experts), chosen (batch, k) and weights.
    scores: Vec<f32>,
    sel: Vec<u32>,
    selw: Vec<f32>,
    needed: Vec<usize>,
    gathered: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    out: Vec<f32>,
}

impl Scratch {
    pub fn new(cfg: &ModelConfig, ctx: usize, batch: usize) -> Scratch {
        let Some(v) = cfg.v4.as_deref() else {
            return Scratch::default();
        };
        let (h, hd, heads, e, k, f) = (
            cfg.hidden,
            cfg.head_dim,
            cfg.n_heads,
            cfg.n_experts,
            cfg.n_experts_used,
            cfg.expert_ffn,
        );
        let hc = v.hc;
        let entries = ctx / v.csa_rate.min(v.hca_rate).max(1) + 1;
        Scratch {
            streams: vec![0.0; batch * hc * h],
            post: vec![0.0; batch * hc],
            comb: vec![0.0; batch * hc * hc],
            tmp: vec![0.0; hc * h],
            qr: vec![0.0; batch * v.q_lora],
            kv: vec![0.0; batch * hd],
            oa: vec![0.0; batch * v.o_groups * v.o_lora],
            grp: vec![0.0; batch * heads * hd / v.o_groups],
            ckv: vec![0.0; batch * 2 * hd.max(v.idx_dim)],
            cgate: vec![0.0; batch * 2 * hd.max(v.idx_dim)],
            iq: vec![0.0; batch * v.idx_heads * v.idx_dim],
            iw: vec![0.0; batch * v.idx_heads],
            iscore: vec![0.0; entries],
            isel: Vec::with_capacity(entries),
            logits: vec![0.0; v.window + entries],
            rows: Vec::with_capacity(v.window + entries),
            scores: vec![0.0; batch * e],
            sel: vec![0; batch * k],
            selw: vec![0.0; batch * k],
            needed: Vec::with_capacity(e),
            gathered: vec![0.0; batch * h],
            gate: vec![0.0; batch * f],
            up: vec![0.0; batch * f],
            down: vec![0.0; batch * h.max(v.o_lora)],
            out: vec![0.0; batch * k * h],
        }
    }
}

impl Model<'_> {
    /// V4's graph for one chunk: `tokens` at cache positions `pos..`, logits of rows
    /// `logits_from..` into `Logits` (every row's final-normed hidden state in `Hfin`).
    pub(crate) fn forward_v4<B: Backend + ?Sized>(
        &self,
        b: &mut B,
        w: &V4Weights<'_>,
        tokens: &[u32],
        pos: usize,
        logits_from: usize,
    ) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let (h, n) = (cfg.hidden, tokens.len());
        let xn = Rows::of(Buf::Xn, h);
        b.embed(&self.weights.token_embd, tokens, Buf::X)?;
        b.v4_hc_expand(n)?;
        let at = At { pos, rope: pos };
        for (l, lw) in w.layers.iter().enumerate() {
            let t = std::time::Instant::now();
            b.v4_hc_pre(&lw.attn_hc, n)?;
            b.rmsnorm(xn, xn, n, h, &lw.attn_norm, cfg.rms_eps)?;
            b.v4_attention(l, &lw.attn, w, n, at)?;
            b.v4_hc_post(n)?;
            b.prof().attention += t.elapsed().as_secs_f64();
            let t = std::time::Instant::now();
            b.v4_hc_pre(&lw.ffn_hc, n)?;
            b.rmsnorm(xn, xn, n, h, &lw.ffn_norm, cfg.rms_eps)?;
            b.v4_moe(l, &lw.moe, tokens, n)?;
            b.v4_hc_post(n)?;
            b.prof().experts += t.elapsed().as_secs_f64();
        }
        b.v4_hc_head(&w.head, n)?;
        let n_logits = n.saturating_sub(logits_from);
        b.rmsnorm(
            Rows::of(Buf::Hfin, h),
            Rows::of(Buf::X, h),
            n,
            h,
            &self.weights.output_norm,
            cfg.rms_eps,
        )?;
        if n_logits > 0 {
            let t = std::time::Instant::now();
            b.matmul(
                Rows::of(Buf::Hfin, h).from_row(logits_from),
                n_logits,
                &[(&self.weights.output, Buf::Logits)],
            )?;
            b.prof().lm_head += t.elapsed().as_secs_f64();
        }
        Ok(())
    }
}

// The MTP block (`V4Mtp`): its input is the main model's streams after the last block, which
// `forward_v4` leaves in the streams scratch (the HyperHead only reads them).
impl Model<'_> {
    /// DeepSeek's `MTPBlock.forward` over `tokens.len()` slots: slot j pairs `tokens[j]` with
    /// the streams in MTP input row j; the block is cache layer `n_layers`; logits of slots
    /// `logits_from..` into `MtpLogits`. The block's experts are read from the mapped files
    /// (not through a streaming expert cache, which holds the main layers only).
    pub(crate) fn mtp_graph_v4(
        &self,
        st: &mut State,
        w: &V4Weights<'_>,
        m: &V4Mtp<'_>,
        tokens: &[u32],
        at: At,
        logits_from: usize,
    ) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let (h, n, eps, hc) = (cfg.hidden, tokens.len(), cfg.rms_eps, params(self).hc);
        let xn = Rows::of(Buf::Xn, h);
        // e_proj(enorm(embed(t))) into X.
        {
            let mut b = super::cpu::CpuBackend::new(self, st);
            b.embed(&self.weights.token_embd, tokens, Buf::Xn)?;
            b.rmsnorm(xn, xn, n, h, &m.enorm, eps)?;
            b.matmul(xn, n, &[(&m.e_proj, Buf::X)])?;
        }
        // Stream j of slot i: h_proj(hnorm(input stream j)) + e_proj(...)[i]; the n * hc
        // normed streams go through h_proj n rows at a time.
        for r in 0..n * hc {
            let d = &mut st.mtp_cat[r * h..(r + 1) * h];
            d.copy_from_slice(&st.mtp_hidden[r * h..(r + 1) * h]);
            rms_weighted(d, &m.hnorm, eps);
        }
        for c in 0..hc {
            let rows = c * n * h..(c + 1) * n * h;
            mm(
                &m.h_proj,
                &st.mtp_cat[rows.clone()],
                n,
                &mut st.v4.streams[rows],
                &mut st.acts,
                &self.pool,
                self.isa,
            )?;
        }
        for i in 0..n {
            let e = &st.x[i * h..(i + 1) * h];
            for j in 0..hc {
                let d = &mut st.v4.streams[(i * hc + j) * h..(i * hc + j + 1) * h];
                d.iter_mut().zip(e).for_each(|(a, b)| *a += b);
            }
        }
        // The block, its HyperHead and norm, the main head; no streaming cache for its experts.
        let cache = st.expert_cache.take();
        let r = (|| -> Result<(), ModelError> {
            let mut b = super::cpu::CpuBackend::new(self, st);
            let (l, lw) = (cfg.n_layers, &m.layer);
            b.v4_hc_pre(&lw.attn_hc, n)?;
            b.rmsnorm(xn, xn, n, h, &lw.attn_norm, eps)?;
            b.v4_attention(l, &lw.attn, w, n, at)?;
            b.v4_hc_post(n)?;
            b.v4_hc_pre(&lw.ffn_hc, n)?;
            b.rmsnorm(xn, xn, n, h, &lw.ffn_norm, eps)?;
            b.v4_moe(l, &lw.moe, tokens, n)?;
            b.v4_hc_post(n)?;
            b.v4_hc_head(&m.head, n)?;
            let n_logits = n.saturating_sub(logits_from);
            b.rmsnorm(
                xn,
                Rows::of(Buf::X, h).from_row(logits_from),
                n_logits,
                h,
                &m.norm,
                eps,
            )?;
            if n_logits > 0 {
                b.matmul(xn, n_logits, &[(&self.weights.output, Buf::MtpLogits)])?;
            }
            Ok(())
        })();
        st.expert_cache = cache;
        r
    }
}

/// `len` floats of the streams scratch from float `at` (a row: `hc * hidden`).
pub(crate) fn streams_rows(st: &State, at: usize, len: usize) -> &[f32] {
    &st.v4.streams[at..at + len]
}

/// Copy `len` floats of the streams scratch from float `at` into the MTP input at float `dst`.
pub(crate) fn take_streams(st: &mut State, at: usize, len: usize, dst: usize) {
    st.mtp_hidden[dst..dst + len].copy_from_slice(&st.v4.streams[at..at + len]);
}

fn params<'m>(m: &'m Model<'_>) -> &'m V4Params {
    m.cfg
        .v4
        .as_deref()
        .expect("V4 operations run on a DeepSeek-V4 model")
}

/// y (n, w.rows) = x (n, w.cols) w^T.
fn mm(
    w: &WeightView<'_>,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    acts: &mut Acts,
    pool: &rayon::ThreadPool,
    isa: Isa,
) -> Result<(), ModelError> {
    acts.load(&x[..n * w.cols], n, w.cols);
    kernels::matmul(w, acts, &mut y[..n * w.rows], Some(pool), isa)?;
    Ok(())
}

/// x * rsqrt(mean(x^2) + eps) (transformers' unweighted RMSNorm), in place.
fn rms_unweighted(x: &mut [f32], eps: f32) {
    let ss: f64 = x.iter().map(|v| (*v as f64) * (*v as f64)).sum();
    let r = (1.0 / ((ss / x.len() as f64) + eps as f64).sqrt()) as f32;
    x.iter_mut().for_each(|v| *v *= r);
}

/// Weighted RMSNorm in place.
fn rms_weighted(x: &mut [f32], w: &[f32], eps: f32) {
    rms_unweighted(x, eps);
    x.iter_mut().zip(w).for_each(|(v, g)| *v *= g);
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Interleaved rotation of `x` (pairs (2i, 2i+1)) by `pos * freq[i]`, scaled by `mscale`;
/// `back`: by the opposite angle (V4 rotates the attention output back).
fn rotate(x: &mut [f32], freq: &(Vec<f32>, f32), pos: usize, back: bool) {
    let (inv, ms) = (&freq.0, freq.1);
    for (i, f) in inv.iter().enumerate() {
        let a = pos as f32 * f;
        let (c, s) = (a.cos() * ms, a.sin() * ms);
        let s = if back { -s } else { s };
        let (x0, x1) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = x0 * c - x1 * s;
        x[2 * i + 1] = x1 * c + x0 * s;
    }
}

/// Streams of rows 0..n = copies of `X` (the embedding in every stream).
pub(crate) fn cpu_hc_expand(m: &Model<'_>, st: &mut State, n: usize) -> Result<(), ModelError> {
    let (h, hc) = (m.cfg.hidden, params(m).hc);
    for i in 0..n {
        for j in 0..hc {
            let d = (i * hc + j) * h;
            st.v4.streams[d..d + h].copy_from_slice(&st.x[i * h..(i + 1) * h]);
        }
    }
    Ok(())
}

/// The mix of one hyper-connection for each row: `pre`-collapsed streams into `Xn`, `post`
/// and `comb` kept for `cpu_hc_post`.
pub(crate) fn cpu_hc_pre(
    m: &Model<'_>,
    st: &mut State,
    w: &Hc,
    n: usize,
) -> Result<(), ModelError> {
    let v = params(m);
    let (h, hc, eps, rms) = (m.cfg.hidden, v.hc, v.hc_eps, m.cfg.rms_eps);
    let s = &mut st.v4;
    let mix_n = (2 + hc) * hc;
    let mut mix = [0f32; 64];
    if mix_n > mix.len() {
        return Err(ModelError::Unsupported(format!(
            "hc_mult {hc}: at most 6 hyper-connection streams"
        )));
    }
    for i in 0..n {
        let streams = &s.streams[i * hc * h..(i + 1) * hc * h];
        s.tmp[..hc * h].copy_from_slice(streams);
        rms_unweighted(&mut s.tmp[..hc * h], rms);
        for (j, mv) in mix[..mix_n].iter_mut().enumerate() {
            *mv = dot(&w.fn_[j * hc * h..(j + 1) * hc * h], &s.tmp[..hc * h]);
        }
        let mut pre = [0f32; 8];
        for j in 0..hc {
            pre[j] = sigmoid(mix[j] * w.scale[0] + w.base[j]) + eps;
            s.post[i * hc + j] = 2.0 * sigmoid(mix[hc + j] * w.scale[1] + w.base[hc + j]);
        }
        let comb = &mut s.comb[i * hc * hc..(i + 1) * hc * hc];
        for a in 0..hc {
            let row = &mut comb[a * hc..(a + 1) * hc];
            for (b, r) in row.iter_mut().enumerate() {
                let k = 2 * hc + a * hc + b;
                *r = mix[k] * w.scale[2] + w.base[k];
            }
            let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for r in row.iter_mut() {
                *r = (*r - mx).exp();
                sum += *r;
            }
            for r in row.iter_mut() {
                *r = *r / sum + eps;
            }
        }
        let cols = |comb: &mut [f32]| {
            for b in 0..hc {
                let sum: f32 = (0..hc).map(|a| comb[a * hc + b]).sum();
                for a in 0..hc {
                    comb[a * hc + b] /= sum + eps;
                }
            }
        };
        cols(comb);
        for _ in 1..v.hc_iters {
            for a in 0..hc {
                let row = &mut comb[a * hc..(a + 1) * hc];
                let sum: f32 = row.iter().sum();
                row.iter_mut().for_each(|r| *r /= sum + eps);
            }
            cols(comb);
        }
        let out = &mut st.xn[i * h..(i + 1) * h];
        out.fill(0.0);
        for (j, p) in pre[..hc].iter().enumerate() {
            for (o, x) in out.iter_mut().zip(&streams[j * h..(j + 1) * h]) {
                *o += p * x;
            }
        }
    }
    Ok(())
}

/// Streams = post x `Proj` + comb^T x streams, for rows 0..n.
pub(crate) fn cpu_hc_post(m: &Model<'_>, st: &mut State, n: usize) -> Result<(), ModelError> {
    let (h, hc) = (m.cfg.hidden, params(m).hc);
    let s = &mut st.v4;
    for i in 0..n {
        let base = i * hc * h;
        let comb = &s.comb[i * hc * hc..(i + 1) * hc * hc];
        for o in 0..hc {
            let t = &mut s.tmp[o * h..(o + 1) * h];
            let p = s.post[i * hc + o];
            for (d, x) in t.iter_mut().zip(&st.proj[i * h..(i + 1) * h]) {
                *d = p * x;
            }
            for j in 0..hc {
                let c = comb[j * hc + o];
                for (d, x) in t
                    .iter_mut()
                    .zip(&s.streams[base + j * h..base + (j + 1) * h])
                {
                    *d += c * x;
                }
            }
        }
        s.streams[base..base + hc * h].copy_from_slice(&s.tmp[..hc * h]);
    }
    Ok(())
}

/// The final collapse of the streams into `X`.
pub(crate) fn cpu_hc_head(
    m: &Model<'_>,
    st: &mut State,
    w: &HcHead,
    n: usize,
) -> Result<(), ModelError> {
    let v = params(m);
    let (h, hc) = (m.cfg.hidden, v.hc);
    let s = &mut st.v4;
    for i in 0..n {
        let streams = &s.streams[i * hc * h..(i + 1) * hc * h];
        s.tmp[..hc * h].copy_from_slice(streams);
        rms_unweighted(&mut s.tmp[..hc * h], m.cfg.rms_eps);
        let out = &mut st.x[i * h..(i + 1) * h];
        out.fill(0.0);
        for j in 0..hc {
            let mix = dot(&w.fn_[j * hc * h..(j + 1) * hc * h], &s.tmp[..hc * h]);
            let p = sigmoid(mix * w.scale + w.base[j]) + v.hc_eps;
            for (o, x) in out.iter_mut().zip(&streams[j * h..(j + 1) * h]) {
                *o += p * x;
            }
        }
    }
    Ok(())
}

/// One pooled entry of window `win` from the raw rows of cache layer `l` (`kv_off` / `gate_off`:
/// where the projections sit in each V row, `coff * dim` wide): per channel, a softmax over the
/// window's positions (CSA: the previous window's low half, then this window's high half) of
/// gate + position bias, weighting kv; then RMSNorm and RoPE at the window's first position.
#[allow(clippy::too_many_arguments)]
fn pool_entry(
    vrows: &[f32],
    vw: usize,
    pool: &Pool<'_>,
    rate: usize,
    coff: usize,
    dim: usize,
    kv_off: usize,
    gate_off: usize,
    win: usize,
    eps: f32,
    freq: &(Vec<f32>, f32),
    rope_dim: usize,
    out: &mut [f32],
) {
    let wd = coff * dim;
    for (ch, o) in out.iter_mut().enumerate().take(dim) {
        // (gate, kv) of each slot: CSA's slots 0..rate from the previous window (channel ch,
        // low half), rate..2 rate from this one (high half); HCA's only this window's.
        let mut mx = f32::NEG_INFINITY;
        let mut slots = [(0f32, 0f32); 512];
        let mut ns = 0;
        if coff == 2 && win > 0 {
            for r in 0..rate {
                let row = &vrows[((win - 1) * rate + r) * vw..];
                let g = row[gate_off + ch] + pool.bias[r * wd + ch];
                slots[ns] = (g, row[kv_off + ch]);
                ns += 1;
                mx = mx.max(g);
            }
        }
        let hi = if coff == 2 { dim } else { 0 };
        for r in 0..rate {
            let row = &vrows[(win * rate + r) * vw..];
            let g = row[gate_off + hi + ch] + pool.bias[r * wd + hi + ch];
            slots[ns] = (g, row[kv_off + hi + ch]);
            ns += 1;
            mx = mx.max(g);
        }
        let (mut s, mut acc) = (0f32, 0f32);
        for &(g, kv) in &slots[..ns] {
            let e = (g - mx).exp();
            s += e;
            acc += e * kv;
        }
        *o = acc / s;
    }
    rms_weighted(&mut out[..dim], &pool.norm, eps);
    rotate(&mut out[dim - rope_dim..dim], freq, win * rate, false);
}

/// V4 attention of rows 0..n of `Xn` at positions `at.pos..` into `Proj` (see the module doc),
/// with its rows written to cache layer `l`.
pub(crate) fn cpu_attention(
    m: &Model<'_>,
    st: &mut State,
    l: usize,
    a: &Attn<'_>,
    w: &V4Weights<'_>,
    n: usize,
    pos: usize,
) -> Result<(), ModelError> {
    let v = params(m);
    let cfg = &m.cfg;
    let (h, hd, heads, eps) = (cfg.hidden, cfg.head_dim, cfg.n_heads, cfg.rms_eps);
    let (pool, isa) = (&m.pool, m.isa);
    let rd = v.rope_dim;
    let kind = v.kind(l);
    let freq = if kind == LayerKind::Sliding {
        &w.main_freq
    } else {
        &w.compress_freq
    };
    let (kw, vw) = (v.k_width(hd), v.v_width(hd));
    let ctx = st.ctx;
    if pos + n > ctx {
        return Err(ModelError::ContextFull {
            needed: pos + n,
            ctx,
        });
    }
    let s = &mut st.v4;
    // q: q_a -> q_a_norm (q residual) -> q_b -> per-head unweighted norm -> rope.
    mm(&a.q_a, &st.xn, n, &mut s.qr, &mut st.acts, pool, isa)?;
    for i in 0..n {
        rms_weighted(
            &mut s.qr[i * v.q_lora..(i + 1) * v.q_lora],
            &a.q_a_norm,
            eps,
        );
    }
    mm(&a.q_b, &s.qr, n, &mut st.q, &mut st.acts, pool, isa)?;
    for i in 0..n {
        for hh in 0..heads {
            let q = &mut st.q[(i * heads + hh) * hd..(i * heads + hh + 1) * hd];
            rms_unweighted(q, eps);
            rotate(&mut q[hd - rd..], freq, pos + i, false);
        }
    }
    // The shared kv: kv_proj -> kv_norm -> rope, into the K rows.
    mm(&a.kv, &st.xn, n, &mut s.kv, &mut st.acts, pool, isa)?;
    let kbase = l * ctx * kw;
    let vbase = l * ctx * vw;
    for i in 0..n {
        let kv = &mut s.kv[i * hd..(i + 1) * hd];
        rms_weighted(kv, &a.kv_norm, eps);
        rotate(&mut kv[hd - rd..], freq, pos + i, false);
        let r = kbase + (pos + i) * kw;
        st.kcache.f32s_mut()[r..r + hd].copy_from_slice(kv);
    }
    // The compressors: raw projections into the V rows, then every window that closes in this
    // chunk pooled into the K row of its last position.
    let rate = v.rate(l);
    let pools: [(Option<&Pool<'_>>, usize, usize, usize, usize); 2] = [
        (
            a.comp.as_ref(),
            if kind == LayerKind::Csa { 2 } else { 1 },
            hd,
            0,
            hd,
        ),
        (
            a.indexer.as_ref().map(|x| &x.pool),
            2,
            v.idx_dim,
            4 * hd,
            2 * hd,
        ),
    ];
    for &(p, coff, dim, voff, koff) in &pools {
        let Some(p) = p else { continue };
        let wd = coff * dim;
        mm(&p.kv, &st.xn, n, &mut s.ckv, &mut st.acts, pool, isa)?;
        mm(&p.gate, &st.xn, n, &mut s.cgate, &mut st.acts, pool, isa)?;
        for i in 0..n {
            let r = vbase + (pos + i) * vw + voff;
            st.vcache.f32s_mut()[r..r + wd].copy_from_slice(&s.ckv[i * wd..(i + 1) * wd]);
            st.vcache.f32s_mut()[r + 2 * dim..r + 2 * dim + wd]
                .copy_from_slice(&s.cgate[i * wd..(i + 1) * wd]);
        }
        for t in pos..pos + n {
            if (t + 1) % rate != 0 {
                continue;
            }
            let win = t / rate;
            let vrows = &st.vcache.f32s()[vbase..vbase + ctx * vw];
            let r = kbase + t * kw + koff;
            let out = &mut st.kcache.f32s_mut()[r..r + dim];
            pool_entry(
                vrows,
                vw,
                p,
                rate,
                coff,
                dim,
                voff,
                voff + 2 * dim,
                win,
                eps,
                &w.compress_freq,
                rd,
                out,
            );
        }
    }
    // Indexer queries and head weights.
    if let Some(ix) = &a.indexer {
        let (ih, id) = (v.idx_heads, v.idx_dim);
        mm(&ix.q_b, &s.qr, n, &mut s.iq, &mut st.acts, pool, isa)?;
        mm(&ix.w, &st.xn, n, &mut s.iw, &mut st.acts, pool, isa)?;
        let ws = (ih as f32).powf(-0.5);
        for i in 0..n {
            for hh in 0..ih {
                let q = &mut s.iq[(i * ih + hh) * id..(i * ih + hh + 1) * id];
                rotate(&mut q[id - rd..], &w.compress_freq, pos + i, false);
            }
            s.iw[i * ih..(i + 1) * ih].iter_mut().for_each(|x| *x *= ws);
        }
    }
    // Attention per query and head over its rows: the window, then the compressed entries.
    let scale = (hd as f32).powf(-0.5);
    for i in 0..n {
        let t = pos + i;
        s.rows.clear();
        let first = (t + 1).saturating_sub(v.window);
        for p in first..=t {
            s.rows.push(kbase + p * kw);
        }
        if kind != LayerKind::Sliding {
            let visible = (t + 1) / rate;
            s.isel.clear();
            if kind == LayerKind::Hca || visible <= v.idx_topk {
                s.isel.extend(0..visible);
            } else {
                let (ih, id) = (v.idx_heads, v.idx_dim);
                let sm = (id as f32).powf(-0.5);
                for e in 0..visible {
                    let key = &st.kcache.f32s()[kbase + ((e + 1) * rate - 1) * kw + 2 * hd..][..id];
                    let mut sc = 0f32;
                    for hh in 0..ih {
                        let q = &s.iq[(i * ih + hh) * id..(i * ih + hh + 1) * id];
                        sc += dot(q, key).max(0.0) * sm * s.iw[i * ih + hh];
                    }
                    s.iscore[e] = sc;
                }
                // The top idx_topk, ties to the lower entry.
                for _ in 0..v.idx_topk {
                    let mut best = usize::MAX;
                    for e in 0..visible {
                        if s.isel.contains(&e) {
                            continue;
                        }
                        if best == usize::MAX || s.iscore[e] > s.iscore[best] {
                            best = e;
                        }
                    }
                    s.isel.push(best);
                }
            }
            for &e in &s.isel {
                s.rows.push(kbase + ((e + 1) * rate - 1) * kw + hd);
            }
        }
        let nr = s.rows.len();
        for hh in 0..heads {
            let q = &st.q[(i * heads + hh) * hd..(i * heads + hh + 1) * hd];
            for (j, &r) in s.rows.iter().enumerate() {
                s.logits[j] = dot(q, &st.kcache.f32s()[r..r + hd]) * scale;
            }
            softmax_with_sink(&mut s.logits[..nr], a.sinks[hh]);
            let o = &mut st.att[(i * heads + hh) * hd..(i * heads + hh + 1) * hd];
            o.fill(0.0);
            for (j, &r) in s.rows.iter().enumerate() {
                let p = s.logits[j];
                for (x, k) in o.iter_mut().zip(&st.kcache.f32s()[r..r + hd]) {
                    *x += p * k;
                }
            }
            rotate(&mut o[hd - rd..], freq, t, true);
        }
    }
    // Grouped output projection: each group of heads through its block of o_a, then o_b.
    let g = v.o_groups;
    let gw = heads * hd / g;
    let orow = a.o_a.row_bytes();
    for gi in 0..g {
        for i in 0..n {
            s.grp[i * gw..(i + 1) * gw]
                .copy_from_slice(&st.att[i * heads * hd + gi * gw..i * heads * hd + (gi + 1) * gw]);
        }
        let wv = WeightView {
            dtype: a.o_a.dtype,
            bytes: &a.o_a.bytes[gi * v.o_lora * orow..(gi + 1) * v.o_lora * orow],
            rows: v.o_lora,
            cols: gw,
        };
        st.acts.load(&s.grp[..n * gw], n, gw);
        kernels::matmul(
            &wv,
            &mut st.acts,
            &mut s.down[..n * v.o_lora],
            Some(pool),
            isa,
        )?;
        let ow = g * v.o_lora;
        for i in 0..n {
            s.oa[i * ow + gi * v.o_lora..i * ow + (gi + 1) * v.o_lora]
                .copy_from_slice(&s.down[i * v.o_lora..(i + 1) * v.o_lora]);
        }
    }
    mm(&a.o_b, &s.oa, n, &mut st.proj, &mut st.acts, pool, isa)?;
    let _ = h;
    Ok(())
}

/// The clamped SwiGLU of V4's routed and shared experts, in place on `gate`.
fn clamped_silu(gate: &mut [f32], up: &[f32], limit: f32) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(g.min(limit)) * u.clamp(-limit, limit);
    }
}

fn v4_limit(m: &Model<'_>) -> f32 {
    params(m).limit
}

/// Expert `ex` (`ws`: gate, up, down) on the rows of `xn` that chose it; each row's output
/// into its slot of `s.out`.
#[allow(clippy::too_many_arguments)]
fn run_expert(
    s: &mut Scratch,
    xn: &[f32],
    acts: &mut Acts,
    ex: usize,
    ws: &[WeightView<'_>; 3],
    n: usize,
    k: usize,
    h: usize,
    f: usize,
    limit: f32,
    pool: &rayon::ThreadPool,
    isa: Isa,
) -> Result<(), ModelError> {
    let mut cnt = 0;
    for i in 0..n {
        if s.sel[i * k..(i + 1) * k].contains(&(ex as u32)) {
            s.gathered[cnt * h..(cnt + 1) * h].copy_from_slice(&xn[i * h..(i + 1) * h]);
            cnt += 1;
        }
    }
    mm(&ws[0], &s.gathered, cnt, &mut s.gate, acts, pool, isa)?;
    mm(&ws[1], &s.gathered, cnt, &mut s.up, acts, pool, isa)?;
    clamped_silu(&mut s.gate[..cnt * f], &s.up[..cnt * f], limit);
    mm(&ws[2], &s.gate, cnt, &mut s.down, acts, pool, isa)?;
    // Every slot of a row that chose `ex` (a hash table may repeat an expert in a row: each
    // slot then counts, as in transformers).
    let mut j = 0;
    for i in 0..n {
        let mut hit = false;
        for slot in 0..k {
            if s.sel[i * k + slot] == ex as u32 {
                let d = (i * k + slot) * h;
                s.out[d..d + h].copy_from_slice(&s.down[j * h..(j + 1) * h]);
                hit = true;
            }
        }
        j += usize::from(hit);
    }
    Ok(())
}

/// V4's MoE block on rows 0..n of `Xn` into `Proj`.
pub(crate) fn cpu_moe(
    m: &Model<'_>,
    st: &mut State,
    l: usize,
    w: &MoeW<'_>,
    tokens: &[u32],
    n: usize,
) -> Result<(), ModelError> {
    let v = params(m);
    let cfg = &m.cfg;
    let (h, e, k, f) = (
        cfg.hidden,
        cfg.n_experts,
        cfg.n_experts_used,
        cfg.expert_ffn,
    );
    let (pool, isa) = (&m.pool, m.isa);
    let s = &mut st.v4;
    mm(&w.router, &st.xn, n, &mut s.scores, &mut st.acts, pool, isa)?;
    for (i, &tok) in tokens.iter().enumerate().take(n) {
        let sc = &mut s.scores[i * e..(i + 1) * e];
        match v.score {
            Score::SqrtSoftplus => sc.iter_mut().for_each(|x| {
                let sp = if *x > 20.0 { *x } else { x.exp().ln_1p() };
                *x = sp.sqrt();
            }),
            Score::Sigmoid => sc.iter_mut().for_each(|x| *x = sigmoid(*x)),
            Score::Softmax => super::blocks::softmax(sc),
        }
        let sel = &mut s.sel[i * k..(i + 1) * k];
        if let Some(t2e) = &w.tid2eid {
            let t = tok as usize;
            sel.copy_from_slice(&t2e[t * k..(t + 1) * k]);
        } else {
            for j in 0..k {
                let mut best = usize::MAX;
                for x in 0..e {
                    if sel[..j].contains(&(x as u32)) {
                        continue;
                    }
                    if best == usize::MAX || sc[x] + w.bias[x] > sc[best] + w.bias[best] {
                        best = x;
                    }
                }
                sel[j] = best as u32;
            }
        }
        let sum: f32 = sel.iter().map(|&x| sc[x as usize]).sum();
        for j in 0..k {
            s.selw[i * k + j] = sc[sel[j] as usize] / (sum + 1e-20) * v.routed_scale;
        }
    }
    // The experts any row chose, ascending; each computed once for its rows, from the mapped
    // files or through the streaming cache (in waves of the layer's slots), in whatever order
    // they arrive: outputs land in their slots, so the sum below does not depend on it.
    s.needed.clear();
    for x in 0..e {
        if s.sel[..n * k].contains(&(x as u32)) {
            s.needed.push(x);
        }
    }
    let x = &w.experts;
    if let Some(mut cache) = st.expert_cache.take() {
        let r = (|| -> Result<(), ModelError> {
            let cap = cache.slots(l).max(1);
            let mut i = 0;
            while i < s.needed.len() {
                let start = i;
                let mut unpinned = 0;
                while i < s.needed.len() {
                    let pinned = cache.is_pinned(l, s.needed[i]);
                    if !pinned && unpinned == cap {
                        break;
                    }
                    unpinned += usize::from(!pinned);
                    i += 1;
                }
                let begun = cache.begin(l, &s.needed[start..i]);
                let wave = (|| -> Result<(), ModelError> {
                    begun?;
                    while let Some((ex, b)) = cache.next_ready()? {
                        let v = |w: &WeightView<'_>, bytes| WeightView { bytes, ..*w };
                        let ws = [
                            v(&x.gate[ex], b.gate),
                            v(&x.up[ex], b.up),
                            v(&x.down[ex], b.down),
                        ];
                        run_expert(
                            s,
                            &st.xn,
                            &mut st.acts,
                            ex,
                            &ws,
                            n,
                            k,
                            h,
                            f,
                            v4_limit(m),
                            pool,
                            isa,
                        )?;
                        st.experts_run += 1;
                    }
                    Ok(())
                })();
                cache.end();
                wave?;
            }
            Ok(())
        })();
        st.expert_cache = Some(cache);
        r?;
    } else {
        for j in 0..s.needed.len() {
            let ex = s.needed[j];
            let ws = [x.gate[ex], x.up[ex], x.down[ex]];
            run_expert(
                s,
                &st.xn,
                &mut st.acts,
                ex,
                &ws,
                n,
                k,
                h,
                f,
                v.limit,
                pool,
                isa,
            )?;
            st.experts_run += 1;
        }
    }
    // Shared expert, then each token's routed outputs in slot order.
    mm(&w.sh_gate, &st.xn, n, &mut s.gate, &mut st.acts, pool, isa)?;
    mm(&w.sh_up, &st.xn, n, &mut s.up, &mut st.acts, pool, isa)?;
    clamped_silu(&mut s.gate[..n * f], &s.up[..n * f], v.limit);
    mm(
        &w.sh_down,
        &s.gate,
        n,
        &mut st.proj,
        &mut st.acts,
        pool,
        isa,
    )?;
    for i in 0..n {
        let p = &mut st.proj[i * h..(i + 1) * h];
        for j in 0..k {
            let wt = s.selw[i * k + j];
            let o = &s.out[(i * k + j) * h..(i * k + j + 1) * h];
            for (d, x) in p.iter_mut().zip(o) {
                *d += wt * x;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotate_back_undoes_rotate() {
        let freq = rope_inv_freq(8, 10000.0, RopeScaling::None);
        let x0 = [0.3f32, -1.0, 2.0, 0.5, 0.1, 0.2, -0.7, 1.5];
        let mut x = x0;
        rotate(&mut x, &freq, 7, false);
        assert!(x.iter().zip(&x0).any(|(a, b)| (a - b).abs() > 1e-3));
        rotate(&mut x, &freq, 7, true);
        for (a, b) in x.iter().zip(&x0) {
            assert!((a - b).abs() < 1e-5, "{x:?}");
        }
    }

    #[test]
    fn clamped_silu_clamps_gate_above_and_up_both_sides() {
        let mut g = [3.0f32, -2.0];
        clamped_silu(&mut g, &[-5.0, 0.25], 1.0);
        assert!((g[0] + silu(1.0)).abs() < 1e-7);
        assert!((g[1] - silu(-2.0) * 0.25).abs() < 1e-7);
    }
}
