//! The HTTP layer's protocol features (hyper on tokio): pipelined keep-alive requests, chunked
//! request bodies (and their `--max-body` limit), `Expect: 100-continue`, and idle clients
//! that cost neither a thread nor anyone else's request.

mod serve_util;

use serde_json::{json, Value};
use serve_util::Server;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn model() -> String {
    sluice::default_model::model_id()
}

fn connect(s: &Server) -> TcpStream {
    let c = TcpStream::connect(&s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    c
}

/// One response from `r`: status, headers (lower-case names), body (Content-Length or chunked).
fn read_response(r: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>, String) {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status: u16 = line
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':').unwrap();
        headers.push((k.to_ascii_lowercase(), v.trim().to_string()));
    }
    let get = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if let Some(n) = get("content-length") {
        body.resize(n.parse().unwrap(), 0);
        r.read_exact(&mut body).unwrap();
    } else if get("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).unwrap();
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            let mut chunk = vec![0u8; n + 2];
            r.read_exact(&mut chunk).unwrap();
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    }
    (status, headers, String::from_utf8(body).unwrap())
}

fn completion_body(prompt: &str) -> String {
    json!({"model": model(), "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": true})
        .to_string()
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let s = Server::start(&[]);
    let body = completion_body("Once upon a time");
    let mut c = connect(&s);
    // Three requests in one write: the second a generation, the third closes.
    let all = format!(
        "GET /health HTTP/1.1\r\nHost: x\r\n\r\n\
         POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}\
         GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        body.len()
    );
    c.write_all(all.as_bytes()).unwrap();
    let mut r = BufReader::new(c);
    let (st, _, b) = read_response(&mut r);
    assert_eq!(st, 200, "{b}");
    assert!(b.contains("\"status\":\"ok\""), "{b}");
    let (st, _, b) = read_response(&mut r);
    assert_eq!(st, 200, "{b}");
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    let (st, h, b) = read_response(&mut r);
    assert_eq!(st, 200, "{b}");
    assert!(b.contains(&model()), "{b}");
    assert!(
        h.iter().any(|(k, v)| k == "connection" && v == "close"),
        "{h:?}"
    );
    let mut rest = Vec::new();
    let _ = r.read_to_end(&mut rest);
    assert!(rest.is_empty(), "bytes after the last response");
}

#[test]
fn chunked_bodies_and_expect_continue() {
    let s = Server::start(&["--max-body", "4096"]);
    let body = completion_body("Once upon a time");
    let want = s.post("/v1/completions", &serde_json::from_str(&body).unwrap());
    assert_eq!(want.0, 200, "{}", want.1);

    // The same body in three chunks.
    let mut c = connect(&s);
    let (a, rest) = body.split_at(10);
    let (b, d) = rest.split_at(7);
    let mut req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".to_string();
    for part in [a, b, d] {
        req.push_str(&format!("{:x}\r\n{part}\r\n", part.len()));
    }
    req.push_str("0\r\n\r\n");
    c.write_all(req.as_bytes()).unwrap();
    let mut r = BufReader::new(c);
    let (st, _, got) = read_response(&mut r);
    assert_eq!(st, 200, "{got}");
    let got: Value = serde_json::from_str(&got).unwrap();
    assert_eq!(got["choices"][0]["text"], want.1["choices"][0]["text"]);

    // A chunked body over --max-body: 413 once it passes the limit.
    let mut c = connect(&s);
    let big = "x".repeat(3000);
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n{0:x}\r\n{big}\r\n{0:x}\r\n{big}\r\n0\r\n\r\n",
        big.len()
    );
    c.write_all(req.as_bytes()).unwrap();
    let mut r = BufReader::new(c);
    let (st, _, got) = read_response(&mut r);
    assert_eq!(st, 413, "{got}");
    assert!(got.contains("--max-body"), "{got}");

    // Expect: 100-continue: the server asks for the body, then answers.
    let mut c = connect(&s);
    write!(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\n\r\n", body.len()).unwrap();
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(line.starts_with("HTTP/1.1 100"), "{line:?}");
    let mut blank = String::new();
    r.read_line(&mut blank).unwrap();
    assert_eq!(blank, "\r\n");
    c.write_all(body.as_bytes()).unwrap();
    let (st, _, got) = read_response(&mut r);
    assert_eq!(st, 200, "{got}");

    // Expect: 100-continue over the limit: 413 at once, no 100 and no body sent.
    let mut c = connect(&s);
    write!(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\nExpect: 100-continue\r\n\r\n").unwrap();
    let mut r = BufReader::new(c);
    let (st, _, got) = read_response(&mut r);
    assert_eq!(st, 413, "{got}");
}

/// Threads of process `pid`.
fn threads(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

#[test]
fn idle_clients_hold_no_thread_and_block_nobody() {
    let s = Server::start(&[]);
    let before = threads(s.pid());
    // 200 connections: half silent, half that sent part of a head and stopped.
    let idle: Vec<TcpStream> = (0..200)
        .map(|i| {
            let mut c = connect(&s);
            if i % 2 == 1 {
                c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                    .unwrap();
            }
            c
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    let (st, v) = s.post(
        "/v1/completions",
        &json!({"model": model(), "prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": true}),
    );
    assert_eq!(st, 200, "{v}");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    let during = threads(s.pid());
    assert!(
        during < before + 20,
        "{before} threads before 200 idle connections, {during} with them"
    );
    drop(idle);
    assert_eq!(s.stop(), 0);
}
