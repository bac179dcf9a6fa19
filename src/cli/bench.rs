//! `sluice bench --kernels`: kernel throughput against the machine's memory read bandwidth.

use clap::Args;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Benchmark the matvec kernels of every supported type.
    #[arg(long)]
    pub kernels: bool,
}

pub fn run(_args: BenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("bench: not built yet")
}
