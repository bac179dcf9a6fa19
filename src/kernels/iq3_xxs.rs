//! IQ3_XXS kernels: dequantize and dot against `Q8K` activations (scalar, AVX2).
//!
//! Block (98 bytes, 256 elements, ggml `block_iq3_xxs`): `d` (f16), `qs[64]` (the grid row of
//! each 4 elements, `IQ3XXS_GRID`), then 8 little-endian u32, one per 32-element group g:
//! four 7-bit sign indices (bits 7k..7k+7 for elements 32g+8k..32g+8k+8, through
//! `KSIGNS_IQ2XS`) and a 4-bit scale `ls` (bits 28..32).
//! Value: `((d * (0.5 + ls)) * 0.5) * grid * sign` (gguf's numpy order; every step is exact).
//!
//! Dot: `(0.5 + ls) * 0.5 = (2 ls + 1) / 4`, so a block contributes
//! `d * da / 4 * sum_g (2 ls_g + 1) * <±grid, a>_g`, an exact integer sum.
//! AVX-512 machines run the AVX2 kernel (the dispatcher falls back to it).

use super::float::f16_at;
use super::iq_grids::IQ3XXS_GRID;
use super::tables::KSIGNS_IQ2XS;
use super::{ActFormat, ActRow, Dot4Kernels, TypeKernels};
use crate::dtype::DType;

const BLOCK_BYTES: usize = 98;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::IQ3_XXS,
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

/// The scale-and-signs word of group `g` (< 8).
#[inline]
fn group_word(b: &[u8], g: usize) -> u32 {
    let at = 66 + 4 * g;
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn dequant(blocks: &[u8], out: &mut [f32]) {
    for (b, y) in blocks
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(256))
    {
        let d = f16_at(b, 0);
        for (g, yg) in y.chunks_exact_mut(32).enumerate() {
            let aux = group_word(b, g);
            let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
            for (k, y8) in yg.chunks_exact_mut(8).enumerate() {
                let signs = KSIGNS_IQ2XS[((aux >> (7 * k)) & 0x7f) as usize];
                for (c, v) in y8.iter_mut().enumerate() {
                    let grid = IQ3XXS_GRID[b[2 + 8 * g + 2 * k + c / 4] as usize].to_le_bytes();
                    let sg = if (signs >> c) & 1 == 0 { 1.0f32 } else { -1.0 };
                    *v = db * grid[c % 4] as f32 * sg;
                }
            }
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a.q8k) {
        let mut isum = 0i32;
        for g in 0..8 {
            let aux = group_word(b, g);
            let mut gi = 0i32;
            for k in 0..4 {
                let signs = KSIGNS_IQ2XS[((aux >> (7 * k)) & 0x7f) as usize];
                for c in 0..8 {
                    let grid = IQ3XXS_GRID[b[2 + 8 * g + 2 * k + c / 4] as usize].to_le_bytes();
                    let p = grid[c % 4] as i32 * q8.qs[32 * g + 8 * k + c] as i32;
                    gi += if (signs >> c) & 1 == 0 { p } else { -p };
                }
            }
            isum += (2 * (aux >> 28) as i32 + 1) * gi;
        }
        sum += q8.d * f16_at(b, 0) * 0.25 * isum as f32;
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
    use super::super::iq_grids::IQ3XXS_GRID;
    use super::super::iq_x86::{common_blocks, hsums, rows4, rows8};
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, prefetch};
    use super::super::tables::KSIGNS_IQ2XS_PM1;
    use super::super::{ActRow, BlockQ8K, Dot4Fn, DotFn};
    use super::{group_word, BLOCK_BYTES};
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

    /// Per 32-element group: eight 4-byte grid rows and four sign rows (±1 bytes) from
    /// tables, `maddubs` of magnitudes with sign-applied activations, `madd` with 2ls+1; for
    /// `N` activation rows at once.
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
                let aux = group_word(b, g);
                let grid = rows4(
                    &IQ3XXS_GRID,
                    std::array::from_fn(|i| b[2 + 8 * g + i] as usize),
                );
                let signs = rows8(
                    &KSIGNS_IQ2XS_PM1,
                    std::array::from_fn(|k| ((aux >> (7 * k)) & 0x7f) as usize),
                );
                let ls = _mm256_set1_epi16((2 * (aux >> 28) + 1) as i16);
                for (isum, q8) in isum.iter_mut().zip(&q8) {
                    let x = &q8.qs[32 * g..32 * g + 32];
                    // SAFETY: `x` is 32 bytes.
                    let x = unsafe { _mm256_loadu_si256(x.as_ptr() as *const __m256i) };
                    let p = _mm256_maddubs_epi16(grid, _mm256_sign_epi8(x, signs));
                    *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(p, ls));
                }
            }
            // SAFETY: `b` holds the block's f16 `d` in its first two bytes; F16C is enabled.
            let fd = unsafe { f16_at(b.as_ptr()) };
            for r in 0..N {
                let f = q8[r].d * fd * 0.25;
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(isum[r]), acc[r]);
            }
        }
        hsums(&acc)
    }
}
