//! `--gpu`, `--vram`, `--gpu-staging`: put the forward pass on the GPU (issue: CUDA backend).
//! Shared by `run`, `serve`, `logits` and `bench` (whose arms are `run` processes).

use super::common::{parse_size, ExpertArgs};
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
}

impl Default for GpuArgs {
    fn default() -> Self {
        GpuArgs {
            gpu: "auto".into(),
            vram: None,
            staging: "arena".into(),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Want {
    Auto,
    On,
    Off,
}

/// Decides CPU or GPU for `st` and, for the GPU, attaches the GPU forward (after
/// `setup_experts`, whose RAM expert cache the VRAM pool stages from). Returns whether the
/// GPU runs the forward. `measure_ceiling`: also time the pinned-copy ceiling (for `--prof`
/// and `--stats-json`).
pub fn setup_gpu(
    model: &crate::model::Model<'_>,
    files: &crate::format::ModelFiles,
    st: &mut crate::model::State,
    g: &GpuArgs,
    experts: Option<&ExpertArgs>,
    mtp: usize,
    measure_ceiling: bool,
) -> anyhow::Result<bool> {
    setup_gpu_notes(model, files, st, g, experts, mtp, measure_ceiling, true)
}

/// `setup_gpu`; `notes`: print the `[plan] gpu: off (...)` line when the CPU is chosen
/// (`logits` stays silent: its stderr is for errors).
#[allow(clippy::too_many_arguments)]
pub fn setup_gpu_notes(
    model: &crate::model::Model<'_>,
    files: &crate::format::ModelFiles,
    st: &mut crate::model::State,
    g: &GpuArgs,
    experts: Option<&ExpertArgs>,
    mtp: usize,
    measure_ceiling: bool,
    notes: bool,
) -> anyhow::Result<bool> {
    let off = |why: &str| {
        if notes {
            eprintln!("[plan] gpu: off ({why})");
        }
    };
    let want = match g.gpu.as_str() {
        "auto" => Want::Auto,
        "on" => Want::On,
        "off" => Want::Off,
        s => anyhow::bail!("--gpu {s:?}: expected auto, on or off"),
    };
    let staging =
        crate::gpu::Staging::parse(&g.staging).map_err(|e| anyhow::anyhow!("--gpu-staging {e}"))?;
    let vram = g.vram.as_deref().map(parse_size).transpose()?;
    if want == Want::Off {
        off("--gpu off");
        return Ok(false);
    }
    if !crate::gpu::BUILT {
        if want == Want::On {
            anyhow::bail!("--gpu on: this sluice was built without the `cuda` feature (cargo build --release --features cuda)");
        }
        off("this build has no `cuda` feature");
        return Ok(false);
    }
    if mtp > 0 {
        if want == Want::On {
            anyhow::bail!("--mtp with --gpu on: the MTP head runs only on the CPU path; use --gpu off or --mtp 0");
        }
        off("--mtp runs on the CPU path");
        return Ok(false);
    }
    // gpt-oss (attention sinks, per-layer windows, biased clamped-SwiGLU experts): CPU only.
    if model.cfg.family == crate::model::Family::GptOss {
        if want == Want::On {
            anyhow::bail!("--gpu on: gpt-oss runs on the CPU only (the GPU forward has no attention sinks, per-layer sliding windows or biased clamped-SwiGLU experts); use --gpu off");
        }
        off("gpt-oss runs on the CPU only");
        return Ok(false);
    }
    if st.experts().is_some_and(|c| c.prefetching()) {
        if want == Want::On {
            anyhow::bail!("--prefetch with --gpu on: expert prefetch runs only on the CPU path; drop --prefetch or use --gpu off");
        }
        off("--prefetch runs on the CPU path");
        return Ok(false);
    }
    attach(
        model,
        files,
        st,
        want,
        vram,
        staging,
        experts,
        measure_ceiling,
        &off,
    )
}

#[cfg(not(feature = "cuda"))]
#[allow(clippy::too_many_arguments)]
fn attach(
    _: &crate::model::Model<'_>,
    _: &crate::format::ModelFiles,
    _: &mut crate::model::State,
    _: Want,
    _: Option<u64>,
    _: crate::gpu::Staging,
    _: Option<&ExpertArgs>,
    _: bool,
    _: &dyn Fn(&str),
) -> anyhow::Result<bool> {
    Ok(false)
}

#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn attach(
    model: &crate::model::Model<'_>,
    files: &crate::format::ModelFiles,
    st: &mut crate::model::State,
    want: Want,
    vram: Option<u64>,
    staging: crate::gpu::Staging,
    experts: Option<&ExpertArgs>,
    measure_ceiling: bool,
    off: &dyn Fn(&str),
) -> anyhow::Result<bool> {
    use crate::gpu::model::GpuState;
    use crate::gpu::{GpuError, GpuOptions};
    let gb = |b: u64| b as f64 / 1e9;
    if !crate::gpu::driver::present() {
        if want == Want::On {
            anyhow::bail!("--gpu on: no CUDA driver library (libcuda.so) on this machine");
        }
        off("no CUDA driver library on this machine");
        return Ok(false);
    }
    let mut made_cache = false;
    // The VRAM pool stages from the RAM expert cache: when the plan reads experts through the
    // mapped files, give the GPU a RAM cache holding every expert (the plan said they fit).
    if st.experts().is_none() {
        let store = model.expert_store(files)?;
        let max_e = (0..store.n_layers())
            .map(|l| store.n_experts(l))
            .max()
            .unwrap_or(0);
        let mut cfg = crate::experts::CacheConfig::new(max_e.max(1));
        if let Some(io) = experts.and_then(|a| a.io.as_deref()) {
            cfg.io = io
                .parse()
                .map_err(|_| anyhow::anyhow!("--io {io:?}: expected direct, buffered or mmap"))?;
        }
        let cache = crate::experts::ExpertCache::new(store, cfg)?;
        eprintln!(
            "[plan] gpu: experts fit in RAM, so the VRAM pool stages from a RAM cache of every expert ({:.2} GB)",
            gb(cache.slab_bytes())
        );
        st.attach_experts(cache);
        made_cache = true;
    }
    let mut pinned = Vec::new();
    if experts.is_some_and(|a| a.autopin) {
        let id = crate::experts::model_identity(files.paths())?;
        let path = super::common::usage_path(files, &id);
        if let Ok(u) = crate::experts::UsageStats::load(&path, &id) {
            pinned = u.top_n(usize::MAX);
        }
    }
    let opts = GpuOptions {
        vram,
        staging,
        pinned,
    };
    let (mut gs, sum) = match GpuState::attach(model, st, &opts) {
        Ok(x) => x,
        Err(e) => {
            if want == Want::On {
                anyhow::bail!("--gpu on: {e}");
            }
            let why = match e {
                GpuError::NoDriver(m) => m,
                other => other.to_string(),
            };
            off(&format!("{why}; running on the CPU"));
            if made_cache {
                st.detach_experts();
            }
            return Ok(false);
        }
    };
    eprintln!(
        "[plan] gpu: on, {} ({:.1} GB): dense weights {:.2} GB, KV cache {:.2} GB, scratch {:.2} GB resident in VRAM",
        sum.device,
        gb(sum.vram_total as u64),
        gb(sum.weights_bytes as u64),
        gb(sum.kv_bytes as u64),
        gb(sum.scratch_bytes as u64)
    );
    eprintln!(
        "[plan] gpu: VRAM expert pool {:.2} GB = {} slots/layer of {:.1} MB ({} pinned), {:.0}% of all experts ({:.2} GB){}",
        gb(sum.pool_bytes as u64),
        sum.pool_slots_per_layer,
        sum.slot_bytes as f64 / 1e6,
        sum.pool_pinned,
        100.0 * sum.pool_bytes as f64 / (sum.all_experts_bytes as f64).max(1.0),
        gb(sum.all_experts_bytes),
        if vram.is_some() { " (--vram)" } else { " (free VRAM less 1 GiB)" }
    );
    eprintln!(
        "[plan] gpu: staging {} ({})",
        sum.staging,
        match sum.staging {
            crate::gpu::Staging::Arena => "RAM expert cache registered once: copies read it directly",
            crate::gpu::Staging::PerExpert => "each staged expert registered and unregistered around its copy (--gpu-staging, for A/B)",
            crate::gpu::Staging::Pageable => "nothing registered: the driver bounces copies (--gpu-staging, for A/B)",
        }
    );
    if measure_ceiling {
        let c = gs.measure_h2d_ceiling(256 << 20)?;
        eprintln!("[plan] gpu: pinned host->device ceiling {c:.1} GB/s (256 MiB copy, best of 5)");
    }
    st.attach_gpu(gs);
    Ok(true)
}

fn since(
    st: &crate::model::State,
    before: Option<crate::gpu::GpuStats>,
) -> Option<crate::gpu::GpuStats> {
    let s = st.gpu_stats()?;
    Some(before.map_or(s, |b| s.since(&b)))
}

/// One line of GPU figures since `before` (the prefill's end), or None without a GPU.
pub fn gpu_summary(
    st: &crate::model::State,
    before: Option<crate::gpu::GpuStats>,
) -> Option<String> {
    let s = since(st, before)?;
    let ceiling = st.gpu_h2d_ceiling();
    Some(format!(
        "gpu: wall {:.2}s, kernels {:.2}s, stall {:.1}% | vram hit {:.1}% | {} experts copied, {:.2} GB at {:.1} GB/s{} | register {:.3}s",
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
        s.register_secs
    ))
}

/// The GPU figures as JSON (for `--stats-json`).
pub fn gpu_json(
    st: &crate::model::State,
    before: Option<crate::gpu::GpuStats>,
) -> Option<serde_json::Value> {
    let s = since(st, before)?;
    Some(serde_json::json!({
        "wall_s": s.wall_secs,
        "kernel_s": s.kernel_secs,
        "stall_share": s.stall_share(),
        "vram_hit_rate": s.vram_hit_rate(),
        "experts_h2d": s.experts_h2d,
        "bytes_h2d": s.bytes_h2d,
        "copy_s": s.copy_secs,
        "h2d_gb_s": s.h2d_gbps(),
        "h2d_ceiling_gb_s": st.gpu_h2d_ceiling(),
        "register_s": s.register_secs,
    }))
}
