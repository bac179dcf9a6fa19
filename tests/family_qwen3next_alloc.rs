//! A Qwen3-Next decode step allocates nothing either: the Gated DeltaNet's conv and delta-rule
//! state, its scratch and the gated attention's q/gate split all live in the state's buffers.
//! The tests/fixtures/models/qwen3_next checkpoint, counted by the wrapping global allocator.

mod alloc_util;

use alloc_util::allocs;
use std::path::Path;

#[test]
fn qwen3next_decode_step_allocates_nothing() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen3_next");
    let files = sluice::format::ModelFiles::open(&dir).unwrap();
    let model = sluice::model::Model::load(
        &files,
        &sluice::model::LoadOptions {
            kv: sluice::model::KvTypes::default(),
            threads: 2,
            ctx: 64,
        },
    )
    .unwrap();
    let mut st = model.new_state(64, 8, 1).unwrap();
    let prompt: Vec<u32> = (0..20).map(|i| (i * 37) % 300).collect();
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
