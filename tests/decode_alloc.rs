//! The decode step allocates nothing: after a warm-up, a forward pass of one token through the
//! default model makes no heap allocation (counted by a wrapping global allocator).

mod alloc_util;

use alloc_util::allocs;

#[test]
fn decode_step_allocates_nothing() {
    // Wide enough that matmuls and attention take the multi-threaded paths.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("decode-alloc");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("wide.gguf");
    let mut spec = sluice::default_model::spec();
    (
        spec.hidden,
        spec.layers,
        spec.heads,
        spec.head_dim,
        spec.experts,
        spec.expert_ffn,
    ) = (1024, 2, 16, 128, 8, 512);
    sluice::synth::write_random_qwen3moe(&path, &spec, &mut |_, _| {}).unwrap();
    let files = sluice::format::ModelFiles::open(&path).unwrap();
    let model = sluice::model::Model::load(
        &files,
        &sluice::model::LoadOptions {
            kv: sluice::model::KvTypes::default(),
            threads: 2,
            ctx: 1024,
        },
    )
    .unwrap();
    let mut st = model.new_state(1024, 16, 1).unwrap();
    let prompt: Vec<u32> = (0..600).map(|i| i % 250).collect();
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
