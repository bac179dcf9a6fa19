//! Q6_K: super-blocks of 256 elements, 210 bytes: `ql[128]`, `qh[64]`, `scales[16]` (i8, one
//! per 16 elements), `d` (f16). Each half h (128 elements) uses ql[64h..][..64] and
//! qh[32h..][..32]: element e takes the low nibble of ql[e] (e < 64) or the high nibble of
//! ql[e - 64], and bits 4..6 from `(qh[e % 32] >> 2 * (e / 32)) & 3`; value =
//! (d * scale) * (q - 32), in that f32 order (as `gguf.quants`).
//!
//! Dots against `Q8K` activations: per super-block the exact integer
//! isum = sum_g sc_g * sum((q - 32) * a) (|isum| < 2^27: exact in i32), then one float step in
//! block order, sum += (d * d_a) * isum (no FMA). Every SIMD dot (single-row and four-row; AVX2
//! and AVX-512) computes that integer exactly (as sum_g sc_g * sum(q * a) minus
//! 32 * sum_g sc_g * bsum_g) and then the same float operations, so all give the scalar dot's
//! bits: a token's logits do not depend on how many tokens share its matmul.

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
    use super::super::simd::x86::{f16_at, prefetch};
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

    /// Lane k: the sum of the eight i32 lanes of `v[k]` (exact in any order).
    ///
    /// # Safety
    /// AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum4(v: [__m256i; 4]) -> __m128i {
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))
    }

    /// The sum of the eight i32 lanes of `v`.
    ///
    /// # Safety
    /// AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum1(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<1>(s)))
    }

    /// `dot_scalar`'s float step for blocks i..i+4 (isum of block i + k in lane k), in block
    /// order: sum += (d * d_a) * isum, no FMA.
    ///
    /// # Safety
    /// AVX2+F16C; `w` valid for blocks i..i+4, `a` for activation blocks i..i+4.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn add4(mut sum: f32, isum: __m128i, w: *const u8, a: *const BlockQ8K, i: usize) -> f32 {
        let dh: [u16; 4] = std::array::from_fn(|k| {
            std::ptr::read_unaligned(w.add((i + k) * BB + 208) as *const u16)
        });
        // A full-register load (`vmovq`), not lane inserts (see `f16x2_at`).
        let dw = _mm_cvtph_ps(_mm_loadl_epi64(dh.as_ptr() as *const __m128i));
        let ad = |k: usize| (*a.add(i + k)).d;
        let da = _mm_setr_ps(ad(0), ad(1), ad(2), ad(3));
        let t = _mm_mul_ps(_mm_mul_ps(dw, da), _mm_cvtepi32_ps(isum));
        let mut d = [0.0f32; 4];
        _mm_storeu_ps(d.as_mut_ptr(), t);
        for d in d {
            sum += d;
        }
        sum
    }

    /// A single-row dot from a block function giving block i's isum spread over eight i32
    /// lanes: four blocks summed across lanes by one `hadd` tree, then `add4`; the last
    /// blocks one at a time. A macro so that each ISA's block function is inlined in its loop.
    macro_rules! q6_dot {
        ($w:expr, $a:expr, $nb:expr, $block:ident($($arg:expr),*)) => {{
            let mut sum = 0.0f32;
            let mut i = 0;
            while i + 4 <= $nb {
                let mut v = [_mm256_setzero_si256(); 4];
                for (k, v) in v.iter_mut().enumerate() {
                    *v = $block($w, $a, i + k, $($arg),*);
                }
                sum = add4(sum, hsum4(v), $w, $a, i);
                i += 4;
            }
            for i in i..$nb {
                let isum = hsum1($block($w, $a, i, $($arg),*));
                sum += f16_at($w.add(i * BB + 208)) * (*$a.add(i)).d * isum as f32;
            }
            sum
        }};
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

    /// The 6-bit codes (0..64) of one half from its `ql[0..32]`, `ql[32..64]` and `qh[0..32]`
    /// (or the same words of several rows, transposed alike: the operations are bytewise):
    /// `[k]` holds elements 32k..32k+32 of the half.
    ///
    /// # Safety
    /// AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn codes(ql0: __m256i, ql1: __m256i, qh: __m256i) -> [__m256i; 4] {
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        [
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
        ]
    }

    /// The block's codes, `[4h + k]`: elements 128h + 32k .. +32.
    ///
    /// # Safety
    /// AVX2; `b` valid for a block.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn block_codes(b: *const u8) -> [__m256i; 8] {
        let ld = |o: usize| _mm256_loadu_si256(b.add(o) as *const __m256i);
        let c0 = codes(ld(0), ld(32), ld(128));
        let c1 = codes(ld(64), ld(96), ld(160));
        [c0[0], c0[1], c0[2], c0[3], c1[0], c1[1], c1[2], c1[3]]
    }

    /// The block's scales per 32 codes (`[j]`: scales 2j and 2j+1, eight i16 lanes each).
    ///
    /// # Safety
    /// AVX2; `b` valid for a block.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn block_scales(b: *const u8) -> [__m256i; 8] {
        let sc8 = _mm_loadu_si128(b.add(192) as *const __m128i);
        std::array::from_fn(|j| {
            let sel = _mm_loadu_si128(SEL[j].as_ptr() as *const __m128i);
            _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, sel))
        })
    }

    /// Eight i32 lanes that sum to the block's isum against activation block `ab`: `maddubs`
    /// of codes and activations (codes <= 63, |a| <= 127: no i16 saturation), `madd` with the
    /// group scales, less 32 * sum_g sc_g * bsum_g.
    ///
    /// # Safety
    /// AVX2; `b` valid for a block.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn isum8(q: &[__m256i; 8], s: &[__m256i; 8], b: *const u8, ab: &BlockQ8K) -> __m256i {
        let mut sumi = _mm256_setzero_si256();
        for j in 0..8 {
            let x = _mm256_loadu_si256(ab.qs.as_ptr().add(32 * j) as *const __m256i);
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], x), s[j]));
        }
        let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i));
        let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
        _mm256_sub_epi32(sumi, _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5))
    }

    /// Block i's isum over eight lanes (see `isum8`).
    ///
    /// # Safety
    /// AVX2; i < the blocks `w` and `a` hold.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn block_avx2(w: *const u8, a: *const BlockQ8K, i: usize, pf: usize) -> __m256i {
        let b = w.add(i * BB);
        prefetch(b, pf, BB);
        isum8(&block_codes(b), &block_scales(b), b, &*a.add(i))
    }

    /// Per block the exact isum of `dot_scalar` (`isum8`), then its float step in its order,
    /// so the result has `dot_scalar`'s bits.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2(w: *const u8, a: *const BlockQ8K, nb: usize) -> f32 {
        let pf = prefetch_distance();
        q6_dot!(w, a, nb, block_avx2(pf))
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

    /// The AVX-512 form of a block: per half, `[0]` codes 0..64 (low nibbles of one 64-byte
    /// `ql` load) and `[1]` codes 64..128 (high nibbles), which line up with contiguous
    /// activations; `qh` is duplicated into both 256-bit halves and shifted per half with
    /// variable 16-bit shifts.
    ///
    /// # Safety
    /// AVX-512 F/BW; `b` valid for a block.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    unsafe fn codes512(b: *const u8, h: usize) -> [__m512i; 2] {
        let m4 = _mm512_set1_epi8(0x0F);
        let m30 = _mm512_set1_epi8(0x30);
        // Codes 0..32 need qh << 4, 32..64 qh << 2; codes 64..96 qh >> 0, 96..128 qh >> 2.
        let shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
        let shr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
        let ql = _mm512_loadu_si512(b.add(64 * h) as *const __m512i);
        let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(128 + 32 * h) as *const __m256i));
        // lo | (high bits & 0x30), fused: ternary logic A | (B & C) = 0xF8.
        let lo = _mm512_ternarylogic_epi32(
            _mm512_and_si512(ql, m4),
            _mm512_sllv_epi16(qh, shl),
            m30,
            0xF8,
        );
        let qlh = _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4);
        let hi = _mm512_ternarylogic_epi32(qlh, _mm512_srlv_epi16(qh, shr), m30, 0xF8);
        [lo, hi]
    }

    /// Eight i32 lanes that sum to the block's isum (AVX-512 form): per half, VNNI `dpbusd`
    /// sums 4 products (at most 4 * 63 * 127 < 2^15), the two results are packed to i16 and
    /// one `dpwssd` applies the group scales (`s[h]`, permuted by `PACKED`); the 16 lanes are
    /// folded to 8 and 32 * sum_g sc_g * bsum_g taken off.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    unsafe fn isum512(
        q: &[[__m512i; 2]; 2],
        s: &[__m512i; 2],
        sc16: __m256i,
        ab: &BlockQ8K,
    ) -> __m256i {
        let zero = _mm512_setzero_si512();
        let x = ab.qs.as_ptr();
        let mut sumi = zero;
        for h in 0..2 {
            let x0 = _mm512_loadu_si512(x.add(128 * h) as *const __m512i);
            let x1 = _mm512_loadu_si512(x.add(128 * h + 64) as *const __m512i);
            let p = _mm512_packs_epi32(
                _mm512_dpbusd_epi32(zero, q[h][0], x0),
                _mm512_dpbusd_epi32(zero, q[h][1], x1),
            );
            sumi = _mm512_dpwssd_epi32(sumi, p, s[h]);
        }
        let v = _mm256_add_epi32(
            _mm512_castsi512_si256(sumi),
            _mm512_extracti64x4_epi64::<1>(sumi),
        );
        let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
        _mm256_sub_epi32(v, _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5))
    }

    /// The block's scales as i16 (`.0`) and permuted for `isum512` (`.1`).
    ///
    /// # Safety
    /// AVX-512 F/BW; `b` valid for a block.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    unsafe fn scales512(b: *const u8) -> (__m256i, [__m512i; 2]) {
        let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i));
        let sc = _mm512_castsi256_si512(sc16);
        let s = std::array::from_fn(|h| {
            _mm512_permutexvar_epi16(_mm512_loadu_si512(PACKED[h].as_ptr() as *const __m512i), sc)
        });
        (sc16, s)
    }

    /// Block i's isum over eight lanes (see `isum512`).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI; i < the blocks `w` and `a` hold.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
    unsafe fn block_avx512(w: *const u8, a: *const BlockQ8K, i: usize, pf: usize) -> __m256i {
        let b = w.add(i * BB);
        prefetch(b, pf, BB);
        let (sc16, s) = scales512(b);
        isum512(&[codes512(b, 0), codes512(b, 1)], &s, sc16, &*a.add(i))
    }

    /// `avx2` with VNNI (`isum512`): the same exact isum and float steps, `dot_scalar`'s bits.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512(w: *const u8, a: *const BlockQ8K, nb: usize) -> f32 {
        let pf = prefetch_distance();
        q6_dot!(w, a, nb, block_avx512(pf))
    }

    /// The float step of four activation rows in `dot_scalar`'s order (lane r: row r):
    /// acc += (d * d_a) * isum.
    ///
    /// # Safety
    /// AVX2+F16C; `b` valid for a block, each `a[r]` for block i.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn step4(acc: __m128, isum: __m128i, b: *const u8, a: &Rows4, i: usize) -> __m128 {
        let dw = _mm_set1_ps(f16_at(b.add(208)));
        let ad = |r: usize| (*a[r].add(i)).d;
        let da = _mm_setr_ps(ad(0), ad(1), ad(2), ad(3));
        _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(dw, da), _mm_cvtepi32_ps(isum)))
    }

    /// `avx2` for four activation rows: the block's codes and scales are unpacked once, each
    /// row's isum is `avx2`'s (summed across lanes by one `hadd` tree for the four rows) and
    /// the float step runs on four lanes in the same order, so each result has `avx2`'s
    /// (= `dot_scalar`'s) bits.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, each `a[r]` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_x4(w: *const u8, a: Rows4, nb: usize, out: &mut [f32; 4]) {
        let mut acc = _mm_setzero_ps();
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let (q, s) = (block_codes(b), block_scales(b));
            // Explicit calls: a closure here is not always inlined.
            let v = [
                isum8(&q, &s, b, &*a[0].add(i)),
                isum8(&q, &s, b, &*a[1].add(i)),
                isum8(&q, &s, b, &*a[2].add(i)),
                isum8(&q, &s, b, &*a[3].add(i)),
            ];
            acc = step4(acc, hsum4(v), b, &a, i);
        }
        _mm_storeu_ps(out.as_mut_ptr(), acc);
    }

    /// `avx512` for four activation rows (see `avx2_x4`): same isums and float steps, so each
    /// result has `avx512`'s (= `dot_scalar`'s) bits.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + F16C; `w` valid for `nb` blocks, each `a[r]` for `nb` blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512_x4(w: *const u8, a: Rows4, nb: usize, out: &mut [f32; 4]) {
        let mut acc = _mm_setzero_ps();
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let (sc16, s) = scales512(b);
            let q = [codes512(b, 0), codes512(b, 1)];
            let v = [
                isum512(&q, &s, sc16, &*a[0].add(i)),
                isum512(&q, &s, sc16, &*a[1].add(i)),
                isum512(&q, &s, sc16, &*a[2].add(i)),
                isum512(&q, &s, sc16, &*a[3].add(i)),
            ];
            acc = step4(acc, hsum4(v), b, &a, i);
        }
        _mm_storeu_ps(out.as_mut_ptr(), acc);
    }
}
