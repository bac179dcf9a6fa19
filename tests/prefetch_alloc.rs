//! Prefetch keeps the decode step allocation-free: with a streaming cache of one and two slots
//! per layer and prefetch on, after a warm-up a forward pass of one token makes no heap
//! allocation on any thread (counted by a wrapping global allocator; alone in its binary).

mod alloc_util;

use alloc_util::allocs;

use sluice::experts::{CacheConfig, IoMode};

#[test]
fn prefetching_decode_step_allocates_nothing() {
    std::env::set_var(
        "SLUICE_CACHE_DIR",
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("prefetch-alloc"),
    );
    let path = sluice::default_model::ensure_random().unwrap();
    let files = sluice::format::ModelFiles::open(&path).unwrap();
    let model = sluice::model::Model::load(
        &files,
        &sluice::model::LoadOptions {
            kv: sluice::model::KvTypes::default(),
            threads: 2,
            ctx: 256,
        },
    )
    .unwrap();
    for (slots, io) in [(1, IoMode::Direct), (2, IoMode::Buffered)] {
        let mut c = CacheConfig::new(slots);
        c.io = io;
        c.io_threads = 2;
        c.prefetch = true;
        let mut st = model.new_state(256, 8, 1).unwrap();
        st.attach_experts(model.expert_cache(&files, c).unwrap());
        model.feed(&mut st, &[1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap();
        for t in 0..4 {
            model.forward_chunk(&mut st, &[10 + t], 0).unwrap();
        }
        let before = allocs();
        for t in 0..24 {
            model
                .forward_chunk(&mut st, &[(20 + 7 * t) % 200], 0)
                .unwrap();
        }
        let after = allocs();
        let s = st.expert_stats().unwrap();
        assert!(s.prefetched > 0, "{s:?}");
        assert_eq!(
            after - before,
            0,
            "{slots} slots, {io}: decode steps with prefetch allocated {} times",
            after - before
        );
    }
}
