//! The CUDA backend (cargo feature `cuda`): the whole forward pass on the GPU, with routed
//! experts computed from a VRAM expert pool that sits above the RAM expert cache and the SSD.
//!
//! Owns: the driver wrapper (`driver.rs`, every unsafe CUDA call), the kernels (`kernels.cu`,
//! compiled to the committed `kernels.ptx` by scripts/build-ptx.py), the VRAM pool bookkeeping
//! (`pool.rs`, compiled without the feature too so it is tested everywhere) and the GPU forward
//! (`model.rs`). Does not own: what is computed — the forward is the CPU model's, step for
//! step; routing runs on the device by the CPU's rule (`route_token`: same scores, bias,
//! groups, top-k with the lower index winning ties), the same kernel for every placement.
//!
//! Memory (issue: residency costs are real): dense weights live in one device allocation, the
//! expert pool in another (`--vram`), scratch in a handful sized once; expert bytes reach the
//! pool from the RAM expert cache's slab, which is registered with the driver once
//! (`--gpu-staging arena`), so an O_DIRECT read lands in memory the copy engine reads directly.
//! `per-expert` registers and unregisters each staged expert around its copy (the naive way,
//! kept for the A/B); `pageable` copies without registering anything.

pub mod pool;

#[cfg(feature = "cuda")]
pub mod driver;
#[cfg(feature = "cuda")]
pub mod gemm;
#[cfg(feature = "cuda")]
pub mod model;

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

/// GPU figures since the state was made (or `since` a snapshot).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GpuStats {
    /// Forward calls and their host wall seconds.
    pub forwards: u64,
    pub wall_secs: f64,
    /// Seconds the compute stream spent in kernels (event-timed segments).
    pub kernel_secs: f64,
    /// Seconds the copy stream spent copying experts, and the bytes it copied.
    pub copy_secs: f64,
    pub bytes_h2d: u64,
    pub experts_h2d: u64,
    /// Host seconds spent registering/unregistering staged experts (per-expert staging).
    pub register_secs: f64,
    /// VRAM pool hits and misses (selections).
    pub vram_hits: u64,
    pub vram_misses: u64,
}

impl GpuStats {
    pub fn since(&self, b: &GpuStats) -> GpuStats {
        GpuStats {
            forwards: self.forwards - b.forwards,
            wall_secs: self.wall_secs - b.wall_secs,
            kernel_secs: self.kernel_secs - b.kernel_secs,
            copy_secs: self.copy_secs - b.copy_secs,
            bytes_h2d: self.bytes_h2d - b.bytes_h2d,
            experts_h2d: self.experts_h2d - b.experts_h2d,
            register_secs: self.register_secs - b.register_secs,
            vram_hits: self.vram_hits - b.vram_hits,
            vram_misses: self.vram_misses - b.vram_misses,
        }
    }
    /// Achieved host -> device GB/s while copying experts.
    pub fn h2d_gbps(&self) -> f64 {
        if self.copy_secs > 0.0 {
            self.bytes_h2d as f64 / self.copy_secs / 1e9
        } else {
            0.0
        }
    }
    pub fn vram_hit_rate(&self) -> f64 {
        let r = self.vram_hits + self.vram_misses;
        if r == 0 {
            0.0
        } else {
            self.vram_hits as f64 / r as f64
        }
    }
    /// Share of wall time the GPU was not running kernels.
    pub fn stall_share(&self) -> f64 {
        if self.wall_secs > 0.0 {
            ((self.wall_secs - self.kernel_secs) / self.wall_secs).max(0.0)
        } else {
            0.0
        }
    }
}

/// Weight types with GPU kernels (kernels.cu instantiates each as `mm_<name>` etc., the name
/// being `DType::name` in lower case).
pub const GPU_TYPES: [crate::dtype::DType; 12] = {
    use crate::dtype::DType::*;
    [
        F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ2_XXS, MXFP4,
    ]
};

/// VRAM left free by the default expert pool (`--vram` unset), for the driver and other users.
pub const VRAM_MARGIN: u64 = 1 << 30;

/// Whether this build has the CUDA backend.
pub const BUILT: bool = cfg!(feature = "cuda");
