//! Issue 20, items 1, 2 and 8 (HTTP): bounded work per request (two maximum-size prompts at
//! once), timeouts that always fire (a trickled head, a body below the minimum rate), idle
//! connections and trickled heads that do not shut clients out, strict header parsing (an
//! exact head limit), and an empty API key refused. The memory check reads the server
//! process's own peak RSS (VmHWM).

#[path = "serve_util/mod.rs"]
mod serve_util;

use serde_json::json;
use serve_util::Server;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn model() -> String {
    sluice::default_model::model_id()
}

/// Peak resident set of process `pid`, in bytes.
fn peak_rss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

/// Read the whole response and its status (0 if the connection closed first).
fn read_status(mut s: TcpStream) -> (u16, String) {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let out = String::from_utf8_lossy(&out).to_string();
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, out)
}

/// Write raw bytes and read the response's status (0 if the connection closed first).
fn raw(addr: &str, bytes: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let _ = s.write_all(bytes);
    read_status(s)
}

/// The body of a request to `path` whose prompt is ordinary text, padded with whitespace to
/// exactly `len` bytes.
fn huge_body(path: &str, len: usize) -> String {
    let line = "the quick brown fox jumps over the lazy dog again and again\n";
    let text = line.repeat((len - 200) / (line.len() + 1));
    let mut b = if path == "/v1/chat/completions" {
        json!({"model": model(), "messages": [{"role": "user", "content": text}]})
    } else {
        json!({"model": model(), "prompt": text, "max_tokens": 1})
    }
    .to_string();
    assert!(b.len() <= len, "{} > {len}", b.len());
    b.extend(std::iter::repeat_n(' ', len - b.len()));
    b
}

/// Two requests of the largest body accepted (16 MiB, the `--max-body` default) at once, each
/// refused for exceeding the context quickly and with bounded memory. Before the bound: ~3.4
/// GB and 12-16 s of CPU per request, 6.5 GB for two at once.
#[test]
fn a_huge_prompt_is_refused_at_the_context_with_bounded_memory() {
    const MAX_BODY: usize = 16 << 20;
    let s = Server::start(&["-c", "256"]);
    let before = peak_rss(s.pid());
    let paths = ["/v1/chat/completions", "/v1/completions"];
    let bodies: Vec<String> = paths.iter().map(|p| huge_body(p, MAX_BODY)).collect();
    let t = Instant::now();
    let answers: Vec<(u16, String, Duration)> = std::thread::scope(|sc| {
        let jobs: Vec<_> = paths
            .iter()
            .zip(&bodies)
            .map(|(path, body)| {
                let s = &s;
                sc.spawn(move || {
                    let (st, r) = s
                        .try_request(
                            "POST",
                            path,
                            Some(body),
                            &[("Content-Type", "application/json")],
                        )
                        .expect("request");
                    (st, r, t.elapsed())
                })
            })
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let grew = peak_rss(s.pid()).saturating_sub(before);
    for (path, (st, r, took)) in paths.iter().zip(&answers) {
        assert_eq!(*st, 400, "{path}: {r}");
        let r: serde_json::Value = serde_json::from_str(r).unwrap();
        assert_eq!(r["error"]["code"], "context_length_exceeded", "{r}");
        assert!(
            *took < Duration::from_secs(8),
            "{path}: refused after {took:?}"
        );
    }
    // Now the JSON bodies and the rendered prompts (a few copies of 16 MiB each) dominate.
    assert!(grew < 400 << 20, "peak RSS grew by {} MiB", grew >> 20);
    eprintln!(
        "two 16 MiB prompts at once: {:?}, peak RSS +{} MiB",
        answers.iter().map(|a| a.2).max().unwrap(),
        grew >> 20
    );
    // A prompt that fits still works after that.
    let (st, r) = s.post(
        "/v1/completions",
        &json!({"model": model(), "prompt": "Once upon a time", "max_tokens": 2}),
    );
    assert_eq!(st, 200, "{r}");
}

#[test]
fn a_head_trickled_in_times_out() {
    let s = Server::start(&[]);
    let mut c = TcpStream::connect(&s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let head = format!("GET /health HTTP/1.1\r\nX-Slow: {}", "a".repeat(10_000));
    let t = Instant::now();
    let mut out = Vec::new();
    // One byte every 50 ms: faster than the server's read poll, never a complete head.
    for b in head.bytes() {
        if c.write_all(&[b]).is_err() {
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let _ = c.read_to_end(&mut out);
            break;
        }
        let mut buf = [0u8; 256];
        match c.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                break;
            }
            Err(_) => {}
        }
        assert!(t.elapsed() < Duration::from_secs(40), "never timed out");
    }
    let out = String::from_utf8_lossy(&out);
    assert!(out.starts_with("HTTP/1.1 408"), "{out}");
}

#[test]
fn idle_connections_do_not_shut_clients_out() {
    let s = Server::start(&["--max-connections", "4"]);
    // Far more idle connections than --max-connections.
    let idle: Vec<TcpStream> = (0..40)
        .filter_map(|_| TcpStream::connect(&s.addr).ok())
        .collect();
    let t = Instant::now();
    loop {
        match s.try_request("GET", "/health", None, &[]) {
            Ok((200, _)) => break,
            other => assert!(
                t.elapsed() < Duration::from_secs(10),
                "/health with idle connections open: {other:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(idle);
}

#[test]
fn header_parsing_is_strict() {
    let s = Server::start(&[]);
    let body = r#"{"model":"x","prompt":"a"}"#;
    let two = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nContent-Length: 3\r\n\r\n{body}",
        body.len()
    );
    let (st, out) = raw(&s.addr, two.as_bytes());
    assert_eq!(st, 400, "{out}");
    assert!(out.contains("Content-Length"), "{out}");
    let plus = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: +{}\r\n\r\n{body}",
        body.len()
    );
    let (st, out) = raw(&s.addr, plus.as_bytes());
    assert_eq!(st, 400, "{out}");
    // Identical repeats agree, so they are fine.
    let same = b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    let (st, out) = raw(&s.addr, same);
    assert_eq!(st, 200, "{out}");
}

#[test]
fn an_empty_api_key_is_refused() {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["serve", "--port", "0", "--api-key", ""])
        .env("SLUICE_CACHE_DIR", serve_util::cache_dir())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("--api-key"), "{err}");
    let errors: Vec<&str> = err.lines().filter(|l| !l.starts_with("[sluice]")).collect();
    assert_eq!(errors.len(), 1, "{err}");
}

/// A `GET /health` head of exactly `len` bytes (request line through the blank line).
fn head_of(len: usize) -> Vec<u8> {
    let start = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: ";
    let end = "\r\n\r\n";
    let pad = len - start.len() - end.len();
    format!("{start}{}{end}", "p".repeat(pad)).into_bytes()
}

/// Write `bytes` in `parts` pieces 20 ms apart, then read the response's status (0 if the
/// connection closed first).
fn raw_in_parts(addr: &str, bytes: &[u8], parts: usize) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    for piece in bytes.chunks(bytes.len().div_ceil(parts)) {
        if s.write_all(piece).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    read_status(s)
}

/// The head limit is exact: 64 KiB (request line through the blank line that ends it) is
/// accepted, one byte more is 431, whether it comes in one write or in pieces.
#[test]
fn the_head_limit_is_exact() {
    const LIMIT: usize = 64 * 1024;
    let s = Server::start(&[]);
    for parts in [1, 5] {
        let (st, out) = raw_in_parts(&s.addr, &head_of(LIMIT), parts);
        assert_eq!(
            st, 200,
            "a head of exactly {LIMIT} bytes in {parts} part(s): {out}"
        );
        let (st, out) = raw_in_parts(&s.addr, &head_of(LIMIT + 1), parts);
        assert_eq!(
            st,
            431,
            "a head of {} bytes in {parts} part(s): {out}",
            LIMIT + 1
        );
    }
    // Far over it, in one write.
    let (st, out) = raw(&s.addr, &head_of(80_000));
    assert_eq!(st, 431, "{out}");
}

/// A POST of a `len`-byte body to /v1/completions: its head.
fn post_head(len: usize) -> String {
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {len}\r\n\r\n"
    )
}

/// Send `body` after `head` in `piece`-byte writes `every` apart, looking for a response
/// between writes; returns what came back and when its first byte did (from the head's end).
/// Stops writing once a response arrives or the server closes.
fn trickle_body(
    addr: &str,
    head: &str,
    body: &[u8],
    piece: usize,
    every: Duration,
) -> (String, Duration) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    let t = Instant::now();
    s.set_read_timeout(Some(every)).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let mut at = None;
    for p in body.chunks(piece) {
        if s.write_all(p).is_err() {
            break;
        }
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                at = Some(t.elapsed());
                break;
            }
            Err(_) => {}
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no answer to a slow body"
        );
    }
    // The rest of the response, then the server's close (end of file or a reset).
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                at.get_or_insert(t.elapsed());
                out.extend_from_slice(&buf[..n]);
            }
        }
    }
    let closed = t.elapsed();
    (
        String::from_utf8_lossy(&out).to_string(),
        at.unwrap_or(closed),
    )
}

/// A body below the minimum rate (64 KiB/s beyond `--body-timeout`'s grace) is answered 408
/// and its connection closed about the grace after it began, however long it declared itself
/// (before, the time allowed grew with the declared length: 1 s + 16 s here). A body above
/// the rate that takes longer than the grace still goes through.
#[test]
fn a_body_below_the_minimum_rate_is_answered_408_and_closed() {
    let s = Server::start(&["--body-timeout", "1"]);
    // 1 MiB declared, 64 bytes every 50 ms (1.3 KB/s).
    let (out, at) = trickle_body(
        &s.addr,
        &post_head(1 << 20),
        &vec![b' '; 1 << 20],
        64,
        Duration::from_millis(50),
    );
    assert!(out.starts_with("HTTP/1.1 408"), "{out}");
    assert!(out.contains("Connection: close"), "{out}");
    assert!(
        at > Duration::from_millis(900) && at < Duration::from_secs(3),
        "408 after {at:?} (grace 1 s)"
    );
    // 256 KiB at 128 KiB/s (16 KiB every 125 ms): 2 s, twice the grace, but above the rate.
    let json = format!(
        r#"{{"model":"{}","prompt":"Once","max_tokens":1}}"#,
        model()
    );
    let mut body = json.into_bytes();
    body.resize(256 << 10, b' ');
    let (out, at) = trickle_body(
        &s.addr,
        &post_head(body.len()),
        &body,
        16 << 10,
        Duration::from_millis(125),
    );
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(at > Duration::from_millis(1500), "{at:?}");
    assert!(s.log_text().contains("408"), "the 408 is logged");
}

/// 300 clients (over the 256 of `--max-connections`) trickling request heads at once do not
/// shut a fresh client out: a head still arriving holds no slot, so /health answers at once,
/// and every trickler gets 408 and is closed at `--head-timeout`.
#[test]
fn many_head_tricklers_do_not_deny_service() {
    const N: usize = 300;
    let s = Server::start(&["--head-timeout", "3"]);
    let mut tricklers: Vec<TcpStream> = (0..N)
        .map(|_| {
            let c = TcpStream::connect(&s.addr).unwrap();
            c.set_nonblocking(true).unwrap();
            c
        })
        .collect();
    let head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let t = Instant::now();
    let mut sent = 0;
    let mut out: Vec<Vec<u8>> = vec![Vec::new(); N];
    let mut closed = vec![false; N];
    let mut health: Option<Duration> = None;
    let mut buf = [0u8; 1024];
    // One byte to every trickler each 100 ms, never a whole head; read what comes back.
    while closed.iter().any(|c| !c) && t.elapsed() < Duration::from_secs(10) {
        for (i, c) in tricklers.iter_mut().enumerate() {
            if closed[i] {
                continue;
            }
            if sent < head.len() {
                let _ = c.write(&head[sent..sent + 1]);
            }
            loop {
                match c.read(&mut buf) {
                    Ok(0) => {
                        closed[i] = true;
                        break;
                    }
                    Ok(n) => out[i].extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        closed[i] = true;
                        break;
                    }
                }
            }
        }
        sent += 1;
        // Once every trickler has begun its head: a fresh client asks for /health.
        if sent == 5 {
            let h = Instant::now();
            let (st, body) = s.get("/health");
            assert_eq!(st, 200, "/health with {N} tricklers: {body}");
            health = Some(h.elapsed());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let took = t.elapsed();
    let health = health.expect("/health was asked");
    assert!(health < Duration::from_secs(1), "/health took {health:?}");
    let answered = out
        .iter()
        .filter(|o| o.starts_with(b"HTTP/1.1 408"))
        .count();
    assert_eq!(
        answered, N,
        "tricklers answered 408 (all closed after {took:?})"
    );
    assert!(
        closed.iter().all(|&c| c) && took < Duration::from_secs(6),
        "tricklers closed: {} of {N} after {took:?} (--head-timeout 3)",
        closed.iter().filter(|&&c| c).count()
    );
    let (st, _) = s.get("/health");
    assert_eq!(st, 200);
}
