//! Issue 20, items 4 and 5: broken model files are refused with one line, never run to NaN;
//! a mapped file truncated during a run ends it with one line and exit 1, never SIGBUS.
//! Reproducers (all made from the committed Qwen3-MoE fixture): a safetensors header length
//! off by one, two tensors' data overlapping, GGUF `general.alignment` 1 on a file laid out
//! at 32, `rope_theta` 0, a rope factor 0, a negative `rms_norm_eps`, `rope.freq_base` 0.
//! Item 8: escape codes in a GGUF's keys and string values are escaped in the error line.

mod reliability_util;

use reliability_util::{
    assert_clean_failure, fixture, logits_args, rewrite_gguf, rewrite_gguf_with, safetensors_copy,
    tmpdir,
};
use sluice::format::MetaValue;
use std::path::Path;

/// The safetensors file at `p` split into (header JSON, data).
fn split_safetensors(p: &Path) -> (serde_json::Map<String, serde_json::Value>, Vec<u8>) {
    let b = std::fs::read(p).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    (h.as_object().unwrap().clone(), b[8 + n..].to_vec())
}

fn join_safetensors(
    p: &Path,
    header: &serde_json::Map<String, serde_json::Value>,
    pad: usize,
    len_delta: i64,
    data: &[u8],
) {
    let mut h = serde_json::to_vec(header).unwrap();
    h.extend(std::iter::repeat_n(b' ', pad));
    let n = (h.len() as i64 + len_delta) as u64;
    let mut out = n.to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    std::fs::write(p, out).unwrap();
}

#[test]
fn safetensors_header_length_off_by_one_is_refused() {
    let d = safetensors_copy("st-len", |_| {});
    let p = d.join("model.safetensors");
    let (h, data) = split_safetensors(&p);
    // Padding spaces keep the JSON valid with one byte less: the data section starts a byte
    // early, which the safetensors library refuses (the data no longer fills the file).
    join_safetensors(&p, &h, 8, -1, &data);
    assert_clean_failure(&logits_args(d.to_str().unwrap(), &[]), "header length");
}

#[test]
fn overlapping_safetensors_data_is_refused() {
    let d = safetensors_copy("st-overlap", |_| {});
    let p = d.join("model.safetensors");
    let (mut h, data) = split_safetensors(&p);
    // Two tensors of the same byte size: point the second at the first's bytes.
    let sized: Vec<(String, u64, u64)> = h
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let o = v["data_offsets"].as_array().unwrap();
            (k.clone(), o[0].as_u64().unwrap(), o[1].as_u64().unwrap())
        })
        .collect();
    let (a, b) = sized
        .iter()
        .enumerate()
        .find_map(|(i, a)| {
            sized[i + 1..]
                .iter()
                .find(|b| b.2 - b.1 == a.2 - a.1 && b.1 != a.1)
                .map(|b| (a.clone(), b.clone()))
        })
        .expect("two tensors of one size");
    h[&b.0]["data_offsets"] = serde_json::json!([a.1, a.2]);
    join_safetensors(&p, &h, 0, 0, &data);
    assert_clean_failure(&logits_args(d.to_str().unwrap(), &[]), "overlaps");
}

#[test]
fn gguf_alignment_that_does_not_match_the_layout_is_refused() {
    let d = tmpdir("gguf-align");
    let p = d.join("m.gguf");
    rewrite_gguf_with(
        &p,
        |_, v| Some(v.clone()),
        &[("general.alignment", MetaValue::U32(32))],
    );
    // Patch the stored 32 to 1: the file stays laid out at 32.
    let mut b = std::fs::read(&p).unwrap();
    let key = b"general.alignment";
    let at = b.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert_eq!(&b[at..at + 8], &[4, 0, 0, 0, 32, 0, 0, 0]);
    b[at + 4] = 1;
    std::fs::write(&p, b).unwrap();
    assert_clean_failure(&logits_args(p.to_str().unwrap(), &[]), "alignment");
}

#[test]
fn config_values_that_make_nan_are_refused() {
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, &str, Edit); 4] = [
        ("theta", "rope theta", |c| {
            c["rope_parameters"]["rope_theta"] = 0.0.into()
        }),
        (
            "factor",
            "rope scaling factor",
            |c| {
                c["rope_parameters"] =
                    serde_json::json!({"rope_type": "linear", "factor": 0.0, "rope_theta": 1e6})
            },
        ),
        ("yarn", "YaRN", |c| {
            c["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "factor": 0.0,
                "rope_theta": 1e6, "original_max_position_embeddings": 32})
        }),
        ("eps", "epsilon", |c| c["rms_norm_eps"] = (-1e-6).into()),
    ];
    for (tag, needle, edit) in cases {
        let d = safetensors_copy(&format!("cfg-{tag}"), edit);
        assert_clean_failure(&logits_args(d.to_str().unwrap(), &[]), needle);
    }
    let d = tmpdir("gguf-theta");
    let p = d.join("m.gguf");
    rewrite_gguf(&p, |k, v| {
        Some(if k.ends_with(".rope.freq_base") {
            MetaValue::F32(0.0)
        } else {
            v.clone()
        })
    });
    assert_clean_failure(&logits_args(p.to_str().unwrap(), &[]), "rope theta");
}

#[test]
fn unchanged_fixtures_still_open() {
    for m in [fixture("qwen3_moe"), fixture("qwen3_moe/model-f32.gguf")] {
        let (code, _, err) = reliability_util::sluice(&logits_args(m.to_str().unwrap(), &[]));
        assert_eq!(code, 0, "{}: {err}", m.display());
    }
}

/// Item 5: truncate the model file under a running generation. Resident weights are read
/// through the map; the lost pages fault, and the fault must become one line and exit 1.
#[test]
fn truncating_a_mapped_model_mid_run_is_an_error_not_sigbus() {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let d = tmpdir("truncate");
    let p = d.join("m.gguf");
    std::fs::copy(fixture("qwen3_moe/model-f32.gguf"), &p).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "run",
            p.to_str().unwrap(),
            "-n",
            "100000",
            "-c",
            "100000",
            "--ignore-eos",
        ])
        .args([
            "-p",
            "hello",
            "--temp",
            "0",
            "-t",
            "1",
            "--experts",
            "resident",
        ])
        .env("SLUICE_CACHE_DIR", d.join("cache"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A watchdog, should the run not notice the truncation.
    let pid = child.id().to_string();
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(120));
        let _ = Command::new("kill").arg(&pid).status();
    });
    // Wait for generated text: the model is loaded and running.
    let mut out = child.stdout.take().unwrap();
    let mut got = [0u8; 64];
    let mut n = 0;
    while n < 16 {
        let k = out.read(&mut got).unwrap();
        assert!(k > 0, "the run ended before producing text");
        n += k;
    }
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(4096).unwrap();
    drop(f);
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        o.status.code(),
        Some(1),
        "status {:?}; stderr: {err}",
        o.status
    );
    assert!(err.contains("SIGBUS") && err.contains("m.gguf"), "{err}");
}

/// `args` must fail with one line on stderr that names `needle` and shows the control
/// characters of the file escaped (`\u{1b}`), none of them raw.
fn assert_escaped_failure(args: &[&str], needle: &str) {
    let (code, _, err) = reliability_util::sluice(args);
    assert_eq!(code, 1, "exit code for {args:?}; stderr: {err:?}");
    assert!(!err.contains("panicked"), "panic for {args:?}: {err:?}");
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| !l.starts_with("[sluice] warning"))
        .collect();
    assert_eq!(lines.len(), 1, "stderr not one line for {args:?}: {err:?}");
    assert!(
        !lines[0].chars().any(char::is_control),
        "a raw control character in the error for {args:?}: {err:?}"
    );
    assert!(lines[0].contains("\\u{1b}"), "not escaped: {err:?}");
    assert!(lines[0].contains(needle), "lacks {needle:?}: {err:?}");
}

/// Item 8: escape codes from a hostile GGUF (ESC, BEL, carriage return in a metadata key or a
/// string value) reach the terminal escaped in the one-line error, never raw. One file per
/// place the text is reported from: the GGUF reader (a key of an unknown value type), the
/// model config (the architecture), the tokenizer (its model and pre-tokenizer names).
#[test]
fn control_characters_from_a_gguf_are_escaped_in_errors() {
    let evil = "x\u{1b}[2J\u{1b}]0;owned\u{7}\r";
    let d = tmpdir("escape");
    let run_args = |p: &std::path::Path| -> Vec<String> {
        ["run", p.to_str().unwrap(), "-n", "1", "-p", "hi", "-t", "1"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    // A metadata value of an unknown type under a key holding the escapes.
    let key = format!("general.{evil}");
    let p = d.join("key.gguf");
    rewrite_gguf_with(&p, |_, v| Some(v.clone()), &[(&key, MetaValue::U32(7))]);
    let mut b = std::fs::read(&p).unwrap();
    let at = b
        .windows(key.len())
        .position(|w| w == key.as_bytes())
        .unwrap()
        + key.len();
    assert_eq!(
        &b[at..at + 4],
        &[4, 0, 0, 0],
        "the value type (u32) after the key"
    );
    b[at] = 99;
    std::fs::write(&p, b).unwrap();
    let a = run_args(&p);
    assert_escaped_failure(
        &a.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        "value type 99",
    );

    // String values: the architecture, the tokenizer's model, its pre-tokenizer.
    for (tag, target, needle) in [
        ("arch", "general.architecture", "architecture"),
        ("tok-model", "tokenizer.ggml.model", "tokenizer model"),
        ("tok-pre", "tokenizer.ggml.pre", "pre-tokenizer"),
    ] {
        let p = d.join(format!("{tag}.gguf"));
        let files = sluice::format::ModelFiles::open(&fixture("qwen3_moe/model-f32.gguf")).unwrap();
        let had = files.meta(target).is_some();
        drop(files);
        let value = MetaValue::String(format!("{evil}qwen2"));
        if had {
            rewrite_gguf(&p, |k, v| {
                Some(if k == target {
                    value.clone()
                } else {
                    v.clone()
                })
            });
        } else {
            rewrite_gguf_with(&p, |_, v| Some(v.clone()), &[(target, value.clone())]);
        }
        let a = run_args(&p);
        assert_escaped_failure(&a.iter().map(|s| s.as_str()).collect::<Vec<_>>(), needle);
    }
}
