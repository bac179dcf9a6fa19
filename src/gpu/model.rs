//! The GPU device: what a CUDA backend keeps across chunks and the coarse steps it runs.
//!
//! Owns: `GpuState` (device copies of the dense weights, mapped from their host addresses;
//! the KV cache; scratch sized once; the VRAM expert pool; the pinned host buffers for the
//! small per-layer transfers), the helpers that launch the kernels (`mm`, `rmsnorm`, `rope`,
//! `attention`, ...), the MoE step (`moe`: routing, job lists, expert launches, combine) and
//! the staging of routed experts from the RAM expert cache into the pool. `backend.rs` maps the
//! forward graph's operations onto these and runs whole chunks (CUDA graph for decode).
//! Does not own: what is computed (the graph, `model::forward`), the RAM cache/SSD reads.
//! Routing runs on the device (kernels.cu `route`, the CPU's `route_token` rule) for every
//! placement; where the routing kernel cannot take a model (more than 64 experts per token,
//! 32 groups or 1024 experts) the host routes with the CPU model's `select_experts`. Quantized
//! weights of the `Q8_TYPES` are dotted with activations quantized to 8 bits per 32 values, as
//! the CPU kernels do; float weights with f32 ones.
//! Invariants: after `attach`, a forward allocates nothing (host or device); each token's MoE
//! output is summed in top-k slot order by one kernel, so it does not depend on which experts
//! were resident or in what order their bytes arrived: tokens do not change with `--vram` or
//! `--gpu-staging`. A RAM-cache slot is never handed back (`ExpertCache::end`) while a copy
//! from it is in flight, and a VRAM slot is never overwritten while a kernel may read it.

use super::driver::{pinned_h2d_gbps, Arg, DevBuf, Event, Gpu, Graph, Kernel, PinnedBuf, Stream};
use super::gemm::{self, GemmFns};
use super::pool::VramPool;
use super::{GpuError, GpuOptions, GpuStats, Staging};
use crate::dtype::DType;
use crate::kernels::WeightView;
use crate::model::config::{AttnKind, ExpertAct, ModelConfig};
use crate::model::weights::{Attention, Ffn, HeadMat, Mlp};
use crate::model::{Model, ModelError, State};
use std::borrow::Cow;
use std::collections::HashMap;
use std::time::Instant;

const WARPS: u32 = 8;
/// Tokens per pass of a matrix-product warp (kernels.cu `NT`).
const NT: usize = 4;
const ALIGN: usize = 256;
/// Bytes of one `Job` in kernels.cu (three u64 pointers, two i32).
const JOB_BYTES: usize = 32;

/// The most flash-decoding splits a state's decode steps use: 64, or `SLUICE_GPU_DEC_SPLITS=N`
/// (1..=128, the tensor-core decode kernel's limit) to measure where the decode kernel's time
/// goes (fewer splits: more keys per block and fewer partials to merge; more: more blocks, so
/// more loads in flight).
fn dec_splits_max() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("SLUICE_GPU_DEC_SPLITS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(64, |n| n.clamp(1, 128))
    })
}

/// From 16 N positions on, the tensor-core decode kernel's splits take at least N positions
/// (whole 64-key tiles; 64 below): N = 256, or `SLUICE_GPU_DEC_MIN_CHUNK=N` (rounded up to a
/// multiple of 64, at most 8192; 64 turns it off). Measured on an H100 (docs/PERFORMANCE.md,
/// session 37): at 4096 positions 16 splits of 256 decode 3 % faster than 64 of 64 (the last
/// block merges 4x fewer partials); at 1024 and 2048 the 64-key splits are 5 % faster than
/// 128 or 192; at 16384 both rules give 64 splits of 256.
fn dec_min_chunk() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("SLUICE_GPU_DEC_MIN_CHUNK")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(256, |n| n.clamp(64, 8192).next_multiple_of(64))
    })
}

/// What `GpuState::add_rmsnorm` adds to x before the norm.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Residual {
    None,
    /// Rows of this (packed, as x) buffer.
    Rows(u64),
    /// The MoE slot outputs, weighted and summed in slot order (`moe_combine`).
    Combine,
}

/// Whether prompt attention takes `attention_tiled` (`SLUICE_GPU_ATT_TILED=0`: `attention`).
fn att_tiled_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_GPU_ATT_TILED").map_or(true, |v| v != "0"))
}

/// Whether prompt attention over an f16 cache takes the tensor cores (`attention_mma_<D>`; on
/// unless `SLUICE_GPU_ATT_MMA=0`, which keeps `attention_tiled`, f32 throughout). Measured in
/// session 34 (docs/PERFORMANCE.md, H100): pp512 1.18x and 6.1x `attention_tiled` at depth 0 and
/// 16384, 1.32x and 1.15x llama.cpp's.
fn att_mma_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_GPU_ATT_MMA").map_or(true, |v| v != "0"))
}

/// Whether flash-decoding over an f16 cache of f32 words takes the tensor cores with a
/// key/value head's query heads in one block (`attention_mma_dec_<D>`) for a state of `ctx`
/// positions (a cache stored as f16 always does: `kv_half_storage`):
/// `SLUICE_GPU_ATT_MMA_DEC=1` / `=0` force it on / off; by default it is on for contexts of at
/// least 8192. Measured in session 34 (H100, docs/PERFORMANCE.md): tg64 at depth 16384 1.34x
/// `attention_split_merge`, at depth 0 0.93x (too few keys per split to fill the GPU with a
/// block per group). The decode graph is captured for every position, so the choice follows
/// the context a state is made for, not the position.
fn att_mma_dec_on(ctx: usize) -> bool {
    static ON: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    ON.get_or_init(|| {
        std::env::var("SLUICE_GPU_ATT_MMA_DEC")
            .ok()
            .map(|v| v != "0")
    })
    .unwrap_or(ctx >= 8192)
}

/// Whether a state stores its KV cache as f16 (`kv_half`): half the bytes the attention
/// kernels read at depth (the f32 words holding f16 values were half padding). Only the
/// tensor-core kernels read f16 storage, so it takes an f16 cache on both sides that they serve
/// for every prompt and decode step: GQA attention (not MLA, DeepSeek-V4 or the hybrid families,
/// whose tiny fixtures are the only ones with such head sizes and have not run it; no sliding
/// window or sinks), keys and values of one head size in `MMA_DIMS`, at most 16 query heads per key/value
/// head, at most 128 decode splits, and neither kernel turned off (`SLUICE_GPU_ATT_MMA=0` or
/// `SLUICE_GPU_ATT_MMA_DEC=0` keep f32 storage, which their kernels read). Decode then always
/// takes the grouped tensor-core kernel: at depth 4096 / 16384 1.14x / 1.07x the f32 words'
/// tg64, at depth 0 level with the per-head split kernel (H100, session 35,
/// docs/PERFORMANCE.md).
fn kv_half_storage(cfg: &ModelConfig, kv16: [bool; 2], splits: usize) -> bool {
    let dec_off = std::env::var("SLUICE_GPU_ATT_MMA_DEC").is_ok_and(|v| v == "0");
    let (heads, kvh) = (cfg.n_heads, cfg.n_kv_heads.max(1));
    kv16 == [true, true]
        && cfg.attn == AttnKind::Gqa
        && cfg.v4.is_none()
        && cfg.hybrid.is_none()
        && cfg.sliding_window.is_none()
        && !cfg.attn_sinks
        && MMA_DIMS.contains(&cfg.head_dim)
        && cfg.v_head_dim == cfg.head_dim
        && heads.is_multiple_of(kvh)
        && (1..=16).contains(&(heads / kvh))
        && splits <= 128
        && att_mma_on()
        && !dec_off
}

/// Which sides of the GPU's KV cache hold f16 numbers for a state whose cache types are `kv`:
/// the GPU keeps f32 storage and rounds what it stores to f16 where the type is f16 (the
/// values the CPU's f16 cache holds); bf16 and q8_0 have no GPU kernels. An MLA cache's value
/// side holds V3.2's indexer keys, always f32.
pub fn gpu_kv16(cfg: &ModelConfig, kv: crate::model::KvTypes) -> Result<[bool; 2], GpuError> {
    use crate::kernels::kv::KvType;
    let side = |t: KvType, flag: &str| {
        match t {
        KvType::F32 => Ok(false),
        KvType::F16 => Ok(true),
        other => Err(GpuError::Config(format!(
            "{flag} {other}: the GPU's KV cache holds f32 or f16 values; use -ctk/-ctv f16 or f32, or --gpu off"
        ))),
    }
    };
    let mla = matches!(cfg.attn, AttnKind::Mla { .. });
    Ok([side(kv.k, "-ctk")?, side(kv.v, "-ctv")? && !mla])
}

/// Head sizes `attention_mma_<D>` and `attention_mma_dec_<D>` are instantiated for
/// (kernels_mma.cu).
const MMA_DIMS: [usize; 4] = [16, 32, 64, 128];

fn align(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// `<name>_<d>` for each head size d of `MMA_DIMS`, in that order.
fn per_mma_dim(gpu: &Gpu, name: &str) -> Result<[Kernel; 4], GpuError> {
    let mut k = [gpu.function(&format!("{name}_{}", MMA_DIMS[0]))?; 4];
    for (k, d) in k.iter_mut().zip(MMA_DIMS).skip(1) {
        *k = gpu.function(&format!("{name}_{d}"))?;
    }
    Ok(k)
}

/// The kernel-name suffix of `d`, if kernels.cu has kernels for it.
fn type_name(d: DType) -> Option<String> {
    super::GPU_TYPES
        .contains(&d)
        .then(|| d.name().to_ascii_lowercase())
}

/// The four kernels of one weight type, and its int8-activation kernels where it has them.
#[derive(Clone, Copy)]
struct TypeFns {
    /// F32 weights (a router of this type joins its routing kernel: `router_route_jobs`).
    f32: bool,
    mm: Kernel,
    gate_up: Kernel,
    down: Kernel,
    embed: Kernel,
    q: Option<QFns>,
}

/// Kernels that dot a type's blocks with 8-bit activations (`__dp4a`), kernels.cu `mmq_*`.
#[derive(Clone, Copy)]
struct QFns {
    mm: Kernel,
    /// Two rows per warp (kernels.cu `mmq2_*`) for tall matvecs, only with
    /// `SLUICE_GPU_MMQ_ROWS=2`: on the H200 it made the output head slower (251 vs 165 us).
    mm2: Option<Kernel>,
    /// Up to three matrices of this type in one launch (kernels_fused.cu `mmq3`).
    mm3: Kernel,
    /// `down` quantizing its input rows itself (kernels_fused.cu `moe_down_qs`).
    down_s: Kernel,
    gate_up: Kernel,
    down: Kernel,
    gemm: GemmFns, // prefill GEMM (gemm.rs)
    /// One-token forwards (a decode step) take the `*_t1` kernels: the same sums in about half
    /// the registers (kernels.cu `row_dotq`); `SLUICE_GPU_T1=0` keeps the 4-token kernels.
    t1: Option<T1Fns>,
}

/// The one-token-per-pass instances of `mm`, `mm3`, `gate_up` and `down_s`.
#[derive(Clone, Copy)]
struct T1Fns {
    mm: Kernel,
    mm3: Kernel,
    gate_up: Kernel,
    down_s: Kernel,
    /// `down_s` with R rows per warp (kernels_fused.cu `moe_down_qs_rows`, same sums), and R:
    /// `SLUICE_GPU_DOWN_ROWS=2|4` (1: `down_s`).
    down_r: Option<(Kernel, u32)>,
    /// `mm` with two rows per warp for tall matvecs (the output head; `mmq_rows1`, same sums):
    /// `SLUICE_GPU_MMQ_ROWS=2`.
    mm2: Option<Kernel>,
}

/// Rows per warp of the one-token expert down product (`SLUICE_GPU_DOWN_ROWS`, default 1).
fn down_rows() -> u32 {
    static R: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *R.get_or_init(|| match std::env::var("SLUICE_GPU_DOWN_ROWS").as_deref() {
        Ok("2") => 2,
        Ok("4") => 4,
        _ => 1,
    })
}

/// Whether flash-decoding takes a key/value head's query heads together
/// (`attention_group_split_merge`, `SLUICE_GPU_ATT_GROUP=1`; otherwise one block per query
/// head). Opt-in until it has run on a device (written in session 27, when none was lent).
fn att_group_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_GPU_ATT_GROUP").is_ok_and(|v| v == "1"))
}

/// Whether RMSNorm rows of up to 4096 values take `add_rmsnorm_q8_w` (1024 threads; same
/// bits) rather than `add_rmsnorm_q8` (`SLUICE_GPU_NORM_WIDE=0`: no).
fn norm_wide_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_GPU_NORM_WIDE").map_or(true, |v| v != "0"))
}

/// Whether one-token forwards take the `*_t1` kernels (`SLUICE_GPU_T1=0`: no).
fn t1_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_GPU_T1").map_or(true, |v| v != "0"))
}

/// Weight types with int8-activation (dp4a) kernels; the float types keep f32 activations
/// (the precision reference path), and the rest the f32-activation kernels.
pub const Q8_TYPES: [DType; 10] = [
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::Q8_0,
    DType::Q4_0,
    // kernels_quants.cu
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::IQ4_NL,
    DType::IQ4_XS,
];

/// A weight matrix in the device arena.
#[derive(Clone, Copy)]
pub(super) struct Mat {
    pub(super) off: usize,
    pub(super) rows: usize,
    pub(super) cols: usize,
    rb: usize,
    f: TypeFns,
}

#[derive(Clone, Copy)]
struct GMlp {
    gate: Mat,
    up: Mat,
    down: Mat,
}

#[derive(Clone, Copy)]
struct GMoe {
    router: Mat,
    /// Selection bias (DeepSeek's e_score_correction_bias), f32 in the arena.
    bias: Option<usize>,
    shared: Option<GMlp>,
    geo: MoeGeo,
    /// The router's bias (gpt-oss), f32 in the arena.
    router_bias: Option<usize>,
    /// Qwen3-Next's shared-expert gate vector, f32 in the arena (`hybrid.rs`).
    shared_gate: Option<usize>,
}

/// A MoE layer's routed-expert geometry (all its experts share it).
#[derive(Clone, Copy)]
pub(super) struct MoeGeo {
    /// Index among MoE layers (the pool's layer numbering).
    pub(super) idx: usize,
    gate_up: TypeFns,
    down: TypeFns,
    ffn: usize,
    rb_gate: usize,
    rb_down: usize,
    /// gpt-oss's expert biases and clamped SwiGLU (`ops.rs`); None: the fused silu kernels.
    act: Option<super::ops::ExpertAct>,
}

pub(super) struct Small {
    rmsnorm: Kernel,
    add: Kernel,
    pub(super) add_bias: Kernel,
    pub(super) silu_mul: Kernel,
    rope: Kernel,
    attention: Kernel,
    head_mv: Kernel,
    pub(super) copy2d: Kernel,
    combine: Kernel,
    quantize: Kernel,
    route: Kernel,
    build_jobs: Kernel,
    kv_store: Kernel,
    att_split: Kernel,
    att_merge: Kernel,
    // kernels_fused.cu
    add_rms_q8: Kernel,
    /// `add_rmsnorm_q8` on 1024 threads (rows of up to 4096 values; same bits).
    add_rms_q8w: Kernel,
    qk_rope_store: Kernel,
    att_split_merge: Kernel,
    /// Flash-decoding with a key/value head's query heads in one block (`SLUICE_GPU_ATT_GROUP=1`
    /// on).
    att_group: Kernel,
    /// Prompt attention in 32-query tiles (kernels_fused.cu `attention_tiled`).
    att_tiled: Kernel,
    /// Prompt attention over an f16 cache on the tensor cores, per head size `MMA_DIMS`
    /// (kernels_mma.cu).
    att_mma: [Kernel; 4],
    /// Flash-decoding over an f16 cache on the tensor cores, a key/value head's query heads
    /// per block, per head size `MMA_DIMS` (kernels_mma.cu).
    att_mma_dec: [Kernel; 4],
    /// `att_mma` and `att_mma_dec` over an f16-stored cache (`kv_half`).
    att_mma_h: [Kernel; 4],
    att_mma_dec_h: [Kernel; 4],
    route_jobs: Kernel,
    router_route_jobs: Kernel,
}

/// Event pairs timing compute segments and expert copies, harvested at sync points.
struct Timers {
    events: Vec<Event>,
    next: usize,
    /// (start, end, is_copy)
    pairs: Vec<(usize, usize, bool)>,
}

/// Scratch device buffers (f32 unless noted).
pub(super) struct Bufs {
    pub(super) x: DevBuf,
    pub(super) xn: DevBuf,
    pub(super) q: DevBuf,
    pub(super) qa: DevBuf,
    pub(super) k: DevBuf,
    pub(super) v: DevBuf,
    pub(super) att: DevBuf,
    pub(super) qcat: DevBuf,
    pub(super) clat: DevBuf,
    pub(super) proj: DevBuf,
    /// Final-normed hidden states of the chunk (`Buf::Hfin`).
    pub(super) hfin: DevBuf,
    pub(super) gate: DevBuf,
    pub(super) up: DevBuf,
    down: DevBuf,
    router: DevBuf,
    pub(super) hb: DevBuf,
    /// The experts' raw up products (gpt-oss's path, `ops.rs`; one float otherwise).
    pub(super) hu: DevBuf,
    pub(super) slot_out: DevBuf,
    pub(super) scores: DevBuf,
    pub(super) logits: DevBuf,
    pub(super) tokens: DevBuf, // i32
    pub(super) tok: DevBuf,    // i32
    pub(super) dst: DevBuf,    // i32
    selw: DevBuf,
    jobs: DevBuf, // Job
    pub(super) kcache: DevBuf,
    pub(super) vcache: DevBuf,
    cos: DevBuf,
    sin: DevBuf,
    /// 8-bit activations (i8) and their per-32 scales, for the dp4a kernels.
    xq: DevBuf,
    xd: DevBuf,
    /// The same for the experts' hidden rows (hb), so xn's stay valid across expert launches.
    hq: DevBuf,
    hd: DevBuf,
    /// [pos, rope pos] of the forward's first token (i32), read by rope/attention/kv_store.
    pub(super) pos: DevBuf,
    /// The device's routing: expert per assignment (i32) and the job count (i32).
    pub(super) sel: DevBuf,
    njobs: DevBuf,
    /// Experts run since the last harvest (i32).
    pub(super) stat: DevBuf,
    /// Zeroed counters of the fused kernels' last-block hand-off (u32; kernels_fused.cu
    /// `last_block`): [0] the router's, then one per (token, head) of flash-decoding's merge.
    done: DevBuf,
    /// Per MoE layer and expert: gate, up, down pointers (u64), for device-built job lists.
    etab: DevBuf,
    /// Flash-decoding partials: max, sum (f32) and unnormalised outputs per split.
    pub(super) pm: DevBuf,
    pub(super) pl: DevBuf,
    pub(super) po: DevBuf,
}

/// Pinned host buffers for the small transfers of every layer.
pub(super) struct Host {
    router: PinnedBuf,
    pub(super) logits: PinnedBuf,
    pub(super) tokens: PinnedBuf,
    tok: PinnedBuf,
    dst: PinnedBuf,
    selw: PinnedBuf,
    jobs: PinnedBuf,
    pub(super) pos: PinnedBuf,
    sel: PinnedBuf,
    pub(super) stat: PinnedBuf,
    etab: PinnedBuf,
}

pub struct GpuState {
    // Field order is drop order: the graph and buffers before the context they live in.
    /// The decode step's CUDA graph, once captured (see `backend.rs`).
    pub(super) graph: Option<Graph>,
    pub(super) bufs: Bufs,
    pub(super) host: Host,
    weights: DevBuf,
    pool_mem: DevBuf,
    timers: Timers,
    /// Device copies of the graph's weights, by the host address and length of their bytes
    /// (`WeightView::bytes`, f32 vectors, per-head matrix lists), built once at attach.
    pub(super) mats: HashMap<(usize, usize), Mat>,
    pub(super) vecs: HashMap<(usize, usize), usize>,
    pub(super) head_mats: HashMap<(usize, usize), usize>,
    /// Per layer: its routed block on the device (None: dense).
    moes: Vec<Option<GMoe>>,
    pub(super) small: Small,
    /// kernels_ops.cu's kernels (`ops.rs`).
    pub(super) ops: super::ops::Ops,
    pub(super) pool: VramPool,
    /// `--gpu-experts hybrid`: pool misses of few tokens run on the CPU (`split.rs`); None:
    /// every miss is staged.
    pub(super) split: Option<super::split::Split>,
    staging: Staging,
    /// The RAM cache slab registered at attach (arena staging): (ptr, len).
    registered: Option<(usize, usize)>,
    /// Tokens of attention per launch (bounded so the score scratch stays small).
    pub(super) att_rows: usize,
    pub(super) stats: GpuStats,
    pub h2d_ceiling_gbps: Option<f64>,
    /// Per-layer scratch of the MoE step (capacity n_experts, never grown after attach).
    misses: Vec<(usize, usize, usize)>,
    hits: Vec<usize>,
    /// Per pool slot: byte offsets of gate, up and down inside it (as staged).
    slot_offs: Vec<[usize; 3]>,
    wave: Vec<usize>,
    /// The quantized-activation buffer holds (src, ld, rows, cols) of this input; cleared by
    /// every other launch (`launch`), so consecutive products of one input quantize it once.
    pub(super) xq_src: std::cell::Cell<Option<(u64, usize, usize, usize)>>,
    /// Per MoE layer: every expert is in the VRAM pool and the device table `etab` holds its
    /// pointers, so the layer's jobs are built on the device (no host round trip).
    pub(super) layer_ready: Vec<bool>,
    experts_per_layer: Vec<usize>,
    /// Flash-decoding: splits and positions per split (forwards of at most `split_rows` tokens).
    pub(super) splits: usize,
    pub(super) chunk: usize,
    /// Whether the routing kernel can take this model (k, groups, experts within its limits).
    pub(super) device_route: bool,
    /// The device's count of experts run, as last read.
    pub(super) stat_last: i32,
    /// Experts per token (n_experts_used).
    pub(super) k: usize,
    /// Decode steps run as a CUDA graph (`SLUICE_GPU_GRAPH=0` turns it off, for A/B runs).
    pub(super) graphs: bool,
    /// Fused decode kernels (kernels_fused.cu); `SLUICE_GPU_FUSED=0` runs kernels.cu's one by one.
    pub(super) fused: bool,
    /// A forward is being recorded into the graph (timers are off: one pair times a replay).
    pub(super) capturing: bool,
    /// The open compute-stream timer of the running chunk (closed around host round trips).
    pub(super) seg: usize,
    /// Cache and rotary position of the running chunk's row 0 (what `bufs.pos` holds).
    pub(super) at: (usize, usize),
    /// Positions in the KV cache (the state's context).
    pub(super) ctx: usize,
    /// MLA model: the KV cache keeps latent + rope key rows only (no V side).
    pub(super) mla: bool,
    /// The cache's keys / values are f16 numbers (-ctk / -ctv f16, as the CPU state's): each
    /// is rounded to f16 as it is stored (the storage stays f32). V3.2's indexer keys, on the
    /// value side of an MLA cache, stay f32.
    pub(super) kv16: [bool; 2],
    /// The cache is stored as f16 (`kv_half_storage`; else f32 words).
    pub(super) kv_half: bool,
    /// DeepSeek-V3.2 / GLM-5: the lightning indexer's buffers (`ops.rs`).
    pub(super) idx: Option<super::ops::IdxState>,
    /// Qwen3-Next / Qwen3.5: the linear layers' states and the mixers' scratch (`hybrid.rs`).
    pub(super) hybrid: Option<super::hybrid::HybridDev>,
    /// DeepSeek-V4: the streams, scratch and expert tables (`v4.rs`).
    pub(super) v4: Option<super::v4::V4Dev>,
    pub(super) gpu: Gpu,
}

/// Tokens per forward up to which attention is split over position chunks (decode, drafts).
pub(super) const SPLIT_ROWS: usize = 8;

// SAFETY: the driver handles inside (context, streams, functions, events) are usable from any
// thread once the context is bound, which every entry point does; the pinned buffers are
// plain memory owned by the state.
unsafe impl Send for GpuState {}

/// What `attach` set up, for the `[plan]` lines.
pub struct GpuSummary {
    pub device: String,
    pub vram_total: usize,
    pub weights_bytes: usize,
    /// The KV cache and, for the hybrid families, the linear layers' recurrent + conv state
    /// (per sequence, as the KV cache).
    pub kv_bytes: usize,
    /// The KV cache is stored as f16 (`kv_half_storage`), else as f32 words.
    pub kv_half: bool,
    pub scratch_bytes: usize,
    pub pool_bytes: usize,
    pub pool_slots_per_layer: usize,
    pub pool_pinned: usize,
    pub slot_bytes: u64,
    pub all_experts_bytes: u64,
    pub staging: Staging,
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Builds the device weight arena: every piece gets an offset now, bytes are uploaded once the
/// single allocation exists.
/// Each piece is keyed by the host address and length of what it copies, so a weight the
/// graph passes again (tied embeddings) maps to one device copy.
pub(super) struct Builder<'a> {
    gpu: &'a Gpu,
    pieces: Vec<(usize, Cow<'a, [u8]>)>,
    total: usize,
    fns: Vec<(DType, TypeFns)>,
    mats: HashMap<(usize, usize), Mat>,
    vecs: HashMap<(usize, usize), usize>,
    heads: HashMap<(usize, usize), usize>,
}

/// The map key of a host slice: its address and length.
pub(super) fn key<T>(v: &[T]) -> (usize, usize) {
    (v.as_ptr() as usize, v.len())
}

impl<'a> Builder<'a> {
    fn put(&mut self, bytes: Cow<'a, [u8]>) -> usize {
        let off = self.total;
        self.total += align(bytes.len().max(1));
        self.pieces.push((off, bytes));
        off
    }

    pub(super) fn vec(&mut self, v: &[f32]) -> usize {
        if let Some(&o) = self.vecs.get(&key(v)) {
            return o;
        }
        let o = self.put(Cow::Owned(f32_bytes(v)));
        self.vecs.insert(key(v), o);
        o
    }

    fn fns(&mut self, d: DType, what: &str) -> Result<TypeFns, GpuError> {
        if let Some((_, f)) = self.fns.iter().find(|(t, _)| *t == d) {
            return Ok(*f);
        }
        let n = type_name(d).ok_or_else(|| {
            let known: Vec<String> = super::GPU_TYPES.iter().map(|t| t.name()).collect();
            GpuError::Config(format!(
                "{what}: tensor type {} has no GPU kernel (GPU types: {})",
                d.name(),
                known.join(" ")
            ))
        })?;
        let f = TypeFns {
            f32: d == DType::F32,
            mm: self.gpu.function(&format!("mm_{n}"))?,
            gate_up: self.gpu.function(&format!("moe_gate_up_{n}"))?,
            down: self.gpu.function(&format!("moe_down_{n}"))?,
            embed: self.gpu.function(&format!("embed_{n}"))?,
            q: if Q8_TYPES.contains(&d) {
                Some(QFns {
                    // Q6_K matvecs of several tokens stage each row through shared memory
                    // (kernels.cu `mmq_q6_ks`: 16-byte loads instead of ~18 narrow ones per 16
                    // values; not yet timed: the benchmark file's head is Q4_K);
                    // `SLUICE_GPU_Q6_STAGE=0` reads rows directly (same sums). One-token
                    // products take the `*_t1` kernels.
                    mm: if d == DType::Q6_K
                        && std::env::var("SLUICE_GPU_Q6_STAGE").map_or(true, |v| v != "0")
                    {
                        self.gpu.function("mmq_q6_ks")?
                    } else {
                        self.gpu.function(&format!("mmq_{n}"))?
                    },
                    mm2: if std::env::var("SLUICE_GPU_MMQ_ROWS").is_ok_and(|v| v == "2") {
                        self.gpu.function(&format!("mmq2_{n}")).ok()
                    } else {
                        None
                    },
                    mm3: self.gpu.function(&format!("mmq3_{n}"))?,
                    down_s: self.gpu.function(&format!("moe_down_qs_{n}"))?,
                    gate_up: self.gpu.function(&format!("moe_gate_up_q_{n}"))?,
                    down: self.gpu.function(&format!("moe_down_q_{n}"))?,
                    gemm: GemmFns::load(self.gpu, &n)?, // prefill GEMM (gemm.rs)
                    t1: if t1_on() {
                        // SLUICE_GPU_T1=2: the kernels not held to 40 registers (`*_t1n`).
                        let sfx = match std::env::var("SLUICE_GPU_T1").as_deref() {
                            Ok("2") => "t1n",
                            _ => "t1",
                        };
                        let f = |k: &str| self.gpu.function(&format!("{k}_{n}_{sfx}")).ok();
                        match (f("mmq"), f("mmq3"), f("moe_gate_up_q"), f("moe_down_qs")) {
                            (Some(mm), Some(mm3), Some(gate_up), Some(down_s)) => Some(T1Fns {
                                mm,
                                mm3,
                                gate_up,
                                down_s,
                                down_r: match down_rows() {
                                    1 => None,
                                    r => self
                                        .gpu
                                        .function(&format!("moe_down_qs{r}_{n}_t1"))
                                        .ok()
                                        .map(|k| (k, r)),
                                },
                                mm2: if std::env::var("SLUICE_GPU_MMQ_ROWS").is_ok_and(|v| v == "2")
                                {
                                    self.gpu.function(&format!("mmq2_{n}_t1")).ok()
                                } else {
                                    None
                                },
                            }),
                            _ => None,
                        }
                    } else {
                        None
                    },
                })
            } else {
                None
            },
        };
        self.fns.push((d, f));
        Ok(f)
    }

    pub(super) fn mat(&mut self, v: &WeightView<'a>, what: &str) -> Result<Mat, GpuError> {
        if let Some(m) = self.mats.get(&key(v.bytes)) {
            return Ok(*m);
        }
        let f = self.fns(v.dtype, what)?;
        let rb = v.bytes.len() / v.rows.max(1);
        let off = self.put(Cow::Borrowed(v.bytes));
        let m = Mat {
            off,
            rows: v.rows,
            cols: v.cols,
            rb,
            f,
        };
        self.mats.insert(key(v.bytes), m);
        Ok(m)
    }

    /// `v` with its rows reordered (row i of the device copy is row `order[i]` of `v`), mapped
    /// from `v`'s host bytes like `mat` (the hybrid layers' grouped projections, `hybrid.rs`).
    pub(super) fn mat_reordered(
        &mut self,
        v: &WeightView<'a>,
        order: &[usize],
        what: &str,
    ) -> Result<Mat, GpuError> {
        if let Some(m) = self.mats.get(&key(v.bytes)) {
            return Ok(*m);
        }
        let f = self.fns(v.dtype, what)?;
        let rb = v.bytes.len() / v.rows.max(1);
        if order.len() != v.rows || order.iter().any(|&r| r >= v.rows) {
            return Err(GpuError::Config(format!(
                "{what}: a row order of {} rows for a {}-row weight",
                order.len(),
                v.rows
            )));
        }
        let bytes: Vec<u8> = order
            .iter()
            .flat_map(|&r| &v.bytes[r * rb..(r + 1) * rb])
            .copied()
            .collect();
        let off = self.put(Cow::Owned(bytes));
        let m = Mat {
            off,
            rows: v.rows,
            cols: v.cols,
            rb,
            f,
        };
        self.mats.insert(key(v.bytes), m);
        Ok(m)
    }

    fn mlp(&mut self, m: &Mlp<'a>, what: &str) -> Result<GMlp, GpuError> {
        Ok(GMlp {
            gate: self.mat(&m.gate, what)?,
            up: self.mat(&m.up, what)?,
            down: self.mat(&m.down, what)?,
        })
    }

    /// Per-head matrices as f32 (heads x rows x cols), dequantized here once.
    fn heads(&mut self, hs: &[HeadMat<'a>], what: &str) -> Result<usize, GpuError> {
        if let Some(&o) = self.heads.get(&key(hs)) {
            return Ok(o);
        }
        let mut all = Vec::new();
        for h in hs {
            match h {
                HeadMat::View(w) => {
                    let mut out = vec![0f32; w.rows * w.cols];
                    crate::kernels::dequantize(w.dtype, w.bytes, &mut out)
                        .map_err(|e| GpuError::Config(format!("{what}: {e}")))?;
                    all.extend_from_slice(&out);
                }
                HeadMat::Owned { data, .. } => all.extend_from_slice(data),
            }
        }
        let o = self.put(Cow::Owned(f32_bytes(&all)));
        self.heads.insert(key(hs), o);
        Ok(o)
    }
}

fn dev_f32(gpu: &Gpu, n: usize) -> Result<DevBuf, GpuError> {
    gpu.alloc(4 * n.max(1))
}

impl GpuState {
    /// Uploads the model's dense weights, sizes every buffer for `st` (batch, context, logit
    /// rows), carves the VRAM expert pool and registers the RAM cache's slab (arena staging).
    /// `st` must carry the RAM expert cache the pool stages from.
    pub fn attach(
        model: &Model<'_>,
        st: &State,
        opts: &GpuOptions,
    ) -> Result<(GpuState, GpuSummary), GpuError> {
        if let Some(why) = super::refusal(&model.cfg, st.ctx()) {
            return Err(GpuError::Config(why));
        }
        let cfg = &model.cfg;
        let kv16 = gpu_kv16(cfg, st.kv_types())?;
        let gpu = Gpu::open()?;
        let w = &model.weights;
        let Some(cache) = st.expert_cache.as_ref() else {
            return Err(GpuError::Config(
                "the GPU path stages experts from the RAM expert cache, and none is attached"
                    .into(),
            ));
        };
        let mut b = Builder {
            gpu: &gpu,
            pieces: Vec::new(),
            total: 0,
            fns: Vec::new(),
            mats: HashMap::new(),
            vecs: HashMap::new(),
            heads: HashMap::new(),
        };
        // Every weight the graph passes (`model::forward`, `deepseek2`), once.
        b.mat(&w.token_embd, "token_embd")?;
        b.mat(&w.output, "output")?;
        b.vec(&w.output_norm);
        let mut moes = Vec::with_capacity(w.layers.len());
        let mut moe_idx = 0;
        let mut experts_per_layer = Vec::new();
        let mut all_experts = 0u64;
        for (l, lw) in w.layers.iter().enumerate() {
            let what = format!("layer {l}");
            b.vec(&lw.attn_norm);
            b.vec(&lw.ffn_norm);
            match &lw.attn {
                Attention::Gqa(a) => {
                    for m in [&a.wq, &a.wk, &a.wv, &a.wo] {
                        b.mat(m, &what)?;
                    }
                    for v in [&a.bq, &a.bk, &a.bv, &a.q_norm, &a.k_norm, &a.bo, &a.sinks]
                        .into_iter()
                        .flatten()
                    {
                        b.vec(v);
                    }
                }
                Attention::Hybrid(m) => {
                    let Some(hy) = cfg.hybrid.as_deref() else {
                        return Err(GpuError::Config(format!(
                            "{what}: a hybrid mixer in a model without hybrid layers"
                        )));
                    };
                    super::hybrid::upload_mixer(&mut b, m, hy, &what)?;
                }
                Attention::Mla(a) => {
                    if let (Some(m), Some(n)) = (&a.q_a, &a.q_a_norm) {
                        b.mat(m, &what)?;
                        b.vec(n);
                    }
                    for m in [&a.q_b, &a.kv_a, &a.wo] {
                        b.mat(m, &what)?;
                    }
                    b.vec(&a.kv_a_norm);
                    b.heads(&a.k_b, &what)?;
                    b.heads(&a.v_b, &what)?;
                    if let Some(ix) = &a.indexer {
                        for m in [&ix.wq_b, &ix.wk, &ix.weights] {
                            b.mat(m, &what)?;
                        }
                        b.vec(&ix.k_norm);
                        b.vec(&ix.k_norm_bias);
                    }
                }
            }
            let ffn = match &lw.ffn {
                Ffn::Dense(m) => {
                    b.mlp(m, &what)?;
                    None
                }
                Ffn::Moe(m) => {
                    let Some(x0) = m.experts.first() else {
                        return Err(GpuError::Config(format!(
                            "{what}: MoE layer without experts"
                        )));
                    };
                    let (g, u, d) = (x0.gate.bytes.len(), x0.up.bytes.len(), x0.down.bytes.len());
                    all_experts += (m.experts.len() * (g + u + d)) as u64;
                    experts_per_layer.push(m.experts.len());
                    // gpt-oss: expert biases and the clamped SwiGLU (ops.rs).
                    let act = if m.exp_bias.is_some() || cfg.expert_act != ExpertAct::Silu {
                        let biases = m
                            .exp_bias
                            .as_ref()
                            .map(|x| (b.vec(&x.gate), b.vec(&x.up), b.vec(&x.down)));
                        let t = x0.gate.dtype;
                        Some(super::ops::ExpertAct::new(&gpu, t, biases, cfg.expert_act)?)
                    } else {
                        None
                    };
                    let gm = GMoe {
                        router: b.mat(&m.router, &what)?,
                        router_bias: m.router_bias.as_deref().map(|v| b.vec(v)),
                        bias: m.score_bias.as_deref().map(|v| b.vec(v)),
                        shared: m.shared.as_ref().map(|s| b.mlp(s, &what)).transpose()?,
                        shared_gate: m.shared_gate.as_deref().map(|g| b.vec(g)),
                        geo: MoeGeo {
                            idx: moe_idx,
                            gate_up: b.fns(x0.gate.dtype, &what)?,
                            down: b.fns(x0.down.dtype, &what)?,
                            ffn: x0.gate.rows,
                            rb_gate: g / x0.gate.rows.max(1),
                            rb_down: d / x0.down.rows.max(1),
                            act,
                        },
                    };
                    if x0.up.dtype != x0.gate.dtype {
                        return Err(GpuError::Config(format!(
                            "{what}: expert gate ({:?}) and up ({:?}) types differ; the GPU kernel takes one type for both",
                            x0.gate.dtype, x0.up.dtype
                        )));
                    }
                    moe_idx += 1;
                    Some(gm)
                }
            };
            moes.push(ffn);
        }
        // DeepSeek-V4's own weights, its routed experts included (`v4.rs`).
        let v4_up = match &w.v4 {
            Some(v) => Some(super::v4::upload(&mut b, &gpu, cfg, v)?),
            None => None,
        };
        let small = Small {
            rmsnorm: gpu.function("rmsnorm")?,
            add: gpu.function("add")?,
            add_bias: gpu.function("add_bias")?,
            silu_mul: gpu.function("silu_mul")?,
            rope: gpu.function("rope")?,
            attention: gpu.function("attention")?,
            att_tiled: gpu.function("attention_tiled")?,
            att_mma: per_mma_dim(&gpu, "attention_mma")?,
            att_mma_dec: per_mma_dim(&gpu, "attention_mma_dec")?,
            att_mma_h: per_mma_dim(&gpu, "attention_mma_h")?,
            att_mma_dec_h: per_mma_dim(&gpu, "attention_mma_dec_h")?,
            head_mv: gpu.function("head_mv")?,
            copy2d: gpu.function("copy2d")?,
            combine: gpu.function("moe_combine")?,
            quantize: gpu.function("quantize_q8")?,
            route: gpu.function("route")?,
            build_jobs: gpu.function("build_jobs")?,
            kv_store: gpu.function("kv_store")?,
            att_split: gpu.function("attention_split")?,
            att_merge: gpu.function("attention_merge")?,
            add_rms_q8: gpu.function("add_rmsnorm_q8")?,
            add_rms_q8w: gpu.function("add_rmsnorm_q8_w")?,
            qk_rope_store: gpu.function("qk_rope_store")?,
            att_split_merge: gpu.function("attention_split_merge")?,
            att_group: gpu.function("attention_group_split_merge")?,
            route_jobs: gpu.function("route_jobs")?,
            router_route_jobs: gpu.function("router_route_jobs")?,
        };
        let weights = gpu.alloc(b.total)?;
        for (off, bytes) in &b.pieces {
            gpu.upload(weights.at(*off), bytes)?;
        }
        let weights_bytes = b.total;
        let (mats, vecs, head_mats) = (b.mats, b.vecs, b.heads);

        // Scratch, sized once for the state's batch, context and logit rows.
        let (bsz, ctx, rows) = (st.batch(), st.ctx(), st.logit_rows());
        let (h, e, k) = (cfg.hidden, cfg.n_experts.max(1), cfg.n_experts_used.max(1));
        let (kc, vc) = cfg.cache_dims();
        // MLA keeps only latent + rope key rows; its value row holds V3.2's indexer key, if
        // the model has an indexer.
        let vc = if matches!(cfg.attn, AttnKind::Mla { .. }) && cfg.indexer.is_none() {
            0
        } else {
            vc
        };
        let (q_lora, kv_lora, nh_qk) = match cfg.attn {
            AttnKind::Mla {
                q_lora, kv_lora, ..
            } => (q_lora.unwrap_or(0), kv_lora, cfg.n_heads * cfg.head_dim),
            AttnKind::Gqa => (0, 0, 0),
        };
        let ffn = cfg.dense_ffn.max(cfg.shared_ffn).max(1);
        let att_rows = (bsz).min(((1usize << 26) / (cfg.n_heads * ctx).max(1)).max(1));
        // Layers with a KV cache (Qwen3-Next / Qwen3.5: the full-attention ones, in compact
        // slots; their linear layers' state is `hybrid.rs`'s).
        let n_layers = cfg.kv_layers();
        // Widest input of any matrix product (quantized-activation scratch).
        let max_cols = [
            h,
            cfg.q_dim().max(nh_qk),
            cfg.att_dim(),
            ffn,
            q_lora,
            cfg.n_heads * cfg.head_dim,
            cfg.hybrid.as_deref().map_or(0, |hy| hy.value_dim()),
            cfg.v4
                .as_deref()
                .map_or(0, |v| (v.o_groups * v.o_lora).max(v.q_lora)),
        ]
        .into_iter()
        .max()
        .unwrap_or(h)
        .next_multiple_of(32);
        let xq_len = bsz * max_cols;
        let hq_len = bsz * k * cfg.expert_ffn.max(1).next_multiple_of(32);
        // Flash-decoding: about 64 splits over the context (at most `dec_splits_max()`), each
        // at most 8192 positions.
        let splits = ctx.div_ceil(64).clamp(1, dec_splits_max());
        let chunk = ctx.div_ceil(splits).min(8192);
        let splits = ctx.div_ceil(chunk);
        let kv_half = kv_half_storage(cfg, kv16, splits);
        let kv_el = if kv_half { 2 } else { 4 };
        let moe_layers_n = experts_per_layer.len();
        let before = gpu.mem_info()?.0;
        let bufs = Bufs {
            x: dev_f32(&gpu, bsz * h)?,
            xn: dev_f32(&gpu, bsz * h)?,
            q: dev_f32(&gpu, bsz * cfg.q_dim().max(nh_qk))?,
            qa: dev_f32(&gpu, bsz * q_lora)?,
            k: dev_f32(&gpu, bsz * cfg.kv_dim().max(kc))?,
            v: dev_f32(&gpu, bsz * cfg.kv_dim())?,
            att: dev_f32(&gpu, bsz * cfg.att_dim())?,
            qcat: dev_f32(&gpu, bsz * cfg.n_heads * if kv_lora > 0 { kc } else { 0 })?,
            clat: dev_f32(&gpu, bsz * cfg.n_heads * kv_lora)?,
            proj: dev_f32(&gpu, bsz * h)?,
            hfin: dev_f32(&gpu, bsz * h)?,
            gate: dev_f32(&gpu, bsz * ffn)?,
            up: dev_f32(&gpu, bsz * ffn)?,
            down: dev_f32(&gpu, bsz * h)?,
            router: dev_f32(&gpu, bsz * e)?,
            hb: dev_f32(&gpu, bsz * k * cfg.expert_ffn.max(1))?,
            hu: dev_f32(
                &gpu,
                if moes.iter().flatten().any(|m| m.geo.act.is_some()) {
                    bsz * k * cfg.expert_ffn.max(1)
                } else {
                    1
                },
            )?,
            slot_out: dev_f32(&gpu, bsz * k * h)?,
            scores: dev_f32(&gpu, att_rows * cfg.n_heads * ctx)?,
            logits: dev_f32(&gpu, rows * cfg.vocab)?,
            tokens: gpu.alloc(4 * bsz)?,
            tok: gpu.alloc(4 * bsz * k)?,
            dst: gpu.alloc(4 * bsz * k)?,
            selw: dev_f32(&gpu, bsz * k)?,
            jobs: gpu.alloc(JOB_BYTES * e)?,
            kcache: gpu.alloc(kv_el * (n_layers * ctx * kc).max(1))?,
            vcache: gpu.alloc(kv_el * (n_layers * ctx * vc).max(1))?,
            cos: gpu.alloc(4 * model.rope.cos_table().len().max(1))?,
            sin: gpu.alloc(4 * model.rope.sin_table().len().max(1))?,
            xq: gpu.alloc(xq_len)?,
            xd: dev_f32(&gpu, xq_len / 32 + 1)?,
            hq: gpu.alloc(hq_len)?,
            hd: dev_f32(&gpu, hq_len / 32 + 1)?,
            pos: gpu.alloc(8)?,
            sel: gpu.alloc(4 * bsz * k)?,
            njobs: gpu.alloc(4)?,
            stat: gpu.alloc(4)?,
            done: gpu.alloc(4 * (1 + SPLIT_ROWS * cfg.n_heads))?,
            etab: gpu.alloc(24 * e * moe_layers_n.max(1))?,
            pm: dev_f32(&gpu, SPLIT_ROWS * cfg.n_heads * splits)?,
            pl: dev_f32(&gpu, SPLIT_ROWS * cfg.n_heads * splits)?,
            po: dev_f32(
                &gpu,
                SPLIT_ROWS * cfg.n_heads * splits * cfg.att_dim().max(kv_lora),
            )?,
        };
        gpu.upload(bufs.stat.ptr, &[0u8; 4])?;
        gpu.upload(bufs.done.ptr, &vec![0u8; bufs.done.bytes])?;
        gpu.upload(bufs.cos.ptr, &f32_bytes(model.rope.cos_table()))?;
        gpu.upload(bufs.sin.ptr, &f32_bytes(model.rope.sin_table()))?;
        let hybrid = cfg
            .hybrid
            .as_deref()
            .map(|hy| super::hybrid::HybridDev::new(&gpu, cfg, hy, bsz))
            .transpose()?;
        let v4 = v4_up
            .map(|u| super::v4::V4Dev::new(&gpu, cfg, u, weights.ptr, bsz, ctx))
            .transpose()?;
        let after = gpu.mem_info()?.0;
        let kv_bytes =
            bufs.kcache.bytes + bufs.vcache.bytes + hybrid.as_ref().map_or(0, |h| h.state_bytes());
        let scratch_bytes = before.saturating_sub(after).saturating_sub(kv_bytes);
        let host = Host {
            router: gpu.alloc_pinned(4 * bsz * e)?,
            logits: gpu.alloc_pinned(4 * rows * cfg.vocab)?,
            tokens: gpu.alloc_pinned(4 * bsz)?,
            tok: gpu.alloc_pinned(4 * bsz * k)?,
            dst: gpu.alloc_pinned(4 * bsz * k)?,
            selw: gpu.alloc_pinned(4 * bsz * k)?,
            jobs: gpu.alloc_pinned(JOB_BYTES * e)?,
            pos: gpu.alloc_pinned(8)?,
            sel: gpu.alloc_pinned(4 * bsz * k)?,
            stat: gpu.alloc_pinned(4)?,
            etab: gpu.alloc_pinned(24 * e * moe_layers_n.max(1))?,
        };

        // The VRAM expert pool: what was asked, else the free memory less a margin, never
        // more than every expert.
        // A VRAM slot takes a RAM cache slot's bytes in one copy: the span of the expert's
        // three parts as the cache laid them out (parts aligned for O_DIRECT).
        let moe_layers = experts_per_layer.len();
        let slot_bytes = cache.slot_bytes().max(ALIGN as u64);
        let (free, _) = gpu.mem_info()?;
        let margin = super::VRAM_MARGIN;
        let want = match opts.vram {
            Some(v) => v,
            None => (free as u64).saturating_sub(margin).min(
                experts_per_layer
                    .iter()
                    .map(|&n| n as u64 * slot_bytes)
                    .sum(),
            ),
        };
        let per_layer = ((want / slot_bytes) as usize)
            .checked_div(moe_layers)
            .unwrap_or(0);
        if moe_layers > 0 && per_layer == 0 {
            return Err(GpuError::Config(format!(
                "the VRAM expert pool of {:.2} GB holds {} slots of {:.1} MB, fewer than one per MoE layer ({moe_layers}): raise --vram",
                want as f64 / 1e9,
                want / slot_bytes,
                slot_bytes as f64 / 1e6
            )));
        }
        let max_e = experts_per_layer.iter().copied().max().unwrap_or(0);
        let per_layer = per_layer.min(max_e);
        let pool_bytes = per_layer * moe_layers * slot_bytes as usize;
        if pool_bytes as u64 > free as u64 {
            return Err(GpuError::Config(format!(
                "--vram {:.2} GB: only {:.2} GB of VRAM is free after weights, KV cache and scratch",
                pool_bytes as f64 / 1e9,
                free as f64 / 1e9
            )));
        }
        let pool_mem = gpu.alloc(pool_bytes)?;
        let moe_of_layer: Vec<usize> = w
            .layers
            .iter()
            .enumerate()
            .filter(|(_, l)| l.moe().is_some())
            .map(|(i, _)| i)
            .collect();
        let pinned: Vec<(usize, usize)> = opts
            .pinned
            .iter()
            .filter_map(|&(l, e)| moe_of_layer.iter().position(|&m| m == l).map(|i| (i, e)))
            .collect();
        let pool = VramPool::new(&experts_per_layer, per_layer, slot_bytes, &pinned);

        // Arena staging: register the whole RAM cache slab once.
        let mut registered = None;
        if opts.staging == Staging::Arena {
            let (p, len) = cache.slab_region();
            if len > 0 {
                // SAFETY: the slab lives as long as the cache, which outlives this state's use
                // of it: `detach` (and Drop) unregister before the cache can go.
                unsafe { gpu.register(p, len)? };
                registered = Some((p as usize, len));
            }
        }
        let n_events = 4 * (2 * max_e + 16);
        let events = (0..n_events)
            .map(|_| gpu.event())
            .collect::<Result<Vec<_>, _>>()?;
        let summary = GpuSummary {
            device: gpu.name.clone(),
            vram_total: gpu.total_mem,
            weights_bytes,
            kv_bytes,
            kv_half,
            scratch_bytes,
            pool_bytes,
            pool_slots_per_layer: per_layer,
            pool_pinned: pool.n_pinned(),
            slot_bytes,
            all_experts_bytes: all_experts,
            staging: opts.staging,
        };
        Ok((
            GpuState {
                graph: None,
                bufs,
                host,
                weights,
                pool_mem,
                timers: Timers {
                    events,
                    next: 0,
                    pairs: Vec::with_capacity(n_events / 2),
                },
                mats,
                vecs,
                head_mats,
                moes,
                small,
                ops: super::ops::Ops::load(&gpu)?,
                pool,
                split: None,
                staging: opts.staging,
                registered,
                att_rows,
                stats: GpuStats::default(),
                h2d_ceiling_gbps: None,
                misses: Vec::with_capacity(max_e),
                hits: Vec::with_capacity(max_e),
                slot_offs: vec![[0; 3]; per_layer * moe_layers],
                wave: Vec::with_capacity(max_e),
                xq_src: std::cell::Cell::new(None),
                layer_ready: vec![false; moe_layers],
                experts_per_layer,
                splits,
                chunk,
                device_route: k <= 64
                    && cfg.routing.n_group <= 32
                    && cfg.routing.topk_group <= 64
                    && e <= 1024,
                stat_last: 0,
                k,
                graphs: std::env::var("SLUICE_GPU_GRAPH").map_or(true, |v| v != "0")
                    && !gpu.profiling(),
                fused: std::env::var("SLUICE_GPU_FUSED").map_or(true, |v| v != "0"),
                capturing: false,
                seg: usize::MAX,
                at: (0, 0),
                ctx,
                mla: matches!(cfg.attn, AttnKind::Mla { .. }),
                kv16,
                kv_half,
                idx: cfg
                    .indexer
                    .map(|ix| super::ops::IdxState::new(&gpu, ix, bsz, ctx))
                    .transpose()?,
                hybrid,
                v4,
                gpu,
            },
            summary,
        ))
    }

    /// Whether the KV cache is stored as f16 (`kv_half_storage`).
    pub fn kv_half(&self) -> bool {
        self.kv_half
    }

    pub fn stats(&self) -> GpuStats {
        let mut s = self.stats;
        s.vram_hits = self.pool.hits;
        s.vram_misses = self.pool.misses;
        s.experts_cpu = self.experts_cpu();
        s
    }

    /// Measures the pinned host -> device ceiling (a `bytes` copy from cuMemHostAlloc memory)
    /// and keeps it for the run's summary.
    pub fn measure_h2d_ceiling(&mut self, bytes: usize) -> Result<f64, GpuError> {
        let g = pinned_h2d_gbps(&self.gpu, bytes, 5)?;
        self.h2d_ceiling_gbps = Some(g);
        Ok(g)
    }

    /// Unregisters the RAM cache slab (before the cache is dropped or replaced).
    pub fn release_staging(&mut self) -> Result<(), GpuError> {
        if let Some((p, _)) = self.registered.take() {
            self.gpu.bind()?;
            self.gpu.sync(Stream::Copy)?;
            // SAFETY: registered in `attach`; the copy stream is idle.
            unsafe { self.gpu.unregister(p as *const u8)? };
        }
        Ok(())
    }

    pub(super) fn wa(&self, off: usize) -> u64 {
        self.weights.at(off)
    }

    pub(super) fn launch(
        &self,
        f: Kernel,
        grid: (u32, u32, u32),
        block: u32,
        shmem: u32,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        self.xq_src.set(None);
        self.gpu
            .launch(f, grid, block, shmem, Stream::Compute, args)
    }

    /// Quantizes rows 0..n of x (row stride ldx, `cols` values) into `xq`/`xd`, unless they
    /// already hold exactly that input (no launch in between).
    fn quantize(&self, x: u64, ldx: usize, n: usize, cols: usize) -> Result<(), GpuError> {
        let key = Some((x, ldx, n, cols));
        if self.xq_src.get() == key {
            return Ok(());
        }
        let groups = (n * cols / 32) as u32;
        self.launch(
            self.small.quantize,
            (groups.div_ceil(8), 1, 1),
            256,
            0,
            &[
                x.into(),
                (ldx as i32).into(),
                (cols as i32).into(),
                (n as i32).into(),
                self.bufs.xq.ptr.into(),
                self.bufs.xd.ptr.into(),
            ],
        )?;
        self.xq_src.set(key);
        Ok(())
    }

    /// Residual add (`add`), RMSNorm of whole rows and their 8-bit quantization (when `dim` is a
    /// multiple of 32) in one launch (kernels_fused.cu `add_rmsnorm_q8`): rows 0..rows of x (row
    /// stride ldx; packed when anything is added) += the addend, y = rmsnorm(x) * w, and the
    /// quantized y is then the input the next product of y finds (`quantize` skips).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn add_rmsnorm(
        &self,
        x: u64,
        ldx: usize,
        add: Residual,
        w: u64,
        dim: usize,
        rows: usize,
        eps: f32,
        y: u64,
        ldy: usize,
    ) -> Result<(), GpuError> {
        let q = dim.is_multiple_of(32) && rows * dim <= self.bufs.xq.bytes;
        let (p, so, sw) = match add {
            Residual::None => (0, 0, 0),
            Residual::Rows(p) => (p, 0, 0),
            Residual::Combine => (0, self.bufs.slot_out.ptr, self.bufs.selw.ptr),
        };
        let (xq, xd) = if q {
            (self.bufs.xq.ptr, self.bufs.xd.ptr)
        } else {
            (0, 0)
        };
        // Rows of up to 4096 values on 1024 threads: the same bits, a quarter of the latency
        // per warp (docs/PERFORMANCE.md session 38; `SLUICE_GPU_NORM_WIDE=0`: 256 threads).
        let (kernel, threads) = if dim <= 4096 && norm_wide_on() {
            (self.small.add_rms_q8w, 1024)
        } else {
            (self.small.add_rms_q8, 256)
        };
        self.gpu.launch(
            kernel,
            (rows as u32, 1, 1),
            threads,
            0,
            Stream::Compute,
            &[
                x.into(),
                (ldx as i32).into(),
                p.into(),
                so.into(),
                sw.into(),
                (self.k as i32).into(),
                w.into(),
                (dim as i32).into(),
                eps.into(),
                y.into(),
                (ldy as i32).into(),
                xq.into(),
                xd.into(),
            ],
        )?;
        self.xq_src.set(q.then_some((y, ldy, rows, dim)));
        Ok(())
    }

    /// For each `(m, y, ldy)`: y = x * m^T. Two or three matrices of one 8-bit-activation type
    /// and width in a matvec-sized forward take one launch (kernels_fused.cu `mmq3`); else one
    /// product each (`mm`).
    pub(super) fn mm_multi(
        &self,
        ms: &[(Mat, u64, usize)],
        x: u64,
        ldx: usize,
        n: usize,
    ) -> Result<(), GpuError> {
        let Some(&(m0, _, _)) = ms.first() else {
            return Ok(());
        };
        let k0 = m0.f.q.map(|q| q.mm3);
        let fused = self.fused
            && (2..=3).contains(&ms.len())
            && k0.is_some()
            && m0.cols.is_multiple_of(32)
            && !gemm::takes(n, m0.cols)
            && ms
                .iter()
                .all(|(m, _, _)| m.cols == m0.cols && m.f.q.map(|q| q.mm3) == k0);
        let Some(k) = k0.filter(|_| fused) else {
            for (m, y, ldy) in ms {
                self.mm(m, x, ldx, n, *y, *ldy)?;
            }
            return Ok(());
        };
        let k = match m0.f.q.and_then(|q| q.t1) {
            Some(t) if n == 1 => t.mm3,
            _ => k,
        };
        self.quantize(x, ldx, n, m0.cols)?;
        let mut a = [Arg::from(0u64); 19];
        let mut blocks = 0u32;
        for (i, (m, y, ldy)) in ms.iter().enumerate() {
            a[5 * i] = self.wa(m.off).into();
            a[5 * i + 1] = (m.rb as i64).into();
            a[5 * i + 2] = (m.rows as i32).into();
            a[5 * i + 3] = (*y).into();
            a[5 * i + 4] = (*ldy as i32).into();
            blocks += (m.rows as u32).div_ceil(WARPS);
        }
        for i in ms.len()..3 {
            a[5 * i + 2] = 0i32.into();
            a[5 * i + 4] = 0i32.into();
        }
        a[15] = (m0.cols as i32).into();
        a[16] = self.bufs.xq.ptr.into();
        a[17] = self.bufs.xd.ptr.into();
        a[18] = (n as i32).into();
        self.gpu
            .launch(k, (blocks, 1, 1), 32 * WARPS, 0, Stream::Compute, &a)?;
        let x_end = x + (4 * n * ldx) as u64;
        for (_, y, ldy) in ms {
            let y_end = *y + (4 * n * ldy) as u64;
            if *y < x_end && x < y_end {
                self.xq_src.set(None);
            }
        }
        Ok(())
    }

    /// Grouped-query attention's per-head steps in one launch (kernels_fused.cu
    /// `qk_rope_store`): optional per-head q/k RMSNorm, rope of q and k (rotary position: the
    /// device's + `rpadd` + row), k and v rows into cache layer `layer` at the chunk's position.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn qk_rope_store(
        &self,
        model: &Model<'_>,
        qkv: [(u64, usize); 3],
        heads: usize,
        kvh: usize,
        hd: usize,
        norms: Option<(u64, u64, f32)>,
        layout: crate::model::config::RopeLayout,
        rpadd: i32,
        layer: usize,
        n: usize,
    ) -> Result<(), GpuError> {
        let kvd = kvh * hd;
        let layout = match layout {
            crate::model::config::RopeLayout::HalfSplit => 0,
            crate::model::config::RopeLayout::Interleaved => 1,
        };
        let (qn, kn, eps) = norms.unwrap_or((0, 0, 0.0));
        let [q, k, v] = qkv;
        self.launch(
            self.small.qk_rope_store,
            (n as u32, (heads + 2 * kvh) as u32, 1),
            256,
            (4 * hd) as u32,
            &[
                q.0.into(),
                (q.1 as i32).into(),
                k.0.into(),
                (k.1 as i32).into(),
                v.0.into(),
                (v.1 as i32).into(),
                (heads as i32).into(),
                (kvh as i32).into(),
                (hd as i32).into(),
                qn.into(),
                kn.into(),
                eps.into(),
                (model.rope.half() as i32).into(),
                layout.into(),
                self.bufs.cos.ptr.into(),
                self.bufs.sin.ptr.into(),
                (self.bufs.pos.ptr + 4).into(),
                rpadd.into(),
                self.bufs.pos.ptr.into(),
                self.cache_layer(&self.bufs.kcache, layer, kvd).into(),
                self.cache_layer(&self.bufs.vcache, layer, kvd).into(),
                (i32::from(self.kv16[0])
                    | (i32::from(self.kv16[1]) << 1)
                    | (i32::from(self.kv_half) << 2))
                    .into(),
            ],
        )
    }

    /// y (n x rows, row stride ldy) = x (n x cols, row stride ldx) * m^T.
    pub(super) fn mm(
        &self,
        m: &Mat,
        x: u64,
        ldx: usize,
        n: usize,
        y: u64,
        ldy: usize,
    ) -> Result<(), GpuError> {
        if let Some(q) = m.f.q.filter(|_| m.cols.is_multiple_of(32)) {
            self.quantize(x, ldx, n, m.cols)?;
            // prefill GEMM (gemm.rs): many tokens multiply on the tensor cores.
            let (xq, xd) = (self.bufs.xq.ptr, self.bufs.xd.ptr);
            let r = if gemm::takes(n, m.cols) {
                let w = self.wa(m.off);
                gemm::mm(
                    &self.gpu, &q.gemm, w, m.rb, m.rows, m.cols, xq, xd, n, y, ldy,
                )
            } else if let Some(mm2) =
                q.t1.and_then(|t| t.mm2)
                    .filter(|_| n == 1 && m.rows >= 32768)
            {
                // The output head of a decode step: two rows per warp (`mmq_rows1`).
                self.gpu.launch(
                    mm2,
                    ((m.rows as u32).div_ceil(2 * WARPS), 1, 1),
                    32 * WARPS,
                    0,
                    Stream::Compute,
                    &[
                        self.wa(m.off).into(),
                        (m.rb as i64).into(),
                        (m.rows as i32).into(),
                        (m.cols as i32).into(),
                        self.bufs.xq.ptr.into(),
                        self.bufs.xd.ptr.into(),
                        (n as i32).into(),
                        y.into(),
                        (ldy as i32).into(),
                    ],
                )
            } else if let Some(mm2) = q.mm2.filter(|_| n <= NT && m.rows >= 32768) {
                // A tall matvec (the output head): two rows per warp (`mmq_rows`).
                self.gpu.launch(
                    mm2,
                    ((m.rows as u32).div_ceil(2 * WARPS), 1, 1),
                    32 * WARPS,
                    0,
                    Stream::Compute,
                    &[
                        self.wa(m.off).into(),
                        (m.rb as i64).into(),
                        (m.rows as i32).into(),
                        (m.cols as i32).into(),
                        self.bufs.xq.ptr.into(),
                        self.bufs.xd.ptr.into(),
                        (n as i32).into(),
                        y.into(),
                        (ldy as i32).into(),
                    ],
                )
            } else {
                let k = match q.t1 {
                    Some(t) if n == 1 => t.mm,
                    _ => q.mm,
                };
                self.gpu.launch(
                    k,
                    ((m.rows as u32).div_ceil(WARPS), 1, 1),
                    32 * WARPS,
                    0,
                    Stream::Compute,
                    &[
                        self.wa(m.off).into(),
                        (m.rb as i64).into(),
                        (m.rows as i32).into(),
                        (m.cols as i32).into(),
                        self.bufs.xq.ptr.into(),
                        self.bufs.xd.ptr.into(),
                        (n as i32).into(),
                        y.into(),
                        (ldy as i32).into(),
                    ],
                )
            };
            return r.inspect(|_| {
                // An output over the quantized input makes its quantization stale.
                let (x_end, y_end) = (x + (4 * n * ldx) as u64, y + (4 * n * ldy) as u64);
                if y < x_end && x < y_end {
                    self.xq_src.set(None);
                }
            });
        }
        // f32 activations: the quantized input stays valid unless y overwrites it. Token
        // groups spread over grid y (a prefill's F32 router is 16 blocks wide otherwise).
        let groups = (n.div_ceil(NT) as u32).min(64);
        self.gpu.launch(
            m.f.mm,
            ((m.rows as u32).div_ceil(WARPS), groups, 1),
            32 * WARPS,
            0,
            Stream::Compute,
            &[
                self.wa(m.off).into(),
                (m.rb as i64).into(),
                (m.rows as i32).into(),
                (m.cols as i32).into(),
                x.into(),
                (ldx as i32).into(),
                (n as i32).into(),
                y.into(),
                (ldy as i32).into(),
            ],
        )?;
        self.stale_if_over(y, ldy, n);
        Ok(())
    }

    /// A launch wrote rows 0..n of y (row stride ldy): the quantized input is stale if they
    /// overlap its source.
    fn stale_if_over(&self, y: u64, ldy: usize, n: usize) {
        if let Some((x, ldx, xn, _)) = self.xq_src.get() {
            let (x_end, y_end) = (x + (4 * xn * ldx) as u64, y + (4 * n * ldy) as u64);
            if y < x_end && x < y_end {
                self.xq_src.set(None);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn rmsnorm(
        &self,
        x: u64,
        ldx: usize,
        w: u64,
        dim: usize,
        rows: usize,
        eps: f32,
        y: u64,
        ldy: usize,
    ) -> Result<(), GpuError> {
        self.launch(
            self.small.rmsnorm,
            (rows as u32, 1, 1),
            256,
            0,
            &[
                x.into(),
                (ldx as i32).into(),
                w.into(),
                (dim as i32).into(),
                eps.into(),
                y.into(),
                (ldy as i32).into(),
            ],
        )
    }

    pub(super) fn add(&self, y: u64, x: u64, len: usize) -> Result<(), GpuError> {
        self.launch(
            self.small.add,
            ((len as u32).div_ceil(256), 1, 1),
            256,
            0,
            &[y.into(), x.into(), (len as i32).into()],
        )
    }

    /// Rotates `heads` pieces (`hs` apart, from value `off`) of rows 0..n of x (row stride
    /// `ld`), row i at rotary position (device rope position) + `padd` + i.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rope(
        &self,
        model: &Model<'_>,
        x: u64,
        ld: usize,
        hs: usize,
        off: usize,
        heads: usize,
        n: usize,
        layout: crate::model::config::RopeLayout,
        padd: i32,
    ) -> Result<(), GpuError> {
        let half = model.rope.half();
        let layout = match layout {
            crate::model::config::RopeLayout::HalfSplit => 0,
            crate::model::config::RopeLayout::Interleaved => 1,
        };
        self.launch(
            self.small.rope,
            (n as u32, heads as u32, 1),
            (half as u32).clamp(32, 256).next_multiple_of(32),
            0,
            &[
                x.into(),
                (ld as i32).into(),
                (hs as i32).into(),
                (off as i32).into(),
                (half as i32).into(),
                layout.into(),
                self.bufs.cos.ptr.into(),
                self.bufs.sin.ptr.into(),
                (self.bufs.pos.ptr + 4).into(),
                padd.into(),
            ],
        )
    }

    /// The tensor-core attention kernels' index for head size `dk` (`MMA_DIMS`), where they
    /// apply: an f16 cache on both sides (not MLA, not DeepSeek-V4), dk == dv, Q and O rows
    /// 8-byte aligned (float2), K and V rows 16-byte aligned (float4).
    fn mma_kernel(
        &self,
        dk: usize,
        dv: usize,
        q: (u64, usize, usize),
        k: (u64, usize, usize),
        v: (u64, usize, usize),
        o: (u64, usize, usize),
    ) -> Option<usize> {
        // K and V rows in whole 16-byte loads (4 f32 or 8 f16 elements).
        let per_load = if self.kv_half { 8 } else { 4 };
        let aligned = [q.1, q.2, o.1, o.2].iter().all(|&x| x % 2 == 0)
            && [k.1, k.2, v.1, v.2].iter().all(|&x| x % per_load == 0)
            && [q.0, o.0].iter().all(|&p| p % 8 == 0)
            && [k.0, v.0].iter().all(|&p| p % 16 == 0);
        let f16 = self.kv16 == [true, true] && !self.mla && self.v4.is_none();
        MMA_DIMS
            .iter()
            .position(|&d| d == dk)
            .filter(|_| f16 && dk == dv && aligned)
    }

    /// Attention of tokens 0..n (row i at device position + `padd` + i), in chunks of
    /// `att_rows` tokens.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &self,
        q: (u64, usize, usize),
        k: (u64, usize, usize),
        v: (u64, usize, usize),
        dk: usize,
        dv: usize,
        group: usize,
        heads: usize,
        n: usize,
        scale: f32,
        padd: i32,
        o: (u64, usize, usize),
    ) -> Result<(), GpuError> {
        let ctx = self.ctx;
        if n <= SPLIT_ROWS {
            // Flash-decoding: every split of the context in its own block, then a merge.
            let (splits, chunk) = (self.splits, self.chunk);
            // Grouped-query heads read each key/value row once per group (fused and unfused
            // paths alike, so they stay identical).
            let group_shm = 4 * (group * (dk + 4) + 32 * (dk + 4) + 32 * dv + group * 33 + group);
            let aligned = [dk, dv, q.1, q.2, k.1, k.2, v.1, v.2]
                .iter()
                .all(|&x| x % 4 == 0)
                && [q.0, k.0, v.0].iter().all(|&p| p % 16 == 0);
            // The merging kernels' arguments: q, k, v, [dk, dv,] group .. done. Each (head,
            // token)'s last split merges, and quantizes the merged rows when they are the
            // output projection's packed input (fused path).
            let q8 = self.fused && dv.is_multiple_of(32) && o.2 == dv && o.1 == heads * dv;
            let (xq, xd) = if q8 {
                (self.bufs.xq.ptr, self.bufs.xd.ptr)
            } else {
                (0, 0)
            };
            let qkv: [Arg; 9] = [
                q.0.into(),
                (q.1 as i32).into(),
                (q.2 as i32).into(),
                k.0.into(),
                (k.1 as i32).into(),
                (k.2 as i32).into(),
                v.0.into(),
                (v.1 as i32).into(),
                (v.2 as i32).into(),
            ];
            let rest: [Arg; 14] = [
                (group as i32).into(),
                self.bufs.pos.ptr.into(),
                padd.into(),
                scale.into(),
                (chunk as i32).into(),
                self.bufs.pm.ptr.into(),
                self.bufs.pl.ptr.into(),
                self.bufs.po.ptr.into(),
                o.0.into(),
                (o.1 as i32).into(),
                (o.2 as i32).into(),
                xq.into(),
                xd.into(),
                self.bufs.done.at(4).into(),
            ];
            let with_dims: [Arg; 25] = std::array::from_fn(|i| match i {
                0..9 => qkv[i],
                9 => (dk as i32).into(),
                10 => (dv as i32).into(),
                _ => rest[i - 11],
            });
            let merging =
                |f: Kernel, grid: (u32, u32, u32), block: u32, shm: usize, args: &[Arg]| {
                    self.gpu
                        .launch(f, grid, block, shm as u32, Stream::Compute, args)?;
                    self.xq_src.set(q8.then_some((o.0, o.1, n, o.1)));
                    Ok(())
                };
            // An f16 cache: the group's query heads as the tensor cores' rows (kernels_mma.cu).
            if let Some(i) = self.mma_kernel(dk, dv, q, k, v, o) {
                if splits <= 128
                    && (1..=16).contains(&group)
                    && heads.is_multiple_of(group)
                    && (self.kv_half || att_mma_dec_on(ctx))
                {
                    // rest with the split's least positions after chunk (rest[4]).
                    let args: [Arg; 24] = std::array::from_fn(|i| match i {
                        0..9 => qkv[i],
                        9..14 => rest[i - 9],
                        14 => (dec_min_chunk() as i32).into(),
                        _ => rest[i - 10],
                    });
                    let grid = ((heads / group) as u32, n as u32, splits as u32);
                    let f = if self.kv_half {
                        self.small.att_mma_dec_h[i]
                    } else {
                        self.small.att_mma_dec[i]
                    };
                    return merging(f, grid, 128, 0, &args);
                }
            }
            self.half_unserved()?;
            if (2..=8).contains(&group)
                && dk <= 128
                && dv <= 128
                && aligned
                && group_shm <= 48 * 1024
                && heads.is_multiple_of(group)
                && att_group_on()
            {
                let grid = ((heads / group) as u32, n as u32, splits as u32);
                return merging(self.small.att_group, grid, 256, group_shm, &with_dims);
            }
            if self.fused {
                let grid = (heads as u32, n as u32, splits as u32);
                return merging(
                    self.small.att_split_merge,
                    grid,
                    128,
                    4 * (dk + chunk),
                    &with_dims,
                );
            }
            self.launch(
                self.small.att_split,
                (heads as u32, n as u32, splits as u32),
                128,
                (4 * (dk + chunk)) as u32,
                &[
                    q.0.into(),
                    (q.1 as i32).into(),
                    (q.2 as i32).into(),
                    k.0.into(),
                    (k.1 as i32).into(),
                    (k.2 as i32).into(),
                    v.0.into(),
                    (v.1 as i32).into(),
                    (v.2 as i32).into(),
                    (dk as i32).into(),
                    (dv as i32).into(),
                    (group as i32).into(),
                    self.bufs.pos.ptr.into(),
                    padd.into(),
                    scale.into(),
                    (chunk as i32).into(),
                    self.bufs.pm.ptr.into(),
                    self.bufs.pl.ptr.into(),
                    self.bufs.po.ptr.into(),
                ],
            )?;
            return self.launch(
                self.small.att_merge,
                (heads as u32, n as u32, 1),
                128,
                0,
                &[
                    self.bufs.pm.ptr.into(),
                    self.bufs.pl.ptr.into(),
                    self.bufs.po.ptr.into(),
                    (splits as i32).into(),
                    (dv as i32).into(),
                    o.0.into(),
                    (o.1 as i32).into(),
                    (o.2 as i32).into(),
                ],
            );
        }
        // Prompt attention over an f16 cache (keys and values f16 numbers): the tensor cores,
        // 64 queries per block (kernels_mma.cu).
        if let Some(i) = self.mma_kernel(dk, dv, q, k, v, o).filter(|_| att_mma_on()) {
            let f = if self.kv_half {
                self.small.att_mma_h[i]
            } else {
                self.small.att_mma[i]
            };
            return self.launch(
                f,
                (heads as u32, n.div_ceil(64) as u32, 1),
                128,
                0,
                &[
                    q.0.into(),
                    (q.1 as i32).into(),
                    (q.2 as i32).into(),
                    k.0.into(),
                    (k.1 as i32).into(),
                    (k.2 as i32).into(),
                    v.0.into(),
                    (v.1 as i32).into(),
                    (v.2 as i32).into(),
                    (group as i32).into(),
                    self.bufs.pos.ptr.into(),
                    padd.into(),
                    scale.into(),
                    (n as i32).into(),
                    o.0.into(),
                    (o.1 as i32).into(),
                    (o.2 as i32).into(),
                ],
            );
        }
        self.half_unserved()?;
        // Prompt attention: 32 queries per block through shared-memory key/value tiles
        // (`attention_tiled`, ~10x less L2 traffic than a block per query) where its shared
        // memory fits; `SLUICE_GPU_ATT_TILED=0` keeps `attention`.
        let tiled_shm = 4 * (32 * (dk + 4) + 16 * (dk + 4) + 16 * dv + 32 * 17);
        // float4 rows: every stride, head offset and base 16-byte aligned.
        let aligned = [dk, dv, q.1, q.2, k.1, k.2, v.1, v.2, o.1, o.2]
            .iter()
            .all(|&x| x % 4 == 0)
            && [q.0, k.0, v.0, o.0].iter().all(|&p| p % 16 == 0);
        if dk <= 192 && dv <= 128 && aligned && tiled_shm <= 48 * 1024 && att_tiled_on() {
            return self.launch(
                self.small.att_tiled,
                (heads as u32, n.div_ceil(32) as u32, 1),
                128,
                tiled_shm as u32,
                &[
                    q.0.into(),
                    (q.1 as i32).into(),
                    (q.2 as i32).into(),
                    k.0.into(),
                    (k.1 as i32).into(),
                    (k.2 as i32).into(),
                    v.0.into(),
                    (v.1 as i32).into(),
                    (v.2 as i32).into(),
                    (dk as i32).into(),
                    (dv as i32).into(),
                    (group as i32).into(),
                    self.bufs.pos.ptr.into(),
                    padd.into(),
                    scale.into(),
                    (n as i32).into(),
                    o.0.into(),
                    (o.1 as i32).into(),
                    (o.2 as i32).into(),
                ],
            );
        }
        let mut c0 = 0;
        while c0 < n {
            let cn = self.att_rows.min(n - c0);
            self.launch(
                self.small.attention,
                (heads as u32, cn as u32, 1),
                128,
                (4 * dk) as u32,
                &[
                    (q.0 + 4 * (c0 * q.1) as u64).into(),
                    (q.1 as i32).into(),
                    (q.2 as i32).into(),
                    k.0.into(),
                    (k.1 as i32).into(),
                    (k.2 as i32).into(),
                    v.0.into(),
                    (v.1 as i32).into(),
                    (v.2 as i32).into(),
                    (dk as i32).into(),
                    (dv as i32).into(),
                    (group as i32).into(),
                    self.bufs.pos.ptr.into(),
                    (c0 as i32 + padd).into(),
                    scale.into(),
                    self.bufs.scores.ptr.into(),
                    (ctx as i32).into(),
                    (o.0 + 4 * (c0 * o.1) as u64).into(),
                    (o.1 as i32).into(),
                    (o.2 as i32).into(),
                ],
            )?;
            c0 += cn;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn head_mv(
        &self,
        m: u64,
        rows: usize,
        cols: usize,
        heads: usize,
        n: usize,
        x: (u64, usize, usize),
        y: (u64, usize, usize),
    ) -> Result<(), GpuError> {
        self.launch(
            self.small.head_mv,
            ((rows as u32).div_ceil(WARPS), heads as u32, n as u32),
            32 * WARPS,
            0,
            &[
                m.into(),
                (rows as i32).into(),
                (cols as i32).into(),
                x.0.into(),
                (x.1 as i32).into(),
                (x.2 as i32).into(),
                y.0.into(),
                (y.1 as i32).into(),
                (y.2 as i32).into(),
            ],
        )
    }

    pub(super) fn timer_start(&mut self, stream: Stream) -> Result<usize, GpuError> {
        if self.capturing {
            return Ok(usize::MAX);
        }
        if self.timers.next + 2 > self.timers.events.len() {
            self.gpu.sync(Stream::Compute)?;
            self.gpu.sync(Stream::Copy)?;
            self.harvest()?;
        }
        let i = self.timers.next;
        self.timers.next += 2;
        self.gpu.record(&self.timers.events[i], stream)?;
        Ok(i)
    }

    pub(super) fn timer_stop(
        &mut self,
        i: usize,
        stream: Stream,
        copy: bool,
    ) -> Result<(), GpuError> {
        if i == usize::MAX {
            return Ok(());
        }
        self.gpu.record(&self.timers.events[i + 1], stream)?;
        self.timers.pairs.push((i, i + 1, copy));
        Ok(())
    }

    /// Adds up the timed segments (every recorded event must have completed).
    pub(super) fn harvest(&mut self) -> Result<(), GpuError> {
        for &(a, b, copy) in &self.timers.pairs {
            let ms = self
                .gpu
                .elapsed_ms(&self.timers.events[a], &self.timers.events[b])?
                as f64;
            if copy {
                self.stats.copy_secs += ms * 1e-3;
            } else {
                self.stats.kernel_secs += ms * 1e-3;
            }
        }
        self.timers.pairs.clear();
        self.timers.next = 0;
        Ok(())
    }

    /// Rows 0..n of src (row stride `ss`, `cols` wide) into the layer's cache rows (`cols`
    /// wide) at the chunk's position (read on the device).
    /// Rows 0..n of `src` into the cache layer at `layer` (device address), from the chunk's
    /// position; each value rounded to f16 when `h16` (that side of the cache is f16), stored
    /// as f16 when the cache is (`kv_half`).
    pub(super) fn kv_store(
        &self,
        src: u64,
        ss: usize,
        cols: usize,
        layer: u64,
        n: usize,
        h16: bool,
    ) -> Result<(), GpuError> {
        self.launch(
            self.small.kv_store,
            (n as u32, 1, 1),
            128,
            0,
            &[
                src.into(),
                (ss as i32).into(),
                layer.into(),
                (cols as i32).into(),
                self.bufs.pos.ptr.into(),
                (if self.kv_half { 2 } else { i32::from(h16) }).into(),
            ],
        )
    }

    /// An error where a cache stored as f16 reaches a kernel that reads f32 words (never, as
    /// `kv_half_storage` decides; a wrong answer would be worse than this one).
    pub(super) fn half_unserved(&self) -> Result<(), GpuError> {
        if self.kv_half {
            return Err(GpuError::Config(
                "internal: the f16-stored KV cache reached an attention kernel that reads f32"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Where `layer` starts in a cache buffer of `cols` elements per position (f16 or f32 as
    /// `kv_half` says).
    pub(super) fn cache_layer(&self, buf: &DevBuf, layer: usize, cols: usize) -> u64 {
        let el = if self.kv_half { 2 } else { 4 };
        buf.ptr + (el * layer * self.ctx * cols) as u64
    }

    /// MLA's absorbed queries of rows 0..n into `qcat` (`kv_lora + rope` per head): q's nope
    /// part folded into latent space by `k_b` (arena offset), its rope part copied beside it.
    pub(super) fn mla_qcat(
        &self,
        k_b: usize,
        (nh, qk): (usize, usize),
        (kv_lora, nope, rope): (usize, usize, usize),
        n: usize,
    ) -> Result<(), GpuError> {
        let kc = kv_lora + rope;
        let (q, qcat) = (self.bufs.q.ptr, self.bufs.qcat.ptr);
        self.head_mv(
            self.wa(k_b),
            kv_lora,
            nope,
            nh,
            n,
            (q, nh * qk, qk),
            (qcat, nh * kc, kc),
        )?;
        self.launch(
            self.small.copy2d,
            ((n * nh) as u32, 1, 1),
            64,
            0,
            &[
                (q + 4 * nope as u64).into(),
                (qk as i32).into(),
                (qcat + 4 * kv_lora as u64).into(),
                (kc as i32).into(),
                (rope as i32).into(),
            ],
        )
    }

    /// MLA in absorbed form for rows 0..n of `q` (rope applied) over cache layer `l` (rows of
    /// latent and rope key, stored): per head, q's nope part folded into latent space by `k_b`,
    /// its rope part beside it, attention over the cache, the latent context expanded by `v_b`
    /// into `att`. `k_b`, `v_b`: arena offsets of the per-head f32 matrices.
    pub(super) fn attend_mla(
        &self,
        model: &Model<'_>,
        l: usize,
        n: usize,
        (k_b, v_b): (usize, usize),
        padd: i32,
    ) -> Result<(), GpuError> {
        let cfg = &model.cfg;
        let AttnKind::Mla {
            kv_lora,
            nope,
            rope,
            v_dim,
            ..
        } = cfg.attn
        else {
            return Err(GpuError::Config("MLA weights in a GQA model".into()));
        };
        let (nh, qk) = (cfg.n_heads, cfg.head_dim);
        let kc = kv_lora + rope;
        let qcat = self.bufs.qcat.ptr;
        self.mla_qcat(k_b, (nh, qk), (kv_lora, nope, rope), n)?;
        let layer = self.bufs.kcache.f(l * self.ctx * kc);
        let clat = self.bufs.clat.ptr;
        self.attention(
            (qcat, nh * kc, kc),
            (layer, kc, 0),
            (layer, kc, 0),
            kc,
            kv_lora,
            nh,
            nh,
            n,
            cfg.attn_scale,
            padd,
            (clat, nh * kv_lora, kv_lora),
        )?;
        self.head_mv(
            self.wa(v_b),
            v_dim,
            kv_lora,
            nh,
            n,
            (clat, nh * kv_lora, kv_lora),
            (self.bufs.att.ptr, nh * v_dim, v_dim),
        )
    }

    /// Rows `tokens` of the embedding matrix `m` into rows 0..n of `dst` (packed, `m.cols`
    /// wide). The token ids go through the pinned token buffer (a captured graph replays with
    /// whatever it holds then).
    pub(super) fn embed(&mut self, m: &Mat, tokens: &[u32], dst: u64) -> Result<(), GpuError> {
        let n = tokens.len();
        for (o, &t) in self.host.tokens.i32s_mut().iter_mut().zip(tokens) {
            *o = t as i32;
        }
        // SAFETY: the pinned token buffer is not written again before this chunk's final sync;
        // the device buffer holds `batch` tokens and n <= batch (checked by `forward_on`).
        unsafe {
            self.gpu.upload_async(
                self.bufs.tokens.ptr,
                self.host.tokens.as_slice().as_ptr(),
                4 * n,
                Stream::Compute,
            )?;
        }
        self.launch(
            m.f.embed,
            (n as u32, 1, 1),
            128,
            0,
            &[
                self.wa(m.off).into(),
                (m.rb as i64).into(),
                (m.cols as i32).into(),
                self.bufs.tokens.ptr.into(),
                dst.into(),
            ],
        )
    }

    /// Forgets every recorded timer (after an error: the streams were synced).
    pub(super) fn clear_timers(&mut self) {
        self.timers.pairs.clear();
        self.timers.next = 0;
        self.seg = usize::MAX;
    }

    /// Opens the chunk's compute timer (closed around host round trips and at its end).
    pub(super) fn seg_start(&mut self) -> Result<(), GpuError> {
        self.seg = self.timer_start(Stream::Compute)?;
        Ok(())
    }

    pub(super) fn seg_stop(&mut self) -> Result<(), GpuError> {
        let i = std::mem::replace(&mut self.seg, usize::MAX);
        self.timer_stop(i, Stream::Compute, false)
    }

    /// SwiGLU of xn rows 0..n; result in `down`.
    fn mlp(&mut self, m: &GMlp, n: usize) -> Result<(), GpuError> {
        let f = m.gate.rows;
        let (xn, g, u, d) = (
            self.bufs.xn.ptr,
            self.bufs.gate.ptr,
            self.bufs.up.ptr,
            self.bufs.down.ptr,
        );
        let h = m.gate.cols;
        self.mm(&m.gate, xn, h, n, g, f)?;
        self.mm(&m.up, xn, h, n, u, f)?;
        let len = n * f;
        self.launch(
            self.small.silu_mul,
            ((len as u32).div_ceil(256), 1, 1),
            256,
            0,
            &[g.into(), u.into(), (len as i32).into()],
        )?;
        self.mm(&m.down, g, f, n, d, m.down.rows)
    }

    /// Launches the expert jobs `j0..j0+cnt` (already written to the pinned job buffer).
    fn launch_jobs(
        &mut self,
        mo: &MoeGeo,
        j0: usize,
        cnt: usize,
        n: usize,
        rows: (usize, usize),
        h: usize,
    ) -> Result<(), GpuError> {
        if cnt == 0 {
            return Ok(());
        }
        // SAFETY: the pinned job entries j0..j0+cnt were written for this launch and are not
        // rewritten before the next MoE layer's router sync; the device table holds E jobs.
        unsafe {
            self.gpu.upload_async(
                self.bufs.jobs.at(j0 * JOB_BYTES),
                self.host.jobs.as_slice()[j0 * JOB_BYTES..].as_ptr(),
                cnt * JOB_BYTES,
                Stream::Compute,
            )?;
        }
        let jobs = self.bufs.jobs.at(j0 * JOB_BYTES);
        self.run_jobs(mo, jobs, cnt, 0, n, rows, h)
    }

    /// The gate/up and down kernels over `grid_y` jobs at `jobs` (device); `nj`: a device job
    /// count that bounds them (0: all `grid_y`). Tokens 0..n of xn; `rows`: the first and the
    /// number of assignment rows the jobs write (quantized between the two products).
    #[allow(clippy::too_many_arguments)]
    fn run_jobs(
        &mut self,
        mo: &MoeGeo,
        jobs: u64,
        grid_y: usize,
        nj: u64,
        n: usize,
        rows: (usize, usize),
        h: usize,
    ) -> Result<(), GpuError> {
        let compute = Stream::Compute;
        // Timed here only outside the chunk's open segment (hits and staged misses).
        let ti = if self.seg == usize::MAX {
            self.timer_start(compute)?
        } else {
            usize::MAX
        };
        if let Some(a) = &mo.act {
            let shape = (mo.ffn, mo.rb_gate, mo.rb_down);
            self.run_jobs_act(a, mo.down.down, shape, jobs, grid_y, nj, h)?;
            return self.timer_stop(ti, compute, false);
        }
        let q = match (mo.gate_up.q, mo.down.q) {
            (Some(a), Some(b)) if h.is_multiple_of(32) && mo.ffn.is_multiple_of(32) => Some((a, b)),
            _ => None,
        };
        if let Some((qg, qd)) = q {
            self.quantize(self.bufs.xn.ptr, h, n, h)?;
            // prefill GEMM (gemm.rs): a job holds at most n tokens.
            let g = gemm::takes(n, h) && gemm::takes(n, mo.ffn);
            let b = &self.bufs;
            if g {
                let (xq, xd, tok, hb) = (b.xq.ptr, b.xd.ptr, b.tok.ptr, b.hb.ptr);
                let (f, rb) = (mo.ffn, mo.rb_gate);
                let gu = &qg.gemm;
                gemm::moe_gate_up(
                    &self.gpu, gu, jobs, nj, grid_y, n, f, h, rb, xq, xd, tok, hb,
                )?;
            } else {
                self.gpu.launch(
                    match qg.t1 {
                        Some(t) if n == 1 => t.gate_up,
                        _ => qg.gate_up,
                    },
                    ((mo.ffn as u32).div_ceil(WARPS), grid_y as u32, 1),
                    32 * WARPS,
                    0,
                    compute,
                    &[
                        jobs.into(),
                        nj.into(),
                        (mo.ffn as i32).into(),
                        (h as i32).into(),
                        (mo.rb_gate as i64).into(),
                        self.bufs.xq.ptr.into(),
                        self.bufs.xd.ptr.into(),
                        self.bufs.tok.ptr.into(),
                        self.bufs.hb.ptr.into(),
                    ],
                )?;
            }
            if !g && self.fused {
                // The down kernel quantizes its job's rows of hb itself.
                let f = mo.ffn;
                let shmem = (4 * f + 16 * f / 32) as u32;
                let (k, rows_per_warp) = match qd.t1 {
                    Some(t) if n == 1 => t.down_r.unwrap_or((t.down_s, 1)),
                    _ => (qd.down_s, 1),
                };
                self.gpu.launch(
                    k,
                    ((h as u32).div_ceil(WARPS * rows_per_warp), grid_y as u32, 1),
                    32 * WARPS,
                    shmem,
                    compute,
                    &[
                        jobs.into(),
                        nj.into(),
                        (h as i32).into(),
                        (f as i32).into(),
                        (mo.rb_down as i64).into(),
                        self.bufs.hb.ptr.into(),
                        self.bufs.dst.ptr.into(),
                        self.bufs.slot_out.ptr.into(),
                    ],
                )?;
                return self.timer_stop(ti, compute, false);
            }
            // The jobs' assignment rows of hb (a span that may include other jobs' rows:
            // harmless, each is rewritten and requantized before its own down product).
            let (r0, rn) = rows;
            let f = mo.ffn;
            self.gpu.launch(
                self.small.quantize,
                (((rn * f / 32) as u32).div_ceil(8), 1, 1),
                256,
                0,
                compute,
                &[
                    self.bufs.hb.f(r0 * f).into(),
                    (f as i32).into(),
                    (f as i32).into(),
                    (rn as i32).into(),
                    self.bufs.hq.at(r0 * f).into(),
                    self.bufs.hd.f(r0 * f / 32).into(),
                ],
            )?;
            if g {
                let (hq, hd, dst, so) = (b.hq.ptr, b.hd.ptr, b.dst.ptr, b.slot_out.ptr);
                let (f, rb) = (mo.ffn, mo.rb_down);
                let dn = &qd.gemm;
                gemm::moe_down(
                    &self.gpu, dn, jobs, nj, grid_y, n, h, f, rb, hq, hd, dst, so,
                )?;
                return self.timer_stop(ti, compute, false);
            }
            self.gpu.launch(
                qd.down,
                ((h as u32).div_ceil(WARPS), grid_y as u32, 1),
                32 * WARPS,
                0,
                compute,
                &[
                    jobs.into(),
                    nj.into(),
                    (h as i32).into(),
                    (mo.ffn as i32).into(),
                    (mo.rb_down as i64).into(),
                    self.bufs.hq.ptr.into(),
                    self.bufs.hd.ptr.into(),
                    self.bufs.dst.ptr.into(),
                    self.bufs.slot_out.ptr.into(),
                ],
            )?;
            return self.timer_stop(ti, compute, false);
        }
        self.launch(
            mo.gate_up.gate_up,
            ((mo.ffn as u32).div_ceil(WARPS), grid_y as u32, 1),
            32 * WARPS,
            0,
            &[
                jobs.into(),
                nj.into(),
                (mo.ffn as i32).into(),
                (h as i32).into(),
                (mo.rb_gate as i64).into(),
                self.bufs.xn.ptr.into(),
                (h as i32).into(),
                self.bufs.tok.ptr.into(),
                self.bufs.hb.ptr.into(),
            ],
        )?;
        self.launch(
            mo.down.down,
            ((h as u32).div_ceil(WARPS), grid_y as u32, 1),
            32 * WARPS,
            0,
            &[
                jobs.into(),
                nj.into(),
                (h as i32).into(),
                (mo.ffn as i32).into(),
                (mo.rb_down as i64).into(),
                self.bufs.hb.ptr.into(),
                self.bufs.dst.ptr.into(),
                self.bufs.slot_out.ptr.into(),
            ],
        )?;
        self.timer_stop(ti, compute, false)
    }

    fn write_job(&mut self, j: usize, slot: usize, a0: usize, cnt: usize) {
        let base = self.pool_mem.at(slot * self.pool.slot_bytes() as usize);
        let o = self.slot_offs[slot];
        let mut e = [0u8; JOB_BYTES];
        e[0..8].copy_from_slice(&(base + o[0] as u64).to_le_bytes());
        e[8..16].copy_from_slice(&(base + o[1] as u64).to_le_bytes());
        e[16..24].copy_from_slice(&(base + o[2] as u64).to_le_bytes());
        e[24..28].copy_from_slice(&(a0 as i32).to_le_bytes());
        e[28..32].copy_from_slice(&(cnt as i32).to_le_bytes());
        self.host.jobs.as_mut_slice()[j * JOB_BYTES..(j + 1) * JOB_BYTES].copy_from_slice(&e);
    }

    /// Routed experts (+ shared) of xn rows 0..n; result in `proj`. `ti`: the open timer of the
    /// layer's pre-MoE segment (closed before any host round trip).
    ///
    /// Routing runs on the device (kernels.cu `route`, the CPU's `route_token`); when every
    /// expert of the layer is in the VRAM pool the job list is built there too and nothing
    /// waits for the host. Otherwise the selection is downloaded, hits run in one launch and
    /// misses are staged from the RAM cache. Both paths order assignments the same way, and
    /// every GPU placement routes with the same kernel, so tokens do not depend on placement.
    ///
    /// `defer`: leave the combine to the caller (`add_rmsnorm` with `Residual::Combine`) when
    /// the layer has no shared expert; returns whether it did.
    pub(super) fn moe(
        &mut self,
        model: &Model<'_>,
        st: &mut State,
        l: usize,
        n: usize,
        defer: bool,
    ) -> Result<bool, ModelError> {
        let cfg = &model.cfg;
        let (h, e, k) = (cfg.hidden, cfg.n_experts, cfg.n_experts_used);
        let compute = Stream::Compute;
        let Some(gm) = self.moes.get(l).copied().flatten() else {
            return Err(
                GpuError::Config(format!("layer {l} has no routed block on the GPU")).into(),
            );
        };
        let (mo, router, shared, bias) = (gm.geo, gm.router, gm.shared, gm.bias);
        // A few tokens route and build their job list in one block (kernels_fused.cu); with
        // an F32 router, in the router product's launch (its last block).
        let rw = n.min(8);
        let rj_shmem = 4 * (rw * (2 * e + 192) + 3 * e);
        let fused_rj = self.fused
            && self.device_route
            && self.layer_ready[mo.idx]
            && n <= SPLIT_ROWS
            && rj_shmem <= 48 * 1024;
        // gpt-oss's router bias is its own launch after the product.
        let with_router = fused_rj
            && gm.router_bias.is_none()
            && router.f.f32
            && router.rows == e
            && router.cols == h;
        if !with_router {
            self.mm(&router, self.bufs.xn.ptr, h, n, self.bufs.router.ptr, e)?;
            if let Some(rb) = gm.router_bias {
                self.router_bias(self.bufs.router.ptr, rb, e, n)?;
            }
        }
        if fused_rj {
            let r = &cfg.routing;
            // router_route_jobs' arguments; route_jobs takes [4..22] (no router, no counter).
            let args: [Arg; 23] = [
                self.wa(router.off).into(),
                (router.rb as i64).into(),
                self.bufs.xn.ptr.into(),
                (h as i32).into(),
                self.bufs.router.ptr.into(),
                (n as i32).into(),
                (e as i32).into(),
                (k as i32).into(),
                bias.map_or(0, |b| self.wa(b)).into(),
                i32::from(r.sigmoid).into(),
                (r.n_group as i32).into(),
                (r.topk_group as i32).into(),
                i32::from(r.norm_topk_prob).into(),
                r.scale.into(),
                self.bufs.sel.ptr.into(),
                self.bufs.selw.ptr.into(),
                self.bufs.etab.at(mo.idx * e * 24).into(),
                self.bufs.jobs.ptr.into(),
                self.bufs.tok.ptr.into(),
                self.bufs.dst.ptr.into(),
                self.bufs.njobs.ptr.into(),
                self.bufs.stat.ptr.into(),
                self.bufs.done.ptr.into(),
            ];
            if with_router {
                self.gpu.launch(
                    self.small.router_route_jobs,
                    ((e as u32).div_ceil(WARPS), 1, 1),
                    32 * WARPS,
                    rj_shmem as u32,
                    compute,
                    &args,
                )?;
            } else {
                self.gpu.launch(
                    self.small.route_jobs,
                    (1, 1, 1),
                    256,
                    rj_shmem as u32,
                    compute,
                    &args[4..22],
                )?;
            }
        }
        if self.device_route && !fused_rj {
            let r = &cfg.routing;
            // Not through `launch`: routing leaves the quantized xn (the router's input, the
            // experts' too) valid.
            self.gpu.launch(
                self.small.route,
                (n as u32, 1, 1),
                32,
                (8 * e) as u32,
                compute,
                &[
                    self.bufs.router.ptr.into(),
                    (e as i32).into(),
                    (k as i32).into(),
                    bias.map_or(0, |b| self.wa(b)).into(),
                    i32::from(r.sigmoid).into(),
                    (r.n_group as i32).into(),
                    (r.topk_group as i32).into(),
                    i32::from(r.norm_topk_prob).into(),
                    r.scale.into(),
                    self.bufs.sel.ptr.into(),
                    self.bufs.selw.ptr.into(),
                ],
            )?;
        }
        if fused_rj {
            if !self.capturing {
                self.pool.count_hits((n * k) as u64);
            }
            let jobs = self.bufs.jobs.ptr;
            let nj = self.bufs.njobs.ptr;
            self.run_jobs(&mo, jobs, e.min(n * k), nj, n, (0, n * k), h)?;
        } else if self.device_route && self.layer_ready[mo.idx] {
            self.gpu.launch(
                self.small.build_jobs,
                (1, 1, 1),
                (e as u32).next_multiple_of(32),
                (12 * e) as u32,
                compute,
                &[
                    self.bufs.sel.ptr.into(),
                    (n as i32).into(),
                    (k as i32).into(),
                    (e as i32).into(),
                    self.bufs.etab.at(mo.idx * e * 24).into(),
                    self.bufs.jobs.ptr.into(),
                    self.bufs.tok.ptr.into(),
                    self.bufs.dst.ptr.into(),
                    self.bufs.njobs.ptr.into(),
                    self.bufs.stat.ptr.into(),
                ],
            )?;
            if !self.capturing {
                self.pool.count_hits((n * k) as u64);
            }
            let jobs = self.bufs.jobs.ptr;
            let nj = self.bufs.njobs.ptr;
            self.run_jobs(&mo, jobs, e.min(n * k), nj, n, (0, n * k), h)?;
        } else {
            self.moe_host(model, st, l, n, &mo)?;
        }

        // Combine in slot order, then the shared experts.
        if defer && self.fused && shared.is_none() {
            return Ok(true);
        }
        self.launch(
            self.small.combine,
            (((n * h) as u32).div_ceil(256), 1, 1),
            256,
            0,
            &[
                self.bufs.slot_out.ptr.into(),
                self.bufs.selw.ptr.into(),
                (k as i32).into(),
                (h as i32).into(),
                (n as i32).into(),
                self.bufs.proj.ptr.into(),
            ],
        )?;
        if let Some(sh) = shared {
            self.mlp(&sh, n)?;
            match gm.shared_gate {
                Some(g) => self.shared_gate_add(g, self.bufs.down.ptr, n, h)?,
                None => self.add(self.bufs.proj.ptr, self.bufs.down.ptr, n * h)?,
            }
        }
        Ok(false)
    }

    /// The combine `moe` left to its caller: proj rows 0..n = the slot outputs in slot order.
    pub(super) fn combine(&self, n: usize, h: usize) -> Result<(), GpuError> {
        self.launch(
            self.small.combine,
            (((n * h) as u32).div_ceil(256), 1, 1),
            256,
            0,
            &[
                self.bufs.slot_out.ptr.into(),
                self.bufs.selw.ptr.into(),
                (self.k as i32).into(),
                (h as i32).into(),
                (n as i32).into(),
                self.bufs.proj.ptr.into(),
            ],
        )
    }

    /// The MoE step with a host round trip: the selection (device-routed, else routed here by
    /// the CPU model's code) comes to the host, hits run in one launch, misses are staged.
    fn moe_host(
        &mut self,
        model: &Model<'_>,
        st: &mut State,
        l: usize,
        n: usize,
        mo: &MoeGeo,
    ) -> Result<(), ModelError> {
        let (h, e, k) = (
            model.cfg.hidden,
            model.cfg.n_experts,
            model.cfg.n_experts_used,
        );
        let compute = Stream::Compute;
        let mo = *mo;
        if self.device_route {
            // SAFETY: the pinned selection buffer holds batch x k ints, untouched until the sync.
            unsafe {
                self.gpu.download_async(
                    self.host.sel.as_mut_slice().as_mut_ptr(),
                    self.bufs.sel.ptr,
                    4 * n * k,
                    compute,
                )?;
            }
            self.split_fetch_xn(n, h)?;
            self.seg_stop()?;
            self.gpu.sync(compute)?;
            self.harvest()?;
            st.groups.iter_mut().for_each(Vec::clear);
            let sel = self.host.sel.i32s_mut();
            for i in 0..n {
                for slot in 0..k {
                    let ex = sel[i * k + slot] as usize;
                    if ex >= e {
                        return Err(ModelError::from(GpuError::Config(format!(
                            "layer {l}: the device router chose expert {ex} of {e}"
                        ))));
                    }
                    st.groups[ex].push((i as u32, slot as u32));
                }
            }
            st.needed.clear();
            for ex in 0..e {
                if !st.groups[ex].is_empty() {
                    st.needed.push(ex);
                }
            }
        } else {
            // SAFETY: the pinned router buffer holds batch x E floats, untouched until the sync.
            unsafe {
                self.gpu.download_async(
                    self.host.router.as_mut_slice().as_mut_ptr(),
                    self.bufs.router.ptr,
                    4 * n * e,
                    compute,
                )?;
            }
            self.split_fetch_xn(n, h)?;
            self.seg_stop()?;
            self.gpu.sync(compute)?;
            self.harvest()?;
            st.router[..n * e].copy_from_slice(&self.host.router.f32s()[..n * e]);
            let bias = match &model.weights.layers[l].ffn {
                Ffn::Moe(m) => m.score_bias.as_deref(),
                Ffn::Dense(_) => None,
            };
            model.select_experts(st, n, bias);
            self.host.selw.f32s_mut()[..n * k].copy_from_slice(&st.selw[..n * k]);
            for (o, &ex) in self.host.sel.i32s_mut().iter_mut().zip(&st.sel[..n * k]) {
                *o = ex as i32;
            }
        }
        st.experts_run += st.needed.len();
        // Assignments in needed order: expert ex owns a0[ex]..a0[ex]+cnt.
        let mut cursor = 0;
        {
            let (tok, dst) = (self.host.tok.i32s_mut(), self.host.dst.i32s_mut());
            for &ex in &st.needed {
                for &(t, slot) in &st.groups[ex] {
                    tok[cursor] = t as i32;
                    dst[cursor] = (t as usize * k + slot as usize) as i32;
                    cursor += 1;
                }
            }
        }
        // SAFETY: the pinned assignment buffers are not rewritten before the next router sync.
        unsafe {
            self.gpu.upload_async(
                self.bufs.tok.ptr,
                self.host.tok.as_slice().as_ptr(),
                4 * cursor,
                compute,
            )?;
            self.gpu.upload_async(
                self.bufs.dst.ptr,
                self.host.dst.as_slice().as_ptr(),
                4 * cursor,
                compute,
            )?;
            if !self.device_route {
                self.gpu.upload_async(
                    self.bufs.selw.ptr,
                    self.host.selw.as_slice().as_ptr(),
                    4 * n * k,
                    compute,
                )?;
                if mo.act.is_some() {
                    // gpt-oss's expert biases find each assignment's expert in `sel`.
                    self.gpu.upload_async(
                        self.bufs.sel.ptr,
                        self.host.sel.as_slice().as_ptr(),
                        4 * n * k,
                        compute,
                    )?;
                }
            }
        }

        // VRAM hits first: one launch for all of them.
        self.pool.begin_step();
        let mut j = 0;
        let mut a0 = 0;
        let (mut lo, mut hi) = (usize::MAX, 0);
        self.misses.clear();
        self.hits.clear();
        for i in 0..st.needed.len() {
            let ex = st.needed[i];
            let cnt = st.groups[ex].len();
            self.pool.note(mo.idx, ex, cnt);
            match self.pool.lookup(mo.idx, ex) {
                Some(slot) => {
                    self.write_job(j, slot, a0, cnt);
                    self.hits.push(ex);
                    (lo, hi) = (lo.min(a0), hi.max(a0 + cnt));
                    j += 1;
                }
                None => self.misses.push((ex, a0, cnt)),
            }
            a0 += cnt;
        }
        self.launch_jobs(&mo, 0, j, n, (lo.min(hi), hi.saturating_sub(lo)), h)?;
        if let Some(c) = &st.expert_cache {
            c.record_usage(l, &self.hits);
        }
        // A pool with a slot for every expert of the layer takes them all now (as misses with
        // no assignments), so the layer runs on device-built job lists from the next forward.
        if self.device_route && !self.layer_ready[mo.idx] && self.pool.slots(mo.idx) >= e {
            for ex in 0..e {
                if st.groups[ex].is_empty() && !self.pool.holds(mo.idx, ex) {
                    self.misses.push((ex, a0, 0));
                }
            }
        }
        let misses = std::mem::take(&mut self.misses);

        // Misses: through the RAM cache, in waves that fit both its free slots and the pool's.
        if !misses.is_empty() {
            let Some(mut cache) = st.expert_cache.take() else {
                return Err(ModelError::from(GpuError::Config(
                    "expert not in VRAM and no RAM expert cache attached".into(),
                )));
            };
            let r = if self.splits_misses() {
                self.misses_split(model, st, &mut cache, l, &mo, &misses, j, n, h)
            } else {
                self.stage_misses(&mut cache, l, &mo, &misses, j, n, h)
            };
            st.expert_cache = Some(cache);
            self.misses = misses;
            r?;
        } else {
            self.misses = misses;
        }
        self.mark_ready(mo.idx, e)?;
        self.seg_start()?;
        Ok(())
    }

    /// Copies every routed expert into the pool now, layer by layer through the RAM expert
    /// cache (the staging path a forward's misses take, with no tokens assigned), and marks each
    /// layer ready for device-built job lists. Only when the pool has a slot for every expert of
    /// every MoE layer (else it copies nothing). Returns the experts copied.
    pub fn preload_experts(
        &mut self,
        model: &Model<'_>,
        st: &mut State,
    ) -> Result<usize, ModelError> {
        let (e, h) = (model.cfg.n_experts, model.cfg.hidden);
        let layers: Vec<(usize, MoeGeo)> = self
            .moes
            .iter()
            .enumerate()
            .filter_map(|(l, gm)| gm.map(|gm| (l, gm.geo)))
            .collect();
        if !self.device_route || layers.iter().any(|(_, mo)| self.pool.slots(mo.idx) < e) {
            return Ok(0);
        }
        self.gpu.bind()?;
        let mut copied = 0;
        for (l, mo) in layers {
            let misses: Vec<(usize, usize, usize)> = (0..e)
                .filter(|&ex| !self.pool.holds(mo.idx, ex))
                .map(|ex| (ex, 0, 0))
                .collect();
            if !misses.is_empty() {
                let Some(mut cache) = st.expert_cache.take() else {
                    return Err(ModelError::from(GpuError::Config(
                        "preloading experts needs the RAM expert cache attached".into(),
                    )));
                };
                let r = self.stage_misses(&mut cache, l, &mo, &misses, 0, 1, h);
                st.expert_cache = Some(cache);
                r?;
                copied += misses.len();
            }
            self.mark_ready(mo.idx, e)?;
        }
        self.gpu.sync(Stream::Compute)?;
        self.harvest()?;
        Ok(copied)
    }

    /// Once every expert of MoE layer `idx` is in the pool (never evicted again: the pool has
    /// a slot for each), writes the layer's pointer table to the device and marks it ready.
    fn mark_ready(&mut self, idx: usize, e: usize) -> Result<(), GpuError> {
        if self.layer_ready[idx] || !self.device_route || self.experts_per_layer[idx] != e {
            return Ok(());
        }
        let Some(slots) = self.pool.all_resident(idx) else {
            return Ok(());
        };
        let sb = self.pool.slot_bytes() as usize;
        let base = idx * e * 24;
        {
            let tab = &mut self.host.etab.as_mut_slice()[base..base + e * 24];
            for (ex, &slot) in slots.iter().enumerate() {
                let at = self.pool_mem.at(slot * sb);
                for (p, off) in self.slot_offs[slot].iter().enumerate() {
                    let o = 24 * ex + 8 * p;
                    tab[o..o + 8].copy_from_slice(&(at + *off as u64).to_le_bytes());
                }
            }
        }
        // SAFETY: this layer's section of the pinned table is written once, here, and never
        // again (the layer stays ready), so it is stable while the copy is in flight.
        unsafe {
            self.gpu.upload_async(
                self.bufs.etab.at(base),
                self.host.etab.as_slice()[base..].as_ptr(),
                e * 24,
                Stream::Compute,
            )?;
        }
        self.layer_ready[idx] = true;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn stage_misses(
        &mut self,
        cache: &mut crate::experts::ExpertCache,
        l: usize,
        mo: &MoeGeo,
        misses: &[(usize, usize, usize)],
        mut j: usize,
        n: usize,
        h: usize,
    ) -> Result<(), ModelError> {
        let ram_cap = cache.slots(l).max(1);
        let mut i = 0;
        let mut wave = std::mem::take(&mut self.wave);
        let r = (|| -> Result<(), ModelError> {
            while i < misses.len() {
                self.pool.begin_wave();
                let vram_cap = self.pool.free_for_wave(mo.idx).max(1);
                wave.clear();
                let start = i;
                let (mut ram_n, mut vram_n) = (0, 0);
                while i < misses.len() {
                    let ex = misses[i].0;
                    let ram_pinned = cache.is_pinned(l, ex);
                    let vram_reserved = self.pool.reserved(mo.idx, ex);
                    if (!ram_pinned && ram_n == ram_cap) || (!vram_reserved && vram_n == vram_cap) {
                        break;
                    }
                    ram_n += usize::from(!ram_pinned);
                    vram_n += usize::from(!vram_reserved);
                    wave.push(ex);
                    i += 1;
                }
                if let Err(e) = cache.begin(l, &wave) {
                    cache.end();
                    return Err(e.into());
                }
                let mut registered: Vec<usize> = Vec::new();
                let r = self.stage_wave(
                    cache,
                    l,
                    mo,
                    &misses[start..i],
                    &mut j,
                    n,
                    h,
                    &mut registered,
                );
                // Copies from the RAM slots must land before the cache may reuse them.
                let synced = self.gpu.sync(Stream::Copy);
                let t = Instant::now();
                for p in registered {
                    // SAFETY: registered in stage_wave; the copy stream is idle (synced above).
                    let _ = unsafe { self.gpu.unregister(p as *const u8) };
                }
                self.stats.register_secs += t.elapsed().as_secs_f64();
                cache.end();
                r?;
                synced?;
            }
            Ok(())
        })();
        self.wave = wave;
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn stage_wave(
        &mut self,
        cache: &crate::experts::ExpertCache,
        l: usize,
        mo: &MoeGeo,
        wave: &[(usize, usize, usize)],
        j: &mut usize,
        n: usize,
        h: usize,
        registered: &mut Vec<usize>,
    ) -> Result<(), ModelError> {
        while let Some((ex, bytes)) = cache.next_ready()? {
            let Some(&(_, a0, cnt)) = wave.iter().find(|m| m.0 == ex) else {
                return Err(ModelError::from(GpuError::Config(format!(
                    "the RAM cache returned expert {ex} of layer {l}, not in the wave"
                ))));
            };
            self.stage_one(l, mo, ex, &bytes, a0, cnt, *j, n, h, registered)?;
            *j += 1;
        }
        Ok(())
    }

    /// Copies expert `ex` of layer `l` (its bytes in a RAM cache slot of the open wave) into
    /// a pool slot on the copy stream and launches it as job `j` (assignments a0..a0+cnt) on
    /// the compute stream after the copy.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn stage_one(
        &mut self,
        l: usize,
        mo: &MoeGeo,
        ex: usize,
        bytes: &crate::experts::ExpertBytes<'_>,
        a0: usize,
        cnt: usize,
        j: usize,
        n: usize,
        h: usize,
        registered: &mut Vec<usize>,
    ) -> Result<(), ModelError> {
        let (compute, copy) = (Stream::Compute, Stream::Copy);
        let Some(a) = self.pool.assign(mo.idx, ex) else {
            return Err(ModelError::from(GpuError::Config(format!(
                "no free VRAM slot for expert {ex} of layer {l} (pool accounting)"
            ))));
        };
        if a.reused_this_step {
            // The slot's previous expert was computed earlier in this step: the copy
            // must wait for that compute.
            let ev = self.timer_start(compute)?;
            self.timer_stop(ev, compute, false)?;
            self.gpu.wait(copy, &self.timers.events[ev + 1])?;
        }
        // One copy per expert: the span of its three parts in the RAM slot.
        let parts = [bytes.gate, bytes.up, bytes.down];
        let lo = parts.iter().map(|p| p.as_ptr() as usize).min().unwrap_or(0);
        let hi = parts
            .iter()
            .map(|p| p.as_ptr() as usize + p.len())
            .max()
            .unwrap_or(0);
        if hi - lo > self.pool.slot_bytes() as usize {
            self.pool.drop_expert(mo.idx, ex);
            return Err(ModelError::from(GpuError::Config(format!(
                "expert {ex} of layer {l} spans {} bytes, more than a pool slot",
                hi - lo
            ))));
        }
        for (o, p) in self.slot_offs[a.slot].iter_mut().zip(&parts) {
            *o = p.as_ptr() as usize - lo;
        }
        if self.staging == Staging::PerExpert {
            let page = 4096;
            let (lo, hi) = (lo / page * page, hi.div_ceil(page) * page);
            let t = Instant::now();
            // SAFETY: the range lies in the RAM cache slot of this wave's expert (slots are
            // page-aligned and disjoint), which stays allocated and unwritten until
            // `cache.end()`, after which stage_misses unregisters it.
            unsafe { self.gpu.register(lo as *const u8, hi - lo)? };
            self.stats.register_secs += t.elapsed().as_secs_f64();
            registered.push(lo);
        }
        let base = a.slot * self.pool.slot_bytes() as usize;
        let tc = self.timer_start(copy)?;
        // SAFETY: the source span lies in this wave's RAM slot (valid until cache.end(),
        // which comes after the copy stream is synced); the destination is the pool slot,
        // at least as large (checked above).
        let r = unsafe {
            self.gpu
                .upload_async(self.pool_mem.at(base), lo as *const u8, hi - lo, copy)
        };
        if let Err(e) = r {
            self.pool.drop_expert(mo.idx, ex);
            return Err(e.into());
        }
        self.stats.bytes_h2d += (hi - lo) as u64;
        self.timer_stop(tc, copy, true)?;
        self.stats.experts_h2d += 1;
        self.gpu.wait(compute, &self.timers.events[tc + 1])?;
        self.write_job(j, a.slot, a0, cnt);
        self.launch_jobs(mo, j, 1, n, (a0, cnt), h)?;
        Ok(())
    }
}

impl Drop for GpuState {
    fn drop(&mut self) {
        let _ = self.release_staging();
    }
}

/// Single kernels run on their own, for the GPU tests (tests/gpu.rs) against references.
pub mod check {
    use super::*;

    fn download_f32(gpu: &Gpu, src: &DevBuf, n: usize) -> Result<Vec<f32>, GpuError> {
        let mut host = gpu.alloc_pinned(4 * n)?;
        // SAFETY: `host` holds 4n bytes and lives until after the sync.
        unsafe {
            gpu.download_async(
                host.as_mut_slice().as_mut_ptr(),
                src.ptr,
                4 * n,
                Stream::Compute,
            )?
        };
        gpu.sync(Stream::Compute)?;
        Ok(host.f32s().to_vec())
    }

    fn upload_new(gpu: &Gpu, bytes: &[u8]) -> Result<DevBuf, GpuError> {
        let b = gpu.alloc(bytes.len())?;
        gpu.upload(b.ptr, bytes)?;
        Ok(b)
    }

    fn kernel(gpu: &Gpu, d: DType, kind: &str) -> Result<Kernel, GpuError> {
        let n = type_name(d).ok_or_else(|| GpuError::Config(format!("no GPU kernel for {d:?}")))?;
        gpu.function(&format!("{kind}_{n}"))
    }

    /// y (n x rows) = x (n x cols) * W^T with the GPU matmul kernel of `d`.
    pub fn matmul(
        d: DType,
        w: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        n: usize,
    ) -> Result<Vec<f32>, GpuError> {
        let gpu = Gpu::open()?;
        let f = kernel(&gpu, d, "mm")?;
        let wd = upload_new(&gpu, w)?;
        let xd = upload_new(&gpu, &f32_bytes(x))?;
        let yd = gpu.alloc(4 * n * rows)?;
        gpu.launch(
            f,
            ((rows as u32).div_ceil(WARPS), 1, 1),
            32 * WARPS,
            0,
            Stream::Compute,
            &[
                wd.ptr.into(),
                ((w.len() / rows) as i64).into(),
                (rows as i32).into(),
                (cols as i32).into(),
                xd.ptr.into(),
                (cols as i32).into(),
                (n as i32).into(),
                yd.ptr.into(),
                (rows as i32).into(),
            ],
        )?;
        download_f32(&gpu, &yd, n * rows)
    }

    /// y (n x rows) = x (n x cols) * W^T with the int8-activation kernel of `d` (x quantized
    /// per 32 values on the device first); `None` if the type has none.
    pub fn matmul_q8(
        d: DType,
        w: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        n: usize,
    ) -> Result<Option<Vec<f32>>, GpuError> {
        if !Q8_TYPES.contains(&d) {
            return Ok(None);
        }
        let gpu = Gpu::open()?;
        let f = kernel(&gpu, d, "mmq")?;
        let quant = gpu.function("quantize_q8")?;
        let wd = upload_new(&gpu, w)?;
        let xd = upload_new(&gpu, &f32_bytes(x))?;
        let xq = gpu.alloc(n * cols)?;
        let xs = gpu.alloc(4 * n * cols / 32)?;
        let yd = gpu.alloc(4 * n * rows)?;
        gpu.launch(
            quant,
            (((n * cols / 32) as u32).div_ceil(8), 1, 1),
            256,
            0,
            Stream::Compute,
            &[
                xd.ptr.into(),
                (cols as i32).into(),
                (cols as i32).into(),
                (n as i32).into(),
                xq.ptr.into(),
                xs.ptr.into(),
            ],
        )?;
        gpu.launch(
            f,
            ((rows as u32).div_ceil(WARPS), 1, 1),
            32 * WARPS,
            0,
            Stream::Compute,
            &[
                wd.ptr.into(),
                ((w.len() / rows) as i64).into(),
                (rows as i32).into(),
                (cols as i32).into(),
                xq.ptr.into(),
                xs.ptr.into(),
                (n as i32).into(),
                yd.ptr.into(),
                (rows as i32).into(),
            ],
        )?;
        download_f32(&gpu, &yd, n * rows).map(Some)
    }

    /// Rows `ids` of W (rows x cols), dequantized by the GPU embedding kernel of `d`.
    pub fn embed(
        d: DType,
        w: &[u8],
        rows: usize,
        cols: usize,
        ids: &[u32],
    ) -> Result<Vec<f32>, GpuError> {
        let gpu = Gpu::open()?;
        let f = kernel(&gpu, d, "embed")?;
        let wd = upload_new(&gpu, w)?;
        let idb: Vec<u8> = ids.iter().flat_map(|&i| (i as i32).to_le_bytes()).collect();
        let id = upload_new(&gpu, &idb)?;
        let yd = gpu.alloc(4 * ids.len() * cols)?;
        gpu.launch(
            f,
            (ids.len() as u32, 1, 1),
            128,
            0,
            Stream::Compute,
            &[
                wd.ptr.into(),
                ((w.len() / rows) as i64).into(),
                (cols as i32).into(),
                id.ptr.into(),
                yd.ptr.into(),
            ],
        )?;
        download_f32(&gpu, &yd, ids.len() * cols)
    }

    /// The tensor-core kernel `<name>_<d>` (`<name>_h_<d>` when `half`: keys and values
    /// stored as f16) on a fresh context, with q, k, v and the position `pos0` uploaded.
    fn mma_inputs(
        name: &str,
        d: usize,
        q: &[f32],
        (k, v, half): (&[f32], &[f32], bool),
        pos0: usize,
    ) -> Result<(Gpu, Kernel, [DevBuf; 4]), GpuError> {
        if !MMA_DIMS.contains(&d) {
            return Err(GpuError::Config(format!("no {name} for head size {d}")));
        }
        let gpu = Gpu::open()?;
        let f = gpu.function(&format!("{name}{}_{d}", if half { "_h" } else { "" }))?;
        let cache = |x: &[f32]| -> Vec<u8> {
            if half {
                x.iter()
                    .flat_map(|&y| crate::kernels::kv::f32_to_f16(y).to_le_bytes())
                    .collect()
            } else {
                f32_bytes(x)
            }
        };
        let bufs = [
            upload_new(&gpu, &f32_bytes(q))?,
            upload_new(&gpu, &cache(k))?,
            upload_new(&gpu, &cache(v))?,
            upload_new(&gpu, &(pos0 as i32).to_le_bytes())?,
        ];
        Ok((gpu, f, bufs))
    }

    /// Flash-decoding on the tensor cores (`attention_mma_dec_<d>`): `n` tokens (rows of heads
    /// x d) at positions `pos0 ..`, token t over keys and values 0 ..= pos0 + t (rows of
    /// kv_heads x d, f16 numbers, stored as f16 when `half`) in `splits` splits of at most
    /// `chunk` and at least `min_chunk` positions (the kernel's own split of each token's
    /// length), scale 1/sqrt(d); the n x heads x d output.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_mma_dec(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        pos0: usize,
        heads: usize,
        kv_heads: usize,
        d: usize,
        (splits, chunk, min_chunk): (usize, usize, usize),
        half: bool,
    ) -> Result<Vec<f32>, GpuError> {
        let (gpu, f, [qb, kb, vb, pb]) = mma_inputs("attention_mma_dec", d, q, (k, v, half), pos0)?;
        let (qd, kvd) = (heads * d, kv_heads * d);
        let parts = n * heads * splits;
        let pm = gpu.alloc(4 * parts)?;
        let pl = gpu.alloc(4 * parts)?;
        let po = gpu.alloc(4 * parts * d)?;
        let done = upload_new(&gpu, &vec![0u8; 4 * n * heads])?;
        let ob = gpu.alloc(4 * n * qd)?;
        gpu.launch(
            f,
            (kv_heads as u32, n as u32, splits as u32),
            128,
            0,
            Stream::Compute,
            &[
                qb.ptr.into(),
                (qd as i32).into(),
                (d as i32).into(),
                kb.ptr.into(),
                (kvd as i32).into(),
                (d as i32).into(),
                vb.ptr.into(),
                (kvd as i32).into(),
                (d as i32).into(),
                ((heads / kv_heads) as i32).into(),
                pb.ptr.into(),
                0i32.into(),
                (1.0 / (d as f32).sqrt()).into(),
                (chunk as i32).into(),
                (min_chunk as i32).into(),
                pm.ptr.into(),
                pl.ptr.into(),
                po.ptr.into(),
                ob.ptr.into(),
                (qd as i32).into(),
                (d as i32).into(),
                0u64.into(),
                0u64.into(),
                done.ptr.into(),
            ],
        )?;
        download_f32(&gpu, &ob, n * qd)
    }

    /// Prompt attention on the tensor cores (`attention_mma_<d>`): `n` queries (rows of
    /// heads x d) at positions `pos0 ..`, over `pos0 + n` keys and values (rows of kv_heads x
    /// d, f16 numbers, stored as f16 when `half`), causal, scale 1/sqrt(d); the n x heads x d
    /// output.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_mma(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        pos0: usize,
        heads: usize,
        kv_heads: usize,
        d: usize,
        half: bool,
    ) -> Result<Vec<f32>, GpuError> {
        let (gpu, f, [qb, kb, vb, pb]) = mma_inputs("attention_mma", d, q, (k, v, half), pos0)?;
        let (qd, kvd) = (heads * d, kv_heads * d);
        let ob = gpu.alloc(4 * n * qd)?;
        gpu.launch(
            f,
            (heads as u32, n.div_ceil(64) as u32, 1),
            128,
            0,
            Stream::Compute,
            &[
                qb.ptr.into(),
                (qd as i32).into(),
                (d as i32).into(),
                kb.ptr.into(),
                (kvd as i32).into(),
                (d as i32).into(),
                vb.ptr.into(),
                (kvd as i32).into(),
                (d as i32).into(),
                ((heads / kv_heads) as i32).into(),
                pb.ptr.into(),
                0i32.into(),
                (1.0 / (d as f32).sqrt()).into(),
                (n as i32).into(),
                ob.ptr.into(),
                (qd as i32).into(),
                (d as i32).into(),
            ],
        )?;
        download_f32(&gpu, &ob, n * qd)
    }
}
