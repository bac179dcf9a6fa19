//! Multi-token prediction: the MTP head against transformers' MTP logits (fixtures made with
//! transformers' `MtpModel`, see tests/fixtures/models/README.md), and self-speculative decoding
//! that emits exactly the tokens plain decoding emits.

use serde_json::Value;
use sluice::format::ModelFiles;
use sluice::model::{LoadOptions, Model};
use std::path::{Path, PathBuf};

fn dir(f: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(f)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn check_mtp_logits(family: &str, model_path: &Path) {
    let d = dir(family);
    let files = ModelFiles::open(model_path).unwrap();
    let model = Model::load(&files, &LoadOptions { threads: 2, ctx: 64 }).unwrap();
    assert!(model.has_mtp(), "{family}: MTP layer not loaded from {}", model_path.display());
    let cases: Value = serde_json::from_str(&std::fs::read_to_string(d.join("cases.json")).unwrap()).unwrap();
    let mtp: Value = serde_json::from_str(&std::fs::read_to_string(d.join("mtp.json")).unwrap()).unwrap();
    for c in mtp["cases"].as_array().unwrap() {
        let name = c["case"].as_str().unwrap();
        let case = cases["cases"].as_array().unwrap().iter().find(|x| x["name"] == name).unwrap();
        let toks = ids(&case["ids"]);
        let t = toks.len();
        let mut st = model.new_state(64, 32, 32).unwrap();
        model.forward_chunk(&mut st, &toks, t).unwrap();
        model.mtp_take_hidden(&mut st, 0, t - 1, 0);
        let got = model.mtp_forward(&mut st, &toks[1..], 0).unwrap().to_vec();
        let (shape, want) = sluice::npy::read_f32(&d.join(c["logits"].as_str().unwrap())).unwrap();
        assert_eq!(shape, vec![t - 1, model.cfg.vocab]);
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let err = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!("{family} {} MTP {name}: max|Δ|/max|ref| = {:.2e}", model_path.display(), err / scale);
        assert!(err <= 1e-4 * scale, "{family} MTP {name}: {}", err / scale);
    }
}

#[test]
fn mtp_logits_match_transformers() {
    check_mtp_logits("deepseek_v3", &dir("deepseek_v3"));
    check_mtp_logits("glm4_moe", &dir("glm4_moe"));
    check_mtp_logits("glm4_moe", &dir("glm4_moe").join("model-f32.gguf"));
}
