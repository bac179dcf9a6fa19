//! Q8_0: blocks of 32 elements, 34 bytes: `d` (f16), `qs[32]` (i8); value = qs[i] * d.
//!
//! Dots against `Q8_32` activations: per block an exact integer sum of qs_w * qs_a, scaled by
//! d_w * d_a in f32 (ggml's `ggml_vec_dot_q8_0_q8_0` order).

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
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, hsum_ps256, hsum_ps512, prefetch};
    use super::{dot_scalar, ActRow, BlockQ8_32, BB};
    use crate::kernels::Isa;
    use std::arch::x86_64::*;

    pub(super) fn dot_avx2(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return dot_scalar(w, a);
        }
        let nb = a.q8_32.len().min(w.len() / BB);
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` holds `nb` whole blocks and
        // `a.q8_32` at least `nb` blocks.
        unsafe { avx2(w.as_ptr(), a.q8_32.as_ptr(), nb) }
    }

    pub(super) fn dot_avx512(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx512.supported() {
            return dot_scalar(w, a);
        }
        let nb = a.q8_32.len().min(w.len() / BB);
        // SAFETY: AVX-512 F/BW/VL/VNNI present (checked above); lengths as in `dot_avx2`.
        unsafe { avx512(w.as_ptr(), a.q8_32.as_ptr(), nb) }
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
            .map(|a| a.q8_32.len())
            .fold(w.len() / BB, usize::min);
        let ap = std::array::from_fn(|r| a[r].q8_32.as_ptr());
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` holds `nb` whole blocks and each
        // activation row at least `nb` blocks.
        unsafe { avx2_x4(w.as_ptr(), ap, nb, out) }
    }

    /// Four activation rows against one weight row, bit-identical to four `dot_avx512` calls.
    pub(super) fn dot4_avx512(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !Isa::Avx512.supported() {
            return dot4_avx2(w, a, out);
        }
        let nb = a
            .iter()
            .map(|a| a.q8_32.len())
            .fold(w.len() / BB, usize::min);
        let ap = std::array::from_fn(|r| a[r].q8_32.as_ptr());
        // SAFETY: AVX-512 F/BW/VL/VNNI/DQ present (checked above); `w` holds `nb` whole blocks
        // and each activation row at least `nb` blocks.
        unsafe { avx512_x4(w.as_ptr(), ap, nb, out) }
    }

    /// Integer dot of one block as 8 i32 lanes: sign trick (|w| * (a * sign w)) so `maddubs`
    /// (unsigned x signed) applies; |w| <= 128 and |a| <= 127 cannot saturate the i16 pairs.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn block_dot(qw: __m256i, qa: __m256i) -> __m256i {
        let p = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    }

    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2(w: *const u8, a: *const BlockQ8_32, nb: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 2];
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            let d = _mm256_set1_ps(f16_at(b) * ab.d);
            let qw = _mm256_loadu_si256(b.add(2) as *const __m256i);
            let qa = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            let s = _mm256_cvtepi32_ps(block_dot(qw, qa));
            acc[i & 1] = _mm256_fmadd_ps(d, s, acc[i & 1]);
        }
        hsum_ps256(_mm256_add_ps(acc[0], acc[1]))
    }

    /// `avx2` for four activation rows: the weight block is loaded, its scale converted and
    /// its absolute value taken once; per row the integer lanes and the float operations are
    /// `avx2`'s in the same order (two alternating accumulators), so each result has its bits.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, each `a[r]` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_x4(w: *const u8, a: [*const BlockQ8_32; 4], nb: usize, out: &mut [f32; 4]) {
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        let pf = prefetch_distance();
        let ones = _mm256_set1_epi16(1);
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let dw = f16_at(b);
            let qw = _mm256_loadu_si256(b.add(2) as *const __m256i);
            let aw = _mm256_sign_epi8(qw, qw);
            for r in 0..4 {
                let ab = &*a[r].add(i);
                let d = _mm256_set1_ps(dw * ab.d);
                let qa = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
                let p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(qa, qw));
                let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
                acc[r][i & 1] = _mm256_fmadd_ps(d, s, acc[r][i & 1]);
            }
        }
        for r in 0..4 {
            out[r] = hsum_ps256(_mm256_add_ps(acc[r][0], acc[r][1]));
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
    static A_OFFS: [i32; 16] = offsets(std::mem::size_of::<BlockQ8_32>() as i32);
    /// `vpermps` indices: lanes 0..8 take scale `2k`, lanes 8..16 scale `2k + 1`.
    const fn pair(k: i32) -> [i32; 16] {
        let mut o = [0i32; 16];
        let mut i = 0;
        while i < 16 {
            o[i] = 2 * k + (i as i32 / 8);
            i += 1;
        }
        o
    }
    static PAIR: [[i32; 16]; 8] = [
        pair(0),
        pair(1),
        pair(2),
        pair(3),
        pair(4),
        pair(5),
        pair(6),
        pair(7),
    ];

    /// Integer dot of blocks `b0` and `b0 + BB` with `a0`, `a0 + 1`: 8 i32 lanes per block.
    #[inline(always)]
    unsafe fn pair_dot(b0: *const u8, a0: *const BlockQ8_32) -> __m512i {
        let qw = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(b0.add(2) as *const __m256i)),
            _mm256_loadu_si256(b0.add(BB + 2) as *const __m256i),
            1,
        );
        let qa = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((*a0).qs.as_ptr() as *const __m256i)),
            _mm256_loadu_si256((*a0.add(1)).qs.as_ptr() as *const __m256i),
            1,
        );
        // Sign trick: |w| (unsigned) x (a * sign w); |w| <= 128, |a| <= 127.
        let sa = _mm512_mask_sub_epi8(qa, _mm512_movepi8_mask(qw), _mm512_setzero_si512(), qa);
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(qw), sa)
    }

    /// Two blocks per 512-bit register (`pair_dot`, VNNI `dpbusd`), and the scales of 16 blocks
    /// at a time: gathered, converted and multiplied once, then spread per pair with `vpermps`
    /// (per-block scalar scale handling cost as much as the dot itself).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
    unsafe fn avx512(w: *const u8, a: *const BlockQ8_32, nb: usize) -> f32 {
        let mut acc = _mm512_setzero_ps();
        let pf = prefetch_distance();
        let w_offs = _mm512_loadu_si512(W_OFFS.as_ptr() as *const __m512i);
        let a_offs = _mm512_loadu_si512(A_OFFS.as_ptr() as *const __m512i);
        let mut i = 0;
        while i + 16 <= nb {
            let b0 = w.add(i * BB);
            let a0 = a.add(i);
            prefetch(b0, pf, 16 * BB);
            // Each gathered i32 starts at a block: its low 16 bits are the f16 `d`.
            let dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32::<1>(
                w_offs,
                b0 as *const _,
            )));
            let da = _mm512_i32gather_ps::<1>(a_offs, a0 as *const _);
            let dv = _mm512_mul_ps(dw, da);
            for (k, pair) in PAIR.iter().enumerate() {
                let p = pair_dot(b0.add(2 * k * BB), a0.add(2 * k));
                let d =
                    _mm512_permutexvar_ps(_mm512_loadu_si512(pair.as_ptr() as *const __m512i), dv);
                acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(p), acc);
            }
            i += 16;
        }
        while i + 2 <= nb {
            let b0 = w.add(i * BB);
            prefetch(b0, pf, 2 * BB);
            let p = pair_dot(b0, a.add(i));
            let d = _mm512_insertf32x8(
                _mm512_set1_ps(f16_at(b0) * (*a.add(i)).d),
                _mm256_set1_ps(f16_at(b0.add(BB)) * (*a.add(i + 1)).d),
                1,
            );
            acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(p), acc);
            i += 2;
        }
        let mut sum = hsum_ps512(acc);
        if i < nb {
            let b = w.add(i * BB);
            let ab = &*a.add(i);
            let qw = _mm256_loadu_si256(b.add(2) as *const __m256i);
            let qa = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            let sa = _mm256_mask_sub_epi8(qa, _mm256_movepi8_mask(qw), _mm256_setzero_si256(), qa);
            let p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(qw), sa);
            sum += hsum_ps256(_mm256_cvtepi32_ps(p)) * (f16_at(b) * ab.d);
        }
        sum
    }

    /// `avx512` for four activation rows: per group of 16 blocks the weight scales are
    /// gathered and converted once, per pair of blocks the weight bytes loaded, their absolute
    /// values and sign mask taken once; per row every operation is `avx512`'s in its order (one
    /// accumulator, the pair tail, the last odd block added after the horizontal sum), so each
    /// result has its bits.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI/DQ + F16C; `w` valid for `nb` blocks, each `a[r]` for `nb`
    /// activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
    unsafe fn avx512_x4(w: *const u8, a: [*const BlockQ8_32; 4], nb: usize, out: &mut [f32; 4]) {
        let mut acc = [_mm512_setzero_ps(); 4];
        let pf = prefetch_distance();
        let w_offs = _mm512_loadu_si512(W_OFFS.as_ptr() as *const __m512i);
        let a_offs = _mm512_loadu_si512(A_OFFS.as_ptr() as *const __m512i);
        let mut i = 0;
        while i + 16 <= nb {
            let b0 = w.add(i * BB);
            prefetch(b0, pf, 16 * BB);
            let dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32::<1>(
                w_offs,
                b0 as *const _,
            )));
            let mut dv = [dw; 4];
            for r in 0..4 {
                dv[r] = _mm512_mul_ps(
                    dw,
                    _mm512_i32gather_ps::<1>(a_offs, a[r].add(i) as *const _),
                );
            }
            for (k, pair) in PAIR.iter().enumerate() {
                let b = b0.add(2 * k * BB);
                let qw = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256(b.add(2) as *const __m256i)),
                    _mm256_loadu_si256(b.add(BB + 2) as *const __m256i),
                    1,
                );
                let (aw, neg) = (_mm512_abs_epi8(qw), _mm512_movepi8_mask(qw));
                let perm = _mm512_loadu_si512(pair.as_ptr() as *const __m512i);
                for r in 0..4 {
                    let a0 = a[r].add(i + 2 * k);
                    let qa = _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_loadu_si256(
                            (*a0).qs.as_ptr() as *const __m256i
                        )),
                        _mm256_loadu_si256((*a0.add(1)).qs.as_ptr() as *const __m256i),
                        1,
                    );
                    let sa = _mm512_mask_sub_epi8(qa, neg, _mm512_setzero_si512(), qa);
                    let p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sa);
                    let d = _mm512_permutexvar_ps(perm, dv[r]);
                    acc[r] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(p), acc[r]);
                }
            }
            i += 16;
        }
        while i + 2 <= nb {
            let b0 = w.add(i * BB);
            prefetch(b0, pf, 2 * BB);
            for r in 0..4 {
                let p = pair_dot(b0, a[r].add(i));
                let d = _mm512_insertf32x8(
                    _mm512_set1_ps(f16_at(b0) * (*a[r].add(i)).d),
                    _mm256_set1_ps(f16_at(b0.add(BB)) * (*a[r].add(i + 1)).d),
                    1,
                );
                acc[r] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(p), acc[r]);
            }
            i += 2;
        }
        for r in 0..4 {
            let mut sum = hsum_ps512(acc[r]);
            if i < nb {
                let b = w.add(i * BB);
                let ab = &*a[r].add(i);
                let qw = _mm256_loadu_si256(b.add(2) as *const __m256i);
                let qa = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
                let sa =
                    _mm256_mask_sub_epi8(qa, _mm256_movepi8_mask(qw), _mm256_setzero_si256(), qa);
                let p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(qw), sa);
                sum += hsum_ps256(_mm256_cvtepi32_ps(p)) * (f16_at(b) * ab.d);
            }
            out[r] = sum;
        }
    }
}
