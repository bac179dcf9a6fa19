//! The forward pass, written once over `Backend` operations: a batch of tokens through every
//! layer, top to bottom (embed -> layers -> final norm -> lm_head), in the style of llama.cpp's
//! per-architecture graphs.
//!
//! Owns: `Model::forward_chunk` / `forward_on` (the entry point, its contract check, the CPU
//! backend or the caller's `Device`)
//! and the shared blocks of the graph: a decoder layer, grouped-query attention, the SwiGLU
//! MLP, the final rows. MLA lives in `deepseek2.rs`, the MTP head in `mtp.rs`.
//! Does not own: arithmetic (the backend's), buffers (the backend's, `State` for the CPU).
//! Invariant: the graph only names buffers and passes weights; it reads no activation, so a
//! device backend runs it with no host sync between operations.

use super::backend::{At, Backend, Buf, Device, GqaShape, HeadNorms, QkPrep, Rows};
use super::config::QkNorm;
use super::cpu::CpuBackend;
use super::weights::{Attention, Ffn, Gqa, Layer, Mlp};
use super::{Model, ModelError, State};

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
        self.forward_on(None, st, tokens, logits_from)
    }

    /// `forward_chunk` on `dev` (a device backend the caller holds beside the state), or on
    /// the CPU backend over `st`'s own buffers when `dev` is `None`. The contract check, the
    /// position and the returned logits are the same for both.
    pub fn forward_on<'s>(
        &self,
        dev: Option<&mut dyn Device>,
        st: &'s mut State,
        tokens: &[u32],
        logits_from: usize,
    ) -> Result<&'s [f32], ModelError> {
        let t0 = std::time::Instant::now();
        let r = match dev {
            Some(d) => self
                .check_chunk(st, tokens, logits_from)
                .and_then(|()| d.forward_chunk(self, st, tokens, logits_from)),
            // Run on a pool thread: nested parallel loops then use the workers' own deques
            // instead of the pool's injector queue, which allocates as jobs pass through it.
            None => self
                .pool
                .install(|| self.forward_inner(st, tokens, logits_from)),
        };
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
        st.experts_run = 0;
        let pos = st.pos;
        self.forward_tokens(&mut CpuBackend::new(self, st), tokens, pos, logits_from)?;
        st.pos += tokens.len();
        Ok(())
    }

    /// The graph of one chunk: `tokens` at cache positions `pos..`, logits of rows
    /// `logits_from..` into `Logits` (and every row's final-normed hidden state in `Hfin`).
    pub(crate) fn forward_tokens<B: Backend + ?Sized>(
        &self,
        b: &mut B,
        tokens: &[u32],
        pos: usize,
        logits_from: usize,
    ) -> Result<(), ModelError> {
        let w = &self.weights;
        if let Some(v4) = &w.v4 {
            return self.forward_v4(b, v4, tokens, pos, logits_from);
        }
        let n = tokens.len();
        b.embed(&w.token_embd, tokens, Buf::X)?;
        let at = At { pos, rope: pos };
        for (l, lw) in w.layers.iter().enumerate() {
            self.layer_forward(b, l, lw, n, at)?;
        }
        self.final_rows(b, n, logits_from)
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

    /// Final norm of every row (kept in `Hfin` for the MTP head) and lm_head of rows
    /// `logits_from..n` into `Logits`.
    fn final_rows<B: Backend + ?Sized>(
        &self,
        b: &mut B,
        n: usize,
        logits_from: usize,
    ) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let (h, w) = (cfg.hidden, &self.weights);
        let n_logits = n.saturating_sub(logits_from);
        b.rmsnorm(
            Rows::of(Buf::Hfin, h),
            Rows::of(Buf::X, h),
            n,
            h,
            &w.output_norm,
            cfg.rms_eps,
        )?;
        if n_logits > 0 {
            let t = std::time::Instant::now();
            b.matmul(
                Rows::of(Buf::Hfin, h).from_row(logits_from),
                n_logits,
                &[(&w.output, Buf::Logits)],
            )?;
            b.prof().lm_head += t.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// One decoder layer over rows 0..n of `X` (in place), at `at`, with its keys and values
    /// in cache layer `l`.
    pub(crate) fn layer_forward<B: Backend + ?Sized>(
        &self,
        b: &mut B,
        l: usize,
        lw: &Layer<'_>,
        n: usize,
        at: At,
    ) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let h = cfg.hidden;
        let (x, xn) = (Rows::of(Buf::X, h), Rows::of(Buf::Xn, h));
        b.rmsnorm(xn, x, n, h, &lw.attn_norm, cfg.rms_eps)?;
        let t = std::time::Instant::now();
        match &lw.attn {
            Attention::Gqa(a) => self.attn_gqa(b, l, n, at, a)?,
            Attention::Mla(a) => self.attn_mla(b, l, n, at, a)?,
            Attention::Hybrid(m) => m.run(b, l, n, at)?,
        }
        b.prof().attention += t.elapsed().as_secs_f64();
        b.add(Buf::X, Buf::Proj, n, h)?;
        if l + 1 < cfg.n_layers {
            let t = std::time::Instant::now();
            b.prefetch(l + 1, n)?;
            b.prof().experts += t.elapsed().as_secs_f64();
        }
        b.rmsnorm(xn, x, n, h, &lw.ffn_norm, cfg.rms_eps)?;
        let t = std::time::Instant::now();
        match &lw.ffn {
            Ffn::Dense(m) => {
                self.mlp(b, n, m, Buf::Proj)?;
                b.prof().dense_ffn += t.elapsed().as_secs_f64();
            }
            Ffn::Moe(m) => {
                b.moe(l, m, n)?;
                b.prof().experts += t.elapsed().as_secs_f64();
            }
        }
        b.add(Buf::X, Buf::Proj, n, h)
    }

    /// Grouped-query attention of rows 0..n of `Xn`; result (after o_proj) in `Proj`.
    fn attn_gqa<B: Backend + ?Sized>(
        &self,
        b: &mut B,
        l: usize,
        n: usize,
        at: At,
        a: &Gqa<'_>,
    ) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let (h, qd, kvd, hd) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let (q, k, v) = (
            Rows::of(Buf::Q, qd),
            Rows::of(Buf::K, kvd),
            Rows::of(Buf::V, kvd),
        );
        b.matmul(
            Rows::of(Buf::Xn, h),
            n,
            &[(&a.wq, Buf::Q), (&a.wk, Buf::K), (&a.wv, Buf::V)],
        )?;
        for (x, bias) in [(q, &a.bq), (k, &a.bk), (v, &a.bv)] {
            if let Some(bias) = bias {
                b.add_bias(x, n, bias)?;
            }
        }
        let part = match cfg.qk_norm {
            QkNorm::PerHead => Some((hd, hd)),
            QkNorm::Whole => Some((qd, kvd)),
            QkNorm::None => None,
        };
        let norm = match (part, &a.q_norm, &a.k_norm) {
            (Some((q_part, k_part)), Some(q), Some(k)) => Some(HeadNorms {
                q_part,
                k_part,
                q,
                k,
                eps: cfg.rms_eps,
            }),
            _ => None,
        };
        b.qk_prep(
            l,
            n,
            at,
            QkPrep {
                q,
                k,
                v,
                head_dim: hd,
                norm,
                clip: cfg.clip_qkv,
                layout: cfg.rope_layout,
            },
        )?;
        b.attend(
            l,
            n,
            at.pos,
            GqaShape {
                heads: cfg.n_heads,
                kv_heads: cfg.n_kv_heads,
                head_dim: hd,
                scale: cfg.attn_scale,
                window: cfg.window(l),
                sinks: a.sinks.as_deref(),
            },
        )?;
        b.matmul(Rows::of(Buf::Att, qd), n, &[(&a.wo, Buf::Proj)])?;
        if let Some(bo) = &a.bo {
            b.add_bias(Rows::of(Buf::Proj, h), n, bo)?;
        }
        Ok(())
    }

    /// SwiGLU MLP of rows 0..n of `Xn`; result in `out`.
    pub(crate) fn mlp<B: Backend + ?Sized>(
        &self,
        b: &mut B,
        n: usize,
        m: &Mlp<'_>,
        out: Buf,
    ) -> Result<(), ModelError> {
        let (h, f) = (self.cfg.hidden, m.gate.rows);
        b.matmul(
            Rows::of(Buf::Xn, h),
            n,
            &[(&m.gate, Buf::Gate), (&m.up, Buf::Up)],
        )?;
        b.swiglu(n, f)?;
        b.matmul(Rows::of(Buf::Gate, f), n, &[(&m.down, out)])
    }
}
