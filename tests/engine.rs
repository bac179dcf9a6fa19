//! The engine through the binary: every command is a client of the same engine, so placement
//! and drafting options reach `logits`, `chat` and `serve` as they reach `run`, and change
//! nothing that is computed.
//!
//! - `logits` and `chat` with streamed experts (`--experts stream --cap 1`, one evictable slot
//!   per layer, so nearly every expert is read from disk; the untied embedding table left in the
//!   mapped file) equal the resident run bit for bit;
//! - `serve --mtp 2` at temperature 0 returns exactly `run --mtp 0`'s text, also for a request
//!   that reuses the previous one's cache (the MTP head re-levelled after prefix sync), on a
//!   fixture with an MTP layer (DeepSeek-V3 and GLM-4.5 shapes);
//! - `chat --kv-dir` resumes a saved session and answers identically;
//! - unsupported flag combinations fail with one line naming the flag, exit 1, before the
//!   model is placed (no `[plan]` line), `serve --parallel N` with what cannot batch among them.

mod serve_util;

use serde_json::json;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn cache() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("engine-cache")
}

fn default_model() -> PathBuf {
    std::env::set_var("SLUICE_CACHE_DIR", cache());
    sluice::default_model::ensure_random().unwrap()
}

fn fixture(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(family)
}

fn sluice(args: &[&str], stdin: Option<&str>) -> (i32, Vec<u8>, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sluice"));
    c.args(args)
        .env("SLUICE_CACHE_DIR", cache())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::piped());
    let mut child = c.spawn().unwrap();
    if let Some(s) = stdin {
        // A process that refuses its flags exits before reading: a broken pipe is fine.
        let _ = child.stdin.take().unwrap().write_all(s.as_bytes());
    } else {
        drop(child.stdin.take());
    }
    let o = child.wait_with_output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        o.stdout,
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

#[test]
fn logits_with_streamed_experts_equal_resident_bit_for_bit() {
    let m = default_model();
    let m = m.to_str().unwrap();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("engine-logits");
    std::fs::create_dir_all(&dir).unwrap();
    let tokens = "1,5,42,7,99,3,250,17,64,8,31,2";
    let mut outs = Vec::new();
    for (name, flags) in [
        ("resident", &["--experts", "resident"][..]),
        ("stream", &["--experts", "stream", "--cap", "1"][..]),
        (
            "stream-buffered",
            &[
                "--experts",
                "stream",
                "--cap",
                "1",
                "--io",
                "buffered",
                "-b",
                "5",
            ][..],
        ),
    ] {
        let out = dir.join(format!("{name}.npy"));
        let (code, _, err) = sluice(
            &[
                &[
                    "logits",
                    m,
                    "--tokens",
                    tokens,
                    "--out",
                    out.to_str().unwrap(),
                ][..],
                &["-t", "2", "--gpu", "off"],
                flags,
            ]
            .concat(),
            None,
        );
        assert_eq!(code, 0, "{name}: {err}");
        assert!(err.is_empty(), "{name}: logits is quiet: {err}");
        outs.push((name, std::fs::read(&out).unwrap()));
    }
    for (name, bytes) in &outs[1..] {
        assert!(
            *bytes == outs[0].1,
            "{name}: logits differ from the resident run"
        );
    }
}

#[test]
fn chat_with_streamed_experts_equals_resident() {
    let m = default_model();
    let m = m.to_str().unwrap();
    let turns = "hi\ntell me more\n\n";
    let base = [
        "chat", m, "-n", "10", "--temp", "0", "-t", "2", "--gpu", "off",
    ];
    let (code, resident, err) = sluice(
        &[&base[..], &["--experts", "resident"]].concat(),
        Some(turns),
    );
    assert_eq!(code, 0, "{err}");
    let (code, streamed, err) = sluice(
        &[&base[..], &["--experts", "stream", "--cap", "1"]].concat(),
        Some(turns),
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("[plan] experts: streamed"), "{err}");
    // The default model's embedding table is untied: streamed on the CPU it stays in the mapped
    // file, unlocked, read a row per token — same text.
    assert!(err.contains("[plan] embedding: "), "{err}");
    assert_eq!(
        String::from_utf8_lossy(&streamed),
        String::from_utf8_lossy(&resident)
    );
    assert_eq!(
        String::from_utf8_lossy(&resident).matches("> ").count(),
        3,
        "two turns answered"
    );
}

#[test]
fn chat_resumes_a_saved_session_identically() {
    let m = default_model();
    let m = m.to_str().unwrap();
    let kv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("engine-chat-kv");
    let _ = std::fs::remove_dir_all(&kv);
    let turns = "hello there\nand then what\n\n";
    let base = [
        "chat", m, "-n", "12", "--temp", "0", "-t", "2", "--gpu", "off",
    ];
    let (code, plain, err) = sluice(&base, Some(turns));
    assert_eq!(code, 0, "{err}");
    let with_kv = [&base[..], &["--kv-dir", kv.to_str().unwrap()]].concat();
    let (code, first, err) = sluice(&with_kv, Some(turns));
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("restored"), "nothing saved yet: {err}");
    let (code, resumed, err) = sluice(&with_kv, Some(turns));
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("saved session(s)") && err.contains("restored from --kv-dir"),
        "the first turn resumes the saved conversation: {err}"
    );
    let timing = err
        .lines()
        .find(|l| l.starts_with("[timing]"))
        .expect("a timing line");
    assert!(!timing.contains("reused 0 "), "{timing}");
    assert_eq!(
        String::from_utf8_lossy(&first),
        String::from_utf8_lossy(&plain)
    );
    assert_eq!(
        String::from_utf8_lossy(&resumed),
        String::from_utf8_lossy(&plain)
    );
}

/// `run -p TEXT` prints TEXT then the generation, then a newline.
fn run_text(model: &str, prompt: &str, n: usize, extra: &[&str]) -> String {
    let n = n.to_string();
    let (code, out, err) = sluice(
        &[
            &[
                "run",
                model,
                "-p",
                prompt,
                "-n",
                &n,
                "--temp",
                "0",
                "--ignore-eos",
                "-t",
                "2",
                "-c",
                "256",
                "--gpu",
                "off",
            ][..],
            extra,
        ]
        .concat(),
        None,
    );
    assert_eq!(code, 0, "{err}");
    let out = String::from_utf8(out).unwrap();
    out.strip_prefix(prompt)
        .and_then(|s| s.strip_suffix('\n'))
        .unwrap_or_else(|| panic!("run output {out:?} does not echo the prompt"))
        .to_string()
}

#[test]
fn serve_with_mtp_returns_run_without_mtp_text() {
    for family in ["deepseek_v3", "glm4_moe"] {
        let dir = fixture(family);
        let model = dir.to_str().unwrap();
        let g: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("greedy.json")).unwrap())
                .unwrap();
        let prompt = g["prompt_text"].as_str().unwrap().to_string();
        let want = run_text(model, &prompt, 16, &["--mtp", "0"]);
        let server = serve_util::Server::start(&[model, "--mtp", "2", "-c", "256", "--gpu", "off"]);
        let ask = |p: &str| {
            let (st, body) = server.post(
                "/v1/completions",
                &json!({"model": family, "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": true}),
            );
            assert_eq!(st, 200, "{family}: {body}");
            (
                body["choices"][0]["text"].as_str().unwrap().to_string(),
                body["usage"].clone(),
            )
        };
        let (got, _) = ask(&prompt);
        assert_eq!(got, want, "{family}: serve --mtp 2 vs run --mtp 0");
        // The same prompt again: the session's cache is reused, the head re-levelled.
        let (again, usage) = ask(&prompt);
        assert_eq!(again, want, "{family}: second request {usage}");
        // A longer prompt that extends the first: reuse plus new prefill with drafting.
        let longer = format!("{prompt}{want}");
        let want2 = run_text(model, &longer, 16, &["--mtp", "0"]);
        let (got2, usage2) = ask(&longer);
        assert_eq!(got2, want2, "{family}: extended prompt {usage2}");
        let log = server.log_text();
        assert_eq!(server.stop(), 0, "{log}");
    }
}

#[test]
fn unsupported_combinations_are_one_line_before_placement() {
    let m = default_model();
    let m = m.to_str().unwrap();
    let mtp_model = fixture("deepseek_v3");
    let mtp_model = mtp_model.to_str().unwrap();
    let kv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("engine-refused-kv");
    let kv = kv.to_str().unwrap();
    // DeepSeek-V3.2: MLA with an indexer, which runs one sequence per forward.
    let v32 = fixture("deepseek_v32").to_str().unwrap().to_string();
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("engine-refused.npy");
    let out = out.to_str().unwrap();
    for (args, flag) in [
        (vec!["run", m, "--mtp", "1"], "--mtp"),
        (vec!["run", mtp_model, "--mtp", "4"], "--mtp 4"),
        (
            vec!["run", mtp_model, "--mtp", "1", "--gpu", "on"],
            "--gpu on",
        ),
        (vec!["chat", m, "--kv-dir", kv, "--gpu", "on"], "--gpu on"),
        (
            vec![
                "logits",
                m,
                "--tokens",
                "1,2",
                "--out",
                out,
                "--gpu",
                "on",
                "--prefetch",
            ],
            "--gpu on",
        ),
        (
            vec!["run", m, "--experts", "resident", "--route-trace", out],
            "--route-trace",
        ),
        (vec!["chat", m, "--io", "sideways"], "--io"),
        (
            vec!["serve", m, "--port", "0", "--parallel", "2", "--gpu", "on"],
            "--parallel 2 with --gpu on",
        ),
        (
            vec!["serve", &v32, "--port", "0", "--parallel", "2"],
            "--parallel 2",
        ),
        (
            vec!["serve", m, "--port", "0", "--parallel", "0"],
            "--parallel 0",
        ),
        (
            vec!["logits", m, "--tokens", "1", "--out", out, "-c", "0"],
            "-c 0",
        ),
    ] {
        let (code, stdout, err) = sluice(&args, Some("hi\n\n"));
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(
            stdout.is_empty(),
            "{args:?}: {}",
            String::from_utf8_lossy(&stdout)
        );
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: one line: {err}");
        assert!(
            lines[0].starts_with("error: ") && lines[0].contains(flag),
            "{args:?}: names {flag}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// The deepseek_v3 fixture on the CPU with 2 MTP drafts, prefill batches of 5 and a 128-token
/// context (`--kv-dir` when given).
fn open_mtp_engine(kv_dir: Option<&Path>) -> sluice::engine::Engine {
    use sluice::engine::{Engine, EngineOptions, GpuWant};
    std::env::set_var("SLUICE_CACHE_DIR", cache());
    let mut o = EngineOptions::new(fixture("deepseek_v3"));
    o.threads = 2;
    o.ctx = Some(128);
    o.batch = 5;
    o.mtp = 2;
    o.quiet = true;
    o.gpu.want = GpuWant::Off;
    o.kv_dir = kv_dir.map(Path::to_path_buf);
    Engine::open(o).unwrap()
}

/// `n` greedy tokens after `prompt`, past end-of-generation tokens.
fn generate_n(e: &mut sluice::engine::Engine, prompt: &[u32], n: usize) -> sluice::engine::Outcome {
    let mut s = e.sampler();
    let mut p = sluice::engine::GenParams::new(n);
    p.ignore_eos = true;
    e.generate(prompt, &mut s, &p, &mut |_| true).unwrap()
}

/// The prompt ids of the deepseek_v3 fixture's greedy.json.
fn fixture_prompt() -> Vec<u32> {
    let path = fixture("deepseek_v3").join("greedy.json");
    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    g["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// The MTP head's cache after prefix sync (a second request extending the first) and after a
/// `--kv-dir` restore equals a fresh prefill's, row for row, in every cache layer: at
/// temperature 0 the text cannot show a wrong head (drafts only change the acceptance rate),
/// so this compares the state itself. Prefill batches of 5 make the chunking differ too.
#[test]
fn mtp_head_after_prefix_sync_and_restore_equals_a_fresh_prefill() {
    let kv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("engine-mtp-kv");
    let _ = std::fs::remove_dir_all(&kv);
    let open = open_mtp_engine;
    let gen = |e: &mut sluice::engine::Engine, prompt: &[u32]| generate_n(e, prompt, 10);
    let p1 = fixture_prompt();

    let mut reused = open(None);
    let first = gen(&mut reused, &p1).generation.tokens;
    let mut p2 = p1.clone();
    p2.extend_from_slice(&first);
    p2.extend_from_slice(&p1[1..6]);
    let second = gen(&mut reused, &p2);
    assert!(second.generation.stats.reused > p1.len(), "prefix kept");

    let mut fresh = open(None);
    let want = gen(&mut fresh, &p2).generation.tokens;
    assert_eq!(second.generation.tokens, want);

    let mut saver = open(Some(&kv));
    gen(&mut saver, &p1);
    saver.save_session().unwrap().expect("session written");
    let mut restored = open(Some(&kv));
    let out = gen(&mut restored, &p2);
    assert!(out.restored_bytes.is_some(), "restored from --kv-dir");
    assert_eq!(out.generation.tokens, want);

    let dims = fresh.model.cfg.cache_dims();
    let f = &fresh.session.st;
    for (name, e) in [("prefix sync", &reused), ("--kv-dir restore", &restored)] {
        let s = &e.session.st;
        assert_eq!(e.session.tokens(), fresh.session.tokens(), "{name}");
        assert_eq!((s.pos, s.mtp_pos), (f.pos, f.mtp_pos), "{name}");
        let layers = f.kv_layers(dims);
        assert_eq!(layers, fresh.model.cfg.n_layers + 1, "the MTP layer caches");
        for layer in 0..layers {
            // The MTP layer holds `mtp_pos` slots; the others `pos` positions.
            let n = if layer == layers - 1 {
                f.mtp_pos
            } else {
                f.pos
            };
            let (fk, fv) = f.kv_rows(layer, dims, n).unwrap();
            let (sk, sv) = s.kv_rows(layer, dims, n).unwrap();
            assert!(
                fk == sk && fv == sv,
                "{name}: cache layer {layer} differs from a fresh prefill"
            );
        }
    }
}

/// `-n 0` (max_tokens 0) prefills the prompt and generates nothing, as llama-cli's `-n 0`
/// does (and `bench -n 0` times that prefill): the next turn reuses the cached prompt and,
/// MTP head included, continues as a fresh prefill of the whole text would.
#[test]
fn zero_max_tokens_prefills_the_prompt() {
    let open = || open_mtp_engine(None);
    let gen = |e: &mut sluice::engine::Engine, prompt: &[u32], n| generate_n(e, prompt, n);
    let p1 = fixture_prompt();
    let mut p2 = p1.clone();
    p2.extend_from_slice(&p1[1..6]);

    let mut warm = open();
    let none = gen(&mut warm, &p1, 0).generation;
    assert!(none.tokens.is_empty());
    assert!(none.stats.prefill_done, "the prompt was prefilled");
    assert_eq!(warm.session.st.pos, p1.len(), "the prompt is in the cache");
    let second = gen(&mut warm, &p2, 10).generation;
    assert!(second.stats.reused >= p1.len() - 1, "prefix kept");

    let mut fresh = open();
    assert_eq!(second.tokens, gen(&mut fresh, &p2, 10).generation.tokens);
}
