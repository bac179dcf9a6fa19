//! Prompt reuse across restarts (`--kv-dir`) and clean shutdown of `sluice serve`.
//! The reference for "resumed generation is right" is the same request answered by a server
//! that computes everything from scratch: at temperature 0 both must give the same text.

mod serve_util;

use serde_json::{json, Value};
use serve_util::Server;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

fn chat(server: &Server, messages: &Value, max_tokens: u32) -> (String, Value) {
    let (st, body) = server.post(
        "/v1/chat/completions",
        &json!({"model": sluice::default_model::model_id(), "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(st, 200, "{body}");
    let text = body["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    (text, body["usage"].clone())
}

#[test]
fn kv_sessions_survive_a_restart_bit_identically() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("serve-kv-sessions");
    let _ = std::fs::remove_dir_all(&dir);
    let kv = dir.to_str().expect("utf-8 path");
    let first = json!([{"role": "system", "content": "You are a storyteller."}, {"role": "user", "content": "Tell me a story about a lighthouse."}]);

    // Server 1 answers the first turn and saves the session on the way.
    let s1 = Server::start(&["-c", "512", "--kv-dir", kv]);
    let (reply, u1) = chat(&s1, &first, 16);
    assert_eq!(u1["reused_tokens"], 0, "{u1}");
    assert_eq!(s1.stop(), 0);
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        files
            .iter()
            .any(|f| f.starts_with("session-") && f.ends_with(".slkv")),
        "{files:?}"
    );
    assert!(
        !files.iter().any(|f| f.ends_with(".tmp")),
        "temporary file left behind: {files:?}"
    );

    let mut second = first.clone();
    second
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "assistant", "content": reply}));
    second
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "user", "content": "And then?"}));

    // A write a crash cut short (a process that is gone) is cleared when the next one starts.
    let stale = dir.join(".session-00000000000000ab.4294967000.tmp");
    std::fs::write(&stale, b"SLUICEKV partial").unwrap();

    // Server 2 starts with the same directory: the second turn reuses the saved prefix.
    let s2 = Server::start(&["-c", "512", "--kv-dir", kv]);
    assert!(
        !stale.exists(),
        "stale temporary session file left in --kv-dir"
    );
    let (resumed, u2) = chat(&s2, &second, 24);
    let (_, metrics) = s2.get("/metrics");
    assert_eq!(s2.stop(), 0);
    let reused = u2["reused_tokens"].as_u64().unwrap();
    assert!(
        reused >= u1["prompt_tokens"].as_u64().unwrap() - 1,
        "restored prefix too short: {u2} vs first turn {u1}"
    );
    assert!(
        metrics.contains(&format!(
            "sluice_kv_sessions_loaded_total{{model=\"{}\"}} 1",
            sluice::default_model::model_id()
        )),
        "{metrics}"
    );

    // Server 3 has no sessions: it computes everything, and must produce the same text.
    let s3 = Server::start(&["-c", "512"]);
    let (fresh, u3) = chat(&s3, &second, 24);
    assert_eq!(u3["reused_tokens"], 0, "{u3}");
    assert_eq!(
        resumed, fresh,
        "a resumed session must continue exactly like a fresh computation"
    );
    // And the first turn replayed on a restored session gives the first reply again.
    let s4 = Server::start(&["-c", "512", "--kv-dir", kv]);
    let (again, u4) = chat(&s4, &first, 16);
    assert_eq!(again, reply);
    assert_eq!(
        u4["reused_tokens"].as_u64().unwrap(),
        u1["prompt_tokens"].as_u64().unwrap() - 1,
        "{u4}"
    );
    drop(s3);
    assert_eq!(s4.stop(), 0);
}

#[test]
fn sigterm_during_a_stream_ends_it_cleanly_and_exits_0() {
    let server = Server::start(&["--shutdown-grace", "0.3"]);
    let addr = server.addr.clone();
    let reader = std::thread::spawn(move || {
        let body = json!({"model": sluice::default_model::model_id(), "prompt": "Once", "max_tokens": 3000, "temperature": 0, "ignore_eos": true, "stream": true}).to_string();
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    });
    // Let it stream for a moment.
    std::thread::sleep(Duration::from_millis(700));
    let t = Instant::now();
    let log = server.log_text();
    let code = server.stop();
    assert_eq!(code, 0, "{log}");
    assert!(t.elapsed() < Duration::from_secs(10));
    let stream = reader.join().unwrap();
    assert!(stream.starts_with("HTTP/1.1 200"), "{stream}");
    assert!(stream.contains("\"text_completion\""), "{stream}");
    assert!(
        stream.contains("shutting down") && stream.contains("data: [DONE]"),
        "stream should end with an error event and [DONE]: {}",
        &stream[stream.len().saturating_sub(500)..]
    );
    assert!(
        stream.ends_with("0\r\n\r\n"),
        "chunked stream not terminated"
    );
}

#[test]
fn streamed_experts_serve_the_same_text_and_export_cache_figures() {
    let msgs = json!([{"role": "user", "content": "Stream the experts."}]);
    let resident = Server::start(&["--experts", "resident"]);
    let (a, _) = chat(&resident, &msgs, 12);
    let (_, m) = resident.get("/metrics");
    assert!(
        !m.contains("sluice_expert_hit_rate"),
        "no cache figures without a cache: {m}"
    );
    drop(resident);
    let streamed = Server::start(&[
        "--experts",
        "stream",
        "--cap",
        "2",
        "--io",
        "buffered",
        "--usage-freeze",
    ]);
    let (b, _) = chat(&streamed, &msgs, 12);
    let (_, m) = streamed.get("/metrics");
    assert_eq!(a, b, "streaming experts must not change the text");
    assert!(m.contains("sluice_expert_hit_rate{"), "{m}");
    let read = m
        .lines()
        .find(|l| l.starts_with("sluice_expert_bytes_read_total{"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert!(
        read.is_some_and(|r| r > 0.0),
        "experts were read from disk: {m}"
    );
    assert_eq!(streamed.stop(), 0);
}
