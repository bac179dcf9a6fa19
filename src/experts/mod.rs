//! Routed experts streamed from disk through a bounded, tiered cache (issue 5).
//!
//! Map of the module, one concern per file:
//! - `store.rs`: `ExpertStore`, where each expert's gate/up/down bytes lie in the model's files
//!   and how they are laid out in a cache slot (`slot_bytes`, the read plan per expert).
//! - `slab.rs`: `Slab`, the one large page-aligned allocation the slots live in (mlocked when
//!   allowed).
//! - `io.rs`: `ReadPool`, reader threads created once that fill slot memory with `--io
//!   direct|buffered|mmap` reads and report completions.
//! - `policy.rs`: eviction choices (LRU, decayed hotness) shared by the cache and the simulator,
//!   so `cache-sim` replays exactly what the cache would do.
//! - `cache.rs`: `ExpertCache`, the pinned + evictable tiers and the begin / next_ready / end
//!   protocol the forward pass drives.
//! - `usage.rs`: `UsageStats`, per (layer, expert) selection counts saved beside the model.
//! - `trace.rs` and `sim.rs`: route traces (text, one line per request) and their replay against
//!   LRU, hotness and Belady-optimal eviction.
//!
//! Not here: deciding which experts a token needs (the router, in model/), computing with the
//! bytes (kernels/), memory budgets for the rest of the engine (the planner).
//!
//! The invariant everything serves: bytes handed out by `ExpertCache::next_ready` are exactly
//! the bytes of the expert's ranges in the files, and stay untouched until `end`; a failed or
//! short read surfaces as an error, never as garbage bytes.

pub mod cache;
pub mod io;
pub(crate) mod policy;
pub mod sim;
pub mod slab;
pub mod store;
pub mod trace;
pub mod usage;
pub mod verify;

pub use cache::{CacheConfig, CacheStats, ExpertBytes, ExpertCache};
pub use io::{advise_random, lock_resident, IoMode, ReadJob, ReadPool};
pub use policy::Policy;
pub use sim::{simulate, simulate_from, SimPolicy, SimResult};
pub use slab::Slab;
pub use store::{ExpertLoc, ExpertStore};
pub use trace::{Trace, TraceLine, TraceWriter};
pub use usage::{model_identity, Loaded, UsageStats};
pub use verify::{expert_hash, ExpertHashes};

use std::path::{Path, PathBuf};

/// O_DIRECT alignment: offsets, lengths and memory addresses of direct reads are multiples of
/// this. 4 KiB covers the logical block size of every NVMe and SATA disk in common use.
pub const ALIGN: u64 = 4096;

/// Everything that can go wrong storing, reading or caching experts. One line each; messages
/// name the file (and offset) or the request that is wrong.
#[derive(Debug, thiserror::Error)]
pub enum ExpertError {
    /// The file system refused (open, stat, read, write, rename).
    #[error("{}: cannot {op}: {err}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        err: std::io::Error,
    },
    /// The operating system failed a read (EIO, a vanished device, ...).
    #[error("{}: read of {len} bytes at offset {offset} failed: {err}", path.display())]
    Read {
        path: PathBuf,
        offset: u64,
        len: u64,
        err: std::io::Error,
    },
    /// A read ended before the bytes an expert needs: the file is shorter than the model says
    /// (truncated while running, or a wrong range).
    #[error("{}: short read at offset {offset}: got {got} of {wanted} bytes (file truncated or shorter than the model says)", path.display())]
    ShortRead {
        path: PathBuf,
        offset: u64,
        wanted: u64,
        got: u64,
    },
    /// An expert's byte range is impossible (file index, overflow, past the end of the file).
    #[error("expert {expert} of layer {layer}, {part}: {msg}")]
    BadRange {
        layer: usize,
        expert: usize,
        part: &'static str,
        msg: String,
    },
    /// A configuration the cache cannot honour (capacity, pinned list, policy parameters).
    #[error("expert cache: {0}")]
    Config(String),
    /// The cache was driven out of protocol (unknown layer or expert, wave too large, begin
    /// while a wave is open).
    #[error("expert cache: {0}")]
    Request(String),
    /// The slot memory could not be allocated.
    #[error("expert cache: cannot allocate {bytes} bytes of slot memory: {err}")]
    Alloc { bytes: u64, err: std::io::Error },
    /// A route trace line that does not parse or contradicts the header.
    #[error("{}:{line}: {msg}", path.display())]
    Trace {
        path: PathBuf,
        line: usize,
        msg: String,
    },
    /// A usage-statistics file that does not parse or belongs to another model.
    #[error("{}: {msg}", path.display())]
    Usage { path: PathBuf, msg: String },
    /// `--verify-experts`: an expert's bytes as read differ from the hash recorded for it.
    #[error("expert {expert} of layer {layer}: the bytes read do not match its recorded hash (--verify-experts): the model file changed or the disk returned bad data")]
    Corrupt { layer: usize, expert: usize },
}

impl ExpertError {
    pub(crate) fn io(path: &Path, op: &'static str, err: std::io::Error) -> ExpertError {
        ExpertError::Io {
            path: path.to_path_buf(),
            op,
            err,
        }
    }
}

/// `x` rounded down to a multiple of `ALIGN`.
pub(crate) fn align_down(x: u64) -> u64 {
    x & !(ALIGN - 1)
}

/// `x` rounded up to a multiple of `ALIGN` (callers keep `x` far from u64::MAX: file offsets).
pub(crate) fn align_up(x: u64) -> u64 {
    (x + ALIGN - 1) & !(ALIGN - 1)
}
