//! `sluice plan [MODEL] [--ram ..] [-c ..] [--json]`: the plan `run` would follow, one `[plan]`
//! line per decision with its reason, and the predicted decode speed. Uses the cached machine
//! profile; without one it probes `--quick` (a second or two) and caches that.

use super::common::{ComputeArgs, ExpertArgs};
use crate::engine::placement::{embedding_in_file, mem_available, plan_request};
use crate::engine::EngineOptions;
use crate::format::ModelFiles;
use crate::model::{LoadOptions, Model, ModelConfig};
use crate::plan::planner::{cached_profile, plan, ModelSummary};
use crate::plan::{load_or_probe_with, ProbeOptions};
use anyhow::Context;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// A .gguf file or safetensors directory (default: the built-in tiny model).
    pub model: Option<PathBuf>,
    /// Print the plan as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// MTP draft tokens the run would use (0 = off).
    #[arg(long, default_value_t = 0)]
    pub mtp: usize,
    #[command(flatten)]
    pub compute: ComputeArgs,
    #[command(flatten)]
    pub experts: ExpertArgs,
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let path = match &args.model {
        Some(p) => p.clone(),
        None => crate::default_model::ensure().context("preparing the default model")?,
    };
    let files = ModelFiles::open(&path)?;
    let mut o = EngineOptions::new(&path);
    args.compute.apply(&mut o)?;
    o.mtp = args.mtp;
    o.experts = args.experts.options()?;
    let cfg = ModelConfig::from_files(&files)?;
    o.check(&cfg)?;
    let ctx = o.ctx_for(&cfg)?;
    let model = Model::load(
        &files,
        &LoadOptions {
            threads: o.threads,
            ctx,
            kv: o.kv_types().0,
        },
    )?;
    let st = if args.mtp > 0 {
        model.new_state_mtp(ctx, 1, 1)?
    } else {
        model.new_state(ctx, 1, 1)?
    };
    let summary = ModelSummary::of(&model, &files, &st)?;
    drop(st);
    let (profile, how) = match cached_profile(&files) {
        Some(p) => {
            let how = format!(
                "cached profile {}{}",
                p.key,
                if p.quick { " (quick)" } else { "" }
            );
            (p, how)
        }
        None => {
            let mut o = ProbeOptions::for_model(&files);
            o.quick = true;
            let l = load_or_probe_with(&o, false, &|_| {})?;
            let how = format!("no cached profile: probed --quick now (rough figures; `sluice doctor` measures properly), saved to {}", l.path.display());
            (l.profile, how)
        }
    };
    let mut req = plan_request(&o.experts, args.mtp, None);
    req.embedding_in_file = embedding_in_file(&o);
    if args.experts.autopin {
        // The plan does not read usage statistics: assume every expert could be pinned.
        req.autopin = Some(usize::MAX);
    }
    req.available = mem_available().or(Some(profile.memory.available_bytes));
    let p = plan(&summary, Some(&profile), &req)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        println!("[plan] model: {}", path.display());
        println!("[plan] machine: {how}");
        for l in p.lines() {
            println!("{l}");
        }
    }
    Ok(())
}
