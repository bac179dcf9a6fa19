//! IQ2_XXS kernels: dequantize and dot against `Q8K` activations (scalar, AVX2, AVX-512).
//!
//! Block (66 bytes, 256 elements, ggml `block_iq2_xxs`): `d` (f16), then 8 groups of 32
//! elements, each two little-endian u32: `aux0` holds four 8-bit grid indices (one per 8
//! elements: `IQ2XXS_GRID` row), `aux1` four 7-bit sign indices (bits 7k..7k+7, through
//! `KSIGNS_IQ2XS`) and a 4-bit scale `ls` (bits 28..32).
//! Value: `((d * (0.5 + ls)) * 0.25) * grid * sign` (gguf's numpy order).
//!
//! Dot: `(0.5 + ls) * 0.25 = (2 ls + 1) / 8`, so a block contributes
//! `d * da / 8 * sum_g (2 ls_g + 1) * <±grid, a>_g`, an exact integer sum.

use super::tables::{IQ2XXS_GRID, KSIGNS_IQ2XS};
use super::{ActFormat, ActRow, TypeKernels};
use crate::dtype::DType;

const BLOCK_BYTES: usize = 66;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::IQ2_XXS,
    act: ActFormat::Q8K,
    dequant,
    dot_scalar,
    dot_avx2: simd::AVX2,
    dot_avx512: simd::AVX512,
});

#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// (aux0, aux1) of group `g` of block `b`.
#[inline]
fn group_words(b: &[u8], g: usize) -> (u32, u32) {
    let at = 2 + 8 * g;
    let w = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    (w(at), w(at + 4))
}

fn dequant(blocks: &[u8], out: &mut [f32]) {
    for (b, y) in blocks.chunks_exact(BLOCK_BYTES).zip(out.chunks_exact_mut(256)) {
        let d = f16_at(b, 0);
        for (g, yg) in y.chunks_exact_mut(32).enumerate() {
            let (aux0, aux1) = group_words(b, g);
            let db = d * (0.5 + (aux1 >> 28) as f32) * 0.25;
            for (k, y8) in yg.chunks_exact_mut(8).enumerate() {
                let grid = IQ2XXS_GRID[((aux0 >> (8 * k)) & 0xff) as usize].to_le_bytes();
                let signs = KSIGNS_IQ2XS[((aux1 >> (7 * k)) & 0x7f) as usize];
                for (c, v) in y8.iter_mut().enumerate() {
                    let s = if (signs >> c) & 1 == 0 { 1.0f32 } else { -1.0 };
                    *v = db * grid[c] as f32 * s;
                }
            }
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a.q8k) {
        let mut isum = 0i32;
        for (g, ag) in q8.qs.chunks_exact(32).enumerate() {
            let (aux0, aux1) = group_words(b, g);
            let mut gi = 0i32;
            for (k, a8) in ag.chunks_exact(8).enumerate() {
                let grid = IQ2XXS_GRID[((aux0 >> (8 * k)) & 0xff) as usize].to_le_bytes();
                let signs = KSIGNS_IQ2XS[((aux1 >> (7 * k)) & 0x7f) as usize];
                for c in 0..8 {
                    let p = grid[c] as i32 * a8[c] as i32;
                    gi += if (signs >> c) & 1 == 0 { p } else { -p };
                }
            }
            isum += (2 * (aux1 >> 28) as i32 + 1) * gi;
        }
        sum += q8.d * f16_at(b, 0) * 0.125 * isum as f32;
    }
    sum
}

#[cfg(not(target_arch = "x86_64"))]
mod simd {
    pub(super) const AVX2: Option<super::super::DotFn> = None;
    pub(super) const AVX512: Option<super::super::DotFn> = None;
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::super::DotFn;
    pub(super) const AVX2: Option<DotFn> = None;
    pub(super) const AVX512: Option<DotFn> = None;
}
