//! The CUDA backend (cargo feature `cuda`): the shared forward graph on the GPU, with routed
//! experts computed from a VRAM expert pool that sits above the RAM expert cache and the SSD.
//!
//! Owns: the driver wrapper (`driver.rs`, every unsafe CUDA call), the kernels (`kernels.cu`,
//! compiled to the committed `kernels.ptx` by scripts/build-ptx.py), the VRAM pool bookkeeping
//! (`pool.rs`, compiled without the feature so it is tested everywhere), the CPU's products of
//! pool misses under `--gpu-experts hybrid` (`cpu_experts.rs`, likewise; `split.rs` places
//! them), the device state
//! (`model.rs`: weights, KV cache, scratch, kernel launchers, the MoE step, staging), the
//! `Backend`/`Device` implementations (`backend.rs`) and the one list of what the device lacks
//! (`refusal`). Does not own: what is computed — the forward graph is model/'s, the same one
//! the CPU runs; routing runs on the device by the CPU's rule (`route_token`: same scores,
//! bias, groups, top-k with the lower index winning ties), the same kernel for every placement.
//!
//! Memory (issue: residency costs are real): dense weights live in one device allocation, the
//! expert pool in another (`--vram`), scratch in a handful sized once; expert bytes reach the
//! pool from the RAM expert cache's slab, which is registered with the driver once
//! (`--gpu-staging arena`), so an O_DIRECT read lands in memory the copy engine reads directly.
//! `per-expert` registers and unregisters each staged expert around its copy (the naive way,
//! kept for the A/B); `pageable` copies without registering anything.

pub mod cpu_experts;
pub mod pool;

#[cfg(feature = "cuda")]
pub mod backend;
#[cfg(feature = "cuda")]
pub mod driver;
#[cfg(feature = "cuda")]
pub mod gemm;
#[cfg(feature = "cuda")]
mod hybrid;
#[cfg(feature = "cuda")]
pub mod model;
#[cfg(feature = "cuda")]
mod ops;
#[cfg(feature = "cuda")]
mod split;
#[cfg(feature = "cuda")]
mod v4;

use std::fmt;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No usable driver or device: callers fall back to the CPU.
    #[error("{0}")]
    NoDriver(String),
    #[error("CUDA: {0}")]
    Driver(String),
    #[error("GPU: {0}")]
    Config(String),
}

/// How expert bytes in host memory are made copyable to the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Staging {
    /// The RAM expert cache's slab is registered once at start.
    Arena,
    /// Each staged expert's slot is registered before its copy and unregistered after.
    PerExpert,
    /// Nothing registered: the driver bounces pageable memory through its own buffers.
    Pageable,
}

impl Staging {
    pub fn parse(s: &str) -> Result<Staging, String> {
        match s {
            "arena" => Ok(Staging::Arena),
            "per-expert" => Ok(Staging::PerExpert),
            "pageable" => Ok(Staging::Pageable),
            _ => Err(format!("{s:?}: expected arena, per-expert or pageable")),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Staging::Arena => "arena",
            Staging::PerExpert => "per-expert",
            Staging::Pageable => "pageable",
        }
    }
}

impl fmt::Display for Staging {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the GPU path was asked for.
#[derive(Clone, Debug)]
pub struct GpuOptions {
    /// Bytes of the VRAM expert pool; `None`: what fits (free VRAM after weights, KV and
    /// scratch, less a margin), capped at every expert.
    pub vram: Option<u64>,
    pub staging: Staging,
    /// (layer, expert) pairs to keep in the pool's pinned tier (most-selected first).
    pub pinned: Vec<(usize, usize)>,
}

/// GPU figures since attach: the model's device figures (`model::backend::DeviceStats`).
pub use crate::model::backend::DeviceStats as GpuStats;

/// A GPU error reaches the forward graph's callers as `ModelError::Backend` (one line).
impl From<GpuError> for crate::model::ModelError {
    fn from(e: GpuError) -> Self {
        crate::model::ModelError::Backend(e.to_string())
    }
}

/// Weight types with GPU kernels (kernels.cu instantiates each as `mm_<name>` etc., the name
/// being `DType::name` in lower case).
/// kernels_quants.cu holds the types from Q4_1 on.
pub const GPU_TYPES: [crate::dtype::DType; 25] = {
    use crate::dtype::DType::*;
    [
        F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ2_XXS, MXFP4, Q4_1, Q5_0, Q5_1,
        IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S, IQ1_S, IQ1_M,
    ]
};

/// Why the CUDA backend cannot run a model with context `ctx`, in one line (None: it can).
/// The one list of what the device lacks: `EngineOptions::check` refuses `--gpu on` with it
/// before weights are bound, `--gpu auto` prints it and runs the CPU, and `GpuState::attach`
/// checks it again. The forward graph is the CPU's; these are the operations it asks for that
/// have no kernel here yet.
pub fn refusal(cfg: &crate::model::ModelConfig, _ctx: usize) -> Option<String> {
    // Families whose graph has run on the device against transformers (tests/gpu.rs) say so
    // in their spec (`FamilySpec::gpu_validated`). A new family's operations reach the GPU as
    // the trait's default bodies until its port is validated there, so it is refused by name
    // rather than run unchecked. Sliding windows,
    // attention sinks, clip_qkv, gpt-oss's biased clamped-SwiGLU experts and DSA's lightning
    // indexer (V3.2, GLM-5) have kernels (`ops.rs`); Qwen3-Next / Qwen3.5-MoE's hybrid layers
    // too (`hybrid.rs`), and DeepSeek-V4's streams, attention and MoE (`v4.rs`, experts resident
    // in VRAM).
    if !cfg.family.spec().gpu_validated {
        return Some(format!(
            "the {} family has not been validated on the GPU backend (tests/gpu.rs); use --gpu off",
            cfg.family.spec().name
        ));
    }
    cfg.hybrid.as_deref().and_then(hybrid_refusal)
}

/// Longest Gated DeltaNet conv kernel, and key-head rows per thread of the delta-rule kernel
/// (kernels_hybrid.cu `GDN_MAXK`, `GDN_MAXR`).
pub const HYBRID_MAX_CONV: usize = 8;
pub const HYBRID_MAX_ROWS: usize = 32;

/// Threads per key-head column group of the delta-rule kernel (a power of two).
pub fn hybrid_parts(hy: &crate::model::qwen3next::Hybrid) -> usize {
    hy.k_dim.div_ceil(HYBRID_MAX_ROWS).next_power_of_two()
}

/// What the hybrid kernels cannot take: a longer conv, or a value head times its key-row groups
/// over one block of 1024 threads.
fn hybrid_refusal(hy: &crate::model::qwen3next::Hybrid) -> Option<String> {
    let parts = hybrid_parts(hy);
    (hy.conv > HYBRID_MAX_CONV || parts > 32 || hy.v_dim * parts > 1024).then(|| {
        format!(
            "Gated DeltaNet with conv kernel {}, key heads {} wide and value heads {} wide: the GPU kernels take conv <= {HYBRID_MAX_CONV} and value width x ceil(key width / {HYBRID_MAX_ROWS}) <= 1024; use --gpu off",
            hy.conv, hy.k_dim, hy.v_dim
        )
    })
}

/// VRAM left free by the default expert pool (`--vram` unset), for the driver and other users.
pub const VRAM_MARGIN: u64 = 1 << 30;

/// Whether this build has the CUDA backend.
pub const BUILT: bool = cfg!(feature = "cuda");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hybrid_shapes_past_the_kernels_are_refused_by_name() {
        let mut hy = crate::model::qwen3next::Hybrid {
            linear: vec![true],
            dense: vec![false],
            k_heads: 16,
            v_heads: 32,
            k_dim: 128,
            v_dim: 128,
            conv: 4,
            fused: false,
            v_tiled: false,
        };
        assert_eq!(hybrid_parts(&hy), 4);
        assert_eq!(hybrid_refusal(&hy), None);
        hy.conv = 9;
        assert!(hybrid_refusal(&hy).is_some_and(|m| m.contains("conv kernel 9")));
        hy.conv = 4;
        hy.k_dim = 256;
        hy.v_dim = 256;
        assert!(hybrid_refusal(&hy).is_some_and(|m| !m.contains('\n')));
    }
}
