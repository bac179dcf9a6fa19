//! The forward pass against Hugging Face transformers (a reference nobody here wrote).
//!
//! Fixtures: tests/fixtures/models/<family>/ made by scripts/make_model_fixtures.py — tiny
//! random-weight models saved by transformers (safetensors + config.json), transformers'
//! float32 logits for fixed token sequences (`cases.json`, `logits_case*.npy`), 16 greedy
//! tokens (`greedy.json`), and GGUF conversions of the same weights by llama.cpp's own
//! converter (`model-f32.gguf`, `model-q8_0.gguf`).
//!
//! Assertions: f32 runs give max|Δlogits| / max|ref| <= 1e-4 at every position with the same
//! argmax, and the same greedy continuation; Q8_0 runs (quantized weights, tiny models with
//! near-tied routers) are compared by KL divergence and top-1 agreement instead.

mod model_util;

use model_util::{argmax, compare, dir, ids, json};
use sluice::format::ModelFiles;
use sluice::model::{LoadOptions, Model};
use std::path::Path;

const FAMILIES: &[&str] = &["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe"];

/// Teacher-forced logits of `tokens` through the model at `path`, with prefill batch `batch`.
fn logits(path: &Path, tokens: &[u32], batch: usize) -> (Vec<f32>, usize) {
    let files = ModelFiles::open(path).unwrap_or_else(|e| panic!("{e}"));
    let model = Model::load(
        &files,
        &LoadOptions {
            kv: sluice::model::KvTypes::F32,
            threads: 2,
            ctx: 256,
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut st = model.new_state(256, batch, batch).unwrap();
    let mut out = Vec::new();
    model.logits_all(&mut st, tokens, &mut out).unwrap();
    (out, model.cfg.vocab)
}

fn check_cases(family: &str, model_path: &Path, what: &str) {
    let d = dir(family);
    let cases = json(&d.join("cases.json"));
    for case in cases["cases"].as_array().unwrap() {
        let toks = ids(&case["ids"]);
        let (shape, refr) =
            sluice::npy::read_f32(&d.join(case["logits"].as_str().unwrap())).unwrap();
        for batch in [1, 5, 64] {
            let (ours, v) = logits(model_path, &toks, batch);
            assert_eq!(shape, vec![toks.len(), v], "{family} {what}: logits shape");
            let (err, same) = compare(&ours, &refr, v);
            eprintln!(
                "{family} {what} {} batch {batch}: max|Δ|/max|ref| = {err:.2e}",
                case["name"]
            );
            assert!(
                err <= 1e-4,
                "{family} {what} {}: max|Δ|/max|ref| = {err:.2e} (batch {batch})",
                case["name"]
            );
            assert!(
                same,
                "{family} {what} {}: argmax differs (batch {batch})",
                case["name"]
            );
        }
    }
}

fn check_greedy(family: &str, model_path: &Path) {
    let g = json(&dir(family).join("greedy.json"));
    let prompt = ids(&g["prompt_ids"]);
    let want = ids(&g["new_ids"]);
    let files = ModelFiles::open(model_path).unwrap();
    let model = Model::load(
        &files,
        &LoadOptions {
            kv: sluice::model::KvTypes::F32,
            threads: 2,
            ctx: 128,
        },
    )
    .unwrap();
    let mut st = model.new_state(128, 16, 1).unwrap();
    let mut next = argmax(model.feed(&mut st, &prompt).unwrap()) as u32;
    let mut got = vec![next];
    while got.len() < want.len() {
        next = argmax(model.forward_chunk(&mut st, &[next], 0).unwrap()) as u32;
        got.push(next);
    }
    assert_eq!(
        got, want,
        "{family}: greedy continuation differs from transformers"
    );
}

#[test]
fn safetensors_logits_match_transformers() {
    for f in FAMILIES {
        check_cases(f, &dir(f), "safetensors");
    }
}

#[test]
fn safetensors_greedy_matches_transformers() {
    for f in FAMILIES {
        check_greedy(f, &dir(f));
    }
}

#[test]
fn gguf_f32_logits_match_transformers() {
    for f in FAMILIES {
        check_cases(f, &dir(f).join("model-f32.gguf"), "gguf f32");
        check_greedy(f, &dir(f).join("model-f32.gguf"));
    }
}

/// KL(ref || ours) per position and top-1 agreement for the Q8_0 conversion.
#[test]
fn gguf_q8_0_close_to_transformers() {
    for f in FAMILIES {
        let d = dir(f);
        let cases = json(&d.join("cases.json"));
        let mut agree = 0usize;
        let mut total = 0usize;
        let mut worst_kl = 0f64;
        for case in cases["cases"].as_array().unwrap() {
            let toks = ids(&case["ids"]);
            let (_, refr) =
                sluice::npy::read_f32(&d.join(case["logits"].as_str().unwrap())).unwrap();
            let (ours, v) = logits(&d.join("model-q8_0.gguf"), &toks, 8);
            for (a, b) in ours.chunks(v).zip(refr.chunks(v)) {
                let lse = |x: &[f32]| {
                    let m = x.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v)) as f64;
                    m + x.iter().map(|v| (*v as f64 - m).exp()).sum::<f64>().ln()
                };
                let (la, lb) = (lse(a), lse(b));
                let kl: f64 = a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| {
                        let (lp, lq) = (*y as f64 - lb, *x as f64 - la);
                        lp.exp() * (lp - lq)
                    })
                    .sum();
                worst_kl = worst_kl.max(kl);
                agree += (argmax(a) == argmax(b)) as usize;
                total += 1;
            }
        }
        eprintln!("{f} q8_0: worst KL {worst_kl:.2e}, top-1 agreement {agree}/{total}");
        assert!(worst_kl < 0.02, "{f} q8_0: KL {worst_kl} too large");
        assert!(
            agree * 10 >= total * 9,
            "{f} q8_0: top-1 agreement {agree}/{total}"
        );
    }
}

/// DeepSeek-V3.2 (DSA indexer) within `index_topk` tokens: transformers' logits, computed with
/// the indexer selecting every causal token, equal sluice's (dense) MLA. Beyond `index_topk`:
/// tests/model_v32.rs.
#[test]
fn deepseek_v32_within_index_topk_matches_transformers() {
    let d = dir("deepseek_v32");
    let cases = json(&d.join("cases.json"));
    for case in cases["cases"].as_array().unwrap() {
        let toks = ids(&case["ids"]);
        let (_, refr) = sluice::npy::read_f32(&d.join(case["logits"].as_str().unwrap())).unwrap();
        let files = ModelFiles::open(&d).unwrap();
        let model = Model::load(
            &files,
            &LoadOptions {
                kv: sluice::model::KvTypes::F32,
                threads: 2,
                ctx: 64,
            },
        )
        .unwrap();
        let mut st = model.new_state(64, 8, 8).unwrap();
        let mut ours = Vec::new();
        model.logits_all(&mut st, &toks, &mut ours).unwrap();
        let (err, same) = compare(&ours, &refr, model.cfg.vocab);
        eprintln!("deepseek_v32 {}: {err:.2e}", case["name"]);
        assert!(err <= 1e-4 && same, "deepseek_v32 {}: {err}", case["name"]);
    }
}
