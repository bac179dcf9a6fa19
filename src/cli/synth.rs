//! `sluice synth OUT --preset NAME [--layers N] [--quant TYPE] [--seed S] [--skew S]
//! [--no-mtp]`: write a GGUF with a real model's shapes and seeded random weights, streaming
//! (never the whole model in RAM), that llama.cpp's loader accepts for the preset's
//! architecture.

use crate::dtype::DType;
use crate::synth::{write_random, MoeSpec};
use clap::Args;
use std::io::Write;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Output .gguf path.
    pub out: PathBuf,
    /// Shape preset: qwen3-30b-a3b | qwen3-235b-a22b (GGUF qwen3moe) | deepseek-v3 (deepseek2:
    /// MLA, 3 dense + 58 MoE layers of 256 experts) | glm-4.5-air (glm4moe: 1 dense + 45 MoE
    /// layers of 128 experts). Both also get their one MTP (NextN) layer (see --no-mtp).
    /// qwen3-next-80b-a3b (qwen3next: 36 Gated DeltaNet + 12 gated-attention layers, 512
    /// experts, a gated shared expert; no MTP layer) | qwen3.5-397b-a17b (qwen35moe: 45 DeltaNet
    /// and 15 gated-attention layers, 512 experts of 1024, tiled value heads; no MTP layer) |
    /// gpt-oss-120b, gpt-oss-20b (gpt-oss: 36 / 24 layers alternating window-128 and full
    /// attention with sinks, 128 / 32 experts of 2880 top-4 with biases) | deepseek-v4-flash
    /// (deepseek4: 2 sliding + 41 CSA/HCA layers of 256 experts of 2048 top-6, 4
    /// hyper-connection streams, 3 hash-routed layers; experts mxfp4; no MTP layer).
    #[arg(long, default_value = "qwen3-30b-a3b")]
    pub preset: String,
    /// Keep only the first N layers (0 = all); at least one stays MoE (leading dense layers
    /// become min(real, N-1)).
    #[arg(long, default_value_t = 0)]
    pub layers: usize,
    /// Type of the matrices: q4_k | q8_0 | q5_0 | q4_1 | q5_1 | iq4_nl | f16 | bf16 | f32, or
    /// iq2_xxs: a mix with routed experts IQ2_XXS and attention, dense FFN, shared experts,
    /// embedding and output Q4_K. The other types sluice reads (Q2_K, Q3_K, Q5_K, Q6_K, IQ4_XS,
    /// TQ1_0, TQ2_0, ...) come only from llama.cpp's llama-quantize: write f16 here and
    /// convert that. mxfp4: routed experts MXFP4 (as OpenAI ships gpt-oss), the rest q8_0.
    /// Norms, routers and biases stay f32; a tensor whose rows the type's block does not
    /// divide falls back to q4_0 (GLM-4.5-Air's expert ffn_down of 1408, MLA's attn_k_b of
    /// 128, under q4_k/iq2_xxs). IQ2_XXS is slow to
    /// write (an exhaustive grid search; see docs/FORMATS.md). The other i-quants sluice runs
    /// (IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) have no quantizer here: make them from an
    /// f16 synth file with llama.cpp's `llama-quantize` (with an `llama-imatrix` matrix).
    /// Default: the preset's own (mxfp4 for gpt-oss and deepseek-v4-flash, q8_0 otherwise).
    #[arg(long)]
    pub quant: Option<String>,
    /// Seed of the weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Leave out the MTP (NextN) layer the deepseek-v3 and glm-4.5-air presets write after
    /// their main layers (`sluice run --mtp K` drafts with it).
    #[arg(long = "no-mtp")]
    pub no_mtp: bool,
    /// Router skew S: expert popularity roughly Zipf-like with exponent S (0 = uniform).
    #[arg(long, default_value_t = 0.0)]
    pub skew: f32,
}

pub fn run(args: SynthArgs) -> anyhow::Result<()> {
    let mut spec = MoeSpec::preset(&args.preset).ok_or_else(|| {
        anyhow::anyhow!(
            "--preset {:?}: unknown (known: {})",
            args.preset,
            MoeSpec::PRESETS.join(", ")
        )
    })?;
    if args.no_mtp {
        spec.mtp_layers = 0;
    }
    if args.layers > 0 {
        spec.cut_layers(args.layers)
            .map_err(|e| anyhow::anyhow!(e))?;
    }
    let quant = args
        .quant
        .unwrap_or_else(|| spec.dtype.name().to_lowercase());
    spec.dtype = match DType::from_name(&quant) {
        Some(
            t @ (DType::Q4_K
            | DType::Q8_0
            | DType::F16
            | DType::BF16
            | DType::F32
            | DType::IQ2_XXS
            | DType::Q5_0
            | DType::Q4_1
            | DType::Q5_1
            | DType::IQ4_NL
            | DType::MXFP4),
        ) => t,
        _ => anyhow::bail!(
            "--quant {:?}: synth can write q4_k, q8_0, q5_0, q4_1, q5_1, iq4_nl, iq2_xxs, mxfp4, \
             f16, bf16 or f32 (other types: write f16 and convert with llama.cpp's llama-quantize)",
            quant
        ),
    };
    spec.seed = args.seed;
    if !(0.0..=8.0).contains(&args.skew) {
        anyhow::bail!("--skew {}: expected 0 (uniform) to 8", args.skew);
    }
    spec.skew = args.skew;
    let start = std::time::Instant::now();
    let mut last = 0u64;
    write_random(&args.out, &spec, &mut |done, total| {
        let pct = done * 100 / total.max(1);
        if pct != last || done == total {
            last = pct;
            eprint!(
                "\r[synth] {:>3}%  {:.2} / {:.2} GB",
                pct,
                done as f64 / 1e9,
                total as f64 / 1e9
            );
            let _ = std::io::stderr().flush();
        }
    })?;
    eprintln!(
        "\n[synth] wrote {} in {:.1}s",
        args.out.display(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
