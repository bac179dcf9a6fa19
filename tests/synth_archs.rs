//! `sluice synth`'s DeepSeek-V3 (`deepseek2`) and GLM-4.5-Air (`glm4moe`) writers, at the
//! presets' architecture with small dimensions (the real ones are tens of GB per layer):
//! - the `gguf` Python package (llama.cpp's reader) reads the file and sees the same tensors
//!   (names, types, shapes, offsets) as sluice's reader;
//! - every `{arch}.*` key and every per-layer tensor name that llama.cpp's own converter wrote
//!   into the committed fixtures (tests/fixtures/models/{deepseek_v3,glm4_moe}/model-q8_0.gguf,
//!   made by scripts/make_model_fixtures.py) is present, except what the preset says it omits;
//! - sluice loads it with the right family, routing and dense/MoE split, and `sluice run`
//!   generates tokens from it;
//! - llama.cpp itself (its `llama-simple`, built by scripts/build-llama-cpp.sh, which `.ci/run`
//!   runs) loads every preset's file (`MoeSpec::PRESETS`: also Qwen3-Next, Qwen3.5-MoE,
//!   gpt-oss and DeepSeek-V4-Flash) and generates tokens from it;
//! - the gpt-oss presets carry the keys and tensor names of a GGUF converted from the
//!   transformers fixture, and their router bias takes `--skew`.

use sluice::dtype::DType;
use sluice::format::{MetaValue, ModelFiles};
use sluice::synth::{MoeSpec, SynthArch};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn small(preset: &str) -> MoeSpec {
    let mut s = MoeSpec::preset(preset).unwrap();
    (
        s.hidden,
        s.experts,
        s.experts_used,
        s.expert_ffn,
        s.vocab,
        s.skew,
    ) = (256, 16, 4, 256, 0, 1.0);
    match &mut s.arch {
        SynthArch::Deepseek2 { mla, moe, .. } => {
            s.heads = 4;
            (mla.q_lora, mla.kv_lora, mla.nope, mla.rope, mla.v_dim) = (64, 64, 32, 32, 32);
            (moe.dense_ffn, moe.n_group, moe.topk_group) = (128, 4, 2);
            // The IQ2_XXS mix: experts IQ2_XXS, the rest Q4_K or (rows < 256) Q4_0.
            s.dtype = DType::IQ2_XXS;
        }
        SynthArch::Glm4Moe {
            moe, rotary_dim, ..
        } => {
            (s.heads, s.kv_heads, s.head_dim, *rotary_dim) = (4, 2, 64, 32);
            moe.dense_ffn = 128;
        }
        SynthArch::Qwen3Moe | SynthArch::Qwen3Next { .. } | SynthArch::GptOss { .. } => {
            (s.heads, s.kv_heads, s.head_dim) = (4, 2, 64);
        }
        SynthArch::DeepseekV4(v) => {
            // llama.cpp's deepseek4 graph aborts on smaller heads (head_dim 64, rope 16,
            // indexer 32: a GGML_ASSERT in a reshape while reserving the graph; not narrowed
            // down): rope 64 and 128-wide heads as in the real model.
            (s.heads, s.head_dim) = (4, 128);
            (v.q_lora, v.o_groups, v.o_lora, v.rope) = (128, 2, 64, 64);
            (v.idx_heads, v.idx_dim, v.idx_topk, v.window) = (4, 128, 4, 8);
        }
    }
    // Qwen3-Next's fourth layer is its first full-attention one (llama.cpp aborts on a file
    // with no KV layer at all); DeepSeek-V4's third and fourth are its first CSA and HCA ones.
    let n = if matches!(
        s.arch,
        SynthArch::Qwen3Next { .. } | SynthArch::DeepseekV4(_)
    ) {
        4
    } else {
        2
    };
    s.cut_layers(n).unwrap();
    s
}

/// `sluice run PATH` greedy on the fox prompt, 1 thread, with `extra` flags.
fn sluice_run(path: &Path, n: &str, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("run")
        .arg(path)
        .args(["-p", "The quick brown fox", "-n", n, "--temp", "0"])
        .args(["--ignore-eos", "-t", "1"])
        .args(extra)
        .output()
        .unwrap()
}

fn load(files: &ModelFiles) -> sluice::model::Model<'_> {
    let opts = sluice::model::LoadOptions {
        kv: sluice::model::KvTypes::F32,
        threads: 1,
        ctx: 64,
    };
    sluice::model::Model::load(files, &opts).unwrap()
}

fn write(preset: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("synth-archs");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{preset}.gguf"));
    sluice::synth::write_random(&path, &small(preset), &mut |_, _| {}).unwrap();
    path
}

/// synth's file (`ours`) and the converter's (`theirs`) have the same metadata keys, except
/// `optional` ones the converter writes only for some configs, and the same tensor names.
fn same_keys_and_names(
    ours: (&BTreeSet<String>, &BTreeSet<String>),
    theirs: (&BTreeSet<String>, &BTreeSet<String>),
    optional: &[&str],
) {
    for k in theirs.0 {
        assert!(
            ours.0.contains(k) || optional.contains(&k.as_str()),
            "the converter writes {k}, synth does not"
        );
    }
    for k in ours.0 {
        assert!(
            theirs.0.contains(k),
            "synth writes {k}, the converter does not"
        );
    }
    assert_eq!(ours.1, theirs.1);
}

/// (arch, `{arch}.*` keys, tensor names with the layer index replaced by `N`) per the gguf
/// package, after checking its tensor list equals sluice's.
fn read_with_gguf(
    path: &Path,
    ours: Option<&ModelFiles>,
) -> (String, BTreeSet<String>, BTreeSet<String>) {
    let script = r#"
import sys, re, gguf
r = gguf.GGUFReader(sys.argv[1])
arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
print(arch)
print(" ".join(k for k in r.fields if k.startswith(arch + ".")))
for t in r.tensors:
    print(t.name, t.tensor_type.name, ",".join(str(int(d)) for d in reversed(t.shape.tolist())), int(t.data_offset))
"#;
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(path)
        .output()
        .expect("python3 (run .ci/run to install the gguf package)");
    assert!(
        out.status.success(),
        "gguf package could not read {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    let arch = lines.next().unwrap().to_string();
    let keys = lines
        .next()
        .unwrap()
        .split_whitespace()
        .map(String::from)
        .collect();
    let tensors: Vec<&str> = lines.collect();
    if let Some(ours) = ours {
        assert_eq!(tensors.len(), ours.tensors().len());
        for (line, t) in tensors.iter().zip(ours.tensors()) {
            let shape: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
            assert_eq!(
                *line,
                format!(
                    "{} {} {} {}",
                    t.name,
                    t.dtype.name(),
                    shape.join(","),
                    t.range.offset
                )
            );
        }
    }
    let digits = |s: &str| -> String {
        let mut o = String::new();
        let mut prev_digit = false;
        for c in s.chars() {
            if c.is_ascii_digit() {
                if !prev_digit {
                    o.push('N');
                }
                prev_digit = true;
            } else {
                o.push(c);
                prev_digit = false;
            }
        }
        o
    };
    let names = tensors
        .iter()
        .map(|l| digits(l.split(' ').next().unwrap()))
        .collect();
    (arch, keys, names)
}

/// The MTP layer's tensors as llama.cpp names them (`blk.N.nextn.*` beside a full decoder
/// layer N = the main layer count). synth leaves out the two optional vocabulary-sized ones.
const NEXTN: [&str; 4] = [
    "blk.N.nextn.eh_proj.weight",
    "blk.N.nextn.enorm.weight",
    "blk.N.nextn.hnorm.weight",
    "blk.N.nextn.shared_head_norm.weight",
];
const NEXTN_OPTIONAL: [&str; 2] = [
    "blk.N.nextn.embed_tokens.weight",
    "blk.N.nextn.shared_head_head.weight",
];

/// `extra_tensors`: names synth writes that the fixture's converter did not.
fn check(
    preset: &str,
    fixture: &str,
    omitted_keys: &[&str],
    omitted_tensors: &[&str],
    extra_keys: &[&str],
    extra_tensors: &[&str],
) {
    let path = write(preset);
    let files = ModelFiles::open(&path).unwrap();
    let (arch, keys, names) = read_with_gguf(&path, Some(&files));
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(fixture)
        .join("model-q8_0.gguf");
    let (farch, fkeys, fnames) = read_with_gguf(&fixture, None);
    assert_eq!(arch, farch);
    for k in &fkeys {
        assert!(
            keys.contains(k) || omitted_keys.contains(&k.as_str()),
            "{preset}: llama.cpp's converter writes {k}, synth does not"
        );
    }
    for n in &fnames {
        assert!(
            names.contains(n) || omitted_tensors.contains(&n.as_str()),
            "{preset}: llama.cpp's converter writes {n}, synth does not"
        );
    }
    for n in &names {
        assert!(
            fnames.contains(n) || extra_tensors.contains(&n.as_str()),
            "{preset}: synth writes {n}, llama.cpp's converter does not"
        );
    }
    for k in &keys {
        assert!(
            fkeys.contains(k) || extra_keys.contains(&k.as_str()),
            "{preset}: synth writes {k}, llama.cpp's converter does not"
        );
    }
    for n in NEXTN {
        assert!(names.contains(n), "{preset}: no MTP tensor {n}");
    }
    // The MTP layer is block 2 of 3 (N = n_layer), and a full MoE layer.
    assert_eq!(
        files
            .meta(&format!("{arch}.block_count"))
            .and_then(MetaValue::as_u64),
        Some(3)
    );
    assert_eq!(
        files
            .meta(&format!("{arch}.nextn_predict_layers"))
            .and_then(MetaValue::as_u64),
        Some(1)
    );
    assert_eq!(
        files.tensor("blk.2.nextn.eh_proj.weight").unwrap().shape,
        vec![256, 512]
    );
    assert!(files.tensor("blk.2.ffn_gate_exps.weight").is_some());

    // sluice's loader: family, routing, dense/MoE split as the preset says.
    let model = load(&files);
    let c = &model.cfg;
    assert_eq!(c.family.name(), arch);
    assert_eq!((c.n_layers, c.n_dense_layers, c.n_mtp_layers), (2, 1, 1));
    assert!(model.has_mtp(), "{preset}: MTP layer not loaded");
    assert!(c.routing.sigmoid && c.routing.norm_topk_prob);
    assert_eq!((c.n_experts, c.n_experts_used, c.shared_ffn), (16, 4, 256));
    match arch.as_str() {
        "deepseek2" => {
            assert_eq!(
                (c.routing.n_group, c.routing.topk_group, c.routing.scale),
                (4, 2, 2.5)
            );
            assert!(matches!(
                c.rope_scaling,
                sluice::model::config::RopeScaling::Yarn { .. }
            ));
            assert!(matches!(
                c.attn,
                sluice::model::config::AttnKind::Mla {
                    q_lora: Some(64),
                    kv_lora: 64,
                    nope: 32,
                    rope: 32,
                    v_dim: 32
                }
            ));
            let t = files.tensor("blk.1.ffn_down_exps.weight").unwrap();
            assert_eq!(t.dtype, DType::IQ2_XXS);
            assert_eq!(
                files.tensor("blk.0.attn_q_a.weight").unwrap().dtype,
                DType::Q4_K
            );
            assert_eq!(
                files.tensor("blk.0.attn_k_b.weight").unwrap().dtype,
                DType::Q4_0
            );
        }
        "glm4moe" => {
            assert_eq!(c.routing.scale, 1.0);
            assert!(c.attn_bias);
            assert_eq!((c.rotary_dim, c.head_dim), (32, 64));
            assert_eq!(
                files
                    .meta("glm4moe.rope.dimension_count")
                    .and_then(MetaValue::as_u64),
                Some(32)
            );
        }
        other => panic!("{other}"),
    }
    drop(model);

    // `sluice run` generates tokens from it.
    let out = sluice_run(&path, "4", &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{preset}: sluice run failed: {stderr}"
    );
    assert!(stderr.contains("generated 4 tok"), "{preset}: {stderr}");

    // `--mtp 2` drafts with the MTP layer and emits plain greedy's text.
    let plain = String::from_utf8_lossy(&out.stdout).to_string();
    let out = sluice_run(&path, "4", &["--mtp", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{preset}: sluice run --mtp 2 failed: {stderr}"
    );
    assert!(stderr.contains("mtp accepted"), "{preset}: {stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), plain, "{preset}");
}

#[test]
fn deepseek_v3_synth_matches_llama_cpp_layout_and_runs() {
    // The vendored converter drops DeepSeek's MTP layer (the fixture has no nextn tensors nor
    // `nextn_predict_layers`); synth writes it under the names llama.cpp's converter gives
    // GLM's (and llama.cpp's deepseek2 loader reads), checked against the GLM fixture below.
    check(
        "deepseek-v3",
        "deepseek_v3",
        &[],
        &[],
        &["deepseek2.nextn_predict_layers"],
        &NEXTN,
    );
}

#[test]
fn glm_4_5_air_synth_matches_llama_cpp_layout_and_runs() {
    // The fixture model has q/k norms (GLM-4.5), GLM-4.5-Air has none; both have the MTP
    // layer, whose optional embed_tokens / shared_head_head synth leaves out.
    let mut omitted = vec!["blk.N.attn_q_norm.weight", "blk.N.attn_k_norm.weight"];
    omitted.extend(NEXTN_OPTIONAL);
    check("glm-4.5-air", "glm4_moe", &[], &omitted, &[], &[]);
}

/// Share of decode-step selections that went to the four most selected experts (of 16), from a
/// `--route-trace` of `sluice run` on a file of `preset` (small dims) written with `skew`.
fn top4_share(preset: &str, skew: f32) -> f64 {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("synth-archs");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{preset}-skew{skew}.gguf"));
    let trace = dir.join(format!("{preset}-skew{skew}.trace"));
    let mut spec = small(preset);
    spec.skew = skew;
    sluice::synth::write_random(&path, &spec, &mut |_, _| {}).unwrap();
    let trace_arg = trace.to_str().unwrap();
    let flags = [
        "--experts",
        "stream",
        "--usage-freeze",
        "--route-trace",
        trace_arg,
    ];
    let out = sluice_run(&path, "64", &flags);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut count = [0usize; 16];
    let mut n = 0usize;
    for line in std::fs::read_to_string(&trace).unwrap().lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        // Decode steps request exactly top-k (4) experts; prefill lines request the union.
        if line.starts_with('#') || f.len() != 2 + 4 {
            continue;
        }
        for e in &f[2..] {
            count[e.parse::<usize>().unwrap()] += 1;
            n += 1;
        }
    }
    assert!(n >= 4 * 60, "{n} decode selections");
    count.sort_unstable_by(|a, b| b.cmp(a));
    count[..4].iter().sum::<usize>() as f64 / n as f64
}

/// `--skew` concentrates routing in every family: with S = 2 the four favourite experts (of 16,
/// top-4 routing) take clearly more of 64 decode steps' selections than without skew. Measured
/// (top-4 share without -> with S = 1, S = 2): qwen3moe 0.34 -> 0.40, 0.48; deepseek2 0.38 ->
/// 0.53, 0.69; glm4moe 0.35 -> 0.51, 0.73; gpt-oss 0.37 -> 0.63 at S = 2 (Zipf(1)/(2)
/// popularity would put 0.62/0.90 of the mass on the top four: the skew is real but under its
/// nominal exponent).
#[test]
fn skew_concentrates_routing_in_every_family() {
    for preset in ["qwen3-30b-a3b", "deepseek-v3", "glm-4.5-air", "gpt-oss-20b"] {
        let (flat, skewed) = (top4_share(preset, 0.0), top4_share(preset, 2.0));
        eprintln!("{preset}: top-4 share {flat:.3} without skew, {skewed:.3} with skew 2");
        assert!(skewed > flat + 0.1, "{preset}: {flat} -> {skewed}");
    }
}

/// llama.cpp's own loader and graph accept the synthetic files of every preset: `llama-simple`
/// loads each and generates. The binary comes from scripts/build-llama-cpp.sh; without it the
/// test says so and passes, unless SLUICE_REQUIRE_LLAMA_CPP is set (`.ci/run` sets it).
#[test]
fn llama_cpp_loads_and_runs_every_preset() {
    let bin =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("vendor-data/llama.cpp-build/bin/llama-simple");
    if !bin.exists() {
        assert!(
            std::env::var_os("SLUICE_REQUIRE_LLAMA_CPP").is_none(),
            "{} missing: run scripts/build-llama-cpp.sh",
            bin.display()
        );
        eprintln!(
            "skipped: {} missing (scripts/build-llama-cpp.sh builds it)",
            bin.display()
        );
        return;
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("synth-llama-cpp");
    std::fs::create_dir_all(&dir).unwrap();
    for preset in MoeSpec::PRESETS {
        let path = dir.join(format!("{preset}.gguf"));
        sluice::synth::write_random(&path, &small(preset), &mut |_, _| {}).unwrap();
        let out = Command::new(&bin)
            .arg("-m")
            .arg(&path)
            .args(["-n", "4", "Hello world"])
            .output()
            .unwrap();
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && all.contains("decoded"),
            "llama.cpp failed on the {preset} synth file ({}):\n{}",
            out.status,
            &all[all.len().saturating_sub(3000)..]
        );
        let line = all.lines().find(|l| l.contains("decoded")).unwrap_or("");
        eprintln!("{preset}: llama.cpp {}", line.trim());
    }
}

/// The gpt-oss presets: the same `gpt-oss.*` keys and per-layer tensor names as a GGUF written
/// from the transformers fixture (tests/fixtures/models/gpt_oss) with gguf-py's GPT_OSS name
/// map (scripts/gptoss_to_gguf.py, which follows llama.cpp's converter), experts MXFP4 and
/// the rest Q8_0 by default; sluice reads it as gpt-oss (alternating window, sinks, biases)
/// and generates from it.
#[test]
fn gpt_oss_synth_matches_the_converters_layout_and_runs() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("synth-archs");
    std::fs::create_dir_all(&dir).unwrap();
    let conv = dir.join("gpt_oss-converted.gguf");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/gpt_oss");
    let out = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gptoss_to_gguf.py"))
        .arg(&fixture)
        .arg(&conv)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "gptoss_to_gguf.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (farch, fkeys, fnames) = read_with_gguf(&conv, None);
    let path = write("gpt-oss-20b");
    let files = ModelFiles::open(&path).unwrap();
    let (arch, keys, names) = read_with_gguf(&path, Some(&files));
    assert_eq!((arch.as_str(), farch.as_str()), ("gpt-oss", "gpt-oss"));
    // The converter copies the YaRN betas only when the config has them (the fixture does);
    // gpt-oss's defaults are the same 32 / 1 that llama.cpp assumes without the keys.
    let optional = [
        "gpt-oss.rope.scaling.yarn_beta_fast",
        "gpt-oss.rope.scaling.yarn_beta_slow",
    ];
    same_keys_and_names((&keys, &names), (&fkeys, &fnames), &optional);
    for (name, want) in [
        ("blk.0.ffn_gate_exps.weight", DType::MXFP4),
        ("blk.0.ffn_down_exps.weight", DType::MXFP4),
        ("blk.0.attn_q.weight", DType::Q8_0),
        ("blk.0.attn_sinks.weight", DType::F32),
        ("blk.0.ffn_up_exps.bias", DType::F32),
    ] {
        assert_eq!(files.tensor(name).unwrap().dtype, want, "{name}");
    }
    let model = load(&files);
    let c = &model.cfg;
    assert_eq!(c.family.name(), "gpt-oss");
    assert_eq!(c.sliding_window, Some(128));
    assert_eq!(c.sliding_layers.as_deref(), Some(&[true, false][..]));
    assert!(c.attn_sinks && c.expert_bias && c.attn_bias && c.o_bias);
    assert_eq!((c.n_experts, c.n_experts_used), (16, 4));
    drop(model);
    let out = sluice_run(&path, "4", &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "sluice run failed: {stderr}");
    assert!(stderr.contains("generated 4 tok"), "{stderr}");
}

/// The deepseek-v4-flash preset (small dims, its first 4 layers: sliding, sliding, CSA, HCA;
/// hash routing on the first 3): the keys and per-layer tensor names of a `deepseek4` GGUF
/// written from the transformers fixture by scripts/deepseek_v4_to_gguf.py (which follows
/// llama.cpp's converter), experts MXFP4; sluice reads it as DeepSeek-V4 and generates from it.
#[test]
fn deepseek_v4_synth_matches_the_converters_layout_and_runs() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("synth-archs");
    std::fs::create_dir_all(&dir).unwrap();
    let conv = dir.join("deepseek_v4-converted.gguf");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/deepseek_v4");
    let out = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/deepseek_v4_to_gguf.py"))
        .arg(&fixture)
        .arg(&conv)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "deepseek_v4_to_gguf.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (farch, fkeys, fnames) = read_with_gguf(&conv, None);
    let path = write("deepseek-v4-flash");
    let files = ModelFiles::open(&path).unwrap();
    let (arch, keys, names) = read_with_gguf(&path, Some(&files));
    assert_eq!((arch.as_str(), farch.as_str()), ("deepseek4", "deepseek4"));
    // The fixture's compress rope has an explicit attention factor (transformers writes it).
    let optional = ["deepseek4.rope.scaling.yarn_attn_factor"];
    same_keys_and_names((&keys, &names), (&fkeys, &fnames), &optional);
    for (name, want) in [
        ("blk.0.ffn_gate_exps.weight", DType::MXFP4),
        ("blk.0.ffn_gate_tid2eid.weight", DType::I32),
        ("blk.3.attn_compressor_ape.weight", DType::F32),
        ("blk.2.indexer.attn_q_b.weight", DType::Q8_0),
    ] {
        assert_eq!(files.tensor(name).unwrap().dtype, want, "{name}");
    }
    let model = load(&files);
    let c = &model.cfg;
    assert_eq!(c.family.name(), "deepseek4");
    let v = c.v4.as_deref().unwrap();
    use sluice::model::deepseek_v4::LayerKind::*;
    assert_eq!(v.kinds, [Sliding, Sliding, Csa, Hca]);
    assert_eq!(v.hash, [true, true, true, false]);
    assert_eq!((v.hc, v.hca_rate, v.window), (4, 128, 8));
    drop(model);
    let out = sluice_run(&path, "4", &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "sluice run failed: {stderr}");
    assert!(stderr.contains("generated 4 tok"), "{stderr}");
}

/// `--no-mtp` (`mtp_layers = 0`): no nextn tensors or key, `block_count` the main layers, and
/// the main model's tensors are the same bytes as in the file with the MTP layer.
#[test]
fn no_mtp_writes_the_same_main_model_without_the_nextn_layer() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("synth-no-mtp");
    std::fs::create_dir_all(&dir).unwrap();
    for preset in ["deepseek-v3", "glm-4.5-air"] {
        let with = dir.join(format!("{preset}-mtp.gguf"));
        let without = dir.join(format!("{preset}-no-mtp.gguf"));
        sluice::synth::write_random(&with, &small(preset), &mut |_, _| {}).unwrap();
        let mut spec = small(preset);
        spec.mtp_layers = 0;
        sluice::synth::write_random(&without, &spec, &mut |_, _| {}).unwrap();
        let (a, b) = (
            ModelFiles::open(&with).unwrap(),
            ModelFiles::open(&without).unwrap(),
        );
        let arch = spec.arch.gguf_name();
        assert_eq!(
            b.meta(&format!("{arch}.block_count"))
                .and_then(MetaValue::as_u64),
            Some(2)
        );
        assert!(b.meta(&format!("{arch}.nextn_predict_layers")).is_none());
        assert!(b.tensors().iter().all(|t| !t.name.starts_with("blk.2.")));
        let extra = a.tensors().len() - b.tensors().len();
        let mtp = a.tensors().iter().filter(|t| t.name.starts_with("blk.2."));
        assert_eq!(mtp.count(), extra);
        for t in b.tensors() {
            let ta = a.tensor(&t.name).unwrap();
            assert_eq!(
                a.bytes(ta).unwrap(),
                b.bytes(t).unwrap(),
                "{preset} {}",
                t.name
            );
        }
        let model = sluice::model::Model::load(
            &b,
            &sluice::model::LoadOptions {
                kv: sluice::model::KvTypes::F32,
                threads: 1,
                ctx: 64,
            },
        )
        .unwrap();
        assert!(!model.has_mtp());
    }
}
