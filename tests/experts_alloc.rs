//! The expert cache's hot path allocates nothing: after a warm-up, waves of hits and misses
//! (begin / next_ready / end / tick_token, route trace on) in every IO mode make no heap
//! allocation on any thread (counted by a wrapping global allocator; alone in its binary).

mod alloc_util;
mod experts_util;

use alloc_util::allocs;
use experts_util::{layout, scratch, Rng};
use sluice::experts::{CacheConfig, ExpertCache, ExpertStore, IoMode, Policy};

#[test]
fn waves_allocate_nothing() {
    let dir = scratch("experts_alloc");
    let l = layout(&dir);
    for mode in [IoMode::Direct, IoMode::Buffered, IoMode::Mmap] {
        for policy in [Policy::Lru, Policy::Hotness { halve_every: 4 }] {
            let cfg = CacheConfig {
                io: mode,
                io_threads: 3,
                read_chunk: 16384,
                policy,
                pinned: vec![(0, 2)],
                trace: Some(dir.join("t.trace")),
                ..CacheConfig::new(3)
            };
            let mut cache = ExpertCache::new(
                ExpertStore::new(l.paths.clone(), l.experts.clone()).expect("store"),
                cfg,
            )
            .expect("cache");
            let mut rng = Rng::new(4);
            // Requests prepared up front (the caller's buffers are its own business).
            let reqs: Vec<(usize, Vec<usize>)> = (0..400)
                .map(|i| {
                    let layer = if i % 2 == 0 { 0 } else { 2 };
                    let n = l.experts[layer].len();
                    let mut v: Vec<usize> = (0..n).collect();
                    for j in (1..n).rev() {
                        v.swap(j, rng.below(j as u64 + 1) as usize);
                    }
                    v.retain(|&e| layer != 0 || e != 2);
                    v.truncate(1 + i % 3);
                    if layer == 0 && i % 5 == 0 {
                        v.push(2);
                    }
                    (layer, v)
                })
                .collect();
            let run = |cache: &mut ExpertCache, range: std::ops::Range<usize>| {
                let mut sum = 0u64;
                for (layer, v) in &reqs[range] {
                    cache.begin(*layer, v).expect("begin");
                    while let Some((_, b)) = cache.next_ready().expect("next_ready") {
                        sum += b.gate[0] as u64 + b.down.len() as u64;
                    }
                    cache.end();
                    cache.tick_token();
                }
                sum
            };
            run(&mut cache, 0..50);
            let before = allocs();
            let sum = run(&mut cache, 50..400);
            let after = allocs();
            let s = cache.stats();
            assert!(
                sum > 0 && s.misses > 100 && s.hits_lru > 10 && s.hits_pin > 10,
                "{s:?}"
            );
            assert_eq!(
                after - before,
                0,
                "{mode} {policy:?}: {} allocations in 350 waves",
                after - before
            );
        }
    }
}
