//! Pre-tokenizer table for GGUF byte-level BPE vocabularies: `tokenizer.ggml.pre` -> the regex
//! splits that the model's own `tokenizer.json` applies before BPE.
//!
//! Owns: the data only (names, regexes, flags). Each regex becomes one `Split` step with the
//! `Isolated` behaviour, applied in order to the pieces the previous step produced; this is how
//! both llama.cpp (`llm_tokenizer_bpe`) and the Hugging Face `tokenizers` package run them.
//! Where llama.cpp rewrote a regex for its own engine (`(?i:...)` spelled out as `[sS]`), the
//! original `tokenizer.json` spelling is kept here, since our engine is the same kind as the
//! reference (`tokenizers` with a backtracking regex).
//! Invariant: a name that is not in the table is an error, never a silent default.

/// How one `tokenizer.ggml.pre` value pre-tokenizes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PreTok {
    /// The regexes, applied in order (each an `Isolated` split).
    pub regexes: &'static [&'static str],
    /// A word that is itself in the vocabulary is emitted whole, without merges
    /// (`ignore_merges` in `tokenizer.json`; llama.cpp sets it for the same names).
    pub ignore_merges: bool,
    /// Unicode NFC normalization before splitting (Qwen2's `tokenizer.json` has it; Qwen3.5's
    /// does not).
    pub nfc: bool,
}

// The GPT-2 split, as the `ByteLevel` pre-tokenizer of `tokenizers` writes it.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
// Kimi-K2's tiktoken `pat_str` (tokenization_kimi.py): GPT-4o's letter runs without Han
// characters (class intersection), Han runs on their own. llama.cpp runs a hand-written
// splitter for it that keeps camelCase words whole; this is Moonshot's own pattern, which the
// regex engine here (like tiktoken's) runs as written.
const KIMI_K2: &str = r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const BAILING: &str = r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";
const SEED_CODER: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";
// The letter class of DeepSeek LLM's `tokenizer.json`. Six code points are written as escapes:
// they have canonical singleton decompositions (U+1F7D, U+1FBE, U+1FD3, U+1FDB, OHM SIGN, KELVIN
// SIGN), so any NFC-normalizing editor would silently turn them into other letters.
const DEEPSEEK_LLM: &[&str] = &[
    r"[\r\n]",
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\x{1F7D}ᾀ-ᾴᾶ-ᾼ\x{1FBE}ῂ-ῄῆ-ῌῐ-\x{1FD3}ῖ-\x{1FDB}ῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\x{2126}ℨ\x{212A}-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
];
const DEEPSEEK_CODER: &[&str] = &[
    r"[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}",
];
const DEEPSEEK_V3: &[&str] = &[
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];
const FALCON: &[&str] = &[
    r"[\p{P}\$\+<=>\^~\|`]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"[0-9][0-9][0-9]",
];
const STARCODER: &[&str] = &[
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
];
/// llama.cpp's fallback for a BPE vocabulary whose `tokenizer.ggml.pre` is `default` or absent.
const DEFAULT: &[&str] = &[
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
];

const fn p(regexes: &'static [&'static str]) -> PreTok {
    PreTok {
        regexes,
        ignore_merges: false,
        nfc: false,
    }
}

/// The pre-tokenizer for a `tokenizer.ggml.pre` value (None: a name sluice does not know).
/// `""` (key absent) is llama.cpp's `default`.
pub(crate) fn lookup(name: &str) -> Option<PreTok> {
    let t = match name {
        "" | "default" => p(DEFAULT),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" => PreTok {
            ignore_merges: true,
            ..p(&[LLAMA3])
        },
        "dbrx" | "smaug-bpe" | "chatglm-bpe" => p(&[LLAMA3]),
        "glm4" | "glm5" => PreTok {
            ignore_merges: true,
            ..p(&[LLAMA3])
        },
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "stablelm2" | "hunyuan" | "megrez"
        | "solar-open" | "grok-2" => PreTok {
            nfc: matches!(name, "qwen2" | "deepseek-r1-qwen"),
            ..p(&[QWEN2])
        },
        "qwen35" => p(&[QWEN35]),
        "deepseek-llm" => p(DEEPSEEK_LLM),
        "deepseek-coder" => p(DEEPSEEK_CODER),
        "deepseek-v3" | "hunyuan-dense" | "joyai-llm" | "hy_v4" => p(DEEPSEEK_V3),
        "falcon" => p(FALCON),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b"
        | "mellum2" => p(STARCODER),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe"
        | "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" | "exaone4" => p(&[GPT2]),
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => p(&[GPT4O]),
        // tiktoken emits a piece that is itself a token whole (no merges), as `ignore_merges`.
        "kimi-k2" => PreTok {
            ignore_merges: true,
            ..p(&[KIMI_K2])
        },
        "tekken" => PreTok {
            ignore_merges: true,
            ..p(&[TEKKEN])
        },
        "bailingmoe" | "bailingmoe2" | "llada-moe" => p(&[BAILING]),
        "seed-coder" => p(&[SEED_CODER]),
        _ => return None,
    };
    Some(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::SplitDelimiterBehavior;

    #[test]
    fn every_regex_compiles() {
        for name in [
            "default",
            "llama-bpe",
            "qwen2",
            "qwen35",
            "deepseek-llm",
            "deepseek-coder",
            "deepseek-v3",
            "falcon",
            "starcoder",
            "gpt-2",
            "gpt-4o",
            "tekken",
            "bailingmoe",
            "seed-coder",
            "glm4",
            "kimi-k2",
        ] {
            let t = lookup(name).unwrap();
            for r in t.regexes {
                let split = Split::new(
                    SplitPattern::Regex(r.to_string()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                );
                assert!(split.is_ok(), "{name}: {r}");
            }
        }
        assert!(lookup("no-such-pre").is_none());
    }

    /// Every table entry splits texts exactly as the Python `tokenizers` package (Oniguruma)
    /// does with the same regexes (tests/fixtures/tokenizer/pretok_splits.json, made by
    /// scripts/make_tokenizer_fixtures.py): our regex engine is fancy-regex, the reference's is
    /// not, and `\p{..}` classes, look-arounds and `(?i:)` must behave the same.
    #[test]
    fn splits_match_python_tokenizers() {
        use tokenizers::pre_tokenizers::sequence::Sequence;
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizer/pretok_splits.json");
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let mut checked = 0;
        for (name, cases) in doc["pre"].as_object().unwrap() {
            let t = lookup(name).unwrap_or_else(|| panic!("{name} is not in the table"));
            let steps = t
                .regexes
                .iter()
                .map(|r| {
                    Split::new(
                        SplitPattern::Regex(r.to_string()),
                        SplitDelimiterBehavior::Isolated,
                        false,
                    )
                    .unwrap()
                    .into()
                })
                .collect();
            let seq = Sequence::new(steps);
            for c in cases.as_array().unwrap() {
                let text = c["text"].as_str().unwrap();
                let mut pts = PreTokenizedString::from(text);
                seq.pre_tokenize(&mut pts).unwrap();
                let got: Vec<&str> = pts
                    .get_splits(OffsetReferential::Original, OffsetType::Char)
                    .into_iter()
                    .map(|s| s.0)
                    .collect();
                let want: Vec<&str> = c["splits"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap())
                    .collect();
                assert_eq!(got, want, "{name}: {text:?}");
                checked += 1;
            }
        }
        assert!(checked > 500);
    }
}
