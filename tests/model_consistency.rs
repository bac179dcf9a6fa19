//! Self-consistency of the forward pass on the built-in default model: batched prefill and
//! token-by-token decode must give the same logits (same math, different batching), and
//! the batch size must not change the result. (Correctness against transformers is in
//! tests/model_reference.rs; this guards the KV cache and batching paths on a quantized GGUF.)

use sluice::format::ModelFiles;
use sluice::model::{LoadOptions, Model};

fn default_model() -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("model-errors-cache");
    std::env::set_var("SLUICE_CACHE_DIR", &dir);
    sluice::default_model::ensure_random().expect("write default model")
}

#[test]
fn batched_prefill_matches_token_by_token() {
    let path = default_model();
    let files = ModelFiles::open(&path).unwrap();
    let model = Model::load(
        &files,
        &LoadOptions {
            kv: sluice::model::KvTypes::default(),
            threads: 2,
            ctx: 64,
        },
    )
    .unwrap();
    let v = model.cfg.vocab;
    let tokens: Vec<u32> = (0..20).map(|i| (i * 37 + 11) % v as u32).collect();

    let mut all = Vec::new();
    let mut st = model.new_state(64, 8, 8).unwrap();
    model.logits_all(&mut st, &tokens, &mut all).unwrap();
    assert_eq!(all.len(), tokens.len() * v);
    assert!(all.iter().all(|x| x.is_finite()));

    let mut st1 = model.new_state(64, 1, 1).unwrap();
    for (i, &t) in tokens.iter().enumerate() {
        let l = model.forward_chunk(&mut st1, &[t], 0).unwrap();
        let r = &all[i * v..(i + 1) * v];
        let scale = r.iter().fold(0f32, |m, x| m.max(x.abs()));
        let err = l.iter().zip(r).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= 1e-4 * scale.max(1.0),
            "position {i}: max diff {err} (scale {scale})"
        );
    }
    // feed() returns the last position's logits.
    let mut st2 = model.new_state(64, 5, 1).unwrap();
    let last = model.feed(&mut st2, &tokens).unwrap().to_vec();
    let r = &all[(tokens.len() - 1) * v..];
    let err = last
        .iter()
        .zip(r)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(err < 1e-3, "feed vs logits_all: {err}");
}

/// Each expert's recorded byte ranges are exactly the bytes its views read (the streaming
/// cache reads by range, the resident path by view: they must agree).
#[test]
fn expert_ranges_address_the_viewed_bytes() {
    let mut paths = vec![default_model()];
    let hf = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/mixtral");
    paths.push(hf.clone());
    paths.push(hf.join("model-q8_0.gguf"));
    for path in paths {
        let files = ModelFiles::open(&path).unwrap();
        let model = Model::load(
            &files,
            &LoadOptions {
                kv: sluice::model::KvTypes::default(),
                threads: 1,
                ctx: 16,
            },
        )
        .unwrap();
        for layer in &model.weights.layers {
            for e in layer.moe().map(|m| &m.experts[..]).unwrap_or(&[]) {
                for (view, range) in [e.gate, e.up, e.down].iter().zip(e.ranges) {
                    let b = files.range_bytes(range).unwrap();
                    assert_eq!(b.as_ptr(), view.bytes.as_ptr(), "{}", path.display());
                    assert_eq!(b.len(), view.bytes.len(), "{}", path.display());
                }
            }
        }
    }
}
