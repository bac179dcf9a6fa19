//! Q2_K, Q3_K, IQ2_XXS and MXFP4 kernels against the `gguf` Python package.
//!
//! Dequantization must be bit-identical (f32 bits) to `gguf.quants.dequantize` on the blocks of
//! tests/fixtures/quant (random valid blocks) and tests/fixtures/iq (every IQ2_XXS grid row,
//! sign index and scale; every MXFP4 code and extreme exponents).
//!
//! Dot products, for every ISA this CPU runs, are checked against the f64 dot of the gguf
//! dequantized weights with the unquantized f32 activations. The activations are quantized per
//! block b (32 or 256 elements) with d_b = max|x_b| / 127 and rounding, so |x_i - d_b q_i| <=
//! d_b / 2, and the integer inner product is exact; hence
//! |dot - ref| <= sum_b (d_b / 2) sum_{i in b} |w_i|  (+ f32 rounding of the block sums,
//! allowed as 1e-5 * sum |w_i x_i| + 1e-6). That bound is a worst case and loose, so a second,
//! tight check holds too: against the f64 dot of the gguf weights with the activations as
//! quantized (d_b * q_i), the kernels may differ only by f32 rounding, 1e-5 * sum |w_i d_b q_i|
//! plus 1e-6, since their integer inner products are exact. SIMD results must also agree with
//! the scalar kernel within that allowance.

use sluice::dtype::DType;
use sluice::kernels::{self, ActFormat, Acts, Isa};
use std::path::PathBuf;

const TYPES: [DType; 4] = [DType::Q2_K, DType::Q3_K, DType::IQ2_XXS, DType::MXFP4];

fn read(dir: &str, name: &str) -> (Vec<u8>, Vec<f32>) {
    let base = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(dir);
    let blocks = std::fs::read(base.join(format!("{name}.blocks"))).expect("fixture blocks");
    let raw = std::fs::read(base.join(format!("{name}.f32"))).expect("fixture f32");
    let f = raw
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (blocks, f)
}

fn assert_dequant_bits(t: DType, blocks: &[u8], want: &[f32], what: &str) {
    let mut got = vec![0f32; want.len()];
    kernels::dequantize(t, blocks, &mut got).expect("dequantize");
    let mut bad = 0;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g.to_bits() != w.to_bits() {
            if bad < 5 {
                eprintln!(
                    "{what} element {i}: sluice {g:e} ({:#010x}), gguf {w:e} ({:#010x})",
                    g.to_bits(),
                    w.to_bits()
                );
            }
            bad += 1;
        }
    }
    assert_eq!(
        bad,
        0,
        "{what}: {bad} of {} elements differ from gguf",
        want.len()
    );
}

#[test]
fn dequantize_matches_gguf_bit_for_bit() {
    for t in TYPES {
        let (blocks, want) = read("quant", &t.name());
        assert_eq!(want.len(), 2048);
        assert_dequant_bits(t, &blocks, &want, &t.name());
    }
    assert_dequant_bits(
        DType::IQ2_XXS,
        &read("iq", "IQ2_XXS_grid").0,
        &read("iq", "IQ2_XXS_grid").1,
        "IQ2_XXS_grid",
    );
    assert_dequant_bits(
        DType::MXFP4,
        &read("iq", "MXFP4_codes").0,
        &read("iq", "MXFP4_codes").1,
        "MXFP4_codes",
    );
}

/// xorshift64*: deterministic activations without a rand dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Activations whose magnitude varies from block to block, with an occasional outlier (what
/// makes per-block scales matter).
fn activations(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(n);
    let mut scale = 1.0f32;
    for i in 0..n {
        if i % 64 == 0 {
            scale = 10f32.powf(2.0 * rng.unit());
        }
        let mut v = rng.unit() * scale;
        if rng.next().is_multiple_of(97) {
            v *= 20.0;
        }
        x.push(v);
    }
    x
}

/// Where element `i` of a 256-element block sits in a `Q8KRows` block, as src/kernels/act.rs
/// documents it: element 32g + 8k + e (row k of 32-element group g) at 64k + 8g + e.
fn q8k_rows_pos(i: usize) -> usize {
    let (g, k, e) = (i / 32, (i / 8) % 4, i % 8);
    64 * k + 8 * g + e
}

fn act_block(t: DType) -> usize {
    match kernels::kernels_for(t).expect("kernels").act {
        ActFormat::Q8_32 => 32,
        ActFormat::Q8K | ActFormat::Q8KRows => 256,
        ActFormat::F32 => 1,
    }
}

struct Check {
    /// f64 dot with the f32 activations.
    reference: f64,
    /// Allowed |dot - reference|: activation quantization plus f32 rounding.
    bound: f64,
    /// f64 dot with the activations as the kernels see them (d_b * q_i).
    quantized: f64,
    /// f32 rounding allowance against `quantized` (and between ISAs).
    rounding: f64,
}

fn dot64(w: &[f32], x: &[f64]) -> (f64, f64) {
    let dot = w.iter().zip(x).map(|(&a, &b)| a as f64 * b).sum();
    let abs = w.iter().zip(x).map(|(&a, &b)| (a as f64 * b).abs()).sum();
    (dot, abs)
}

/// The activations of `row` after quantization, as f64 (exact: d_b * q_i).
fn dequantized_acts(row: &kernels::ActRow<'_>, fmt: ActFormat) -> Vec<f64> {
    match fmt {
        ActFormat::Q8_32 => row
            .q8_32
            .iter()
            .flat_map(|b| b.qs.iter().map(move |&q| b.d as f64 * q as f64))
            .collect(),
        ActFormat::Q8K => row
            .q8k
            .iter()
            .flat_map(|b| b.qs.iter().map(move |&q| b.d as f64 * q as f64))
            .collect(),
        ActFormat::Q8KRows => row
            .q8k_rows
            .iter()
            .flat_map(|b| (0..256).map(move |i| b.d as f64 * b.qs[q8k_rows_pos(i)] as f64))
            .collect(),
        ActFormat::F32 => row.f32.iter().map(|&v| v as f64).collect(),
    }
}

fn check_for(w: &[f32], x: &[f32], xq: &[f64], ab: usize) -> Check {
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let (reference, abs) = dot64(w, &x64);
    let (quantized, abs_q) = dot64(w, xq);
    let mut quant = 0.0f64;
    for (wb, xb) in w.chunks(ab).zip(x.chunks(ab)) {
        let d = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 127.0;
        quant += d / 2.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>();
    }
    Check {
        reference,
        bound: quant + 1e-5 * abs + 1e-6,
        quantized,
        rounding: 1e-5 * abs_q + 1e-6,
    }
}

/// Dot rows of `row_blocks` blocks cut from `blocks`, with several activation rows, at every ISA.
fn check_dots(t: DType, blocks: &[u8], deq: &[f32], row_blocks: usize, rng: &mut Rng) {
    let (be, bb) = t.block_geometry().expect("geometry");
    let n = row_blocks * be;
    let n_rows = blocks.len() / bb / row_blocks;
    let ab = act_block(t);
    let fmt = kernels::kernels_for(t).expect("kernels").act;
    let act_rows = 3;
    let x = activations(rng, act_rows * n);
    let mut acts = Acts::new();
    acts.load(&x, act_rows, n);
    acts.prepare(fmt);
    for r in 0..n_rows {
        let wb = &blocks[r * row_blocks * bb..(r + 1) * row_blocks * bb];
        let wf = &deq[r * n..(r + 1) * n];
        for ar in 0..act_rows {
            let xr = &x[ar * n..(ar + 1) * n];
            let row = acts.row(ar);
            let c = check_for(wf, xr, &dequantized_acts(&row, fmt), ab);
            let scalar = kernels::dot_fn(t, Isa::Scalar).expect("dot_fn")(wb, &row);
            for isa in Isa::available() {
                let got = kernels::dot_fn(t, isa).expect("dot_fn")(wb, &row);
                let err = (got as f64 - c.reference).abs();
                assert!(
                    err <= c.bound,
                    "{} {} n={n} row {r} act {ar}: dot {got} vs gguf f64 {} (err {err:e} > bound {:e})",
                    t.name(),
                    isa.name(),
                    c.reference,
                    c.bound
                );
                let err_q = (got as f64 - c.quantized).abs();
                assert!(
                    err_q <= c.rounding,
                    "{} {} n={n} row {r} act {ar}: dot {got} vs gguf f64 with quantized acts {} (err {err_q:e} > {:e})",
                    t.name(),
                    isa.name(),
                    c.quantized,
                    c.rounding
                );
                let diff = (got as f64 - scalar as f64).abs();
                assert!(
                    diff <= c.rounding,
                    "{} {} n={n} row {r} act {ar}: dot {got} vs scalar {scalar} (diff {diff:e} > {:e})",
                    t.name(),
                    isa.name(),
                    c.rounding
                );
            }
        }
    }
}

#[test]
fn dot_matches_gguf_within_activation_quantization() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    eprintln!("ISAs tested: {:?}", Isa::available());
    for t in TYPES {
        let (blocks, deq) = read("quant", &t.name());
        let nb = blocks.len() / t.block_geometry().expect("geometry").1;
        // Odd lengths exercise the SIMD tails; whole-fixture rows the long loops.
        for row_blocks in [1, 3, 5, nb] {
            check_dots(t, &blocks, &deq, row_blocks, &mut rng);
        }
    }
    let (blocks, deq) = read("iq", "IQ2_XXS_grid");
    for row_blocks in [1, 8] {
        check_dots(DType::IQ2_XXS, &blocks, &deq, row_blocks, &mut rng);
    }
}

#[test]
fn zero_activations_give_zero() {
    for t in TYPES {
        let (blocks, _) = read("quant", &t.name());
        let n = blocks.len() / t.block_geometry().expect("geometry").1
            * t.block_geometry().expect("geometry").0;
        let mut acts = Acts::new();
        acts.load(&vec![0.0; n], 1, n);
        acts.prepare(kernels::kernels_for(t).expect("kernels").act);
        for isa in Isa::available() {
            assert_eq!(
                kernels::dot_fn(t, isa).expect("dot_fn")(&blocks, &acts.row(0)),
                0.0,
                "{} {}",
                t.name(),
                isa.name()
            );
        }
    }
}
