//! OpenAI gpt-oss (GGUF `gpt-oss`, HF `GptOssForCausalLM`): what the family reads from its
//! config, the names of its extra tensors, and its two pieces of arithmetic.
//!
//! The model: GQA attention with q/k/v/o biases and one learned "sink" logit per head that
//! joins every softmax (it takes probability mass and contributes no value); layers alternate
//! sliding-window (even layers) and full attention; YaRN RoPE without rounding the correction
//! range (`truncate: false`); a router with a bias whose top-k logits are softmaxed; experts
//! with biases on every projection and a clamped SwiGLU, `(clamp(up) + 1) * g * sigmoid(alpha
//! g)` with `g = min(gate, limit)`. References: transformers `models/gpt_oss/modeling_gpt_oss.py`
//! (5.25), llama.cpp `src/models/openai-moe-iswa.cpp` and its converter's `GptOssModel`.
//!
//! Owns: the family's `SPEC` and its hooks `hf_hparams` / `gguf_hparams` (the family's config
//! features, unsupported ones refused by name), the tensor names of sinks / output bias / router bias / expert biases, and
//! `clamped_swiglu` / `softmax_with_sink`. Does not own: the forward pass (it calls these).
//! Invariant: a config feature of gpt-oss that changes the computation is either implemented
//! here or refused with its name; none is ignored.

use super::config::{ExpertAct, Family, ModelConfig, RopeLayout, RopeScaling};
use super::family::{self, BiasRule, FamilySpec, GgufKeys, HfKeys};
use super::names::Role;
use super::ModelError;
use crate::format::{FileKind, ModelFiles};
use serde_json::Value;

pub static SPEC: FamilySpec = FamilySpec {
    family: Family::GptOss,
    name: "gpt-oss",
    gguf_archs: &["gpt-oss"],
    hf_archs: &["GptOssForCausalLM", "gpt_oss"],
    hf_moe: HF_MOE,
    gguf_rope_layout: RopeLayout::HalfSplit,
    sigmoid_router: false,
    // Softmax over the chosen logits = renormalised softmax.
    gguf_norm_topk: true,
    hf_norm_topk: Some(true),
    hf_expert_ffn_key: "intermediate_size",
    // No rope settings at all: the hook applies GptOssConfig's defaults.
    hf_default_rope_theta: 10000.0,
    // Read by the hook (default true, and it also biases o_proj).
    hf_attention_bias: BiasRule::Ignored,
    clip_qkv: false,
    gguf_yarn_cancelled: false,
    hf_qk_norm: family::no_qk_norm,
    // Read by the hook with the per-layer pattern.
    hf_sliding_window: family::no_sliding_window,
    // llama.cpp writes its alternating window as a per-layer pattern (read by the hook).
    gguf_window_pattern: true,
    hf_experts_refused: Some("MXFP4 *_blocks/*_scales or transposed gate_up_proj"),
    gpu_validated: true,
    gguf_hparams,
    hf_hparams,
};

fn hf_hparams(k: &HfKeys<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    *c = hf_config(c.clone(), k.cfg)?;
    Ok(())
}

fn gguf_hparams(k: &GgufKeys<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    *c = gguf_config(c.clone(), k.files)?;
    Ok(())
}

/// transformers' `GptOssConfig` defaults, and llama.cpp's constants for a GGUF (which has no
/// key for them): the SwiGLU's sigmoid gain and clamp.
pub const SWIGLU_ALPHA: f32 = 1.702;
pub const SWIGLU_LIMIT: f32 = 7.0;

/// Names of the family's extra tensors: (GGUF, HF), `{l}` the layer.
pub const SINKS: (&str, &str) = (
    "blk.{l}.attn_sinks.weight",
    "model.layers.{l}.self_attn.sinks",
);
pub const O_BIAS: (&str, &str) = (
    "blk.{l}.attn_output.bias",
    "model.layers.{l}.self_attn.o_proj.bias",
);
pub const ROUTER_BIAS: (&str, &str) = (
    "blk.{l}.ffn_gate_inp.bias",
    "model.layers.{l}.mlp.router.bias",
);
/// Expert biases, [n_experts, ffn] for gate and up, [n_experts, hidden] for down. HF holds gate
/// and up interleaved in one [n_experts, 2 * ffn] tensor (gate at even columns).
pub const GATE_BIAS_GGUF: &str = "blk.{l}.ffn_gate_exps.bias";
pub const UP_BIAS_GGUF: &str = "blk.{l}.ffn_up_exps.bias";
pub const DOWN_BIAS: (&str, &str) = (
    "blk.{l}.ffn_down_exps.bias",
    "model.layers.{l}.mlp.experts.down_proj_bias",
);
pub const GATE_UP_BIAS_HF: &str = "model.layers.{l}.mlp.experts.gate_up_proj_bias";
/// HF names of the MoE block (the router; the experts are refused, see `Weights`).
pub const HF_MOE: &[(Role, &str)] = &[(Role::Router, "model.layers.{l}.mlp.router.weight")];

/// The name for `files`' format.
pub fn name(files: &ModelFiles, pair: (&str, &str), layer: usize) -> String {
    let p = if files.kind() == FileKind::Gguf {
        pair.0
    } else {
        pair.1
    };
    p.replace("{l}", &layer.to_string())
}

fn refuse<T>(m: String) -> Result<T, ModelError> {
    Err(ModelError::Config(m))
}

/// The shared fields of every gpt-oss config.
fn common(mut c: ModelConfig, sliding: Vec<bool>) -> ModelConfig {
    c.sliding_layers = Some(sliding);
    c.attn_sinks = true;
    c.expert_bias = true;
    c.routing.norm_topk_prob = true;
    c.shared_ffn = 0;
    c.n_dense_layers = 0;
    c.dense_ffn = 0;
    c
}

/// gpt-oss's config.json on top of the generic reading (`c`).
fn hf_config(c: ModelConfig, cfg: &Value) -> Result<ModelConfig, ModelError> {
    let n = c.n_layers;
    // transformers: layer_types, default sliding for even layers.
    let sliding: Vec<bool> = match cfg.get("layer_types") {
        None | Some(Value::Null) => (0..n).map(|l| l % 2 == 0).collect(),
        Some(Value::Array(a)) if a.len() == n => {
            let mut v = Vec::with_capacity(n);
            for (l, t) in a.iter().enumerate() {
                match t.as_str() {
                    Some("sliding_attention") => v.push(true),
                    Some("full_attention") => v.push(false),
                    _ => {
                        return refuse(format!(
                            "config.json: layer_types[{l}] {t} is not supported for gpt-oss (sliding_attention or full_attention)"
                        ))
                    }
                }
            }
            v
        }
        Some(v) => {
            return refuse(format!(
                "config.json: layer_types {v} is not a list of {n} layer types"
            ))
        }
    };
    let window = match cfg.get("sliding_window") {
        None => Some(128), // GptOssConfig's default
        Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(w) if w > 0 => Some(w as usize),
            _ => {
                return refuse(format!(
                    "config.json: sliding_window {v} is not a positive integer"
                ))
            }
        },
    };
    if window.is_none() && sliding.iter().any(|s| *s) {
        return refuse(
            "config.json: layer_types has sliding_attention layers but sliding_window is null"
                .into(),
        );
    }
    let f = |k: &str, d: f64| -> Result<f32, ModelError> {
        match cfg.get(k) {
            None | Some(Value::Null) => Ok(d as f32),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(x as f32),
                _ => refuse(format!("config.json: {k} {v} is not a positive number")),
            },
        }
    };
    let act = ExpertAct::ClampedSwiglu {
        alpha: f("swiglu_alpha", SWIGLU_ALPHA as f64)?,
        limit: f("swiglu_limit", SWIGLU_LIMIT as f64)?,
    };
    if let Some(q) = cfg.get("quantization_config").filter(|q| !q.is_null()) {
        let m = q.get("quant_method").and_then(Value::as_str).unwrap_or("?");
        if m != "mxfp4" {
            return refuse(format!(
                "config.json: quantization_config.quant_method {m:?} is not supported for gpt-oss (mxfp4, or none)"
            ));
        }
    }
    let bias = cfg
        .get("attention_bias")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let mut c = common(c, sliding);
    c.sliding_window = window;
    c.attn_bias = bias;
    c.o_bias = bias;
    c.expert_act = act;
    // No rope settings at all: GptOssConfig's default (YaRN 32x over 4096, theta 150000).
    if cfg.get("rope_parameters").is_none() && cfg.get("rope_scaling").is_none() {
        if cfg.get("rope_theta").is_none() {
            c.rope_theta = 150000.0;
        }
        c.rope_scaling = RopeScaling::Yarn {
            factor: 32.0,
            orig_ctx: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 0.1 * 32f64.ln() + 1.0,
            truncate: false,
        };
    }
    Ok(c)
}

/// A `gpt-oss` GGUF on top of the generic reading (`c`): llama.cpp alternates sliding-window
/// (even layers) and full attention, and hard-codes the SwiGLU's alpha and limit.
fn gguf_config(c: ModelConfig, files: &ModelFiles) -> Result<ModelConfig, ModelError> {
    let arch = "gpt-oss";
    if let Some(p) = files
        .meta(&format!("{arch}.attention.sliding_window_pattern"))
        .and_then(crate::format::MetaValue::as_u64)
    {
        if p != 2 {
            return refuse(format!(
                "{arch}.attention.sliding_window_pattern {p}: gpt-oss alternates (pattern 2)"
            ));
        }
    }
    if c.sliding_window.is_none() {
        return refuse(format!(
            "{arch}.attention.sliding_window is missing (gpt-oss's even layers use a sliding window)"
        ));
    }
    let n = c.n_layers;
    let o_bias = files.tensor(&name(files, O_BIAS, 0)).is_some();
    let mut c = common(c, (0..n).map(|l| l % 2 == 0).collect());
    c.o_bias = o_bias;
    // gpt-oss's own YaRN does not round the correction range (its config says truncate
    // false); GGUF has no key for it, so the family decides.
    if let RopeScaling::Yarn { truncate, .. } = &mut c.rope_scaling {
        *truncate = false;
    }
    c.expert_act = ExpertAct::ClampedSwiglu {
        alpha: SWIGLU_ALPHA,
        limit: SWIGLU_LIMIT,
    };
    Ok(c)
}

/// gpt-oss's expert activation, in place on `gate`: `g = min(gate, limit)`,
/// `u = clamp(up, -limit, limit)`, `gate = (u + 1) * g * sigmoid(alpha * g)`.
pub fn clamped_swiglu(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    for (g, u) in gate.iter_mut().zip(up) {
        let x = g.min(limit);
        let u = u.clamp(-limit, limit);
        *g = (u + 1.0) * (x / (1.0 + (-alpha * x).exp()));
    }
}

/// Softmax of `x` with one extra logit `sink` that takes its share of the mass and is then
/// dropped (the result sums to less than one).
pub fn softmax_with_sink(x: &mut [f32], sink: f32) {
    let m = x.iter().copied().fold(sink, f32::max);
    let mut s = (sink - m).exp();
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    let inv = 1.0 / s;
    x.iter_mut().for_each(|v| *v *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sink_takes_its_share() {
        let mut x = [0.0f32, 0.0];
        softmax_with_sink(&mut x, 0.0);
        assert!((x[0] - 1.0 / 3.0).abs() < 1e-7 && (x[1] - 1.0 / 3.0).abs() < 1e-7);
        let mut y = [1.0f32, 2.0];
        softmax_with_sink(&mut y, f32::NEG_INFINITY);
        let e = (1.0f32).exp();
        assert!((y[0] - 1.0 / (1.0 + e)).abs() < 1e-7);
    }

    #[test]
    fn swiglu_clamps_gate_above_and_up_both_sides() {
        let mut g = [10.0f32, -3.0];
        clamped_swiglu(&mut g, &[-9.0, 0.5], 1.702, 7.0);
        let want0 = (-7.0 + 1.0) * (7.0 / (1.0 + (-1.702f32 * 7.0).exp()));
        let want1 = 1.5 * (-3.0 / (1.0 + (1.702f32 * 3.0).exp()));
        assert!((g[0] - want0).abs() < 1e-5, "{g:?}");
        assert!((g[1] - want1).abs() < 1e-6, "{g:?}");
    }
}
