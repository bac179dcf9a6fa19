//! What the CPU is: model name, logical and physical cores, SIMD, last-level cache.
//!
//! Owns: reading /proc/cpuinfo and /sys/devices/system/cpu. Does not own: choosing kernels
//! (`kernels::Isa`), which this reports as-is. Invariant: nothing here measures; every field is
//! what the OS says, `None` when it says nothing.

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

use crate::kernels::Isa;

/// The CPU as the OS describes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CpuInfo {
    /// /proc/cpuinfo `model name`.
    pub model: Option<String>,
    /// Threads this process may run at once (affinity and CPU quota respected).
    pub logical_cores: usize,
    /// Distinct (package, core) pairs.
    pub physical_cores: Option<usize>,
    pub avx2: bool,
    pub avx512: bool,
    /// AVX-512 VNNI (int8 dot products in 512-bit registers).
    pub avx512_vnni: bool,
    /// The instruction set sluice's kernels pick on this CPU (`Isa::hardware()`).
    pub kernel_isa: String,
    /// Last-level (L3, else L2) cache of cpu0, bytes.
    pub llc_bytes: Option<u64>,
}

pub fn probe() -> CpuInfo {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let (avx2, avx512, vnni) = simd();
    CpuInfo {
        model: crate::bench::kernels::cpu_model(),
        logical_cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        physical_cores: physical_from_cpuinfo(&info).or_else(physical_from_sysfs),
        avx2,
        avx512,
        avx512_vnni: vnni,
        kernel_isa: Isa::hardware().name().to_string(),
        llc_bytes: last_level_cache(),
    }
}

#[cfg(target_arch = "x86_64")]
fn simd() -> (bool, bool, bool) {
    (
        is_x86_feature_detected!("avx2"),
        is_x86_feature_detected!("avx512f"),
        is_x86_feature_detected!("avx512vnni"),
    )
}

#[cfg(not(target_arch = "x86_64"))]
fn simd() -> (bool, bool, bool) {
    (false, false, false)
}

/// Count distinct (`physical id`, `core id`) pairs in /proc/cpuinfo text.
pub fn physical_from_cpuinfo(text: &str) -> Option<usize> {
    let mut cores = BTreeSet::new();
    let (mut pkg, mut core) = (None, None);
    let mut flush = |pkg: &mut Option<String>, core: &mut Option<String>| {
        if let Some(c) = core.take() {
            cores.insert((pkg.take().unwrap_or_default(), c));
        }
        *pkg = None;
    };
    for line in text.lines() {
        if line.trim().is_empty() {
            flush(&mut pkg, &mut core);
            continue;
        }
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        match k.trim() {
            "physical id" => pkg = Some(v.trim().to_string()),
            "core id" => core = Some(v.trim().to_string()),
            _ => {}
        }
    }
    flush(&mut pkg, &mut core);
    (!cores.is_empty()).then_some(cores.len())
}

fn physical_from_sysfs() -> Option<usize> {
    let mut cores = BTreeSet::new();
    for e in std::fs::read_dir("/sys/devices/system/cpu").ok()?.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !name.starts_with("cpu")
            || !name[3..].bytes().all(|b| b.is_ascii_digit())
            || name.len() == 3
        {
            continue;
        }
        let t = e.path().join("topology");
        let read = |f: &str| {
            std::fs::read_to_string(t.join(f))
                .ok()
                .map(|s| s.trim().to_string())
        };
        if let (Some(p), Some(c)) = (read("physical_package_id"), read("core_id")) {
            cores.insert((p, c));
        }
    }
    (!cores.is_empty()).then_some(cores.len())
}

/// Parse a sysfs cache size such as `32768K` or `2M`.
pub fn parse_cache_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mul) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1u64 << 10),
        b'M' => (&s[..s.len() - 1], 1 << 20),
        b'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mul)
}

fn last_level_cache() -> Option<u64> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    let mut best: Option<(u32, u64)> = None;
    for e in dir.flatten() {
        let p = e.path();
        let level = std::fs::read_to_string(p.join("level"))
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok());
        let kind = std::fs::read_to_string(p.join("type")).unwrap_or_default();
        let size = std::fs::read_to_string(p.join("size"))
            .ok()
            .and_then(|s| parse_cache_size(&s));
        if let (Some(l), Some(sz)) = (level, size) {
            if kind.trim() != "Instruction" && best.is_none_or(|(bl, _)| l > bl) {
                best = Some((l, sz));
            }
        }
    }
    best.map(|(_, s)| s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_cores_not_threads() {
        let text = "processor\t: 0\nphysical id\t: 0\ncore id\t: 0\n\nprocessor\t: 1\nphysical id\t: 0\ncore id\t: 0\n\n\
                    processor\t: 2\nphysical id\t: 0\ncore id\t: 1\n\nprocessor\t: 3\nphysical id\t: 1\ncore id\t: 0\n";
        assert_eq!(physical_from_cpuinfo(text), Some(3));
        assert_eq!(physical_from_cpuinfo("processor : 0\n"), None);
    }

    #[test]
    fn cache_sizes() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("2M"), Some(2 << 20));
        assert_eq!(parse_cache_size("x"), None);
    }
}
