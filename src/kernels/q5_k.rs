//! Q5_K: super-blocks of 256 elements, 176 bytes: `d` (f16), `dmin` (f16), `scales[12]` (packed
//! as in Q4_K), `qh[32]`, `qs[128]`. Element l of sub-block j (32 elements) has low 4 bits from
//! qs as in Q4_K and fifth bit `(qh[l] >> j) & 1`; value = (d * sc_j) * q - (dmin * m_j).
//!
//! Dots against `Q8K` activations, as Q4_K with 5-bit codes.

use super::float::f16_le;
use super::q4_k::scales_mins;
use super::{ActFormat, ActRow, BlockQ8K, TypeKernels};
use crate::dtype::DType;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::Q5_K,
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

/// The four-row dot (prefill on AVX2; AVX-512 has the tile): see `kernels::dot4_fn`.
pub(super) const DOT4: super::Dot4Kernels = super::Dot4Kernels {
    #[cfg(target_arch = "x86_64")]
    avx2: Some(x86::dot4_avx2),
    #[cfg(not(target_arch = "x86_64"))]
    avx2: None,
    avx512: None,
};

/// The 8-row x 8-token tile (prefill): see `kernels::tile_fn`. AVX-512 only.
pub(super) const TILE: super::TileKernels = super::TileKernels {
    avx2: None,
    #[cfg(target_arch = "x86_64")]
    avx512: Some(x86::tile_avx512),
    #[cfg(not(target_arch = "x86_64"))]
    avx512: None,
};

/// The 8-row x 16-token tile (prefill): see `kernels::tile16_fn`. AVX-512 only.
pub(super) const TILE16: super::TileKernels<16> = super::TileKernels {
    avx2: None,
    #[cfg(target_arch = "x86_64")]
    avx512: Some(x86::tile16_avx512),
    #[cfg(not(target_arch = "x86_64"))]
    avx512: None,
};

const BB: usize = 176;

/// The 5-bit code of element l of sub-block j.
#[inline]
fn code(qh: &[u8], qs: &[u8], j: usize, l: usize) -> u8 {
    let lo = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
    lo | (((qh[l] >> j) & 1) << 4)
}

fn dequant(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BB).zip(out.chunks_exact_mut(256)) {
        let d = f16_le(blk);
        let dmin = f16_le(&blk[2..]);
        let (sc, m) = scales_mins(&blk[4..16]);
        let (qh, qs) = (&blk[16..48], &blk[48..]);
        for (j, o) in o.chunks_exact_mut(32).enumerate() {
            let dj = d * sc[j] as f32;
            let mj = dmin * m[j] as f32;
            for (l, o) in o.iter_mut().enumerate() {
                *o = dj * code(qh, qs, j, l) as f32 - mj;
            }
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (blk, ab) in w.chunks_exact(BB).zip(a.q8k) {
        let (sc, m) = scales_mins(&blk[4..16]);
        let (qh, qs) = (&blk[16..48], &blk[48..]);
        let mut isum = 0i32;
        let mut msum = 0i32;
        for j in 0..8 {
            let x = &ab.qs[32 * j..32 * j + 32];
            let q = &qs[32 * (j / 2)..32 * (j / 2) + 32];
            let shift = 4 * (j % 2);
            let mut s = 0i32;
            for ((&q, &h), &x) in q.iter().zip(qh).zip(x) {
                s += (((q >> shift) & 0x0F) | (((h >> j) & 1) << 4)) as i32 * x as i32;
            }
            isum += sc[j] as i32 * s;
            msum += m[j] as i32 * (ab.bsums[2 * j] as i32 + ab.bsums[2 * j + 1] as i32);
        }
        sum += f16_le(blk) * ab.d * isum as f32 - f16_le(&blk[2..]) * ab.d * msum as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::q4_k::k_dot_avx512;
    use super::super::q4_k::x86::{avx512_8x8_k, mins_dot, scales_mins16, tile16_avx512_k};
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16x2_at, hsum_ps128, hsum_ps256, prefetch};
    use super::{dot_scalar, ActRow, BlockQ8K, BB};
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

    /// `avx2` for four activation rows: the block's 5-bit codes and scales are unpacked once;
    /// per row the integer sums and the float operations are `avx2`'s in its order, so each
    /// result has its bits.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, each `a[r]` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_x4(w: *const u8, a: [*const BlockQ8K; 4], nb: usize, out: &mut [f32; 4]) {
        let m4 = _mm256_set1_epi8(0x0F);
        let sixteen = _mm256_set1_epi8(0x10);
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut accm = [_mm_setzero_ps(); 4];
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let fd = f16x2_at(b);
            let sm = scales_mins16(b);
            let mut sc = [0i16; 16];
            _mm256_storeu_si256(sc.as_mut_ptr() as *mut __m256i, sm);
            let qh = _mm256_loadu_si256(b.add(16) as *const __m256i);
            let qs = b.add(48);
            let mut codes = [(_mm256_setzero_si256(), _mm256_setzero_si256()); 4];
            for (j, c) in codes.iter_mut().enumerate() {
                let q = _mm256_loadu_si256(qs.add(32 * j) as *const __m256i);
                let lo = _mm256_and_si256(q, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                let b0 = _mm256_set1_epi8(1 << (2 * j));
                let b1 = _mm256_set1_epi8((1u8 << (2 * j + 1)) as i8);
                let h0 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), sixteen);
                let h1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), sixteen);
                *c = (_mm256_or_si256(lo, h0), _mm256_or_si256(hi, h1));
            }
            for r in 0..4 {
                let ab = &*a[r].add(i);
                let dd = _mm_mul_ps(fd, _mm_set1_ps(ab.d));
                let d = _mm_cvtss_f32(dd);
                let dmin = _mm_cvtss_f32(_mm_movehdup_ps(dd));
                accm[r] = _mm_fmadd_ps(
                    _mm_set1_ps(dmin),
                    _mm_cvtepi32_ps(mins_dot(sm, ab)),
                    accm[r],
                );
                let x = ab.qs.as_ptr();
                let mut sumi = _mm256_setzero_si256();
                for (j, &(c0, c1)) in codes.iter().enumerate() {
                    let x0 = _mm256_loadu_si256(x.add(64 * j) as *const __m256i);
                    let x1 = _mm256_loadu_si256(x.add(64 * j + 32) as *const __m256i);
                    let p0 = _mm256_maddubs_epi16(c0, x0);
                    let p1 = _mm256_maddubs_epi16(c1, x1);
                    let p0 = _mm256_madd_epi16(p0, _mm256_set1_epi16(sc[2 * j]));
                    let p1 = _mm256_madd_epi16(p1, _mm256_set1_epi16(sc[2 * j + 1]));
                    sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
                }
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
            }
        }
        for r in 0..4 {
            out[r] = hsum_ps256(acc[r]) - hsum_ps128(accm[r]);
        }
    }

    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2(w: *const u8, a: *const BlockQ8K, nb: usize) -> f32 {
        let m4 = _mm256_set1_epi8(0x0F);
        let sixteen = _mm256_set1_epi8(0x10);
        let mut acc = _mm256_setzero_ps();
        let mut accm = _mm_setzero_ps();
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            // d and dmin (adjacent f16) times the activation scale, in lanes 0 and 1.
            let dd = _mm_mul_ps(f16x2_at(b), _mm_set1_ps(ab.d));
            let d = _mm_cvtss_f32(dd);
            let dmin = _mm_cvtss_f32(_mm_movehdup_ps(dd));
            let sm = scales_mins16(b);
            accm = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(mins_dot(sm, ab)), accm);
            let mut sc = [0i16; 16];
            _mm256_storeu_si256(sc.as_mut_ptr() as *mut __m256i, sm);
            let qh = _mm256_loadu_si256(b.add(16) as *const __m256i);
            let qs = b.add(48);
            let x = ab.qs.as_ptr();
            let mut sumi = _mm256_setzero_si256();
            for j in 0..4 {
                let q = _mm256_loadu_si256(qs.add(32 * j) as *const __m256i);
                let lo = _mm256_and_si256(q, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                // Fifth bit: byte l of qh has bit j set -> add 16.
                let b0 = _mm256_set1_epi8(1 << (2 * j));
                let b1 = _mm256_set1_epi8((1u8 << (2 * j + 1)) as i8);
                let h0 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), sixteen);
                let h1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), sixteen);
                let x0 = _mm256_loadu_si256(x.add(64 * j) as *const __m256i);
                let x1 = _mm256_loadu_si256(x.add(64 * j + 32) as *const __m256i);
                // code (<= 31) x a (|a| <= 127), pairs summed: no i16 saturation.
                let p0 = _mm256_maddubs_epi16(_mm256_or_si256(lo, h0), x0);
                let p1 = _mm256_maddubs_epi16(_mm256_or_si256(hi, h1), x1);
                let p0 = _mm256_madd_epi16(p0, _mm256_set1_epi16(sc[2 * j]));
                let p1 = _mm256_madd_epi16(p1, _mm256_set1_epi16(sc[2 * j + 1]));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
            }
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
        }
        hsum_ps256(acc) - hsum_ps128(accm)
    }

    /// `vpermw` indices for the packed sums of half `h` (see `avx512`): in 128-bit lanes 0 and 1
    /// i16 lanes 0..4 take scale 4h and 4..8 scale 4h+1; in lanes 2 and 3, scales 4h+2, 4h+3.
    const fn packed_idx(h: u16) -> [u16; 32] {
        let mut c = [0u16; 32];
        let mut i = 0;
        while i < 32 {
            let lane = i / 8;
            let second = (i % 8) / 4;
            c[i] = 4 * h + 2 * (lane as u16 / 2) + second as u16;
            i += 1;
        }
        c
    }
    static PACKED: [[u16; 32]; 2] = [packed_idx(0), packed_idx(1)];
    /// `vpermw` indices (256-bit): each min (lanes 8..16 of the scales/mins vector) twice, to
    /// meet the 16-element bsums.
    static MIN_DUP: [u16; 16] = [8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15];
    /// Bytes 0..32 select bit `a` of qh, bytes 32..64 bit `b`.
    const fn bit_sel(a: u32, b: u32) -> [u8; 64] {
        let mut c = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            c[i] = if i < 32 { 1 << a } else { 1 << b };
            i += 1;
        }
        c
    }
    static BITS: [[u8; 64]; 4] = [bit_sel(0, 2), bit_sel(1, 3), bit_sel(4, 6), bit_sel(5, 7)];

    /// Block i's exact isum (8 i32 lanes) and msum (8 lanes) partial sums: as Q4_K's AVX-512
    /// kernel (`dpbusd`, pack to i16, one `dpwssd` per half; sums of 4 products are at most
    /// 4 * 31 * 127, so the pack is exact); the fifth bit comes from `qh` (duplicated into both
    /// halves of a register) through a byte test mask that adds 16.
    ///
    /// # Safety
    /// As `avx512`, with i < nb.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn isum_msum(
        w: *const u8,
        a: *const BlockQ8K,
        i: usize,
        pf: usize,
    ) -> (__m256i, __m256i) {
        let b = w.add(i * BB);
        prefetch(b, pf, BB);
        let ab = &*a.add(i);
        let sm = scales_mins16(b);
        let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
        let min_dup = _mm256_loadu_si256(MIN_DUP.as_ptr() as *const __m256i);
        let mins = _mm256_madd_epi16(bs, _mm256_permutexvar_epi16(min_dup, sm));
        let sc = _mm512_castsi256_si512(sm);
        let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(16) as *const __m256i));
        let x = ab.qs.as_ptr();
        let sumi = half_dot(b.add(48), qh, x, sc, 0, _mm512_setzero_si512());
        let sumi = half_dot(b.add(48), qh, x, sc, 1, sumi);
        (
            _mm256_add_epi32(
                _mm512_castsi512_si256(sumi),
                _mm512_extracti64x4_epi64(sumi, 1),
            ),
            mins,
        )
    }

    /// Half h (codes 128h..128h + 128) of a block's scaled integer sums added to `sumi`: the
    /// 5-bit codes against the activations by `dpbusd`, packed to i16, one `dpwssd` with the
    /// group scales.
    ///
    /// # Safety
    /// AVX-512 F/BW/VNNI; `qs` valid for 128 bytes, `x` for 256.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn half_dot(
        qs: *const u8,
        qh: __m512i,
        x: *const i8,
        sc: __m512i,
        h: usize,
        sumi: __m512i,
    ) -> __m512i {
        let m4 = _mm512_set1_epi8(0x0F);
        let sixteen = _mm512_set1_epi8(0x10);
        let zero = _mm512_setzero_si512();
        let bits = |k: usize| _mm512_loadu_si512(BITS[k].as_ptr() as *const __m512i);
        let q = _mm512_loadu_si512(qs.add(64 * h) as *const __m512i);
        let lo = _mm512_and_si512(q, m4);
        let hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        let lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, bits(2 * h)), lo, sixteen);
        let hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(qh, bits(2 * h + 1)), hi, sixteen);
        let x0 = _mm512_loadu_si512(x.add(128 * h) as *const __m512i);
        let x1 = _mm512_loadu_si512(x.add(128 * h + 64) as *const __m512i);
        let plo = _mm512_dpbusd_epi32(zero, lo, _mm512_shuffle_i64x2(x0, x1, 0x44));
        let phi = _mm512_dpbusd_epi32(zero, hi, _mm512_shuffle_i64x2(x0, x1, 0xEE));
        let ix = _mm512_loadu_si512(PACKED[h].as_ptr() as *const __m512i);
        let s = _mm512_permutexvar_epi16(ix, sc);
        _mm512_dpwssd_epi32(sumi, _mm512_packs_epi32(plo, phi), s)
    }

    /// Per block the exact integers isum and msum of `dot_scalar` (`isum_msum`), then its float
    /// operations in its order: Q4_K's AVX-512 dot (`q4_k::k_dot_avx512`), so the result has
    /// `dot_scalar`'s bits.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512(w: *const u8, a: *const BlockQ8K, nb: usize) -> f32 {
        let pf = prefetch_distance();
        k_dot_avx512!(w, a, nb, BB, isum_msum(pf))
    }

    /// Eight weight rows (`w`: row r at `r * rb`) against one to eight activation rows:
    /// `out[t][r]` has the bits of `dot_avx512(row r, a[t])` (= `dot_scalar`'s), by Q4_K's tile
    /// with the fifth bit (`q4_k::x86::avx512_8x8_k`).
    pub(super) fn tile_avx512(w: &[u8], rb: usize, a: &[ActRow<'_>], out: &mut [[f32; 8]; 8]) {
        let n = a.len();
        assert!(
            w.len() >= 8 * rb && (1..=8).contains(&n),
            "Q5_K tile: {} bytes for 8 rows of {rb}, {n} activation rows",
            w.len()
        );
        if !Isa::Avx512.supported() {
            return crate::kernels::tile_by_dots(w, rb, a, out, dot_scalar);
        }
        let nb = a.iter().map(|a| a.q8k.len()).fold(rb / BB, usize::min);
        // Missing rows point at row 0 (read, never stored).
        let ap: [*const BlockQ8K; 16] =
            std::array::from_fn(|t| a[if t < n { t } else { 0 }].q8k.as_ptr());
        let (w, o) = (w.as_ptr(), &mut out[..]);
        // SAFETY: AVX-512 F/BW/VL/VNNI present (checked above); `w` holds 8 rows of `rb` bytes,
        // each at least `nb` whole blocks, and each activation row at least `nb` blocks.
        unsafe { by_tokens!(n, avx512_8x8_k [, true] (w, rb, ap, nb, o)) }
    }

    /// `tile_avx512` for 9 to 16 activation rows (`q4_k::x86::tile16_avx512_k`): `out[t][r]`
    /// has the bits of `dot_avx512(row r, a[t])` (= `dot_scalar`'s).
    pub(super) fn tile16_avx512(w: &[u8], rb: usize, a: &[ActRow<'_>], out: &mut [[f32; 8]; 16]) {
        tile16_avx512_k::<true>(w, rb, a, out, tile_avx512)
    }
}
