//! The multi-token-prediction head (DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5-MoE; DeepSeek-V4's
//! hyper-connection variant is `deepseek_v4::V4Mtp`): a draft model built into the checkpoint. Slot s combines the main model's final-normed hidden state at position s with
//! the embedding of token s+1 and predicts token s+2:
//! `x = eh_proj([enorm(embed(t[s+1])); hnorm(h[s])])` -> one decoder layer (its own KV cache,
//! causal over slots, rotary position s+1) -> `head_norm` -> `head`.
//!
//! Invariant: the MTP head only proposes tokens; what is emitted is always decided by the main
//! model's logits (see `generate::generate_mtp`), so output never depends on it at temp 0.

use super::backend::{At, Backend, Buf, Rows};
use super::cpu::CpuBackend;
use super::{Model, ModelError, State};

impl<'a> Model<'a> {
    pub fn has_mtp(&self) -> bool {
        self.weights.mtp.is_some() || self.weights.v4.as_ref().is_some_and(|v| v.mtp.is_some())
    }

    /// Floats of one MTP input row: the hidden size, or DeepSeek-V4's `hc` streams of it.
    pub fn mtp_width(&self) -> usize {
        self.cfg.hidden * self.cfg.v4.as_ref().map_or(1, |v| v.hc)
    }

    /// Row `row` of the last forward chunk as the MTP head takes it (`mtp_take_hidden`):
    /// `mtp_width` floats.
    pub fn mtp_source_row<'s>(&self, st: &'s State, row: usize) -> &'s [f32] {
        let w = self.mtp_width();
        if self.cfg.v4.is_some() {
            return super::deepseek_v4::streams_rows(st, row * w, w);
        }
        &st.hfin[row * w..(row + 1) * w]
    }

    /// Copy final-normed main hidden rows `row0..row0+n` of the last forward chunk into the MTP
    /// input rows `dst0..` (DeepSeek-V4: the hc streams after the last block).
    pub fn mtp_take_hidden(&self, st: &mut State, row0: usize, n: usize, dst0: usize) {
        if self.cfg.v4.is_some() {
            let w = self.mtp_width();
            super::deepseek_v4::take_streams(st, row0 * w, n * w, dst0 * w);
            return;
        }
        let h = self.cfg.hidden;
        let (dst, src) = (
            Rows::of(Buf::MtpHidden, h).from_row(dst0),
            Rows::of(Buf::Hfin, h).from_row(row0),
        );
        // Two distinct buffers: `copy` cannot fail.
        let _ = CpuBackend::new(self, st).copy(dst, src, n);
    }

    /// The MTP layer's output of the last row of the last `mtp_forward` (the hidden state a
    /// chained draft feeds back in), copied into MTP input row `dst`. DeepSeek-V3 / GLM-4.5
    /// chain the layer's output before the head norm; Qwen3-Next / Qwen3.5 after `mtp.norm`
    /// (their MTP module returns the normed state, as the main model's final norm does), so
    /// `last_row` must then be a logits row of that `mtp_forward`.
    pub fn mtp_chain_hidden(&self, st: &mut State, last_row: usize, dst: usize) {
        if self.cfg.v4.is_some() {
            // The MTP block's output streams (before its HyperHead), as DeepSeek's block
            // returns them.
            self.mtp_take_hidden(st, last_row, 1, dst);
            return;
        }
        let h = self.cfg.hidden;
        let from = if self.cfg.hybrid.is_some() {
            Buf::Xn
        } else {
            Buf::X
        };
        let (dst, src) = (
            Rows::of(Buf::MtpHidden, h).from_row(dst),
            Rows::of(from, h).from_row(last_row),
        );
        let _ = CpuBackend::new(self, st).copy(dst, src, 1);
    }

    /// Run the MTP head over `tokens.len()` slots starting at `st.mtp_pos`; slot j pairs
    /// `tokens[j]` with MTP input row j (see `mtp_take_hidden`). Returns the logits of slots
    /// `logits_from..` (at most `st.logit_rows()` rows).
    pub fn mtp_forward<'s>(
        &self,
        st: &'s mut State,
        tokens: &[u32],
        logits_from: usize,
    ) -> Result<&'s [f32], ModelError> {
        if !self.has_mtp() {
            return Err(ModelError::Input("this model has no MTP layer".into()));
        }
        if !st.has_mtp() {
            return Err(ModelError::Input(
                "mtp_forward: the state has no MTP layer cache (make it with new_state_mtp)".into(),
            ));
        }
        let v = self.cfg.vocab;
        let n = tokens.len();
        let n_logits = n.saturating_sub(logits_from);
        if n == 0 || n > st.batch() || n_logits > st.logit_rows() {
            return Err(ModelError::Input(format!(
                "mtp_forward: {n} slots, {n_logits} logit rows"
            )));
        }
        if st.mtp_pos + n + 1 > st.ctx() {
            return Err(ModelError::ContextFull {
                needed: st.mtp_pos + n + 1,
                ctx: st.ctx(),
            });
        }
        for &t in tokens {
            if t as usize >= v {
                return Err(ModelError::Input(format!(
                    "token id {t} is out of range (vocabulary has {v} tokens)"
                )));
            }
        }
        st.experts_run = 0;
        if let Some(v4) = &self.weights.v4 {
            let m = v4
                .mtp
                .as_ref()
                .ok_or_else(|| ModelError::Input("this model has no MTP layer".into()))?;
            // DeepSeek's MTPBlock caches and rotates slot s at position s.
            let at = At {
                pos: st.mtp_pos,
                rope: st.mtp_pos,
            };
            self.pool
                .install(|| self.mtp_graph_v4(st, v4, m, tokens, at, logits_from))?;
            st.mtp_pos += n;
            return Ok(&st.mtp_logits[..n_logits * v]);
        }
        let m = self
            .weights
            .mtp
            .as_ref()
            .ok_or_else(|| ModelError::Input("this model has no MTP layer".into()))?;
        let at = At {
            pos: st.mtp_pos,
            rope: st.mtp_pos + 1,
        };
        self.pool.install(|| {
            self.mtp_graph(&mut CpuBackend::new(self, st), m, tokens, at, logits_from)
        })?;
        st.mtp_pos += n;
        Ok(&st.mtp_logits[..n_logits * v])
    }

    /// The MTP head's graph: slot j pairs `tokens[j]` with `MtpHidden` row j; its layer is
    /// cache layer `n_layers`; logits of slots `logits_from..` into `MtpLogits`.
    fn mtp_graph<B: Backend + ?Sized>(
        &self,
        b: &mut B,
        m: &super::weights::MtpWeights<'_>,
        tokens: &[u32],
        at: At,
        logits_from: usize,
    ) -> Result<(), ModelError> {
        let (h, eps) = (self.cfg.hidden, self.cfg.rms_eps);
        let n = tokens.len();
        let n_logits = n.saturating_sub(logits_from);
        let cat = Rows::of(Buf::MtpCat, 2 * h);
        b.embed(&m.embed, tokens, Buf::Xn)?;
        b.rmsnorm(cat.cols(0, h), Rows::of(Buf::Xn, h), n, h, &m.enorm, eps)?;
        b.rmsnorm(
            cat.cols(h, h),
            Rows::of(Buf::MtpHidden, h),
            n,
            h,
            &m.hnorm,
            eps,
        )?;
        b.matmul(cat, n, &[(&m.eh_proj, Buf::X)])?;
        self.layer_forward(b, self.cfg.n_layers, &m.layer, n, at)?;
        b.rmsnorm(
            Rows::of(Buf::Xn, h),
            Rows::of(Buf::X, h).from_row(logits_from),
            n_logits,
            h,
            &m.head_norm,
            eps,
        )?;
        if n_logits > 0 {
            b.matmul(Rows::of(Buf::Xn, h), n_logits, &[(&m.head, Buf::MtpLogits)])?;
        }
        Ok(())
    }
}
