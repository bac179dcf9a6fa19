//! `sluice run [MODEL] -p PROMPT -n N`: generate text, streaming it to stdout, with one timing
//! line on stderr. With no MODEL, runs the small default model sluice writes itself.

use super::common::{expert_summary, save_usage, setup_experts, stats_json, ComputeArgs, ExpertArgs, SamplingArgs};
use crate::format::ModelFiles;
use crate::generate::{generate, load_tokenizer};
use crate::model::{LoadOptions, Model};
use crate::sample::Sampler;
use anyhow::Context;
use clap::Args;
use std::io::Write;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// A .gguf file (first shard of a split model) or a safetensors model directory.
    /// Default: sluice's own small MoE model, written to the cache directory on first use.
    pub model: Option<PathBuf>,
    /// Prompt text (raw, no chat template; see `sluice chat`).
    #[arg(short = 'p', long = "prompt", default_value = "The quick brown fox")]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
    pub n_predict: usize,
    /// Keep generating past end-of-generation tokens.
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
    #[command(flatten)]
    pub compute: ComputeArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub experts: ExpertArgs,
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let path = match &args.model {
        Some(p) => p.clone(),
        None => {
            let p = crate::default_model::ensure().context("preparing the default model")?;
            eprintln!(
                "[sluice] no model given: running the built-in tiny random MoE model at {} (its text is noise); pass a .gguf path to run a real model",
                p.display()
            );
            p
        }
    };
    let files = ModelFiles::open(&path)?;
    let model = Model::load(&files, &LoadOptions { threads: args.compute.threads, ctx: args.compute.ctx })?;
    let tok = load_tokenizer(&files)?;
    let prompt = tok.encode(&args.prompt, true)?;
    let mut st = model.new_state(args.compute.ctx, args.compute.batch, 1)?;
    setup_experts(&model, &files, &mut st, &args.experts)?;
    let mut sampler = Sampler::new(args.sampling.params(), model.cfg.vocab);
    let stdout = std::io::stdout();
    let mut lock = stdout.lock();
    write!(lock, "{}", args.prompt)?;
    let (_, stats) = generate(&model, &mut st, &tok, &mut sampler, &prompt, args.n_predict, args.ignore_eos, &mut |s| {
        let ok = write!(lock, "{s}").is_ok();
        let _ = lock.flush();
        ok
    })?;
    writeln!(lock)?;
    eprintln!("{}", stats.timing_line());
    if let Some(line) = expert_summary(&st, stats.experts_after_prefill, stats.decode_steps, stats.decode_secs) {
        eprintln!("{line}");
    }
    if let Some(p) = &args.experts.stats_json {
        let tmp = p.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_string_pretty(&stats_json(&st, &stats))?).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, p).with_context(|| format!("writing {}", p.display()))?;
    }
    save_usage(&files, &st, &args.experts)?;
    Ok(())
}
