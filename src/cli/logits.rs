//! `sluice logits MODEL --tokens 1,5,42 --out FILE.npy`: teacher-forced float32 logits of
//! shape [T, vocab] for every position, the format other implementations are compared in.

use super::common::ComputeArgs;
use crate::format::ModelFiles;
use anyhow::Context;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct LogitsArgs {
    pub model: PathBuf,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',', required = true)]
    pub tokens: Vec<u32>,
    /// Output .npy path (float32, C order, shape [T, vocab]).
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub compute: ComputeArgs,
    #[command(flatten)]
    pub gpu: super::gpu::GpuArgs,
}

pub fn run(args: LogitsArgs) -> anyhow::Result<()> {
    let files = ModelFiles::open(&args.model)?;
    let (model, ctx) = args.compute.load(&files, args.tokens.len())?;
    let batch = args.compute.batch.max(1);
    let mut st = model.new_state(ctx, batch, batch.min(64))?;
    super::gpu::setup_gpu_notes(&model, &files, &mut st, &args.gpu, None, 0, false, false)?;
    let mut out = Vec::with_capacity(args.tokens.len() * model.cfg.vocab);
    model.logits_all(&mut st, &args.tokens, &mut out)?;
    crate::npy::write_f32(&args.out, &[args.tokens.len(), model.cfg.vocab], &out)
        .with_context(|| format!("writing {}", args.out.display()))?;
    Ok(())
}
