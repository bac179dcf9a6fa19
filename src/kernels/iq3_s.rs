//! IQ3_S kernels: dequantize and dot against `Q8K` activations (scalar, AVX2).
//!
//! Block (110 bytes, 256 elements, ggml `block_iq3_s`): `d` (f16), `qs[64]` (low 8 bits of the
//! grid row of each 4 elements, `IQ3S_GRID`), `qh[8]` (bit i % 8 of byte i / 8: bit 8 of row
//! i's index), `signs[32]` (bit j % 8 of byte j / 8: element j negative), `scales[4]` (nibble
//! g, low first: the scale s of 32-element group g).
//! Value: `(d * (1 + 2s)) * grid * sign` (gguf's numpy order; every step is exact).
//!
//! Dot: a block contributes `d * da * sum_g (2 s_g + 1) * <±grid, a>_g`, an exact integer sum.
//! AVX-512 machines run the AVX2 kernel (the dispatcher falls back to it).

use super::float::f16_at;
use super::iq_grids::IQ3S_GRID;
use super::{ActFormat, ActRow, Dot4Kernels, TypeKernels};
use crate::dtype::DType;

const BLOCK_BYTES: usize = 110;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::IQ3_S,
    act: ActFormat::Q8K,
    dequant,
    dot_scalar,
    dot_avx2: simd::AVX2,
    dot_avx512: None,
});

/// Four-row dots (prefill), each row with the single-row dot's bits; AVX-512 machines run these
/// AVX2 ones as they do the single-row dot.
pub(super) const DOT4: Dot4Kernels = Dot4Kernels {
    avx2: simd::DOT4,
    avx512: None,
};

/// Grid row of 4-element row `i` (< 64).
#[inline]
fn grid_row(b: &[u8], i: usize) -> usize {
    b[2 + i] as usize | (((b[66 + i / 8] >> (i % 8)) & 1) as usize) << 8
}

/// Whether element `j` (< 256) is negative.
#[inline]
fn negative(b: &[u8], j: usize) -> bool {
    (b[74 + j / 8] >> (j % 8)) & 1 != 0
}

/// Scale nibble of group `g` (< 8).
#[inline]
fn scale(b: &[u8], g: usize) -> u32 {
    ((b[106 + g / 2] >> (4 * (g % 2))) & 0xf) as u32
}

fn dequant(blocks: &[u8], out: &mut [f32]) {
    for (b, y) in blocks
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(256))
    {
        let d = f16_at(b, 0);
        for (j, v) in y.iter_mut().enumerate() {
            let db = d * (1 + 2 * scale(b, j / 32)) as f32;
            let grid = IQ3S_GRID[grid_row(b, j / 4)].to_le_bytes()[j % 4];
            let sg = if negative(b, j) { -1.0f32 } else { 1.0 };
            *v = db * grid as f32 * sg;
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a.q8k) {
        let mut isum = 0i32;
        for g in 0..8 {
            let mut gi = 0i32;
            for j in 32 * g..32 * g + 32 {
                let grid = IQ3S_GRID[grid_row(b, j / 4)].to_le_bytes()[j % 4];
                let p = grid as i32 * q8.qs[j] as i32;
                gi += if negative(b, j) { -p } else { p };
            }
            isum += (2 * scale(b, g) as i32 + 1) * gi;
        }
        sum += q8.d * f16_at(b, 0) * isum as f32;
    }
    sum
}

#[cfg(not(target_arch = "x86_64"))]
mod simd {
    pub(super) const AVX2: Option<super::super::DotFn> = None;
    pub(super) const DOT4: Option<super::super::Dot4Fn> = None;
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::super::iq_grids::IQ3S_GRID;
    use super::super::iq_x86::{common_blocks, hsums, rows4, signs_pm1};
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, prefetch};
    use super::super::{ActRow, BlockQ8K, Dot4Fn, DotFn};
    use super::{scale, BLOCK_BYTES};
    use crate::kernels::Isa;
    use std::arch::x86_64::*;

    pub(super) const AVX2: Option<DotFn> = Some(dot_avx2);
    pub(super) const DOT4: Option<Dot4Fn> = Some(dot4_avx2);

    fn dot_avx2(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return super::dot_scalar(w, a);
        }
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        unsafe { dot_avx2_impl::<1>(w, [a.q8k])[0] }
    }

    /// Four activation rows: the grid rows, signs and scales of each group are made once; per
    /// row the arithmetic is the single-row dot's, so each row gets its bits.
    fn dot4_avx2(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !Isa::Avx2.supported() {
            *out = std::array::from_fn(|r| super::dot_scalar(w, &a[r]));
            return;
        }
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        *out = unsafe { dot_avx2_impl::<4>(w, [a[0].q8k, a[1].q8k, a[2].q8k, a[3].q8k]) };
    }

    /// Per 32-element group: eight 4-byte grid rows from the table, the group's 32 sign bits
    /// as ±1 bytes, `maddubs` of magnitudes with sign-applied activations, `madd` with 2s+1;
    /// for `N` activation rows at once.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_avx2_impl<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
        let mut acc = [_mm256_setzero_ps(); N];
        let pf = prefetch_distance();
        let nb = common_blocks(w, BLOCK_BYTES, &a);
        for (i, b) in w.chunks_exact(BLOCK_BYTES).take(nb).enumerate() {
            prefetch(b.as_ptr(), pf, BLOCK_BYTES);
            let q8: [&BlockQ8K; N] = std::array::from_fn(|r| &a[r][i]);
            let mut isum = [_mm256_setzero_si256(); N];
            for g in 0..8 {
                let qh = b[66 + g] as usize;
                let rows =
                    std::array::from_fn(|i| b[2 + 8 * g + i] as usize | ((qh >> i) & 1) << 8);
                let grid = rows4(&IQ3S_GRID, rows);
                let bits = u32::from_le_bytes(b[74 + 4 * g..78 + 4 * g].try_into().expect("4"));
                let signs = signs_pm1(bits);
                let s = _mm256_set1_epi16((2 * scale(b, g) + 1) as i16);
                for (isum, q8) in isum.iter_mut().zip(&q8) {
                    let x = &q8.qs[32 * g..32 * g + 32];
                    // SAFETY: `x` is 32 bytes.
                    let x = unsafe { _mm256_loadu_si256(x.as_ptr() as *const __m256i) };
                    let p = _mm256_maddubs_epi16(grid, _mm256_sign_epi8(x, signs));
                    *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(p, s));
                }
            }
            // SAFETY: `b` holds the block's f16 `d` in its first two bytes; F16C is enabled.
            let fd = unsafe { f16_at(b.as_ptr()) };
            for r in 0..N {
                let f = q8[r].d * fd;
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(isum[r]), acc[r]);
            }
        }
        hsums(&acc)
    }
}
