//! Issue 20, item 3: absurd sizes from a file or the command line give one-line errors
//! naming the field, before anything is allocated: no abort, no panic, no hang.
//! Reproducers: a GGUF whose layer count is 2^31, 2^32 or 2^63 or whose feed_forward_length
//! is 2^63; `-c 2^64-1`, `-c 2^32`, `-c 100000000`; `-b 1000000000` and `-t 100000` (capped, with a message).

mod reliability_util;

use reliability_util::{assert_clean_failure, logits_args, rewrite_gguf, sluice, tmpdir};
use sluice::format::MetaValue;
use std::time::{Duration, Instant};

fn with_meta(tag: &str, suffix: &'static str, v: u64) -> String {
    let d = tmpdir(tag);
    let p = d.join("m.gguf");
    rewrite_gguf(&p, |k, old| {
        Some(if k.ends_with(suffix) {
            MetaValue::U64(v)
        } else {
            old.clone()
        })
    });
    p.to_str().unwrap().to_string()
}

#[test]
fn absurd_layer_counts_are_refused_by_name() {
    for (i, v) in [1u64 << 31, 1 << 32, 1 << 63].into_iter().enumerate() {
        let m = with_meta(&format!("layers-{i}"), ".block_count", v);
        let t = Instant::now();
        assert_clean_failure(&logits_args(&m, &[]), "layer count");
        assert!(t.elapsed() < Duration::from_secs(60));
    }
}

#[test]
fn absurd_feed_forward_length_is_refused_by_name() {
    let m = with_meta("ffn", ".expert_feed_forward_length", 1 << 63);
    assert_clean_failure(&logits_args(&m, &[]), "expert width");
    let m = with_meta("heads", ".attention.head_count", 1 << 40);
    assert_clean_failure(&logits_args(&m, &[]), "heads");
}

#[test]
fn absurd_context_and_batch_are_refused_before_allocating() {
    let m = reliability_util::fixture("qwen3_moe/model-f32.gguf");
    let m = m.to_str().unwrap();
    let max = u64::MAX.to_string();
    assert_clean_failure(&logits_args(m, &["-c", &max]), "-c 18446744073709551615");
    assert_clean_failure(&logits_args(m, &["-c", "4294967296"]), "-c 4294967296");
    // 10^8 positions: a KV cache past this machine's memory; refused
    // before the table is built.
    let t = Instant::now();
    assert_clean_failure(&logits_args(m, &["-c", "100000000"]), "-c 100000000");
    assert!(t.elapsed() < Duration::from_secs(30));
}

/// `-b` past the context is cut to it with a message (llama.cpp clamps n_batch to n_ctx), so
/// `-b 1000000000` allocates a context's worth of rows, not 10^9.
#[test]
fn absurd_batch_is_capped_to_the_context_with_a_message() {
    let m = reliability_util::fixture("qwen3_moe/model-f32.gguf");
    let (code, _, err) = sluice(&logits_args(m.to_str().unwrap(), &["-b", "1000000000"]));
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("-b 1000000000") && err.contains("using"),
        "{err}"
    );
}

#[test]
fn absurd_thread_count_is_capped_with_a_message() {
    let m = reliability_util::fixture("qwen3_moe/model-f32.gguf");
    let t = Instant::now();
    let (code, _, err) = sluice(&logits_args(m.to_str().unwrap(), &["-t", "100000"]));
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("-t 100000") && err.contains("using"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(60));
}
