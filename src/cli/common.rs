//! Arguments shared by the commands that load a model and generate.

use crate::format::ModelFiles;
use crate::model::{LoadOptions, Model, ModelConfig};
use crate::sample::SamplingParams;
use clap::Args;

/// Model-loading and compute options (llama.cpp spellings).
#[derive(Args, Debug, Clone)]
pub struct ComputeArgs {
    /// Compute threads (default: all cores).
    #[arg(short = 't', long = "threads", default_value_t = 0)]
    pub threads: usize,
    /// Context length in tokens (KV cache size). Default: the model's own context length, at
    /// most 4096. More than the model's context length runs with a warning (as llama.cpp).
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx: Option<usize>,
    /// Prompt tokens per prefill batch.
    #[arg(short = 'b', long = "batch-size", default_value_t = 128)]
    pub batch: usize,
}

impl ComputeArgs {
    /// The context length to run with, for a model whose hyperparameters are `cfg`: `-c`, else
    /// the model's own context length capped at 4096 (and at DeepSeek-V3.2's dense limit), and
    /// at least `need` tokens. A context beyond the model's own length runs, with a one-line
    /// warning on stderr (llama.cpp does the same): positions past it were never trained.
    pub fn ctx_for(&self, cfg: &ModelConfig, need: usize) -> anyhow::Result<usize> {
        let max = cfg.train_ctx;
        if self.ctx == Some(0) {
            anyhow::bail!("-c 0: the context must hold at least one token");
        }
        let auto = max
            .min(4096)
            .min(cfg.dense_attn_limit.unwrap_or(usize::MAX));
        let ctx = self.ctx.unwrap_or(auto).max(need);
        if ctx > max {
            eprintln!(
                "[sluice] warning: context {ctx} is more than the model's context length (max_position_embeddings / context_length), {max}: positions past it were not trained"
            );
        }
        Ok(ctx)
    }

    /// Read the model's hyperparameters, settle the context length (`ctx_for`) and load the
    /// model with rotary tables for it.
    pub fn load<'a>(
        &self,
        files: &'a ModelFiles,
        need: usize,
    ) -> anyhow::Result<(Model<'a>, usize)> {
        let cfg = ModelConfig::from_files(files)?;
        let ctx = self.ctx_for(&cfg, need)?;
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let (threads, warning) = super::limits::threads(self.threads, cpus);
        if let Some(w) = warning {
            eprintln!("{w}");
        }
        super::limits::ctx_and_batch(ctx, self.batch, &cfg, mem_available())
            .map_err(anyhow::Error::msg)?;
        let model = Model::load(files, &LoadOptions { threads, ctx })?;
        Ok((model, ctx))
    }
}

/// Sampling options (llama.cpp spellings and defaults).
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Nucleus sampling threshold (1.0 = off).
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens below min_p x the top probability (0 = off).
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalty for tokens among the last `--repeat-last-n` (1.0 = off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed (default: fixed 0xC0FFEE, so runs repeat; pass your own to vary).
    #[arg(long, default_value_t = 0xC0FFEE)]
    pub seed: u64,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed,
        }
    }
}

/// Where routed experts live and how they are read (issue: streaming expert cache).
#[derive(Args, Debug, Clone)]
pub struct ExpertArgs {
    /// auto | resident | stream. `resident` reads experts through the mapped files (the OS
    /// page cache decides what stays); `stream` reads them into sluice's own bounded cache.
    /// `auto` streams when the model does not fit in `--ram`.
    #[arg(long = "experts", default_value = "auto")]
    pub mode: String,
    /// Memory budget for everything (resident weights, KV cache, expert cache), e.g. 24G.
    /// Default: 85% of MemAvailable.
    #[arg(long)]
    pub ram: Option<String>,
    /// Evictable expert slots per MoE layer (default: what the budget holds).
    #[arg(long)]
    pub cap: Option<usize>,
    /// direct | buffered | mmap (direct falls back to buffered where O_DIRECT is refused).
    /// Default: the planner's (direct where O_DIRECT works).
    #[arg(long)]
    pub io: Option<String>,
    /// Reader threads (default: the planner's, from the probed disk ceiling; 4 without one).
    #[arg(long = "io-threads")]
    pub io_threads: Option<usize>,
    /// Eviction policy: hotness (selection counts halved every `--halve-every` tokens; the
    /// default: it beat LRU on recorded traces, see docs/PERFORMANCE.md) | lru.
    #[arg(long, default_value = "hotness")]
    pub policy: String,
    #[arg(long = "halve-every", default_value_t = 64)]
    pub halve_every: u64,
    /// Write (token, layer, experts) per MoE step to FILE for `sluice cache-sim`.
    #[arg(long = "route-trace")]
    pub route_trace: Option<std::path::PathBuf>,
    /// Pin the most-selected experts (from earlier runs' usage statistics) up to `--pin-gb`.
    #[arg(long)]
    pub autopin: bool,
    /// Share of the expert budget the pinned tier may take (default: half; the LRU tier keeps
    /// at least one slot per layer).
    #[arg(long = "pin-gb")]
    pub pin_gb: Option<f64>,
    /// Read usage statistics but never write them (for benchmarks).
    #[arg(long = "usage-freeze")]
    pub usage_freeze: bool,
    /// Check every streamed expert read against a hash recorded per expert (computed once,
    /// kept beside the usage statistics): a corrupt expert stops the run with an error.
    #[arg(long = "verify-experts")]
    pub verify_experts: bool,
    /// Print where decode time went (attention, expert wait, expert compute, lm_head, other)
    /// and a verdict (I/O-bound, compute-bound, balanced).
    #[arg(long)]
    pub prof: bool,
    /// Write the run's figures as JSON to FILE.
    #[arg(long = "stats-json")]
    pub stats_json: Option<std::path::PathBuf>,
    /// Predict each MoE layer's experts from the previous layer (its router applied after that
    /// layer's attention) and start their reads early. `--prefetch` = on, `--prefetch=off`;
    /// default: the planner's.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "on", value_name = "on|off")]
    pub prefetch: Option<String>,
}

/// Where a model's usage statistics live: beside the model if that directory is writable,
/// else in the cache directory, named after the model identity.
pub fn usage_path(files: &crate::format::ModelFiles, id: &str) -> std::path::PathBuf {
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
pub fn save_usage(
    files: &crate::format::ModelFiles,
    st: &crate::model::State,
    a: &ExpertArgs,
) -> anyhow::Result<()> {
    let Some(cache) = st.experts() else {
        return Ok(());
    };
    if a.usage_freeze {
        return Ok(());
    }
    let id = crate::experts::model_identity(files.paths())?;
    let path = usage_path(files, &id);
    let mut usage = cache.usage();
    match crate::experts::UsageStats::load_matching(&path, &id, &usage.experts_per_layer()) {
        crate::experts::Loaded::Stats(old) => usage.add(&old)?,
        crate::experts::Loaded::SetAside(bad, why) => eprintln!(
            "[sluice] warning: usage statistics {}: {why}; set aside as {} and started afresh",
            path.display(),
            bad.display()
        ),
        crate::experts::Loaded::Nothing(_) => {}
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    usage.save(&path, &id)?;
    Ok(())
}

/// Parse sizes like `24G`, `512M`, `1.5GiB`, `1000000` (bytes).
pub fn parse_size(s: &str) -> anyhow::Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.trim().parse().map_err(|_| {
        anyhow::anyhow!("size {s:?}: expected a number with an optional K/M/G/T suffix")
    })?;
    let mul = match unit
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 1.0,
        "K" => 1024.0,
        "M" => 1024.0 * 1024.0,
        "G" => 1024.0 * 1024.0 * 1024.0,
        "T" => 1024.0f64.powi(4),
        _ => anyhow::bail!("size {s:?}: unknown unit {unit:?}"),
    };
    if v.is_nan() || v < 0.0 {
        anyhow::bail!("size {s:?} must be positive");
    }
    Ok((v * mul) as u64)
}

/// MemAvailable from /proc/meminfo, in bytes.
pub fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

use crate::plan::planner::human;

/// Decide where experts live, print one `[plan]` line per decision with its reason, and
/// attach a streaming cache to `st` when streaming. Returns the plan (for predicted vs measured).
pub fn setup_experts(
    model: &crate::model::Model<'_>,
    files: &crate::format::ModelFiles,
    st: &mut crate::model::State,
    a: &ExpertArgs,
) -> anyhow::Result<crate::plan::planner::Plan> {
    setup_experts_mtp(model, files, st, a, 0)
}

/// The planner's request from the flags (`autopin`: experts with usage statistics, if asked).
pub fn plan_request(
    a: &ExpertArgs,
    mtp: usize,
    autopin: Option<usize>,
) -> anyhow::Result<crate::plan::planner::PlanRequest> {
    use crate::plan::planner::{ExpertMode, PlanRequest};
    let io = match &a.io {
        Some(s) => Some(
            s.parse::<crate::experts::IoMode>()
                .map_err(|_| anyhow::anyhow!("--io {s:?}: expected direct, buffered or mmap"))?,
        ),
        None => None,
    };
    Ok(PlanRequest {
        ram: a.ram.as_deref().map(parse_size).transpose()?,
        available: mem_available(),
        mode: ExpertMode::parse(&a.mode)?,
        cap: a.cap,
        io,
        io_threads: a.io_threads,
        autopin,
        pin_bytes: a.pin_gb.map(|g| (g * 1e9) as u64),
        mtp,
        prefetch: match a.prefetch.as_deref() {
            None => None,
            Some("on") => Some(true),
            Some("off") => Some(false),
            Some(other) => anyhow::bail!("--prefetch={other}: expected on or off"),
        },
    })
}

/// The machine profile `run` uses: the cached one, never a fresh probe (a `[plan]` line says).
pub fn run_profile(files: &crate::format::ModelFiles) -> Option<crate::plan::MachineProfile> {
    match crate::plan::planner::cached_profile(files) {
        Some(p) => {
            eprintln!(
                "[plan] machine: cached profile {} ({}probed {} s ago)",
                p.key,
                if p.quick { "quick, " } else { "" },
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs())
                    .saturating_sub(p.probed_unix)
            );
            Some(p)
        }
        None => {
            eprintln!("[plan] machine: no cached profile for this disk and CPU: default decisions, no prediction (`sluice doctor` or `sluice plan` measure it)");
            None
        }
    }
}

/// `setup_experts` with `--mtp K` taken into account by the planner.
pub fn setup_experts_mtp(
    model: &crate::model::Model<'_>,
    files: &crate::format::ModelFiles,
    st: &mut crate::model::State,
    a: &ExpertArgs,
    mtp: usize,
) -> anyhow::Result<crate::plan::planner::Plan> {
    use crate::experts::{CacheConfig, Policy};
    let summary = crate::plan::planner::ModelSummary::of(model, files, st.kv_bytes() as u64)?;
    let policy =
        Policy::parse(&a.policy, a.halve_every).map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
    // Usage statistics first: how many experts could be pinned bounds the pinned tier.
    let mut usage = None;
    if a.autopin {
        let id = crate::experts::model_identity(files.paths())?;
        let path = usage_path(files, &id);
        let store = model.expert_store(files)?;
        let shape: Vec<usize> = (0..store.n_layers()).map(|l| store.n_experts(l)).collect();
        match crate::experts::UsageStats::load_matching(&path, &id, &shape) {
            crate::experts::Loaded::Stats(u) => usage = Some((u, path)),
            crate::experts::Loaded::SetAside(bad, why) => eprintln!("[plan] autopin: usage statistics {}: {why}; set aside as {}, so none yet", path.display(), bad.display()),
            crate::experts::Loaded::Nothing(e) => eprintln!("[plan] autopin: no usage statistics yet ({e}); run once without --usage-freeze to collect them"),
        }
    }
    let avail = a
        .autopin
        .then(|| usage.as_ref().map_or(0, |(u, _)| u.top_n(usize::MAX).len()));
    let profile = run_profile(files);
    let req = plan_request(a, mtp, avail)?;
    let plan = crate::plan::planner::plan(&summary, profile.as_ref(), &req)?;
    for l in plan.lines() {
        eprintln!("{l}");
    }
    if !plan.stream {
        if a.verify_experts {
            anyhow::bail!(
                "--verify-experts checks experts as the streamed cache reads them; add --experts stream"
            );
        }
        if let Some(p) = &a.route_trace {
            anyhow::bail!(
                "--route-trace {}: routes are traced by the streamed expert cache; add --experts stream",
                p.display()
            );
        }
        return Ok(plan);
    }
    let store = model.expert_store(files)?;
    let mut pinned = Vec::new();
    if let Some((u, path)) = &usage {
        pinned = u.top_n(plan.pinned);
        eprintln!(
            "[plan] autopin: {} most-selected experts ({}) from {}",
            pinned.len(),
            human(pinned.len() as u64 * store.slot_bytes()),
            path.display()
        );
    }
    let mut cfg = CacheConfig::new(plan.slots_per_layer);
    cfg.pinned = pinned;
    cfg.io = plan.io_mode();
    cfg.io_threads = plan.io_threads;
    cfg.policy = policy;
    cfg.trace = a.route_trace.clone();
    cfg.prefetch = plan.prefetch;
    let mut cache = crate::experts::ExpertCache::new(store, cfg)?;
    if a.verify_experts {
        let id = crate::experts::model_identity(files.paths())?;
        let path = usage_path(files, &id).with_extension("expert-hashes.json");
        let (h, computed) =
            crate::experts::ExpertHashes::load_or_compute(&path, &id, files, &model.expert_locs())?;
        eprintln!(
            "[plan] verify-experts: hashes {} {}",
            if computed {
                "computed and saved to"
            } else {
                "from"
            },
            path.display()
        );
        cache.set_verify(h);
    }
    eprintln!(
        "[plan] experts: streamed, {} slots/layer of {}, {} policy, slab {} (pinned + evictable), io {} x{}",
        cache.slots(model.cfg.n_dense_layers),
        human(cache.slot_bytes()),
        cache.policy().name(),
        human(cache.slab_bytes()),
        cache.io_mode().name(),
        plan.io_threads
    );
    for n in cache.notes() {
        eprintln!("[plan] note: {n}");
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
    let resident: Vec<&[u8]> = files
        .tensors()
        .iter()
        .filter(|t| !expert_starts.contains(&(t.range.file, t.range.offset)))
        .filter_map(|t| files.range_bytes(t.range).ok())
        .collect();
    match crate::experts::lock_resident(&resident) {
        Ok(b) => eprintln!("[plan] resident weights locked in memory ({})", human(b)),
        Err(e) => eprintln!("[plan] note: {e}"),
    }
    st.attach_experts(cache);
    Ok(plan)
}

/// After a run: `[plan] predicted X–Y tok/s, measured Z tok/s`.
pub fn predicted_vs_measured(plan: &crate::plan::planner::Plan, measured: f64) -> String {
    match plan.predicted_tok_s {
        Some((lo, hi)) => {
            format!("[plan] predicted {lo:.2}–{hi:.2} tok/s, measured {measured:.2} tok/s")
        }
        None => {
            format!("[plan] predicted unknown (no machine profile), measured {measured:.2} tok/s")
        }
    }
}

/// The cache's figures since `before` (the prefill's end), i.e. decode only.
fn decode_stats(
    st: &crate::model::State,
    before: Option<crate::experts::CacheStats>,
) -> Option<crate::experts::CacheStats> {
    st.expert_stats().map(|s| before.map_or(s, |b| s.since(&b)))
}

/// The process's peak resident set (VmHWM), in bytes.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// The run's figures as JSON (`--stats-json`).
pub fn stats_json(st: &crate::model::State, g: &crate::generate::GenStats) -> serde_json::Value {
    // With MTP a decode forward emits several tokens: per-token figures divide by tokens.
    let mtp = g.mtp_drafted > 0;
    let decoded = if mtp {
        g.generated.saturating_sub(1)
    } else {
        g.decode_steps
    };
    let mut v = serde_json::json!({
        "tokens": g.generated,
        "prompt_tokens": g.prompt_tokens,
        "decode_tok_s": if mtp { g.gen_tps() } else { g.decode_tps() },
        "prefill_tok_s": g.prefill_tps(),
        "experts_per_token": g.experts_per_token,
        "experts_per_token_without_mtp": g.experts_per_token_plain,
    });
    if mtp {
        v["mtp_drafted"] = g.mtp_drafted.into();
        v["mtp_accepted"] = g.mtp_accepted.into();
        v["mtp_acceptance"] = g.mtp_acceptance().into();
        v["decode_forwards"] = g.decode_steps.into();
        v["tokens_per_forward"] = g.tokens_per_forward().into();
        v["experts_per_token_main"] = g.mtp_experts_main_per_token.into();
        v["experts_per_token_mtp_head"] = g.mtp_experts_head_per_token.into();
    }
    if let Some(s) = decode_stats(st, g.experts_after_prefill) {
        let req = s.requests().max(1) as f64;
        let steps = decoded.max(1) as f64;
        v["hit_rate"] = s.hit_rate().into();
        v["hit_pin"] = (s.hits_pin as f64 / req).into();
        v["hit_lru"] = (s.hits_lru as f64 / req).into();
        v["experts_read_per_token"] = (s.misses as f64 / steps).into();
        v["bytes_read"] = s.bytes_read.into();
        v["read_gb_s"] = (gb(s.bytes_read) / s.read_secs.max(1e-9)).into();
        v["prefetch"] = st.experts().is_some_and(|c| c.prefetching()).into();
        v["predicted"] = s.predicted.into();
        v["prefetched"] = s.prefetched.into();
        v["prefetch_used"] = s.prefetch_used.into();
        v["prefetch_precision"] = s.prefetch_precision().into();
        v["prefetch_recall"] = s.prefetch_recall().into();
    }
    v["time_shares"] = time_shares(st).0;
    if let Some(gj) = super::gpu::gpu_json(st, g.gpu_after_prefill) {
        v["gpu"] = gj;
    }
    if let Some(b) = peak_rss_bytes() {
        v["peak_rss_bytes"] = b.into();
    }
    v
}

/// Time shares of the whole run (prefill and decode): expert-disk wait, expert compute (the
/// MoE blocks minus the wait), attention, lm_head, other. Returns (shares line, verdict line).
pub fn time_shares(st: &crate::model::State) -> (serde_json::Value, String, String) {
    let p = st.prof;
    let wait = st
        .expert_stats()
        .map(|s| s.wait_secs)
        .unwrap_or(0.0)
        .min(p.experts);
    let total = p.total.max(1e-9);
    let other = (p.total - p.attention - p.experts - p.dense_ffn - p.lm_head).max(0.0);
    let shares = serde_json::json!({
        "expert_disk_wait": wait / total,
        "expert_matmul": (p.experts - wait) / total,
        "attention": p.attention / total,
        "dense_ffn": p.dense_ffn / total,
        "lm_head": p.lm_head / total,
        "other": other / total,
    });
    let line = format!(
        "[prof] {:.2}s in forward: expert-disk wait {:.0}% | expert matmul {:.0}% | attention {:.0}% | dense ffn {:.0}% | lm_head {:.0}% | other {:.0}%",
        p.total,
        100.0 * wait / total,
        100.0 * (p.experts - wait) / total,
        100.0 * p.attention / total,
        100.0 * p.dense_ffn / total,
        100.0 * p.lm_head / total,
        100.0 * other / total
    );
    let w = wait / total;
    let verdict = if w > 0.5 {
        "[prof] verdict: I/O-bound (more than half the time waits for expert reads: a bigger cache, autopin or a faster disk helps; more threads do not)"
    } else if w < 0.1 {
        "[prof] verdict: compute-bound (expert reads wait under 10%: more cache will not help; threads and kernels do)"
    } else {
        "[prof] verdict: balanced (reads and compute both matter)"
    };
    (shares, line, verdict.to_string())
}

/// The end-of-run expert line: hit rates, experts read per token, bytes read and read speed.
/// `before` (the figures when the prefill ended) is subtracted, so the line is decode only.
pub fn expert_summary(
    st: &crate::model::State,
    before: Option<crate::experts::CacheStats>,
    decoded: usize,
    secs: f64,
) -> Option<String> {
    let s = decode_stats(st, before)?;
    let req = s.requests().max(1) as f64;
    let rss = peak_rss_bytes()
        .map(|b| format!(" | peak RSS {}", human(b)))
        .unwrap_or_default();
    let prefetch = if st.experts().is_some_and(|c| c.prefetching()) {
        format!(
            "\n[experts] prefetch: {} experts predicted, precision {:.1}% | {} reads started ({:.1}/token), recall {:.1}% of misses",
            s.predicted,
            100.0 * s.prefetch_precision(),
            s.prefetched,
            s.prefetched as f64 / decoded.max(1) as f64,
            100.0 * s.prefetch_recall()
        )
    } else {
        String::new()
    };
    Some(format!(
        "[experts] decode {decoded} tokens in {secs:.2}s ({:.2} tok/s) | expert hit {:.1}% (pin {:.1}% + lru {:.1}%) | {:.1} experts read/token | {} read at {:.2} GB/s | wait {:.2}s{rss}",
        decoded as f64 / secs.max(1e-9),
        100.0 * s.hit_rate(),
        100.0 * s.hits_pin as f64 / req,
        100.0 * s.hits_lru as f64 / req,
        s.misses as f64 / decoded.max(1) as f64,
        human(s.bytes_read),
        gb(s.bytes_read) / s.read_secs.max(1e-9),
        s.wait_secs
    ) + &prefetch)
}
