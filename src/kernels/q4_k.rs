//! Q4_K: super-blocks of 256 elements, 144 bytes: `d` (f16), `dmin` (f16), `scales[12]` (eight
//! 6-bit scales and eight 6-bit mins, packed), `qs[128]`. Sub-block j (32 elements) reads the
//! low nibbles of qs[32*(j/2)..][..32] when j is even, the high nibbles when odd;
//! value = (d * sc_j) * q - (dmin * m_j), in that f32 order (as `gguf.quants`).
//!
//! Dots against `Q8K` activations: per super-block the exact integers
//! sum_j sc_j * sum(q * a) and sum_j m_j * (bsum of sub-block j), scaled by d*d_a and dmin*d_a.
//! Every SIMD dot (single-row, four-row, 8x4 tile; AVX2 and AVX-512) computes those integers
//! exactly and then the scalar dot's float operations in its order, so all give its bits.

use super::float::f16_le;
use super::{ActFormat, ActRow, BlockQ8K, TypeKernels};
use crate::dtype::DType;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::Q4_K,
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

/// The four-row dots (prefill): see `kernels::dot4_fn`.
pub(super) const DOT4: super::Dot4Kernels = super::Dot4Kernels {
    #[cfg(target_arch = "x86_64")]
    avx2: Some(x86::dot4_avx2),
    #[cfg(target_arch = "x86_64")]
    avx512: Some(x86::dot4_avx512),
    #[cfg(not(target_arch = "x86_64"))]
    avx2: None,
    #[cfg(not(target_arch = "x86_64"))]
    avx512: None,
};

/// The 8-row x 16-token tiles (prefill): see `kernels::tile16_fn`.
pub(super) const TILE16: super::TileKernels<16> = super::TileKernels {
    #[cfg(target_arch = "x86_64")]
    avx2: Some(x86::tile16_avx2),
    #[cfg(target_arch = "x86_64")]
    avx512: Some(x86::tile16_avx512),
    #[cfg(not(target_arch = "x86_64"))]
    avx2: None,
    #[cfg(not(target_arch = "x86_64"))]
    avx512: None,
};

/// The 8-row x 8-token tile (prefill): see `kernels::tile_fn`.
pub(super) const TILE: super::TileKernels = super::TileKernels {
    #[cfg(target_arch = "x86_64")]
    avx2: Some(x86::tile_avx2),
    #[cfg(target_arch = "x86_64")]
    avx512: Some(x86::tile_avx512),
    #[cfg(not(target_arch = "x86_64"))]
    avx2: None,
    #[cfg(not(target_arch = "x86_64"))]
    avx512: None,
};

const BB: usize = 144;

/// The eight 6-bit scales and eight 6-bit mins of a Q4_K/Q5_K `scales[12]` field.
/// Bytes 0..4 hold sc0..3 (low 6 bits) and the top 2 bits of sc4..7; bytes 4..8 the same for
/// the mins; bytes 8..12 the low 4 bits of sc4..7 (low nibble) and m4..7 (high nibble).
#[inline]
pub(super) fn scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, m)
}

/// `scales_mins` as two little-endian u64 words (byte j = sc_j / m_j), with word operations.
#[inline]
pub(super) fn scales_mins_u64(s: &[u8]) -> (u64, u64) {
    let w = |i: usize| u32::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
    let (a, b, c) = (w(0), w(4), w(8));
    const LOW6: u32 = 0x3F3F_3F3F;
    const LOW4: u32 = 0x0F0F_0F0F;
    const TOP2: u32 = 0x0303_0303;
    let sc_lo = a & LOW6;
    let sc_hi = (c & LOW4) | (((a >> 6) & TOP2) << 4);
    let m_lo = b & LOW6;
    let m_hi = ((c >> 4) & LOW4) | (((b >> 6) & TOP2) << 4);
    (
        sc_lo as u64 | (sc_hi as u64) << 32,
        m_lo as u64 | (m_hi as u64) << 32,
    )
}

fn dequant(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BB).zip(out.chunks_exact_mut(256)) {
        let d = f16_le(blk);
        let dmin = f16_le(&blk[2..]);
        let (sc, m) = scales_mins(&blk[4..16]);
        let qs = &blk[16..];
        for (j, o) in o.chunks_exact_mut(32).enumerate() {
            let dj = d * sc[j] as f32;
            let mj = dmin * m[j] as f32;
            let q = &qs[32 * (j / 2)..32 * (j / 2) + 32];
            let shift = 4 * (j % 2);
            for (o, &q) in o.iter_mut().zip(q) {
                *o = dj * ((q >> shift) & 0x0F) as f32 - mj;
            }
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (blk, ab) in w.chunks_exact(BB).zip(a.q8k) {
        let (sc, m) = scales_mins(&blk[4..16]);
        let qs = &blk[16..];
        let mut isum = 0i32;
        let mut msum = 0i32;
        for j in 0..8 {
            let q = &qs[32 * (j / 2)..32 * (j / 2) + 32];
            let shift = 4 * (j % 2);
            let x = &ab.qs[32 * j..32 * j + 32];
            let s: i32 = q
                .iter()
                .zip(x)
                .map(|(&q, &x)| ((q >> shift) & 0x0F) as i32 * x as i32)
                .sum();
            isum += sc[j] as i32 * s;
            msum += m[j] as i32 * (ab.bsums[2 * j] as i32 + ab.bsums[2 * j + 1] as i32);
        }
        sum += f16_le(blk) * ab.d * isum as f32 - f16_le(&blk[2..]) * ab.d * msum as f32;
    }
    sum
}

/// The float part of a K-quant AVX-512 dot in `dot_scalar`'s order (Q4_K's and Q5_K's
/// `avx512`): `$block($w, $a, i, args..)` gives block i's exact isum and msum as 8 i32 lanes
/// each; four blocks are summed across lanes by one `hadd` tree, then per block
/// `sum += d * d_a * isum - dmin * d_a * msum` in block order. A macro so that each type's
/// block function is inlined in its own loop.
#[cfg(target_arch = "x86_64")]
macro_rules! k_dot_avx512 {
    ($w:expr, $a:expr, $nb:expr, $bb:expr, $block:ident($($arg:expr),*)) => {{
        let mut sum = 0.0f32;
        let mut i = 0;
        while i + 4 <= $nb {
            // Calls, not a closure (a closure here is not inlined, and costs 40%); in a loop,
            // which gets Q5_K's larger block function inlined where four call sites did not.
            let mut p = [(_mm256_setzero_si256(), _mm256_setzero_si256()); 4];
            for (k, pk) in p.iter_mut().enumerate() {
                *pk = $block($w, $a, i + k, $($arg),*);
            }
            // Lane k: block i + k's isum / msum.
            let h = _mm256_hadd_epi32(
                _mm256_hadd_epi32(p[0].0, p[1].0),
                _mm256_hadd_epi32(p[2].0, p[3].0),
            );
            let isum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            let h = _mm256_hadd_epi32(
                _mm256_hadd_epi32(p[0].1, p[1].1),
                _mm256_hadd_epi32(p[2].1, p[3].1),
            );
            let msum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            // d and dmin of the four blocks: [d0, m0, d1, m1 | d2, m2, d3, m3].
            let dd = |k: usize| std::ptr::read_unaligned($w.add((i + k) * $bb) as *const i32);
            let f = _mm256_cvtph_ps(_mm_setr_epi32(dd(0), dd(1), dd(2), dd(3)));
            let (lo, hi) = (_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
            let dw = _mm_shuffle_ps(lo, hi, 0b10_00_10_00);
            let dm = _mm_shuffle_ps(lo, hi, 0b11_01_11_01);
            let ad = _mm_setr_ps(
                (*$a.add(i)).d,
                (*$a.add(i + 1)).d,
                (*$a.add(i + 2)).d,
                (*$a.add(i + 3)).d,
            );
            let t1 = _mm_mul_ps(_mm_mul_ps(dw, ad), _mm_cvtepi32_ps(isum));
            let t2 = _mm_mul_ps(_mm_mul_ps(dm, ad), _mm_cvtepi32_ps(msum));
            let mut d = [0.0f32; 4];
            _mm_storeu_ps(d.as_mut_ptr(), _mm_sub_ps(t1, t2));
            for d in d {
                sum += d;
            }
            i += 4;
        }
        for i in i..$nb {
            let (v, mins) = $block($w, $a, i, $($arg),*);
            // [isum, msum] partial sums, then isum in lane 0 and msum in lane 1.
            let h = _mm256_hadd_epi32(v, mins);
            let h = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            let h = _mm_hadd_epi32(h, h);
            let t = _mm_mul_ps(
                _mm_mul_ps(f16x2_at($w.add(i * $bb)), _mm_set1_ps((*$a.add(i)).d)),
                _mm_cvtepi32_ps(h),
            );
            sum += _mm_cvtss_f32(t) - _mm_cvtss_f32(_mm_movehdup_ps(t));
        }
        sum
    }};
}
#[cfg(target_arch = "x86_64")]
pub(super) use k_dot_avx512;

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16x2_at, prefetch};
    use super::{dot_scalar, scales_mins_u64, ActRow, BlockQ8K, BB};
    type Rows4 = [*const BlockQ8K; 4];
    type Rows16 = [*const BlockQ8K; 16];
    use crate::kernels::Isa;
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

    /// Two blocks per iteration (the scales of both by `scales_mins_x2`, the horizontal sums
    /// and float products of both in one set of vectors: 10 % faster than a block at a time on
    /// a Zen 3, docs/PERFORMANCE.md session 37); each block's integers and float operations are
    /// `avx2_1`'s, the blocks added to the sum in order, so the result has `dot_scalar`'s bits.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2(w: *const u8, a: *const BlockQ8K, nb: usize) -> f32 {
        let mut sum = 0.0f32;
        let pf = prefetch_distance();
        let mut i = 0;
        while i + 2 <= nb {
            let (b0, b1) = (w.add(i * BB), w.add((i + 1) * BB));
            prefetch(b0, pf, 2 * BB);
            let (a0, a1) = (&*a.add(i), &*a.add(i + 1));
            // Lane L: [sc u64, m u64] of block L.
            let scm = scales_mins_x2(_mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128(b0 as *const __m128i)),
                _mm_loadu_si128(b1 as *const __m128i),
                1,
            ));
            let sm0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(scm));
            let sm1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(scm, 1));
            let sc0 = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm0));
            let sc1 = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm1));
            let v0 = block_isum8(&nibbles(b0.add(16)), sc0, a0.qs.as_ptr());
            let v1 = block_isum8(&nibbles(b1.add(16)), sc1, a1.qs.as_ptr());
            // [b0 x4 | b1 x4] lanes folded: isum of block 0 in lanes 0-1, block 1 in 2-3.
            let v = _mm256_hadd_epi32(v0, v1);
            let v4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            let m4 = _mm_hadd_epi32(mins_dot(sm0, a0), mins_dot(sm1, a1));
            // [isum0, isum1, msum0, msum1].
            let h = _mm_hadd_epi32(v4, m4);
            // [d0, d1, dmin0, dmin1] and [da0, da1, da0, da1].
            let dd = _mm_cvtph_ps(_mm_unpacklo_epi16(
                _mm_cvtsi32_si128(std::ptr::read_unaligned(b0 as *const i32)),
                _mm_cvtsi32_si128(std::ptr::read_unaligned(b1 as *const i32)),
            ));
            let da = _mm_unpacklo_ps(_mm_set1_ps(a0.d), _mm_set1_ps(a1.d));
            let t = _mm_mul_ps(_mm_mul_ps(dd, da), _mm_cvtepi32_ps(h));
            let mut tt = [0f32; 4];
            _mm_storeu_ps(tt.as_mut_ptr(), t);
            sum += tt[0] - tt[2];
            sum += tt[1] - tt[3];
            i += 2;
        }
        if i < nb {
            sum += avx2_1(w.add(i * BB), a.add(i), nb - i);
        }
        sum
    }

    pub(super) fn dot_avx512(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx512.supported() {
            return dot_scalar(w, a);
        }
        let nb = a.q8k.len().min(w.len() / BB);
        // SAFETY: AVX-512 F/BW/VL/VNNI present (checked above); lengths as in `dot_avx2`.
        unsafe { avx512(w.as_ptr(), a.q8k.as_ptr(), nb) }
    }

    /// Four activation rows against one weight row, bit-identical to four `dot_avx2` calls.
    pub(super) fn dot4_avx2(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !Isa::Avx2.supported() {
            out.iter_mut()
                .zip(a)
                .for_each(|(o, a)| *o = dot_scalar(w, a));
            return;
        }
        let (nb, ap) = super::super::act::q8k_rows4(w.len() / BB, a);
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` holds `nb` whole blocks and each
        // activation row at least `nb` blocks.
        unsafe { avx2_x4(w.as_ptr(), ap, nb, out) }
    }

    /// Eight weight rows (`w`: `8 * rb` bytes, row r at `r * rb`) against one to eight
    /// activation rows (`avx2_8x8`): `out[t][r]` has the bits of
    /// `dot_avx2(row r, a[t])` (= `dot_scalar`'s).
    pub(super) fn tile_avx2(w: &[u8], rb: usize, a: &[ActRow<'_>], out: &mut [[f32; 8]; 8]) {
        let n = a.len();
        assert!(
            w.len() >= 8 * rb && (1..=8).contains(&n),
            "Q4_K tile: {} bytes for 8 rows of {rb}, {n} activation rows",
            w.len()
        );
        if !Isa::Avx2.supported() {
            return crate::kernels::tile_by_dots(w, rb, a, out, dot_scalar);
        }
        let nb = a.iter().map(|a| a.q8k.len()).fold(rb / BB, usize::min);
        // Missing rows point at row 0 (read, never stored).
        let ap: Rows16 = std::array::from_fn(|t| a[if t < n { t } else { 0 }].q8k.as_ptr());
        let wp = w.as_ptr();
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` holds 8 rows of `rb` bytes,
        // each at least `nb` whole blocks, and each activation row at least `nb` blocks.
        unsafe { by_tokens!(n, avx2_8x8 [] (wp, rb, ap, nb, &mut out[..])) }
    }

    /// `tile_avx2` for 9 to 16 activation rows: each block's transposed nibbles, scales and
    /// mins serve all of them (made once per 16 tokens instead of per 8: at eight tokens that
    /// work was ~20 % of the tile, docs/PERFORMANCE.md session 37); `out[t][r]` has the bits
    /// of `dot_avx2(row r, a[t])` (= `dot_scalar`'s).
    pub(super) fn tile16_avx2(w: &[u8], rb: usize, a: &[ActRow<'_>], out: &mut [[f32; 8]; 16]) {
        let Some((nb, ap)) = tile16_setup(w, rb, BB, a, out, tile_avx2, Isa::Avx2) else {
            return;
        };
        let wp = w.as_ptr();
        // SAFETY: AVX2/FMA/F16C present (`tile16_setup`); `w` holds 8 rows of `rb` bytes, each
        // at least `nb` whole blocks, and each activation row at least `nb` blocks.
        unsafe { by_tokens16!(a.len(), avx2_8x8 [] (wp, rb, ap, nb, out)) }
    }

    /// The 16-token tiles' common part: checks the sizes; with more than 8 activation rows and
    /// `isa` present returns their whole block count (at most `rb / bb`) and row pointers
    /// (missing rows at row 0: read, never stored); otherwise runs them through `tile8` eight at
    /// a time and returns `None`.
    fn tile16_setup(
        w: &[u8],
        rb: usize,
        bb: usize,
        a: &[ActRow<'_>],
        out: &mut [[f32; 8]; 16],
        tile8: super::super::TileFn,
        isa: Isa,
    ) -> Option<(usize, Rows16)> {
        let n = a.len();
        assert!(
            w.len() >= 8 * rb && (1..=16).contains(&n),
            "K-quant tile: {} bytes for 8 rows of {rb}, {n} activation rows",
            w.len()
        );
        if n <= 8 || !isa.supported() {
            for (a, o) in a.chunks(8).zip(out.chunks_mut(8)) {
                let mut o8 = [[0.0f32; 8]; 8];
                tile8(w, rb, a, &mut o8);
                o[..a.len()].copy_from_slice(&o8[..a.len()]);
            }
            return None;
        }
        let nb = a.iter().map(|a| a.q8k.len()).fold(rb / bb, usize::min);
        Some((
            nb,
            std::array::from_fn(|t| a[if t < n { t } else { 0 }].q8k.as_ptr()),
        ))
    }

    /// `tile_avx2` with VNNI, all eight tokens in one pass: `out[t][r]` has the bits of
    /// `dot_avx512(row r, a[t])` (= `dot_scalar`'s).
    pub(super) fn tile_avx512(w: &[u8], rb: usize, a: &[ActRow<'_>], out: &mut [[f32; 8]; 8]) {
        let n = a.len();
        assert!(
            w.len() >= 8 * rb && (1..=8).contains(&n),
            "Q4_K tile: {} bytes for 8 rows of {rb}, {n} activation rows",
            w.len()
        );
        if !Isa::Avx512.supported() {
            return tile_avx2(w, rb, a, out);
        }
        let nb = a.iter().map(|a| a.q8k.len()).fold(rb / BB, usize::min);
        // Missing rows point at row 0 (read, never stored).
        let ap: Rows16 = std::array::from_fn(|t| a[if t < n { t } else { 0 }].q8k.as_ptr());
        let (w, o) = (w.as_ptr(), &mut out[..]);
        // SAFETY: AVX-512 F/BW/VL/VNNI present (checked above); lengths as in `tile_avx2`.
        unsafe { by_tokens!(n, avx512_8x8_k [, false] (w, rb, ap, nb, o)) }
    }

    /// `tile_avx512` for 9 to 16 activation rows (the block's transposes and nibbles made once
    /// for all of them, as `tile16_avx2`): `out[t][r]` has the bits of `dot_avx512(row r, a[t])`
    /// (= `dot_scalar`'s).
    pub(super) fn tile16_avx512(w: &[u8], rb: usize, a: &[ActRow<'_>], out: &mut [[f32; 8]; 16]) {
        tile16_avx512_k::<false>(w, rb, a, out, tile_avx512)
    }

    /// The 16-token AVX-512 tile of Q4_K (`Q5` false) and Q5_K (`Q5` true, `w` in Q5_K
    /// blocks): `tile8` (the type's 8-token tile) serves 1..=8 tokens and machines without
    /// AVX-512.
    pub(in crate::kernels) fn tile16_avx512_k<const Q5: bool>(
        w: &[u8],
        rb: usize,
        a: &[ActRow<'_>],
        out: &mut [[f32; 8]; 16],
        tile8: super::super::TileFn,
    ) {
        let bb = if Q5 { 176 } else { BB };
        let Some((nb, ap)) = tile16_setup(w, rb, bb, a, out, tile8, Isa::Avx512) else {
            return;
        };
        let wp = w.as_ptr();
        // SAFETY: AVX-512 F/BW/VL/VNNI present (`tile16_setup`); `w` holds 8 rows of `rb`
        // bytes, each at least `nb` whole blocks, and each activation row at least `nb` blocks.
        unsafe { by_tokens16!(a.len(), avx512_8x8_k [, Q5] (wp, rb, ap, nb, out)) }
    }

    /// Four activation rows against one weight row, bit-identical to four `dot_avx512` calls.
    pub(super) fn dot4_avx512(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !Isa::Avx512.supported() {
            out.iter_mut()
                .zip(a)
                .for_each(|(o, a)| *o = dot_scalar(w, a));
            return;
        }
        let (nb, ap) = super::super::act::q8k_rows4(w.len() / BB, a);
        // SAFETY: AVX-512 F/BW/VL/VNNI present (checked above); lengths as in `dot4_avx2`.
        unsafe { avx512_x4(w.as_ptr(), ap, nb, out) }
    }

    /// Scales (i16 lanes 0..8) and mins (lanes 8..16) of the block at `b`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(in crate::kernels) unsafe fn scales_mins16(b: *const u8) -> __m256i {
        let (sc, m) = scales_mins_u64(std::slice::from_raw_parts(b.add(4), 12));
        _mm256_cvtepu8_epi16(_mm_set_epi64x(m as i64, sc as i64))
    }

    /// sum_j m_j * bsum(sub-block j) as 4 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(in crate::kernels) unsafe fn mins_dot(sm: __m256i, ab: &BlockQ8K) -> __m128i {
        let bs8 = _mm_loadu_si128(ab.bsum32.as_ptr() as *const __m128i);
        _mm_madd_epi16(_mm256_extracti128_si256(sm, 1), bs8)
    }

    /// The eight nibble vectors of a block's `qs` (`nib[j]`: the 32 4-bit values of sub-block j).
    ///
    /// # Safety
    /// AVX2; `qs` valid for 128 bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles(qs: *const u8) -> [__m256i; 8] {
        let m4 = _mm256_set1_epi8(0x0F);
        let mut nib = [_mm256_setzero_si256(); 8];
        for k in 0..4 {
            let q = _mm256_loadu_si256(qs.add(32 * k) as *const __m256i);
            nib[2 * k] = _mm256_and_si256(q, m4);
            nib[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        }
        nib
    }

    /// Eight i32 lanes that sum to the block's sum_j sc_j * sum(q_j * x_j). The byte products
    /// are folded in i16 (`maddubs` pairs, then three levels of `hadd`: each lane ends as the
    /// sum of 16 products, |.| <= 16 * 15 * 127 < 2^15) so that one `madd` applies all eight
    /// scales: 9 multiplies per block and activation row instead of 16, which is what limits
    /// these kernels (measured: docs/PERFORMANCE.md, issue 16 section). `sc`: the eight scales
    /// as i16 in both 128-bit lanes.
    ///
    /// # Safety
    /// AVX2; `x` valid for 256 bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn block_isum8(nib: &[__m256i; 8], sc: __m256i, x: *const i8) -> __m256i {
        let p = |j: usize| {
            _mm256_maddubs_epi16(nib[j], _mm256_loadu_si256(x.add(32 * j) as *const __m256i))
        };
        let f01 = _mm256_hadd_epi16(p(0), p(1));
        let f23 = _mm256_hadd_epi16(p(2), p(3));
        let f45 = _mm256_hadd_epi16(p(4), p(5));
        let f67 = _mm256_hadd_epi16(p(6), p(7));
        let f = _mm256_hadd_epi16(_mm256_hadd_epi16(f01, f23), _mm256_hadd_epi16(f45, f67));
        _mm256_madd_epi16(f, sc)
    }

    /// Per block the exact integers isum and msum of `dot_scalar`, then its float operations
    /// in its order ((d * d_a) * isum - (dmin * d_a) * msum, added to the sum; no FMA), so the
    /// result has `dot_scalar`'s bits.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_1(w: *const u8, a: *const BlockQ8K, nb: usize) -> f32 {
        let mut sum = 0.0f32;
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            let sm = scales_mins16(b);
            let sc = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
            let v = block_isum8(&nibbles(b.add(16)), sc, ab.qs.as_ptr());
            let v4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            // isum in lane 0, msum in lane 1.
            let h = _mm_hadd_epi32(v4, mins_dot(sm, ab));
            let h = _mm_hadd_epi32(h, h);
            // (d * d_a, dmin * d_a) * (isum, msum).
            let t = _mm_mul_ps(
                _mm_mul_ps(f16x2_at(b), _mm_set1_ps(ab.d)),
                _mm_cvtepi32_ps(h),
            );
            sum += _mm_cvtss_f32(t) - _mm_cvtss_f32(_mm_movehdup_ps(t));
        }
        sum
    }

    /// The block's exact `isum` (sum_j sc_j * sum(q_j * x_j)) spread over 16 i32 lanes. Each
    /// 32-byte chunk k of `qs` is broadcast to both 256-bit halves and the upper half shifted
    /// by 4 (`qnib`), so the vector holds sub-blocks 2k (low nibbles) and 2k+1 (high nibbles) in
    /// the order of activation bytes 64k..64k+64, which are then loaded as they are (no
    /// activation shuffles). VNNI `dpbusd` gives sums of 4 products (|sum| <= 4 * 15 * 127, fits
    /// i16); chunks 2h and 2h+1 are packed to i16 and one `dpwssd` applies the sub-block scales.
    /// `s`: the scales permuted by `packed_bytes`.
    ///
    /// # Safety
    /// AVX-512 F/BW/VNNI; `qs` valid for 128 bytes, `x` for 256.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn isum16(qs: *const u8, x: *const i8, s: &[__m512i; 2]) -> __m512i {
        let m4 = _mm512_set1_epi8(0x0F);
        let mut sumi = _mm512_setzero_si512();
        for (h, s) in s.iter().enumerate() {
            let p0 = qnib_dot(qs, x, 2 * h, m4);
            let p1 = qnib_dot(qs, x, 2 * h + 1, m4);
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_packs_epi32(p0, p1), *s);
        }
        sumi
    }

    /// Chunk k of `qs` (sub-blocks 2k, 2k+1) against activation bytes 64k..64k+64: 16 i32 lanes,
    /// lanes 0..8 of sub-block 2k, 8..16 of 2k+1 (see `isum16`).
    ///
    /// # Safety
    /// AVX-512 F/BW/VNNI; `qs` valid for 32(k+1) bytes, `x` for 64(k+1).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn qnib_dot(qs: *const u8, x: *const i8, k: usize, m4: __m512i) -> __m512i {
        let q = _mm512_broadcast_i64x4(_mm256_loadu_si256(qs.add(32 * k) as *const __m256i));
        let q = _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xFFFF_0000, q, 4), m4);
        let xk = _mm512_loadu_si512(x.add(64 * k) as *const __m512i);
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xk)
    }

    /// 16 i32 lanes folded to 8 (exact).
    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    unsafe fn fold512(v: __m512i) -> __m256i {
        _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1))
    }

    /// `vpermw` indices for the packed sums of half `h` (see `isum16`): in 128-bit lanes 0 and 1
    /// i16 lanes 0..4 take scale 4h and 4..8 scale 4h+2; in lanes 2 and 3, scales 4h+1, 4h+3.
    const fn packed_idx(h: u16) -> [u16; 32] {
        let mut c = [0u16; 32];
        let mut i = 0;
        while i < 32 {
            let lane = i / 8;
            let second = (i % 8) / 4;
            c[i] = 4 * h + (lane as u16 / 2) + 2 * second as u16;
            i += 1;
        }
        c
    }
    /// `packed_idx` as `pshufb` controls on the eight scales (i16) broadcast to every 128-bit
    /// lane (one in-lane byte shuffle instead of a `vpermw`: 1.5-2.5% faster single- and
    /// four-row dots on a Zen 4).
    const fn packed_bytes(h: u16) -> [u8; 64] {
        let w = packed_idx(h);
        let mut c = [0u8; 64];
        let mut i = 0;
        while i < 32 {
            c[2 * i] = 2 * w[i] as u8;
            c[2 * i + 1] = 2 * w[i] as u8 + 1;
            i += 1;
        }
        c
    }
    static PACKED_B: [[u8; 64]; 2] = [packed_bytes(0), packed_bytes(1)];
    /// `vpermw` indices (256-bit): each min (lanes 8..16 of the scales/mins vector) twice, to
    /// meet the 16-element bsums.
    static MIN_DUP: [u16; 16] = [8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15];

    /// The scales of the block whose scales/mins vector is `sm`, permuted for `isum16`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn packed_scales(sm: __m256i) -> [__m512i; 2] {
        // The eight scales in every 128-bit lane, then an in-lane byte shuffle per half.
        let sc = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sm));
        [
            _mm512_shuffle_epi8(
                sc,
                _mm512_loadu_si512(PACKED_B[0].as_ptr() as *const __m512i),
            ),
            _mm512_shuffle_epi8(
                sc,
                _mm512_loadu_si512(PACKED_B[1].as_ptr() as *const __m512i),
            ),
        ]
    }

    /// Block i's exact isum (8 i32 lanes) and msum (8 lanes) partial sums (see `avx512`).
    ///
    /// # Safety
    /// As `avx512`, with i < nb.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    unsafe fn isum_msum(
        w: *const u8,
        a: *const BlockQ8K,
        i: usize,
        min_dup: __m256i,
        pf: usize,
    ) -> (__m256i, __m256i) {
        let b = w.add(i * BB);
        prefetch(b, pf, BB);
        let ab = &*a.add(i);
        let sm = scales_mins16(b);
        let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
        let mins = _mm256_madd_epi16(bs, _mm256_permutexvar_epi16(min_dup, sm));
        (
            fold512(isum16(b.add(16), ab.qs.as_ptr(), &packed_scales(sm))),
            mins,
        )
    }

    /// Per block the exact integers isum (`isum16`) and msum (bsums x duplicated mins in one
    /// `madd`) of `dot_scalar`, summed across lanes (four blocks at a time by one `hadd` tree),
    /// then its float operations in its order, so the result has `dot_scalar`'s bits (as
    /// `avx2`).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512(w: *const u8, a: *const BlockQ8K, nb: usize) -> f32 {
        let min_dup = _mm256_loadu_si256(MIN_DUP.as_ptr() as *const __m256i);
        let pf = prefetch_distance();
        k_dot_avx512!(w, a, nb, BB, isum_msum(min_dup, pf))
    }

    /// `avx2` for four activation rows: the block's nibbles and scales are unpacked once, each
    /// row's integers are `avx2`'s (summed across lanes by one `hadd` tree for the four rows),
    /// and the float operations run on four lanes (one per row) in `avx2`'s order, so each
    /// result has `avx2`'s (= `dot_scalar`'s) bits.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, each `a[r]` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_x4(w: *const u8, a: Rows4, nb: usize, out: &mut [f32; 4]) {
        let mut acc = _mm_setzero_ps();
        let pf = prefetch_distance();
        // Mins m0..m3 twice, then m4..m7 twice (i16), against two rows' pair-summed bsums.
        let mins_idx = _mm256_setr_epi32(4, 5, 4, 5, 6, 7, 6, 7);
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let sm = scales_mins16(b);
            let sc = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
            let mm = _mm256_permutevar8x32_epi32(sm, mins_idx);
            let nib = nibbles(b.add(16));
            let ab: [&BlockQ8K; 4] = std::array::from_fn(|r| &*a[r].add(i));
            // Explicit calls: a closure here is not always inlined.
            let v = [
                block_isum8(&nib, sc, ab[0].qs.as_ptr()),
                block_isum8(&nib, sc, ab[1].qs.as_ptr()),
                block_isum8(&nib, sc, ab[2].qs.as_ptr()),
                block_isum8(&nib, sc, ab[3].qs.as_ptr()),
            ];
            // Lane r: row r's isum (each 128-bit half holds half of it).
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            let isum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            // msum: bsums pair-summed per sub-block (|.| <= 32 * 127), times the mins.
            let bs = |r: usize| _mm256_loadu_si256(ab[r].bsums.as_ptr() as *const __m256i);
            let u01 = _mm256_madd_epi16(_mm256_hadd_epi16(bs(0), bs(1)), mm);
            let u23 = _mm256_madd_epi16(_mm256_hadd_epi16(bs(2), bs(3)), mm);
            let hm = _mm256_hadd_epi32(u01, u23);
            let msum = _mm_add_epi32(_mm256_castsi256_si128(hm), _mm256_extracti128_si256(hm, 1));
            let ad = _mm_setr_ps(ab[0].d, ab[1].d, ab[2].d, ab[3].d);
            let dw = f16x2_at(b);
            let t1 = _mm_mul_ps(
                _mm_mul_ps(_mm_broadcastss_ps(dw), ad),
                _mm_cvtepi32_ps(isum),
            );
            let t2 = _mm_mul_ps(
                _mm_mul_ps(_mm_permute_ps(dw, 0x55), ad),
                _mm_cvtepi32_ps(msum),
            );
            acc = _mm_add_ps(acc, _mm_sub_ps(t1, t2));
        }
        _mm_storeu_ps(out.as_mut_ptr(), acc);
    }

    /// `pshufb` controls for the tile's scales: in each 128-bit lane (two weight rows, eight
    /// scale bytes each), i16 lanes 0..4 take byte `j` of the first row, 4..8 of the second.
    const fn scale_sel(j: u8) -> [u8; 32] {
        let mut c = [0x80u8; 32];
        let mut i = 0;
        while i < 32 {
            let k = i % 16;
            if k % 2 == 0 {
                c[i] = if k < 8 { j } else { 8 + j };
            }
            i += 1;
        }
        c
    }
    static SCALE_SEL: [[u8; 32]; 8] = [
        scale_sel(0),
        scale_sel(1),
        scale_sel(2),
        scale_sel(3),
        scale_sel(4),
        scale_sel(5),
        scale_sel(6),
        scale_sel(7),
    ];

    /// Four 32-byte rows as 64-bit words transposed: out[g] = word g of rows 0, 1, 2, 3.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(in crate::kernels) unsafe fn transpose_q(r: [__m256i; 4]) -> [__m256i; 4] {
        let t0 = _mm256_unpacklo_epi64(r[0], r[1]);
        let t1 = _mm256_unpackhi_epi64(r[0], r[1]);
        let t2 = _mm256_unpacklo_epi64(r[2], r[3]);
        let t3 = _mm256_unpackhi_epi64(r[2], r[3]);
        [
            _mm256_permute2x128_si256(t0, t2, 0x20),
            _mm256_permute2x128_si256(t1, t3, 0x20),
            _mm256_permute2x128_si256(t0, t2, 0x31),
            _mm256_permute2x128_si256(t1, t3, 0x31),
        ]
    }

    /// Eight bytes at `p` in every 64-bit lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(in crate::kernels) unsafe fn bcast8(p: *const i8) -> __m256i {
        _mm256_set1_epi64x(std::ptr::read_unaligned(p as *const i64))
    }

    /// `scales_mins_u64` of two blocks at once (`scales_mins_x4`'s word operations on AVX2):
    /// 128-bit lane L of `v` holds a block's first 16 bytes (d, dmin, scales[12]); lane L of the
    /// result holds [sc u64, m u64] of it.
    ///
    /// # Safety
    /// AVX2.
    #[inline(always)]
    unsafe fn scales_mins_x2(v: __m256i) -> __m256i {
        // Dwords per lane: v = [dd, a, b, c]; x = [a, c, b, c], y = [a, a, b, b].
        let x = _mm256_shuffle_epi32::<0b11_10_11_01>(v);
        let y = _mm256_shuffle_epi32::<0b10_10_01_01>(v);
        let lo = _mm256_and_si256(x, _mm256_set1_epi32(0x3F3F_3F3F));
        let sh = _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4);
        let c4 = _mm256_and_si256(_mm256_srlv_epi32(x, sh), _mm256_set1_epi32(0x0F0F_0F0F));
        let top = _mm256_and_si256(_mm256_srli_epi32::<2>(y), _mm256_set1_epi32(0x3030_3030));
        _mm256_blend_epi32::<0b1010_1010>(lo, _mm256_or_si256(c4, top))
    }

    /// 8 weight rows x `T` (1..=16) activation rows (`out[t]` for t >= T is not written). Per
    /// block, each group of four weight rows is
    /// transposed in 8-byte words so that a register holds the same 8 positions of four rows
    /// (i16 lanes 0..4, 4..8, 8..12, 12..16 after `maddubs`: rows 0, 1, 2, 3) and each
    /// activation's 8 bytes are broadcast against it: the four 8-byte groups of a 32-element
    /// sub-block then add in i16 (each lane 8 products, |.| <= 8 * 15 * 127 < 2^15) and one
    /// `madd` applies the four rows' scales. Each weight register serves four activation rows
    /// and each broadcast two row groups (the transposes and nibbles of a block are made once
    /// for all eight). The per-block integers are `dot_scalar`'s isum and
    /// msum exactly; the float operations are its, in its order, on lanes laid out
    /// [t0 r0, t0 r1, t1 r0, t1 r1 | t0 r2, t0 r3, t1 r2, t1 r3] per (row group, token pair), so
    /// every output has `dot_scalar`'s bits.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; rows `w + r * rb` (r < 8) valid for `nb` blocks, each `a[t]` for `nb`
    /// activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_8x8<const T: usize>(
        w: *const u8,
        rb: usize,
        a: Rows16,
        nb: usize,
        out: &mut [[f32; 8]],
    ) {
        let m4 = _mm256_set1_epi8(0x0F);
        // Per row group, per token pair.
        let mut acc = [[_mm256_setzero_ps(); 8]; 2];
        // The eight rows are read block by block side by side, which hardware prefetchers do
        // not follow (short rows): prefetch the same block of the next eight rows, one tile
        // ahead (off when the prefetch distance is 0).
        let pf = if prefetch_distance() == 0 { 0 } else { 8 * rb };
        for i in 0..nb {
            let blk = |r: usize| w.add(r * rb + i * BB);
            let mut dh = [0u16; 8];
            let mut mh = [0u16; 8];
            for r in 0..8 {
                let b = blk(r);
                prefetch(b, pf, BB);
                dh[r] = std::ptr::read_unaligned(b as *const u16);
                mh[r] = std::ptr::read_unaligned(b.add(2) as *const u16);
            }
            // Rows (r, r + 1)'s scales and mins, [sc, m] per 128-bit lane (`scales_mins_x2`).
            let head = |r: usize| _mm_loadu_si128(blk(r) as *const __m128i);
            let pair = |r: usize| {
                scales_mins_x2(_mm256_inserti128_si256(
                    _mm256_castsi128_si256(head(r)),
                    head(r + 1),
                    1,
                ))
            };
            let scm = [pair(0), pair(2), pair(4), pair(6)];
            let ab: [&BlockQ8K; 16] = std::array::from_fn(|t| &*a[t].add(i));
            // Per token: the sums of each 32 (`bsum32`, |.| <= 32 * 127), in both 128-bit lanes.
            let bp = |t: usize| {
                _mm256_broadcastsi128_si256(
                    _mm_loadu_si128(ab[t].bsum32.as_ptr() as *const __m128i),
                )
            };
            let da = _mm256_setr_ps(
                ab[0].d, ab[1].d, ab[2].d, ab[3].d, ab[4].d, ab[5].d, ab[6].d, ab[7].d,
            );
            let da_hi = if T > 8 {
                _mm256_setr_ps(
                    ab[8].d, ab[9].d, ab[10].d, ab[11].d, ab[12].d, ab[13].d, ab[14].d, ab[15].d,
                )
            } else {
                da
            };
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(dh.as_ptr() as *const __m128i));
            let dm = _mm256_cvtph_ps(_mm_loadu_si128(mh.as_ptr() as *const __m128i));
            for (q, acc) in acc.iter_mut().enumerate() {
                let r0 = 4 * q;
                // [sc r0, sc r1, sc r2, sc r3] and, per 128-bit half, mins (r0, r2) | (r1, r3).
                let (sa, sb) = (scm[2 * q], scm[2 * q + 1]);
                let sq = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_unpacklo_epi64(sa, sb));
                let mins = _mm256_unpackhi_epi64(sa, sb);
                // The block's nibbles in transposed order, made once (8 steps x 4 registers),
                // then the tokens in passes of four against them (four accumulators stay in
                // registers; eight spilled).
                let mut nibs = [[_mm256_setzero_si256(); 4]; 8];
                for k in 0..4 {
                    let raw = transpose_q(std::array::from_fn(|j| {
                        _mm256_loadu_si256(blk(r0 + j).add(16 + 32 * k) as *const __m256i)
                    }));
                    for g in 0..4 {
                        nibs[2 * k][g] = _mm256_and_si256(raw[g], m4);
                        nibs[2 * k + 1][g] = _mm256_and_si256(_mm256_srli_epi16(raw[g], 4), m4);
                    }
                }
                let mut s32 = [_mm256_setzero_si256(); 16];
                for t0 in (0..T).step_by(4) {
                    let mut s4 = [_mm256_setzero_si256(); 4];
                    for (kh, nib) in nibs.iter().enumerate() {
                        let s = _mm256_shuffle_epi8(
                            sq,
                            _mm256_loadu_si256(SCALE_SEL[kh].as_ptr() as *const __m256i),
                        );
                        for (u, s4) in s4.iter_mut().enumerate().take(T.min(t0 + 4) - t0) {
                            let x = ab[t0 + u].qs.as_ptr().add(32 * kh);
                            let p01 = _mm256_add_epi16(
                                _mm256_maddubs_epi16(nib[0], bcast8(x)),
                                _mm256_maddubs_epi16(nib[1], bcast8(x.add(8))),
                            );
                            let p23 = _mm256_add_epi16(
                                _mm256_maddubs_epi16(nib[2], bcast8(x.add(16))),
                                _mm256_maddubs_epi16(nib[3], bcast8(x.add(24))),
                            );
                            *s4 = _mm256_add_epi32(
                                *s4,
                                _mm256_madd_epi16(_mm256_add_epi16(p01, p23), s),
                            );
                        }
                    }
                    s32[t0..t0 + 4].copy_from_slice(&s4);
                }
                // i32 lanes of s32[t]: [r0, r0, r1, r1 | r2, r2, r3, r3].
                let isum: [__m256i; 8] =
                    std::array::from_fn(|p| _mm256_hadd_epi32(s32[2 * p], s32[2 * p + 1]));
                // Mins of rows (0, 2) and (1, 3) of the group, one row per 128-bit lane.
                let ma = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(mins));
                let mb = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(mins, 1));
                let hm = |t: usize| {
                    let b = bp(t);
                    _mm256_hadd_epi32(_mm256_madd_epi16(ma, b), _mm256_madd_epi16(mb, b))
                };
                let ri = |k: i32| r0 as i32 + k;
                let rows_idx =
                    _mm256_setr_epi32(ri(0), ri(1), ri(0), ri(1), ri(2), ri(3), ri(2), ri(3));
                let dwq = _mm256_permutevar8x32_ps(dw, rows_idx);
                let dmq = _mm256_permutevar8x32_ps(dm, rows_idx);
                for p in 0..T.div_ceil(2) {
                    let msum = _mm256_hadd_epi32(hm(2 * p), hm(2 * p + 1));
                    // Tokens 2p, 2p + 1 in `da` (p < 4) or `da_hi`.
                    let (dsrc, u) = if p < 4 {
                        (da, 2 * p as i32)
                    } else {
                        (da_hi, 2 * p as i32 - 8)
                    };
                    let v = u + 1;
                    let dap =
                        _mm256_permutevar8x32_ps(dsrc, _mm256_setr_epi32(u, u, v, v, u, u, v, v));
                    let t1 = _mm256_mul_ps(_mm256_mul_ps(dwq, dap), _mm256_cvtepi32_ps(isum[p]));
                    let t2 = _mm256_mul_ps(_mm256_mul_ps(dmq, dap), _mm256_cvtepi32_ps(msum));
                    acc[p] = _mm256_add_ps(acc[p], _mm256_sub_ps(t1, t2));
                }
            }
        }
        for (q, acc) in acc.iter().enumerate() {
            for (p, v) in acc.iter().enumerate() {
                let mut l = [0.0f32; 8];
                _mm256_storeu_ps(l.as_mut_ptr(), *v);
                // Lane order [t0 r0, t0 r1, t1 r0, t1 r1 | t0 r2, t0 r3, t1 r2, t1 r3].
                for (k, &v) in l.iter().enumerate() {
                    let t = 2 * p + (k % 4) / 2;
                    let r = 4 * q + 2 * (k / 4) + k % 2;
                    if t < T {
                        out[t][r] = v;
                    }
                }
            }
        }
    }

    /// `avx512` for four activation rows: the block's scales are unpacked once, each row's
    /// integers are `avx512`'s (summed across lanes by one `hadd` tree for the four rows), and the
    /// float operations run on four lanes in `avx512`'s order, so each result has its (=
    /// `dot_scalar`'s) bits.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + F16C; `w` valid for `nb` blocks, each `a[r]` for `nb` blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512_x4(w: *const u8, a: Rows4, nb: usize, out: &mut [f32; 4]) {
        let min_dup = _mm256_loadu_si256(MIN_DUP.as_ptr() as *const __m256i);
        let mut acc = _mm_setzero_ps();
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let sm = scales_mins16(b);
            let mdup = _mm256_permutexvar_epi16(min_dup, sm);
            let s = packed_scales(sm);
            let ab: [&BlockQ8K; 4] = std::array::from_fn(|r| &*a[r].add(i));
            let v = [
                fold512(isum16(b.add(16), ab[0].qs.as_ptr(), &s)),
                fold512(isum16(b.add(16), ab[1].qs.as_ptr(), &s)),
                fold512(isum16(b.add(16), ab[2].qs.as_ptr(), &s)),
                fold512(isum16(b.add(16), ab[3].qs.as_ptr(), &s)),
            ];
            let m: [__m256i; 4] = std::array::from_fn(|r| {
                let bs = _mm256_loadu_si256(ab[r].bsums.as_ptr() as *const __m256i);
                _mm256_madd_epi16(bs, mdup)
            });
            // Lane r: row r's isum / msum (each 128-bit half holds half of it).
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            let isum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(m[0], m[1]), _mm256_hadd_epi32(m[2], m[3]));
            let msum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            let ad = _mm_setr_ps(ab[0].d, ab[1].d, ab[2].d, ab[3].d);
            let dw = f16x2_at(b);
            let t1 = _mm_mul_ps(
                _mm_mul_ps(_mm_broadcastss_ps(dw), ad),
                _mm_cvtepi32_ps(isum),
            );
            let t2 = _mm_mul_ps(
                _mm_mul_ps(_mm_permute_ps(dw, 0x55), ad),
                _mm_cvtepi32_ps(msum),
            );
            acc = _mm_add_ps(acc, _mm_sub_ps(t1, t2));
        }
        _mm_storeu_ps(out.as_mut_ptr(), acc);
    }

    /// `_mm256_hadd_epi32` per 128-bit lane of 512-bit vectors: [x0+x1, x2+x3, y0+y1, y2+y3].
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn hadd512(x: __m512i, y: __m512i) -> __m512i {
        let (x, y) = (_mm512_castsi512_ps(x), _mm512_castsi512_ps(y));
        let even = _mm512_castps_si512(_mm512_shuffle_ps(x, y, 0b10_00_10_00));
        let odd = _mm512_castps_si512(_mm512_shuffle_ps(x, y, 0b11_01_11_01));
        _mm512_add_epi32(even, odd)
    }

    /// `pshufb` controls for the AVX-512 tile's scales (see `avx512_8x4`): in 128-bit lane L
    /// (rows 2L, 2L+1: scale bytes 0..8 and 8..16), i16 lanes 0,1 take sub-block 2k's scale of
    /// row 2L, 2,3 of row 2L+1, 4,5 sub-block 2k+1's of row 2L, 6,7 of row 2L+1.
    const fn scale_sel512(k: u8) -> [u8; 64] {
        let mut c = [0x80u8; 64];
        let mut i = 0;
        while i < 64 {
            let e = i % 16;
            if e % 2 == 0 {
                let lane = (e / 2) as u8;
                let row = (lane / 2) % 2;
                let sub = 2 * k + lane / 4;
                c[i] = 8 * row + sub;
            }
            i += 1;
        }
        c
    }
    static SCALE_SEL512: [[u8; 64]; 4] = [
        scale_sel512(0),
        scale_sel512(1),
        scale_sel512(2),
        scale_sel512(3),
    ];

    /// `scales_mins_u64` of four blocks at once: 128-bit lane L of `v` holds a block's first
    /// 16 bytes (d, dmin, scales[12]); lane L of the result holds [sc u64, m u64] of it, by the
    /// same word operations.
    ///
    /// # Safety
    /// AVX-512 F.
    #[inline(always)]
    unsafe fn scales_mins_x4(v: __m512i) -> __m512i {
        // Dwords per lane: v = [dd, a, b, c]; x = [a, c, b, c], y = [a, a, b, b].
        let x = _mm512_shuffle_epi32::<0b11_10_11_01>(v);
        let y = _mm512_shuffle_epi32::<0b10_10_01_01>(v);
        let lo = _mm512_and_si512(x, _mm512_set1_epi32(0x3F3F_3F3F));
        // c & LOW4 (sc_hi) and (c >> 4) & LOW4 (m_hi) in dwords 1 and 3 ...
        let sh = _mm512_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0, 4);
        let c4 = _mm512_and_si512(_mm512_srlv_epi32(x, sh), _mm512_set1_epi32(0x0F0F_0F0F));
        // ... | ((a or b) >> 6 & TOP2) << 4, which is (a or b) >> 2 & 0x30 per byte.
        let top = _mm512_and_si512(_mm512_srli_epi32::<2>(y), _mm512_set1_epi32(0x3030_3030));
        let hi = _mm512_or_si512(c4, top);
        _mm512_mask_blend_epi32(0b1010_1010_1010_1010, lo, hi)
    }

    /// 8 weight rows x `T` (1..=8) activation rows with VNNI (`out[t]` for t >= T is not
    /// written); the weight unpacking and the per-block scales and mins serve all T tokens. Per block and 32-byte chunk k of `qs`, the eight rows are transposed in 8-byte
    /// words (register g: word g of rows 0..8, 128-bit lane L = rows 2L, 2L+1) and each
    /// activation's 8 bytes are broadcast against it; `dpbusd` over the four words gives per row
    /// two i32 lanes of 16 products each (|.| <= 16 * 15 * 127 < 2^15), sub-blocks 2k and 2k+1
    /// are packed to i16 and one `dpwssd` applies the eight rows' scales. The per-block integers
    /// are `dot_scalar`'s isum and msum exactly; the float operations are its, in its order, on
    /// lanes laid out [t r2L, t r2L+1, u r2L, u r2L+1] per 128-bit lane L for the token pair
    /// (t, u), so every output has `dot_scalar`'s bits.
    ///
    /// For Q4_K (`Q5` false: blocks of `BB` bytes, `qs` at 16) or Q5_K (`Q5`: blocks of 176 bytes, `qh[32]` at 16 and `qs` at 48). For Q5_K the rows' `qh` is
    /// transposed in 8-byte words as `qs` is, and per 32-byte chunk k the low (high) nibbles of
    /// word g gain 16 where bit 2k (2k + 1) of qh's word g is set; with 5-bit codes four words
    /// in one lane could reach 16 * 31 * 127 > 2^15, so each nibble half sums words 0-1 and
    /// 2-3 apart (at most 8 * 31 * 127) and each pair is packed and scaled by its own
    /// `dpwssd`: the same exact integers.
    ///
    /// # Safety
    /// Rows `w + r * rb` (r < 8) valid for `nb` blocks of the type's size, each `a[t]` for `nb`
    /// activation blocks; AVX-512 F/BW/VL/VNNI + F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(in crate::kernels) unsafe fn avx512_8x8_k<const T: usize, const Q5: bool>(
        w: *const u8,
        rb: usize,
        a: Rows16,
        nb: usize,
        out: &mut [[f32; 8]],
    ) {
        let (bb, qs_at) = if Q5 { (176, 48) } else { (BB, 16) };
        let sixteen = _mm512_set1_epi8(0x10);
        let m4 = _mm512_set1_epi8(0x0F);
        let zero = _mm512_setzero_si512();
        let tr: [__m512i; 2] = [
            _mm512_setr_epi64(0, 4, 8, 12, 1, 5, 9, 13),
            _mm512_setr_epi64(2, 6, 10, 14, 3, 7, 11, 15),
        ];
        let sel: [__m512i; 4] =
            std::array::from_fn(|k| _mm512_loadu_si512(SCALE_SEL512[k].as_ptr() as *const __m512i));
        // f32 lane (L, i) <- d (dmin) of row 2L + i % 2 in `dd`'s interleaved order.
        let rows_d = _mm512_setr_epi32(0, 2, 0, 2, 4, 6, 4, 6, 8, 10, 8, 10, 12, 14, 12, 14);
        let rows_m = _mm512_add_epi32(rows_d, _mm512_set1_epi32(1));
        // Qwords 0, 2, .. (1, 3, ..) of two registers: the rows' scales (mins) in row order.
        let even_q = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14);
        let odd_q = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
        // Dword 0 of every 128-bit lane of two registers: each row's d and dmin.
        let first_dw = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
        // f32 lane (L, i) <- token 2p + i / 2.
        let tok_idx: [__m512i; 4] = std::array::from_fn(|p| {
            let (t, u) = (2 * p as i32, 2 * p as i32 + 1);
            _mm512_setr_epi32(t, t, u, u, t, t, u, u, t, t, u, u, t, t, u, u)
        });
        const P: usize = 8;
        let mut acc = [_mm512_setzero_ps(); P];
        // The eight rows are read block by block side by side, which hardware prefetchers do
        // not follow (short rows): prefetch the same block of the next eight rows, one tile
        // ahead (off when the prefetch distance is 0).
        let pf = if prefetch_distance() == 0 { 0 } else { 8 * rb };
        for i in 0..nb {
            let blk = |r: usize| w.add(r * rb + i * bb);
            for r in 0..8 {
                prefetch(blk(r), pf, bb);
            }
            // The eight rows' scales, mins, d and dmin from their first 16 bytes.
            let head = |r0: usize| {
                let l = |r: usize| _mm_loadu_si128(blk(r) as *const __m128i);
                let v = _mm512_inserti32x4::<1>(_mm512_castsi128_si512(l(r0)), l(r0 + 1));
                let v = _mm512_inserti32x4::<2>(v, l(r0 + 2));
                _mm512_inserti32x4::<3>(v, l(r0 + 3))
            };
            let (v0, v1) = (head(0), head(4));
            let (u0, u1) = (scales_mins_x4(v0), scales_mins_x4(v1));
            let sq = _mm512_permutex2var_epi64(u0, even_q, u1);
            let mq = _mm512_permutex2var_epi64(u0, odd_q, u1);
            // f16 d and dmin of rows 0..8, interleaved: [d0, dmin0, d1, dmin1, ..].
            let dd = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi32(
                v0, first_dw, v1,
            )));
            let ab: [&BlockQ8K; 16] = std::array::from_fn(|t| &*a[t].add(i));
            // Eight rows' 32 bytes at byte `off` of their block, transposed in 8-byte words:
            // register g holds word g of rows 0..8 (row r in qword r).
            let words = |off: usize| -> [__m512i; 4] {
                let ld = |r: usize| _mm256_loadu_si256(blk(r).add(off) as *const __m256i);
                let z = |r: usize| _mm512_inserti64x4(_mm512_castsi256_si512(ld(r)), ld(r + 1), 1);
                let (z01, z23, z45, z67) = (z(0), z(2), z(4), z(6));
                let p = [
                    _mm512_permutex2var_epi64(z01, tr[0], z23),
                    _mm512_permutex2var_epi64(z01, tr[1], z23),
                ];
                let q = [
                    _mm512_permutex2var_epi64(z45, tr[0], z67),
                    _mm512_permutex2var_epi64(z45, tr[1], z67),
                ];
                [
                    _mm512_shuffle_i64x2(p[0], q[0], 0x44),
                    _mm512_shuffle_i64x2(p[0], q[0], 0xEE),
                    _mm512_shuffle_i64x2(p[1], q[1], 0x44),
                    _mm512_shuffle_i64x2(p[1], q[1], 0xEE),
                ]
            };
            let qh = if Q5 { words(16) } else { [zero; 4] };
            let mut s32 = [_mm512_setzero_si512(); 16];
            for (k, &sel) in sel.iter().enumerate() {
                let raw = words(qs_at + 32 * k);
                let mut lo: [__m512i; 4] = std::array::from_fn(|g| _mm512_and_si512(raw[g], m4));
                let mut hi: [__m512i; 4] =
                    std::array::from_fn(|g| _mm512_and_si512(_mm512_srli_epi16(raw[g], 4), m4));
                if Q5 {
                    let (bl, bh) = (
                        _mm512_set1_epi8(1 << (2 * k)),
                        _mm512_set1_epi8(2 << (2 * k)),
                    );
                    for g in 0..4 {
                        let (ml, mh) = (
                            _mm512_test_epi8_mask(qh[g], bl),
                            _mm512_test_epi8_mask(qh[g], bh),
                        );
                        lo[g] = _mm512_mask_add_epi8(lo[g], ml, lo[g], sixteen);
                        hi[g] = _mm512_mask_add_epi8(hi[g], mh, hi[g], sixteen);
                    }
                }
                let s = _mm512_shuffle_epi8(sq, sel);
                for t in 0..T {
                    let x = ab[t].qs.as_ptr().add(64 * k);
                    let bc = |o: usize| {
                        _mm512_set1_epi64(std::ptr::read_unaligned(x.add(o) as *const i64))
                    };
                    if Q5 {
                        for g0 in [0, 2] {
                            let pl = _mm512_dpbusd_epi32(zero, lo[g0], bc(8 * g0));
                            let pl = _mm512_dpbusd_epi32(pl, lo[g0 + 1], bc(8 * g0 + 8));
                            let ph = _mm512_dpbusd_epi32(zero, hi[g0], bc(32 + 8 * g0));
                            let ph = _mm512_dpbusd_epi32(ph, hi[g0 + 1], bc(40 + 8 * g0));
                            s32[t] = _mm512_dpwssd_epi32(s32[t], _mm512_packs_epi32(pl, ph), s);
                        }
                        continue;
                    }
                    let mut pl = _mm512_dpbusd_epi32(zero, lo[0], bc(0));
                    let mut ph = _mm512_dpbusd_epi32(zero, hi[0], bc(32));
                    for g in 1..4 {
                        pl = _mm512_dpbusd_epi32(pl, lo[g], bc(8 * g));
                        ph = _mm512_dpbusd_epi32(ph, hi[g], bc(32 + 8 * g));
                    }
                    s32[t] = _mm512_dpwssd_epi32(s32[t], _mm512_packs_epi32(pl, ph), s);
                }
            }
            // Per 128-bit lane L of s32[t]: [2k of r2L, 2k of r2L+1, 2k+1 of r2L, 2k+1 of r2L+1]
            // summed over k; row sums in lanes 0 and 1.
            let rs: [__m512i; 16] = std::array::from_fn(|t| {
                _mm512_add_epi32(s32[t], _mm512_shuffle_epi32::<_MM_PERM_BADC>(s32[t]))
            });
            // Mins of rows (0, 2, 4, 6) and (1, 3, 5, 7), one row per 128-bit lane, as i16.
            let ma =
                _mm512_cvtepu8_epi16(_mm512_castsi512_si256(_mm512_permutexvar_epi64(even_q, mq)));
            let mb =
                _mm512_cvtepu8_epi16(_mm512_castsi512_si256(_mm512_permutexvar_epi64(odd_q, mq)));
            // Per token: the sums of each 32 (`bsum32`, |.| <= 32 * 127), in every 128-bit lane.
            let hm = |t: usize| {
                let bp = _mm512_broadcast_i32x4(_mm_loadu_si128(
                    ab[t].bsum32.as_ptr() as *const __m128i
                ));
                hadd512(_mm512_madd_epi16(ma, bp), _mm512_madd_epi16(mb, bp))
            };
            let da = _mm512_castps256_ps512(_mm256_setr_ps(
                ab[0].d, ab[1].d, ab[2].d, ab[3].d, ab[4].d, ab[5].d, ab[6].d, ab[7].d,
            ));
            let da_hi = if T > 8 {
                _mm512_castps256_ps512(_mm256_setr_ps(
                    ab[8].d, ab[9].d, ab[10].d, ab[11].d, ab[12].d, ab[13].d, ab[14].d, ab[15].d,
                ))
            } else {
                da
            };
            let dwq = _mm512_permutexvar_ps(rows_d, dd);
            let dmq = _mm512_permutexvar_ps(rows_m, dd);
            for p in 0..T.div_ceil(2) {
                let (t, u) = (2 * p, (2 * p + 1).min(T - 1));
                let isum = _mm512_unpacklo_epi64(rs[t], rs[u]);
                let msum = hadd512(hm(t), hm(u));
                // Tokens 2p, 2p + 1 in `da` (p < 4) or `da_hi`.
                let dap = if p < 4 {
                    _mm512_permutexvar_ps(tok_idx[p], da)
                } else {
                    _mm512_permutexvar_ps(tok_idx[p - 4], da_hi)
                };
                let t1 = _mm512_mul_ps(_mm512_mul_ps(dwq, dap), _mm512_cvtepi32_ps(isum));
                let t2 = _mm512_mul_ps(_mm512_mul_ps(dmq, dap), _mm512_cvtepi32_ps(msum));
                acc[p] = _mm512_add_ps(acc[p], _mm512_sub_ps(t1, t2));
            }
        }
        for (p, v) in acc.iter().enumerate() {
            let mut l = [0.0f32; 16];
            _mm512_storeu_ps(l.as_mut_ptr(), *v);
            for (k, &v) in l.iter().enumerate() {
                let t = 2 * p + (k % 4) / 2;
                let r = 2 * (k / 4) + k % 2;
                if t < T {
                    out[t][r] = v;
                }
            }
        }
    }
}
