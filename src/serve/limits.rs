//! Bounded work per request: a prompt is tokenized against the server's context, so a request
//! of the largest accepted body costs time and memory in proportion to the context, not to the
//! body.
//!
//! Owns: `encode_prompt`, the one way serve turns prompt text into tokens. Does not own: the
//! body limit (http.rs), rendering the chat template (chat.rs), the context check of the token
//! count that is submitted (mod.rs `submit`).
//! Invariant: the tokens returned are exactly `Tokenizer::encode(text)`; a text is refused
//! only when it certainly holds at least `ctx` tokens, and the memory spent on refusing it is
//! bounded by one chunk's tokenization.

use std::sync::OnceLock;

use super::engine::context_error;
use super::error::ApiError;
use crate::tokenizer::Tokenizer;

/// Texts up to this size are tokenized in one go (a few tens of MB of tokenizer work).
const WHOLE: usize = 256 << 10;
/// Larger texts are first counted in chunks of about this size, cut after a newline.
const CHUNK: usize = 64 << 10;
/// Tokens a cut between chunks may add compared with tokenizing the text whole (a piece split
/// in two, a space marker prepended to the next chunk): subtracted per chunk, so the count
/// stays a lower bound.
const CUT_SLACK: usize = 4;
/// A normalizer can shrink text (NFKC folds some 3-byte characters into 2): allow this factor
/// on top of the longest token when bounding tokens from bytes.
const SHRINK: usize = 4;

/// Bytes of text the longest token of the vocabulary stands for (as decoded). Computed once
/// per process: serve runs one model.
fn longest_token(tok: &Tokenizer) -> usize {
    static LONGEST: OnceLock<usize> = OnceLock::new();
    *LONGEST.get_or_init(|| {
        (0..tok.vocab_size() as u32)
            .filter_map(|id| tok.decode_piece(&[id], false).ok())
            .map(|s| s.len())
            .max()
            .unwrap_or(1)
            .max(1)
    })
}

/// Where to cut `text` at or before `at`: just after a newline followed by a non-space
/// character (where tokenizers' pre-tokenizers split anyway), else at a character boundary.
fn cut(text: &str, at: usize) -> usize {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    let b = text.as_bytes();
    let lo = at.saturating_sub(CHUNK / 2);
    (lo + 1..=at)
        .rev()
        .find(|&i| b[i - 1] == b'\n' && i < b.len() && !b[i].is_ascii_whitespace())
        .filter(|&i| text.is_char_boundary(i))
        .unwrap_or(at)
}

/// Tokenize a prompt (`param`: the request field it came from, for errors) for a server
/// whose context holds `ctx` tokens. Long texts are counted chunk by chunk first and refused
/// with `context_length_exceeded` as soon as they certainly exceed the context.
pub(crate) fn encode_prompt(
    tok: &Tokenizer,
    text: &str,
    add_special: bool,
    ctx: usize,
    param: &str,
) -> Result<Vec<u32>, ApiError> {
    let fail = |e: crate::tokenizer::TokenizerError| {
        ApiError::param(param, format!("cannot tokenize `{param}`: {e}"))
    };
    if text.len() > WHOLE {
        let too_long = |at_least: usize| {
            let mut e = context_error(at_least, ctx);
            e.message = format!(
                "the prompt is at least {at_least} tokens; this server's context holds {ctx} (one more must fit for the reply; raise -c)"
            );
            e.param = Some(param.to_string());
            e
        };
        // Every token stands for at most `longest` bytes.
        let longest = longest_token(tok);
        let floor = text.len() / longest.saturating_mul(SHRINK).max(1);
        if floor >= ctx {
            return Err(too_long(floor));
        }
        let mut at_least = 0usize;
        let mut start = 0;
        while start < text.len() {
            let end = if text.len() - start <= CHUNK {
                text.len()
            } else {
                cut(text, start + CHUNK).max(start + 1)
            };
            let mut end = end;
            while !text.is_char_boundary(end) {
                end += 1;
            }
            let n = tok.encode(&text[start..end], false).map_err(fail)?.len();
            at_least += n.saturating_sub(CUT_SLACK);
            if at_least >= ctx {
                return Err(too_long(at_least));
            }
            start = end;
        }
    }
    tok.encode(text, add_special).map_err(fail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_after_newlines_on_char_boundaries() {
        let t = format!("{}\nabc{}", "x".repeat(100), "é".repeat(10));
        assert_eq!(cut(&t, 110), 101);
        let t = "é".repeat(100);
        let c = cut(&t, 51);
        assert!(t.is_char_boundary(c) && (50..=51).contains(&c));
    }
}
