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

pub(crate) use super::backend::Span;

/// Whose rows a layer runs: one sequence (the backend's own cache) or several.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Spans<'s> {
    One(At),
    Many(&'s [Span]),
}

impl Spans<'_> {
    /// The one sequence's position; several sequences are refused (a graph that batches
    /// only grouped-query attention and MLA without an indexer).
    pub(crate) fn one(self) -> Result<At, ModelError> {
        match self {
            Spans::One(at) => Ok(at),
            Spans::Many(_) => Err(ModelError::Unsupported(
                "batched decoding of several sequences needs grouped-query attention or MLA without an indexer".into(),
            )),
        }
    }
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

    /// A batched forward over several sequences (continuous batching): `tokens` is the
    /// concatenation of each part's tokens, part `(seq, n)` feeding `n` tokens to `seqs[seq]`
    /// at its position (`seqs[seq].pos..`). Every operation runs once over all rows (so a MoE
    /// layer computes the union of the rows' experts, each once for all the rows routed to
    /// it) except rotation, the cache writes and attention, which each part does on its own
    /// rows against its own sequence's cache. `st` holds the buffers (and the expert cache);
    /// its own KV cache is not used. The logits of the rows listed in `logits` (ascending:
    /// the last row of each prompt that ends in this step and each decode row) are returned
    /// in that order, one `vocab`-wide row each; each sequence's position advances by its
    /// part. Only those rows go through the output matrix (the largest product of a step on
    /// small MoE models), so a step can carry several prompts' chunks at no lm_head cost.
    ///
    /// Every row's arithmetic is the one a lone forward of that sequence does (activations are
    /// quantized per row, each output element is one dot in a fixed order, attention reads
    /// only its own sequence), so a token's logits do not depend on what it is batched with.
    pub fn forward_seqs<'s>(
        &self,
        st: &'s mut State,
        seqs: &mut [State],
        tokens: &[u32],
        parts: &[(usize, usize)],
        logits: &[usize],
    ) -> Result<&'s [f32], ModelError> {
        let t0 = std::time::Instant::now();
        let mut spans = Vec::with_capacity(parts.len());
        let mut row0 = 0;
        for (i, &(seq, n)) in parts.iter().enumerate() {
            let Some(s) = seqs.get(seq) else {
                return Err(ModelError::Input(format!(
                    "forward_seqs: sequence {seq} of {}",
                    seqs.len()
                )));
            };
            if n == 0 || parts[..i].iter().any(|p| p.0 == seq) {
                return Err(ModelError::Input(format!(
                    "forward_seqs: sequence {seq} has no rows or two parts"
                )));
            }
            if s.ctx != st.ctx || s.cache_dims != st.cache_dims || s.has_mtp() {
                return Err(ModelError::Input(
                    "forward_seqs: a sequence's cache does not match the batch state".into(),
                ));
            }
            if s.pos + n > s.ctx {
                return Err(ModelError::ContextFull {
                    needed: s.pos + n,
                    ctx: s.ctx,
                });
            }
            spans.push(Span {
                seq,
                row0,
                n,
                at: At {
                    pos: s.pos,
                    rope: s.pos,
                },
            });
            row0 += n;
        }
        if row0 != tokens.len() {
            return Err(ModelError::Input(format!(
                "forward_seqs: parts hold {row0} rows, {} tokens given",
                tokens.len()
            )));
        }
        let w = &self.weights;
        let plain = w.v4.is_none()
            && w.layers.iter().all(|lw| match &lw.attn {
                Attention::Gqa(_) => true,
                Attention::Mla(a) => a.indexer.is_none() && !a.shares_indexer,
                // Each sequence's rows run on its own recurrent state (qwen3next.rs).
                Attention::Hybrid(_) => true,
            });
        if !plain {
            return Err(ModelError::Unsupported(
                "batched decoding of several sequences needs grouped-query attention, MLA without an indexer or the hybrid layers".into(),
            ));
        }
        if logits.windows(2).any(|w| w[0] >= w[1]) || logits.last().is_some_and(|&r| r >= row0) {
            return Err(ModelError::Input(format!(
                "forward_seqs: logit rows {logits:?} are not ascending rows of 0..{row0}"
            )));
        }
        // The contract of a chunk, on the batch state (its own position is not used; the
        // logit rows are counted as a tail of as many rows).
        let pos = std::mem::replace(&mut st.pos, 0);
        let checked = self.check_chunk(st, tokens, row0 - logits.len());
        st.pos = pos;
        checked?;
        let r = self.pool.install(|| {
            st.experts_run = 0;
            let mut b = CpuBackend::with_seqs(self, st, seqs);
            b.embed(&w.token_embd, tokens, Buf::X)?;
            for (l, lw) in w.layers.iter().enumerate() {
                self.layer_rows(&mut b, l, lw, row0, Spans::Many(&spans))?;
            }
            self.final_rows_at(&mut b, row0, logits)
        });
        st.prof.total += t0.elapsed().as_secs_f64();
        r?;
        for s in &spans {
            seqs[s.seq].pos += s.n;
        }
        Ok(&st.logits[..logits.len() * self.cfg.vocab])
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

    /// `final_rows` for the listed rows only (ascending): a contiguous tail goes straight to
    /// the output matrix; otherwise the rows' final-normed states are gathered into `Xn` rows
    /// 0.. first (a copy: each row's logits are the ones its own forward computes).
    fn final_rows_at<B: Backend + ?Sized>(
        &self,
        b: &mut B,
        n: usize,
        rows: &[usize],
    ) -> Result<(), ModelError> {
        let k = rows.len();
        if rows.first().is_none_or(|&r| r + k == n) {
            return self.final_rows(b, n, n - k);
        }
        self.final_rows(b, n, n)?;
        let h = self.cfg.hidden;
        let (hfin, xn) = (Rows::of(Buf::Hfin, h), Rows::of(Buf::Xn, h));
        // Runs of consecutive rows, one copy each.
        let mut j = 0;
        while j < k {
            let mut e = j + 1;
            while e < k && rows[e] == rows[e - 1] + 1 {
                e += 1;
            }
            b.copy(xn.from_row(j), hfin.from_row(rows[j]), e - j)?;
            j = e;
        }
        let t = std::time::Instant::now();
        b.matmul(xn, k, &[(&self.weights.output, Buf::Logits)])?;
        b.prof().lm_head += t.elapsed().as_secs_f64();
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
        self.layer_rows(b, l, lw, n, Spans::One(at))
    }

    /// `layer_forward` over rows that may belong to several sequences (`spans`): every
    /// operation but attention's cache part runs on all rows at once.
    fn layer_rows<B: Backend + ?Sized>(
        &self,
        b: &mut B,
        l: usize,
        lw: &Layer<'_>,
        n: usize,
        spans: Spans<'_>,
    ) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let h = cfg.hidden;
        let (x, xn) = (Rows::of(Buf::X, h), Rows::of(Buf::Xn, h));
        b.rmsnorm(xn, x, n, h, &lw.attn_norm, cfg.rms_eps)?;
        let t = std::time::Instant::now();
        match &lw.attn {
            Attention::Gqa(a) => self.attn_gqa(b, l, n, spans, a)?,
            Attention::Mla(a) => self.attn_mla(b, l, n, spans, a)?,
            Attention::Hybrid(m) => m.run_spans(b, l, n, spans)?,
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
        spans: Spans<'_>,
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
        let shape = GqaShape {
            heads: cfg.n_heads,
            kv_heads: cfg.n_kv_heads,
            head_dim: hd,
            scale: cfg.attn_scale,
            window: cfg.window(l),
            sinks: a.sinks.as_deref(),
        };
        // Norms, rotation, the cache and the softmax per sequence: each span on its own rows.
        let core = |b: &mut B, r0: usize, n: usize, at: At| -> Result<(), ModelError> {
            let prep = QkPrep {
                q: q.from_row(r0),
                k: k.from_row(r0),
                v: v.from_row(r0),
                head_dim: hd,
                norm,
                clip: cfg.clip_qkv,
                layout: cfg.rope_layout,
            };
            b.qk_prep(l, n, at, prep)?;
            b.attend_rows(l, r0, n, at.pos, shape)
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

#[cfg(test)]
mod tests {
    use crate::format::ModelFiles;
    use crate::model::{LoadOptions, Model, State};

    fn tiny() -> ModelFiles {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-moe.gguf");
        ModelFiles::open(std::path::Path::new(path)).expect("tiny-moe fixture")
    }

    const A: [u32; 12] = [1, 7, 3, 9, 4, 4, 2, 11, 5, 8, 6, 10];
    const B: [u32; 7] = [3, 3, 12, 1, 0, 9, 2];
    const ALL: [usize; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];

    /// Every row's logits of `tokens` fed alone, in chunks of `chunk`.
    fn alone(m: &Model<'_>, tokens: &[u32], chunk: usize) -> Vec<f32> {
        let mut st = m.new_state(32, 16, 16).unwrap();
        let mut out = Vec::new();
        for c in tokens.chunks(chunk) {
            out.extend_from_slice(m.forward_chunk(&mut st, c, 0).unwrap());
        }
        out
    }

    #[test]
    fn batched_rows_equal_each_sequence_alone_bit_for_bit() {
        let files = tiny();
        let m = Model::load(&files, &LoadOptions::default()).unwrap();
        let v = m.cfg.vocab;
        let (la, lb) = (alone(&m, &A, 12), alone(&m, &B, 1));
        assert_eq!(la, alone(&m, &A, 5), "chunking does not change a row");

        let mut st = m.new_state(32, 16, 16).unwrap();
        let mut seqs: Vec<State> = (0..3).map(|_| m.new_state(32, 1, 1).unwrap()).collect();
        // Step 1: A's first 5 tokens beside B's first 3 (sequence 2 idle).
        let mut toks = A[..5].to_vec();
        toks.extend_from_slice(&B[..3]);
        let l = m
            .forward_seqs(&mut st, &mut seqs, &toks, &[(0, 5), (2, 3)], &ALL[..8])
            .unwrap()
            .to_vec();
        assert_eq!(l[..5 * v], la[..5 * v]);
        assert_eq!(l[5 * v..], lb[..3 * v]);
        assert_eq!((seqs[0].pos, seqs[1].pos, seqs[2].pos), (5, 0, 3));
        // Step 2: the rest, in the other order; only the last 2 rows' logits.
        let mut toks = B[3..].to_vec();
        toks.extend_from_slice(&A[5..]);
        let l = m
            .forward_seqs(&mut st, &mut seqs, &toks, &[(2, 4), (0, 7)], &[9, 10])
            .unwrap()
            .to_vec();
        assert_eq!(l, la[10 * v..]);
        // Each sequence's cache holds what a lone run's does: decode one more token each.
        let mut solo = m.new_state(32, 16, 16).unwrap();
        m.forward_chunk(&mut solo, &B, 0).unwrap();
        let want = m.forward_chunk(&mut solo, &[5], 0).unwrap().to_vec();
        let l = m
            .forward_seqs(&mut st, &mut seqs, &[6, 5], &[(0, 1), (2, 1)], &[1])
            .unwrap();
        assert_eq!(l, &want[..]);
    }

    #[test]
    fn logits_of_chosen_rows_only() {
        // Two prompts ending in one step beside a decode row: the logits of each prompt's
        // last row and of the decode row, in row order, each as its sequence alone gives it.
        let files = tiny();
        let m = Model::load(&files, &LoadOptions::default()).unwrap();
        let v = m.cfg.vocab;
        let (la, lb) = (alone(&m, &A, 12), alone(&m, &B, 7));
        let mut st = m.new_state(32, 16, 4).unwrap();
        let mut seqs: Vec<State> = (0..3).map(|_| m.new_state(32, 1, 1).unwrap()).collect();
        // Sequence 1 first reads A's first 11 tokens; its 12th is then its decode row.
        m.forward_seqs(&mut st, &mut seqs, &A[..11], &[(1, 11)], &[])
            .unwrap();
        let mut toks = A[..5].to_vec();
        toks.push(A[11]);
        toks.extend_from_slice(&B);
        let parts = [(0, 5), (1, 1), (2, 7)];
        let l = m
            .forward_seqs(&mut st, &mut seqs, &toks, &parts, &[4, 5, 12])
            .unwrap()
            .to_vec();
        assert_eq!(l.len(), 3 * v);
        assert_eq!(l[..v], la[4 * v..5 * v], "A's 5th row");
        assert_eq!(l[v..2 * v], la[11 * v..], "the decode row");
        assert_eq!(l[2 * v..], lb[6 * v..], "B's last row");
        // Rows out of order, repeated or past the batch are refused before anything moves.
        let pos: Vec<usize> = seqs.iter().map(|s| s.pos).collect();
        for bad in [&[2, 1][..], &[1, 1], &[3]] {
            assert!(m
                .forward_seqs(&mut st, &mut seqs, &[1, 2, 3], &[(0, 3)], bad)
                .is_err());
        }
        // More logit rows than the state holds.
        assert!(m
            .forward_seqs(&mut st, &mut seqs, &[1; 5], &[(0, 5)], &ALL[..5])
            .is_err());
        assert_eq!(seqs.iter().map(|s| s.pos).collect::<Vec<_>>(), pos);
    }

    #[test]
    fn bad_batches_are_refused() {
        let files = tiny();
        let m = Model::load(&files, &LoadOptions::default()).unwrap();
        let mut st = m.new_state(8, 4, 4).unwrap();
        let mut seqs: Vec<State> = (0..2).map(|_| m.new_state(8, 1, 1).unwrap()).collect();
        let mut other = vec![m.new_state(16, 1, 1).unwrap()];
        assert!(m
            .forward_seqs(&mut st, &mut seqs, &[1, 2], &[(0, 1), (0, 1)], &[])
            .is_err());
        assert!(m
            .forward_seqs(&mut st, &mut seqs, &[1, 2], &[(0, 1), (5, 1)], &[])
            .is_err());
        assert!(m
            .forward_seqs(&mut st, &mut seqs, &[1, 2, 3], &[(0, 2)], &[])
            .is_err());
        assert!(m
            .forward_seqs(&mut st, &mut other, &[1], &[(0, 1)], &[])
            .is_err());
        assert!(m
            .forward_seqs(&mut st, &mut seqs, &[1; 5], &[(0, 5)], &[])
            .is_err());
        // Nothing moved.
        assert_eq!((seqs[0].pos, seqs[1].pos), (0, 0));
        seqs[1].pos = 8;
        assert!(m
            .forward_seqs(&mut st, &mut seqs, &[1], &[(1, 1)], &[])
            .is_err());
    }
}
