//! gpt-oss's decode step allocates nothing either (sinks, per-layer windows, biases and the
//! clamped SwiGLU all work in the state's buffers): the fixture written as a `gpt-oss` GGUF
//! by scripts/gptoss_to_gguf.py, MXFP4 experts, counted by the wrapping global allocator.

mod alloc_util;

use alloc_util::allocs;
use std::path::Path;
use std::process::Command;

#[test]
fn gptoss_decode_step_allocates_nothing() {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gpt-oss-alloc.gguf");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let run = Command::new("python3")
        .arg(root.join("scripts/gptoss_to_gguf.py"))
        .arg(root.join("tests/fixtures/models/gpt_oss"))
        .arg(&out)
        .output()
        .expect("python3 with gguf and numpy");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let files = sluice::format::ModelFiles::open(&out).unwrap();
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
