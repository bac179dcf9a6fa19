//! GGUF-embedded vocabularies (`tokenizer.ggml.*`) converted into a `tokenizers` tokenizer of
//! the same kind the model's own `tokenizer.json` describes, plus an exact decode table.
//!
//! Owns: reading the tokenizer keys through a metadata accessor, building
//! - `gpt2` (byte-level BPE): the vocabulary and merges as a BPE model, the pre-tokenizer regexes
//!   that `tokenizer.ggml.pre` names (see pretok.rs), a byte-level mapping;
//! - `llama` (SentencePiece BPE by scores): a BPE model whose merges are derived from the piece
//!   scores (every split of a piece into two pieces, ranked by the merged piece's score, as the
//!   Hugging Face converter does), byte fallback through `<0xNN>` pieces, `▁` for spaces and an
//!   optional space prefix;
//! - special tokens: control and unknown pieces (types 3, 2) become special added tokens (matched
//!   in text only when special tokens are parsed), user-defined pieces (type 4) non-special added
//!   tokens (always matched), both on the raw text, as llama.cpp partitions text;
//! - bos/eos/eot/eom ids, add_bos/add_eos/add_space_prefix, and the end-of-generation set.
//!
//! Does not own: reading GGUF files (format/), encoding at run time (mod.rs).
//! Invariant: decoding renders every id exactly as llama.cpp's `token_to_piece` does (normal
//! pieces unmapped, bytes as bytes, user-defined pieces raw, control pieces raw unless skipped);
//! nothing from the file is indexed without a bounds check.

use std::collections::HashMap;

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormSequence, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::pretok;
use super::TokenizerError;
use crate::format::MetaValue;

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
mod tt {
    pub const NORMAL: i64 = 1;
    pub const UNKNOWN: i64 = 2;
    pub const CONTROL: i64 = 3;
    pub const USER_DEFINED: i64 = 4;
    pub const UNUSED: i64 = 5;
    pub const BYTE: i64 = 6;
}

/// Token texts that end generation when present (llama.cpp's list, which finds them by text
/// because converters do not record them).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
];

/// OpenAI's harmony vocabulary (gpt-oss) ends a message with `<|end|>` but a reply with
/// `<|return|>` (or `<|call|>` for a tool call): between the analysis and the final message
/// the model writes `<|end|><|start|>assistant`, so `<|end|>` must not stop generation. As
/// llama.cpp does (and transformers' generation_config.json, which lists only `<|return|>`,
/// `<|call|>` and `<|endoftext|>`): when `<|return|>` and `<|call|>` both end generation,
/// `<|end|>` does not.
fn drop_harmony_end(eog: &mut Vec<u32>, tokens: &[&str]) {
    let text = |i: u32| tokens.get(i as usize).copied().unwrap_or("");
    let has = |t: &str| eog.iter().any(|&i| text(i) == t);
    if has("<|return|>") && has("<|call|>") {
        eog.retain(|&i| text(i) != "<|end|>");
    }
}

/// SentencePiece's visible space.
const SPM_SPACE: &str = "\u{2581}";

/// How one token renders when decoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Render {
    /// Always (normal, byte and user-defined pieces).
    Always,
    /// Only when special tokens are not skipped (control and unknown pieces).
    Special,
    /// Never (unused pieces).
    Never,
}

/// The bytes each token id decodes to, in one buffer.
#[derive(Debug)]
pub(crate) struct PieceTable {
    bytes: Vec<u8>,
    /// `offs[i]..offs[i + 1]` is token i's bytes; `offs.len() == n_tokens + 1`.
    offs: Vec<usize>,
    render: Vec<Render>,
}

impl PieceTable {
    pub fn len(&self) -> usize {
        self.render.len()
    }

    /// Append the bytes of `ids` to `out`. An id outside the table is an error.
    pub fn decode_into(
        &self,
        ids: &[u32],
        skip_special: bool,
        out: &mut Vec<u8>,
    ) -> Result<(), TokenizerError> {
        for &id in ids {
            let i = id as usize;
            let (Some(&r), Some(&a), Some(&b)) =
                (self.render.get(i), self.offs.get(i), self.offs.get(i + 1))
            else {
                return Err(TokenizerError::TokenId {
                    id,
                    vocab: self.len(),
                });
            };
            let show = match r {
                Render::Always => true,
                Render::Special => !skip_special,
                Render::Never => false,
            };
            if show {
                out.extend_from_slice(&self.bytes[a..b]);
            }
        }
        Ok(())
    }
}

/// A GGUF vocabulary ready to encode (`hf`) and decode (`table`).
pub(crate) struct GgufVocab {
    pub hf: tokenizers::Tokenizer,
    pub table: PieceTable,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// End-of-generation ids, sorted, deduplicated.
    pub eog: Vec<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    /// SentencePiece vocabularies with a space prefix: decoding drops one leading space.
    pub strip_leading_space: bool,
    pub chat_template: Option<String>,
    pub token_texts: Vec<String>,
}

type Get<'g, 'm> = &'g dyn Fn(&str) -> Option<&'m MetaValue>;

fn meta_err(key: &str, msg: impl Into<String>) -> TokenizerError {
    TokenizerError::Meta {
        key: key.to_string(),
        msg: msg.into(),
    }
}

fn array<'m>(get: Get<'_, 'm>, key: &str) -> Result<Option<&'m [MetaValue]>, TokenizerError> {
    match get(key) {
        None => Ok(None),
        Some(v) => v
            .as_array()
            .map(Some)
            .ok_or_else(|| meta_err(key, "is not an array")),
    }
}

fn string_list<'m>(get: Get<'_, 'm>, key: &str) -> Result<Option<Vec<&'m str>>, TokenizerError> {
    let Some(a) = array(get, key)? else {
        return Ok(None);
    };
    a.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_str()
                .ok_or_else(|| meta_err(key, format!("element {i} is not a string")))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn opt_id(get: Get<'_, '_>, key: &str, n: usize) -> Result<Option<u32>, TokenizerError> {
    let Some(v) = get(key) else { return Ok(None) };
    // Converters write -1 (as a signed type) for "none".
    if v.as_i64().is_some_and(|x| x < 0) {
        return Ok(None);
    }
    let id = v
        .as_u64()
        .ok_or_else(|| meta_err(key, "is not an integer"))?;
    if id >= n as u64 {
        return Err(meta_err(
            key,
            format!("token id {id} is outside the vocabulary of {n} tokens"),
        ));
    }
    Ok(Some(id as u32))
}

fn opt_bool(get: Get<'_, '_>, key: &str) -> Result<Option<bool>, TokenizerError> {
    match get(key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| meta_err(key, "is not a boolean")),
    }
}

/// GPT-2's byte <-> printable character mapping: printable Latin-1 bytes map to themselves,
/// the others to U+0100.. in byte order.
fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut next = 256u32;
    for b in 0..256u32 {
        let c = if printable(b) {
            b
        } else {
            next += 1;
            next - 1
        };
        table[b as usize] = char::from_u32(c).unwrap_or('\u{FFFD}');
    }
    table
}

/// `<0xNN>` -> NN.
fn parse_byte_piece(s: &str) -> Option<u8> {
    let hex = s.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `tokenizer.ggml.model = gpt2`.
    ByteLevelBpe,
    /// `tokenizer.ggml.model = llama`.
    SentencePiece,
}

pub(crate) fn from_meta(get: Get<'_, '_>) -> Result<GgufVocab, TokenizerError> {
    const MODEL: &str = "tokenizer.ggml.model";
    const TOKENS: &str = "tokenizer.ggml.tokens";
    const TYPES: &str = "tokenizer.ggml.token_type";
    const SCORES: &str = "tokenizer.ggml.scores";
    const MERGES: &str = "tokenizer.ggml.merges";
    const PRE: &str = "tokenizer.ggml.pre";

    let model = get(MODEL)
        .ok_or_else(|| meta_err(MODEL, "missing (the file has no embedded vocabulary)"))?;
    let model = model
        .as_str()
        .ok_or_else(|| meta_err(MODEL, "is not a string"))?;
    let kind = match model {
        "gpt2" => Kind::ByteLevelBpe,
        "llama" => Kind::SentencePiece,
        other => {
            return Err(TokenizerError::Unsupported(format!(
                "GGUF tokenizer model `{}` (sluice reads `gpt2` and `llama`)",
                crate::format::printable(other)
            )))
        }
    };
    let tokens = string_list(get, TOKENS)?.ok_or_else(|| meta_err(TOKENS, "missing"))?;
    let n = tokens.len();
    if n == 0 || n > u32::MAX as usize {
        return Err(meta_err(TOKENS, format!("has {n} tokens")));
    }
    let types: Vec<i64> = match array(get, TYPES)? {
        None => vec![tt::NORMAL; n],
        Some(a) => {
            if a.len() != n {
                return Err(meta_err(
                    TYPES,
                    format!("has {} entries for {n} tokens", a.len()),
                ));
            }
            a.iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_i64()
                        .ok_or_else(|| meta_err(TYPES, format!("element {i} is not an integer")))
                })
                .collect::<Result<_, _>>()?
        }
    };

    let bos_key = "tokenizer.ggml.bos_token_id";
    let eos_key = "tokenizer.ggml.eos_token_id";
    let mut bos = opt_id(get, bos_key, n)?;
    let mut eos = opt_id(get, eos_key, n)?;
    let unk = opt_id(get, "tokenizer.ggml.unknown_token_id", n)?;
    let eot = opt_id(get, "tokenizer.ggml.eot_token_id", n)?;
    let eom = opt_id(get, "tokenizer.ggml.eom_token_id", n)?;
    let pre_name = match get(PRE) {
        None => "",
        Some(v) => v.as_str().ok_or_else(|| meta_err(PRE, "is not a string"))?,
    };

    // llama.cpp's defaults where the file says nothing.
    let (mut add_bos, mut add_space_prefix) = match kind {
        Kind::SentencePiece => {
            if bos.is_none() && get(bos_key).is_none() && n > 1 {
                bos = Some(1);
            }
            if eos.is_none() && get(eos_key).is_none() && n > 2 {
                eos = Some(2);
            }
            (true, true)
        }
        Kind::ByteLevelBpe => {
            let llama3 = matches!(
                pre_name,
                "llama3"
                    | "llama-v3"
                    | "llama-bpe"
                    | "falcon3"
                    | "falcon-h1"
                    | "pixtral"
                    | "midm-2.0"
                    | "lfm2"
                    | "tekken"
            );
            (llama3, false)
        }
    };
    if let Some(b) = opt_bool(get, "tokenizer.ggml.add_bos_token")? {
        add_bos = b;
    }
    let add_eos = opt_bool(get, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    if let Some(b) = opt_bool(get, "tokenizer.ggml.add_space_prefix")? {
        add_space_prefix = b;
    }
    if add_bos && bos.is_none() {
        return Err(meta_err(
            "tokenizer.ggml.add_bos_token",
            "is true but there is no bos_token_id",
        ));
    }
    if add_eos && eos.is_none() {
        return Err(meta_err(
            "tokenizer.ggml.add_eos_token",
            "is true but there is no eos_token_id",
        ));
    }

    // Vocabulary map: a later duplicate wins, as in llama.cpp's `token_to_id`.
    let mut vocab = Vocab::with_capacity(n);
    for (i, t) in tokens.iter().enumerate() {
        vocab.insert((*t).to_string(), i as u32);
    }

    let mut hf = match kind {
        Kind::ByteLevelBpe => {
            let pre = pretok::lookup(pre_name).ok_or_else(|| {
                TokenizerError::Unsupported(format!(
                    "pre-tokenizer `{}` ({PRE})",
                    crate::format::printable(pre_name)
                ))
            })?;
            let merges = string_list(get, MERGES)?
                .ok_or_else(|| meta_err(MERGES, "missing (a gpt2 vocabulary needs merges)"))?;
            let mut pairs = Vec::with_capacity(merges.len());
            for (i, m) in merges.iter().enumerate() {
                // The separator is the first space after the first byte (a piece may be " ").
                let first = m.chars().next().map_or(0, char::len_utf8);
                let cut = m[first..]
                    .find(' ')
                    .map(|p| p + first)
                    .filter(|_| first > 0);
                let Some(cut) = cut else {
                    return Err(meta_err(
                        MERGES,
                        format!("element {i} `{m}` is not two pieces separated by a space"),
                    ));
                };
                let (a, b) = (&m[..cut], &m[cut + 1..]);
                let joined = format!("{a}{b}");
                // A merge whose parts or result are not pieces can never apply; skip it.
                if vocab.contains_key(a) && vocab.contains_key(b) && vocab.contains_key(&joined) {
                    pairs.push((a.to_string(), b.to_string()));
                }
            }
            let bpe = BPE::builder()
                .vocab_and_merges(vocab, pairs)
                .ignore_merges(pre.ignore_merges)
                .build()
                .map_err(|e| TokenizerError::Build(format!("GGUF gpt2 vocabulary: {e}")))?;
            let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(pre.regexes.len() + 1);
            for r in pre.regexes {
                let split = Split::new(
                    SplitPattern::Regex((*r).to_string()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(|e| {
                    TokenizerError::Build(format!("pre-tokenizer `{pre_name}` regex {r}: {e}"))
                })?;
                steps.push(split.into());
            }
            steps.push(ByteLevel::new(false, false, false).into());
            let mut hf = tokenizers::Tokenizer::new(bpe);
            hf.with_pre_tokenizer(Some(PreSequence::new(steps)));
            if pre.nfc {
                hf.with_normalizer(Some(NFC))
                    .map_err(|e| TokenizerError::Build(format!("NFC normalizer: {e}")))?;
            }
            hf
        }
        Kind::SentencePiece => {
            let scores: Vec<f32> = match array(get, SCORES)? {
                None => vec![0.0; n],
                Some(a) => {
                    if a.len() != n {
                        return Err(meta_err(
                            SCORES,
                            format!("has {} entries for {n} tokens", a.len()),
                        ));
                    }
                    a.iter()
                        .enumerate()
                        .map(|(i, v)| {
                            v.as_f64().map(|x| x as f32).ok_or_else(|| {
                                meta_err(SCORES, format!("element {i} is not a number"))
                            })
                        })
                        .collect::<Result<_, _>>()?
                }
            };
            let pairs = spm_merges(&tokens, &vocab, &scores);
            let byte_fallback = vocab.contains_key("<0x00>");
            let mut b = BPE::builder()
                .vocab_and_merges(vocab, pairs)
                .byte_fallback(byte_fallback)
                .fuse_unk(true);
            if let Some(u) = unk.and_then(|u| tokens.get(u as usize)) {
                b = b.unk_token((*u).to_string());
            }
            let bpe = b
                .build()
                .map_err(|e| TokenizerError::Build(format!("GGUF llama vocabulary: {e}")))?;
            let mut steps: Vec<NormalizerWrapper> = Vec::with_capacity(2);
            if add_space_prefix {
                steps.push(Prepend::new(SPM_SPACE.to_string()).into());
            }
            let replace = Replace::new(" ", SPM_SPACE)
                .map_err(|e| TokenizerError::Build(format!("normalizer: {e}")))?;
            steps.push(replace.into());
            let mut hf = tokenizers::Tokenizer::new(bpe);
            hf.with_normalizer(Some(NormSequence::new(steps)))
                .map_err(|e| TokenizerError::Build(format!("normalizer: {e}")))?;
            hf
        }
    };

    // Special pieces, matched on the raw text before anything else.
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (i, (&t, &ty)) in tokens.iter().zip(&types).enumerate() {
        if t.is_empty() {
            continue;
        }
        let is_control = ty == tt::CONTROL || ty == tt::UNKNOWN || Some(i as u32) == unk;
        if is_control {
            special.push(AddedToken::from(t, true).normalized(false));
        } else if ty == tt::USER_DEFINED {
            user.push(AddedToken::from(t, false).normalized(false));
        }
    }
    hf.add_special_tokens(special)
        .map_err(|e| TokenizerError::Build(format!("special tokens: {e}")))?;
    hf.add_tokens(user)
        .map_err(|e| TokenizerError::Build(format!("user-defined tokens: {e}")))?;

    let table = piece_table(kind, &tokens, &types);

    let mut eog: Vec<u32> = [eos, eot, eom].into_iter().flatten().collect();
    for (i, (&t, &ty)) in tokens.iter().zip(&types).enumerate() {
        if EOG_TEXTS.contains(&t) && ty != tt::NORMAL && ty != tt::BYTE {
            eog.push(i as u32);
        }
    }
    eog.sort_unstable();
    eog.dedup();
    drop_harmony_end(&mut eog, &tokens);

    let chat_template = match get("tokenizer.chat_template") {
        None => None,
        Some(v) => Some(
            v.as_str()
                .ok_or_else(|| meta_err("tokenizer.chat_template", "is not a string"))?
                .to_string(),
        ),
    };

    Ok(GgufVocab {
        hf,
        table,
        bos,
        eos,
        eog,
        add_bos,
        add_eos,
        strip_leading_space: kind == Kind::SentencePiece && add_space_prefix,
        chat_template,
        token_texts: tokens.iter().map(|s| s.to_string()).collect(),
    })
}

/// BPE merges equivalent to SentencePiece's "merge the adjacent pair whose concatenation is the
/// best-scoring piece": every split of every piece into two pieces, ordered by the merged
/// piece's score (higher first), then by its id. One known difference: where two different
/// pieces have the same score, llama.cpp merges the leftmost pair first and this order the
/// lower id; normal pieces of real vocabularies almost never tie (llama: 16 of 31741, all at
/// -1e9).
fn spm_merges(tokens: &[&str], vocab: &Vocab, scores: &[f32]) -> Vec<(String, String)> {
    let mut ranked: Vec<(f32, u32, usize, usize)> = Vec::new(); // (score, id, token index, split byte)
    for (i, t) in tokens.iter().enumerate() {
        if vocab.get(*t) != Some(&(i as u32)) {
            continue; // a shadowed duplicate
        }
        for (cut, _) in t.char_indices().skip(1) {
            let (a, b) = t.split_at(cut);
            if vocab.contains_key(a) && vocab.contains_key(b) {
                ranked.push((scores.get(i).copied().unwrap_or(0.0), i as u32, i, cut));
            }
        }
    }
    ranked.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.3.cmp(&y.3)));
    ranked
        .into_iter()
        .map(|(_, _, i, cut)| {
            let (a, b) = tokens[i].split_at(cut);
            (a.to_string(), b.to_string())
        })
        .collect()
}

fn piece_table(kind: Kind, tokens: &[&str], types: &[i64]) -> PieceTable {
    let b2c = byte_to_char_table();
    let mut c2b: HashMap<char, u8> = HashMap::with_capacity(256);
    for (b, c) in b2c.iter().enumerate() {
        c2b.insert(*c, b as u8);
    }
    let mut bytes = Vec::with_capacity(tokens.iter().map(|t| t.len()).sum());
    let mut offs = Vec::with_capacity(tokens.len() + 1);
    let mut render = Vec::with_capacity(tokens.len());
    offs.push(0);
    for (&t, &ty) in tokens.iter().zip(types) {
        let r = match ty {
            tt::CONTROL | tt::UNKNOWN => {
                bytes.extend_from_slice(t.as_bytes());
                Render::Special
            }
            tt::USER_DEFINED => {
                bytes.extend_from_slice(t.as_bytes());
                Render::Always
            }
            tt::UNUSED => Render::Never,
            tt::BYTE => match parse_byte_piece(t) {
                Some(b) => {
                    bytes.push(b);
                    Render::Always
                }
                None => Render::Never,
            },
            // Normal (and undefined) pieces.
            _ => {
                match kind {
                    Kind::SentencePiece => {
                        bytes.extend_from_slice(t.replace(SPM_SPACE, " ").as_bytes())
                    }
                    Kind::ByteLevelBpe => {
                        for c in t.chars() {
                            match c2b.get(&c) {
                                Some(&b) => bytes.push(b),
                                None => {
                                    let mut buf = [0u8; 4];
                                    bytes.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                                }
                            }
                        }
                    }
                }
                Render::Always
            }
        };
        render.push(r);
        offs.push(bytes.len());
    }
    PieceTable {
        bytes,
        offs,
        render,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_gpt2s() {
        let t = byte_to_char_table();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0xAD], 'Ń');
        let mut seen: Vec<char> = t.to_vec();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 256);
    }

    #[test]
    fn byte_pieces() {
        assert_eq!(parse_byte_piece("<0x0A>"), Some(10));
        assert_eq!(parse_byte_piece("<0xFF>"), Some(255));
        assert_eq!(parse_byte_piece("<0x1>"), None);
        assert_eq!(parse_byte_piece("0x10"), None);
    }
}
