//! Qwen3-Next and Qwen3.5-MoE (text) against transformers 5.25 (float32, eager, the torch
//! fallbacks of the Gated DeltaNet), a reference nobody here wrote.
//!
//! Fixtures: tests/fixtures/models/qwen3_next and qwen3_5_moe, made by
//! scripts/make_qwen3next_fixtures.py: 4 layers each with Gated DeltaNet and gated full
//! attention layers (Qwen3-Next also a dense-MLP layer), 2 key / 4 value heads in the DeltaNet,
//! partial rotary 0.25, a sigmoid-gated shared expert. Every case must match transformers'
//! logits (max|Δ| / max|ref| <= 1e-4, the same argmax at every position) for prefill chunks of
//! 1 (every token a decode step), 5 and 64 tokens (the 80-token case crosses chunk boundaries
//! inside the prompt, and transformers' own 64-token delta-rule chunk); the 16 greedy tokens
//! must be identical; streamed experts bit-identical to resident ones; a snapshot of the
//! recurrent + KV state restored into a fresh state continues bit-identically; truncating a
//! recurrent state restarts the sequence. Control tests show the fixture discriminates.

mod model_util;

use model_util::{argmax, compare, dir, ids, json};
use sluice::experts::{CacheConfig, IoMode};
use sluice::format::{MetaValue, ModelFiles};
use sluice::model::qwen3next::Mixer;
use sluice::model::weights::Attention;
use sluice::model::{LoadOptions, Model};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const OPTS: LoadOptions = LoadOptions {
    kv: sluice::model::KvTypes::F32,
    threads: 2,
    ctx: 128,
};

/// (fixture or file, family): the GGUF is checked against the safetensors fixture's logits.
const FAMILIES: [(&str, &str); 4] = [
    ("qwen3_next", "qwen3next"),
    ("qwen3_next.gguf", "qwen3next"),
    ("qwen3_5_moe", "qwen35moe"),
    ("qwen3_5_moe.gguf", "qwen35moe"),
];

/// The fixture directory holding the reference logits of `name`.
fn refdir(name: &str) -> PathBuf {
    dir(name.trim_end_matches(".gguf"))
}

fn open(name: &str) -> ModelFiles {
    let p = match name.strip_suffix(".gguf") {
        Some(fixture) => gguf(fixture),
        None => dir(name),
    };
    ModelFiles::open(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Fixture `fixture` as a `qwen3next` / `qwen35moe` GGUF (llama.cpp's names, keys and, for
/// Qwen3.5, its tiled value-head order), written once per test binary by
/// scripts/qwen3next_to_gguf.py.
fn gguf(fixture: &str) -> PathBuf {
    static CELLS: [(&str, OnceLock<PathBuf>); 2] = [
        ("qwen3_next", OnceLock::new()),
        ("qwen3_5_moe", OnceLock::new()),
    ];
    let (_, cell) = CELLS
        .iter()
        .find(|(f, _)| *f == fixture)
        .unwrap_or_else(|| panic!("no GGUF writer for {fixture}"));
    cell.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{fixture}.gguf"));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/qwen3next_to_gguf.py");
        let run = Command::new("python3")
            .arg(script)
            .arg(dir(fixture))
            .arg(&out)
            .output()
            .expect("python3 with the gguf and numpy packages (.ci/run installs them)");
        assert!(
            run.status.success(),
            "scripts/qwen3next_to_gguf.py failed:\n{}",
            String::from_utf8_lossy(&run.stderr)
        );
        out
    })
    .clone()
}

/// Worst relative error over every case and chunk size, asserting argmax agreement.
fn check_cases(name: &str, model: &Model<'_>) -> f32 {
    let d = refdir(name);
    let mut worst = 0f32;
    for case in json(&d.join("cases.json"))["cases"].as_array().unwrap() {
        let toks = ids(&case["ids"]);
        let (shape, refr) =
            sluice::npy::read_f32(&d.join(case["logits"].as_str().unwrap())).unwrap();
        assert_eq!(shape, vec![toks.len(), model.cfg.vocab]);
        for batch in [1, 5, 64] {
            let mut st = model.new_state(128, batch, batch).unwrap();
            let mut ours = Vec::new();
            model.logits_all(&mut st, &toks, &mut ours).unwrap();
            let (err, same) = compare(&ours, &refr, model.cfg.vocab);
            eprintln!(
                "{name} {} batch {batch}: max|Δ|/max|ref| = {err:.2e}",
                case["name"]
            );
            assert!(
                same,
                "{name} {}: argmax differs (batch {batch})",
                case["name"]
            );
            worst = worst.max(err);
        }
    }
    worst
}

#[test]
fn logits_match_transformers() {
    for (name, family) in FAMILIES {
        let files = open(name);
        let model = Model::load(&files, &OPTS).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(model.cfg.family.name(), family);
        // Only the full-attention layers keep a KV cache (qwen3_next: 2 of 4; qwen3_5_moe: 1).
        let hy = model.cfg.hybrid.as_deref().unwrap();
        assert_eq!(model.cfg.kv_layers(), 4 - hy.n_linear());
        let err = check_cases(name, &model);
        assert!(err <= 1e-4, "{name}: max|Δ|/max|ref| = {err:.2e}");
    }
}

#[test]
fn greedy_matches_transformers() {
    for (name, _) in FAMILIES {
        let g = &json(&refdir(name).join("cases.json"))["greedy"];
        let (prompt, want) = (ids(&g["prompt_ids"]), ids(&g["tokens"]));
        let files = open(name);
        let model = Model::load(&files, &OPTS).unwrap();
        for batch in [1, 4, 16] {
            let mut st = model.new_state(128, batch, 1).unwrap();
            let mut next = argmax(model.feed(&mut st, &prompt).unwrap()) as u32;
            let mut got = vec![next];
            while got.len() < want.len() {
                next = argmax(model.forward_chunk(&mut st, &[next], 0).unwrap()) as u32;
                got.push(next);
            }
            assert_eq!(got, want, "{name} batch {batch}: greedy continuation");
        }
    }
}

#[test]
fn streamed_experts_are_bit_identical_to_resident() {
    for name in ["qwen3_next", "qwen3_next.gguf", "qwen3_5_moe.gguf"] {
        streamed_matches_resident(name);
    }
}

fn streamed_matches_resident(name: &str) {
    let files = open(name);
    let model = Model::load(&files, &OPTS).unwrap();
    let case = &json(&refdir(name).join("cases.json"))["cases"][2];
    let toks = ids(&case["ids"]);
    let run = |batch: usize, cache: Option<CacheConfig>| {
        let mut st = model.new_state(128, batch, batch).unwrap();
        if let Some(c) = cache {
            st.attach_experts(model.expert_cache(&files, c).unwrap());
        }
        let mut out = Vec::new();
        model.logits_all(&mut st, &toks, &mut out).unwrap();
        out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
    };
    let reference = run(8, None);
    for io in [IoMode::Buffered, IoMode::Mmap] {
        for slots in [1, 3] {
            let mut c = CacheConfig::new(slots);
            c.io = io;
            assert_eq!(run(8, Some(c)), reference, "{name} io {io:?} slots {slots}");
        }
    }
}

#[test]
fn snapshot_restores_the_recurrent_state_and_truncate_restarts() {
    let name = "qwen3_next";
    let files = open(name);
    let model = Model::load(&files, &OPTS).unwrap();
    let toks = ids(&json(&dir(name).join("cases.json"))["cases"][2]["ids"]);
    let v = model.cfg.vocab;
    let mut st = model.new_state(128, 4, 4).unwrap();
    let mut whole = Vec::new();
    model.logits_all(&mut st, &toks, &mut whole).unwrap();

    // A snapshot at 10 positions, restored into a fresh state, continues bit-identically.
    let mut st = model.new_state(128, 4, 4).unwrap();
    let mut head = Vec::new();
    model.logits_all(&mut st, &toks[..10], &mut head).unwrap();
    assert!(
        st.snapshot(5).is_err(),
        "a recurrent state cannot be snapshotted before its end"
    );
    let snap = st.snapshot(10).unwrap();
    let mut fresh = model.new_state(128, 4, 4).unwrap();
    fresh.restore(&snap).unwrap();
    let mut rest = Vec::new();
    for &t in &toks[10..] {
        rest.extend_from_slice(model.forward_chunk(&mut fresh, &[t], 0).unwrap());
    }
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let mut one_by_one = model.new_state(128, 4, 4).unwrap();
    let mut want = Vec::new();
    for &t in &toks {
        want.extend_from_slice(model.forward_chunk(&mut one_by_one, &[t], 0).unwrap());
    }
    assert_eq!(bits(&rest), bits(&want[10 * v..]));

    // Truncating into the sequence cannot cut a recurrent state: it restarts at 0, and
    // re-feeding gives the same logits.
    assert_eq!(st.truncate(4), 0);
    let mut again = Vec::new();
    model.logits_all(&mut st, &toks, &mut again).unwrap();
    let (err, same) = compare(&again, &whole, v);
    assert!(same && err == 0.0, "after truncate: {err:.2e}");
}

/// Relative error on the longest case after `edit` changes the loaded model.
fn err_with(name: &str, edit: impl Fn(&mut Model<'_>)) -> f32 {
    let d = refdir(name);
    let files = open(name);
    let mut model = Model::load(&files, &OPTS).unwrap();
    edit(&mut model);
    let case = &json(&d.join("cases.json"))["cases"][3];
    let (_, refr) = sluice::npy::read_f32(&d.join(case["logits"].as_str().unwrap())).unwrap();
    let mut st = model.new_state(128, 8, 8).unwrap();
    let mut ours = Vec::new();
    model
        .logits_all(&mut st, &ids(&case["ids"]), &mut ours)
        .unwrap();
    compare(&ours, &refr, model.cfg.vocab).0
}

#[test]
fn shared_gate_conv_and_decay_each_matter() {
    let name = "qwen3_next";
    let no_gate = err_with(name, |m| {
        for l in &mut m.weights.layers {
            if let Some(mo) = match &mut l.ffn {
                sluice::model::weights::Ffn::Moe(mo) => Some(mo),
                _ => None,
            } {
                mo.shared_gate = None;
            }
        }
    });
    let no_conv_history = err_with(name, |m| {
        let k = m.cfg.hybrid.as_ref().unwrap().conv;
        for l in &mut m.weights.layers {
            if let Attention::Hybrid(Mixer::DeltaNet(d)) = &mut l.attn {
                for (i, w) in d.conv.iter_mut().enumerate() {
                    if i % k != k - 1 {
                        *w = 0.0;
                    }
                }
            }
        }
    });
    let no_decay = err_with(name, |m| {
        for l in &mut m.weights.layers {
            if let Attention::Hybrid(Mixer::DeltaNet(d)) = &mut l.attn {
                d.a_neg.iter_mut().for_each(|a| *a = 0.0);
            }
        }
    });
    eprintln!("without shared gate {no_gate:.2e}, conv history {no_conv_history:.2e}, decay {no_decay:.2e}");
    for (what, e) in [
        ("shared-expert gate", no_gate),
        ("conv history", no_conv_history),
        ("decay", no_decay),
    ] {
        assert!(
            e > 1e-3,
            "without the {what} the logits barely move ({e:.2e})"
        );
    }
}

/// The `qwen35moe` GGUF's tiled value-head order matters: read as HF's grouped order, the
/// value heads meet the wrong key heads and the logits leave the reference.
#[test]
fn qwen35moe_gguf_value_heads_are_tiled() {
    let grouped = err_with("qwen3_5_moe.gguf", |m| {
        let hy = m.cfg.hybrid.as_mut().unwrap();
        assert!(hy.v_tiled && hy.k_heads < hy.v_heads);
        hy.v_tiled = false;
    });
    eprintln!("qwen35moe GGUF read in grouped order: {grouped:.2e}");
    assert!(grouped > 1e-2, "grouped order stays at {grouped:.2e}");
}

#[test]
fn unimplemented_config_features_are_refused_by_name() {
    let base: serde_json::Value = json(&dir("qwen3_next").join("config.json"));
    let tmp = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("qwen3next-bad");
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::copy(
        dir("qwen3_next").join("model.safetensors"),
        tmp.join("model.safetensors"),
    )
    .unwrap();
    for (key, val, want) in [
        ("attention_bias", serde_json::json!(true), "attention_bias"),
        (
            "layer_types",
            serde_json::json!([
                "linear_attention",
                "sliding_attention",
                "linear_attention",
                "full_attention"
            ]),
            "layer_types[1]",
        ),
        (
            "use_sliding_window",
            serde_json::json!(true),
            "use_sliding_window",
        ),
        ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
    ] {
        let mut c = base.clone();
        c[key] = val;
        std::fs::write(tmp.join("config.json"), c.to_string()).unwrap();
        let files = ModelFiles::open(&tmp).unwrap();
        let e = Model::load(&files, &OPTS)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{key}: {e}");
    }
}

#[test]
fn synth_presets_write_loadable_qwen3next_and_qwen35moe() {
    use sluice::synth::{MoeSpec, SynthArch};
    for (preset, arch, tiled) in [
        ("qwen3-next-80b-a3b", "qwen3next", false),
        ("qwen3.5-397b-a17b", "qwen35moe", true),
    ] {
        let mut s = MoeSpec::preset(preset).unwrap();
        (s.hidden, s.experts, s.experts_used, s.expert_ffn, s.vocab) = (128, 16, 4, 64, 0);
        (s.heads, s.kv_heads, s.head_dim) = (4, 2, 32);
        if let SynthArch::Qwen3Next {
            linear,
            shared_ffn,
            rotary_dim,
            ..
        } = &mut s.arch
        {
            (linear.k_heads, linear.v_heads, linear.k_dim, linear.v_dim) = (2, 4, 16, 16);
            (*shared_ffn, *rotary_dim) = (64, 8);
        }
        s.cut_layers(4).unwrap();
        let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("synth-{preset}.gguf"));
        sluice::synth::write_random(&path, &s, &mut |_, _| {}).unwrap();
        let files = ModelFiles::open(&path).unwrap();
        let got = files
            .meta("general.architecture")
            .and_then(MetaValue::as_str);
        assert_eq!(got, Some(arch), "{preset}");
        let model = Model::load(&files, &OPTS).unwrap();
        assert_eq!(model.cfg.family.name(), arch, "{preset}");
        let hy = model.cfg.hybrid.as_deref().unwrap();
        assert_eq!(hy.linear, vec![true, true, true, false], "{preset}");
        assert_eq!(hy.v_tiled, tiled, "{preset}");
        assert_eq!(model.cfg.kv_layers(), 1);
        let mut st = model.new_state(128, 8, 1).unwrap();
        let toks: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 200).collect();
        let last = model.feed(&mut st, &toks).unwrap().to_vec();
        assert!(last.iter().all(|v| v.is_finite()));
        for t in 0..8 {
            let l = model.forward_chunk(&mut st, &[t], 0).unwrap();
            assert!(l.iter().all(|v| v.is_finite()), "{preset} step {t}");
        }
    }
}

#[test]
fn config_defaults_follow_transformers() {
    // Without partial_rotary_factor the configs default to 0.25 (not the generic 1.0): the
    // fixture's logits come out the same.
    let mut c: serde_json::Value = json(&dir("qwen3_next").join("config.json"));
    c["rope_parameters"]
        .as_object_mut()
        .unwrap()
        .remove("partial_rotary_factor");
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR")).join("qwen3next-defaults");
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::copy(
        dir("qwen3_next").join("model.safetensors"),
        tmp.join("model.safetensors"),
    )
    .unwrap();
    std::fs::write(tmp.join("config.json"), c.to_string()).unwrap();
    let files = ModelFiles::open(&tmp).unwrap();
    let model = Model::load(&files, &OPTS).unwrap();
    assert_eq!(model.cfg.rotary_dim, 4);
    let case = &json(&dir("qwen3_next").join("cases.json"))["cases"][2];
    let (_, refr) =
        sluice::npy::read_f32(&dir("qwen3_next").join(case["logits"].as_str().unwrap())).unwrap();
    let mut st = model.new_state(128, 8, 8).unwrap();
    let mut ours = Vec::new();
    model
        .logits_all(&mut st, &ids(&case["ids"]), &mut ours)
        .unwrap();
    let (err, same) = compare(&ours, &refr, model.cfg.vocab);
    assert!(same && err <= 1e-4, "{err:.2e}");
}
