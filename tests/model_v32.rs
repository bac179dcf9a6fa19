//! DeepSeek-V3.2 sparse attention (DSA) against transformers 5.17 (a reference nobody here
//! wrote): tests/fixtures/models/deepseek_v32_sparse has `index_topk` 4 and 8 indexer heads, so
//! beyond the 4th token the lightning indexer decides which positions each query attends to.
//! The fixture's seed was chosen so that no top-k cut is a tie (smallest gap 5.9e-4, f32
//! rounding ~1e-6): every position is compared as for the other families
//! (max|Δlogits| / max|ref| <= 1e-4, same argmax), for prefill batches of 1 (every token a
//! decode step), 3 and 24, and the 16-token greedy continuation must be identical. The same
//! weights are also written as a llama.cpp `deepseek32` GGUF by the `gguf` package's own
//! GGUFWriter, tensor names from its own name map, and must match the same references.

mod model_util;

use model_util::{argmax, compare, dir, ids, json};
use sluice::format::ModelFiles;
use sluice::model::config::IndexerDims;
use sluice::model::{LoadOptions, Model};
use std::path::Path;
use std::process::Command;

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
            kv: sluice::model::KvTypes::F32,
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
            kv: sluice::model::KvTypes::F32,
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
            kv: sluice::model::KvTypes::F32,
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

/// The fixture as a llama.cpp `deepseek32` GGUF, written by scripts/mla_fixture_to_gguf.py
/// (gguf-py's own writer and name tables), matches the same references.
#[test]
fn deepseek32_gguf_matches_transformers() {
    let d = dir("deepseek_v32_sparse");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("v32-sparse-deepseek32.gguf");
    let run = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/mla_fixture_to_gguf.py"))
        .arg(&d)
        .arg(&out)
        .output()
        .expect("python3 with the gguf package (.ci/run installs it)");
    assert!(
        run.status.success(),
        "writing the deepseek32 GGUF failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let files = load(&out);
    let names: Vec<&str> = files.tensors().iter().map(|t| t.name.as_str()).collect();
    for want in [
        "blk.1.indexer.attn_q_b.weight",
        "blk.1.indexer.attn_k.weight",
        "blk.1.indexer.k_norm.weight",
        "blk.1.indexer.k_norm.bias",
        "blk.1.indexer.proj.weight",
    ] {
        assert!(names.contains(&want), "{want} not in {names:?}");
    }
    drop(files);
    check_cases(&d, &out, "gguf deepseek32");
    check_greedy(&d, &out, "gguf deepseek32");
}
