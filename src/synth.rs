//! Synthetic models: GGUFs with real shapes and seeded random weights, for the default model and
//! for performance work (no real model can be downloaded here).
//!
//! Owns: `MoeSpec` (a model's shape), presets with real models' dimensions, and a streaming
//! writer that never holds more than one tensor in memory.
//! Does not own: the GGUF byte layout (`format::GgufWriter`), quantizers (`kernels::quantize`).
//! Invariant: output is a pure function of the spec (seeded generator, fixed tensor order).

use crate::dtype::DType;
use crate::format::{FormatError, GgufWriter, MetaValue};
use crate::kernels::quantize::quantize;
use std::path::Path;

/// The shape of a Qwen3-MoE-style model.
#[derive(Clone, Debug)]
pub struct MoeSpec {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub experts: usize,
    pub experts_used: usize,
    pub expert_ffn: usize,
    /// Vocabulary size; 0 = just the built-in byte-level vocabulary. Larger sizes are padded
    /// with unused tokens so embeddings and lm_head have the real model's size.
    pub vocab: usize,
    pub ctx: usize,
    /// Type of the matrices (norms and router stay F32).
    pub dtype: DType,
    pub seed: u64,
    pub name: String,
    /// Router skew S: expert popularity roughly Zipf-like with exponent S (0 = uniform).
    /// How: every token embedding gets a constant +1 in dimension 0, so the normed hidden
    /// state keeps a positive component there; each router row gets a weight in column 0 that
    /// adds a logit bias of -S * ln(rank + 1) (rank = a seeded permutation per layer). The
    /// resulting popularity is measured, not promised: see `sluice cache-sim` / usage stats.
    pub skew: f32,
}

impl MoeSpec {
    /// Real models' dimensions, by preset name.
    pub fn preset(name: &str) -> Option<MoeSpec> {
        let base = |hidden, layers, heads, kv_heads, head_dim, experts, used, ffn, vocab| MoeSpec {
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim,
            experts,
            experts_used: used,
            expert_ffn: ffn,
            vocab,
            ctx: 40960,
            dtype: DType::Q8_0,
            seed: 1,
            name: format!("synthetic {name}"),
            skew: 0.0,
        };
        Some(match name {
            "qwen3-30b-a3b" => base(2048, 48, 32, 4, 128, 128, 8, 768, 151936),
            "qwen3-235b-a22b" => base(4096, 94, 64, 4, 128, 128, 8, 1536, 151936),
            _ => return None,
        })
    }

    pub const PRESETS: &'static [&'static str] = &["qwen3-30b-a3b", "qwen3-235b-a22b"];
}

/// FNV-1a of a name (to key per-tensor streams).
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// SplitMix64: a tiny deterministic generator (weights must not depend on a crate's version).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub(crate) fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [-a, a).
    fn uniform(&mut self, a: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * u - 1.0) * a
    }
}

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
const VOCAB_JSON: &str = include_str!("../assets/synth-vocab.json");

/// The embedded vocabulary, padded with `<|unused_N|>` tokens to `min_size`.
struct Vocab {
    tokens: Vec<String>,
    merges: Vec<String>,
    types: Vec<i32>,
    eos: u32,
    pad: u32,
}

fn vocabulary(min_size: usize, path: &Path) -> Result<Vocab, FormatError> {
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

const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Write a Qwen3-MoE GGUF (llama.cpp names and keys) with seeded random weights. `progress`
/// is called after each tensor with (bytes written, total bytes).
pub fn write_random_qwen3moe(
    path: &Path,
    spec: &MoeSpec,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(), FormatError> {
    let Vocab {
        tokens,
        merges,
        types,
        eos,
        pad,
    } = vocabulary(spec.vocab, path)?;
    let vocab = tokens.len();
    let bc = byte_chars();
    let printable: Vec<bool> = tokens
        .iter()
        .map(|t| {
            !t.starts_with("<|")
                && t.chars().all(|c| {
                    bc.iter()
                        .position(|b| *b == c)
                        .is_some_and(|b| (0x20..0x7f).contains(&b))
                })
        })
        .collect();
    let mut w = GgufWriter::new(path)?;
    let s = |v: &str| MetaValue::String(v.to_string());
    let u = |v: usize| MetaValue::U32(v as u32);
    let arch = "qwen3moe";
    let meta: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), s(arch)),
        ("general.name".into(), s(&spec.name)),
        (format!("{arch}.context_length"), u(spec.ctx)),
        (format!("{arch}.embedding_length"), u(spec.hidden)),
        (format!("{arch}.block_count"), u(spec.layers)),
        (format!("{arch}.feed_forward_length"), u(spec.expert_ffn)),
        (
            format!("{arch}.expert_feed_forward_length"),
            u(spec.expert_ffn),
        ),
        (format!("{arch}.attention.head_count"), u(spec.heads)),
        (format!("{arch}.attention.head_count_kv"), u(spec.kv_heads)),
        (format!("{arch}.attention.key_length"), u(spec.head_dim)),
        (format!("{arch}.attention.value_length"), u(spec.head_dim)),
        (
            format!("{arch}.rope.freq_base"),
            MetaValue::F32(1_000_000.0),
        ),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            MetaValue::F32(1e-6),
        ),
        (format!("{arch}.expert_count"), u(spec.experts)),
        (format!("{arch}.expert_used_count"), u(spec.experts_used)),
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s("qwen2")),
        (
            "tokenizer.ggml.tokens".into(),
            MetaValue::Array(tokens.iter().map(|t| s(t)).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            MetaValue::Array(types.iter().map(|t| MetaValue::I32(*t)).collect()),
        ),
        (
            "tokenizer.ggml.merges".into(),
            MetaValue::Array(merges.iter().map(|m| s(m)).collect()),
        ),
        ("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(eos)),
        (
            "tokenizer.ggml.padding_token_id".into(),
            MetaValue::U32(pad),
        ),
        (
            "tokenizer.ggml.add_bos_token".into(),
            MetaValue::Bool(false),
        ),
        ("tokenizer.chat_template".into(), s(CHAT_TEMPLATE)),
    ];
    for (k, v) in meta {
        w.add_meta(&k, v)?;
    }

    // (name, type, shape outermost-first, init scale); scale 0 = a norm (all ones).
    let (h, qd, kvd, f, e, dt) = (
        spec.hidden,
        spec.heads * spec.head_dim,
        spec.kv_heads * spec.head_dim,
        spec.expert_ffn,
        spec.experts,
        spec.dtype,
    );
    let fan = |n: usize| 1.7 / (n as f32).sqrt();
    let (hu, qu, ku, fu, eu, vu) = (
        h as u64,
        qd as u64,
        kvd as u64,
        f as u64,
        e as u64,
        vocab as u64,
    );
    let mut plan: Vec<(String, DType, Vec<u64>, f32)> =
        vec![("token_embd.weight".into(), dt, vec![vu, hu], 1.0)];
    for l in 0..spec.layers {
        let b = |n: &str| format!("blk.{l}.{n}.weight");
        plan.push((b("attn_norm"), DType::F32, vec![hu], 0.0));
        plan.push((b("attn_q"), dt, vec![qu, hu], fan(h)));
        plan.push((b("attn_k"), dt, vec![ku, hu], fan(h)));
        plan.push((b("attn_v"), dt, vec![ku, hu], fan(h)));
        plan.push((b("attn_output"), dt, vec![hu, qu], fan(qd)));
        plan.push((
            b("attn_q_norm"),
            DType::F32,
            vec![spec.head_dim as u64],
            0.0,
        ));
        plan.push((
            b("attn_k_norm"),
            DType::F32,
            vec![spec.head_dim as u64],
            0.0,
        ));
        plan.push((b("ffn_norm"), DType::F32, vec![hu], 0.0));
        plan.push((b("ffn_gate_inp"), DType::F32, vec![eu, hu], 4.0 * fan(h)));
        plan.push((b("ffn_gate_exps"), dt, vec![eu, fu, hu], fan(h)));
        plan.push((b("ffn_up_exps"), dt, vec![eu, fu, hu], fan(h)));
        plan.push((b("ffn_down_exps"), dt, vec![eu, hu, fu], fan(f)));
    }
    plan.push(("output_norm.weight".into(), DType::F32, vec![hu], 0.0));
    plan.push(("output.weight".into(), dt, vec![vu, hu], fan(h)));
    let mut total = 0u64;
    for (name, dtype, shape, _) in &plan {
        w.add_tensor_info(name, *dtype, shape)?;
        total += dtype.bytes_for(shape.iter().product()).unwrap_or(0);
    }
    let mut rng = Rng(spec.seed);
    let mut x = Vec::new();
    let mut buf = Vec::new();
    let mut done = 0u64;
    for (name, dtype, shape, scale) in &plan {
        let n: u64 = shape.iter().product();
        // Generate and encode in pieces of whole rows so huge tensors never sit in memory.
        let row = *shape.last().unwrap_or(&1);
        let rows_per_piece = ((1u64 << 22) / row.max(1)).max(1);
        let mut left = n / row.max(1);
        let mut row0 = 0usize;
        while left > 0 {
            let r = left.min(rows_per_piece);
            x.clear();
            x.extend((0..r * row).map(|_| {
                if *scale == 0.0 {
                    1.0
                } else {
                    rng.uniform(*scale)
                }
            }));
            if spec.skew > 0.0 && name == "token_embd.weight" {
                x.chunks_exact_mut(row as usize).for_each(|xr| xr[0] = 1.0);
            }
            if spec.skew > 0.0 && name.ends_with("ffn_gate_inp.weight") {
                // One seeded rank permutation per layer (Fisher-Yates on a layer-keyed stream).
                let mut perm: Vec<usize> = (0..spec.experts).collect();
                let mut prng =
                    Rng(spec.seed ^ 0xA5A5_0000 ^ (row0 as u64) ^ name.len() as u64 ^ fnv(name));
                for i in (1..perm.len()).rev() {
                    perm.swap(i, (prng.next_u64() % (i as u64 + 1)) as usize);
                }
                // x[0] of a normed hidden state is ~1.7 (1 against uniform(-1,1) entries).
                for (e, xr) in x.chunks_exact_mut(row as usize).enumerate() {
                    xr[0] = -spec.skew * ((perm[(row0 + e) % spec.experts] + 1) as f32).ln() / 1.7;
                }
            }
            if name == "output.weight" {
                // Readable noise: tokens that spell printable ASCII get full-scale logits,
                // the rest (other bytes, specials, padding) near-zero ones.
                for (i, xr) in x.chunks_exact_mut(row as usize).enumerate() {
                    if !printable[row0 + i] {
                        xr.iter_mut().for_each(|v| *v *= 0.05);
                    }
                }
            }
            row0 += r as usize;
            buf.clear();
            quantize(*dtype, &x, &mut buf).map_err(|err| FormatError::Writer {
                path: path.to_path_buf(),
                msg: format!("{name}: {err}"),
            })?;
            w.write_tensor_data(&buf)?;
            done += buf.len() as u64;
            left -= r;
        }
        progress(done, total);
    }
    w.finish()?;
    Ok(())
}
