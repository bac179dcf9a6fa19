//! Text generation: prefill a prompt, then sample and decode one token at a time, streaming
//! text out as it completes. Shared by `run`, `chat` and (later) the server.
//!
//! Owns: the generation loop and its timing figures. Does not own: the model, tokenizer or
//! sampler (passed in). Invariant: at temperature 0 the tokens depend only on the prompt.

use crate::format::{FileKind, ModelFiles};
use crate::model::{Model, ModelError, State};
use crate::sample::Sampler;
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
    if files.kind() == FileKind::Safetensors || json.is_file() && files.meta("tokenizer.ggml.model").is_none() {
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
    /// Expert-cache figures when the prefill ended (decode figures are the difference).
    pub experts_after_prefill: Option<crate::experts::CacheStats>,
}

impl GenStats {
    pub fn prefill_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }

    pub fn decode_tps(&self) -> f64 {
        self.decode_steps as f64 / self.decode_secs.max(1e-9)
    }

    /// One line for stderr, llama.cpp-like.
    pub fn timing_line(&self) -> String {
        format!(
            "[timing] prompt {} tok, prefill {:.2} tok/s | generated {} tok, decode {:.2} tok/s | experts/token {:.1}",
            self.prompt_tokens,
            self.prefill_tps(),
            self.generated,
            self.decode_tps(),
            self.experts_per_token
        )
    }
}

/// Feed `prompt` to the model at `st.pos` and generate up to `max_tokens`, calling `on_text`
/// with each completed piece of text. Stops at an end-of-generation token (not emitted; unless
/// `ignore_eos`) or when `on_text` returns false. Returns the generated ids and figures.
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
    let mut stats = GenStats { prompt_tokens: prompt.len(), ..Default::default() };
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
    Ok((out, stats))
}
