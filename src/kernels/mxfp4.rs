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
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        ((e as u32) - 1) << 23
    };
    f32::from_bits(bits)
}

fn dequant(blocks: &[u8], out: &mut [f32]) {
    for (b, y) in blocks
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(32))
    {
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
    use super::super::simd::x86::{hsum256, ld128, ld256};
    use super::super::tables::MXFP4_KVALUES;
    use super::super::{ActRow, BlockQ8_32, DotFn};
    use super::{e8m0_half, BLOCK_BYTES};
    use crate::kernels::Isa;
    use std::arch::x86_64::*;

    pub(super) const AVX2: Option<DotFn> = Some(dot_avx2);
    pub(super) const AVX512: Option<DotFn> = Some(dot_avx512);

    /// Bytes ahead of the current block to prefetch into L1 (weights stream from DRAM).
    const PREFETCH: usize = 1024;

    fn dot_avx2(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return super::dot_scalar(w, a);
        }
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        unsafe { dot_avx2_impl(w, a.q8_32) }
    }

    fn dot_avx512(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx512.supported() {
            return dot_avx2(w, a);
        }
        // SAFETY: the CPU has AVX-512 F/BW/VL/VNNI and AVX2/FMA (checked just above).
        unsafe { dot_avx512_impl(w, a.q8_32) }
    }

    /// The 16 kvalues as a vector (a `pshufb` table).
    #[target_feature(enable = "avx2,fma,f16c")]
    fn kvalues() -> __m128i {
        ld128(&MXFP4_KVALUES)
    }

    /// Codes of one block as 32 bytes: element i < 16 from the low nibble of qs[i], 16 + i
    /// from the high nibble.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn codes(b: &[u8]) -> __m256i {
        let q = ld128(&b[1..17]);
        let m4 = _mm_set1_epi8(0x0f);
        _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16::<4>(q), m4),
            _mm_and_si128(q, m4),
        )
    }

    /// AVX2: one block (32 elements) per step: codes -> values with `pshufb`, signed x signed
    /// product as `maddubs(|v|, sign(x, v))`.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_avx2_impl(w: &[u8], a: &[BlockQ8_32]) -> f32 {
        let kv = _mm256_broadcastsi128_si256(kvalues());
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a) {
            _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().wrapping_add(PREFETCH) as *const i8);
            let v = _mm256_shuffle_epi8(kv, codes(b));
            let x = ld256(&q8.qs);
            let p = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(x, v));
            let isum = _mm256_madd_epi16(p, ones);
            acc = _mm256_fmadd_ps(
                _mm256_set1_ps(e8m0_half(b[0]) * q8.d),
                _mm256_cvtepi32_ps(isum),
                acc,
            );
        }
        hsum256(acc)
    }

    /// AVX-512: two blocks (64 elements) per step: |value| by `pshufb` on the low 3 code bits,
    /// sign (code bit 3) applied to the activations by a masked subtract, `vpdpbusd`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn dot_avx512_impl(w: &[u8], a: &[BlockQ8_32]) -> f32 {
        let kv = kvalues();
        let kabs = _mm512_broadcast_i32x4(_mm_abs_epi8(kv));
        let bit3 = _mm512_set1_epi8(0x08);
        let mut acc = _mm512_setzero_ps();
        let mut pairs = w.chunks_exact(2 * BLOCK_BYTES).zip(a.chunks_exact(2));
        for (bb, qq) in pairs.by_ref() {
            _mm_prefetch::<_MM_HINT_T0>(bb.as_ptr().wrapping_add(PREFETCH) as *const i8);
            let (b0, b1) = bb.split_at(BLOCK_BYTES);
            let c = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(codes(b0)), codes(b1));
            let v = _mm512_shuffle_epi8(kabs, c);
            let x =
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ld256(&qq[0].qs)), ld256(&qq[1].qs));
            let x =
                _mm512_mask_sub_epi8(x, _mm512_test_epi8_mask(c, bit3), _mm512_setzero_si512(), x);
            let isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, x);
            let f0 = _mm512_set1_ps(e8m0_half(b0[0]) * qq[0].d);
            let f = _mm512_mask_mov_ps(f0, 0xff00, _mm512_set1_ps(e8m0_half(b1[0]) * qq[1].d));
            acc = _mm512_fmadd_ps(f, _mm512_cvtepi32_ps(isum), acc);
        }
        let mut sum = _mm512_reduce_add_ps(acc);
        // An odd last block.
        let rest = w.len() / BLOCK_BYTES % 2;
        if rest == 1 {
            let nb = w.len() / BLOCK_BYTES;
            sum += dot_avx2_impl(&w[(nb - 1) * BLOCK_BYTES..], &a[nb - 1..]);
        }
        sum
    }
}
