//! Multi-token prediction for the hybrid families (Qwen3-Next, Qwen3.5-MoE; issue 18 items 1
//! and 3): the MTP head against transformers' MTP logits, and self-speculative decoding whose
//! verification rolls the Gated DeltaNet's recurrent and conv state back when a draft is
//! rejected, so the tokens equal plain decoding's.
//!
//! Fixtures: tests/fixtures/models/qwen3_next_mtp and qwen3_5_moe_mtp, made by
//! scripts/make_qwen3next_mtp_fixtures.py: the qwen3_next / qwen3_5_moe fixtures plus a random
//! `mtp.*` module under the real checkpoints' names, and logits from transformers' generic
//! `MtpModel` over the family's own decoder layer (transformers 5.25 has no MTP wiring for
//! these two families, but its `MtpModel` reads their layout). The GGUF twins are written by
//! scripts/qwen3next_to_gguf.py with llama.cpp's `nextn` names.

mod model_util;

use model_util::{dir, ids, json};
use sluice::format::ModelFiles;
use sluice::generate::{generate, generate_mtp, generate_mtp_with, load_tokenizer};
use sluice::model::{LoadOptions, Model};
use sluice::sample::{Sampler, SamplingParams};
use sluice::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const OPTS: LoadOptions = LoadOptions {
    kv: sluice::model::KvTypes::F32,
    threads: 2,
    ctx: 160,
};

/// The fixture as a GGUF (llama.cpp's names, the MTP layer as block n_layers with `nextn.*`),
/// written once per test binary.
fn gguf(fixture: &str) -> PathBuf {
    static CELLS: [(&str, OnceLock<PathBuf>); 2] = [
        ("qwen3_next_mtp", OnceLock::new()),
        ("qwen3_5_moe_mtp", OnceLock::new()),
    ];
    let (_, cell) = CELLS.iter().find(|(f, _)| *f == fixture).unwrap();
    cell.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{fixture}.gguf"));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/qwen3next_to_gguf.py");
        let run = Command::new("python3")
            .arg(script)
            .arg(dir(fixture))
            .arg(&out)
            .output()
            .expect("python3 with the gguf and numpy packages");
        assert!(
            run.status.success(),
            "scripts/qwen3next_to_gguf.py failed:\n{}",
            String::from_utf8_lossy(&run.stderr)
        );
        out
    })
    .clone()
}

/// (fixture, file): each fixture from its safetensors and from its GGUF.
fn files() -> Vec<(&'static str, PathBuf)> {
    let mut v = Vec::new();
    for f in ["qwen3_next_mtp", "qwen3_5_moe_mtp"] {
        v.push((f, dir(f)));
        v.push((f, gguf(f)));
    }
    v
}

fn tokenizer(fixture: &str) -> Tokenizer {
    load_tokenizer(&ModelFiles::open(&dir(fixture)).unwrap()).unwrap()
}

#[test]
fn hybrid_mtp_logits_match_transformers() {
    for (fixture, path) in files() {
        let files = ModelFiles::open(&path).unwrap();
        let model = Model::load(&files, &OPTS).unwrap();
        assert!(model.has_mtp(), "{}: no MTP layer loaded", path.display());
        let mtp = json(&dir(fixture).join("mtp.json"));
        let mut worst = 0f32;
        for c in mtp["cases"].as_array().unwrap() {
            let toks = ids(&c["ids"]);
            let t = toks.len();
            for chunk in [t, 5] {
                let mut st = model.new_state_mtp(160, 96, 96).unwrap();
                let mut a = 0;
                while a < t {
                    let e = (a + chunk).min(t);
                    model.forward_chunk(&mut st, &toks[a..e], e - a).unwrap();
                    model.mtp_take_hidden(&mut st, 0, e - a, a);
                    a = e;
                }
                let got = model.mtp_forward(&mut st, &toks[1..], 0).unwrap().to_vec();
                let (shape, want) =
                    sluice::npy::read_f32(&dir(fixture).join(c["logits"].as_str().unwrap()))
                        .unwrap();
                assert_eq!(shape, vec![t - 1, model.cfg.vocab]);
                let v = model.cfg.vocab;
                let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
                let err = got
                    .iter()
                    .zip(&want)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                for r in 0..t - 1 {
                    assert_eq!(
                        model_util::argmax(&got[r * v..(r + 1) * v]),
                        model_util::argmax(&want[r * v..(r + 1) * v]),
                        "{} {}: MTP argmax of slot {r}",
                        path.display(),
                        c["case"]
                    );
                }
                worst = worst.max(err / scale);
                assert!(
                    err <= 1e-4 * scale,
                    "{} {} chunk {chunk}: MTP logits off by {}",
                    path.display(),
                    c["case"],
                    err / scale
                );
            }
        }
        eprintln!(
            "{}: MTP logits max|Δ|/max|ref| = {worst:.2e}",
            path.display()
        );
    }
}

/// Plain greedy over `n` tokens (and a check of its first 16 against transformers).
fn plain(model: &Model<'_>, tok: &Tokenizer, fixture: &str, n: usize) -> (Vec<u32>, Vec<u32>) {
    let g = &json(&dir(fixture).join("mtp.json"))["generate"];
    let prompt = ids(
        &json(&dir(fixture.trim_end_matches("_mtp")).join("cases.json"))["greedy"]["prompt_ids"],
    );
    let mut st = model.new_state(160, 8, 4).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy(), model.cfg.vocab);
    let (out, _) = generate(
        model,
        &mut st,
        tok,
        &mut sampler,
        &prompt,
        n,
        true,
        &mut |_| true,
    )
    .unwrap();
    assert_eq!(
        &out[..16],
        &ids(&g["fixture_greedy"])[..],
        "{fixture}: plain greedy vs transformers"
    );
    (prompt, out)
}

/// `--mtp K` at temperature 0 emits exactly plain decoding's tokens, for every K and prefill
/// batch, from safetensors and GGUF (the random MTP head's own drafts).
#[test]
fn hybrid_speculative_decoding_emits_plain_greedy_tokens() {
    for (fixture, path) in files() {
        let files = ModelFiles::open(&path).unwrap();
        let model = Model::load(&files, &OPTS).unwrap();
        let tok = tokenizer(fixture);
        let (prompt, want) = plain(&model, &tok, fixture, 40);
        let (mut drafted, mut accepted, mut rollbacks) = (0, 0, 0);
        for k in 1..=3 {
            for batch in [k + 1, 8] {
                let mut st = model.new_state_mtp(160, batch, k + 1).unwrap();
                let mut sampler = Sampler::new(SamplingParams::greedy(), model.cfg.vocab);
                let (spec, stats) = generate_mtp(
                    &model,
                    &mut st,
                    &tok,
                    &mut sampler,
                    &prompt,
                    40,
                    true,
                    k,
                    &mut |_| true,
                )
                .unwrap();
                assert_eq!(spec, want, "{} --mtp {k} batch {batch}", path.display());
                drafted += stats.mtp_drafted;
                accepted += stats.mtp_accepted;
                rollbacks += stats.mtp_rollbacks;
            }
        }
        eprintln!(
            "{}: the MTP head's own drafts: accepted {accepted}/{drafted}, {rollbacks} rollbacks",
            path.display()
        );
        assert!(drafted > 0 && rollbacks > 0);
    }
}

/// Drafts that are right and, every fourth, wrong on purpose: verification accepts some,
/// rejects others and rolls the recurrent state back; the output stays plain greedy's and the
/// accepted drafts save forwards.
#[test]
fn hybrid_rejected_drafts_roll_back_the_recurrent_state() {
    for (fixture, path) in files() {
        let files = ModelFiles::open(&path).unwrap();
        let model = Model::load(&files, &OPTS).unwrap();
        let tok = tokenizer(fixture);
        let (prompt, want) = plain(&model, &tok, fixture, 40);
        let mut oracle = want.clone();
        for (i, t) in oracle.iter_mut().enumerate() {
            if i % 4 == 3 {
                *t = (*t + 1) % model.cfg.vocab as u32;
            }
        }
        for k in 1..=3 {
            let mut st = model.new_state_mtp(160, 4, 4).unwrap();
            let mut sampler = Sampler::new(SamplingParams::greedy(), model.cfg.vocab);
            let (spec, stats) = generate_mtp_with(
                &model,
                &mut st,
                &tok,
                &mut sampler,
                &prompt,
                40,
                true,
                k,
                Some(&oracle),
                &mut |_| true,
            )
            .unwrap();
            assert_eq!(
                spec,
                want,
                "{} --mtp {k} with oracle drafts",
                path.display()
            );
            assert!(
                stats.mtp_accepted > 0 && stats.mtp_accepted < stats.mtp_drafted,
                "{} k {k}: {}/{}",
                path.display(),
                stats.mtp_accepted,
                stats.mtp_drafted
            );
            assert!(stats.mtp_rollbacks > 0, "{} k {k}", path.display());
            assert!(
                stats.decode_steps < 39,
                "{} k {k}: accepted drafts save forwards ({} steps)",
                path.display(),
                stats.decode_steps
            );
        }
    }
}

/// The rollback itself: feed a prompt, save, feed three more tokens, roll back, feed one; the
/// logits equal a fresh run's over prompt + that token bit for bit. Without the rollback (the
/// three tokens left in the recurrent state) they differ: the check can fail.
#[test]
fn rollback_restores_the_recurrent_state_bit_identically() {
    let model_files = ModelFiles::open(&dir("qwen3_next_mtp")).unwrap();
    let model = Model::load(&model_files, &OPTS).unwrap();
    let prompt = [5u32, 77, 301, 12, 9, 150, 42];
    let mut fresh = model.new_state_mtp(160, 8, 4).unwrap();
    model.forward_chunk(&mut fresh, &prompt, 7).unwrap();
    let want = model.forward_chunk(&mut fresh, &[88], 0).unwrap().to_vec();

    let mut st = model.new_state_mtp(160, 8, 4).unwrap();
    model.forward_chunk(&mut st, &prompt, 7).unwrap();
    st.checkpoint_recurrent().unwrap();
    model.forward_chunk(&mut st, &[3, 4, 6], 3).unwrap();
    let mut no_rollback = model.new_state_mtp(160, 8, 4).unwrap();
    model.forward_chunk(&mut no_rollback, &prompt, 7).unwrap();
    model
        .forward_chunk(&mut no_rollback, &[3, 4, 6], 3)
        .unwrap();
    no_rollback.pos = prompt.len(); // the KV cache cut, the recurrent state not
    let wrong = model
        .forward_chunk(&mut no_rollback, &[88], 0)
        .unwrap()
        .to_vec();
    assert_ne!(
        wrong, want,
        "control: a stale recurrent state changes the logits"
    );

    st.rollback_recurrent(prompt.len()).unwrap();
    assert_eq!(st.pos, prompt.len());
    let got = model.forward_chunk(&mut st, &[88], 0).unwrap().to_vec();
    assert_eq!(got, want);
    // A plain state (no MTP) has no rollback copy: refused, not silently ignored.
    let mut plain = model.new_state(160, 8, 4).unwrap();
    assert!(plain.checkpoint_recurrent().is_err());
}

/// The engine across turns with `--mtp`: a second turn that extends the first must answer as a
/// fresh run does, and keep the first turn's state. The MTP head's slots lag the main cache by
/// one position, which a KV cache re-levels by cutting one position; a recurrent state cannot
/// be cut, so the last decode's row of that slot is kept and run first (`resumes_mtp`).
#[test]
fn engine_turns_with_mtp_match_fresh_runs() {
    use sluice::engine::{Engine, EngineOptions, GenParams, GpuWant};
    std::env::set_var(
        "SLUICE_CACHE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("mtp-hybrid-cache"),
    );
    let open = |mtp: usize| {
        let mut o = EngineOptions::new(dir("qwen3_next_mtp"));
        o.threads = 2;
        o.ctx = Some(160);
        o.batch = 5;
        o.quiet = true;
        o.mtp = mtp;
        o.gpu.want = GpuWant::Off;
        Engine::open(o).unwrap()
    };
    let gen = |e: &mut Engine, prompt: &[u32]| {
        let mut s = e.sampler();
        let mut p = GenParams::new(12);
        p.ignore_eos = true;
        e.generate(prompt, &mut s, &p, &mut |_| true)
            .unwrap()
            .generation
            .tokens
    };
    let first = [5u32, 77, 301, 12, 9, 150, 42];
    let mut e = open(2);
    let out1 = gen(&mut e, &first);
    let mut second = first.to_vec();
    second.extend_from_slice(&out1);
    second.extend_from_slice(&[88, 199, 64]);
    let mut sampler = e.sampler();
    let mut p = GenParams::new(12);
    p.ignore_eos = true;
    let o2 = e
        .generate(&second, &mut sampler, &p, &mut |_| true)
        .unwrap();
    let out2 = o2.generation.tokens;
    assert!(
        o2.generation.stats.reused >= first.len() + out1.len() - 1,
        "the first turn's state is kept ({} reused)",
        o2.generation.stats.reused
    );
    for mtp in [0, 2] {
        let mut fresh = open(mtp);
        assert_eq!(
            gen(&mut fresh, &second),
            out2,
            "second turn vs a fresh run (--mtp {mtp})"
        );
    }
}

/// Above temperature 0 the rollback runs on the sampling path too: with top-k 1 both
/// distributions are point masses, so the output must be plain greedy's whatever the coin
/// flips; at temperature 1 a run repeats under its seed and stays in the vocabulary.
#[test]
fn hybrid_speculative_sampling_rolls_back_too() {
    for (fixture, path) in files() {
        let files = ModelFiles::open(&path).unwrap();
        let model = Model::load(&files, &OPTS).unwrap();
        let tok = tokenizer(fixture);
        let (prompt, want) = plain(&model, &tok, fixture, 24);
        for (k, seed) in [(1, 1u64), (2, 2), (3, 3)] {
            let params = SamplingParams {
                temperature: 0.7,
                top_k: 1,
                seed,
                ..SamplingParams::default()
            };
            let mut st = model.new_state_mtp(160, 4, 4).unwrap();
            let mut sampler = Sampler::new(params, model.cfg.vocab);
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
            assert_eq!(spec, want, "{} --mtp {k} at top-k 1", path.display());
            assert!(stats.mtp_rollbacks > 0);
        }
        let run = || {
            let params = SamplingParams {
                temperature: 1.0,
                seed: 11,
                ..SamplingParams::default()
            };
            let mut st = model.new_state_mtp(160, 4, 3).unwrap();
            let mut sampler = Sampler::new(params, model.cfg.vocab);
            generate_mtp(
                &model,
                &mut st,
                &tok,
                &mut sampler,
                &prompt,
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
}
