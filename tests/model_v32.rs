//! DeepSeek-V3.2 sparse attention (DSA) against transformers 5.17 (a reference nobody here
//! wrote): tests/fixtures/models/deepseek_v32_sparse has `index_topk` 4 and 8 indexer heads, so
//! beyond the 4th token the lightning indexer decides which positions each query attends to.
//! The fixture's seed was chosen so that no top-k cut is a tie (smallest gap 5.9e-4, f32
//! rounding ~1e-6): every position is compared as for the other families
//! (max|Δlogits| / max|ref| <= 1e-4, same argmax), for prefill batches of 1 (every token a
//! decode step), 3 and 24, and the 16-token greedy continuation must be identical.

use serde_json::Value;
use sluice::format::ModelFiles;
use sluice::model::config::IndexerDims;
use sluice::model::{LoadOptions, Model};
use std::path::{Path, PathBuf};

fn dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

fn json(p: &Path) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
    )
    .unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn argmax(x: &[f32]) -> usize {
    let mut b = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[b] {
            b = i;
        }
    }
    b
}

/// max|a-b| / max|b| over each row, and whether every row's argmax agrees.
fn compare(ours: &[f32], refr: &[f32], v: usize) -> (f32, bool) {
    let mut worst = 0f32;
    let mut same = true;
    for (a, b) in ours.chunks(v).zip(refr.chunks(v)) {
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        worst = worst.max(err / scale);
        same &= argmax(a) == argmax(b);
    }
    (worst, same)
}

fn load(path: &Path) -> ModelFiles {
    ModelFiles::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every case's teacher-forced logits through the model at `path` (fixture folder `d` holds
/// the references), for several prefill batch sizes.
fn check_cases(d: &Path, path: &Path, what: &str) {
    let files = load(path);
    let model = Model::load(
        &files,
        &LoadOptions {
            threads: 2,
            ctx: 64,
        },
    )
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    let ix = model.cfg.indexer.expect("the fixture has an indexer");
    assert_eq!((ix.heads, ix.head_dim, ix.topk), (8, 16, 4), "{what}");
    let cases = json(&d.join("cases.json"));
    for case in cases["cases"].as_array().unwrap() {
        let toks = ids(&case["ids"]);
        let (shape, refr) =
            sluice::npy::read_f32(&d.join(case["logits"].as_str().unwrap())).unwrap();
        for batch in [1, 3, 24] {
            let mut st = model.new_state(64, batch, batch).unwrap();
            let mut ours = Vec::new();
            model.logits_all(&mut st, &toks, &mut ours).unwrap();
            assert_eq!(shape, vec![toks.len(), model.cfg.vocab], "{what}: shape");
            let (err, same) = compare(&ours, &refr, model.cfg.vocab);
            eprintln!(
                "deepseek_v32_sparse {what} {} batch {batch}: max|Δ|/max|ref| = {err:.2e}",
                case["name"]
            );
            assert!(
                err <= 1e-4 && same,
                "{what} {} batch {batch}: max|Δ|/max|ref| = {err:.2e}, argmax same: {same}",
                case["name"]
            );
        }
    }
}

fn check_greedy(d: &Path, path: &Path, what: &str) {
    let g = &json(&d.join("cases.json"))["greedy"];
    let (prompt, want) = (ids(&g["prompt_ids"]), ids(&g["tokens"]));
    let files = load(path);
    let model = Model::load(
        &files,
        &LoadOptions {
            threads: 2,
            ctx: 64,
        },
    )
    .unwrap();
    for batch in [1, 16] {
        let mut st = model.new_state(64, batch, 1).unwrap();
        let mut next = argmax(model.feed(&mut st, &prompt).unwrap()) as u32;
        let mut got = vec![next];
        while got.len() < want.len() {
            next = argmax(model.forward_chunk(&mut st, &[next], 0).unwrap()) as u32;
            got.push(next);
        }
        assert_eq!(got, want, "{what} batch {batch}: greedy continuation");
    }
}

#[test]
fn sparse_attention_logits_match_transformers() {
    let d = dir("deepseek_v32_sparse");
    check_cases(&d, &d, "safetensors");
}

#[test]
fn sparse_attention_greedy_matches_transformers() {
    let d = dir("deepseek_v32_sparse");
    check_greedy(&d, &d, "safetensors");
}

/// The control: the same weights with `index_topk` raised to the context (so every query
/// attends to every causal position: dense MLA) do not match transformers past `index_topk` tokens, so the comparisons above do
/// test the selection.
#[test]
fn dense_attention_does_not_match_past_index_topk() {
    let d = dir("deepseek_v32_sparse");
    let files = load(&d);
    let mut model = Model::load(
        &files,
        &LoadOptions {
            threads: 2,
            ctx: 64,
        },
    )
    .unwrap();
    let ix = model.cfg.indexer.unwrap();
    model.cfg.indexer = Some(IndexerDims { topk: 64, ..ix });
    let case = &json(&d.join("cases.json"))["cases"][2];
    let toks = ids(&case["ids"]);
    let (_, refr) = sluice::npy::read_f32(&d.join(case["logits"].as_str().unwrap())).unwrap();
    let mut st = model.new_state(64, 8, 8).unwrap();
    let mut ours = Vec::new();
    model.logits_all(&mut st, &toks, &mut ours).unwrap();
    let v = model.cfg.vocab;
    // Within index_topk (the first 4 positions) dense is exact; past it, it is not.
    let (err_in, _) = compare(&ours[..4 * v], &refr[..4 * v], v);
    let (err_past, _) = compare(&ours[4 * v..], &refr[4 * v..], v);
    eprintln!(
        "dense MLA vs sparse reference: first 4 positions {err_in:.2e}, later {err_past:.2e}"
    );
    assert!(err_in <= 1e-4, "{err_in}");
    assert!(err_past > 1e-2, "{err_past}");
}
