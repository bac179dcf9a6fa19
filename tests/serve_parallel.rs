//! `serve --parallel N` beyond "each request returns what it returns alone" (serve_flags.rs):
//! a prompt prefix one slot computed is copied by another slot's new request (counted, and the
//! text does not change), a client that leaves is cancelled within one step, a full queue
//! answers 503 with Retry-After, and where experts stream the automatic slot count follows the
//! expert reads (`[plan] parallel:` says why; the flag overrides it). The planner's decision
//! itself is unit-tested on given numbers in src/plan/parallel.rs.

mod serve_util;

use serde_json::{json, Value};
use serve_util::Server;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// The random Qwen3-MoE-shaped model (grouped-query attention: batched).
fn gqa() -> String {
    std::env::set_var("SLUICE_CACHE_DIR", serve_util::cache_dir());
    let p = sluice::default_model::ensure_random().unwrap();
    p.to_str().unwrap().to_string()
}

fn model() -> String {
    sluice::default_model::random_model_id()
}

/// Send a POST /v1/completions on a raw socket (the response is read, or not, by the caller).
fn send(addr: &str, body: &Value) -> TcpStream {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    s
}

/// Read from `s` until `needle` has arrived (or panic after 60 s).
fn read_until(s: &mut TcpStream, needle: &str) -> String {
    let mut got = Vec::new();
    let mut b = [0u8; 4096];
    let t = Instant::now();
    while !String::from_utf8_lossy(&got).contains(needle) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no {needle:?} in {:?}",
            String::from_utf8_lossy(&got)
        );
        let n = s.read(&mut b).unwrap();
        assert!(
            n > 0,
            "closed before {needle:?}: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&b[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

fn figure(m: &str, name: &str) -> f64 {
    m.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} in {m}"))
}

const SYSTEM: &str = "You are a careful assistant. Answer in one short paragraph, cite nothing, and never repeat the question back. The user is an engineer who likes exact numbers and plain words.";

/// On the random grouped-query model and on the built-in MLA one (whose cache holds the
/// latent and rope key, and a value part 0 wide).
#[test]
fn a_shared_prefix_is_computed_once_and_changes_nothing() {
    let path = gqa();
    shared_prefix(&[&path], &model());
    shared_prefix(&[], &sluice::default_model::model_id());
}

fn shared_prefix(args: &[&str], model: &str) {
    let model = || model.to_string();
    let start = |extra: &[&str]| Server::start(&[args, extra].concat());
    let q = |s: &str| format!("{SYSTEM} Question: {s}");
    let second = json!({"model": model(), "prompt": q("why is the sky blue?"), "max_tokens": 24, "ignore_eos": true, "temperature": 0});
    // Without sharing: the second request alone on a fresh server; and the system prompt's
    // own token count.
    let (want, sys_tokens) = {
        let s = start(&["--parallel", "2"]);
        let (st, v) = s.post("/v1/completions", &second);
        assert_eq!(st, 200, "{v}");
        assert_eq!(
            v["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
            "{v}"
        );
        let (st, sys) = s.post(
            "/v1/completions",
            &json!({"model": model(), "prompt": SYSTEM, "max_tokens": 1}),
        );
        assert_eq!(st, 200, "{sys}");
        (v, sys["usage"]["prompt_tokens"].as_u64().unwrap())
    };
    assert!(sys_tokens > 20, "{sys_tokens}");
    // With sharing: a first request with the same system prompt is generating in one slot when
    // the second arrives; the second takes the other slot and copies the prefix.
    let s = start(&["--parallel", "2"]);
    let mut first = send(
        &s.addr,
        &json!({"model": model(), "prompt": q("what is a prime number?"), "max_tokens": 100000, "ignore_eos": true, "stream": true, "temperature": 0}),
    );
    read_until(&mut first, "data: ");
    let (st, got) = s.post("/v1/completions", &second);
    assert_eq!(st, 200, "{got}");
    assert_eq!(
        got["choices"][0]["text"], want["choices"][0]["text"],
        "temperature 0: the same text with the prefix copied from another slot"
    );
    let prompt = got["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // The shared part: the system prompt's tokens (the last may merge with what follows).
    assert!(
        cached + 1 >= sys_tokens && cached < prompt,
        "cached {cached} of {prompt}, the system prompt is {sys_tokens}: {got}"
    );
    let m = s.get("/metrics").1;
    // Per-slot figures: the first request's slot is decoding, both hold positions.
    assert!(m.contains("state=\"decoding\"} 1"), "{m}");
    assert_eq!(m.matches("sluice_slot_positions{").count(), 2, "{m}");
    assert_eq!(
        figure(&m, "sluice_batch_shared_prefix_tokens_total"),
        cached as f64,
        "{m}"
    );
    // The prefill skipped them: only the rest was prefilled.
    assert!(
        s.log_text()
            .contains(&format!("(reused {cached}, prefilled {})", prompt - cached)),
        "{}",
        s.log_text()
    );
    drop(first);
}

#[test]
fn a_client_that_leaves_is_cancelled_within_one_step() {
    let path = gqa();
    let s = Server::start(&[&path, "--parallel", "2"]);
    // A keeps the batch stepping.
    let mut a = send(
        &s.addr,
        &json!({"model": model(), "prompt": "Once upon a time", "max_tokens": 100000, "ignore_eos": true, "stream": true, "temperature": 0}),
    );
    read_until(&mut a, "data: ");
    // B (streamed, then plain) leaves as soon as its request is written: at most the step
    // that was running when it joined produces a token for it. (A's tokens are counted when A
    // ends, so the generated figure moves by B's alone.)
    for (k, stream) in [true, false].into_iter().enumerate() {
        let m0 = s.get("/metrics").1;
        let b = send(
            &s.addr,
            &json!({"model": model(), "prompt": "The quick brown fox", "max_tokens": 100000, "ignore_eos": true, "stream": stream, "temperature": 0}),
        );
        b.shutdown(std::net::Shutdown::Both).unwrap();
        drop(b);
        let t = Instant::now();
        let m1 = loop {
            let m = s.get("/metrics").1;
            if figure(&m, "sluice_generations_cancelled_total") == (k + 1) as f64 {
                break m;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "B was not cancelled: {m}\n{}",
                s.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let n = figure(&m1, "sluice_generated_tokens_total")
            - figure(&m0, "sluice_generated_tokens_total");
        assert!(
            n <= 1.0,
            "B (stream {stream}) generated {n} tokens after leaving"
        );
    }
    // A is still streaming.
    read_until(&mut a, "data: ");
    drop(a);
}

#[test]
fn a_full_queue_answers_503_with_retry_after() {
    let path = gqa();
    let s = Server::start(&[&path, "--parallel", "2", "--max-queue", "1"]);
    let long = json!({"model": model(), "prompt": "Once", "max_tokens": 100000, "ignore_eos": true, "stream": true, "temperature": 0});
    // Two slots busy, one request waiting.
    let mut running: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut c = send(&s.addr, &long);
            read_until(&mut c, "data: ");
            c
        })
        .collect();
    running.push(send(&s.addr, &long));
    let t = Instant::now();
    while !s.get("/health").1.contains("\"queue\":1") {
        assert!(t.elapsed() < Duration::from_secs(30), "no request queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    // (Kept alive: read the answer, not to the end of the connection.)
    let mut d = send(&s.addr, &long);
    let out = read_until(&mut d, "retry later");
    assert!(out.starts_with("HTTP/1.1 503 "), "{out}");
    let retry: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("Retry-After: "))
        .unwrap_or_else(|| panic!("no Retry-After: {out}"))
        .trim()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "{out}");
    assert!(out.contains("--max-queue"), "{out}");
    drop(running);
}

#[test]
fn streamed_experts_cap_the_automatic_slots() {
    let path = gqa();
    // 4 cache slots a layer of 16 experts, top-4: a second sequence's union (7 a layer)
    // crowds out each one's recent experts, so one slot.
    let s = Server::start(&[&path, "--experts", "stream", "--cap", "4"]);
    let log = s.log_text();
    assert!(
        log.contains("[plan] parallel: 1 sequence slot (experts stream and decode waits on the disk: expert bytes from disk per generated token"),
        "{log}"
    );
    assert!(log.contains("--parallel N overrides"), "{log}");
    let m = s.get("/metrics").1;
    assert!(!m.contains("sluice_parallel_slots"), "{m}");
    drop(s);
    // One slot a layer: nothing survives between tokens anyway, sharing the union pays.
    let s = Server::start(&[&path, "--experts", "stream", "--cap", "1"]);
    assert!(
        s.log_text()
            .contains("[plan] parallel: 4 sequence slots (experts stream"),
        "{}",
        s.log_text()
    );
    drop(s);
    // The flag overrides.
    let s = Server::start(&[
        &path,
        "--experts",
        "stream",
        "--cap",
        "4",
        "--parallel",
        "3",
    ]);
    assert!(
        s.log_text()
            .contains("[plan] parallel: 3 sequence slots, decoded together (--parallel;"),
        "{}",
        s.log_text()
    );
    assert!(
        s.log_text().contains(
            "[plan] note: --parallel 3 kept; left out, the automatic count would be 1 sequence slot ("
        ),
        "{}",
        s.log_text()
    );
    assert_eq!(figure(&s.get("/metrics").1, "sluice_parallel_slots"), 3.0);
}

/// `--kv-dir` with sequence slots: a slot's conversation is saved when its request ends, and
/// after a restart a request extending it is restored into a slot (counted) and returns the
/// text a server without saved sessions returns.
#[test]
fn kv_sessions_work_with_slots() {
    let path = gqa();
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("serve-parallel-kv");
    let _ = std::fs::remove_dir_all(&dir);
    let dir = dir.to_str().unwrap();
    let first = json!({"model": model(), "prompt": format!("{SYSTEM} Question: what is a prime number?"), "max_tokens": 12, "ignore_eos": true, "temperature": 0});
    let s = Server::start(&[&path, "--parallel", "2", "--kv-dir", dir]);
    assert!(
        s.log_text().contains("[plan] parallel: 4 sequence slots")
            || s.log_text().contains("--parallel; 2 KV caches"),
        "{}",
        s.log_text()
    );
    let (st, v) = s.post("/v1/completions", &first);
    assert_eq!(st, 200, "{v}");
    let held = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let m = s.get("/metrics").1;
    assert_eq!(figure(&m, "sluice_kv_sessions_saved_total"), 1.0, "{m}");
    assert_eq!(s.stop(), 0);
    let second = json!({"model": model(), "prompt": format!("{SYSTEM} Question: what is a prime number?{text} And a composite one?"), "max_tokens": 12, "ignore_eos": true, "temperature": 0});
    let want = {
        let s = Server::start(&[&path, "--parallel", "2"]);
        let (st, v) = s.post("/v1/completions", &second);
        assert_eq!(st, 200, "{v}");
        v
    };
    let s = Server::start(&[&path, "--parallel", "2", "--kv-dir", dir]);
    assert!(
        s.log_text().contains("1 saved session(s)"),
        "{}",
        s.log_text()
    );
    let (st, got) = s.post("/v1/completions", &second);
    assert_eq!(st, 200, "{got}");
    assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
    let cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached + 1 >= held,
        "restored {cached} of the {held} saved prompt tokens: {got}"
    );
    let m = s.get("/metrics").1;
    assert_eq!(figure(&m, "sluice_kv_sessions_loaded_total"), 1.0, "{m}");
}

/// Qwen3-Next and Qwen3.5-MoE in slots (their recurrent state swapped in per sequence): three
/// concurrent requests of different prompts and lengths return at temperature 0 exactly the text
/// each returns from a one-slot server, in batched steps. The fixtures with qwen3_moe's tokenizer
/// (320 ids, as their vocabulary), served under `--model-id hybrid`.
#[test]
fn hybrid_requests_in_slots_equal_each_alone() {
    std::env::set_var("SLUICE_CACHE_DIR", serve_util::cache_dir());
    let fx = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
    for f in ["qwen3_next", "qwen3_5_moe"] {
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("serve-{f}"));
        std::fs::create_dir_all(&dir).unwrap();
        for x in ["config.json", "model.safetensors"] {
            std::fs::copy(fx.join(f).join(x), dir.join(x)).unwrap();
        }
        std::fs::copy(
            fx.join("qwen3_moe/tokenizer.json"),
            dir.join("tokenizer.json"),
        )
        .unwrap();
        let path = dir.to_str().unwrap();
        let reqs: Vec<Value> = [("Once upon a time", 30), ("The quick brown fox", 21), ("Hi", 26)]
            .iter()
            .map(|(p, n)| json!({"model": "hybrid", "prompt": p, "max_tokens": n, "ignore_eos": true, "temperature": 0}))
            .collect();
        let args = |n: &'static str| [path, "--model-id", "hybrid", "-c", "4096", "--parallel", n];
        let want: Vec<String> = {
            let s = Server::start(&args("1"));
            reqs.iter()
                .map(|r| {
                    let (st, v) = s.post("/v1/completions", r);
                    assert_eq!(st, 200, "{f}: {v}");
                    v["choices"][0]["text"].as_str().unwrap().to_string()
                })
                .collect()
        };
        let s = Server::start(&args("4"));
        // A long stream keeps a slot decoding while the three run, so their steps are batched
        // however fast this machine runs them one by one (drained on its own thread).
        let mut bg = send(
            &s.addr,
            &json!({"model": "hybrid", "prompt": "Meanwhile", "max_tokens": 3000, "ignore_eos": true, "stream": true, "temperature": 0}),
        );
        read_until(&mut bg, "data: ");
        let drain = std::thread::spawn(move || {
            let mut b = [0u8; 4096];
            while matches!(bg.read(&mut b), Ok(n) if n > 0) {}
        });
        let got: Vec<String> = std::thread::scope(|sc| {
            let hs: Vec<_> = reqs
                .iter()
                .map(|r| {
                    let s = &s;
                    sc.spawn(move || {
                        let (st, v) = s.post("/v1/completions", r);
                        assert_eq!(st, 200, "{v}");
                        v["choices"][0]["text"].as_str().unwrap().to_string()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got, want, "{f}: texts in slots");
        let m = s.get("/metrics").1;
        let (steps, rows) = (
            figure(&m, "sluice_batch_steps_total"),
            figure(&m, "sluice_batch_decode_rows_total"),
        );
        assert!(
            rows > steps,
            "{f}: decode rows {rows} over {steps} steps: batched"
        );
        drop(s);
        drain.join().unwrap();
    }
}
