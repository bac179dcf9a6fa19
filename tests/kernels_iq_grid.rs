//! The grid i-quants (IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) against the `gguf` Python
//! package.
//!
//! tests/kernels_ref.rs runs the general checks on their fixtures (tests/fixtures/iq_grid, from
//! scripts/make_iq_grid_fixtures.py): dequantization bit-identical to `gguf.quants.dequantize`,
//! dots within the activation-quantization bound at every ISA, SIMD vs scalar, `matmul` batches.
//! This file adds what makes the first of those a proof that src/kernels/iq_grids.rs equals
//! gguf's grids: the fixture blocks use every row of every grid (read here from the block
//! layout ggml documents, independently of the kernels), so a wrong table entry would change
//! some dequantized value. It also checks each ISA's dot on long rows (all fixture blocks as one
//! row) and under `SLUICE_ISA`-style caps through `dot_fn`.

use sluice::dtype::DType;
use sluice::kernels::{self, Acts, Isa};
use std::collections::HashSet;
use std::path::PathBuf;

fn read(t: DType) -> (Vec<u8>, Vec<f32>) {
    let base = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/iq_grid");
    let blocks = std::fs::read(base.join(format!("{}.blocks", t.name()))).expect("blocks");
    let f = std::fs::read(base.join(format!("{}.f32", t.name())))
        .expect("f32")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (blocks, f)
}

/// Grid rows a block of `t` uses, decoded from ggml's block structs.
fn rows_used(t: DType, b: &[u8]) -> Vec<usize> {
    let u16at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]) as usize;
    match t {
        // d, qs[32] u16: row in the low 9 bits.
        DType::IQ2_XS => (0..32).map(|i| u16at(2 + 2 * i) & 511).collect(),
        // d, qs[32], signs[32], qh[8]: 2 high bits per row.
        DType::IQ2_S => (0..32)
            .map(|i| b[2 + i] as usize | ((b[66 + i / 4] as usize >> (2 * (i % 4))) & 3) << 8)
            .collect(),
        // d, qs[64].
        DType::IQ3_XXS => (0..64).map(|i| b[2 + i] as usize).collect(),
        // d, qs[64], qh[8]: 1 high bit per row.
        DType::IQ3_S => (0..64)
            .map(|i| b[2 + i] as usize | ((b[66 + i / 8] as usize >> (i % 8)) & 1) << 8)
            .collect(),
        // d, qs[32], qh[8] u16: 3 high bits per row.
        DType::IQ1_S => (0..32)
            .map(|i| b[2 + i] as usize | ((u16at(34 + 2 * (i / 4)) >> (3 * (i % 4))) & 7) << 8)
            .collect(),
        // qs[32], qh[16]: a nibble per row, its low 3 bits the high bits.
        DType::IQ1_M => (0..32)
            .map(|i| b[i] as usize | ((b[32 + i / 2] as usize >> (4 * (i % 2))) & 7) << 8)
            .collect(),
        _ => unreachable!(),
    }
}

#[test]
fn fixtures_use_every_grid_row() {
    for (t, grid_rows) in [
        (DType::IQ2_XS, 512),
        (DType::IQ2_S, 1024),
        (DType::IQ3_XXS, 256),
        (DType::IQ3_S, 512),
        (DType::IQ1_S, 2048),
    ] {
        let (blocks, _) = read(t);
        let bb = t.block_geometry().unwrap().1;
        let used: HashSet<usize> = blocks
            .chunks_exact(bb)
            .flat_map(|b| rows_used(t, b))
            .collect();
        assert_eq!(
            used.len(),
            grid_rows,
            "{t}: fixture uses {} grid rows",
            used.len()
        );
    }
}

#[test]
fn dequantize_matches_gguf_bit_for_bit() {
    for t in [
        DType::IQ3_XXS,
        DType::IQ3_S,
        DType::IQ2_XS,
        DType::IQ2_S,
        DType::IQ1_S,
        DType::IQ1_M,
    ] {
        let (blocks, want) = read(t);
        let mut got = vec![f32::NAN; want.len()];
        kernels::dequantize(t, &blocks, &mut got).unwrap();
        let bad: Vec<usize> = (0..want.len())
            .filter(|&i| got[i].to_bits() != want[i].to_bits())
            .collect();
        assert!(
            bad.is_empty(),
            "{t}: {} of {} elements differ from gguf, first {} (sluice {}, gguf {})",
            bad.len(),
            want.len(),
            bad[0],
            got[bad[0]],
            want[bad[0]]
        );
    }
}

/// Every fixture block as one long row: each ISA within f32 rounding of the f64 dot of gguf's
/// weights with the activations as quantized (the integer sums are exact), and of scalar.
#[test]
fn long_rows_agree_across_isas() {
    for t in [
        DType::IQ3_XXS,
        DType::IQ3_S,
        DType::IQ2_XS,
        DType::IQ2_S,
        DType::IQ1_S,
        DType::IQ1_M,
    ] {
        let (blocks, w) = read(t);
        let n = w.len();
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i / 256) as f32))
            .collect();
        let mut acts = Acts::new();
        acts.load(&x, 1, n);
        acts.prepare(kernels::kernels_for(t).unwrap().act);
        let row = acts.row(0);
        let seen: Vec<f64> = row
            .q8k
            .iter()
            .flat_map(|b| b.qs.iter().map(move |&q| b.d as f64 * q as f64))
            .collect();
        let exact: f64 = w.iter().zip(&seen).map(|(&a, &b)| a as f64 * b).sum();
        let tol = 1e-5
            * w.iter()
                .zip(&seen)
                .map(|(&a, &b)| (a as f64 * b).abs())
                .sum::<f64>()
            + 1e-6;
        let scalar = kernels::dot_fn(t, Isa::Scalar).unwrap()(&blocks, &row);
        for isa in Isa::available() {
            let got = kernels::dot_fn(t, isa).unwrap()(&blocks, &row);
            assert!(
                (got as f64 - exact).abs() <= tol,
                "{t} {isa:?}: {got} vs exact {exact} (tol {tol:e})"
            );
            assert!(
                ((got - scalar) as f64).abs() <= tol,
                "{t} {isa:?}: {got} vs scalar {scalar}"
            );
        }
    }
}
