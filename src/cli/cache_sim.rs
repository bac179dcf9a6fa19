//! `sluice cache-sim TRACE --slots N [--policy lru|hotness|belady|all] [--halve-every K]
//! [--pin-top N]`: replay a route trace (`sluice::experts::trace`) against eviction policies and
//! print hit rates, so a policy change is judged against Belady's optimum without a model run.

use anyhow::Context;
use clap::Args;
use std::path::PathBuf;

use crate::experts::{simulate, SimPolicy, Trace, UsageStats};

#[derive(Args, Debug)]
pub struct CacheSimArgs {
    /// A route trace written by the expert cache (text, `# sluice route-trace v1`).
    pub trace: PathBuf,
    /// Evictable slots per MoE layer.
    #[arg(long)]
    pub slots: usize,
    /// lru | hotness | belady | all.
    #[arg(long, default_value = "all")]
    pub policy: String,
    /// Hotness: halve every count each K tokens.
    #[arg(long, default_value_t = 64)]
    pub halve_every: u64,
    /// Pin the N experts the trace itself selects most (an oracle autopin: an upper bound on
    /// what pinning from earlier runs' counts can do).
    #[arg(long, default_value_t = 0)]
    pub pin_top: usize,
}

pub fn run(args: CacheSimArgs) -> anyhow::Result<()> {
    let policies: Vec<SimPolicy> = match args.policy.as_str() {
        "lru" => vec![SimPolicy::Lru],
        "hotness" => vec![SimPolicy::Hotness {
            halve_every: args.halve_every,
        }],
        "belady" => vec![SimPolicy::Belady],
        "all" => vec![
            SimPolicy::Lru,
            SimPolicy::Hotness {
                halve_every: args.halve_every,
            },
            SimPolicy::Belady,
        ],
        p => anyhow::bail!("--policy {p:?}: expected lru, hotness, belady or all"),
    };
    if args.halve_every == 0 {
        anyhow::bail!("--halve-every must be at least 1");
    }
    let trace = Trace::load(&args.trace)?;
    let pinned = if args.pin_top > 0 {
        let mut u = UsageStats::new(&trace.experts_per_layer);
        for l in &trace.lines {
            for &e in &l.experts {
                u.record(l.layer, e);
            }
        }
        u.top_n(args.pin_top)
    } else {
        Vec::new()
    };
    println!(
        "trace {}: {} tokens, {} layers, {} requests, {} selections | {} slots per layer, {} pinned",
        args.trace.display(),
        trace.tokens(),
        trace.experts_per_layer.len(),
        trace.lines.len(),
        trace.selections(),
        args.slots,
        pinned.len()
    );
    println!(
        "{:<10} {:>12} {:>12} {:>12} {:>9}",
        "policy", "hits pin", "hits", "misses", "hit rate"
    );
    for p in policies {
        let r = simulate(&trace, args.slots, &pinned, p)
            .with_context(|| format!("replaying {}", args.trace.display()))?;
        let name = match p {
            SimPolicy::Hotness { halve_every } => format!("hotness/{halve_every}"),
            _ => p.name().to_string(),
        };
        println!(
            "{:<10} {:>12} {:>12} {:>12} {:>8.2}%",
            name,
            r.hits_pin,
            r.hits,
            r.misses,
            100.0 * r.hit_rate()
        );
    }
    Ok(())
}
