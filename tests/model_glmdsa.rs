//! GLM-5 (`GlmMoeDsaForCausalLM`, GGUF `glm-dsa`) against transformers (a reference nobody here
//! wrote): tests/fixtures/models/glm_moe_dsa (scripts/make_variant_fixtures.py) is DeepSeek-V3.2's
//! MLA + DSA with `index_topk` 4, the indexer rotated interleaved, and `indexer_types` full /
//! shared / full / shared, so past the 4th token the indexer chooses the attended positions and
//! layers 1 and 3 reuse the choice of layers 0 and 2. Every position is compared as for the
//! other families (max|Δlogits| / max|ref| <= 1e-4, same argmax) for prefill batches of 1, 3
//! and 24, the 16-token greedy continuation must be identical, and the same holds for the
//! weights written as a `glm-dsa` GGUF (with and without `attention.indexer.types`). Controls
//! show both GLM-5 differences are exercised: a half-split indexer rotation does not match.
//! Streamed experts (safetensors and GGUF; direct, buffered and mmap reads; caches of 1, 3
//! and every expert per layer) give logits and greedy tokens bit-identical to resident ones.

mod model_util;

use model_util::{argmax, compare, dir, ids, json};
use sluice::experts::{CacheConfig, IoMode};
use sluice::format::ModelFiles;
use sluice::model::config::{Family, IndexerDims, RopeLayout};
use sluice::model::{LoadOptions, Model};
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture() -> PathBuf {
    dir("glm_moe_dsa")
}

fn load(path: &Path) -> ModelFiles {
    ModelFiles::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn model(files: &ModelFiles) -> Model<'_> {
    Model::load(
        files,
        &LoadOptions {
            kv: sluice::model::KvTypes::F32,
            threads: 2,
            ctx: 64,
        },
    )
    .unwrap()
}

/// Worst max|Δ|/max|ref| over every case and prefill batch, and whether every argmax agreed.
fn worst(model: &Model<'_>) -> (f32, bool) {
    let d = fixture();
    let (mut err, mut same) = (0f32, true);
    for case in json(&d.join("cases.json"))["cases"].as_array().unwrap() {
        let toks = ids(&case["ids"]);
        let (shape, refr) =
            sluice::npy::read_f32(&d.join(case["logits"].as_str().unwrap())).unwrap();
        assert_eq!(shape, vec![toks.len(), model.cfg.vocab]);
        for batch in [1, 3, 24] {
            let mut st = model.new_state(64, batch, batch).unwrap();
            let mut ours = Vec::new();
            model.logits_all(&mut st, &toks, &mut ours).unwrap();
            let (e, s) = compare(&ours, &refr, model.cfg.vocab);
            err = err.max(e);
            same &= s;
        }
    }
    (err, same)
}

fn check(path: &Path, what: &str) {
    let files = load(path);
    let m = model(&files);
    assert_eq!(m.cfg.family, Family::GlmDsa, "{what}");
    let ix = m.cfg.indexer.expect("the fixture has an indexer");
    assert_eq!(
        (ix.heads, ix.head_dim, ix.topk, ix.rope),
        (8, 16, 4, RopeLayout::Interleaved),
        "{what}"
    );
    assert_eq!(m.cfg.indexer_full, [true, false, true, false], "{what}");
    let (err, same) = worst(&m);
    eprintln!("glm_moe_dsa {what}: worst max|Δ|/max|ref| = {err:.2e}");
    assert!(
        err <= 1e-4 && same,
        "{what}: {err:.2e}, argmax same: {same}"
    );
    // Greedy continuation, decode one token at a time after a batched prompt.
    let g = &json(&fixture().join("cases.json"))["greedy"];
    let (prompt, want) = (ids(&g["prompt_ids"]), ids(&g["tokens"]));
    for batch in [1, 16] {
        let mut st = m.new_state(64, batch, 1).unwrap();
        let mut next = argmax(m.feed(&mut st, &prompt).unwrap()) as u32;
        let mut got = vec![next];
        while got.len() < want.len() {
            next = argmax(m.forward_chunk(&mut st, &[next], 0).unwrap()) as u32;
            got.push(next);
        }
        assert_eq!(got, want, "{what} batch {batch}: greedy continuation");
    }
}

#[test]
fn safetensors_match_transformers() {
    check(&fixture(), "safetensors");
}

/// The controls: V3.2's half-split indexer rotation, or every query attending densely, do not
/// match past `index_topk` tokens, so the comparisons above test both GLM-5 differences.
#[test]
fn half_split_indexer_or_dense_attention_do_not_match() {
    let files = load(&fixture());
    let mut m = model(&files);
    let ix = m.cfg.indexer.unwrap();
    m.cfg.indexer = Some(IndexerDims {
        rope: RopeLayout::HalfSplit,
        ..ix
    });
    let (err, _) = worst(&m);
    eprintln!("half-split indexer rotation: {err:.2e}");
    assert!(err > 1e-3, "{err}");
    m.cfg.indexer = Some(IndexerDims { topk: 64, ..ix });
    let (err, _) = worst(&m);
    eprintln!("dense attention: {err:.2e}");
    assert!(err > 1e-3, "{err}");
}

fn write_gguf(extra: &[&str], name: &str) -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let run = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/mla_fixture_to_gguf.py"))
        .arg(fixture())
        .arg(&out)
        .args(["--arch", "glm-dsa"])
        .args(extra)
        .output()
        .expect("python3 with the gguf package (.ci/run installs it)");
    assert!(
        run.status.success(),
        "writing the glm-dsa GGUF failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    out
}

/// The same weights as llama.cpp's `glm-dsa` GGUF (scripts/mla_fixture_to_gguf.py, gguf-py's
/// writer and name tables): with `attention.indexer.types`, and without it (unsloth's files:
/// the shared layers then tell by having no `blk.N.indexer.*` tensors).
#[test]
fn glm_dsa_gguf_matches_transformers() {
    let with = write_gguf(&[], "glm-dsa.gguf");
    let files = load(&with);
    let names: Vec<&str> = files.tensors().iter().map(|t| t.name.as_str()).collect();
    assert!(names.contains(&"blk.2.indexer.attn_k.weight"), "{names:?}");
    assert!(!names.iter().any(|n| n.starts_with("blk.1.indexer.")));
    assert!(files.meta("glm-dsa.attention.indexer.types").is_some());
    drop(files);
    check(&with, "gguf glm-dsa");
    let without = write_gguf(&["--no-indexer-types"], "glm-dsa-no-types.gguf");
    assert!(load(&without)
        .meta("glm-dsa.attention.indexer.types")
        .is_none());
    check(&without, "gguf glm-dsa, types from the tensors");
}

/// A config whose first layer is "shared" is refused with one line naming the field.
#[test]
fn shared_first_layer_is_refused() {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("glm-dsa-bad-types");
    std::fs::create_dir_all(&d).unwrap();
    let mut cfg = json(&fixture().join("config.json"));
    cfg["indexer_types"] = serde_json::json!(["shared", "full", "full", "shared"]);
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(
        fixture().join("model.safetensors"),
        d.join("model.safetensors"),
    )
    .unwrap();
    let e = Model::load(
        &load(&d),
        &LoadOptions {
            kv: sluice::model::KvTypes::F32,
            threads: 1,
            ctx: 64,
        },
    )
    .err()
    .expect("a shared first layer must be refused")
    .to_string();
    assert!(e.contains("indexer_types") && e.contains("layer 0"), "{e}");
}

/// Streaming never changes the numbers: with the routed experts read through the expert cache
/// (every IO mode; one slot per layer, three, or all eight), the logits of the longest case
/// (24 tokens, so the indexer picks the attended positions) are bit-identical to the resident
/// run's for prefill batches of 1 and 8, and a streamed greedy decode gives the resident
/// decode's logits bit for bit and the transformers tokens. Both checkpoint layouts: per-expert
/// safetensors tensors and the GGUF's fused `ffn_*_exps`.
#[test]
fn streamed_experts_are_bit_identical_to_resident() {
    let gguf = write_gguf(&[], "glm-dsa-stream.gguf");
    for (path, what) in [(fixture(), "safetensors"), (gguf, "gguf glm-dsa")] {
        streamed_matches_resident(&path, what);
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn streamed_matches_resident(path: &Path, what: &str) {
    let files = load(path);
    let m = model(&files);
    let n_exp = m.cfg.n_experts;
    assert_eq!(n_exp, 8, "{what}");
    let cases = json(&fixture().join("cases.json"));
    let toks = ids(&cases["cases"][2]["ids"]);
    assert!(toks.len() > m.cfg.indexer.unwrap().topk, "{what}");
    let g = &cases["greedy"];
    let (prompt, want) = (ids(&g["prompt_ids"]), ids(&g["tokens"]));
    let cache = |io: IoMode, slots: usize| {
        let mut c = CacheConfig::new(slots);
        c.io = io;
        m.expert_cache(&files, c).unwrap()
    };
    let logits = |batch: usize, cache: Option<sluice::experts::ExpertCache>| {
        let mut st = m.new_state(64, batch, batch).unwrap();
        if let Some(c) = cache {
            st.attach_experts(c);
        }
        let mut out = Vec::new();
        m.logits_all(&mut st, &toks, &mut out).unwrap();
        (bits(&out), st.expert_stats())
    };
    // Greedy: the prompt as one chunk, then one token per step; every step's logits kept.
    let greedy = |cache: Option<sluice::experts::ExpertCache>| {
        let mut st = m.new_state(64, 8, 1).unwrap();
        if let Some(c) = cache {
            st.attach_experts(c);
        }
        let first = m.feed(&mut st, &prompt).unwrap().to_vec();
        let mut next = argmax(&first) as u32;
        let (mut toks, mut all) = (vec![next], bits(&first));
        while toks.len() < want.len() {
            let l = m.forward_chunk(&mut st, &[next], 0).unwrap();
            all.extend(bits(l));
            next = argmax(l) as u32;
            toks.push(next);
        }
        (toks, all, st.expert_stats())
    };
    let (reference, _) = logits(8, None);
    let (ref_toks, ref_greedy, _) = greedy(None);
    assert_eq!(ref_toks, want, "{what}: resident greedy continuation");
    for io in [IoMode::Direct, IoMode::Buffered, IoMode::Mmap] {
        let probe = cache(io, 1);
        if probe.io_mode() != io {
            eprintln!("{what}: {io:?} fell back to {:?}", probe.io_mode());
        }
        drop(probe);
        for slots in [1, 3, n_exp] {
            for batch in [1, 8] {
                let (got, stats) = logits(batch, Some(cache(io, slots)));
                let stats = stats.unwrap();
                assert!(
                    stats.misses > 0,
                    "{what} io {io:?} slots {slots}: the cache read nothing"
                );
                // Fewer slots than the experts a layer routes to must evict and re-read.
                if slots == 1 {
                    assert!(stats.misses > (n_exp as u64), "{what}: {stats:?}");
                }
                assert_eq!(
                    got, reference,
                    "{what} io {io:?} slots {slots} batch {batch}: logits"
                );
            }
            let (toks, all, stats) = greedy(Some(cache(io, slots)));
            assert!(stats.unwrap().misses > 0);
            assert_eq!(toks, want, "{what} io {io:?} slots {slots}: greedy tokens");
            assert_eq!(
                all, ref_greedy,
                "{what} io {io:?} slots {slots}: greedy logits"
            );
        }
    }
}
