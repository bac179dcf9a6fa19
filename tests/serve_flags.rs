//! Every `sluice serve` option does what its help says (no option is silently ignored):
//! sampling defaults, `--model-id` and the SLUICE_API_KEY key, queue and connection limits,
//! `--kv-max-sessions`, `--prof`, `--route-trace`, `--parallel` (concurrent requests decoded
//! together return what each returns alone), and refusals of values that mean nothing.
//! (Options tested elsewhere: --host/--port/--api-key/--max-body in serve_clients.rs;
//! --kv-dir, --shutdown-grace, --experts/--cap/--io/--usage-freeze in serve_kv.rs;
//! --chat-template in serve_tools.rs.)

mod serve_util;

use serde_json::{json, Value};
use serve_util::Server;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

fn model() -> String {
    sluice::default_model::model_id()
}

/// A completion of `n` tokens; `extra` fields are merged into the request.
fn complete(s: &Server, extra: Value, n: u32) -> String {
    let mut body = json!({"model": model(), "prompt": "Once upon a time", "max_tokens": n, "ignore_eos": true});
    if let (Some(b), Value::Object(e)) = (body.as_object_mut(), extra) {
        b.extend(e);
    }
    let (st, r) = s.post("/v1/completions", &body);
    assert_eq!(st, 200, "{r}");
    r["choices"][0]["text"].as_str().expect("text").to_string()
}

#[test]
fn sampling_defaults_come_from_the_command_line() {
    let greedy = {
        let s = Server::start(&["--temp", "0"]);
        let a = complete(&s, json!({}), 24);
        assert_eq!(a, complete(&s, json!({"temperature": 0}), 24));
        a
    };
    // Each filter alone, at temperature 1, keeps only the most likely token: greedy text.
    for flags in [
        [
            "--temp", "1", "--top-k", "1", "--min-p", "0", "--top-p", "1",
        ],
        [
            "--temp", "1", "--top-k", "0", "--min-p", "1", "--top-p", "1",
        ],
        [
            "--temp", "1", "--top-k", "0", "--min-p", "0", "--top-p", "1e-6",
        ],
    ] {
        let s = Server::start(&flags);
        assert_eq!(complete(&s, json!({}), 24), greedy, "{flags:?}");
        // A request's own field still wins over the default.
        if flags[3] == "1" {
            assert_ne!(complete(&s, json!({"top_k": 0}), 24), greedy, "{flags:?}");
        }
    }
    // --seed: the same seed repeats, another one differs; both differ from greedy.
    let sampled = |seed: &str| {
        let s = Server::start(&[
            "--temp", "1", "--top-k", "0", "--min-p", "0", "--seed", seed,
        ]);
        let a = complete(&s, json!({}), 24);
        assert_eq!(a, complete(&s, json!({}), 24), "--seed {seed} must repeat");
        a
    };
    let (a, b) = (sampled("7"), sampled("8"));
    assert_ne!(a, b);
    assert_ne!(a, greedy);
    // --repeat-penalty changes greedy text (the random model repeats itself within 64 tokens).
    let s = Server::start(&["--temp", "0", "--repeat-penalty", "1.5"]);
    let long_greedy = {
        let g = Server::start(&["--temp", "0"]);
        complete(&g, json!({}), 64)
    };
    assert_ne!(complete(&s, json!({}), 64), long_greedy);
}

#[test]
fn model_id_and_the_key_from_the_environment() {
    let s = Server::start_env(
        &["--model-id", "my-model"],
        &[("SLUICE_API_KEY", "env-key")],
    );
    let (st, _) = s
        .try_request("GET", "/v1/models", None, &[])
        .expect("request");
    assert_eq!(st, 401);
    let (st, body) = s
        .try_request(
            "GET",
            "/v1/models",
            None,
            &[("Authorization", "Bearer env-key")],
        )
        .expect("request");
    assert_eq!(st, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"][0]["id"], "my-model", "{v}");
    let req = json!({"model": model(), "prompt": "x", "max_tokens": 1}).to_string();
    let auth = [
        ("Authorization", "Bearer env-key"),
        ("Content-Type", "application/json"),
    ];
    let (st, body) = s
        .try_request("POST", "/v1/completions", Some(&req), &auth)
        .expect("request");
    assert_eq!(
        st, 404,
        "the file's name is not the model's name now: {body}"
    );
    let req = json!({"model": "my-model", "prompt": "x", "max_tokens": 1}).to_string();
    let (st, body) = s
        .try_request("POST", "/v1/completions", Some(&req), &auth)
        .expect("request");
    assert_eq!(st, 200, "{body}");
}

fn send(addr: &str, body: &Value) -> TcpStream {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    // A server that refuses the connection may close it before the request is written.
    let _ = write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    s
}

/// The status of the response on `s` (0 if the connection was reset first).
fn status_of(mut s: TcpStream) -> u16 {
    let mut head = [0u8; 12];
    match s.read_exact(&mut head) {
        Ok(()) => String::from_utf8_lossy(&head[9..12]).parse().unwrap_or(0),
        Err(_) => 0,
    }
}

#[test]
fn queue_and_connection_limits() {
    // One sequence slot: A generates, B waits (with --parallel N, N requests run at once).
    let s = Server::start(&[
        "--max-queue",
        "1",
        "--max-connections",
        "3",
        "--parallel",
        "1",
    ]);
    let long = json!({"model": model(), "prompt": "Once", "max_tokens": 4000, "ignore_eos": true, "stream": true, "temperature": 0});
    // A: generating (its stream has begun).
    let mut a = send(&s.addr, &long);
    let mut first = [0u8; 12];
    a.read_exact(&mut first).unwrap();
    assert_eq!(&first[9..12], b"200");
    // B: waiting in the queue.
    let b = send(&s.addr, &long);
    let t = Instant::now();
    loop {
        let (_, h) = s.get("/health");
        if h.contains("\"queue\":1") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "B never queued: {h}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // C: a third connection, inside a request (its head is in, its body not yet; idle
    // connections and heads still arriving do not count). D: a fourth, refused.
    let mut c = TcpStream::connect(&s.addr).unwrap();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    // (The server answers 503 as it accepts, before reading anything: D only listens.)
    let d = TcpStream::connect(&s.addr).unwrap();
    d.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    assert_eq!(
        status_of(d),
        503,
        "fourth connection over --max-connections 3"
    );
    drop(c);
    // E: a request while one waits: over --max-queue 1 (once C's slot is free again): 503
    // with Retry-After (the connection limit's 503 has none).
    let t = Instant::now();
    loop {
        let mut e = send(&s.addr, &long);
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") && matches!(e.read(&mut b), Ok(1)) {
            head.push(b[0]);
        }
        let head = String::from_utf8_lossy(&head).into_owned();
        if head.starts_with("HTTP/1.1 503") && head.contains("Retry-After: ") {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no 503 with Retry-After over --max-queue: {head}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(a);
    drop(b);
    // Still serving, once the server has seen those connections close.
    let t = Instant::now();
    while !matches!(s.try_request("GET", "/health", None, &[]), Ok((200, _))) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no /health after the limits"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!complete(&s, json!({}), 2).is_empty());
    let m = s.get("/metrics").1;
    assert!(m.contains("status=\"503\"} 1"), "{m}");
}

#[test]
fn kv_max_sessions_keeps_the_newest() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("serve-kv-max");
    let _ = std::fs::remove_dir_all(&dir);
    let s = Server::start(&["--kv-dir", dir.to_str().unwrap(), "--kv-max-sessions", "1"]);
    for p in ["First conversation", "Something else entirely"] {
        complete(&s, json!({"prompt": p, "temperature": 0}), 4);
    }
    assert_eq!(s.stop(), 0);
    let files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(files[0].starts_with("session-"), "{files:?}");
}

#[test]
fn prof_and_route_trace_report_at_the_end() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("serve-flags");
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("routes.txt");
    let _ = std::fs::remove_file(&trace);
    let t = trace.to_str().unwrap();
    let s = Server::start(&[
        "--prof",
        "--experts",
        "stream",
        "--cap",
        "2",
        "--io",
        "buffered",
        "--usage-freeze",
        "--route-trace",
        t,
    ]);
    complete(&s, json!({"temperature": 0}), 8);
    let log_before = s.log_text();
    let log = {
        let l = s.log.clone();
        assert_eq!(s.stop(), 0);
        let text = l.lock().unwrap().clone();
        text
    };
    assert!(!log_before.contains("[prof]"), "prof lines come at the end");
    assert!(
        log.contains("[prof]") && log.contains("verdict"),
        "--prof printed nothing:\n{log}"
    );
    let text = std::fs::read_to_string(&trace).expect("route trace written");
    assert!(text.lines().count() > 8, "{text}");

    // Without a streamed cache there is nothing to trace: refused, not ignored.
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "serve",
            "--port",
            "0",
            "--experts",
            "resident",
            "--route-trace",
            t,
        ])
        .env("SLUICE_CACHE_DIR", serve_util::cache_dir())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--route-trace"), "{err}");
}

#[test]
fn meaningless_values_are_refused() {
    for args in [
        &["--max-queue", "0"][..],
        &["--max-connections", "0"],
        &["--max-body", "0"],
        &["--kv-max-sessions", "3"],
        &["--stats-json", "/tmp/x.json"],
        &["--shutdown-grace=-1"],
        &["--head-timeout", "0"],
        &["--body-timeout", "NaN"],
        &["--parallel", "0"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["serve", "--port", "0"])
            .args(args)
            .env("SLUICE_CACHE_DIR", serve_util::cache_dir())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        let flag = args[0].split('=').next().unwrap();
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}

/// `--parallel 3`: four concurrent requests of different prompts and lengths (one waits for a
/// slot) return at temperature 0 exactly the text each returns from a one-slot server; the
/// steps were batched (more decode rows than steps). The default is 4 slots on the CPU for a
/// grouped-query model (the random Qwen3-MoE-shaped one) and the built-in MLA one, 1 with
/// `--mtp`.
#[test]
fn parallel_requests_equal_each_alone() {
    std::env::set_var("SLUICE_CACHE_DIR", serve_util::cache_dir());
    let gqa = sluice::default_model::ensure_random().unwrap();
    let gqa = gqa.to_str().unwrap();
    let model = || sluice::default_model::random_model_id();
    let reqs: Vec<Value> = [
        ("Once upon a time", 40),
        ("The quick brown fox jumps over the lazy dog, and then", 25),
        ("Hi", 33),
        ("A long time ago in a galaxy far, far away there lived", 18),
    ]
    .iter()
    .map(|(p, n)| {
        json!({"model": model(), "prompt": p, "max_tokens": n, "ignore_eos": true, "temperature": 0})
    })
    .collect();
    let want: Vec<String> = {
        let s = Server::start(&[gqa, "--parallel", "1"]);
        reqs.iter()
            .map(|r| {
                let (st, v) = s.post("/v1/completions", r);
                assert_eq!(st, 200, "{v}");
                v["choices"][0]["text"].as_str().unwrap().to_string()
            })
            .collect()
    };
    let s = Server::start(&[gqa, "--parallel", "3"]);
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
    assert_eq!(got, want);
    let m = s.get("/metrics").1;
    let figure = |name: &str| -> f64 {
        m.lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {m}"))
    };
    assert_eq!(figure("sluice_parallel_slots"), 3.0);
    let (steps, rows) = (
        figure("sluice_batch_steps_total"),
        figure("sluice_batch_decode_rows_total"),
    );
    assert!(
        rows > steps,
        "decode rows {rows} over {steps} steps: batched"
    );
    assert_eq!(figure("sluice_generated_tokens_total"), 116.0);
    // A streamed request beside a plain one, and a stop string, in slots.
    let (st, v) = s.post(
        "/v1/completions",
        &json!({"model": model(), "prompt": "Hi", "max_tokens": 33, "temperature": 0, "stop": [want[2].chars().skip(5).take(3).collect::<String>()]}),
    );
    assert_eq!(st, 200, "{v}");
    assert!(want[2].starts_with(v["choices"][0]["text"].as_str().unwrap()));
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    drop(s);
    let d = Server::start(&[gqa]);
    assert!(
        d.log_text().contains("[plan] parallel: 4 sequence slots"),
        "{}",
        d.log_text()
    );
    drop(d);
    // The automatic count keeps the slots' KV caches (8.4 MB each at -c 4096 here with f32
    // rows; the default f16 halves them) within an eighth of --ram: 3 of them in 200 MiB.
    let d = Server::start(&[gqa, "--ram", "200M", "-ctk", "f32", "-ctv", "f32"]);
    assert!(
        d.log_text().contains("[plan] parallel: 3 sequence slots"),
        "{}",
        d.log_text()
    );
    drop(d);
    // The built-in model (MLA) batches too; with --mtp it keeps one slot and says why.
    let d = Server::start(&[]);
    assert!(d.log_text().contains("[plan] parallel: 4 sequence slots"));
    drop(d);
    let d = Server::start(&["--mtp", "1"]);
    assert!(
        d.log_text()
            .contains("[plan] parallel: 1 sequence slot (--mtp drafts for one sequence)"),
        "{}",
        d.log_text()
    );
}
