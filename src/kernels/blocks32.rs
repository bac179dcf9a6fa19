//! The shared engine of the 32-element block types that dot against `Q8_32` activations
//! through signed 8-bit codes: Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL (one small file each describes its
//! block through [`Block32`]; this file owns the loops).
//!
//! Every such block decodes to `d * c_i (+ m)` with `d` (and `m`) f16 at the block start and
//! codes `c_i` in -127..=127, so against activations `da * q_i`:
//! `dot = d * da * sum(c_i q_i) + m * da * sum(q_i)`, both sums exact integers per block.
//! The SIMD loops compute exactly those two integer sums per block and differ from the scalar
//! one only in f32 summation order.
//!
//! Speed (issue 17): the SIMD loop takes 8 blocks per step and reduces each block's 8 i32 lanes
//! to one lane (`reduce8`), so the scales (8 f16 `d` assembled in a register, 8 activation
//! scales by one load of `q8_32_d`) cost one convert, one multiply and one FMA per 8 blocks
//! instead of a conversion, broadcast and FMA per block. The integer dot runs on unsigned
//! codes `c + OFF` (VNNI `dpbusd` on AVX-512, `maddubs` on AVX2 where `c + OFF <= 31`) and
//! subtracts `OFF * sum(q)` once per 8 blocks; `sum(q)`, which the minimum term needs too, is
//! precomputed once per activation row (`q8_32_sum`), not per weight row. IQ4_NL on AVX2 keeps
//! the sign trick (`c + 128` would saturate `maddubs`). docs/PERFORMANCE.md has the figures
//! and what did not help.
//!
//! Does not own: block layouts (the per-type files) or dispatch (`mod.rs`).
//! Invariant: a `Block32` type's `codes` give the 32 codes in element order, `codes_avx2` the
//! same codes (plus `OFF` unless `SIGNED_AVX2`), `ucodes_avx512` the codes plus `OFF`, and
//! `|c_i| <= 127` (so `maddubs` on |c| x (q * sign c) cannot saturate).

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
    /// What the SIMD dots add to every code so that it is unsigned (0, 8, 16 or 128): they
    /// multiply `u_i = c_i + OFF` (unsigned) by the signed activations and subtract
    /// `OFF * sum(q_i)`, with `sum(q_i)` precomputed per activation block (`q8_32_sum`), once
    /// per 8 blocks.
    const OFF: u8;
    /// Whether `codes_avx2` gives the signed codes `c_i` (the AVX2 dot then uses the sign trick:
    /// `c + 128` would saturate `maddubs`) rather than `c_i + OFF` (at most 31).
    const SIGNED_AVX2: bool;
    /// The 32 codes as bytes of one register: `c_i` if `SIGNED_AVX2`, else `c_i + OFF`.
    ///
    /// # Safety
    /// AVX2 available; `b` valid for `BB` bytes.
    #[cfg(target_arch = "x86_64")]
    unsafe fn codes_avx2(b: *const u8) -> std::arch::x86_64::__m256i;
    /// The codes plus `OFF`, as unsigned bytes, using AVX-512 BW/VL where that is shorter.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL and AVX2 available; `b` valid for `BB` bytes.
    #[cfg(target_arch = "x86_64")]
    unsafe fn ucodes_avx512(b: *const u8) -> std::arch::x86_64::__m256i;
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
    // Both lanes hold the 16 bytes; the high lane's dwords shift right by 4.
    let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i));
    let q = _mm256_srlv_epi32(q, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    _mm256_and_si256(q, _mm256_set1_epi8(0x0F))
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, hsum_epi32, hsum_ps256, prefetch};
    use super::{dot_scalar, ActRow, Block32};
    use crate::kernels::Isa;
    use std::arch::x86_64::*;

    /// The block count both `w` and every activation array of `a` hold.
    fn blocks<T: Block32>(w: &[u8], a: &ActRow<'_>) -> usize {
        (w.len() / T::BB)
            .min(a.q8_32.len())
            .min(a.q8_32_d.len())
            .min(a.q8_32_sum.len())
    }

    pub(in crate::kernels) fn dot_avx2<T: Block32>(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return dot_scalar::<T>(w, a);
        }
        let nb = blocks::<T>(w, a);
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` holds `nb` whole blocks and
        // `a.q8_32`, `a.q8_32_d`, `a.q8_32_sum` at least `nb` entries each.
        unsafe { avx2::<T>(w.as_ptr(), a, nb) }
    }

    pub(in crate::kernels) fn dot_avx512<T: Block32>(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx512.supported() {
            return dot_scalar::<T>(w, a);
        }
        let nb = blocks::<T>(w, a);
        // SAFETY: AVX-512 F/BW/VL/VNNI present (checked above); lengths as in `dot_avx2`.
        unsafe { avx512::<T>(w.as_ptr(), a, nb) }
    }

    /// The integer sum of one block as 8 i32 lanes, in two steps so that a four-row dot
    /// unpacks each block once: `codes` (per weight block), `mul` (per activation row).
    trait IntDot {
        /// Whether `mul` sums `(c_i + OFF) q_i` (the loop then subtracts `OFF * sum(q_i)`)
        /// rather than `c_i q_i`.
        fn offset<T: Block32>() -> bool;
        /// The block's codes as `mul` takes them.
        ///
        /// # Safety
        /// The ISA of the implementation; `b` valid for `T::BB` bytes.
        unsafe fn codes<T: Block32>(b: *const u8) -> [__m256i; 2];
        /// # Safety
        /// The ISA of the implementation.
        unsafe fn mul<T: Block32>(c: [__m256i; 2], qa: __m256i) -> __m256i;
        /// Four vectors of 8 i32 lanes to one (`join` finishes eight lane sums).
        ///
        /// # Safety
        /// The ISA of the implementation.
        unsafe fn half4(v: &[__m256i; 4]) -> __m256i;
    }

    /// `maddubs` on the unsigned `c + OFF` (at most 31) x q, or, for `SIGNED_AVX2` types, on
    /// |c| x (q * sign c) (|c|, |q| <= 127 cannot saturate).
    struct Avx2Dot;
    impl IntDot for Avx2Dot {
        #[inline(always)]
        fn offset<T: Block32>() -> bool {
            T::OFF != 0 && !T::SIGNED_AVX2
        }
        #[inline(always)]
        unsafe fn codes<T: Block32>(b: *const u8) -> [__m256i; 2] {
            let c = T::codes_avx2(b);
            if T::SIGNED_AVX2 {
                [_mm256_sign_epi8(c, c), c]
            } else {
                [c, c]
            }
        }
        #[inline(always)]
        unsafe fn mul<T: Block32>(c: [__m256i; 2], qa: __m256i) -> __m256i {
            let p = if T::SIGNED_AVX2 {
                _mm256_maddubs_epi16(c[0], _mm256_sign_epi8(qa, c[1]))
            } else {
                _mm256_maddubs_epi16(c[0], qa)
            };
            _mm256_madd_epi16(p, _mm256_set1_epi16(1))
        }
        #[inline(always)]
        unsafe fn half4(v: &[__m256i; 4]) -> __m256i {
            // [x01, x23, y01, y23 | x45, x67, y45, y67]; twice: [v0..3 low halves | high halves].
            _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]))
        }
    }

    /// VNNI `dpbusd` on the unsigned `c + OFF` and q.
    struct VnniDot;
    impl IntDot for VnniDot {
        #[inline(always)]
        fn offset<T: Block32>() -> bool {
            T::OFF != 0
        }
        #[inline(always)]
        unsafe fn codes<T: Block32>(b: *const u8) -> [__m256i; 2] {
            let u = T::ucodes_avx512(b);
            [u, u]
        }
        #[inline(always)]
        unsafe fn mul<T: Block32>(c: [__m256i; 2], qa: __m256i) -> __m256i {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), c[0], qa)
        }
        /// The first level by shifts and a blend instead of `vphaddd` (fewer shuffles: 1.31
        /// against 1.49 ns per Q4_1 block on Zen 4 with AVX-512, a little slower on the AVX2
        /// loop, which keeps `vphaddd`).
        #[inline(always)]
        unsafe fn half4(v: &[__m256i; 4]) -> __m256i {
            let p01 = pair_sb(v[0], v[1]);
            let p23 = pair_sb(v[2], v[3]);
            // [a0-3, b0-3, c0-3, d0-3 | a4-7, b4-7, c4-7, d4-7].
            _mm256_add_epi32(
                _mm256_unpacklo_epi64(p01, p23),
                _mm256_unpackhi_epi64(p01, p23),
            )
        }
    }

    /// Two `half4` results to the 8 lane sums of their 8 inputs, in order.
    #[inline(always)]
    unsafe fn join(g0: __m256i, g1: __m256i) -> __m256i {
        _mm256_add_epi32(
            _mm256_permute2x128_si256(g0, g1, 0x20),
            _mm256_permute2x128_si256(g0, g1, 0x31),
        )
    }

    /// `half4`'s first level on AVX-512: [a01, b01, a23, b23 | a45, b45, a67, b67].
    #[inline(always)]
    unsafe fn pair_sb(a: __m256i, b: __m256i) -> __m256i {
        let a = _mm256_add_epi32(a, _mm256_srli_epi64(a, 32));
        let b = _mm256_add_epi32(b, _mm256_slli_epi64(b, 32));
        _mm256_blend_epi32(a, b, 0b1010_1010)
    }

    /// The f16 at `p + k * stride` for k in 0..8, as f32 (assembled in two u64: scalar
    /// loads and shifts, which leave the vector shuffle units to the dot).
    #[inline(always)]
    unsafe fn f16x8(p: *const u8, stride: usize) -> __m256 {
        let h = |k: usize| std::ptr::read_unaligned(p.add(k * stride) as *const u16) as u64;
        let lo = h(0) | h(1) << 16 | h(2) << 32 | h(3) << 48;
        let hi = h(4) | h(5) << 16 | h(6) << 32 | h(7) << 48;
        _mm256_cvtph_ps(_mm_set_epi64x(hi as i64, lo as i64))
    }

    /// The loop shared by both ISAs: 8 blocks per step, their integer sums reduced to one lane
    /// per block (`reduce8`) so the scales (8 at once: the weights' by `f16x8`, the
    /// activations' and their `sum(q)` by one load each) cost one convert and one FMA per 8
    /// blocks.
    #[inline(always)]
    unsafe fn body<T: Block32, D: IntDot>(w: *const u8, a: &ActRow<'_>, nb: usize) -> f32 {
        let (aq, ad, asum) = (a.q8_32.as_ptr(), a.q8_32_d.as_ptr(), a.q8_32_sum.as_ptr());
        let mut acc = _mm256_setzero_ps();
        let mut accm = _mm256_setzero_ps();
        let off = _mm256_set1_epi32(T::OFF as i32);
        let pf = prefetch_distance();
        let mut i = 0;
        while i + 8 <= nb {
            let b0 = w.add(i * T::BB);
            prefetch(b0, pf, 8 * T::BB);
            let mut g = [_mm256_setzero_si256(); 2];
            for (h, g) in g.iter_mut().enumerate() {
                let s: [__m256i; 4] = std::array::from_fn(|k| {
                    let j = 4 * h + k;
                    let qa = _mm256_loadu_si256((*aq.add(i + j)).qs.as_ptr() as *const __m256i);
                    D::mul::<T>(D::codes::<T>(b0.add(j * T::BB)), qa)
                });
                *g = D::half4(&s);
            }
            let mut isum = join(g[0], g[1]);
            let qsum = _mm256_loadu_si256(asum.add(i) as *const __m256i);
            if D::offset::<T>() {
                isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(qsum, off));
            }
            let da = _mm256_loadu_ps(ad.add(i));
            let dv = _mm256_mul_ps(f16x8(b0, T::BB), da);
            acc = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(isum), acc);
            if T::HAS_MIN {
                let mv = _mm256_mul_ps(f16x8(b0.add(2), T::BB), da);
                accm = _mm256_fmadd_ps(mv, _mm256_cvtepi32_ps(qsum), accm);
            }
            i += 8;
        }
        let tail = tail::<T, D>(w, a, i, nb);
        hsum_ps256(_mm256_add_ps(acc, accm)) + tail
    }

    /// Blocks `i..nb` one at a time (the rest after the 8-block steps), summed in f32 as the
    /// scalar loop does per block.
    #[inline(always)]
    unsafe fn tail<T: Block32, D: IntDot>(
        w: *const u8,
        a: &ActRow<'_>,
        mut i: usize,
        nb: usize,
    ) -> f32 {
        let (aq, ad, asum) = (a.q8_32.as_ptr(), a.q8_32_d.as_ptr(), a.q8_32_sum.as_ptr());
        let mut tail = 0.0f32;
        while i < nb {
            let b = w.add(i * T::BB);
            let qa = _mm256_loadu_si256((*aq.add(i)).qs.as_ptr() as *const __m256i);
            let (da, qsum) = (*ad.add(i), *asum.add(i));
            let mut isum = hsum_epi32(D::mul::<T>(D::codes::<T>(b), qa));
            if D::offset::<T>() {
                isum -= T::OFF as i32 * qsum;
            }
            tail += isum as f32 * (f16_at(b) * da);
            if T::HAS_MIN {
                tail += qsum as f32 * (f16_at(b.add(2)) * da);
            }
            i += 1;
        }
        tail
    }

    /// `body` for four activation rows at once (prefill): each weight block's codes are
    /// unpacked once for the four rows; per row the integer sums, f32 operations and their
    /// order are `body`'s, so every row gets exactly the single-row dot's bits.
    #[inline(always)]
    unsafe fn body4<T: Block32, D: IntDot>(
        w: *const u8,
        a: &[ActRow<'_>; 4],
        nb: usize,
        out: &mut [f32; 4],
    ) {
        let aq: [_; 4] = std::array::from_fn(|r| a[r].q8_32.as_ptr());
        let ad: [_; 4] = std::array::from_fn(|r| a[r].q8_32_d.as_ptr());
        let asum: [_; 4] = std::array::from_fn(|r| a[r].q8_32_sum.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut accm = [_mm256_setzero_ps(); 4];
        let off = _mm256_set1_epi32(T::OFF as i32);
        let pf = prefetch_distance();
        let mut i = 0;
        while i + 8 <= nb {
            let b0 = w.add(i * T::BB);
            prefetch(b0, pf, 8 * T::BB);
            let mut g = [[_mm256_setzero_si256(); 2]; 4];
            for h in 0..2 {
                let c: [[__m256i; 2]; 4] =
                    std::array::from_fn(|k| D::codes::<T>(b0.add((4 * h + k) * T::BB)));
                for (r, g) in g.iter_mut().enumerate() {
                    let s: [__m256i; 4] = std::array::from_fn(|k| {
                        let q = (*aq[r].add(i + 4 * h + k)).qs.as_ptr();
                        D::mul::<T>(c[k], _mm256_loadu_si256(q as *const __m256i))
                    });
                    g[h] = D::half4(&s);
                }
            }
            let dw = f16x8(b0, T::BB);
            let mw = if T::HAS_MIN {
                f16x8(b0.add(2), T::BB)
            } else {
                _mm256_setzero_ps()
            };
            for r in 0..4 {
                let mut isum = join(g[r][0], g[r][1]);
                let qsum = _mm256_loadu_si256(asum[r].add(i) as *const __m256i);
                if D::offset::<T>() {
                    isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(qsum, off));
                }
                let da = _mm256_loadu_ps(ad[r].add(i));
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(isum), acc[r]);
                if T::HAS_MIN {
                    let mv = _mm256_mul_ps(mw, da);
                    accm[r] = _mm256_fmadd_ps(mv, _mm256_cvtepi32_ps(qsum), accm[r]);
                }
            }
            i += 8;
        }
        let tail = tail4::<T, D>(w, a, i, nb);
        for r in 0..4 {
            out[r] = hsum_ps256(_mm256_add_ps(acc[r], accm[r])) + tail[r];
        }
    }

    /// `tail` for four activation rows: each block's codes unpacked once and the four rows'
    /// lane sums reduced together (`half4`); the integer sums are exact, and per row the f32
    /// operations and their order are `tail`'s. Rows of fewer than 8 blocks (DeepSeek's
    /// 128-wide `attn_k_b`) are all tail.
    #[inline(always)]
    unsafe fn tail4<T: Block32, D: IntDot>(
        w: *const u8,
        a: &[ActRow<'_>; 4],
        mut i: usize,
        nb: usize,
    ) -> [f32; 4] {
        let mut tail = [0.0f32; 4];
        while i < nb {
            let b = w.add(i * T::BB);
            let c = D::codes::<T>(b);
            let s: [__m256i; 4] = std::array::from_fn(|r| {
                let q = (*a[r].q8_32.as_ptr().add(i)).qs.as_ptr();
                D::mul::<T>(c, _mm256_loadu_si256(q as *const __m256i))
            });
            // [r0..r3 first halves | second halves] -> the four block sums.
            let h = D::half4(&s);
            let v = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            let mut isum = [0i32; 4];
            _mm_storeu_si128(isum.as_mut_ptr() as *mut __m128i, v);
            let (d, m) = (f16_at(b), if T::HAS_MIN { f16_at(b.add(2)) } else { 0.0 });
            for r in 0..4 {
                let (da, qsum) = (
                    *a[r].q8_32_d.as_ptr().add(i),
                    *a[r].q8_32_sum.as_ptr().add(i),
                );
                let mut isum = isum[r];
                if D::offset::<T>() {
                    isum -= T::OFF as i32 * qsum;
                }
                tail[r] += isum as f32 * (d * da);
                if T::HAS_MIN {
                    tail[r] += qsum as f32 * (m * da);
                }
            }
            i += 1;
        }
        tail
    }

    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, every row's three `q8_32` arrays for `nb`
    /// entries.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_4<T: Block32>(w: *const u8, a: &[ActRow<'_>; 4], nb: usize, out: &mut [f32; 4]) {
        body4::<T, Avx2Dot>(w, a, nb, out)
    }

    /// # Safety
    /// As `avx512`, for every row of `a`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512_4<T: Block32>(
        w: *const u8,
        a: &[ActRow<'_>; 4],
        nb: usize,
        out: &mut [f32; 4],
    ) {
        body4::<T, VnniDot>(w, a, nb, out)
    }

    /// The block count `w` and every row of `a` hold.
    fn blocks4<T: Block32>(w: &[u8], a: &[ActRow<'_>; 4]) -> usize {
        a.iter().map(|a| blocks::<T>(w, a)).min().unwrap_or(0)
    }

    /// Four-row dot with `dot_avx2`'s bits per row.
    pub(in crate::kernels) fn dot4_avx2<T: Block32>(
        w: &[u8],
        a: &[ActRow<'_>; 4],
        out: &mut [f32; 4],
    ) {
        if !Isa::Avx2.supported() {
            *out = std::array::from_fn(|r| dot_scalar::<T>(w, &a[r]));
            return;
        }
        let nb = blocks4::<T>(w, a);
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` and every row hold `nb` blocks.
        unsafe { avx2_4::<T>(w.as_ptr(), a, nb, out) }
    }

    /// Four-row dot with `dot_avx512`'s bits per row.
    pub(in crate::kernels) fn dot4_avx512<T: Block32>(
        w: &[u8],
        a: &[ActRow<'_>; 4],
        out: &mut [f32; 4],
    ) {
        if !Isa::Avx512.supported() {
            *out = std::array::from_fn(|r| dot_scalar::<T>(w, &a[r]));
            return;
        }
        let nb = blocks4::<T>(w, a);
        // SAFETY: AVX-512 F/BW/VL/VNNI present (checked above); lengths as in `dot4_avx2`.
        unsafe { avx512_4::<T>(w.as_ptr(), a, nb, out) }
    }

    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, `a`'s three `q8_32` arrays for `nb` entries.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2<T: Block32>(w: *const u8, a: &ActRow<'_>, nb: usize) -> f32 {
        body::<T, Avx2Dot>(w, a, nb)
    }

    /// As `avx2`, with VNNI `dpbusd` for the integer sums.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + AVX2/FMA/F16C; `w` valid for `nb` blocks, `a`'s three `q8_32`
    /// arrays for `nb` entries.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512<T: Block32>(w: *const u8, a: &ActRow<'_>, nb: usize) -> f32 {
        body::<T, VnniDot>(w, a, nb)
    }
}
