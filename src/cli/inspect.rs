//! `sluice inspect MODEL [--json]`.

use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A .gguf file (the first shard of a split model) or a directory with config.json + safetensors.
    pub model: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(_args: InspectArgs) -> anyhow::Result<()> {
    anyhow::bail!("inspect: not built yet")
}
