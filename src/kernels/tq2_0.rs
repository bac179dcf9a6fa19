//! TQ2_0 (ternary, 2.06 bits): super-blocks of 256 elements, 66 bytes: `qs[64]`, `d` (f16).
//! Element `128 h + 32 n + m` (h < 2, n < 4, m < 32) is `((qs[32 h + m] >> 2 n) & 3) - 1`;
//! value = d * that.
//!
//! Dots against `Q8K` activations: per super-block the exact integer
//! `sum(code * a) - sum(a)` (codes 0..=3 before the -1; `sum(a)` from the block's `bsums`),
//! scaled by d * d_a. The four-row dots (prefill) are `ternary.rs`'s loop on this file's codes.

use super::float::f16_le;
#[cfg(target_arch = "x86_64")]
use super::ternary::x86 as tx86;
use super::ternary::Ternary;
use super::{ActFormat, ActRow, Dot4Kernels, TypeKernels};
use crate::dtype::DType;

const BB: usize = 66;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::TQ2_0,
    act: ActFormat::Q8K,
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

/// Four-row dots (prefill), each row with the single-row dot's bits.
pub(super) const DOT4: Dot4Kernels = Dot4Kernels {
    #[cfg(target_arch = "x86_64")]
    avx2: Some(tx86::dot4_avx2::<Tq2_0>),
    #[cfg(target_arch = "x86_64")]
    avx512: Some(tx86::dot4_avx512::<Tq2_0>),
    #[cfg(not(target_arch = "x86_64"))]
    avx2: None,
    #[cfg(not(target_arch = "x86_64"))]
    avx512: None,
};

pub(super) struct Tq2_0;

impl Ternary for Tq2_0 {
    const BB: usize = BB;
    const D_AT: usize = 64;

    fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
        dot_scalar(w, a)
    }

    /// Code vector `4 h + n` is the 2-bit field n of the 32 bytes `qs[32 h..]` (as `x86::avx2`).
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn for_codes(b: *const u8, mut f: impl FnMut(usize, std::arch::x86_64::__m256i)) {
        use std::arch::x86_64::*;
        let m3 = _mm256_set1_epi8(3);
        for h in 0..2 {
            let q = _mm256_loadu_si256(b.add(32 * h) as *const __m256i);
            for n in 0..4 {
                let c = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * n)), m3);
                f(128 * h + 32 * n as usize, c);
            }
        }
    }
}

/// Unsigned code (0..=3) of element `i` of the block at the start of `b`.
#[inline]
fn code(b: &[u8], i: usize) -> u8 {
    let (h, n, m) = (i / 128, (i / 32) % 4, i % 32);
    (b[32 * h + m] >> (2 * n)) & 3
}

fn dequant(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BB).zip(out.chunks_exact_mut(256)) {
        let d = f16_le(&blk[64..]);
        for (i, o) in o.iter_mut().enumerate() {
            *o = d * (code(blk, i) as i32 - 1) as f32;
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (blk, ab) in w.chunks_exact(BB).zip(a.q8k) {
        let isum: i32 = (0..256)
            .map(|i| code(blk, i) as i32 * ab.qs[i] as i32)
            .sum();
        let asum: i32 = ab.bsums.iter().map(|&s| s as i32).sum();
        sum += f16_le(&blk[64..]) * ab.d * (isum - asum) as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, hsum_ps256, prefetch};
    use super::{dot_scalar, ActRow, BB};
    use crate::kernels::{BlockQ8K, Isa};
    use std::arch::x86_64::*;

    pub(super) fn dot_avx2(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return dot_scalar(w, a);
        }
        let nb = a.q8k.len().min(w.len() / BB);
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` holds `nb` whole blocks and
        // `a.q8k` at least `nb` blocks.
        unsafe { avx2(w.as_ptr(), a.q8k.as_ptr(), nb) }
    }

    pub(super) fn dot_avx512(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx512.supported() {
            return dot_scalar(w, a);
        }
        let nb = a.q8k.len().min(w.len() / BB);
        // SAFETY: AVX-512 F/BW/VL/VNNI present (checked above); lengths as in `dot_avx2`.
        unsafe { avx512(w.as_ptr(), a.q8k.as_ptr(), nb) }
    }

    /// sum(a) of a block from its 16 `bsums`, as 8 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn bsum_lanes(ab: &BlockQ8K) -> __m256i {
        let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
        _mm256_madd_epi16(bs, _mm256_set1_epi16(1))
    }

    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2(w: *const u8, a: *const BlockQ8K, nb: usize) -> f32 {
        let m3 = _mm256_set1_epi8(3);
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            let x = ab.qs.as_ptr();
            // Codes <= 3 and |a| <= 127: eight maddubs pair sums stay within i16.
            let mut p16 = _mm256_setzero_si256();
            for h in 0..2 {
                let q = _mm256_loadu_si256(b.add(32 * h) as *const __m256i);
                for n in 0..4 {
                    let c = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * n)), m3);
                    let xa = _mm256_loadu_si256(x.add(128 * h + 32 * n as usize) as *const __m256i);
                    p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(c, xa));
                }
            }
            let s = _mm256_sub_epi32(_mm256_madd_epi16(p16, ones), bsum_lanes(ab));
            let d = _mm256_set1_ps(f16_at(b.add(64)) * ab.d);
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc);
        }
        hsum_ps256(acc)
    }

    /// As `avx2`, with VNNI `dpbusd` for the code x activation sums.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + AVX2/FMA/F16C; `w` valid for `nb` blocks, `a` for `nb`
    /// activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512(w: *const u8, a: *const BlockQ8K, nb: usize) -> f32 {
        let m3 = _mm256_set1_epi8(3);
        let mut acc = _mm256_setzero_ps();
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            let x = ab.qs.as_ptr();
            let mut s = _mm256_setzero_si256();
            for h in 0..2 {
                let q = _mm256_loadu_si256(b.add(32 * h) as *const __m256i);
                for n in 0..4 {
                    let c = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * n)), m3);
                    let xa = _mm256_loadu_si256(x.add(128 * h + 32 * n as usize) as *const __m256i);
                    s = _mm256_dpbusd_epi32(s, c, xa);
                }
            }
            let s = _mm256_sub_epi32(s, bsum_lanes(ab));
            let d = _mm256_set1_ps(f16_at(b.add(64)) * ab.d);
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc);
        }
        hsum_ps256(acc)
    }
}
