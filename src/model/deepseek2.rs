//! DeepSeek-V3/R1/V3.1/V3.2 and Kimi-K2 (GGUF `deepseek2` / `deepseek32`, HF
//! `DeepseekV3ForCausalLM` / `DeepseekV32ForCausalLM`): multi-head latent attention (q and kv
//! low-rank projections; the cache keeps the kv latent and one shared rope key per token;
//! decode runs in latent space with the up-projections folded into q and the output), YaRN
//! rope with mscale, dense first layers, a shared expert, and sigmoid routing with a
//! selection-only bias, group-limited top-k and a routed scale. V3.2 adds DSA sparse
//! attention: a lightning indexer picks the `index_topk` positions each query attends to
//! (below). Papers: <https://arxiv.org/abs/2412.19437>, DeepSeek-V3.2-Exp (DSA).

use super::blocks::{dot, Rope};
use super::config::ModelConfig;
use super::names::{Role, HF_MLP_MOE};
use super::weights::Indexer;
use super::{Model, ModelError, State};
use crate::kernels;
use rayon::prelude::*;

pub const HF_MOE: &[(Role, &str)] = HF_MLP_MOE;

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
    q: Vec<f32>,       // (batch, idx_heads*idx_dim) rotated queries
    k: Vec<f32>,       // (batch, idx_dim) keys before their norm and rotation
    w: Vec<f32>,       // (batch, idx_heads) head weights, scaled by idx_heads^-0.5
    score: Vec<f32>,   // (ctx) one query's index scores
    order: Vec<u32>,   // (ctx) positions, partially ordered by score
    pub sel: Vec<u32>, // (min(topk, ctx)) the selected positions, ascending
}

impl IndexerScratch {
    pub fn new(cfg: &ModelConfig, ctx: usize, batch: usize) -> IndexerScratch {
        let Some(ix) = cfg.indexer else {
            return IndexerScratch {
                q: Vec::new(),
                k: Vec::new(),
                w: Vec::new(),
                score: Vec::new(),
                order: Vec::new(),
                sel: Vec::new(),
            };
        };
        IndexerScratch {
            q: vec![0.0; batch * ix.heads * ix.head_dim],
            k: vec![0.0; batch * ix.head_dim],
            w: vec![0.0; batch * ix.heads],
            score: vec![0.0; ctx],
            order: vec![0; ctx],
            sel: vec![0; ix.topk.min(ctx)],
        }
    }
}

/// Half-split (NeoX, HF `rotate_half`) rotation of the first `2 * rope.half()` values of `x`
/// at `pos`, with the model's tables whatever their own layout.
fn rope_half_split(rope: &Rope, x: &mut [f32], pos: usize) {
    let h = rope.half();
    let c = &rope.cos_table()[pos * h..(pos + 1) * h];
    let s = &rope.sin_table()[pos * h..(pos + 1) * h];
    for i in 0..h {
        let (a, b) = (x[i], x[i + h]);
        x[i] = a * c[i] - b * s[i];
        x[i + h] = b * c[i] + a * s[i];
    }
}

/// torch.nn.LayerNorm over `x` in place (biased variance, f64 sums).
fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32], eps: f64) {
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
    /// The indexer's projections of the layer input (`st.acts` holds rows 0..n of `st.xn`):
    /// raw keys and scaled head weights.
    pub(super) fn indexer_project_x(
        &self,
        st: &mut State,
        n: usize,
        ix: &Indexer<'_>,
    ) -> Result<(), ModelError> {
        let (pool, isa) = (Some(&self.pool), self.isa);
        let (d, nh) = (ix.wk.rows, ix.weights.rows);
        kernels::matmul(&ix.wk, &mut st.acts, &mut st.idx.k[..n * d], pool, isa)?;
        kernels::matmul(
            &ix.weights,
            &mut st.acts,
            &mut st.idx.w[..n * nh],
            pool,
            isa,
        )?;
        let scale = (nh as f32).powf(-0.5);
        st.idx.w[..n * nh].iter_mut().for_each(|v| *v *= scale);
        Ok(())
    }

    /// The indexer's queries from the q latent (`st.acts` holds it), rotated; and the keys of
    /// rows 0..n normed, rotated and written to cache layer `l` at positions `st.pos..`.
    pub(super) fn indexer_project_q(
        &self,
        st: &mut State,
        l: usize,
        n: usize,
        ix: &Indexer<'_>,
    ) -> Result<(), ModelError> {
        let (pool, isa) = (Some(&self.pool), self.isa);
        let d = ix.wk.rows;
        let qd = ix.wq_b.rows;
        kernels::matmul(&ix.wq_b, &mut st.acts, &mut st.idx.q[..n * qd], pool, isa)?;
        let ctx = st.ctx();
        for i in 0..n {
            let p = st.pos + i;
            let rp = p + st.rope_offset;
            st.idx.q[i * qd..(i + 1) * qd]
                .chunks_exact_mut(d)
                .for_each(|x| rope_half_split(&self.rope, x, rp));
            let k = &mut st.idx.k[i * d..(i + 1) * d];
            layer_norm(k, &ix.k_norm, &ix.k_norm_bias, 1e-6);
            rope_half_split(&self.rope, k, rp);
            let base = (l * ctx + p) * d;
            st.vcache[base..base + d].copy_from_slice(k);
        }
        Ok(())
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
        let keys = &st.vcache[l * ctx * d..(l * ctx + len) * d];
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
    use crate::model::config::{RopeLayout, RopeScaling};

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
        rope_half_split(&inter, &mut a, 5);
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
