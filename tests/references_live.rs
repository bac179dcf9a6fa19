//! The committed references re-checked against the `gguf` package installed now (.ci/run
//! installs it), so a committed file can't drift from the reference it claims to come from:
//! - every tests/fixtures/quant/<TYPE>.f32 must equal what `gguf.quants.dequantize` returns for
//!   <TYPE>.blocks today, bit for bit (tests/kernels_ref.rs holds sluice to those files);
//! - a MoE GGUF in llama.cpp's layout is written here, by the gguf package's own GGUFWriter, and
//!   `sluice inspect --json` must report what the writer script computes from its own tensors.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs a python3 snippet with `args`; returns its stdout. Panics with the snippet's stderr.
fn python(code: &str, args: &[&Path]) -> String {
    let out = Command::new("python3")
        .arg("-c")
        .arg(code)
        .args(args)
        .output()
        .expect("python3 (run .ci/run to install the gguf package)");
    assert!(
        out.status.success(),
        "python3 failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

const DEQUANT_CHECK: &str = r#"
import json, sys
from pathlib import Path
import numpy as np
import gguf
from gguf.quants import dequantize
d = Path(sys.argv[1])
names = json.loads((d / "MANIFEST.json").read_text())["types"]
for name in names:
    raw = np.fromfile(d / f"{name}.blocks", dtype=np.uint8)
    now = dequantize(raw.reshape(1, -1), gguf.GGMLQuantizationType[name]).astype("<f4").reshape(-1)
    committed = np.fromfile(d / f"{name}.f32", dtype="<f4")
    same = now.shape == committed.shape and np.array_equal(now.view("<u4"), committed.view("<u4"))
    print(name, "same" if same else "DIFFERENT")
"#;

#[test]
fn committed_quant_references_equal_installed_gguf() {
    let dir = root().join("tests/fixtures/quant");
    let out = python(DEQUANT_CHECK, &[&dir]);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines.len() >= 12, "too few types checked:\n{out}");
    for l in &lines {
        assert!(
            l.ends_with(" same"),
            "{l}: the committed reference differs from the installed gguf package"
        );
    }
    eprintln!(
        "{} types: committed .f32 == gguf.quants.dequantize now",
        lines.len()
    );
}

/// Writes a qwen3moe GGUF (llama.cpp tensor names, 3-D expert tensors, mixed F32 / F16 / Q8_0)
/// with GGUFWriter and prints what inspect must say, computed from the writer's own tensors.
const WRITE_MOE: &str = r#"
import json, sys
import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize
path = sys.argv[1]
H, F, V, E, K, L = 256, 256, 64, 6, 2, 3
rng = np.random.default_rng(7)
w = gguf.GGUFWriter(path, "qwen3moe")
w.add_block_count(L); w.add_context_length(256); w.add_embedding_length(H)
w.add_feed_forward_length(F); w.add_expert_feed_forward_length(F)
w.add_head_count(4); w.add_head_count_kv(2); w.add_key_length(64); w.add_value_length(64)
w.add_expert_count(E); w.add_expert_used_count(K); w.add_layer_norm_rms_eps(1e-6)
w.add_rope_freq_base(1e6)
resident = routed = 0
def put(name, shape, qt):
    global resident, routed
    x = rng.standard_normal(shape).astype(np.float32)
    if qt in (T.F32, T.F16):
        data = x.astype(np.float32 if qt == T.F32 else np.float16)
        w.add_tensor(name, data)
    else:
        data = quantize(x, qt)
        w.add_tensor(name, data, raw_dtype=qt)
    if "_exps" in name:
        routed += data.nbytes
    else:
        resident += data.nbytes
put("token_embd.weight", (V, H), T.Q8_0)
for l in range(L):
    p = f"blk.{l}."
    put(p + "attn_norm.weight", (H,), T.F32)
    put(p + "attn_q.weight", (256, H), T.Q8_0)
    put(p + "attn_k.weight", (128, H), T.Q8_0)
    put(p + "attn_v.weight", (128, H), T.Q8_0)
    put(p + "attn_output.weight", (H, 256), T.Q8_0)
    put(p + "attn_q_norm.weight", (64,), T.F32)
    put(p + "attn_k_norm.weight", (64,), T.F32)
    put(p + "ffn_norm.weight", (H,), T.F32)
    put(p + "ffn_gate_inp.weight", (E, H), T.F32)
    put(p + "ffn_gate_exps.weight", (E, F, H), T.Q8_0)
    put(p + "ffn_up_exps.weight", (E, F, H), T.F16)
    put(p + "ffn_down_exps.weight", (E, H, F), T.Q8_0)
put("output_norm.weight", (H,), T.F32)
put("output.weight", (V, H), T.Q8_0)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
one = routed // (L * E)
print(json.dumps({"architecture": "qwen3moe", "layers": L, "moe_layers": L, "experts_per_layer": E,
                  "experts_used_per_token": K, "resident_bytes": resident, "routed_expert_bytes": routed,
                  "one_expert_bytes_per_layer": one, "routed_bytes_per_token": one * K * L,
                  "tensors": 3 + 12 * L}))
"#;

#[test]
fn inspect_reads_a_moe_gguf_written_by_gguf_writer_now() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("references-live");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("writer-moe.gguf");
    let expected: Value = serde_json::from_str(&python(WRITE_MOE, &[&path])).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["inspect", path.to_str().unwrap(), "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "inspect failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    for (k, v) in expected.as_object().unwrap() {
        assert_eq!(
            &got[k], v,
            "inspect field {k}: sluice {} vs writer {v}",
            got[k]
        );
    }
}
