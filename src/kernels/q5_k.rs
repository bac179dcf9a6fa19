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
    use super::super::q4_k::x86::{hadd512, mins_dot, scales_mins16, scales_mins_x4, SCALE_SEL512};
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
                accm[r] =
                    _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(mins_dot(sm, ab)), accm[r]);
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
    unsafe fn isum_msum(w: *const u8, a: *const BlockQ8K, i: usize, pf: usize) -> (__m256i, __m256i) {
        let m4 = _mm512_set1_epi8(0x0F);
        let sixteen = _mm512_set1_epi8(0x10);
        let zero = _mm512_setzero_si512();
        let b = w.add(i * BB);
        prefetch(b, pf, BB);
        let ab = &*a.add(i);
        let sm = scales_mins16(b);
        let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
        let min_dup = _mm256_loadu_si256(MIN_DUP.as_ptr() as *const __m256i);
        let mins = _mm256_madd_epi16(bs, _mm256_permutexvar_epi16(min_dup, sm));
        let sc = _mm512_castsi256_si512(sm);
        let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(16) as *const __m256i));
        let qs = b.add(48);
        let x = ab.qs.as_ptr();
        let mut sumi = _mm512_setzero_si512();
        for h in 0..2 {
            let bits = |k: usize| _mm512_loadu_si512(BITS[k].as_ptr() as *const __m512i);
            let q = _mm512_loadu_si512(qs.add(64 * h) as *const __m512i);
            let lo = _mm512_and_si512(q, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
            let lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, bits(2 * h)), lo, sixteen);
            let hi =
                _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(qh, bits(2 * h + 1)), hi, sixteen);
            let x0 = _mm512_loadu_si512(x.add(128 * h) as *const __m512i);
            let x1 = _mm512_loadu_si512(x.add(128 * h + 64) as *const __m512i);
            let plo = _mm512_dpbusd_epi32(zero, lo, _mm512_shuffle_i64x2(x0, x1, 0x44));
            let phi = _mm512_dpbusd_epi32(zero, hi, _mm512_shuffle_i64x2(x0, x1, 0xEE));
            let ix = _mm512_loadu_si512(PACKED[h].as_ptr() as *const __m512i);
            let s = _mm512_permutexvar_epi16(ix, sc);
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_packs_epi32(plo, phi), s);
        }
        (
            _mm256_add_epi32(_mm512_castsi512_si256(sumi), _mm512_extracti64x4_epi64(sumi, 1)),
            mins,
        )
    }

    /// Per block the exact integers isum and msum of `dot_scalar` (`isum_msum`), summed across
    /// lanes four blocks at a time by one `hadd` tree, then its float operations in its order
    /// (`sum += d * d_a * isum - dmin * d_a * msum`), so the result has `dot_scalar`'s bits (as
    /// Q4_K's).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512(w: *const u8, a: *const BlockQ8K, nb: usize) -> f32 {
        let mut sum = 0.0f32;
        let pf = prefetch_distance();
        let mut i = 0;
        while i + 4 <= nb {
            let p = [
                isum_msum(w, a, i, pf),
                isum_msum(w, a, i + 1, pf),
                isum_msum(w, a, i + 2, pf),
                isum_msum(w, a, i + 3, pf),
            ];
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
            let dd = |k: usize| std::ptr::read_unaligned(w.add((i + k) * BB) as *const i32);
            let f = _mm256_cvtph_ps(_mm_setr_epi32(dd(0), dd(1), dd(2), dd(3)));
            let (lo, hi) = (_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
            let dw = _mm_shuffle_ps(lo, hi, 0b10_00_10_00);
            let dm = _mm_shuffle_ps(lo, hi, 0b11_01_11_01);
            let ad = _mm_setr_ps(
                (*a.add(i)).d,
                (*a.add(i + 1)).d,
                (*a.add(i + 2)).d,
                (*a.add(i + 3)).d,
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
        for i in i..nb {
            let (v, mins) = isum_msum(w, a, i, pf);
            // [isum, msum] partial sums, then isum in lane 0 and msum in lane 1.
            let h = _mm256_hadd_epi32(v, mins);
            let h = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            let h = _mm_hadd_epi32(h, h);
            let t = _mm_mul_ps(
                _mm_mul_ps(f16x2_at(w.add(i * BB)), _mm_set1_ps((*a.add(i)).d)),
                _mm_cvtepi32_ps(h),
            );
            sum += _mm_cvtss_f32(t) - _mm_cvtss_f32(_mm_movehdup_ps(t));
        }
        sum
    }

    /// Eight weight rows (`w`: row r at `r * rb`) against one to eight activation rows:
    /// `out[t][r]` has the bits of `dot_avx512(row r, a[t])` (= `dot_scalar`'s).
    pub(super) fn tile_avx512(w: &[u8], rb: usize, a: &[ActRow<'_>], out: &mut [[f32; 8]; 8]) {
        let n = a.len();
        assert!(
            w.len() >= 8 * rb && (1..=8).contains(&n),
            "Q5_K tile: {} bytes for 8 rows of {rb}, {n} activation rows",
            w.len()
        );
        if !Isa::Avx512.supported() {
            for (o, t) in out.iter_mut().zip(a) {
                for (r, o) in o.iter_mut().enumerate() {
                    *o = dot_scalar(&w[r * rb..(r + 1) * rb], t);
                }
            }
            return;
        }
        let nb = a.iter().map(|a| a.q8k.len()).fold(rb / BB, usize::min);
        // Missing rows point at row 0 (read, never stored).
        let ap: [*const BlockQ8K; 8] =
            std::array::from_fn(|t| a[if t < n { t } else { 0 }].q8k.as_ptr());
        let (w, o) = (w.as_ptr(), out);
        // SAFETY: AVX-512 F/BW/VL/VNNI present (checked above); `w` holds 8 rows of `rb` bytes,
        // each at least `nb` whole blocks, and each activation row at least `nb` blocks.
        unsafe {
            match n {
                1 => avx512_8x8::<1>(w, rb, ap, nb, o),
                2 => avx512_8x8::<2>(w, rb, ap, nb, o),
                3 => avx512_8x8::<3>(w, rb, ap, nb, o),
                4 => avx512_8x8::<4>(w, rb, ap, nb, o),
                5 => avx512_8x8::<5>(w, rb, ap, nb, o),
                6 => avx512_8x8::<6>(w, rb, ap, nb, o),
                7 => avx512_8x8::<7>(w, rb, ap, nb, o),
                _ => avx512_8x8::<8>(w, rb, ap, nb, o),
            }
        }
    }

    /// Q4_K's 8x8 tile (`q4_k::x86::avx512_8x8`, which see) with the fifth bit: the rows' `qh`
    /// is transposed in 8-byte words as `qs` is, and per 32-byte chunk k the low (high) nibbles
    /// of word g gain 16 where bit 2k (2k + 1) of qh's word g is set. With 5-bit codes a lane of
    /// four `dpbusd` could reach 16 * 31 * 127 > 2^15, so each nibble half sums words 0-1 and
    /// 2-3 apart (at most 8 * 31 * 127 < 2^15) and each pair is packed and scaled by its own
    /// `dpwssd`: the same exact integers. The float operations are `dot_scalar`'s in its order.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + F16C; rows `w + r * rb` (r < 8) valid for `nb` blocks, each
    /// `a[t]` for `nb` activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512_8x8<const T: usize>(
        w: *const u8,
        rb: usize,
        a: [*const BlockQ8K; 8],
        nb: usize,
        out: &mut [[f32; 8]; 8],
    ) {
        let m4 = _mm512_set1_epi8(0x0F);
        let sixteen = _mm512_set1_epi8(0x10);
        let zero = _mm512_setzero_si512();
        let tr: [__m512i; 2] = [
            _mm512_setr_epi64(0, 4, 8, 12, 1, 5, 9, 13),
            _mm512_setr_epi64(2, 6, 10, 14, 3, 7, 11, 15),
        ];
        let sel: [__m512i; 4] =
            std::array::from_fn(|k| _mm512_loadu_si512(SCALE_SEL512[k].as_ptr() as *const __m512i));
        let rows_d = _mm512_setr_epi32(0, 2, 0, 2, 4, 6, 4, 6, 8, 10, 8, 10, 12, 14, 12, 14);
        let rows_m = _mm512_add_epi32(rows_d, _mm512_set1_epi32(1));
        let even_q = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14);
        let odd_q = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
        let first_dw = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
        let tok_idx: [__m512i; 4] = std::array::from_fn(|p| {
            let (t, u) = (2 * p as i32, 2 * p as i32 + 1);
            _mm512_setr_epi32(t, t, u, u, t, t, u, u, t, t, u, u, t, t, u, u)
        });
        const P: usize = 4;
        let mut acc = [_mm512_setzero_ps(); P];
        let pf = if prefetch_distance() == 0 { 0 } else { 8 * rb };
        // Eight rows' 32-byte pieces at byte `off` of their block i, transposed in 8-byte words:
        // register g holds word g of rows 0..8 (row r in qword r).
        let words = |i: usize, off: usize| -> [__m512i; 4] {
            let ld = |r: usize| _mm256_loadu_si256(w.add(r * rb + i * BB + off) as *const __m256i);
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
        for i in 0..nb {
            let blk = |r: usize| w.add(r * rb + i * BB);
            for r in 0..8 {
                prefetch(blk(r), pf, BB);
            }
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
            let dd = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi32(
                v0, first_dw, v1,
            )));
            let ab: [&BlockQ8K; 8] = std::array::from_fn(|t| &*a[t].add(i));
            let qh = words(i, 16);
            let mut s32 = [_mm512_setzero_si512(); 8];
            for (k, &sel) in sel.iter().enumerate() {
                let raw = words(i, 48 + 32 * k);
                let (bl, bh) = (_mm512_set1_epi8(1 << (2 * k)), _mm512_set1_epi8(2 << (2 * k)));
                let lo: [__m512i; 4] = std::array::from_fn(|g| {
                    let v = _mm512_and_si512(raw[g], m4);
                    _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(qh[g], bl), v, sixteen)
                });
                let hi: [__m512i; 4] = std::array::from_fn(|g| {
                    let v = _mm512_and_si512(_mm512_srli_epi16(raw[g], 4), m4);
                    _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(qh[g], bh), v, sixteen)
                });
                let s = _mm512_shuffle_epi8(sq, sel);
                for t in 0..T {
                    let x = ab[t].qs.as_ptr().add(64 * k);
                    let bc = |o: usize| {
                        _mm512_set1_epi64(std::ptr::read_unaligned(x.add(o) as *const i64))
                    };
                    for half in 0..2 {
                        let g0 = 2 * half;
                        let pl = _mm512_dpbusd_epi32(zero, lo[g0], bc(8 * g0));
                        let pl = _mm512_dpbusd_epi32(pl, lo[g0 + 1], bc(8 * g0 + 8));
                        let ph = _mm512_dpbusd_epi32(zero, hi[g0], bc(32 + 8 * g0));
                        let ph = _mm512_dpbusd_epi32(ph, hi[g0 + 1], bc(32 + 8 * g0 + 8));
                        s32[t] = _mm512_dpwssd_epi32(s32[t], _mm512_packs_epi32(pl, ph), s);
                    }
                }
            }
            let rs: [__m512i; 8] = std::array::from_fn(|t| {
                _mm512_add_epi32(s32[t], _mm512_shuffle_epi32::<_MM_PERM_BADC>(s32[t]))
            });
            let ma =
                _mm512_cvtepu8_epi16(_mm512_castsi512_si256(_mm512_permutexvar_epi64(even_q, mq)));
            let mb =
                _mm512_cvtepu8_epi16(_mm512_castsi512_si256(_mm512_permutexvar_epi64(odd_q, mq)));
            let hm = |t: usize| {
                let bp = _mm512_broadcast_i32x4(_mm_loadu_si128(
                    ab[t].bsum32.as_ptr() as *const __m128i
                ));
                hadd512(_mm512_madd_epi16(ma, bp), _mm512_madd_epi16(mb, bp))
            };
            let da = _mm512_castps256_ps512(_mm256_setr_ps(
                ab[0].d, ab[1].d, ab[2].d, ab[3].d, ab[4].d, ab[5].d, ab[6].d, ab[7].d,
            ));
            let dwq = _mm512_permutexvar_ps(rows_d, dd);
            let dmq = _mm512_permutexvar_ps(rows_m, dd);
            for p in 0..T.div_ceil(2) {
                let (t, u) = (2 * p, (2 * p + 1).min(T - 1));
                let isum = _mm512_unpacklo_epi64(rs[t], rs[u]);
                let msum = hadd512(hm(t), hm(u));
                let dap = _mm512_permutexvar_ps(tok_idx[p], da);
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
