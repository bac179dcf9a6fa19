//! AVX2 building blocks shared by the grid i-quant kernels (IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
//! IQ1_S, IQ1_M): grid rows gathered into a vector, sign bits turned into ±1 bytes, per-16
//! scale vectors. Owns no type's layout; each kernel file says which pieces it uses.
//!
//! Invariant: every function here is `#[target_feature(enable = "avx2")]` (or inlined into such
//! a kernel) and safe to call from kernels compiled with AVX2; callers check the CPU first.

use std::arch::x86_64::*;

/// Grid rows `r0..r3` of an 8-byte-per-row table as one vector (row k in qword k).
#[inline(always)]
pub(super) fn rows8(t: &[u64], r: [usize; 4]) -> __m256i {
    // SAFETY: AVX is implied by the callers' `avx2` target feature (this is inlined into them).
    unsafe {
        _mm256_set_epi64x(
            t[r[3]] as i64,
            t[r[2]] as i64,
            t[r[1]] as i64,
            t[r[0]] as i64,
        )
    }
}

/// Grid rows of a 4-byte-per-row table as one vector (row k in dword k).
#[inline(always)]
pub(super) fn rows4(t: &[u32], r: [usize; 8]) -> __m256i {
    // SAFETY: as `rows8`.
    unsafe {
        _mm256_set_epi32(
            t[r[7]] as i32,
            t[r[6]] as i32,
            t[r[5]] as i32,
            t[r[4]] as i32,
            t[r[3]] as i32,
            t[r[2]] as i32,
            t[r[1]] as i32,
            t[r[0]] as i32,
        )
    }
}

/// The 32 sign bits `bits` (bit j: element j negative) as bytes +1 / -1.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn signs_pm1(bits: u32) -> __m256i {
    // Byte j <- byte j / 8 of `bits`, then test bit j % 8.
    let spread = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0,
    );
    let bit = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
    let v = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), spread);
    let neg = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    _mm256_or_si256(neg, _mm256_set1_epi8(1))
}

/// Sixteen per-16-element scales (bytes, in element order) held in `s`; returns, for 32-element
/// group `g`, scale `2g` in the eight i16 of the low lane and `2g + 1` in the high lane (the
/// layout `_mm256_maddubs_epi16` leaves its sums in).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn scale_pair(s: __m256i, g: usize) -> __m256i {
    // Byte pairs (2g, 0x80) in the low lane and (2g + 1, 0x80) in the high lane: i16 = scale.
    let lo = (2 * g as i16) | (0x80u8 as i8 as i16) << 8;
    let hi = lo + 1;
    let ctrl = _mm256_set_epi16(
        hi, hi, hi, hi, hi, hi, hi, hi, lo, lo, lo, lo, lo, lo, lo, lo,
    );
    _mm256_shuffle_epi8(s, ctrl)
}

/// `<w, x>` per pair of bytes for signed weights `w` (|w| <= 127) and signed activations `x`
/// (|x| <= 127): `maddubs(|w|, sign(x, w))`, 16 i16 sums of two products each.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn mul_signed(w: __m256i, x: __m256i) -> __m256i {
    _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
}

/// The number of whole `bb`-byte blocks of `w` that every activation row of `a` also holds.
#[inline]
pub(super) fn common_blocks<const N: usize>(
    w: &[u8],
    bb: usize,
    a: &[&[super::BlockQ8K]; N],
) -> usize {
    a.iter().map(|a| a.len()).fold(w.len() / bb, usize::min)
}

/// The horizontal sum of each accumulator (the last step of every kernel here).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn hsums<const N: usize>(acc: &[__m256; N]) -> [f32; N] {
    let mut out = [0.0f32; N];
    for (o, &v) in out.iter_mut().zip(acc) {
        *o = super::simd::x86::hsum256(v);
    }
    out
}
