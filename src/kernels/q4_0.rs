//! Q4_0: blocks of 32 elements, 18 bytes: `d` (f16), `qs[16]`; element i < 16 is the low nibble
//! of qs[i], element 16 + i the high nibble; value = (nibble - 8) * d.
//!
//! Dots against `Q8_32` activations: exact integer sum per block, scaled by d_w * d_a in f32.

use super::float::f16_le;
use super::{ActFormat, ActRow, BlockQ8_32, TypeKernels};
use crate::dtype::DType;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::Q4_0,
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

const BB: usize = 18;

#[inline]
fn nibble(qs: &[u8], i: usize) -> i32 {
    (if i < 16 {
        qs[i] & 0x0F
    } else {
        qs[i - 16] >> 4
    }) as i32
        - 8
}

fn dequant(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BB).zip(out.chunks_exact_mut(32)) {
        let d = f16_le(blk);
        for (i, o) in o.iter_mut().enumerate() {
            *o = d * nibble(&blk[2..], i) as f32;
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (blk, ab) in w.chunks_exact(BB).zip(a.q8_32) {
        let (lo, hi) = ab.qs.split_at(16);
        let mut sumi = 0i32;
        for ((&q, &x0), &x1) in blk[2..].iter().zip(lo).zip(hi) {
            sumi += ((q & 0x0F) as i32 - 8) * x0 as i32 + ((q >> 4) as i32 - 8) * x1 as i32;
        }
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

    /// The 32 nibbles of a block as unsigned bytes 0..15, in element order.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles(b: *const u8) -> __m256i {
        let q = _mm_loadu_si128(b.add(2) as *const __m128i);
        let m4 = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(q, m4);
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
        _mm256_set_m128i(hi, lo)
    }

    /// # Safety
    /// AVX2+FMA+F16C; `w` valid for `nb` blocks, `a` for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2(w: *const u8, a: *const BlockQ8_32, nb: usize) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let eight = _mm256_set1_epi8(8);
        let ones = _mm256_set1_epi16(1);
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            let d = _mm256_set1_ps(f16_at(b) * ab.d);
            let qw = _mm256_sub_epi8(nibbles(b), eight);
            let qa = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            // |w| * (a * sign w): unsigned x signed for maddubs; |w| <= 8 cannot saturate.
            let p = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
            let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
            acc = _mm256_fmadd_ps(d, s, acc);
        }
        hsum_ps256(acc)
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

    /// Integer dot of blocks `b0`, `b0 + BB` with `a0`, `a0 + 1`: 8 i32 lanes per block,
    /// sum(nibble * a) - 8 * sum(a), both with VNNI `dpbusd`.
    #[inline(always)]
    unsafe fn pair_dot(b0: *const u8, a0: *const BlockQ8_32) -> __m512i {
        // [q0, q1] and [q0 >> 4, q1 >> 4], then 128-bit lanes reordered to
        // [lo0, hi0, lo1, hi1]: element order of the two blocks.
        let q = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(b0.add(2) as *const __m128i)),
            _mm_loadu_si128(b0.add(BB + 2) as *const __m128i),
            1,
        );
        let z = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
        let qw = _mm512_and_si512(
            _mm512_shuffle_i64x2(z, z, 0b11_01_10_00),
            _mm512_set1_epi8(0x0F),
        );
        let qa = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((*a0).qs.as_ptr() as *const __m256i)),
            _mm256_loadu_si256((*a0.add(1)).qs.as_ptr() as *const __m256i),
            1,
        );
        let zero = _mm512_setzero_si512();
        _mm512_sub_epi32(
            _mm512_dpbusd_epi32(zero, qw, qa),
            _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(8), qa),
        )
    }

    /// Two blocks per 512-bit register (`pair_dot`), scales of 16 blocks at a time (gathered,
    /// converted and multiplied once, spread per pair with `vpermps`), as in Q8_0.
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
            let z = _mm256_setzero_si256();
            let qa = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            let p = _mm256_dpbusd_epi32(z, nibbles(b), qa);
            let p = _mm256_sub_epi32(p, _mm256_dpbusd_epi32(z, _mm256_set1_epi8(8), qa));
            sum += hsum_ps256(_mm256_cvtepi32_ps(p)) * (f16_at(b) * ab.d);
        }
        sum
    }
}
