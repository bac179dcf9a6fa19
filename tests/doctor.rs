//! `sluice doctor` end to end and the machine profile's pieces: serialization round trip, the
//! O_DIRECT probe on a small file (sane figures, probe file removed), the model checks and
//! `--deep` checksums on tests/fixtures/tiny-moe.gguf (checksums against the FNV-1a values the
//! `gguf` Python package's reading gave, in tests/fixtures/format/expected.json), and corrupted
//! copies failing with one line. Speeds are never asserted, only that they are measured.

mod format_util;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use format_util::*;
use sluice::plan::probe_disk::{self, DiskProbeOptions, ReadMode, PROBE_PREFIX};
use sluice::plan::{self, MachineProfile, PROFILE_VERSION};

fn doctor(cache: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("doctor")
        .args(args)
        .env("SLUICE_CACHE_DIR", cache)
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run sluice")
}

fn json_of(o: &Output) -> serde_json::Value {
    assert!(
        o.status.success(),
        "doctor failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("doctor --json prints JSON")
}

/// A scratch directory holding `bytes` as `tiny-moe.gguf`.
fn model_copy(tag: &str, bytes: &[u8]) -> (PathBuf, PathBuf) {
    let d = scratch(tag);
    let p = d.join("tiny-moe.gguf");
    std::fs::write(&p, bytes).unwrap();
    (d, p)
}

fn tiny() -> Vec<u8> {
    std::fs::read(fixture("tiny-moe.gguf")).unwrap()
}

fn probe_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(PROBE_PREFIX))
        .collect()
}

fn expect_one_line_failure(o: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    let line = err.trim_end();
    assert_eq!(
        o.status.code(),
        Some(1),
        "exit status {:?}, stderr: {err}",
        o.status
    );
    assert!(!line.contains('\n'), "stderr is not one line:\n{err}");
    assert!(!err.contains("panicked"), "panic:\n{err}");
    assert!(line.starts_with("error: "), "{line}");
    for n in needles {
        assert!(line.contains(n), "error lacks {n:?}: {line}");
    }
}

#[test]
fn profile_round_trip() {
    let d = scratch("profile");
    let o = plan::ProbeOptions {
        cache_dir: d.join("cache"),
        storage_dir: d.clone(),
        model_file: None,
        block_sizes: vec![64 << 10],
        quick: true,
    };
    let p = plan::probe(&o, &|_| {}).expect("probe");
    assert_eq!(p.version, PROFILE_VERSION);
    let text = serde_json::to_string(&p).unwrap();
    let back: MachineProfile = serde_json::from_str(&text).unwrap();
    assert_eq!(back, p);

    // Through the cache file (temporary + rename), and another version is not read back.
    let path = plan::profile_path(&o.cache_dir, &p.key);
    plan::write_profile(&path, &p).unwrap();
    assert_eq!(plan::read_profile(&path).as_ref(), Some(&p));
    let leftovers: Vec<_> = std::fs::read_dir(&o.cache_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        leftovers.len(),
        1,
        "only the profile in the cache dir: {leftovers:?}"
    );
    let mut old = p.clone();
    old.version = PROFILE_VERSION + 1;
    plan::write_profile(&path, &old).unwrap();
    assert_eq!(plan::read_profile(&path), None);

    // The planner's view: a ceiling at the nearest probed size.
    let (size, pt) = p.disk_ceiling(100 << 10).expect("a direct series");
    assert!(size == 64 << 10 || size == 1 << 20);
    assert!(pt.gbps > 0.0);
    assert!(probe_files(&d).is_empty());
}

#[test]
fn o_direct_probe_small_file() {
    let d = scratch("odirect");
    let o = DiskProbeOptions {
        dir: d.clone(),
        model_file: None,
        block_sizes: vec![64 << 10, 1 << 20, 5000],
        threads: vec![1, 2],
        file_bytes: Some(8 << 20),
        point: Duration::from_millis(30),
        buffered: true,
    };
    let s = probe_disk::probe(&o, &|_| {}).expect("probe");
    assert!(
        probe_files(&d).is_empty(),
        "probe file left behind: {:?}",
        probe_files(&d)
    );
    assert_eq!(s.data_bytes, 8 << 20);
    assert!(s.data.as_deref().unwrap_or("").contains("probe file"));
    let modes: Vec<ReadMode> = if s.o_direct {
        vec![ReadMode::Direct, ReadMode::Buffered]
    } else {
        vec![ReadMode::Buffered]
    };
    if !s.o_direct {
        assert!(
            s.note.as_deref().unwrap_or("").contains("O_DIRECT"),
            "{:?}",
            s.note
        );
    }
    for mode in modes {
        // 5000 bytes is rounded up to 8 KiB.
        for block in [8u64 << 10, 64 << 10, 1 << 20] {
            let series = s
                .series
                .iter()
                .find(|x| x.mode == mode && x.block_bytes == block)
                .unwrap_or_else(|| panic!("no {mode:?} series at {block}: {:?}", s.series));
            assert_eq!(
                series.points.iter().map(|p| p.threads).collect::<Vec<_>>(),
                vec![1, 2]
            );
            for p in &series.points {
                assert!(p.gbps.is_finite() && p.gbps > 0.0, "{p:?}");
                assert!(p.iops.is_finite() && p.iops > 0.0, "{p:?}");
                assert!(p.reads > 0 && p.seconds > 0.0, "{p:?}");
                let implied = p.reads as f64 * block as f64 / p.seconds / 1e9;
                assert!((implied - p.gbps).abs() <= 1e-4 * implied, "{p:?}");
            }
        }
    }
}

#[test]
fn o_direct_probe_too_large_block_is_noted() {
    let d = scratch("odirect-big");
    let o = DiskProbeOptions {
        dir: d.clone(),
        model_file: None,
        block_sizes: vec![8 << 20],
        threads: vec![1],
        file_bytes: Some(4 << 20),
        point: Duration::from_millis(10),
        buffered: false,
    };
    let s = probe_disk::probe(&o, &|_| {}).expect("probe");
    assert!(s.series.is_empty());
    assert!(
        s.note
            .as_deref()
            .unwrap_or("")
            .contains("8192 KiB not measured"),
        "{:?}",
        s.note
    );
    assert!(probe_files(&d).is_empty());
}

#[test]
fn doctor_tiny_model_deep_matches_gguf_reference() {
    let (d, model) = model_copy("doctor-ok", &tiny());
    let cache = d.join("cache");
    let ms = model.to_str().unwrap();
    let v = json_of(&doctor(&cache, &[ms, "--deep", "--quick", "--json"]));
    assert_eq!(v["origin"], "probed");
    let m = &v["model"];
    assert_eq!(m["tensors"], 27);
    let checks = m["checks"].as_array().unwrap();
    let names: Vec<&str> = checks.iter().map(|c| c["name"].as_str().unwrap()).collect();
    for want in [
        "header",
        "ranges",
        "overlap",
        "sizes",
        "alignment",
        "experts",
    ] {
        assert!(names.contains(&want), "no {want} check: {names:?}");
    }
    for c in checks {
        assert_eq!(c["status"], "ok", "{c}");
    }
    // One expert of one tensor: the largest fused tensor (ffn_down_exps, Q8_0, 69632 bytes in
    // expected.json) holds 8 experts; one expert over gate+up+down is inspect's 17920.
    assert_eq!(m["expert_slice_bytes"], 69632 / 8);
    assert_eq!(m["expert_bytes_per_layer"], 17920);

    // Every tensor's checksum is the one computed from the gguf package's reading.
    let exp = expected();
    let reference: HashMap<String, String> = exp["gguf"]["tiny-moe.gguf"]["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_string(),
                t["fnv"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let deep = &m["deep"];
    assert_eq!(deep["algorithm"], "fnv1a64");
    let tensors = deep["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), reference.len());
    for t in tensors {
        let name = t["name"].as_str().unwrap();
        assert_eq!(
            t["fnv1a64"].as_str(),
            Some(reference[name].as_str()),
            "{name}"
        );
    }
    assert_eq!(deep["bad"].as_array().unwrap().len(), 0);
    let files = deep["files"].as_array().unwrap();
    assert_eq!(files.len(), 1);
    assert_eq!(files[0]["tensors"], 27);
    let ref_bytes: u64 = exp["gguf"]["tiny-moe.gguf"]["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| as_u64(&t["n_bytes"]))
        .sum();
    assert_eq!(as_u64(&files[0]["bytes"]), ref_bytes);
    assert_eq!(as_u64(&deep["bytes"]), ref_bytes);

    // The profile: the model's directory was probed at its expert sizes and 1 MiB.
    let p = &v["profile"];
    assert_eq!(p["version"], PROFILE_VERSION);
    assert!(p["cpu"]["logical_cores"].as_u64().unwrap() >= 1);
    assert!(p["memory"]["total_bytes"].as_u64().unwrap() > 0);
    assert!(p["memory"]["read_gbps"].as_f64().unwrap() > 0.0);
    let s = &p["storage"];
    assert_eq!(
        s["dir"].as_str().unwrap(),
        std::fs::canonicalize(&d).unwrap().to_str().unwrap()
    );
    let sizes: Vec<u64> = s["series"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| as_u64(&x["block_bytes"]))
        .collect();
    for want in [12u64 << 10, 20 << 10, 1 << 20] {
        assert!(sizes.contains(&want), "{want} not probed: {sizes:?}");
    }
    assert!(p["gpu"].is_object());
    assert!(probe_files(&d).is_empty(), "probe file left behind");
    assert!(Path::new(v["profile_path"].as_str().unwrap()).starts_with(&cache));

    // Reused, then re-probed on --refresh; the text output has one line per figure.
    let again = json_of(&doctor(&cache, &[ms, "--quick", "--json"]));
    assert_eq!(again["origin"], "cached");
    assert_eq!(again["profile"]["probed_unix"], p["probed_unix"]);
    let text = doctor(&cache, &[ms, "--quick", "--refresh"]);
    assert!(text.status.success());
    let text = String::from_utf8(text.stdout).unwrap();
    for label in [
        "check ranges ",
        "cpu ",
        "ram total ",
        "mlock limit ",
        "memory read ",
        "read-ahead ",
        "disk ceiling ",
        "gpu",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(label)),
            "no {label:?} line in:\n{text}"
        );
    }
    assert!(text.contains("probed now"), "{text}");
}

#[test]
fn doctor_deep_sharded_safetensors_matches_reference() {
    let d = scratch("doctor-st");
    let src = fixture("format/hf-deepseek");
    let dir = d.join("hf-deepseek");
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(&src).unwrap().flatten() {
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let v = json_of(&doctor(
        &d.join("cache"),
        &[dir.to_str().unwrap(), "--deep", "--quick", "--json"],
    ));
    let exp = expected();
    let reference = exp["safetensors"]["format/hf-deepseek"]["tensors"]
        .as_array()
        .unwrap();
    let got: HashMap<&str, &str> = v["model"]["deep"]["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["name"].as_str().unwrap(), t["fnv1a64"].as_str().unwrap()))
        .collect();
    assert_eq!(got.len(), reference.len());
    for t in reference {
        let name = t["name"].as_str().unwrap();
        assert_eq!(got.get(name).copied(), t["fnv"].as_str(), "{name}");
    }
    let files = v["model"]["deep"]["files"].as_array().unwrap();
    assert_eq!(files.len(), 2);
    assert_eq!(
        files.iter().map(|f| as_u64(&f["tensors"])).sum::<u64>(),
        reference.len() as u64
    );
    assert!(probe_files(&dir).is_empty());
}

/// Offset of `output.weight`'s tensor-info offset field.
fn output_offset_field(g: &[u8]) -> usize {
    let mut needle = 13u64.to_le_bytes().to_vec();
    needle.extend(b"output.weight");
    let at = g.windows(needle.len()).position(|w| w == needle).unwrap() + needle.len();
    at + 4 + 16 + 4 // n_dims, two dims, type
}

#[test]
fn doctor_range_outside_file_fails_in_one_line() {
    let mut g = tiny();
    let at = output_offset_field(&g);
    g[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let (d, model) = model_copy("doctor-range", &g);
    let o = doctor(&d.join("cache"), &[model.to_str().unwrap(), "--quick"]);
    expect_one_line_failure(&o, &["tiny-moe.gguf", "output.weight", "past the end"]);
    assert!(o.stdout.is_empty());
}

#[test]
fn doctor_overlapping_tensors_fail_in_one_line() {
    let mut g = tiny();
    let at = output_offset_field(&g);
    g[at..at + 8].copy_from_slice(&0u64.to_le_bytes()); // on top of token_embd.weight
    let (d, model) = model_copy("doctor-overlap", &g);
    let o = doctor(&d.join("cache"), &[model.to_str().unwrap(), "--quick"]);
    expect_one_line_failure(
        &o,
        &[
            "tiny-moe.gguf",
            "output.weight",
            "overlap",
            "token_embd.weight",
        ],
    );
    assert!(o.stdout.is_empty());
}

#[test]
fn doctor_deep_names_a_nan_tensor() {
    let mut g = tiny();
    // blk.0.attn_norm.weight is F32 at byte 44800 (expected.json).
    let exp = expected();
    let t = exp["gguf"]["tiny-moe.gguf"]["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "blk.0.attn_norm.weight")
        .unwrap()
        .clone();
    assert_eq!(t["type"], "F32");
    let off = as_u64(&t["offset"]) as usize + 8;
    g[off..off + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    let (d, model) = model_copy("doctor-nan", &g);
    let cache = d.join("cache");
    let ms = model.to_str().unwrap();
    // Without --deep the header is fine.
    assert!(doctor(&cache, &[ms, "--quick"]).status.success());
    let o = doctor(&cache, &[ms, "--quick", "--deep"]);
    expect_one_line_failure(
        &o,
        &[
            "tiny-moe.gguf",
            "1 of 27 tensors bad",
            "blk.0.attn_norm.weight",
            "NaN",
        ],
    );
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.lines()
            .any(|l| l.starts_with("deep BAD") && l.contains("blk.0.attn_norm.weight")),
        "{text}"
    );
}

#[test]
fn doctor_deep_needs_a_model() {
    let d = scratch("doctor-nomodel");
    let o = doctor(&d.join("cache"), &["--deep", "--quick"]);
    expect_one_line_failure(&o, &["--deep", "MODEL"]);
}

#[test]
fn probe_file_removed_on_sigint() {
    let (d, model) = model_copy("doctor-sigint", &tiny());
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["doctor", model.to_str().unwrap(), "--quick"])
        .env("SLUICE_CACHE_DIR", d.join("cache"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let mut seen = false;
    while t.elapsed() < Duration::from_secs(30) {
        if !probe_files(&d).is_empty() {
            seen = true;
            break;
        }
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    if !seen {
        // The probe finished before we looked: nothing to interrupt; it still cleaned up.
        child.wait().unwrap();
        assert!(probe_files(&d).is_empty());
        eprintln!("probe_file_removed_on_sigint: probe ended before it could be interrupted");
        return;
    }
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert!(status.signal() == Some(2) || status.success(), "{status:?}");
    assert!(
        probe_files(&d).is_empty(),
        "probe file left after SIGINT: {:?}",
        probe_files(&d)
    );
}
