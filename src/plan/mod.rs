//! What this machine can do, measured: the `MachineProfile` that `sluice doctor` prints and that
//! later commands (the planner, `run`, `bench`) read to decide cache sizes, reader threads and
//! IO mode.
//!
//! Map:
//! - `mod.rs`: the profile (versioned serde schema), where it is cached, `load_or_probe`.
//! - `probe_cpu.rs`, `probe_mem.rs`, `probe_disk.rs`, `probe_gpu.rs`: one probe per resource.
//! - `doctor.rs`: a model's header/range checks and `--deep` checksums.
//! - `gpu_experts.rs`: where VRAM-pool misses run (`--gpu-experts`), from measured costs.
//! - `sys.rs`: the libc calls std lacks (statvfs, getrlimit, posix_fadvise, signal cleanup).
//!
//! Caching: one JSON file per (filesystem device, CPU) in the cache directory,
//! `machine-<major>-<minor>-<hash>.json`, written to a temporary name and renamed. A load reuses
//! it when its version and key match and it holds O_DIRECT figures for every read size asked
//! for; missing sizes are probed and added. The volatile figures (available memory, cgroup and
//! mlock limits, free space) are re-read on every load, so a reused profile is never stale there.
//!
//! Owns: the measurements and their schema. Does not own: decisions (the planner), printing
//! (cli/doctor.rs). Invariant: every figure was measured or read from the OS on this machine;
//! one that could not be is `None` with a note saying why, never an estimate.

pub mod doctor;
pub mod gpu_experts;
pub mod parallel;
pub mod planner;
pub mod probe_cpu;
pub mod probe_disk;
pub mod probe_gpu;
pub mod probe_mem;
mod sys;

use serde::{Deserialize, Serialize};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use probe_cpu::CpuInfo;
pub use probe_disk::{ReadMode, ReadPoint, ReadSeries, StorageInfo};
pub use probe_gpu::{CopyRate, GpuDevice, GpuInfo};
pub use probe_mem::MemoryInfo;

use crate::format::{FormatError, ModelFiles};

/// A probe that found the machine busier than this (share of all cores' time) is taken again
/// on a later start that finds it quieter than `QUIET`.
pub const BUSY: f64 = 0.5;
/// See `BUSY`.
pub const QUIET: f64 = 0.25;
/// A run whose expert reads came faster than the profile's ceiling times this raises it.
pub const RAISE_ABOVE: f64 = 1.25;

/// Bump when the schema or a method changes: older files are then probed again.
pub const PROFILE_VERSION: u32 = 1;

/// Everything sluice knows about this machine's resources.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MachineProfile {
    pub version: u32,
    /// The sluice that measured it.
    pub sluice_version: String,
    /// Device identity the profile is cached under (see `profile_key`).
    pub key: String,
    /// When it was probed, seconds since the Unix epoch.
    pub probed_unix: u64,
    /// How long the probe took.
    pub probe_seconds: f64,
    /// Probed with `--quick` (small files, short points): rough figures.
    pub quick: bool,
    pub cpu: CpuInfo,
    pub memory: MemoryInfo,
    pub storage: StorageInfo,
    pub gpu: GpuInfo,
}

impl MachineProfile {
    /// Best O_DIRECT random-read GB/s at the probed size nearest `block_bytes`, with the thread
    /// count that reached it: the storage ceiling for a planner.
    pub fn disk_ceiling(&self, block_bytes: u64) -> Option<(u64, &ReadPoint)> {
        let s = self.storage.nearest_direct(block_bytes)?;
        Some((s.block_bytes, s.best()?))
    }

    /// A run's own expert-read figures against the profile: `bytes` read in `secs` of wall
    /// time with reads outstanding, in reads of about `block_bytes`. When the run read faster
    /// than the profile's O_DIRECT ceiling x `RAISE_ABOVE` (a probe taken while the machine
    /// was busy, or a disk that got faster), the ceiling's best point is raised to what the run
    /// achieved and a line says so (the caller saves the profile); when it read at less than
    /// half the ceiling, a line says so and nothing changes (the run may not have kept the
    /// readers busy). `None`: nothing worth saying (too little read, or within the band).
    pub fn check_run_reads(&mut self, block_bytes: u64, bytes: u64, secs: f64) -> Option<String> {
        if bytes < 64 << 20 || secs <= 0.0 {
            return None;
        }
        let run = bytes as f64 / secs / 1e9;
        let busy = self.storage.busy_at_probe;
        let series = self
            .storage
            .series
            .iter_mut()
            .filter(|s| s.mode == ReadMode::Direct)
            .min_by_key(|s| s.block_bytes.abs_diff(block_bytes))?;
        let best = series
            .points
            .iter_mut()
            .max_by(|a, b| a.gbps.total_cmp(&b.gbps))?;
        let ceiling = best.gbps;
        if run > ceiling * RAISE_ABOVE {
            let why = match busy {
                Some(b) if b > BUSY => {
                    format!(" (probed while the machine was {:.0}% busy)", 100.0 * b)
                }
                _ => String::new(),
            };
            best.gbps = sig6(run);
            let note =
                format!("raised from {ceiling:.2} to {run:.2} GB/s by a run's expert reads{why}");
            self.storage.raised_by_run = Some(note);
            Some(format!(
                "disk: this run read experts at {run:.2} GB/s, faster than the profile's {ceiling:.2} GB/s{why}: profile raised (`sluice doctor --refresh` probes again)"
            ))
        } else if run < ceiling * 0.5 {
            Some(format!(
                "disk: this run read experts at {run:.2} GB/s, under half the profile's {ceiling:.2} GB/s (readers idle part of the time, or the disk is shared); profile kept"
            ))
        } else {
            None
        }
    }

    /// Re-read what changes while a machine runs (available memory, limits, free space).
    pub fn refresh_volatile(&mut self) {
        let l = probe_mem::limits();
        self.memory.total_bytes = l.total_bytes;
        self.memory.available_bytes = l.available_bytes;
        self.memory.memlock_limit_bytes = l.memlock_limit_bytes;
        self.memory.cgroup_limit_bytes = l.cgroup_limit_bytes;
        self.memory.cgroup_source = l.cgroup_source;
        self.storage.free_bytes = sys::free_bytes(Path::new(&self.storage.dir)).ok();
    }

    /// The profile of the machine and of the storage under `path_hint` (a model file or
    /// directory; `None`: the cache directory): the cached one when it fits, else probed now
    /// and cached. A model's expert read size is probed too. See the module doc.
    pub fn load_or_probe(
        path_hint: Option<&Path>,
        refresh: bool,
    ) -> Result<MachineProfile, ProbeError> {
        let o = ProbeOptions::for_path(path_hint)?;
        Ok(load_or_probe_with(&o, refresh, &|_| {})?.profile)
    }
}

/// Everything that can stop a probe. Each message names the file or directory involved.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{}: cannot {op}: {err}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        err: std::io::Error,
    },
    #[error("{}: {msg}", path.display())]
    Read { path: PathBuf, msg: String },
    #[error("{0}")]
    Other(String),
    #[error(transparent)]
    Format(#[from] FormatError),
}

impl ProbeError {
    pub(crate) fn io(path: &Path, op: &'static str, err: std::io::Error) -> ProbeError {
        ProbeError::Io {
            path: path.to_path_buf(),
            op,
            err,
        }
    }
}

/// What to probe and where.
#[derive(Clone, Debug)]
pub struct ProbeOptions {
    /// Where profiles are cached.
    pub cache_dir: PathBuf,
    /// Directory whose storage to measure.
    pub storage_dir: PathBuf,
    /// The model's largest file, read instead of a probe file when large enough.
    pub model_file: Option<PathBuf>,
    /// O_DIRECT read sizes (1 MiB is always added).
    pub block_sizes: Vec<u64>,
    /// Small files and short points: a rough profile in a second or two.
    pub quick: bool,
}

impl ProbeOptions {
    /// Probe the cache directory's storage at 1 MiB.
    pub fn for_cache_dir() -> ProbeOptions {
        let c = crate::default_model::cache_dir();
        ProbeOptions {
            storage_dir: c.clone(),
            cache_dir: c,
            model_file: None,
            block_sizes: vec![1 << 20],
            quick: false,
        }
    }

    /// Probe the storage under `m` at its expert read sizes and 1 MiB.
    pub fn for_model(m: &ModelFiles) -> ProbeOptions {
        let sizes = doctor::expert_sizes(m);
        let largest = m
            .paths()
            .iter()
            .max_by_key(|p| std::fs::metadata(p).map(|md| md.len()).unwrap_or(0))
            .cloned();
        let mut block_sizes = vec![1 << 20];
        block_sizes.extend(sizes.slice_bytes);
        if sizes.per_layer_bytes > 0 {
            block_sizes.push(sizes.per_layer_bytes);
        }
        ProbeOptions {
            cache_dir: crate::default_model::cache_dir(),
            storage_dir: m.dir().to_path_buf(),
            model_file: largest,
            block_sizes,
            quick: false,
        }
    }

    /// A model path (opened to learn its expert size), a directory, or nothing (the cache dir).
    pub fn for_path(path_hint: Option<&Path>) -> Result<ProbeOptions, ProbeError> {
        let Some(p) = path_hint else {
            return Ok(Self::for_cache_dir());
        };
        if let Ok(m) = ModelFiles::open(p) {
            return Ok(Self::for_model(&m));
        }
        let dir = if p.is_dir() {
            p.to_path_buf()
        } else {
            p.parent()
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
        };
        if !dir.is_dir() {
            return Err(ProbeError::Other(format!(
                "{}: not a model or a directory",
                p.display()
            )));
        }
        Ok(ProbeOptions {
            storage_dir: dir,
            ..Self::for_cache_dir()
        })
    }

    fn sizes(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .block_sizes
            .iter()
            .chain(std::iter::once(&(1u64 << 20)))
            .map(|&b| b.max(1).div_ceil(probe_disk::ALIGN) * probe_disk::ALIGN)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    fn point(&self) -> Duration {
        Duration::from_millis(if self.quick { 50 } else { 400 })
    }
}

/// How a profile came to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// Read from the cache as it was.
    Cached,
    /// Read from the cache, with read sizes it lacked probed and added.
    Extended,
    /// Probed now.
    Probed,
}

/// A profile and where it lives.
#[derive(Clone, Debug)]
pub struct Loaded {
    pub profile: MachineProfile,
    pub path: PathBuf,
    pub origin: Origin,
    /// Why the profile could not be written to the cache (it is still valid).
    pub save_error: Option<String>,
}

/// `x` to six significant digits: what a measurement is worth, and short enough that the JSON
/// reader gives back the very same `f64` (profiles round-trip exactly).
pub(crate) fn sig6(x: f64) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    format!("{x:.5e}").parse().unwrap_or(x)
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xCBF2_9CE4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01B3)
    })
}

/// The cache key: the filesystem device of `dir`, and a hash of the CPU model and core count.
pub fn profile_key(dir: &Path, cpu: &CpuInfo) -> Result<String, ProbeError> {
    let md = std::fs::metadata(dir).map_err(|e| ProbeError::io(dir, "stat", e))?;
    let (maj, min) = probe_disk::dev_major_minor(md.dev());
    let id = format!(
        "{}|{}",
        cpu.model.as_deref().unwrap_or("?"),
        cpu.logical_cores
    );
    Ok(format!("{maj}-{min}-{:08x}", fnv1a(id.as_bytes()) as u32))
}

/// Where the profile for `key` is cached.
pub fn profile_path(cache_dir: &Path, key: &str) -> PathBuf {
    cache_dir.join(format!("machine-{key}.json"))
}

/// Read a cached profile; `None` if absent, unreadable, or of another version.
pub fn read_profile(path: &Path) -> Option<MachineProfile> {
    let text = std::fs::read(path).ok()?;
    let p: MachineProfile = serde_json::from_slice(&text).ok()?;
    (p.version == PROFILE_VERSION).then_some(p)
}

/// Write `p` to `path` through a temporary file and a rename.
pub fn write_profile(path: &Path, p: &MachineProfile) -> Result<(), ProbeError> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(|e| ProbeError::io(d, "create directory", e))?;
    }
    let tmp = path.with_extension(format!("json.{}.tmp", std::process::id()));
    let text = serde_json::to_vec_pretty(p)
        .map_err(|e| ProbeError::Other(format!("serialising the profile: {e}")))?;
    std::fs::write(&tmp, text).map_err(|e| ProbeError::io(&tmp, "write", e))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        ProbeError::io(path, "rename into place", e)
    })
}

fn disk_options(o: &ProbeOptions, cpu: &CpuInfo, sizes: Vec<u64>) -> probe_disk::DiskProbeOptions {
    probe_disk::DiskProbeOptions {
        dir: o.storage_dir.clone(),
        model_file: o.model_file.clone(),
        block_sizes: sizes,
        threads: probe_disk::thread_ladder(cpu.logical_cores),
        file_bytes: o.quick.then_some(64 << 20),
        point: o.point(),
        buffered: true,
    }
}

/// Measure everything now (no cache involved).
pub fn probe(o: &ProbeOptions, log: &dyn Fn(&str)) -> Result<MachineProfile, ProbeError> {
    let t = Instant::now();
    let cpu = probe_cpu::probe();
    let key = profile_key(&o.storage_dir, &cpu)?;
    let l = probe_mem::limits();
    let sweep = probe_mem::SweepOptions::auto(&cpu, l.available_bytes, o.quick);
    log(&format!(
        "memory read sweep over {} MiB with {} threads",
        sweep.buffer_bytes >> 20,
        sweep.threads
    ));
    let read_gbps = probe_mem::read_bandwidth(&sweep).ok().map(sig6);
    let memory = MemoryInfo {
        total_bytes: l.total_bytes,
        available_bytes: l.available_bytes,
        memlock_limit_bytes: l.memlock_limit_bytes,
        cgroup_limit_bytes: l.cgroup_limit_bytes,
        cgroup_source: l.cgroup_source,
        read_gbps,
        read_threads: sweep.threads,
        read_buffer_bytes: sweep.buffer_bytes,
        read_reps: sweep.reps,
    };
    let storage = probe_disk::probe(&disk_options(o, &cpu, o.sizes()), log)?;
    log("asking the CUDA driver for GPUs");
    let gpu = probe_gpu::probe();
    Ok(MachineProfile {
        version: PROFILE_VERSION,
        sluice_version: env!("CARGO_PKG_VERSION").to_string(),
        key,
        probed_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        probe_seconds: sig6(t.elapsed().as_secs_f64()),
        quick: o.quick,
        cpu,
        memory,
        storage,
        gpu,
    })
}

/// `load_or_probe` with explicit options and a progress log.
pub fn load_or_probe_with(
    o: &ProbeOptions,
    refresh: bool,
    log: &dyn Fn(&str),
) -> Result<Loaded, ProbeError> {
    std::fs::create_dir_all(&o.cache_dir)
        .map_err(|e| ProbeError::io(&o.cache_dir, "create directory", e))?;
    let cpu = probe_cpu::probe();
    let key = profile_key(&o.storage_dir, &cpu)?;
    let path = profile_path(&o.cache_dir, &key);
    let cached = if refresh { None } else { read_profile(&path) }
        .filter(|p| p.key == key && p.cpu == cpu && (o.quick || !p.quick));
    let (mut profile, origin) = match cached {
        Some(mut p) => {
            let measured = p.storage.note.is_none() || !p.storage.series.is_empty();
            let missing: Vec<u64> = o
                .sizes()
                .into_iter()
                .filter(|&b| p.storage.direct(b).is_none())
                .collect();
            let busy_then = p.storage.busy_at_probe.filter(|&b| b > BUSY);
            let quiet_now = busy_then
                .and_then(|_| sys::cpu_busy(Duration::from_millis(300)))
                .filter(|&b| b < QUIET);
            if !p.storage.o_direct && measured {
                // O_DIRECT was refused there: nothing more to learn by probing again.
                (p, Origin::Cached)
            } else if let (Some(then), Some(now)) = (busy_then, quiet_now) {
                log(&format!(
                    "the cached disk figures were probed while the machine was {:.0}% busy; it is {:.0}% busy now: probing the disk again",
                    100.0 * then,
                    100.0 * now
                ));
                p.storage = probe_disk::probe(&disk_options(o, &cpu, o.sizes()), log)?;
                (p, Origin::Extended)
            } else if missing.is_empty() {
                (p, Origin::Cached)
            } else {
                log(&format!(
                    "the cached profile lacks {} read size(s); probing them",
                    missing.len()
                ));
                let s = probe_disk::probe(&disk_options(o, &cpu, missing), log)?;
                let mut series = std::mem::take(&mut p.storage.series);
                series.retain(|old| {
                    !s.series
                        .iter()
                        .any(|n| n.mode == old.mode && n.block_bytes == old.block_bytes)
                });
                series.extend(s.series.iter().cloned());
                series.sort_by_key(|s| (s.block_bytes, s.mode == ReadMode::Buffered));
                let earlier = p.storage.data.take();
                p.storage = StorageInfo { series, ..s };
                if earlier.is_some() && earlier != p.storage.data {
                    let now = p.storage.data.take().unwrap_or_default();
                    p.storage.data = Some(format!(
                        "{now}; sizes probed earlier: {}",
                        earlier.unwrap_or_default()
                    ));
                }
                (p, Origin::Extended)
            }
        }
        None => (probe(o, log)?, Origin::Probed),
    };
    let save_error = if origin == Origin::Cached {
        None
    } else {
        write_profile(&path, &profile).err().map(|e| e.to_string())
    };
    profile.refresh_volatile();
    Ok(Loaded {
        profile,
        path,
        origin,
        save_error,
    })
}
