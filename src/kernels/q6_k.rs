//! Q6_K: super-blocks of 256 elements, 210 bytes: `ql[128]`, `qh[64]`, `scales[16]` (i8, one
//! per 16 elements), `d` (f16). Each half h (128 elements) uses ql[64h..][..64] and
//! qh[32h..][..32]: element e takes the low nibble of ql[e] (e < 64) or the high nibble of
//! ql[e - 64], and bits 4..6 from `(qh[e % 32] >> 2 * (e / 32)) & 3`; value =
//! (d * scale) * (q - 32), in that f32 order (as `gguf.quants`).
//!
//! Dots against `Q8K` activations: sum_g sc_g * sum(q * a) - 32 * sum_g sc_g * bsum_g, exact in
//! i32, scaled by d * d_a.

use super::float::f16_le;
use super::{ActFormat, ActRow, BlockQ8K, TypeKernels};
use crate::dtype::DType;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::Q6_K,
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

const BB: usize = 210;

/// The 6-bit code (0..64) of element `i` (0..256) of a block.
#[inline]
fn code(blk: &[u8], i: usize) -> i32 {
    let (h, e) = (i / 128, i % 128);
    let ql = &blk[64 * h..];
    let lo = if e < 64 {
        ql[e] & 0x0F
    } else {
        ql[e - 64] >> 4
    };
    let hi = (blk[128 + 32 * h + e % 32] >> (2 * (e / 32))) & 3;
    (lo | (hi << 4)) as i32
}

fn dequant(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BB).zip(out.chunks_exact_mut(256)) {
        let d = f16_le(&blk[208..]);
        for (g, o) in o.chunks_exact_mut(16).enumerate() {
            let dg = d * (blk[192 + g] as i8) as f32;
            for (l, o) in o.iter_mut().enumerate() {
                *o = dg * (code(blk, 16 * g + l) - 32) as f32;
            }
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (blk, ab) in w.chunks_exact(BB).zip(a.q8k) {
        // Codes of the block in element order, then 16 exact integer group sums.
        let mut q = [0i8; 256];
        for h in 0..2 {
            let (ql, qh) = (
                &blk[64 * h..64 * h + 64],
                &blk[128 + 32 * h..128 + 32 * h + 32],
            );
            let out = &mut q[128 * h..128 * h + 128];
            for l in 0..32 {
                let hb = qh[l];
                out[l] = ((ql[l] & 0x0F) | ((hb & 3) << 4)) as i8 - 32;
                out[l + 32] = ((ql[l + 32] & 0x0F) | (((hb >> 2) & 3) << 4)) as i8 - 32;
                out[l + 64] = ((ql[l] >> 4) | (((hb >> 4) & 3) << 4)) as i8 - 32;
                out[l + 96] = ((ql[l + 32] >> 4) | (((hb >> 6) & 3) << 4)) as i8 - 32;
            }
        }
        let mut isum = 0i32;
        for (g, (qg, xg)) in q.chunks_exact(16).zip(ab.qs.chunks_exact(16)).enumerate() {
            let s: i32 = qg.iter().zip(xg).map(|(&q, &x)| q as i32 * x as i32).sum();
            isum += (blk[192 + g] as i8) as i32 * s;
        }
        sum += f16_le(&blk[208..]) * ab.d * isum as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, hsum_ps256, hsum_ps512, prefetch};
    use super::{dot_scalar, ActRow, BlockQ8K, BB};
    type Rows4 = [*const BlockQ8K; 4];
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

    /// `pshufb` control: bytes 0..8 pick scale `g`, bytes 8..16 scale `g + 1`.
    const fn pair_sel(g: u8) -> [u8; 16] {
        let mut c = [0u8; 16];
        let mut i = 0;
        while i < 16 {
            c[i] = if i < 8 { g } else { g + 1 };
            i += 1;
        }
        c
    }
    static SEL: [[u8; 16]; 8] = [
        pair_sel(0),
        pair_sel(2),
        pair_sel(4),
        pair_sel(6),
        pair_sel(8),
        pair_sel(10),
        pair_sel(12),
        pair_sel(14),
    ];

    /// 32 codes (0..64) per register: four per half, `maddubs` against the activations (codes
    /// <= 63, |a| <= 127: no i16 saturation), `madd` with the i16 scales of the two 16-element
    /// groups each register spans. The -32 offset is applied once per block through the bsums.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2(w: *const u8, a: *const BlockQ8K, nb: usize) -> f32 {
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        let mut acc = _mm256_setzero_ps();
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            let d = f16_at(b.add(208)) * ab.d;
            let sc8 = _mm_loadu_si128(b.add(192) as *const __m128i);
            let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
            let offset = _mm256_madd_epi16(bs, _mm256_cvtepi8_epi16(sc8));
            let mut sumi = _mm256_setzero_si256();
            for h in 0..2 {
                let ql0 = _mm256_loadu_si256(b.add(64 * h) as *const __m256i);
                let ql1 = _mm256_loadu_si256(b.add(64 * h + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(b.add(128 + 32 * h) as *const __m256i);
                let q = [
                    _mm256_or_si256(
                        _mm256_and_si256(ql0, m4),
                        _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(ql1, m4),
                        _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                        _mm256_and_si256(qh, m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                        _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
                    ),
                ];
                for (k, q) in q.iter().enumerate() {
                    let x =
                        _mm256_loadu_si256(ab.qs.as_ptr().add(128 * h + 32 * k) as *const __m256i);
                    let sel = _mm_loadu_si128(SEL[4 * h + k].as_ptr() as *const __m128i);
                    let s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, sel));
                    sumi =
                        _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(*q, x), s));
                }
            }
            let sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(offset, 5));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
        }
        hsum_ps256(acc)
    }

    /// `vpermw` indices for the packed sums of half `h`: in 128-bit lane k, i16 lanes 0..4 take
    /// scale 8h+k (codes 0..64 of the half) and 4..8 scale 8h+4+k (codes 64..128).
    const fn packed_idx(h: u16) -> [u16; 32] {
        let mut c = [0u16; 32];
        let mut i = 0;
        while i < 32 {
            let lane = i as u16 / 8;
            let second = (i as u16 % 8) / 4;
            c[i] = 8 * h + lane + 4 * second;
            i += 1;
        }
        c
    }
    static PACKED: [[u16; 32]; 2] = [packed_idx(0), packed_idx(1)];

    /// Per half: one 64-byte `ql` load gives codes 0..64 (low nibbles) and 64..128 (high
    /// nibbles), which line up with contiguous activations; `qh` is duplicated into both
    /// 256-bit halves and shifted per half with variable 16-bit shifts. VNNI `dpbusd` sums 4
    /// products (at most 4 * 63 * 127 < 2^15), the two results of a half are packed to i16 and
    /// one `dpwssd` applies the 16-element group scales.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512(w: *const u8, a: *const BlockQ8K, nb: usize) -> f32 {
        let m4 = _mm512_set1_epi8(0x0F);
        let m30 = _mm512_set1_epi8(0x30);
        // Codes 0..32 need qh << 4, 32..64 qh << 2; codes 64..96 qh >> 0, 96..128 qh >> 2.
        let shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
        let shr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
        let idx: [__m512i; 2] =
            std::array::from_fn(|k| _mm512_loadu_si512(PACKED[k].as_ptr() as *const __m512i));
        let zero = _mm512_setzero_si512();
        let mut acc = _mm512_setzero_ps();
        let mut acc_off = _mm256_setzero_ps();
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            let d = f16_at(b.add(208)) * ab.d;
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i));
            let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
            let off = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, sc16));
            acc_off = _mm256_fmadd_ps(_mm256_set1_ps(d), off, acc_off);
            let sc = _mm512_castsi256_si512(sc16);
            let x = ab.qs.as_ptr();
            let mut sumi = _mm512_setzero_si512();
            for (h, ix) in idx.iter().enumerate() {
                let ql = _mm512_loadu_si512(b.add(64 * h) as *const __m512i);
                let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    b.add(128 + 32 * h) as *const __m256i
                ));
                // lo | (high bits & 0x30), fused: ternary logic A | (B & C) = 0xF8.
                let lo = _mm512_ternarylogic_epi32(
                    _mm512_and_si512(ql, m4),
                    _mm512_sllv_epi16(qh, shl),
                    m30,
                    0xF8,
                );
                let qlh = _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4);
                let hi = _mm512_ternarylogic_epi32(qlh, _mm512_srlv_epi16(qh, shr), m30, 0xF8);
                let x0 = _mm512_loadu_si512(x.add(128 * h) as *const __m512i);
                let x1 = _mm512_loadu_si512(x.add(128 * h + 64) as *const __m512i);
                let p = _mm512_packs_epi32(
                    _mm512_dpbusd_epi32(zero, lo, x0),
                    _mm512_dpbusd_epi32(zero, hi, x1),
                );
                sumi = _mm512_dpwssd_epi32(sumi, p, _mm512_permutexvar_epi16(*ix, sc));
            }
            acc = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sumi), acc);
        }
        hsum_ps512(acc) - 32.0 * hsum_ps256(acc_off)
    }

    /// `avx2` for four activation rows: the 6-bit codes and scales of a weight block are
    /// unpacked once and dotted with each row; per row the float operations are `avx2`'s, in
    /// the same order (integer sums are exact in any order), so each result has its bits.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, each `a[r]` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_x4(w: *const u8, a: Rows4, nb: usize, out: &mut [f32; 4]) {
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        let mut acc = [_mm256_setzero_ps(); 4];
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let dw = f16_at(b.add(208));
            let sc8 = _mm_loadu_si128(b.add(192) as *const __m128i);
            let sc16 = _mm256_cvtepi8_epi16(sc8);
            let mut sumi = [_mm256_setzero_si256(); 4];
            for h in 0..2 {
                let ql0 = _mm256_loadu_si256(b.add(64 * h) as *const __m256i);
                let ql1 = _mm256_loadu_si256(b.add(64 * h + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(b.add(128 + 32 * h) as *const __m256i);
                let q = [
                    _mm256_or_si256(
                        _mm256_and_si256(ql0, m4),
                        _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(ql1, m4),
                        _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                        _mm256_and_si256(qh, m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                        _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
                    ),
                ];
                for (k, q) in q.iter().enumerate() {
                    let sel = _mm_loadu_si128(SEL[4 * h + k].as_ptr() as *const __m128i);
                    let s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, sel));
                    for r in 0..4 {
                        let x = _mm256_loadu_si256(
                            (*a[r].add(i)).qs.as_ptr().add(128 * h + 32 * k) as *const __m256i,
                        );
                        sumi[r] = _mm256_add_epi32(
                            sumi[r],
                            _mm256_madd_epi16(_mm256_maddubs_epi16(*q, x), s),
                        );
                    }
                }
            }
            for r in 0..4 {
                let ab = &*a[r].add(i);
                let d = dw * ab.d;
                let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
                let offset = _mm256_madd_epi16(bs, sc16);
                let s = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(offset, 5));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(s), acc[r]);
            }
        }
        for r in 0..4 {
            out[r] = hsum_ps256(acc[r]);
        }
    }

    /// `avx512` for four activation rows (see `avx2_x4`): same per-row float operations, so
    /// each result has `avx512`'s bits.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + F16C; `w` valid for `nb` blocks, each `a[r]` for `nb` blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512_x4(w: *const u8, a: Rows4, nb: usize, out: &mut [f32; 4]) {
        let m4 = _mm512_set1_epi8(0x0F);
        let m30 = _mm512_set1_epi8(0x30);
        let shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
        let shr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
        let idx: [__m512i; 2] =
            std::array::from_fn(|k| _mm512_loadu_si512(PACKED[k].as_ptr() as *const __m512i));
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut acc_off = [_mm256_setzero_ps(); 4];
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let dw = f16_at(b.add(208));
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i));
            let sc = _mm512_castsi256_si512(sc16);
            let mut codes = [(zero, zero); 2];
            let mut s = [zero; 2];
            for (h, ix) in idx.iter().enumerate() {
                let ql = _mm512_loadu_si512(b.add(64 * h) as *const __m512i);
                let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    b.add(128 + 32 * h) as *const __m256i
                ));
                let lo = _mm512_ternarylogic_epi32(
                    _mm512_and_si512(ql, m4),
                    _mm512_sllv_epi16(qh, shl),
                    m30,
                    0xF8,
                );
                let qlh = _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4);
                let hi = _mm512_ternarylogic_epi32(qlh, _mm512_srlv_epi16(qh, shr), m30, 0xF8);
                codes[h] = (lo, hi);
                s[h] = _mm512_permutexvar_epi16(*ix, sc);
            }
            for r in 0..4 {
                let ab = &*a[r].add(i);
                let d = dw * ab.d;
                let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
                let off = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, sc16));
                acc_off[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), off, acc_off[r]);
                let x = ab.qs.as_ptr();
                let mut sumi = zero;
                for h in 0..2 {
                    let x0 = _mm512_loadu_si512(x.add(128 * h) as *const __m512i);
                    let x1 = _mm512_loadu_si512(x.add(128 * h + 64) as *const __m512i);
                    let (lo, hi) = codes[h];
                    let p = _mm512_packs_epi32(
                        _mm512_dpbusd_epi32(zero, lo, x0),
                        _mm512_dpbusd_epi32(zero, hi, x1),
                    );
                    sumi = _mm512_dpwssd_epi32(sumi, p, s[h]);
                }
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sumi), acc[r]);
            }
        }
        for r in 0..4 {
            out[r] = hsum_ps512(acc[r]) - 32.0 * hsum_ps256(acc_off[r]);
        }
    }
}
