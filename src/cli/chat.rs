//! `sluice chat [MODEL]`: interactive chat using the model's chat template. Each turn reuses
//! the session's cache for the longest common token prefix with the previous turn; with
//! `--kv-dir` the conversation is saved after each turn and a later chat that starts the same
//! way resumes from it.

use super::common::{engine_options, ComputeArgs, ExpertArgs, SamplingArgs};
use crate::chat::{render_chat, ChatMessage};
use crate::engine::{Engine, Event, GenParams};
use crate::serve::reasoning::{Piece, ReasoningFormat, ReplySplitter};
use clap::Args;
use std::io::{BufRead, Write};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ChatArgs {
    /// Model path (default: sluice's built-in tiny model).
    pub model: Option<PathBuf>,
    /// System prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per reply.
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    pub n_predict: usize,
    /// Self-speculative decoding with the model's MTP head: K drafts per step (0 = off).
    #[arg(long, default_value_t = 0)]
    pub mtp: usize,
    /// Save the conversation's KV cache here after each turn, and resume from a saved one.
    #[arg(long = "kv-dir")]
    pub kv_dir: Option<PathBuf>,
    /// Most sessions kept in --kv-dir (oldest removed first).
    #[arg(long = "kv-max-sessions", default_value_t = 8, requires = "kv_dir")]
    pub kv_max_sessions: usize,
    #[command(flatten)]
    pub compute: ComputeArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub experts: ExpertArgs,
    #[command(flatten)]
    pub gpu: super::gpu::GpuArgs,
}

pub fn run(args: ChatArgs) -> anyhow::Result<()> {
    let path = super::common::model_or_default(&args.model)?;
    let mut o = engine_options(
        "chat",
        &path,
        &args.compute,
        &args.sampling,
        &args.experts,
        &args.gpu,
    )?;
    o.mtp = args.mtp;
    o.kv_dir = args.kv_dir.clone();
    o.kv_max_sessions = args.kv_max_sessions.max(1);
    let mut engine = Engine::open(o)?;
    let ctx = engine.ctx;
    let template = engine
        .tok
        .chat_template()
        .map(str::to_string)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{}: the model has no chat template; use `sluice run -p` for raw prompts",
                path.display()
            )
        })?;
    if let (Some(dir), Some(n)) = (&args.kv_dir, engine.saved_sessions()) {
        eprintln!(
            "[sluice] --kv-dir {}: {n} saved session(s) of this model",
            dir.display()
        );
    }
    // Reasoning (`<think>` blocks, gpt-oss's analysis channel) is shown apart and kept out of
    // the conversation, as the templates expect (they drop earlier turns' thoughts).
    let reasoning = ReasoningFormat::detect(Some(&template));
    let (dim, undim) = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        ("\x1b[2m", "\x1b[0m")
    } else {
        ("", "")
    };
    let mut sampler = engine.sampler();
    let mut messages: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &args.system {
        messages.push(ChatMessage {
            role: "system".into(),
            content: s.clone(),
        });
    }
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    eprintln!(
        "[sluice] chat with {} (empty line or Ctrl-D to quit)",
        path.display()
    );
    loop {
        write!(out, "> ")?;
        out.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        messages.push(ChatMessage {
            role: "user".into(),
            content: line.trim_end().to_string(),
        });
        let text = render_chat(
            &template,
            &messages,
            true,
            engine.tok.bos_token().unwrap_or(""),
            engine.tok.eos_token().unwrap_or(""),
            None,
        )?;
        let ids = engine.tok.encode(&text, false)?;
        if ids.len() > ctx {
            eprintln!("[sluice] the conversation ({} tokens) no longer fits the context of {ctx} tokens (raise -c); chat ends", ids.len());
            break;
        }
        let mut reply = String::new();
        let mut params = GenParams::new(args.n_predict);
        // gpt-oss's channel markers are control tokens: the split needs them in the text.
        params.special = reasoning == Some(ReasoningFormat::Harmony);
        let mut split = reasoning.map(|f| ReplySplitter::new(f, f.opens_in_prompt(&text)));
        let show = |pieces: Vec<Piece>, reply: &mut String| {
            for p in pieces {
                match p {
                    // Thoughts to stderr (dim on a terminal), the answer to stdout.
                    Piece::Reasoning(t) => eprint!("{dim}{t}{undim}"),
                    Piece::Content(t) => {
                        reply.push_str(&t);
                        print!("{t}");
                    }
                }
            }
            let _ = std::io::stdout().flush();
        };
        let res = engine.generate(&ids, &mut sampler, &params, &mut |e| {
            if let Event::Text(s) = e {
                match &mut split {
                    Some(sp) => show(sp.push(s), &mut reply),
                    None => show(vec![Piece::Content(s.to_string())], &mut reply),
                }
            }
            true
        })?;
        if let Some(sp) = split.take() {
            // Harmony calls (no tools here) are text of the reply.
            let (rest, calls) = sp.finish();
            show(rest, &mut reply);
            let calls = calls
                .into_iter()
                .map(|c| Piece::Content(c.arguments))
                .collect();
            show(calls, &mut reply);
        }
        println!();
        let stats = &res.generation.stats;
        let full =
            !stats.stopped_by_eos && stats.generated < args.n_predict && engine.state().pos >= ctx;
        if full {
            eprintln!("{}", super::run::context_limit_note(ctx, stats.generated));
        }
        let restored = if res.restored_bytes.is_some() {
            " (restored from --kv-dir)"
        } else {
            ""
        };
        eprintln!(
            "{} | reused {} cached tokens{restored}",
            stats.timing_line(),
            stats.reused
        );
        if let Err(e) = engine.save_session() {
            eprintln!("[sluice] warning: cannot save the KV session: {e}");
        }
        messages.push(ChatMessage {
            role: "assistant".into(),
            content: reply,
        });
        if full {
            break;
        }
    }
    engine.save_usage()?;
    Ok(())
}
