//! Storage: what filesystem and block device hold a directory, and how fast random reads of a
//! given size come off it with 1, 2, 4, ... reader threads.
//!
//! Method. The ceiling is O_DIRECT random reads (4 KiB-aligned offsets, whole blocks, each
//! thread `pread`ing into its own aligned buffer for a fixed time) of data that is not in the
//! page cache: either the model's largest file, when it is at least as large as a probe file
//! would be and opens with O_DIRECT (O_DIRECT bypasses the page cache, so its cached pages do
//! not count), or a probe file of pseudo-random bytes written here with O_DIRECT (or written,
//! synced and dropped with POSIX_FADV_DONTNEED where O_DIRECT is refused). The probe file is
//! removed when the probe ends, on error, and on SIGINT/SIGTERM/SIGHUP; files of dead earlier
//! runs are removed on the next. Buffered random reads of the same data are measured for
//! contrast — after dropping the file's clean, unmapped pages (a model file's too), with the
//! kernel's read-ahead as the advice says —
//! and report how many bytes the device read meanwhile (`/sys/dev/block/M:m/stat`), which shows
//! read-ahead amplification. They are never a ceiling.
//!
//! Owns: the probe file's life, the reader threads, mountinfo parsing, read-ahead lookup.
//! Does not own: the profile's caching (mod.rs). Invariant: the probe file never outlives the
//! probe, and a direct figure only ever comes from O_DIRECT reads.

use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use super::sys::{self, Advice, RemoveOnSignal};
use super::{sig6, ProbeError};

/// O_DIRECT offset, length and buffer alignment used here (covers 512 B and 4 KiB sectors).
pub const ALIGN: u64 = 4096;
/// Name prefix of probe files (`.sluice-probe-<pid>.tmp`).
pub const PROBE_PREFIX: &str = ".sluice-probe-";

/// How reads were issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReadMode {
    /// O_DIRECT: no page cache, no read-ahead. The only mode a ceiling comes from.
    Direct,
    /// Through the page cache, after dropping the file's pages.
    Buffered,
}

/// One measurement: `threads` readers for about `seconds`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReadPoint {
    pub threads: usize,
    /// Bytes delivered to the readers per second, 1e9.
    pub gbps: f64,
    /// Reads completed per second.
    pub iops: f64,
    pub reads: u64,
    pub seconds: f64,
    /// Bytes the block device read during the measurement (all processes), when its stat file
    /// is readable: more than `reads * block` means read-ahead (or someone else) read extra.
    pub device_read_bytes: Option<u64>,
}

/// Random reads of one size in one mode, over increasing thread counts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReadSeries {
    pub mode: ReadMode,
    pub block_bytes: u64,
    /// The page-cache advice in force (buffered reads only).
    pub advice: Option<String>,
    pub points: Vec<ReadPoint>,
}

impl ReadSeries {
    /// The point with the most GB/s.
    pub fn best(&self) -> Option<&ReadPoint> {
        self.points.iter().max_by(|a, b| a.gbps.total_cmp(&b.gbps))
    }
}

/// The storage that holds a directory, and its measured random-read figures.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StorageInfo {
    /// The directory probed (the model's, or the cache directory).
    pub dir: String,
    pub fs_type: Option<String>,
    pub mount_point: Option<String>,
    /// What is mounted (`/dev/vda`, `overlay`, ...).
    pub source: Option<String>,
    /// The filesystem's device number, `major:minor`.
    pub dev: String,
    /// The block device whose queue serves it (`vda`, `nvme0n1`), when found.
    pub block_device: Option<String>,
    /// That queue's `read_ahead_kb`.
    pub read_ahead_kb: Option<u64>,
    /// Free bytes for an unprivileged user (volatile: refreshed on every load).
    pub free_bytes: Option<u64>,
    /// Whether a file here opens and reads with O_DIRECT.
    pub o_direct: bool,
    /// What was read: "probe file, N MiB" or "model file PATH".
    pub data: Option<String>,
    pub data_bytes: u64,
    pub series: Vec<ReadSeries>,
    /// Why something was not measured.
    pub note: Option<String>,
    /// Share of all cores' time that was busy (other work) just before the reads were
    /// measured (`/proc/stat` over a short window): a busy machine gives low figures, so a
    /// profile probed busy is probed again once the machine is quiet (`plan::busy_reprobe`).
    #[serde(default)]
    pub busy_at_probe: Option<f64>,
    /// Figures raised since the probe because a run read faster (see
    /// `MachineProfile::check_run_reads`), as a note.
    #[serde(default)]
    pub raised_by_run: Option<String>,
}

impl StorageInfo {
    /// The O_DIRECT series measured at exactly `block_bytes`.
    pub fn direct(&self, block_bytes: u64) -> Option<&ReadSeries> {
        self.series
            .iter()
            .find(|s| s.mode == ReadMode::Direct && s.block_bytes == block_bytes)
    }

    /// The O_DIRECT series whose block size is nearest `block_bytes` (by ratio): what a
    /// planner uses for a read size that was not probed.
    pub fn nearest_direct(&self, block_bytes: u64) -> Option<&ReadSeries> {
        let dist = |s: &ReadSeries| {
            ((s.block_bytes.max(1) as f64) / (block_bytes.max(1) as f64))
                .ln()
                .abs()
        };
        self.series
            .iter()
            .filter(|s| s.mode == ReadMode::Direct)
            .min_by(|a, b| dist(a).total_cmp(&dist(b)))
    }
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct DiskProbeOptions {
    /// Directory whose filesystem to probe (the probe file is written here).
    pub dir: PathBuf,
    /// Read this file instead of writing a probe file, if it is at least `file_bytes` long and
    /// opens with O_DIRECT.
    pub model_file: Option<PathBuf>,
    /// Read sizes (rounded up to `ALIGN`).
    pub block_sizes: Vec<u64>,
    /// Reader-thread counts, one point each.
    pub threads: Vec<usize>,
    /// Probe file size; `None`: 2 GiB, or an eighth of the free space if less (at least 64 MiB).
    pub file_bytes: Option<u64>,
    /// Time per point.
    pub point: Duration,
    /// Also measure buffered reads for contrast.
    pub buffered: bool,
}

/// 1, 2, 4, ... up to twice `cores` (twice `cores` itself included).
pub fn thread_ladder(cores: usize) -> Vec<usize> {
    let top = cores.max(1) * 2;
    let mut v = Vec::new();
    let mut t = 1;
    while t < top {
        v.push(t);
        t *= 2;
    }
    v.push(top);
    v
}

/// One line of /proc/self/mountinfo.
#[derive(Clone, Debug, PartialEq)]
pub struct Mount {
    pub dev: String,
    pub mount_point: String,
    pub fs_type: String,
    pub source: String,
    pub super_options: String,
}

/// Undo mountinfo's octal escapes (`\040` for a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parse /proc/self/mountinfo (lines that do not parse are skipped).
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let f: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            Some(Mount {
                dev: f.get(2)?.to_string(),
                mount_point: unescape(f.get(4)?),
                fs_type: r.first()?.to_string(),
                source: unescape(r.get(1).copied().unwrap_or("")),
                super_options: r.get(2).copied().unwrap_or("").to_string(),
            })
        })
        .collect()
}

/// The mount holding `path` (canonical): the longest mount point that contains it, the last
/// mounted on ties.
pub fn mount_of<'a>(mounts: &'a [Mount], path: &Path) -> Option<&'a Mount> {
    let mut best: Option<&Mount> = None;
    for m in mounts {
        if path.starts_with(&m.mount_point)
            && best.is_none_or(|b| m.mount_point.len() >= b.mount_point.len())
        {
            best = Some(m);
        }
    }
    best
}

/// Linux's `dev_t` split into major and minor.
pub fn dev_major_minor(dev: u64) -> (u64, u64) {
    (
        ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff),
        (dev & 0xff) | ((dev >> 12) & !0xff),
    )
}

/// The block device for `maj:min`: (its sysfs directory, the queue directory). A partition's
/// queue is its parent disk's.
fn block_device(dev: &str) -> Option<(PathBuf, PathBuf)> {
    let d = std::fs::canonicalize(Path::new("/sys/dev/block").join(dev)).ok()?;
    let q = if d.join("partition").exists() {
        d.parent()?.join("queue")
    } else {
        d.join("queue")
    };
    Some((d, q))
}

/// Sectors read so far by a block device, in bytes (field 3 of its `stat` file).
fn device_read_bytes(stat: &Path) -> Option<u64> {
    let s = std::fs::read_to_string(stat).ok()?;
    s.split_whitespace()
        .nth(2)?
        .parse::<u64>()
        .ok()?
        .checked_mul(512)
}

/// Filesystem facts about `dir` (no reads or writes).
pub fn describe(dir: &Path) -> Result<StorageInfo, ProbeError> {
    let canon = std::fs::canonicalize(dir).map_err(|e| ProbeError::io(dir, "resolve", e))?;
    let md = std::fs::metadata(&canon).map_err(|e| ProbeError::io(dir, "stat", e))?;
    let (maj, min) = dev_major_minor(md.dev());
    let mut dev = format!("{maj}:{min}");
    let mounts =
        parse_mountinfo(&std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default());
    let m = mount_of(&mounts, &canon);
    // Some filesystems (btrfs subvolumes, overlay) report an anonymous st_dev; their source
    // device, when it is a block device, has the queue.
    let mut blk = block_device(&dev);
    if blk.is_none() {
        if let Some(src) = m
            .map(|m| m.source.as_str())
            .filter(|s| s.starts_with("/dev/"))
        {
            if let Ok(smd) = std::fs::metadata(src) {
                let (a, b) = dev_major_minor(smd.rdev());
                let d = format!("{a}:{b}");
                if let Some(x) = block_device(&d) {
                    dev = d;
                    blk = Some(x);
                }
            }
        }
    }
    let read_ahead_kb = blk
        .as_ref()
        .and_then(|(_, q)| std::fs::read_to_string(q.join("read_ahead_kb")).ok())
        .and_then(|s| s.trim().parse().ok());
    Ok(StorageInfo {
        dir: canon.display().to_string(),
        fs_type: m.map(|m| m.fs_type.clone()),
        mount_point: m.map(|m| m.mount_point.clone()),
        source: m.map(|m| m.source.clone()),
        dev,
        block_device: blk
            .as_ref()
            .and_then(|(d, _)| d.file_name())
            .map(|n| n.to_string_lossy().into_owned()),
        read_ahead_kb,
        free_bytes: sys::free_bytes(&canon).ok(),
        o_direct: false,
        data: None,
        data_bytes: 0,
        series: Vec::new(),
        note: None,
        busy_at_probe: None,
        raised_by_run: None,
    })
}

/// A buffer of `len` bytes aligned to `ALIGN`, carved out of a slightly larger `Vec`.
struct Aligned {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Result<Aligned, String> {
        let mut raw = Vec::new();
        raw.try_reserve_exact(len + ALIGN as usize)
            .map_err(|_| format!("cannot allocate {len} bytes"))?;
        raw.resize(len + ALIGN as usize, 0);
        let start = raw.as_ptr().align_offset(ALIGN as usize);
        if start + len > raw.len() {
            return Err("cannot align a read buffer".into());
        }
        Ok(Aligned { raw, start, len })
    }

    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }
}

/// xorshift64*: cheap, seeded, good enough for offsets and filler bytes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// The probe file: created, filled, and removed when dropped or on a fatal signal.
struct ProbeFile {
    path: PathBuf,
    _signal: RemoveOnSignal,
}

impl Drop for ProbeFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn open_direct(p: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(p)
}

/// Remove probe files that runs no longer alive left in `dir`.
fn remove_stale(dir: &Path) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(PROBE_PREFIX))
            .and_then(|n| n.strip_suffix(".tmp"))
        else {
            continue;
        };
        if pid.parse::<u32>().is_ok_and(|p| !sys::process_alive(p)) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Write `bytes` of pseudo-random data to a new probe file in `dir`; returns the guard and
/// whether it was written with O_DIRECT.
fn write_probe_file(dir: &Path, bytes: u64) -> Result<(ProbeFile, bool), ProbeError> {
    let path = dir.join(format!("{PROBE_PREFIX}{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let guard = ProbeFile {
        _signal: RemoveOnSignal::new(&path).map_err(|e| ProbeError::io(&path, "register", e))?,
        path,
    };
    let path = guard.path.clone();
    let create = |direct: bool| {
        let mut o = OpenOptions::new();
        o.write(true).create_new(true);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(&path)
    };
    let (mut f, direct) = match create(true) {
        Ok(f) => (f, true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (
            create(false).map_err(|e| ProbeError::io(&path, "create", e))?,
            false,
        ),
        Err(e) => return Err(ProbeError::io(&path, "create", e)),
    };
    const CHUNK: usize = 8 << 20;
    let mut buf = Aligned::new(CHUNK).map_err(ProbeError::Other)?;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ std::process::id() as u64);
    let mut left = bytes;
    while left > 0 {
        let n = (left as usize).min(CHUNK);
        for w in buf.as_mut().chunks_exact_mut(8) {
            w.copy_from_slice(&rng.next().to_le_bytes());
        }
        f.write_all(&buf.as_mut()[..n])
            .map_err(|e| ProbeError::io(&path, "write", e))?;
        left -= n as u64;
    }
    f.sync_all().map_err(|e| ProbeError::io(&path, "sync", e))?;
    if !direct {
        sys::advise(&f, Advice::DontNeed)
            .map_err(|e| ProbeError::io(&path, "drop from the page cache", e))?;
    }
    Ok((guard, direct))
}

/// `threads` readers doing random reads of `block` bytes from `f` (of `len` bytes) for `dur`.
fn measure(
    f: &File,
    len: u64,
    block: u64,
    threads: usize,
    dur: Duration,
    stat: Option<&Path>,
) -> Result<ReadPoint, String> {
    let positions = (len.saturating_sub(block)) / ALIGN + 1;
    if block > len {
        return Err(format!("{block}-byte reads do not fit in {len} bytes"));
    }
    let before = stat.and_then(device_read_bytes);
    let barrier = Barrier::new(threads + 1);
    let start_cell = std::sync::OnceLock::new();
    let results: Vec<Result<(u64, Instant), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let barrier = &barrier;
                let start_cell = &start_cell;
                s.spawn(move || -> Result<(u64, Instant), String> {
                    let buf = Aligned::new(block as usize);
                    let mut rng = Rng(0xD1B5_4A32_D192_ED03 ^ ((t as u64 + 1) << 32) ^ block);
                    // Every thread reaches the barrier, even one whose buffer failed.
                    barrier.wait();
                    let mut buf = buf?;
                    let start: &Instant = start_cell.get_or_init(Instant::now);
                    let deadline = *start + dur;
                    let mut reads = 0u64;
                    loop {
                        let off = (rng.next() % positions) * ALIGN;
                        f.read_exact_at(buf.as_mut(), off)
                            .map_err(|e| format!("read {block} bytes at {off}: {e}"))?;
                        reads += 1;
                        let now = Instant::now();
                        if now >= deadline {
                            return Ok((reads, now));
                        }
                    }
                })
            })
            .collect();
        barrier.wait();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a reader thread panicked".into()))
            })
            .collect()
    });
    let after = stat.and_then(device_read_bytes);
    let start = *start_cell.get().ok_or("no reader started")?;
    let mut reads = 0;
    let mut end = start;
    for r in results {
        let (n, e) = r?;
        reads += n;
        end = end.max(e);
    }
    let secs = (end - start).as_secs_f64().max(1e-9);
    Ok(ReadPoint {
        threads,
        gbps: sig6((reads * block) as f64 / secs / 1e9),
        iops: sig6(reads as f64 / secs),
        reads,
        seconds: sig6(secs),
        device_read_bytes: before.zip(after).map(|(b, a)| a.saturating_sub(b)),
    })
}

/// One O_DIRECT point on an existing file (a model's, read-only): `threads` readers doing
/// random `block`-byte reads for `dur`. For a run that checks the disk it just read from
/// (`run --prof`): the ceiling measured in the same run, not the cached profile's.
pub fn direct_point(
    path: &Path,
    block: u64,
    threads: usize,
    dur: Duration,
) -> Result<ReadPoint, String> {
    let f = open_direct(path).map_err(|e| format!("{}: O_DIRECT open: {e}", path.display()))?;
    let len = f
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    let block = block.max(1).div_ceil(ALIGN) * ALIGN;
    measure(&f, len, block, threads.max(1), dur, None)
}

/// The probe file size when not given: 2 GiB, or an eighth of the free space if less.
pub fn auto_file_bytes(free: Option<u64>) -> u64 {
    let eighth = free.map_or(u64::MAX, |f| f / 8);
    (2u64 << 30).min(eighth) / (8 << 20) * (8 << 20)
}

/// Describe `o.dir`'s storage and measure it (see the module doc). `log` gets one line per step.
pub fn probe(o: &DiskProbeOptions, log: &dyn Fn(&str)) -> Result<StorageInfo, ProbeError> {
    let mut info = describe(&o.dir)?;
    let want = match o.file_bytes {
        Some(b) => b / ALIGN * ALIGN,
        None => auto_file_bytes(info.free_bytes),
    };
    const MIN_FILE: u64 = 1 << 20;
    // Prefer the model's own file when it is big enough and O_DIRECT works on it.
    let model = o.model_file.as_ref().and_then(|p| {
        let len = std::fs::metadata(p).ok()?.len();
        (len >= want.max(MIN_FILE)).then_some(())?;
        let f = open_direct(p).ok()?;
        let mut b = Aligned::new(ALIGN as usize).ok()?;
        f.read_exact_at(b.as_mut(), 0).ok()?;
        Some((p.clone(), f, len))
    });
    let mut _guard = None;
    let (direct, len, label, path) = if let Some((p, f, len)) = model {
        (Some(f), len, format!("model file {}", p.display()), p)
    } else {
        if want < MIN_FILE {
            info.note = Some(format!(
                "not measured: {} has {} MiB free, too little for a probe file",
                info.dir,
                info.free_bytes.unwrap_or(0) >> 20
            ));
            return Ok(info);
        }
        remove_stale(&o.dir);
        log(&format!(
            "writing a {} MiB probe file in {}",
            want >> 20,
            info.dir
        ));
        let (g, wrote_direct) = write_probe_file(&o.dir, want)?;
        let p = g.path.clone();
        _guard = Some(g);
        // Written without O_DIRECT means O_DIRECT is refused here: no direct reads either.
        let f = if wrote_direct {
            open_direct(&p).ok()
        } else {
            None
        };
        (
            f,
            want,
            format!("probe file, {} MiB, removed after", want >> 20),
            p,
        )
    };
    info.o_direct = direct.is_some();
    info.data = Some(label);
    info.data_bytes = len;
    let stat = info
        .block_device
        .as_ref()
        .and_then(|_| block_device(&info.dev))
        .map(|(d, _)| d.join("stat"));
    let mut sizes: Vec<u64> = o
        .block_sizes
        .iter()
        .map(|&b| b.max(1).div_ceil(ALIGN) * ALIGN)
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut skipped = Vec::new();
    info.busy_at_probe = sys::cpu_busy(Duration::from_millis(300)).map(sig6);
    if let Some(b) = info.busy_at_probe.filter(|&b| b > super::BUSY) {
        log(&format!(
            "the machine is {:.0}% busy: read figures may come out low (probed again once quiet)",
            100.0 * b
        ));
    }
    let point = |f: &File, block: u64, t: usize| {
        measure(f, len, block, t, o.point, stat.as_deref()).map_err(|m| ProbeError::Read {
            path: path.clone(),
            msg: m,
        })
    };
    for &block in &sizes {
        if block * 2 > len {
            skipped.push(block);
            continue;
        }
        if let Some(f) = &direct {
            log(&format!("O_DIRECT random reads of {} KiB", block >> 10));
            let mut s = ReadSeries {
                mode: ReadMode::Direct,
                block_bytes: block,
                advice: None,
                points: Vec::new(),
            };
            for &t in &o.threads {
                s.points.push(point(f, block, t)?);
            }
            // One more measurement at the best thread count, keeping the better: a point
            // taken while something else used the disk or the CPU is not the ceiling.
            if let Some(i) =
                (0..s.points.len()).max_by(|&a, &b| s.points[a].gbps.total_cmp(&s.points[b].gbps))
            {
                let again = point(f, block, s.points[i].threads)?;
                if again.gbps > s.points[i].gbps {
                    s.points[i] = again;
                }
            }
            info.series.push(s);
        }
        if o.buffered {
            log(&format!("buffered random reads of {} KiB", block >> 10));
            let f = File::open(&path).map_err(|e| ProbeError::io(&path, "open", e))?;
            let mut s = ReadSeries {
                mode: ReadMode::Buffered,
                block_bytes: block,
                advice: Some(format!(
                    "{} after {} of the file",
                    Advice::Normal.name(),
                    Advice::DontNeed.name()
                )),
                points: Vec::new(),
            };
            for &t in &o.threads {
                sys::advise(&f, Advice::DontNeed)
                    .map_err(|e| ProbeError::io(&path, "drop from the page cache", e))?;
                sys::advise(&f, Advice::Normal).map_err(|e| ProbeError::io(&path, "advise", e))?;
                s.points.push(point(&f, block, t)?);
            }
            sys::advise(&f, Advice::DontNeed)
                .map_err(|e| ProbeError::io(&path, "drop from the page cache", e))?;
            info.series.push(s);
        }
    }
    let mut notes = Vec::new();
    if direct.is_none() {
        notes.push(format!(
            "O_DIRECT is refused on this filesystem ({}): no ceiling measured",
            info.fs_type.as_deref().unwrap_or("?")
        ));
    }
    if !skipped.is_empty() {
        let list: Vec<String> = skipped.iter().map(|b| format!("{} KiB", b >> 10)).collect();
        notes.push(format!(
            "{} not measured: larger than half the {} MiB of data",
            list.join(", "),
            len >> 20
        ));
    }
    if !notes.is_empty() {
        info.note = Some(notes.join("; "));
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ladder() {
        assert_eq!(thread_ladder(2), vec![1, 2, 4]);
        assert_eq!(thread_ladder(3), vec![1, 2, 4, 6]);
        assert_eq!(thread_ladder(16), vec![1, 2, 4, 8, 16, 32]);
        assert_eq!(thread_ladder(0), vec![1, 2]);
    }

    #[test]
    fn mountinfo() {
        let t = "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard\n\
                 35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
                 50 27 0:40 / /mnt/my\\040disk rw shared:1 - xfs /dev/nvme0n1p1 rw\n";
        let m = parse_mountinfo(t);
        assert_eq!(m.len(), 3);
        assert_eq!(m[2].mount_point, "/mnt/my disk");
        assert_eq!(m[2].fs_type, "xfs");
        assert_eq!(
            mount_of(&m, Path::new("/mnt/my disk/models")).map(|m| m.dev.as_str()),
            Some("0:40")
        );
        assert_eq!(
            mount_of(&m, Path::new("/root")).map(|m| m.source.as_str()),
            Some("/dev/vda")
        );
    }

    #[test]
    fn dev_numbers() {
        assert_eq!(dev_major_minor(0xfe00), (254, 0));
        assert_eq!(dev_major_minor((259 << 8) | 3), (259, 3));
    }

    #[test]
    fn file_size() {
        assert_eq!(auto_file_bytes(None), 2 << 30);
        assert_eq!(auto_file_bytes(Some(800 << 20)), 96 << 20);
    }
}
