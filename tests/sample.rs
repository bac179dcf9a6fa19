//! The sampler against straightforward reference implementations of llama.cpp's sampler chain
//! (penalties -> top-k -> top-p -> min-p -> temperature -> draw), a statistical check of the
//! draw, determinism, and a counting allocator that proves `sample` allocates nothing.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use sluice::sample::{Sampler, SamplingParams};

struct Counting;
thread_local! {
    /// Allocations made by this thread (tests run in parallel threads).
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

fn count() {
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

fn allocs() -> usize {
    ALLOCS.with(Cell::get)
}

// SAFETY: forwards to the system allocator; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        count();
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// A small deterministic generator for test data (not the sampler's).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Roughly normal, scaled.
    fn logits(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n)
            .map(|_| ((0..4).map(|_| self.next()).sum::<f64>() - 2.0) as f32 * scale as f32)
            .collect()
    }
}

fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        repeat_penalty: 1.0,
        repeat_last_n: 64,
        seed: 7,
    }
}

/// llama.cpp's chain written out plainly: every step on a fully sorted list.
fn reference(logits: &[f32], history: &[u32], p: &SamplingParams) -> Vec<(u32, f32)> {
    let mut l = logits.to_vec();
    if p.repeat_penalty != 1.0 && p.repeat_last_n > 0 {
        let window = &history[history.len().saturating_sub(p.repeat_last_n)..];
        let mut seen = std::collections::BTreeSet::new();
        for &t in window {
            seen.insert(t as usize);
        }
        for t in seen {
            l[t] = if l[t] <= 0.0 {
                l[t] * p.repeat_penalty
            } else {
                l[t] / p.repeat_penalty
            };
        }
    }
    let mut c: Vec<(u32, f32)> = l.iter().enumerate().map(|(i, &x)| (i as u32, x)).collect();
    c.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        c.truncate(p.top_k);
    }
    if p.top_p < 1.0 {
        let max = c[0].1 as f64;
        let z: f64 = c.iter().map(|x| (x.1 as f64 - max).exp()).sum();
        let mut cum = 0.0;
        let mut keep = c.len();
        for (i, x) in c.iter().enumerate() {
            cum += (x.1 as f64 - max).exp() / z;
            if cum >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        c.truncate(keep);
    }
    if p.min_p > 0.0 {
        let floor = c[0].1 + p.min_p.ln();
        let first = c[0];
        c.retain(|x| x.1 >= floor);
        if c.is_empty() {
            c.push(first);
        }
    }
    let t = p.temperature as f64;
    let max = c[0].1 as f64 / t;
    let z: f64 = c.iter().map(|x| (x.1 as f64 / t - max).exp()).sum();
    c.iter()
        .map(|x| (x.0, ((x.1 as f64 / t - max).exp() / z) as f32))
        .collect()
}

fn assert_same_dist(got: &[(u32, f32)], want: &[(u32, f32)], what: &str) {
    let gi: Vec<u32> = got.iter().map(|x| x.0).collect();
    let wi: Vec<u32> = want.iter().map(|x| x.0).collect();
    assert_eq!(gi, wi, "{what}: candidate set");
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g.1 - w.1).abs() <= 1e-5,
            "{what}: p[{}] = {} vs {}",
            g.0,
            g.1,
            w.1
        );
    }
}

#[test]
fn greedy_is_argmax_lowest_id_on_ties() {
    let mut s = Sampler::new(SamplingParams::greedy(), 8);
    assert_eq!(
        s.sample(&[0.1, 3.0, -1.0, 3.0, 2.9, f32::NAN, 0.0, 1.0], &[]),
        1
    );
    assert_eq!(s.sample(&[-5.0, -5.0, -5.0], &[]), 0);
    assert_eq!(s.sample(&[f32::NAN, -1.0, f32::NAN], &[]), 1);
    let mut rng = Lcg(3);
    for _ in 0..20 {
        let l = rng.logits(500, 3.0);
        let (best, _) =
            l.iter().enumerate().fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &x)| if x > b.1 { (i, x) } else { b },
            );
        assert_eq!(s.sample(&l, &[]) as usize, best);
        assert_eq!(s.probs_after_filters(&l, &[]), &[(best as u32, 1.0)]);
    }
}

#[test]
fn greedy_sees_the_repetition_penalty() {
    let p = SamplingParams {
        repeat_penalty: 2.0,
        repeat_last_n: 2,
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(p, 3);
    // Token 0 (3.0 -> 1.5) loses to token 1 (2.0) when it is in the window.
    assert_eq!(s.sample(&[3.0, 2.0, 1.0], &[0]), 1);
    // Outside the window (last 2 of history): no penalty.
    assert_eq!(s.sample(&[3.0, 2.0, 1.0], &[0, 2, 2]), 0);
    // A negative logit is multiplied: token 2 (-1.0 -> -2.0) falls below token 1 (-1.5).
    assert_eq!(s.sample(&[-3.0, -1.5, -1.0], &[2]), 1);
}

#[test]
fn repetition_penalty_is_llama_cpps() {
    // Temperature 1, no filters: the distribution is softmax of the penalized logits, each
    // distinct token in the window penalized once however often it occurs.
    let p = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.5,
        repeat_last_n: 4,
        seed: 1,
    };
    let logits = [2.0f32, -1.0, 0.5, 1.0, 0.0];
    let history = [3, 1, 0, 1, 1];
    let mut s = Sampler::new(p.clone(), logits.len());
    let got = s.probs_after_filters(&logits, &history).to_vec();
    let want = reference(&logits, &history, &p);
    assert_same_dist(&got, &want, "penalty");
    // The window is the last 4 tokens: 3 is out; 0 and 1 are in.
    let pen = [2.0f32 / 1.5, -1.5, 0.5, 1.0, 0.0];
    let z: f32 = pen.iter().map(|x| x.exp()).sum();
    for (id, prob) in got {
        assert!((prob - pen[id as usize].exp() / z).abs() < 1e-6);
    }
}

#[test]
fn filters_keep_exactly_the_reference_sets() {
    let mut rng = Lcg(11);
    let combos = [
        (0.8, 40, 0.95, 0.05),
        (1.0, 0, 0.9, 0.0),
        (1.0, 0, 1.0, 0.1),
        (0.5, 5, 1.0, 0.0),
        (1.3, 100, 0.5, 0.0),
        (0.7, 0, 0.99, 0.02),
        (1.0, 1, 0.95, 0.05),
        (2.0, 0, 1.0, 0.0),
        (1.0, 2000, 0.8, 0.3),
    ];
    for (round, &(t, k, tp, mp)) in combos.iter().cycle().take(90).enumerate() {
        let n = [50, 1000, 4096][round % 3];
        let logits = rng.logits(n, [1.0, 4.0, 10.0][round % 3]);
        let mut p = params(t, k, tp, mp);
        let history: Vec<u32> = (0..30).map(|_| (rng.next() * n as f64) as u32).collect();
        if round % 2 == 1 {
            p.repeat_penalty = 1.3;
            p.repeat_last_n = 16;
        }
        let mut s = Sampler::new(p.clone(), n);
        let got = s.probs_after_filters(&logits, &history).to_vec();
        let want = reference(&logits, &history, &p);
        assert_same_dist(&got, &want, &format!("round {round} {p:?}"));
    }
}

#[test]
fn draws_follow_the_distribution() {
    // 8 tokens, temperature 0.7, no filters: frequencies over many draws within 5 sigma.
    let logits = [1.0f32, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2];
    let p = params(0.7, 0, 1.0, 0.0);
    let mut s = Sampler::new(p.clone(), logits.len());
    let probs: Vec<f64> = {
        let mut v = vec![0.0; logits.len()];
        for (id, q) in reference(&logits, &[], &p) {
            v[id as usize] = q as f64;
        }
        v
    };
    let n = 200_000;
    let mut counts = vec![0usize; logits.len()];
    for _ in 0..n {
        counts[s.sample(&logits, &[]) as usize] += 1;
    }
    let mut chi2 = 0.0;
    for (i, &c) in counts.iter().enumerate() {
        let expect = probs[i] * n as f64;
        let sigma = (n as f64 * probs[i] * (1.0 - probs[i])).sqrt();
        assert!(
            (c as f64 - expect).abs() < 5.0 * sigma,
            "token {i}: {c} draws, expected {expect:.0} ± {sigma:.0}"
        );
        chi2 += (c as f64 - expect).powi(2) / expect;
    }
    // 7 degrees of freedom: P(chi2 > 29.9) ≈ 1e-4.
    assert!(chi2 < 29.9, "chi-square {chi2}");

    // With filters the draws stay inside the kept set, in proportion.
    let p = params(1.0, 3, 1.0, 0.0);
    let mut s = Sampler::new(p.clone(), logits.len());
    let kept: Vec<u32> = reference(&logits, &[], &p).iter().map(|x| x.0).collect();
    for _ in 0..10_000 {
        assert!(kept.contains(&s.sample(&logits, &[])));
    }
}

#[test]
fn same_seed_same_tokens() {
    let mut rng = Lcg(5);
    let logits: Vec<Vec<f32>> = (0..200).map(|_| rng.logits(300, 2.0)).collect();
    let run = |seed: u64| {
        let mut s = Sampler::new(
            SamplingParams {
                seed,
                ..SamplingParams::default()
            },
            300,
        );
        logits
            .iter()
            .map(|l| s.sample(l, &[]))
            .collect::<Vec<u32>>()
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
    let greedy = |_: u64| {
        let mut s = Sampler::new(SamplingParams::greedy(), 300);
        logits
            .iter()
            .map(|l| s.sample(l, &[]))
            .collect::<Vec<u32>>()
    };
    assert_eq!(greedy(1), greedy(2));
    // Reseeding restarts the sequence.
    let mut s = Sampler::new(
        SamplingParams {
            seed: 42,
            ..SamplingParams::default()
        },
        300,
    );
    let first: Vec<u32> = logits.iter().map(|l| s.sample(l, &[])).collect();
    s.reseed(42);
    let again: Vec<u32> = logits.iter().map(|l| s.sample(l, &[])).collect();
    assert_eq!(first, again);
}

#[test]
fn sample_allocates_nothing() {
    let n = 32_000;
    let logits = Lcg(9).logits(n, 3.0);
    let history: Vec<u32> = (0..100).map(|i| (i * 37 % n) as u32).collect();
    let b = allocs();
    std::hint::black_box(vec![1u8; 10]);
    assert!(allocs() > b, "the counting allocator counts");
    for p in [
        SamplingParams::default(),
        SamplingParams::greedy(),
        SamplingParams {
            repeat_penalty: 1.1,
            ..SamplingParams::default()
        },
        params(1.0, 0, 0.9, 0.0),
    ] {
        let mut s = Sampler::new(p, n);
        s.sample(&logits, &history);
        let before = allocs();
        for _ in 0..20 {
            std::hint::black_box(s.sample(&logits, &history));
        }
        assert_eq!(allocs(), before, "sample allocated");
    }
}
