//! Placement never changes semantics: teacher-forced logits (and greedy tokens) are
//! bit-identical whether experts come from the mapped files or through the streaming cache,
//! for every IO mode, cache size (one slot per layer up to every expert), policy, pinning and
//! reader thread count, and across prefill batch sizes of the streamed path.

use sluice::experts::{CacheConfig, IoMode, Policy};
use sluice::format::ModelFiles;
use sluice::model::{LoadOptions, Model};
use std::path::{Path, PathBuf};

fn model_path() -> PathBuf {
    // A DeepSeek-shaped fixture (dense first layer, shared expert, group routing) and the
    // default Qwen3-MoE model both run below.
    std::env::set_var(
        "SLUICE_CACHE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("stream-cache"),
    );
    sluice::default_model::ensure_random().unwrap()
}

fn logits(
    model: &Model<'_>,
    files: &ModelFiles,
    tokens: &[u32],
    batch: usize,
    cache: Option<CacheConfig>,
) -> (Vec<f32>, Option<sluice::experts::CacheStats>) {
    let mut st = model.new_state(128, batch, batch).unwrap();
    if let Some(c) = cache {
        st.attach_experts(model.expert_cache(files, c).unwrap());
    }
    let mut out = Vec::new();
    model.logits_all(&mut st, tokens, &mut out).unwrap();
    (out, st.expert_stats())
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn check(path: &Path) {
    let files = ModelFiles::open(path).unwrap();
    let model = Model::load(
        &files,
        &LoadOptions {
            kv: sluice::model::KvTypes::default(),
            threads: 2,
            ctx: 128,
        },
    )
    .unwrap();
    let v = model.cfg.vocab as u32;
    let tokens: Vec<u32> = (0..40).map(|i| (i * 131 + 7) % v).collect();
    let n_exp = model.cfg.n_experts;
    let (reference, _) = logits(&model, &files, &tokens, 16, None);
    let mut arms = 0;
    for io in [IoMode::Direct, IoMode::Buffered, IoMode::Mmap] {
        for slots in [1, 2, n_exp] {
            for threads in [1, 3] {
                for batch in [1, 16] {
                    let mut c = CacheConfig::new(slots);
                    c.io = io;
                    c.io_threads = threads;
                    c.policy = if slots == 2 {
                        Policy::Hotness { halve_every: 8 }
                    } else {
                        Policy::Lru
                    };
                    let (got, stats) = logits(&model, &files, &tokens, batch, Some(c));
                    let stats = stats.unwrap();
                    assert!(stats.requests() > 0);
                    assert_eq!(
                        bits(&got),
                        bits(&reference),
                        "{}: io {io:?} slots {slots} threads {threads} batch {batch}",
                        path.display()
                    );
                    arms += 1;
                }
            }
        }
    }
    // Pinned experts: pin every expert of layer 0 and one of each other layer.
    let mut c = CacheConfig::new(1);
    c.pinned = (0..n_exp)
        .map(|e| (model.cfg.n_dense_layers, e))
        .chain((0..model.cfg.n_layers).map(|l| (l, 0)))
        .filter(|(l, _)| *l >= model.cfg.n_dense_layers)
        .collect();
    c.pinned.sort();
    c.pinned.dedup();
    let (got, stats) = logits(&model, &files, &tokens, 4, Some(c));
    assert_eq!(bits(&got), bits(&reference), "{}: pinned", path.display());
    assert!(stats.unwrap().hits_pin > 0);
    assert!(arms > 0);
}

#[test]
fn streamed_logits_are_bit_identical_qwen3moe() {
    check(&model_path());
}

#[test]
fn streamed_logits_are_bit_identical_deepseek_v3() {
    check(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/models/deepseek_v3/model-q8_0.gguf"),
    );
}

/// A file truncated under a running model gives a clear error, never a garbage token.
#[test]
fn truncated_file_mid_run_is_an_error() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("stream-trunc");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("m.gguf");
    std::fs::copy(model_path(), &p).unwrap();
    let files = ModelFiles::open(&p).unwrap();
    let model = Model::load(
        &files,
        &LoadOptions {
            kv: sluice::model::KvTypes::default(),
            threads: 1,
            ctx: 64,
        },
    )
    .unwrap();
    let mut st = model.new_state(64, 4, 1).unwrap();
    let mut c = CacheConfig::new(1);
    c.io = IoMode::Buffered;
    st.attach_experts(model.expert_cache(&files, c).unwrap());
    model.feed(&mut st, &[1, 2, 3]).unwrap();
    // Cut the file just after the resident part: every expert range of the last layer is gone.
    let first_expert = model
        .expert_locs()
        .iter()
        .flatten()
        .map(|l| l.parts[0].offset)
        .min()
        .unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(first_expert + 4096)
        .unwrap();
    let mut err = None;
    for t in 0..20u32 {
        match model.forward_chunk(&mut st, &[4 + t], 0) {
            Ok(_) => {}
            Err(e) => {
                err = Some(e.to_string());
                break;
            }
        }
    }
    let err = err.expect("a truncated model file must fail the run");
    assert!(err.contains("m.gguf"), "error names the file: {err}");
}

/// Peak RSS stays within the budget plus a small fixed overhead while running a model whose
/// routed experts are more than 4x the budget (generated here, in a temp dir).
#[test]
fn peak_rss_stays_within_budget() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("stream-rss");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("wide64.gguf");
    let mut spec = sluice::default_model::spec();
    // ~200 MB of routed experts (4 layers x 64 experts x 3 x 512x512 Q8_0), ~5 MB resident.
    (
        spec.hidden,
        spec.layers,
        spec.heads,
        spec.head_dim,
        spec.experts,
        spec.expert_ffn,
    ) = (512, 4, 8, 64, 64, 512);
    if !path.exists() {
        sluice::synth::write_random_qwen3moe(&path, &spec, &mut |_, _| {}).unwrap();
    }
    let files = ModelFiles::open(&path).unwrap();
    let model = Model::load(
        &files,
        &LoadOptions {
            kv: sluice::model::KvTypes::default(),
            threads: 1,
            ctx: 64,
        },
    )
    .unwrap();
    let (routed, resident) = model.routed_and_resident_bytes(&files);
    // The budget holds the process too (binary, tokenizer, heap, activation buffers: the
    // planner's `process` line), so the whole resident set stays under it.
    let budget: u64 = 48 << 20;
    assert!(routed >= 4 * budget, "experts {routed} vs budget {budget}");
    drop(model);
    let json = dir.join("stats.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "run",
            path.to_str().unwrap(),
            "-n",
            "24",
            "--ignore-eos",
            "-t",
            "1",
            "-c",
            "64",
            "--experts",
            "stream",
        ])
        .args([
            "--ram",
            &budget.to_string(),
            "--usage-freeze",
            "--stats-json",
            json.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rss = v["peak_rss_bytes"].as_u64().unwrap();
    // Slack for what is allocated after the plan is made: reader and pool thread stacks,
    // allocator slack, the output text.
    let overhead: u64 = 4 << 20;
    eprintln!("peak RSS {rss}, budget {budget}, resident weights {resident}, routed {routed}");
    assert!(
        rss <= budget + overhead,
        "peak RSS {rss} > budget {budget} + {overhead}"
    );
    assert!(v["bytes_read"].as_u64().unwrap() > 0);
}
