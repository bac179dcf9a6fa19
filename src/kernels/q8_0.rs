//! Q8_0: blocks of 32 elements, 34 bytes: `d` (f16), `qs[32]` (i8); value = qs[i] * d.
//!
//! Dots against `Q8_32` activations: per block an exact integer sum of qs_w * qs_a, scaled by
//! d_w * d_a in f32 (ggml's `ggml_vec_dot_q8_0_q8_0` order). The scalar dot adds the blocks'
//! products one by one in block order; every SIMD dot (AVX2 and AVX-512; single-row, four-row
//! and 8x8 tile) does exactly that (the integer sums of 8 or 16 blocks at once, their products
//! in one vector, the adds in order), so all give the scalar dot's bits: a token's logits do
//! not depend on how many tokens share its matmul.

use super::float::f16_le;
use super::{ActFormat, ActRow, BlockQ8_32, TypeKernels};
use crate::dtype::DType;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::Q8_0,
    act: ActFormat::Q8_32,
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
    #[cfg(not(target_arch = "x86_64"))]
    avx2: None,
    #[cfg(target_arch = "x86_64")]
    avx512: Some(x86::dot4_avx512),
    #[cfg(not(target_arch = "x86_64"))]
    avx512: None,
};

/// The 8-row x 8-token tile (prefill): see `kernels::tile_fn`.
pub(super) const TILE: super::TileKernels = super::TileKernels {
    #[cfg(target_arch = "x86_64")]
    avx2: Some(x86::tile_avx2),
    #[cfg(not(target_arch = "x86_64"))]
    avx2: None,
    #[cfg(target_arch = "x86_64")]
    avx512: Some(x86::tile_avx512),
    #[cfg(not(target_arch = "x86_64"))]
    avx512: None,
};

const BB: usize = 34;

fn dequant(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BB).zip(out.chunks_exact_mut(32)) {
        let d = f16_le(blk);
        for (o, &q) in o.iter_mut().zip(&blk[2..]) {
            *o = (q as i8) as f32 * d;
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (blk, ab) in w.chunks_exact(BB).zip(a.q8_32) {
        let sumi: i32 = blk[2..]
            .iter()
            .zip(&ab.qs)
            .map(|(&q, &x)| (q as i8) as i32 * x as i32)
            .sum();
        sum += sumi as f32 * (f16_le(blk) * ab.d);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::q4_k::x86::{bcast8, transpose_q};
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, hsum_epi32, prefetch};
    use super::{dot_scalar, ActRow, BlockQ8_32, BB};
    use crate::kernels::Isa;
    use std::arch::x86_64::*;

    pub(super) fn dot_avx2(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return dot_scalar(w, a);
        }
        let nb = a.q8_32.len().min(a.q8_32_d.len()).min(w.len() / BB);
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` holds `nb` whole blocks and
        // `a.q8_32` and `a.q8_32_d` at least `nb` each.
        unsafe { avx2(w.as_ptr(), a, nb) }
    }

    pub(super) fn dot_avx512(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx512.supported() {
            return dot_scalar(w, a);
        }
        let nb = a
            .q8_32
            .len()
            .min(a.q8_32_d.len())
            .min(a.q8_32_sum.len())
            .min(w.len() / BB);
        // SAFETY: AVX-512 F/BW/VL/VNNI/DQ present (checked above); `w` holds `nb` whole blocks
        // and each of `a`'s slices at least `nb`.
        unsafe { avx512(w.as_ptr(), a, nb) }
    }

    /// Four activation rows against one weight row, bit-identical to four `dot_avx2` calls.
    pub(super) fn dot4_avx2(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !Isa::Avx2.supported() {
            out.iter_mut()
                .zip(a)
                .for_each(|(o, a)| *o = dot_scalar(w, a));
            return;
        }
        let nb = a
            .iter()
            .map(|a| a.q8_32.len().min(a.q8_32_d.len()))
            .fold(w.len() / BB, usize::min);
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` holds `nb` whole blocks and each
        // activation row's blocks and scales at least `nb`.
        unsafe { avx2_x4(w.as_ptr(), a, nb, out) }
    }

    /// Four activation rows against one weight row, bit-identical to four `dot_avx512` calls.
    pub(super) fn dot4_avx512(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !Isa::Avx512.supported() {
            return dot4_avx2(w, a, out);
        }
        let nb = a
            .iter()
            .map(|a| a.q8_32.len().min(a.q8_32_d.len()).min(a.q8_32_sum.len()))
            .fold(w.len() / BB, usize::min);
        // SAFETY: AVX-512 F/BW/VL/VNNI/DQ present (checked above); `w` holds `nb` whole blocks
        // and each activation row's slices at least `nb` blocks.
        unsafe { avx512_x4(w.as_ptr(), a, nb, out) }
    }

    /// Integer dot of one block as 8 i32 lanes: sign trick (|w| * (a * sign w)) so `maddubs`
    /// (unsigned x signed) applies; |w| <= 128 and |a| <= 127 cannot saturate the i16 pairs.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn block_dot(qw: __m256i, qa: __m256i) -> __m256i {
        let p = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    }

    /// Lane k: the sum of the eight i32 lanes of `v[k]` (exact in any order).
    ///
    /// # Safety
    /// AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum8(v: &[__m256i; 8]) -> __m256i {
        // Per 128-bit lane: [v0 v1 v2 v3] (resp. v4..v8) summed over that lane's four lanes.
        let h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        let h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
        _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(h0, h1),
            _mm256_permute2x128_si256::<0x31>(h0, h1),
        )
    }

    /// The f16 `d` of eight blocks at `b + k * stride` (k < 8) as f32. Each is read as the
    /// 32-bit word at its block's start (`vmovd`/`vpinsrd`: no 16-bit inserts into a register
    /// LLVM may pick, see `f16x2_at`), its low half kept and the halves packed.
    ///
    /// # Safety
    /// AVX2+F16C; `b + k * stride` valid for 4 bytes, k < 8.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn scales8(b: *const u8, stride: usize) -> __m256 {
        let dd = |k: usize| std::ptr::read_unaligned(b.add(k * stride) as *const i32);
        let m = _mm_set1_epi32(0xFFFF);
        let lo = _mm_and_si128(_mm_setr_epi32(dd(0), dd(1), dd(2), dd(3)), m);
        let hi = _mm_and_si128(_mm_setr_epi32(dd(4), dd(5), dd(6), dd(7)), m);
        _mm256_cvtph_ps(_mm_packus_epi32(lo, hi))
    }

    /// `sum + p[0] + .. + p[7]`, one add at a time in lane order (`dot_scalar`'s).
    ///
    /// # Safety
    /// AVX.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn add8(mut sum: f32, p: __m256) -> f32 {
        let mut l = [0.0f32; 8];
        _mm256_storeu_ps(l.as_mut_ptr(), p);
        for x in l {
            sum += x;
        }
        sum
    }

    /// One weight row against `R` activation rows (`a[r]` blocks, `d[r]` their scales), each
    /// in `dot_scalar`'s order: per block the exact isum (`block_dot`, eight blocks summed
    /// across lanes by one `hadd` tree), `isum as f32 * (d_w * d_a)` and the adds in block
    /// order. The rows share the weight blocks (loaded from L1 after the first).
    ///
    /// # Safety
    /// AVX2+F16C; `w` valid for `nb` blocks, each `a[r]` and `d[r]` for `nb`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_avx2<const R: usize>(
        w: *const u8,
        a: [*const BlockQ8_32; R],
        d: [*const f32; R],
        nb: usize,
    ) -> [f32; R] {
        let pf = prefetch_distance();
        let mut sum = [0.0f32; R];
        let ld = |b: *const u8| _mm256_loadu_si256(b.add(2) as *const __m256i);
        let qa = |a: *const BlockQ8_32| _mm256_loadu_si256((*a).qs.as_ptr() as *const __m256i);
        let mut i = 0;
        while i + 8 <= nb {
            let b0 = w.add(i * BB);
            prefetch(b0, pf, 8 * BB);
            let dw = scales8(b0, BB);
            for r in 0..R {
                let v: [__m256i; 8] =
                    std::array::from_fn(|k| block_dot(ld(b0.add(k * BB)), qa(a[r].add(i + k))));
                let dd = _mm256_mul_ps(dw, _mm256_loadu_ps(d[r].add(i)));
                let p = _mm256_mul_ps(_mm256_cvtepi32_ps(hsum8(&v)), dd);
                sum[r] = add8(sum[r], p);
            }
            i += 8;
        }
        for i in i..nb {
            let b = w.add(i * BB);
            let dw = f16_at(b);
            for r in 0..R {
                let isum = hsum_epi32(block_dot(ld(b), qa(a[r].add(i))));
                sum[r] += isum as f32 * (dw * *d[r].add(i));
            }
        }
        sum
    }

    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, `a.q8_32` and `a.q8_32_d` for `nb`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2(w: *const u8, a: &ActRow<'_>, nb: usize) -> f32 {
        rows_avx2::<1>(w, [a.q8_32.as_ptr()], [a.q8_32_d.as_ptr()], nb)[0]
    }

    /// `avx2` for four activation rows: each result has its (= `dot_scalar`'s) bits.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, each row's `q8_32` and `q8_32_d` for `nb`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_x4(w: *const u8, a: &[ActRow<'_>; 4], nb: usize, out: &mut [f32; 4]) {
        let ap = std::array::from_fn(|r| a[r].q8_32.as_ptr());
        let dp = std::array::from_fn(|r| a[r].q8_32_d.as_ptr());
        *out = rows_avx2::<4>(w, ap, dp, nb);
    }

    /// Eight weight rows (`w`: row r at `r * rb`) against one to eight activation rows
    /// (`avx2_8x8`): `out[t][r]` has the bits of `dot_avx2(row r, a[t])` (= `dot_scalar`'s).
    pub(super) fn tile_avx2(w: &[u8], rb: usize, a: &[ActRow<'_>], out: &mut [[f32; 8]; 8]) {
        let n = a.len();
        assert!(
            w.len() >= 8 * rb && (1..=8).contains(&n),
            "Q8_0 tile: {} bytes for 8 rows of {rb}, {n} activation rows",
            w.len()
        );
        if !Isa::Avx2.supported() {
            return crate::kernels::tile_by_dots(w, rb, a, out, dot_scalar);
        }
        let nb = a
            .iter()
            .map(|a| a.q8_32.len().min(a.q8_32_d.len()))
            .fold(rb / BB, usize::min);
        // Missing rows point at row 0 (read, never stored).
        let at = |t: usize| &a[if t < n { t } else { 0 }];
        let ap: [*const BlockQ8_32; 8] = std::array::from_fn(|t| at(t).q8_32.as_ptr());
        let dp: [*const f32; 8] = std::array::from_fn(|t| at(t).q8_32_d.as_ptr());
        let wp = w.as_ptr();
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` holds 8 rows of `rb` bytes,
        // each at least `nb` whole blocks, and each activation row's blocks and scales `nb`.
        unsafe { by_tokens!(n, avx2_8x8 [] (wp, rb, ap, dp, nb, out)) }
    }

    /// 8 weight rows x `T` (1..=8) activation rows (`out[t]` for t >= T is not written). Per
    /// block, each group of four weight rows has its 32 bytes transposed in 8-byte words (as
    /// Q4_K's tile: register g holds word g of the four rows, row j in 64-bit lane j) and their
    /// absolute values taken, once for all the tokens; each token's word g is broadcast against
    /// register g of both groups with the sign trick (`maddubs(|w|, a * sign w)`, `madd` to
    /// i32), giving two i32 lanes per row that sum to the block's isum exactly. One horizontal
    /// add of the two groups' sums gives the token's eight isums (lanes [r0, r1, r4, r5 | r2,
    /// r3, r6, r7]) and `isum as f32 * (d_w * d_a)` is added to its running sums: per output
    /// `dot_scalar`'s operations in its order.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; rows `w + r * rb` (r < 8) valid for `nb` blocks, each `a[t]` and `d[t]`
    /// for `nb` blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_8x8<const T: usize>(
        w: *const u8,
        rb: usize,
        a: [*const BlockQ8_32; 8],
        d: [*const f32; 8],
        nb: usize,
        out: &mut [[f32; 8]; 8],
    ) {
        let zero = _mm256_setzero_si256();
        let ones = _mm256_set1_epi16(1);
        // Lane k of a token's sums holds row ROWS[k].
        const ROWS: [usize; 8] = [0, 1, 4, 5, 2, 3, 6, 7];
        let rows_idx = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
        let mut acc = [_mm256_setzero_ps(); 8];
        // The eight rows are read block by block side by side: prefetch the same block of the
        // next eight rows, one tile ahead (off when the prefetch distance is 0).
        let pf = if prefetch_distance() == 0 { 0 } else { 8 * rb };
        for i in 0..nb {
            let blk = |r: usize| w.add(r * rb + i * BB);
            for r in 0..8 {
                prefetch(blk(r), pf, BB);
            }
            let dw = _mm256_permutevar8x32_ps(scales8(blk(0), rb), rows_idx);
            let wg: [[__m256i; 4]; 2] = std::array::from_fn(|q| {
                transpose_q(std::array::from_fn(|j| {
                    _mm256_loadu_si256(blk(4 * q + j).add(2) as *const __m256i)
                }))
            });
            let aw: [[__m256i; 4]; 2] = std::array::from_fn(|q| {
                std::array::from_fn(|g| _mm256_sign_epi8(wg[q][g], wg[q][g]))
            });
            for (t, acc) in acc.iter_mut().enumerate().take(T) {
                let x = (*a[t].add(i)).qs.as_ptr();
                let mut s = [zero; 2];
                for g in 0..4 {
                    let bc = bcast8(x.add(8 * g));
                    for q in 0..2 {
                        let p = _mm256_maddubs_epi16(aw[q][g], _mm256_sign_epi8(bc, wg[q][g]));
                        s[q] = _mm256_add_epi32(s[q], _mm256_madd_epi16(p, ones));
                    }
                }
                let v = _mm256_cvtepi32_ps(_mm256_hadd_epi32(s[0], s[1]));
                let dd = _mm256_mul_ps(dw, _mm256_set1_ps(*d[t].add(i)));
                *acc = _mm256_add_ps(*acc, _mm256_mul_ps(v, dd));
            }
        }
        for (t, v) in acc.iter().enumerate().take(T) {
            let mut l = [0.0f32; 8];
            _mm256_storeu_ps(l.as_mut_ptr(), *v);
            for (k, &v) in l.iter().enumerate() {
                out[t][ROWS[k]] = v;
            }
        }
    }

    /// Byte offsets of the scales of 16 consecutive blocks of `stride` bytes.
    const fn offsets(stride: i32) -> [i32; 16] {
        let mut o = [0i32; 16];
        let mut k = 0;
        while k < 16 {
            o[k] = k as i32 * stride;
            k += 1;
        }
        o
    }
    static W_OFFS: [i32; 16] = offsets(BB as i32);
    /// After `isums`' reduction lane j holds block `[0, 2, 4, 6, 1, 3, 5, 7, 8, ..][j]`: the
    /// lanes to take for blocks 0..16 in order.
    static NATURAL: [i32; 16] = [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15];

    /// The weight bytes of blocks `b0 .. b0 + m` (m <= 16) plus 128 (unsigned), two blocks
    /// per register; blocks past m are zero.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
    unsafe fn wpairs<const M: usize>(b0: *const u8) -> [__m512i; 8] {
        let m = M;
        let x80 = _mm512_set1_epi8(-128);
        std::array::from_fn(|k| {
            let b = b0.add(2 * k * BB);
            let lo = |b: *const u8| _mm256_loadu_si256(b.add(2) as *const __m256i);
            let z = match m.saturating_sub(2 * k) {
                0 => return _mm512_setzero_si512(),
                1 => _mm512_castsi256_si512(lo(b)),
                _ => _mm512_inserti64x4(_mm512_castsi256_si512(lo(b)), lo(b.add(BB)), 1),
            };
            // Past block m the upper half must stay zero (the xor would make it 128s).
            let keep: __mmask8 = if m >= 2 * k + 2 { 0xFF } else { 0x0F };
            _mm512_maskz_xor_epi64(keep, z, x80)
        })
    }

    /// Exact integer dots of blocks 0..m (m <= 16) given as `wpairs` with activation blocks
    /// `a` (sums `s`): lane j = sum_i w_i a_i of block j (lanes m.. zero). The unsigned
    /// weights (w + 128) meet the signed activations in `dpbusd`; 128 * sum(a) comes off.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
    unsafe fn isums<const M: usize>(
        wp: &[__m512i; 8],
        a: *const BlockQ8_32,
        s: *const i32,
    ) -> __m512i {
        let m = M;
        let zero = _mm512_setzero_si512();
        let p: [__m512i; 8] = std::array::from_fn(|k| {
            let qa = |j: usize| _mm256_loadu_si256((*a.add(j)).qs.as_ptr() as *const __m256i);
            let x = match m.saturating_sub(2 * k) {
                0 => return zero,
                1 => _mm512_castsi256_si512(qa(2 * k)),
                _ => _mm512_inserti64x4(_mm512_castsi256_si512(qa(2 * k)), qa(2 * k + 1), 1),
            };
            _mm512_dpbusd_epi32(zero, wp[k], x)
        });
        // Eight lanes per block summed: pairs of registers per 128-bit lane, then the two
        // halves of each block (128-bit lanes 0/1 and 2/3).
        let h: [__m512i; 4] = std::array::from_fn(|k| hadd512(p[2 * k], p[2 * k + 1]));
        let (g0, g1) = (hadd512(h[0], h[1]), hadd512(h[2], h[3]));
        let f = _mm512_add_epi32(
            _mm512_shuffle_i64x2::<0b10_00_10_00>(g0, g1),
            _mm512_shuffle_i64x2::<0b11_01_11_01>(g0, g1),
        );
        let f = _mm512_permutexvar_epi32(_mm512_loadu_si512(NATURAL.as_ptr() as *const _), f);
        let mask = (1u32 << m).wrapping_sub(1) as u16;
        _mm512_sub_epi32(f, _mm512_slli_epi32::<7>(_mm512_maskz_loadu_epi32(mask, s)))
    }

    /// `_mm256_hadd_epi32` per 128-bit lane of 512-bit vectors: [x0+x1, x2+x3, y0+y1, y2+y3].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
    unsafe fn hadd512(x: __m512i, y: __m512i) -> __m512i {
        let (x, y) = (_mm512_castsi512_ps(x), _mm512_castsi512_ps(y));
        let even = _mm512_castps_si512(_mm512_shuffle_ps(x, y, 0b10_00_10_00));
        let odd = _mm512_castps_si512(_mm512_shuffle_ps(x, y, 0b11_01_11_01));
        _mm512_add_epi32(even, odd)
    }

    /// The f16 scales of blocks `b0 .. b0 + m` as f32 (lanes m.. zero).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
    unsafe fn wscales<const M: usize>(b0: *const u8) -> __m512 {
        let m = M;
        let offs = _mm512_loadu_si512(W_OFFS.as_ptr() as *const __m512i);
        let mask = (1u32 << m).wrapping_sub(1) as u16;
        // Each gathered i32 starts at a block: its low 16 bits are the f16 `d`.
        let g =
            _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), mask, offs, b0 as *const i32);
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g))
    }

    /// `sum + p[0] + p[1] + .. + p[m - 1]`, added one at a time in lane order (lane 0 of the
    /// 128-bit vectors; each lane brought down by a shuffle, off the chain of adds).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
    unsafe fn add_in_order(mut sum: __m128, p: __m512, m: usize) -> __m128 {
        let q = [
            _mm512_castps512_ps128(p),
            _mm512_extractf32x4_ps::<1>(p),
            _mm512_extractf32x4_ps::<2>(p),
            _mm512_extractf32x4_ps::<3>(p),
        ];
        for (c, x) in q.iter().enumerate() {
            let lanes = [
                *x,
                _mm_movehdup_ps(*x),
                _mm_unpackhi_ps(*x, *x),
                _mm_shuffle_ps::<0b11_11_11_11>(*x, *x),
            ];
            for (l, v) in lanes.iter().enumerate() {
                if 4 * c + l >= m {
                    return sum;
                }
                sum = _mm_add_ss(sum, *v);
            }
        }
        sum
    }

    /// Blocks `i .. i + M` (M <= 16) of one weight row (at `b0`) against activation rows `a`:
    /// per row `sum += isum_j as f32 * (d_w * d_a)` for the blocks in order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
    unsafe fn group<const M: usize, const R: usize>(
        b0: *const u8,
        a: &[&ActRow<'_>; R],
        i: usize,
        sum: &mut [__m128; R],
    ) {
        let wp = wpairs::<M>(b0);
        let dw = wscales::<M>(b0);
        let mask = (1u32 << M).wrapping_sub(1) as u16;
        for (r, a) in a.iter().enumerate() {
            let is = isums::<M>(&wp, a.q8_32.as_ptr().add(i), a.q8_32_sum.as_ptr().add(i));
            let da = _mm512_maskz_loadu_ps(mask, a.q8_32_d.as_ptr().add(i));
            let p = _mm512_mul_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(dw, da));
            sum[r] = add_in_order(sum[r], p, M);
        }
    }

    /// Every block of one weight row against `R` activation rows (`dot_scalar`'s operations per
    /// row): groups of 16, then the last m < 16 blocks.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI/DQ + F16C; `w` valid for `nb` blocks, each row's slices for `nb`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
    unsafe fn rows_dot<const R: usize>(w: *const u8, a: &[&ActRow<'_>; R], nb: usize) -> [f32; R] {
        let pf = prefetch_distance();
        let mut sum = [_mm_setzero_ps(); R];
        let mut i = 0;
        while i + 16 <= nb {
            let b0 = w.add(i * BB);
            prefetch(b0, pf, 16 * BB);
            group::<16, R>(b0, a, i, &mut sum);
            i += 16;
        }
        let b0 = w.add(i * BB);
        macro_rules! tail {
            ($($m:literal)*) => {
                match nb - i {
                    $($m => group::<$m, R>(b0, a, i, &mut sum),)*
                    _ => {}
                }
            };
        }
        tail!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
        sum.map(|s| _mm_cvtss_f32(s))
    }

    /// One activation row: `rows_dot`.
    ///
    /// # Safety
    /// As `rows_dot`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
    unsafe fn avx512(w: *const u8, a: &ActRow<'_>, nb: usize) -> f32 {
        rows_dot::<1>(w, &[a], nb)[0]
    }

    /// Four activation rows: the weight bytes and scales are loaded once per group; per row
    /// every operation is `avx512`'s in its order, so each result has its bits.
    ///
    /// # Safety
    /// As `rows_dot`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
    unsafe fn avx512_x4(w: *const u8, a: &[ActRow<'_>; 4], nb: usize, out: &mut [f32; 4]) {
        *out = rows_dot::<4>(w, &[&a[0], &a[1], &a[2], &a[3]], nb);
    }

    /// Eight weight rows (`w`: row r at `r * rb`) against one to eight activation rows:
    /// `out[t][r]` has the bits of `dot_avx512(row r, a[t])` (= `dot_scalar`'s).
    pub(super) fn tile_avx512(w: &[u8], rb: usize, a: &[ActRow<'_>], out: &mut [[f32; 8]; 8]) {
        let n = a.len();
        assert!(
            w.len() >= 8 * rb && (1..=8).contains(&n) && 8 * rb < i32::MAX as usize,
            "Q8_0 tile: {} bytes for 8 rows of {rb}, {n} activation rows",
            w.len()
        );
        if !Isa::Avx512.supported() {
            return crate::kernels::tile_by_dots(w, rb, a, out, dot_scalar);
        }
        let nb = a
            .iter()
            .map(|a| a.q8_32.len().min(a.q8_32_d.len()).min(a.q8_32_sum.len()))
            .fold(rb / BB, usize::min);
        // Missing rows point at row 0 (read, never stored).
        let ap: [&ActRow<'_>; 8] = std::array::from_fn(|t| &a[if t < n { t } else { 0 }]);
        let (w, o) = (w.as_ptr(), out);
        // SAFETY: AVX-512 F/BW/VL/VNNI/DQ present (checked above); `w` holds 8 rows of `rb`
        // bytes, each at least `nb` whole blocks, every activation row's slices `nb` blocks,
        // and 8 * rb fits the i32 gather offsets (asserted).
        unsafe { by_tokens!(n, avx512_8x8 [] (w, rb, ap, nb, o)) }
    }

    /// 8 weight rows x `T` (1..=8) activation rows, block by block: the eight rows' 32 bytes
    /// (plus 128) transposed in 8-byte words (register g: word g of rows 0..8, row r in dwords
    /// 2r, 2r+1), each token's word g broadcast against register g, four `dpbusd` per token
    /// giving two partial sums per row; tokens (t, u) are paired by one horizontal add into
    /// lanes [t r2L, t r2L+1, u r2L, u r2L+1] of 128-bit lane L, 128 * sum(a) comes off, and
    /// `p = isum as f32 * (d_w * d_a)` is added to the running sums: per output `dot_scalar`'s
    /// operations in its order.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI/DQ + F16C; rows `w + r * rb` (r < 8) valid for `nb` blocks, each
    /// `a[t]`'s slices for `nb` blocks, `8 * rb` below 2^31.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
    unsafe fn avx512_8x8<const T: usize>(
        w: *const u8,
        rb: usize,
        a: [&ActRow<'_>; 8],
        nb: usize,
        out: &mut [[f32; 8]; 8],
    ) {
        let x80 = _mm512_set1_epi8(-128);
        let zero = _mm512_setzero_si512();
        let tr: [__m512i; 2] = [
            _mm512_setr_epi64(0, 4, 8, 12, 1, 5, 9, 13),
            _mm512_setr_epi64(2, 6, 10, 14, 3, 7, 11, 15),
        ];
        // f32 lane (L, i) <- row 2L + i % 2; token 2p + i / 2.
        let rows_idx = _mm512_setr_epi32(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7);
        let tok_idx: [__m512i; 4] = std::array::from_fn(|p| {
            let (t, u) = (2 * p as i32, 2 * p as i32 + 1);
            _mm512_setr_epi32(t, t, u, u, t, t, u, u, t, t, u, u, t, t, u, u)
        });
        let rb32 = rb as i32;
        let d_off = _mm256_setr_epi32(
            0,
            rb32,
            2 * rb32,
            3 * rb32,
            4 * rb32,
            5 * rb32,
            6 * rb32,
            7 * rb32,
        );
        // The tokens' block scales and sums by one gather each: byte offsets from token 0's.
        let (d0, s0) = (a[0].q8_32_d.as_ptr(), a[0].q8_32_sum.as_ptr());
        let rel = |p: *const u8, q: *const u8| (p as isize - q as isize) as i64;
        let offd: [i64; 8] = std::array::from_fn(|t| rel(a[t].q8_32_d.as_ptr() as _, d0 as _));
        let offs: [i64; 8] = std::array::from_fn(|t| rel(a[t].q8_32_sum.as_ptr() as _, s0 as _));
        let offd = _mm512_loadu_si512(offd.as_ptr() as *const __m512i);
        let offs = _mm512_loadu_si512(offs.as_ptr() as *const __m512i);
        let qs: [*const u8; 8] = std::array::from_fn(|t| a[t].q8_32.as_ptr() as *const u8);
        const AB: usize = std::mem::size_of::<BlockQ8_32>();
        const QS: usize = std::mem::offset_of!(BlockQ8_32, qs);
        let mut acc = [_mm512_setzero_ps(); 4];
        // The eight rows are read block by block side by side: prefetch the same block of the
        // next eight rows, one tile ahead (off when the prefetch distance is 0).
        let pf = if prefetch_distance() == 0 { 0 } else { 8 * rb };
        for i in 0..nb {
            let blk = |r: usize| w.add(r * rb + i * BB);
            for r in 0..8 {
                prefetch(blk(r), pf, BB);
            }
            let ld = |r: usize| _mm256_loadu_si256(blk(r).add(2) as *const __m256i);
            let z = |r: usize| {
                let v = _mm512_inserti64x4(_mm512_castsi256_si512(ld(r)), ld(r + 1), 1);
                _mm512_xor_si512(v, x80)
            };
            let (z01, z23, z45, z67) = (z(0), z(2), z(4), z(6));
            let p = [
                _mm512_permutex2var_epi64(z01, tr[0], z23),
                _mm512_permutex2var_epi64(z01, tr[1], z23),
            ];
            let q = [
                _mm512_permutex2var_epi64(z45, tr[0], z67),
                _mm512_permutex2var_epi64(z45, tr[1], z67),
            ];
            let wg = [
                _mm512_shuffle_i64x2(p[0], q[0], 0x44),
                _mm512_shuffle_i64x2(p[0], q[0], 0xEE),
                _mm512_shuffle_i64x2(p[1], q[1], 0x44),
                _mm512_shuffle_i64x2(p[1], q[1], 0xEE),
            ];
            let mut s32 = [zero; 8];
            for t in 0..T {
                let x = qs[t].add(i * AB + QS);
                let bc = |g: usize| {
                    _mm512_set1_epi64(std::ptr::read_unaligned(x.add(8 * g) as *const i64))
                };
                let mut v = _mm512_dpbusd_epi32(zero, wg[0], bc(0));
                for (g, wg) in wg.iter().enumerate().skip(1) {
                    v = _mm512_dpbusd_epi32(v, *wg, bc(g));
                }
                s32[t] = v;
            }
            // Row scales (f16 at each block's start) and the tokens' scales and sums.
            let dw = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_i32gather_epi32::<1>(
                blk(0) as *const i32,
                d_off,
            )));
            let dwq = _mm512_permutexvar_ps(rows_idx, _mm512_castps256_ps512(dw));
            let da = _mm512_castps256_ps512(_mm512_i64gather_ps::<1>(offd, d0.add(i)));
            let sa = _mm512_slli_epi32::<7>(_mm512_castsi256_si512(_mm512_i64gather_epi32::<1>(
                offs,
                s0.add(i),
            )));
            for p in 0..T.div_ceil(2) {
                let (t, u) = (2 * p, (2 * p + 1).min(T - 1));
                let raw = hadd512(s32[t], s32[u]);
                let is = _mm512_sub_epi32(raw, _mm512_permutexvar_epi32(tok_idx[p], sa));
                let sc = _mm512_mul_ps(dwq, _mm512_permutexvar_ps(tok_idx[p], da));
                acc[p] = _mm512_add_ps(acc[p], _mm512_mul_ps(_mm512_cvtepi32_ps(is), sc));
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
