//! DeepSeek-V4's MTP block (issue 18 item 1): the MTP head against reference logits, and
//! `--mtp` decoding that emits plain greedy's tokens.
//!
//! Fixture: tests/fixtures/models/deepseek_v4_mtp, made by
//! scripts/make_deepseek_v4_mtp_fixtures.py: the deepseek_v4 fixture plus a random `mtp.0.*`
//! block under DeepSeek's checkpoint names. No library implements V4's MTP (transformers 5.25
//! drops `mtp.*`; llama.cpp's deepseek4 converter drops it too), so the reference logits come
//! from a small PyTorch reimplementation of DeepSeek's `MTPBlock.forward` (inference/model.py)
//! in that script, over transformers' own decoder layer, HyperHead, norms, rope and mask.

mod model_util;

use model_util::{argmax, dir, ids, json};
use sluice::format::ModelFiles;
use sluice::generate::{generate, generate_mtp, generate_mtp_with, load_tokenizer};
use sluice::model::{LoadOptions, Model};
use sluice::sample::{Sampler, SamplingParams};

const OPTS: LoadOptions = LoadOptions {
    kv: sluice::model::KvTypes::F32,
    threads: 2,
    ctx: 64,
};

#[test]
fn v4_mtp_logits_match_reference() {
    let d = dir("deepseek_v4_mtp");
    let files = ModelFiles::open(&d).unwrap();
    let model = Model::load(&files, &OPTS).unwrap();
    assert!(model.has_mtp(), "no MTP block loaded");
    let v = model.cfg.vocab;
    let mtp = json(&d.join("mtp.json"));
    for c in mtp["cases"].as_array().unwrap() {
        let toks = ids(&c["ids"]);
        let t = toks.len();
        for chunk in [t, 3] {
            let mut st = model.new_state_mtp(64, 32, 32).unwrap();
            let mut a = 0;
            while a < t {
                let e = (a + chunk).min(t);
                model.forward_chunk(&mut st, &toks[a..e], e - a).unwrap();
                model.mtp_take_hidden(&mut st, 0, e - a, a);
                a = e;
            }
            let got = model.mtp_forward(&mut st, &toks[1..], 0).unwrap().to_vec();
            let (shape, want) =
                sluice::npy::read_f32(&d.join(c["logits"].as_str().unwrap())).unwrap();
            assert_eq!(shape, vec![t - 1, v]);
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            let err = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            eprintln!(
                "V4 MTP {} chunk {chunk}: max|Δ|/max|ref| = {:.2e}",
                c["case"],
                err / scale
            );
            assert!(err <= 1e-4 * scale, "{}: {}", c["case"], err / scale);
            for r in 0..t - 1 {
                assert_eq!(
                    argmax(&got[r * v..(r + 1) * v]),
                    argmax(&want[r * v..(r + 1) * v]),
                    "{} slot {r}",
                    c["case"]
                );
            }
        }
    }
}

/// `--mtp K` at temperature 0 emits plain greedy's tokens (which equal transformers'), with the
/// head's own drafts and with drafts forced right and wrong (acceptance and rejection).
#[test]
fn v4_speculative_decoding_emits_plain_greedy_tokens() {
    let d = dir("deepseek_v4_mtp");
    let files = ModelFiles::open(&d).unwrap();
    let model = Model::load(&files, &OPTS).unwrap();
    let tok = load_tokenizer(&files).unwrap();
    let g = json(&d.join("greedy.json"));
    let prompt = ids(&g["prompt_ids"]);
    let n = 24;
    let mut st = model.new_state(64, 8, 4).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy(), model.cfg.vocab);
    let (plain, _) = generate(
        &model,
        &mut st,
        &tok,
        &mut sampler,
        &prompt,
        n,
        true,
        &mut |_| true,
    )
    .unwrap();
    assert_eq!(
        &plain[..16],
        &ids(&g["tokens"])[..],
        "plain vs transformers"
    );
    let mut oracle = plain.clone();
    for (i, t) in oracle.iter_mut().enumerate() {
        if i % 4 == 3 {
            *t = (*t + 1) % model.cfg.vocab as u32;
        }
    }
    let (mut drafted, mut accepted) = (0, 0);
    for k in 1..=3 {
        for batch in [k + 1, 8] {
            let mut st = model.new_state_mtp(64, batch, k + 1).unwrap();
            let mut sampler = Sampler::new(SamplingParams::greedy(), model.cfg.vocab);
            let (spec, stats) = generate_mtp(
                &model,
                &mut st,
                &tok,
                &mut sampler,
                &prompt,
                n,
                true,
                k,
                &mut |_| true,
            )
            .unwrap();
            assert_eq!(spec, plain, "--mtp {k} batch {batch}");
            drafted += stats.mtp_drafted;
            accepted += stats.mtp_accepted;
        }
        let mut st = model.new_state_mtp(64, 4, 4).unwrap();
        let mut sampler = Sampler::new(SamplingParams::greedy(), model.cfg.vocab);
        let (spec, stats) = generate_mtp_with(
            &model,
            &mut st,
            &tok,
            &mut sampler,
            &prompt,
            n,
            true,
            k,
            Some(&oracle),
            &mut |_| true,
        )
        .unwrap();
        assert_eq!(spec, plain, "--mtp {k} with oracle drafts");
        assert!(
            stats.mtp_accepted > 0 && stats.mtp_accepted < stats.mtp_drafted,
            "k {k}: {}/{}",
            stats.mtp_accepted,
            stats.mtp_drafted
        );
    }
    eprintln!("V4: the MTP head's own drafts: accepted {accepted}/{drafted}");
    assert!(drafted > 0);
}
