//! The expert cache returns exactly the files' bytes in every IO mode, thread count, read
//! chunk and cache size; pinned experts are never re-read; LRU and hotness evict the expected
//! expert; a file truncated while the cache runs gives a clear error, never garbage bytes.

mod experts_util;

use experts_util::{layout, scratch, Layout, Rng};
use sluice::experts::{CacheConfig, ExpertCache, ExpertError, ExpertStore, IoMode, Policy};

const MODES: [IoMode; 3] = [IoMode::Direct, IoMode::Buffered, IoMode::Mmap];

fn store(l: &Layout) -> ExpertStore {
    ExpertStore::new(l.paths.clone(), l.experts.clone()).expect("store")
}

fn cfg(slots: usize, io: IoMode, threads: usize) -> CacheConfig {
    CacheConfig {
        io,
        io_threads: threads,
        ..CacheConfig::new(slots)
    }
}

/// Runs one wave and checks every handed-out expert byte for byte; returns the experts in the
/// order they came.
fn wave(cache: &mut ExpertCache, l: &Layout, layer: usize, experts: &[usize]) -> Vec<usize> {
    cache.begin(layer, experts).expect("begin");
    let mut got = Vec::new();
    while let Some((e, b)) = cache.next_ready().expect("next_ready") {
        assert!(
            experts.contains(&e),
            "expert {e} handed out but not requested"
        );
        assert!(!got.contains(&e), "expert {e} handed out twice");
        for (i, part) in [b.gate, b.up, b.down].into_iter().enumerate() {
            assert!(
                part == l.expected(layer, e, i),
                "layer {layer} expert {e} part {i}: wrong bytes"
            );
        }
        got.push(e);
    }
    cache.end();
    assert_eq!(got.len(), experts.len(), "not every expert was handed out");
    got
}

#[test]
fn every_mode_every_size_exact_bytes() {
    let dir = scratch("experts_io_exact");
    let l = layout(&dir);
    for mode in MODES {
        for threads in 1..=4 {
            // Chunks of 8 KiB (many jobs per expert, EOF inside a chunk) and 1 MiB.
            for chunk in [8192u64, 1 << 20] {
                for slots in 1..=6 {
                    let c = CacheConfig {
                        read_chunk: chunk,
                        ..cfg(slots, mode, threads)
                    };
                    let mut cache = ExpertCache::new(store(&l), c).expect("cache");
                    assert!(
                        cache.io_mode() == mode || !cache.notes().is_empty(),
                        "mode changed without a note"
                    );
                    let mut rng = Rng::new((slots * 31 + threads) as u64);
                    for _ in 0..12 {
                        for layer in [0usize, 2] {
                            let n = l.experts[layer].len();
                            let k = 1 + rng.below(slots.min(n) as u64) as usize;
                            let mut req: Vec<usize> = (0..n).collect();
                            for i in (1..n).rev() {
                                req.swap(i, rng.below(i as u64 + 1) as usize);
                            }
                            req.truncate(k);
                            wave(&mut cache, &l, layer, &req);
                        }
                        cache.tick_token();
                    }
                    let s = cache.stats();
                    assert_eq!(s.requests(), s.hits_lru + s.misses);
                    assert!(s.misses > 0 && s.bytes_read > 0);
                }
            }
        }
    }
}

#[test]
fn direct_reads_widen_to_alignment() {
    let dir = scratch("experts_io_widen");
    let l = layout(&dir);
    let mut cache = ExpertCache::new(store(&l), cfg(6, IoMode::Direct, 2)).expect("cache");
    if cache.io_mode() != IoMode::Direct {
        eprintln!("O_DIRECT unavailable here: {:?}", cache.notes());
        return;
    }
    // Layer 2 expert 4: gate [2_000_003, +123_457) -> 4096-aligned window [1_998_848, 2_125_824),
    // up [1_500_001, +4096) -> [1_499_136, 1_507_328), down ends at EOF of file 1
    // (1_048_653): [983_040, 1_048_653) read from the window [983_040, 1_052_672).
    wave(&mut cache, &l, 2, &[4]);
    let s = cache.stats();
    assert_eq!(s.misses, 1);
    assert_eq!(
        s.bytes_read,
        (2_125_824 - 1_998_848) + (1_507_328 - 1_499_136) + (1_048_653 - 983_040)
    );
    assert_eq!(cache.slot_bytes() % 4096, 0);
}

#[test]
fn pinned_experts_are_never_reread() {
    let dir = scratch("experts_io_pinned");
    let l = layout(&dir);
    for mode in MODES {
        let pinned = vec![(0, 5), (0, 1), (2, 4)];
        let c = CacheConfig {
            pinned: pinned.clone(),
            ..cfg(1, mode, 3)
        };
        let mut cache = ExpertCache::new(store(&l), c).expect("cache");
        assert!(cache.stats().pin_load_bytes > 0);
        for &(layer, e) in &pinned {
            assert!(cache.is_pinned(layer, e));
        }
        // With one evictable slot, churn the evictable tier hard around the pinned experts.
        for i in 0..20 {
            wave(&mut cache, &l, 0, &[5, 1, [0, 2, 3, 4][i % 4]]);
            wave(&mut cache, &l, 2, &[4, i % 4]);
        }
        let s = cache.stats();
        assert_eq!(s.hits_pin, 20 * 3, "{mode}");
        // Every unpinned request missed except repeats of the single slot's expert (none here:
        // consecutive requests in a layer always name a different unpinned expert).
        assert_eq!(s.misses, 40, "{mode}");
        assert_eq!(s.hits_lru, 0, "{mode}");
        for &(layer, e) in &pinned {
            assert!(cache.is_pinned(layer, e) && cache.is_cached(layer, e));
        }
    }
}

#[test]
fn lru_evicts_least_recently_used() {
    let dir = scratch("experts_io_lru");
    let l = layout(&dir);
    let mut cache = ExpertCache::new(
        store(&l),
        CacheConfig {
            policy: Policy::Lru,
            ..cfg(2, IoMode::Buffered, 1)
        },
    )
    .expect("cache");
    for e in [0, 0, 0, 1] {
        wave(&mut cache, &l, 0, &[e]);
    }
    // 0 was used at ticks 1-3, 1 at tick 4: LRU evicts 0 for 2.
    wave(&mut cache, &l, 0, &[2]);
    assert!(!cache.is_cached(0, 0) && cache.is_cached(0, 1) && cache.is_cached(0, 2));
    wave(&mut cache, &l, 0, &[1]);
    wave(&mut cache, &l, 0, &[3]);
    assert!(!cache.is_cached(0, 2) && cache.is_cached(0, 1) && cache.is_cached(0, 3));
    let s = cache.stats();
    assert_eq!((s.hits_lru, s.misses), (3, 4));
}

#[test]
fn hotness_evicts_the_coldest_and_decays() {
    let dir = scratch("experts_io_hot");
    let l = layout(&dir);
    // Without decay: 0 was selected 3 times, 1 once, so 2 evicts 1 (LRU would evict 0).
    let c = CacheConfig {
        policy: Policy::Hotness { halve_every: 1000 },
        ..cfg(2, IoMode::Mmap, 2)
    };
    let mut cache = ExpertCache::new(store(&l), c).expect("cache");
    for e in [0, 0, 0, 1, 2] {
        wave(&mut cache, &l, 0, &[e]);
        cache.tick_token();
    }
    assert!(cache.is_cached(0, 0) && !cache.is_cached(0, 1) && cache.is_cached(0, 2));

    // Halving every token: 0's three selections decay to 0 while 1 (selected this token)
    // counts 1, so 2 evicts 0.
    let c = CacheConfig {
        policy: Policy::Hotness { halve_every: 1 },
        ..cfg(2, IoMode::Mmap, 2)
    };
    let mut cache = ExpertCache::new(store(&l), c).expect("cache");
    for e in [0, 0, 0] {
        wave(&mut cache, &l, 0, &[e]);
        cache.tick_token();
    }
    wave(&mut cache, &l, 0, &[1]);
    wave(&mut cache, &l, 0, &[2]);
    assert!(!cache.is_cached(0, 0) && cache.is_cached(0, 1) && cache.is_cached(0, 2));
}

#[test]
fn truncated_file_gives_an_error_not_bytes() {
    for mode in MODES {
        let dir = scratch(&format!("experts_io_trunc_{mode}"));
        let l = layout(&dir);
        let mut cache = ExpertCache::new(store(&l), cfg(6, mode, 2)).expect("cache");
        // Cut file 0 to 1 MB: layer 0 experts 0..4 have gates below it (and the rest above).
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&l.paths[0])
            .expect("open");
        f.set_len(1_000_000).expect("truncate");
        drop(f);
        cache.begin(0, &[3, 5]).expect("begin");
        let mut errors = 0;
        loop {
            match cache.next_ready() {
                Ok(None) => break,
                Ok(Some((e, _))) => panic!("{mode}: expert {e} handed out from a truncated file"),
                Err(e) => {
                    let msg = e.to_string();
                    assert!(matches!(e, ExpertError::ShortRead { .. }), "{mode}: {msg}");
                    assert!(
                        msg.contains("model-0.bin") && msg.contains("truncated"),
                        "{mode}: {msg}"
                    );
                    errors += 1;
                }
            }
        }
        cache.end();
        assert!(errors >= 1, "{mode}: no error");
        assert!(
            !cache.is_cached(0, 3) && !cache.is_cached(0, 5),
            "{mode}: failed experts stay cached"
        );
        // The cache still works for experts the files still hold (layer 2 experts 0-3 live in
        // file 1).
        wave(&mut cache, &l, 2, &[0, 1, 2, 3]);
    }
}

#[test]
fn protocol_errors() {
    let dir = scratch("experts_io_protocol");
    let l = layout(&dir);
    let mut cache = ExpertCache::new(store(&l), cfg(2, IoMode::Buffered, 1)).expect("cache");
    assert!(matches!(cache.next_ready(), Err(ExpertError::Request(_))));
    let e = cache.begin(0, &[0, 1, 2]).unwrap_err().to_string();
    assert!(
        e.contains("3 unpinned experts requested at once, 2 slots"),
        "{e}"
    );
    assert!(cache
        .begin(0, &[1, 1])
        .unwrap_err()
        .to_string()
        .contains("named twice"));
    assert!(cache
        .begin(0, &[6])
        .unwrap_err()
        .to_string()
        .contains("out of range"));
    assert!(cache
        .begin(3, &[0])
        .unwrap_err()
        .to_string()
        .contains("out of range"));
    assert!(cache
        .begin(1, &[0])
        .unwrap_err()
        .to_string()
        .contains("out of range"));
    cache.begin(0, &[0]).expect("begin");
    assert!(cache
        .begin(2, &[0])
        .unwrap_err()
        .to_string()
        .contains("call end() first"));
    cache.end();
    wave(&mut cache, &l, 0, &[0, 1]);

    let bad = CacheConfig {
        pinned: vec![(1, 0)],
        ..cfg(2, IoMode::Buffered, 1)
    };
    assert!(ExpertCache::new(store(&l), bad).is_err());
    let bad = CacheConfig {
        io_threads: 0,
        ..cfg(2, IoMode::Buffered, 1)
    };
    assert!(ExpertCache::new(store(&l), bad).is_err());
    // A range past the end of its file is refused up front.
    let mut ex = l.experts.clone();
    ex[0][0].parts[1].offset = experts_util::F0_LEN as u64;
    let e = ExpertCache::new(
        ExpertStore::new(l.paths.clone(), ex).expect("store"),
        cfg(2, IoMode::Buffered, 1),
    );
    assert!(e
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
        .contains("expert 0 of layer 0, up"));
}

#[test]
fn direct_on_tmpfs_falls_back_or_works() {
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        return;
    }
    let dir = shm.join(format!("sluice-experts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let l = layout(&dir);
    let mut cache = ExpertCache::new(store(&l), cfg(6, IoMode::Direct, 2)).expect("cache");
    if cache.io_mode() == IoMode::Buffered {
        let n = &cache.notes()[0];
        assert!(n.contains("O_DIRECT") && n.contains("buffered"), "{n}");
    }
    wave(&mut cache, &l, 0, &[0, 1, 2, 3, 4, 5]);
    wave(&mut cache, &l, 2, &[0, 1, 2, 3, 4]);
    drop(cache);
    let _ = std::fs::remove_dir_all(&dir);
}
