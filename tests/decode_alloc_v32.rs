//! DeepSeek-V3.2's sparse decode step allocates nothing: after a warm-up, a forward pass of one
//! token through the DSA fixture model (index_topk 4) at ~600 cached positions (the indexer
//! scores them on the parallel path, selects 4 per layer and MLA attends to those) makes no heap
//! allocation (counted by a wrapping global allocator). A file of its own: the counter is
//! process-wide, so no other test may run beside it.

mod alloc_util;

use alloc_util::allocs;

#[test]
fn sparse_decode_step_allocates_nothing() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models/deepseek_v32_sparse");
    let files = sluice::format::ModelFiles::open(&dir).unwrap();
    let model = sluice::model::Model::load(
        &files,
        &sluice::model::LoadOptions {
            kv: sluice::model::KvTypes::default(),
            threads: 2,
            ctx: 1024,
        },
    )
    .unwrap();
    assert_eq!(model.cfg.indexer.map(|i| i.topk), Some(4));
    let mut st = model.new_state(1024, 16, 1).unwrap();
    let prompt: Vec<u32> = (0..600).map(|i| (i * 7) % 300 + 3).collect();
    model.feed(&mut st, &prompt).unwrap();
    for t in 0..3 {
        model.forward_chunk(&mut st, &[10 + t], 0).unwrap();
    }
    let before = allocs();
    for t in 0..8 {
        model.forward_chunk(&mut st, &[20 + t], 0).unwrap();
    }
    let after = allocs();
    assert_eq!(
        after - before,
        0,
        "decode steps allocated {} times",
        after - before
    );
}
