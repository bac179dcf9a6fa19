//! Issue 20, items 1, 2 and 8 (HTTP): bounded work per request, timeouts that always fire,
//! idle connections that do not shut active clients out, strict header parsing, and an empty
//! API key refused. The memory check reads the server process's own peak RSS (VmHWM).

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

/// Write raw bytes and read the response's status (0 if the connection closed first).
fn raw(addr: &str, bytes: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let _ = s.write_all(bytes);
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

#[test]
fn a_huge_prompt_is_refused_at_the_context_with_bounded_memory() {
    let s = Server::start(&["-c", "256"]);
    let before = peak_rss(s.pid());
    // Just under the 16 MiB body limit, of ordinary text.
    let line = "the quick brown fox jumps over the lazy dog again and again\n";
    let text = line.repeat((15 << 20) / line.len());
    let t = Instant::now();
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"model": model(), "messages": [{"role": "user", "content": text}]}),
        ),
        (
            "/v1/completions",
            json!({"model": model(), "prompt": text, "max_tokens": 1}),
        ),
    ] {
        let (st, r) = s.post(path, &body);
        assert_eq!(st, 400, "{path}: {r}");
        assert_eq!(r["error"]["code"], "context_length_exceeded", "{r}");
    }
    let took = t.elapsed();
    let grew = peak_rss(s.pid()).saturating_sub(before);
    // Before the bound: ~3.4 GB and 12-16 s per request. Now the JSON body and the rendered
    // prompt (a few copies of 15 MiB) dominate.
    assert!(grew < 400 << 20, "peak RSS grew by {} MiB", grew >> 20);
    assert!(took < Duration::from_secs(60), "{took:?}");
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
    // A complete head of 80 KB in one write: over the 64 KiB head limit.
    let big = format!(
        "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "b".repeat(80_000)
    );
    let (st, out) = raw(&s.addr, big.as_bytes());
    assert_eq!(st, 431, "{out}");
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
