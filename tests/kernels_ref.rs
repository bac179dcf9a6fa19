//! Kernels against the `gguf` Python package (llama.cpp's numpy reference), for every type in
//! `sluice::kernels::supported_types()` and every ISA this CPU can run.
//!
//! Fixtures: `tests/fixtures/quant/<TYPE>.blocks` (random valid blocks, 2048 elements) and
//! `<TYPE>.f32` (what `gguf.quants.dequantize` returns for them), made by
//! `scripts/make_quant_fixtures.py`.
//!
//! # The dot error bound
//! A dot kernel computes `sum_i w_i * x_i` where `w` are the weights exactly as the reference
//! dequantizes them and `x` the f32 activations. Quantized weight types do not see `x`: they see
//! the activations quantized per block `b` (32 elements for `Q8_32`, 256 for `Q8K`) as
//! `d_b * q_i` with `d_b = max_{i in b} |x_i| / 127` and `q_i = round(x_i / d_b)`, so
//! `|x_i - d_b q_i| <= d_b / 2`. Everything after that is exact integer arithmetic (the products
//! of weight and activation codes and their per-block sums) followed by a few f32 operations per
//! block. Hence
//!
//! `|kernel - sum_i w_i x_i| <= sum_b (d_b / 2) * sum_{i in b} |w_i|  +  slack`,
//!
//! where `slack = 1e-5 * sum_i |w_i x_i| + 1e-6` covers f32 rounding of the per-block scales
//! and of the accumulation (a few ulps per block, far below 1e-5 relative for rows of
//! thousands of elements). Float weight types dot against the f32 activations themselves,
//! so their bound is the slack alone. The reference is computed in f64.
//!
//! That bound is a worst case: activation rounding errors have random signs, so it sits far
//! above typical errors and a layout bug (a swapped scale) can hide under it. A second, tight
//! check therefore takes the activations exactly as the kernel saw them (`d_b * q_i`, read back
//! from the prepared `Acts`) and allows only the f32 slack against the f64 dot with the
//! reference weights.

use sluice::dtype::DType;
use sluice::kernels::{self, ActFormat, Acts, Isa, WeightView};
use std::path::PathBuf;

fn fixture(t: DType, ext: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/quant")
        .join(format!("{}.{ext}", t.name()));
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// (blocks, reference f32 values) of type `t`.
fn load(t: DType) -> (Vec<u8>, Vec<f32>) {
    let blocks = fixture(t, "blocks");
    let refv: Vec<f32> = fixture(t, "f32")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(
        Some(blocks.len() as u64),
        t.bytes_for(refv.len() as u64),
        "{t}: fixture sizes disagree"
    );
    (blocks, refv)
}

/// Bytes of `n` elements of `t`.
fn nbytes(t: DType, n: usize) -> usize {
    t.bytes_for(n as u64).expect("whole blocks") as usize
}

/// Deterministic pseudo-random numbers (splitmix64), so failures reproduce.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f32 {
        let u = self.uniform().max(1e-300);
        let v = self.uniform();
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    }
}

/// Activation patterns: plain normal; normal with rare large outliers; one with a whole
/// 256-element block of zeros (d = 0 for that block) and mixed magnitudes.
fn activations(n: usize, pattern: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed ^ (pattern as u64) << 32);
    (0..n)
        .map(|i| {
            let x = r.normal();
            match pattern {
                0 => x,
                1 => {
                    if r.next().is_multiple_of(97) {
                        x * 60.0
                    } else {
                        x
                    }
                }
                _ => {
                    if (i / 256) % 3 == 1 {
                        0.0
                    } else {
                        x * (1.0 + (i % 7) as f32)
                    }
                }
            }
        })
        .collect()
}

fn act_block(fmt: ActFormat) -> Option<usize> {
    match fmt {
        ActFormat::F32 => None,
        ActFormat::Q8_32 => Some(32),
        ActFormat::Q8K | ActFormat::Q8KRows => Some(256),
    }
}

/// The activations of row `row` as the kernels see them: `d_b * q_i` for quantized formats.
fn seen_activations(acts: &Acts, row: usize, fmt: ActFormat) -> Vec<f64> {
    let r = acts.row(row);
    match fmt {
        ActFormat::F32 => r.f32.iter().map(|&v| v as f64).collect(),
        ActFormat::Q8_32 => r
            .q8_32
            .iter()
            .flat_map(|b| b.qs.iter().map(move |&q| b.d as f64 * q as f64))
            .collect(),
        ActFormat::Q8K => r
            .q8k
            .iter()
            .flat_map(|b| b.qs.iter().map(move |&q| b.d as f64 * q as f64))
            .collect(),
        // Element 32g + 8k + e (row k of group g) sits at 64k + 8g + e (src/kernels/act.rs).
        ActFormat::Q8KRows => r
            .q8k_rows
            .iter()
            .flat_map(|b| {
                (0..256).map(move |i| {
                    let (g, k, e) = (i / 32, (i / 8) % 4, i % 8);
                    b.d as f64 * b.qs[64 * k + 8 * g + e] as f64
                })
            })
            .collect(),
    }
}

/// (f64 reference dot, allowed error) for weights `w` (dequantized) and activations `x`.
fn reference(w: &[f32], x: &[f32], fmt: ActFormat) -> (f64, f64) {
    let exact: f64 = w.iter().zip(x).map(|(&w, &x)| w as f64 * x as f64).sum();
    let abs: f64 = w
        .iter()
        .zip(x)
        .map(|(&w, &x)| (w as f64 * x as f64).abs())
        .sum();
    let mut bound = 1e-5 * abs + 1e-6;
    if let Some(b) = act_block(fmt) {
        for (wb, xb) in w.chunks(b).zip(x.chunks(b)) {
            let d = xb.iter().fold(0.0f64, |m, &v| m.max(v.abs() as f64)) / 127.0;
            bound += d / 2.0 * wb.iter().map(|&v| v.abs() as f64).sum::<f64>();
        }
    }
    (exact, bound)
}

#[test]
fn dequantize_is_bit_identical_to_gguf() {
    let types = kernels::supported_types();
    assert!(
        types.len() >= 8,
        "expected at least the float, Q8_0, Q4_0 and K types, got {types:?}"
    );
    for t in types {
        let (blocks, refv) = load(t);
        let mut out = vec![f32::NAN; refv.len()];
        kernels::dequantize(t, &blocks, &mut out).unwrap();
        for (i, (a, b)) in out.iter().zip(&refv).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{t}: element {i}: sluice {a:e} vs gguf {b:e}"
            );
        }
    }
}

#[test]
fn dequantize_rejects_partial_blocks() {
    let mut out = vec![0.0f32; 256];
    assert!(kernels::dequantize(DType::Q4_K, &[0u8; 143], &mut out).is_err());
    let mut out = vec![0.0f32; 100];
    assert!(kernels::dequantize(DType::Q4_K, &[0u8; 144], &mut out).is_err());
}

/// The fixtures hold blocks with negative `d` (and `dmin`), so the comparisons above cover
/// negative scales. Offsets of the f16 `d` field per ggml's block structs.
#[test]
fn fixtures_include_negative_scales() {
    let d_offset = [
        (DType::Q8_0, 0),
        (DType::Q4_0, 0),
        (DType::Q4_K, 0),
        (DType::Q4_K, 2),
        (DType::Q5_K, 0),
        (DType::Q5_K, 2),
        (DType::Q6_K, 208),
    ];
    for (t, off) in d_offset {
        let (blocks, _) = load(t);
        let bb = t.block_geometry().unwrap().1;
        let neg = blocks
            .chunks_exact(bb)
            .filter(|b| b[off + 1] & 0x80 != 0)
            .count();
        let n = blocks.len() / bb;
        assert!(
            neg > 0 && neg < n,
            "{t}: {neg} of {n} blocks have a negative scale at byte {off}"
        );
    }
}

/// Dots of the fixture rows, shaped as rows x cols, against three activation patterns, at every
/// ISA: within the activation-quantization bound of the f64 reference, and SIMD close to scalar.
#[test]
fn dot_within_activation_quantization_bound() {
    for t in kernels::supported_types() {
        let (blocks, refv) = load(t);
        let fmt = kernels::kernels_for(t).unwrap().act;
        let be = t.block_elems().unwrap();
        // Whole fixture as 8, 1 or 4 rows; then odd block counts (63, 21, 7, 3 blocks of 32 or
        // 256), which reach the SIMD kernels' remainder paths.
        let shapes = [
            (8usize, 256usize),
            (1, 2048),
            (4, 512),
            (1, 2016),
            (3, 672),
            (1, 1792),
            (2, 768),
        ];
        for (rows, cols) in shapes.into_iter().filter(|(_, c)| c % be == 0) {
            let rb = nbytes(t, cols);
            for pattern in 0..3 {
                let x = activations(cols, pattern, 7 + cols as u64);
                let mut acts = Acts::new();
                acts.load(&x, 1, cols);
                acts.prepare(fmt);
                let seen = seen_activations(&acts, 0, fmt);
                for r in 0..rows {
                    let w = &refv[r * cols..(r + 1) * cols];
                    let (exact, bound) = reference(w, &x, fmt);
                    let exact_seen: f64 = w.iter().zip(&seen).map(|(&w, &x)| w as f64 * x).sum();
                    let tight = 1e-5
                        * w.iter()
                            .zip(&seen)
                            .map(|(&w, &x)| (w as f64 * x).abs())
                            .sum::<f64>()
                        + 1e-6;
                    let mut scalar = None;
                    for isa in Isa::available() {
                        let got =
                            kernels::dot(t, isa, &blocks[r * rb..(r + 1) * rb], &acts, 0).unwrap();
                        let err_seen = (got as f64 - exact_seen).abs();
                        assert!(
                            err_seen <= tight,
                            "{t} {isa:?} {rows}x{cols} row {r} pattern {pattern}: got {got}, exact with the quantized activations {exact_seen}, err {err_seen:e} > {tight:e}"
                        );
                        let err = (got as f64 - exact).abs();
                        assert!(
                            err <= bound,
                            "{t} {isa:?} {rows}x{cols} row {r} pattern {pattern}: got {got}, exact {exact}, err {err:e} > bound {bound:e}"
                        );
                        match scalar {
                            None => scalar = Some(got),
                            Some(s) => {
                                // Same integer sums, different f32 summation order only.
                                let abs: f64 = w
                                    .iter()
                                    .zip(&x)
                                    .map(|(&w, &x)| (w as f64 * x as f64).abs())
                                    .sum();
                                let tol = 1e-5 * abs + 1e-6;
                                assert!(
                                    ((got - s) as f64).abs() <= tol,
                                    "{t} {isa:?} row {r} pattern {pattern}: simd {got} vs scalar {s} (tol {tol:e})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The bound above is not vacuous: it is a small fraction of sum |w x| for plain activations.
#[test]
fn bound_is_tight_enough_to_catch_layout_bugs() {
    for t in kernels::supported_types() {
        let (_, refv) = load(t);
        let fmt = kernels::kernels_for(t).unwrap().act;
        let x = activations(refv.len(), 0, 11);
        let (_, bound) = reference(&refv, &x, fmt);
        let abs: f64 = refv
            .iter()
            .zip(&x)
            .map(|(&w, &x)| (w as f64 * x as f64).abs())
            .sum();
        assert!(
            bound < 0.05 * abs,
            "{t}: bound {bound:e} is {:.1}% of sum|wx|",
            100.0 * bound / abs
        );
    }
}

#[test]
fn zero_activations_give_exact_zero() {
    for t in kernels::supported_types() {
        let (blocks, refv) = load(t);
        let fmt = kernels::kernels_for(t).unwrap().act;
        let mut acts = Acts::new();
        acts.load(&vec![0.0; refv.len()], 1, refv.len());
        acts.prepare(fmt);
        for isa in Isa::available() {
            let got = kernels::dot(t, isa, &blocks, &acts, 0).unwrap();
            assert_eq!(got, 0.0, "{t} {isa:?}: dot with zero activations is {got}");
        }
    }
}

/// `matmul` (threaded, several activation rows, four-row dots included) equals the per-row
/// dots bit for bit. Rows are
/// pairs of 256-element chunks of the fixture in varying order, so every output differs.
#[test]
fn matmul_matches_per_row_dots() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for t in kernels::supported_types() {
        let (blocks, refv) = load(t);
        let chunk = nbytes(t, 256);
        let n_chunks = refv.len() / 256;
        let (rows, cols) = (1024usize, 512usize);
        let mut w = Vec::with_capacity(rows * 2 * chunk);
        for r in 0..rows {
            for c in [(r * 3) % n_chunks, (r * 5 + 1) % n_chunks] {
                w.extend_from_slice(&blocks[c * chunk..(c + 1) * chunk]);
            }
        }
        let view = WeightView::new(t, &w, rows, cols).unwrap();
        let fmt = kernels::kernels_for(t).unwrap().act;
        for t_rows in [1usize, 3, 4, 9] {
            let x: Vec<f32> = (0..t_rows).flat_map(|p| activations(cols, p, 99)).collect();
            for isa in Isa::available() {
                for pool in [None, Some(&pool)] {
                    let mut acts = Acts::new();
                    acts.load(&x, t_rows, cols);
                    let mut y = vec![f32::NAN; t_rows * rows];
                    kernels::matmul(&view, &mut acts, &mut y, pool, isa).unwrap();
                    acts.prepare(fmt);
                    for tr in 0..t_rows {
                        for r in 0..rows {
                            let want = kernels::dot(t, isa, view.row(r), &acts, tr).unwrap();
                            let got = y[tr * rows + r];
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "{t} {isa:?} act row {tr} weight row {r}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_rejects_bad_shapes() {
    let (blocks, _) = load(DType::Q4_K);
    let view = WeightView::new(DType::Q4_K, &blocks, 8, 256).unwrap();
    let mut acts = Acts::new();
    acts.load(&[0.0; 512], 1, 512);
    let mut y = vec![0.0; 8];
    assert!(kernels::matmul(&view, &mut acts, &mut y, None, Isa::detect()).is_err());
    acts.load(&[0.0; 256], 1, 256);
    let mut y = vec![0.0; 7];
    assert!(kernels::matmul(&view, &mut acts, &mut y, None, Isa::detect()).is_err());
    assert!(WeightView::new(DType::Q4_K, &blocks, 9, 256).is_err());
}
