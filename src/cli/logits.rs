//! `sluice logits MODEL --tokens 1,5,42 --out FILE.npy`: teacher-forced float32 logits of
//! shape [T, vocab] for every position, the format other implementations are compared in.
//! Experts are placed like `run`'s (`--experts stream` etc.); placement never changes the
//! logits. Quiet: stderr is for errors. Usage statistics are not saved (a teacher-forced
//! sequence says nothing about which experts a generation needs).

use super::common::{engine_options, ComputeArgs, ExpertArgs, SamplingArgs};
use crate::engine::Engine;
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
    pub experts: ExpertArgs,
    #[command(flatten)]
    pub gpu: super::gpu::GpuArgs,
}

pub fn run(args: LogitsArgs) -> anyhow::Result<()> {
    let sampling = SamplingArgs {
        temp: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        repeat_last_n: 0,
        seed: 0,
    };
    let mut o = engine_options(
        "logits",
        &args.model,
        &args.compute,
        &sampling,
        &args.experts,
        &args.gpu,
    )?;
    o.min_ctx = args.tokens.len();
    o.batch = args
        .compute
        .batch
        .unwrap_or(super::common::DEFAULT_BATCH)
        .max(1);
    o.logit_rows = o.batch.min(64);
    o.quiet = true;
    let mut engine = Engine::open(o)?;
    let vocab = engine.model.cfg.vocab;
    let mut out = Vec::with_capacity(args.tokens.len() * vocab);
    engine.logits(&args.tokens, &mut out)?;
    crate::npy::write_f32(&args.out, &[args.tokens.len(), vocab], &out)
        .with_context(|| format!("writing {}", args.out.display()))?;
    Ok(())
}
