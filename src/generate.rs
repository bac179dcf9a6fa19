//! The old entry points of the decode loop, kept for callers that own their model and state
//! (tests, benchmarks): thin wrappers over `crate::engine::decode`, the one loop.
//!
//! Owns nothing. Does not own: the loop (engine/decode.rs), the session (engine/mod.rs).

pub use crate::engine::decode::{GenStats, GenerateError};
pub use crate::engine::load_tokenizer;

use crate::engine::decode::{decode, Event, GenParams};
use crate::model::{Model, State};
use crate::sample::Sampler;
use crate::tokenizer::Tokenizer;

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
    let mut p = GenParams::new(max_tokens);
    p.ignore_eos = ignore_eos;
    run(model, st, tok, sampler, prompt, &p, on_text)
}

/// Self-speculative generation with the model's MTP head (`k` drafts per step); `st` must
/// come from `Model::new_state_mtp` with `batch` and `logit_rows` of at least `k + 1`; it is
/// reset first. At temperature 0 the output equals `generate`'s token for token.
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

/// `generate_mtp` with an optional draft override for tests (see `GenParams::oracle`).
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
    if k == 0 {
        return Err(crate::model::ModelError::Input("--mtp 0: needs 1..=3 drafts".into()).into());
    }
    st.reset();
    let mut p = GenParams::new(max_tokens);
    p.ignore_eos = ignore_eos;
    p.mtp = k;
    p.oracle = oracle;
    run(model, st, tok, sampler, prompt, &p, on_text)
}

fn run(
    model: &Model<'_>,
    st: &mut State,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    prompt: &[u32],
    p: &GenParams<'_>,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<(Vec<u32>, GenStats), GenerateError> {
    let mut held = Vec::new();
    let g = decode(
        model,
        tok,
        st,
        &mut held,
        &[],
        prompt,
        sampler,
        p,
        &mut |e| match e {
            Event::Text(t) => on_text(t),
            Event::Started { .. } => true,
        },
    )?;
    Ok((g.tokens, g.stats))
}
