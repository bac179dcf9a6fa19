//! What an engine is asked for: a plain options struct (no clap), the parsers that turn flag
//! text into typed values (each once), and the one place that refuses flag combinations.
//!
//! Owns: `EngineOptions` and its parts, `parse_size`, `parse_io`, `parse_prefetch`, and
//! `EngineOptions::check`, the table of combinations no backend honours. Does not own: flag
//! spelling (cli/), what the planner decides (plan/).
//! Invariant: every refusal is one line naming the flag and the reason, and happens before
//! any weight is bound (`Engine::open` calls `check` right after reading the config).

use super::EngineError;
use crate::experts::{IoMode, Policy};
use crate::gpu::Staging;
use crate::kernels::kv::KvType;
use crate::model::{KvTypes, ModelConfig};
use crate::plan::gpu_experts::GpuExperts;
use crate::plan::planner::ExpertMode;
use crate::sample::SamplingParams;
use std::path::PathBuf;

/// Prompt tokens per prefill batch when `-b` is not given, on every backend (llama.cpp's ubatch;
/// docs/PERFORMANCE.md, session 32, has the CPU A/B; the GPU's is session 26's).
pub const DEFAULT_BATCH: usize = 512;

/// Everything `Engine::open` needs, from any front end.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// A .gguf file (first shard) or a safetensors directory.
    pub model: PathBuf,
    /// Compute threads (0 = all cores).
    pub threads: usize,
    /// Context length (`None`: the model's own, at most 4096).
    pub ctx: Option<usize>,
    /// The context must hold at least this many tokens (`logits`: the sequence).
    pub min_ctx: usize,
    /// Prompt tokens per prefill batch.
    pub batch: usize,
    /// Positions whose logits one forward returns (1 for generation; `logits` wants more).
    pub logit_rows: usize,
    /// Sampling defaults (a request may bring its own).
    pub sampling: SamplingParams,
    /// MTP drafts per step (0 = plain decoding).
    pub mtp: usize,
    pub experts: ExpertOptions,
    pub gpu: GpuRequest,
    /// `-ctk` / `-ctv` (`None`: the default, see `kv_types`).
    pub kv: KvRequest,
    /// Save sessions here and restore them (`--kv-dir`), at most `kv_max_sessions`.
    pub kv_dir: Option<PathBuf>,
    pub kv_max_sessions: usize,
    /// Sequence slots decoded together in one batched forward (`serve --parallel`; 1 = one
    /// generation at a time).
    pub parallel: usize,
    /// `--parallel` left out (`serve`): `Engine::open` picks llama-server's 4 slots where the
    /// batched path runs, else 1, and says why (`resolve_parallel`, called once).
    pub parallel_auto: bool,
    /// Print no `[plan]` lines (`logits`: its stderr is for errors).
    pub quiet: bool,
    /// Time the pinned host-to-device copy ceiling when the GPU attaches (`--prof`).
    pub measure_h2d: bool,
    /// The command, for messages (`run`, `chat`, `serve`, `logits`).
    pub command: &'static str,
}

impl EngineOptions {
    /// Defaults for `model` (greedy sampling, planner's placement, GPU auto).
    pub fn new(model: impl Into<PathBuf>) -> EngineOptions {
        EngineOptions {
            model: model.into(),
            threads: 0,
            ctx: None,
            min_ctx: 0,
            batch: DEFAULT_BATCH,
            logit_rows: 1,
            sampling: SamplingParams::greedy(),
            mtp: 0,
            experts: ExpertOptions::default(),
            gpu: GpuRequest::default(),
            kv: KvRequest::default(),
            kv_dir: None,
            kv_max_sessions: 8,
            parallel: 1,
            parallel_auto: false,
            quiet: false,
            measure_h2d: false,
            command: "run",
        }
    }
}

/// `-ctk` / `-ctv`: the KV cache's element types as asked (`None`: left to the default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvRequest {
    pub k: Option<KvType>,
    pub v: Option<KvType>,
}

impl KvRequest {
    /// The flags given with a type other than f32 and f16 (what the GPU's cache cannot hold).
    fn not_gpu(&self) -> Option<String> {
        let flags: Vec<String> = [("-ctk", self.k), ("-ctv", self.v)]
            .into_iter()
            .filter_map(|(f, t)| {
                t.filter(|t| !matches!(t, KvType::F32 | KvType::F16))
                    .map(|t| format!("{f} {t}"))
            })
            .collect();
        (!flags.is_empty()).then(|| flags.join(" "))
    }
}

/// `-ctk` / `-ctv` (`--cache-type-k` / `--cache-type-v`), llama.cpp's spellings.
pub fn parse_kv_type(flag: &str, s: &str) -> Result<KvType, EngineError> {
    KvType::parse(s).ok_or_else(|| {
        refused(
            &format!("{flag} {s:?}"),
            "expected f32, f16, bf16 or q8_0 (the KV cache's element type)",
        )
    })
}

/// Where routed experts live and how they are read.
#[derive(Clone, Debug)]
pub struct ExpertOptions {
    pub mode: ExpertMode,
    /// Memory budget in bytes (`None`: 85% of MemAvailable).
    pub ram: Option<u64>,
    /// Evictable slots per MoE layer.
    pub cap: Option<usize>,
    /// `--io`, parsed once here; the planner checks O_DIRECT and falls back.
    pub io: Option<IoMode>,
    pub io_threads: Option<usize>,
    pub policy: Policy,
    pub route_trace: Option<PathBuf>,
    pub autopin: bool,
    /// Bytes the pinned tier may take (`--pin-gb`).
    pub pin_bytes: Option<u64>,
    /// Read usage statistics but never write them.
    pub usage_freeze: bool,
    /// `--prefetch` on/off (`None`: the planner's).
    pub prefetch: Option<bool>,
    /// `--verify-experts`: check every streamed expert read against its recorded hash.
    pub verify_experts: bool,
}

impl Default for ExpertOptions {
    fn default() -> Self {
        ExpertOptions {
            mode: ExpertMode::Auto,
            ram: None,
            cap: None,
            io: None,
            io_threads: None,
            policy: Policy::Hotness { halve_every: 64 },
            route_trace: None,
            verify_experts: false,
            autopin: false,
            pin_bytes: None,
            usage_freeze: false,
            prefetch: None,
        }
    }
}

/// `--gpu auto|on|off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuWant {
    Auto,
    On,
    Off,
}

/// What the GPU path is asked for.
#[derive(Clone, Debug)]
pub struct GpuRequest {
    pub want: GpuWant,
    /// VRAM expert pool bytes (`None`: what fits).
    pub vram: Option<u64>,
    pub staging: Staging,
    /// Copy every routed expert into the VRAM pool at start when it has a slot for each.
    pub preload: bool,
    /// `--gpu-experts`: where VRAM-pool misses run (None: the planner's choice,
    /// plan/gpu_experts.rs).
    pub experts: Option<GpuExperts>,
}

impl Default for GpuRequest {
    fn default() -> Self {
        GpuRequest {
            want: GpuWant::Auto,
            vram: None,
            staging: Staging::Arena,
            preload: true,
            experts: None,
        }
    }
}

impl GpuWant {
    pub fn parse(s: &str) -> Result<GpuWant, EngineError> {
        match s {
            "auto" => Ok(GpuWant::Auto),
            "on" => Ok(GpuWant::On),
            "off" => Ok(GpuWant::Off),
            s => Err(refused(&format!("--gpu {s:?}"), "expected auto, on or off")),
        }
    }
}

fn refused(flag: &str, reason: impl Into<String>) -> EngineError {
    EngineError::Refused {
        flag: flag.to_string(),
        reason: reason.into(),
    }
}

/// `--io direct|buffered|mmap`.
pub fn parse_io(s: &str) -> Result<IoMode, EngineError> {
    s.parse::<IoMode>()
        .map_err(|_| refused(&format!("--io {s:?}"), "expected direct, buffered or mmap"))
}

/// `--prefetch[=on|off]`.
pub fn parse_prefetch(s: &str) -> Result<bool, EngineError> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(EngineError::Refused {
            flag: format!("--prefetch={other}"),
            reason: "expected on or off".into(),
        }),
    }
}

/// Sequence slots when `--parallel` is left out (llama-server's `-np` default).
pub const AUTO_PARALLEL: usize = 4;

/// Whether sequences of this model can share a batched forward (`Model::forward_seqs`).
fn batchable(cfg: &ModelConfig) -> bool {
    use crate::model::config::AttnKind;
    let attn = match cfg.attn {
        AttnKind::Gqa => true,
        // MLA batches without V3.2's / GLM-5's indexer (its selection runs per sequence).
        AttnKind::Mla { .. } => cfg.indexer.is_none(),
    };
    // Hybrid layers batch too: each sequence's rows run on its own recurrent state.
    attn && cfg.v4.is_none()
}

#[cfg(feature = "cuda")]
fn gpu_driver_present() -> bool {
    crate::gpu::driver::present()
}

#[cfg(not(feature = "cuda"))]
fn gpu_driver_present() -> bool {
    false
}

/// Parse sizes like `24G`, `512M`, `1.5GiB`, `1000000` (bytes).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("size {s:?}: expected a number with an optional K/M/G/T suffix"))?;
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
        _ => return Err(format!("size {s:?}: unknown unit {unit:?}")),
    };
    if v.is_nan() || v < 0.0 {
        return Err(format!("size {s:?} must be positive"));
    }
    Ok((v * mul) as u64)
}

impl EngineOptions {
    /// The one place that refuses flag combinations no backend honours, before any weight is
    /// bound. `cfg`: the model's hyperparameters (rules that depend on the model).
    pub fn check(&self, cfg: &ModelConfig) -> Result<(), EngineError> {
        let gpu_on = self.gpu.want == GpuWant::On;
        if self.mtp > 3 {
            return Err(refused(
                &format!("--mtp {}", self.mtp),
                "draft 1 to 3 tokens per step (0 = off)",
            ));
        }
        if self.mtp > 0 && cfg.n_mtp_layers == 0 {
            return Err(refused("--mtp", "this model has no MTP layer"));
        }
        if self.ctx == Some(0) {
            return Err(refused("-c 0", "the context must hold at least one token"));
        }
        if self.batch == 0 {
            return Err(refused(
                "--batch-size 0",
                "a prefill batch holds at least one token",
            ));
        }
        if let (GpuWant::Off, Some(m)) = (self.gpu.want, self.gpu.experts) {
            return Err(refused(
                &format!("--gpu-experts {m}"),
                "it places the GPU's VRAM-pool misses, and --gpu off runs everything on the CPU",
            ));
        }
        if gpu_on {
            // What the CUDA backend lacks, from the one list (`gpu::refusal`); the context is
            // the one asked for.
            let ctx = self.ctx.unwrap_or(0).max(self.min_ctx);
            if let Some(why) = crate::gpu::refusal(cfg, ctx) {
                return Err(refused("--gpu on", why));
            }
        }
        if let (true, Some(flags)) = (gpu_on, self.kv.not_gpu()) {
            return Err(refused(
                &format!("{flags} with --gpu on"),
                "the GPU's KV cache holds f32 or f16 values; use -ctk/-ctv f16 (the default) or f32, or --gpu off",
            ));
        }
        // q8_0 needs whole 32-element blocks per head (`ModelConfig::kv_types` names the width).
        cfg.kv_types(self.kv_types().0)?;
        if gpu_on && !crate::gpu::BUILT {
            return Err(refused(
                "--gpu on",
                "this sluice was built without the `cuda` feature (cargo build --release --features cuda)",
            ));
        }
        if gpu_on && self.mtp > 0 {
            return Err(refused(
                "--mtp with --gpu on",
                "the MTP head runs only on the CPU path; use --gpu off or --mtp 0",
            ));
        }
        if gpu_on && self.experts.prefetch == Some(true) {
            return Err(refused(
                "--prefetch with --gpu on",
                "expert prefetch runs only on the CPU path; drop --prefetch or use --gpu off",
            ));
        }
        if gpu_on && self.kv_dir.is_some() {
            return Err(refused(
                "--kv-dir with --gpu on",
                "saved KV caches work on the CPU path only; use --gpu off",
            ));
        }
        if self.parallel == 0 {
            return Err(refused("--parallel 0", "at least one sequence slot"));
        }
        if self.parallel > 1 {
            let flag = format!("--parallel {}", self.parallel);
            if !batchable(cfg) {
                return Err(refused(
                    &flag,
                    "batched sequences need grouped-query attention or MLA without an indexer (not DeepSeek-V3.2 / GLM-5's sparse attention or DeepSeek-V4); use --parallel 1",
                ));
            }
            if gpu_on {
                return Err(refused(
                    &format!("{flag} with --gpu on"),
                    "the CUDA backend runs one sequence per forward; use --gpu off or --parallel 1",
                ));
            }
            if self.mtp > 0 {
                return Err(refused(
                    &format!("{flag} with --mtp"),
                    "MTP drafting runs one sequence at a time; use --mtp 0 or --parallel 1",
                ));
            }
        }
        if self.experts.verify_experts && self.experts.mode == ExpertMode::Resident {
            return Err(refused(
                "--verify-experts",
                "experts are checked as the streamed cache reads them; add --experts stream",
            ));
        }
        if let Some(p) = &self.experts.route_trace {
            if self.experts.mode == ExpertMode::Resident {
                return Err(refused(
                    &format!("--route-trace {}", p.display()),
                    "routes are traced by the streamed expert cache; add --experts stream",
                ));
            }
        }
        Ok(())
    }

    /// Why the CPU runs although `--gpu auto` might have picked the GPU (None: nothing here
    /// keeps it off). The same rules as `check`'s, as notes.
    pub(crate) fn gpu_off_reason(&self) -> Option<&'static str> {
        if self.mtp > 0 {
            return Some("--mtp runs on the CPU path");
        }
        if self.experts.prefetch == Some(true) {
            return Some("--prefetch runs on the CPU path");
        }
        if self.kv_dir.is_some() {
            return Some("--kv-dir keeps KV caches in host memory");
        }
        if self.kv.not_gpu().is_some() {
            return Some(
                "-ctk/-ctv bf16 or q8_0 keep the KV cache on the CPU (the GPU's holds f32 or f16 values)",
            );
        }
        if self.parallel > 1 && !self.parallel_auto {
            // (An automatic count is above 1 only where the GPU cannot run: its own reason.)
            return Some("--parallel batches sequences on the CPU path");
        }
        None
    }

    /// The `[plan] parallel:` line of an explicit `--parallel N > 1`; or, `--parallel` left
    /// out: llama-server's default (4 sequence slots; it drops to 1 for
    /// speculative decoding) where the batched path runs — the CPU forward, grouped-query
    /// attention, no `--mtp` — else 1. Sets `parallel` and returns the
    /// `[plan] parallel:` line. The GPU is preferred when `--gpu auto` may attach it (it runs
    /// one sequence per forward, and faster than the CPU batches).
    pub(crate) fn resolve_parallel(&mut self, cfg: &ModelConfig) -> Option<String> {
        let caches = |n: usize| format!("{n} KV caches of -c positions, one per slot");
        if !self.parallel_auto {
            return (self.parallel > 1).then(|| {
                format!(
                    "[plan] parallel: {} sequence slots, decoded together (--parallel; {})",
                    self.parallel,
                    caches(self.parallel)
                )
            });
        }
        let gpu_may_run = match self.gpu.want {
            GpuWant::On => true,
            GpuWant::Off => false,
            GpuWant::Auto => {
                let ctx = self.ctx.unwrap_or(0).max(self.min_ctx);
                crate::gpu::BUILT
                    && gpu_driver_present()
                    && crate::gpu::refusal(cfg, ctx).is_none()
                    && self.gpu_off_reason().is_none()
                    && self.experts.prefetch != Some(true)
            }
        };
        let why = if !batchable(cfg) {
            Some("this model's attention batches only as grouped-query or MLA without an indexer")
        } else if self.mtp > 0 {
            Some("--mtp drafts for one sequence")
        } else if gpu_may_run {
            Some("the GPU runs one sequence per forward; --gpu off batches on the CPU")
        } else {
            None
        };
        self.parallel = if why.is_some() { 1 } else { AUTO_PARALLEL };
        Some(match why {
            Some(w) => format!("[plan] parallel: 1 sequence slot ({w})"),
            None => format!(
                "[plan] parallel: {AUTO_PARALLEL} sequence slots, decoded together (llama-server's default; --parallel N to change; {})",
                caches(AUTO_PARALLEL)
            ),
        })
    }

    /// The KV cache types the state is made with, and why: the flags where given, else f16
    /// (llama.cpp's default, on the CPU and the GPU; `check` refuses bf16 and q8_0 with
    /// `--gpu on`).
    pub fn kv_types(&self) -> (KvTypes, &'static str) {
        let kv = KvTypes {
            k: self.kv.k.unwrap_or(KvType::F16),
            v: self.kv.v.unwrap_or(KvType::F16),
        };
        let why = match (self.kv.k, self.kv.v) {
            (Some(_), Some(_)) => "-ctk/-ctv",
            (None, None) => "f16 by default, as llama.cpp",
            _ => "-ctk/-ctv; the other side's default f16",
        };
        (kv, why)
    }

    /// The context length to run with for a model whose hyperparameters are `cfg`: `ctx`, else
    /// the model's own context length capped at 4096, and at least `min_ctx` tokens (both
    /// backends run DSA's indexer, so V3.2 / GLM-5 are not held to `index_topk`). A context beyond the model's own length runs, with a one-line
    /// warning on stderr (llama.cpp does the same): positions past it were never trained.
    pub fn ctx_for(&self, cfg: &ModelConfig) -> Result<usize, EngineError> {
        let max = cfg.train_ctx;
        if self.ctx == Some(0) {
            return Err(refused("-c 0", "the context must hold at least one token"));
        }
        let auto = max.min(4096);
        let ctx = self.ctx.unwrap_or(auto).max(self.min_ctx);
        if ctx > max {
            eprintln!(
                "[sluice] warning: context {ctx} is more than the model's context length (max_position_embeddings / context_length), {max}: positions past it were not trained"
            );
        }
        Ok(ctx)
    }
}
