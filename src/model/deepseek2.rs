//! DeepSeek-V3/R1/V3.1/V3.2 and Kimi-K2 (GGUF `deepseek2` / `deepseek32`, HF
//! `DeepseekV3ForCausalLM` / `DeepseekV32ForCausalLM`): multi-head latent attention (q and kv
//! low-rank projections; the cache keeps the kv latent and one shared rope key per token;
//! decode runs in latent space with the up-projections folded into q and the output), YaRN
//! rope with mscale, dense first layers, a shared expert, and sigmoid routing with a
//! selection-only bias, group-limited top-k and a routed scale. V3.2 adds DSA sparse
//! attention: a lightning indexer picks the `index_topk` positions each query attends to
//! (below). Papers: <https://arxiv.org/abs/2412.19437>, DeepSeek-V3.2-Exp (DSA).

use super::backend::{At, Backend, Buf, Cache, Rows};
use super::blocks::dot;
use super::config::{
    yarn_mscale, AttnKind, Family, IndexerDims, ModelConfig, RopeLayout, RopeScaling,
};
use super::family::{self, BiasRule, FamilySpec, GgufKeys, HfKeys};
use super::forward::Spans;
use super::names::{Role, HF_MLP_MOE};
use super::weights::Mla;
use super::{Model, ModelError, State};
use rayon::prelude::*;

/// Why `-ctv` sets nothing here: MLA caches the latent + rope key (which follows `-ctk`, as
/// llama.cpp's MLA cache does) and no values.
pub const KV_NO_VALUES: &str =
    "MLA caches no value rows (the latent, which follows -ctk, stands for both)";
/// Why V3.2's / GLM-5's value side stays f32: it holds the lightning indexer's keys, which
/// `indexer_select` scores as f32 rows.
pub const KV_INDEXER_F32: &str =
    "the value side holds the lightning indexer's keys, kept f32 (its scores read f32 rows)";

pub const HF_MOE: &[(Role, &str)] = HF_MLP_MOE;

pub static SPEC: FamilySpec = FamilySpec {
    family: Family::DeepseekV3,
    name: "deepseek2",
    gguf_archs: &["deepseek2", "deepseek32"],
    // V3.2 is V3 plus DSA's lightning indexer.
    hf_archs: &[
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        "DeepseekV32ForCausalLM",
        "deepseek_v32",
    ],
    hf_moe: HF_MOE,
    gguf_rope_layout: RopeLayout::Interleaved,
    sigmoid_router: true,
    // llama.cpp reads a missing expert_weights_norm as false.
    gguf_norm_topk: false,
    hf_norm_topk: None,
    hf_expert_ffn_key: "moe_intermediate_size",
    hf_default_rope_theta: 10000.0,
    hf_attention_bias: BiasRule::Ignored,
    clip_qkv: false,
    gguf_yarn_cancelled: true,
    hf_qk_norm: family::no_qk_norm,
    hf_sliding_window: family::no_sliding_window,
    gguf_window_pattern: false,
    hf_experts_refused: None,
    gpu_validated: true,
    gguf_hparams,
    hf_hparams,
};

/// MLA's shape (llama.cpp's keys), its softmax scale with YaRN's mscale, and V3.2's indexer.
pub(super) fn gguf_hparams(k: &GgufKeys<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    let kv_lora = k.req_u("attention.kv_lora_rank")?;
    let rope = k.req_u("rope.dimension_count")?;
    let qk = k.opt_u("attention.key_length_mla").unwrap_or(c.head_dim);
    let v_dim = k
        .opt_u("attention.value_length_mla")
        .unwrap_or(c.v_head_dim);
    let q_lora = k.opt_u("attention.q_lora_rank").filter(|r| *r > 0);
    c.attn = AttnKind::Mla {
        q_lora,
        kv_lora,
        nope: qk.saturating_sub(rope),
        rope,
        v_dim,
    };
    (c.head_dim, c.v_head_dim, c.n_kv_heads, c.rotary_dim) = (qk, v_dim, c.n_heads, rope);
    let mut attn_scale = 1.0 / (qk as f64).sqrt();
    if let RopeScaling::Yarn { factor, .. } = c.rope_scaling {
        // yarn_log_multiplier = 0.1 * mscale_all_dim; a file without the key gets no
        // scaling, as in llama.cpp (its default multiplier is 0).
        let m = yarn_mscale(
            factor,
            k.opt_f("rope.scaling.yarn_log_multiplier").unwrap_or(0.0) / 0.1,
        );
        attn_scale *= m * m;
    }
    c.attn_scale = attn_scale as f32;
    // DeepSeek-V3.2 (llama.cpp's `deepseek32`): the indexer's shape from its keys, or from
    // its tensors' shapes, and its top-k (DeepSeek's 2048 when a file omits it).
    let has_indexer = k.files.tensor("blk.0.indexer.attn_k.weight").is_some();
    if k.arch == "deepseek32" || has_indexer {
        let head_dim = k
            .opt_u("attention.indexer.key_length")
            .or_else(|| k.dim_of("blk.0.indexer.attn_k.weight", 0))
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "{} is missing and there is no blk.0.indexer.attn_k.weight",
                    k.key("attention.indexer.key_length")
                ))
            })?;
        let heads = k
            .opt_u("attention.indexer.head_count")
            .or_else(|| k.dim_of("blk.0.indexer.proj.weight", 0))
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "{} is missing and there is no blk.0.indexer.proj.weight",
                    k.key("attention.indexer.head_count")
                ))
            })?;
        let ix = IndexerDims {
            heads,
            head_dim,
            topk: k.opt_u("attention.indexer.top_k").unwrap_or(2048),
            rope: RopeLayout::HalfSplit,
        };
        c.indexer = Some(ix);
        c.dense_attn_limit = Some(ix.topk);
    }
    Ok(())
}

/// MLA's shape (transformers' DeepseekV3Config), mscale, rope pairing, the sigmoid-only
/// scoring, and V3.2's indexer (defaults as DeepseekV32Config).
pub(super) fn hf_hparams(k: &HfKeys<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    let (nope, rope_d, v_dim, kv_lora) = (
        k.req_u("qk_nope_head_dim")?,
        k.req_u("qk_rope_head_dim")?,
        k.req_u("v_head_dim")?,
        k.req_u("kv_lora_rank")?,
    );
    c.attn = AttnKind::Mla {
        q_lora: k.opt_u("q_lora_rank"),
        kv_lora,
        nope,
        rope: rope_d,
        v_dim,
    };
    (c.head_dim, c.v_head_dim, c.n_kv_heads, c.rotary_dim) =
        (nope + rope_d, v_dim, c.n_heads, rope_d);
    let mut attn_scale = 1.0 / (c.head_dim as f64).sqrt();
    if k.rope_type() != "default" {
        let ma = k.rget("mscale_all_dim").unwrap_or(0.0);
        if ma != 0.0 {
            let m = yarn_mscale(k.rget("factor").unwrap_or(1.0), ma);
            attn_scale *= m * m;
        }
    }
    c.attn_scale = attn_scale as f32;
    if k.bool_or("rope_interleave", true) {
        c.rope_layout = RopeLayout::Interleaved;
    }
    let scoring = k
        .cfg
        .get("scoring_func")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("sigmoid");
    if scoring != "sigmoid" {
        return Err(ModelError::Config(format!(
            "config.json: scoring_func {scoring:?} is not supported (sigmoid only)"
        )));
    }
    if let Some(topk) = k.opt_u("index_topk") {
        let ix = IndexerDims {
            heads: k.opt_u("index_n_heads").unwrap_or(64),
            head_dim: k.opt_u("index_head_dim").unwrap_or(128),
            topk,
            rope: RopeLayout::HalfSplit,
        };
        c.indexer = Some(ix);
        c.dense_attn_limit = Some(ix.topk);
    }
    Ok(())
}

// DeepSeek-V3.2 sparse attention (DSA), as transformers 5.17's `DeepseekV32Indexer`: per
// layer, a lightning indexer scores every cached position t for query s,
//   I[s,t] = sum_h relu(q[s,h] . k[t] / sqrt(idx_dim)) * w[s,h],
// with q = wq_b(q latent) split into heads, k = LayerNorm(wk x) (one key per token, cached),
// both half-split (NeoX) rotated on their first `rotary_dim` dims with the model's cos/sin
// (MLA itself rotates interleaved), and w = weights_proj(x) / sqrt(idx_heads). MLA then
// attends only to the `index_topk` best positions (at most that many causal positions: all of
// them, which is exactly dense attention). Like transformers, the FP8 quantization and the
// Hadamard rotation of DeepSeek's own kernels are skipped (the rotation leaves dot products
// unchanged).

/// The indexer's per-chunk buffers, sized once (empty for models without an indexer).
pub struct IndexerScratch {
    pub(super) q: Vec<f32>, // (batch, idx_heads*idx_dim) rotated queries
    pub(super) k: Vec<f32>, // (batch, idx_dim) keys before their norm and rotation
    pub(super) w: Vec<f32>, // (batch, idx_heads) head weights, scaled by idx_heads^-0.5
    score: Vec<f32>,        // (ctx) one query's index scores
    order: Vec<u32>,        // (ctx) positions, partially ordered by score
    pub sel: Vec<u32>,      // (min(topk, ctx)) the selected positions, ascending
    /// GLM-5's shared layers: each row's selection (batch, min(topk, ctx)) and whether it was
    /// sparse, kept by the last layer that ran its indexer (empty without shared layers).
    kept: Vec<u32>,
    kept_sparse: Vec<bool>,
}

impl IndexerScratch {
    /// Bytes of its buffers (the planner's memory budget).
    pub fn bytes(&self) -> usize {
        4 * (self.q.capacity()
            + self.k.capacity()
            + self.w.capacity()
            + self.score.capacity()
            + self.order.capacity()
            + self.sel.capacity()
            + self.kept.capacity())
            + self.kept_sparse.capacity()
    }

    /// Keep row `i`'s selection (in `sel` when `sparse`) for the shared layers that follow.
    pub(super) fn keep(&mut self, i: usize, sparse: bool) {
        if self.kept_sparse.is_empty() {
            return;
        }
        let t = self.sel.len();
        self.kept_sparse[i] = sparse;
        if sparse {
            self.kept[i * t..(i + 1) * t].copy_from_slice(&self.sel);
        }
    }

    /// A shared layer's selection for row `i`: what the last full layer chose (into `sel`).
    pub(super) fn recall(&mut self, i: usize) -> bool {
        let sparse = self.kept_sparse.get(i).copied().unwrap_or(false);
        if sparse {
            let t = self.sel.len();
            self.sel.copy_from_slice(&self.kept[i * t..(i + 1) * t]);
        }
        sparse
    }

    pub fn new(cfg: &ModelConfig, ctx: usize, batch: usize) -> IndexerScratch {
        let Some(ix) = cfg.indexer else {
            return IndexerScratch {
                q: Vec::new(),
                k: Vec::new(),
                w: Vec::new(),
                score: Vec::new(),
                order: Vec::new(),
                sel: Vec::new(),
                kept: Vec::new(),
                kept_sparse: Vec::new(),
            };
        };
        let shared = cfg.indexer_full.iter().any(|full| !full);
        let t = ix.topk.min(ctx);
        IndexerScratch {
            q: vec![0.0; batch * ix.heads * ix.head_dim],
            k: vec![0.0; batch * ix.head_dim],
            w: vec![0.0; batch * ix.heads],
            score: vec![0.0; ctx],
            order: vec![0; ctx],
            sel: vec![0; t],
            kept: vec![0; if shared { batch * t } else { 0 }],
            kept_sparse: vec![false; if shared { batch } else { 0 }],
        }
    }
}

/// torch.nn.LayerNorm over `x` in place (biased variance, f64 sums).
pub(super) fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32], eps: f64) {
    let n = x.len() as f64;
    let mean = x.iter().map(|v| *v as f64).sum::<f64>() / n;
    let var = x.iter().map(|v| (*v as f64 - mean).powi(2)).sum::<f64>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    for ((v, g), c) in x.iter_mut().zip(w).zip(b) {
        *v = ((*v as f64 - mean) * inv) as f32 * g + c;
    }
}

/// Positions scored per parallel task.
const SCORE_CHUNK: usize = 256;

impl<'a> Model<'a> {
    /// Multi-head latent attention of rows 0..n of `Xn` (with V3.2's indexer when the layer
    /// has one); result (after o_proj) in `Proj`.
    /// q = q_b(norm(q_a x)) or q_proj(x); kv = kv_a x = [latent | rope key]; the indexer's
    /// keys are LayerNormed, rotated half-split and cached on side V of the layer.
    ///
    /// Over several sequences' rows (`Spans::Many`, a batched forward) the projections run on
    /// all rows and rotation, the cache write and attention per sequence; a layer with an
    /// indexer (V3.2, GLM-5) runs one sequence only.
    pub(super) fn attn_mla<B: Backend + ?Sized>(
        &self,
        b: &mut B,
        l: usize,
        n: usize,
        spans: Spans<'_>,
        a: &Mla<'_>,
    ) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let AttnKind::Mla {
            q_lora,
            kv_lora,
            nope,
            rope,
            v_dim,
        } = cfg.attn
        else {
            return Err(ModelError::Config("MLA weights in a GQA model".into()));
        };
        let (h, nh, qk) = (cfg.hidden, cfg.n_heads, cfg.head_dim);
        let kc = kv_lora + rope;
        let (xn, k) = (Rows::of(Buf::Xn, h), Rows::of(Buf::K, kc));
        match &a.indexer {
            Some(ix) => b.matmul(
                xn,
                n,
                &[
                    (&a.kv_a, Buf::K),
                    (&ix.wk, Buf::IdxK),
                    (&ix.weights, Buf::IdxW),
                ],
            )?,
            None => b.matmul(xn, n, &[(&a.kv_a, Buf::K)])?,
        }
        if let Some(ix) = &a.indexer {
            let nhi = ix.weights.rows;
            b.scale(Rows::of(Buf::IdxW, nhi), n, (nhi as f32).powf(-0.5))?;
        }
        let mut q_in = xn;
        if let (Some(qa), Some(qn), Some(r)) = (&a.q_a, &a.q_a_norm, q_lora) {
            b.matmul(xn, n, &[(qa, Buf::Qa)])?;
            q_in = Rows::of(Buf::Qa, r);
            b.rmsnorm(q_in, q_in, n, r, qn, cfg.rms_eps)?;
        }
        match &a.indexer {
            Some(ix) => b.matmul(q_in, n, &[(&a.q_b, Buf::Q), (&ix.wq_b, Buf::IdxQ)])?,
            None => b.matmul(q_in, n, &[(&a.q_b, Buf::Q)])?,
        }
        if let Some(ix) = &a.indexer {
            let at = spans.one()?;
            let (d, qd) = (ix.wk.rows, ix.wq_b.rows);
            let layout = cfg.indexer.map_or(RopeLayout::HalfSplit, |x| x.rope);
            b.rope(Rows::of(Buf::IdxQ, qd), n, d, 0, at.rope, layout)?;
            let ik = Rows::of(Buf::IdxK, d);
            b.layer_norm(ik, n, &ix.k_norm, &ix.k_norm_bias, 1e-6)?;
            b.rope(ik, n, d, 0, at.rope, layout)?;
            b.store_cache(l, Cache::V, ik, n, at.pos)?;
        }
        if a.shares_indexer {
            spans.one()?;
        }
        let lat = k.cols(0, kv_lora);
        b.rmsnorm(lat, lat, n, kv_lora, &a.kv_a_norm, cfg.rms_eps)?;
        let q = Rows::of(Buf::Q, nh * qk);
        // Rotation, the cache and attention are per sequence: each span on its own rows.
        let core = |b: &mut B, r0: usize, n: usize, at: At| -> Result<(), ModelError> {
            b.rope(k.from_row(r0), n, kc, kv_lora, at.rope, cfg.rope_layout)?;
            b.store_cache(l, Cache::K, k.from_row(r0), n, at.pos)?;
            b.rope(q.from_row(r0), n, qk, nope, at.rope, cfg.rope_layout)?;
            b.attend_mla_rows(l, r0, n, at.pos, a)
        };
        match spans {
            Spans::One(at) => core(b, 0, n, at)?,
            Spans::Many(ss) => {
                for s in ss {
                    b.use_sequence(s.seq)?;
                    core(b, s.row0, s.n, s.at)?;
                }
            }
        }
        b.matmul(Rows::of(Buf::Att, nh * v_dim), n, &[(&a.wo, Buf::Proj)])
    }

    /// Choose the positions query row `i` (at position `len - 1`) attends to in layer `l`:
    /// false when all `len` causal positions fit in `index_topk` (dense attention), else true
    /// with the `index_topk` best-scoring positions in `st.idx.sel`, ascending. Ties (which
    /// transformers leaves to torch's `topk`) go to the lower position.
    pub(super) fn indexer_select(&self, st: &mut State, l: usize, i: usize, len: usize) -> bool {
        let Some(dims) = self.cfg.indexer else {
            return false;
        };
        let topk = st.idx.sel.len();
        if len <= dims.topk || topk == 0 {
            return false;
        }
        let (d, nh, ctx) = (dims.head_dim, dims.heads, st.ctx());
        let q = &st.idx.q[i * nh * d..(i + 1) * nh * d];
        let w = &st.idx.w[i * nh..(i + 1) * nh];
        let keys = &st.vcache.f32s()[l * ctx * d..(l * ctx + len) * d];
        let scale = (d as f32).powf(-0.5);
        let score_chunk = |(c, out): (usize, &mut [f32])| {
            for (j, o) in out.iter_mut().enumerate() {
                let t = c * SCORE_CHUNK + j;
                let k = &keys[t * d..(t + 1) * d];
                let mut s = 0.0f32;
                for (qh, wh) in q.chunks_exact(d).zip(w) {
                    s += (dot(qh, k) * scale).max(0.0) * wh;
                }
                *o = s;
            }
        };
        let scores = &mut st.idx.score[..len];
        if len * nh * d > 1 << 16 {
            scores
                .par_chunks_mut(SCORE_CHUNK)
                .enumerate()
                .for_each(score_chunk);
        } else {
            scores
                .chunks_mut(SCORE_CHUNK)
                .enumerate()
                .for_each(score_chunk);
        }
        let scores = &st.idx.score[..len];
        let order = &mut st.idx.order[..len];
        order
            .iter_mut()
            .enumerate()
            .for_each(|(t, o)| *o = t as u32);
        order.select_nth_unstable_by(topk - 1, |a, b| {
            scores[*b as usize]
                .total_cmp(&scores[*a as usize])
                .then(a.cmp(b))
        });
        st.idx.sel.copy_from_slice(&order[..topk]);
        st.idx.sel.sort_unstable();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::blocks::Rope;
    use crate::model::config::RopeScaling;

    #[test]
    fn half_split_rotation_ignores_the_tables_layout() {
        // The indexer rotates half-split with MLA's (interleaved) tables: the same angles.
        let yarn = RopeScaling::Yarn {
            factor: 4.0,
            orig_ctx: 128.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 1.1,
            truncate: true,
        };
        let inter = Rope::new(16, 8, 10000.0, yarn, RopeLayout::Interleaved);
        let half = Rope::new(16, 8, 10000.0, yarn, RopeLayout::HalfSplit);
        let x: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin()).collect();
        let (mut a, mut b) = (x.clone(), x.clone());
        inter.apply_as(&mut a, 5, RopeLayout::HalfSplit);
        half.apply(&mut b, 5);
        assert_eq!(a, b);
        assert_eq!(a[16..], x[16..], "dims past the rotary part stay");
    }

    #[test]
    fn layer_norm_has_biased_variance_and_bias() {
        // nn.LayerNorm(4, eps=1e-6)'s formula with weight (1, 2, 3, 4), bias (0, 1, 0, -1) on
        // (1, 2, 3, 4): mean 2.5, biased variance 1.25.
        let mut x = [1.0f32, 2.0, 3.0, 4.0];
        layer_norm(&mut x, &[1.0, 2.0, 3.0, 4.0], &[0.0, 1.0, 0.0, -1.0], 1e-6);
        let inv = 1.0 / (1.25f64 + 1e-6).sqrt();
        let want = [
            -1.5 * inv,
            2.0 * -0.5 * inv + 1.0,
            3.0 * 0.5 * inv,
            4.0 * 1.5 * inv - 1.0,
        ];
        for (a, b) in x.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{x:?} vs {want:?}");
        }
    }
}
