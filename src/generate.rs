//! Text generation: prefill a prompt, then sample and decode one token at a time, streaming
//! text out as it completes. Shared by `run`, `chat` and (later) the server.
//!
//! Owns: the generation loop and its timing figures. Does not own: the model, tokenizer or
//! sampler (passed in). Invariant: at temperature 0 the tokens depend only on the prompt.

use crate::format::{FileKind, ModelFiles};
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

/// The tokenizer of a model: `tokenizer.json` beside a safetensors model (or a GGUF, if one
/// is there), else the vocabulary embedded in the GGUF.
pub fn load_tokenizer(files: &ModelFiles) -> Result<Tokenizer, TokenizerError> {
    let json = files.dir().join("tokenizer.json");
    if files.kind() == FileKind::Safetensors
        || json.is_file() && files.meta("tokenizer.ggml.model").is_none()
    {
        return Tokenizer::from_file(&json);
    }
    Tokenizer::from_gguf_meta(&|k| files.meta(k))
}

/// What one generation did, for the timing line and the server's usage figures.
#[derive(Clone, Debug, Default)]
pub struct GenStats {
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
    pub generated: usize,
    /// Forward passes of one token (the first token comes from the prefill's logits).
    pub decode_steps: usize,
    pub decode_secs: f64,
    /// Routed experts computed per decoded token, summed over layers.
    pub experts_per_token: f64,
    pub stopped_by_eos: bool,
    /// MTP speculative decoding: tokens drafted and accepted.
    pub mtp_drafted: usize,
    pub mtp_accepted: usize,
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

/// Feed `prompt` to the model at `st.pos` and generate up to `max_tokens`, calling `on_text`
/// with each completed piece of text. Stops at an end-of-generation token (not emitted; unless
/// `ignore_eos`) or when `on_text` returns false. Returns the generated ids and figures.
#[allow(clippy::too_many_arguments)]
pub fn generate(
    model: &Model<'_>,
    st: &mut State,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    prompt: &[u32],
    max_tokens: usize,
    ignore_eos: bool,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<(Vec<u32>, GenStats), GenerateError> {
    if prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let mut history: Vec<u32> = Vec::with_capacity(prompt.len() + max_tokens);
    history.extend_from_slice(prompt);
    let mut out = Vec::with_capacity(max_tokens);
    let mut dec = StreamDecoder::new();
    if max_tokens == 0 {
        return Ok((out, stats));
    }

    let t0 = Instant::now();
    let mut next = sampler.sample(model.feed(st, prompt)?, &history);
    stats.prefill_secs = t0.elapsed().as_secs_f64();
    stats.experts_after_prefill = st.expert_stats();
    stats.gpu_after_prefill = st.gpu_stats();

    let t1 = Instant::now();
    let mut experts = 0usize;
    loop {
        if !ignore_eos && tok.eos_ids().contains(&next) {
            stats.stopped_by_eos = true;
            break;
        }
        out.push(next);
        history.push(next);
        stats.generated += 1;
        if let Some(text) = dec.push(tok, next)? {
            if !on_text(&text) {
                break;
            }
        }
        if out.len() >= max_tokens || st.pos >= st.ctx() {
            break;
        }
        let logits = model.forward_chunk(st, &[next], 0)?;
        next = sampler.sample(logits, &history);
        experts += st.experts_run;
        st.tick_token();
        stats.decode_steps += 1;
    }
    if let Some(text) = dec.flush(tok)? {
        on_text(&text);
    }
    stats.decode_secs = t1.elapsed().as_secs_f64();
    stats.experts_per_token = experts as f64 / stats.decode_steps.max(1) as f64;
    stats.experts_per_token_plain = plain_experts_per_token(model);
    Ok((out, stats))
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

/// Self-speculative generation with the model's MTP head: each step drafts up to `k` tokens
/// with the MTP head, verifies them in one batched forward of the main model, and keeps the
/// longest accepted prefix plus the main model's own next token, by the speculative-sampling
/// rule of `crate::speculative` (accept with min(1, p/q), else draw from norm(max(0, p − q)),
/// bonus token from p), which keeps the output distribution the main model's. At temperature 0
/// p and q are point masses, so a draft is accepted iff it equals the main model's arg-max and
/// the output equals `generate`'s token for token.
///
/// `st` must come from `Model::new_state_mtp`, with `batch` and `logit_rows` of at least
/// `k + 1`; it is reset first.
#[allow(clippy::too_many_arguments)]
pub fn generate_mtp(
    model: &Model<'_>,
    st: &mut State,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    prompt: &[u32],
    max_tokens: usize,
    ignore_eos: bool,
    k: usize,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<(Vec<u32>, GenStats), GenerateError> {
    generate_mtp_with(
        model, st, tok, sampler, prompt, max_tokens, ignore_eos, k, None, on_text,
    )
}

/// `generate_mtp` with an optional draft override for tests: when `oracle` is given, draft j
/// of the step that follows output token i is `oracle[i + 1 + j]` (the MTP head still runs,
/// so its cache is exercised), which lets a test drive the acceptance and rollback paths with
/// drafts that are right or wrong on purpose. Greedy only.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn generate_mtp_with(
    model: &Model<'_>,
    st: &mut State,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    prompt: &[u32],
    max_tokens: usize,
    ignore_eos: bool,
    k: usize,
    oracle: Option<&[u32]>,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<(Vec<u32>, GenStats), GenerateError> {
    if !model.has_mtp() {
        return Err(ModelError::Input("--mtp: this model has no MTP layer".into()).into());
    }
    if !st.has_mtp() {
        return Err(ModelError::Input(
            "--mtp: the state has no MTP layer cache (make it with new_state_mtp)".into(),
        )
        .into());
    }
    if k == 0 || st.batch() < k + 1 || st.logit_rows() < k + 1 {
        return Err(ModelError::Input(format!(
            "--mtp {k}: needs 1..=3 drafts and a state of at least {} rows",
            k + 1
        ))
        .into());
    }
    if prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    st.reset();
    let h = model.cfg.hidden;
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let mut history: Vec<u32> = Vec::with_capacity(prompt.len() + max_tokens + k);
    history.extend_from_slice(prompt);
    let mut out = Vec::with_capacity(max_tokens + k);
    let mut dec = StreamDecoder::new();
    let mut pending = vec![0f32; h];
    let mut coin = Coin(crate::synth::Rng(sampler.params().seed ^ 0x5bd1_e995));
    let greedy = sampler.params().temperature <= 0.0;

    // Prefill in chunks; after each, the MTP head catches up on the slots whose next token is known.
    let t0 = Instant::now();
    let b = st.batch();
    let n = prompt.len();
    let mut next = 0u32;
    let mut a = 0;
    while a < n {
        let e = (a + b - 1).min(n); // leave room for the pending slot in the MTP call
        let last = e == n;
        let logits =
            model.forward_chunk(st, &prompt[a..e], if last { e - a - 1 } else { e - a })?;
        if last {
            next = sampler.sample(logits, &history);
        }
        let mut rows = 0;
        if a > 0 {
            st.mtp_hidden[..h].copy_from_slice(&pending);
            rows = 1;
        }
        let own = (e - a).saturating_sub(1);
        if own > 0 {
            model.mtp_take_hidden(st, 0, own, rows);
        }
        let first_tok = if a > 0 { a } else { 1 };
        if e > first_tok {
            model.mtp_forward(st, &prompt[first_tok..e], e - first_tok)?;
        }
        pending.copy_from_slice(&st.hfin[(e - a - 1) * h..(e - a) * h]);
        a = e;
    }
    stats.prefill_secs = t0.elapsed().as_secs_f64();
    stats.experts_after_prefill = st.expert_stats();
    stats.gpu_after_prefill = st.gpu_stats();

    let t1 = Instant::now();
    let mut drafts = vec![0u32; k];
    let mut qdists: Vec<Vec<(u32, f32)>> = vec![Vec::new(); k];
    let mut residual: Vec<(u32, f32)> = Vec::new();
    let (mut experts, mut experts_head) = (0usize, 0usize);
    let mut emit = |id: u32,
                    out: &mut Vec<u32>,
                    history: &mut Vec<u32>,
                    stats: &mut GenStats|
     -> Result<bool, GenerateError> {
        if !ignore_eos && tok.eos_ids().contains(&id) {
            stats.stopped_by_eos = true;
            return Ok(false);
        }
        out.push(id);
        history.push(id);
        stats.generated += 1;
        if let Some(text) = dec.push(tok, id)? {
            if !on_text(&text) {
                return Ok(false);
            }
        }
        Ok(out.len() < max_tokens)
    };
    'gen: loop {
        if !emit(next, &mut out, &mut history, &mut stats)? {
            break;
        }
        let pos = st.pos;
        let kk = k
            .min(max_tokens - out.len())
            .min(st.ctx().saturating_sub(pos + 1));
        if kk == 0 {
            // No room to draft: one plain step.
            if pos >= st.ctx() {
                break;
            }
            let logits = model.forward_chunk(st, &[next], 0)?;
            next = sampler.sample(logits, &history);
            experts += st.experts_run;
            stats.decode_steps += 1;
            st.tick_token();
            continue;
        }
        // Draft kk tokens: slot pos-1 pairs `next` with the real hidden state; later slots chain.
        st.mtp_hidden[..h].copy_from_slice(&pending);
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
            let q = sampler.probs_after_filters(lg, &history);
            let mut d = spec::draw(q, coin.next());
            qdists[j].clear();
            match oracle.and_then(|o| o.get(out.len() + j)) {
                Some(&o) if greedy => {
                    d = o;
                    qdists[j].push((o, 1.0));
                }
                _ => {
                    qdists[j].extend_from_slice(q);
                    spec::sort_by_id(&mut qdists[j]);
                }
            }
            experts_head += st.experts_run;
            drafts[j] = d;
            history.push(d);
            prev = d;
        }
        history.truncate(hist_len);
        stats.mtp_drafted += kk;

        // Verify: one main forward over [next, d1..dkk].
        let mut input = [0u32; 4];
        input[0] = next;
        input[1..=kk].copy_from_slice(&drafts[..kk]);
        let logits = model.forward_chunk(st, &input[..=kk], 0)?;
        stats.decode_steps += 1;
        let v = model.cfg.vocab;
        let mut acc = 0;
        let mut fix = None;
        for j in 0..kk {
            let p = sampler.probs_after_filters(&logits[j * v..(j + 1) * v], &history);
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
                let p = sampler.probs_after_filters(&logits[kk * v..(kk + 1) * v], &history);
                spec::draw(p, coin.next())
            }
        };
        history.truncate(hist_len);
        stats.mtp_accepted += acc;
        experts += st.experts_run;

        // Keep the main cache up to the last accepted token; redo the MTP slots of accepted
        // drafts with the main model's real hidden states.
        st.truncate(pos + 1 + acc);
        st.mtp_pos = mtp_start + 1;
        if acc > 0 {
            model.mtp_take_hidden(st, 0, acc, 0);
            model.mtp_forward(st, &drafts[..acc], acc)?;
            experts_head += st.experts_run;
        }
        pending.copy_from_slice(&st.hfin[acc * h..(acc + 1) * h]);
        for _ in 0..=acc {
            st.tick_token();
        }
        for &d in &drafts[..acc] {
            if !emit(d, &mut out, &mut history, &mut stats)? {
                break 'gen;
            }
        }
        next = bonus;
    }
    if let Some(text) = dec.flush(tok)? {
        on_text(&text);
    }
    stats.decode_secs = t1.elapsed().as_secs_f64();
    let tokens = stats.generated.saturating_sub(1).max(1) as f64;
    stats.mtp_experts_main_per_token = experts as f64 / tokens;
    stats.mtp_experts_head_per_token = experts_head as f64 / tokens;
    stats.experts_per_token = (experts + experts_head) as f64 / tokens;
    stats.experts_per_token_plain = plain_experts_per_token(model);
    Ok((out, stats))
}
