//! `--prefetch` (the next layer's experts predicted by its router and read early):
//! - the cache: a prefetch followed by `begin` of the same layer never reads an expert twice
//!   (bytes_read accounting), a prefetch issued while another layer's wave is open completes,
//!   prefetches that hold every free slot make `begin` wait instead of failing, and a failed
//!   prefetch read only empties its slot (the request that needs the expert reports the error);
//! - the model: temp-0 logits and greedy tokens are bit-identical with prefetch on and with the
//!   experts read through the mapped files, for every IO mode, cache size (one slot per layer to
//!   all), reader thread count and batch size, on Qwen3-MoE and DeepSeek-V3 shaped models;
//! - the CLI: `--prefetch` / `--prefetch=off` give the same text, and `--stats-json` carries the
//!   prefetch figures.

mod experts_util;

use experts_util::{layout, scratch, Layout};
use sluice::experts::{CacheConfig, ExpertCache, ExpertStore, IoMode, Policy};
use sluice::format::ModelFiles;
use sluice::model::{LoadOptions, Model};
use std::path::{Path, PathBuf};

fn cache(l: &Layout, slots: usize, io: IoMode, threads: usize) -> ExpertCache {
    let cfg = CacheConfig {
        io,
        io_threads: threads,
        read_chunk: 4096,
        ..CacheConfig::new(slots)
    };
    ExpertCache::new(
        ExpertStore::new(l.paths.clone(), l.experts.clone()).expect("store"),
        cfg,
    )
    .expect("cache")
}

/// Runs one wave, checking every handed-out expert's bytes against the files; returns the
/// experts handed out, sorted.
fn wave(c: &mut ExpertCache, l: &Layout, layer: usize, experts: &[usize]) -> Vec<usize> {
    c.begin(layer, experts).expect("begin");
    let mut got = Vec::new();
    while let Some((e, b)) = c.next_ready().expect("next_ready") {
        assert_eq!(
            b.gate,
            l.expected(layer, e, 0),
            "layer {layer} expert {e} gate"
        );
        assert_eq!(b.up, l.expected(layer, e, 1), "layer {layer} expert {e} up");
        assert_eq!(
            b.down,
            l.expected(layer, e, 2),
            "layer {layer} expert {e} down"
        );
        got.push(e);
    }
    c.end();
    got.sort();
    got
}

/// Bytes a cold cache reads to serve `experts` of `layer` once.
fn cold_bytes(l: &Layout, io: IoMode, layer: usize, experts: &[usize]) -> u64 {
    let mut c = cache(l, 6, io, 2);
    wave(&mut c, l, layer, experts);
    c.stats().bytes_read
}

#[test]
fn prefetch_then_begin_never_reads_twice() {
    let dir = scratch("prefetch_cache");
    let l = layout(&dir);
    for io in [IoMode::Direct, IoMode::Buffered, IoMode::Mmap] {
        for threads in [1, 3] {
            let want = [1usize, 3, 5];
            let mut c = cache(&l, 6, io, threads);
            assert_eq!(c.prefetch(0, &want).expect("prefetch"), 3);
            // Immediately: with 4 KiB jobs some reads are usually still in flight.
            assert_eq!(wave(&mut c, &l, 0, &want), want);
            let s = c.stats();
            assert_eq!(
                s.bytes_read,
                cold_bytes(&l, io, 0, &want),
                "{io} x{threads}"
            );
            assert_eq!((s.misses, s.prefetched, s.prefetch_used), (3, 3, 3));
            assert_eq!((s.predicted, s.predicted_used), (3, 3));
            assert_eq!(s.prefetch_recall(), 1.0);
            // Predicting cached experts reads nothing more; a mixed request reads only the new.
            assert_eq!(c.prefetch(0, &[1, 3]).expect("prefetch"), 0);
            assert_eq!(c.stats().bytes_read, s.bytes_read);
            assert_eq!(wave(&mut c, &l, 0, &[0, 1, 3]), [0, 1, 3]);
            let s2 = c.stats();
            assert_eq!(s2.hits_lru, 2);
            assert_eq!(s2.prefetch_used, 3, "a hit is not a prefetch");
            assert_eq!(
                s2.bytes_read - s.bytes_read,
                cold_bytes(&l, io, 0, &[0]),
                "{io}"
            );
            // A prediction that is not requested lowers precision, never correctness.
            c.prefetch(0, &[2]).expect("prefetch");
            assert_eq!(wave(&mut c, &l, 0, &[4]), [4]);
            let s3 = c.stats();
            assert_eq!((s3.predicted, s3.predicted_used), (6, 5));
            assert_eq!(s3.prefetched, 4);
        }
    }
}

#[test]
fn prefetch_while_another_wave_is_open_completes() {
    let dir = scratch("prefetch_open_wave");
    let l = layout(&dir);
    for io in [IoMode::Direct, IoMode::Buffered] {
        for threads in [1, 2] {
            let mut c = cache(&l, 2, io, threads);
            c.begin(0, &[0, 5]).expect("begin");
            // Layer 2's reads queue behind layer 0's and complete while its wave drains.
            assert_eq!(c.prefetch(2, &[1, 4, 3]).expect("prefetch"), 2, "2 slots");
            let mut got = Vec::new();
            while let Some((e, b)) = c.next_ready().expect("next_ready") {
                assert_eq!(b.down, l.expected(0, e, 2));
                got.push(e);
            }
            c.end();
            got.sort();
            assert_eq!(got, [0, 5]);
            // The prefetched experts are served without another read (some of the prefetch's
            // reads may still be in flight here, so only the totals are compared).
            assert_eq!(wave(&mut c, &l, 2, &[1, 4]), [1, 4]);
            let s = c.stats();
            assert_eq!(s.prefetch_used, 2);
            assert_eq!(
                s.bytes_read,
                cold_bytes(&l, io, 0, &[0, 5]) + cold_bytes(&l, io, 2, &[1, 4])
            );
            // Prefetch into the open wave's own layer: its busy slots are never taken.
            c.begin(2, &[0]).expect("begin");
            assert_eq!(c.prefetch(2, &[2, 3]).expect("prefetch"), 1);
            assert_eq!(c.next_ready().expect("next").map(|(e, _)| e), Some(0));
            c.end();
            assert_eq!(wave(&mut c, &l, 2, &[0, 2]), [0, 2]);
        }
    }
}

#[test]
fn begin_waits_for_prefetches_holding_every_slot() {
    let dir = scratch("prefetch_full");
    let l = layout(&dir);
    for threads in [1, 3] {
        let mut c = cache(&l, 1, IoMode::Buffered, threads);
        for round in 0..20 {
            // Each prediction is wrong: the only slot is being prefetched when `begin` needs it.
            assert_eq!(c.prefetch(0, &[(round + 3) % 6]).expect("prefetch"), 1);
            let e = (round + 1) % 6;
            assert_eq!(wave(&mut c, &l, 0, &[e]), [e]);
        }
        let s = c.stats();
        assert_eq!((s.misses, s.prefetched, s.prefetch_used), (20, 20, 0));
        assert_eq!(s.predicted_used, 0);
    }
}

#[test]
fn failed_prefetch_drops_the_slot_and_the_request_reports_it() {
    let dir = scratch("prefetch_fail");
    let l = layout(&dir);
    let mut c = cache(&l, 2, IoMode::Buffered, 2);
    // Expert 4 of layer 2 ends at the end of file 1: cut it short.
    let f1 = std::fs::OpenOptions::new()
        .write(true)
        .open(&l.paths[1])
        .expect("open");
    f1.set_len(experts_util::F1_LEN as u64 - 1000)
        .expect("truncate");
    c.prefetch(2, &[4])
        .expect("a prefetch never fails for a read");
    // Layer 0's wave runs fine meanwhile (expert 0 lies in file 0).
    assert_eq!(wave(&mut c, &l, 0, &[0]), [0]);
    c.begin(2, &[4]).expect("begin");
    let err = match c.next_ready() {
        Ok(Some(_)) => panic!("bytes of a short read handed out"),
        Ok(None) => panic!("the failed read was not reported"),
        Err(e) => e.to_string(),
    };
    c.end();
    assert!(err.contains("model-1.bin"), "error names the file: {err}");
    assert!(!c.is_cached(2, 4));
    // The cache stays usable.
    assert_eq!(wave(&mut c, &l, 2, &[0]), [0]);
}

// ---- the model ------------------------------------------------------------------------------

fn default_model() -> PathBuf {
    std::env::set_var(
        "SLUICE_CACHE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("prefetch-cache"),
    );
    sluice::default_model::ensure_random().unwrap()
}

fn deepseek() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/deepseek_v3/model-q8_0.gguf")
}

/// Greedy choice, lowest id on ties.
fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Teacher-forced logits of `tokens`, then `gen` greedy tokens with each step's logits.
fn run(
    model: &Model<'_>,
    files: &ModelFiles,
    tokens: &[u32],
    gen: usize,
    batch: usize,
    cache: Option<CacheConfig>,
) -> (
    Vec<f32>,
    Vec<u32>,
    Vec<f32>,
    Option<sluice::experts::CacheStats>,
) {
    let mut st = model.new_state(128, batch, batch).unwrap();
    if let Some(c) = cache {
        st.attach_experts(model.expert_cache(files, c).unwrap());
    }
    let mut forced = Vec::new();
    model.logits_all(&mut st, tokens, &mut forced).unwrap();
    let v = model.cfg.vocab;
    let mut last = forced[forced.len() - v..].to_vec();
    let (mut toks, mut step_logits) = (Vec::new(), Vec::new());
    for _ in 0..gen {
        let t = argmax(&last);
        toks.push(t);
        last = model.forward_chunk(&mut st, &[t], 0).unwrap().to_vec();
        step_logits.extend_from_slice(&last);
    }
    (forced, toks, step_logits, st.expert_stats())
}

fn check_model(path: &Path) {
    let files = ModelFiles::open(path).unwrap();
    let model = Model::load(
        &files,
        &LoadOptions {
            kv: sluice::model::KvTypes::F32,
            threads: 2,
            ctx: 128,
        },
    )
    .unwrap();
    let v = model.cfg.vocab as u32;
    let tokens: Vec<u32> = (0..24).map(|i| (i * 131 + 7) % v).collect();
    let n_exp = model.cfg.n_experts;
    let (rf, rt, rl, _) = run(&model, &files, &tokens, 12, 16, None);
    let (mut used, mut arms) = (0, 0);
    for io in [IoMode::Direct, IoMode::Buffered, IoMode::Mmap] {
        for slots in [1, 2, n_exp] {
            for threads in [1, 3] {
                for batch in [1, 16] {
                    let mut c = CacheConfig::new(slots);
                    c.io = io;
                    c.io_threads = threads;
                    c.prefetch = true;
                    if slots == 2 {
                        c.policy = Policy::Hotness { halve_every: 8 };
                    }
                    let what = format!(
                        "{}: io {io:?} slots {slots} threads {threads} batch {batch}",
                        path.display()
                    );
                    let (f, t, lg, s) = run(&model, &files, &tokens, 12, batch, Some(c));
                    assert_eq!(bits(&f), bits(&rf), "teacher-forced logits, {what}");
                    assert_eq!(t, rt, "greedy tokens, {what}");
                    assert_eq!(bits(&lg), bits(&rl), "decode logits, {what}");
                    let s = s.unwrap();
                    assert!(s.predicted > 0 && s.predicted_used > 0, "{what}: {s:?}");
                    used += s.prefetch_used;
                    arms += 1;
                }
            }
        }
    }
    assert_eq!(arms, 36);
    assert!(used > 0, "no prefetched read ever served a request");
}

#[test]
fn prefetch_is_bit_identical_qwen3moe() {
    check_model(&default_model());
}

#[test]
fn prefetch_is_bit_identical_deepseek_v3() {
    check_model(&deepseek());
}

#[test]
fn cli_flag_same_text_and_stats_json() {
    let path = default_model();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("prefetch-cli");
    std::fs::create_dir_all(&dir).unwrap();
    let mut texts = Vec::new();
    for flag in ["--prefetch", "--prefetch=off"] {
        let json = dir.join("stats.json");
        let _ = std::fs::remove_file(&json);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args([
                "run",
                path.to_str().unwrap(),
                "-p",
                "Once upon a time",
                "-n",
                "16",
            ])
            .args(["--temp", "0", "--ignore-eos", "-t", "1", "-c", "64"])
            .args(["--experts", "stream", "--cap", "2", "--usage-freeze", flag])
            .args(["--stats-json", json.to_str().unwrap()])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{stderr}");
        let on = flag == "--prefetch";
        assert!(
            stderr.contains(&format!(
                "[plan] prefetch: {} (--prefetch)",
                if on { "on" } else { "off" }
            )),
            "{stderr}"
        );
        assert_eq!(stderr.contains("[experts] prefetch:"), on, "{stderr}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        for k in ["prefetch_precision", "prefetch_recall", "prefetched"] {
            assert!(v[k].is_number(), "{k} in {v}");
        }
        assert_eq!(v["prefetch"].as_bool(), Some(on));
        assert_eq!(v["prefetched"].as_u64().unwrap() > 0, on, "{v}");
        let p = v["prefetch_precision"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&p));
        texts.push(String::from_utf8_lossy(&out.stdout).to_string());
    }
    assert_eq!(texts[0], texts[1]);
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["run", path.to_str().unwrap(), "-n", "1", "--prefetch=maybe"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--prefetch=maybe"));
}
