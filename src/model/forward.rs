//! The forward pass: a batch of tokens through every layer, top to bottom in one function.
//!
//! Owns: `State` (every buffer and the KV cache, sized once) and `Model::forward_chunk`.
//! Invariant: after `State::new`, a forward call of at most `batch` tokens allocates nothing;
//! the MoE output of each token is summed in its top-k slot order, so the result does not
//! depend on the order in which experts are computed (or, later, arrive from disk).

use super::blocks::{axpy, dot, rmsnorm, rmsnorm_inplace, silu, softmax, top_k};
use super::config::{ModelConfig, QkNorm};
use super::{Model, ModelError};
use crate::kernels::{self, Acts};
use rayon::prelude::*;

/// Buffers for one sequence: activations for up to `batch` tokens and the KV cache for `ctx`.
pub struct State {
    batch: usize,
    ctx: usize,
    logit_rows: usize,
    /// Tokens already in the KV cache.
    pub pos: usize,
    x: Vec<f32>,        // (batch, hidden) residual stream
    xn: Vec<f32>,       // (batch, hidden) normed input of a sub-block
    q: Vec<f32>,        // (batch, q_dim)
    k: Vec<f32>,        // (batch, kv_dim)
    v: Vec<f32>,        // (batch, kv_dim)
    att: Vec<f32>,      // (batch, q_dim) attention output before o_proj
    scores: Vec<f32>,   // (n_heads, ctx)
    proj: Vec<f32>,     // (batch, hidden) sub-block output
    pub(super) kcache: Vec<f32>, // (layers, ctx, kv_dim); pub(super) for kv_io.rs
    pub(super) vcache: Vec<f32>, // (layers, ctx, kv_dim)
    router: Vec<f32>,   // (batch, n_experts)
    sel: Vec<usize>,    // (batch, k) chosen experts
    selw: Vec<f32>,     // (batch, k) their routing weights
    groups: Vec<Vec<(u32, u32)>>, // per expert: (token, slot) pairs, capacity batch
    gathered: Vec<f32>, // (batch, hidden) inputs of one expert's tokens
    gate: Vec<f32>,     // (batch, ffn)
    up: Vec<f32>,       // (batch, ffn)
    down: Vec<f32>,     // (batch, hidden)
    slot_out: Vec<f32>, // (batch, k, hidden) each token's expert outputs, unweighted
    acts: Acts,
    logits: Vec<f32>,   // (logit_rows, vocab)
    /// Experts computed in the last forward call, summed over layers (telemetry).
    pub experts_run: usize,
}

impl State {
    /// `batch`: most tokens per forward chunk (prefill speed vs memory); `logit_rows`: most
    /// positions whose logits one chunk returns (1 for generation).
    pub fn new(cfg: &ModelConfig, ctx: usize, batch: usize, logit_rows: usize) -> State {
        let (h, qd, kvd, e, k, f) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn);
        let batch = batch.max(1);
        let logit_rows = logit_rows.clamp(1, batch);
        let widest = h.max(qd).max(f);
        State {
            batch,
            ctx,
            logit_rows,
            pos: 0,
            x: vec![0.0; batch * h],
            xn: vec![0.0; batch * h],
            q: vec![0.0; batch * qd],
            k: vec![0.0; batch * kvd],
            v: vec![0.0; batch * kvd],
            att: vec![0.0; batch * qd],
            scores: vec![0.0; cfg.n_heads * ctx],
            proj: vec![0.0; batch * h],
            kcache: vec![0.0; cfg.n_layers * ctx * kvd],
            vcache: vec![0.0; cfg.n_layers * ctx * kvd],
            router: vec![0.0; batch * e],
            sel: vec![0; batch * k],
            selw: vec![0.0; batch * k],
            groups: (0..e).map(|_| Vec::with_capacity(batch)).collect(),
            gathered: vec![0.0; batch * h],
            gate: vec![0.0; batch * f],
            up: vec![0.0; batch * f],
            down: vec![0.0; batch * h],
            slot_out: vec![0.0; batch * k * h],
            acts: Acts::with_capacity(batch, widest),
            logits: vec![0.0; logit_rows * cfg.vocab],
            experts_run: 0,
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

    /// Bytes held by the KV cache.
    pub fn kv_bytes(&self) -> usize {
        (self.kcache.len() + self.vcache.len()) * 4
    }

    /// Forget the sequence (the buffers stay allocated).
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Drop cached positions from `pos` on (prompt reuse keeps a prefix).
    pub fn truncate(&mut self, pos: usize) {
        self.pos = self.pos.min(pos);
    }
}

impl<'a> Model<'a> {
    /// Run `tokens` (at most `st.batch()`) at positions `st.pos..`, append them to the KV cache,
    /// and leave the logits of tokens `logits_from..` in the returned slice
    /// ((tokens.len() - logits_from) x vocab, at most `st.logit_rows()` rows).
    pub fn forward_chunk<'s>(&self, st: &'s mut State, tokens: &[u32], logits_from: usize) -> Result<&'s [f32], ModelError> {
        // Run on a pool thread: nested parallel loops then use the workers' own deques instead
        // of the pool's injector queue, which allocates as jobs pass through it.
        self.pool.install(|| self.forward_inner(st, tokens, logits_from))?;
        let n_logits = tokens.len().saturating_sub(logits_from);
        Ok(&st.logits[..n_logits * self.cfg.vocab])
    }

    fn forward_inner(&self, st: &mut State, tokens: &[u32], logits_from: usize) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let n = tokens.len();
        if n == 0 || n > st.batch {
            return Err(ModelError::Input(format!("forward_chunk got {n} tokens (batch holds 1..={})", st.batch)));
        }
        if st.pos + n > st.ctx {
            return Err(ModelError::ContextFull { needed: st.pos + n, ctx: st.ctx });
        }
        let n_logits = n.saturating_sub(logits_from);
        if n_logits > st.logit_rows {
            return Err(ModelError::Input(format!("{n_logits} logit rows requested, state holds {}", st.logit_rows)));
        }
        for &t in tokens {
            if t as usize >= cfg.vocab {
                return Err(ModelError::Input(format!("token id {t} is out of range (vocabulary has {} tokens)", cfg.vocab)));
            }
        }
        let (h, qd, kvd, hd) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let pool = Some(&self.pool);
        let isa = self.isa;
        let w = &self.weights;
        st.experts_run = 0;

        // Embeddings.
        let er = w.token_embd.row_bytes();
        for (i, &t) in tokens.iter().enumerate() {
            let row = &w.token_embd.bytes[t as usize * er..(t as usize + 1) * er];
            kernels::dequantize(w.token_embd.dtype, row, &mut st.x[i * h..(i + 1) * h])?;
        }

        for (l, lw) in w.layers.iter().enumerate() {
            // --- attention ---
            for i in 0..n {
                rmsnorm(&mut st.xn[i * h..(i + 1) * h], &st.x[i * h..(i + 1) * h], &lw.attn_norm, cfg.rms_eps);
            }
            st.acts.load(&st.xn[..n * h], n, h);
            kernels::matmul(&lw.wq, &mut st.acts, &mut st.q[..n * qd], pool, isa)?;
            kernels::matmul(&lw.wk, &mut st.acts, &mut st.k[..n * kvd], pool, isa)?;
            kernels::matmul(&lw.wv, &mut st.acts, &mut st.v[..n * kvd], pool, isa)?;
            for i in 0..n {
                let q = &mut st.q[i * qd..(i + 1) * qd];
                let k = &mut st.k[i * kvd..(i + 1) * kvd];
                match (cfg.qk_norm, &lw.q_norm, &lw.k_norm) {
                    (QkNorm::PerHead, Some(qn), Some(kn)) => {
                        q.chunks_exact_mut(hd).for_each(|x| rmsnorm_inplace(x, qn, cfg.rms_eps));
                        k.chunks_exact_mut(hd).for_each(|x| rmsnorm_inplace(x, kn, cfg.rms_eps));
                    }
                    (QkNorm::Whole, Some(qn), Some(kn)) => {
                        rmsnorm_inplace(q, qn, cfg.rms_eps);
                        rmsnorm_inplace(k, kn, cfg.rms_eps);
                    }
                    _ => {}
                }
                let p = st.pos + i;
                q.chunks_exact_mut(hd).for_each(|x| self.rope.apply(x, p));
                k.chunks_exact_mut(hd).for_each(|x| self.rope.apply(x, p));
                let base = (l * st.ctx + p) * kvd;
                st.kcache[base..base + kvd].copy_from_slice(k);
                st.vcache[base..base + kvd].copy_from_slice(&st.v[i * kvd..(i + 1) * kvd]);
            }
            let group = cfg.n_heads / cfg.n_kv_heads;
            let scale = 1.0 / (hd as f32).sqrt();
            let layer_k = &st.kcache[l * st.ctx * kvd..(l + 1) * st.ctx * kvd];
            let layer_v = &st.vcache[l * st.ctx * kvd..(l + 1) * st.ctx * kvd];
            let ctx = st.ctx;
            for i in 0..n {
                let len = st.pos + i + 1; // causal: positions 0..=pos+i
                let q = &st.q[i * qd..(i + 1) * qd];
                let out = &mut st.att[i * qd..(i + 1) * qd];
                let head = |(hh, (o, sc)): (usize, (&mut [f32], &mut [f32]))| {
                    let qh = &q[hh * hd..(hh + 1) * hd];
                    let kvh = hh / group;
                    let sc = &mut sc[..len];
                    for (j, s) in sc.iter_mut().enumerate() {
                        let kj = &layer_k[j * kvd + kvh * hd..j * kvd + (kvh + 1) * hd];
                        *s = dot(qh, kj) * scale;
                    }
                    softmax(sc);
                    o.fill(0.0);
                    for (j, s) in sc.iter().enumerate() {
                        let vj = &layer_v[j * kvd + kvh * hd..j * kvd + (kvh + 1) * hd];
                        axpy(o, *s, vj);
                    }
                };
                let heads = out.par_chunks_mut(hd).zip(st.scores.par_chunks_mut(ctx)).enumerate();
                if len * qd > 1 << 14 {
                    self.pool.install(|| heads.for_each(head));
                } else {
                    out.chunks_mut(hd).zip(st.scores.chunks_mut(ctx)).enumerate().for_each(head);
                }
            }
            st.acts.load(&st.att[..n * qd], n, qd);
            kernels::matmul(&lw.wo, &mut st.acts, &mut st.proj[..n * h], pool, isa)?;
            for (x, p) in st.x[..n * h].iter_mut().zip(&st.proj[..n * h]) {
                *x += p;
            }

            // --- mixture of experts ---
            for i in 0..n {
                rmsnorm(&mut st.xn[i * h..(i + 1) * h], &st.x[i * h..(i + 1) * h], &lw.ffn_norm, cfg.rms_eps);
            }
            self.moe(st, l, n)?;
            for (x, p) in st.x[..n * h].iter_mut().zip(&st.proj[..n * h]) {
                *x += p;
            }
        }
        st.pos += n;

        // Final norm and lm_head for the requested rows.
        let v = cfg.vocab;
        for i in logits_from..n {
            let r = i - logits_from;
            rmsnorm(&mut st.xn[r * h..(r + 1) * h], &st.x[i * h..(i + 1) * h], &w.output_norm, cfg.rms_eps);
        }
        if n_logits > 0 {
            st.acts.load(&st.xn[..n_logits * h], n_logits, h);
            kernels::matmul(&w.output, &mut st.acts, &mut st.logits[..n_logits * v], pool, isa)?;
        }
        Ok(())
    }

    /// Routed experts for tokens 0..n of `st.xn`; result in `st.proj`.
    fn moe(&self, st: &mut State, l: usize, n: usize) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let lw = &self.weights.layers[l];
        let (h, e, k, f) = (cfg.hidden, cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn);
        let pool = Some(&self.pool);
        let isa = self.isa;

        st.acts.load(&st.xn[..n * h], n, h);
        kernels::matmul(&lw.router, &mut st.acts, &mut st.router[..n * e], pool, isa)?;
        st.groups.iter_mut().for_each(Vec::clear);
        for i in 0..n {
            let probs = &mut st.router[i * e..(i + 1) * e];
            softmax(probs);
            let sel = &mut st.sel[i * k..(i + 1) * k];
            top_k(probs, sel);
            let selw = &mut st.selw[i * k..(i + 1) * k];
            for (wv, &ex) in selw.iter_mut().zip(sel.iter()) {
                *wv = probs[ex];
            }
            if cfg.norm_topk_prob {
                let s: f32 = selw.iter().sum();
                selw.iter_mut().for_each(|wv| *wv /= s);
            }
            for (slot, &ex) in sel.iter().enumerate() {
                st.groups[ex].push((i as u32, slot as u32));
            }
        }

        for (ex, toks) in st.groups.iter().enumerate() {
            let m = toks.len();
            if m == 0 {
                continue;
            }
            st.experts_run += 1;
            let xw = &lw.experts[ex];
            for (j, &(t, _)) in toks.iter().enumerate() {
                st.gathered[j * h..(j + 1) * h].copy_from_slice(&st.xn[t as usize * h..(t as usize + 1) * h]);
            }
            st.acts.load(&st.gathered[..m * h], m, h);
            kernels::matmul(&xw.gate, &mut st.acts, &mut st.gate[..m * f], pool, isa)?;
            kernels::matmul(&xw.up, &mut st.acts, &mut st.up[..m * f], pool, isa)?;
            for (g, u) in st.gate[..m * f].iter_mut().zip(&st.up[..m * f]) {
                *g = silu(*g) * u;
            }
            st.acts.load(&st.gate[..m * f], m, f);
            kernels::matmul(&xw.down, &mut st.acts, &mut st.down[..m * h], pool, isa)?;
            for (j, &(t, slot)) in toks.iter().enumerate() {
                let dst = (t as usize * k + slot as usize) * h;
                st.slot_out[dst..dst + h].copy_from_slice(&st.down[j * h..(j + 1) * h]);
            }
        }

        for i in 0..n {
            let out = &mut st.proj[i * h..(i + 1) * h];
            out.fill(0.0);
            for slot in 0..k {
                let wv = st.selw[i * k + slot];
                let src = &st.slot_out[(i * k + slot) * h..(i * k + slot + 1) * h];
                for (o, s) in out.iter_mut().zip(src) {
                    *o += wv * s;
                }
            }
        }
        Ok(())
    }
}
