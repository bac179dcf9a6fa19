//! The shared engine of the 32-element block types that dot against `Q8_32` activations
//! through signed 8-bit codes: Q4_1, Q5_0, Q5_1 and IQ4_NL (one small file each describes its
//! block through [`Block32`]; this file owns the loops).
//!
//! Every such block decodes to `d * c_i (+ m)` with `d` (and `m`) f16 at the block start and
//! codes `c_i` in -127..=127, so against activations `da * q_i`:
//! `dot = d * da * sum(c_i q_i) + m * da * sum(q_i)`, both sums exact integers per block.
//! The SIMD loops compute exactly those two integer sums per block and differ from the scalar
//! one only in f32 summation order.
//!
//! Does not own: block layouts (the per-type files) or dispatch (`mod.rs`).
//! Invariant: a `Block32` type's `codes` and `codes_avx2` give the same 32 codes in element
//! order, and `|c_i| <= 127` (so `maddubs` on |c| x (q * sign c) cannot saturate).

use super::float::f16_le;
use super::ActRow;

/// One 32-element block type of this family.
pub(super) trait Block32 {
    /// Bytes per block.
    const BB: usize;
    /// Whether an f16 `m` follows `d` (value = d * c + m, in that f32 order, as gguf).
    const HAS_MIN: bool;
    /// The 32 codes of the block at the start of `b`, in element order.
    fn codes(b: &[u8]) -> [i8; 32];
    /// The same codes as 32 bytes of one register.
    ///
    /// # Safety
    /// AVX2 available; `b` valid for `BB` bytes.
    #[cfg(target_arch = "x86_64")]
    unsafe fn codes_avx2(b: *const u8) -> std::arch::x86_64::__m256i;
}

pub(super) fn dequant<T: Block32>(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(T::BB).zip(out.chunks_exact_mut(32)) {
        let d = f16_le(blk);
        let c = T::codes(blk);
        if T::HAS_MIN {
            let m = f16_le(&blk[2..]);
            for (o, &c) in o.iter_mut().zip(&c) {
                *o = d * c as f32 + m;
            }
        } else {
            for (o, &c) in o.iter_mut().zip(&c) {
                *o = d * c as f32;
            }
        }
    }
}

pub(super) fn dot_scalar<T: Block32>(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (blk, ab) in w.chunks_exact(T::BB).zip(a.q8_32) {
        let c = T::codes(blk);
        let isum: i32 = c
            .iter()
            .zip(&ab.qs)
            .map(|(&c, &q)| c as i32 * q as i32)
            .sum();
        sum += isum as f32 * (f16_le(blk) * ab.d);
        if T::HAS_MIN {
            let qsum: i32 = ab.qs.iter().map(|&q| q as i32).sum();
            sum += qsum as f32 * (f16_le(&blk[2..]) * ab.d);
        }
    }
    sum
}

/// Expands the 32 bits of `bits` to 32 bytes: byte i is 0xFF where bit i is set, else 0.
///
/// # Safety
/// AVX2 available.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn bits_to_bytes(bits: u32) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // Byte i takes byte i / 8 of `bits`, then every bit but (i % 8) is forced on.
    let v = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64));
    _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1))
}

/// The 32 nibbles of the 16 bytes at `p` as bytes 0..15 in element order (low nibbles are
/// elements 0..16, high nibbles 16..32).
///
/// # Safety
/// AVX2 available; `p` valid for 16 bytes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn nibbles(p: *const u8) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let q = _mm_loadu_si128(p as *const __m128i);
    let m4 = _mm_set1_epi8(0x0F);
    _mm256_set_m128i(
        _mm_and_si128(_mm_srli_epi16(q, 4), m4),
        _mm_and_si128(q, m4),
    )
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, hsum_ps256, prefetch};
    use super::{dot_scalar, ActRow, Block32};
    use crate::kernels::{BlockQ8_32, Isa};
    use std::arch::x86_64::*;

    pub(in crate::kernels) fn dot_avx2<T: Block32>(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return dot_scalar::<T>(w, a);
        }
        let nb = a.q8_32.len().min(w.len() / T::BB);
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` holds `nb` whole blocks and
        // `a.q8_32` at least `nb` blocks.
        unsafe { avx2::<T>(w.as_ptr(), a.q8_32.as_ptr(), nb) }
    }

    pub(in crate::kernels) fn dot_avx512<T: Block32>(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx512.supported() {
            return dot_scalar::<T>(w, a);
        }
        let nb = a.q8_32.len().min(w.len() / T::BB);
        // SAFETY: AVX-512 F/BW/VL/VNNI present (checked above); lengths as in `dot_avx2`.
        unsafe { avx512::<T>(w.as_ptr(), a.q8_32.as_ptr(), nb) }
    }

    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2<T: Block32>(w: *const u8, a: *const BlockQ8_32, nb: usize) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut accm = _mm256_setzero_ps();
        let ones16 = _mm256_set1_epi16(1);
        let ones8 = _mm256_set1_epi8(1);
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * T::BB);
            prefetch(b, pf, T::BB);
            let ab = &*a.add(i);
            let c = T::codes_avx2(b);
            let qa = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            // |c| * (q * sign c): unsigned x signed for maddubs, |c|, |q| <= 127.
            let p = _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(qa, c));
            let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones16));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b) * ab.d), s, acc);
            if T::HAS_MIN {
                let qs = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, qa), ones16);
                let m = _mm256_set1_ps(f16_at(b.add(2)) * ab.d);
                accm = _mm256_fmadd_ps(m, _mm256_cvtepi32_ps(qs), accm);
            }
        }
        hsum_ps256(_mm256_add_ps(acc, accm))
    }

    /// As `avx2`, with VNNI `dpbusd` for the integer sums.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + AVX2/FMA/F16C; `w` valid for `nb` blocks, `a` for `nb`
    /// activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512<T: Block32>(w: *const u8, a: *const BlockQ8_32, nb: usize) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut accm = _mm256_setzero_ps();
        let ones8 = _mm256_set1_epi8(1);
        let zero = _mm256_setzero_si256();
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * T::BB);
            prefetch(b, pf, T::BB);
            let ab = &*a.add(i);
            let c = T::codes_avx2(b);
            let qa = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            let p = _mm256_dpbusd_epi32(zero, _mm256_abs_epi8(c), _mm256_sign_epi8(qa, c));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b) * ab.d), _mm256_cvtepi32_ps(p), acc);
            if T::HAS_MIN {
                let qs = _mm256_dpbusd_epi32(zero, ones8, qa);
                let m = _mm256_set1_ps(f16_at(b.add(2)) * ab.d);
                accm = _mm256_fmadd_ps(m, _mm256_cvtepi32_ps(qs), accm);
            }
        }
        hsum_ps256(_mm256_add_ps(acc, accm))
    }
}
