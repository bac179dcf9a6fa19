//! GGUF-embedded vocabularies against llama.cpp's own tokenizer test cases: for each
//! `vendor-data/vocab/ggml-vocab-NAME.gguf`, every string of `.gguf.inp` must encode to the ids
//! of `.gguf.out` (produced by the model's Hugging Face tokenizer, see llama.cpp's
//! tests/test-tokenizer-0.py), decode back, and stream-decode to the same text.
//! Needs `scripts/fetch-test-data.sh` (fails, naming it, when the data is missing).

use std::path::{Path, PathBuf};

use sluice::format::ModelFiles;
use sluice::tokenizer::{StreamDecoder, Tokenizer};

fn vocab_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("vendor-data/vocab");
    assert!(
        dir.join("ggml-vocab-qwen2.gguf").is_file(),
        "{} is missing: run scripts/fetch-test-data.sh first (it fetches llama.cpp's vocabulary test files)",
        dir.display()
    );
    dir
}

fn load(name: &str) -> Tokenizer {
    let path = vocab_dir().join(format!("ggml-vocab-{name}.gguf"));
    let files = ModelFiles::open(&path).unwrap_or_else(|e| panic!("{e}"));
    Tokenizer::from_gguf_meta(&|k| files.meta(k))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// llama.cpp's test format: inputs separated by "\n__ggml_vocab_test__\n", one line of ids each.
fn cases(name: &str) -> Vec<(String, Vec<u32>)> {
    let dir = vocab_dir();
    let inp = std::fs::read_to_string(dir.join(format!("ggml-vocab-{name}.gguf.inp"))).unwrap();
    let out = std::fs::read_to_string(dir.join(format!("ggml-vocab-{name}.gguf.out"))).unwrap();
    let sep = "\n__ggml_vocab_test__\n";
    let mut texts: Vec<String> = inp.split(sep).map(str::to_string).collect();
    // The file ends with a separator: the last split is empty.
    if texts.last().is_some_and(|t| t.is_empty()) {
        texts.pop();
    }
    let ids: Vec<Vec<u32>> = out
        .lines()
        .map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect())
        .collect();
    assert_eq!(
        texts.len(),
        ids.len(),
        "{name}: .inp and .out disagree on the number of cases"
    );
    texts.into_iter().zip(ids).collect()
}

struct Report {
    encode_ok: usize,
    decode_ok: usize,
    total: usize,
    failures: Vec<String>,
}

fn check(name: &str) -> Report {
    let tok = load(name);
    let cases = cases(name);
    let mut r = Report {
        encode_ok: 0,
        decode_ok: 0,
        total: cases.len(),
        failures: Vec::new(),
    };
    for (text, want) in &cases {
        let got = tok.encode_literal(text, false).unwrap();
        if &got == want {
            r.encode_ok += 1;
        } else {
            r.failures
                .push(format!("encode {text:?}: got {got:?}, want {want:?}"));
        }
        // Decoding the reference ids gives the text back.
        let back = tok.decode(want, false).unwrap();
        if &back == text {
            r.decode_ok += 1;
        } else {
            r.failures
                .push(format!("decode {want:?}: got {back:?}, want {text:?}"));
        }
        // Streaming one id at a time gives the same text as decoding all at once.
        let mut dec = StreamDecoder::new();
        let mut streamed = String::new();
        for &id in want {
            if let Some(s) = dec.push(&tok, id).unwrap() {
                streamed.push_str(&s);
            }
        }
        if let Some(s) = dec.flush(&tok).unwrap() {
            streamed.push_str(&s);
        }
        let whole = tok.decode_piece(want, true).unwrap();
        assert_eq!(streamed, whole, "{name}: streamed decode of {want:?}");
    }
    r
}

fn run(name: &str) {
    let r = check(name);
    eprintln!(
        "{name}: encode {}/{} decode {}/{}",
        r.encode_ok, r.total, r.decode_ok, r.total
    );
    for f in &r.failures {
        eprintln!("  {f}");
    }
    assert!(
        r.failures.is_empty(),
        "{name}: {} mismatches with llama.cpp's expected ids/text",
        r.failures.len()
    );
}

#[test]
fn qwen2() {
    run("qwen2");
}

#[test]
fn qwen35() {
    run("qwen35");
}

#[test]
fn llama_bpe() {
    run("llama-bpe");
}

#[test]
fn deepseek_llm() {
    run("deepseek-llm");
}

#[test]
fn deepseek_coder() {
    run("deepseek-coder");
}

#[test]
fn gpt_2() {
    run("gpt-2");
}

#[test]
fn llama_spm() {
    run("llama-spm");
}

#[test]
fn phi_3() {
    run("phi-3");
}

#[test]
fn falcon() {
    run("falcon");
}

#[test]
fn starcoder() {
    run("starcoder");
}

#[test]
fn refact() {
    run("refact");
}

#[test]
fn mpt() {
    run("mpt");
}

#[test]
fn command_r() {
    run("command-r");
}

#[test]
fn special_tokens_in_text() {
    let tok = load("qwen2");
    let (start, end) = (
        tok.token_to_id("<|im_start|>").unwrap(),
        tok.token_to_id("<|im_end|>").unwrap(),
    );
    assert_eq!((start, end), (151644, 151645));
    let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
    let mut want = vec![start];
    want.extend(tok.encode_literal("user\nhi", false).unwrap());
    want.push(end);
    assert_eq!(ids, want);
    assert_eq!(
        tok.decode(&ids, false).unwrap(),
        "<|im_start|>user\nhi<|im_end|>"
    );
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi");
    let mut dec = StreamDecoder::new();
    let mut streamed = String::new();
    for &id in ids.iter().chain(&ids) {
        streamed.push_str(&dec.push(&tok, id).unwrap().unwrap_or_default());
    }
    streamed.push_str(&dec.flush(&tok).unwrap().unwrap_or_default());
    assert_eq!(streamed, "user\nhiuser\nhi");
    let mut dec = StreamDecoder::with_special();
    let mut streamed = String::new();
    for &id in &ids {
        streamed.push_str(&dec.push(&tok, id).unwrap().unwrap_or_default());
    }
    assert_eq!(streamed, "<|im_start|>user\nhi<|im_end|>");
    // Literal encoding keeps control tokens as text, and it decodes back to the same text.
    let lit = tok.encode_literal("<|im_start|>", false).unwrap();
    assert!(!lit.contains(&start) && lit.len() > 1, "{lit:?}");
    assert_eq!(tok.decode(&lit, false).unwrap(), "<|im_start|>");
    // End of generation: <|endoftext|> (eos) and <|im_end|> (by its text, as llama.cpp does).
    assert!(
        tok.eos_ids().contains(&151643) && tok.eos_ids().contains(&151645),
        "{:?}",
        tok.eos_ids()
    );
    assert_eq!(tok.eos_token(), Some("<|endoftext|>"));
    // Qwen2 adds no bos.
    assert_eq!(
        tok.encode("hi", true).unwrap(),
        tok.encode("hi", false).unwrap()
    );
    assert!(matches!(
        tok.decode(&[tok.vocab_size() as u32], false),
        Err(sluice::tokenizer::TokenizerError::TokenId { .. })
    ));
}

#[test]
fn llama3_adds_bos() {
    let tok = load("llama-bpe");
    assert_eq!(tok.bos_id(), Some(128000));
    assert_eq!(tok.bos_token(), Some("<|begin_of_text|>"));
    let ids = tok.encode("Hello", true).unwrap();
    assert_eq!(ids[0], 128000);
    assert_eq!(&ids[1..], tok.encode("Hello", false).unwrap().as_slice());
    // "<|eot_id|>" ends generation although the file only names <|end_of_text|> as eos.
    let eot = tok.token_to_id("<|eot_id|>").unwrap();
    assert!(tok.eos_ids().contains(&eot) && tok.eos_ids().contains(&128001));
}

#[test]
fn sentencepiece_bos_and_space_prefix() {
    let tok = load("llama-spm");
    let ids = tok.encode("Hello world", true).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(tok.decode(&ids, true).unwrap(), "Hello world");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<s> Hello world");
    // After a special token the text gets its space prefix again (llama.cpp's rule).
    let mut want = vec![2];
    want.extend(tok.encode_literal("Hello", false).unwrap());
    assert_eq!(tok.encode("</s>Hello", false).unwrap(), want);
    // A stream keeps the leading space of its first piece: it continues a prompt.
    let mut dec = StreamDecoder::new();
    let mut out = String::new();
    for &id in &ids[1..] {
        out.push_str(&dec.push(&tok, id).unwrap().unwrap_or_default());
    }
    out.push_str(&dec.flush(&tok).unwrap().unwrap_or_default());
    assert_eq!(out, " Hello world");
    // Bytes outside the vocabulary fall back to <0xNN> pieces and stream back whole.
    let text = "\u{1F999} 🦙";
    let ids = tok.encode_literal(text, false).unwrap();
    let mut dec = StreamDecoder::new();
    let mut pieces = Vec::new();
    for &id in &ids {
        pieces.extend(dec.push(&tok, id).unwrap());
    }
    pieces.extend(dec.flush(&tok).unwrap());
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
    assert_eq!(pieces.concat(), format!(" {text}"));
}

#[test]
fn bad_metadata_is_an_error_not_a_panic() {
    use sluice::format::MetaValue as M;
    use std::collections::HashMap;
    let s = |v: &str| M::String(v.to_string());
    let strs = |v: &[&str]| M::Array(v.iter().map(|x| s(x)).collect());
    let good = || -> HashMap<&'static str, M> {
        HashMap::from([
            ("tokenizer.ggml.model", s("gpt2")),
            ("tokenizer.ggml.pre", s("qwen2")),
            ("tokenizer.ggml.tokens", strs(&["a", "b", "ab", "<|end|>"])),
            (
                "tokenizer.ggml.token_type",
                M::Array(vec![M::I32(1), M::I32(1), M::I32(1), M::I32(3)]),
            ),
            ("tokenizer.ggml.merges", strs(&["a b"])),
            ("tokenizer.ggml.eos_token_id", M::U32(3)),
        ])
    };
    let load = |m: &HashMap<&'static str, M>| Tokenizer::from_gguf_meta(&|k| m.get(k));
    let tok = load(&good()).unwrap();
    assert_eq!(tok.encode("abab<|end|>", false).unwrap(), vec![2, 2, 3]);
    assert_eq!(tok.eos_ids(), &[3]);

    let cases: Vec<(&str, Option<M>, &str)> = vec![
        ("tokenizer.ggml.model", None, "tokenizer.ggml.model"),
        ("tokenizer.ggml.model", Some(s("bert")), "bert"),
        (
            "tokenizer.ggml.model",
            Some(M::U32(1)),
            "tokenizer.ggml.model",
        ),
        ("tokenizer.ggml.tokens", None, "tokenizer.ggml.tokens"),
        (
            "tokenizer.ggml.tokens",
            Some(M::Array(vec![])),
            "tokenizer.ggml.tokens",
        ),
        (
            "tokenizer.ggml.tokens",
            Some(M::Array(vec![M::U8(1)])),
            "tokenizer.ggml.tokens",
        ),
        (
            "tokenizer.ggml.token_type",
            Some(M::Array(vec![M::I32(1)])),
            "tokenizer.ggml.token_type",
        ),
        ("tokenizer.ggml.merges", None, "tokenizer.ggml.merges"),
        (
            "tokenizer.ggml.merges",
            Some(strs(&["ab"])),
            "tokenizer.ggml.merges",
        ),
        ("tokenizer.ggml.pre", Some(s("no-such-pre")), "no-such-pre"),
        (
            "tokenizer.ggml.eos_token_id",
            Some(M::U32(99)),
            "tokenizer.ggml.eos_token_id",
        ),
        (
            "tokenizer.ggml.bos_token_id",
            Some(s("x")),
            "tokenizer.ggml.bos_token_id",
        ),
        (
            "tokenizer.ggml.add_bos_token",
            Some(M::Bool(true)),
            "add_bos_token",
        ),
        (
            "tokenizer.chat_template",
            Some(M::U32(0)),
            "tokenizer.chat_template",
        ),
    ];
    for (key, value, needle) in cases {
        let mut m = good();
        match value {
            Some(v) => m.insert(key, v),
            None => m.remove(key),
        };
        let e = load(&m).unwrap_err().to_string();
        assert!(e.contains(needle), "{key}: {e}");
    }
    // A merge whose pieces are not in the vocabulary can never apply: skipped, not fatal.
    let mut m = good();
    m.insert("tokenizer.ggml.merges", strs(&["a b", "x y"]));
    assert_eq!(load(&m).unwrap().encode("ab", false).unwrap(), vec![2]);
    // Ids out of range are errors when decoding and streaming.
    let mut dec = StreamDecoder::new();
    assert!(dec.push(&tok, 4).is_err());
    assert!(tok.decode(&[0, 7], false).is_err());
}

/// gpt-oss's harmony vocabulary: `<|end|>` closes a message, not the reply (the analysis message
/// ends `<|end|>` and the final one follows), so only `<|return|>`, `<|call|>` (and
/// `<|endoftext|>`) end generation, as in llama.cpp's vocabulary loader and in the
/// `eos_token_id` list of gpt-oss's generation_config.json (tests/fixtures/models/gpt_oss:
/// `<|return|>`, `<|call|>`). A vocabulary with `<|end|>` but no `<|call|>` (Phi-3's) keeps it.
#[test]
fn harmony_end_does_not_stop_generation() {
    use sluice::format::MetaValue as M;
    use std::collections::HashMap;
    let s = |v: &str| M::String(v.to_string());
    let meta = |toks: &[&str], eos: u32| -> HashMap<&'static str, M> {
        let mut types = vec![M::I32(1); 3];
        types.extend(toks[3..].iter().map(|_| M::I32(3)));
        HashMap::from([
            ("tokenizer.ggml.model", s("gpt2")),
            ("tokenizer.ggml.pre", s("gpt-4o")),
            (
                "tokenizer.ggml.tokens",
                M::Array(toks.iter().map(|x| s(x)).collect()),
            ),
            ("tokenizer.ggml.token_type", M::Array(types)),
            ("tokenizer.ggml.merges", M::Array(vec![s("a b")])),
            ("tokenizer.ggml.eos_token_id", M::U32(eos)),
        ])
    };
    let load = |m: &HashMap<&'static str, M>| Tokenizer::from_gguf_meta(&|k| m.get(k)).unwrap();
    let harmony = [
        "a",
        "b",
        "ab",
        "<|endoftext|>",
        "<|return|>",
        "<|channel|>",
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|call|>",
    ];
    let tok = load(&meta(&harmony, 4));
    assert_eq!(
        tok.eos_ids(),
        &[3, 4, 9],
        "<|endoftext|>, <|return|>, <|call|>"
    );
    let phi3 = ["a", "b", "ab", "<|endoftext|>", "<|end|>"];
    let tok = load(&meta(&phi3, 3));
    assert_eq!(tok.eos_ids(), &[3, 4], "<|endoftext|> and <|end|>");
}
