//! `sluice doctor [MODEL] [--json] [--refresh] [--deep] [--quick]`: check a model's files and
//! print this machine's profile (`sluice::plan::MachineProfile`), probing it when the cache
//! holds none for this device.

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;
use std::io::IsTerminal;
use std::path::PathBuf;

use crate::format::ModelFiles;
use crate::plan::doctor::{check_model, deep_check, ModelReport};
use crate::plan::{load_or_probe_with, MachineProfile, Origin, ProbeOptions, ReadMode};

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// A model (.gguf file, safetensors file or directory): check it and probe the storage it is
    /// on at its expert size. Without it: the cache directory's storage.
    pub model: Option<PathBuf>,
    /// Print JSON (the profile, and the model report) instead of text.
    #[arg(long)]
    pub json: bool,
    /// Probe again even if a cached profile fits.
    #[arg(long)]
    pub refresh: bool,
    /// Also read every tensor and checksum it (FNV-1a 64, per tensor and per file); tensors
    /// that cannot be read or hold NaN/inf floats are reported by name and fail the command.
    #[arg(long)]
    pub deep: bool,
    /// A fast, rough probe (64 MiB probe file, 50 ms per point, 128 MiB memory sweep). Such a
    /// profile is cached but not reused by a normal run.
    #[arg(long)]
    pub quick: bool,
}

/// The `--json` document.
#[derive(Serialize)]
struct Report<'a> {
    profile_path: String,
    origin: Origin,
    save_error: Option<&'a str>,
    profile: &'a MachineProfile,
    model: Option<&'a ModelReport>,
}

pub fn run(args: DoctorArgs) -> anyhow::Result<()> {
    let model = match &args.model {
        Some(p) => Some(ModelFiles::open(p)?),
        None => None,
    };
    if args.deep && model.is_none() {
        bail!("doctor: --deep checksums a model's tensors; name the MODEL");
    }
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let show = std::io::stderr().is_terminal();
    let log = |s: &str| {
        if show {
            eprintln!("doctor: {s}");
        }
    };
    let mut report = match &model {
        Some(m) => Some(check_model(m)?),
        None => None,
    };
    if let (Some(m), Some(r), true) = (&model, report.as_mut(), args.deep) {
        log(&format!(
            "checksumming {} tensors with {threads} threads",
            m.tensors().len()
        ));
        r.deep = Some(deep_check(m, threads)?);
    }
    let mut opts = match &model {
        Some(m) => ProbeOptions::for_model(m),
        None => ProbeOptions::for_cache_dir(),
    };
    opts.quick = args.quick;
    let loaded =
        load_or_probe_with(&opts, args.refresh, &log).context("doctor: probing the machine")?;

    if args.json {
        let doc = Report {
            profile_path: loaded.path.display().to_string(),
            origin: loaded.origin,
            save_error: loaded.save_error.as_deref(),
            profile: &loaded.profile,
            model: report.as_ref(),
        };
        emit(&(serde_json::to_string_pretty(&doc).context("serialising the report")? + "\n"))?;
    } else {
        let o = &mut Out(String::new());
        if let Some(r) = &report {
            print_model(o, r);
        }
        let how = match loaded.origin {
            Origin::Cached => "cached".to_string(),
            Origin::Extended => "cached, new read sizes probed now".to_string(),
            Origin::Probed => format!("probed now in {:.1} s", loaded.profile.probe_seconds),
        };
        o.line("profile", format!("{} ({how})", loaded.path.display()));
        if let Some(e) = &loaded.save_error {
            o.line("profile not saved", e.clone());
        }
        print_profile(o, &loaded.profile);
        emit(&o.0)?;
    }
    if let Some(d) = report.as_ref().and_then(|r| r.deep.as_ref()) {
        if !d.bad.is_empty() {
            let list: Vec<String> = d
                .bad
                .iter()
                .take(8)
                .map(|b| format!("`{}` ({})", b.name, b.reason))
                .collect();
            bail!(
                "{}: {} of {} tensors bad: {}{}",
                report.as_ref().map_or("", |r| r.path.as_str()),
                d.bad.len(),
                d.tensors.len(),
                list.join(", "),
                if d.bad.len() > 8 { ", ..." } else { "" }
            );
        }
    }
    Ok(())
}

const W: usize = 22;

/// The text report, written to stdout at the end in one go.
struct Out(String);

impl Out {
    fn line(&mut self, label: &str, value: impl std::fmt::Display) {
        use std::fmt::Write;
        let _ = writeln!(self.0, "{label:<W$} {value}");
    }
}

/// Write to stdout; a closed pipe (`| head`) is not an error.
fn emit(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut o = std::io::stdout().lock();
    match o.write_all(text.as_bytes()).and_then(|_| o.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e).context("writing to stdout"),
        _ => Ok(()),
    }
}

/// Bytes as KiB/MiB/GiB with one decimal.
pub fn size(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < U.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[u])
    }
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

fn print_model(o: &mut Out, r: &ModelReport) {
    o.line(
        "model",
        format!(
            "{} ({}, {} file(s), {} tensors)",
            r.path,
            r.format,
            r.files.len(),
            r.tensors
        ),
    );
    for c in &r.checks {
        o.line(
            &format!("check {}", c.name),
            format!("{}: {}", c.status, c.detail),
        );
    }
    if let Some(d) = &r.deep {
        let gbps = if d.seconds > 0.0 {
            d.bytes as f64 / d.seconds / 1e9
        } else {
            0.0
        };
        o.line(
            "deep",
            format!(
                "{} of {} tensors, {} in {:.2} s ({gbps:.2} GB/s, {} threads)",
                d.algorithm,
                d.tensors.len(),
                size(d.bytes),
                d.seconds,
                d.threads
            ),
        );
        for f in &d.files {
            o.line(
                "deep file",
                format!(
                    "{}: {} tensors, {}, {} {}",
                    f.path,
                    f.tensors,
                    size(f.bytes),
                    d.algorithm,
                    f.fnv1a64
                ),
            );
        }
        for b in &d.bad {
            o.line(
                "deep BAD",
                format!("`{}` in {}: {}", b.name, b.path, b.reason),
            );
        }
        if d.bad.is_empty() {
            o.line(
                "deep result",
                format!(
                    "ok: all {} tensors read, no NaN/inf in float tensors",
                    d.tensors.len()
                ),
            );
        }
    }
}

fn print_profile(o: &mut Out, p: &MachineProfile) {
    let c = &p.cpu;
    o.line("cpu", c.model.as_deref().unwrap_or("unknown"));
    o.line(
        "cores",
        format!(
            "{} logical, {} physical",
            c.logical_cores,
            c.physical_cores
                .map_or("unknown".to_string(), |n| n.to_string())
        ),
    );
    o.line(
        "simd",
        format!(
            "avx2 {}, avx512 {}, avx512-vnni {}; kernels use {}",
            yes(c.avx2),
            yes(c.avx512),
            yes(c.avx512_vnni),
            c.kernel_isa
        ),
    );
    o.line(
        "last-level cache",
        c.llc_bytes.map_or("unknown".to_string(), size),
    );

    let m = &p.memory;
    o.line("ram total", size(m.total_bytes));
    o.line("ram available", size(m.available_bytes));
    o.line(
        "mlock limit",
        m.memlock_limit_bytes.map_or("unlimited".to_string(), size),
    );
    o.line(
        "cgroup memory limit",
        match (m.cgroup_limit_bytes, &m.cgroup_source) {
            (Some(l), Some(s)) => format!("{} ({s}; counts page cache)", size(l)),
            (Some(l), None) => size(l),
            (None, Some(s)) => format!("none ({s})"),
            (None, None) => "none (no memory cgroup visible)".to_string(),
        },
    );
    o.line(
        "memory read",
        match m.read_gbps {
            Some(g) => format!(
                "{g:.2} GB/s ({} threads, {} buffer, median of {})",
                m.read_threads,
                size(m.read_buffer_bytes),
                m.read_reps
            ),
            None => "not measured (the sweep buffer could not be allocated)".to_string(),
        },
    );

    let s = &p.storage;
    o.line("storage", &s.dir);
    o.line(
        "filesystem",
        format!(
            "{} on {} (dev {}{}), {} free",
            s.fs_type.as_deref().unwrap_or("?"),
            s.source.as_deref().unwrap_or("?"),
            s.dev,
            s.block_device
                .as_ref()
                .map_or(String::new(), |b| format!(", block device {b}")),
            s.free_bytes.map_or("?".to_string(), size)
        ),
    );
    o.line(
        "read-ahead",
        s.read_ahead_kb
            .map_or("unknown (no block device queue found)".to_string(), |k| {
                format!("{k} KiB")
            }),
    );
    o.line(
        "O_DIRECT",
        format!(
            "{}; data read: {}",
            yes(s.o_direct),
            s.data.as_deref().unwrap_or("none")
        ),
    );
    for series in &s.series {
        let mode = match series.mode {
            ReadMode::Direct => "direct",
            ReadMode::Buffered => "buffered",
        };
        for pt in &series.points {
            let amp = match pt.device_read_bytes {
                Some(d) if series.mode == ReadMode::Buffered && pt.reads > 0 => {
                    format!(
                        "   device read {:.1}x the bytes asked (whole device)",
                        d as f64 / (pt.reads * series.block_bytes) as f64
                    )
                }
                _ => String::new(),
            };
            o.line(
                &format!("{mode} {} x{}", size(series.block_bytes), pt.threads),
                format!("{:>7.2} GB/s {:>9.0} IOPS{amp}", pt.gbps, pt.iops),
            );
        }
        if let Some(a) = &series.advice {
            o.line(&format!("{mode} {} advice", size(series.block_bytes)), a);
        }
    }
    match s
        .series
        .iter()
        .filter(|x| x.mode == ReadMode::Direct)
        .filter_map(|x| Some((x, x.best()?)))
        .max_by(|a, b| a.1.gbps.total_cmp(&b.1.gbps))
    {
        Some((x, b)) => o.line(
            "disk ceiling",
            format!(
                "{:.2} GB/s (O_DIRECT, {} reads, {} reader thread(s))",
                b.gbps,
                size(x.block_bytes),
                b.threads
            ),
        ),
        None => o.line(
            "disk ceiling",
            "not measured (no O_DIRECT figures; buffered figures are not a ceiling)",
        ),
    }
    if let Some(n) = &s.note {
        o.line("storage note", n);
    }

    let g = &p.gpu;
    if g.devices.is_empty() {
        o.line(
            "gpu",
            format!("none ({})", g.note.as_deref().unwrap_or("no device")),
        );
    } else {
        o.line(
            "gpu driver",
            format!(
                "{} (CUDA {})",
                g.driver.as_deref().unwrap_or("?"),
                g.driver_version.as_deref().unwrap_or("?")
            ),
        );
        for d in &g.devices {
            o.line(
                &format!("gpu {}", d.index),
                format!("{}, {} VRAM", d.name, size(d.vram_bytes)),
            );
        }
        match &g.h2d {
            Some(r) => {
                o.line(
                    "h2d pinned",
                    format!(
                        "{:.2} GB/s ({} copies x{} into gpu {})",
                        r.pinned_gbps,
                        size(r.bytes),
                        r.copies,
                        r.device
                    ),
                );
                o.line(
                    "h2d pageable",
                    r.pageable_gbps.map_or("not measured".to_string(), |v| {
                        format!("{v:.2} GB/s (for contrast)")
                    }),
                );
            }
            None => o.line(
                "h2d",
                format!("not measured ({})", g.note.as_deref().unwrap_or("?")),
            ),
        }
    }
}
