//! MXFP4 kernels: dequantize and dot against `Q8_32` activations (scalar, AVX2, AVX-512).
//!
//! Block (17 bytes, 32 elements, ggml `block_mxfp4`): `e` (E8M0 shared exponent), `qs[16]`
//! (4-bit E2M1 codes: element i < 16 in the low nibble of `qs[i]`, element 16 + i in the high
//! nibble). Codes map through `MXFP4_KVALUES` (the E2M1 values doubled, as integers), so the
//! block scale is half of 2^(e - 127): `2^(e - 128)`. Value: `scale * kvalue` (gguf's numpy).
//!
//! Dot: a block contributes `scale * da * <kvalue, a>`, an exact integer inner product.

use super::tables::MXFP4_KVALUES;
use super::{ActFormat, ActRow, TypeKernels};
use crate::dtype::DType;

const BLOCK_BYTES: usize = 17;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::MXFP4,
    act: ActFormat::Q8_32,
    dequant,
    dot_scalar,
    dot_avx2: simd::AVX2,
    dot_avx512: simd::AVX512,
});

/// Half of the E8M0 scale 2^(e - 127), as gguf's `e8m0_to_fp32_half` builds it from bits.
#[inline]
fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { ((e as u32) - 1) << 23 };
    f32::from_bits(bits)
}

fn dequant(blocks: &[u8], out: &mut [f32]) {
    for (b, y) in blocks.chunks_exact(BLOCK_BYTES).zip(out.chunks_exact_mut(32)) {
        let d = e8m0_half(b[0]);
        let (lo, hi) = y.split_at_mut(16);
        for ((&q, ylo), yhi) in b[1..17].iter().zip(lo).zip(hi) {
            *ylo = d * MXFP4_KVALUES[(q & 0xf) as usize] as f32;
            *yhi = d * MXFP4_KVALUES[(q >> 4) as usize] as f32;
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a.q8_32) {
        let mut isum = 0i32;
        for (i, &q) in b[1..17].iter().enumerate() {
            isum += MXFP4_KVALUES[(q & 0xf) as usize] as i32 * q8.qs[i] as i32;
            isum += MXFP4_KVALUES[(q >> 4) as usize] as i32 * q8.qs[16 + i] as i32;
        }
        sum += e8m0_half(b[0]) * q8.d * isum as f32;
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
