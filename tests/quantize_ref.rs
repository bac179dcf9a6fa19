//! sluice's quantizers for the 32-element types (`src/kernels/quantize.rs`, used by
//! `sluice synth --quant`) against the `gguf` Python package: for Q5_0, Q4_1, Q5_1 and MXFP4 the bytes
//! must equal what `gguf.quants.quantize` writes for the same f32 input (llama.cpp's reference
//! quantizers); IQ4_NL (no quantizer in gguf) must decode, through the dequantizer that is
//! bit-identical to gguf's, close to its input. Fixtures from scripts/make_quant_fixtures.py.

use sluice::dtype::DType;
use sluice::kernels::{self, quantize::quantize};
use std::path::PathBuf;

fn fixture(name: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/quant")
        .join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn input() -> Vec<f32> {
    fixture("quantize_in.f32")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn quantizers_write_ggufs_bytes() {
    let x = input();
    for t in [DType::Q5_0, DType::Q4_1, DType::Q5_1, DType::MXFP4] {
        let want = fixture(&format!("{}.quantized", t.name()));
        let mut got = Vec::new();
        quantize(t, &x, &mut got).unwrap();
        assert_eq!(got.len(), want.len(), "{t}: length");
        let bb = t.block_geometry().unwrap().1;
        for (b, (g, w)) in got.chunks(bb).zip(want.chunks(bb)).enumerate() {
            assert_eq!(g, w, "{t}: block {b}");
        }
    }
}

#[test]
fn iq4_nl_quantizer_round_trips_closely() {
    let x = input();
    let mut q = Vec::new();
    quantize(DType::IQ4_NL, &x, &mut q).unwrap();
    let mut y = vec![0f32; x.len()];
    kernels::dequantize(DType::IQ4_NL, &q, &mut y).unwrap();
    for (b, (xb, yb)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
        let e: f64 = xb
            .iter()
            .zip(yb)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let n: f64 = xb.iter().map(|a| (*a as f64).powi(2)).sum();
        // 4-bit non-linear codebook: well under 10% relative RMS error per block (ggml's own
        // search gets ~8-9% on Gaussian data; the all-zero block must decode to zeros).
        assert!(
            e <= 0.015 * n,
            "block {b}: relative squared error {}",
            e / n.max(1e-30)
        );
    }
}
