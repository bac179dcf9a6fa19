//! Q4_0: blocks of 32 elements, 18 bytes: `d` (f16), `qs[16]`; element i < 16 is the low nibble
//! of qs[i], element 16 + i the high nibble; value = (nibble - 8) * d.
//!
//! Dots against `Q8_32` activations: exact integer sum per block, scaled by d_w * d_a in f32.

use super::float::f16_le;
use super::{ActFormat, ActRow, BlockQ8_32, TypeKernels};
use crate::dtype::DType;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::Q4_0,
    act: ActFormat::Q8_32,
    dequant,
    dot_scalar,
    #[cfg(target_arch = "x86_64")]
    dot_avx2: Some(x86::dot_avx2),
    #[cfg(target_arch = "x86_64")]
    dot_avx512: Some(x86::dot_avx512),
    #[cfg(not(target_arch = "x86_64"))]
    dot_avx2: None,
    #[cfg(not(target_arch = "x86_64"))]
    dot_avx512: None,
});

const BB: usize = 18;

#[inline]
fn nibble(qs: &[u8], i: usize) -> i32 {
    (if i < 16 { qs[i] & 0x0F } else { qs[i - 16] >> 4 }) as i32 - 8
}

fn dequant(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BB).zip(out.chunks_exact_mut(32)) {
        let d = f16_le(blk);
        for (i, o) in o.iter_mut().enumerate() {
            *o = d * nibble(&blk[2..], i) as f32;
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (blk, ab) in w.chunks_exact(BB).zip(a.q8_32) {
        let sumi: i32 = ab.qs.iter().enumerate().map(|(i, &x)| nibble(&blk[2..], i) * x as i32).sum();
        sum += sumi as f32 * (f16_le(blk) * ab.d);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, hsum_ps256, prefetch};
    use super::{dot_scalar, ActRow, BlockQ8_32, BB};
    use crate::kernels::Isa;
    use std::arch::x86_64::*;

    pub(super) fn dot_avx2(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return dot_scalar(w, a);
        }
        let nb = a.q8_32.len().min(w.len() / BB);
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` holds `nb` whole blocks and
        // `a.q8_32` at least `nb` blocks.
        unsafe { avx2(w.as_ptr(), a.q8_32.as_ptr(), nb) }
    }

    pub(super) fn dot_avx512(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx512.supported() {
            return dot_scalar(w, a);
        }
        let nb = a.q8_32.len().min(w.len() / BB);
        // SAFETY: AVX-512 F/BW/VL/VNNI present (checked above); lengths as in `dot_avx2`.
        unsafe { avx512(w.as_ptr(), a.q8_32.as_ptr(), nb) }
    }

    /// The 32 nibbles of a block as unsigned bytes 0..15, in element order.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles(b: *const u8) -> __m256i {
        let q = _mm_loadu_si128(b.add(2) as *const __m128i);
        let m4 = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(q, m4);
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
        _mm256_set_m128i(hi, lo)
    }

    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2(w: *const u8, a: *const BlockQ8_32, nb: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 2];
        let eight = _mm256_set1_epi8(8);
        let ones = _mm256_set1_epi16(1);
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            let d = _mm256_set1_ps(f16_at(b) * ab.d);
            let qw = _mm256_sub_epi8(nibbles(b), eight);
            let qa = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            // |w| * (a * sign w): unsigned x signed for maddubs; |w| <= 8 cannot saturate.
            let p = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
            let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
            acc[i & 1] = _mm256_fmadd_ps(d, s, acc[i & 1]);
        }
        hsum_ps256(_mm256_add_ps(acc[0], acc[1]))
    }

    /// VNNI: sum(nibble * a) - 8 * sum(a), both with `dpbusd`.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512(w: *const u8, a: *const BlockQ8_32, nb: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 2];
        let zero = _mm256_setzero_si256();
        let eight = _mm256_set1_epi8(8);
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            let d = _mm256_set1_ps(f16_at(b) * ab.d);
            let qa = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            let p = _mm256_dpbusd_epi32(zero, nibbles(b), qa);
            let p = _mm256_sub_epi32(p, _mm256_dpbusd_epi32(zero, eight, qa));
            acc[i & 1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[i & 1]);
        }
        hsum_ps256(_mm256_add_ps(acc[0], acc[1]))
    }
}
