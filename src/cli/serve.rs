//! `sluice serve [MODEL] [--host 127.0.0.1] [--port 8080] [--api-key KEY] [--kv-dir DIR]`: an
//! OpenAI- and Anthropic-compatible HTTP server (see docs/SERVER.md). With no MODEL, serves the
//! built-in tiny model.

use super::common::{engine_options, ComputeArgs, ExpertArgs, SamplingArgs};
use crate::engine::Engine;
use crate::serve::{run, ServeConfig};
use anyhow::Context;
use clap::Args;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A .gguf file (first shard of a split model) or a safetensors model directory.
    /// Default: sluice's own small MoE model.
    pub model: Option<PathBuf>,
    /// Address to listen on (loopback by default; anything else exposes the model).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0 = any free port; the one chosen is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require this key: `Authorization: Bearer KEY` or `x-api-key: KEY` (default: the
    /// SLUICE_API_KEY environment variable, which keeps the key out of `ps`).
    #[arg(long = "api-key")]
    pub api_key: Option<String>,
    /// Model name clients ask for (default: the file name without .gguf).
    #[arg(long = "model-id")]
    pub model_id: Option<String>,
    /// Use the Jinja chat template in FILE instead of the model's own (it also decides how tool
    /// calls are parsed; see docs/SERVER.md).
    #[arg(long = "chat-template")]
    pub chat_template: Option<PathBuf>,
    /// Reasoning in chat replies: `auto` splits it off the content where the chat template
    /// marks it (`<think>` blocks; gpt-oss's harmony analysis channel, whose commentary
    /// calls become tool calls) into `reasoning_content` (Anthropic: `thinking` blocks), as
    /// llama-server does; `none` leaves it in the content. A request's `reasoning_format`
    /// field overrides it.
    #[arg(long = "reasoning-format", default_value = "auto", value_parser = ["auto", "none"])]
    pub reasoning_format: String,
    /// Save KV sessions here and restore them (also across restarts).
    #[arg(long = "kv-dir")]
    pub kv_dir: Option<PathBuf>,
    /// Most sessions kept in --kv-dir (oldest removed first).
    #[arg(long = "kv-max-sessions", default_value_t = 8, requires = "kv_dir")]
    pub kv_max_sessions: usize,
    /// Largest request body in bytes.
    #[arg(long = "max-body", default_value_t = 16 << 20)]
    pub max_body: usize,
    /// Most requests waiting for a free sequence slot (more get 503 with Retry-After).
    #[arg(long = "max-queue", default_value_t = 64)]
    pub max_queue: usize,
    /// Most connections inside a request at once (more get 503); idle ones do not count, and at
    /// most 4x this many may be open.
    #[arg(long = "max-connections", default_value_t = 256)]
    pub max_connections: usize,
    /// Seconds a request head may take from its first byte to its end (408 after).
    #[arg(long = "head-timeout", default_value_t = 10.0)]
    pub head_timeout: f64,
    /// Seconds of grace for a request body, beyond which it must arrive at 64 KiB/s or faster
    /// (at any moment it may have taken this long plus 1 s per 64 KiB received; 408 after).
    #[arg(long = "body-timeout", default_value_t = 30.0)]
    pub body_timeout: f64,
    /// On SIGINT/SIGTERM, seconds a running generation may go on before it is cancelled.
    #[arg(long = "shutdown-grace", default_value_t = 5.0)]
    pub shutdown_grace: f64,
    /// Sequence slots: up to N requests are decoded together, one batched forward per step
    /// over every running sequence, so each expert is read once per step for all of them
    /// (llama-server's -np). 1 = one request at a time, the others wait in the queue.
    /// Default: 4 where the batched path runs (the CPU forward, grouped-query attention or
    /// MLA without an indexer, no --mtp), else 1, and fewer where N KV caches
    /// of -c positions would take over an eighth of the memory budget, or where experts
    /// stream from disk and more sequences would read more expert bytes per generated token
    /// (the `[plan] parallel:` line says why).
    #[arg(long)]
    pub parallel: Option<usize>,
    /// Self-speculative decoding with the model's MTP head: K drafts per step (0 = off).
    #[arg(long, default_value_t = 0)]
    pub mtp: usize,
    /// At shutdown, print where the forward's time went over everything served.
    #[arg(long)]
    pub prof: bool,
    #[command(flatten)]
    pub compute: ComputeArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub experts: ExpertArgs,
    #[command(flatten)]
    pub gpu: super::gpu::GpuArgs,
}

pub fn run_cmd(args: ServeArgs) -> anyhow::Result<()> {
    let path = match &args.model {
        Some(p) => p.clone(),
        None => {
            let p = crate::default_model::ensure().context("preparing the default model")?;
            eprintln!(
                "[sluice] no model given: serving the built-in {} ({})",
                crate::default_model::DESCRIPTION,
                p.display()
            );
            p
        }
    };
    let model_id = match args.model_id {
        Some(id) if !id.is_empty() => id,
        Some(_) => anyhow::bail!("--model-id must not be empty"),
        None => {
            let p = if path.is_dir() {
                path.clone()
            } else {
                path.with_extension("")
            };
            p.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        }
    };
    if !(0.0..=3600.0).contains(&args.shutdown_grace) {
        anyhow::bail!("--shutdown-grace must be between 0 and 3600 seconds");
    }
    for (flag, v) in [
        ("--head-timeout", args.head_timeout),
        ("--body-timeout", args.body_timeout),
    ] {
        if !(0.1..=3600.0).contains(&v) {
            anyhow::bail!("{flag} must be between 0.1 and 3600 seconds (got {v})");
        }
    }
    let chat_template = match &args.chat_template {
        None => None,
        Some(p) => {
            let t = std::fs::read_to_string(p)
                .with_context(|| format!("--chat-template {}: cannot read it", p.display()))?;
            if t.trim().is_empty() {
                anyhow::bail!("--chat-template {}: the file is empty", p.display());
            }
            Some(t)
        }
    };
    for (flag, v) in [
        ("--kv-max-sessions", args.kv_max_sessions),
        ("--max-queue", args.max_queue),
        ("--max-connections", args.max_connections),
        ("--max-body", args.max_body),
    ] {
        if v == 0 {
            anyhow::bail!("{flag} must be at least 1");
        }
    }
    if args.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        anyhow::bail!("--api-key \"\": an empty key would turn authentication off; leave the flag out to run without a key");
    }
    if args.compute.ctx.is_some_and(|c| c < 2) {
        anyhow::bail!("--ctx-size must be at least 2");
    }
    let mut o = engine_options(
        "serve",
        &path,
        &args.compute,
        &args.sampling,
        &args.experts,
        &args.gpu,
    )?;
    o.min_ctx = 2;
    o.mtp = args.mtp;
    o.parallel = args.parallel.unwrap_or(1);
    o.parallel_auto = args.parallel.is_none();
    o.kv_dir = args.kv_dir.clone();
    o.kv_max_sessions = args.kv_max_sessions;
    o.measure_h2d = args.prof;
    let engine = Engine::open(o)?;
    let ctx = engine.ctx;
    let cfg = ServeConfig {
        host: args.host,
        port: args.port,
        api_key: args
            .api_key
            .or_else(|| std::env::var("SLUICE_API_KEY").ok())
            .filter(|k| !k.is_empty()),
        model_id,
        chat_template,
        split_reasoning: args.reasoning_format == "auto",
        ctx,
        sampling: args.sampling.params(),
        max_body: args.max_body,
        max_queue: args.max_queue,
        max_connections: args.max_connections,
        timeouts: crate::serve::Timeouts {
            head: Duration::from_secs_f64(args.head_timeout),
            body: Duration::from_secs_f64(args.body_timeout),
        },
        shutdown_grace: Duration::from_secs_f64(args.shutdown_grace),
    };
    let engine = run(engine, cfg)?;
    let st = engine.state();
    if args.prof {
        // Where the forward's time went over everything this server generated.
        match super::gpu::gpu_summary(&engine, None) {
            Some(line) => eprintln!("{line}"),
            None => {
                let (_, line, verdict) = super::common::time_shares(st);
                eprintln!("{line}");
                eprintln!("{verdict}");
            }
        }
    }
    engine.save_usage()?;
    Ok(())
}
