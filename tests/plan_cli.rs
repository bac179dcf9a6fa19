//! `sluice plan` and `sluice bench MODEL --ab` through the binary on the built-in model.

use std::path::{Path, PathBuf};
use std::process::Command;

fn cache() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("plan-cli-cache")
}

fn model() -> PathBuf {
    std::env::set_var("SLUICE_CACHE_DIR", cache());
    sluice::default_model::ensure_random().unwrap()
}

fn sluice(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .env("SLUICE_CACHE_DIR", cache())
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

#[test]
fn plan_prints_decisions_and_json() {
    let m = model();
    let ms = m.to_str().unwrap();
    let (code, out, err) = sluice(&["plan", ms, "--ram", "64M", "--experts", "stream"]);
    assert_eq!(code, 0, "{err}");
    for what in [
        "budget: 67.1 MB (--ram)",
        "resident:",
        "kv cache:",
        "experts: streamed",
        "expert cache:",
        "pin/lru split:",
        "io:",
        "prefetch: off",
        "mtp: off",
        "expected hit:",
        "predicted decode:",
    ] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(&format!("[plan] {what}"))),
            "no [plan] {what} in\n{out}"
        );
    }
    let (code, out, err) = sluice(&["plan", ms, "--json", "--ram", "64M"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["budget_bytes"], 64u64 << 20);
    assert_eq!(v["stream"], false, "the tiny model fits in 64 MiB");
    assert!(v["decisions"].as_array().unwrap().len() >= 6);
    // Impossible: one line, exit 1, the numbers.
    let (code, _, err) = sluice(&["plan", ms, "--ram", "1M"]);
    assert_eq!(code, 1);
    assert!(
        err.starts_with("error: plan impossible: budget 1048.6 KB cannot hold the resident part"),
        "{err}"
    );
    // run prints the same lines and predicted vs measured.
    let (code, _, err) = sluice(&[
        "run",
        ms,
        "-n",
        "4",
        "--temp",
        "0",
        "--experts",
        "stream",
        "--cap",
        "1",
        "--usage-freeze",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("[plan] expert cache:") && err.contains("[plan] prefetch: off"),
        "{err}"
    );
    assert!(
        err.lines()
            .any(|l| l.starts_with("[plan] predicted") && l.contains("measured")),
        "{err}"
    );
}

#[test]
fn bench_ab_reports_a_ratio_only_for_identical_text() {
    let m = model();
    let ms = m.to_str().unwrap();
    let (code, out, err) = sluice(&[
        "bench",
        ms,
        "-p",
        "16",
        "-n",
        "8",
        "-r",
        "2",
        "--json",
        "--ab",
        "--experts stream --cap 1 --io direct",
        "--experts stream --cap 1 --io buffered",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["text_identical"], true);
    assert!(v["ratio_b_over_a"]["tg"].as_f64().unwrap() > 0.0);
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    assert!(rows
        .iter()
        .all(|r| r["reps"] == 2 && r["min"].as_f64().unwrap() <= r["median"].as_f64().unwrap()));
    let (code, _, err) = sluice(&[
        "bench",
        ms,
        "-p",
        "16",
        "-n",
        "8",
        "-r",
        "1",
        "--ab",
        "--seed 1 --temp 1",
        "--seed 2 --temp 1",
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("different text") && err.contains("no ratio"),
        "{err}"
    );
    // The kernel bench keeps its flag.
    let (code, _, err) = sluice(&["bench"]);
    assert_eq!(code, 1);
    assert!(err.contains("--kernels"), "{err}");
}
