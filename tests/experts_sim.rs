//! Route traces, the eviction simulator and usage statistics: exact hit counts on hand-made
//! traces (worked out by hand below), Belady >= LRU and hotness on Zipf routing, the simulator
//! agreeing with the real cache on the trace the cache wrote, and usage files round-tripping.

mod experts_util;

use std::path::Path;

use experts_util::{r, random_file, scratch, zipf_weights, Rng};
use sluice::experts::{
    simulate, simulate_from, CacheConfig, ExpertCache, ExpertLoc, ExpertStore, IoMode, Policy,
    SimPolicy, Trace, TraceWriter, UsageStats,
};

fn trace(text: &str) -> Trace {
    Trace::parse(text, Path::new("hand.trace")).expect("trace parses")
}

fn hits(t: &Trace, slots: usize, pinned: &[(usize, usize)], p: SimPolicy) -> (u64, u64, u64) {
    let r = simulate(t, slots, pinned, p).expect("simulate");
    (r.hits_pin, r.hits, r.misses)
}

#[test]
fn hand_trace_single_expert_requests() {
    // One layer of 4 experts, 2 slots, one expert per token: 0 1 0 2 0 1 3 0 1.
    let t = trace("# sluice route-trace v1\n# experts-per-layer 4\n0 0 0\n1 0 1\n2 0 0\n3 0 2\n4 0 0\n5 0 1\n6 0 3\n7 0 0\n8 0 1\n");
    // LRU: 0m 1m 0h 2m(evict 1) 0h 1m(evict 2) 3m(evict 0) 0m(evict 1) 1m(evict 3).
    assert_eq!(hits(&t, 2, &[], SimPolicy::Lru), (0, 2, 7));
    // Belady: 2 evicts 1 (next use 6 vs 5), 1 evicts 2 (never again), 3 evicts 1 (9 vs 8):
    // 0m 1m 0h 2m 0h 1m 3m 0h 1m.
    assert_eq!(hits(&t, 2, &[], SimPolicy::Belady), (0, 3, 6));
    // Hotness without decay: 2 evicts 1 (count 1 < 2), 1 evicts 2 (1 < 3), 3 evicts 1 (2 < 3),
    // 1 evicts 3 (1 < 4): same choices as Belady here.
    assert_eq!(
        hits(&t, 2, &[], SimPolicy::Hotness { halve_every: 100 }),
        (0, 3, 6)
    );
    // Hotness halving every token: every count is back to 0 before the next token's choice, so
    // ties fall to LRU and the counts equal LRU's.
    assert_eq!(
        hits(&t, 2, &[], SimPolicy::Hotness { halve_every: 1 }),
        (0, 2, 7)
    );
    // Enough slots: only the 4 cold misses.
    for p in [
        SimPolicy::Lru,
        SimPolicy::Belady,
        SimPolicy::Hotness { halve_every: 3 },
    ] {
        assert_eq!(hits(&t, 4, &[], p), (0, 5, 4));
    }
}

#[test]
fn hand_trace_sets_and_pins() {
    // 5 experts, 4 pinned, 2 slots, two experts per request: [0 4] [1 2] [0 1] [4 3].
    //  1: 4 pin hit, 0 miss -> slots [0, -].
    //  2: 1 takes the empty slot, 2 evicts 0 (1 is busy) -> [2, 1].
    //  3: 1 hit (busy), 0 evicts 2 -> [0, 1].
    //  4: 4 pin hit, 3 evicts slot 0 (0 and 1 tie on last use and, for Belady, on "never
    //     again"; the lower slot goes).
    let t = trace(
        "# sluice route-trace v1\n# experts-per-layer 5\n0 0 0 4\n1 0 1 2\n2 0 0 1\n3 0 4 3\n",
    );
    for p in [
        SimPolicy::Lru,
        SimPolicy::Belady,
        SimPolicy::Hotness { halve_every: 10 },
    ] {
        assert_eq!(hits(&t, 2, &[(0, 4)], p), (2, 1, 5), "{p:?}");
    }
    // A request with more unpinned experts than slots is refused, as the cache refuses it.
    let e = simulate(&t, 1, &[], SimPolicy::Lru)
        .unwrap_err()
        .to_string();
    assert!(e.contains("2 unpinned experts, 1 slots"), "{e}");
}

/// `tokens` tokens of top-`k` Zipf routing over `layers` layers of `experts` experts, with a
/// popularity shift halfway (as topics change), as trace text.
fn zipf_trace(layers: usize, experts: usize, k: usize, tokens: usize, seed: u64) -> Trace {
    let mut rng = Rng::new(seed);
    let mut text = format!(
        "# sluice route-trace v1\n# experts-per-layer{}\n",
        format!(" {experts}").repeat(layers)
    );
    let mut weights: Vec<Vec<f64>> = (0..layers)
        .map(|_| zipf_weights(experts, 1.0, &mut rng))
        .collect();
    for t in 0..tokens {
        if t == tokens / 2 {
            weights = (0..layers)
                .map(|_| zipf_weights(experts, 1.0, &mut rng))
                .collect();
        }
        for (l, w) in weights.iter().enumerate() {
            let sel = rng.distinct_weighted(w, k);
            text.push_str(&format!("{t} {l}"));
            for e in sel {
                text.push_str(&format!(" {e}"));
            }
            text.push('\n');
        }
    }
    trace(&text)
}

#[test]
fn belady_bounds_lru_and_hotness_on_zipf_routing() {
    let t = zipf_trace(4, 64, 4, 1500, 7);
    // (With slots == k every request evicts everything it does not name: no policy has a choice.)
    for slots in [4, 6, 8, 16, 32] {
        let b = simulate(&t, slots, &[], SimPolicy::Belady).expect("belady");
        let l = simulate(&t, slots, &[], SimPolicy::Lru).expect("lru");
        for k in [4, 16, 64, 256] {
            let h =
                simulate(&t, slots, &[], SimPolicy::Hotness { halve_every: k }).expect("hotness");
            assert!(
                b.hits >= h.hits,
                "slots {slots}: belady {} < hotness/{k} {}",
                b.hits,
                h.hits
            );
            eprintln!("slots {slots:>2}: hotness/{k:<3} {:.3}", h.hit_rate());
        }
        assert!(
            b.hits >= l.hits,
            "slots {slots}: belady {} < lru {}",
            b.hits,
            l.hits
        );
        if slots > 4 {
            assert!(
                b.hits > l.hits,
                "slots {slots}: belady should strictly beat LRU on this trace"
            );
        } else {
            assert_eq!(b.hits, l.hits);
        }
        eprintln!(
            "slots {slots:>2}: lru {:.3} belady {:.3}",
            l.hit_rate(),
            b.hit_rate()
        );
        assert_eq!(b.requests(), t.selections());
    }
}

#[test]
fn simulator_matches_the_cache_on_its_own_trace() {
    let dir = scratch("experts_sim_match");
    // 3 layers of 12 small experts in one file (unaligned sizes).
    let path = dir.join("experts.bin");
    let part = 1001u64;
    random_file(&path, (3 * 12 * 3 * part) as usize, 5);
    let experts: Vec<Vec<ExpertLoc>> = (0..3u64)
        .map(|l| {
            (0..12u64)
                .map(|e| {
                    let base = (l * 12 + e) * 3 * part;
                    ExpertLoc {
                        parts: [
                            r(0, base, part),
                            r(0, base + part, part),
                            r(0, base + 2 * part, part),
                        ],
                    }
                })
                .collect()
        })
        .collect();
    for policy in [Policy::Lru, Policy::Hotness { halve_every: 8 }] {
        let trace_path = dir.join(format!("{}.trace", policy.name()));
        let pinned = vec![(0, 3), (2, 0), (2, 11)];
        let cfg = CacheConfig {
            pinned: pinned.clone(),
            policy,
            io: IoMode::Buffered,
            io_threads: 2,
            trace: Some(trace_path.clone()),
            ..CacheConfig::new(4)
        };
        let mut cache = ExpertCache::new(
            ExpertStore::new(vec![path.clone()], experts.clone()).expect("store"),
            cfg,
        )
        .expect("cache");
        let mut rng = Rng::new(99);
        let w: Vec<Vec<f64>> = (0..3).map(|_| zipf_weights(12, 1.2, &mut rng)).collect();
        for _ in 0..300 {
            for (l, wl) in w.iter().enumerate() {
                let sel = rng.distinct_weighted(wl, 3);
                cache.begin(l, &sel).expect("begin");
                while cache.next_ready().expect("next_ready").is_some() {}
                cache.end();
            }
            cache.tick_token();
        }
        cache.flush_trace().expect("flush");
        let s = cache.stats();
        let t = Trace::load(&trace_path).expect("load trace");
        assert_eq!(t.tokens(), 300);
        let sp = match policy {
            Policy::Lru => SimPolicy::Lru,
            Policy::Hotness { halve_every } => SimPolicy::Hotness { halve_every },
        };
        let sim = simulate(&t, 4, &pinned, sp).expect("simulate");
        assert_eq!(
            (sim.hits_pin, sim.hits, sim.misses),
            (s.hits_pin, s.hits_lru, s.misses),
            "{policy:?}"
        );
        // The cache's in-memory log (the run summary's Belady bound replays it) is the file.
        assert_eq!(cache.route_log().expect("log fits"), t, "{policy:?}");
        assert_eq!(s.waves as usize, t.lines.len());
        let (slots, pins) = cache.shape();
        assert_eq!(slots, 4);
        let mut want_pins = pinned.clone();
        want_pins.sort_unstable();
        assert_eq!(pins, want_pins);
        // Usage counts of the run equal the trace's selections.
        let u = cache.usage();
        assert_eq!(u.total(), t.selections());
    }
}

/// `simulate_from` counts only the lines from `from` on, after the earlier lines filled the
/// cache: for LRU (whose choices do not look ahead) that is the whole replay's counts minus
/// those of a replay of the earlier lines alone.
#[test]
fn simulate_from_counts_the_tail_of_one_replay() {
    let t = zipf_trace(3, 32, 4, 400, 11);
    for from in [0, 1, t.lines.len() / 3, t.lines.len()] {
        let head = Trace {
            experts_per_layer: t.experts_per_layer.clone(),
            lines: t.lines[..from].to_vec(),
        };
        let all = simulate(&t, 6, &[(0, 1)], SimPolicy::Lru).unwrap();
        let pre = simulate(&head, 6, &[(0, 1)], SimPolicy::Lru).unwrap();
        let tail = simulate_from(&t, 6, &[(0, 1)], SimPolicy::Lru, from).unwrap();
        assert_eq!(
            (tail.hits_pin, tail.hits, tail.misses),
            (
                all.hits_pin - pre.hits_pin,
                all.hits - pre.hits,
                all.misses - pre.misses
            ),
            "from {from}"
        );
        let bel = simulate_from(&t, 6, &[(0, 1)], SimPolicy::Belady, from).unwrap();
        assert_eq!(bel.requests(), tail.requests());
        assert!(bel.misses <= tail.misses, "from {from}");
    }
}

#[test]
fn trace_round_trip_and_bad_lines() {
    let dir = scratch("experts_sim_trace");
    let p = dir.join("t.trace");
    let mut w = TraceWriter::create(&p, &[0, 8, 8]).expect("create");
    w.record(0, 1, &[3, 7, 0]).expect("record");
    w.record(0, 2, &[5]).expect("record");
    w.record(4, 1, &[]).expect("record");
    w.flush().expect("flush");
    let t = Trace::load(&p).expect("load");
    assert_eq!(t.experts_per_layer, vec![0, 8, 8]);
    assert_eq!(t.lines.len(), 3);
    assert_eq!(
        (
            t.lines[0].token,
            t.lines[0].layer,
            t.lines[0].experts.clone()
        ),
        (0, 1, vec![3, 7, 0])
    );
    assert_eq!(
        (t.lines[2].token, t.lines[2].layer, t.lines[2].experts.len()),
        (4, 1, 0)
    );

    let head = "# sluice route-trace v1\n# experts-per-layer 0 8\n";
    for (body, want) in [
        ("0 0 1\n", "expert 1 out of range: layer 0 has 0"),
        ("0 2 1\n", "layer 2 out of range"),
        ("0 1 9\n", "expert 9 out of range"),
        ("0 1 2 2\n", "expert 2 named twice"),
        ("3 1 2\n1 1 2\n", "tokens must not decrease"),
        ("0 1 x\n", "expert `x` is not a number"),
        ("7\n", "missing layer"),
    ] {
        let e = Trace::parse(&format!("{head}{body}"), Path::new("t"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{body:?}: {e}");
    }
    assert!(Trace::parse("hello\n", Path::new("t"))
        .unwrap_err()
        .to_string()
        .contains("not a route trace"));
}

#[test]
fn usage_save_load_top_n() {
    let dir = scratch("experts_sim_usage");
    let p = dir.join("usage.json");
    let mut u = UsageStats::new(&[3, 0, 4]);
    for (l, e, n) in [(0, 1, 5), (2, 3, 5), (2, 0, 9), (0, 2, 1)] {
        for _ in 0..n {
            u.record(l, e);
        }
    }
    assert_eq!(u.top_n(3), vec![(2, 0), (0, 1), (2, 3)]);
    assert_eq!(u.top_n(10).len(), 4);
    u.save(&p, "model-a").expect("save");
    assert_eq!(UsageStats::load(&p, "model-a").expect("load"), u);
    // No temporary file is left beside it.
    let names: Vec<_> = std::fs::read_dir(&dir)
        .expect("dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("usage.json")]);
    let e = UsageStats::load(&p, "model-b").unwrap_err().to_string();
    assert!(e.contains("made for model `model-a`, not `model-b`"), "{e}");
    std::fs::write(
        &p,
        b"{\"format\":\"sluice-usage\",\"version\":9,\"model\":\"m\",\"layers\":[]}",
    )
    .expect("write");
    assert!(UsageStats::load(&p, "m")
        .unwrap_err()
        .to_string()
        .contains("version 9"));
    std::fs::write(&p, b"garbage").expect("write");
    assert!(UsageStats::load(&p, "m")
        .unwrap_err()
        .to_string()
        .contains("not a usage file"));
    let mut twice = u.clone();
    twice.add(&u).expect("add");
    assert_eq!(twice.count(2, 0), 18);
    assert!(twice.add(&UsageStats::new(&[3])).is_err());

    // The identity changes with the file's size and its first bytes.
    let f = dir.join("m.bin");
    random_file(&f, 5000, 1);
    let a = sluice::experts::model_identity(std::slice::from_ref(&f)).expect("id");
    random_file(&f, 5000, 2);
    let b = sluice::experts::model_identity(std::slice::from_ref(&f)).expect("id");
    assert_ne!(a, b);
    assert!(a.starts_with("5000:"));
}

#[test]
fn cache_sim_command() {
    let dir = scratch("experts_sim_cli");
    let p = dir.join("t.trace");
    std::fs::write(&p, "# sluice route-trace v1\n# experts-per-layer 4\n0 0 0\n1 0 1\n2 0 0\n3 0 2\n4 0 0\n5 0 1\n6 0 3\n7 0 0\n8 0 1\n")
        .expect("write");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "cache-sim",
            p.to_str().expect("utf-8 path"),
            "--slots",
            "2",
            "--halve-every",
            "100",
        ])
        .output()
        .expect("run sluice");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = |name: &str| {
        text.lines().find(|l| l.starts_with(name)).map(|l| {
            l.split_whitespace()
                .skip(1)
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
    };
    assert_eq!(row("lru").as_deref(), Some("0 2 7"), "{text}");
    assert_eq!(row("hotness/100").as_deref(), Some("0 3 6"), "{text}");
    assert_eq!(row("belady").as_deref(), Some("0 3 6"), "{text}");
    // Bad input: one line, exit 1.
    std::fs::write(
        &p,
        "# sluice route-trace v1\n# experts-per-layer 4\n0 0 7\n",
    )
    .expect("write");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["cache-sim", p.to_str().expect("utf-8"), "--slots", "2"])
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        err.contains("t.trace:3: expert 7 out of range") && err.lines().count() == 1,
        "{err}"
    );
}
