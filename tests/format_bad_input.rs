//! Bad model files: the built `sluice inspect` must exit 1 with one line on stderr that names
//! the file and says what is wrong — never a panic. Each corrupt file is made here from a good
//! fixture.

mod format_util;

use std::path::{Path, PathBuf};
use std::process::Command;

use format_util::*;

/// Run `sluice inspect <path> <extra>` and check the failure is one clean line naming `names`
/// and containing every `needles`.
fn expect_failure(path: &Path, extra: &[&str], names: &str, needles: &[&str]) {
    let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("inspect")
        .arg(path)
        .args(extra)
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run sluice");
    let err = String::from_utf8_lossy(&o.stderr);
    let line = err.trim_end();
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}: exit status {:?}, stderr: {err}",
        path.display(),
        o.status
    );
    assert!(
        !line.contains('\n'),
        "{}: stderr is not one line:\n{err}",
        path.display()
    );
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{}: panic:\n{err}",
        path.display()
    );
    assert!(line.starts_with("error: "), "{line}");
    assert!(
        line.contains(names),
        "{}: error does not name {names}: {line}",
        path.display()
    );
    for n in needles {
        assert!(
            line.contains(n),
            "{}: error lacks {n:?}: {line}",
            path.display()
        );
    }
    assert!(o.stdout.is_empty(), "nothing on stdout for a failure");
}

fn tiny() -> Vec<u8> {
    std::fs::read(fixture("tiny-moe.gguf")).unwrap()
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len())
        .position(|w| w == needle)
        .expect("needle in fixture")
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Offset of `output.weight`'s tensor info, just after its name.
fn output_info(g: &[u8]) -> usize {
    let mut needle = 13u64.to_le_bytes().to_vec();
    needle.extend(b"output.weight");
    find(g, &needle) + needle.len()
}

#[test]
fn gguf_truncated_header() {
    let d = scratch("bad");
    let p = write(&d, "trunc-header.gguf", &tiny()[..100]);
    expect_failure(&p, &[], "trunc-header.gguf", &["truncated"]);
}

#[test]
fn gguf_truncated_data() {
    let d = scratch("bad");
    let g = tiny();
    let p = write(&d, "trunc-data.gguf", &g[..g.len() - 1000]);
    expect_failure(
        &p,
        &[],
        "trunc-data.gguf",
        &["output.weight", "past the end of the file"],
    );
}

#[test]
fn gguf_bad_magic() {
    let d = scratch("bad");
    let mut g = tiny();
    g[..4].copy_from_slice(b"GGML");
    let p = write(&d, "magic.gguf", &g);
    expect_failure(&p, &[], "magic.gguf", &["not a GGUF file", "magic"]);
}

#[test]
fn gguf_bad_version() {
    let d = scratch("bad");
    let mut g = tiny();
    g[4..8].copy_from_slice(&1u32.to_le_bytes());
    let p = write(&d, "v1.gguf", &g);
    expect_failure(&p, &[], "v1.gguf", &["version 1"]);
}

#[test]
fn gguf_string_length_past_end() {
    let d = scratch("bad");
    let mut g = tiny();
    put_u64(&mut g, 24, 1 << 40); // the first key's length
    let p = write(&d, "strlen.gguf", &g);
    expect_failure(&p, &[], "strlen.gguf", &["string length", "past the end"]);
}

#[test]
fn gguf_array_length_past_end() {
    let d = scratch("bad");
    let mut g = tiny();
    // key, then value type (ARRAY) and element type (STRING), then the count
    let at = find(&g, b"tokenizer.ggml.tokens") + "tokenizer.ggml.tokens".len() + 8;
    put_u64(&mut g, at, 1 << 50);
    let p = write(&d, "arrlen.gguf", &g);
    expect_failure(
        &p,
        &[],
        "arrlen.gguf",
        &["tokenizer.ggml.tokens", "array of", "past the end"],
    );
}

#[test]
fn gguf_tensor_offset_outside_file() {
    let d = scratch("bad");
    let mut g = tiny();
    let at = output_info(&g) + 4 + 16 + 4; // n_dims, two dims, type, then the offset
    put_u64(&mut g, at, 1 << 40);
    let p = write(&d, "offset.gguf", &g);
    expect_failure(&p, &[], "offset.gguf", &["output.weight", "past the end"]);
}

#[test]
fn gguf_too_many_dims() {
    let d = scratch("bad");
    let mut g = tiny();
    let at = output_info(&g);
    g[at..at + 4].copy_from_slice(&7u32.to_le_bytes());
    let p = write(&d, "dims.gguf", &g);
    expect_failure(&p, &[], "dims.gguf", &["output.weight", "7 dimensions"]);
}

#[test]
fn gguf_empty_and_missing_files() {
    let d = scratch("bad");
    let p = write(&d, "empty.gguf", &[]);
    expect_failure(&p, &[], "empty.gguf", &["empty"]);
    expect_failure(&d.join("nope.gguf"), &[], "nope.gguf", &["cannot open"]);
}

#[test]
fn gguf_unsupported_type_when_used() {
    // Inspecting only describes; --check reads every tensor and meets type 99.
    let p = fixture("format/unknown-type.gguf");
    let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("inspect")
        .arg(&p)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    expect_failure(&p, &["--check"], "unknown-type.gguf", &["b.weight", "#99"]);
}

#[test]
fn gguf_missing_shard() {
    let d = scratch("bad");
    for n in ["split-00001-of-00003.gguf", "split-00003-of-00003.gguf"] {
        std::fs::copy(fixture(&format!("format/{n}")), d.join(n)).unwrap();
    }
    // The whole path of the missing shard, not only its name.
    let missing = d.join("split-00002-of-00003.gguf");
    expect_failure(
        &d.join("split-00001-of-00003.gguf"),
        &[],
        &missing.display().to_string(),
        &["missing shard"],
    );
}

/// The three shards of the split fixture in a fresh directory, `edit` applied to shard `n`.
fn split_with(tag: &str, n: usize, edit: impl FnOnce(&mut Vec<u8>)) -> (PathBuf, PathBuf) {
    let d = scratch(tag);
    for i in 1..=3 {
        let name = format!("split-0000{i}-of-00003.gguf");
        std::fs::copy(fixture(&format!("format/{name}")), d.join(name)).unwrap();
    }
    let edited = d.join(format!("split-0000{n}-of-00003.gguf"));
    let mut b = std::fs::read(&edited).unwrap();
    edit(&mut b);
    std::fs::write(&edited, b).unwrap();
    (d.join("split-00001-of-00003.gguf"), edited)
}

#[test]
fn gguf_corrupt_middle_shard() {
    let (first, bad) = split_with("bad-shard2", 2, |b| b[..4].copy_from_slice(b"GGML"));
    expect_failure(
        &first,
        &[],
        &bad.display().to_string(),
        &["not a GGUF file", "magic"],
    );
}

#[test]
fn gguf_truncated_last_shard() {
    // Shard 3 loses its tail: a tensor's range now ends past that shard's end.
    let (first, bad) = split_with("bad-shard3", 3, |b| b.truncate(b.len() - 100));
    expect_failure(&first, &[], &bad.display().to_string(), &["past the end"]);
}

#[test]
fn gguf_counts_past_end() {
    // Tensor count (offset 8) and metadata count (offset 16) far beyond what the file holds:
    // refused before anything is allocated for them.
    for (at, name) in [(8, "ntensors.gguf"), (16, "nkv.gguf")] {
        let d = scratch("bad");
        let mut g = tiny();
        put_u64(&mut g, at, 1 << 60);
        let p = write(&d, name, &g);
        expect_failure(&p, &[], name, &["cannot fit"]);
    }
}

fn fused() -> Vec<u8> {
    std::fs::read(fixture("format/hf-fused/model.safetensors")).unwrap()
}

#[test]
fn safetensors_header_length_past_end() {
    let d = scratch("bad");
    let mut b = fused();
    put_u64(&mut b, 0, 1 << 40);
    let p = write(&d, "hdr.safetensors", &b);
    expect_failure(
        &p,
        &[],
        "hdr.safetensors",
        &["header length", "past the end"],
    );
}

#[test]
fn safetensors_truncated() {
    let d = scratch("bad");
    let b = fused();
    let p = write(&d, "trunc.safetensors", &b[..b.len() - 100]);
    expect_failure(&p, &[], "trunc.safetensors", &["outside the data section"]);
    let p = write(&d, "tiny.safetensors", &b[..5]);
    expect_failure(&p, &[], "tiny.safetensors", &["truncated"]);
}

#[test]
fn safetensors_bad_json() {
    let d = scratch("bad");
    let mut b = fused();
    b[8] = b'[';
    let p = write(&d, "json.safetensors", &b);
    expect_failure(&p, &[], "json.safetensors", &["not valid JSON"]);
}

#[test]
fn safetensors_unsupported_dtype_when_used() {
    let d = scratch("bad");
    let mut b = fused();
    let at = find(&b, br#""dtype":"BF16""#);
    b[at..at + 14].copy_from_slice(br#""dtype":"U16" "#);
    let p = write(&d, "u16.safetensors", &b);
    expect_failure(&p, &["--check"], "u16.safetensors", &["U16", "cannot"]);
}

#[test]
fn safetensors_missing_shard() {
    let d = scratch("bad-st");
    for n in [
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
    ] {
        std::fs::copy(fixture(&format!("format/hf-deepseek/{n}")), d.join(n)).unwrap();
    }
    let missing = d.join("model-00002-of-00002.safetensors");
    expect_failure(
        &d,
        &[],
        &missing.display().to_string(),
        &["missing shard", "index.json"],
    );
}

#[test]
fn safetensors_bad_index() {
    let copy = |tag: &str| {
        let d = scratch(tag);
        for n in [
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ] {
            std::fs::copy(fixture(&format!("format/hf-deepseek/{n}")), d.join(n)).unwrap();
        }
        d
    };
    let d = copy("bad-index-json");
    std::fs::write(d.join("model.safetensors.index.json"), "{\"weight_map\": ").unwrap();
    expect_failure(&d, &[], "model.safetensors.index.json", &["not valid JSON"]);
    // A shard named by a path, not a file beside the index, is refused (never followed).
    let d = copy("bad-index-path");
    let text = std::fs::read_to_string(fixture("format/hf-deepseek/model.safetensors.index.json"))
        .unwrap();
    let text = text.replacen(
        "\"model-00002-of-00002.safetensors\"",
        "\"../model-00002-of-00002.safetensors\"",
        1,
    );
    std::fs::write(d.join("model.safetensors.index.json"), text).unwrap();
    expect_failure(
        &d,
        &[],
        "model.safetensors.index.json",
        &["not a plain file name"],
    );
}

#[test]
fn safetensors_bad_config() {
    let d = scratch("bad-cfg");
    std::fs::copy(
        fixture("format/hf-fused/model.safetensors"),
        d.join("model.safetensors"),
    )
    .unwrap();
    std::fs::write(d.join("config.json"), "{\"num_hidden_layers\": ").unwrap();
    expect_failure(&d, &[], "config.json", &["not valid JSON"]);
}

#[test]
fn not_a_model() {
    let d = scratch("bad-dir");
    expect_failure(
        &d,
        &[],
        d.file_name().unwrap().to_str().unwrap(),
        &["no .safetensors or .gguf"],
    );
    let p = write(&d, "notes.txt", b"hello");
    expect_failure(&p, &[], "notes.txt", &["not a model"]);
}
