//! Placement: the planner's decisions for a loaded model and their execution — the streamed
//! expert cache (with autopin and usage statistics), attached to a state, and the CUDA backend,
//! returned to the engine that holds it beside the state.
//!
//! Owns: the `[plan]` lines printed at start, the request handed to the planner, usage
//! statistics' path and saving, the GPU attach (CPU fallback with `--gpu auto`). Does not own:
//! the decisions themselves (plan/planner.rs), the cache (experts/), the CUDA backend (gpu/).
//! Invariant: placement never changes what is computed, only where and how fast.

use super::options::{EngineOptions, ExpertOptions, GpuWant};
use super::EngineError;
use crate::experts::{CacheConfig, ExpertCache, Loaded, UsageStats};
use crate::format::ModelFiles;
use crate::model::backend::Device;
use crate::model::{Model, State};
use crate::plan::planner::{self, human, Plan, PlanRequest};

/// Prints a `[plan]` line unless the engine is quiet.
pub(crate) struct Say {
    pub quiet: bool,
}

impl Say {
    pub fn line(&self, s: &str) {
        if !self.quiet {
            eprintln!("{s}");
        }
    }
}

/// MemAvailable from /proc/meminfo, in bytes.
pub fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The planner's request from the options (`autopin`: experts with usage statistics).
pub fn plan_request(a: &ExpertOptions, mtp: usize, autopin: Option<usize>) -> PlanRequest {
    PlanRequest {
        ram: a.ram,
        available: mem_available(),
        mode: a.mode,
        cap: a.cap,
        io: a.io,
        io_threads: a.io_threads,
        autopin,
        pin_bytes: a.pin_bytes,
        mtp,
        prefetch: a.prefetch,
        embedding_in_file: false,
    }
}

/// Where a model's usage statistics live: beside the model if that directory is writable,
/// else in the cache directory, named after the model identity.
pub fn usage_path(files: &ModelFiles, id: &str) -> std::path::PathBuf {
    let name = files
        .paths()
        .first()
        .and_then(|p| p.file_name())
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| "model".into());
    let beside = files.dir().join(format!(".{name}.sluice-usage.json"));
    let writable = std::fs::metadata(files.dir())
        .map(|m| !m.permissions().readonly())
        .unwrap_or(false)
        && std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(files.dir().join(".sluice-write-probe"))
            .map(|_| true)
            .unwrap_or(false);
    let _ = std::fs::remove_file(files.dir().join(".sluice-write-probe"));
    if writable {
        beside
    } else {
        let short: String = id
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .take(24)
            .collect();
        crate::default_model::cache_dir().join(format!("usage-{short}.json"))
    }
}

/// After a run: add this run's selections to the saved usage statistics (unless frozen).
pub fn save_usage(files: &ModelFiles, st: &State, a: &ExpertOptions) -> Result<(), EngineError> {
    let Some(cache) = st.experts() else {
        return Ok(());
    };
    if a.usage_freeze {
        return Ok(());
    }
    let id = crate::experts::model_identity(files.paths())?;
    let path = usage_path(files, &id);
    let mut usage = cache.usage();
    match UsageStats::load_matching(&path, &id, &usage.experts_per_layer()) {
        Loaded::Stats(old) => usage.add(&old)?,
        Loaded::SetAside(bad, why) => eprintln!(
            "[sluice] warning: usage statistics {}: {why}; set aside as {} and started afresh",
            path.display(),
            bad.display()
        ),
        Loaded::Nothing(_) => {}
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| EngineError::Io {
            what: format!("creating {}", dir.display()),
            err: e,
        })?;
    }
    usage.save(&path, &id)?;
    Ok(())
}

/// The machine profile a run uses: the cached one, never a fresh probe (a `[plan]` line says).
fn run_profile(files: &ModelFiles, say: &Say) -> Option<crate::plan::MachineProfile> {
    match planner::cached_profile(files) {
        Some(p) => {
            say.line(&format!(
                "[plan] machine: cached profile {} ({}probed {} s ago)",
                p.key,
                if p.quick { "quick, " } else { "" },
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs())
                    .saturating_sub(p.probed_unix)
            ));
            Some(p)
        }
        None => {
            say.line("[plan] machine: no cached profile for this disk and CPU: default decisions, no prediction (`sluice doctor` or `sluice plan` measure it)");
            None
        }
    }
}

/// On the CPU the token-embedding table is read a row per token: where experts stream it stays
/// in the mapped file and its budget goes to expert slots (`PlanRequest::embedding_in_file`). A
/// GPU run copies the whole table to the device, so it keeps the table resident.
pub fn embedding_in_file(o: &EngineOptions) -> bool {
    o.gpu.want == GpuWant::Off || !crate::gpu::BUILT || !gpu_driver()
}

/// Whether a CUDA driver library can be loaded (false in a build without `cuda`).
fn gpu_driver() -> bool {
    #[cfg(feature = "cuda")]
    {
        crate::gpu::driver::present()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// The automatic `--parallel` (`EngineOptions::resolve_parallel`) capped by memory: slots
/// whose KV caches (each `kv_one` bytes) would take more than an
/// eighth of the budget (`--ram`, else 85% of MemAvailable) are dropped, down to one. Returns
/// the `[plan] parallel:` line that replaces the automatic one when it cut.
pub(crate) fn cap_auto_parallel(o: &mut EngineOptions, kv_one: u64) -> Option<String> {
    if !o.parallel_auto || o.parallel <= 1 || kv_one == 0 {
        return None;
    }
    let budget = o
        .experts
        .ram
        .or_else(|| mem_available().map(|m| m / 100 * 85))?;
    let share = budget / KV_SHARE;
    let fit = (share / kv_one).max(1) as usize;
    if fit >= o.parallel {
        return None;
    }
    let want = o.parallel;
    o.parallel = fit;
    let gb = |b: u64| b as f64 / 1e9;
    Some(format!(
        "[plan] parallel: {fit} sequence slot{} (llama-server's default is {want}, but {want} KV caches of -c positions would take {:.2} GB, over 1/{KV_SHARE} of the budget {:.2} GB; --parallel N or a smaller -c to change)",
        if fit == 1 { "" } else { "s" },
        gb(want as u64 * kv_one),
        gb(budget)
    ))
}

/// The automatic `--parallel`'s KV caches take at most 1/KV_SHARE of the memory budget.
const KV_SHARE: u64 = 8;

/// Decide where experts live, print one `[plan]` line per decision with its reason, and
/// attach a streaming cache to `st` when streaming. Where experts stream and `--parallel` was
/// left out, the slot count is also capped where a slot more stops paying in expert reads
/// (`cap_parallel_by_reads`); then `o.parallel` is lowered and the `[plan] parallel:` line is
/// returned. Returns the plan.
pub(crate) fn place_experts(
    model: &Model<'_>,
    files: &ModelFiles,
    st: &mut State,
    o: &mut EngineOptions,
    say: &Say,
) -> Result<(Plan, Option<String>), EngineError> {
    let a = &o.experts;
    let mut summary = planner::ModelSummary::of(model, files, st)?;
    // --parallel N > 1: N sequence slots, each with a KV cache of the session's size (the
    // session's own is released: its state is only the batched step's buffers).
    if o.parallel > 1 {
        summary.kv_bytes *= o.parallel as u64;
    }
    // Usage statistics first: how many experts could be pinned bounds the pinned tier.
    let mut usage = None;
    if a.autopin {
        let id = crate::experts::model_identity(files.paths())?;
        let path = usage_path(files, &id);
        let store = model.expert_store(files)?;
        let shape: Vec<usize> = (0..store.n_layers()).map(|l| store.n_experts(l)).collect();
        match UsageStats::load_matching(&path, &id, &shape) {
            Loaded::Stats(u) => usage = Some((u, path)),
            Loaded::SetAside(bad, why) => say.line(&format!("[plan] autopin: usage statistics {}: {why}; set aside as {}, so none yet", path.display(), bad.display())),
            Loaded::Nothing(e) => say.line(&format!("[plan] autopin: no usage statistics yet ({e}); run once without --usage-freeze to collect them")),
        }
    }
    let avail = a
        .autopin
        .then(|| usage.as_ref().map_or(0, |(u, _)| u.top_n(usize::MAX).len()));
    let profile = run_profile(files, say);
    let mut req = plan_request(a, o.mtp, avail);
    req.embedding_in_file = embedding_in_file(o);
    let slots = |n: usize| format!("{n} sequence slot{}", if n == 1 { "" } else { "s" });
    let mut parallel_line = None;
    let kv_one = summary.kv_bytes / o.parallel.max(1) as u64;
    let mut plan = match planner::plan(&summary, profile.as_ref(), &req) {
        Err(planner::PlanError::Impossible(why)) if o.parallel_auto && o.parallel > 1 => {
            // The automatic slots' KV caches leave no room: as many as still fit.
            let want = o.parallel;
            let mut fit = None;
            for n in (1..want).rev() {
                summary.kv_bytes = kv_one * n as u64;
                if let Ok(p) = planner::plan(&summary, profile.as_ref(), &req) {
                    fit = Some((n, p));
                    break;
                }
            }
            let Some((n, p)) = fit else {
                return Err(planner::PlanError::Impossible(why).into());
            };
            o.parallel = n;
            parallel_line = Some(format!(
                "[plan] parallel: {} (with {want}, {why}; --parallel N overrides)",
                slots(n)
            ));
            p
        }
        r => r?,
    };
    // Batch size follows the bottleneck: where experts stream and decode waits on the disk
    // (or no bandwidth is known), fewer slots when more stop paying in expert reads.
    let disk_waits = plan.stream && (plan.disk_bound || plan.disk_gbps.is_none());
    if !o.parallel_auto && o.parallel > 1 && disk_waits {
        // The flag wins; say what the expert reads alone would have chosen.
        let d = cap_parallel_by_reads(&plan, o.parallel, kv_one, req.cap.is_some());
        if d.n < o.parallel {
            say.line(&format!(
                "[plan] note: --parallel {} kept; left out, the automatic count would be {} ({})",
                o.parallel,
                slots(d.n),
                d.reason
            ));
        }
    }
    if o.parallel_auto && o.parallel > 1 && disk_waits {
        let d = cap_parallel_by_reads(&plan, o.parallel, kv_one, req.cap.is_some());
        let capped = d.n < o.parallel;
        if capped {
            // The KV caches of the dropped slots go to the expert cache.
            o.parallel = d.n;
            summary.kv_bytes = kv_one * d.n as u64;
            plan = planner::plan(&summary, profile.as_ref(), &req)?;
        }
        // (Uncapped, a line on slots the KV caches already cut stays.)
        if capped || parallel_line.is_none() {
            parallel_line = Some(format!("[plan] parallel: {} ({})", slots(d.n), d.reason));
        }
    }
    let a = &o.experts;
    for l in plan.lines() {
        say.line(&l);
    }
    if !plan.stream {
        if a.verify_experts {
            return Err(EngineError::Refused {
                flag: "--verify-experts".into(),
                reason:
                    "experts are checked as the streamed cache reads them; add --experts stream"
                        .into(),
            });
        }
        if let Some(p) = &a.route_trace {
            return Err(EngineError::Refused {
                flag: format!("--route-trace {}", p.display()),
                reason: "routes are traced by the streamed expert cache; add --experts stream"
                    .into(),
            });
        }
        return Ok((plan, parallel_line));
    }
    let store = model.expert_store(files)?;
    let mut pinned = Vec::new();
    if let Some((u, path)) = &usage {
        pinned = u.top_n(plan.pinned);
        say.line(&format!(
            "[plan] autopin: {} most-selected experts ({}) from {}",
            pinned.len(),
            human(pinned.len() as u64 * store.slot_bytes()),
            path.display()
        ));
    }
    let mut cfg = CacheConfig::new(plan.slots_per_layer);
    cfg.pinned = pinned;
    cfg.io = plan.io_mode();
    cfg.io_threads = plan.io_threads;
    cfg.policy = a.policy;
    cfg.trace = a.route_trace.clone();
    cfg.prefetch = plan.prefetch;
    let mut cache = ExpertCache::new(store, cfg)?;
    if a.verify_experts {
        let id = crate::experts::model_identity(files.paths())?;
        let path = usage_path(files, &id).with_extension("expert-hashes.json");
        let (h, computed) =
            crate::experts::ExpertHashes::load_or_compute(&path, &id, files, &model.expert_locs())?;
        say.line(&format!(
            "[plan] verify-experts: hashes {} {}",
            if computed {
                "computed and saved to"
            } else {
                "from"
            },
            path.display()
        ));
        cache.set_verify(h);
    }
    say.line(&format!(
        "[plan] experts: streamed, {} slots/layer of {}, {} policy, slab {} (pinned + evictable), io {} x{}",
        cache.slots(model.cfg.n_dense_layers),
        human(cache.slot_bytes()),
        cache.policy().name(),
        human(cache.slab_bytes()),
        cache.io_mode().name(),
        plan.io_threads
    ));
    for n in cache.notes() {
        say.line(&format!("[plan] note: {n}"));
    }
    // Keep the resident (non-expert) weights in memory while experts stream past them.
    // Every routed tensor begins with some expert's part (expert 0's slice of a 3-D tensor, a
    // per-expert tensor, the gate half of a fused gate_up): those starts identify them.
    let expert_starts: std::collections::HashSet<(usize, u64)> = model
        .expert_locs()
        .iter()
        .flatten()
        .flat_map(|l| l.parts.iter().map(|p| (p.file, p.offset)))
        .collect();
    // The token-embedding table left in the file (plan.embedding_in_file) is not locked: a
    // token faults in the page of its row, alone (MADV_RANDOM).
    let in_file = |name: &str| plan.embedding_in_file && planner::is_embedding_table(name);
    for t in files.tensors().iter().filter(|t| in_file(&t.name)) {
        if let Err(e) = files
            .range_bytes(t.range)
            .map_err(|e| e.to_string())
            .and_then(crate::experts::advise_random)
        {
            say.line(&format!("[plan] note: {e}"));
        }
    }
    let resident: Vec<&[u8]> = files
        .tensors()
        .iter()
        .filter(|t| !expert_starts.contains(&(t.range.file, t.range.offset)))
        .filter(|t| !in_file(&t.name))
        .filter_map(|t| files.range_bytes(t.range).ok())
        .collect();
    match crate::experts::lock_resident(&resident) {
        Ok(b) => say.line(&format!(
            "[plan] resident weights locked in memory ({})",
            human(b)
        )),
        Err(e) => say.line(&format!("[plan] note: {e}")),
    }
    st.attach_experts(cache);
    Ok((plan, parallel_line))
}

/// The automatic slot count where experts stream: the planner's cost of 1..=`parallel` slots
/// (plan/parallel.rs) over the expert cache `plan` sized for `parallel` KV caches of `kv_one`
/// bytes each, a dropped slot's KV cache becoming expert cache slots (unless `--cap` fixed
/// them).
fn cap_parallel_by_reads(
    plan: &Plan,
    parallel: usize,
    kv_one: u64,
    cap_fixed: bool,
) -> crate::plan::parallel::SlotDecision {
    use crate::plan::parallel::{decide, slot_costs, SlotInputs, DEFAULT_REUSE, TOLERANCE};
    let m = &plan.model;
    let layers = m.moe_layers.max(1) as f64;
    let base = plan.slots_per_layer as f64 + plan.pinned as f64 / layers;
    let freed = |n: usize| -> f64 {
        if cap_fixed || m.slot_bytes == 0 {
            return 0.0;
        }
        ((parallel - n) as f64 * kv_one as f64 / (m.slot_bytes as f64 * layers)).floor()
    };
    let cache = (1..=parallel).map(|n| base + freed(n)).collect();
    let inputs = SlotInputs {
        moe_layers: m.moe_layers,
        experts_per_layer: m.experts_per_layer,
        top_k: m.top_k,
        slot_bytes: m.slot_bytes,
        cache_per_layer: cache,
        reuse: DEFAULT_REUSE,
    };
    decide(&slot_costs(&inputs), TOLERANCE)
}

/// Decides CPU or GPU for `st` and, for the GPU, attaches the CUDA backend (after
/// `place_experts`, whose RAM expert cache the VRAM pool stages from). Returns the device
/// backend the engine runs the forward on (None: the CPU). Combinations `--gpu on` cannot
/// honour were refused by `EngineOptions::check`; with `--gpu auto` they print why the CPU
/// runs.
pub(crate) fn place_gpu(
    model: &Model<'_>,
    files: &ModelFiles,
    st: &mut State,
    o: &EngineOptions,
    plan: &Plan,
    say: &Say,
) -> Result<Option<Box<dyn Device>>, EngineError> {
    let off = |why: &str| say.line(&format!("[plan] gpu: off ({why})"));
    let want = o.gpu.want;
    if want == GpuWant::Off {
        off("--gpu off");
        return Ok(None);
    }
    if !crate::gpu::BUILT {
        off("this build has no `cuda` feature");
        return Ok(None);
    }
    if let Some(why) = crate::gpu::refusal(&model.cfg, st.ctx()) {
        off(&why);
        return Ok(None);
    }
    if let Some(why) = o.gpu_off_reason() {
        off(why);
        return Ok(None);
    }
    if st.experts().is_some_and(|c| c.prefetching()) {
        // The planner turned prefetch on by default.
        if want == GpuWant::On {
            return Err(EngineError::Refused {
                flag: "--gpu on".into(),
                reason: "expert prefetch (the plan's default here) runs only on the CPU path; add --prefetch=off or use --gpu off".into(),
            });
        }
        off("--prefetch runs on the CPU path");
        return Ok(None);
    }
    let dev = attach(model, files, st, o, plan, &off)?;
    if dev.is_some() && st.kv_types() != crate::model::KvTypes::F32 {
        // The device keeps its own cache: f32 storage, the f16 sides' values rounded to f16.
        say.line(&format!(
            "[plan] kv cache types on the GPU: keys {}, values {} (f16 numbers in f32 storage, as the CPU's f16 cache holds them)",
            st.kv_types().k,
            st.kv_types().v
        ));
    }
    Ok(dev)
}

#[cfg(not(feature = "cuda"))]
fn attach(
    _: &Model<'_>,
    _: &ModelFiles,
    _: &mut State,
    _: &EngineOptions,
    _: &Plan,
    _: &dyn Fn(&str),
) -> Result<Option<Box<dyn Device>>, EngineError> {
    Ok(None)
}

#[cfg(feature = "cuda")]
fn attach(
    model: &Model<'_>,
    files: &ModelFiles,
    st: &mut State,
    o: &EngineOptions,
    plan: &Plan,
    off: &dyn Fn(&str),
) -> Result<Option<Box<dyn Device>>, EngineError> {
    use crate::gpu::model::GpuState;
    use crate::gpu::{GpuError, GpuOptions};
    let gb = |b: u64| b as f64 / 1e9;
    let want = o.gpu.want;
    let vram = o.gpu.vram;
    let gpu_err = |reason: String| EngineError::Refused {
        flag: "--gpu on".into(),
        reason,
    };
    if !crate::gpu::driver::present() {
        if want == GpuWant::On {
            return Err(gpu_err(
                "no CUDA driver library (libcuda.so) on this machine".into(),
            ));
        }
        off("no CUDA driver library on this machine");
        return Ok(None);
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
        let mut cfg = CacheConfig::new(max_e.max(1));
        // The plan's IO (the one `--io` parse, O_DIRECT checked there).
        cfg.io = plan.io_mode();
        // With preload on, every expert is the cache's pinned tier, read by `new` (at load, as
        // llama.cpp reads its weights), not by the first prompt: a 489-token prompt with a
        // quarter of the experts in VRAM spent most of its second reading the rest
        // (docs/PERFORMANCE.md, session 36).
        if o.gpu.preload {
            cfg.pinned = (0..store.n_layers())
                .flat_map(|l| (0..store.n_experts(l)).map(move |e| (l, e)))
                .collect();
        }
        let cache = ExpertCache::new(store, cfg)?;
        if !o.quiet {
            let s = cache.stats();
            let read = if o.gpu.preload {
                format!(
                    ", read at load: {} experts in {:.2} s (--gpu-preload off reads each when a token first needs it)",
                    cache.n_pinned(),
                    s.pin_load_secs
                )
            } else {
                String::new()
            };
            eprintln!(
                "[plan] gpu: experts fit in RAM, so the VRAM pool stages from a RAM cache of every expert ({:.2} GB){read}",
                gb(cache.slab_bytes())
            );
        }
        st.attach_experts(cache);
        made_cache = true;
    }
    let mut pinned = Vec::new();
    if o.experts.autopin {
        let id = crate::experts::model_identity(files.paths())?;
        let path = usage_path(files, &id);
        if let Ok(u) = UsageStats::load(&path, &id) {
            pinned = u.top_n(usize::MAX);
        }
    }
    let opts = GpuOptions {
        vram,
        staging: o.gpu.staging,
        pinned,
    };
    let (mut gs, sum) = match GpuState::attach(model, st, &opts) {
        Ok(x) => x,
        Err(e) => {
            if want == GpuWant::On {
                return Err(gpu_err(e.to_string()));
            }
            let why = match e {
                GpuError::NoDriver(m) => m,
                other => other.to_string(),
            };
            off(&format!("{why}; running on the CPU"));
            if made_cache {
                st.detach_experts();
            }
            return Ok(None);
        }
    };
    let say = Say { quiet: o.quiet };
    say.line(&format!(
        "[plan] gpu: on, {} ({:.1} GB): dense weights {:.2} GB, KV cache {:.2} GB{}, scratch {:.2} GB resident in VRAM",
        sum.device,
        gb(sum.vram_total as u64),
        gb(sum.weights_bytes as u64),
        gb(sum.kv_bytes as u64),
        if sum.kv_half { " (stored as f16)" } else { "" },
        gb(sum.scratch_bytes as u64)
    ));
    say.line(&format!(
        "[plan] gpu: VRAM expert pool {:.2} GB = {} slots/layer of {:.1} MB ({} pinned), {:.0}% of all experts ({:.2} GB){}",
        gb(sum.pool_bytes as u64),
        sum.pool_slots_per_layer,
        sum.slot_bytes as f64 / 1e6,
        sum.pool_pinned,
        100.0 * sum.pool_bytes as f64 / (sum.all_experts_bytes as f64).max(1.0),
        gb(sum.all_experts_bytes),
        if vram.is_some() { " (--vram)" } else { " (free VRAM less 1 GiB)" }
    ));
    say.line(&format!(
        "[plan] gpu: staging {} ({})",
        sum.staging,
        match sum.staging {
            crate::gpu::Staging::Arena => "RAM expert cache registered once: copies read it directly",
            crate::gpu::Staging::PerExpert => "each staged expert registered and unregistered around its copy (--gpu-staging, for A/B)",
            crate::gpu::Staging::Pageable => "nothing registered: the driver bounces copies (--gpu-staging, for A/B)",
        }
    ));
    gpu_experts(model, files, &mut gs, o, &sum, &say)?;
    if !o.gpu.preload {
        say.line("[plan] gpu: preload off (--gpu-preload off): experts are staged when a token first needs them");
    } else if sum.pool_bytes as u64 >= sum.all_experts_bytes {
        let t = std::time::Instant::now();
        let n = gs.preload_experts(model, st)?;
        say.line(&format!(
            "[plan] gpu: preloaded all {n} routed experts ({:.2} GB) into the VRAM pool in {:.2}s (it has a slot for each; --gpu-preload off stages them on first use)",
            gb(sum.all_experts_bytes),
            t.elapsed().as_secs_f64()
        ));
    } else {
        say.line("[plan] gpu: no preload (the VRAM pool holds only part of the experts: misses are placed as tokens need them, per the gpu-experts line)");
    }
    if o.measure_h2d {
        let c = gs.measure_h2d_ceiling(256 << 20)?;
        say.line(&format!(
            "[plan] gpu: pinned host->device ceiling {c:.1} GB/s (256 MiB copy, best of 5)"
        ));
    }
    Ok(Some(Box::new(gs)))
}

/// See `Engine::check_disk_profile`. Only O_DIRECT reads count (buffered ones may come from
/// the page cache, which says nothing about the disk).
pub fn check_disk_profile(files: &ModelFiles, st: &State) -> Option<String> {
    let cache = st.experts()?;
    if cache.io_mode() != crate::experts::IoMode::Direct {
        return None;
    }
    let s = cache.stats();
    let o = crate::plan::ProbeOptions::for_model(files);
    let cpu = crate::plan::probe_cpu::probe();
    let key = crate::plan::profile_key(&o.storage_dir, &cpu).ok()?;
    let path = crate::plan::profile_path(&o.cache_dir, &key);
    let mut p = crate::plan::read_profile(&path).filter(|p| p.key == key && p.cpu == cpu)?;
    let before = p.storage.raised_by_run.clone();
    let line = p.check_run_reads(cache.slot_bytes(), s.bytes_read, s.read_secs)?;
    if p.storage.raised_by_run != before {
        if let Err(e) = crate::plan::write_profile(&path, &p) {
            return Some(format!("[plan] {line} (saving {}: {e})", path.display()));
        }
    }
    Some(format!("[plan] {line}"))
}

/// Where VRAM-pool misses run (`--gpu-experts`, plan/gpu_experts.rs): the choice from the
/// measured costs of copying an expert (doctor's pinned host->device figure, else timed now)
/// and of the CPU's products of one (timed now on the model's experts), printed as a
/// `[plan] gpu-experts:` line and set on the device.
#[cfg(feature = "cuda")]
fn gpu_experts(
    model: &Model<'_>,
    files: &ModelFiles,
    gs: &mut crate::gpu::model::GpuState,
    o: &EngineOptions,
    sum: &crate::gpu::model::GpuSummary,
    say: &Say,
) -> Result<(), EngineError> {
    use crate::plan::gpu_experts::{decide, ExpertsInputs, GpuExperts};
    let holds_all = sum.pool_bytes as u64 >= sum.all_experts_bytes;
    let cpu_refusal = crate::gpu::cpu_experts::cpu_refusal(model);
    let weigh = !holds_all && o.gpu.experts != Some(GpuExperts::Stage) && cpu_refusal.is_none();
    let mut h2d = None;
    let mut cpu = None;
    if weigh {
        h2d = planner::cached_profile(files).and_then(|p| {
            p.gpu
                .h2d
                .map(|c| (c.pinned_gbps, "doctor's profile".to_string()))
        });
        if h2d.is_none() {
            let g = gs.measure_h2d_ceiling(64 << 20)?;
            h2d = Some((g, "timed at start, 64 MiB pinned".into()));
        }
        cpu = crate::gpu::cpu_experts::measure_cpu_expert(model);
    }
    let choice = decide(&ExpertsInputs {
        want: o.gpu.experts,
        pool_holds_all: holds_all,
        expert_bytes: sum.slot_bytes,
        h2d,
        cpu,
        cpu_refusal,
    })
    .map_err(|reason| EngineError::Refused {
        flag: "--gpu-experts".into(),
        reason,
    })?;
    say.line(&choice.line());
    // Stage: misses staged through the same waves (a few slots turn over, the pool keeping
    // the experts selected most); vram: the pool holds every expert, nothing to place.
    let m = match choice.mode {
        GpuExperts::Hybrid => Some(choice.cpu_max_tokens),
        GpuExperts::Stage => Some(0),
        GpuExperts::Vram => None,
    };
    gs.set_cpu_misses(model, m)?;
    Ok(())
}
