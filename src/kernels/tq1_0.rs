//! TQ1_0 (ternary, 1.69 bits): super-blocks of 256 elements, 54 bytes: `qs[48]`, `qh[4]`,
//! `d` (f16). Each byte packs five (qh: four) base-3 digits as a fixed-point fraction: digit n
//! of byte v is `((v * 3^n mod 256) * 3) >> 8` (0..=2), value = d * (digit - 1).
//! Element order (as `gguf.quants.TQ1_0`): element `32 n + m` is digit n of qs[m] (m < 32,
//! n < 5); `160 + 16 n + m` digit n of qs[32 + m] (m < 16, n < 5); `240 + 4 n + m` digit n of
//! qh[m] (m < 4, n < 4).
//!
//! Dots against `Q8K` activations: per super-block the exact integer
//! `sum(digit * a) - sum(a)` (`sum(a)` from the block's `bsums`), scaled by d * d_a. The
//! four-row dots (prefill) are `ternary.rs`'s loop on this file's digits.

use super::float::f16_le;
#[cfg(target_arch = "x86_64")]
use super::ternary::x86 as tx86;
use super::ternary::Ternary;
use super::{ActFormat, ActRow, Dot4Kernels, TypeKernels};
use crate::dtype::DType;

const BB: usize = 54;
const POW3: [u8; 5] = [1, 3, 9, 27, 81];

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::TQ1_0,
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
    avx2: Some(tx86::dot4_avx2::<Tq1_0>),
    #[cfg(target_arch = "x86_64")]
    avx512: Some(tx86::dot4_avx512::<Tq1_0>),
    #[cfg(not(target_arch = "x86_64"))]
    avx2: None,
    #[cfg(not(target_arch = "x86_64"))]
    avx512: None,
};

pub(super) struct Tq1_0;

impl Ternary for Tq1_0 {
    const BB: usize = BB;
    const D_AT: usize = 52;

    fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
        dot_scalar(w, a)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn for_codes(b: *const u8, f: impl FnMut(usize, std::arch::x86_64::__m256i)) {
        x86::for_digits(b, f)
    }
}

/// Digit `n` of byte `v`.
#[inline]
fn digit(v: u8, n: usize) -> u8 {
    ((v.wrapping_mul(POW3[n]) as u16 * 3) >> 8) as u8
}

/// The 256 digits (0..=2) of the block at the start of `b`, in element order.
fn digits(b: &[u8]) -> [u8; 256] {
    std::array::from_fn(|i| {
        if i < 160 {
            digit(b[i % 32], i / 32)
        } else if i < 240 {
            let k = i - 160;
            digit(b[32 + k % 16], k / 16)
        } else {
            let k = i - 240;
            digit(b[48 + k % 4], k / 4)
        }
    })
}

fn dequant(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BB).zip(out.chunks_exact_mut(256)) {
        let d = f16_le(&blk[52..]);
        for (o, &q) in o.iter_mut().zip(digits(blk).iter()) {
            *o = d * (q as i32 - 1) as f32;
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (blk, ab) in w.chunks_exact(BB).zip(a.q8k) {
        let isum: i32 = digits(blk)
            .iter()
            .zip(&ab.qs)
            .map(|(&q, &x)| q as i32 * x as i32)
            .sum();
        let asum: i32 = ab.bsums.iter().map(|&s| s as i32).sum();
        sum += f16_le(&blk[52..]) * ab.d * (isum - asum) as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, hsum_ps256, prefetch};
    use super::{dot_scalar, ActRow, BB, POW3};
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

    /// Per byte: `((q * p mod 256) * 3) >> 8`, the base-3 digit that multiplier `p` selects.
    /// Even and odd bytes go through separate 16-bit lanes so no product spills across.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn digits(q: __m256i, p: __m256i) -> __m256i {
        let lo = _mm256_set1_epi16(0x00FF);
        let three = _mm256_set1_epi16(3);
        let e = _mm256_and_si256(
            _mm256_mullo_epi16(_mm256_and_si256(q, lo), _mm256_and_si256(p, lo)),
            lo,
        );
        let e = _mm256_srli_epi16(_mm256_mullo_epi16(e, three), 8);
        let o = _mm256_and_si256(
            _mm256_mullo_epi16(_mm256_srli_epi16(q, 8), _mm256_srli_epi16(p, 8)),
            lo,
        );
        let o = _mm256_andnot_si256(lo, _mm256_mullo_epi16(o, three));
        _mm256_or_si256(e, o)
    }

    /// The eight 32-digit vectors of a block, in element order, handed to `f` with their
    /// activation offsets.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn for_digits(b: *const u8, mut f: impl FnMut(usize, __m256i)) {
        let q0 = _mm256_loadu_si256(b as *const __m256i);
        for (n, &p) in POW3.iter().enumerate() {
            f(32 * n, digits(q0, _mm256_set1_epi8(p as i8)));
        }
        let q1 = _mm_loadu_si128(b.add(32) as *const __m128i);
        let qh = _mm_set1_epi32(std::ptr::read_unaligned(b.add(48) as *const i32));
        let pair = |a: i8, c: i8| _mm256_set_m128i(_mm_set1_epi8(c), _mm_set1_epi8(a));
        f(160, digits(_mm256_set_m128i(q1, q1), pair(1, 3)));
        f(192, digits(_mm256_set_m128i(q1, q1), pair(9, 27)));
        let p_tail = _mm256_set_m128i(
            _mm_set_epi32(0x1b1b_1b1b, 0x0909_0909, 0x0303_0303, 0x0101_0101),
            _mm_set1_epi8(81),
        );
        f(224, digits(_mm256_set_m128i(qh, q1), p_tail));
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
        let mut acc = _mm256_setzero_ps();
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            let x = ab.qs.as_ptr();
            // Digits <= 2, |a| <= 127: eight maddubs pair sums stay within i16.
            let mut p16 = _mm256_setzero_si256();
            for_digits(b, |off, c| {
                let xa = _mm256_loadu_si256(x.add(off) as *const __m256i);
                p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(c, xa));
            });
            let s = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
            let s = _mm256_sub_epi32(s, bsum_lanes(ab));
            let d = _mm256_set1_ps(f16_at(b.add(52)) * ab.d);
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc);
        }
        hsum_ps256(acc)
    }

    /// As `avx2`, with VNNI `dpbusd` for the digit x activation sums.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + AVX2/FMA/F16C; `w` valid for `nb` blocks, `a` for `nb`
    /// activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512(w: *const u8, a: *const BlockQ8K, nb: usize) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            let x = ab.qs.as_ptr();
            let mut s = _mm256_setzero_si256();
            for_digits(b, |off, c| {
                let xa = _mm256_loadu_si256(x.add(off) as *const __m256i);
                s = _mm256_dpbusd_epi32(s, c, xa);
            });
            let s = _mm256_sub_epi32(s, bsum_lanes(ab));
            let d = _mm256_set1_ps(f16_at(b.add(52)) * ab.d);
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc);
        }
        hsum_ps256(acc)
    }
}
