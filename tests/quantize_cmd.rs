//! `sluice quantize IN OUT TYPE` end to end, against references nobody here wrote:
//! - an F32/F16 GGUF written by the `gguf` package's GGUFWriter is converted; every tensor of
//!   the output must be, byte for byte, what `gguf.quants.quantize` makes of the input's values
//!   for the type llama-quantize's rules give it (matrices converted; norms, biases and routers
//!   kept; a row the block does not divide falls back), and every metadata key must be kept;
//! - the built-in model (assets/sluice-tiny-moe.gguf) converted to F32 and back to Q8_0 gives
//!   its tensors back byte for byte (its file is written that way: docs/MODELS.md);
//! - bad input is one line, exit 1, and leaves no output file behind.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn sluice() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sluice-quantize-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn python(code: &str, args: &[&Path]) -> String {
    let out = Command::new("python3")
        .arg("-c")
        .arg(code)
        .args(args)
        .output()
        .expect("python3 with the gguf package (.ci/run installs it)");
    assert!(
        out.status.success(),
        "python3 failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Writes IN (argv[1]): llama.cpp-style names, F32 matrices and one F16 one, a router, norms,
/// a bias, an expert tensor whose rows (96) no 256-block divides, and metadata of several types.
const WRITE_INPUT: &str = r#"
import sys
import numpy as np
import gguf
rng = np.random.default_rng(7)
w = gguf.GGUFWriter(sys.argv[1], "qwen3moe")
w.add_uint32("qwen3moe.block_count", 1)
w.add_float32("qwen3moe.rope.freq_base", 1e6)
w.add_string("general.name", "quantize-test")
w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
w.add_bool("qwen3moe.flag", True)
def t(name, shape, dtype=np.float32):
    w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(dtype))
t("token_embd.weight", (64, 256))
t("blk.0.attn_norm.weight", (256,))
t("blk.0.attn_q.weight", (128, 256))
t("blk.0.attn_k.weight", (64, 256), np.float16)
t("blk.0.ffn_gate_inp.weight", (8, 256))
t("blk.0.ffn_up_exps.weight", (8, 96, 256))
t("blk.0.ffn_down_exps.weight", (8, 256, 96))
t("blk.0.attn_output.bias", (256,))
t("output.weight", (64, 256))
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
"#;

/// Checks OUT (argv[2]) against IN (argv[1]) for the bulk type argv[3]; prints one line per
/// tensor, "ok ..." or "BAD ...", and "meta ok" / "meta BAD ...".
const CHECK: &str = r#"
import sys
import numpy as np
import gguf
from gguf.quants import quantize, dequantize
Q = gguf.GGMLQuantizationType
a, b, bulk = gguf.GGUFReader(sys.argv[1]), gguf.GGUFReader(sys.argv[2]), Q[sys.argv[3]]
def want(name, row):
    kept = name.endswith(("_norm.weight", ".bias")) or "ffn_gate_inp" in name
    if kept:
        return None
    t = bulk
    if bulk == Q.MXFP4 and "_exps" not in name:
        t = Q.Q8_0
    if row % gguf.GGML_QUANT_SIZES[t][0]:
        t = Q.Q4_0 if gguf.GGML_QUANT_SIZES[t][0] >= 256 else Q.Q8_0
    return t
src = {t.name: t for t in a.tensors}
for t in b.tensors:
    s = src[t.name]
    x = dequantize(np.asarray(s.data), s.tensor_type).astype(np.float32)
    row = int(s.shape[0])
    w = want(t.name, row)
    if w is None:
        exp_type, exp = s.tensor_type, np.asarray(s.data).view(np.uint8).reshape(-1)
    else:
        exp_type = w
        exp = x.reshape(-1, row) if w in (Q.F32,) else quantize(x.reshape(-1, row), w)
        exp = np.ascontiguousarray(exp).view(np.uint8).reshape(-1)
    got = np.asarray(t.data).view(np.uint8).reshape(-1)
    ok = t.tensor_type == exp_type and np.array_equal(got, exp)
    print(("ok" if ok else "BAD"), t.name, t.tensor_type.name, "want", exp_type.name)
print("tensors", len(b.tensors), len(a.tensors))
bad = []
for k, f in a.fields.items():
    if k.startswith("GGUF.") or k == "general.file_type":
        continue
    g = b.fields.get(k)
    if g is None or [bytes(p) for p in f.parts] != [bytes(p) for p in g.parts]:
        bad.append(k)
print("meta ok" if not bad else "meta BAD " + " ".join(bad))
"#;

#[test]
fn converted_tensors_are_the_gguf_packages_bytes() {
    let d = tmpdir("ref");
    let input = d.join("in.gguf");
    python(WRITE_INPUT, &[&input]);
    for (ty, gguf_name) in [
        ("q8_0", "Q8_0"),
        ("q4_0", "Q4_0"),
        ("q4_1", "Q4_1"),
        ("q5_0", "Q5_0"),
        ("q5_1", "Q5_1"),
        ("bf16", "BF16"),
        ("mxfp4", "MXFP4"),
    ] {
        let out = d.join(format!("{ty}.gguf"));
        let o = sluice()
            .args(["quantize"])
            .arg(&input)
            .arg(&out)
            .arg(ty)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "quantize {ty}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let report = python(CHECK, &[&input, &out, Path::new(gguf_name)]);
        let bad: Vec<&str> = report
            .lines()
            .filter(|l| l.starts_with("BAD") || l.starts_with("meta BAD"))
            .collect();
        assert!(bad.is_empty(), "{ty}:\n{report}");
        assert!(
            report.contains("tensors 9 9") && report.contains("meta ok"),
            "{report}"
        );
        // The fallback happened where it should: 96-value rows are not whole 256-blocks.
        if ty == "q8_0" {
            assert!(
                report.contains("ok blk.0.ffn_down_exps.weight Q8_0"),
                "{report}"
            );
        }
    }
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn tensor_type_overrides_and_q4_k_fallback() {
    let d = tmpdir("over");
    let input = d.join("in.gguf");
    python(WRITE_INPUT, &[&input]);
    let out = d.join("mix.gguf");
    let o = sluice()
        .arg("quantize")
        .arg(&input)
        .arg(&out)
        .arg("q4_k")
        .args(["--tensor-type", "output.weight=q8_0"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let f = sluice::format::ModelFiles::open(&out).unwrap();
    let ty = |n: &str| f.tensor(n).unwrap().dtype.name();
    assert_eq!(ty("output.weight"), "Q8_0");
    assert_eq!(ty("blk.0.attn_q.weight"), "Q4_K");
    assert_eq!(ty("blk.0.ffn_down_exps.weight"), "Q4_0");
    assert_eq!(ty("blk.0.ffn_gate_inp.weight"), "F32");
    assert_eq!(ty("blk.0.attn_norm.weight"), "F32");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn the_builtin_model_round_trips_through_f32() {
    let d = tmpdir("tiny");
    let shipped = root().join("assets/sluice-tiny-moe.gguf");
    let f32 = d.join("f32.gguf");
    let q8 = d.join("q8.gguf");
    for (i, o, t) in [(&shipped, &f32, "f32"), (&f32, &q8, "q8_0")] {
        let r = sluice()
            .arg("quantize")
            .arg(i)
            .arg(o)
            .arg(t)
            .output()
            .unwrap();
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    }
    let a = sluice::format::ModelFiles::open(&shipped).unwrap();
    let b = sluice::format::ModelFiles::open(&q8).unwrap();
    assert_eq!(a.tensors().len(), b.tensors().len());
    for (x, y) in a.tensors().iter().zip(b.tensors()) {
        assert_eq!((&x.name, x.dtype, &x.shape), (&y.name, y.dtype, &y.shape));
        assert!(a.bytes(x).unwrap() == b.bytes(y).unwrap(), "{}", x.name);
    }
    let keys = |f: &sluice::format::ModelFiles| f.meta_keys().map(String::from).collect::<Vec<_>>();
    assert_eq!(keys(&a), keys(&b));
    for k in keys(&a) {
        assert_eq!(a.meta(&k), b.meta(&k), "{k}");
    }
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn bad_input_is_one_line_and_leaves_nothing() {
    let d = tmpdir("bad");
    let input = d.join("in.gguf");
    python(WRITE_INPUT, &[&input]);
    let text = d.join("notes.txt");
    std::fs::write(&text, "not a model").unwrap();
    let out = d.join("out.gguf");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![d.join("missing.gguf").display().to_string(), "q8_0".into()],
            "missing.gguf",
        ),
        (
            vec![input.display().to_string(), "q9_9".into()],
            "TYPE \"q9_9\"",
        ),
        (
            vec![input.display().to_string(), "q6_k".into()],
            "llama-quantize",
        ),
        (
            vec![
                input.display().to_string(),
                "q8_0".into(),
                "--tensor-type".into(),
                "attn".into(),
            ],
            "PATTERN=TYPE",
        ),
        (vec![text.display().to_string(), "q8_0".into()], "notes.txt"),
        (
            vec![
                root()
                    .join("tests/fixtures/models/qwen3_moe")
                    .display()
                    .to_string(),
                "q8_0".into(),
            ],
            "quantize reads GGUF",
        ),
    ];
    for (args, needle) in cases {
        let mut c = sluice();
        c.arg("quantize").arg(&args[0]).arg(&out).args(&args[1..]);
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(
            !out.exists() && !d.join("out.gguf.tmp").exists(),
            "{args:?}"
        );
    }
    // OUT is the input.
    let o = sluice()
        .arg("quantize")
        .arg(&input)
        .arg(&input)
        .arg("q8_0")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("OUT is the input"));
    std::fs::remove_dir_all(&d).ok();
}
