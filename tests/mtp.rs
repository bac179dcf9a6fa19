//! Multi-token prediction: the MTP head against transformers' MTP logits (fixtures made with
//! transformers' `MtpModel`, see tests/fixtures/models/README.md), and self-speculative decoding
//! that emits exactly the tokens plain decoding emits.

mod model_util;

use model_util::{dir, ids};
use serde_json::Value;
use sluice::format::ModelFiles;
use sluice::model::{LoadOptions, Model};
use std::path::Path;

fn check_mtp_logits(family: &str, model_path: &Path) {
    let d = dir(family);
    let files = ModelFiles::open(model_path).unwrap();
    let model = Model::load(
        &files,
        &LoadOptions {
            kv: sluice::model::KvTypes::F32,
            threads: 2,
            ctx: 64,
        },
    )
    .unwrap();
    assert!(
        model.has_mtp(),
        "{family}: MTP layer not loaded from {}",
        model_path.display()
    );
    let cases: Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("cases.json")).unwrap()).unwrap();
    let mtp: Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("mtp.json")).unwrap()).unwrap();
    for c in mtp["cases"].as_array().unwrap() {
        let name = c["case"].as_str().unwrap();
        let case = cases["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == name)
            .unwrap();
        let toks = ids(&case["ids"]);
        let t = toks.len();
        let mut st = model.new_state_mtp(64, 32, 32).unwrap();
        model.forward_chunk(&mut st, &toks, t).unwrap();
        model.mtp_take_hidden(&mut st, 0, t - 1, 0);
        let got = model.mtp_forward(&mut st, &toks[1..], 0).unwrap().to_vec();
        let (shape, want) = sluice::npy::read_f32(&d.join(c["logits"].as_str().unwrap())).unwrap();
        assert_eq!(shape, vec![t - 1, model.cfg.vocab]);
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let err = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!(
            "{family} {} MTP {name}: max|Δ|/max|ref| = {:.2e}",
            model_path.display(),
            err / scale
        );
        assert!(err <= 1e-4 * scale, "{family} MTP {name}: {}", err / scale);
    }
}

#[test]
fn mtp_logits_match_transformers() {
    check_mtp_logits("deepseek_v3", &dir("deepseek_v3"));
    check_mtp_logits("glm4_moe", &dir("glm4_moe"));
    check_mtp_logits("glm4_moe", &dir("glm4_moe").join("model-f32.gguf"));
}

/// With `--mtp K` the emitted tokens are exactly plain decoding's, at temperature 0, for every
/// K, prefill batch and file format; and drafts are actually accepted sometimes.
#[test]
fn speculative_decoding_emits_plain_greedy_tokens() {
    use sluice::generate::{generate, generate_mtp, load_tokenizer};
    use sluice::sample::{Sampler, SamplingParams};
    for (family, path) in [
        ("deepseek_v3", dir("deepseek_v3")),
        ("glm4_moe", dir("glm4_moe")),
        ("glm4_moe", dir("glm4_moe").join("model-f32.gguf")),
    ] {
        let files = ModelFiles::open(&path).unwrap();
        let model = Model::load(
            &files,
            &LoadOptions {
                kv: sluice::model::KvTypes::F32,
                threads: 2,
                ctx: 128,
            },
        )
        .unwrap();
        let tok = load_tokenizer(&files).unwrap();
        let g: Value = serde_json::from_str(
            &std::fs::read_to_string(dir(family).join("greedy.json")).unwrap(),
        )
        .unwrap();
        let prompt = ids(&g["prompt_ids"]);
        let mut st = model.new_state(128, 8, 4).unwrap();
        let mut sampler = Sampler::new(SamplingParams::greedy(), model.cfg.vocab);
        let (plain, _) = generate(
            &model,
            &mut st,
            &tok,
            &mut sampler,
            &prompt,
            24,
            true,
            &mut |_| true,
        )
        .unwrap();
        assert_eq!(
            &plain[..16],
            &ids(&g["new_ids"])[..],
            "{family}: plain greedy vs transformers"
        );
        let mut accepted = 0;
        for k in 1..=3 {
            for batch in [k + 1, 8] {
                let mut st = model.new_state_mtp(128, batch, k + 1).unwrap();
                let mut sampler = Sampler::new(SamplingParams::greedy(), model.cfg.vocab);
                let (spec, stats) = generate_mtp(
                    &model,
                    &mut st,
                    &tok,
                    &mut sampler,
                    &prompt,
                    24,
                    true,
                    k,
                    &mut |_| true,
                )
                .unwrap();
                assert_eq!(
                    spec,
                    plain,
                    "{family} {}: --mtp {k} batch {batch}",
                    path.display()
                );
                assert!(stats.mtp_drafted > 0);
                accepted += stats.mtp_accepted;
            }
        }
        eprintln!(
            "{family} {}: accepted {accepted} drafts over k = 1..3",
            path.display()
        );
    }
}

/// Above temperature 0 speculative sampling still runs, repeats under a seed, and stays in vocab.
#[test]
fn speculative_sampling_is_seeded() {
    use sluice::generate::{generate_mtp, load_tokenizer};
    use sluice::sample::{Sampler, SamplingParams};
    let files = ModelFiles::open(&dir("deepseek_v3")).unwrap();
    let model = Model::load(
        &files,
        &LoadOptions {
            kv: sluice::model::KvTypes::F32,
            threads: 2,
            ctx: 128,
        },
    )
    .unwrap();
    let tok = load_tokenizer(&files).unwrap();
    let run = || {
        let mut st = model.new_state_mtp(128, 4, 3).unwrap();
        let params = SamplingParams {
            temperature: 1.0,
            seed: 11,
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(params, model.cfg.vocab);
        generate_mtp(
            &model,
            &mut st,
            &tok,
            &mut sampler,
            &[3, 4, 5],
            20,
            true,
            2,
            &mut |_| true,
        )
        .unwrap()
        .0
    };
    let a = run();
    assert_eq!(a.len(), 20);
    assert_eq!(a, run());
    assert!(a.iter().all(|&t| (t as usize) < model.cfg.vocab));
}

/// Drafts that are right (and, every fourth one, wrong on purpose) drive the acceptance,
/// rollback and MTP catch-up paths; the output must still be plain greedy's.
#[test]
fn accepted_and_rejected_drafts_keep_greedy_output() {
    use sluice::generate::{generate, generate_mtp_with, load_tokenizer};
    use sluice::sample::{Sampler, SamplingParams};
    for (family, path) in [
        ("deepseek_v3", dir("deepseek_v3")),
        ("glm4_moe", dir("glm4_moe").join("model-f32.gguf")),
    ] {
        let files = ModelFiles::open(&path).unwrap();
        let model = Model::load(
            &files,
            &LoadOptions {
                kv: sluice::model::KvTypes::F32,
                threads: 2,
                ctx: 128,
            },
        )
        .unwrap();
        let tok = load_tokenizer(&files).unwrap();
        let prompt = [5u32, 17, 99, 4, 42, 8];
        let mut st = model.new_state(128, 8, 4).unwrap();
        let mut sampler = Sampler::new(SamplingParams::greedy(), model.cfg.vocab);
        let (plain, _) = generate(
            &model,
            &mut st,
            &tok,
            &mut sampler,
            &prompt,
            30,
            true,
            &mut |_| true,
        )
        .unwrap();
        let mut oracle = plain.clone();
        for (i, t) in oracle.iter_mut().enumerate() {
            if i % 4 == 3 {
                *t = (*t + 1) % model.cfg.vocab as u32;
            }
        }
        for k in 1..=3 {
            let mut st = model.new_state_mtp(128, 4, 4).unwrap();
            let mut sampler = Sampler::new(SamplingParams::greedy(), model.cfg.vocab);
            let (spec, stats) = generate_mtp_with(
                &model,
                &mut st,
                &tok,
                &mut sampler,
                &prompt,
                30,
                true,
                k,
                Some(&oracle),
                &mut |_| true,
            )
            .unwrap();
            assert_eq!(spec, plain, "{family}: --mtp {k} with oracle drafts");
            assert!(
                stats.mtp_accepted > 0 && stats.mtp_accepted < stats.mtp_drafted,
                "{family} k {k}: {}/{}",
                stats.mtp_accepted,
                stats.mtp_drafted
            );
            assert!(
                stats.decode_steps < 29,
                "{family} k {k}: accepted drafts save forwards ({} steps)",
                stats.decode_steps
            );
        }
    }
}

/// Above temperature 0 the draft and verify distributions go through the sampler's filters:
/// with top-k 1 both are point masses on their arg-max, so speculative sampling must emit plain
/// greedy's tokens whatever the coin flips (exactness of the rule itself is enumerated in
/// src/speculative.rs).
#[test]
fn speculative_sampling_with_top_k_1_is_greedy() {
    use sluice::generate::{generate, generate_mtp, load_tokenizer};
    use sluice::sample::{Sampler, SamplingParams};
    let files = ModelFiles::open(&dir("deepseek_v3")).unwrap();
    let model = Model::load(
        &files,
        &LoadOptions {
            kv: sluice::model::KvTypes::F32,
            threads: 2,
            ctx: 128,
        },
    )
    .unwrap();
    let tok = load_tokenizer(&files).unwrap();
    let prompt = [5u32, 17, 99, 4];
    let mut st = model.new_state(128, 4, 4).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy(), model.cfg.vocab);
    let (plain, _) = generate(
        &model,
        &mut st,
        &tok,
        &mut sampler,
        &prompt,
        20,
        true,
        &mut |_| true,
    )
    .unwrap();
    for (k, seed) in [(1, 1u64), (2, 2), (3, 3)] {
        let mut st = model.new_state_mtp(128, 4, 4).unwrap();
        let params = SamplingParams {
            temperature: 0.7,
            top_k: 1,
            seed,
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(params, model.cfg.vocab);
        let (spec, stats) = generate_mtp(
            &model,
            &mut st,
            &tok,
            &mut sampler,
            &prompt,
            20,
            true,
            k,
            &mut |_| true,
        )
        .unwrap();
        assert_eq!(spec, plain, "--mtp {k} at top-k 1");
        assert!(stats.mtp_drafted > 0);
    }
}

/// The end-of-run figures with `--mtp`: experts per token without MTP is top-k x MoE layers
/// (what plain decode measures), with MTP it is the main model's forwards plus the head's, and
/// the CLI prints both with the acceptance rate, on stderr and in `--stats-json`.
#[test]
fn summary_reports_acceptance_and_experts_with_and_without_mtp() {
    use sluice::generate::{generate, generate_mtp, load_tokenizer};
    use sluice::sample::{Sampler, SamplingParams};
    let path = dir("glm4_moe").join("model-f32.gguf");
    let files = ModelFiles::open(&path).unwrap();
    let model = Model::load(
        &files,
        &LoadOptions {
            kv: sluice::model::KvTypes::F32,
            threads: 2,
            ctx: 128,
        },
    )
    .unwrap();
    let tok = load_tokenizer(&files).unwrap();
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(dir("glm4_moe").join("config.json")).unwrap(),
    )
    .unwrap();
    let u = |k: &str| cfg[k].as_u64().unwrap() as f64;
    let plain_want =
        u("num_experts_per_tok") * (u("num_hidden_layers") - u("first_k_dense_replace"));
    let prompt = [5u32, 17, 99, 4];
    let mut st = model.new_state(128, 4, 1).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy(), model.cfg.vocab);
    let (_, plain) = generate(
        &model,
        &mut st,
        &tok,
        &mut sampler,
        &prompt,
        16,
        true,
        &mut |_| true,
    )
    .unwrap();
    assert_eq!(plain.experts_per_token, plain_want);
    assert_eq!(plain.experts_per_token_plain, plain_want);
    let mut st = model.new_state_mtp(128, 4, 3).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy(), model.cfg.vocab);
    let (_, s) = generate_mtp(
        &model,
        &mut st,
        &tok,
        &mut sampler,
        &prompt,
        16,
        true,
        2,
        &mut |_| true,
    )
    .unwrap();
    assert_eq!(s.experts_per_token_plain, plain_want);
    assert!(
        (s.experts_per_token - s.mtp_experts_main_per_token - s.mtp_experts_head_per_token).abs()
            < 1e-9
    );
    // The verify batches are wider than one token, and the head adds its own.
    assert!(s.mtp_experts_main_per_token > 0.0 && s.mtp_experts_head_per_token > 0.0);
    let line = s.timing_line();
    assert!(line.contains("without --mtp"), "{line}");
    assert!(line.contains("mtp accepted"), "{line}");

    let json = std::env::temp_dir().join(format!("sluice-mtp-stats-{}.json", std::process::id()));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("run")
        .arg(&path)
        .args([
            "-p",
            "The keeper",
            "-n",
            "12",
            "--temp",
            "0",
            "--ignore-eos",
            "-t",
            "1",
        ])
        .args(["--mtp", "2", "--stats-json", json.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("without --mtp"), "{stderr}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    for k in [
        "mtp_drafted",
        "mtp_accepted",
        "mtp_acceptance",
        "tokens_per_forward",
        "decode_forwards",
        "experts_per_token_main",
        "experts_per_token_mtp_head",
    ] {
        assert!(v[k].is_number(), "--stats-json lacks {k}: {v}");
    }
    assert_eq!(v["experts_per_token_without_mtp"], plain_want);
    let acc = v["mtp_accepted"].as_f64().unwrap() / v["mtp_drafted"].as_f64().unwrap();
    assert!((v["mtp_acceptance"].as_f64().unwrap() - acc).abs() < 1e-12);
}
