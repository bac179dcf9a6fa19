//! The built-in default model: a small Qwen3-MoE-shaped GGUF with random (seeded) weights that
//! sluice writes into the user's cache directory on first use, so `sluice run` works with no
//! download. Its text is noise; it exists to exercise the whole path (GGUF reading, tokenizer,
//! routing, experts, sampling) on any machine.
//!
//! Invariant: the file is a pure function of `VERSION` — same bytes on every machine.

use crate::dtype::DType;
use crate::format::{FormatError, GgufWriter, MetaValue};
use crate::kernels::quantize::quantize;
use std::path::PathBuf;

/// Bump when the model's contents change, so stale caches are not reused.
const VERSION: u32 = 1;

const HIDDEN: usize = 256;
const LAYERS: usize = 4;
const HEADS: usize = 8;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 32;
const EXPERTS: usize = 16;
const EXPERTS_USED: usize = 4;
const EXPERT_FFN: usize = 256;
const CTX: usize = 4096;

/// The cache directory: `$SLUICE_CACHE_DIR`, else `$XDG_CACHE_HOME/sluice`, else `~/.cache/sluice`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SLUICE_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("sluice");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".cache").join("sluice"),
        None => std::env::temp_dir().join("sluice-cache"),
    }
}

/// Path of the default model, writing it first if it is not there.
pub fn ensure() -> Result<PathBuf, FormatError> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let dir = cache_dir();
    let path = dir.join(format!("default-moe-v{VERSION}.gguf"));
    if path.is_file() {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).map_err(|e| FormatError::Io { path: dir.clone(), op: "create directory", err: e })?;
    // Another process may be writing it too: write under our own name, then rename into place.
    let mine = dir.join(format!("default-moe-v{VERSION}.{}.gguf", std::process::id()));
    write(&mine)?;
    std::fs::rename(&mine, &path).map_err(|e| FormatError::Io { path: path.clone(), op: "rename", err: e })?;
    Ok(path)
}

/// SplitMix64: a tiny deterministic generator (weights must not depend on a crate's version).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-a, a).
    fn uniform(&mut self, a: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * u - 1.0) * a
    }
}

/// GPT-2's byte -> printable character map (byte-level BPE vocabularies spell bytes this way).
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
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

/// A byte-level vocabulary: the 256 bytes, merges of common English pairs, and ChatML specials.
fn vocabulary() -> (Vec<String>, Vec<String>, Vec<i32>) {
    let bc = byte_chars();
    let mut tokens: Vec<String> = bc.iter().map(|c| c.to_string()).collect();
    let mut merges = Vec::new();
    let sp = bc[b' ' as usize];
    // Merge pairs in order; each result is a new token (only pairs of existing tokens).
    let words = ["th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te", "of", "ed", "is", "it", "al", "ar"];
    for w in words {
        let (a, b) = w.split_at(1);
        merges.push(format!("{a} {b}"));
        tokens.push(w.to_string());
    }
    for w in ["t", "a", "o", "s", "w", "i", "c", "b", "f", "m"] {
        merges.push(format!("{sp} {w}"));
        tokens.push(format!("{sp}{w}"));
    }
    let mut types = vec![1i32; tokens.len()];
    for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] {
        tokens.push(s.to_string());
        types.push(3); // control
    }
    (tokens, merges, types)
}

const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn write(path: &std::path::Path) -> Result<(), FormatError> {
    let (tokens, merges, types) = vocabulary();
    let vocab = tokens.len();
    let eos = vocab as u32 - 1; // <|im_end|>
    let mut w = GgufWriter::new(path)?;
    let s = |v: &str| MetaValue::String(v.to_string());
    let u = |v: usize| MetaValue::U32(v as u32);
    let arch = "qwen3moe";
    let meta: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), s(arch)),
        ("general.name".into(), s("sluice default tiny MoE (random weights)")),
        (format!("{arch}.context_length"), u(CTX)),
        (format!("{arch}.embedding_length"), u(HIDDEN)),
        (format!("{arch}.block_count"), u(LAYERS)),
        (format!("{arch}.feed_forward_length"), u(EXPERT_FFN)),
        (format!("{arch}.expert_feed_forward_length"), u(EXPERT_FFN)),
        (format!("{arch}.attention.head_count"), u(HEADS)),
        (format!("{arch}.attention.head_count_kv"), u(KV_HEADS)),
        (format!("{arch}.attention.key_length"), u(HEAD_DIM)),
        (format!("{arch}.attention.value_length"), u(HEAD_DIM)),
        (format!("{arch}.rope.freq_base"), MetaValue::F32(1_000_000.0)),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), MetaValue::F32(1e-6)),
        (format!("{arch}.expert_count"), u(EXPERTS)),
        (format!("{arch}.expert_used_count"), u(EXPERTS_USED)),
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s("qwen2")),
        ("tokenizer.ggml.tokens".into(), MetaValue::Array(tokens.iter().map(|t| s(t)).collect())),
        ("tokenizer.ggml.token_type".into(), MetaValue::Array(types.iter().map(|t| MetaValue::I32(*t)).collect())),
        ("tokenizer.ggml.merges".into(), MetaValue::Array(merges.iter().map(|m| s(m)).collect())),
        ("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(eos)),
        ("tokenizer.ggml.padding_token_id".into(), MetaValue::U32(vocab as u32 - 3)),
        ("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(false)),
        ("tokenizer.chat_template".into(), s(CHAT_TEMPLATE)),
    ];
    for (k, v) in meta {
        w.add_meta(&k, v)?;
    }

    // (name, type, shape outermost-first, init scale); norms are ones.
    let (h, qd, kvd, f, e) = (HIDDEN, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, EXPERT_FFN, EXPERTS);
    let mut plan: Vec<(String, DType, Vec<u64>, f32)> = vec![("token_embd.weight".into(), DType::Q8_0, vec![vocab as u64, h as u64], 1.0)];
    for l in 0..LAYERS {
        let b = |n: &str| format!("blk.{l}.{n}.weight");
        let fan = |n: usize| 1.0 / (n as f32).sqrt() * 1.7;
        plan.push((b("attn_norm"), DType::F32, vec![h as u64], 0.0));
        plan.push((b("attn_q"), DType::Q8_0, vec![qd as u64, h as u64], fan(h)));
        plan.push((b("attn_k"), DType::Q8_0, vec![kvd as u64, h as u64], fan(h)));
        plan.push((b("attn_v"), DType::Q8_0, vec![kvd as u64, h as u64], fan(h)));
        plan.push((b("attn_output"), DType::Q8_0, vec![h as u64, qd as u64], fan(qd)));
        plan.push((b("attn_q_norm"), DType::F32, vec![HEAD_DIM as u64], 0.0));
        plan.push((b("attn_k_norm"), DType::F32, vec![HEAD_DIM as u64], 0.0));
        plan.push((b("ffn_norm"), DType::F32, vec![h as u64], 0.0));
        plan.push((b("ffn_gate_inp"), DType::F32, vec![e as u64, h as u64], 4.0 * fan(h)));
        plan.push((b("ffn_gate_exps"), DType::Q8_0, vec![e as u64, f as u64, h as u64], fan(h)));
        plan.push((b("ffn_up_exps"), DType::Q8_0, vec![e as u64, f as u64, h as u64], fan(h)));
        plan.push((b("ffn_down_exps"), DType::Q8_0, vec![e as u64, h as u64, f as u64], fan(f)));
    }
    plan.push(("output_norm.weight".into(), DType::F32, vec![h as u64], 0.0));
    plan.push(("output.weight".into(), DType::Q8_0, vec![vocab as u64, h as u64], 1.0 / (h as f32).sqrt()));
    for (name, dt, shape, _) in &plan {
        w.add_tensor_info(name, *dt, shape)?;
    }
    let mut rng = Rng(0x5EED_0000 + VERSION as u64);
    let mut buf = Vec::new();
    for (name, dt, shape, scale) in &plan {
        let n: u64 = shape.iter().product();
        let x: Vec<f32> = (0..n).map(|_| if *scale == 0.0 { 1.0 } else { rng.uniform(*scale) }).collect();
        buf.clear();
        quantize(*dt, &x, &mut buf).map_err(|err| FormatError::Writer { path: path.to_path_buf(), msg: format!("{name}: {err}") })?;
        w.write_tensor_data(&buf)?;
    }
    w.finish()?;
    Ok(())
}
