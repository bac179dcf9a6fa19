//! `sluice bench MODEL --sweep NAME=V1,V2 --plot out.svg`: one row per swept value in the
//! table and in the JSON/CSV outputs, and a well-formed SVG (parsed by Python's xml module)
//! with both panels' points, axis labels and a title naming the model and the flag.

use std::path::Path;
use std::process::Command;

fn tiny_model(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("tiny.gguf");
    let mut spec = sluice::default_model::spec();
    spec.layers = 2;
    sluice::synth::write_random(&path, &spec, &mut |_, _| {}).unwrap();
    path
}

fn bench(model: &Path, extra: &[&str]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("bench")
        .arg(model)
        .args(["-p", "8", "-n", "4", "-r", "1", "--sweep", "cap=1,8"])
        .args(["--run-flags", "--experts stream -t 1"])
        .args(extra)
        .output()
        .unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(out.status.success(), "bench failed: {se}");
    (so, se)
}

#[test]
fn sweep_table_json_csv_and_svg() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-sweep");
    std::fs::create_dir_all(&dir).unwrap();
    let model = tiny_model(&dir);
    let svg = dir.join("sweep.svg");
    let _ = std::fs::remove_file(&svg);

    let (json, _) = bench(&model, &["--json", "--plot", svg.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["sweep"]["flag"], "cap");
    let rows = v["sweep"]["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["value"], "1");
    assert_eq!(rows[1]["value"], "8");
    for r in rows {
        assert!(r["tg_median"].as_f64().unwrap() > 0.0, "{r}");
        let h = r["hit_rate"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&h), "{r}");
    }
    // Four results (pp and tg per value), each naming its value.
    assert_eq!(v["results"].as_array().unwrap().len(), 4);

    let check = r#"
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
ns = "{http://www.w3.org/2000/svg}"
assert root.tag == ns + "svg", root.tag
texts = [t.text or "" for t in root.iter(ns + "text")]
circles = list(root.iter(ns + "circle"))
lines = list(root.iter(ns + "polyline"))
assert any("tiny.gguf" in t and "--cap" in t for t in texts), texts
assert "decode tok/s (median)" in texts and "expert hit rate (%)" in texts, texts
assert "--cap" in texts and "1" in texts and "8" in texts, texts
assert len(circles) == 4, len(circles)
assert len(lines) == 2, len(lines)
print("ok")
"#;
    let out = Command::new("python3")
        .arg("-c")
        .arg(check)
        .arg(&svg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "SVG check failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let (text, _) = bench(&model, &[]);
    let table: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("| cap "))
        .skip(1)
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert_eq!(table.len(), 2, "{text}");

    let (csv, _) = bench(&model, &["--csv"]);
    let mut lines = csv.lines();
    assert!(lines.next().unwrap().ends_with(",sweep_flag,sweep_value"));
    let values: Vec<&str> = lines.map(|l| l.rsplit(',').next().unwrap()).collect();
    assert_eq!(values, ["1", "1", "8", "8"]);
}
