//! Each model family's tokenizer and chat template, from both sources sluice reads, against the
//! references in tests/fixtures/models/<family>/tokenizer_cases.json (made by
//! scripts/make_model_fixtures.py): encodings and decodings by the Python `tokenizers` package
//! for varied text (unicode, emoji, whitespace runs, special tokens), and transformers'
//! `apply_chat_template(tokenize=False)` renderings with their ids.
//!
//! Sources: the folder's `tokenizer.json` + `tokenizer_config.json`, and the vocabulary and
//! template llama.cpp's converter embedded in `model-f32.gguf` (byte-level BPE with the
//! `qwen2` pre-tokenizer, `tokenizer.chat_template`, bos/eos and `add_bos_token`).

use serde_json::Value;
use sluice::chat::render_chat_json_at;
use sluice::format::ModelFiles;
use sluice::tokenizer::{StreamDecoder, Tokenizer};
use std::path::{Path, PathBuf};

const FAMILIES: &[&str] = &["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe"];
/// Families whose fixture has no GGUF beside its tokenizer.json (scripts/make_family_fixtures.py).
const JSON_ONLY: &[&str] = &["gpt_oss"];

fn dir(f: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(f)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn stream(tok: &Tokenizer, ids: &[u32]) -> String {
    let mut dec = StreamDecoder::new();
    let mut out = String::new();
    for &id in ids {
        if let Some(s) = dec.push(tok, id).unwrap() {
            out.push_str(&s);
        }
    }
    if let Some(s) = dec.flush(tok).unwrap() {
        out.push_str(&s);
    }
    out
}

/// Every mismatch of `tok` against the family's references, as readable lines.
fn mismatches(family: &str, source: &str, tok: &Tokenizer) -> Vec<String> {
    let path = dir(family).join("tokenizer_cases.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut bad = Vec::new();
    let mut fail = |what: String| bad.push(format!("{family} {source}: {what}"));
    for (name, id) in doc["special_tokens"].as_object().unwrap() {
        if tok.token_to_id(name) != id.as_u64().map(|x| x as u32) {
            fail(format!("special token {name:?} is not id {id}"));
        }
    }
    for c in doc["encode"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let with = ids(&c["ids_add_special"]);
        let without = ids(&c["ids_no_special"]);
        let got = tok.encode(text, true).unwrap();
        if got != with {
            fail(format!(
                "encode {text:?} with specials: {got:?} != {with:?}"
            ));
        }
        let got = tok.encode(text, false).unwrap();
        if got != without {
            fail(format!("encode {text:?}: {got:?} != {without:?}"));
        }
        let skip = c["decode_skip_special"].as_str().unwrap();
        let keep = c["decode_keep_special"].as_str().unwrap();
        let got = tok.decode(&with, true).unwrap();
        if got != skip {
            fail(format!(
                "decode (skip specials) {with:?}: {got:?} != {skip:?}"
            ));
        }
        let got = tok.decode(&with, false).unwrap();
        if got != keep {
            fail(format!(
                "decode (keep specials) {with:?}: {got:?} != {keep:?}"
            ));
        }
        // What `run` prints for generated ids (no leading BOS): the skip-specials decoding.
        let got = stream(tok, &without);
        let want = tok.decode(&without, true).unwrap();
        if got != want {
            fail(format!("stream decode {without:?}: {got:?} != {want:?}"));
        }
    }
    let template = tok.chat_template().expect("a chat template");
    let (bos, eos) = (tok.bos_token().unwrap_or(""), tok.eos_token().unwrap_or(""));
    for c in doc["chat"].as_array().unwrap() {
        let name = c["name"].as_str().unwrap();
        let messages = c["messages"].as_array().unwrap();
        let agp = c["add_generation_prompt"].as_bool().unwrap();
        let want = c["rendered"].as_str().unwrap();
        match render_chat_json_at(template, messages, agp, bos, eos, None, 0) {
            Ok(got) if got == want => {
                let got_ids = tok.encode(&got, false).unwrap();
                let want_ids = ids(&c["ids_no_special"]);
                if got_ids != want_ids {
                    fail(format!("chat {name}: ids {got_ids:?} != {want_ids:?}"));
                }
            }
            Ok(got) => fail(format!("chat {name}: rendered {got:?} != {want:?}")),
            Err(e) => fail(format!("chat {name}: {e}")),
        }
    }
    bad
}

#[test]
fn tokenizer_json_matches_python_and_transformers() {
    let mut bad = Vec::new();
    for f in FAMILIES.iter().chain(JSON_ONLY) {
        let tok = Tokenizer::from_file(&dir(f).join("tokenizer.json")).unwrap();
        bad.extend(mismatches(f, "tokenizer.json", &tok));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn gguf_vocabulary_matches_python_and_transformers() {
    let mut bad = Vec::new();
    for f in FAMILIES {
        let files = ModelFiles::open(&dir(f).join("model-f32.gguf")).unwrap();
        let tok = Tokenizer::from_gguf_meta(&|k| files.meta(k)).unwrap();
        bad.extend(mismatches(f, "gguf", &tok));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
