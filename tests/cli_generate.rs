//! `sluice run` / `sluice chat` / `sluice logits` through the binary on the built-in model:
//! text on stdout, one timing line on stderr, deterministic at temperature 0, clean errors.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

fn sluice(args: &[&str], stdin: Option<&str>) -> (i32, String, String) {
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-generate-cache");
    let mut c = Command::new(env!("CARGO_BIN_EXE_sluice"));
    c.args(args)
        .env("SLUICE_CACHE_DIR", &cache)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::piped());
    let mut child = c.spawn().unwrap();
    if let Some(s) = stdin {
        child.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
    } else {
        drop(child.stdin.take());
    }
    let o = child.wait_with_output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

#[test]
fn run_default_model_streams_text_and_times() {
    let (code, out, err) = sluice(
        &[
            "run",
            "-p",
            "Hello there",
            "-n",
            "12",
            "--temp",
            "0",
            "--ignore-eos",
            "-t",
            "2",
        ],
        None,
    );
    assert_eq!(code, 0, "stderr: {err}");
    assert!(out.starts_with("Hello there"), "stdout: {out}");
    assert!(out.len() > "Hello there".len(), "nothing generated: {out}");
    let timing: Vec<_> = err.lines().filter(|l| l.starts_with("[timing]")).collect();
    assert_eq!(timing.len(), 1, "stderr: {err}");
    assert!(
        timing[0].contains("prompt")
            && timing[0].contains("prefill")
            && timing[0].contains("decode")
    );
    assert!(
        err.contains("built-in sluice-tiny-moe"),
        "no note about the default model: {err}"
    );
    // Temperature 0 is deterministic run to run (and across thread counts and batch sizes).
    let (_, out2, _) = sluice(
        &[
            "run",
            "-p",
            "Hello there",
            "-n",
            "12",
            "--temp",
            "0",
            "--ignore-eos",
            "-t",
            "1",
            "-b",
            "3",
        ],
        None,
    );
    assert_eq!(out, out2);
}

#[test]
fn seeded_sampling_repeats() {
    let a = sluice(
        &[
            "run",
            "-p",
            "abc",
            "-n",
            "16",
            "--temp",
            "1.0",
            "--seed",
            "7",
            "--ignore-eos",
        ],
        None,
    )
    .1;
    let b = sluice(
        &[
            "run",
            "-p",
            "abc",
            "-n",
            "16",
            "--temp",
            "1.0",
            "--seed",
            "7",
            "--ignore-eos",
        ],
        None,
    )
    .1;
    assert_eq!(a, b);
}

#[test]
fn prompt_longer_than_context_is_a_clean_error() {
    let long = "word ".repeat(200);
    let (code, out, err) = sluice(&["run", "-p", &long, "-c", "32", "-n", "4"], None);
    assert_eq!(code, 1);
    assert!(
        out.is_empty(),
        "no prompt echo for a run that cannot start: {out}"
    );
    assert!(
        err.contains("context full") && !err.contains("panicked"),
        "{err}"
    );
    assert_eq!(
        err.lines().filter(|l| l.starts_with("error")).count(),
        1,
        "{err}"
    );
}

#[test]
fn chat_answers_each_turn() {
    let (code, out, err) = sluice(
        &["chat", "-n", "6", "--temp", "0"],
        Some("hi\nand again\n\n"),
    );
    assert_eq!(code, 0, "stderr: {err}");
    assert_eq!(
        out.matches("> ").count(),
        3,
        "two turns and the final prompt: {out}"
    );
    let timings: Vec<_> = err.lines().filter(|l| l.starts_with("[timing]")).collect();
    assert_eq!(timings.len(), 2, "{err}");
    assert!(
        timings[1].contains("reused") && !timings[1].contains("reused 0 "),
        "second turn reuses the cache: {err}"
    );
}

#[test]
fn logits_writes_npy_of_t_by_vocab() {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-logits.npy");
    let (code, _, err) = sluice(
        &[
            "logits",
            "--tokens",
            "1,5,42",
            "--out",
            out.to_str().unwrap(),
        ],
        None,
    );
    // No model given is a usage error for `logits` (it needs an explicit model).
    assert_ne!(code, 0, "{err}");
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-generate-cache");
    std::env::set_var("SLUICE_CACHE_DIR", &cache);
    let m = sluice::default_model::ensure_random().unwrap();
    let (code, _, err) = sluice(
        &[
            "logits",
            m.to_str().unwrap(),
            "--tokens",
            "1,5,42",
            "--out",
            out.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    let (shape, data) = sluice::npy::read_f32(&out).unwrap();
    assert_eq!(shape[0], 3);
    assert_eq!(data.len(), 3 * shape[1]);
}

#[test]
fn streaming_run_saves_usage_and_autopins_from_it() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-usage");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::env::set_var(
        "SLUICE_CACHE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-generate-cache"),
    );
    let m = dir.join("m.gguf");
    std::fs::copy(sluice::default_model::ensure_random().unwrap(), &m).unwrap();
    let ms = m.to_str().unwrap();
    let usage = dir.join(".m.gguf.sluice-usage.json");
    // --usage-freeze: nothing written.
    let (code, out_frozen, err) = sluice(
        &[
            "run",
            ms,
            "-n",
            "8",
            "--temp",
            "0",
            "--ignore-eos",
            "--experts",
            "stream",
            "--cap",
            "1",
            "--usage-freeze",
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert!(!usage.exists());
    assert!(err.contains("[experts] decode"), "{err}");
    // A normal streaming run writes the statistics; --autopin then pins from them.
    let (code, out, err) = sluice(
        &[
            "run",
            ms,
            "-n",
            "8",
            "--temp",
            "0",
            "--ignore-eos",
            "--experts",
            "stream",
            "--cap",
            "1",
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert!(usage.exists(), "usage statistics written beside the model");
    let json = dir.join("stats.json");
    let (code, out_pinned, err) = sluice(
        &[
            "run",
            ms,
            "-n",
            "8",
            "--temp",
            "0",
            "--ignore-eos",
            "--experts",
            "stream",
            "--ram",
            "64M",
            "--autopin",
            "--pin-gb",
            "0.002",
            "--usage-freeze",
            "--stats-json",
            json.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("[plan] autopin:"), "{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for k in [
        "tokens",
        "decode_tok_s",
        "prefill_tok_s",
        "hit_rate",
        "hit_pin",
        "hit_lru",
        "experts_read_per_token",
        "bytes_read",
        "read_gb_s",
        "peak_rss_bytes",
        "time_shares",
    ] {
        assert!(v.get(k).is_some(), "stats json lacks {k}: {v}");
    }
    assert!(v["hit_pin"].as_f64().unwrap() > 0.0, "{v}");
    // Placement never changes the text.
    assert_eq!(out, out_frozen);
    assert_eq!(out, out_pinned);
}

/// Generation that reaches the end of the context stops with a one-line note, not an error.
#[test]
fn generation_at_the_context_limit_stops_with_a_note() {
    let (code, out, err) = sluice(
        &[
            "run",
            "-p",
            "Hi",
            "-c",
            "12",
            "-n",
            "64",
            "--temp",
            "0",
            "--ignore-eos",
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("Hi"), "{out}");
    let notes: Vec<_> = err
        .lines()
        .filter(|l| l.contains("stopped at the context limit"))
        .collect();
    assert_eq!(notes.len(), 1, "{err}");
    assert!(notes[0].contains("12 tokens"), "{err}");
    assert!(!err.contains("error"), "{err}");
    // chat: the reply that fills the context ends the chat with the same note.
    let (code, _, err) = sluice(
        &["chat", "-c", "48", "-n", "200", "--temp", "0"],
        Some("Hello\nMore\n"),
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("stopped at the context limit") || err.contains("no longer fits the context"),
        "{err}"
    );
}

/// `run --depth N` (what `bench -d` passes): the cache holds N filler tokens first, untimed, so
/// the timing line counts only the prompt; a context too small for both is a clean error.
#[test]
fn run_depth_fills_the_cache_before_the_timed_prompt() {
    let prompt_tokens = |err: &str| -> usize {
        let line = err.lines().find(|l| l.starts_with("[timing]")).unwrap();
        let rest = &line[line.find("prompt").unwrap() + "prompt".len()..];
        rest.split_whitespace().next().unwrap().parse().unwrap()
    };
    let base = [
        "run",
        "-p",
        "Hello there",
        "-n",
        "4",
        "--temp",
        "0",
        "--ignore-eos",
    ];
    let (code, _, plain) = sluice(&base, None);
    assert_eq!(code, 0, "stderr: {plain}");
    let mut deep = base.to_vec();
    deep.extend(["--depth", "40", "-c", "64"]);
    let (code, out, err) = sluice(&deep, None);
    assert_eq!(code, 0, "stderr: {err}");
    assert!(out.starts_with("Hello there"), "stdout: {out}");
    assert_eq!(prompt_tokens(&err), prompt_tokens(&plain), "{err}");
    let mut small = base.to_vec();
    small.extend(["--depth", "40", "-c", "32"]);
    let (code, _, err) = sluice(&small, None);
    assert_eq!(code, 1);
    assert!(
        err.contains("context full") && !err.contains("panicked"),
        "{err}"
    );
}
