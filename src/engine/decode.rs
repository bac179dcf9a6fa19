//! The one decode loop: prefill in batches, then decode token by token — plainly or with MTP
//! drafts verified in one batched forward — with stop conditions (end-of-generation tokens,
//! a token budget, the context, stop strings), a streaming text callback and cancellation.
//!
//! Owns: `decode` (the loop), `GenStats` (its figures), `StopScanner`, `Finish`. Does not
//! own: which tokens are already cached and what to reuse (the session, `super::Engine`), the
//! model or sampler (passed in).
//! Invariants: `held` lists exactly the tokens fed into the state (`held` grows with every
//! token whose keys and values are cached), so a caller can keep `held.len() == st.pos`; at
//! temperature 0 the tokens depend only on the prompt, and MTP drafting emits exactly the
//! tokens plain decoding does (a draft is kept iff it equals the main model's arg-max).

use crate::model::backend::{reborrow, Device};
use crate::model::{Model, ModelError, State};
use crate::sample::Sampler;
use crate::speculative::{self as spec, Verdict};
use crate::tokenizer::{StreamDecoder, Tokenizer, TokenizerError};
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("prompt is empty after tokenization")]
    EmptyPrompt,
}

/// What one generation did, for the timing line, `--stats-json` and the server's figures.
#[derive(Clone, Debug, Default)]
pub struct GenStats {
    /// Tokens fed in the prefill (the prompt less what was reused).
    pub prompt_tokens: usize,
    /// Prompt tokens whose cache was reused (kept from the last turn or restored).
    pub reused: usize,
    pub prefill_secs: f64,
    /// The prefill ran to its end (false: cancelled before).
    pub prefill_done: bool,
    pub generated: usize,
    /// Forward passes of the main model after the prefill (the first token comes from the
    /// prefill's logits; with MTP each forward verifies several drafts).
    pub decode_steps: usize,
    pub decode_secs: f64,
    /// Routed experts computed per decoded token, summed over layers.
    pub experts_per_token: f64,
    /// Routed experts computed in decode forwards (main model, and the MTP head's).
    pub experts_main: usize,
    pub experts_head: usize,
    pub stopped_by_eos: bool,
    /// MTP speculative decoding: tokens drafted and accepted.
    pub mtp_drafted: usize,
    pub mtp_accepted: usize,
    /// MTP steps whose recurrent (Gated DeltaNet) state was rolled back after a rejection.
    pub mtp_rollbacks: usize,
    /// With MTP, `experts_per_token` split: the main model's forwards (verify batches, whose
    /// expert union is wider than one token's) and the MTP head's (drafts and catch-up).
    pub mtp_experts_main_per_token: f64,
    pub mtp_experts_head_per_token: f64,
    /// Routed experts a plain one-token decode step computes: top-k x MoE layers (a token's
    /// top-k experts are distinct), the figure without `--mtp`.
    pub experts_per_token_plain: f64,
    /// Expert-cache figures when the prefill ended (decode figures are the difference).
    pub experts_after_prefill: Option<crate::experts::CacheStats>,
    /// GPU figures when the prefill ended (decode figures are the difference).
    pub gpu_after_prefill: Option<crate::gpu::GpuStats>,
}

impl GenStats {
    pub fn prefill_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }

    pub fn decode_tps(&self) -> f64 {
        self.decode_steps as f64 / self.decode_secs.max(1e-9)
    }

    /// Generated tokens per second of decode time (with MTP, more than one per forward).
    pub fn gen_tps(&self) -> f64 {
        self.generated.saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }

    /// Accepted drafts over drafted ones (0 without MTP).
    pub fn mtp_acceptance(&self) -> f64 {
        self.mtp_accepted as f64 / self.mtp_drafted.max(1) as f64
    }

    /// Generated tokens per main-model decode forward (1 without MTP).
    pub fn tokens_per_forward(&self) -> f64 {
        self.generated.saturating_sub(1) as f64 / self.decode_steps.max(1) as f64
    }

    /// Tokens decoded after the first (with MTP several per forward).
    pub fn decoded(&self) -> usize {
        if self.mtp_drafted > 0 {
            self.generated.saturating_sub(1)
        } else {
            self.decode_steps
        }
    }

    /// One line for stderr, llama.cpp-like.
    pub fn timing_line(&self) -> String {
        let mtp = if self.mtp_drafted > 0 {
            format!(
                " (main {:.1} + MTP head {:.1}; without --mtp {:.1}) | mtp accepted {}/{} ({:.0}%), {:.2} tok/forward",
                self.mtp_experts_main_per_token,
                self.mtp_experts_head_per_token,
                self.experts_per_token_plain,
                self.mtp_accepted,
                self.mtp_drafted,
                100.0 * self.mtp_acceptance(),
                self.tokens_per_forward()
            )
        } else {
            String::new()
        };
        format!(
            "[timing] prompt {} tok, prefill {:.2} tok/s | generated {} tok, decode {:.2} tok/s | experts/token {:.1}{mtp}",
            self.prompt_tokens,
            self.prefill_tps(),
            self.generated,
            self.gen_tps(),
            self.experts_per_token
        )
    }
}

/// Why a generation ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token.
    Eos,
    /// The token budget is spent or the context is full.
    Length,
    /// This stop string appeared (cut from the text).
    Stop(String),
    /// The callback refused more text, or the cancel check said stop.
    Cancelled,
}

/// What the loop tells its caller as it goes.
pub enum Event<'t> {
    /// The prompt's reuse is decided: `reused` tokens kept, `prefilled` to feed.
    Started { reused: usize, prefilled: usize },
    /// Generated text (stop strings already removed). Return false to stop (`Cancelled`).
    Text(&'t str),
}

/// How to generate (what varies per request).
pub struct GenParams<'r> {
    pub max_tokens: usize,
    /// Keep generating past end-of-generation tokens.
    pub ignore_eos: bool,
    /// Stop strings: generation ends where one appears, and it is cut from the text.
    pub stop: &'r [String],
    /// Render control tokens in the text.
    pub special: bool,
    /// MTP drafts per step (0 = plain).
    pub mtp: usize,
    /// Checked once per prefill chunk and per decode step: true stops (`Cancelled`).
    pub cancel: Option<&'r dyn Fn() -> bool>,
    /// Test hook: with MTP at temperature 0, draft j of the step after output token i is
    /// `oracle[i + 1 + j]` (the head still runs), to drive acceptance and rollback on purpose.
    pub oracle: Option<&'r [u32]>,
}

impl<'r> GenParams<'r> {
    pub fn new(max_tokens: usize) -> GenParams<'r> {
        GenParams {
            max_tokens,
            ignore_eos: false,
            stop: &[],
            special: false,
            mtp: 0,
            cancel: None,
            oracle: None,
        }
    }
}

/// A generation's result.
#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub stats: GenStats,
    pub finish: Finish,
}

/// Routed experts one token's one-token forward computes: top-k per MoE layer.
fn plain_experts_per_token(model: &Model<'_>) -> f64 {
    let c = &model.cfg;
    let moe = (0..c.n_layers).filter(|&l| c.is_moe_layer(l)).count();
    if c.n_experts == 0 {
        return 0.0;
    }
    (moe * c.n_experts_used.min(c.n_experts)) as f64
}

/// A small generator for speculative sampling's uniforms (independent of the sampler's).
struct Coin(crate::synth::Rng);

impl Coin {
    fn next(&mut self) -> f64 {
        self.0.next_f64()
    }
}

/// Emission of generated tokens: stop checks, text decoding, stop strings. What it keeps
/// between tokens is owned (`Emission`: a batch slot holds one per sequence); what it
/// borrows for a call is the `Sink`.
pub(crate) struct Emission {
    pub(crate) ignore_eos: bool,
    pub(crate) max_tokens: usize,
    pub(crate) out: Vec<u32>,
    dec: StreamDecoder,
    stops: StopScanner,
}

/// Where emitted text goes, and what else an emission reads.
pub(crate) struct Sink<'a, 'c> {
    pub(crate) tok: &'a Tokenizer,
    pub(crate) eos: &'a [u32],
    pub(crate) cancel: Option<&'a dyn Fn() -> bool>,
    pub(crate) on_event: &'c mut dyn FnMut(Event<'_>) -> bool,
}

impl Emission {
    pub(crate) fn new(p: &GenParams<'_>, capacity: usize) -> Emission {
        Emission {
            ignore_eos: p.ignore_eos,
            max_tokens: p.max_tokens,
            out: Vec::with_capacity(capacity),
            dec: if p.special {
                StreamDecoder::with_special()
            } else {
                StreamDecoder::new()
            },
            stops: StopScanner::new(p.stop),
        }
    }

    /// Emit `id`; Some(finish) when generation ends with it (or before it, for an EOS).
    pub(crate) fn emit(
        &mut self,
        sink: &mut Sink<'_, '_>,
        id: u32,
        history: &mut Vec<u32>,
    ) -> Result<Option<Finish>, GenerateError> {
        if !self.ignore_eos && sink.eos.contains(&id) {
            return Ok(Some(Finish::Eos));
        }
        self.out.push(id);
        history.push(id);
        if let Some(piece) = self.dec.push(sink.tok, id)? {
            let (text, hit) = self.stops.push(&piece);
            if !text.is_empty() && !(sink.on_event)(Event::Text(&text)) {
                return Ok(Some(Finish::Cancelled));
            }
            if let Some(s) = hit {
                return Ok(Some(Finish::Stop(s)));
            }
        }
        if sink.cancel.is_some_and(|c| c()) {
            return Ok(Some(Finish::Cancelled));
        }
        if self.out.len() >= self.max_tokens {
            return Ok(Some(Finish::Length));
        }
        Ok(None)
    }

    /// The end: the decoder's tail and held-back text for a natural end.
    pub(crate) fn finish(
        &mut self,
        sink: &mut Sink<'_, '_>,
        finish: Finish,
    ) -> Result<Finish, GenerateError> {
        if !matches!(finish, Finish::Eos | Finish::Length) {
            return Ok(finish);
        }
        let tail = self.dec.flush(sink.tok)?.unwrap_or_default();
        let (mut text, hit) = self.stops.push(&tail);
        if hit.is_none() {
            text.push_str(&self.stops.finish());
        }
        if !text.is_empty() {
            (sink.on_event)(Event::Text(&text));
        }
        Ok(match hit {
            Some(s) => Finish::Stop(s),
            None => finish,
        })
    }
}

/// An emission with its sink, for the one-sequence loops.
struct Emitter<'a, 'c> {
    e: Emission,
    sink: Sink<'a, 'c>,
}

impl Emitter<'_, '_> {
    fn emit(&mut self, id: u32, history: &mut Vec<u32>) -> Result<Option<Finish>, GenerateError> {
        self.e.emit(&mut self.sink, id, history)
    }

    fn finish(&mut self, finish: Finish) -> Result<Finish, GenerateError> {
        self.e.finish(&mut self.sink, finish)
    }
}

/// Feed `input` to the model at `st.pos` (prefill, in batches of `st.batch()`), then generate
/// up to `p.max_tokens` tokens, sending text through `on_event`. `held` gets every token fed
/// (so a caller's list of cached tokens stays exact); `context` is what came before `input`
/// (for the repetition penalty). With `p.mtp > 0` the state must come from
/// `Model::new_state_mtp` with `batch` and `logit_rows` of at least `mtp + 1`, and its MTP
/// head must be level with the main cache (`st.mtp_pos == st.pos`: a fresh or reset state,
/// or one the session re-levelled).
#[allow(clippy::too_many_arguments)]
pub fn decode(
    model: &Model<'_>,
    tok: &Tokenizer,
    st: &mut State,
    held: &mut Vec<u32>,
    context: &[u32],
    input: &[u32],
    sampler: &mut Sampler,
    p: &GenParams<'_>,
    on_event: &mut dyn FnMut(Event<'_>) -> bool,
) -> Result<Generation, GenerateError> {
    decode_on(
        None, model, tok, st, held, context, input, sampler, p, on_event,
    )
}

/// `decode` with the forward on `dev` (a device backend held beside `st`; `None`: the CPU).
#[allow(clippy::too_many_arguments)]
pub fn decode_on(
    mut dev: Option<&mut dyn Device>,
    model: &Model<'_>,
    tok: &Tokenizer,
    st: &mut State,
    held: &mut Vec<u32>,
    context: &[u32],
    input: &[u32],
    sampler: &mut Sampler,
    p: &GenParams<'_>,
    on_event: &mut dyn FnMut(Event<'_>) -> bool,
) -> Result<Generation, GenerateError> {
    if input.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    let k = p.mtp;
    if k > 0 && dev.is_some() {
        // EngineOptions::check refuses --mtp with --gpu on; --gpu auto keeps the CPU for it.
        return Err(
            ModelError::Input("--mtp: the MTP head runs on the CPU backend only".into()).into(),
        );
    }
    if k > 0 {
        if !model.has_mtp() {
            return Err(ModelError::Input("--mtp: this model has no MTP layer".into()).into());
        }
        if !st.has_mtp() {
            return Err(ModelError::Input(
                "--mtp: the state has no MTP layer cache (make it with new_state_mtp)".into(),
            )
            .into());
        }
        if k > 3 || st.batch() < k + 1 || st.logit_rows() < k + 1 {
            return Err(ModelError::Input(format!(
                "--mtp {k}: needs 1..=3 drafts and a state of at least {} rows",
                k + 1
            ))
            .into());
        }
        if st.mtp_pos != st.pos && !resumes_mtp(st) {
            return Err(ModelError::Input(format!(
                "--mtp: the MTP head holds {} positions, the main cache {}",
                st.mtp_pos, st.pos
            ))
            .into());
        }
    }
    if st.pos + input.len() > st.ctx() {
        return Err(ModelError::ContextFull {
            needed: st.pos + input.len(),
            ctx: st.ctx(),
        }
        .into());
    }
    let mut stats = GenStats {
        prompt_tokens: input.len(),
        reused: st.pos,
        ..Default::default()
    };
    let mut history: Vec<u32> = Vec::with_capacity(context.len() + input.len() + p.max_tokens + k);
    history.extend_from_slice(context);
    history.extend_from_slice(input);
    let eos = tok.eos_ids().to_vec();
    let mut em = Emitter {
        e: Emission::new(p, p.max_tokens.min(st.ctx()) + k),
        sink: Sink {
            tok,
            eos: &eos,
            cancel: p.cancel,
            on_event,
        },
    };
    let cancelled = || p.cancel.is_some_and(|c| c());

    // Prefill in chunks, looking for a cancel between them. With MTP the head catches up
    // after each chunk on the slots whose next token is known (slot s pairs the hidden state
    // of position s with token s + 1), and a chunk leaves room for the pending slot.
    // MTP input rows are `mtp_width` floats: the hidden size (DeepSeek-V4: its hc streams).
    let h = model.mtp_width();
    let mut pending = vec![0f32; if k > 0 { h } else { 0 }];
    // A state one slot behind with the last decode's row kept (`resumes_mtp`): that row is
    // the pending slot of the first chunk.
    let resume = k > 0 && st.mtp_pos != st.pos;
    if resume {
        pending.copy_from_slice(&st.mtp_pending);
    }
    let t0 = Instant::now();
    let b = st.batch();
    let step = if k > 0 { b - 1 } else { b };
    let n = input.len();
    let mut next = 0u32;
    let mut a = 0;
    while a < n {
        if cancelled() {
            stats.prefill_secs = t0.elapsed().as_secs_f64();
            return Ok(Generation {
                tokens: Vec::new(),
                stats,
                finish: Finish::Cancelled,
            });
        }
        let e = (a + step).min(n);
        let last = e == n;
        let from = if last { e - a - 1 } else { e - a };
        let logits = model.forward_on(reborrow(&mut dev), st, &input[a..e], from)?;
        if last {
            next = sampler.sample(logits, &history);
        }
        held.extend_from_slice(&input[a..e]);
        if k > 0 {
            // The first chunk has no pending slot (unless resumed): its own rows pair with
            // tokens a+1..e.
            let first = a == 0 && !resume;
            let mut rows = 0;
            if !first {
                st.mtp_hidden[..h].copy_from_slice(&pending);
                rows = 1;
            }
            let own = (e - a).saturating_sub(1);
            if own > 0 {
                model.mtp_take_hidden(st, 0, own, rows);
            }
            // Taken before the head runs (DeepSeek-V4's head reuses the streams scratch).
            pending.copy_from_slice(model.mtp_source_row(st, e - a - 1));
            let first_tok = if first { a + 1 } else { a };
            if e > first_tok {
                model.mtp_forward(st, &input[first_tok..e], e - first_tok)?;
            }
        }
        a = e;
    }
    stats.prefill_secs = t0.elapsed().as_secs_f64();
    stats.prefill_done = true;
    stats.experts_after_prefill = st.expert_stats();
    stats.gpu_after_prefill = dev.as_ref().map(|d| d.stats());
    if p.max_tokens == 0 {
        // The prompt is in the cache (llama-cli's `-n 0`; `bench -n 0` times prefill alone).
        keep_mtp_pending(st, k, &pending);
        return Ok(Generation {
            tokens: Vec::new(),
            stats,
            finish: Finish::Length,
        });
    }

    let t1 = Instant::now();
    let finish = if k == 0 {
        plain_loop(
            dev,
            model,
            st,
            held,
            sampler,
            &mut history,
            &mut em,
            &mut stats,
            next,
        )?
    } else {
        mtp_loop(
            model,
            st,
            held,
            sampler,
            &mut history,
            &mut em,
            &mut stats,
            next,
            &mut pending,
            k,
            p.oracle,
        )?
    };
    keep_mtp_pending(st, k, &pending);
    let finish = em.finish(finish)?;
    stats.decode_secs = t1.elapsed().as_secs_f64();
    stats.generated = em.e.out.len();
    stats.stopped_by_eos = finish == Finish::Eos;
    stats.experts_per_token_plain = plain_experts_per_token(model);
    if k == 0 {
        stats.experts_per_token = stats.experts_main as f64 / stats.decode_steps.max(1) as f64;
    } else {
        let tokens = stats.generated.saturating_sub(1).max(1) as f64;
        stats.mtp_experts_main_per_token = stats.experts_main as f64 / tokens;
        stats.mtp_experts_head_per_token = stats.experts_head as f64 / tokens;
        stats.experts_per_token = (stats.experts_main + stats.experts_head) as f64 / tokens;
    }
    Ok(Generation {
        tokens: std::mem::take(&mut em.e.out),
        stats,
        finish,
    })
}

/// With `k` drafts, a state one MTP slot behind keeps that slot's main-model row for the next
/// turn (`resumes_mtp`).
fn keep_mtp_pending(st: &mut State, k: usize, pending: &[f32]) {
    if k > 0 && st.mtp_pos + 1 == st.pos {
        st.mtp_pending.copy_from_slice(pending);
        st.mtp_pending_pos = Some(st.pos - 1);
    }
}

/// Whether `st` is one MTP slot behind its cache with the main model's row of that slot kept
/// by the last decode (`State::mtp_pending`): `decode` then runs that slot first. (Should the
/// row be stale, only the drafts suffer: output is always the main model's.)
pub fn resumes_mtp(st: &State) -> bool {
    st.pos > 0 && st.mtp_pos + 1 == st.pos && st.mtp_pending_pos == Some(st.pos - 1)
}

/// Plain decoding: one token per forward.
#[allow(clippy::too_many_arguments)]
fn plain_loop(
    mut dev: Option<&mut dyn Device>,
    model: &Model<'_>,
    st: &mut State,
    held: &mut Vec<u32>,
    sampler: &mut Sampler,
    history: &mut Vec<u32>,
    em: &mut Emitter<'_, '_>,
    stats: &mut GenStats,
    mut next: u32,
) -> Result<Finish, GenerateError> {
    loop {
        if let Some(f) = em.emit(next, history)? {
            return Ok(f);
        }
        if st.pos >= st.ctx() {
            return Ok(Finish::Length);
        }
        let logits = model.forward_on(reborrow(&mut dev), st, &[next], 0)?;
        held.push(next);
        next = sampler.sample(logits, history);
        stats.experts_main += st.experts_run;
        st.tick_token();
        stats.decode_steps += 1;
    }
}

/// Self-speculative decoding with the model's MTP head: each step drafts up to `k` tokens
/// with the head, verifies them in one batched forward of the main model, and keeps the
/// longest accepted prefix plus the main model's own next token, by the speculative-sampling
/// rule of `crate::speculative` (accept with min(1, p/q), else draw from norm(max(0, p − q)),
/// bonus token from p), which keeps the output distribution the main model's. At temperature 0
/// p and q are point masses, so a draft is accepted iff it equals the main model's arg-max and
/// the output equals plain decoding's token for token.
#[allow(clippy::too_many_arguments)]
fn mtp_loop(
    model: &Model<'_>,
    st: &mut State,
    held: &mut Vec<u32>,
    sampler: &mut Sampler,
    history: &mut Vec<u32>,
    em: &mut Emitter<'_, '_>,
    stats: &mut GenStats,
    mut next: u32,
    pending: &mut [f32],
    k: usize,
    oracle: Option<&[u32]>,
) -> Result<Finish, GenerateError> {
    let h = model.mtp_width();
    let mut coin = Coin(crate::synth::Rng(sampler.params().seed ^ 0x5bd1_e995));
    let greedy = sampler.params().temperature <= 0.0;
    let mut drafts = vec![0u32; k];
    let mut qdists: Vec<Vec<(u32, f32)>> = vec![Vec::new(); k];
    let mut residual: Vec<(u32, f32)> = Vec::new();
    loop {
        if let Some(f) = em.emit(next, history)? {
            return Ok(f);
        }
        let pos = st.pos;
        let kk = k
            .min(em.e.max_tokens - em.e.out.len())
            .min(st.ctx().saturating_sub(pos + 1));
        if kk == 0 {
            // No room to draft: one plain step.
            if pos >= st.ctx() {
                return Ok(Finish::Length);
            }
            let logits = model.forward_chunk(st, &[next], 0)?;
            held.push(next);
            next = sampler.sample(logits, history);
            stats.experts_main += st.experts_run;
            stats.decode_steps += 1;
            st.tick_token();
            continue;
        }
        // Draft kk tokens: slot pos-1 pairs `next` with the real hidden state; later slots chain.
        st.mtp_hidden[..h].copy_from_slice(pending);
        let mtp_start = st.mtp_pos;
        let mut prev = next;
        let hist_len = history.len();
        for j in 0..kk {
            if j > 0 {
                model.mtp_chain_hidden(st, 0, 0);
            }
            let lg = model.mtp_forward(st, &[prev], 0)?;
            // q, the draft distribution, is the MTP head's logits through the very transforms
            // that make p from the main logits (the same sampler: repetition penalty over the
            // same history, top-k, top-p, min-p, temperature; at temperature 0 a point mass on
            // the arg-max), because acceptance is highest when q is closest to p. The filters
            // can leave q and p with different supports; the rule stays exact for any q (a
            // draft outside p's support has p = 0 and is always rejected, a token only p allows
            // is reached through the residual), so only the acceptance rate suffers.
            let q = sampler.probs_after_filters(lg, history);
            let mut d = spec::draw(q, coin.next());
            qdists[j].clear();
            match oracle.and_then(|o| o.get(em.e.out.len() + j)) {
                Some(&o) if greedy => {
                    d = o;
                    qdists[j].push((o, 1.0));
                }
                _ => {
                    qdists[j].extend_from_slice(q);
                    spec::sort_by_id(&mut qdists[j]);
                }
            }
            stats.experts_head += st.experts_run;
            drafts[j] = d;
            history.push(d);
            prev = d;
        }
        history.truncate(hist_len);
        stats.mtp_drafted += kk;

        // Verify: one main forward over [next, d1..dkk]. A recurrent (Gated DeltaNet) state
        // cannot be cut back afterwards: it is saved first and rolled back on a rejection.
        let mut input = [0u32; 4];
        input[0] = next;
        input[1..=kk].copy_from_slice(&drafts[..kk]);
        let recurrent = st.is_recurrent();
        if recurrent {
            st.checkpoint_recurrent()?;
        }
        let logits = model.forward_chunk(st, &input[..=kk], 0)?;
        stats.decode_steps += 1;
        let v = model.cfg.vocab;
        let mut acc = 0;
        let mut fix = None;
        for j in 0..kk {
            let p = sampler.probs_after_filters(&logits[j * v..(j + 1) * v], history);
            let (u_accept, u_residual) = (coin.next(), coin.next());
            match spec::verify_draft(
                p,
                &qdists[j],
                drafts[j],
                u_accept,
                u_residual,
                &mut residual,
            ) {
                Verdict::Accept => {
                    acc += 1;
                    history.push(drafts[j]);
                }
                Verdict::Reject(y) => {
                    fix = Some(y);
                    break;
                }
            }
        }
        // All accepted: `history` already ends with the kk drafts the bonus token follows.
        let bonus = match fix {
            Some(y) => y,
            None => {
                let p = sampler.probs_after_filters(&logits[kk * v..(kk + 1) * v], history);
                spec::draw(p, coin.next())
            }
        };
        history.truncate(hist_len);
        stats.mtp_accepted += acc;
        stats.experts_main += st.experts_run;

        // Keep the main cache up to the last accepted token (a recurrent state: roll back and
        // feed the kept tokens again, which also remakes their hidden rows); redo the MTP
        // slots of accepted drafts with the main model's real hidden states.
        if recurrent && acc < kk {
            st.rollback_recurrent(pos)?;
            model.forward_chunk(st, &input[..=acc], acc)?;
            stats.experts_main += st.experts_run;
            stats.mtp_rollbacks += 1;
        } else {
            st.truncate(pos + 1 + acc);
        }
        held.push(next);
        held.extend_from_slice(&drafts[..acc]);
        st.mtp_pos = mtp_start + 1;
        if acc > 0 {
            model.mtp_take_hidden(st, 0, acc, 0);
        }
        pending.copy_from_slice(model.mtp_source_row(st, acc));
        if acc > 0 {
            model.mtp_forward(st, &drafts[..acc], acc)?;
            stats.experts_head += st.experts_run;
        }
        for _ in 0..=acc {
            st.tick_token();
        }
        for &d in &drafts[..acc] {
            if let Some(f) = em.emit(d, history)? {
                return Ok(f);
            }
        }
        next = bonus;
    }
}

/// Length of the longest common prefix.
pub fn lcp(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Finds stop sequences in streamed text. Text that could still turn out to be the start of
/// a stop sequence is held back until it cannot.
pub struct StopScanner {
    stops: Vec<String>,
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
}

impl StopScanner {
    pub fn new(stops: &[String]) -> StopScanner {
        StopScanner {
            stops: stops.to_vec(),
            text: String::new(),
            emitted: 0,
        }
    }

    /// Add text; returns what may be sent now and the stop sequence found, if one was (the
    /// text from it on is dropped).
    pub fn push(&mut self, piece: &str) -> (String, Option<String>) {
        self.text.push_str(piece);
        if self.stops.is_empty() {
            let out = self.text[self.emitted..].to_string();
            self.emitted = self.text.len();
            return (out, None);
        }
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let mut from = self.emitted.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|p| (from + p, s)))
            .min_by_key(|(p, _)| *p);
        if let Some((pos, s)) = hit {
            let pos = pos.max(self.emitted);
            let out = self.text[self.emitted..pos].to_string();
            self.emitted = self.text.len();
            return (out, Some(s.clone()));
        }
        // Hold back the longest tail that is a proper prefix of some stop sequence.
        let len = self.text.len();
        let mut keep = 0;
        for s in &self.stops {
            for k in (1..s.len()).rev() {
                if k <= len - self.emitted
                    && self.text.is_char_boundary(len - k)
                    && s.is_char_boundary(k)
                    && self.text.ends_with(&s[..k])
                {
                    keep = keep.max(k);
                    break;
                }
            }
        }
        let out = self.text[self.emitted..len - keep].to_string();
        self.emitted = len - keep;
        (out, None)
    }

    /// Everything held back (generation ended without a stop sequence).
    pub fn finish(&mut self) -> String {
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut sc = StopScanner::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let (e, hit) = sc.push(p);
            out.push_str(&e);
            if hit.is_some() {
                return (out, hit);
            }
        }
        out.push_str(&sc.finish());
        (out, None)
    }

    #[test]
    fn stop_sequence_split_across_pieces_is_cut() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "D tail"]),
            ("abc ".to_string(), Some("END".to_string()))
        );
        assert_eq!(
            run(&["\n\n", "xyz"], &["one\n", "two", "\n", "\nthree"]),
            ("one\ntwo".to_string(), Some("\n\n".to_string()))
        );
    }

    #[test]
    fn near_misses_are_released() {
        assert_eq!(run(&["END"], &["E", "N", "d"]), ("ENd".to_string(), None));
        assert_eq!(run(&["é!"], &["aé", "b"]), ("aéb".to_string(), None));
        assert_eq!(run(&[], &["a", "b"]), ("ab".to_string(), None));
    }

    #[test]
    fn earliest_stop_wins() {
        assert_eq!(
            run(&["c", "ab"], &["xabc"]),
            ("x".to_string(), Some("ab".to_string()))
        );
    }
}
