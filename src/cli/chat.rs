//! `sluice chat [MODEL]`: interactive chat using the model's chat template. Each turn reuses
//! the KV cache for the longest common token prefix with the previous turn.

use super::common::{ComputeArgs, SamplingArgs};
use crate::chat::{render_chat, ChatMessage};
use crate::format::ModelFiles;
use crate::generate::{generate, load_tokenizer};
use crate::sample::Sampler;
use anyhow::Context;
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
    #[command(flatten)]
    pub compute: ComputeArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub gpu: super::gpu::GpuArgs,
}

pub fn run(args: ChatArgs) -> anyhow::Result<()> {
    let path = match &args.model {
        Some(p) => p.clone(),
        None => crate::default_model::ensure().context("preparing the default model")?,
    };
    let files = ModelFiles::open(&path)?;
    let (model, ctx) = args.compute.load(&files, 0)?;
    let tok = load_tokenizer(&files)?;
    let template = tok.chat_template().map(str::to_string).ok_or_else(|| {
        anyhow::anyhow!(
            "{}: the model has no chat template; use `sluice run -p` for raw prompts",
            path.display()
        )
    })?;
    let mut st = model.new_state(ctx, args.compute.batch, 1)?;
    super::gpu::setup_gpu(&model, &files, &mut st, &args.gpu, None, 0, false)?;
    let mut sampler = Sampler::new(args.sampling.params(), model.cfg.vocab);
    let mut messages: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &args.system {
        messages.push(ChatMessage {
            role: "system".into(),
            content: s.clone(),
        });
    }
    let mut cached: Vec<u32> = Vec::new();
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
            tok.bos_token().unwrap_or(""),
            tok.eos_token().unwrap_or(""),
            None,
        )?;
        let ids = tok.encode(&text, false)?;
        if ids.len() > ctx {
            eprintln!("[sluice] the conversation ({} tokens) no longer fits the context of {ctx} tokens (raise -c); chat ends", ids.len());
            break;
        }
        // Reuse the cached prefix; always feed at least one token to get fresh logits.
        let common = cached
            .iter()
            .zip(&ids)
            .take_while(|(a, b)| a == b)
            .count()
            .min(ids.len().saturating_sub(1))
            .min(st.pos);
        st.truncate(common);
        cached.truncate(common);
        let mut reply = String::new();
        let (gen, stats) = generate(
            &model,
            &mut st,
            &tok,
            &mut sampler,
            &ids[common..],
            args.n_predict,
            false,
            &mut |s| {
                reply.push_str(s);
                print!("{s}");
                let _ = std::io::stdout().flush();
                true
            },
        )?;
        println!();
        let full = !stats.stopped_by_eos && stats.generated < args.n_predict && st.pos >= ctx;
        if full {
            eprintln!("{}", super::run::context_limit_note(ctx, stats.generated));
        }
        eprintln!("{} | reused {common} cached tokens", stats.timing_line());
        cached.extend_from_slice(&ids[common..]);
        cached.extend_from_slice(&gen);
        messages.push(ChatMessage {
            role: "assistant".into(),
            content: reply,
        });
        if full {
            break;
        }
    }
    Ok(())
}
