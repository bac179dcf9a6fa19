//! `--gpu`, `--vram`, `--gpu-staging`: put the forward pass on the GPU (issue: CUDA backend),
//! and the end-of-run GPU figures. Shared by `run`, `chat`, `serve`, `logits` and `bench`
//! (whose arms are `run` processes); the attach itself is the engine's (engine/placement.rs).

use crate::engine::options::parse_size;
use crate::engine::{GpuRequest, GpuWant};
use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct GpuArgs {
    /// auto | on | off. `auto` (the default) uses the GPU when this build has the `cuda`
    /// feature and a CUDA device answers, else the CPU (a `[plan]` line says which and why).
    #[arg(long, default_value = "auto")]
    pub gpu: String,
    /// Bytes of the VRAM expert pool, e.g. 8G (default: free VRAM after weights, KV cache
    /// and scratch, less 1 GiB, at most every expert).
    #[arg(long)]
    pub vram: Option<String>,
    /// arena | per-expert | pageable: how expert bytes in RAM are made copyable. `arena`
    /// registers the RAM expert cache once; `per-expert` registers each staged expert around
    /// its copy (the naive way, for A/B); `pageable` registers nothing.
    #[arg(long = "gpu-staging", default_value = "arena")]
    pub staging: String,
    /// auto | off. `auto`: when the VRAM pool has a slot for every routed expert, copy them
    /// all in at start (as llama.cpp's -ngl 99 loads its weights), so the first prompt does
    /// not stage them inside its prefill; when it holds part of them and the GPU makes its own
    /// RAM cache of every expert, read them all into it at start; `off`: read and stage each
    /// expert when a token first needs it.
    #[arg(long = "gpu-preload", default_value = "auto")]
    pub preload: String,
    /// auto | vram | hybrid | stage: where a routed expert missing from the VRAM pool runs.
    /// `hybrid`: misses of few tokens on the CPU threads from the RAM cache while the GPU runs
    /// the pool's, larger ones copied in; `stage`: every miss copied into the pool; `vram`: the
    /// pool must hold every expert. `auto` (the default): the planner's choice from the
    /// measured copy and CPU rates (a `[plan] gpu-experts:` line says which and why).
    #[arg(long = "gpu-experts", default_value = "auto")]
    pub experts: String,
}

impl Default for GpuArgs {
    fn default() -> Self {
        GpuArgs {
            gpu: "auto".into(),
            vram: None,
            staging: "arena".into(),
            preload: "auto".into(),
            experts: "auto".into(),
        }
    }
}

impl GpuArgs {
    /// The GPU flags, parsed once (`engine::options` refuses what cannot run).
    pub fn request(&self) -> anyhow::Result<GpuRequest> {
        Ok(GpuRequest {
            want: GpuWant::parse(&self.gpu)?,
            vram: self
                .vram
                .as_deref()
                .map(parse_size)
                .transpose()
                .map_err(|e| anyhow::anyhow!("--vram: {e}"))?,
            staging: crate::gpu::Staging::parse(&self.staging)
                .map_err(|e| anyhow::anyhow!("--gpu-staging {e}"))?,
            preload: match self.preload.as_str() {
                "auto" => true,
                "off" => false,
                s => anyhow::bail!("--gpu-preload {s:?}: expected auto or off"),
            },
            experts: crate::plan::gpu_experts::parse(&self.experts)
                .map_err(|e| anyhow::anyhow!("--gpu-experts {e}"))?,
        })
    }
}

fn since(
    engine: &crate::engine::Engine,
    before: Option<crate::gpu::GpuStats>,
) -> Option<crate::gpu::GpuStats> {
    let s = engine.gpu_stats()?;
    Some(before.map_or(s, |b| s.since(&b)))
}

/// One line of GPU figures since `before` (the prefill's end), or None without a GPU.
pub fn gpu_summary(
    engine: &crate::engine::Engine,
    before: Option<crate::gpu::GpuStats>,
) -> Option<String> {
    let s = since(engine, before)?;
    let ceiling = engine.gpu_h2d_ceiling();
    Some(format!(
        "gpu: wall {:.2}s, kernels {:.2}s, stall {:.1}% | vram hit {:.1}% | {} experts copied, {:.2} GB at {:.1} GB/s{} | {} on the CPU | register {:.3}s",
        s.wall_secs,
        s.kernel_secs,
        100.0 * s.stall_share(),
        100.0 * s.vram_hit_rate(),
        s.experts_h2d,
        s.bytes_h2d as f64 / 1e9,
        s.h2d_gbps(),
        match ceiling {
            Some(c) if c > 0.0 => format!(" = {:.2} of the {c:.1} GB/s pinned ceiling", s.h2d_gbps() / c),
            _ => String::new(),
        },
        s.experts_cpu,
        s.register_secs
    ))
}

/// The GPU figures as JSON (for `--stats-json`).
pub fn gpu_json(
    engine: &crate::engine::Engine,
    before: Option<crate::gpu::GpuStats>,
) -> Option<serde_json::Value> {
    let s = since(engine, before)?;
    Some(serde_json::json!({
        "wall_s": s.wall_secs,
        "kernel_s": s.kernel_secs,
        "stall_share": s.stall_share(),
        "vram_hit_rate": s.vram_hit_rate(),
        "experts_h2d": s.experts_h2d,
        "experts_cpu": s.experts_cpu,
        "bytes_h2d": s.bytes_h2d,
        "copy_s": s.copy_secs,
        "h2d_gb_s": s.h2d_gbps(),
        "h2d_ceiling_gb_s": engine.gpu_h2d_ceiling(),
        "register_s": s.register_secs,
    }))
}
