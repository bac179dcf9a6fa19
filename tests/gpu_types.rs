//! The GPU kernels of the types added for community GGUFs (src/gpu/kernels_quants.cu: Q4_1,
//! Q5_0, Q5_1, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) against
//! the CPU kernels, whose dequantization is bit-identical to the `gguf` package.
//!
//! Built only with `--features cuda`; every test prints "skipped: ..." and passes when no CUDA
//! device answers.
//!
//! - Dequantization: the embedding kernel (a row lookup is a dequantization) on the `gguf`
//!   package's blocks (tests/fixtures/quant, and tests/fixtures/iq_grid for the grid types, whose
//!   blocks use every grid row) equals the CPU's `dequantize` bit for bit.
//! - Matrix-vector products on matrices of those blocks: the f32-activation kernel against an
//!   f64 dot of the dequantized weights (f32 rounding only: `1e-5 * sum|w x| + 1e-6`, the bound
//!   of tests/gpu.rs) and against the CPU's `matmul` (which rounds activations to 8 bits: per 32
//!   values for the 32-blocks, per 256 for the rest; bound `sum |w| (d_32 + d_256) / 2`, as
//!   tests/gpu_gemm.rs); for Q4_1, Q5_0, Q5_1, IQ4_NL and IQ4_XS also the int8-activation (dp4a)
//!   kernel and the prefill GEMM against the reference (`sum |w| d_32 / 2`) and the GEMM against
//!   the dp4a kernel (f32 order only), and the grouped expert GEMM against the expert matvec.
//! - End to end: a small random Qwen3-MoE file (`sluice synth`, F16) with every matrix
//!   re-encoded in one type (llama.cpp's names and layout; the types with a quantizer in sluice
//!   are quantized, the others get random codes with the block scale set so each matrix keeps
//!   the F16 file's RMS), run on the CPU (`--gpu off`) and on the GPU (`--gpu on`): teacher-forced
//!   logits of 64 positions (prefilled in one forward: the GEMM for the dp4a types) by mean KL
//!   (<= 1e-3) and top-1 (a flip only where the CPU's top-2 logit margin is below 0.05: the
//!   random codes make nearly flat logits, and the CPU rounds activations to 8 bits where the
//!   GPU keeps f32 or rounds per 32), and 24 greedy tokens, identical up to the first step
//!   where the CPU's margin is below 0.05 (past it the sequences are not compared).
//! - `gpu_types_bandwidth_report` (ignored: `--ignored --nocapture`) prints each GPU type's
//!   decode matvec GB/s (weight bytes per second, one token, a matrix far larger than L2)
//!   beside the device's copy bandwidth measured in the same run.

#![cfg(feature = "cuda")]

use sluice::dtype::DType;
use sluice::experts::CacheConfig;
use sluice::format::{GgufWriter, ModelFiles};
use sluice::gpu::driver::{Arg, Gpu, Stream};
use sluice::gpu::model::{check, GpuState};
use sluice::gpu::{GpuOptions, Staging};
use sluice::kernels::{self, Acts, Isa, WeightView};
use sluice::model::backend::Device;
use sluice::model::{LoadOptions, Model, State};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The types of kernels_quants.cu.
const NEW: [DType; 13] = [
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::IQ4_NL,
    DType::IQ4_XS,
    DType::TQ1_0,
    DType::TQ2_0,
    DType::IQ3_XXS,
    DType::IQ3_S,
    DType::IQ2_XS,
    DType::IQ2_S,
    DType::IQ1_S,
    DType::IQ1_M,
];

/// Those of them with dp4a kernels and the prefill GEMM.
const Q8: [DType; 5] = [
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::IQ4_NL,
    DType::IQ4_XS,
];

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
    match Gpu::open() {
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

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The `gguf` package's blocks of `t` and its dequantization of them.
fn fixture(t: DType) -> (Vec<u8>, Vec<f32>) {
    for dir in ["quant", "iq_grid"] {
        let d = root().join("tests/fixtures").join(dir);
        let b = d.join(format!("{}.blocks", t.name()));
        if b.exists() {
            return (read(&b), f32s(&read(&d.join(format!("{}.f32", t.name())))));
        }
    }
    panic!("no fixture blocks for {t}");
}

/// splitmix64.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// A `rows` x `cols` matrix of `t` made of the fixture's 256-value pieces in a row-dependent
/// order, and the CPU's dequantization of it.
fn matrix(t: DType, rows: usize, cols: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let (blocks, refv) = fixture(t);
    let piece = t.bytes_for(256).unwrap() as usize;
    let pieces = refv.len() / 256;
    let mut r = Rng(seed);
    let mut w = Vec::new();
    for _ in 0..rows * cols / 256 {
        let p = (r.next() % pieces as u64) as usize;
        w.extend_from_slice(&blocks[p * piece..(p + 1) * piece]);
    }
    let mut v = vec![0f32; rows * cols];
    kernels::dequantize(t, &w, &mut v).unwrap();
    (w, v)
}

fn activations(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed);
    (0..n)
        .map(|i| if i % 97 == 5 { 40.0 * r.f() } else { r.f() })
        .collect()
}

fn amax(x: &[f32]) -> f64 {
    x.iter().fold(0f32, |m, v| m.max(v.abs())) as f64
}

#[test]
fn gpu_dequant_is_bit_identical_to_cpu() {
    if !gpu_or_skip("gpu_dequant_is_bit_identical_to_cpu") {
        return;
    }
    let mut bad = Vec::new();
    for t in NEW {
        let (blocks, refv) = fixture(t);
        let cols = 256;
        let rows = refv.len() / cols;
        let mut cpu = vec![0f32; refv.len()];
        kernels::dequantize(t, &blocks, &mut cpu).unwrap();
        assert!(
            cpu.iter()
                .zip(&refv)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{t}: the CPU's dequantization differs from the gguf package's"
        );
        // Every row, in reverse and then again (the kernel indexes rows by token id).
        let ids: Vec<u32> = (0..rows as u32).rev().chain(0..rows as u32).collect();
        let gpu = check::embed(t, &blocks, rows, cols, &ids).unwrap();
        let mut diff = 0;
        let mut first = None;
        for (k, &id) in ids.iter().enumerate() {
            for c in 0..cols {
                let (g, e) = (gpu[k * cols + c], cpu[id as usize * cols + c]);
                if g.to_bits() != e.to_bits() {
                    diff += 1;
                    first.get_or_insert((id, c, g, e));
                }
            }
        }
        eprintln!(
            "{t}: {} rows x {cols}: {diff} of {} GPU values differ from the CPU's",
            rows,
            ids.len() * cols
        );
        if let Some((r, c, g, e)) = first {
            bad.push(format!(
                "{t}: {diff} values differ, first row {r} col {c}: gpu {g:e} cpu {e:e}"
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Per output element: the f64 reference dot, sum |w x|, and the activation-rounding bounds
/// `sum |w| d_32 / 2` and `sum |w| (d_32 + d_256) / 2` (with 1% margin and a 1e-6 floor).
fn reference(ws: &[f32], xs: &[f32]) -> (f64, f64, f64, f64) {
    let (mut dot, mut mag, mut b32, mut b256) = (0f64, 0f64, 1e-6f64, 1e-6f64);
    for (c, xb) in xs.chunks(32).enumerate() {
        let dx = amax(xb) / 127.0;
        let g0 = (32 * c) / 256 * 256;
        let dx256 = amax(&xs[g0..(g0 + 256).min(xs.len())]) / 127.0;
        for (i, xv) in xb.iter().enumerate() {
            let wf = ws[32 * c + i] as f64;
            dot += wf * *xv as f64;
            mag += (wf * *xv as f64).abs();
            b32 += wf.abs() * dx * 0.505;
            b256 += wf.abs() * (dx + dx256) * 0.505;
        }
    }
    (dot, mag, b32, b256)
}

#[test]
fn gpu_matvec_matches_reference_and_cpu() {
    if !gpu_or_skip("gpu_matvec_matches_reference_and_cpu") {
        return;
    }
    let isa = Isa::detect();
    let mut bad = Vec::new();
    for t in NEW {
        for (rows, cols, n) in [(64usize, 512usize, 5usize), (33, 1024, 1), (96, 1024, 77)] {
            let (w, wv) = matrix(t, rows, cols, 11 + rows as u64);
            let x = activations(n * cols, 3 + n as u64);
            let y = check::matmul(t, &w, rows, cols, &x, n).unwrap();
            let yq = check::matmul_q8(t, &w, rows, cols, &x, n).unwrap();
            assert_eq!(yq.is_some(), Q8.contains(&t), "{t}: dp4a kernels");
            let gemm = Q8
                .contains(&t)
                .then(|| sluice::gpu::gemm::check::matmul(t, &w, rows, cols, &x, n, true).unwrap());
            let view = WeightView::new(t, &w, rows, cols).unwrap();
            let mut acts = Acts::new();
            acts.load(&x, n, cols);
            let mut cpu = vec![0f32; n * rows];
            kernels::matmul(&view, &mut acts, &mut cpu, None, isa).unwrap();
            let mut worst = [0f64; 5];
            for tk in 0..n {
                let xs = &x[tk * cols..(tk + 1) * cols];
                for r in 0..rows {
                    let (dot, mag, b32, b256) = reference(&wv[r * cols..(r + 1) * cols], xs);
                    let i = tk * rows + r;
                    let f32b = 1e-5 * mag + 1e-6;
                    let mut checkv = |k: usize, what: &str, v: f64, want: f64, bound: f64| {
                        let e = (v - want).abs();
                        worst[k] = worst[k].max(e / mag.max(1e-30));
                        if e > bound && bad.len() < 40 {
                            bad.push(format!(
                                "{t} {rows}x{cols} n={n} token {tk} row {r}: {what} {v} vs {want} (bound {bound:.2e})"
                            ));
                        }
                    };
                    checkv(0, "gpu f32 vs reference", y[i] as f64, dot, f32b);
                    checkv(1, "gpu f32 vs cpu", y[i] as f64, cpu[i] as f64, b256 + f32b);
                    if let Some(yq) = &yq {
                        checkv(2, "gpu dp4a vs reference", yq[i] as f64, dot, b32 + f32b);
                        checkv(
                            3,
                            "gpu dp4a vs cpu",
                            yq[i] as f64,
                            cpu[i] as f64,
                            b256 + f32b,
                        );
                        if let Some(g) = &gemm {
                            checkv(4, "gpu gemm vs dp4a", g[i] as f64, yq[i] as f64, f32b);
                        }
                    }
                }
            }
            eprintln!(
                "{t} {rows}x{cols} n={n}: worst |Δ|/Σ|wx|: f32 kernel vs reference {:.1e}, vs cpu {:.1e}; dp4a vs reference {:.1e}, vs cpu {:.1e}; gemm vs dp4a {:.1e}",
                worst[0], worst[1], worst[2], worst[3], worst[4]
            );
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn gpu_expert_gemm_matches_matvec() {
    if !gpu_or_skip("gpu_expert_gemm_matches_matvec") {
        return;
    }
    let (experts, ffn, h, k, n) = (8usize, 256usize, 512usize, 4usize, 100usize);
    for (gt, dt) in [
        (DType::Q4_1, DType::Q5_0),
        (DType::Q5_1, DType::IQ4_NL),
        (DType::IQ4_XS, DType::IQ4_XS),
    ] {
        let (mut gate, mut up, mut down, mut dv) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for e in 0..experts as u64 {
            gate.extend(matrix(gt, ffn, h, 100 + e).0);
            up.extend(matrix(gt, ffn, h, 200 + e).0);
            let (d, v) = matrix(dt, h, ffn, 300 + e);
            down.extend(d);
            dv.extend(v);
        }
        let x = activations(n * h, 77);
        let mut r = Rng(5);
        let mut sel = Vec::new();
        for _ in 0..n {
            let mut s: Vec<usize> = Vec::new();
            while s.len() < k {
                let e = ((r.next() % 64) as f64).sqrt() as usize % experts;
                if !s.contains(&e) {
                    s.push(e);
                }
            }
            sel.extend(s);
        }
        let run = |gemm| {
            sluice::gpu::gemm::check::moe(
                (gt, dt),
                &gate,
                &up,
                &down,
                experts,
                ffn,
                h,
                &x,
                &sel,
                k,
                gemm,
            )
            .unwrap()
        };
        let ((hg, og), (hm, om)) = (run(true), run(false));
        let scale = amax(&hm);
        let mut worst_h = 0f64;
        for (a, b) in hg.iter().zip(&hm) {
            let e = (*a as f64 - *b as f64).abs();
            assert!(e <= 1e-4 * scale, "{gt}: hidden {a} vs matvec {b}");
            worst_h = worst_h.max(e / scale);
        }
        // Each path quantizes its own hidden rows (codes may differ by one step on a rounding
        // edge): bound sum |w| d_h. Hidden rows are in job order (experts ascending).
        let mut row_of = vec![0usize; n * k];
        let mut p = 0;
        for e in 0..experts {
            for (a, &s) in sel.iter().enumerate() {
                if s == e {
                    row_of[a] = p;
                    p += 1;
                }
            }
        }
        let mut worst = 0f64;
        for a in 0..n * k {
            let e = sel[a];
            let hrow = &hm[row_of[a] * ffn..(row_of[a] + 1) * ffn];
            for c in 0..h {
                let w = &dv[(e * h + c) * ffn..(e * h + c + 1) * ffn];
                let (mut bound, mut mag) = (1e-6f64, 0f64);
                for (ch, hb) in hrow.chunks(32).enumerate() {
                    let d = amax(hb) / 127.0;
                    for (i, hv) in hb.iter().enumerate() {
                        bound += (w[32 * ch + i] as f64).abs() * d * 1.01;
                        mag += (w[32 * ch + i] as f64 * *hv as f64).abs();
                    }
                }
                let (gv, mv) = (og[a * h + c] as f64, om[a * h + c] as f64);
                assert!(
                    (gv - mv).abs() <= bound + 1e-5 * mag,
                    "{gt}/{dt}: assignment {a} (expert {e}) row {c}: gemm {gv} vs matvec {mv} (bound {bound:.2e})"
                );
                worst = worst.max((gv - mv).abs() / mag.max(1e-30));
            }
        }
        eprintln!(
            "moe {gt}/{dt}: hidden worst {worst_h:.1e} of max, out worst |Δ|/Σ|wh| {worst:.1e}"
        );
    }
}

// ---- End to end --------------------------------------------------------------------------------

/// f16 bits of a positive normal f32 (round to nearest).
fn f16_bits(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

/// Sets the f16 scale `d` of every block of `t` in `b`.
fn set_d(t: DType, b: &mut [u8], d: u16) {
    let bb = t.bytes_for(t.block_elems().unwrap() as u64).unwrap() as usize;
    for blk in b.chunks_exact_mut(bb) {
        match t {
            DType::TQ1_0 => blk[52..54].copy_from_slice(&d.to_le_bytes()),
            DType::TQ2_0 => blk[64..66].copy_from_slice(&d.to_le_bytes()),
            DType::IQ1_M => {
                // The top nibble of scale word w holds bits 4w..4w+4 of d.
                for w in 0..4 {
                    let at = 48 + 2 * w;
                    let s = u16::from_le_bytes([blk[at], blk[at + 1]]);
                    let s = (s & 0x0fff) | (((d >> (4 * w)) & 15) << 12);
                    blk[at..at + 2].copy_from_slice(&s.to_le_bytes());
                }
            }
            _ => blk[0..2].copy_from_slice(&d.to_le_bytes()),
        }
    }
}

/// `x` (whole rows) as `t`: quantized where sluice has a quantizer for `t`, else random codes
/// with every block's scale set so that the values' RMS is x's.
fn encode(t: DType, x: &[f32], rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::new();
    if kernels::quantize::quantize(t, x, &mut out).is_ok() {
        return out;
    }
    let nb = t.bytes_for(x.len() as u64).unwrap() as usize;
    let mut b: Vec<u8> = (0..nb).map(|_| rng.next() as u8).collect();
    if t == DType::TQ2_0 {
        // Codes 0..=2 (-1, 0, +1) only, as the format's quantizer writes.
        for blk in b.chunks_exact_mut(66) {
            for q in &mut blk[..64] {
                *q = (0..4).map(|n| ((rng.next() % 3) as u8) << (2 * n)).sum();
            }
        }
    }
    set_d(t, &mut b, f16_bits(1.0));
    let mut v = vec![0f32; x.len()];
    kernels::dequantize(t, &b, &mut v).unwrap();
    let rms =
        |v: &[f32]| (v.iter().map(|a| (*a as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
    set_d(t, &mut b, f16_bits((rms(x) / rms(&v)) as f32));
    b
}

/// The F16 synthetic model every end-to-end file is made from.
fn f16_model(dir: &Path) -> PathBuf {
    let mut s = sluice::synth::MoeSpec::preset("qwen3-30b-a3b").unwrap();
    (
        s.hidden,
        s.experts,
        s.experts_used,
        s.expert_ffn,
        s.vocab,
        s.skew,
    ) = (256, 16, 4, 256, 0, 1.0);
    (s.heads, s.kv_heads, s.head_dim) = (4, 2, 64);
    s.cut_layers(2).unwrap();
    s.dtype = DType::F16;
    let p = dir.join("f16.gguf");
    sluice::synth::write_random(&p, &s, &mut |_, _| {}).unwrap();
    p
}

/// `base` with every F16 matrix re-encoded as `t` (metadata and F32 tensors copied).
fn retype(base: &Path, t: DType, out: &Path) {
    let src = ModelFiles::open(base).unwrap();
    let mut w = GgufWriter::new(out).unwrap();
    for k in src.meta_keys() {
        w.add_meta(k, src.meta(k).unwrap().clone()).unwrap();
    }
    let mut rng = Rng(0x5EED ^ t.ggml_id().unwrap() as u64);
    let mut data = Vec::new();
    for ti in src.tensors() {
        let (dt, bytes) = if ti.dtype == DType::F16 {
            (t, encode(t, &src.dequantize(ti).unwrap(), &mut rng))
        } else {
            (ti.dtype, src.bytes(ti).unwrap().to_vec())
        };
        w.add_tensor_info(&ti.name, dt, &ti.shape).unwrap();
        data.push(bytes);
    }
    for d in data {
        w.write_tensor_data(&d).unwrap();
    }
    w.finish().unwrap();
}

/// A sequence state, with the CUDA backend beside it when `gpu` (declared first: it stages
/// from the state's RAM expert cache, so it is dropped first).
struct Run {
    g: Option<GpuState>,
    st: State,
}

impl Run {
    fn new(model: &Model<'_>, files: &ModelFiles, batch: usize, gpu: bool) -> Run {
        let mut st = model.new_state(256, batch, batch).unwrap();
        let mut g = None;
        if gpu {
            let mut cfg = CacheConfig::new(model.cfg.n_experts);
            cfg.io = sluice::experts::IoMode::Buffered;
            st.attach_experts(model.expert_cache(files, cfg).unwrap());
            let opts = GpuOptions {
                vram: None,
                staging: Staging::Arena,
                pinned: Vec::new(),
            };
            g = Some(GpuState::attach(model, &st, &opts).unwrap().0);
        }
        Run { g, st }
    }
    fn parts(&mut self) -> (Option<&mut dyn Device>, &mut State) {
        (self.g.as_mut().map(|g| g as &mut dyn Device), &mut self.st)
    }
}

fn argmax(x: &[f32]) -> usize {
    let mut b = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[b] {
            b = i;
        }
    }
    b
}

/// Top-1 minus top-2 logit.
fn margin(x: &[f32]) -> f32 {
    let a = argmax(x);
    let second = x
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != a)
        .fold(f32::NEG_INFINITY, |m, (_, v)| m.max(*v));
    x[a] - second
}

/// KL(p || q) of two logit rows.
fn kl(p: &[f32], q: &[f32]) -> f64 {
    let lse = |x: &[f32]| {
        let m = x.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v)) as f64;
        m + x.iter().map(|v| (*v as f64 - m).exp()).sum::<f64>().ln()
    };
    let (lp, lq) = (lse(p), lse(q));
    p.iter()
        .zip(q)
        .map(|(a, b)| {
            let (a, b) = (*a as f64 - lp, *b as f64 - lq);
            a.exp() * (a - b)
        })
        .sum()
}

/// Greedy tokens and each step's logits.
fn greedy(model: &Model<'_>, r: &mut Run, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let (d, st) = r.parts();
    let l = model.feed_on(d, st, prompt).unwrap().to_vec();
    let mut next = argmax(&l) as u32;
    let (mut toks, mut logits) = (vec![next], vec![l]);
    while toks.len() < n {
        let (d, st) = r.parts();
        let l = model.forward_on(d, st, &[next], 0).unwrap().to_vec();
        next = argmax(&l) as u32;
        toks.push(next);
        logits.push(l);
    }
    (toks, logits)
}

const TIE: f32 = 0.05;

#[test]
fn gpu_runs_every_type_end_to_end_like_cpu() {
    if !gpu_or_skip("gpu_runs_every_type_end_to_end_like_cpu") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("sluice-gpu-types-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = f16_model(&dir);
    let mut bad = Vec::new();
    for t in NEW {
        let path = dir.join(format!("{t}.gguf"));
        retype(&base, t, &path);
        let files = ModelFiles::open(&path).unwrap();
        let lo = LoadOptions {
            kv: sluice::model::KvTypes::F32,
            threads: 2,
            ctx: 256,
        };
        let model = Model::load(&files, &lo).unwrap();
        let v = model.cfg.vocab;
        let toks: Vec<u32> = (0..64).map(|i| ((i * 37 + 11) % v) as u32).collect();
        // Teacher-forced logits, the 64 positions in one forward (GEMM for the dp4a types).
        let mut cpu = Vec::new();
        let mut rc = Run::new(&model, &files, 64, false);
        model.logits_all(&mut rc.st, &toks, &mut cpu).unwrap();
        let mut gpu = Vec::new();
        let mut rg = Run::new(&model, &files, 64, true);
        let (d, st) = rg.parts();
        model.logits_all_on(d, st, &toks, &mut gpu).unwrap();
        let (mut kl_sum, mut kl_max, mut agree, mut flip_margin) = (0f64, 0f64, 0usize, 0f32);
        for (i, (c, g)) in cpu.chunks(v).zip(gpu.chunks(v)).enumerate() {
            let k = kl(c, g);
            kl_sum += k;
            kl_max = kl_max.max(k);
            if argmax(c) == argmax(g) {
                agree += 1;
                continue;
            }
            // A random-code model's logits are nearly flat: a top-1 flip is allowed only at a
            // near tie of the CPU's (its 8-bit activation rounding decides those).
            let m = margin(c);
            flip_margin = flip_margin.max(m);
            if m >= TIE {
                bad.push(format!(
                    "{t}: position {i}: gpu top-1 {} vs cpu {} where the cpu's margin is {m:.3} >= {TIE}",
                    argmax(g),
                    argmax(c)
                ));
            }
        }
        let pos = toks.len();
        let kl_mean = kl_sum / pos as f64;
        // Greedy decode (the matvec kernels) after a 16-token prompt.
        let prompt = &toks[..16];
        let (ct, cl) = greedy(&model, &mut Run::new(&model, &files, 64, false), prompt, 24);
        let (gt, _) = greedy(&model, &mut Run::new(&model, &files, 64, true), prompt, 24);
        let mut same = 0;
        let mut verdict = "all identical".to_string();
        for i in 0..ct.len() {
            if ct[i] == gt[i] {
                same += 1;
                continue;
            }
            let m = margin(&cl[i]);
            verdict = format!("differ at step {i} (cpu top-2 margin {m:.3})");
            if m >= TIE {
                bad.push(format!(
                    "{t}: greedy token {i}: gpu {} vs cpu {} where the cpu's margin is {m:.3} >= {TIE}",
                    gt[i], ct[i]
                ));
            }
            break;
        }
        let flips = if agree < pos {
            format!(" (flips where the cpu's top-2 margin is at most {flip_margin:.3})")
        } else {
            String::new()
        };
        eprintln!(
            "{t}: {pos} positions: mean KL {kl_mean:.2e} (max {kl_max:.2e}), top-1 {agree}/{pos}{flips}; greedy {same}/{} tokens identical, {verdict}",
            ct.len()
        );
        if kl_mean > 1e-3 {
            bad.push(format!("{t}: mean KL {kl_mean:e} > 1e-3"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

// ---- Bandwidth report --------------------------------------------------------------------------

/// Prints, per GPU type, the decode matvec's weight bytes per second (one token; the f32 kernel
/// and, where the type has one, the dp4a kernel the backend uses) on a matrix of ~512 MiB (far
/// beyond L2), beside the device's copy bandwidth in the same run. Asserts nothing about speed.
#[test]
#[ignore = "GPU benchmark, no assertion: scripts/gpu-check.sh runs it on the device (--ignored --nocapture)"]
fn gpu_types_bandwidth_report() {
    if !gpu_or_skip("gpu_types_bandwidth_report") {
        return;
    }
    let gpu = Gpu::open().unwrap();
    let bytes = 512usize << 20;
    // Copy bandwidth: device-to-device copies of 512 MiB (each reads and writes every byte).
    let (a, b) = (gpu.alloc(bytes).unwrap(), gpu.alloc(bytes).unwrap());
    gpu.copy_d2d(b.ptr, a.ptr, bytes, Stream::Compute).unwrap();
    gpu.sync(Stream::Compute).unwrap();
    let reps = 20;
    let t0 = Instant::now();
    for _ in 0..reps {
        gpu.copy_d2d(b.ptr, a.ptr, bytes, Stream::Compute).unwrap();
    }
    gpu.sync(Stream::Compute).unwrap();
    let s = t0.elapsed().as_secs_f64() / reps as f64;
    let copy = 2.0 * bytes as f64 / s / 1e9;
    drop((a, b));
    eprintln!(
        "device {}: copy 512 MiB d2d: {:.0} GB/s read + write ({:.0} GB/s each way)",
        gpu.name,
        copy,
        copy / 2.0
    );
    let cols = 4096usize;
    for t in sluice::gpu::GPU_TYPES {
        let rb = t.bytes_for(cols as u64).unwrap() as usize;
        let rows = bytes / rb;
        // Real blocks (the fixtures'), repeated; the floats get random finite values.
        let w: Vec<u8> = if t.is_quantized() {
            let (blocks, _) = fixture(t);
            let piece = t.bytes_for(256).unwrap() as usize;
            let mut w = blocks[..piece * (blocks.len() / piece)].to_vec();
            while w.len() < rows * rb {
                w.extend_from_within(..w.len().min(rows * rb - w.len()));
            }
            w
        } else {
            let x = activations(rows * cols, 9);
            let mut o = Vec::new();
            kernels::quantize::quantize(t, &x, &mut o).unwrap();
            o
        };
        let wd = gpu.alloc(w.len()).unwrap();
        gpu.upload(wd.ptr, &w).unwrap();
        drop(w);
        let x = activations(cols, 4);
        let xb: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let xd = gpu.alloc(xb.len()).unwrap();
        gpu.upload(xd.ptr, &xb).unwrap();
        let y = gpu.alloc(4 * rows).unwrap();
        let name = t.name().to_ascii_lowercase();
        let time = |kernel: &str, q: Option<(u64, u64)>| -> f64 {
            let f = gpu.function(&format!("{kernel}_{name}")).unwrap();
            let run = || {
                let (xa, xs) = q.unwrap_or((xd.ptr, 0));
                let mut args: Vec<Arg> =
                    vec![wd.ptr.into(), (rb as i64).into(), (rows as i32).into()];
                args.push((cols as i32).into());
                args.push(xa.into());
                if q.is_some() {
                    args.push(xs.into());
                } else {
                    args.push((cols as i32).into());
                }
                args.extend::<[Arg; 3]>([1i32.into(), y.ptr.into(), (rows as i32).into()]);
                gpu.launch(
                    f,
                    ((rows as u32).div_ceil(8), 1, 1),
                    256,
                    0,
                    Stream::Compute,
                    &args,
                )
                .unwrap();
            };
            run();
            gpu.sync(Stream::Compute).unwrap();
            let reps = 10;
            let t0 = Instant::now();
            for _ in 0..reps {
                run();
            }
            gpu.sync(Stream::Compute).unwrap();
            t0.elapsed().as_secs_f64() / reps as f64
        };
        let f = time("mm", None);
        let mut line = format!(
            "{t:>8}: {:.0} MiB, {rows}x{cols}: f32 kernel {:.3} ms = {:.0} GB/s ({:.0}% of copy each way)",
            (rows * rb) as f64 / (1 << 20) as f64,
            f * 1e3,
            (rows * rb) as f64 / f / 1e9,
            100.0 * (rows * rb) as f64 / f / 1e9 / (copy / 2.0)
        );
        if sluice::gpu::model::Q8_TYPES.contains(&t) {
            let xq = gpu.alloc(cols).unwrap();
            let xs = gpu.alloc(4 * cols / 32).unwrap();
            let qf = gpu.function("quantize_q8").unwrap();
            gpu.launch(
                qf,
                (((cols / 32) as u32).div_ceil(8), 1, 1),
                256,
                0,
                Stream::Compute,
                &[
                    xd.ptr.into(),
                    (cols as i32).into(),
                    (cols as i32).into(),
                    1i32.into(),
                    xq.ptr.into(),
                    xs.ptr.into(),
                ],
            )
            .unwrap();
            let q = time("mmq", Some((xq.ptr, xs.ptr)));
            line += &format!(
                "; dp4a kernel {:.3} ms = {:.0} GB/s ({:.0}%)",
                q * 1e3,
                (rows * rb) as f64 / q / 1e9,
                100.0 * (rows * rb) as f64 / q / 1e9 / (copy / 2.0)
            );
        }
        eprintln!("{line}");
    }
}
