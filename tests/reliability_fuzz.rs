//! Issue 20, item 6 of what to build: fuzzing that stays. Four targets — the GGUF reader, the
//! safetensors reader with config.json, the HTTP request parser (through a running server) and
//! the chat-template renderer — each driven by a seeded mutator over real seed inputs for a
//! bounded time: `SLUICE_FUZZ_SECS` seconds per target (default 3, so the normal test run
//! stays short; CI's long job sets 60). The property: no panic, no crash, no hang; every
//! failure is an error value. A failing input is written under target/tmp/fuzz-crashers/ and
//! the seed printed, so it can be committed below as a regression case.

#[path = "serve_util/mod.rs"]
mod serve_util;

use sluice::format::ModelFiles;
use sluice::model::ModelConfig;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn budget() -> Duration {
    let s: f64 = std::env::var("SLUICE_FUZZ_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3.0);
    Duration::from_secs_f64(s)
}

fn seed() -> u64 {
    std::env::var("SLUICE_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_f00d)
}

/// xorshift64*: a small deterministic generator (the seed makes a run repeatable).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Values that break sizes: zero, one, powers of two and their neighbours, the maxima.
const INTERESTING: [u64; 12] = [
    0,
    1,
    2,
    31,
    32,
    255,
    1 << 16,
    (1 << 31) - 1,
    1 << 31,
    1 << 32,
    1 << 63,
    u64::MAX,
];

/// One random mutation of `b` (bytes flipped, set, overwritten by an interesting
/// little-endian integer, truncated, spliced).
fn mutate(r: &mut Rng, b: &mut Vec<u8>) {
    if b.is_empty() {
        b.push(r.next() as u8);
        return;
    }
    match r.below(7) {
        0 => {
            let i = r.below(b.len());
            b[i] ^= 1 << r.below(8);
        }
        1 => {
            let i = r.below(b.len());
            b[i] = r.next() as u8;
        }
        2 | 3 => {
            let v = INTERESTING[r.below(INTERESTING.len())];
            let w = [1usize, 2, 4, 8][r.below(4)];
            let i = r.below(b.len());
            for (k, byte) in v.to_le_bytes()[..w].iter().enumerate() {
                if let Some(x) = b.get_mut(i + k) {
                    *x = *byte;
                }
            }
        }
        4 => {
            let n = r.below(b.len());
            b.truncate(n);
        }
        5 => {
            let i = r.below(b.len());
            let n = r.below(64).min(b.len() - i);
            let chunk: Vec<u8> = b[i..i + n].to_vec();
            let at = r.below(b.len());
            b.splice(at..at, chunk);
        }
        _ => {
            let i = r.below(b.len());
            let n = r.below(16).min(b.len() - i);
            b.drain(i..i + n);
        }
    }
}

fn crasher_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-crashers");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Run `f` over mutations of `seeds` until the time budget is spent; a panic fails the test
/// after saving the input.
fn fuzz(target: &str, seeds: &[Vec<u8>], f: impl Fn(&[u8])) -> usize {
    let mut r = Rng(seed() ^ (target.len() as u64 * 0x9e37_79b9));
    let t = Instant::now();
    let mut runs = 0;
    while t.elapsed() < budget() || runs < seeds.len() {
        let mut b = seeds[runs % seeds.len()].clone();
        if runs >= seeds.len() {
            for _ in 0..1 + r.below(4) {
                mutate(&mut r, &mut b);
            }
        }
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&b))).is_err() {
            let p = crasher_dir().join(format!("{target}-{runs}.bin"));
            std::fs::write(&p, &b).unwrap();
            panic!("{target}: input #{runs} panicked; saved to {}", p.display());
        }
        runs += 1;
    }
    runs
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Open a model from files, read its config and every tensor's bytes, dequantize small ones.
fn exercise(path: &Path) {
    let Ok(files) = ModelFiles::open(path) else {
        return;
    };
    let _ = ModelConfig::from_files(&files);
    for t in files.tensors() {
        let _ = files.bytes(t);
        if t.n_elems() <= 1 << 16 {
            let _ = files.dequantize(t);
        }
    }
}

#[test]
fn fuzz_gguf_reader() {
    let seeds: Vec<Vec<u8>> = ["all-types.gguf", "all-types-v2.gguf", "unknown-type.gguf"]
        .iter()
        .map(|n| std::fs::read(fixtures().join("format").join(n)).unwrap())
        .collect();
    let p = crasher_dir().join(format!("work-{}.gguf", std::process::id()));
    let n = fuzz("gguf", &seeds, |b| {
        std::fs::write(&p, b).unwrap();
        exercise(&p);
    });
    eprintln!("gguf: {n} inputs");
}

#[test]
fn fuzz_safetensors_and_config() {
    let src = fixtures().join("format/hf-fused");
    let st = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let (head, data) = (st[..8 + n].to_vec(), st[8 + n..].to_vec());
    let cfg = std::fs::read(src.join("config.json")).unwrap();
    let dir = crasher_dir().join(format!("work-st-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // One input = config.json, a 0xff separator, the safetensors head (the data is fixed).
    let mut seed = cfg.clone();
    seed.push(0xff);
    seed.extend(&head);
    let runs = fuzz("safetensors", &[seed], |b| {
        let (c, h) = match b.iter().position(|&x| x == 0xff) {
            Some(i) => (&b[..i], &b[i + 1..]),
            None => (b, &b[..0]),
        };
        std::fs::write(dir.join("config.json"), c).unwrap();
        let mut f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
        f.write_all(h).unwrap();
        f.write_all(&data).unwrap();
        drop(f);
        exercise(&dir);
    });
    eprintln!("safetensors: {runs} inputs");
}

#[test]
fn fuzz_chat_templates() {
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("chat/expected.json")).unwrap())
            .unwrap();
    let mut templates = Vec::new();
    let vendor = Path::new(env!("CARGO_MANIFEST_DIR")).join("vendor-data/templates");
    if let Ok(rd) = std::fs::read_dir(&vendor) {
        let mut names: Vec<PathBuf> = rd.filter_map(|e| e.ok()).map(|e| e.path()).collect();
        names.sort();
        for p in names.into_iter().take(12) {
            if let Ok(t) = std::fs::read_to_string(p) {
                templates.push(t);
            }
        }
    }
    let files = ModelFiles::open(&fixtures().join("models/qwen3_moe/model-f32.gguf")).unwrap();
    if let Some(t) = files
        .meta("tokenizer.chat_template")
        .and_then(|v| v.as_str())
    {
        templates.push(t.to_string());
    }
    let seeds: Vec<Vec<u8>> = expected["conversations"]
        .as_object()
        .unwrap()
        .values()
        .map(|c| c.to_string().into_bytes())
        .collect();
    let runs = fuzz("chat", &seeds, |b| {
        let Ok(serde_json::Value::Array(msgs)) = serde_json::from_slice(b) else {
            return;
        };
        for t in &templates {
            let _ = sluice::chat::render_chat_json_at(t, &msgs, true, "<s>", "</s>", None, 0);
        }
    });
    eprintln!("chat: {runs} inputs over {} templates", templates.len());
}

#[test]
fn fuzz_http_requests() {
    let s = serve_util::Server::start(&["-c", "64"]);
    let body = format!(
        r#"{{"model":"{}","prompt":"Once","max_tokens":1}}"#,
        sluice::default_model::model_id()
    );
    let seeds: Vec<Vec<u8>> = vec![
        format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).into_bytes(),
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        b"GET /v1/models HTTP/1.0\r\nConnection: keep-alive\r\n\r\n".to_vec(),
    ];
    let addr = s.addr.clone();
    let runs = fuzz("http", &seeds, |b| {
        let Ok(mut c) = std::net::TcpStream::connect(&addr) else {
            panic!("the server stopped accepting connections");
        };
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let _ = c.write_all(b);
        let _ = c.shutdown(std::net::Shutdown::Write);
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
    });
    let (st, _) = s.get("/health");
    assert_eq!(st, 200, "server unhealthy after fuzzing: {}", s.log_text());
    assert!(!s.log_text().contains("panicked"), "{}", s.log_text());
    eprintln!("http: {runs} requests");
}
