//! Memory: how much there is (/proc/meminfo), how much this process may use (the memory
//! cgroup, v1 or v2, walked up to the root; RLIMIT_MEMLOCK for pinning), and how fast it reads
//! (a multi-threaded read-only sweep over a buffer much larger than the last-level cache —
//! `bench::kernels::parallel_read_sweep`, the same sweep `sluice bench --kernels` uses as its
//! ceiling).
//!
//! Owns: those readings and the sweep's sizing. Does not own: the sweep loop (bench/).
//! Invariant: the limits are re-read on every `limits()` call (they change while a machine runs);
//! only the bandwidth is a measurement worth caching.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::sys;

/// Memory sizes, limits and read bandwidth.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryInfo {
    /// MemTotal, bytes.
    pub total_bytes: u64,
    /// MemAvailable when the profile was loaded (volatile: refreshed on every load), bytes.
    pub available_bytes: u64,
    /// RLIMIT_MEMLOCK soft limit, bytes; `None` = unlimited (volatile).
    pub memlock_limit_bytes: Option<u64>,
    /// The tightest memory-cgroup limit over this process's cgroup and its ancestors, bytes;
    /// `None` = no limit found. It counts the page cache too (volatile).
    pub cgroup_limit_bytes: Option<u64>,
    /// The file that set `cgroup_limit_bytes`, or the hierarchy that was checked.
    pub cgroup_source: Option<String>,
    /// Read-only sweep bandwidth, GB/s (1e9 bytes/s), median over `read_reps`.
    pub read_gbps: Option<f64>,
    pub read_threads: usize,
    pub read_buffer_bytes: u64,
    pub read_reps: usize,
}

impl MemoryInfo {
    /// The RAM this process can fill: MemTotal capped by the cgroup limit.
    pub fn usable_bytes(&self) -> u64 {
        self.cgroup_limit_bytes
            .map_or(self.total_bytes, |c| c.min(self.total_bytes))
    }
}

/// The volatile part: sizes and limits as of now.
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    pub total_bytes: u64,
    pub available_bytes: u64,
    pub memlock_limit_bytes: Option<u64>,
    pub cgroup_limit_bytes: Option<u64>,
    pub cgroup_source: Option<String>,
}

/// Fields of /proc/meminfo (kB) as bytes: (MemTotal, MemAvailable).
pub fn parse_meminfo(text: &str) -> (Option<u64>, Option<u64>) {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            let kb: u64 = rest.split_whitespace().next()?.parse().ok()?;
            kb.checked_mul(1024)
        })
    };
    (field("MemTotal"), field("MemAvailable"))
}

/// This process's resident set now (`/proc/self/statm`), bytes; None where it cannot be read.
pub fn process_rss() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = text.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages.checked_mul(u64::try_from(page).ok().filter(|p| *p > 0)?)
}

pub fn limits() -> Limits {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let (total, avail) = parse_meminfo(&text);
    let total = total.unwrap_or(0);
    let (cg, src) = match cgroup_limit() {
        Some((l, s)) => (l, Some(s)),
        None => (None, None),
    };
    Limits {
        total_bytes: total,
        available_bytes: avail.unwrap_or(total),
        memlock_limit_bytes: sys::memlock_limit().unwrap_or(None),
        cgroup_limit_bytes: cg,
        cgroup_source: src,
    }
}

/// Values at or above this are "no limit" (cgroup v1 writes PAGE_COUNTER_MAX * page size).
const NO_LIMIT: u64 = 1 << 60;

/// Where the cgroup hierarchies are mounted: (v2 mount, v1 memory-controller mount).
fn cgroup_mounts() -> (Option<PathBuf>, Option<PathBuf>) {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let (mut v2, mut v1) = (None, None);
    for m in super::probe_disk::parse_mountinfo(&text) {
        if m.fs_type == "cgroup2" && v2.is_none() {
            v2 = Some(PathBuf::from(&m.mount_point));
        } else if m.fs_type == "cgroup" && m.super_options.split(',').any(|o| o == "memory") {
            v1 = Some(PathBuf::from(&m.mount_point));
        }
    }
    (v2, v1)
}

/// The tightest memory limit for this process: `(limit, source)`; `limit` is `None` when the
/// hierarchy was found but sets no limit. `None` when no memory cgroup is visible at all.
fn cgroup_limit() -> Option<(Option<u64>, String)> {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let (v2, v1) = cgroup_mounts();
    let mut checked = None;
    let mut best: Option<(u64, String)> = None;
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let (mount, file) = if id == "0" && ctrls.is_empty() {
            match &v2 {
                Some(m) => (m, "memory.max"),
                None => continue,
            }
        } else if ctrls.split(',').any(|c| c == "memory") {
            match &v1 {
                Some(m) => (m, "memory.limit_in_bytes"),
                None => continue,
            }
        } else {
            continue;
        };
        checked.get_or_insert_with(|| format!("{} ({file})", mount.display()));
        if let Some((l, src)) = walk_up(mount, path, file) {
            if best.as_ref().is_none_or(|(b, _)| l < *b) {
                best = Some((l, src));
            }
        }
    }
    match best {
        Some((l, s)) => Some((Some(l), s)),
        None => checked.map(|c| (None, c)),
    }
}

/// The smallest limit in `file` from `mount/path` up to `mount`.
fn walk_up(mount: &Path, path: &str, file: &str) -> Option<(u64, String)> {
    let mut dir = mount.join(path.trim_start_matches('/'));
    let mut best: Option<(u64, String)> = None;
    loop {
        let f = dir.join(file);
        if let Ok(s) = std::fs::read_to_string(&f) {
            if let Ok(v) = s.trim().parse::<u64>() {
                if v < NO_LIMIT && best.as_ref().is_none_or(|(b, _)| v < *b) {
                    best = Some((v, f.display().to_string()));
                }
            }
        }
        if dir == mount || !dir.pop() || !dir.starts_with(mount) {
            break;
        }
    }
    best
}

/// How to size the bandwidth sweep.
#[derive(Clone, Debug)]
pub struct SweepOptions {
    pub threads: usize,
    pub buffer_bytes: u64,
    pub reps: usize,
}

impl SweepOptions {
    /// All cores, a buffer of 8x the last-level cache (at least 512 MiB, at most 2 GiB and a
    /// quarter of available memory), 5 timed repetitions. `quick`: 128 MiB, 3 repetitions.
    pub fn auto(cpu: &super::CpuInfo, available: u64, quick: bool) -> SweepOptions {
        let want: u64 = if quick {
            128 << 20
        } else {
            cpu.llc_bytes
                .unwrap_or(0)
                .saturating_mul(8)
                .clamp(512 << 20, 2 << 30)
        };
        SweepOptions {
            threads: cpu.logical_cores.max(1),
            buffer_bytes: want.min(available / 4).max(16 << 20),
            reps: if quick { 3 } else { 5 },
        }
    }
}

/// Read bandwidth in GB/s: one warm-up sweep, then the median of `reps` timed sweeps.
pub fn read_bandwidth(o: &SweepOptions) -> Result<f64, String> {
    let n = usize::try_from(o.buffer_bytes)
        .map_err(|_| "buffer too large for this machine".to_string())?;
    let mut buf = Vec::new();
    buf.try_reserve_exact(n)
        .map_err(|_| format!("cannot allocate {} MiB for the sweep", n >> 20))?;
    buf.resize(n, 1u8);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(o.threads.max(1))
        .build()
        .map_err(|e| format!("cannot start {} threads: {e}", o.threads))?;
    let mut sink = crate::bench::kernels::parallel_read_sweep(&buf, &pool, 0);
    let mut v = Vec::with_capacity(o.reps);
    for _ in 0..o.reps.max(1) {
        let t = Instant::now();
        sink ^= crate::bench::kernels::parallel_read_sweep(&buf, &pool, 0);
        let s = t.elapsed().as_secs_f64();
        if s > 0.0 {
            v.push(n as f64 / s / 1e9);
        }
    }
    std::hint::black_box(sink);
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2)
        .copied()
        .ok_or_else(|| "the sweep took no measurable time".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_fields() {
        let t = "MemTotal:       24683584 kB\nMemFree:        16068680 kB\nMemAvailable:   23741212 kB\n";
        assert_eq!(
            parse_meminfo(t),
            (Some(24683584 * 1024), Some(23741212 * 1024))
        );
        assert_eq!(parse_meminfo("junk"), (None, None));
    }

    #[test]
    fn limits_are_plausible() {
        let l = limits();
        assert!(l.total_bytes > 0 && l.available_bytes <= l.total_bytes);
    }
}
