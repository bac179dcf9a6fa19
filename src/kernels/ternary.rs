//! The four-row dots (prefill) of the ternary types TQ1_0 and TQ2_0: one loop for both, each
//! type's file describing its block through [`Ternary`] (its single-row dots stay in its file).
//!
//! Both types decode a 256-element super-block to `d * (c_i - 1)` with unsigned codes
//! `c_i <= 3`, so against `Q8K` activations `da * q_i` a block's dot is the exact integer
//! `sum(c_i q_i) - sum(q_i)` (`sum(q_i)` from the block's `bsums`) scaled by `d * da`. The
//! single-row dots hold that integer in 8 i32 lanes (lane j: bytes 4j..4j+3 of every 32-code
//! vector; AVX2 adds eight `maddubs` pair sums in i16 and widens with one `madd`, AVX-512
//! accumulates VNNI `dpbusd` in i32), subtract the `bsums` lane by lane and add
//! `(d * da) * lanes` into one f32 accumulator by one FMA per block. The four-row loop decodes
//! a block's codes once and then does exactly that for each row.
//!
//! Does not own: block layouts and the single-row dots (the per-type files) or dispatch
//! (`mod.rs`).
//! Invariant: per row the integer lanes are exact, so their order does not matter, and the f32
//! operations and their order are the single-row dot's of the same ISA: every row has exactly
//! its bits (tests/kernels_tile.rs `four_row_dots_equal_single_row_dots`).
//!
//! Session 39: one loop over R rows with R = 1 as the single-row dot as well was tried and
//! not kept: the same instructions, 5% slower in cache on Zen 3 (docs/PERFORMANCE.md).

use super::ActRow;

/// One ternary super-block type (256 elements, codes at most 3, f16 `d`).
pub(super) trait Ternary {
    /// Bytes per block.
    const BB: usize;
    /// Byte offset of the f16 `d` in a block.
    const D_AT: usize;
    /// The scalar dot (the SIMD dots' fallback where their ISA is missing).
    fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32;
    /// The block's 256 codes (unsigned bytes, at most 3) as eight 32-byte vectors, handed to
    /// `f` with the element offset of their first code (each of 0, 32, .., 224 once).
    ///
    /// # Safety
    /// AVX2 available; `b` valid for `BB` bytes.
    #[cfg(target_arch = "x86_64")]
    unsafe fn for_codes(b: *const u8, f: impl FnMut(usize, std::arch::x86_64::__m256i));
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, hsum_ps256, prefetch};
    use super::{ActRow, Ternary};
    use crate::kernels::{BlockQ8K, Isa};
    use std::arch::x86_64::*;

    /// A block's code x activation sums accumulated in one register, then widened to i32 lanes.
    trait IntDot {
        /// # Safety
        /// The ISA of the implementation.
        unsafe fn mac(acc: __m256i, c: __m256i, x: __m256i) -> __m256i;
        /// # Safety
        /// The ISA of the implementation.
        unsafe fn lanes(acc: __m256i) -> __m256i;
    }

    /// `maddubs` pair sums added in i16 (codes <= 3 and |q| <= 127: eight vectors' pair sums
    /// stay within i16), one `madd` to i32.
    struct Avx2Dot;
    impl IntDot for Avx2Dot {
        #[inline(always)]
        unsafe fn mac(acc: __m256i, c: __m256i, x: __m256i) -> __m256i {
            _mm256_add_epi16(acc, _mm256_maddubs_epi16(c, x))
        }
        #[inline(always)]
        unsafe fn lanes(acc: __m256i) -> __m256i {
            _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
        }
    }

    /// VNNI `dpbusd`, accumulated in i32.
    struct VnniDot;
    impl IntDot for VnniDot {
        #[inline(always)]
        unsafe fn mac(acc: __m256i, c: __m256i, x: __m256i) -> __m256i {
            _mm256_dpbusd_epi32(acc, c, x)
        }
        #[inline(always)]
        unsafe fn lanes(acc: __m256i) -> __m256i {
            acc
        }
    }

    /// sum(a) of a block from its 16 `bsums`, as 8 i32 lanes.
    #[inline(always)]
    unsafe fn bsum_lanes(ab: &BlockQ8K) -> __m256i {
        let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
        _mm256_madd_epi16(bs, _mm256_set1_epi16(1))
    }

    /// Four activation rows (`a[r]` valid for `nb` blocks) against one weight row of `nb`
    /// blocks: each block's codes decoded once, then per row the single-row dot's operations.
    #[inline(always)]
    unsafe fn body4<T: Ternary, D: IntDot>(
        w: *const u8,
        a: [*const BlockQ8K; 4],
        nb: usize,
    ) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * T::BB);
            prefetch(b, pf, T::BB);
            let ab: [&BlockQ8K; 4] = std::array::from_fn(|r| &*a[r].add(i));
            // The eight code vectors first, then row by row (rows inner kept all 32 products of
            // a block live at once: spills).
            let mut c = [_mm256_setzero_si256(); 8];
            T::for_codes(b, |off, v| c[off / 32] = v);
            let dw = f16_at(b.add(T::D_AT));
            for (acc, ab) in acc.iter_mut().zip(&ab) {
                let mut s = _mm256_setzero_si256();
                for (k, &c) in c.iter().enumerate() {
                    let x = _mm256_loadu_si256(ab.qs.as_ptr().add(32 * k) as *const __m256i);
                    s = D::mac(s, c, x);
                }
                let s = _mm256_sub_epi32(D::lanes(s), bsum_lanes(ab));
                let d = _mm256_set1_ps(dw * ab.d);
                *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), *acc);
            }
        }
        acc.map(|v| hsum_ps256(v))
    }

    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, every `a[r]` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_4<T: Ternary>(w: *const u8, a: [*const BlockQ8K; 4], nb: usize) -> [f32; 4] {
        body4::<T, Avx2Dot>(w, a, nb)
    }

    /// As `avx2_4`, with VNNI `dpbusd` for the code x activation sums (the AVX-512 single-row
    /// dots' integer step).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + AVX2/FMA/F16C; `w` valid for `nb` blocks, every `a[r]` for `nb`
    /// activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512_4<T: Ternary>(w: *const u8, a: [*const BlockQ8K; 4], nb: usize) -> [f32; 4] {
        body4::<T, VnniDot>(w, a, nb)
    }

    /// The block count `w` and every row of `a` hold.
    fn blocks<T: Ternary>(w: &[u8], a: &[ActRow<'_>; 4]) -> usize {
        a.iter()
            .map(|a| a.q8k.len())
            .fold(w.len() / T::BB, usize::min)
    }

    /// Four-row dot with the type's `dot_avx2` bits per row.
    pub(in crate::kernels) fn dot4_avx2<T: Ternary>(
        w: &[u8],
        a: &[ActRow<'_>; 4],
        out: &mut [f32; 4],
    ) {
        if !Isa::Avx2.supported() {
            *out = std::array::from_fn(|r| T::dot_scalar(w, &a[r]));
            return;
        }
        let nb = blocks::<T>(w, a);
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` and every row's `q8k` hold `nb`
        // blocks.
        *out = unsafe { avx2_4::<T>(w.as_ptr(), a.each_ref().map(|a| a.q8k.as_ptr()), nb) };
    }

    /// Four-row dot with the type's `dot_avx512` bits per row (untested on hardware in session
    /// 39: written on a Zen 3 without AVX-512).
    pub(in crate::kernels) fn dot4_avx512<T: Ternary>(
        w: &[u8],
        a: &[ActRow<'_>; 4],
        out: &mut [f32; 4],
    ) {
        if !Isa::Avx512.supported() {
            *out = std::array::from_fn(|r| T::dot_scalar(w, &a[r]));
            return;
        }
        let nb = blocks::<T>(w, a);
        // SAFETY: AVX-512 F/BW/VL/VNNI present (checked above); lengths as in `dot4_avx2`.
        *out = unsafe { avx512_4::<T>(w.as_ptr(), a.each_ref().map(|a| a.q8k.as_ptr()), nb) };
    }
}
