//! Kimi-K2's tokenizer (`tokenizer.ggml.pre` = `kimi-k2`) against tiktoken, the library
//! Moonshot's tokenization_kimi.py runs (a reference nobody here wrote): the fixture
//! (scripts/make_kimi_fixture.py) is a byte-level BPE rank table under Kimi-K2's exact split
//! pattern, the ids tiktoken 0.14 gives for strings that exercise each alternative (camelCase
//! and ALLCAPS runs, contractions in any case, Han runs beside other scripts, digits in threes,
//! newlines and trailing spaces, emoji), and the same vocabulary written as a GGUF the way
//! llama.cpp's converter writes a Kimi-K2 model's (merges recovered from the ranks).

use sluice::format::ModelFiles;
use sluice::tokenizer::Tokenizer;
use std::path::Path;

#[test]
fn kimi_k2_encodes_as_tiktoken() {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/kimi");
    let files = ModelFiles::open(&d.join("kimi-k2-vocab.gguf")).unwrap();
    let tok = Tokenizer::from_gguf_meta(&|k| files.meta(k)).unwrap();
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("cases.json")).unwrap()).unwrap();
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want: Vec<u32> = c["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tok.encode(text, false).unwrap();
        assert_eq!(got, want, "{text:?}");
        assert_eq!(tok.decode(&got, false).unwrap(), text, "{text:?}");
    }
}
