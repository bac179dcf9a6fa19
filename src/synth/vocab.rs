//! The tokenizer every synthetic model carries: a real small byte-level BPE (so `run` works on
//! text), padded with unused tokens to the model's vocabulary size.
//!
//! Invariant: token ids 0..988 are the embedded vocabulary's, whatever the padded size.

use crate::format::FormatError;
use std::path::Path;

/// GPT-2's byte -> printable character map (byte-level BPE vocabularies spell bytes this way).
pub fn byte_chars() -> Vec<char> {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut extra = 0u32;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap_or('?')
            }
        })
        .collect()
}

/// A real (small) byte-level BPE: 988 tokens and 729 merges trained with the Python
/// `tokenizers` package on an English corpus with Qwen2's pre-tokenizer, plus ChatML specials
/// (assets/synth-vocab.json = tests/fixtures/tokenizer/bytelevel/tokenizer.json, made by
/// scripts/make_tokenizer_fixtures.py).
const VOCAB_JSON: &str = include_str!("../../assets/synth-vocab.json");

/// The embedded vocabulary, padded with `<|unused_N|>` tokens to `min_size`.
pub(super) struct Vocab {
    pub(super) tokens: Vec<String>,
    pub(super) merges: Vec<String>,
    pub(super) types: Vec<i32>,
    pub(super) eos: u32,
    pub(super) pad: u32,
}

pub(super) fn vocabulary(min_size: usize, path: &Path) -> Result<Vocab, FormatError> {
    let bad = |m: &str| FormatError::Writer {
        path: path.to_path_buf(),
        msg: format!("embedded vocabulary: {m}"),
    };
    let v: serde_json::Value = serde_json::from_str(VOCAB_JSON).map_err(|e| bad(&e.to_string()))?;
    let map = v["model"]["vocab"]
        .as_object()
        .ok_or_else(|| bad("no model.vocab"))?;
    let added = v["added_tokens"].as_array().cloned().unwrap_or_default();
    let ids = map
        .values()
        .chain(added.iter().map(|a| &a["id"]))
        .filter_map(|x| x.as_u64());
    let n = ids
        .max()
        .map(|m| m as usize + 1)
        .ok_or_else(|| bad("empty"))?;
    let mut tokens = vec![String::new(); n];
    let mut types = vec![1i32; n];
    for (t, id) in map {
        let id = id.as_u64().ok_or_else(|| bad("non-integer id"))? as usize;
        tokens[id] = t.clone();
    }
    for a in &added {
        let (Some(id), Some(c)) = (a["id"].as_u64(), a["content"].as_str()) else {
            return Err(bad("bad added token"));
        };
        tokens[id as usize] = c.to_string();
        types[id as usize] = if a["special"].as_bool().unwrap_or(true) {
            3
        } else {
            4
        };
    }
    let mut unused = 0;
    for (t, ty) in tokens.iter_mut().zip(types.iter_mut()) {
        if t.is_empty() {
            *t = format!("<|unused_{unused}|>");
            *ty = 5;
            unused += 1;
        }
    }
    while tokens.len() < min_size {
        tokens.push(format!("<|unused_{unused}|>"));
        types.push(5);
        unused += 1;
    }
    let merges = v["model"]["merges"]
        .as_array()
        .ok_or_else(|| bad("no model.merges"))?
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(p) => {
                Some(format!("{} {}", p.first()?.as_str()?, p.get(1)?.as_str()?))
            }
            _ => None,
        })
        .collect::<Option<Vec<String>>>()
        .ok_or_else(|| bad("bad merge"))?;
    let id_of = |s: &str| {
        tokens
            .iter()
            .position(|t| t == s)
            .map(|i| i as u32)
            .ok_or_else(|| bad(&format!("no {s}")))
    };
    let (eos, pad) = (id_of("<|im_end|>")?, id_of("<|endoftext|>")?);
    Ok(Vocab {
        tokens,
        merges,
        types,
        eos,
        pad,
    })
}

pub(super) const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
