//! Benchmark, not a test (ignored by default; asserts only correctness of what it reads):
//! expert read GB/s through `ExpertCache` (O_DIRECT, N readers, read chunk C) against a plain
//! single-threaded O_DIRECT `pread` loop over the same expert windows.
//!
//! Run: `SLUICE_BENCH_GB=1.5 cargo test --release --test experts_bench -- --ignored --nocapture`
//! It writes a temporary file of that size under CARGO_TARGET_TMPDIR (or $SLUICE_BENCH_DIR)
//! and deletes it after; SLUICE_BENCH_PASSES sets how often each layer is swept (default 24).

mod experts_util;

use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::time::Instant;

use experts_util::{r, scratch, Rng};
use sluice::experts::{CacheConfig, ExpertCache, ExpertLoc, ExpertStore, IoMode, Slab};

/// Qwen3-30B-A3B-like expert parts at Q4_K: 768 x 2048 -> 884,736 bytes each.
const PART: u64 = 884_736;
const EXPERTS: u64 = 128;

#[test]
// Ignored: a benchmark (writes a 1.5 GB file and times reads), not a correctness check, and
// timing is never asserted. Run it by hand as the module doc says:
// `cargo test --release --test experts_bench -- --ignored --nocapture`.
#[ignore = "benchmark: run with --ignored --nocapture (see module doc)"]
fn expert_read_bandwidth() {
    let gb: f64 = std::env::var("SLUICE_BENCH_GB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.5);
    let dir = match std::env::var_os("SLUICE_BENCH_DIR") {
        Some(d) => {
            let d = std::path::PathBuf::from(d).join("experts_bench");
            std::fs::create_dir_all(&d).expect("create SLUICE_BENCH_DIR");
            d
        }
        None => scratch("experts_bench"),
    };
    let path = dir.join("experts.bin");
    let layer_bytes = 3 * EXPERTS * PART;
    let layers = ((gb * 1e9) as u64 / layer_bytes).max(1);
    let header = 12_345u64; // unaligned start of the first tensor, like a GGUF data section
    let size = header + layers * layer_bytes;
    {
        use std::io::Write;
        let t0 = Instant::now();
        let mut f = std::io::BufWriter::with_capacity(
            1 << 22,
            std::fs::File::create(&path).expect("create"),
        );
        let mut rng = Rng::new(1);
        let mut buf = vec![0u8; 1 << 22];
        let mut left = size;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            rng.fill(&mut buf[..n]);
            f.write_all(&buf[..n]).expect("write");
            left -= n as u64;
        }
        let f = f.into_inner().expect("flush");
        f.sync_all().expect("fsync");
        // SAFETY: advice on an fd we own.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        eprintln!(
            "wrote {:.2} GB in {:.1}s ({} layers of {EXPERTS} experts x 3 x {PART} B)",
            size as f64 / 1e9,
            t0.elapsed().as_secs_f64(),
            layers
        );
    }
    let experts: Vec<Vec<ExpertLoc>> = (0..layers)
        .map(|l| {
            let base = header + l * layer_bytes;
            (0..EXPERTS)
                .map(|e| {
                    let t = |i: u64| r(0, base + i * EXPERTS * PART + e * PART, PART);
                    ExpertLoc {
                        parts: [t(0), t(1), t(2)],
                    }
                })
                .collect()
        })
        .collect();
    let store = || ExpertStore::new(vec![path.clone()], experts.clone()).expect("store");

    // The same request sequence for every arm: 8 random experts per layer wave (decode top-8).
    let mut rng = Rng::new(3);
    let passes: usize = std::env::var("SLUICE_BENCH_PASSES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(24);
    let waves: Vec<(usize, Vec<usize>)> = (0..passes)
        .flat_map(|_| (0..layers as usize).collect::<Vec<_>>())
        .map(|l| {
            let w = vec![1.0; EXPERTS as usize];
            (l, rng.distinct_weighted(&w, 8))
        })
        .collect();

    // Baseline: one thread, O_DIRECT pread of each aligned part window in turn.
    let baseline = || {
        let st = store();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .expect("open O_DIRECT");
        let (buf, _) = Slab::new(st.slot_bytes(), false).expect("buffer");
        let t0 = Instant::now();
        let mut bytes = 0u64;
        for (l, sel) in &waves {
            for &e in sel {
                let plan = st.plan(*l, e).expect("plan");
                for rd in plan.reads() {
                    let len = (rd.aligned_end - rd.aligned_off) as usize;
                    // SAFETY: `buf` holds slot_bytes >= every window; aligned offset and length.
                    let n = unsafe {
                        libc::pread(
                            f.as_raw_fd(),
                            buf.as_ptr().cast(),
                            len,
                            rd.aligned_off as libc::off_t,
                        )
                    };
                    // The last window of the file stops at its (unaligned) end.
                    assert!(
                        n >= 0 && n as u64 >= rd.data_end - rd.aligned_off,
                        "pread returned {n}"
                    );
                    bytes += n as u64;
                }
            }
        }
        let s = t0.elapsed().as_secs_f64();
        eprintln!(
            "baseline pread loop, 1 thread, O_DIRECT: {:.2} GB in {s:.2}s = {:.2} GB/s",
            bytes as f64 / 1e9,
            bytes as f64 / 1e9 / s
        );
    };
    // Two rounds, so drift (other load on the machine) shows as a spread between them.
    for round in 1..=2 {
        eprintln!("round {round}");
        baseline();
        for (mode, threads, chunk) in [
            (IoMode::Direct, 1, 1 << 20),
            (IoMode::Direct, 2, 1 << 20),
            (IoMode::Direct, 4, 1 << 20),
            (IoMode::Direct, 8, 1 << 20),
            (IoMode::Direct, 8, 256 << 10),
            (IoMode::Buffered, 4, 1 << 20),
        ] {
            let cfg = CacheConfig {
                io: mode,
                io_threads: threads,
                read_chunk: chunk,
                ..CacheConfig::new(8)
            };
            let mut cache = ExpertCache::new(store(), cfg).expect("cache");
            if mode == IoMode::Buffered {
                let f = std::fs::File::open(&path).expect("open");
                // SAFETY: advice on an fd we own.
                unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            }
            let t0 = Instant::now();
            let mut handed = 0usize;
            for (l, sel) in &waves {
                cache.begin(*l, sel).expect("begin");
                while let Some((_, b)) = cache.next_ready().expect("next_ready") {
                    assert_eq!(
                        b.gate.len() as u64 + b.up.len() as u64 + b.down.len() as u64,
                        3 * PART
                    );
                    handed += 1;
                }
                cache.end();
            }
            let s = t0.elapsed().as_secs_f64();
            let st = cache.stats();
            assert_eq!(handed, waves.len() * 8);
            eprintln!(
            "ExpertCache {mode:<8} {threads:>2} threads, chunk {:>5} KiB: {:.2} GB in {s:.2}s = {:.2} GB/s (hit {:.1}%, reads outstanding {:.0}% of the time)",
            chunk >> 10,
            st.bytes_read as f64 / 1e9,
            st.bytes_read as f64 / 1e9 / s,
            100.0 * st.hit_rate(),
            100.0 * st.read_secs / s
        );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
