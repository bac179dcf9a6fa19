//! Qwen3-Next (HF `Qwen3NextForCausalLM`) and Qwen3.5-MoE text (HF `Qwen3_5MoeForCausalLM`):
//! the hybrid families. What they read from a config, their tensor names, their weights'
//! shapes, the arithmetic of a Gated DeltaNet step, and their per-sequence recurrent state.
//!
//! The model (transformers 5.25 `models/qwen3_next/modeling_qwen3_next.py` and
//! `models/qwen3_5_moe/`; Gated DeltaNet: <https://arxiv.org/abs/2412.06464>):
//! - layers are `linear_attention` (Gated DeltaNet) or `full_attention` (`layer_types`);
//! - Gated DeltaNet: x -> q, k, v, z, b, a projections (Qwen3-Next: fused `in_proj_qkvz` /
//!   `in_proj_ba`, grouped per key head; Qwen3.5: separate `in_proj_qkv`, `_z`, `_b`, `_a`);
//!   [q; k; v] goes through a causal depthwise conv1d (kernel `K`, no bias) and silu; q and k
//!   are L2-normalised per head (eps 1e-6), q scaled by 1/sqrt(dk); each key head serves
//!   `v_heads / k_heads` consecutive value heads; per value head `beta = sigmoid(b)`,
//!   `g = -exp(A_log) * softplus(a + dt_bias)` and the delta rule on a (dk x dv) state S:
//!   `S *= exp(g); S += k (beta (v - S^T k))^T; o = S^T q`; o is RMS-normed per value head with
//!   a plain weight and multiplied by silu(z); `out_proj`.
//! - gated full attention: `q_proj` gives per head [q (hd); gate (hd)]; q/k RMSNorm per head;
//!   RoPE on the first `partial_rotary_factor * hd` dims (half-split); GQA; the output is
//!   multiplied by sigmoid(gate) before `o_proj`.
//! - every RMSNorm except the DeltaNet's gated one is zero-centred: `x * (1 + w)`; the loader
//!   adds the 1 once to the checkpoint's weights (llama.cpp's converter does the same).
//! - MoE: softmax top-k (renormalised with `norm_topk_prob`) plus a shared expert scaled by
//!   `sigmoid(shared_expert_gate . x)`; Qwen3-Next's `mlp_only_layers` / `decoder_sparse_step`
//!   make some layers a dense MLP.
//! - MTP (`mtp.*`; transformers' generic `MtpModel` over these layers, see
//!   scripts/make_qwen3next_mtp_fixtures.py): `fc([norm_e(embed(t[s+1])); norm_h(h[s])])`
//!   (zero-centred norms) -> one gated full-attention + MoE layer (cache layer `n_layers`, the
//!   KV slot after the main full layers) -> `mtp.norm` -> the main `lm_head`; run by mtp.rs.
//!
//! Qwen3.5's multimodal RoPE (`mrope_section`) gives every text token the same position on its
//! three axes, which is plain RoPE: sluice feeds text only.
//!
//! State: per linear layer the last `K - 1` conv inputs and the (v_heads, dk, dv) delta-rule
//! state, the state after the last position fed. It cannot be cut back to an earlier position:
//! `State::truncate` below the end restarts the sequence (the engine re-feeds from 0), a
//! snapshot is taken only at the current position, and a chunk that starts at position 0
//! starts from a zero state. Only the full-attention layers keep a KV cache, in compact slots
//! (`Hybrid::kv_slot`, `ModelConfig::kv_layers`). Speculative decoding saves the recurrent
//! state before a verify forward and rolls it back when a draft is rejected
//! (`State::checkpoint_recurrent` / `rollback_recurrent`, below).
//!
//! Files: HF safetensors of both families; llama.cpp's `qwen3next` and `qwen35moe` GGUF (names
//! and keys as its converter writes them, see scripts/qwen3next_to_gguf.py). A `qwen35moe` GGUF
//! holds the value heads in llama.cpp's tiled order (value head j reads key head
//! j % key_heads, `Hybrid::v_tiled`) and MRoPE sections, which for text (the same position on
//! every axis) are plain RoPE; its MTP layer is block `n_layers` with llama.cpp's `nextn.*`
//! names (`eh_proj` = `mtp.fc`, `enorm` = `pre_fc_norm_embedding`, `hnorm` =
//! `pre_fc_norm_hidden`, `shared_head_norm` = `mtp.norm`; norms hold 1 + w like every GGUF
//! norm of these families).
//!
//! Owns: the two `FamilySpec`s and their config hooks (unsupported features refused by name),
//! `Hybrid`, the mixer weights (`Mixer`), `HybridState`, the DeltaNet arithmetic
//! (`conv_step`, `delta_step`). Does not own: the CPU plumbing (cpu.rs, its `// Qwen3-Next`
//! block), the shared forward (forward.rs calls `Mixer::run`).
//! Invariant: a config feature of these families that changes the computation is implemented
//! here or refused with its name.

use super::backend::{At, Backend};
use super::blocks::silu;
use super::config::{Family, ModelConfig, QkNorm, RopeLayout};
use super::family::{self, BiasRule, FamilySpec, GgufKeys, HfKeys};
use super::forward::Spans;
use super::names::HF_MLP_MOE;
use super::ModelError;
use crate::format::MetaValue;
use crate::kernels::WeightView;
use serde_json::Value;

pub static SPEC: FamilySpec = FamilySpec {
    family: Family::Qwen3Next,
    name: "qwen3next",
    gguf_archs: &["qwen3next"],
    hf_archs: &["Qwen3NextForCausalLM", "qwen3_next"],
    hf_moe: HF_MLP_MOE,
    gguf_rope_layout: RopeLayout::HalfSplit,
    sigmoid_router: false,
    gguf_norm_topk: true,
    hf_norm_topk: None,
    hf_expert_ffn_key: "moe_intermediate_size",
    hf_default_rope_theta: 10000.0,
    hf_attention_bias: BiasRule::Refused,
    clip_qkv: false,
    gguf_yarn_cancelled: false,
    // The per-head q/k norms are the gated attention's own (bound with the mixer).
    hf_qk_norm: family::no_qk_norm,
    hf_sliding_window: family::no_sliding_window,
    gguf_window_pattern: false,
    hf_experts_refused: None,
    gpu_validated: true,
    gguf_hparams: gguf_next,
    hf_hparams: hf_next,
};

pub static SPEC35: FamilySpec = FamilySpec {
    family: Family::Qwen35Moe,
    name: "qwen35moe",
    gguf_archs: &["qwen35moe"],
    hf_archs: &["Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"],
    hf_moe: HF_MLP_MOE,
    gguf_rope_layout: RopeLayout::HalfSplit,
    sigmoid_router: false,
    gguf_norm_topk: true,
    // Qwen3.5's router always renormalises the top-k (its config has no norm_topk_prob).
    hf_norm_topk: Some(true),
    hf_expert_ffn_key: "moe_intermediate_size",
    hf_default_rope_theta: 10000.0,
    hf_attention_bias: BiasRule::Refused,
    clip_qkv: false,
    gguf_yarn_cancelled: false,
    hf_qk_norm: family::no_qk_norm,
    hf_sliding_window: family::no_sliding_window,
    gguf_window_pattern: false,
    hf_experts_refused: None,
    gpu_validated: true,
    gguf_hparams: gguf_35,
    hf_hparams: hf_35,
};

/// HF tensor names of a layer's mixer (`{l}` the layer).
pub mod hf {
    pub const IN_QKVZ: &str = "model.layers.{l}.linear_attn.in_proj_qkvz.weight";
    pub const IN_BA: &str = "model.layers.{l}.linear_attn.in_proj_ba.weight";
    pub const IN_QKV: &str = "model.layers.{l}.linear_attn.in_proj_qkv.weight";
    pub const IN_Z: &str = "model.layers.{l}.linear_attn.in_proj_z.weight";
    pub const IN_B: &str = "model.layers.{l}.linear_attn.in_proj_b.weight";
    pub const IN_A: &str = "model.layers.{l}.linear_attn.in_proj_a.weight";
    pub const CONV: &str = "model.layers.{l}.linear_attn.conv1d.weight";
    pub const A_LOG: &str = "model.layers.{l}.linear_attn.A_log";
    pub const DT_BIAS: &str = "model.layers.{l}.linear_attn.dt_bias";
    pub const NORM: &str = "model.layers.{l}.linear_attn.norm.weight";
    pub const OUT: &str = "model.layers.{l}.linear_attn.out_proj.weight";
    pub const Q: &str = "model.layers.{l}.self_attn.q_proj.weight";
    pub const K: &str = "model.layers.{l}.self_attn.k_proj.weight";
    pub const V: &str = "model.layers.{l}.self_attn.v_proj.weight";
    pub const O: &str = "model.layers.{l}.self_attn.o_proj.weight";
    pub const Q_NORM: &str = "model.layers.{l}.self_attn.q_norm.weight";
    pub const K_NORM: &str = "model.layers.{l}.self_attn.k_norm.weight";
    pub const SHARED_GATE: &str = "model.layers.{l}.mlp.shared_expert_gate.weight";
}

/// llama.cpp's GGUF tensor names of a layer's mixer (`{l}` the layer): `attn_qkv` is
/// [q; k; v] ungrouped, `attn_gate` is z, `ssm_ba` keeps HF's per-key-head grouping, `ssm_a`
/// holds -exp(A_log), the norms hold 1 + w.
pub mod gguf {
    pub const QKV: &str = "blk.{l}.attn_qkv.weight";
    pub const Z: &str = "blk.{l}.attn_gate.weight";
    pub const BA: &str = "blk.{l}.ssm_ba.weight";
    /// `qwen35moe`: b and a as separate projections (value heads tiled).
    pub const BETA: &str = "blk.{l}.ssm_beta.weight";
    pub const ALPHA: &str = "blk.{l}.ssm_alpha.weight";
    pub const CONV: &str = "blk.{l}.ssm_conv1d.weight";
    pub const A: &str = "blk.{l}.ssm_a";
    pub const DT_BIAS: &str = "blk.{l}.ssm_dt.bias";
    pub const NORM: &str = "blk.{l}.ssm_norm.weight";
    pub const OUT: &str = "blk.{l}.ssm_out.weight";
    pub const Q: &str = "blk.{l}.attn_q.weight";
    pub const K: &str = "blk.{l}.attn_k.weight";
    pub const V: &str = "blk.{l}.attn_v.weight";
    pub const O: &str = "blk.{l}.attn_output.weight";
    pub const Q_NORM: &str = "blk.{l}.attn_q_norm.weight";
    pub const K_NORM: &str = "blk.{l}.attn_k_norm.weight";
    pub const SHARED_GATE: &str = "blk.{l}.ffn_gate_inp_shexp.weight";
    pub const ROUTER: &str = "blk.{l}.ffn_gate_inp.weight";
}

/// The hybrid layer pattern and the Gated DeltaNet's shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hybrid {
    /// Per layer: Gated DeltaNet (else gated full attention).
    pub linear: Vec<bool>,
    /// Per layer: a dense MLP instead of experts.
    pub dense: Vec<bool>,
    pub k_heads: usize,
    pub v_heads: usize,
    /// Key (and query) width per head.
    pub k_dim: usize,
    /// Value width per head.
    pub v_dim: usize,
    /// Conv kernel length.
    pub conv: usize,
    /// Qwen3-Next's fused, per-key-head grouped `in_proj_qkvz` / `in_proj_ba` (else Qwen3.5's
    /// separate projections).
    pub fused: bool,
    /// Value heads in llama.cpp's tiled order (a `qwen35moe` GGUF): value head j reads key head
    /// j % k_heads; else HF's grouped order, key head j / (v_heads / k_heads).
    pub v_tiled: bool,
}

impl Hybrid {
    pub fn key_dim(&self) -> usize {
        self.k_heads * self.k_dim
    }

    pub fn value_dim(&self) -> usize {
        self.v_heads * self.v_dim
    }

    /// Channels of the conv: [q; k; v].
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Floats of one layer's conv state (the last `conv - 1` inputs).
    pub fn conv_state(&self) -> usize {
        (self.conv - 1) * self.conv_dim()
    }

    /// Floats of one layer's delta-rule state.
    pub fn rec_state(&self) -> usize {
        self.v_heads * self.k_dim * self.v_dim
    }

    pub fn n_linear(&self) -> usize {
        self.linear.iter().filter(|x| **x).count()
    }

    /// The KV-cache slot of full-attention layer `l` (its index among the full layers); the
    /// MTP layer (`l` = the layer count, gated full attention) takes the slot after them.
    pub fn kv_slot(&self, l: usize) -> Option<usize> {
        let n = self.linear.len();
        if l == n {
            return Some(n - self.n_linear());
        }
        (!*self.linear.get(l)?).then(|| self.linear[..l].iter().filter(|x| !**x).count())
    }

    /// The key head that value head `hv` reads.
    pub fn key_head(&self, hv: usize) -> usize {
        if self.v_tiled {
            hv % self.k_heads
        } else {
            hv / (self.v_heads / self.k_heads)
        }
    }

    /// Index of linear layer `l` among the linear layers.
    pub fn linear_index(&self, l: usize) -> Option<usize> {
        (*self.linear.get(l)?).then(|| self.linear[..l].iter().filter(|x| **x).count())
    }

    /// Bytes of recurrent + conv state per sequence (f32), whatever its length.
    pub fn state_bytes(&self) -> usize {
        self.n_linear() * (self.conv_state() + self.rec_state()) * 4
    }
}

fn refuse<T>(m: String) -> Result<T, ModelError> {
    Err(ModelError::Config(m))
}

/// A `qwen3next` GGUF (llama.cpp's keys, see scripts/qwen3next_to_gguf.py): the layer pattern
/// from `attention.recurrent_layers` when present, else `full_attention_interval`, the
/// DeltaNet's shape from the `ssm.*` keys, dense layers where a layer has no router.
fn gguf_next(k: &GgufKeys<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    gguf_common(k, c, false)
}

/// A `qwen35moe` GGUF: as `qwen3next`, with the value heads in tiled order. Its
/// `rope.dimension_sections` (MRoPE) rotate text positions as plain RoPE; its MTP layer
/// (`nextn_predict_layers`, block `n_layers` with the `nextn.*` tensors) runs under `--mtp`.
fn gguf_35(k: &GgufKeys<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    if let Some(MetaValue::Array(s)) = k.get("rope.dimension_sections") {
        let pairs: u64 = s.iter().filter_map(MetaValue::as_u64).sum();
        if pairs as usize * 2 != c.rotary_dim {
            return refuse(format!(
                "{}: sections of {pairs} rotary pairs do not cover rope.dimension_count {}",
                k.key("rope.dimension_sections"),
                c.rotary_dim
            ));
        }
    }
    gguf_common(k, c, true)
}

fn gguf_common(k: &GgufKeys<'_>, c: &mut ModelConfig, v_tiled: bool) -> Result<(), ModelError> {
    let n = c.n_layers;
    let linear: Vec<bool> = match k.get("attention.recurrent_layers") {
        Some(MetaValue::Array(a)) => {
            let flags: Vec<bool> = a
                .iter()
                .map(|v| match v {
                    MetaValue::Bool(b) => Some(*b),
                    v => v.as_u64().map(|x| x != 0),
                })
                .collect::<Option<_>>()
                .filter(|f: &Vec<bool>| f.len() >= n)
                .ok_or_else(|| {
                    ModelError::Config(format!(
                        "GGUF metadata {} must hold a flag for each of the {n} layers",
                        k.key("attention.recurrent_layers")
                    ))
                })?;
            flags[..n].to_vec()
        }
        _ => {
            let every = k.req_u("full_attention_interval")?.max(1);
            (0..n).map(|l| (l + 1) % every != 0).collect()
        }
    };
    let v_heads = k.req_u("ssm.time_step_rank")?.max(1);
    let inner = k.req_u("ssm.inner_size")?;
    let hy = Hybrid {
        linear,
        dense: (0..n)
            .map(|l| {
                k.files
                    .tensor(&gguf::ROUTER.replace("{l}", &l.to_string()))
                    .is_none()
            })
            .collect(),
        k_heads: k.req_u("ssm.group_count")?.max(1),
        v_heads,
        k_dim: k.req_u("ssm.state_size")?,
        v_dim: inner / v_heads,
        conv: k.req_u("ssm.conv_kernel")?.max(1),
        fused: false,
        v_tiled,
    };
    if !hy.v_heads.is_multiple_of(hy.k_heads) || inner % v_heads != 0 {
        return refuse(format!(
            "{}: {} value heads ({inner} wide) over {} key heads do not divide",
            k.key("ssm.time_step_rank"),
            hy.v_heads,
            hy.k_heads
        ));
    }
    c.shared_ffn = k.req_u("expert_shared_feed_forward_length")?;
    c.qk_norm = QkNorm::None;
    c.hybrid = Some(Box::new(hy));
    Ok(())
}

fn hf_next(k: &HfKeys<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    hf_common(k, c, true)
}

fn hf_35(k: &HfKeys<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    hf_common(k, c, false)
}

/// The hybrid keys of both families on top of the generic reading.
fn hf_common(k: &HfKeys<'_>, c: &mut ModelConfig, fused: bool) -> Result<(), ModelError> {
    let n = c.n_layers;
    let name = c.family.name();
    let linear: Vec<bool> = match k.cfg.get("layer_types") {
        None | Some(Value::Null) => {
            // Qwen3NextConfig's default: every `full_attention_interval`-th layer is full.
            let every = k.opt_u("full_attention_interval").unwrap_or(4).max(1);
            (0..n).map(|l| (l + 1) % every != 0).collect()
        }
        Some(Value::Array(a)) if a.len() == n => {
            let mut v = Vec::with_capacity(n);
            for (l, t) in a.iter().enumerate() {
                match t.as_str() {
                    Some("linear_attention") => v.push(true),
                    Some("full_attention") => v.push(false),
                    _ => {
                        return refuse(format!(
                            "config.json: layer_types[{l}] {t} is not supported for {name} (linear_attention or full_attention)"
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
    let dense: Vec<bool> = if fused {
        let step = k.opt_u("decoder_sparse_step").unwrap_or(1).max(1);
        let only: Vec<u64> = match k.cfg.get("mlp_only_layers") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).collect(),
            Some(v) => return refuse(format!("config.json: mlp_only_layers {v} is not a list")),
        };
        (0..n)
            .map(|l| only.contains(&(l as u64)) || (l + 1) % step != 0)
            .collect()
    } else {
        vec![false; n]
    };
    let req = |key: &str| -> Result<usize, ModelError> {
        match k.opt_u(key) {
            Some(v) if v > 0 => Ok(v),
            _ => refuse(format!(
                "config.json: {key} is missing or not a positive integer ({name})"
            )),
        }
    };
    let hy = Hybrid {
        linear,
        dense,
        k_heads: req("linear_num_key_heads")?,
        v_heads: req("linear_num_value_heads")?,
        k_dim: req("linear_key_head_dim")?,
        v_dim: req("linear_value_head_dim")?,
        conv: req("linear_conv_kernel_dim")?,
        fused,
        v_tiled: false,
    };
    if !hy.v_heads.is_multiple_of(hy.k_heads) {
        return refuse(format!(
            "config.json: linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
            hy.v_heads, hy.k_heads
        ));
    }
    if hy.dense.iter().any(|d| *d) {
        c.dense_ffn = req("intermediate_size")?;
    }
    c.shared_ffn = req("shared_expert_intermediate_size")?;
    // The configs' own defaults where the generic reading has others: head_dim 256 and
    // partial_rotary_factor 0.25 (Qwen3NextConfig / Qwen3_5MoeTextConfig).
    if k.opt_u("head_dim").is_none() {
        c.head_dim = 256;
        c.v_head_dim = 256;
        c.attn_scale = 1.0 / 16.0;
    }
    let partial = k
        .rget("partial_rotary_factor")
        .or_else(|| k.opt_f("partial_rotary_factor"))
        .unwrap_or(0.25);
    c.rotary_dim = (c.head_dim as f64 * partial) as usize;
    c.qk_norm = QkNorm::None;
    // The MTP module (`mtp.*`): the real checkpoints count it as `mtp_num_hidden_layers`.
    c.n_mtp_layers = k
        .opt_u("mtp_num_hidden_layers")
        .or_else(|| k.opt_u("num_nextn_predict_layers"))
        .unwrap_or(0);
    if k.flag("use_sliding_window") {
        return refuse(format!(
            "config.json: use_sliding_window is not supported for {name}"
        ));
    }
    c.hybrid = Some(Box::new(hy));
    Ok(())
}

/// A Gated DeltaNet layer's weights.
pub struct DeltaNet<'a> {
    /// Qwen3-Next HF (`Hybrid::fused`): (2 key_dim + 2 value_dim, hidden) grouped per key head
    /// as [q (dk); k (dk); v (r dv); z (r dv)], r = v_heads / k_heads. Otherwise (conv_dim,
    /// hidden) = [q; k; v].
    pub in_qkv: WeightView<'a>,
    /// Qwen3-Next: (2 v_heads, hidden) grouped per key head as [b (r); a (r)] (HF and GGUF).
    /// Qwen3.5: b (v_heads, hidden).
    pub in_b: WeightView<'a>,
    /// z (value_dim, hidden): Qwen3.5 and Qwen3-Next GGUF. a (v_heads, hidden): Qwen3.5.
    pub in_z: Option<WeightView<'a>>,
    pub in_a: Option<WeightView<'a>>,
    /// (conv_dim, K) the depthwise conv kernel.
    pub conv: Vec<f32>,
    /// (v_heads) -exp(A_log).
    pub a_neg: Vec<f32>,
    /// (v_heads)
    pub dt_bias: Vec<f32>,
    /// (v_dim) the gated RMSNorm's weight (not zero-centred).
    pub norm: Vec<f32>,
    /// (hidden, value_dim)
    pub out: WeightView<'a>,
}

/// A gated full-attention layer's weights.
pub struct GatedAttn<'a> {
    /// (n_heads * 2 head_dim, hidden): per head [q; gate].
    pub wq: WeightView<'a>,
    pub wk: WeightView<'a>, // (n_kv_heads*head_dim, hidden)
    pub wv: WeightView<'a>, // (n_kv_heads*head_dim, hidden)
    pub wo: WeightView<'a>, // (hidden, n_heads*head_dim)
    /// (head_dim) 1 + the checkpoint's weight.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

/// The token mixer of one hybrid layer.
pub enum Mixer<'a> {
    DeltaNet(DeltaNet<'a>),
    Gated(GatedAttn<'a>),
}

impl Mixer<'_> {
    /// Rows 0..n of `Xn` through this mixer into `Proj` (layer `l`, at `at`).
    /// `run` over the rows of one sequence or, in a batched forward, of several (each span's
    /// recurrent part on its own sequence's state).
    pub(crate) fn run_spans<B: Backend + ?Sized>(
        &self,
        b: &mut B,
        l: usize,
        n: usize,
        spans: Spans<'_>,
    ) -> Result<(), ModelError> {
        match (spans, self) {
            (Spans::One(at), _) => self.run(b, l, n, at),
            (Spans::Many(ss), Mixer::DeltaNet(d)) => b.delta_net_seqs(l, n, ss, d),
            (Spans::Many(ss), Mixer::Gated(a)) => b.gated_attention_seqs(l, n, ss, a),
        }
    }

    pub fn run<B: Backend + ?Sized>(
        &self,
        b: &mut B,
        l: usize,
        n: usize,
        at: At,
    ) -> Result<(), ModelError> {
        match self {
            Mixer::DeltaNet(d) => b.delta_net(l, n, at, d),
            Mixer::Gated(a) => b.gated_attention(l, n, at, a),
        }
    }
}

/// The CPU's recurrent state and scratch of the hybrid layers (empty for other families).
#[derive(Default)]
pub struct HybridState {
    /// The model layer of each linear layer, in order.
    pub layers: Vec<usize>,
    /// Floats per layer of `conv` and of `rec`.
    pub conv_width: usize,
    pub rec_width: usize,
    /// (n_linear, K - 1, conv_dim) the last conv inputs, oldest first.
    pub conv: Vec<f32>,
    /// (n_linear, v_heads, k_dim, v_dim) delta-rule states.
    pub rec: Vec<f32>,
    /// `conv` and `rec` as they were before a speculative verify forward (`--mtp` only:
    /// `State::checkpoint_recurrent`); empty otherwise.
    pub saved_conv: Vec<f32>,
    pub saved_rec: Vec<f32>,
    /// (batch, 2 key_dim + 2 value_dim) Qwen3-Next's fused projection.
    pub proj: Vec<f32>,
    /// (batch, 2 v_heads) Qwen3-Next's grouped b/a projection.
    pub ba: Vec<f32>,
    /// (batch, conv_dim) [q; k; v] before and after the conv.
    pub mixed: Vec<f32>,
    /// (batch, value_dim)
    pub z: Vec<f32>,
    /// (batch, v_heads)
    pub b: Vec<f32>,
    pub a: Vec<f32>,
    /// (batch, value_dim) the DeltaNet's output before out_proj.
    pub core: Vec<f32>,
    /// (2 key_dim) one token's normalised q and k.
    pub qk: Vec<f32>,
    /// (batch, 2 q_dim) gated attention's q_proj output; (batch, q_dim) its gate.
    pub qg: Vec<f32>,
    pub gate: Vec<f32>,
}

impl HybridState {
    /// `mtp`: also the copy speculative verification rolls back to.
    pub fn new(cfg: &ModelConfig, batch: usize, mtp: bool) -> HybridState {
        let Some(hy) = cfg.hybrid.as_deref() else {
            return HybridState::default();
        };
        let (kd, vd, nl) = (hy.key_dim(), hy.value_dim(), hy.n_linear());
        HybridState {
            layers: (0..hy.linear.len()).filter(|l| hy.linear[*l]).collect(),
            conv_width: hy.conv_state(),
            rec_width: hy.rec_state(),
            conv: vec![0.0; nl * hy.conv_state()],
            rec: vec![0.0; nl * hy.rec_state()],
            saved_conv: vec![0.0; if mtp { nl * hy.conv_state() } else { 0 }],
            saved_rec: vec![0.0; if mtp { nl * hy.rec_state() } else { 0 }],
            proj: vec![
                0.0;
                if hy.fused {
                    batch * (2 * kd + 2 * vd)
                } else {
                    0
                }
            ],
            ba: vec![0.0; batch * 2 * hy.v_heads],
            mixed: vec![0.0; batch * hy.conv_dim()],
            z: vec![0.0; batch * vd],
            b: vec![0.0; batch * hy.v_heads],
            a: vec![0.0; batch * hy.v_heads],
            core: vec![0.0; batch * vd],
            qk: vec![0.0; 2 * kd],
            qg: vec![0.0; batch * 2 * cfg.q_dim()],
            gate: vec![0.0; batch * cfg.q_dim()],
        }
    }

    /// Whether the sequence state has recurrent parts.
    pub fn is_recurrent(&self) -> bool {
        !self.rec.is_empty()
    }
}

// Speculative verification over a recurrent state (issue 18 item 3). A verify forward feeds
// the next token and its K drafts; the KV cache can be cut back to any accepted prefix, the
// Gated DeltaNet's conv and delta-rule state cannot (they hold only the state after the last
// token fed). So the decode loop saves them before the verify forward and, when a draft is
// rejected, puts them back and feeds the kept tokens again: the state then holds exactly the
// accepted tokens, as plain decoding would have left it.
impl super::State {
    /// Whether this state has Gated DeltaNet layers (a recurrent part that cannot be cut).
    pub fn is_recurrent(&self) -> bool {
        self.hybrid.is_recurrent()
    }

    /// Save the recurrent and conv state (the state must come from `new_state_mtp`).
    pub fn checkpoint_recurrent(&mut self) -> Result<(), ModelError> {
        let h = &mut self.hybrid;
        if h.saved_rec.len() != h.rec.len() || h.saved_conv.len() != h.conv.len() {
            return Err(ModelError::Input(
                "checkpoint_recurrent: the state has no rollback copy (make it with new_state_mtp)"
                    .into(),
            ));
        }
        h.saved_conv.copy_from_slice(&h.conv);
        h.saved_rec.copy_from_slice(&h.rec);
        Ok(())
    }

    /// Put back the state saved by `checkpoint_recurrent`, taken at position `pos`, and cut
    /// the KV cache to `pos`: the sequence holds positions `0..pos` again.
    pub fn rollback_recurrent(&mut self, pos: usize) -> Result<(), ModelError> {
        let h = &mut self.hybrid;
        if h.saved_rec.len() != h.rec.len() || pos > self.pos {
            return Err(ModelError::Input(format!(
                "rollback_recurrent to {pos}: no checkpoint, or the state holds only {}",
                self.pos
            )));
        }
        h.conv.copy_from_slice(&h.saved_conv);
        h.rec.copy_from_slice(&h.saved_rec);
        self.pos = pos;
        self.mtp_pos = self.mtp_pos.min(pos.saturating_sub(1));
        Ok(())
    }
}

/// Qwen3-Next's per-key-head grouped [b (r); a (r)] of one token -> b, a.
pub fn ungroup_ba(hy: &Hybrid, ba: &[f32], b: &mut [f32], a: &mut [f32]) {
    let r = hy.v_heads / hy.k_heads;
    for g in 0..hy.k_heads {
        let s = &ba[g * 2 * r..(g + 1) * 2 * r];
        b[g * r..(g + 1) * r].copy_from_slice(&s[..r]);
        a[g * r..(g + 1) * r].copy_from_slice(&s[r..]);
    }
}

/// Qwen3-Next's grouped projections of one token -> [q; k; v] (`mixed`), z, b, a.
pub fn ungroup(
    hy: &Hybrid,
    qkvz: &[f32],
    ba: &[f32],
    mixed: &mut [f32],
    z: &mut [f32],
    b: &mut [f32],
    a: &mut [f32],
) {
    let (dk, dv, r) = (hy.k_dim, hy.v_dim, hy.v_heads / hy.k_heads);
    let kd = hy.key_dim();
    let group = 2 * dk + 2 * r * dv;
    for g in 0..hy.k_heads {
        let src = &qkvz[g * group..(g + 1) * group];
        mixed[g * dk..(g + 1) * dk].copy_from_slice(&src[..dk]);
        mixed[kd + g * dk..kd + (g + 1) * dk].copy_from_slice(&src[dk..2 * dk]);
        let v0 = 2 * kd + g * r * dv;
        mixed[v0..v0 + r * dv].copy_from_slice(&src[2 * dk..2 * dk + r * dv]);
        z[g * r * dv..(g + 1) * r * dv].copy_from_slice(&src[2 * dk + r * dv..]);
    }
    ungroup_ba(hy, ba, b, a);
}

/// The causal depthwise conv of one token, in place on `x` (conv_dim): out[c] =
/// silu(sum_j w[c][j] * input[t - K + 1 + j][c]), the earlier inputs from `state`
/// ((K - 1, conv_dim), oldest first), which then drops its oldest row and keeps `x`'s input.
pub fn conv_step(x: &mut [f32], state: &mut [f32], w: &[f32], k: usize) {
    let cd = x.len();
    for (c, xc) in x.iter_mut().enumerate() {
        let wc = &w[c * k..(c + 1) * k];
        let mut acc = 0.0f32;
        for j in 0..k - 1 {
            acc += wc[j] * state[j * cd + c];
        }
        acc += wc[k - 1] * *xc;
        let input = *xc;
        for j in 0..k.saturating_sub(2) {
            state[j * cd + c] = state[(j + 1) * cd + c];
        }
        if k > 1 {
            state[(k - 2) * cd + c] = input;
        }
        *xc = silu(acc);
    }
}

/// x * rsqrt(sum(x^2) + eps), as transformers' (and fla's) `l2norm`.
fn l2norm(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// torch's softplus (beta 1, threshold 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// One token of the gated delta rule on one layer's state `s` ((v_heads, dk, dv)): `x` is the
/// conv output [q; k; v], `b` / `a` the token's gate inputs, `qk` scratch (2 key_dim), `out`
/// (value_dim) the attention output before the gated norm.
#[allow(clippy::too_many_arguments)]
pub fn delta_step(
    hy: &Hybrid,
    d: &DeltaNet<'_>,
    x: &[f32],
    b: &[f32],
    a: &[f32],
    s: &mut [f32],
    qk: &mut [f32],
    out: &mut [f32],
) {
    let (dk, dv, kd) = (hy.k_dim, hy.v_dim, hy.key_dim());
    qk.copy_from_slice(&x[..2 * kd]);
    let scale = 1.0 / (dk as f32).sqrt();
    for h in qk.chunks_exact_mut(dk) {
        l2norm(h);
    }
    qk[..kd].iter_mut().for_each(|v| *v *= scale);
    let (qn, kn) = qk.split_at(kd);
    let v = &x[2 * kd..];
    for hv in 0..hy.v_heads {
        let kh = hy.key_head(hv);
        let (q, k) = (&qn[kh * dk..(kh + 1) * dk], &kn[kh * dk..(kh + 1) * dk]);
        let beta = 1.0 / (1.0 + (-b[hv]).exp());
        let decay = (d.a_neg[hv] * softplus(a[hv] + d.dt_bias[hv])).exp();
        let sh = &mut s[hv * dk * dv..(hv + 1) * dk * dv];
        let o = &mut out[hv * dv..(hv + 1) * dv];
        sh.iter_mut().for_each(|x| *x *= decay);
        // o = delta = beta * (v - S^T k)
        o.copy_from_slice(&v[hv * dv..(hv + 1) * dv]);
        for (i, ki) in k.iter().enumerate() {
            for (oj, sij) in o.iter_mut().zip(&sh[i * dv..(i + 1) * dv]) {
                *oj -= sij * ki;
            }
        }
        o.iter_mut().for_each(|x| *x *= beta);
        for (i, ki) in k.iter().enumerate() {
            for (sij, dj) in sh[i * dv..(i + 1) * dv].iter_mut().zip(o.iter()) {
                *sij += ki * dj;
            }
        }
        o.fill(0.0);
        for (i, qi) in q.iter().enumerate() {
            for (oj, sij) in o.iter_mut().zip(&sh[i * dv..(i + 1) * dv]) {
                *oj += sij * qi;
            }
        }
    }
}

/// The DeltaNet's gated RMSNorm of one token, in place: per value head
/// `o * rsqrt(mean(o^2) + eps) * w * silu(z)`.
pub fn gated_norm(o: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let dv = w.len();
    for (oh, zh) in o.chunks_exact_mut(dv).zip(z.chunks_exact(dv)) {
        let ms: f32 = oh.iter().map(|v| v * v).sum::<f32>() / dv as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((x, g), wj) in oh.iter_mut().zip(zh).zip(w) {
            *x = wj * (*x * inv) * silu(*g);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_step_is_a_causal_depthwise_conv() {
        // One channel, kernel 3: out_t = silu(w0 x_{t-2} + w1 x_{t-1} + w2 x_t).
        let w = [0.5f32, -1.0, 2.0];
        let mut st = [0.0f32; 2];
        let xs = [1.0f32, 2.0, 3.0, 4.0];
        let mut got = Vec::new();
        for &x in &xs {
            let mut v = [x];
            conv_step(&mut v, &mut st, &w, 3);
            got.push(v[0]);
        }
        let pad = [0.0, 0.0, 1.0, 2.0, 3.0, 4.0];
        for t in 0..4 {
            let want = silu(w[0] * pad[t] + w[1] * pad[t + 1] + w[2] * pad[t + 2]);
            assert!((got[t] - want).abs() < 1e-6, "{t}: {got:?}");
        }
        assert_eq!(st, [3.0, 4.0]);
    }

    #[test]
    fn softplus_matches_torch_threshold() {
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
    }
}
