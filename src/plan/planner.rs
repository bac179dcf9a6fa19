//! The planner: from a model's sizes, a measured `MachineProfile` and the user's request, decide
//! where experts live and how they are read, and predict decode speed. `sluice plan` prints the
//! `Plan`; `run` builds its expert cache from it.
//!
//! Decisions, each a `Decision { what, value, reason }` (one `[plan]` line):
//! - budget: `--ram`, else 85% of MemAvailable or of the memory cgroup's limit if lower.
//! - resident bytes (dense weights, norms, embeddings, shared experts) and KV bytes for `-c`.
//! - experts: resident (read through the mapped files) when the whole model fits the budget,
//!   else streamed through the bounded cache (`--experts` overrides).
//! - embedding: where experts stream on the CPU (`PlanRequest::embedding_in_file`), an untied
//!   token-embedding table stays in the mapped file (a token reads one row; `EMBEDDING_TOUCHED`
//!   counted), its bytes going to expert slots.
//! - expert cache: slots per MoE layer from what the budget leaves, split into a pinned tier
//!   (`--autopin`: half of it unless `--pin-gb`, the LRU keeping at least one slot a layer) and
//!   an evictable tier (`--cap` overrides the count).
//! - reader threads: the thread count at which the probed O_DIRECT ceiling was reached, two
//!   where one peaked but two tied it (`READERS_TIE`) (`--io-threads` overrides); IO mode:
//!   direct where O_DIRECT works, else buffered (`--io`).
//! - prefetch: off by default: on the generated Qwen3-30B-shaped model the next layer's router
//!   predicted only 52% of the experts, and decode was 14-16% slower with it (PERFORMANCE.md,
//!   "Prefetch"); `--prefetch` turns it on where experts stream (see `prefetch_decision`).
//! - MTP: off unless asked; when asked while decode is disk-bound it is kept (the flag wins) but
//!   the line says it will likely slow decode: the head's draft tokens widen the per-token union
//!   of experts that must be read. `MtpCost` puts figures on it: a step of K drafts reads the
//!   union of K+1 tokens' experts, so it pays only when experts are resident, above a per-draft
//!   acceptance rate the line states.
//! - gpu: what `--gpu auto` will do at start (gpu/, feature `cuda`): on when the probe found a
//!   CUDA device whose VRAM holds the resident weights and KV cache with 1 GiB to spare, the
//!   rest being the VRAM expert pool (`--vram`); off without the feature, without a device, with
//!   `--mtp`, or when the card is too small. The prediction below is the CPU's (not the GPU's).
//! - predicted decode tok/s, a range from this cost model (per decoded token):
//!   `missed = (1 - hit) x routed bytes/token`, `routed bytes/token = top-k x expert bytes x MoE
//!   layers`, `time = missed / disk ceiling + active / memory read GB/s`, with `active` = resident
//!   bytes but the embedding table + routed bytes/token (every active weight byte is read once
//!   from RAM). The hit rate:
//!   lower bound under uniform routing, `hit = C / E` (C cached slots per layer, E experts per
//!   layer); upper bound from a skewed estimate, the cache holding the C most popular experts of
//!   a Zipf(1) popularity, `hit = H(C) / H(E)` with `H(n) = 1 + 1/2 + ... + 1/n`. Real routing
//!   usually lies between; LRU on skewed routing does a little worse than the ideal top-C.
//!
//! Owns: those decisions and the cost model. Does not own: measuring (the probes), building the
//! cache (experts/), printing. Invariant: a plan either fits the budget or is refused with the
//! numbers that do not fit; no decision is made without a reason saying which input drove it.

use serde::{Deserialize, Serialize};

use super::MachineProfile;
use crate::experts::IoMode;

/// What the planner needs to know about a model (sizes only; cheap to build).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSummary {
    /// Bytes of everything that is not a routed expert.
    pub resident_bytes: u64,
    /// Bytes of all routed experts.
    pub routed_bytes: u64,
    /// KV cache bytes for the requested context.
    pub kv_bytes: u64,
    /// What the process holds besides weights, KV and experts: the binary, tokenizer and heap
    /// when the plan is made (its resident set then) plus the activation buffers a chunk
    /// touches (`State::scratch_bytes`). Counted against the budget like the KV cache.
    #[serde(default)]
    pub process_bytes: u64,
    /// Layers with routed experts.
    pub moe_layers: usize,
    /// Routed experts per MoE layer.
    pub experts_per_layer: usize,
    /// Experts a token selects per MoE layer.
    pub top_k: usize,
    /// One expert's bytes in one layer as a cache slot holds it (the read size).
    pub slot_bytes: u64,
    /// MTP head layers (0: the model has none).
    pub mtp_layers: usize,
    /// Bytes of the token-embedding table when it is not also the output head: resident, but
    /// a token reads one row of it, so the cost model leaves it out of the active bytes.
    #[serde(default)]
    pub embedding_bytes: u64,
    /// Bytes of the MTP layer (all its tensors; resident, read only with `--mtp`).
    #[serde(default)]
    pub mtp_layer_bytes: u64,
    /// Bytes one MTP draft reads: the MTP layer's tensors but its routed experts, top-k of
    /// those, and the output head it predicts with.
    #[serde(default)]
    pub mtp_draft_bytes: u64,
}

/// Whether a tensor is the token-embedding table (GGUF or Hugging Face name).
pub fn is_embedding_table(name: &str) -> bool {
    name == "token_embd.weight" || name.ends_with("embed_tokens.weight")
}

impl ModelSummary {
    /// The summary of a loaded model, with the KV cache and buffers of the state `st` it will
    /// run with and this process's resident set now.
    pub fn of(
        model: &crate::model::Model<'_>,
        files: &crate::format::ModelFiles,
        st: &crate::model::State,
    ) -> Result<ModelSummary, crate::model::ModelError> {
        let kv_bytes = st.kv_bytes() as u64;
        let process_bytes =
            super::probe_mem::process_rss().unwrap_or(0) + st.scratch_bytes() as u64;
        let (routed, resident) = model.routed_and_resident_bytes(files);
        let store = model.expert_store(files)?;
        let (mtp_layer_bytes, mtp_draft_bytes) = mtp_bytes(model, files);
        Ok(ModelSummary {
            resident_bytes: resident,
            routed_bytes: routed,
            kv_bytes,
            process_bytes,
            moe_layers: store.moe_layers(),
            experts_per_layer: model.cfg.n_experts,
            top_k: model.cfg.n_experts_used,
            slot_bytes: store.slot_bytes(),
            mtp_layers: model.cfg.n_mtp_layers,
            embedding_bytes: if model.cfg.tie_embeddings {
                0
            } else {
                files
                    .tensors()
                    .iter()
                    .filter(|t| is_embedding_table(&t.name))
                    .map(|t| t.range.len)
                    .sum()
            },
            mtp_layer_bytes,
            mtp_draft_bytes,
        })
    }

    /// Bytes of the whole model plus its KV cache and the process around it.
    pub fn total_bytes(&self) -> u64 {
        self.fixed_bytes() + self.routed_bytes
    }

    /// What the budget holds whatever the experts do: resident weights, KV cache, process.
    pub fn fixed_bytes(&self) -> u64 {
        self.resident_bytes + self.kv_bytes + self.process_bytes
    }

    /// `fixed_bytes` with the token-embedding table left in the mapped file: only the pages of
    /// the rows a run touches count (`EMBEDDING_TOUCHED`). Equal to `fixed_bytes` for a tied
    /// table (it is the output head, read whole every token).
    pub fn fixed_bytes_embedding_in_file(&self) -> u64 {
        self.fixed_bytes() - self.embedding_bytes + self.embedding_bytes.min(EMBEDDING_TOUCHED)
    }

    /// Bytes one decoded token reads from RAM: resident weights but the embedding table and the
    /// MTP layer, plus its routed experts.
    pub fn active_bytes_per_token(&self) -> u64 {
        self.resident_bytes
            .saturating_sub(self.embedding_bytes + self.mtp_layer_bytes)
            + self.routed_bytes_per_token()
    }

    /// Routed bytes one token reads when every selected expert is distinct.
    pub fn routed_bytes_per_token(&self) -> u64 {
        (self.top_k.min(self.experts_per_layer) * self.moe_layers) as u64 * self.slot_bytes
    }
}

/// (MTP layer bytes, bytes one MTP draft reads) of a loaded model: the tensors of cache layer
/// `n_layers` (GGUF `blk.N.`, HF `model.layers.N.`), its routed experts counted top-k of E for
/// a draft, plus the head it predicts with (its own `shared_head.head`, else the output).
fn mtp_bytes(model: &crate::model::Model<'_>, files: &crate::format::ModelFiles) -> (u64, u64) {
    let c = &model.cfg;
    if c.n_mtp_layers == 0 || !model.has_mtp() {
        return (0, 0);
    }
    let n = c.n_layers as u64;
    let (mut layer, mut draft, mut own_head) = (0u64, 0f64, 0u64);
    for t in files.tensors() {
        let mut parts = t.name.split('.');
        let mut idx = None;
        while let Some(p) = parts.next() {
            if p == "blk" || p == "layers" {
                idx = parts.next().and_then(|x| x.parse::<u64>().ok());
                break;
            }
        }
        if idx != Some(n) {
            continue;
        }
        layer += t.range.len;
        if crate::inspect::routed_expert_tensor(&t.name).is_some() {
            draft += t.range.len as f64 * c.n_experts_used as f64 / c.n_experts.max(1) as f64;
        } else if t.name.contains("shared_head_head") || t.name.contains("shared_head.head") {
            own_head += t.range.len;
        } else if !t.name.contains("embed_tokens") {
            draft += t.range.len as f64;
        }
    }
    let head = if own_head > 0 {
        own_head
    } else {
        files
            .tensors()
            .iter()
            .filter(|t| t.name == "output.weight" || t.name == "lm_head.weight")
            .map(|t| t.range.len)
            .sum()
    };
    (layer, draft as u64 + head)
}

/// Expected distinct experts one MoE layer reads in a forward of `n` tokens that each pick
/// `k` of `e` experts, under uniform independent routing: `e (1 - (1 - k/e)^n)`. One token:
/// `k`; it grows almost linearly in `n` while `n k` is small against `e`.
pub fn expert_union(e: usize, k: usize, n: usize) -> f64 {
    if e == 0 || n == 0 {
        return 0.0;
    }
    let (e, k) = (e as f64, k.min(e) as f64);
    e * (1.0 - (1.0 - k / e).powi(n as i32))
}

/// `--mtp K` in the cost model. A step runs K one-token drafts of the MTP head, then one
/// verify forward of K+1 tokens of the main model, and emits 1 + (accepted drafts) tokens.
/// The verify forward reads the resident weights once for all K+1 tokens but the *union* of
/// their experts, `expert_union(E, k, K+1)` per MoE layer instead of k: that widened union is
/// what a step costs. Where experts stream and decode is disk-bound, the missed share of the
/// union comes from disk, so a step costs nearly K+1 plain tokens and MTP pays only with
/// near-perfect acceptance, if ever; where experts are resident, the resident reads shared by
/// the K+1 tokens make a step much cheaper than K+1 tokens, and it pays above a moderate
/// per-draft acceptance rate. The MTP head's own expert reads are resident (its layer is not
/// streamed).
/// Memory-bandwidth model like `token_secs`: compute is not counted, so it assumes a forward
/// of K+1 tokens reads each weight once. Where the batched matmul is compute-bound instead (the
/// 2-core Q4_K box of docs/PERFORMANCE.md "MTP speculative decoding": a 2-token forward costs
/// 1.97 one-token forwards) a verify costs about K+1 tokens and MTP loses even at full
/// acceptance; the break-even stated here is then a lower bound.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MtpCost {
    pub drafts: usize,
    /// Expected routed experts per MoE layer the verify forward reads (plain decode: top-k).
    pub union_per_layer: f64,
    /// Routed experts read per step (verify union over the MoE layers + the head's top-k per
    /// draft), and per plain token.
    pub experts_per_step: f64,
    pub experts_per_plain_token: f64,
    /// Predicted seconds of a step over seconds of a plain token.
    pub step_cost: f64,
    /// Per-draft acceptance rate a at which 1 + a + ... + a^K tokens per step match plain
    /// decode; `None`: never (the step costs K+1 plain tokens or more).
    pub break_even_acceptance: Option<f64>,
}

pub fn mtp_cost(
    m: &ModelSummary,
    drafts: usize,
    hit: f64,
    disk_gbps: f64,
    mem_gbps: f64,
) -> MtpCost {
    let (e, k, l) = (
        m.experts_per_layer,
        m.top_k.min(m.experts_per_layer),
        m.moe_layers,
    );
    let u = expert_union(e, k, drafts + 1);
    let slot = m.slot_bytes as f64;
    let base = m
        .resident_bytes
        .saturating_sub(m.embedding_bytes + m.mtp_layer_bytes) as f64;
    let (disk, mem) = (disk_gbps.max(1e-9) * 1e9, mem_gbps.max(1e-9) * 1e9);
    let plain = (1.0 - hit) * (k * l) as f64 * slot / disk + (base + (k * l) as f64 * slot) / mem;
    let step = (1.0 - hit) * u * l as f64 * slot / disk
        + (base + u * l as f64 * slot + drafts as f64 * m.mtp_draft_bytes as f64) / mem;
    let r = step / plain.max(1e-30);
    let tokens = |a: f64| (0..=drafts).map(|i| a.powi(i as i32)).sum::<f64>();
    let break_even = if r <= 1.0 {
        Some(0.0)
    } else if r >= (drafts + 1) as f64 {
        None
    } else {
        let (mut lo, mut hi) = (0.0f64, 1.0f64);
        for _ in 0..60 {
            let mid = 0.5 * (lo + hi);
            if tokens(mid) < r {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Some(0.5 * (lo + hi))
    };
    MtpCost {
        drafts,
        union_per_layer: u,
        experts_per_step: u * l as f64 + (drafts * k) as f64,
        experts_per_plain_token: (k * l) as f64,
        step_cost: r,
        break_even_acceptance: break_even,
    }
}

/// `--experts`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExpertMode {
    Auto,
    Resident,
    Stream,
}

impl ExpertMode {
    pub fn parse(s: &str) -> Result<ExpertMode, PlanError> {
        match s {
            "auto" => Ok(ExpertMode::Auto),
            "resident" => Ok(ExpertMode::Resident),
            "stream" => Ok(ExpertMode::Stream),
            other => Err(PlanError::Flag(format!(
                "--experts {other:?}: expected auto, resident or stream"
            ))),
        }
    }
}

/// What the user asked for; every `Some` overrides the planner's choice.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanRequest {
    /// `--ram`, bytes.
    pub ram: Option<u64>,
    /// MemAvailable now, bytes (the default budget is 85% of it).
    pub available: Option<u64>,
    pub mode: ExpertMode,
    /// `--cap`: evictable slots per MoE layer.
    pub cap: Option<usize>,
    pub io: Option<IoMode>,
    pub io_threads: Option<usize>,
    /// `--autopin`: `Some(n)` = n experts have usage statistics to pin from; `None` = off.
    pub autopin: Option<usize>,
    /// `--pin-gb`, bytes.
    pub pin_bytes: Option<u64>,
    /// `--mtp K` (0 = off).
    pub mtp: usize,
    /// `--prefetch` / `--prefetch=off`; `None`: the planner decides.
    pub prefetch: Option<bool>,
    /// Where experts stream, leave an untied token-embedding table in the mapped file (a token
    /// reads one row of it; the pages are neither locked nor counted in the budget beyond
    /// `EMBEDDING_TOUCHED`). The engine asks for it on CPU runs (a GPU run copies the whole
    /// table to the device).
    pub embedding_in_file: bool,
}

/// What the budget counts of a token-embedding table left in the mapped file: the pages of the
/// rows a run touches (one 4 KiB page per distinct token; clean page cache the kernel reclaims
/// first under pressure, so this is a margin, not a cap).
pub const EMBEDDING_TOUCHED: u64 = 8 << 20;

impl Default for PlanRequest {
    fn default() -> PlanRequest {
        PlanRequest {
            ram: None,
            available: None,
            mode: ExpertMode::Auto,
            cap: None,
            io: None,
            io_threads: None,
            autopin: None,
            pin_bytes: None,
            mtp: 0,
            prefetch: None,
            embedding_in_file: false,
        }
    }
}

/// One decision and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub what: String,
    pub value: String,
    pub reason: String,
}

/// The plan: what `run` will do, and what it should reach.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub model: ModelSummary,
    pub budget_bytes: u64,
    /// Stream experts through the cache (else read them through the mapped files).
    pub stream: bool,
    /// Evictable slots per MoE layer (streaming only).
    pub slots_per_layer: usize,
    /// Experts to pin (streaming with `--autopin` only).
    pub pinned: usize,
    /// Bytes of the expert cache (pinned + evictable slots).
    pub expert_cache_bytes: u64,
    pub io: IoMode,
    pub io_threads: usize,
    pub prefetch: bool,
    /// MTP draft tokens (0 = off).
    pub mtp: usize,
    /// The token-embedding table stays in the mapped file, unlocked and read a row at a time
    /// (`PlanRequest::embedding_in_file`, streaming, untied table): the engine must not lock it.
    #[serde(default)]
    pub embedding_in_file: bool,
    /// Expected expert hit rate: (uniform routing, skewed estimate).
    pub hit_rate: (f64, f64),
    /// Storage ceiling used, GB/s (None: no profile or no O_DIRECT figure).
    pub disk_gbps: Option<f64>,
    /// Memory read bandwidth used, GB/s.
    pub mem_gbps: Option<f64>,
    /// Predicted decode tok/s (low, high); None when a bandwidth is unknown.
    pub predicted_tok_s: Option<(f64, f64)>,
    /// Whether decode is predicted to wait on the disk more than on memory (uniform bound).
    pub disk_bound: bool,
    /// `--mtp K` in the cost model at the uniform hit bound (K = 1 when not asked); None
    /// without an MTP head or a bandwidth.
    #[serde(default)]
    pub mtp_cost: Option<MtpCost>,
    pub decisions: Vec<Decision>,
}

impl Plan {
    pub fn io_mode(&self) -> IoMode {
        self.io
    }

    /// The `[plan] what: value (reason)` lines.
    pub fn lines(&self) -> Vec<String> {
        self.decisions
            .iter()
            .map(|d| format!("[plan] {}: {} ({})", d.what, d.value, d.reason))
            .collect()
    }
}

/// A plan that cannot work, with the numbers, or a bad override.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("plan impossible: {0}")]
    Impossible(String),
    #[error("{0}")]
    Flag(String),
}

/// Bytes in the unit that reads best (decimal).
pub fn human(b: u64) -> String {
    match b {
        0..=9_999 => format!("{b} B"),
        10_000..=9_999_999 => format!("{:.1} KB", b as f64 / 1e3),
        10_000_000..=9_999_999_999 => format!("{:.1} MB", b as f64 / 1e6),
        _ => format!("{:.2} GB", b as f64 / 1e9),
    }
}

/// Expected hit rate with `c` cached slots per layer of `e` experts: (uniform, Zipf(1) top-c).
pub fn expected_hit(c: f64, e: usize) -> (f64, f64) {
    if e == 0 {
        return (1.0, 1.0);
    }
    let c = c.clamp(0.0, e as f64);
    let uniform = c / e as f64;
    let h = |n: f64| -> f64 {
        let whole = n.floor() as usize;
        let mut s: f64 = (1..=whole).map(|i| 1.0 / i as f64).sum();
        s += (n - whole as f64) / (whole + 1) as f64;
        s
    };
    let skewed = (h(c) / h(e as f64)).max(uniform);
    (uniform, skewed.min(1.0))
}

/// Seconds per decoded token: missed bytes from disk plus active bytes from RAM.
fn token_secs(m: &ModelSummary, hit: f64, disk: f64, mem: f64) -> (f64, f64) {
    let routed = m.routed_bytes_per_token() as f64;
    let missed = (1.0 - hit) * routed;
    let active = m.active_bytes_per_token() as f64;
    (missed / (disk * 1e9), active / (mem * 1e9))
}

/// What `--gpu auto` will do at start, from the profile's GPU probe: the forward on the GPU
/// with dense weights and the KV cache in VRAM and a VRAM expert pool of what is left (less
/// 1 GiB), or the CPU, with the reason.
fn gpu_decision(
    m: &ModelSummary,
    profile: Option<&MachineProfile>,
    req: &PlanRequest,
) -> (String, String) {
    if !crate::gpu::BUILT {
        return (
            "off".into(),
            "this build has no `cuda` feature (cargo build --release --features cuda)".into(),
        );
    }
    if req.mtp > 0 {
        return ("off".into(), "--mtp runs on the CPU path".into());
    }
    let Some(p) = profile else {
        return (
            "auto".into(),
            "no machine profile: decided at start (--gpu on|off overrides)".into(),
        );
    };
    let Some(dev) = p.gpu.devices.first() else {
        let why = p
            .gpu
            .note
            .clone()
            .unwrap_or_else(|| "no CUDA device".into());
        return (
            "off".into(),
            format!("{why} (--gpu on fails, --gpu off is the CPU)"),
        );
    };
    let resident = m.resident_bytes + m.kv_bytes;
    let pool = dev
        .vram_bytes
        .saturating_sub(resident)
        .saturating_sub(crate::gpu::VRAM_MARGIN)
        .min(m.routed_bytes);
    let share = 100.0 * pool as f64 / (m.routed_bytes as f64).max(1.0);
    let copy = p
        .gpu
        .h2d
        .as_ref()
        .map(|c| format!("; pinned host->device {:.1} GB/s", c.pinned_gbps))
        .unwrap_or_default();
    if resident + crate::gpu::VRAM_MARGIN > dev.vram_bytes {
        return (
            "off".into(),
            format!(
                "{}: {} of VRAM cannot hold the resident weights and KV cache ({}) (--gpu on fails)",
                dev.name,
                human(dev.vram_bytes),
                human(resident)
            ),
        );
    }
    // A partial pool's misses: where they run is decided at start (plan/gpu_experts.rs).
    let misses = if pool < m.routed_bytes {
        "; misses run on the CPU or are copied in, decided at start from the CPU's timed expert products against the copy (--gpu-experts)"
    } else {
        ""
    };
    (
        format!("on, {}", dev.name),
        format!(
            "{} of VRAM holds the resident weights and KV cache ({}); VRAM expert pool ~{} = {share:.0}% of the experts (--vram){copy}{misses}; --gpu off for the CPU",
            human(dev.vram_bytes),
            human(resident),
            human(pool)
        ),
    )
}

fn d(what: &str, value: impl Into<String>, reason: impl Into<String>) -> Decision {
    Decision {
        what: what.into(),
        value: value.into(),
        reason: reason.into(),
    }
}

/// Decide. `profile` = None: no measured machine (defaults, no prediction; a decision says so).
/// Each step below adds its `Decision` lines in the order `run` prints them.
pub fn plan(
    m: &ModelSummary,
    profile: Option<&MachineProfile>,
    req: &PlanRequest,
) -> Result<Plan, PlanError> {
    let mut ds = Vec::new();
    let budget = budget_decision(m, profile, req, &mut ds)?;
    let fits = m.total_bytes() <= budget;
    let stream = experts_decision(m, req, budget, fits, &mut ds);
    let embedding_in_file = stream && req.embedding_in_file && m.embedding_bytes > 0;
    let left = if embedding_in_file {
        ds.push(d(
            "embedding",
            format!(
                "{} token-embedding table read from the mapped file",
                human(m.embedding_bytes)
            ),
            format!(
                "a token reads one row: not locked, {} counted for the rows touched, the rest of the budget goes to expert slots",
                human(m.embedding_bytes.min(EMBEDDING_TOUCHED))
            ),
        ));
        budget.saturating_sub(m.fixed_bytes_embedding_in_file())
    } else {
        budget.saturating_sub(m.fixed_bytes())
    };
    let cache = cache_decision(m, req, stream, budget, left, &mut ds)?;
    let (io, io_threads, ceiling) = io_decision(m, profile, req, stream, &mut ds)?;

    // Prediction.
    let hit = if m.moe_layers == 0 || (!stream && fits) {
        (1.0, 1.0)
    } else {
        expected_hit(cache.per_layer, m.experts_per_layer)
    };
    let disk = ceiling.map(|(_, p)| p.gbps).filter(|g| *g > 0.0);
    let mem = profile
        .and_then(|p| p.memory.read_gbps)
        .filter(|g| *g > 0.0);
    let (predicted, disk_bound) = match (disk, mem) {
        (Some(dk), Some(mm)) => {
            let (dl, cl) = token_secs(m, hit.0, dk, mm);
            let (dh, ch) = token_secs(m, hit.1, dk, mm);
            (
                Some((1.0 / (dl + cl).max(1e-12), 1.0 / (dh + ch).max(1e-12))),
                dl > cl,
            )
        }
        _ => (None, false),
    };

    let (prefetch, prefetch_why) = prefetch_decision(stream, disk_bound, req);
    ds.push(d(
        "prefetch",
        if prefetch { "on" } else { "off" },
        prefetch_why,
    ));
    // MTP: its cost is the widened expert union of the verify forward (`MtpCost`).
    let mtp_cost = match (disk, mem) {
        // Resident experts never touch the disk: its bandwidth does not matter then.
        (dk, Some(mm)) if m.mtp_layers > 0 && (dk.is_some() || hit.0 >= 1.0) => {
            Some(mtp_cost(m, req.mtp.max(1), hit.0, dk.unwrap_or(1.0), mm))
        }
        _ => None,
    };
    ds.push(mtp_decision(m, req, disk_bound, mtp_cost.as_ref()));
    if req.mtp > 0 && m.mtp_layers == 0 {
        return Err(PlanError::Flag("--mtp: the model has no MTP head".into()));
    }
    let (gpu_value, gpu_why) = gpu_decision(m, profile, req);
    ds.push(d("gpu", gpu_value, gpu_why));
    ds.push(hit_decision(m, cache.per_layer, hit));
    ds.push(prediction_decision(
        m, profile, predicted, disk, mem, disk_bound,
    ));

    let expert_cache_bytes = if stream {
        (cache.slots as u64 * m.moe_layers as u64 + cache.pinned as u64) * m.slot_bytes
    } else {
        0
    };
    Ok(Plan {
        model: m.clone(),
        budget_bytes: budget,
        stream,
        slots_per_layer: cache.slots,
        pinned: cache.pinned,
        expert_cache_bytes,
        io,
        io_threads,
        prefetch,
        mtp: req.mtp,
        embedding_in_file,
        hit_rate: hit,
        disk_gbps: disk,
        mem_gbps: mem,
        predicted_tok_s: predicted,
        disk_bound,
        mtp_cost,
        decisions: ds,
    })
}

/// The memory budget (`--ram`, else 85% of MemAvailable) and what always takes from it; an
/// error when the resident part and the KV cache alone do not fit.
fn budget_decision(
    m: &ModelSummary,
    profile: Option<&MachineProfile>,
    req: &PlanRequest,
    ds: &mut Vec<Decision>,
) -> Result<u64, PlanError> {
    let available = req.available.or(profile.map(|p| p.memory.available_bytes));
    // A memory cgroup's limit counts this process (and its page cache) whatever MemAvailable
    // says: a run planned on MemAvailable inside a smaller cgroup is killed by the OOM killer.
    let cgroup = profile.and_then(|p| {
        let m = &p.memory;
        m.cgroup_limit_bytes
            .filter(|&c| available.is_none_or(|a| c < a))
            .map(|c| (c, m.cgroup_source.clone().unwrap_or_default()))
    });
    let (budget, why) = match (req.ram, available, cgroup) {
        (Some(r), _, _) => (r, "--ram".to_string()),
        (None, _, Some((c, src))) => (
            c / 100 * 85,
            format!("85% of the memory cgroup's limit {} ({src})", human(c)),
        ),
        (None, Some(a), None) => (a / 100 * 85, format!("85% of MemAvailable {}", human(a))),
        (None, None, None) => (
            m.total_bytes(),
            "MemAvailable unknown: assumed the whole model fits".to_string(),
        ),
    };
    ds.push(d("budget", human(budget), why));
    ds.push(d(
        "resident",
        human(m.resident_bytes),
        "dense weights, embeddings, norms, shared experts: always in RAM",
    ));
    ds.push(d(
        "kv cache",
        human(m.kv_bytes),
        "-c context x layers x KV row bytes, in the cache's types (-ctk/-ctv; see kv cache types)",
    ));
    ds.push(d(
        "process",
        human(m.process_bytes),
        "binary, tokenizer and heap measured now, plus the activation buffers of a -b chunk",
    ));
    // A run that may stream with the embedding table in the file needs room for the rest.
    let fixed = if req.embedding_in_file && req.mode != ExpertMode::Resident {
        m.fixed_bytes_embedding_in_file()
    } else {
        m.fixed_bytes()
    };
    if fixed > budget {
        return Err(PlanError::Impossible(format!(
            "budget {} cannot hold the resident part: weights {} + KV cache {} + process {} = {} (lower -c or raise --ram)",
            human(budget),
            human(m.resident_bytes - (m.fixed_bytes() - fixed)),
            human(m.kv_bytes),
            human(m.process_bytes),
            human(fixed)
        )));
    }
    Ok(budget)
}

/// Stream the routed experts through the cache, or read them through the mapped files.
fn experts_decision(
    m: &ModelSummary,
    req: &PlanRequest,
    budget: u64,
    fits: bool,
    ds: &mut Vec<Decision>,
) -> bool {
    let stream = match req.mode {
        ExpertMode::Resident => false,
        ExpertMode::Stream => true,
        ExpertMode::Auto => req.cap.is_some() || !fits,
    };
    let why = match (req.mode, stream) {
        (ExpertMode::Resident, _) => "--experts resident".to_string(),
        (ExpertMode::Stream, _) => "--experts stream".to_string(),
        (ExpertMode::Auto, true) if req.cap.is_some() => "--cap given".to_string(),
        (ExpertMode::Auto, streamed) => format!(
            "model + KV + process {} {} the budget {}",
            human(m.total_bytes()),
            if streamed { "exceed" } else { "fit" },
            human(budget)
        ),
    };
    ds.push(d(
        "experts",
        if stream {
            format!("streamed, {} routed", human(m.routed_bytes))
        } else {
            format!(
                "resident, {} routed read through the mapped files",
                human(m.routed_bytes)
            )
        },
        why,
    ));
    stream
}

/// The expert cache's shape: evictable slots per MoE layer, pinned experts, and how many
/// experts per layer stay cached on average (the mapped files' page cache when not streaming).
struct CacheLayout {
    slots: usize,
    pinned: usize,
    per_layer: f64,
}

fn cache_decision(
    m: &ModelSummary,
    req: &PlanRequest,
    stream: bool,
    budget: u64,
    left: u64,
    ds: &mut Vec<Decision>,
) -> Result<CacheLayout, PlanError> {
    let moe = m.moe_layers.max(1) as u64;
    let slot = m.slot_bytes.max(1);
    if !stream || m.moe_layers == 0 {
        // Mapped experts: the page cache keeps what the budget leaves.
        let per_layer = if m.moe_layers > 0 {
            (left / slot) as f64 / moe as f64
        } else {
            0.0
        };
        return Ok(CacheLayout {
            slots: 0,
            pinned: 0,
            per_layer,
        });
    }
    let floor = moe * slot;
    let mut pinned = 0;
    if let Some(avail) = req.autopin {
        let want = req.pin_bytes.unwrap_or(left / 2);
        let pin_bytes = want.min(left.saturating_sub(floor));
        pinned = ((pin_bytes / slot) as usize).min(avail);
    }
    let by_budget = ((left / slot) as usize).saturating_sub(pinned) / m.moe_layers;
    let (s, why) = match req.cap {
        Some(c) => (c, "--cap".to_string()),
        None => (
            by_budget,
            format!(
                "{} left for experts after resident + KV, {} a slot",
                human(left),
                human(slot)
            ),
        ),
    };
    let slots = if req.cap.is_none() && pinned > 0 {
        s.max(1)
    } else {
        s
    };
    if slots == 0 {
        return Err(PlanError::Impossible(format!(
            "budget {} leaves {} for experts, less than one {} slot per MoE layer x {} layers = {} (raise --ram)",
            human(budget),
            human(left),
            human(slot),
            m.moe_layers,
            human(floor)
        )));
    }
    let cache_bytes = (slots as u64 * moe + pinned as u64) * slot;
    let pin_why = match req.autopin {
        None => "no --autopin".to_string(),
        Some(0) => "--autopin, but no usage statistics yet".to_string(),
        Some(_) => match req.pin_bytes {
            Some(_) => "--autopin, --pin-gb".to_string(),
            None => {
                "--autopin: half the expert budget, the LRU keeping >= 1 slot a layer".to_string()
            }
        },
    };
    ds.push(d(
        "expert cache",
        format!(
            "{} = {} evictable slots/layer x {} layers + {} pinned",
            human(cache_bytes),
            slots,
            m.moe_layers,
            pinned
        ),
        why,
    ));
    ds.push(d(
        "pin/lru split",
        format!(
            "{} pinned / {} evictable",
            human(pinned as u64 * slot),
            human(slots as u64 * moe * slot)
        ),
        pin_why,
    ));
    Ok(CacheLayout {
        slots,
        pinned,
        per_layer: slots as f64 + pinned as f64 / moe as f64,
    })
}

/// `io_decision`'s answer: the IO mode, reader threads, and the disk ceiling used (the probed
/// read size and its best point, `MachineProfile::disk_ceiling`).
type IoChoice<'p> = (IoMode, usize, Option<(u64, &'p super::ReadPoint)>);

/// How experts are read (`--io`, else O_DIRECT where the profile says it works) and by how many
/// reader threads (`--io-threads`, else the disk probe's best point); also the disk ceiling the
/// prediction uses.
/// Two readers instead of the probe's one when two measured at least this close to one's peak.
const READERS_TIE: f64 = 0.15;

fn io_decision<'p>(
    m: &ModelSummary,
    profile: Option<&'p MachineProfile>,
    req: &PlanRequest,
    stream: bool,
    ds: &mut Vec<Decision>,
) -> Result<IoChoice<'p>, PlanError> {
    let direct_ok = profile.map(|p| p.storage.o_direct);
    let (io, io_why) = match (req.io, direct_ok) {
        (Some(i), _) => (i, "--io".to_string()),
        (None, Some(true)) | (None, None) if stream => (
            IoMode::Direct,
            if direct_ok.is_some() {
                "O_DIRECT works here: no page-cache double copy".to_string()
            } else {
                "default (no profile); falls back to buffered where O_DIRECT is refused".to_string()
            },
        ),
        (None, Some(false)) if stream => (
            IoMode::Buffered,
            "O_DIRECT refused on this filesystem (doctor)".to_string(),
        ),
        (None, _) => (
            IoMode::Direct,
            "unused: experts are not streamed".to_string(),
        ),
    };
    // The reads the cache issues: an expert's tensors split into pieces of at most
    // `read_chunk` (1 MiB), not one read of the whole slot. The probe's series nearest that
    // size picks the readers (a 2.5 MiB series that peaked with one reader chose one reader
    // for runs whose 1 MiB reads went 1.5x faster with two or four).
    let read_bytes = m
        .slot_bytes
        .min(crate::experts::CacheConfig::new(1).read_chunk);
    let ceiling = profile.and_then(|p| p.disk_ceiling(read_bytes));
    let (threads, threads_why) = match (req.io_threads, ceiling) {
        (Some(0), _) => return Err(PlanError::Flag("--io-threads must be at least 1".into())),
        (Some(t), _) => (t, "--io-threads".to_string()),
        (None, Some((b, p))) => {
            let peak = format!(
                "O_DIRECT {} reads peaked at {:.2} GB/s with {} threads",
                human(b),
                p.gbps,
                p.threads
            );
            // One reader leaves the disk idle between a read's end and the next one's start,
            // and a wave's reads never overlap: runs read at 0.9 reads in flight, 0.72 of the
            // ceiling (docs/PERFORMANCE.md, session 28). A second reader costs nothing where
            // the probe found two within `TIE` of one (a tie, on a noisy disk).
            let two = profile
                .and_then(|pr| pr.storage.nearest_direct(read_bytes))
                .and_then(|s| s.points.iter().find(|q| q.threads == 2))
                .filter(|q| p.threads == 1 && q.gbps >= p.gbps * (1.0 - READERS_TIE));
            match two {
                Some(q) => (
                    2,
                    format!(
                        "{peak}, 2 threads {:.2} (within {:.0}%: two keep a read in flight while the other lands)",
                        q.gbps,
                        100.0 * READERS_TIE
                    ),
                ),
                None => (p.threads.clamp(1, 64), peak),
            }
        }
        (None, None) => (4, "default (no measured disk figures)".to_string()),
    };
    if stream {
        ds.push(d(
            "io",
            format!("{} x{threads} readers", io.name()),
            format!("{io_why}; {threads_why}"),
        ));
    }
    Ok((io, threads, ceiling))
}

/// `--mtp`: on when asked (with a warning when decode is disk-bound), with the cost model's
/// verdict beside it.
fn mtp_decision(
    m: &ModelSummary,
    req: &PlanRequest,
    disk_bound: bool,
    cost: Option<&MtpCost>,
) -> Decision {
    let cost_why = |c: &MtpCost| {
        format!(
            "--mtp {}: a step reads {:.1} experts per MoE layer (the union of {} tokens) against {} per plain token and costs {:.2}x a plain token, so it {}",
            c.drafts,
            c.union_per_layer,
            c.drafts + 1,
            m.top_k,
            c.step_cost,
            match c.break_even_acceptance {
                Some(a) => format!("pays above {:.0}% acceptance per draft", 100.0 * a),
                None => "never pays (it costs K+1 plain tokens or more)".to_string(),
            }
        )
    };
    let with_cost = |why: String| match cost {
        Some(c) => format!("{why}; {}", cost_why(c)),
        None => why,
    };
    let (value, why) = if m.mtp_layers == 0 {
        (
            "off".to_string(),
            if req.mtp > 0 {
                "--mtp asked, but the model has no MTP head".to_string()
            } else {
                "the model has no MTP head".to_string()
            },
        )
    } else if req.mtp > 0 {
        let why = if disk_bound {
            "--mtp; warning: decode is disk-bound, and the MTP head's drafts widen the per-token expert union, so it will likely slow decode".to_string()
        } else {
            "--mtp".to_string()
        };
        (format!("on, {} drafts", req.mtp), with_cost(why))
    } else if disk_bound {
        ("off".to_string(), "disk-bound: the MTP head's drafts widen the per-token expert union (more misses per step)".to_string())
    } else {
        (
            "off".to_string(),
            with_cost(
                "not asked (--mtp K turns it on; pays when experts are resident)".to_string(),
            ),
        )
    };
    d("mtp", value, why)
}

fn hit_decision(m: &ModelSummary, per_layer: f64, hit: (f64, f64)) -> Decision {
    d(
        "expected hit",
        format!("{:.0}%..{:.0}%", 100.0 * hit.0, 100.0 * hit.1),
        format!(
            "{:.1} cached of {} experts per layer: uniform routing {:.0}% (lower bound), Zipf(1) popularity with the top experts cached {:.0}% (upper)",
            per_layer.min(m.experts_per_layer as f64),
            m.experts_per_layer,
            100.0 * hit.0,
            100.0 * hit.1
        ),
    )
}

fn prediction_decision(
    m: &ModelSummary,
    profile: Option<&MachineProfile>,
    predicted: Option<(f64, f64)>,
    disk: Option<f64>,
    mem: Option<f64>,
    disk_bound: bool,
) -> Decision {
    match (predicted, disk, mem) {
        (Some((lo, hi)), Some(dk), Some(mm)) => d(
            "predicted decode",
            format!("{lo:.2}–{hi:.2} tok/s"),
            format!(
                "(1 - hit) x {} routed/token from disk at {dk:.2} GB/s + {} active/token from RAM at {mm:.2} GB/s; {}",
                human(m.routed_bytes_per_token()),
                human(m.active_bytes_per_token()),
                if disk_bound { "disk-bound" } else { "memory-bound" }
            ),
        ),
        _ => d(
            "predicted decode",
            "unknown",
            match (disk, mem) {
                (None, _) if profile.is_none() => {
                    "no machine profile (run `sluice doctor`)".to_string()
                }
                (None, _) => "the profile has no O_DIRECT read figure".to_string(),
                _ => "the profile has no memory read bandwidth".to_string(),
            },
        ),
    }
}

/// Prefetch: predict the next layer's experts and read them early (forward.rs). It can only
/// help while experts stream and decode waits on the disk, and only if the prediction is good
/// enough that the wasted reads and evictions cost less than the overlap gains. Measured on the
/// generated Qwen3-30B-shaped model (docs/PERFORMANCE.md, "Prefetch"): precision 52%, decode
/// 0.84-0.86x while disk-bound, so the default is off until a model where it wins is measured.
/// The flag wins where experts stream.
fn prefetch_decision(stream: bool, disk_bound: bool, req: &PlanRequest) -> (bool, String) {
    match (req.prefetch, stream) {
        (Some(true), false) => (
            false,
            "--prefetch, but experts are not streamed: nothing to read early".to_string(),
        ),
        (Some(on), true) => (on, "--prefetch".to_string()),
        (Some(false) | None, false) => (false, "experts are not streamed".to_string()),
        (None, true) => (
            false,
            format!(
                "{}measured slower on the generated Qwen3-30B-shaped model (52% of predictions right, decode 0.84-0.86x; PERFORMANCE.md \"Prefetch\"): `--prefetch` to try it",
                if disk_bound { "disk-bound, but " } else { "" }
            ),
        ),
    }
}

/// The cached machine profile for the storage under `files`, without probing; `None` if none
/// is cached for this device and CPU.
pub fn cached_profile(files: &crate::format::ModelFiles) -> Option<MachineProfile> {
    let o = super::ProbeOptions::for_model(files);
    let cpu = super::probe_cpu::probe();
    let key = super::profile_key(&o.storage_dir, &cpu).ok()?;
    let mut p = super::read_profile(&super::profile_path(&o.cache_dir, &key))
        .filter(|p| p.key == key && p.cpu == cpu)?;
    p.refresh_volatile();
    Some(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_is_off_unless_asked_and_streamed() {
        let req = |p| PlanRequest {
            prefetch: p,
            ..PlanRequest::default()
        };
        for disk_bound in [false, true] {
            let (on, why) = prefetch_decision(true, disk_bound, &req(None));
            assert!(!on && why.contains("measured slower"), "{why}");
            assert!(prefetch_decision(true, disk_bound, &req(Some(true))).0);
            assert!(!prefetch_decision(true, disk_bound, &req(Some(false))).0);
        }
        let (on, why) = prefetch_decision(false, true, &req(Some(true)));
        assert!(!on && why.contains("not streamed"));
        assert!(!prefetch_decision(false, false, &req(None)).0);
    }
}
