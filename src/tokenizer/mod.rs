//! Text <-> token ids: Hugging Face `tokenizer.json` files and GGUF-embedded vocabularies, both
//! run by the `tokenizers` crate, plus incremental detokenization for streaming.
//!
//! Owns: loading (`tokenizer.json` with `tokenizer_config.json` / `generation_config.json` /
//! `chat_template.jinja` beside it, or `tokenizer.ggml.*` metadata), encoding with or without
//! parsing special tokens in the text, decoding, bos/eos/end-of-generation ids, the chat
//! template text, and `StreamDecoder`.
//! Does not own: rendering chat templates (chat.rs), reading GGUF files (format/).
//! Invariant: for a GGUF vocabulary, encoding equals llama.cpp's `llama_tokenize` and decoding
//! its `token_to_piece` (tests/tokenizer_gguf.rs checks llama.cpp's own test cases); for a
//! `tokenizer.json`, both equal the Python `tokenizers` package (tests/tokenizer_hf.rs).
//!
//! Map: `gguf_vocab.rs` converts GGUF metadata; `pretok.rs` is the table of pre-tokenizer
//! regexes by `tokenizer.ggml.pre` name.

mod gguf_vocab;
mod pretok;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use serde_json::Value;
use tokenizers::{Decoder, DecoderWrapper};

use crate::format::MetaValue;
use gguf_vocab::PieceTable;

/// Everything that can go wrong loading a tokenizer or converting between text and ids.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{}: cannot read: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },
    /// A tokenizer or config file that does not parse or does not make sense.
    #[error("{}: {msg}", path.display())]
    File { path: PathBuf, msg: String },
    /// A GGUF `tokenizer.*` key that is missing or malformed.
    #[error("GGUF metadata `{key}`: {msg}")]
    Meta { key: String, msg: String },
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    #[error("cannot build the tokenizer: {0}")]
    Build(String),
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenId { id: u32, vocab: usize },
    #[error("cannot encode text: {0}")]
    Encode(String),
    #[error("cannot decode tokens: {0}")]
    Decode(String),
}

/// How ids become text.
enum Detok {
    /// GGUF vocabularies: a table of each id's bytes (llama.cpp's rendering).
    Table {
        table: PieceTable,
        strip_leading_space: bool,
    },
    /// `tokenizer.json`: the file's decoder; `stream` is the same decoder without the step that
    /// drops a leading space at the start of a text (None: the file has no such step).
    Hf { stream: Option<DecoderWrapper> },
}

struct Inner {
    /// Matches special tokens in the text.
    hf: tokenizers::Tokenizer,
    /// Same, but control tokens in the text stay text (llama.cpp's `parse_special = false`);
    /// built on first use.
    literal: OnceLock<tokenizers::Tokenizer>,
    detok: Detok,
    vocab_size: usize,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    eos_ids: Vec<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos: bool,
    add_eos: bool,
    chat_template: Option<String>,
}

/// A model's tokenizer. Cloning is cheap (shared).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.vocab_size)
            .field("bos_id", &self.inner.bos_id)
            .field("eos_ids", &self.inner.eos_ids)
            .finish()
    }
}

/// A special-token entry of `tokenizer_config.json`: `"<s>"` or `{"content": "<s>", ...}`.
fn config_token(cfg: &Value, key: &str) -> Option<String> {
    match cfg.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

fn read_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|err| TokenizerError::Io {
        path: path.to_path_buf(),
        err,
    })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TokenizerError::File {
            path: path.to_path_buf(),
            msg: format!("invalid JSON: {e}"),
        })
}

/// The decoder of a `tokenizer.json` with its "drop the leading space" step turned off, for
/// decoding pieces in the middle of a text. None when nothing needed turning off.
fn stream_decoder(hf: &tokenizers::Tokenizer) -> Option<DecoderWrapper> {
    fn strip_off(v: &mut Value) -> bool {
        let Some(o) = v.as_object_mut() else {
            return false;
        };
        match o.get("type").and_then(Value::as_str) {
            Some("Sequence") => {
                let mut changed = false;
                if let Some(Value::Array(ds)) = o.get_mut("decoders") {
                    for d in ds {
                        changed |= strip_off(d);
                    }
                }
                changed
            }
            Some("Strip") => {
                let start = o.get("start").and_then(Value::as_u64).unwrap_or(0);
                if start > 0 {
                    o.insert("start".into(), Value::from(0));
                    true
                } else {
                    false
                }
            }
            Some("Metaspace") => {
                let mut changed = false;
                if o.get("prepend_scheme")
                    .and_then(Value::as_str)
                    .is_some_and(|s| s != "never")
                {
                    o.insert("prepend_scheme".into(), Value::from("never"));
                    changed = true;
                }
                if o.get("add_prefix_space").and_then(Value::as_bool) == Some(true) {
                    o.insert("add_prefix_space".into(), Value::from(false));
                    changed = true;
                }
                changed
            }
            _ => false,
        }
    }
    let mut v = serde_json::to_value(hf.get_decoder()?).ok()?;
    if !strip_off(&mut v) {
        return None;
    }
    serde_json::from_value(v).ok()
}

impl Tokenizer {
    /// A Hugging Face `tokenizer.json`. Beside it, if present: `tokenizer_config.json` (bos/eos
    /// tokens, `add_bos_token`/`add_eos_token`, `chat_template`), `chat_template.jinja` (takes
    /// precedence, as in transformers) and `generation_config.json` (`eos_token_id`: every id it
    /// lists ends generation; `config.json`'s when it has none).
    pub fn from_file(path: &Path) -> Result<Tokenizer, TokenizerError> {
        if !path.is_file() {
            return Err(TokenizerError::Io {
                path: path.to_path_buf(),
                err: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            });
        }
        let hf = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError::File {
            path: path.to_path_buf(),
            msg: format!("not a tokenizer.json: {e}"),
        })?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = read_json(&cfg_path)?.unwrap_or(Value::Null);
        let bos_token = config_token(&cfg, "bos_token");
        let eos_token = config_token(&cfg, "eos_token");
        let bos_id = bos_token.as_deref().and_then(|t| hf.token_to_id(t));
        let eos_id = eos_token.as_deref().and_then(|t| hf.token_to_id(t));

        // What the file's post-processor adds, unless the config says otherwise (transformers
        // rebuilds the post-processor from `add_bos_token`/`add_eos_token` for Llama-like
        // tokenizers). sluice always encodes without the post-processor and adds these itself.
        let probe = hf.encode_fast("", true).map_err(|e| TokenizerError::File {
            path: path.to_path_buf(),
            msg: format!("encoding a probe: {e}"),
        })?;
        let probe = probe.get_ids();
        let pp_bos = bos_id.is_some() && probe.first().copied() == bos_id;
        let pp_eos =
            eos_id.is_some() && probe.last().copied() == eos_id && !(pp_bos && probe.len() == 1);
        let add_bos = cfg
            .get("add_bos_token")
            .and_then(Value::as_bool)
            .unwrap_or(pp_bos)
            && bos_id.is_some();
        let add_eos = cfg
            .get("add_eos_token")
            .and_then(Value::as_bool)
            .unwrap_or(pp_eos)
            && eos_id.is_some();

        let jinja = dir.join("chat_template.jinja");
        let chat_template = if jinja.is_file() {
            Some(
                std::fs::read_to_string(&jinja).map_err(|err| TokenizerError::Io {
                    path: jinja.clone(),
                    err,
                })?,
            )
        } else {
            match cfg.get("chat_template") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                // A list of named templates: the one called "default", else the first.
                Some(Value::Array(list)) => {
                    let named = |n: &str| {
                        list.iter()
                            .find(|t| t.get("name").and_then(Value::as_str) == Some(n))
                    };
                    named("default")
                        .or(list.first())
                        .and_then(|t| t.get("template"))
                        .and_then(Value::as_str)
                        .map(str::to_string)
                }
                Some(_) => {
                    return Err(TokenizerError::File {
                        path: cfg_path,
                        msg: "`chat_template` is not a string or a list".into(),
                    })
                }
            }
        };

        let mut eos_ids: Vec<u32> = eos_id.into_iter().collect();
        // transformers' `generate` stops at generation_config.json's eos ids, else config.json's.
        let gen = match read_json(&dir.join("generation_config.json"))? {
            Some(g) if g.get("eos_token_id").is_some() => Some(g),
            _ => read_json(&dir.join("config.json"))?,
        };
        match gen.as_ref().and_then(|g| g.get("eos_token_id")) {
            Some(Value::Number(n)) => eos_ids.extend(n.as_u64().map(|x| x as u32)),
            Some(Value::Array(a)) => {
                eos_ids.extend(a.iter().filter_map(Value::as_u64).map(|x| x as u32))
            }
            _ => {}
        }
        let vocab_size = hf.get_vocab_size(true);
        eos_ids.retain(|&i| (i as usize) < vocab_size);
        eos_ids.sort_unstable();
        eos_ids.dedup();

        let stream = stream_decoder(&hf);
        Ok(Tokenizer {
            inner: Arc::new(Inner {
                hf,
                literal: OnceLock::new(),
                detok: Detok::Hf { stream },
                vocab_size,
                bos_id,
                eos_id,
                eos_ids,
                bos_token,
                eos_token,
                add_bos,
                add_eos,
                chat_template,
            }),
        })
    }

    /// A vocabulary embedded in GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`),
    /// read through `get` (e.g. `|k| files.meta(k)`).
    pub fn from_gguf_meta<'m>(
        get: &dyn Fn(&str) -> Option<&'m MetaValue>,
    ) -> Result<Tokenizer, TokenizerError> {
        let v = gguf_vocab::from_meta(get)?;
        let text = |id: Option<u32>| id.and_then(|i| v.token_texts.get(i as usize)).cloned();
        let bos_token = text(v.bos);
        let eos_token = text(v.eos);
        Ok(Tokenizer {
            inner: Arc::new(Inner {
                vocab_size: v.table.len(),
                hf: v.hf,
                literal: OnceLock::new(),
                detok: Detok::Table {
                    table: v.table,
                    strip_leading_space: v.strip_leading_space,
                },
                bos_id: v.bos,
                eos_id: v.eos,
                eos_ids: v.eog,
                bos_token,
                eos_token,
                add_bos: v.add_bos,
                add_eos: v.add_eos,
                chat_template: v.chat_template,
            }),
        })
    }

    fn encode_with(
        &self,
        hf: &tokenizers::Tokenizer,
        text: &str,
        add_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let inner = &*self.inner;
        let enc = hf
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        let ids = enc.get_ids();
        let mut out = Vec::with_capacity(ids.len() + 2);
        if add_special && inner.add_bos {
            out.extend(inner.bos_id);
        }
        out.extend_from_slice(ids);
        if add_special && inner.add_eos {
            out.extend(inner.eos_id);
        }
        Ok(out)
    }

    /// Encode `text`; special tokens written in it (`<|im_start|>`, `<s>`, ...) become their ids,
    /// as for a rendered chat prompt. `add_special`: add bos/eos where the model's config asks
    /// for them (pass false for text rendered from a chat template, which carries its own).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with(&self.inner.hf, text, add_special)
    }

    /// Encode `text` with control tokens written in it kept as plain text (user-defined tokens
    /// still match, as in llama.cpp with `parse_special = false`). For untrusted text.
    pub fn encode_literal(
        &self,
        text: &str,
        add_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let lit = self.inner.literal.get_or_init(|| {
            let mut t = self.inner.hf.clone();
            t.set_encode_special_tokens(true);
            t
        });
        self.encode_with(lit, text, add_special)
    }

    fn check_ids(&self, ids: &[u32]) -> Result<(), TokenizerError> {
        match ids.iter().find(|&&id| id as usize >= self.inner.vocab_size) {
            Some(&id) => Err(TokenizerError::TokenId {
                id,
                vocab: self.inner.vocab_size,
            }),
            None => Ok(()),
        }
    }

    /// The text of `ids`. `skip_special`: leave out control tokens (bos, eos, `<|im_end|>` ...).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.check_ids(ids)?;
        match &self.inner.detok {
            Detok::Table {
                table,
                strip_leading_space,
            } => {
                let mut bytes = Vec::new();
                table.decode_into(ids, skip_special, &mut bytes)?;
                let s = if *strip_leading_space && bytes.first() == Some(&b' ') {
                    &bytes[1..]
                } else {
                    &bytes[..]
                };
                Ok(String::from_utf8_lossy(s).into_owned())
            }
            Detok::Hf { .. } => self
                .inner
                .hf
                .decode(ids, skip_special)
                .map_err(|e| TokenizerError::Decode(e.to_string())),
        }
    }

    /// Like `decode`, but as a piece in the middle of a text: no leading space is dropped.
    pub fn decode_piece(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.check_ids(ids)?;
        match &self.inner.detok {
            Detok::Table { table, .. } => {
                let mut bytes = Vec::new();
                table.decode_into(ids, skip_special, &mut bytes)?;
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Detok::Hf { stream: None } => self.decode(ids, skip_special),
            Detok::Hf { stream: Some(dec) } => {
                let hf = &self.inner.hf;
                let added = hf.get_added_vocabulary();
                let tokens: Vec<String> = ids
                    .iter()
                    .filter_map(|&id| hf.id_to_token(id))
                    .filter(|t| !skip_special || !added.is_special_token(t))
                    .collect();
                dec.decode(tokens)
                    .map_err(|e| TokenizerError::Decode(e.to_string()))
            }
        }
    }

    /// Number of token ids (including added/special tokens).
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.inner.bos_id
    }

    /// The configured eos id (one); see `eos_ids` for every id that ends generation.
    pub fn eos_id(&self) -> Option<u32> {
        self.inner.eos_id
    }

    /// Every id that ends generation (eos, eot, `<|im_end|>`, ... as the model's config says),
    /// sorted.
    pub fn eos_ids(&self) -> &[u32] {
        &self.inner.eos_ids
    }

    /// Whether `encode(.., true)` adds a bos / eos token.
    pub fn add_bos(&self) -> bool {
        self.inner.add_bos
    }

    pub fn add_eos(&self) -> bool {
        self.inner.add_eos
    }

    /// The bos token's text, for chat templates (`{{ bos_token }}`).
    pub fn bos_token(&self) -> Option<&str> {
        self.inner.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.inner.eos_token.as_deref()
    }

    /// The model's Jinja chat template, if it ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.inner.chat_template.as_deref()
    }

    /// The id of a token given its vocabulary text (e.g. `"<|im_end|>"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.hf.token_to_id(token)
    }
}

/// Incremental detokenization: feed generated ids one at a time, get back the text they
/// complete. Holds back text until it is valid UTF-8 (a multi-byte character split over
/// tokens) and never drops a leading space (the text continues a prompt).
/// Invariant: the concatenation of everything `push` and `flush` return equals
/// `tokenizer.decode_piece(all ids)`.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Start of the window decoded each step (the last emitted piece, for context).
    prefix: usize,
    /// Ids before this are emitted.
    read: usize,
    skip_special: bool,
}

impl Default for StreamDecoder {
    fn default() -> Self {
        StreamDecoder::new()
    }
}

impl StreamDecoder {
    /// A decoder that leaves out control tokens.
    pub fn new() -> StreamDecoder {
        StreamDecoder {
            ids: Vec::with_capacity(64),
            prefix: 0,
            read: 0,
            skip_special: true,
        }
    }

    /// A decoder that renders control tokens too (`--special`).
    pub fn with_special() -> StreamDecoder {
        StreamDecoder {
            skip_special: false,
            ..StreamDecoder::new()
        }
    }

    /// Add one id; returns newly completed text, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>, TokenizerError> {
        if id as usize >= tok.vocab_size() {
            return Err(TokenizerError::TokenId {
                id,
                vocab: tok.vocab_size(),
            });
        }
        self.ids.push(id);
        let prev = tok.decode_piece(&self.ids[self.prefix..self.read], self.skip_special)?;
        let full = tok.decode_piece(&self.ids[self.prefix..], self.skip_special)?;
        let Some(new) = full.strip_prefix(prev.as_str()) else {
            return Ok(None); // a decoder that rewrote earlier text; wait
        };
        if new.is_empty() {
            // Tokens that render as nothing (skipped control tokens): consumed.
            self.read = self.ids.len();
            return Ok(None);
        }
        // An incomplete UTF-8 character at the end: wait for the rest, unless the window has
        // grown past a few tokens (then it is not going to complete: let it out).
        if new.ends_with('\u{FFFD}') && self.ids.len() - self.read < 8 {
            return Ok(None);
        }
        let new = new.to_string();
        self.prefix = self.read;
        self.read = self.ids.len();
        if self.prefix > 256 {
            self.ids.drain(..self.prefix);
            self.read -= self.prefix;
            self.prefix = 0;
        }
        Ok(Some(new))
    }

    /// Whatever is held back (an incomplete character comes out as U+FFFD).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<Option<String>, TokenizerError> {
        if self.read >= self.ids.len() {
            return Ok(None);
        }
        let prev = tok.decode_piece(&self.ids[self.prefix..self.read], self.skip_special)?;
        let full = tok.decode_piece(&self.ids[self.prefix..], self.skip_special)?;
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(full
            .strip_prefix(prev.as_str())
            .filter(|s| !s.is_empty())
            .map(str::to_string))
    }

    /// Forget everything (a new text).
    pub fn reset(&mut self) {
        self.ids.clear();
        self.prefix = 0;
        self.read = 0;
    }
}
