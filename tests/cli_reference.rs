//! `sluice run` end to end against transformers: on each fixture model directory that has a
//! tokenizer (tests/fixtures/models/<family>/, see its README), `run -p PROMPT --temp 0
//! --ignore-eos -n 16` must print the prompt followed by exactly the text of transformers' 16
//! greedy tokens (`greedy.json` `new_ids`), decoded by the Python `tokenizers` package (.ci/run
//! installs it) — so the tokenizer, the forward pass, greedy sampling and the streaming
//! detokenizer are checked together against references nobody here wrote. stderr must carry
//! one timing line of the documented shape with the prompt's token count (`prompt_ids`).

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const FAMILIES: &[&str] = &["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe"];

fn dir(f: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(f)
}

/// The `tokenizers` package's decoding (special tokens skipped, as `run` prints) of each
/// family's greedy ids, in FAMILIES order.
fn reference_texts() -> Vec<String> {
    const CODE: &str = r#"
import json, sys
from tokenizers import Tokenizer
out = []
for d in sys.argv[1:]:
    g = json.load(open(d + "/greedy.json"))
    t = Tokenizer.from_file(d + "/tokenizer.json")
    out.append(t.decode(g["new_ids"], skip_special_tokens=True))
print(json.dumps(out))
"#;
    let dirs: Vec<PathBuf> = FAMILIES.iter().map(|f| dir(f)).collect();
    let o = Command::new("python3")
        .arg("-c")
        .arg(CODE)
        .args(&dirs)
        .output()
        .expect("python3 with the tokenizers package (.ci/run installs it)");
    assert!(
        o.status.success(),
        "python3 tokenizers failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

/// "[timing] prompt P tok, prefill X tok/s | generated G tok, decode Y tok/s | experts/token E"
fn timing_fields(line: &str) -> (usize, f64, usize, f64, f64) {
    let rest = line
        .strip_prefix("[timing] prompt ")
        .unwrap_or_else(|| panic!("timing line: {line}"));
    let num = |s: &str| -> f64 { s.parse().unwrap_or_else(|_| panic!("{s:?} in {line}")) };
    let parts: Vec<&str> = rest.split(" | ").collect();
    assert_eq!(parts.len(), 3, "timing line: {line}");
    let (p, pf) = parts[0].split_once(" tok, prefill ").unwrap();
    let pf = pf.strip_suffix(" tok/s").unwrap();
    let g = parts[1].strip_prefix("generated ").unwrap();
    let (g, d) = g.split_once(" tok, decode ").unwrap();
    let d = d.strip_suffix(" tok/s").unwrap();
    let e = parts[2].strip_prefix("experts/token ").unwrap();
    (
        p.parse().unwrap(),
        num(pf),
        g.parse().unwrap(),
        num(d),
        num(e),
    )
}

#[test]
fn run_prints_transformers_greedy_text() {
    let texts = reference_texts();
    for (f, want) in FAMILIES.iter().zip(texts) {
        let d = dir(f);
        let g: Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("greedy.json")).unwrap()).unwrap();
        let prompt = g["prompt_text"].as_str().unwrap();
        let n_prompt = g["prompt_ids"].as_array().unwrap().len();
        let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["run", d.to_str().unwrap(), "-p", prompt])
            .args([
                "-n",
                "16",
                "--temp",
                "0",
                "--ignore-eos",
                "-c",
                "128",
                "-t",
                "2",
            ])
            .args(["--gpu", "off"])
            // f32 KV: exact against transformers (the default f16 rounds each cached row).
            .args(["-ctk", "f32", "-ctv", "f32"])
            .output()
            .unwrap();
        let (out, err) = (
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
        );
        assert!(o.status.success(), "{f}: {err}");
        assert_eq!(
            out,
            format!("{prompt}{want}\n"),
            "{f}: run's text differs from transformers' greedy tokens"
        );
        let timing: Vec<&str> = err.lines().filter(|l| l.starts_with("[timing]")).collect();
        assert_eq!(timing.len(), 1, "{f}: {err}");
        let (p, pf, gen, dec, experts) = timing_fields(timing[0]);
        assert_eq!(
            p, n_prompt,
            "{f}: prompt tokens (tokenizer vs transformers)"
        );
        assert_eq!(gen, 16, "{f}: generated tokens");
        assert!(pf > 0.0 && dec > 0.0, "{f}: {}", timing[0]);
        // One decoded token runs top-k experts in each MoE layer.
        let cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
        let k = cfg["num_experts_per_tok"].as_u64().unwrap() as f64;
        let moe_layers = cfg["num_hidden_layers"].as_u64().unwrap()
            - cfg["first_k_dense_replace"].as_u64().unwrap_or(0);
        assert_eq!(experts, k * moe_layers as f64, "{f}: {}", timing[0]);
    }
}
