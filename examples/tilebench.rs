//! Q4_K (or Q6_K / Q8_0) dot kernels compute-bound: 64 L2-resident weight rows of 2048 columns
//! against 4 activation rows, single-row dot vs four-row dot vs 8x4 tile, interleaved in one
//! process, best of 30 x 50 passes, in GMAC/s, beside the `maddubs` throughput of one core.
//!
//! `cargo run --release --features cuda --example tilebench -- Q4_K avx2 [COLS]` (ISA: avx2 or
//! avx512, capped at what the CPU has; COLS default 2048). Figures: docs/PERFORMANCE.md (issue 16).
use sluice::dtype::DType;
use sluice::kernels::{self, Acts, Isa};
use std::time::Instant;

fn main() {
    peak();
    let t = match std::env::args().nth(1).as_deref() {
        Some("Q6_K") => DType::Q6_K,
        Some("Q8_0") => DType::Q8_0,
        _ => DType::Q4_K,
    };
    let cols: usize = std::env::args()
        .nth(3)
        .and_then(|c| c.parse().ok())
        .unwrap_or(2048);
    let rows = 64usize;
    let (be, bb) = t.block_geometry().unwrap();
    let rb = cols / be * bb;
    let mut s = 12345u64;
    let mut w = vec![0u8; rows * rb];
    for b in w.iter_mut() {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *b = (s >> 33) as u8;
    }
    // sane f16 scales
    for blk in w.chunks_exact_mut(bb) {
        match t {
            DType::Q4_K => {
                blk[0..2].copy_from_slice(&[0, 0x20]);
                blk[2..4].copy_from_slice(&[0, 0x20]);
            }
            DType::Q6_K => {
                blk[208..210].copy_from_slice(&[0, 0x20]);
            }
            _ => {
                blk[0..2].copy_from_slice(&[0, 0x20]);
            }
        }
    }
    let x: Vec<f32> = (0..4 * cols)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let mut acts = Acts::new();
    acts.load(&x, 4, cols);
    acts.prepare(kernels::kernels_for(t).unwrap().act);
    let a = [acts.row(0), acts.row(1), acts.row(2), acts.row(3)];
    let isa = match std::env::args().nth(2).as_deref() {
        Some("avx512") => Isa::Avx512,
        _ => Isa::Avx2,
    };
    let dot = kernels::dot_fn(t, isa).unwrap();
    let dot4 = kernels::dot4_fn(t, isa);
    let tile = kernels::tile_fn(t, isa);
    let macs = (rows * cols * 4) as f64;
    let passes = 50;
    let mut best = [f64::MAX; 5];
    let mut sink = 0.0f32;
    for _round in 0..30 {
        // single
        let t0 = Instant::now();
        for _ in 0..passes {
            for r in 0..rows {
                for a in &a {
                    sink += dot(&w[r * rb..(r + 1) * rb], a);
                }
            }
        }
        best[0] = best[0].min(t0.elapsed().as_secs_f64());
        if let Some(d4) = dot4 {
            let t0 = Instant::now();
            let mut o = [0.0f32; 4];
            for _ in 0..passes {
                for r in 0..rows {
                    d4(&w[r * rb..(r + 1) * rb], &a, &mut o);
                    sink += o[0];
                }
            }
            best[1] = best[1].min(t0.elapsed().as_secs_f64());
        }
        if let Some(tl) = tile {
            let t0 = Instant::now();
            let mut o = [[0.0f32; 8]; 8];
            for _ in 0..passes {
                for r in (0..rows).step_by(8) {
                    tl(&w[r * rb..(r + 8) * rb], rb, &a, &mut o);
                    sink += o[0][0];
                }
            }
            best[2] = best[2].min(t0.elapsed().as_secs_f64());
            // Fewer activation rows (the same work counted per activation row): 8x1 and 8x2.
            for (slot, n) in [(3, 1), (4, 2)] {
                let t0 = Instant::now();
                for _ in 0..passes * 4 / n {
                    for r in (0..rows).step_by(8) {
                        tl(&w[r * rb..(r + 8) * rb], rb, &a[..n], &mut o);
                        sink += o[0][0];
                    }
                }
                best[slot] = best[slot].min(t0.elapsed().as_secs_f64());
            }
        }
    }
    std::hint::black_box(sink);
    for (n, b) in ["single", "four-row", "tile8x4", "tile8x1", "tile8x2"]
        .iter()
        .zip(best)
    {
        println!(
            "{t} {isa:?} {n:10} {:.2} GMAC/s",
            macs * passes as f64 / b / 1e9
        );
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn maddubs_peak(n: usize) -> i32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_set1_epi16(1); 8];
    let w = _mm256_set1_epi8(3);
    for _ in 0..n {
        for a in acc.iter_mut() {
            *a = _mm256_maddubs_epi16(w, *a);
        }
    }
    let mut s = _mm256_setzero_si256();
    for a in acc {
        s = _mm256_add_epi16(s, a);
    }
    _mm256_extract_epi16(s, 0)
}

pub fn peak() {
    if Isa::hardware() < Isa::Avx2 {
        return;
    }
    let n = 1_000_000;
    let mut best = f64::MAX;
    for _ in 0..20 {
        let t0 = Instant::now();
        // SAFETY: AVX2 checked above.
        std::hint::black_box(unsafe { maddubs_peak(n) });
        best = best.min(t0.elapsed().as_secs_f64());
    }
    println!(
        "maddubs peak: {:.2} G maddubs/s = {:.1} GMAC/s",
        8.0 * n as f64 / best / 1e9,
        8.0 * n as f64 * 32.0 / best / 1e9
    );
}
