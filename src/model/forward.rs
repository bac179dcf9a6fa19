//! The forward pass: a batch of tokens through every layer, top to bottom in one function.
//!
//! Owns: `State` (every buffer and the KV cache, sized once) and `Model::forward_chunk`.
//! Invariant: after `State::new`, a forward call of at most `batch` tokens allocates nothing;
//! the MoE output of each token is summed in its top-k slot order, so the result does not
//! depend on the order in which experts are computed (or, later, arrive from disk).

use super::blocks::{axpy, dot, rmsnorm, rmsnorm_inplace, silu, softmax, top_k};
use super::config::{AttnKind, ExpertAct, ModelConfig, QkNorm};
use super::gptoss;
use super::weights::{Attention, ExpertBias, Ffn, Gqa, HeadMat, Layer, Mla, Mlp, Moe};
use super::{Model, ModelError};
use crate::experts::ExpertCache;
use crate::kernels::{self, Acts, Isa, WeightView};
use rayon::prelude::*;

/// Buffers for one sequence: activations for up to `batch` tokens and the KV cache for `ctx`.
pub struct State {
    batch: usize,
    ctx: usize,
    logit_rows: usize,
    /// Tokens already in the KV cache.
    pub pos: usize,
    pub(crate) x: Vec<f32>,    // (batch, hidden) residual stream
    pub(crate) xn: Vec<f32>,   // (batch, hidden) normed input of a sub-block
    q: Vec<f32>,               // (batch, q_dim)
    qa: Vec<f32>,              // (batch, q_lora) MLA q latent
    k: Vec<f32>,               // (batch, max(kv_dim, kv_lora + rope))
    v: Vec<f32>,               // (batch, kv_dim)
    att: Vec<f32>,             // (batch, att_dim) attention output before o_proj
    scores: Vec<f32>,          // (n_heads, ctx)
    lat: Vec<f32>,             // (2, kv_lora) MLA: q folded into latent space, latent context
    proj: Vec<f32>,            // (batch, hidden) sub-block output
    pub(crate) hfin: Vec<f32>, // (batch, hidden) final-normed hidden states of the last chunk
    /// Added to cache positions to get rotary positions (1 for the MTP head's slots).
    pub(crate) rope_offset: usize,
    pub(super) kcache: Vec<f32>, // (layers, ctx, k_dim) GQA keys, or MLA latent + rope key; pub(super) for kv_io.rs
    pub(super) vcache: Vec<f32>, // (layers, ctx, v_dim) GQA values, or V3.2 indexer keys
    pub(super) idx: super::deepseek2::IndexerScratch, // V3.2 indexer buffers (empty otherwise)
    pub(crate) router: Vec<f32>, // (batch, n_experts) router scores
    choice: Vec<f32>,            // (n_experts) selection scores of one token
    groups_score: Vec<f32>,      // (n_group)
    groups_kept: Vec<usize>,     // (topk_group)
    pub(crate) sel: Vec<usize>,  // (batch, k) chosen experts
    pub(crate) selw: Vec<f32>,   // (batch, k) their routing weights
    pub(crate) groups: Vec<Vec<(u32, u32)>>, // per expert: (token, slot) pairs, capacity batch
    gathered: Vec<f32>,          // (batch, hidden) inputs of one expert's tokens
    gate: Vec<f32>,              // (batch, widest ffn)
    up: Vec<f32>,                // (batch, widest ffn)
    down: Vec<f32>,              // (batch, hidden)
    slot_out: Vec<f32>,          // (batch, k, hidden) each token's expert outputs, unweighted
    pub(crate) acts: Acts,
    pub(crate) logits: Vec<f32>,   // (logit_rows, vocab)
    pub(crate) needed: Vec<usize>, // (n_experts) experts one MoE layer needs, ascending
    // Prefetch (`CacheConfig::prefetch`): the next layer's router applied early.
    pf_router: Vec<f32>,   // (batch, n_experts) next layer's router scores
    pf_sel: Vec<usize>,    // (k) one token's predicted experts
    pf_selw: Vec<f32>,     // (k) their weights (unused)
    pf_mark: Vec<bool>,    // (n_experts) predicted by some token of the chunk
    pf_needed: Vec<usize>, // (n_experts) the predicted union, ascending
    // Multi-token prediction (empty unless the model has an MTP layer).
    pub(crate) mtp_cat: Vec<f32>, // (batch, 2*hidden) [enorm(embed); hnorm(h)]
    pub(crate) mtp_hidden: Vec<f32>, // (batch, hidden) main hidden states paired with tokens
    pub(crate) mtp_logits: Vec<f32>, // (logit_rows, vocab)
    /// MTP slots in the MTP layer's cache (slot s pairs hidden of position s with token s+1).
    pub mtp_pos: usize,
    /// Streaming expert cache; `None` = experts are read through the mapped files.
    pub(crate) expert_cache: Option<ExpertCache>,
    /// Experts computed in the last forward call, summed over layers (telemetry).
    pub experts_run: usize,
    /// Seconds spent per part of the forward pass since the state was made (`--prof`).
    pub prof: Prof,
    /// The GPU forward (`--gpu`); when set, `forward_chunk` runs there.
    #[cfg(feature = "cuda")]
    pub(crate) gpu: Option<Box<crate::gpu::model::GpuState>>,
}

/// Where forward time goes (wall seconds, accumulated).
#[derive(Clone, Copy, Debug, Default)]
pub struct Prof {
    pub total: f64,
    pub attention: f64,
    /// Routed experts: waiting for bytes and computing (the cache's own wait figure splits it).
    pub experts: f64,
    pub dense_ffn: f64,
    pub lm_head: f64,
}

impl State {
    /// `batch`: most tokens per forward chunk (prefill speed vs memory); `logit_rows`: most
    /// positions whose logits one chunk returns (1 for generation).
    /// No MTP layer cache or buffers (see `with_mtp`).
    pub fn new(cfg: &ModelConfig, ctx: usize, batch: usize, logit_rows: usize) -> State {
        State::with_mtp(cfg, ctx, batch, logit_rows, false)
    }

    /// `new`, plus, when `mtp` is set and the model has an MTP layer, that layer's KV cache
    /// (one more cache layer) and the MTP head's buffers: what `--mtp K > 0` needs. sluice
    /// runs only the first MTP layer, so that is the one cached.
    pub fn with_mtp(
        cfg: &ModelConfig,
        ctx: usize,
        batch: usize,
        logit_rows: usize,
        mtp: bool,
    ) -> State {
        let mtp = mtp && cfg.n_mtp_layers > 0;
        let cache_layers = cfg.n_layers + usize::from(mtp);
        let (h, qd, kvd, e, k) = (
            cfg.hidden,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.n_experts,
            cfg.n_experts_used,
        );
        let (kc, vc) = cfg.cache_dims();
        let (q_lora, kv_lora) = match cfg.attn {
            AttnKind::Mla {
                q_lora, kv_lora, ..
            } => (q_lora.unwrap_or(0), kv_lora),
            AttnKind::Gqa => (0, 0),
        };
        let ffn = cfg.expert_ffn.max(cfg.dense_ffn).max(cfg.shared_ffn);
        let batch = batch.max(1);
        let logit_rows = logit_rows.clamp(1, batch);
        let widest = (2 * h)
            .max(qd)
            .max(ffn)
            .max(cfg.att_dim())
            .max(q_lora)
            .max(kv_lora);
        State {
            batch,
            ctx,
            logit_rows,
            pos: 0,
            x: vec![0.0; batch * h],
            xn: vec![0.0; batch * h],
            q: vec![0.0; batch * qd],
            qa: vec![0.0; batch * q_lora],
            k: vec![0.0; batch * kvd.max(kc)],
            v: vec![0.0; batch * kvd],
            att: vec![0.0; batch * cfg.att_dim()],
            scores: vec![0.0; cfg.n_heads * ctx],
            lat: vec![0.0; 2 * kv_lora],
            proj: vec![0.0; batch * h],
            hfin: vec![0.0; batch * h],
            rope_offset: 0,
            kcache: vec![0.0; cache_layers * ctx * kc],
            vcache: vec![0.0; cache_layers * ctx * vc],
            idx: super::deepseek2::IndexerScratch::new(cfg, ctx, batch),
            router: vec![0.0; batch * e],
            choice: vec![0.0; e],
            groups_score: vec![0.0; cfg.routing.n_group],
            groups_kept: vec![0; cfg.routing.topk_group],
            sel: vec![0; batch * k],
            selw: vec![0.0; batch * k],
            groups: (0..e).map(|_| Vec::with_capacity(batch)).collect(),
            gathered: vec![0.0; batch * h],
            gate: vec![0.0; batch * ffn],
            up: vec![0.0; batch * ffn],
            down: vec![0.0; batch * h],
            slot_out: vec![0.0; batch * k * h],
            acts: Acts::with_capacity(batch, widest),
            logits: vec![0.0; logit_rows * cfg.vocab],
            needed: Vec::with_capacity(e),
            pf_router: vec![0.0; batch * e],
            pf_sel: vec![0; k],
            pf_selw: vec![0.0; k],
            pf_mark: vec![false; e],
            pf_needed: Vec::with_capacity(e),
            mtp_cat: vec![0.0; if mtp { batch * 2 * h } else { 0 }],
            mtp_hidden: vec![0.0; if mtp { batch * h } else { 0 }],
            mtp_logits: vec![0.0; if mtp { logit_rows * cfg.vocab } else { 0 }],
            mtp_pos: 0,
            expert_cache: None,
            experts_run: 0,
            prof: Prof::default(),
            #[cfg(feature = "cuda")]
            gpu: None,
        }
    }

    pub fn ctx(&self) -> usize {
        self.ctx
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    pub fn logit_rows(&self) -> usize {
        self.logit_rows
    }

    /// Whether this state carries the MTP layer's cache and buffers (`with_mtp`).
    pub fn has_mtp(&self) -> bool {
        !self.mtp_hidden.is_empty()
    }

    /// Bytes held by the KV cache: `ctx` x `ModelConfig::kv_bytes_per_token(mtp)`.
    pub fn kv_bytes(&self) -> usize {
        (self.kcache.len() + self.vcache.len()) * 4
    }

    /// Forget the sequence (the buffers stay allocated).
    pub fn reset(&mut self) {
        self.pos = 0;
        self.mtp_pos = 0;
    }

    /// Drop cached positions from `pos` on (prompt reuse keeps a prefix). The MTP head's
    /// slots depend on the positions after them, so they go back to `pos - 1`.
    pub fn truncate(&mut self, pos: usize) {
        self.pos = self.pos.min(pos);
        self.mtp_pos = self.mtp_pos.min(pos.saturating_sub(1));
    }
}

/// y = M x for a per-head matrix.
fn head_matvec(
    m: &HeadMat<'_>,
    x: &[f32],
    y: &mut [f32],
    acts: &mut Acts,
    isa: Isa,
) -> Result<(), ModelError> {
    match m {
        HeadMat::View(w) => {
            acts.load(x, 1, w.cols);
            kernels::matmul(w, acts, y, None, isa)?;
        }
        HeadMat::Owned { rows, cols, data } => {
            for (r, o) in y.iter_mut().enumerate().take(*rows) {
                *o = dot(&data[r * cols..(r + 1) * cols], x);
            }
        }
    }
    Ok(())
}

impl<'a> Model<'a> {
    /// Run `tokens` (at most `st.batch()`) at positions `st.pos..`, append them to the KV cache,
    /// and leave the logits of tokens `logits_from..` in the returned slice
    /// ((tokens.len() - logits_from) x vocab, at most `st.logit_rows()` rows).
    pub fn forward_chunk<'s>(
        &self,
        st: &'s mut State,
        tokens: &[u32],
        logits_from: usize,
    ) -> Result<&'s [f32], ModelError> {
        // Run on a pool thread: nested parallel loops then use the workers' own deques instead
        // of the pool's injector queue, which allocates as jobs pass through it.
        let t0 = std::time::Instant::now();
        #[cfg(feature = "cuda")]
        if let Some(mut g) = st.gpu.take() {
            let r = self
                .check_chunk(st, tokens, logits_from)
                .and_then(|()| g.forward(self, st, tokens, logits_from));
            st.gpu = Some(g);
            st.prof.total += t0.elapsed().as_secs_f64();
            r?;
            let n_logits = tokens.len().saturating_sub(logits_from);
            return Ok(&st.logits[..n_logits * self.cfg.vocab]);
        }
        let r = self
            .pool
            .install(|| self.forward_inner(st, tokens, logits_from));
        st.prof.total += t0.elapsed().as_secs_f64();
        r?;
        let n_logits = tokens.len().saturating_sub(logits_from);
        Ok(&st.logits[..n_logits * self.cfg.vocab])
    }

    fn forward_inner(
        &self,
        st: &mut State,
        tokens: &[u32],
        logits_from: usize,
    ) -> Result<(), ModelError> {
        self.check_chunk(st, tokens, logits_from)?;
        let cfg = &self.cfg;
        let n = tokens.len();
        let n_logits = n.saturating_sub(logits_from);
        let h = cfg.hidden;
        let w = &self.weights;
        st.experts_run = 0;

        // Embeddings.
        let er = w.token_embd.row_bytes();
        for (i, &t) in tokens.iter().enumerate() {
            let row = &w.token_embd.bytes[t as usize * er..(t as usize + 1) * er];
            kernels::dequantize(w.token_embd.dtype, row, &mut st.x[i * h..(i + 1) * h])?;
        }

        for (l, lw) in w.layers.iter().enumerate() {
            self.layer_forward(st, l, lw, n)?;
        }
        st.pos += n;
        self.final_rows(st, n, logits_from, n_logits)
    }

    /// The contract of `forward_chunk`: 1..=batch tokens, room in the context, at most
    /// `logit_rows` logit rows, token ids in the vocabulary.
    fn check_chunk(
        &self,
        st: &State,
        tokens: &[u32],
        logits_from: usize,
    ) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let n = tokens.len();
        if n == 0 || n > st.batch {
            return Err(ModelError::Input(format!(
                "forward_chunk got {n} tokens (batch holds 1..={})",
                st.batch
            )));
        }
        if st.pos + n > st.ctx {
            return Err(ModelError::ContextFull {
                needed: st.pos + n,
                ctx: st.ctx,
            });
        }
        let n_logits = n.saturating_sub(logits_from);
        if n_logits > st.logit_rows {
            return Err(ModelError::Input(format!(
                "{n_logits} logit rows requested, state holds {}",
                st.logit_rows
            )));
        }
        for &t in tokens {
            if t as usize >= cfg.vocab {
                return Err(ModelError::Input(format!(
                    "token id {t} is out of range (vocabulary has {} tokens)",
                    cfg.vocab
                )));
            }
        }
        Ok(())
    }

    fn final_rows(
        &self,
        st: &mut State,
        n: usize,
        logits_from: usize,
        n_logits: usize,
    ) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let (h, w) = (cfg.hidden, &self.weights);
        // Final norm of every row (kept for the MTP head) and lm_head for the requested rows.
        let v = cfg.vocab;
        for i in 0..n {
            rmsnorm(
                &mut st.hfin[i * h..(i + 1) * h],
                &st.x[i * h..(i + 1) * h],
                &w.output_norm,
                cfg.rms_eps,
            );
        }
        if n_logits > 0 {
            let t = std::time::Instant::now();
            st.acts.load(&st.hfin[logits_from * h..n * h], n_logits, h);
            kernels::matmul(
                &w.output,
                &mut st.acts,
                &mut st.logits[..n_logits * v],
                Some(&self.pool),
                self.isa,
            )?;
            st.prof.lm_head += t.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// One decoder layer over rows 0..n of `st.x` (in place), at positions `st.pos..`, with
    /// its keys and values in cache layer `l`.
    pub(crate) fn layer_forward(
        &self,
        st: &mut State,
        l: usize,
        lw: &Layer<'_>,
        n: usize,
    ) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let h = cfg.hidden;
        for i in 0..n {
            rmsnorm(
                &mut st.xn[i * h..(i + 1) * h],
                &st.x[i * h..(i + 1) * h],
                &lw.attn_norm,
                cfg.rms_eps,
            );
        }
        let t = std::time::Instant::now();
        match &lw.attn {
            Attention::Gqa(a) => self.attn_gqa(st, l, n, a)?,
            Attention::Mla(a) => self.attn_mla(st, l, n, a)?,
        }
        st.prof.attention += t.elapsed().as_secs_f64();
        for (x, p) in st.x[..n * h].iter_mut().zip(&st.proj[..n * h]) {
            *x += p;
        }
        if l + 1 < cfg.n_layers {
            let t = std::time::Instant::now();
            self.prefetch_next(st, l + 1, n)?;
            st.prof.experts += t.elapsed().as_secs_f64();
        }
        for i in 0..n {
            rmsnorm(
                &mut st.xn[i * h..(i + 1) * h],
                &st.x[i * h..(i + 1) * h],
                &lw.ffn_norm,
                cfg.rms_eps,
            );
        }
        let t = std::time::Instant::now();
        match &lw.ffn {
            Ffn::Dense(m) => {
                self.mlp(st, n, m)?;
                st.proj[..n * h].copy_from_slice(&st.down[..n * h]);
                st.prof.dense_ffn += t.elapsed().as_secs_f64();
            }
            Ffn::Moe(m) => {
                self.moe(st, l, n, m)?;
                st.prof.experts += t.elapsed().as_secs_f64();
            }
        }
        for (x, p) in st.x[..n * h].iter_mut().zip(&st.proj[..n * h]) {
            *x += p;
        }
        Ok(())
    }

    /// Grouped-query attention of tokens 0..n of `st.xn`; result (after o_proj) in `st.proj`.
    fn attn_gqa(&self, st: &mut State, l: usize, n: usize, a: &Gqa<'_>) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let (h, qd, kvd, hd) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let (pool, isa) = (Some(&self.pool), self.isa);
        st.acts.load(&st.xn[..n * h], n, h);
        kernels::matmul(&a.wq, &mut st.acts, &mut st.q[..n * qd], pool, isa)?;
        kernels::matmul(&a.wk, &mut st.acts, &mut st.k[..n * kvd], pool, isa)?;
        kernels::matmul(&a.wv, &mut st.acts, &mut st.v[..n * kvd], pool, isa)?;
        let rd = cfg.rotary_dim;
        for i in 0..n {
            let q = &mut st.q[i * qd..(i + 1) * qd];
            let k = &mut st.k[i * kvd..(i + 1) * kvd];
            let v = &mut st.v[i * kvd..(i + 1) * kvd];
            for (x, b) in [(&mut *q, &a.bq), (&mut *k, &a.bk), (&mut *v, &a.bv)] {
                if let Some(b) = b {
                    x.iter_mut().zip(b).for_each(|(x, b)| *x += b);
                }
            }
            match (cfg.qk_norm, &a.q_norm, &a.k_norm) {
                (QkNorm::PerHead, Some(qn), Some(kn)) => {
                    q.chunks_exact_mut(hd)
                        .for_each(|x| rmsnorm_inplace(x, qn, cfg.rms_eps));
                    k.chunks_exact_mut(hd)
                        .for_each(|x| rmsnorm_inplace(x, kn, cfg.rms_eps));
                }
                (QkNorm::Whole, Some(qn), Some(kn)) => {
                    rmsnorm_inplace(q, qn, cfg.rms_eps);
                    rmsnorm_inplace(k, kn, cfg.rms_eps);
                }
                _ => {}
            }
            if let Some(c) = cfg.clip_qkv {
                for x in [&mut *q, &mut *k, &mut *v] {
                    x.iter_mut().for_each(|x| *x = x.clamp(-c, c));
                }
            }
            let p = st.pos + i;
            let rp = p + st.rope_offset;
            q.chunks_exact_mut(hd)
                .for_each(|x| self.rope.apply(&mut x[..rd], rp));
            k.chunks_exact_mut(hd)
                .for_each(|x| self.rope.apply(&mut x[..rd], rp));
            let base = (l * st.ctx + p) * kvd;
            st.kcache[base..base + kvd].copy_from_slice(k);
            st.vcache[base..base + kvd].copy_from_slice(v);
        }
        let group = cfg.n_heads / cfg.n_kv_heads;
        let scale = cfg.attn_scale;
        let ctx = st.ctx;
        let layer_k = &st.kcache[l * ctx * kvd..(l + 1) * ctx * kvd];
        let layer_v = &st.vcache[l * ctx * kvd..(l + 1) * ctx * kvd];
        for i in 0..n {
            // Causal: positions first..=pos+i; a sliding window keeps the last W of them.
            let len = st.pos + i + 1;
            let first = cfg.window(l).map_or(0, |w| len.saturating_sub(w));
            let q = &st.q[i * qd..(i + 1) * qd];
            let sinks = a.sinks.as_deref();
            let out = &mut st.att[i * qd..(i + 1) * qd];
            let head = |(hh, (o, sc)): (usize, (&mut [f32], &mut [f32]))| {
                let qh = &q[hh * hd..(hh + 1) * hd];
                let kvh = hh / group;
                let sc = &mut sc[..len - first];
                for (j, s) in (first..).zip(sc.iter_mut()) {
                    *s = dot(qh, &layer_k[j * kvd + kvh * hd..j * kvd + (kvh + 1) * hd]) * scale;
                }
                match sinks {
                    Some(sk) => gptoss::softmax_with_sink(sc, sk[hh]),
                    None => softmax(sc),
                }
                o.fill(0.0);
                for (j, s) in (first..).zip(sc.iter()) {
                    axpy(
                        o,
                        *s,
                        &layer_v[j * kvd + kvh * hd..j * kvd + (kvh + 1) * hd],
                    );
                }
            };
            if len * qd > 1 << 14 {
                out.par_chunks_mut(hd)
                    .zip(st.scores.par_chunks_mut(ctx))
                    .enumerate()
                    .for_each(head);
            } else {
                out.chunks_mut(hd)
                    .zip(st.scores.chunks_mut(ctx))
                    .enumerate()
                    .for_each(head);
            }
        }
        st.acts.load(&st.att[..n * qd], n, qd);
        kernels::matmul(&a.wo, &mut st.acts, &mut st.proj[..n * h], pool, isa)?;
        if let Some(bo) = &a.bo {
            st.proj[..n * h]
                .chunks_exact_mut(h)
                .for_each(|x| x.iter_mut().zip(bo).for_each(|(x, b)| *x += b));
        }
        Ok(())
    }

    /// Multi-head latent attention in absorbed form: scores and values are computed against
    /// the cached latent, never against expanded per-head keys and values.
    fn attn_mla(&self, st: &mut State, l: usize, n: usize, a: &Mla<'_>) -> Result<(), ModelError> {
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
        let (pool, isa) = (Some(&self.pool), self.isa);
        let kc = kv_lora + rope;
        // q = q_b(norm(q_a x)) or q_proj(x); kv = kv_a x = [latent | rope key].
        st.acts.load(&st.xn[..n * h], n, h);
        kernels::matmul(&a.kv_a, &mut st.acts, &mut st.k[..n * kc], pool, isa)?;
        if let Some(ix) = &a.indexer {
            self.indexer_project_x(st, n, ix)?;
        }
        if let (Some(qa), Some(qn), Some(r)) = (&a.q_a, &a.q_a_norm, q_lora) {
            kernels::matmul(qa, &mut st.acts, &mut st.qa[..n * r], pool, isa)?;
            st.qa[..n * r]
                .chunks_exact_mut(r)
                .for_each(|x| rmsnorm_inplace(x, qn, cfg.rms_eps));
            st.acts.load(&st.qa[..n * r], n, r);
        }
        kernels::matmul(&a.q_b, &mut st.acts, &mut st.q[..n * nh * qk], pool, isa)?;
        if let Some(ix) = &a.indexer {
            self.indexer_project_q(st, l, n, ix)?;
        }
        for i in 0..n {
            let p = st.pos + i;
            let kv = &mut st.k[i * kc..(i + 1) * kc];
            rmsnorm_inplace(&mut kv[..kv_lora], &a.kv_a_norm, cfg.rms_eps);
            self.rope.apply(&mut kv[kv_lora..], p + st.rope_offset);
            let base = (l * st.ctx + p) * kc;
            st.kcache[base..base + kc].copy_from_slice(kv);
            for hh in 0..nh {
                self.rope.apply(
                    &mut st.q[i * nh * qk + hh * qk + nope..i * nh * qk + (hh + 1) * qk],
                    p + st.rope_offset,
                );
            }
        }
        let ctx = st.ctx;
        for i in 0..n {
            let len = st.pos + i + 1;
            // V3.2: past `index_topk` positions, attend only to those the indexer selects.
            let sparse = match &a.indexer {
                Some(_) => self.indexer_select(st, l, i, len),
                None => false,
            };
            let sel = &st.idx.sel[..if sparse { st.idx.sel.len() } else { 0 }];
            let m = if sparse { sel.len() } else { len };
            for hh in 0..nh {
                let q = &st.q[i * nh * qk + hh * qk..i * nh * qk + (hh + 1) * qk];
                let (q_lat, c_lat) = st.lat.split_at_mut(kv_lora);
                head_matvec(&a.k_b[hh], &q[..nope], q_lat, &mut st.acts, isa)?;
                let sc = &mut st.scores[hh * ctx..hh * ctx + m];
                let layer = &st.kcache[l * ctx * kc..];
                let pos = |jj: usize| if sparse { sel[jj] as usize } else { jj };
                for (jj, s) in sc.iter_mut().enumerate() {
                    let j = pos(jj);
                    let c = &layer[j * kc..(j + 1) * kc];
                    *s = (dot(q_lat, &c[..kv_lora]) + dot(&q[nope..], &c[kv_lora..]))
                        * cfg.attn_scale;
                }
                softmax(sc);
                c_lat.fill(0.0);
                for (jj, s) in sc.iter().enumerate() {
                    let j = pos(jj);
                    axpy(c_lat, *s, &layer[j * kc..j * kc + kv_lora]);
                }
                let out =
                    &mut st.att[i * nh * v_dim + hh * v_dim..i * nh * v_dim + (hh + 1) * v_dim];
                head_matvec(&a.v_b[hh], c_lat, out, &mut st.acts, isa)?;
            }
        }
        st.acts.load(&st.att[..n * nh * v_dim], n, nh * v_dim);
        kernels::matmul(&a.wo, &mut st.acts, &mut st.proj[..n * h], pool, isa)?;
        Ok(())
    }

    /// SwiGLU MLP of tokens 0..n of `st.xn`; result in `st.down`.
    fn mlp(&self, st: &mut State, n: usize, m: &Mlp<'_>) -> Result<(), ModelError> {
        let (h, f) = (self.cfg.hidden, m.gate.rows);
        let (pool, isa) = (Some(&self.pool), self.isa);
        st.acts.load(&st.xn[..n * h], n, h);
        kernels::matmul(&m.gate, &mut st.acts, &mut st.gate[..n * f], pool, isa)?;
        kernels::matmul(&m.up, &mut st.acts, &mut st.up[..n * f], pool, isa)?;
        for (g, u) in st.gate[..n * f].iter_mut().zip(&st.up[..n * f]) {
            *g = silu(*g) * u;
        }
        st.acts.load(&st.gate[..n * f], n, f);
        kernels::matmul(&m.down, &mut st.acts, &mut st.down[..n * h], pool, isa)?;
        Ok(())
    }

    /// One expert for all the tokens routed to it: gather their inputs, SwiGLU, and leave
    /// each token's output in its top-k slot.
    fn run_expert(
        &self,
        st: &mut State,
        ex: usize,
        gate: &WeightView<'_>,
        up: &WeightView<'_>,
        down: &WeightView<'_>,
        bias: Option<&ExpertBias>,
    ) -> Result<(), ModelError> {
        let (h, k, f) = (
            self.cfg.hidden,
            self.cfg.n_experts_used,
            self.cfg.expert_ffn,
        );
        let (pool, isa) = (Some(&self.pool), self.isa);
        let toks = &st.groups[ex];
        let cnt = toks.len();
        st.experts_run += 1;
        for (j, &(t, _)) in toks.iter().enumerate() {
            st.gathered[j * h..(j + 1) * h]
                .copy_from_slice(&st.xn[t as usize * h..(t as usize + 1) * h]);
        }
        st.acts.load(&st.gathered[..cnt * h], cnt, h);
        kernels::matmul(gate, &mut st.acts, &mut st.gate[..cnt * f], pool, isa)?;
        kernels::matmul(up, &mut st.acts, &mut st.up[..cnt * f], pool, isa)?;
        if let Some(b) = bias {
            let (bg, bu) = (&b.gate[ex * f..(ex + 1) * f], &b.up[ex * f..(ex + 1) * f]);
            for (g, u) in st.gate[..cnt * f]
                .chunks_exact_mut(f)
                .zip(st.up[..cnt * f].chunks_exact_mut(f))
            {
                g.iter_mut().zip(bg).for_each(|(x, b)| *x += b);
                u.iter_mut().zip(bu).for_each(|(x, b)| *x += b);
            }
        }
        match self.cfg.expert_act {
            ExpertAct::Silu => {
                for (g, u) in st.gate[..cnt * f].iter_mut().zip(&st.up[..cnt * f]) {
                    *g = silu(*g) * u;
                }
            }
            ExpertAct::ClampedSwiglu { alpha, limit } => {
                gptoss::clamped_swiglu(&mut st.gate[..cnt * f], &st.up[..cnt * f], alpha, limit)
            }
        }
        st.acts.load(&st.gate[..cnt * f], cnt, f);
        kernels::matmul(down, &mut st.acts, &mut st.down[..cnt * h], pool, isa)?;
        if let Some(b) = bias {
            let bd = &b.down[ex * h..(ex + 1) * h];
            st.down[..cnt * h]
                .chunks_exact_mut(h)
                .for_each(|d| d.iter_mut().zip(bd).for_each(|(x, b)| *x += b));
        }
        for (j, &(t, slot)) in st.groups[ex].iter().enumerate() {
            let dst = (t as usize * k + slot as usize) * h;
            st.slot_out[dst..dst + h].copy_from_slice(&st.down[j * h..(j + 1) * h]);
        }
        Ok(())
    }

    /// The needed experts through the streaming cache, in waves of at most the layer's
    /// evictable slots: all misses of a wave are read at once and each expert is computed as
    /// soon as its bytes land (hits first).
    fn moe_streamed(
        &self,
        st: &mut State,
        l: usize,
        m: &Moe<'_>,
        cache: &mut ExpertCache,
    ) -> Result<(), ModelError> {
        let cap = cache.slots(l).max(1);
        let mut i = 0;
        while i < st.needed.len() {
            let start = i;
            let mut unpinned = 0;
            while i < st.needed.len() {
                let pinned = cache.is_pinned(l, st.needed[i]);
                if !pinned && unpinned == cap {
                    break;
                }
                unpinned += usize::from(!pinned);
                i += 1;
            }
            let begun = cache.begin(l, &st.needed[start..i]);
            let wave = (|| -> Result<(), ModelError> {
                begun?;
                while let Some((ex, b)) = cache.next_ready()? {
                    let xw = &m.experts[ex];
                    let v = |w: &WeightView<'_>, bytes| WeightView { bytes, ..*w };
                    self.run_expert(
                        st,
                        ex,
                        &v(&xw.gate, b.gate),
                        &v(&xw.up, b.up),
                        &v(&xw.down, b.down),
                        m.exp_bias.as_ref(),
                    )?;
                }
                Ok(())
            })();
            cache.end();
            wave?;
        }
        Ok(())
    }

    /// Choose experts and their weights for token `i` from `st.router` (raw logits), into
    /// `st.sel` and `st.selw` (see `route_token`).
    fn route(&self, st: &mut State, i: usize, bias: Option<&[f32]>) {
        let (e, k) = (self.cfg.n_experts, self.cfg.n_experts_used);
        route_token(
            &self.cfg,
            bias,
            &mut st.router[i * e..(i + 1) * e],
            &mut Scratch {
                choice: &mut st.choice,
                groups_score: &mut st.groups_score,
                groups_kept: &mut st.groups_kept,
            },
            &mut st.sel[i * k..(i + 1) * k],
            &mut st.selw[i * k..(i + 1) * k],
        );
    }

    /// `--prefetch`: predict layer `next`'s experts for tokens 0..n by applying its router to
    /// the residual stream as it is now (after this layer's attention, before its FFN) and
    /// start reading the predicted union. Touches only scratch (`st.xn`, `st.acts`, which the
    /// caller recomputes, and the `pf_*` buffers), so results do not depend on it.
    fn prefetch_next(&self, st: &mut State, next: usize, n: usize) -> Result<(), ModelError> {
        if !st
            .expert_cache
            .as_ref()
            .is_some_and(ExpertCache::prefetching)
        {
            return Ok(());
        }
        let Some(lw) = self.weights.layers.get(next) else {
            return Ok(());
        };
        let Ffn::Moe(m) = &lw.ffn else {
            return Ok(());
        };
        let cfg = &self.cfg;
        let (h, e, k) = (cfg.hidden, cfg.n_experts, cfg.n_experts_used);
        for i in 0..n {
            rmsnorm(
                &mut st.xn[i * h..(i + 1) * h],
                &st.x[i * h..(i + 1) * h],
                &lw.ffn_norm,
                cfg.rms_eps,
            );
        }
        st.acts.load(&st.xn[..n * h], n, h);
        kernels::matmul(
            &m.router,
            &mut st.acts,
            &mut st.pf_router[..n * e],
            Some(&self.pool),
            self.isa,
        )?;
        add_rows(&mut st.pf_router[..n * e], m.router_bias.as_deref());
        st.pf_mark.fill(false);
        for i in 0..n {
            route_token(
                cfg,
                m.score_bias.as_deref(),
                &mut st.pf_router[i * e..(i + 1) * e],
                &mut Scratch {
                    choice: &mut st.choice,
                    groups_score: &mut st.groups_score,
                    groups_kept: &mut st.groups_kept,
                },
                &mut st.pf_sel[..k],
                &mut st.pf_selw[..k],
            );
            for &ex in &st.pf_sel[..k] {
                st.pf_mark[ex] = true;
            }
        }
        st.pf_needed.clear();
        st.pf_needed.extend((0..e).filter(|&ex| st.pf_mark[ex]));
        if let Some(c) = &st.expert_cache {
            c.prefetch(next, &st.pf_needed)?;
        }
        Ok(())
    }

    /// Route tokens 0..n from the router logits in `st.router`: `st.sel`/`st.selw` per token,
    /// `st.groups` (per expert, its (token, slot) pairs) and `st.needed` (experts with tokens,
    /// ascending). The GPU forward calls this too, so both choose experts by the same code.
    pub(crate) fn select_experts(&self, st: &mut State, n: usize, bias: Option<&[f32]>) {
        let (e, k) = (self.cfg.n_experts, self.cfg.n_experts_used);
        st.groups.iter_mut().for_each(Vec::clear);
        for i in 0..n {
            self.route(st, i, bias);
            for slot in 0..k {
                let ex = st.sel[i * k + slot];
                st.groups[ex].push((i as u32, slot as u32));
            }
        }
        st.needed.clear();
        for ex in 0..e {
            if !st.groups[ex].is_empty() {
                st.needed.push(ex);
            }
        }
    }

    /// Routed experts (+ shared experts) for tokens 0..n of `st.xn`; result in `st.proj`.
    fn moe(&self, st: &mut State, l: usize, n: usize, m: &Moe<'_>) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let (h, e, k) = (cfg.hidden, cfg.n_experts, cfg.n_experts_used);
        let (pool, isa) = (Some(&self.pool), self.isa);

        st.acts.load(&st.xn[..n * h], n, h);
        kernels::matmul(&m.router, &mut st.acts, &mut st.router[..n * e], pool, isa)?;
        add_rows(&mut st.router[..n * e], m.router_bias.as_deref());
        self.select_experts(st, n, m.score_bias.as_deref());

        // Take the cache out of the state while experts run (put back on every path).
        let mut cache = st.expert_cache.take();
        let streamed = if l < cfg.n_layers {
            cache.as_mut()
        } else {
            None
        };
        let run = match streamed {
            None => (0..st.needed.len()).try_for_each(|i| {
                let ex = st.needed[i];
                let xw = &m.experts[ex];
                self.run_expert(st, ex, &xw.gate, &xw.up, &xw.down, m.exp_bias.as_ref())
            }),
            Some(c) => self.moe_streamed(st, l, m, c),
        };
        st.expert_cache = cache;
        run?;

        for i in 0..n {
            let out = &mut st.proj[i * h..(i + 1) * h];
            out.fill(0.0);
            for slot in 0..k {
                let wv = st.selw[i * k + slot];
                axpy(
                    out,
                    wv,
                    &st.slot_out[(i * k + slot) * h..(i * k + slot + 1) * h],
                );
            }
        }
        if let Some(sh) = &m.shared {
            self.mlp(st, n, sh)?;
            for (o, d) in st.proj[..n * h].iter_mut().zip(&st.down[..n * h]) {
                *o += d;
            }
        }
        Ok(())
    }
}

/// Add `bias` (one row's worth) to every row of `x`, if there is one.
fn add_rows(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        x.chunks_exact_mut(b.len())
            .for_each(|r| r.iter_mut().zip(b).for_each(|(x, b)| *x += b));
    }
}

/// Per-token routing buffers (one token's worth; reused).
struct Scratch<'b> {
    choice: &'b mut [f32],        // (n_experts)
    groups_score: &'b mut [f32],  // (n_group)
    groups_kept: &'b mut [usize], // (topk_group)
}

/// One token's routing from its raw router logits `scores` (turned into scores in place):
/// scores by softmax or sigmoid; selection on score + `bias` (selection only, DeepSeek's
/// `e_score_correction_bias`), limited to the best groups; the chosen experts in `sel` and their
/// weights in `selw`: the unbiased scores, optionally renormalised, times the routed scale.
fn route_token(
    cfg: &ModelConfig,
    bias: Option<&[f32]>,
    scores: &mut [f32],
    sc: &mut Scratch<'_>,
    sel: &mut [usize],
    selw: &mut [f32],
) {
    let r = &cfg.routing;
    let e = cfg.n_experts;
    if r.sigmoid {
        scores
            .iter_mut()
            .for_each(|s| *s = 1.0 / (1.0 + (-*s).exp()));
    } else {
        softmax(scores);
    }
    let choice = &mut *sc.choice;
    choice.copy_from_slice(scores);
    if let Some(b) = bias {
        choice.iter_mut().zip(b).for_each(|(c, b)| *c += b);
    }
    if r.n_group > 1 {
        // Group score = sum of its two best choice scores; keep the best `topk_group`
        // groups and zero the rest (as transformers' masked_fill(0.0)).
        let per = e / r.n_group;
        for (g, gs) in sc.groups_score.iter_mut().enumerate() {
            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &v in &choice[g * per..(g + 1) * per] {
                if v > a {
                    b = a;
                    a = v;
                } else if v > b {
                    b = v;
                }
            }
            *gs = if per >= 2 { a + b } else { a };
        }
        top_k(sc.groups_score, sc.groups_kept);
        for g in 0..r.n_group {
            if !sc.groups_kept.contains(&g) {
                choice[g * per..(g + 1) * per].fill(0.0);
            }
        }
    }
    top_k(choice, sel);
    for (wv, &ex) in selw.iter_mut().zip(sel.iter()) {
        *wv = scores[ex];
    }
    if r.norm_topk_prob {
        let s: f32 = selw.iter().sum::<f32>() + if r.sigmoid { 1e-20 } else { 0.0 };
        selw.iter_mut().for_each(|wv| *wv /= s);
    }
    if r.scale != 1.0 {
        selw.iter_mut().for_each(|wv| *wv *= r.scale);
    }
}
