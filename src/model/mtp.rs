//! The multi-token-prediction head (DeepSeek-V3, GLM-4.5): a draft model built into the
//! checkpoint. Slot s combines the main model's final-normed hidden state at position s with
//! the embedding of token s+1 and predicts token s+2:
//! `x = eh_proj([enorm(embed(t[s+1])); hnorm(h[s])])` -> one decoder layer (its own KV cache,
//! causal over slots, rotary position s+1) -> `head_norm` -> `head`.
//!
//! Invariant: the MTP head only proposes tokens; what is emitted is always decided by the main
//! model's logits (see `generate::generate_mtp`), so output never depends on it at temp 0.

use super::blocks::rmsnorm;
use super::{Model, ModelError, State};
use crate::kernels;

impl<'a> Model<'a> {
    pub fn has_mtp(&self) -> bool {
        self.weights.mtp.is_some()
    }

    /// Copy final-normed main hidden rows `row0..row0+n` of the last forward chunk into the MTP
    /// input rows `dst0..`.
    pub fn mtp_take_hidden(&self, st: &mut State, row0: usize, n: usize, dst0: usize) {
        let h = self.cfg.hidden;
        let (src, dst) = (
            &st.hfin[row0 * h..(row0 + n) * h],
            &mut st.mtp_hidden[dst0 * h..(dst0 + n) * h],
        );
        dst.copy_from_slice(src);
    }

    /// The MTP layer's output of the last row of the last `mtp_forward` (the hidden state a
    /// chained draft feeds back in), copied into MTP input row `dst`.
    pub fn mtp_chain_hidden(&self, st: &mut State, last_row: usize, dst: usize) {
        let h = self.cfg.hidden;
        let (x, hid) = (
            &st.x[last_row * h..(last_row + 1) * h],
            &mut st.mtp_hidden[dst * h..(dst + 1) * h],
        );
        hid.copy_from_slice(x);
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
        let m = self
            .weights
            .mtp
            .as_ref()
            .ok_or_else(|| ModelError::Input("this model has no MTP layer".into()))?;
        if !st.has_mtp() {
            return Err(ModelError::Input(
                "mtp_forward: the state has no MTP layer cache (make it with new_state_mtp)".into(),
            ));
        }
        let (h, v) = (self.cfg.hidden, self.cfg.vocab);
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
        let saved = st.pos;
        st.experts_run = 0;
        let result = self.pool.install(|| -> Result<(), ModelError> {
            let er = m.embed.row_bytes();
            for (j, &t) in tokens.iter().enumerate() {
                let row = &m.embed.bytes[t as usize * er..(t as usize + 1) * er];
                kernels::dequantize(m.embed.dtype, row, &mut st.xn[j * h..(j + 1) * h])?;
                let cat = &mut st.mtp_cat[j * 2 * h..(j + 1) * 2 * h];
                rmsnorm(
                    &mut cat[..h],
                    &st.xn[j * h..(j + 1) * h],
                    &m.enorm,
                    self.cfg.rms_eps,
                );
                rmsnorm(
                    &mut cat[h..],
                    &st.mtp_hidden[j * h..(j + 1) * h],
                    &m.hnorm,
                    self.cfg.rms_eps,
                );
            }
            st.acts.load(&st.mtp_cat[..n * 2 * h], n, 2 * h);
            kernels::matmul(
                &m.eh_proj,
                &mut st.acts,
                &mut st.x[..n * h],
                Some(&self.pool),
                self.isa,
            )?;
            st.pos = st.mtp_pos;
            st.rope_offset = 1;
            self.layer_forward(st, self.cfg.n_layers, &m.layer, n)?;
            for i in logits_from..n {
                let r = i - logits_from;
                rmsnorm(
                    &mut st.xn[r * h..(r + 1) * h],
                    &st.x[i * h..(i + 1) * h],
                    &m.head_norm,
                    self.cfg.rms_eps,
                );
            }
            if n_logits > 0 {
                st.acts.load(&st.xn[..n_logits * h], n_logits, h);
                kernels::matmul(
                    &m.head,
                    &mut st.acts,
                    &mut st.mtp_logits[..n_logits * v],
                    Some(&self.pool),
                    self.isa,
                )?;
            }
            Ok(())
        });
        st.pos = saved;
        st.rope_offset = 0;
        result?;
        st.mtp_pos += n;
        Ok(&st.mtp_logits[..n_logits * v])
    }
}
