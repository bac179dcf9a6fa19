//! `sluice synth OUT --preset NAME [--layers N] [--quant TYPE] [--seed S]`: write a GGUF with a
//! real model's shapes and seeded random weights, streaming (never the whole model in RAM).

use crate::dtype::DType;
use crate::synth::{write_random_qwen3moe, MoeSpec};
use clap::Args;
use std::io::Write;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Output .gguf path.
    pub out: PathBuf,
    /// Shape preset: qwen3-30b-a3b | qwen3-235b-a22b.
    #[arg(long, default_value = "qwen3-30b-a3b")]
    pub preset: String,
    /// Keep only the first N layers (0 = all).
    #[arg(long, default_value_t = 0)]
    pub layers: usize,
    /// Type of the matrices: q4_k | q8_0 | f16 | bf16 | f32 (norms and routers stay f32).
    #[arg(long, default_value = "q8_0")]
    pub quant: String,
    /// Seed of the weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
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
    if args.layers > 0 {
        spec.layers = args.layers.min(spec.layers);
    }
    spec.dtype = match DType::from_name(&args.quant) {
        Some(t @ (DType::Q4_K | DType::Q8_0 | DType::F16 | DType::BF16 | DType::F32)) => t,
        _ => anyhow::bail!(
            "--quant {:?}: synth can write q4_k, q8_0, f16, bf16 or f32",
            args.quant
        ),
    };
    spec.seed = args.seed;
    if !(0.0..=8.0).contains(&args.skew) {
        anyhow::bail!("--skew {}: expected 0 (uniform) to 8", args.skew);
    }
    spec.skew = args.skew;
    let start = std::time::Instant::now();
    let mut last = 0u64;
    write_random_qwen3moe(&args.out, &spec, &mut |done, total| {
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
