//! `sluice quantize IN OUT TYPE [--tensor-type PATTERN=TYPE]...`: rewrite a GGUF's weight
//! matrices in another type (llama.cpp's `llama-quantize`, for the types sluice can encode).

use crate::convert::{quantize_file, TARGETS};
use crate::dtype::DType;
use clap::Args;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// Input GGUF (the first shard of a split file names them all).
    pub input: PathBuf,
    /// Output .gguf path (written as OUT.tmp, renamed when whole).
    pub out: PathBuf,
    /// Type of the matrices: q4_k | q8_0 | q4_0 | q4_1 | q5_0 | q5_1 | iq4_nl | f16 | bf16 | f32,
    /// or a mix: mxfp4 (routed experts MXFP4, other matrices Q8_0, as gpt-oss ships) | iq2_xxs
    /// (routed experts IQ2_XXS, no importance matrix; other matrices Q4_K). Norms, biases,
    /// routers (ffn_gate_inp) and convolution kernels keep their type, as llama-quantize keeps
    /// them; a row the type's block does not divide falls back to Q4_0 (256-blocks), then Q8_0,
    /// then F32. Other types (K-quants but Q4_K, IQ1-IQ3): llama.cpp's llama-quantize.
    pub r#type: String,
    /// PATTERN=TYPE: matrices whose name contains PATTERN get TYPE (first match wins), e.g.
    /// `--tensor-type ffn_down_exps=q8_0 --tensor-type output.weight=q8_0`.
    #[arg(long = "tensor-type", value_name = "PATTERN=TYPE")]
    pub tensor_type: Vec<String>,
}

fn parse_type(s: &str, what: &str) -> anyhow::Result<DType> {
    DType::from_name(s)
        .filter(|d| TARGETS.contains(d))
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{what} {s:?}: quantize writes {} (other types: llama.cpp's llama-quantize)",
                TARGETS
                    .iter()
                    .map(|d| d.name().to_lowercase())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}

pub fn run(args: QuantizeArgs) -> anyhow::Result<()> {
    let target = parse_type(&args.r#type, "TYPE")?;
    let overrides = args
        .tensor_type
        .iter()
        .map(|o| {
            let (p, t) = o
                .split_once('=')
                .filter(|(p, _)| !p.is_empty())
                .ok_or_else(|| anyhow::anyhow!("--tensor-type {o:?}: expected PATTERN=TYPE"))?;
            Ok((p.to_string(), parse_type(t, "--tensor-type")?))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let same = |a: &PathBuf, b: &PathBuf| match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    };
    if same(&args.input, &args.out) {
        anyhow::bail!("{}: OUT is the input file", args.out.display());
    }
    let start = std::time::Instant::now();
    let mut last = u64::MAX;
    let tty = std::io::stderr().is_terminal();
    let sum = quantize_file(
        &args.input,
        &args.out,
        target,
        &overrides,
        &mut |done, total| {
            let pct = done * 100 / total.max(1);
            if tty && pct != last {
                last = pct;
                eprint!(
                    "\r[quantize] {pct:>3}%  {:.2} / {:.2} GB",
                    done as f64 / 1e9,
                    total as f64 / 1e9
                );
                let _ = std::io::stderr().flush();
            }
        },
    )?;
    if tty {
        eprintln!();
    }
    let types: Vec<String> = sum
        .by_type
        .iter()
        .map(|(d, n, b)| format!("{d} {n} ({:.1} MB)", *b as f64 / 1e6))
        .collect();
    eprintln!(
        "[quantize] wrote {} in {:.1}s: {} tensors, {} converted, {:.1} MB -> {:.1} MB; {}",
        args.out.display(),
        start.elapsed().as_secs_f64(),
        sum.tensors,
        sum.converted,
        sum.bytes_in as f64 / 1e6,
        sum.bytes_out as f64 / 1e6,
        types.join(", ")
    );
    Ok(())
}
