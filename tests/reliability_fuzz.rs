//! Issue 20, item 6 of what to build: fuzzing that stays. Four targets — the GGUF reader, the
//! safetensors reader with config.json, the HTTP request parser (through a running server) and
//! the chat-template renderer — each driven by a seeded mutator over real seed inputs for a
//! bounded time: `SLUICE_FUZZ_SECS` seconds per target (default 3, so the normal test run
//! stays short; CI's long job sets 60). The property: no panic, no crash, no hang; every
//! failure is an error value. Each input runs on a worker thread with a limit
//! (`SLUICE_FUZZ_INPUT_SECS`, default 20 s): an input that panics or hangs is written under
//! target/tmp/fuzz-crashers/ and the failure names that file and the seed, so it can be
//! committed below as a regression case (the HTTP target also counts a server that neither
//! answers nor closes within half the limit as a hang).
//!
//! Runs made (2026-12-06, the 2-core dev box, `SLUICE_FUZZ_SECS=60 cargo test --release --test
//! reliability_fuzz -- --test-threads=1`, seed 0x5eed_f00d): GGUF reader 17,265 inputs,
//! safetensors + config.json 10,543, chat templates 117,262 (over 13 templates), HTTP 256,680
//! requests; no crasher (no panic, no hang) was found, so none is committed. (The issue's own
//! report, about 37,000 fuzzed runs of `inspect`/`logits`/`run`, led to the reproducers in
//! tests/reliability_sizes.rs and tests/reliability_files.rs.)

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

/// How long one input may take before it counts as a hang: `SLUICE_FUZZ_INPUT_SECS` (default
/// 20; a normal input takes milliseconds).
fn input_limit() -> Duration {
    let s: f64 = std::env::var("SLUICE_FUZZ_INPUT_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20.0);
    Duration::from_secs_f64(s)
}

/// Save a failing input of `target` under the crasher directory; its path.
fn save_crasher(target: &str, run: usize, b: &[u8]) -> PathBuf {
    let p = crasher_dir().join(format!("{target}-{run}.bin"));
    std::fs::write(&p, b).unwrap();
    p
}

/// Run `f` over mutations of `seeds` until the time budget is spent. `f` runs on a worker
/// thread: an input that panics, or that has not finished after `input_limit()` (a hang: the
/// worker is left behind), fails the test after saving the input and naming its file.
fn fuzz(target: &str, seeds: &[Vec<u8>], f: impl Fn(&[u8]) + Send + 'static) -> usize {
    fuzz_for(target, seeds, budget(), input_limit(), f)
}

/// `fuzz` for `time`, with a hang declared after `limit`.
fn fuzz_for(
    target: &str,
    seeds: &[Vec<u8>],
    time: Duration,
    limit: Duration,
    f: impl Fn(&[u8]) + Send + 'static,
) -> usize {
    let (inputs, worker_in) = std::sync::mpsc::channel::<Vec<u8>>();
    let (worker_out, results) = std::sync::mpsc::channel::<bool>();
    std::thread::Builder::new()
        .name(format!("fuzz-{target}"))
        .spawn(move || {
            for b in worker_in {
                let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&b))).is_ok();
                if worker_out.send(ok).is_err() {
                    break;
                }
            }
        })
        .unwrap();
    let mut r = Rng(seed() ^ (target.len() as u64 * 0x9e37_79b9));
    let t = Instant::now();
    let mut runs = 0;
    while t.elapsed() < time || runs < seeds.len() {
        let mut b = seeds[runs % seeds.len()].clone();
        if runs >= seeds.len() {
            for _ in 0..1 + r.below(4) {
                mutate(&mut r, &mut b);
            }
        }
        inputs.send(b.clone()).unwrap();
        match results.recv_timeout(limit) {
            Ok(true) => {}
            Ok(false) => {
                let p = save_crasher(target, runs, &b);
                panic!(
                    "{target}: input #{runs} (SLUICE_FUZZ_SEED={}) panicked; saved to {}",
                    seed(),
                    p.display()
                );
            }
            Err(_) => {
                let p = save_crasher(target, runs, &b);
                panic!(
                    "{target}: input #{runs} (SLUICE_FUZZ_SEED={}) hung (no result after {limit:?}); saved to {}",
                    seed(),
                    p.display()
                );
            }
        }
        runs += 1;
    }
    runs
}

/// The harness itself: an input that hangs is reported (not waited on forever) with the file
/// it was saved to, and one that panics likewise.
#[test]
fn a_hanging_or_panicking_input_is_reported_with_its_file() {
    let seeds = vec![b"fine".to_vec(), b"hang".to_vec()];
    let hung = std::panic::catch_unwind(|| {
        fuzz_for(
            "selftest-hang",
            &seeds,
            Duration::ZERO,
            Duration::from_millis(200),
            |b| {
                if b == b"hang" {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            },
        )
    });
    let msg = *hung
        .expect_err("the hang was not reported")
        .downcast::<String>()
        .unwrap();
    assert!(
        msg.contains("input #1 (") && msg.contains(") hung"),
        "{msg}"
    );
    let path = msg.rsplit("saved to ").next().unwrap();
    assert_eq!(std::fs::read(path).unwrap(), b"hang", "{msg}");
    let panicked = std::panic::catch_unwind(|| {
        fuzz_for(
            "selftest-panic",
            &seeds[..1],
            Duration::ZERO,
            Duration::from_secs(10),
            |_| panic!("boom"),
        )
    });
    let msg = *panicked
        .expect_err("the panic was not reported")
        .downcast::<String>()
        .unwrap();
    assert!(
        msg.contains("input #0 (") && msg.contains(") panicked"),
        "{msg}"
    );
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
    let n = fuzz("gguf", &seeds, move |b| {
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
    let runs = fuzz("safetensors", &[seed], move |b| {
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
    let n_templates = templates.len();
    let runs = fuzz("chat", &seeds, move |b| {
        let Ok(serde_json::Value::Array(msgs)) = serde_json::from_slice(b) else {
            return;
        };
        for t in &templates {
            let _ = sluice::chat::render_chat_json_at(t, &msgs, true, "<s>", "</s>", None, 0);
        }
    });
    eprintln!("chat: {runs} inputs over {n_templates} templates");
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
    // Every input ends its side of the connection, so the server answers or closes at once;
    // one that does neither within half the input limit is a hang of the server.
    let wait = input_limit() / 2;
    let runs = fuzz("http", &seeds, move |b| {
        let Ok(mut c) = std::net::TcpStream::connect(&addr) else {
            panic!("the server stopped accepting connections");
        };
        c.set_read_timeout(Some(wait)).unwrap();
        let _ = c.write_all(b);
        let _ = c.shutdown(std::net::Shutdown::Write);
        let mut out = Vec::new();
        if let Err(e) = c.read_to_end(&mut out) {
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                panic!("the server neither answered nor closed within {wait:?}");
            }
        }
    });
    let (st, _) = s.get("/health");
    assert_eq!(st, 200, "server unhealthy after fuzzing: {}", s.log_text());
    assert!(!s.log_text().contains("panicked"), "{}", s.log_text());
    eprintln!("http: {runs} requests");
}
