//! `tokenizer.json` tokenizers against the Python `tokenizers` package: two small real BPE
//! tokenizers (byte-level Qwen2-style, SentencePiece-style with byte fallback) and the ids and
//! strings Python produced for awkward texts, made by scripts/make_tokenizer_fixtures.py.

use std::path::{Path, PathBuf};

use serde_json::Value;
use sluice::tokenizer::{StreamDecoder, Tokenizer};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
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

fn check(name: &str) -> Tokenizer {
    let all: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("cases.json")).unwrap())
            .unwrap();
    let rec = &all["tokenizers"][name];
    let tok = Tokenizer::from_file(&fixtures().join(name).join("tokenizer.json")).unwrap();
    assert_eq!(
        tok.vocab_size() as u64,
        rec["vocab_size"].as_u64().unwrap(),
        "{name}: vocab size"
    );
    let cases = rec["cases"].as_array().unwrap();
    let mut failures = Vec::new();
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        let checks = [
            ("encode", tok.encode(text, false).unwrap(), want.clone()),
            (
                "encode add_special",
                tok.encode(text, true).unwrap(),
                ids(&c["ids_add_special"]),
            ),
            (
                "encode_literal",
                tok.encode_literal(text, false).unwrap(),
                ids(&c["ids_literal"]),
            ),
        ];
        for (what, got, want) in checks {
            if got != want {
                failures.push(format!("{what} {text:?}: got {got:?}, want {want:?}"));
            }
        }
        let decoded = tok.decode(&want, false).unwrap();
        if decoded != c["decoded"].as_str().unwrap() {
            failures.push(format!(
                "decode {want:?}: got {decoded:?}, want {:?}",
                c["decoded"]
            ));
        }
        let skip = c["decoded_skip_special"].as_str().unwrap();
        let decoded = tok.decode(&want, true).unwrap();
        if decoded != skip {
            failures.push(format!(
                "decode skip_special {want:?}: got {decoded:?}, want {skip:?}"
            ));
        }
        // Streaming equals decoding the whole, except that a stream never drops the leading
        // space a SentencePiece decoder strips at the start of a text.
        let streamed = stream(&tok, &want);
        assert_eq!(
            streamed,
            tok.decode_piece(&want, true).unwrap(),
            "{name}: stream of {text:?}"
        );
        let unstripped = if name == "spm" {
            streamed.strip_prefix(' ').unwrap_or(&streamed)
        } else {
            &streamed
        };
        if unstripped != skip {
            failures.push(format!(
                "stream {text:?}: got {streamed:?}, want {skip:?} (+ leading space)"
            ));
        }
    }
    eprintln!(
        "{name}: {} cases, {} mismatches",
        cases.len(),
        failures.len()
    );
    for f in &failures {
        eprintln!("  {f}");
    }
    assert!(
        failures.is_empty(),
        "{name}: {} mismatches with the Python tokenizers package",
        failures.len()
    );
    tok
}

#[test]
fn byte_level_matches_python() {
    let tok = check("bytelevel");
    let end = tok.token_to_id("<|im_end|>").unwrap();
    let eot = tok.token_to_id("<|endoftext|>").unwrap();
    assert_eq!(tok.bos_id(), None);
    assert!(!tok.add_bos());
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    let mut want = vec![end, eot];
    want.sort();
    assert_eq!(
        tok.eos_ids(),
        want.as_slice(),
        "eos from tokenizer_config.json + generation_config.json"
    );
}

#[test]
fn sentencepiece_matches_python() {
    let tok = check("spm");
    assert_eq!(tok.bos_id(), Some(1));
    assert!(tok.add_bos());
    assert_eq!(tok.bos_token(), Some("<s>"));
    assert_eq!(tok.eos_ids(), &[2]);
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn send_sync<T: Send + Sync + Clone>() {}
    send_sync::<Tokenizer>();
}

#[test]
fn missing_or_bad_files_are_errors() {
    let dir = std::env::temp_dir().join(format!("sluice-tok-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let e = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap_err();
    assert!(e.to_string().contains("tokenizer.json"), "{e}");
    std::fs::write(dir.join("tokenizer.json"), "{ not json").unwrap();
    let e = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap_err();
    assert!(e.to_string().contains("tokenizer.json"), "{e}");
    std::fs::copy(
        fixtures().join("bytelevel/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), "[1, 2").unwrap();
    let e = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap_err();
    assert!(e.to_string().contains("tokenizer_config.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
