//! The CUDA backend against references nobody here wrote, and its placement invariance.
//!
//! Built only with `--features cuda`; every test prints "skipped: ..." and passes when no CUDA
//! device answers (CI has none). scripts/gpu-check.sh runs them on the GPU machine.
//!
//! - Kernels: each type's GPU matrix product on the `gguf`-package fixture blocks
//!   (tests/fixtures/quant) against an f64 dot of the reference-dequantized weights. The GPU
//!   multiplies f32 activations without quantizing them, so the only error is f32 rounding:
//!   `|gpu - ref| <= 1e-5 * sum|w x| + 1e-6` (a few ulps per partial sum; the sums are at most
//!   2048 long). The embedding kernel's dequantized rows must match the reference to 1e-6
//!   relative (fused multiply-adds may round the last bit differently). The int8-activation
//!   (dp4a) kernels of Q4_K, Q5_K, Q6_K, Q8_0 and Q4_0 against the same reference, within the
//!   rounding of the activations to 8 bits (`sum |w| * d_x / 2`, d_x = max|x|/127 per 32).
//! - Models: GPU logits of every fixture family (f32 GGUF and safetensors) against
//!   transformers' logits with the CPU tests' bound (max|Δ|/max|ref| <= 1e-4, same argmax);
//!   the Q8_0 GGUFs against the CPU forward by KL and top-1 (both quantize activations to 8
//!   bits per 32 values for quantized weights; routing runs on the device on the GPU).
//! - Placement: temp-0 tokens and logits bit-identical across VRAM pool sizes (one slot per
//!   layer .. every expert), RAM cache sizes, and staging modes; with misses computed on the
//!   CPU (`--gpu-experts hybrid`), the all-GPU run's tokens and logits within 1e-4.
//! - The forward's less common operations (gpu/ops.rs), each on a transformers fixture with the
//!   same bound: sliding-window attention (mixtral_swa, qwen3_moe_swa), clip_qkv (olmoe_clip),
//!   DSA's lightning indexer past index_topk (deepseek_v32_sparse; glm_moe_dsa with its shared
//!   indexer layers), LayerNorm and scaling,
//!   and gpt-oss (sinks, alternating window, q/k/v/o and router biases, biased clamped-SwiGLU
//!   experts, YaRN) from the GGUFs scripts/gptoss_to_gguf.py writes (F32 and MXFP4 experts),
//!   its 16 greedy tokens identical to transformers'. Batches 1 (every token a decode step, the
//!   captured graph), 5 (split attention) and 16 (one-pass attention).
//! - Qwen3-Next and Qwen3.5-MoE (gpu/hybrid.rs: Gated DeltaNet with its conv and recurrent state
//!   on the device, gated attention, the sigmoid-gated shared expert), safetensors and llama.cpp's
//!   GGUF (scripts/qwen3next_to_gguf.py): logits with the same bound, 16 greedy tokens identical
//!   to transformers', and at length (1100 tokens, 200 greedy tokens) against the CPU forward;
//!   a truncated sequence restarts from a zero device state, bit-identical to a fresh run.
//! - DeepSeek-V4 (gpu/v4.rs: hyper-connection streams, sliding / CSA / HCA attention with the
//!   compressors, the lightning indexer past index_topk and sinks, hash and biased top-k routing,
//!   clamped SwiGLU experts resident in VRAM), safetensors and llama.cpp's GGUF: logits with the
//!   same bound (batches 1, 5, 16), 16 greedy tokens identical to transformers', at length (240
//!   tokens, 100 greedy tokens) against the CPU forward, MXFP4 experts against their F32 twin.

#![cfg(feature = "cuda")]

mod model_util;

use model_util::{argmax, compare, ids, json};
use sluice::experts::CacheConfig;
use sluice::format::ModelFiles;
use sluice::gpu::model::{check, GpuState};
use sluice::gpu::{GpuOptions, Staging};
use sluice::model::backend::Device;
use sluice::model::{LoadOptions, Model, State};
use std::path::{Path, PathBuf};

const FAMILIES: &[&str] = &["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe"];

/// Fixture variants whose safetensors exercise one operation each (sliding window, clip_qkv,
/// DSA).
/// DeepSeek-V3.2's and GLM-5's DSA fixtures have index_topk 4, so their longer cases attend
/// sparsely through the device's lightning indexer (GLM-5's shared layers reuse its choice).
const VARIANTS: &[&str] = &[
    "mixtral_swa",
    "qwen3_moe_swa",
    "olmoe_clip",
    "deepseek_v32_sparse",
    "glm_moe_dsa",
];

/// The gpt-oss fixture as a GGUF with `experts` (f32 or mxfp4) experts.
fn gptoss_gguf(experts: &str) -> PathBuf {
    fixture_gguf(
        "gpt_oss",
        "scripts/gptoss_to_gguf.py",
        &format!("gpt-oss-{experts}.gguf"),
        &["--experts", experts],
    )
}

/// Qwen3-Next / Qwen3.5-MoE's fixture (`qwen3_next`, `qwen3_5_moe`) as llama.cpp's GGUF
/// (`qwen3next`: b/a grouped per key head; `qwen35moe`: value heads tiled).
fn hybrid_gguf(fixture: &str) -> PathBuf {
    fixture_gguf(
        fixture,
        "scripts/qwen3next_to_gguf.py",
        &format!("{fixture}.gguf"),
        &[],
    )
}

/// Fixture `fixture` written as GGUF `name` by `script`: from `SLUICE_GGUF_DIR` when set (the
/// GPU machine has no gguf package: the files travel with the test binary), else written once.
fn fixture_gguf(fixture: &str, script: &str, name: &str, args: &[&str]) -> PathBuf {
    if let Some(d) = std::env::var_os("SLUICE_GGUF_DIR") {
        return PathBuf::from(d).join(name);
    }
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    if !out.exists() {
        let run = std::process::Command::new("python3")
            .arg(root().join(script))
            .arg(root().join("tests/fixtures/models").join(fixture))
            .arg(&out)
            .args(args)
            .output()
            .expect("python3 with the gguf and numpy packages");
        assert!(
            run.status.success(),
            "{script} failed:\n{}",
            String::from_utf8_lossy(&run.stderr)
        );
    }
    out
}

/// Qwen3-Next and Qwen3.5-MoE (hybrid Gated DeltaNet + gated attention layers, `gpu/hybrid.rs`).
const HYBRID: &[&str] = &["qwen3_next", "qwen3_5_moe"];

/// The repository: `SLUICE_ROOT` when the tests run from a copy (the GPU machine), else the
/// directory they were built in.
fn root() -> PathBuf {
    std::env::var_os("SLUICE_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

fn gpu_or_skip(test: &str) -> bool {
    if !sluice::gpu::driver::present() {
        eprintln!("{test}: skipped: no CUDA driver on this machine");
        return false;
    }
    match sluice::gpu::driver::Gpu::open() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("{test}: skipped: {e}");
            false
        }
    }
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn lcg(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed;
    move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

#[test]
fn kernels_match_gguf_reference() {
    if !gpu_or_skip("kernels_match_gguf_reference") {
        return;
    }
    for t in sluice::gpu::GPU_TYPES {
        // The i-quants with grids have their blocks (every grid row used) in iq_grid/.
        let mut q = root().join("tests/fixtures/quant");
        if !q.join(format!("{}.blocks", t.name())).exists() {
            q = root().join("tests/fixtures/iq_grid");
        }
        let blocks = read(&q.join(format!("{}.blocks", t.name())));
        let refw: Vec<f32> = read(&q.join(format!("{}.f32", t.name())))
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let mut shapes = vec![(8usize, 256usize)];
        if !t.is_quantized() {
            shapes.push((51, 40)); // rows whose length is not a multiple of 32
        }
        for (rows, cols) in shapes {
            let nbytes = t.bytes_for((rows * cols) as u64).unwrap() as usize;
            let w = &blocks[..nbytes];
            let mut rnd = lcg(7);
            let n = 5;
            let x: Vec<f32> = (0..n * cols).map(|_| rnd()).collect();
            let y = check::matmul(t, w, rows, cols, &x, n).unwrap();
            let mut worst = 0f64;
            for tk in 0..n {
                for r in 0..rows {
                    let (mut dot, mut mag) = (0f64, 0f64);
                    for c in 0..cols {
                        let p = refw[r * cols + c] as f64 * x[tk * cols + c] as f64;
                        dot += p;
                        mag += p.abs();
                    }
                    let err = (y[tk * rows + r] as f64 - dot).abs();
                    let bound = 1e-5 * mag + 1e-6;
                    assert!(
                        err <= bound,
                        "{} {rows}x{cols}: token {tk} row {r}: gpu {} vs {dot} (bound {bound:.2e})",
                        t.name(),
                        y[tk * rows + r]
                    );
                    worst = worst.max(err / mag.max(1e-30));
                }
            }
            // The int8-activation (dp4a) kernel: the activations are rounded to 8 bits per 32
            // values (d = max|x|/127), so each product is off by at most |w| * d/2; the bound
            // is that sum with a margin for the f32 sums: |gpu - ref| <= sum |w| d_x / 2 * 1.01.
            if let Some(yq) = check::matmul_q8(t, w, rows, cols, &x, n).unwrap() {
                let mut worst_q = 0f64;
                for tk in 0..n {
                    let xs = &x[tk * cols..(tk + 1) * cols];
                    for r in 0..rows {
                        let (mut dot, mut mag, mut bound) = (0f64, 0f64, 1e-6f64);
                        for (c32, xb) in xs.chunks(32).enumerate() {
                            let dx = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 127.0;
                            for (i, xv) in xb.iter().enumerate() {
                                let wv = refw[r * cols + 32 * c32 + i] as f64;
                                dot += wv * *xv as f64;
                                mag += (wv * *xv as f64).abs();
                                bound += wv.abs() * dx * 0.505;
                            }
                        }
                        let err = (yq[tk * rows + r] as f64 - dot).abs();
                        assert!(
                            err <= bound + 1e-5 * mag,
                            "{} dp4a {rows}x{cols}: token {tk} row {r}: gpu {} vs {dot} (bound {bound:.2e})",
                            t.name(),
                            yq[tk * rows + r]
                        );
                        worst_q = worst_q.max(err / mag.max(1e-30));
                    }
                }
                eprintln!(
                    "{} {rows}x{cols} dp4a (8-bit activations): worst |Δ|/Σ|wx| {worst_q:.1e}",
                    t.name()
                );
            }
            let ids = [3u32, 0, (rows - 1) as u32];
            let e = check::embed(t, w, rows, cols, &ids).unwrap();
            for (i, &id) in ids.iter().enumerate() {
                for c in 0..cols {
                    let (g, r) = (e[i * cols + c], refw[id as usize * cols + c]);
                    assert!(
                        (g - r).abs() <= 1e-6 * r.abs() + 1e-30,
                        "{} embed row {id} col {c}: gpu {g} vs gguf {r}",
                        t.name()
                    );
                }
            }
            eprintln!("{} {rows}x{cols}: worst |Δ|/Σ|wx| {worst:.1e}", t.name());
        }
    }
}

/// A sequence state and, when it runs there, the CUDA backend beside it (declared first: it
/// stages from, and registered, the state's RAM expert cache, so it is dropped first).
struct Run {
    g: Option<GpuState>,
    st: State,
}

impl Run {
    /// The device (None: the CPU) and the state, for `Model::*_on`.
    fn parts(&mut self) -> (Option<&mut dyn Device>, &mut State) {
        (self.g.as_mut().map(|g| g as &mut dyn Device), &mut self.st)
    }
}

/// A state with a RAM expert cache of `ram_slots` per layer, on the GPU when `gpu` is given.
fn state(
    model: &Model<'_>,
    files: &ModelFiles,
    batch: usize,
    ram_slots: usize,
    gpu: Option<&GpuOptions>,
) -> (Run, u64) {
    let mut st = model.new_state(256, batch, batch).unwrap();
    let mut slot = 0;
    let mut dev = None;
    if let Some(opts) = gpu {
        let mut cfg = CacheConfig::new(ram_slots);
        cfg.io = sluice::experts::IoMode::Buffered;
        st.attach_experts(model.expert_cache(files, cfg).unwrap());
        let (g, sum) = GpuState::attach(model, &st, opts).unwrap();
        slot = sum.slot_bytes
            * model
                .weights
                .layers
                .iter()
                .filter(|l| l.moe().is_some())
                .count() as u64;
        dev = Some(g);
    }
    (Run { g: dev, st }, slot)
}

fn opts(vram: Option<u64>, staging: Staging) -> GpuOptions {
    GpuOptions {
        vram,
        staging,
        pinned: Vec::new(),
    }
}

fn load(path: &Path) -> (ModelFiles, LoadOptions) {
    (
        ModelFiles::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        LoadOptions {
            kv: sluice::model::KvTypes::F32,
            threads: 2,
            ctx: 256,
        },
    )
}

#[test]
fn gpu_logits_match_transformers() {
    if !gpu_or_skip("gpu_logits_match_transformers") {
        return;
    }
    let mut paths: Vec<(String, PathBuf, PathBuf)> = Vec::new();
    for f in FAMILIES {
        let d = root().join("tests/fixtures/models").join(f);
        paths.push((format!("{f} gguf f32"), d.join("model-f32.gguf"), d.clone()));
        paths.push((format!("{f} safetensors"), d.clone(), d.clone()));
    }
    let d32 = root().join("tests/fixtures/models/deepseek_v32");
    paths.push(("deepseek_v32 safetensors".into(), d32.clone(), d32));
    for v in VARIANTS {
        let d = root().join("tests/fixtures/models").join(v);
        paths.push((format!("{v} safetensors"), d.clone(), d));
    }
    for f in HYBRID {
        let d = root().join("tests/fixtures/models").join(f);
        paths.push((format!("{f} safetensors"), d.clone(), d.clone()));
        paths.push((format!("{f} gguf f32"), hybrid_gguf(f), d));
    }
    let oss = root().join("tests/fixtures/models/gpt_oss");
    for e in ["f32", "mxfp4"] {
        paths.push((
            format!("gpt_oss gguf {e} experts"),
            gptoss_gguf(e),
            oss.clone(),
        ));
    }
    for (what, path, d) in paths {
        let (files, lo) = load(&path);
        let model = Model::load(&files, &lo).unwrap();
        let cases = json(&d.join("cases.json"));
        for case in cases["cases"].as_array().unwrap() {
            let toks = ids(&case["ids"]);
            let (_, refr) =
                sluice::npy::read_f32(&d.join(case["logits"].as_str().unwrap())).unwrap();
            for batch in [1, 5, 16] {
                let e = model.cfg.n_experts;
                let (mut r, _) = state(&model, &files, batch, e, Some(&opts(None, Staging::Arena)));
                let mut out = Vec::new();
                let (d, st) = r.parts();
                model.logits_all_on(d, st, &toks, &mut out).unwrap();
                let (err, same) = compare(&out, &refr, model.cfg.vocab);
                eprintln!(
                    "{what} {} batch {batch}: gpu max|Δ|/max|ref| = {err:.2e}",
                    case["name"]
                );
                assert!(
                    err <= 1e-4,
                    "{what} {}: gpu max|Δ|/max|ref| = {err:.2e}",
                    case["name"]
                );
                assert!(
                    same,
                    "{what} {}: gpu argmax differs from transformers",
                    case["name"]
                );
            }
        }
    }
}

#[test]
fn gpu_q8_0_close_to_cpu() {
    if !gpu_or_skip("gpu_q8_0_close_to_cpu") {
        return;
    }
    for f in FAMILIES {
        let d = root().join("tests/fixtures/models").join(f);
        let (files, lo) = load(&d.join("model-q8_0.gguf"));
        let model = Model::load(&files, &lo).unwrap();
        let cases = json(&d.join("cases.json"));
        let (mut agree, mut total, mut worst_kl) = (0, 0, 0f64);
        for case in cases["cases"].as_array().unwrap() {
            let toks = ids(&case["ids"]);
            let (mut cpu_run, _) = state(&model, &files, 8, 0, None);
            let mut cpu = Vec::new();
            model.logits_all(&mut cpu_run.st, &toks, &mut cpu).unwrap();
            let (mut r, _) = state(
                &model,
                &files,
                8,
                model.cfg.n_experts,
                Some(&opts(None, Staging::Arena)),
            );
            let mut gpu = Vec::new();
            let (d, st) = r.parts();
            model.logits_all_on(d, st, &toks, &mut gpu).unwrap();
            let v = model.cfg.vocab;
            for (a, b) in gpu.chunks(v).zip(cpu.chunks(v)) {
                let lse = |x: &[f32]| {
                    let m = x.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v)) as f64;
                    m + x.iter().map(|v| (*v as f64 - m).exp()).sum::<f64>().ln()
                };
                let (la, lb) = (lse(a), lse(b));
                let kl: f64 = a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| {
                        let (lp, lq) = (*y as f64 - lb, *x as f64 - la);
                        lp.exp() * (lp - lq)
                    })
                    .sum();
                worst_kl = worst_kl.max(kl);
                agree += usize::from(argmax(a) == argmax(b));
                total += 1;
            }
        }
        eprintln!("{f} q8_0 gpu vs cpu: worst KL {worst_kl:.2e}, top-1 {agree}/{total}");
        assert!(worst_kl < 0.02, "{f} q8_0: KL {worst_kl}");
        assert!(agree * 10 >= total * 9, "{f} q8_0: top-1 {agree}/{total}");
    }
}

/// Greedy tokens and every step's logits.
fn greedy(model: &Model<'_>, r: &mut Run, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let mut logits = Vec::new();
    let (d, st) = r.parts();
    let l = model.feed_on(d, st, prompt).unwrap();
    logits.extend_from_slice(l);
    let mut next = argmax(l) as u32;
    let mut toks = vec![next];
    while toks.len() < n {
        let (d, st) = r.parts();
        let l = model.forward_on(d, st, &[next], 0).unwrap();
        logits.extend_from_slice(l);
        next = argmax(l) as u32;
        toks.push(next);
    }
    (toks, logits)
}

#[test]
fn gpu_tokens_identical_across_placement() {
    if !gpu_or_skip("gpu_tokens_identical_across_placement") {
        return;
    }
    let default = sluice::default_model::ensure_random().unwrap();
    let mut models = vec![default];
    for f in ["qwen3_moe", "deepseek_v3", "glm4_moe"] {
        models.push(
            root()
                .join("tests/fixtures/models")
                .join(f)
                .join("model-q8_0.gguf"),
        );
    }
    // gpt-oss: sinks, a window of 4 over 31 positions, biased clamped-SwiGLU MXFP4 experts.
    models.push(gptoss_gguf("mxfp4"));
    // Qwen3.5-MoE: recurrent DeltaNet state across the chunks, the gated shared expert.
    models.push(hybrid_gguf("qwen3_5_moe"));
    for path in models {
        let (files, lo) = load(&path);
        let model = Model::load(&files, &lo).unwrap();
        let e = model.cfg.n_experts;
        let prompt: Vec<u32> = (0..11)
            .map(|i| (i * 7 + 3) as u32 % model.cfg.vocab as u32)
            .collect();
        let (mut r, per_slot) = state(&model, &files, 4, e, Some(&opts(None, Staging::Arena)));
        let (want_t, want_l) = greedy(&model, &mut r, &prompt, 20);
        drop(r);
        let per_slot = per_slot.max(1);
        let mut runs = 0;
        for slots in [1, 2, e] {
            for staging in [Staging::Arena, Staging::PerExpert, Staging::Pageable] {
                for ram in [1, e] {
                    let o = opts(Some(per_slot * slots as u64), staging);
                    let (mut r, _) = state(&model, &files, 4, ram, Some(&o));
                    let (t, l) = greedy(&model, &mut r, &prompt, 20);
                    let what = format!(
                        "{}: vram {slots} slots/layer, {staging}, ram {ram} slots/layer",
                        path.display()
                    );
                    assert_eq!(t, want_t, "{what}: tokens differ");
                    assert!(
                        l.iter()
                            .zip(&want_l)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: logits not bit-identical"
                    );
                    let s = r.g.as_ref().unwrap().stats();
                    if slots == 1 {
                        assert!(s.experts_h2d > 0, "{what}: nothing was staged");
                    }
                    runs += 1;
                }
            }
        }
        eprintln!(
            "{}: {runs} placements, identical tokens and logits",
            path.display()
        );
    }
}

/// `--gpu-experts hybrid`: pool misses computed on the CPU (gpu/split.rs) give the all-GPU
/// run's temp-0 tokens, and logits within 1e-4 of its largest (the CPU's and the GPU's
/// products of an expert differ in f32 summation order only): f32 and Q8_0 fixture GGUFs,
/// pools of 1 and 2 slots a layer (the first misses of a layer fill the pool, the rest run on
/// the CPU), misses of at most 1 token or of any count on the CPU, batch 4 (prefill chunks
/// of 4 tokens, then decode steps).
#[test]
fn gpu_hybrid_experts_match_all_gpu() {
    if !gpu_or_skip("gpu_hybrid_experts_match_all_gpu") {
        return;
    }
    let mut failed = Vec::new();
    for f in ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe"] {
        for file in ["model-f32.gguf", "model-q8_0.gguf"] {
            let path = root().join("tests/fixtures/models").join(f).join(file);
            let (files, lo) = load(&path);
            let model = Model::load(&files, &lo).unwrap();
            let e = model.cfg.n_experts;
            let v = model.cfg.vocab;
            let prompt: Vec<u32> = (0..11).map(|i| (i * 7 + 3) as u32 % v as u32).collect();
            let (mut r, per_slot) = state(&model, &files, 4, e, Some(&opts(None, Staging::Arena)));
            let (want_t, want_l) = greedy(&model, &mut r, &prompt, 20);
            drop(r);
            for slots in [1, 2] {
                for cpu_max in [1, 64] {
                    let o = opts(Some(per_slot.max(1) * slots), Staging::Arena);
                    let (mut r, _) = state(&model, &files, 4, e, Some(&o));
                    r.g.as_mut()
                        .unwrap()
                        .set_cpu_misses(&model, Some(cpu_max))
                        .unwrap();
                    let (t, l) = greedy(&model, &mut r, &prompt, 20);
                    let (err, same) = compare(&l, &want_l, v);
                    let cpu = r.g.as_ref().unwrap().stats().experts_cpu;
                    let what = format!(
                        "{f} {file}: {slots} slots/layer, misses of <= {cpu_max} tokens on the CPU"
                    );
                    eprintln!(
                        "{what}: {cpu} experts on the CPU, max|Δ|/max|all-GPU| = {err:.2e}, tokens {}",
                        if t == want_t { "identical" } else { "DIFFER" }
                    );
                    if cpu == 0 {
                        failed.push(format!("{what}: no expert ran on the CPU"));
                    }
                    if t != want_t || !same || err > 1e-4 {
                        failed.push(format!("{what}: err {err:.2e}, argmax same {same}"));
                    }
                }
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// The committed PTX was made from the committed kernels.cu (scripts/build-ptx.py writes the
/// source's SHA-256 on its first line). Runs everywhere: it needs no GPU.
#[test]
fn ptx_is_built_from_this_source() {
    // kernels.cu, then every kernels_*.cu in name order: one translation unit (build-ptx.py).
    let gpu = root().join("src/gpu");
    let mut srcs: Vec<_> = std::fs::read_dir(&gpu)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy().into_owned();
            n.starts_with("kernels_") && n.ends_with(".cu")
        })
        .collect();
    srcs.sort();
    srcs.insert(0, gpu.join("kernels.cu"));
    let cat = std::process::Command::new("sh")
        .arg("-c")
        .arg("cat \"$@\" | sha256sum")
        .arg("sh")
        .args(&srcs)
        .output()
        .expect("sha256sum");
    let hash = String::from_utf8_lossy(&cat.stdout)
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_string();
    let ptx = String::from_utf8(read(&root().join("src/gpu/kernels.ptx"))).unwrap();
    let first = ptx.lines().next().unwrap_or("");
    assert_eq!(
        first,
        format!("// sluice kernels.cu sha256 {hash}"),
        "src/gpu/kernels.ptx is stale: run scripts/build-ptx.py"
    );
}

/// DSA past its index_topk at length: DeepSeek-V3.2 and GLM-5 (index_topk 4) over 1100 tokens,
/// the GPU (prefill in chunks of 64, and every token a captured decode step) against the CPU
/// forward (itself matched to transformers in tests/model_v32.rs, model_glmdsa.rs): the
/// indexer's scores span many blocks and its select several passes of 1024 positions. Bound
/// as the transformers comparisons (max|Δ|/max|ref| <= 1e-4, same argmax at every position);
/// a near tie in the index scores could flip one selection, so the worst position is printed.
#[test]
fn gpu_dsa_long_context_matches_cpu() {
    if !gpu_or_skip("gpu_dsa_long_context_matches_cpu") {
        return;
    }
    let ctx = 1200;
    for v in ["deepseek_v32_sparse", "glm_moe_dsa"] {
        let d = root().join("tests/fixtures/models").join(v);
        let files = ModelFiles::open(&d).unwrap();
        let lo = LoadOptions {
            kv: sluice::model::KvTypes::F32,
            threads: 2,
            ctx,
        };
        let model = Model::load(&files, &lo).unwrap();
        let vocab = model.cfg.vocab;
        let mut r = lcg(7);
        let toks: Vec<u32> = (0..1100)
            .map(|_| ((r() * 0.5 + 0.5) * (vocab - 1) as f32) as u32)
            .collect();
        let mut cpu_st = model.new_state(ctx, 64, 64).unwrap();
        let mut cpu = Vec::new();
        model.logits_all(&mut cpu_st, &toks, &mut cpu).unwrap();
        for batch in [64, 1] {
            let mut st = model.new_state(ctx, batch, batch).unwrap();
            let mut cfg = CacheConfig::new(model.cfg.n_experts);
            cfg.io = sluice::experts::IoMode::Buffered;
            st.attach_experts(model.expert_cache(&files, cfg).unwrap());
            let (mut g, _) = GpuState::attach(&model, &st, &opts(None, Staging::Arena)).unwrap();
            let mut gpu = Vec::new();
            model
                .logits_all_on(Some(&mut g as &mut dyn Device), &mut st, &toks, &mut gpu)
                .unwrap();
            let (mut worst, mut at, mut flips) = (0f32, 0, 0);
            for (i, (a, b)) in gpu.chunks(vocab).zip(cpu.chunks(vocab)).enumerate() {
                let (e, same) = compare(a, b, vocab);
                if e > worst {
                    (worst, at) = (e, i);
                }
                flips += usize::from(!same);
            }
            eprintln!(
                "{v} {} tokens, batch {batch}: gpu vs cpu worst max|Δ|/max|ref| = {worst:.2e} at position {at}, {flips} argmax differences",
                toks.len()
            );
            assert!(
                worst <= 1e-4 && flips == 0,
                "{v} batch {batch}: worst {worst:.2e} at {at}, {flips} argmax differences"
            );
        }
    }
}

/// gpt-oss's 16 greedy tokens on the GPU are transformers' (`greedy.json`: argmax of a full
/// recompute per step), prompt prefilled in chunks of 5, then one decode step per token.
#[test]
fn gpu_gptoss_greedy_matches_transformers() {
    if !gpu_or_skip("gpu_gptoss_greedy_matches_transformers") {
        return;
    }
    let g = json(&root().join("tests/fixtures/models/gpt_oss/greedy.json"));
    let (prompt, want) = (ids(&g["prompt_ids"]), ids(&g["new_ids"]));
    for e in ["f32", "mxfp4"] {
        let path = gptoss_gguf(e);
        let (files, lo) = load(&path);
        let model = Model::load(&files, &lo).unwrap();
        let ne = model.cfg.n_experts;
        let (mut r, _) = state(&model, &files, 5, ne, Some(&opts(None, Staging::Arena)));
        let (toks, _) = greedy(&model, &mut r, &prompt, want.len());
        assert_eq!(toks, want, "gpt_oss {e} experts: GPU greedy tokens");
        eprintln!("gpt_oss {e} experts: 16 greedy tokens identical to transformers");
    }
}

/// Qwen3-Next / Qwen3.5-MoE's 16 greedy tokens on the GPU are transformers' (`cases.json`
/// "greedy"), safetensors and llama.cpp's GGUF, prompt prefilled in chunks of 5 (the recurrent
/// state carried across them), then one captured decode step per token.
#[test]
fn gpu_hybrid_greedy_matches_transformers() {
    if !gpu_or_skip("gpu_hybrid_greedy_matches_transformers") {
        return;
    }
    for f in HYBRID {
        let d = root().join("tests/fixtures/models").join(f);
        let g = &json(&d.join("cases.json"))["greedy"];
        let (prompt, want) = (ids(&g["prompt_ids"]), ids(&g["tokens"]));
        for (what, path) in [("safetensors", d.clone()), ("gguf", hybrid_gguf(f))] {
            let (files, lo) = load(&path);
            let model = Model::load(&files, &lo).unwrap();
            let ne = model.cfg.n_experts;
            let (mut r, _) = state(&model, &files, 5, ne, Some(&opts(None, Staging::Arena)));
            let (toks, _) = greedy(&model, &mut r, &prompt, want.len());
            assert_eq!(toks, want, "{f} {what}: GPU greedy tokens");
            eprintln!(
                "{f} {what}: {} greedy tokens identical to transformers",
                want.len()
            );
        }
    }
}

/// The hybrid families at length: 1100 tokens of logits, the GPU (prefill in chunks of 64, and
/// every token a captured decode step) against the CPU forward (itself matched to transformers
/// in tests/family_qwen3next.rs), then 200 greedy tokens after a 40-token prompt, GPU against
/// CPU: the recurrent and conv states carried over many chunks and decode steps. Bound as the
/// transformers comparisons (max|Δ|/max|ref| <= 1e-4, same argmax at every position); the
/// greedy tokens identical.
#[test]
fn gpu_hybrid_long_run_matches_cpu() {
    if !gpu_or_skip("gpu_hybrid_long_run_matches_cpu") {
        return;
    }
    let ctx = 1200;
    for f in HYBRID {
        let d = root().join("tests/fixtures/models").join(f);
        let files = ModelFiles::open(&d).unwrap();
        let lo = LoadOptions {
            kv: sluice::model::KvTypes::F32,
            threads: 2,
            ctx,
        };
        let model = Model::load(&files, &lo).unwrap();
        let vocab = model.cfg.vocab;
        let mut r = lcg(11);
        let toks: Vec<u32> = (0..1100)
            .map(|_| ((r() * 0.5 + 0.5) * (vocab - 1) as f32) as u32)
            .collect();
        let mut cpu_st = model.new_state(ctx, 64, 64).unwrap();
        let mut cpu = Vec::new();
        model.logits_all(&mut cpu_st, &toks, &mut cpu).unwrap();
        let gpu_state = |batch: usize| {
            let mut st = model.new_state(ctx, batch, batch).unwrap();
            let mut cfg = CacheConfig::new(model.cfg.n_experts);
            cfg.io = sluice::experts::IoMode::Buffered;
            st.attach_experts(model.expert_cache(&files, cfg).unwrap());
            let (g, _) = GpuState::attach(&model, &st, &opts(None, Staging::Arena)).unwrap();
            Run { g: Some(g), st }
        };
        for batch in [64, 1] {
            let mut run = gpu_state(batch);
            let mut gpu = Vec::new();
            let (dev, st) = run.parts();
            model.logits_all_on(dev, st, &toks, &mut gpu).unwrap();
            let (mut worst, mut at, mut flips) = (0f32, 0, 0);
            for (i, (a, b)) in gpu.chunks(vocab).zip(cpu.chunks(vocab)).enumerate() {
                let (e, same) = compare(a, b, vocab);
                if e > worst {
                    (worst, at) = (e, i);
                }
                flips += usize::from(!same);
            }
            eprintln!(
                "{f} {} tokens, batch {batch}: gpu vs cpu worst max|Δ|/max|ref| = {worst:.2e} at position {at}, {flips} argmax differences",
                toks.len()
            );
            assert!(
                worst <= 1e-4 && flips == 0,
                "{f} batch {batch}: worst {worst:.2e} at {at}, {flips} argmax differences"
            );
        }
        let prompt = &toks[..40];
        let (mut cpu_run, _) = state(&model, &files, 16, 0, None);
        let (want, _) = greedy(&model, &mut cpu_run, prompt, 200);
        let mut run = gpu_state(16);
        let (got, _) = greedy(&model, &mut run, prompt, 200);
        let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        eprintln!("{f}: 200 greedy tokens, GPU and CPU agree on the first {same}");
        assert_eq!(got, want, "{f}: GPU greedy tokens differ from the CPU's");
    }
}

/// The device's recurrent state follows the CPU's rule: truncating a hybrid sequence below its
/// end restarts it (`State::truncate` returns 0) and the chunk at position 0 zeroes the state on
/// the device, so a prompt fed after another sequence's tokens gives a fresh run's logits, bit
/// for bit (chunks of 5, then decode steps through the captured graph).
#[test]
fn gpu_hybrid_truncate_restarts_from_a_zero_state() {
    if !gpu_or_skip("gpu_hybrid_truncate_restarts_from_a_zero_state") {
        return;
    }
    for f in HYBRID {
        let d = root().join("tests/fixtures/models").join(f);
        let (files, lo) = load(&d);
        let model = Model::load(&files, &lo).unwrap();
        let ne = model.cfg.n_experts;
        let prompt: Vec<u32> = (0..23).map(|i| (i * 13 + 5) % 300).collect();
        let other: Vec<u32> = (0..17).map(|i| (i * 7 + 2) % 300).collect();
        let (mut fresh, _) = state(&model, &files, 5, ne, Some(&opts(None, Staging::Arena)));
        let (want_t, want_l) = greedy(&model, &mut fresh, &prompt, 8);
        let (mut r, _) = state(&model, &files, 5, ne, Some(&opts(None, Staging::Arena)));
        greedy(&model, &mut r, &other, 6);
        assert_eq!(r.st.truncate(9), 0, "{f}: a recurrent state restarts");
        let (t, l) = greedy(&model, &mut r, &prompt, 8);
        assert_eq!(t, want_t, "{f}: tokens after the restart");
        assert!(
            l.iter()
                .zip(&want_l)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{f}: logits after the restart differ from a fresh run's"
        );
        eprintln!("{f}: truncate restarts from a zero state on the device (bit-identical)");
    }
}

/// DeepSeek-V4 runs on the device (gpu/v4.rs): `gpu::refusal` passes it, so nothing is left
/// that a fixture family is refused for (the hybrid shapes past the kernels are refused by name:
/// gpu/mod.rs's unit test).
#[test]
fn gpu_refuses_no_fixture_family() {
    let (files, lo) = load(&root().join("tests/fixtures/models/deepseek_v4"));
    let model = Model::load(&files, &lo).unwrap();
    assert_eq!(sluice::gpu::refusal(&model.cfg, 64), None);
}

/// The DeepSeek-V4 fixture as a `deepseek4` GGUF (scripts/deepseek_v4_to_gguf.py; `experts`:
/// "f32", or "mxfp4" / "mxfp4-f32" for MXFP4 experts and their F32 twin).
fn v4_gguf(experts: &str) -> PathBuf {
    let args: &[&str] = match experts {
        "f32" => &[],
        e => &["--experts", e],
    };
    fixture_gguf(
        "deepseek_v4",
        "scripts/deepseek_v4_to_gguf.py",
        &format!("deepseek_v4-{experts}.gguf"),
        args,
    )
}

/// A DeepSeek-V4 model's sequence on the device (experts resident in VRAM, uploaded at attach).
fn v4_gpu(model: &Model<'_>, files: &ModelFiles, ctx: usize, batch: usize) -> Run {
    let mut st = model.new_state(ctx, batch, batch).unwrap();
    let mut cfg = CacheConfig::new(model.cfg.n_experts);
    cfg.io = sluice::experts::IoMode::Buffered;
    st.attach_experts(model.expert_cache(files, cfg).unwrap());
    let (g, _) = GpuState::attach(model, &st, &opts(None, Staging::Arena)).unwrap();
    Run { g: Some(g), st }
}

/// DeepSeek-V4 (gpu/v4.rs: hyper-connection streams, sliding / CSA with the lightning indexer
/// past index_topk / HCA attention with sinks, hash and biased top-k routing, the clamped
/// SwiGLU) against transformers, safetensors and llama.cpp's GGUF: logits of every case with
/// batches 1 (each token a decode step: the captured graph), 5 and 16 within the bound, and the
/// 16 greedy tokens (prompt in chunks of 5, then decode steps) identical.
#[test]
fn gpu_deepseek_v4_matches_transformers() {
    if !gpu_or_skip("gpu_deepseek_v4_matches_transformers") {
        return;
    }
    let d = root().join("tests/fixtures/models/deepseek_v4");
    let g = json(&d.join("greedy.json"));
    let (prompt, want) = (ids(&g["prompt_ids"]), ids(&g["tokens"]));
    for (what, path) in [("safetensors", d.clone()), ("gguf f32", v4_gguf("f32"))] {
        let (files, lo) = load(&path);
        let model = Model::load(&files, &lo).unwrap();
        for case in json(&d.join("cases.json"))["cases"].as_array().unwrap() {
            let toks = ids(&case["ids"]);
            let (_, refr) =
                sluice::npy::read_f32(&d.join(case["logits"].as_str().unwrap())).unwrap();
            for batch in [1, 5, 16] {
                let mut r = v4_gpu(&model, &files, 64, batch);
                let mut out = Vec::new();
                let (dev, st) = r.parts();
                model.logits_all_on(dev, st, &toks, &mut out).unwrap();
                let (err, same) = compare(&out, &refr, model.cfg.vocab);
                eprintln!(
                    "deepseek_v4 {what} {} batch {batch}: gpu max|Δ|/max|ref| = {err:.2e}",
                    case["name"]
                );
                assert!(
                    err <= 1e-4,
                    "deepseek_v4 {what} {}: {err:.2e}",
                    case["name"]
                );
                assert!(same, "deepseek_v4 {what} {}: argmax differs", case["name"]);
            }
        }
        let mut r = v4_gpu(&model, &files, 64, 5);
        let (toks, _) = greedy(&model, &mut r, &prompt, want.len());
        assert_eq!(toks, want, "deepseek_v4 {what}: GPU greedy tokens");
        eprintln!(
            "deepseek_v4 {what}: {} greedy tokens identical to transformers",
            want.len()
        );
    }
}

/// DeepSeek-V4 at length: 240 tokens of logits (every window kind closing many times, the
/// indexer choosing 2 of up to 60 entries), the GPU (prefill in chunks of 64, and every token a
/// captured decode step) against the CPU forward (matched to transformers in
/// tests/family_deepseek_v4.rs), same bound, no argmax difference; then 100 greedy tokens after a
/// 40-token prompt, GPU and CPU identical.
#[test]
fn gpu_deepseek_v4_long_run_matches_cpu() {
    if !gpu_or_skip("gpu_deepseek_v4_long_run_matches_cpu") {
        return;
    }
    let ctx = 256;
    let d = root().join("tests/fixtures/models/deepseek_v4");
    let files = ModelFiles::open(&d).unwrap();
    let model = Model::load(
        &files,
        &LoadOptions {
            kv: sluice::model::KvTypes::F32,
            threads: 2,
            ctx,
        },
    )
    .unwrap();
    let vocab = model.cfg.vocab;
    let mut r = lcg(7);
    let toks: Vec<u32> = (0..240)
        .map(|_| ((r() * 0.5 + 0.5) * (vocab - 1) as f32) as u32)
        .collect();
    let mut cpu_st = model.new_state(ctx, 64, 64).unwrap();
    let mut cpu = Vec::new();
    model.logits_all(&mut cpu_st, &toks, &mut cpu).unwrap();
    for batch in [64, 1] {
        let mut run = v4_gpu(&model, &files, ctx, batch);
        let mut gpu = Vec::new();
        let (dev, st) = run.parts();
        model.logits_all_on(dev, st, &toks, &mut gpu).unwrap();
        let (mut worst, mut at, mut flips) = (0f32, 0, 0);
        for (i, (a, b)) in gpu.chunks(vocab).zip(cpu.chunks(vocab)).enumerate() {
            let (e, same) = compare(a, b, vocab);
            if e > worst {
                (worst, at) = (e, i);
            }
            flips += usize::from(!same);
        }
        eprintln!(
            "deepseek_v4 {} tokens, batch {batch}: gpu vs cpu worst max|Δ|/max|ref| = {worst:.2e} at position {at}, {flips} argmax differences",
            toks.len()
        );
        assert!(
            worst <= 1e-4 && flips == 0,
            "deepseek_v4 batch {batch}: worst {worst:.2e} at {at}, {flips} argmax differences"
        );
    }
    let prompt = &toks[..40];
    let (mut cpu_run, _) = state(&model, &files, 16, 0, None);
    let (want, _) = greedy(&model, &mut cpu_run, prompt, 100);
    let mut run = v4_gpu(&model, &files, ctx, 16);
    let (got, _) = greedy(&model, &mut run, prompt, 100);
    let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
    eprintln!("deepseek_v4: 100 greedy tokens, GPU and CPU agree on the first {same}");
    assert_eq!(
        got, want,
        "deepseek_v4: GPU greedy tokens differ from the CPU's"
    );
}

/// DeepSeek-V4's MXFP4 experts (what llama.cpp's converter writes, and the synth preset's) on
/// the device against their F32 twin (the same rounded values as F32): the device's expert
/// kernels take f32 activations, so the two agree to the bound, same argmax.
#[test]
fn gpu_deepseek_v4_mxfp4_experts_match_their_f32_twin() {
    if !gpu_or_skip("gpu_deepseek_v4_mxfp4_experts_match_their_f32_twin") {
        return;
    }
    let d = root().join("tests/fixtures/models/deepseek_v4");
    let case = &json(&d.join("cases.json"))["cases"][2];
    let toks = ids(&case["ids"]);
    let logits = |path: PathBuf| {
        let (files, lo) = load(&path);
        let model = Model::load(&files, &lo).unwrap();
        let mut r = v4_gpu(&model, &files, 64, 8);
        let mut out = Vec::new();
        let (dev, st) = r.parts();
        model.logits_all_on(dev, st, &toks, &mut out).unwrap();
        (out, model.cfg.vocab)
    };
    let (mx, vocab) = logits(v4_gguf("mxfp4"));
    let (twin, _) = logits(v4_gguf("mxfp4-f32"));
    let (err, same) = compare(&mx, &twin, vocab);
    eprintln!(
        "deepseek_v4 GGUF MXFP4 experts vs their F32 twin on the GPU: max|Δ|/max|ref| = {err:.2e}"
    );
    assert!(
        same && err <= 1e-4,
        "MXFP4 experts on the GPU: {err:.2e}, same argmax {same}"
    );
}

/// Causal attention in f64: token t of `n` (at position pos0 + t) over keys and values
/// 0 ..= pos0 + t, rows of heads x d and kvh x d, scale 1/sqrt(d); the n x heads x d output.
#[allow(clippy::too_many_arguments)]
fn attention_f64(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    pos0: usize,
    heads: usize,
    kvh: usize,
    d: usize,
) -> Vec<f64> {
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0f64; n * heads * d];
    for t in 0..n {
        for h in 0..heads {
            let g = h / (heads / kvh);
            let qr = &q[(t * heads + h) * d..][..d];
            let s: Vec<f64> = (0..=pos0 + t)
                .map(|j| {
                    let kr = &k[(j * kvh + g) * d..][..d];
                    let dot: f64 = qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum();
                    dot * scale
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = s.iter().map(|&x| (x - m).exp()).collect();
            let l: f64 = p.iter().sum();
            for c in 0..d {
                let a: f64 = p
                    .iter()
                    .enumerate()
                    .map(|(j, &pj)| pj * v[(j * kvh + g) * d + c] as f64)
                    .sum();
                out[(t * heads + h) * d + c] = a / l;
            }
        }
    }
    out
}

/// max|have - want| and max|want|.
fn worst_of(have: &[f32], want: &[f64]) -> (f64, f64) {
    have.iter()
        .zip(want)
        .fold((0f64, 0f64), |(w, t), (&h, &x)| {
            (w.max((h as f64 - x).abs()), t.max(x.abs()))
        })
}

/// Random queries, and keys and values that are f16 numbers (an f16 cache's).
fn qkv_f16(seed: u64, nq: usize, nkv: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut r = lcg(seed);
    let f16 = |x: f32| half::f16::from_f32(x).to_f32();
    let q: Vec<f32> = (0..nq).map(|_| 2.0 * r()).collect();
    let k: Vec<f32> = (0..nkv).map(|_| f16(2.0 * r())).collect();
    let v: Vec<f32> = (0..nkv).map(|_| f16(r())).collect();
    (q, k, v)
}

/// Tensor-core prompt attention (`attention_mma_<d>`, an f16 cache) against attention computed
/// here in f64 from the same f16 keys and values: 100 queries at positions 150.. (causal, so
/// full, partial and masked key tiles), 8 query heads over 2 key/value heads, every head size
/// it is built for, over a cache of f32 words and one stored as f16 (`attention_mma_h_<d>`).
/// What the kernel rounds (each query and each probability to f16, as
/// llama.cpp's flash attention) stays within 1e-2 of max|ref|; a fragment-layout mistake is
/// off by the order of the values themselves.
#[test]
fn gpu_tensor_core_attention_matches_f64() {
    if !gpu_or_skip("gpu_tensor_core_attention_matches_f64") {
        return;
    }
    let (n, pos0, heads, kvh) = (100usize, 150usize, 8usize, 2usize);
    for half in [false, true] {
        for d in [16usize, 32, 64, 128] {
            let (q, k, v) = qkv_f16(d as u64, n * heads * d, (pos0 + n) * kvh * d);
            let got = check::attention_mma(&q, &k, &v, n, pos0, heads, kvh, d, half).unwrap();
            let want = attention_f64(&q, &k, &v, n, pos0, heads, kvh, d);
            let (worst, top) = worst_of(&got, &want);
            eprintln!("attention_mma_{d} (f16 storage {half}): max|Δ| = {worst:.2e}, max|ref| = {top:.2e}");
            assert!(
                worst <= 1e-2 * top,
                "attention_mma_{d} (f16 storage {half}): max|Δ| {worst:.2e} against max|ref| {top:.2e}"
            );
        }
    }
}

/// Tensor-core flash-decoding (`attention_mma_dec_<d>`: a key/value head's query heads as the
/// rows, 16 keys per warp, the warps' and the splits' partials merged) against f64 attention:
/// 3 tokens at lengths from 1 (one key: a single warp of a single split) through part-filled
/// and empty splits to 3000 keys over 16 splits, groups of 16, 8, 4 and 1 query heads, both
/// head sizes, a cache of f32 words and one stored as f16 (`attention_mma_dec_h_<d>`); within
/// 1e-2 of max|ref| (queries and probabilities rounded to f16).
#[test]
fn gpu_tensor_core_decode_attention_matches_f64() {
    if !gpu_or_skip("gpu_tensor_core_decode_attention_matches_f64") {
        return;
    }
    let n = 3;
    for (d, half) in [(64usize, false), (128, false), (64, true), (128, true)] {
        for (heads, kvh) in [(16usize, 1usize), (32, 4), (8, 2), (2, 2)] {
            for pos0 in [0usize, 13, 100, 700, 2997] {
                let (q, k, v) = qkv_f16(
                    (d + heads + pos0) as u64,
                    n * heads * d,
                    (pos0 + n) * kvh * d,
                );
                let want = attention_f64(&q, &k, &v, n, pos0, heads, kvh, d);
                // 16 splits of up to 256 keys, the kernel's most: 128 of 64, and 128 of at
                // least 128 from 2048 positions on (as the decode default from 4096: fewer
                // splits than the grid has).
                for sp in [(16usize, 256usize, 64usize), (128, 64, 64), (128, 64, 128)] {
                    let (splits, _, minc) = sp;
                    let got =
                        check::attention_mma_dec(&q, &k, &v, n, pos0, heads, kvh, d, sp, half)
                            .unwrap();
                    let (worst, top) = worst_of(&got, &want);
                    assert!(
                        worst <= 1e-2 * top,
                        "attention_mma_dec_{d} (f16 storage {half}), {heads} heads over {kvh}, position {pos0}, {splits} splits of >= {minc}: max|Δ| {worst:.2e} against max|ref| {top:.2e}"
                    );
                }
            }
        }
        eprintln!("attention_mma_dec_{d} (f16 storage {half}): within 1e-2 of max|ref| everywhere");
    }
}

/// An f16 KV cache on the GPU holds the numbers the CPU's f16 cache holds: 300 tokens of
/// logits with `-ctk f16 -ctv f16` on both, one token per forward (decode kernels, f32
/// arithmetic over the rounded values: within the f32 bound, 1e-4 of max|ref|, same argmax
/// everywhere) and in chunks of 64 (the same with `SLUICE_GPU_ATT_MMA=0`: `attention_tiled`).
/// Prompts take the tensor cores by default, and flash-decoding does with
/// `SLUICE_GPU_ATT_MMA_DEC=1` or where the cache is stored as f16 (the default where the
/// tensor-core kernels serve every step: `kv_half_storage`); they round each query and probability to
/// f16: within 1e-2, argmax differences at no more than 2% of positions of these tiny random
/// models, whose top logits nearly tie).
#[test]
fn gpu_f16_cache_matches_cpu_f16_cache() {
    if !gpu_or_skip("gpu_f16_cache_matches_cpu_f16_cache") {
        return;
    }
    let f16 = sluice::model::KvTypes {
        k: sluice::kernels::kv::KvType::F16,
        v: sluice::kernels::kv::KvType::F16,
    };
    let ctx = 320;
    for f in FAMILIES {
        let d = root().join("tests/fixtures/models").join(f);
        let files = ModelFiles::open(&d).unwrap();
        let lo = LoadOptions {
            kv: f16,
            threads: 2,
            ctx,
        };
        let model = Model::load(&files, &lo).unwrap();
        let vocab = model.cfg.vocab;
        let mut r = lcg(5);
        let toks: Vec<u32> = (0..300)
            .map(|_| ((r() * 0.5 + 0.5) * (vocab - 1) as f32) as u32)
            .collect();
        let mut cpu_st = model.new_state(ctx, 64, 64).unwrap();
        let mla = matches!(model.cfg.attn, sluice::model::config::AttnKind::Mla { .. });
        // An MLA cache has no value side of its own (its f32 side holds V3.2's indexer keys).
        assert_eq!(cpu_st.kv_types().k, f16.k);
        assert!(mla || cpu_st.kv_types().v == f16.v);
        let mut cpu = Vec::new();
        model.logits_all(&mut cpu_st, &toks, &mut cpu).unwrap();
        for batch in [1, 64] {
            let mut st = model.new_state(ctx, batch, batch).unwrap();
            let mut cfg = CacheConfig::new(model.cfg.n_experts);
            cfg.io = sluice::experts::IoMode::Buffered;
            st.attach_experts(model.expert_cache(&files, cfg).unwrap());
            let (g, _) = GpuState::attach(&model, &st, &opts(None, Staging::Arena)).unwrap();
            let half = g.kv_half();
            let mut run = Run { g: Some(g), st };
            let mut gpu = Vec::new();
            let (dev, st) = run.parts();
            model.logits_all_on(dev, st, &toks, &mut gpu).unwrap();
            let (mut worst, mut flips) = (0f32, 0);
            for (a, b) in gpu.chunks(vocab).zip(cpu.chunks(vocab)) {
                let (e, same) = compare(a, b, vocab);
                worst = worst.max(e);
                flips += usize::from(!same);
            }
            let env = |v: &str| std::env::var(v).ok();
            let mma = half
                || !mla
                    && (env("SLUICE_GPU_ATT_MMA").is_none_or(|v| v != "0") && batch > 8
                        || env("SLUICE_GPU_ATT_MMA_DEC").is_some_and(|v| v == "1") && batch <= 8);
            eprintln!(
                "{f} f16 cache, batch {batch}{}{}: gpu vs cpu worst max|Δ|/max|ref| = {worst:.2e}, {flips} argmax differences in {}",
                if mma { " (tensor cores)" } else { "" },
                if half { " (stored as f16)" } else { "" },
                toks.len()
            );
            if mma {
                assert!(
                    worst <= 1e-2 && flips * 50 <= toks.len(),
                    "{f} batch {batch}: worst {worst:.2e}, {flips} argmax differences"
                );
            } else {
                assert!(
                    worst <= 1e-4 && flips == 0,
                    "{f} batch {batch}: worst {worst:.2e}, {flips} argmax differences"
                );
            }
        }
    }
}
