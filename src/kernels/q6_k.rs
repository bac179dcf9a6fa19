//! Q6_K: super-blocks of 256 elements, 210 bytes: `ql[128]`, `qh[64]`, `scales[16]` (i8, one
//! per 16 elements), `d` (f16). Each half h (128 elements) uses ql[64h..][..64] and
//! qh[32h..][..32]: element e takes the low nibble of ql[e] (e < 64) or the high nibble of
//! ql[e - 64], and bits 4..6 from `(qh[e % 32] >> 2 * (e / 32)) & 3`; value =
//! (d * scale) * (q - 32), in that f32 order (as `gguf.quants`).
//!
//! Dots against `Q8K` activations: per super-block the exact integer
//! isum = sum_g sc_g * sum((q - 32) * a) (|isum| < 2^27: exact in i32), then one float step in
//! block order, sum += (d * d_a) * isum (no FMA). Every SIMD dot (single-row, four-row, 8x8 tile;
//! AVX2 and AVX-512) computes that integer exactly (as sum_g sc_g * sum(q * a) minus
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

/// The 8-row x 8-token tile (prefill): see `kernels::tile_fn`. AVX2 only; at AVX-512 prefill
/// keeps the four-row dot (an AVX2 tile there would give the same bits, but is unmeasured).
pub(super) const TILE: super::TileKernels = super::TileKernels {
    #[cfg(target_arch = "x86_64")]
    avx2: Some(x86::tile_avx2),
    #[cfg(not(target_arch = "x86_64"))]
    avx2: None,
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
    use super::super::q4_k::x86::{bcast8, transpose_q};
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, hsum_epi32, prefetch};
    use super::{dot_scalar, ActRow, BlockQ8K, BB};
    type Rows4 = [*const BlockQ8K; 4];
    type Rows8 = [*const BlockQ8K; 8];
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

    /// Eight weight rows (`w`: `8 * rb` bytes, row r at `r * rb`) against one to eight
    /// activation rows (`avx2_8x8`): `out[t][r]` has the bits of `dot_avx2(row r, a[t])`
    /// (= `dot_scalar`'s).
    pub(super) fn tile_avx2(w: &[u8], rb: usize, a: &[ActRow<'_>], out: &mut [[f32; 8]; 8]) {
        let n = a.len();
        assert!(
            w.len() >= 8 * rb && (1..=8).contains(&n),
            "Q6_K tile: {} bytes for 8 rows of {rb}, {n} activation rows",
            w.len()
        );
        if !Isa::Avx2.supported() {
            return crate::kernels::tile_by_dots(w, rb, a, out, dot_scalar);
        }
        let nb = a.iter().map(|a| a.q8k.len()).fold(rb / BB, usize::min);
        // Missing rows point at row 0 (read, never stored).
        let ap: Rows8 = std::array::from_fn(|t| a[if t < n { t } else { 0 }].q8k.as_ptr());
        let wp = w.as_ptr();
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` holds 8 rows of `rb` bytes,
        // each at least `nb` whole blocks, and each activation row at least `nb` blocks.
        unsafe { by_tokens!(n, avx2_8x8 [] (wp, rb, ap, nb, out)) }
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

    /// `dot_scalar`'s float step for blocks i..i+4 (isum of block i + k in lane k), in block
    /// order: sum += (d * d_a) * isum, no FMA.
    ///
    /// # Safety
    /// AVX2+F16C; `w` valid for blocks i..i+4, `a` for activation blocks i..i+4.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn add4(mut sum: f32, isum: __m128i, w: *const u8, a: *const BlockQ8K, i: usize) -> f32 {
        // The words at bytes 206..210 (d in the upper half): `vmovd` then `vpinsrd`, no 16-bit
        // inserts into a register LLVM may pick (such as `sum`'s: see `f16x2_at`).
        let dd = |k: usize| std::ptr::read_unaligned(w.add((i + k) * BB + 206) as *const i32);
        let f = _mm256_cvtph_ps(_mm_setr_epi32(dd(0), dd(1), dd(2), dd(3)));
        let dw = _mm_shuffle_ps::<0b11_01_11_01>(
            _mm256_castps256_ps128(f),
            _mm256_extractf128_ps::<1>(f),
        );
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
                let isum = hsum_epi32($block($w, $a, i, $($arg),*));
                sum += f16_at($w.add(i * BB + 208)) * (*$a.add(i)).d * isum as f32;
            }
            sum
        }};
    }

    /// `pshufb` controls against a half of the block's i16 scales in both 128-bit lanes:
    /// `[m]` gives scale 2m of the half in i16 lanes 0..8 and 2m + 1 in lanes 8..16.
    const fn pair_sel(m: u8) -> [u8; 32] {
        let mut c = [0u8; 32];
        let mut i = 0;
        while i < 32 {
            let s = if i < 16 { 2 * m } else { 2 * m + 1 };
            c[i] = 2 * s + (i % 2) as u8;
            i += 1;
        }
        c
    }
    static SEL: [[u8; 32]; 4] = [pair_sel(0), pair_sel(1), pair_sel(2), pair_sel(3)];

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

    /// The block's 16 scales as i16.
    ///
    /// # Safety
    /// AVX2; `b` valid for a block.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn scales16(b: *const u8) -> __m256i {
        _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i))
    }

    /// The block's scales per 32 codes from `scales16` (`[j]`: scales 2j and 2j+1, eight i16
    /// lanes each): each half of the scales in both 128-bit lanes, then one `pshufb` per pair.
    ///
    /// # Safety
    /// AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn block_scales(sc16: __m256i) -> [__m256i; 8] {
        let half = [
            _mm256_permute4x64_epi64::<0b01_00_01_00>(sc16),
            _mm256_permute4x64_epi64::<0b11_10_11_10>(sc16),
        ];
        std::array::from_fn(|j| {
            let sel = _mm256_loadu_si256(SEL[j % 4].as_ptr() as *const __m256i);
            _mm256_shuffle_epi8(half[j / 4], sel)
        })
    }

    /// Eight i32 lanes that sum to the block's isum against activation block `ab`: `maddubs`
    /// of codes and activations (codes <= 63, |a| <= 127: no i16 saturation), `madd` with the
    /// group scales (`s`: `block_scales` of `sc16`), less 32 * sum_g sc_g * bsum_g.
    ///
    /// # Safety
    /// AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn isum8(q: &[__m256i; 8], s: &[__m256i; 8], sc16: __m256i, ab: &BlockQ8K) -> __m256i {
        let mut sumi = _mm256_setzero_si256();
        for j in 0..8 {
            let x = _mm256_loadu_si256(ab.qs.as_ptr().add(32 * j) as *const __m256i);
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], x), s[j]));
        }
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
        let sc16 = scales16(b);
        isum8(&block_codes(b), &block_scales(sc16), sc16, &*a.add(i))
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
            let sc16 = scales16(b);
            let (q, s) = (block_codes(b), block_scales(sc16));
            // Explicit calls: a closure here is not always inlined.
            let v = [
                isum8(&q, &s, sc16, &*a[0].add(i)),
                isum8(&q, &s, sc16, &*a[1].add(i)),
                isum8(&q, &s, sc16, &*a[2].add(i)),
                isum8(&q, &s, sc16, &*a[3].add(i)),
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

    /// `pshufb` controls for the tile's group scales. Against two rows' scale bytes interleaved
    /// (`unpack*_epi8`: byte 2g of the first row, 2g + 1 of the second, one row pair per
    /// 128-bit lane), the high bytes of i16 lanes 0..4 take the first row's scale of group g
    /// and those of lanes 4..8 the second's; an arithmetic shift by 8 then extends the sign.
    const fn group_sel(g: u8) -> [u8; 32] {
        let mut c = [0x80u8; 32];
        let mut i = 0;
        while i < 32 {
            let k = i % 16;
            if k % 2 == 1 {
                c[i] = if k < 8 { 2 * g } else { 2 * g + 1 };
            }
            i += 1;
        }
        c
    }
    static GROUP_SEL: [[u8; 32]; 8] = [
        group_sel(0),
        group_sel(1),
        group_sel(2),
        group_sel(3),
        group_sel(4),
        group_sel(5),
        group_sel(6),
        group_sel(7),
    ];

    /// 8 weight rows x `T` (1..=8) activation rows (`out[t]` for t >= T is not written). Per
    /// block and group of four weight rows, `ql` and `qh` are transposed in 8-byte words (as
    /// Q4_K's tile) and decoded by `codes`, so a register holds the same 8 positions of the
    /// four rows (i16 lanes 0..4, 4..8, 8..12, 12..16 after `maddubs`: rows 0, 1, 2, 3); each
    /// activation's 8 bytes are broadcast against it. The two 8-byte halves of a 16-element
    /// group then add in i16 (each lane 4 products, |.| <= 4 * 63 * 127 < 2^15) and one `madd`
    /// applies the four rows' scales of the group: 12 multiplies per block, row and token
    /// instead of the single-row dot's 16. Codes and scales are made once per block for all
    /// tokens, which go in passes of four (four accumulators in registers). Less
    /// 32 * sum_g sc_g * bsum_g, the integers are `dot_scalar`'s isum exactly; the float step
    /// is its, in its order, on lanes laid out [t0 r0, t0 r1, t1 r0, t1 r1 | t0 r2, t0 r3,
    /// t1 r2, t1 r3] per (row group, token pair), so every output has `dot_scalar`'s bits.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; rows `w + r * rb` (r < 8) valid for `nb` blocks, each `a[t]` for `nb`
    /// activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_8x8<const T: usize>(
        w: *const u8,
        rb: usize,
        a: Rows8,
        nb: usize,
        out: &mut [[f32; 8]; 8],
    ) {
        let zero = _mm256_setzero_si256();
        // Per row group, per token pair.
        let mut acc = [[_mm256_setzero_ps(); 4]; 2];
        // The eight rows are read block by block side by side, which hardware prefetchers do
        // not follow (short rows): prefetch the same block of the next eight rows, one tile
        // ahead (off when the prefetch distance is 0).
        let pf = if prefetch_distance() == 0 { 0 } else { 8 * rb };
        for i in 0..nb {
            let blk = |r: usize| w.add(r * rb + i * BB);
            let mut dh = [0u16; 8];
            for (r, dh) in dh.iter_mut().enumerate() {
                let b = blk(r);
                prefetch(b, pf, BB);
                *dh = std::ptr::read_unaligned(b.add(208) as *const u16);
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(dh.as_ptr() as *const __m128i));
            let ab: [&BlockQ8K; 8] = std::array::from_fn(|t| &*a[t].add(i));
            let da = _mm256_setr_ps(
                ab[0].d, ab[1].d, ab[2].d, ab[3].d, ab[4].d, ab[5].d, ab[6].d, ab[7].d,
            );
            for (q, acc) in acc.iter_mut().enumerate() {
                let r0 = 4 * q;
                let ld =
                    |j: usize, o: usize| _mm256_loadu_si256(blk(r0 + j).add(o) as *const __m256i);
                // cq[4h + k][g]: elements 128h + 32k + 8g .. +8 of the four rows.
                let mut cq = [[zero; 4]; 8];
                for h in 0..2 {
                    let ql0 = transpose_q(std::array::from_fn(|j| ld(j, 64 * h)));
                    let ql1 = transpose_q(std::array::from_fn(|j| ld(j, 64 * h + 32)));
                    let qh = transpose_q(std::array::from_fn(|j| ld(j, 128 + 32 * h)));
                    for g in 0..4 {
                        let c = codes(ql0[g], ql1[g], qh[g]);
                        for k in 0..4 {
                            cq[4 * h + k][g] = c[k];
                        }
                    }
                }
                // Group scales (i16): sg[G] lanes 0..4 row 0, 4..8 row 1, 8..12 row 2, 12..16 row 3.
                let sc = |j: usize| _mm_loadu_si128(blk(r0 + j).add(192) as *const __m128i);
                let pair =
                    |j: usize| _mm256_inserti128_si256(_mm256_castsi128_si256(sc(j)), sc(j + 2), 1);
                let (sa, sb) = (pair(0), pair(1));
                let il = [_mm256_unpacklo_epi8(sa, sb), _mm256_unpackhi_epi8(sa, sb)];
                let sg: [__m256i; 16] = std::array::from_fn(|g| {
                    let sel = _mm256_loadu_si256(GROUP_SEL[g % 8].as_ptr() as *const __m256i);
                    _mm256_srai_epi16(_mm256_shuffle_epi8(il[g / 8], sel), 8)
                });
                let mut s32 = [zero; 8];
                for t0 in (0..T).step_by(4) {
                    let mut s4 = [zero; 4];
                    for (g, s) in sg.iter().enumerate() {
                        // Elements 16g .. 16g + 16: words 2(g % 2) and 2(g % 2) + 1 of cq[g / 2].
                        let (c0, c1) = (cq[g / 2][2 * (g % 2)], cq[g / 2][2 * (g % 2) + 1]);
                        for (u, s4) in s4.iter_mut().enumerate().take(T.min(t0 + 4) - t0) {
                            let x = ab[t0 + u].qs.as_ptr().add(16 * g);
                            let p = _mm256_add_epi16(
                                _mm256_maddubs_epi16(c0, bcast8(x)),
                                _mm256_maddubs_epi16(c1, bcast8(x.add(8))),
                            );
                            *s4 = _mm256_add_epi32(*s4, _mm256_madd_epi16(p, *s));
                        }
                    }
                    s32[t0..t0 + 4].copy_from_slice(&s4);
                }
                // Per token: s32 less 32 * sum_g sc_g * bsum_g, lanes [r0, r0, r1, r1 | r2, r2,
                // r3, r3] (each pair sums to a row's isum).
                let sc16: [__m256i; 4] = std::array::from_fn(|j| _mm256_cvtepi8_epi16(sc(j)));
                let isum = |t: usize| {
                    let bs = _mm256_loadu_si256(ab[t].bsums.as_ptr() as *const __m256i);
                    let m = |j: usize| _mm256_madd_epi16(bs, sc16[j]);
                    let h01 = _mm256_hadd_epi32(m(0), m(1));
                    let h23 = _mm256_hadd_epi32(m(2), m(3));
                    let off = _mm256_add_epi32(
                        _mm256_permute2x128_si256::<0x20>(h01, h23),
                        _mm256_permute2x128_si256::<0x31>(h01, h23),
                    );
                    _mm256_sub_epi32(s32[t], _mm256_slli_epi32(off, 5))
                };
                let ri = |k: i32| r0 as i32 + k;
                let rows_idx =
                    _mm256_setr_epi32(ri(0), ri(1), ri(0), ri(1), ri(2), ri(3), ri(2), ri(3));
                let dwq = _mm256_permutevar8x32_ps(dw, rows_idx);
                for (p, acc) in acc.iter_mut().enumerate().take(T.div_ceil(2)) {
                    // [t0 r0, t0 r1, t1 r0, t1 r1 | t0 r2, t0 r3, t1 r2, t1 r3].
                    let v = _mm256_hadd_epi32(isum(2 * p), isum(2 * p + 1));
                    let (u, v2) = (2 * p as i32, 2 * p as i32 + 1);
                    let dap =
                        _mm256_permutevar8x32_ps(da, _mm256_setr_epi32(u, u, v2, v2, u, u, v2, v2));
                    let t = _mm256_mul_ps(_mm256_mul_ps(dwq, dap), _mm256_cvtepi32_ps(v));
                    *acc = _mm256_add_ps(*acc, t);
                }
            }
        }
        for (q, acc) in acc.iter().enumerate() {
            for (p, v) in acc.iter().enumerate() {
                let mut l = [0.0f32; 8];
                _mm256_storeu_ps(l.as_mut_ptr(), *v);
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
}
