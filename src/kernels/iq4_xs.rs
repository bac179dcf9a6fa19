//! IQ4_XS: super-blocks of 256 elements, 136 bytes: `d` (f16), `scales_h` (u16), `scales_l[4]`,
//! `qs[128]`. Sub-block j (32 elements) has the 6-bit scale
//! `ls_j = (scales_l[j / 2] >> 4 (j % 2)) & 15 | ((scales_h >> 2 j) & 3) << 4` and reads
//! qs[16 j..16 j + 16]: low nibbles are its elements 0..16, high nibbles 16..32.
//! Value: `(d * (ls_j - 32)) * KVALUES[nibble]` (gguf's f32 order; codebook of `iq4_nl.rs`).
//!
//! Dots against `Q8K` activations: per super-block the exact integer
//! `sum_j (ls_j - 32) * sum(KVALUES[q] * a)`, scaled by d * d_a.

use super::float::f16_le;
use super::iq4_nl::KVALUES;
use super::{ActFormat, ActRow, Dot4Kernels, TypeKernels};
use crate::dtype::DType;

const BB: usize = 136;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::IQ4_XS,
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

/// Four-row dots (prefill), each row with the single-row dot's bits (the AVX-512 entry runs the
/// AVX2 loop, as the single-row dot does).
pub(super) const DOT4: Dot4Kernels = Dot4Kernels {
    #[cfg(target_arch = "x86_64")]
    avx2: Some(x86::dot4_avx2),
    #[cfg(target_arch = "x86_64")]
    avx512: Some(x86::dot4_avx2),
    #[cfg(not(target_arch = "x86_64"))]
    avx2: None,
    #[cfg(not(target_arch = "x86_64"))]
    avx512: None,
};

/// The eight sub-block scales `ls_j - 32` of the block at the start of `b`.
#[inline]
fn scales(b: &[u8]) -> [i32; 8] {
    let h = u16::from_le_bytes([b[2], b[3]]);
    std::array::from_fn(|j| {
        let lo = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
        let hi = ((h >> (2 * j)) & 3) as u8;
        (lo | (hi << 4)) as i32 - 32
    })
}

/// Element i (< 32) of sub-block j's codebook index.
#[inline]
fn index(b: &[u8], j: usize, i: usize) -> usize {
    let q = b[8 + 16 * j + (i % 16)];
    (if i < 16 { q & 0x0F } else { q >> 4 }) as usize
}

fn dequant(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BB).zip(out.chunks_exact_mut(256)) {
        let d = f16_le(blk);
        let sc = scales(blk);
        for (j, o) in o.chunks_exact_mut(32).enumerate() {
            let dl = d * sc[j] as f32;
            for (i, o) in o.iter_mut().enumerate() {
                *o = dl * KVALUES[index(blk, j, i)] as f32;
            }
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (blk, ab) in w.chunks_exact(BB).zip(a.q8k) {
        let sc = scales(blk);
        let mut isum = 0i32;
        for (j, &s) in sc.iter().enumerate() {
            let x = &ab.qs[32 * j..32 * j + 32];
            let p: i32 = (0..32)
                .map(|i| KVALUES[index(blk, j, i)] as i32 * x[i] as i32)
                .sum();
            isum += s * p;
        }
        sum += f16_le(blk) * ab.d * isum as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::blocks32::nibbles;
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, hsum_ps256, prefetch};
    use super::{dot_scalar, ActRow, BB, KVALUES};
    use crate::kernels::{BlockQ8K, Isa};
    use std::arch::x86_64::*;

    pub(super) fn dot_avx2(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return dot_scalar(w, a);
        }
        let nb = a.q8k.len().min(w.len() / BB);
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` holds `nb` whole blocks and
        // `a.q8k` at least `nb` blocks.
        unsafe { avx2(w, a.q8k.as_ptr(), nb) }
    }

    pub(super) fn dot_avx512(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx512.supported() {
            return dot_scalar(w, a);
        }
        let nb = a.q8k.len().min(w.len() / BB);
        // SAFETY: AVX-512 F/BW/VL/VNNI present (checked above); lengths as in `dot_avx2`.
        unsafe { avx512(w, a.q8k.as_ptr(), nb) }
    }

    /// The eight sub-block scales `ls_j - 32` of the block at `b` as i16 words 0..8 of both
    /// 128-bit lanes (vector shifts on the scale bytes, no scalar unpacking).
    ///
    /// # Safety
    /// AVX2; `b` valid for 8 bytes.
    #[inline(always)]
    unsafe fn scales_i16(b: *const u8) -> __m256i {
        let sh = _mm256_set1_epi32(std::ptr::read_unaligned(b.add(2) as *const u16) as i32);
        let sl = _mm256_set1_epi32(std::ptr::read_unaligned(b.add(4) as *const u32) as i32);
        let lo = _mm256_and_si256(
            _mm256_srlv_epi32(sl, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
            _mm256_set1_epi32(0x0F),
        );
        // Bits 2j, 2j + 1 of `scales_h` to bits 4, 5 of lane j.
        let hi = _mm256_and_si256(
            _mm256_sllv_epi32(sh, _mm256_setr_epi32(4, 2, 0, 32, 32, 32, 32, 32)),
            _mm256_set1_epi32(0x30),
        );
        let hi = _mm256_or_si256(
            hi,
            _mm256_and_si256(
                _mm256_srlv_epi32(sh, _mm256_setr_epi32(32, 32, 32, 2, 4, 6, 8, 10)),
                _mm256_set1_epi32(0x30),
            ),
        );
        let l = _mm256_sub_epi32(_mm256_or_si256(lo, hi), _mm256_set1_epi32(32));
        // Words [l0..3 l0..3 | l4..7 l4..7] -> [l0..7 | l0..7].
        let w = _mm256_packs_epi32(l, l);
        _mm256_permute4x64_epi64(w, 0b10_00_10_00)
    }

    /// # Safety
    /// AVX2+FMA+F16C; `w` holds `nb` blocks, `a` is valid for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2(w: &[u8], a: *const BlockQ8K, nb: usize) -> f32 {
        let table =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES.as_ptr() as *const __m128i));
        let mut acc = _mm256_setzero_ps();
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.as_ptr().add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            let sc = scales_i16(b);
            let mut sumi = _mm256_setzero_si256();
            for j in 0..8 {
                let c = _mm256_shuffle_epi8(table, nibbles(b.add(8 + 16 * j)));
                let x = _mm256_loadu_si256(ab.qs.as_ptr().add(32 * j) as *const __m256i);
                // |c| * (x * sign c): |c|, |x| <= 127, so the i16 pair sums cannot saturate.
                let p = _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(x, c));
                // Scale j (word j of each lane) in every word.
                let sj = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((0x0100 + 0x0202 * j) as i16));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sj));
            }
            let d = _mm256_set1_ps(f16_at(b) * ab.d);
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
        }
        hsum_ps256(acc)
    }

    pub(super) fn dot4_avx2(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !Isa::Avx2.supported() {
            *out = std::array::from_fn(|r| dot_scalar(w, &a[r]));
            return;
        }
        let nb = a.iter().map(|a| a.q8k.len()).fold(w.len() / BB, usize::min);
        let ap = std::array::from_fn(|r| a[r].q8k.as_ptr());
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` and every row hold `nb` blocks.
        unsafe { avx2_4(w, ap, nb, out) }
    }

    /// `avx2` for four activation rows: each sub-block's codes, their magnitudes and its
    /// scale are made once for the four rows; per row the integer sums and f32 operations are
    /// `avx2`'s, in its order, so each row gets exactly the single-row bits.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; `w` holds `nb` blocks, every `a[r]` is valid for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_4(w: &[u8], a: [*const BlockQ8K; 4], nb: usize, out: &mut [f32; 4]) {
        let table =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES.as_ptr() as *const __m128i));
        let mut acc = [_mm256_setzero_ps(); 4];
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.as_ptr().add(i * BB);
            prefetch(b, pf, BB);
            let sc = scales_i16(b);
            let mut sumi = [_mm256_setzero_si256(); 4];
            for j in 0..8 {
                let c = _mm256_shuffle_epi8(table, nibbles(b.add(8 + 16 * j)));
                let ac = _mm256_sign_epi8(c, c);
                let sj = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((0x0100 + 0x0202 * j) as i16));
                for (r, sumi) in sumi.iter_mut().enumerate() {
                    let x = (*a[r].add(i)).qs.as_ptr().add(32 * j);
                    let x = _mm256_loadu_si256(x as *const __m256i);
                    let p = _mm256_maddubs_epi16(ac, _mm256_sign_epi8(x, c));
                    *sumi = _mm256_add_epi32(*sumi, _mm256_madd_epi16(p, sj));
                }
            }
            let fd = f16_at(b);
            for r in 0..4 {
                let d = _mm256_set1_ps(fd * (*a[r].add(i)).d);
                acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            }
        }
        *out = std::array::from_fn(|r| hsum_ps256(acc[r]));
    }

    /// The AVX2 loop: on Zen 4 its `maddubs` + `madd` by the i16 scale (14.1 GB/s with the
    /// weights in L2, one core) beat `dpbusd` + a `vpmulld` per 32 (12.4 GB/s), and an
    /// unsigned-code `dpbusd` with the `128 * sum(a)` correction from `bsums` (10.4 GB/s).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + AVX2/FMA/F16C; `w` holds `nb` blocks, `a` is valid for `nb`
    /// activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512(w: &[u8], a: *const BlockQ8K, nb: usize) -> f32 {
        avx2(w, a, nb)
    }
}
