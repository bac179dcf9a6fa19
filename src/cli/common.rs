//! Arguments shared by the commands that load a model and generate, their translation into
//! `EngineOptions` (each flag parsed once, in `engine::options`), and the end-of-run figures.

use crate::engine::{EngineOptions, ExpertOptions};
use crate::sample::SamplingParams;
use anyhow::Context;
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
    /// Prompt tokens per prefill batch (llama.cpp's `-ub`; in `serve`, the rows of one batched
    /// step, as llama-server's `-b`). Default 512: on the GPU a 512-token prompt prefills 2.4x
    /// faster than in 128-token batches (H200); on the CPU 1.03-1.08x (each routed expert's
    /// tile sees more tokens), for 0.3-0.5 GB more activation buffers on a DeepSeek-V3 shape.
    #[arg(short = 'b', long = "batch-size")]
    pub batch: Option<usize>,
    /// KV cache type for keys (`-ctk`, llama.cpp's spelling): f32, f16, bf16 or q8_0. Default
    /// f16 (as llama.cpp; the GPU takes f32 and f16, storing f16 numbers in f32). MLA's latent
    /// cache follows it; DeepSeek-V4's caches stay f32 (the run says so).
    #[arg(long = "cache-type-k", value_name = "TYPE")]
    pub cache_type_k: Option<String>,
    /// KV cache type for values (`-ctv`): f32, f16, bf16 or q8_0. Default as `-ctk`'s. (MLA
    /// caches no values; V3.2's indexer keys there stay f32.)
    #[arg(long = "cache-type-v", value_name = "TYPE")]
    pub cache_type_v: Option<String>,
}

pub use crate::engine::options::DEFAULT_BATCH;

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
    /// Predict each MoE layer's experts from the previous layer (its router applied after that
    /// layer's attention) and start their reads early. `--prefetch` = on, `--prefetch=off`;
    /// default: the planner's.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "on", value_name = "on|off")]
    pub prefetch: Option<String>,
}

/// What `run` reports besides its text.
#[derive(Args, Debug, Clone)]
pub struct ReportArgs {
    /// Print where decode time went (attention, expert wait, expert compute, lm_head, other)
    /// and a verdict (I/O-bound, compute-bound, balanced).
    #[arg(long)]
    pub prof: bool,
    /// Write the run's figures as JSON to FILE.
    #[arg(long = "stats-json")]
    pub stats_json: Option<std::path::PathBuf>,
}

impl ComputeArgs {
    /// Copy the compute flags into `o` (`-ctk` / `-ctv` parsed once here; a bad value is
    /// refused naming the flag).
    pub fn apply(&self, o: &mut EngineOptions) -> anyhow::Result<()> {
        use crate::engine::options::parse_kv_type;
        o.threads = self.threads;
        o.ctx = self.ctx;
        o.batch = self.batch.unwrap_or(DEFAULT_BATCH);
        o.kv.k = self
            .cache_type_k
            .as_deref()
            .map(|s| parse_kv_type("-ctk", s))
            .transpose()?;
        o.kv.v = self
            .cache_type_v
            .as_deref()
            .map(|s| parse_kv_type("-ctv", s))
            .transpose()?;
        Ok(())
    }
}

impl ExpertArgs {
    /// The placement flags, each parsed once (`engine::options` refuses bad values).
    pub fn options(&self) -> anyhow::Result<ExpertOptions> {
        use crate::engine::options::{parse_io, parse_prefetch, parse_size};
        Ok(ExpertOptions {
            mode: crate::plan::planner::ExpertMode::parse(&self.mode)?,
            ram: self
                .ram
                .as_deref()
                .map(parse_size)
                .transpose()
                .map_err(|e| anyhow::anyhow!("--ram: {e}"))?,
            cap: self.cap,
            io: self.io.as_deref().map(parse_io).transpose()?,
            io_threads: self.io_threads,
            policy: crate::experts::Policy::parse(&self.policy, self.halve_every)
                .map_err(|e| anyhow::anyhow!("--policy: {e}"))?,
            route_trace: self.route_trace.clone(),
            autopin: self.autopin,
            pin_bytes: self.pin_gb.map(|g| (g * 1e9) as u64),
            usage_freeze: self.usage_freeze,
            prefetch: self.prefetch.as_deref().map(parse_prefetch).transpose()?,
            verify_experts: self.verify_experts,
        })
    }
}

/// The engine options of a command that loads `model`: compute, sampling, placement and GPU
/// flags (the command sets the rest: MTP, `--kv-dir`, logit rows).
pub fn engine_options(
    command: &'static str,
    model: &std::path::Path,
    compute: &ComputeArgs,
    sampling: &SamplingArgs,
    experts: &ExpertArgs,
    gpu: &super::gpu::GpuArgs,
) -> anyhow::Result<EngineOptions> {
    let mut o = EngineOptions::new(model);
    o.command = command;
    compute.apply(&mut o)?;
    o.sampling = sampling.params();
    o.experts = experts.options()?;
    o.gpu = gpu.request()?;
    Ok(o)
}

/// The model to open: `model`, else the built-in tiny model (written on first use).
pub fn model_or_default(model: &Option<std::path::PathBuf>) -> anyhow::Result<std::path::PathBuf> {
    match model {
        Some(p) => Ok(p.clone()),
        None => crate::default_model::ensure().context("preparing the default model"),
    }
}

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

use crate::plan::planner::human;

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

/// After a run: `[plan] memory: peak RSS X of the Y budget` (the planner counts the process
/// itself against `--ram`, so the peak should stay under it).
pub fn peak_vs_budget(plan: &crate::plan::planner::Plan) -> Option<String> {
    let peak = peak_rss_bytes()?;
    Some(format!(
        "[plan] memory: peak RSS {} of the {} budget ({:.0}%)",
        human(peak),
        human(plan.budget_bytes),
        100.0 * peak as f64 / plan.budget_bytes.max(1) as f64
    ))
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
pub fn stats_json(
    engine: &crate::engine::Engine,
    g: &crate::engine::GenStats,
) -> serde_json::Value {
    let st = engine.state();
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
    if let Some(gj) = super::gpu::gpu_json(engine, g.gpu_after_prefill) {
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

/// After a streamed run: the decode speed this run's own routes allow with this cache size —
/// Belady's optimal eviction replayed on the route log (`cache-sim`'s bound), its misses priced
/// at the run's own read rate and at the disk's O_DIRECT ceiling (`disk_gbps`, the machine
/// profile's), plus the run's compute time — how close the run came to each, and how fast its
/// expert reads went against that ceiling (issue 16's streaming goals: reads >= 0.9 of the
/// ceiling, tok/s >= 0.8 of the bound).
pub fn belady_bound(
    st: &crate::model::State,
    before: Option<crate::experts::CacheStats>,
    decoded: usize,
    secs: f64,
    disk_gbps: Option<f64>,
) -> Option<String> {
    use crate::experts::{simulate_from, SimPolicy};
    let cache = st.experts()?;
    let s = decode_stats(st, before)?;
    if decoded == 0 || s.misses == 0 || s.read_secs <= 0.0 {
        return None;
    }
    let Some(trace) = cache.route_log() else {
        return Some("[experts] bound: the run outgrew the in-memory route log; use --route-trace and `sluice cache-sim --policy belady`".into());
    };
    let (slots, pinned) = cache.shape();
    let from = before.map_or(0, |b| b.waves as usize);
    let bel = simulate_from(&trace, slots, &pinned, SimPolicy::Belady, from).ok()?;
    // A miss costs what this run's misses cost on average (read wall time per miss).
    let per_miss = s.read_secs / s.misses as f64;
    let compute = (secs - s.wait_secs).max(0.0);
    let bound = decoded as f64 / (compute + bel.misses as f64 * per_miss).max(1e-9);
    let measured = decoded as f64 / secs.max(1e-9);
    let mut line = format!(
        "[experts] bound: Belady's eviction on this run's routes would hit {:.1}% (this run {:.1}%), {:.1} experts read/token: {bound:.2} tok/s at this run's read rate ({:.2} ms/expert) and compute ({:.2}s); measured {measured:.2} tok/s = {:.0}% of it",
        100.0 * bel.hit_rate(),
        100.0 * s.hit_rate(),
        bel.misses as f64 / decoded as f64,
        1e3 * per_miss,
        compute,
        100.0 * measured / bound
    );
    if let Some(disk) = disk_gbps.filter(|&g| g > 0.0) {
        // The same misses read at the disk's ceiling: the bound a perfect reader would allow.
        let bytes_per_miss = s.bytes_read as f64 / s.misses as f64;
        let at_disk = bel.misses as f64 * bytes_per_miss / (disk * 1e9);
        let disk_bound = decoded as f64 / (compute + at_disk).max(1e-9);
        let run_gbps = gb(s.bytes_read) / s.read_secs;
        line += &format!(
            "\n[experts] bound at the disk's ceiling ({disk:.2} GB/s O_DIRECT, machine profile): {disk_bound:.2} tok/s; measured = {:.0}% of it | this run's expert reads {run_gbps:.2} GB/s = {:.2} of the ceiling",
            100.0 * measured / disk_bound,
            run_gbps / disk
        );
    }
    Some(line)
}

/// `run --prof` after a streamed decode: the disk's O_DIRECT ceiling measured now, in the same
/// run — random reads of the run's mean read size from the model's largest file, with the
/// run's reader count and twice it, `PROBE_SECS` each — against the run's own expert read
/// rate, and the Belady bound priced at that ceiling (issue 16: reads >= 0.9 of the disk's
/// O_DIRECT bandwidth measured in the same run). `None` when nothing streamed or the cache did
/// not read with O_DIRECT; a "not measured" line when the probe's reads fail.
pub fn disk_now(
    st: &crate::model::State,
    before: Option<crate::experts::CacheStats>,
    decoded: usize,
    secs: f64,
) -> Option<String> {
    use crate::experts::{simulate_from, IoMode, SimPolicy};
    const PROBE_SECS: f64 = 0.5;
    let cache = st.experts()?;
    let s = decode_stats(st, before)?;
    if decoded == 0 || s.reads == 0 || s.read_secs <= 0.0 || cache.io_mode() != IoMode::Direct {
        return None;
    }
    let path = cache
        .store()
        .paths()
        .iter()
        .max_by_key(|p| std::fs::metadata(p).map_or(0, |m| m.len()))?;
    let block = s.bytes_read / s.reads;
    let readers = cache.readers();
    let mut points = Vec::new();
    for t in [readers, 2 * readers] {
        let dur = std::time::Duration::from_secs_f64(PROBE_SECS);
        match crate::plan::probe_disk::direct_point(path, block, t, dur) {
            Ok(p) => points.push(p),
            Err(e) => return Some(format!("[experts] disk now: not measured ({e})")),
        }
    }
    let best = points.iter().map(|p| p.gbps).fold(0.0, f64::max);
    let run = gb(s.bytes_read) / s.read_secs;
    let list: Vec<String> = points
        .iter()
        .map(|p| format!("x{} {:.2}", p.threads, p.gbps))
        .collect();
    let mut line = format!(
        "[experts] disk now: O_DIRECT {} random reads of {} just after decode, {PROBE_SECS} s each: {} GB/s | this run's expert reads {run:.2} GB/s = {:.2} of the best",
        human(block),
        path.display(),
        list.join(", "),
        run / best.max(1e-9)
    );
    // The Belady bound with its misses read at this ceiling.
    if let (Some(trace), true) = (cache.route_log(), s.misses > 0 && best > 0.0) {
        let (slots, pinned) = cache.shape();
        let from = before.map_or(0, |b| b.waves as usize);
        if let Ok(bel) = simulate_from(&trace, slots, &pinned, SimPolicy::Belady, from) {
            let compute = (secs - s.wait_secs).max(0.0);
            let at = bel.misses as f64 * (s.bytes_read as f64 / s.misses as f64) / (best * 1e9);
            let bound = decoded as f64 / (compute + at).max(1e-9);
            let measured = decoded as f64 / secs.max(1e-9);
            line += &format!(
                "; Belady bound at it {bound:.2} tok/s, measured = {:.0}% of it",
                100.0 * measured / bound
            );
        }
    }
    Some(line)
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
        "[experts] decode {decoded} tokens in {secs:.2}s ({:.2} tok/s) | expert hit {:.1}% (pin {:.1}% + lru {:.1}%) | {:.1} experts read/token | {} read at {:.2} GB/s ({:.2} reads of {} in flight on average, {:.2} GB/s each) | wait {:.2}s{rss}",
        decoded as f64 / secs.max(1e-9),
        100.0 * s.hit_rate(),
        100.0 * s.hits_pin as f64 / req,
        100.0 * s.hits_lru as f64 / req,
        s.misses as f64 / decoded.max(1) as f64,
        human(s.bytes_read),
        gb(s.bytes_read) / s.read_secs.max(1e-9),
        s.read_sum_secs / s.read_secs.max(1e-9),
        human(s.bytes_read / s.reads.max(1)),
        gb(s.bytes_read) / s.read_sum_secs.max(1e-9),
        s.wait_secs
    ) + &prefetch)
}
