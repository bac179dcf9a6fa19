//! Continuous batching at the engine level (`engine::batch`, `serve --parallel N`): sequences
//! decoded together in one batched forward per step return exactly what each returns alone
//! through the one-sequence decode loop (`Engine::generate`) — tokens, text and finish —
//! at temperature 0 and with a seeded sampler, for prompts of different lengths and token
//! budgets, one admitted while the others run, a slot reused with a shared prefix, and a
//! request cancelled mid-way that leaves the others untouched; with grouped-query attention
//! (the random Qwen3-MoE-shaped model), MLA (the built-in DeepSeek-V3-style model) and the
//! hybrid families (Qwen3-Next and Qwen3.5-MoE fixtures: each sequence's Gated DeltaNet conv
//! and recurrent state swapped in for its rows, its gated-attention cache likewise). The
//! admission: prompts waiting together are read in one step, and a long prompt is read in
//! chunks beside the running streams.

use sluice::engine::batch::{Batch, Done, SeqRequest};
use sluice::engine::{Engine, EngineOptions, Event, Finish, GenParams, GpuWant};
use sluice::sample::{Sampler, SamplingParams};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

fn model() -> PathBuf {
    std::env::set_var(
        "SLUICE_CACHE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("engine-batch-cache"),
    );
    sluice::default_model::ensure_random().unwrap()
}

/// The built-in trained model: DeepSeek-V3-style MLA (its MTP head unused here).
fn mla_model() -> PathBuf {
    model();
    sluice::default_model::ensure().unwrap()
}

/// A hybrid fixture (`qwen3_next`, `qwen3_5_moe`) in a directory of its own, with qwen3_moe's
/// tokenizer (320 ids, as the fixture's vocabulary) so the engine opens it.
fn hybrid_model(fixture: &str) -> PathBuf {
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("engine-batch-{fixture}"));
    std::fs::create_dir_all(&out).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fx.join(fixture).join(f), out.join(f)).unwrap();
    }
    std::fs::copy(
        fx.join("qwen3_moe/tokenizer.json"),
        out.join("tokenizer.json"),
    )
    .unwrap();
    out
}

fn open(parallel: usize) -> Engine {
    open_model(&model(), parallel)
}

fn open_model(path: &Path, parallel: usize) -> Engine {
    let mut o = EngineOptions::new(path);
    o.threads = 2;
    o.ctx = Some(160);
    // Small prefill chunks, so prompts are read over several steps beside others' decoding.
    o.batch = 6;
    o.parallel = parallel;
    o.quiet = true;
    o.gpu.want = GpuWant::Off;
    Engine::open(o).unwrap()
}

#[derive(Clone)]
struct Case {
    prompt: Vec<u32>,
    max_tokens: usize,
    ignore_eos: bool,
    sampling: SamplingParams,
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..Default::default()
    }
}

/// Deterministic token ids (the random model's vocabulary is the built-in one's).
fn prompt(seed: u32, n: usize, vocab: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            3 + x % (vocab as u32 - 3)
        })
        .collect()
}

/// What the one-sequence loop returns for `c` (a fresh session each time).
fn alone(e: &mut Engine, c: &Case) -> (Vec<u32>, String, Finish) {
    e.session.reset();
    let mut s = Sampler::new(c.sampling.clone(), e.model.cfg.vocab);
    let mut p = GenParams::new(c.max_tokens);
    p.ignore_eos = c.ignore_eos;
    let mut text = String::new();
    let out = e
        .generate(&c.prompt, &mut s, &p, &mut |ev| {
            if let Event::Text(t) = ev {
                text.push_str(t);
            }
            true
        })
        .unwrap();
    let g = out.generation;
    (g.tokens, text, g.finish)
}

type Texts = Arc<Mutex<Vec<String>>>;

/// Admit the request `r` builds (it reads the engine, which `admit` then borrows mutably).
fn admit<T>(
    b: &mut Batch<T>,
    e: &mut Engine,
    r: impl FnOnce(&Engine) -> SeqRequest,
    tag: T,
) -> Option<Done<T>> {
    let r = r(e);
    b.admit(e, r, tag)
}

fn request(e: &Engine, c: &Case, i: usize, texts: &Texts, cancel: Arc<AtomicBool>) -> SeqRequest {
    let texts = texts.clone();
    SeqRequest {
        prompt: c.prompt.clone(),
        sampler: Sampler::new(c.sampling.clone(), e.model.cfg.vocab),
        max_tokens: c.max_tokens,
        ignore_eos: c.ignore_eos,
        stop: Vec::new(),
        special: false,
        cancel: Box::new(move || cancel.load(Ordering::Relaxed)),
        on_event: Box::new(move |ev| {
            if let Event::Text(t) = ev {
                texts.lock().unwrap()[i].push_str(t);
            }
            true
        }),
    }
}

#[test]
fn batched_sequences_equal_each_alone() {
    equal_each_alone(&model());
}

#[test]
fn batched_mla_sequences_equal_each_alone() {
    equal_each_alone(&mla_model());
}

/// Qwen3-Next and Qwen3.5-MoE: the batched steps run each sequence's rows on its own recurrent
/// state. The slot reused for request 5 held request 0's prompt and reply, which a recurrent
/// state cannot be cut back from: it starts from 0 and still answers as alone.
#[test]
fn batched_hybrid_sequences_equal_each_alone() {
    for f in ["qwen3_next", "qwen3_5_moe"] {
        equal_each_alone(&hybrid_model(f));
    }
}

fn equal_each_alone(path: &Path) {
    let mut solo = open_model(path, 1);
    let mut e = open_model(path, 4);
    let v = e.model.cfg.vocab;
    let seeded = SamplingParams {
        temperature: 0.9,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 77,
        ..Default::default()
    };
    let case = |seed, n, max_tokens, ignore_eos, sampling: &SamplingParams| Case {
        prompt: prompt(seed, n, v),
        max_tokens,
        ignore_eos,
        sampling: sampling.clone(),
    };
    let mut cases = vec![
        case(1, 23, 20, true, &greedy()),
        case(2, 5, 9, true, &greedy()),
        case(3, 40, 31, false, &greedy()),
        // Admitted at step 6, while the others decode.
        case(4, 13, 17, true, &greedy()),
        // A seeded sampler is the request's own: the same draws as alone.
        case(5, 9, 15, true, &seeded),
    ];
    // Admitted once a slot is free, sharing case 0's prompt as a prefix (slot reuse).
    let mut p6 = cases[0].prompt.clone();
    p6.extend_from_slice(&prompt(6, 7, v));
    cases.push(Case {
        prompt: p6,
        max_tokens: 12,
        ignore_eos: true,
        sampling: greedy(),
    });
    let want: Vec<_> = cases.iter().map(|c| alone(&mut solo, c)).collect();

    let mut b: Batch<usize> = Batch::new(&e, 4).unwrap();
    let texts: Texts = Arc::new(Mutex::new(vec![String::new(); cases.len()]));
    let mut done: Vec<Done<usize>> = Vec::new();
    let no = || Arc::new(AtomicBool::new(false));
    for i in [0, 1, 2] {
        assert!(admit(
            &mut b,
            &mut e,
            |e| request(e, &cases[i], i, &texts, no()),
            i
        )
        .is_none());
    }
    let mut next = 3;
    let mut steps = 0;
    while done.len() < cases.len() {
        if next < cases.len()
            && b.free() > 0
            && (next != 3 || steps >= 6)
            && (next != 5 || done.iter().any(|d| d.tag == 0))
        {
            assert!(admit(
                &mut b,
                &mut e,
                |e| request(e, &cases[next], next, &texts, no()),
                next
            )
            .is_none());
            next += 1;
        }
        done.extend(b.step(&mut e));
        steps += 1;
        assert!(steps < 1000, "the batch does not finish");
    }
    assert!(
        b.stats.decode_rows > b.stats.decode_steps,
        "several sequences decoded per step"
    );
    let texts = texts.lock().unwrap();
    for d in done {
        let i = d.tag;
        let g = d.result.unwrap();
        assert_eq!(g.tokens, want[i].0, "request {i}: tokens");
        assert_eq!(texts[i], want[i].1, "request {i}: text");
        assert_eq!(g.finish, want[i].2, "request {i}: finish");
        assert_eq!(g.stats.generated, g.tokens.len());
        if i == 5 && e.session.st.block_floats() == 0 {
            assert!(
                g.stats.reused >= cases[0].prompt.len(),
                "slot reuse: {:?}",
                g.stats
            );
        }
    }
}

#[test]
fn a_cancelled_sequence_leaves_the_others_untouched() {
    let mut solo = open(1);
    let mut e = open(3);
    let v = e.model.cfg.vocab;
    let cases: Vec<Case> = (0..3)
        .map(|i| Case {
            prompt: prompt(10 + i as u32, 8 + 5 * i, v),
            max_tokens: 24,
            ignore_eos: true,
            sampling: greedy(),
        })
        .collect();
    let want: Vec<_> = cases.iter().map(|c| alone(&mut solo, c)).collect();
    let mut b: Batch<usize> = Batch::new(&e, 3).unwrap();
    let texts: Texts = Arc::new(Mutex::new(vec![String::new(); 3]));
    let stop = Arc::new(AtomicBool::new(false));
    for (i, c) in cases.iter().enumerate() {
        let cancel = if i == 1 {
            stop.clone()
        } else {
            Arc::new(AtomicBool::new(false))
        };
        assert!(admit(&mut b, &mut e, |e| request(e, c, i, &texts, cancel), i).is_none());
    }
    let mut done = Vec::new();
    for step in 0.. {
        if step == 8 {
            stop.store(true, Ordering::Relaxed);
        }
        done.extend(b.step(&mut e));
        if done.len() == 3 {
            break;
        }
        assert!(step < 1000);
    }
    for d in done {
        let g = d.result.unwrap();
        if d.tag == 1 {
            assert_eq!(g.finish, Finish::Cancelled);
            assert!(g.tokens.len() < 24);
            assert_eq!(
                g.tokens[..],
                want[1].0[..g.tokens.len()],
                "a prefix of its reply"
            );
        } else {
            assert_eq!(g.tokens, want[d.tag].0, "request {}", d.tag);
        }
    }
    assert_eq!(b.active(), 0);
}

#[test]
fn refusals() {
    let mut e = open(2);
    // Its session state is the steps' buffers, without a KV cache of its own.
    let mut sampler = Sampler::new(greedy(), e.model.cfg.vocab);
    let r = e.generate(&[1, 2, 3], &mut sampler, &GenParams::new(2), &mut |_| true);
    assert!(
        r.is_err(),
        "a batched engine's session does not generate alone"
    );
    assert!(
        Batch::<()>::new(&e, 3).is_err(),
        "more slots than the engine was opened for"
    );
    let mut b: Batch<()> = Batch::new(&e, 2).unwrap();
    let texts: Texts = Arc::new(Mutex::new(vec![String::new(); 1]));
    let c = Case {
        prompt: Vec::new(),
        max_tokens: 4,
        ignore_eos: true,
        sampling: greedy(),
    };
    let no = Arc::new(AtomicBool::new(false));
    let d = admit(
        &mut b,
        &mut e,
        |e| request(e, &c, 0, &texts, no.clone()),
        (),
    )
    .expect("refused");
    assert!(d.result.is_err(), "empty prompt");
    let long = Case {
        prompt: vec![5; 161],
        ..c.clone()
    };
    let d = admit(&mut b, &mut e, |e| request(e, &long, 0, &texts, no), ()).expect("refused");
    assert!(d.result.is_err(), "over the context");
    assert_eq!(b.active(), 0);
}

/// Prompts waiting together are all read in one step (within `-b`), and each then returns
/// what it returns alone.
#[test]
fn waiting_prompts_are_admitted_in_one_step() {
    let mut solo = open(1);
    let mut o = EngineOptions::new(model());
    o.threads = 2;
    o.ctx = Some(160);
    o.batch = 64;
    o.parallel = 4;
    o.quiet = true;
    o.gpu.want = GpuWant::Off;
    let mut e = Engine::open(o).unwrap();
    let v = e.model.cfg.vocab;
    let cases: Vec<Case> = (0..4)
        .map(|i| Case {
            prompt: prompt(30 + i as u32, 5 + 4 * i, v),
            max_tokens: 6,
            ignore_eos: true,
            sampling: greedy(),
        })
        .collect();
    let want: Vec<_> = cases.iter().map(|c| alone(&mut solo, c)).collect();
    let mut b: Batch<usize> = Batch::new(&e, 4).unwrap();
    let texts: Texts = Arc::new(Mutex::new(vec![String::new(); 4]));
    for (i, c) in cases.iter().enumerate() {
        let no = Arc::new(AtomicBool::new(false));
        assert!(admit(&mut b, &mut e, |e| request(e, c, i, &texts, no), i).is_none());
    }
    let mut done = b.step(&mut e);
    let rows: usize = cases.iter().map(|c| c.prompt.len()).sum();
    assert_eq!((b.stats.steps, b.stats.prefill_rows), (1, rows as u64));
    assert_eq!(
        b.phases(),
        (0, 4),
        "every prompt read and sampled in the first step"
    );
    // The next step decodes all four.
    done.extend(b.step(&mut e));
    assert_eq!(b.stats.decode_rows, 4);
    while b.active() > 0 {
        done.extend(b.step(&mut e));
    }
    assert_eq!(done.len(), 4);
    for d in done {
        let g = d.result.unwrap();
        assert_eq!(g.tokens, want[d.tag].0, "request {}", d.tag);
    }
}

/// A long prompt is read a chunk per step beside the running streams: every step decodes
/// every stream, and the prompt's reply is still its own.
#[test]
fn a_long_prompt_does_not_stall_running_streams() {
    let mut solo = open(1);
    let mut e = open(3);
    let v = e.model.cfg.vocab;
    let case = |seed, n| Case {
        prompt: prompt(seed, n, v),
        max_tokens: 40,
        ignore_eos: true,
        sampling: greedy(),
    };
    let cases = [case(40, 3), case(41, 3), case(42, 60)];
    let want: Vec<_> = cases.iter().map(|c| alone(&mut solo, c)).collect();
    let mut b: Batch<usize> = Batch::new(&e, 3).unwrap();
    let texts: Texts = Arc::new(Mutex::new(vec![String::new(); 3]));
    let no = || Arc::new(AtomicBool::new(false));
    let mut done = Vec::new();
    for i in [0, 1] {
        assert!(admit(
            &mut b,
            &mut e,
            |e| request(e, &cases[i], i, &texts, no()),
            i
        )
        .is_none());
    }
    done.extend(b.step(&mut e));
    assert_eq!(b.phases(), (0, 2), "both short prompts in one 6-row step");
    assert!(admit(
        &mut b,
        &mut e,
        |e| request(e, &cases[2], 2, &texts, no()),
        2
    )
    .is_none());
    let mut prefill_steps = 0;
    while b.phases().0 > 0 {
        let before = b.stats;
        done.extend(b.step(&mut e));
        assert_eq!(
            b.stats.decode_rows - before.decode_rows,
            2,
            "both streams ran"
        );
        assert_eq!(
            b.stats.prefill_rows - before.prefill_rows,
            4,
            "a 4-row chunk"
        );
        prefill_steps += 1;
    }
    assert_eq!(prefill_steps, 15, "60 prompt tokens in chunks of 6 - 2");
    while b.active() > 0 {
        done.extend(b.step(&mut e));
    }
    for d in done {
        let g = d.result.unwrap();
        assert_eq!(g.tokens, want[d.tag].0, "request {}", d.tag);
    }
}
