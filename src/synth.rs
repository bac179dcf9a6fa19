//! Synthetic models: GGUFs with real models' shapes and seeded random weights, for the default
//! model and for performance work (no real model can be downloaded here).
//!
//! Owns: `MoeSpec` (a model's shape, one of three families: Qwen3-MoE, DeepSeek-V3 as GGUF
//! `deepseek2`, GLM-4.5 as `glm4moe`), presets with real models' dimensions, and a streaming
//! writer that never holds more than one piece of one tensor in memory.
//! Does not own: the GGUF byte layout (`format::GgufWriter`), quantizers (`kernels::quantize`),
//! the families' tensor lists and metadata keys (`synth/plan.rs`), the vocabulary
//! (`synth/vocab.rs`).
//! Invariant: output is a pure function of the spec (seeded generator, fixed tensor order); a
//! Qwen3-MoE spec writes the same bytes as the first synth writer did (the default model's
//! cache key depends on it).

mod plan;
mod vocab;

pub use plan::{mix_type, TensorClass};
pub use vocab::byte_chars;

use crate::dtype::DType;
use crate::format::{FormatError, GgufWriter, MetaValue};
use crate::kernels::quantize::quantize;
use plan::Init;
use std::path::Path;
use vocab::{vocabulary, Vocab, CHAT_TEMPLATE};

/// Multi-head latent attention sizes (DeepSeek-V3).
#[derive(Clone, Debug, PartialEq)]
pub struct Mla {
    pub q_lora: usize,
    pub kv_lora: usize,
    /// Per-head q/k widths without and with rotary embedding.
    pub nope: usize,
    pub rope: usize,
    pub v_dim: usize,
}

/// YaRN rope scaling as a config.json's `rope_scaling` gives it.
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f32,
    pub orig_ctx: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
    pub mscale_all_dim: f32,
}

/// The MoE block of the sigmoid-routed families (DeepSeek-V3, GLM-4.5): leading dense layers,
/// shared experts, group-limited selection, a scale on the routed weights.
#[derive(Clone, Debug, PartialEq)]
pub struct SigmoidMoe {
    /// The first `dense_layers` layers have a dense FFN of width `dense_ffn`.
    pub dense_layers: usize,
    pub dense_ffn: usize,
    pub shared_experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scale: f32,
}

/// A synthetic model's family and its family-specific shape.
#[derive(Clone, Debug, PartialEq)]
pub enum SynthArch {
    /// Qwen3-MoE: GQA with per-head q/k norms, softmax routing, every layer MoE.
    Qwen3Moe,
    /// DeepSeek-V3 (GGUF `deepseek2`): MLA, sigmoid group-limited routing with a selection
    /// bias, shared experts, leading dense layers. `heads` is the query heads; `kv_heads`
    /// and `head_dim` are unused (MLA's sizes are in `mla`).
    Deepseek2 {
        mla: Mla,
        moe: SigmoidMoe,
        yarn: Option<Yarn>,
    },
    /// GLM-4.5 (GGUF `glm4moe`): GQA with q/k/v biases and partial rotary embedding, sigmoid
    /// routing with a selection bias, shared experts, leading dense layers.
    Glm4Moe {
        moe: SigmoidMoe,
        rotary_dim: usize,
        qk_norm: bool,
    },
    /// Qwen3-Next (GGUF `qwen3next`): layer l is gated full attention when (l + 1) %
    /// `interval` == 0, else a Gated DeltaNet; every layer MoE with a sigmoid-gated shared
    /// expert of `shared_ffn`; q/k norms, partial rotary `rotary_dim`.
    /// `qwen35`: Qwen3.5-MoE as GGUF `qwen35moe` (separate `ssm_beta` / `ssm_alpha`, value
    /// heads in llama.cpp's tiled order, MRoPE sections, `attention.recurrent_layers`).
    Qwen3Next {
        linear: LinearAttn,
        shared_ffn: usize,
        interval: usize,
        rotary_dim: usize,
        qwen35: bool,
    },
    /// OpenAI gpt-oss (GGUF `gpt-oss`): GQA with q/k/v/o biases and one learned sink logit per
    /// head; even layers attend a sliding window of `window` tokens, odd layers everything;
    /// a softmax router with a bias; experts with biases on every projection (clamped
    /// SwiGLU); YaRN x32 over 4096 positions, theta 150000 (gpt-oss's config).
    GptOss { window: usize },
    /// DeepSeek-V4 (GGUF `deepseek4`, llama.cpp's names and keys): shared-KV MQA of one
    /// `head_dim` KV head with a low-rank q and a grouped low-rank output, sinks, a sliding
    /// window in every layer, compressed layers by `ratios` (0 sliding, 4 CSA with the
    /// indexer, 128 HCA), `hc` hyper-connection streams, the first `hash_layers` layers routed
    /// by a `tid2eid` table, sqrtsoftplus routing, one shared expert, YaRN on the compressed
    /// layers. See deepseek_v4.rs.
    DeepseekV4(Box<V4Shape>),
}

/// DeepSeek-V4's own sizes (its config.json names in the comments).
#[derive(Clone, Debug, PartialEq)]
pub struct V4Shape {
    pub q_lora: usize,      // q_lora_rank
    pub o_groups: usize,    // o_groups
    pub o_lora: usize,      // o_lora_rank
    pub rope: usize,        // qk_rope_head_dim
    pub window: usize,      // sliding_window
    pub idx_heads: usize,   // index_n_heads
    pub idx_dim: usize,     // index_head_dim
    pub idx_topk: usize,    // index_topk
    pub hc: usize,          // hc_mult
    pub hash_layers: usize, // num_hash_layers
    pub ratios: Vec<usize>, // compress_ratios, one per layer
    pub routed_scale: f32,  // routed_scaling_factor
    pub swiglu_limit: f32,  // swiglu_limit
    pub yarn: Yarn,         // rope_scaling (the compressed layers')
}

/// A Gated DeltaNet's shape (llama.cpp's `ssm.*` keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearAttn {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub conv: usize,
}

impl SynthArch {
    /// `general.architecture`.
    pub fn gguf_name(&self) -> &'static str {
        match self {
            SynthArch::Qwen3Moe => "qwen3moe",
            SynthArch::Deepseek2 { .. } => "deepseek2",
            SynthArch::Glm4Moe { .. } => "glm4moe",
            SynthArch::Qwen3Next { qwen35: false, .. } => "qwen3next",
            SynthArch::Qwen3Next { qwen35: true, .. } => "qwen35moe",
            SynthArch::GptOss { .. } => "gpt-oss",
            SynthArch::DeepseekV4(_) => "deepseek4",
        }
    }
}

/// The shape of a synthetic MoE model.
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
    /// Type of the matrices, or the mix it names (`plan::mix_type`); norms and routers F32.
    pub dtype: DType,
    pub seed: u64,
    pub name: String,
    /// Router skew S: expert popularity roughly Zipf-like with exponent S (0 = uniform); rank =
    /// a seeded permutation of the experts per layer.
    /// Softmax routers (Qwen3-MoE): every token embedding gets a constant +1 in dimension 0,
    /// so the normed hidden state keeps a positive component there, and each router row a
    /// weight in column 0 adding a logit bias of -S * ln(rank + 1) / 1.7 per unit of it.
    /// Sigmoid routers (DeepSeek-V3, GLM-4.5) select on sigmoid(logit) + `exp_probs_b`, the
    /// checkpoint's own selection bias, so the skew goes there, as a real load bias does:
    /// `exp_probs_b = -SIGMOID_SKEW_SLOPE * S * ln(rank + 1)`, with router logits of sd ~1 so
    /// that a score offset of slope x d is close to a logit offset of d near the top-k
    /// threshold; routing weights are untouched. The resulting popularity is measured, not
    /// promised (tests/synth_archs.rs; `--route-trace` + `sluice cache-sim`).
    pub skew: f32,
    /// The family and its own sizes.
    pub arch: SynthArch,
    /// MTP (NextN) layers written after the main ones (llama.cpp's `blk.N.nextn.*` with
    /// N = `layers`, and `{arch}.nextn_predict_layers`); 0 = none.
    pub mtp_layers: usize,
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
            arch: SynthArch::Qwen3Moe,
            mtp_layers: 0,
        };
        Some(match name {
            "qwen3-30b-a3b" => base(2048, 48, 32, 4, 128, 128, 8, 768, 151936),
            "qwen3-235b-a22b" => base(4096, 94, 64, 4, 128, 128, 8, 1536, 151936),
            // DeepSeek-V3's config.json (V3/R1/V3.1 share these shapes), with its one MTP layer.
            "deepseek-v3" => MoeSpec {
                ctx: 163840,
                mtp_layers: 1,
                arch: SynthArch::Deepseek2 {
                    mla: Mla {
                        q_lora: 1536,
                        kv_lora: 512,
                        nope: 128,
                        rope: 64,
                        v_dim: 128,
                    },
                    moe: SigmoidMoe {
                        dense_layers: 3,
                        dense_ffn: 18432,
                        shared_experts: 1,
                        n_group: 8,
                        topk_group: 4,
                        routed_scale: 2.5,
                    },
                    yarn: Some(Yarn {
                        factor: 40.0,
                        orig_ctx: 4096,
                        beta_fast: 32.0,
                        beta_slow: 1.0,
                        mscale_all_dim: 1.0,
                    }),
                },
                ..base(7168, 61, 128, 128, 192, 256, 8, 2048, 129280)
            },
            // GLM-4.5-Air's config.json (no q/k norm), with its one MTP layer.
            "glm-4.5-air" => MoeSpec {
                ctx: 131072,
                mtp_layers: 1,
                arch: SynthArch::Glm4Moe {
                    moe: SigmoidMoe {
                        dense_layers: 1,
                        dense_ffn: 10944,
                        shared_experts: 1,
                        n_group: 1,
                        topk_group: 1,
                        routed_scale: 1.0,
                    },
                    rotary_dim: 64,
                    qk_norm: false,
                },
                ..base(4096, 46, 96, 8, 128, 128, 8, 1408, 151552)
            },
            // Qwen3-Next-80B-A3B's config.json (its MTP layer not written: llama.cpp's
            // converter skips it too).
            "qwen3-next-80b-a3b" => MoeSpec {
                arch: SynthArch::Qwen3Next {
                    linear: LinearAttn {
                        k_heads: 16,
                        v_heads: 32,
                        k_dim: 128,
                        v_dim: 128,
                        conv: 4,
                    },
                    shared_ffn: 512,
                    interval: 4,
                    rotary_dim: 64,
                    qwen35: false,
                },
                ..base(2048, 48, 16, 2, 256, 512, 10, 512, 151936)
            },
            // Qwen3.5-397B-A17B's text config (60 layers, 3 DeltaNet : 1 gated attention, 512
            // experts of 1024 with 10 used and a gated shared expert of 1024); its MTP layer
            // not written.
            "qwen3.5-397b-a17b" => MoeSpec {
                ctx: 262144,
                arch: SynthArch::Qwen3Next {
                    linear: LinearAttn {
                        k_heads: 16,
                        v_heads: 64,
                        k_dim: 128,
                        v_dim: 128,
                        conv: 4,
                    },
                    shared_ffn: 1024,
                    interval: 4,
                    rotary_dim: 64,
                    qwen35: true,
                },
                ..base(4096, 60, 32, 2, 256, 512, 10, 1024, 248320)
            },
            // gpt-oss-120b / -20b's config.json (36 / 24 layers of 128 / 32 experts, top-4,
            // experts of 2880, 64 q / 8 kv heads x 64, window 128, o200k_harmony's 201088
            // tokens). Rows of 2880 are not a multiple of 256: use `--quant mxfp4` (experts
            // MXFP4 as OpenAI ships them, the rest Q8_0) or a 32-block type.
            "gpt-oss-120b" => MoeSpec {
                ctx: 131072,
                dtype: DType::MXFP4,
                arch: SynthArch::GptOss { window: 128 },
                ..base(2880, 36, 64, 8, 64, 128, 4, 2880, 201088)
            },
            "gpt-oss-20b" => MoeSpec {
                ctx: 131072,
                dtype: DType::MXFP4,
                arch: SynthArch::GptOss { window: 128 },
                ..base(2880, 24, 64, 8, 64, 32, 4, 2880, 201088)
            },
            // DeepSeek-V4-Flash's config.json (43 layers: 2 sliding, then CSA / HCA
            // alternating, the last CSA; 3 hash-routed layers; 256 experts of 2048, top-6, one
            // shared; 64 heads x 512 on one KV head; vocab 129280). Its MTP layer is not
            // written (llama.cpp's converter skips it by default).
            "deepseek-v4-flash" => {
                let mut ratios = vec![0, 0];
                for _ in 0..20 {
                    ratios.extend([4, 128]);
                }
                ratios.push(4);
                MoeSpec {
                    ctx: 1_048_576,
                    // Routed experts MXFP4 (the release's FP4 experts, as llama.cpp's converter
                    // repacks them), the rest Q8_0.
                    dtype: DType::MXFP4,
                    arch: SynthArch::DeepseekV4(Box::new(V4Shape {
                        q_lora: 1024,
                        o_groups: 8,
                        o_lora: 1024,
                        rope: 64,
                        window: 128,
                        idx_heads: 64,
                        idx_dim: 128,
                        idx_topk: 512,
                        hc: 4,
                        hash_layers: 3,
                        ratios,
                        routed_scale: 1.5,
                        swiglu_limit: 10.0,
                        yarn: Yarn {
                            factor: 16.0,
                            orig_ctx: 65536,
                            beta_fast: 32.0,
                            beta_slow: 1.0,
                            mscale_all_dim: 0.0,
                        },
                    })),
                    ..base(4096, 43, 64, 1, 512, 256, 6, 2048, 129280)
                }
            }
            _ => return None,
        })
    }

    pub const PRESETS: &'static [&'static str] = &[
        "qwen3-30b-a3b",
        "qwen3-235b-a22b",
        "deepseek-v3",
        "glm-4.5-air",
        "qwen3-next-80b-a3b",
        "qwen3.5-397b-a17b",
        "gpt-oss-120b",
        "gpt-oss-20b",
        "deepseek-v4-flash",
    ];

    /// Keep the first `n` layers (n >= 1), at least one of them MoE: the leading dense
    /// layers become min(real, n - 1). The MTP layers (set `mtp_layers` first) stay.
    pub fn cut_layers(&mut self, n: usize) -> Result<(), String> {
        if n == 0 {
            return Err("--layers must be at least 1".into());
        }
        let n = n.min(self.layers);
        if let SynthArch::Deepseek2 { mla, .. } = &self.arch {
            // llama.cpp takes a deepseek2 GGUF of 26 or 27 layers for a "lite" model without
            // q_lora_rank and would look for attn_q instead of attn_q_a/attn_q_b. Whether it
            // counts the MTP layers there is not checked, so both counts are refused.
            let blocks = n + self.mtp_layers;
            if [n, blocks].iter().any(|b| *b == 26 || *b == 27) && mla.q_lora > 0 {
                return Err(format!(
                    "--layers {n}: llama.cpp reads a deepseek2 GGUF of 26 or 27 layers ({blocks} blocks with {} MTP) as DeepSeek-V2-Lite (no q_lora_rank); pick another depth",
                    self.mtp_layers
                ));
            }
        }
        self.layers = n;
        match &mut self.arch {
            SynthArch::Qwen3Moe | SynthArch::Qwen3Next { .. } | SynthArch::GptOss { .. } => {}
            SynthArch::DeepseekV4(v) => {
                v.ratios.truncate(n);
                v.hash_layers = v.hash_layers.min(n);
            }
            SynthArch::Deepseek2 { moe, .. } | SynthArch::Glm4Moe { moe, .. } => {
                moe.dense_layers = moe.dense_layers.min(n - 1);
            }
        }
        Ok(())
    }
}

/// Score-space size of one logit unit near a sigmoid router's top-k threshold (sigmoid slope
/// s(1-s) at logits ~0.7..1.9, the threshold of top-4-of-16 .. top-8-of-256 for sd-1 logits).
pub const SIGMOID_SKEW_SLOPE: f32 = 0.15;

/// A seeded permutation of `n` (Fisher-Yates on a stream keyed by the seed, tensor and row).
fn rank_perm(n: usize, seed: u64, row0: usize, name: &str) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..n).collect();
    let mut prng = Rng(seed ^ 0xA5A5_0000 ^ (row0 as u64) ^ name.len() as u64 ^ fnv(name));
    for i in (1..perm.len()).rev() {
        perm.swap(i, (prng.next_u64() % (i as u64 + 1)) as usize);
    }
    perm
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
        self.0 = self.0.wrapping_add(GAMMA);
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

/// SplitMix64's state advance per value.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// Replace `x` with the next `n` values of `init` from `rng`. SplitMix64's k-th value depends
/// only on `state + k * GAMMA`, so uniform draws are made in parallel pieces with the same
/// values, in the same order, as one thread drawing them (the files' bytes do not change).
fn fill(x: &mut Vec<f32>, n: usize, init: Init, rng: &mut Rng) {
    x.clear();
    let a = match init {
        Init::Ones => return x.resize(n, 1.0),
        Init::Zeros => return x.resize(n, 0.0),
        Init::Const(c) => return x.resize(n, c),
        Init::ExpertIds { .. } => return x.resize(n, 0.0),
        Init::Uniform(a) => a,
    };
    x.resize(n, 0.0);
    let threads = std::thread::available_parallelism()
        .map(|t| t.get())
        .unwrap_or(1)
        .min(16);
    let per = n.div_ceil(threads).max(1 << 16);
    let base = rng.0;
    std::thread::scope(|s| {
        for (i, c) in x.chunks_mut(per).enumerate() {
            let mut r = Rng(base.wrapping_add(((i * per) as u64).wrapping_mul(GAMMA)));
            s.spawn(move || c.iter_mut().for_each(|v| *v = r.uniform(a)));
        }
    });
    rng.0 = base.wrapping_add((n as u64).wrapping_mul(GAMMA));
}

/// Encode `x` (whole rows of `row` values) as `dtype`, splitting the rows over threads for
/// the slow quantizers. Blocks are independent, so the bytes equal a one-thread encoding.
pub(crate) fn quantize_rows(
    dtype: DType,
    x: &[f32],
    row: usize,
    out: &mut Vec<u8>,
) -> Result<(), crate::kernels::KernelError> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(16);
    // Every type with a search or a per-value code table (all but the plain scalings).
    let slow = !matches!(
        dtype,
        DType::F32 | DType::F16 | DType::BF16 | DType::Q8_0 | DType::Q4_0
    );
    let rows = x.len() / row.max(1);
    if !slow || threads < 2 || rows < 2 * threads {
        return quantize(dtype, x, out);
    }
    let per = rows.div_ceil(threads) * row;
    let parts: Vec<Result<Vec<u8>, _>> = std::thread::scope(|s| {
        let handles: Vec<_> = x
            .chunks(per)
            .map(|c| {
                s.spawn(move || {
                    let mut o = Vec::new();
                    quantize(dtype, c, &mut o).map(|_| o)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(crate::kernels::KernelError::Shape(
                        "quantizer thread panicked".into(),
                    ))
                })
            })
            .collect()
    });
    for p in parts {
        out.extend_from_slice(&p?);
    }
    Ok(())
}

/// Write a synthetic GGUF of `spec` (llama.cpp names and keys for its family) with seeded
/// random weights. `progress` is called after each tensor with (bytes written, total bytes).
pub fn write_random(
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
    if spec.mtp_layers > 0
        && matches!(
            spec.arch,
            SynthArch::Qwen3Moe | SynthArch::Qwen3Next { .. } | SynthArch::GptOss { .. }
        )
    {
        return Err(FormatError::Writer {
            path: path.to_path_buf(),
            msg: format!("{} has no MTP (NextN) layers", spec.arch.gguf_name()),
        });
    }
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
    let mut meta: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), s(spec.arch.gguf_name())),
        ("general.name".into(), s(&spec.name)),
    ];
    meta.extend(plan::arch_meta(spec, vocab));
    meta.extend([
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
    ]);
    for (k, v) in meta {
        w.add_meta(&k, v)?;
    }

    let plan = plan::tensors(spec, vocab);
    let mut total = 0u64;
    for t in &plan {
        w.add_tensor_info(&t.name, t.dtype, &t.shape)?;
        total += t.dtype.bytes_for(t.shape.iter().product()).unwrap_or(0);
    }
    let mut rng = Rng(spec.seed);
    let mut x = Vec::new();
    let mut buf = Vec::new();
    let mut done = 0u64;
    for t in &plan {
        let name = t.name.as_str();
        let n: u64 = t.shape.iter().product();
        // Generate and encode in pieces of whole rows so huge tensors never sit in memory.
        let row = *t.shape.last().unwrap_or(&1);
        let rows_per_piece = ((1u64 << 22) / row.max(1)).max(1);
        let mut left = n / row.max(1);
        let mut row0 = 0usize;
        while left > 0 {
            let r = left.min(rows_per_piece);
            fill(&mut x, (r * row) as usize, t.init, &mut rng);
            let softmax = spec.arch == SynthArch::Qwen3Moe;
            if spec.skew > 0.0 && softmax && name == "token_embd.weight" {
                x.chunks_exact_mut(row as usize).for_each(|xr| xr[0] = 1.0);
            }
            if spec.skew > 0.0 && softmax && name.ends_with("ffn_gate_inp.weight") {
                let perm = rank_perm(spec.experts, spec.seed, row0, name);
                // x[0] of a normed hidden state is ~1.7 (1 against uniform(-1,1) entries).
                for (e, xr) in x.chunks_exact_mut(row as usize).enumerate() {
                    xr[0] = -spec.skew * ((perm[(row0 + e) % spec.experts] + 1) as f32).ln() / 1.7;
                }
            }
            if spec.skew > 0.0
                && matches!(spec.arch, SynthArch::GptOss { .. })
                && name.ends_with("ffn_gate_inp.bias")
            {
                // gpt-oss's router has a bias: the skew is a logit offset there.
                let perm = rank_perm(spec.experts, spec.seed, row0, name);
                for (e, v) in x.iter_mut().enumerate() {
                    *v = -spec.skew * ((perm[e % spec.experts] + 1) as f32).ln();
                }
            }
            if spec.skew > 0.0 && name.ends_with("exp_probs_b.bias") {
                let perm = rank_perm(spec.experts, spec.seed, row0, name);
                for (e, v) in x.iter_mut().enumerate() {
                    *v = -SIGMOID_SKEW_SLOPE
                        * spec.skew
                        * ((perm[e % spec.experts] + 1) as f32).ln();
                }
            }
            if let Init::ExpertIds { experts } = t.init {
                // A hash layer's tid2eid: k distinct experts per token, spread evenly.
                let k = row as usize;
                for (i, xr) in x.chunks_exact_mut(k).enumerate() {
                    let tok = row0 + i;
                    for (j, v) in xr.iter_mut().enumerate() {
                        *v = ((tok * 31 + j * (experts / k).max(1)) % experts) as f32;
                    }
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
            if t.dtype == DType::I32 {
                buf.extend(x.iter().flat_map(|v| (*v as i32).to_le_bytes()));
            } else {
                quantize_rows(t.dtype, &x, row as usize, &mut buf).map_err(|err| {
                    FormatError::Writer {
                        path: path.to_path_buf(),
                        msg: format!("{name}: {err}"),
                    }
                })?;
            }
            w.write_tensor_data(&buf)?;
            done += buf.len() as u64;
            left -= r;
        }
        progress(done, total);
    }
    w.finish()?;
    Ok(())
}

/// The first writer's name, kept for callers that write the Qwen3-MoE default model.
pub fn write_random_qwen3moe(
    path: &Path,
    spec: &MoeSpec,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(), FormatError> {
    write_random(path, spec, progress)
}
