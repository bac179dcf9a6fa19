//! Q8_0: blocks of 32 elements, 34 bytes: `d` (f16), `qs[32]` (i8); value = qs[i] * d.
//!
//! Dots against `Q8_32` activations: per block an exact integer sum of qs_w * qs_a, scaled by
//! d_w * d_a in f32 (ggml's `ggml_vec_dot_q8_0_q8_0` order).

use super::float::f16_le;
use super::{ActFormat, ActRow, BlockQ8_32, TypeKernels};
use crate::dtype::DType;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::Q8_0,
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

const BB: usize = 34;

fn dequant(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BB).zip(out.chunks_exact_mut(32)) {
        let d = f16_le(blk);
        for (o, &q) in o.iter_mut().zip(&blk[2..]) {
            *o = (q as i8) as f32 * d;
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (blk, ab) in w.chunks_exact(BB).zip(a.q8_32) {
        let sumi: i32 = blk[2..].iter().zip(&ab.qs).map(|(&q, &x)| (q as i8) as i32 * x as i32).sum();
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

    /// Integer dot of one block as 8 i32 lanes: sign trick (|w| * (a * sign w)) so `maddubs`
    /// (unsigned x signed) applies; |w| <= 128 and |a| <= 127 cannot saturate the i16 pairs.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn block_dot(qw: __m256i, qa: __m256i) -> __m256i {
        let p = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    }

    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2(w: *const u8, a: *const BlockQ8_32, nb: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 2];
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            let d = _mm256_set1_ps(f16_at(b) * ab.d);
            let qw = _mm256_loadu_si256(b.add(2) as *const __m256i);
            let qa = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            let s = _mm256_cvtepi32_ps(block_dot(qw, qa));
            acc[i & 1] = _mm256_fmadd_ps(d, s, acc[i & 1]);
        }
        hsum_ps256(_mm256_add_ps(acc[0], acc[1]))
    }

    /// Same as `avx2`, with VNNI's `dpbusd` doing the multiply-add in one instruction.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512(w: *const u8, a: *const BlockQ8_32, nb: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 2];
        let zero = _mm256_setzero_si256();
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            let d = _mm256_set1_ps(f16_at(b) * ab.d);
            let qw = _mm256_loadu_si256(b.add(2) as *const __m256i);
            let qa = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            let neg = _mm256_movepi8_mask(qw);
            let sa = _mm256_mask_sub_epi8(qa, neg, zero, qa);
            let p = _mm256_dpbusd_epi32(zero, _mm256_abs_epi8(qw), sa);
            acc[i & 1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[i & 1]);
        }
        hsum_ps256(_mm256_add_ps(acc[0], acc[1]))
    }
}
