//! `sluice run [MODEL] -p PROMPT -n N`: generate text, streaming it to stdout, with one timing
//! line on stderr. With no MODEL, runs the small default model sluice writes itself.

use super::common::{
    engine_options, expert_summary, predicted_vs_measured, stats_json, time_shares, ComputeArgs,
    ExpertArgs, ReportArgs, SamplingArgs,
};
use crate::engine::{Engine, Event, GenParams};
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
    /// Self-speculative decoding with the model's MTP head: draft K tokens (1..=3) per step
    /// and verify them in one batched forward (0 = off). Pays only when experts are resident.
    #[arg(long, default_value_t = 0)]
    pub mtp: usize,
    /// Keep generating past end-of-generation tokens.
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
    /// Benchmark aid (llama-bench's `-d`): first fill the KV cache with N tokens (the prompt's
    /// tokens repeated), untimed, so the prompt is prefilled and decoded after N cached tokens.
    /// The context (`-c`) must hold N + the prompt + the generated tokens.
    #[arg(long, default_value_t = 0)]
    pub depth: usize,
    #[command(flatten)]
    pub compute: ComputeArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub experts: ExpertArgs,
    #[command(flatten)]
    pub report: ReportArgs,
    #[command(flatten)]
    pub gpu: super::gpu::GpuArgs,
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let path = match &args.model {
        Some(p) => p.clone(),
        None => {
            let p = crate::default_model::ensure().context("preparing the default model")?;
            eprintln!(
                "[sluice] no model given: running the built-in {} ({}); pass a .gguf path to run a real model",
                crate::default_model::DESCRIPTION,
                p.display()
            );
            p
        }
    };
    let mut o = engine_options(
        "run",
        &path,
        &args.compute,
        &args.sampling,
        &args.experts,
        &args.gpu,
    )?;
    o.mtp = args.mtp;
    o.measure_h2d = args.report.prof || args.report.stats_json.is_some();
    let mut engine = Engine::open(o)?;
    let prompt = engine.tok.encode(&args.prompt, true)?;
    let ctx = engine.ctx;
    // Checked before anything is printed: no prompt echo for a run that cannot start.
    if let Some(t) = prompt
        .iter()
        .find(|&&t| t as usize >= engine.model.cfg.vocab)
    {
        anyhow::bail!(
            "the tokenizer gave token id {t}, out of range for the model's vocabulary of {} tokens",
            engine.model.cfg.vocab
        );
    }
    // With --depth the whole sequence is the fill, then the prompt: the session keeps the
    // fill's cache from the untimed first call and prefills only the prompt in the second.
    let fill: Vec<u32> = prompt.iter().cycle().take(args.depth).copied().collect();
    let full: Vec<u32> = fill.iter().chain(prompt.iter()).copied().collect();
    if full.len() > ctx {
        return Err(crate::model::ModelError::ContextFull {
            needed: full.len(),
            ctx,
        }
        .into());
    }
    let mut sampler = engine.sampler();
    if !fill.is_empty() {
        engine.generate(&fill, &mut sampler, &GenParams::new(1), &mut |_| true)?;
    }
    let stdout = std::io::stdout();
    let mut lock = stdout.lock();
    write!(lock, "{}", args.prompt)?;
    let mut params = GenParams::new(args.n_predict);
    params.ignore_eos = args.ignore_eos;
    let out = engine.generate(&full, &mut sampler, &params, &mut |e| match e {
        Event::Text(s) => {
            let ok = write!(lock, "{s}").is_ok();
            let _ = lock.flush();
            ok
        }
        Event::Started { .. } => true,
    })?;
    let stats = out.generation.stats;
    writeln!(lock)?;
    let st = engine.state();
    if !stats.stopped_by_eos && stats.generated < args.n_predict && st.pos >= ctx {
        eprintln!("{}", context_limit_note(ctx, stats.generated));
    }
    eprintln!("{}", stats.timing_line());
    if let Some(line) = expert_summary(
        st,
        stats.experts_after_prefill,
        stats.decoded(),
        stats.decode_secs,
    ) {
        eprintln!("{line}");
    }
    if let Some(line) = super::common::belady_bound(
        st,
        stats.experts_after_prefill,
        stats.decoded(),
        stats.decode_secs,
        engine.plan.disk_gbps,
    ) {
        eprintln!("{line}");
    }
    if let Some(line) = super::gpu::gpu_summary(&engine, stats.gpu_after_prefill) {
        eprintln!("{line}");
    }
    if args.report.prof && engine.gpu_stats().is_none() {
        let (_, line, verdict) = time_shares(st);
        eprintln!("{line}");
        eprintln!("{verdict}");
        if let Some(line) = super::common::disk_now(
            st,
            stats.experts_after_prefill,
            stats.decoded(),
            stats.decode_secs,
        ) {
            eprintln!("{line}");
        }
    }
    eprintln!("{}", predicted_vs_measured(&engine.plan, stats.gen_tps()));
    if let Some(line) = super::common::peak_vs_budget(&engine.plan) {
        eprintln!("{line}");
    }
    if let Some(line) = engine.check_disk_profile() {
        eprintln!("{line}");
    }
    if let Some(p) = &args.report.stats_json {
        let tmp = p.with_extension("json.tmp");
        std::fs::write(
            &tmp,
            serde_json::to_string_pretty(&stats_json(&engine, &stats))?,
        )
        .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, p).with_context(|| format!("writing {}", p.display()))?;
    }
    engine.save_usage()?;
    Ok(())
}

/// The note (not an error) when generation stops because the context is full.
pub(super) fn context_limit_note(ctx: usize, generated: usize) -> String {
    format!("[sluice] stopped at the context limit: {ctx} tokens (raise -c), after {generated} generated tokens")
}
