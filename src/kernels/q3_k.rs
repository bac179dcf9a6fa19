//! Q3_K kernels: dequantize and dot against `Q8K` activations (scalar, AVX2, AVX-512).
//!
//! Block (110 bytes, 256 elements, ggml `block_q3_K`): `hmask[32]` (high bits), `qs[64]` (low
//! 2 bits), `scales[12]` (sixteen 6-bit scales, offset by 32), `d` (f16).
//! Element `e = 128h + 32j + l`: low bits `(qs[32h + l] >> 2j) & 3`, high bit
//! `(hmask[l] >> (4h + j)) & 1`; `q = low - 4` when the high bit is clear, `low` when set
//! (q in -4..=3). Value: `(d * (scale - 32)) * q` (gguf's numpy order).
//!
//! Dot: with `u = q + 4 = low | high << 2` (0..=7, unsigned, so it fits `maddubs`),
//! `sum_g s_g <q, a>_g = sum_g s_g <u, a>_g - 4 sum_g s_g bsum_g`, all integer.

use super::float::f16_at;
use super::{ActFormat, ActRow, TypeKernels};
use crate::dtype::DType;

const BLOCK_BYTES: usize = 110;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::Q3_K,
    act: ActFormat::Q8K,
    dequant,
    dot_scalar,
    dot_avx2: simd::AVX2,
    dot_avx512: simd::AVX512,
});

/// The sixteen signed scales (already minus 32) of a block's packed `scales[12]`.
///
/// Scale i: low 4 bits from byte i (i < 8, low nibble) or byte i-8 (high nibble); high 2
/// bits from byte `8 + i % 4` at bit `2 * (i / 4)`.
#[inline]
fn unpack_scales(s: &[u8]) -> [i8; 16] {
    let word = |i: usize| u32::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
    let (lo0, lo1, hi) = (word(0), word(4), word(8));
    const LO: u32 = 0x0f0f_0f0f;
    const HI: u32 = 0x0303_0303;
    let parts = [
        (lo0 & LO) | ((hi & HI) << 4),
        (lo1 & LO) | (((hi >> 2) & HI) << 4),
        ((lo0 >> 4) & LO) | (((hi >> 4) & HI) << 4),
        ((lo1 >> 4) & LO) | (((hi >> 6) & HI) << 4),
    ];
    let mut out = [0i8; 16];
    for (o, p) in out.chunks_exact_mut(4).zip(parts) {
        for (k, v) in o.iter_mut().enumerate() {
            *v = ((p >> (8 * k)) & 0xff) as i8 - 32;
        }
    }
    out
}

fn dequant(blocks: &[u8], out: &mut [f32]) {
    for (b, y) in blocks
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(256))
    {
        let (hmask, qs) = (&b[0..32], &b[32..96]);
        let sc = unpack_scales(&b[96..108]);
        let d = f16_at(b, 108);
        for (e, v) in y.iter_mut().enumerate() {
            let (h, j, l) = (e / 128, (e / 32) % 4, e % 32);
            let low = ((qs[32 * h + l] >> (2 * j)) & 3) as i8;
            let high = (hmask[l] >> (4 * h + j)) & 1;
            let q = if high == 0 { low - 4 } else { low };
            *v = (d * sc[e / 16] as f32) * q as f32;
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a.q8k) {
        let (hmask, qs) = (&b[0..32], &b[32..96]);
        let sc = unpack_scales(&b[96..108]);
        let mut isum = 0i32;
        for (g, &s) in sc.iter().enumerate() {
            let (h, j, l0) = (g / 8, (g / 2) % 4, 16 * (g % 2));
            let mut gi = 0i32;
            for l in l0..l0 + 16 {
                let low = ((qs[32 * h + l] >> (2 * j)) & 3) as i32;
                let high = ((hmask[l] >> (4 * h + j)) & 1) as i32;
                gi += (low | (high << 2)) * q8.qs[16 * g + l - l0] as i32;
            }
            isum += s as i32 * (gi - 4 * q8.bsums[g] as i32);
        }
        sum += q8.d * (f16_at(b, 108) * isum as f32);
    }
    sum
}

#[cfg(not(target_arch = "x86_64"))]
mod simd {
    pub(super) const AVX2: Option<super::super::DotFn> = None;
    pub(super) const AVX512: Option<super::super::DotFn> = None;
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::super::simd::x86::{hsum256, ld256, ld512};
    use super::super::{ActRow, BlockQ8K, DotFn};
    use super::BLOCK_BYTES;
    use crate::kernels::Isa;
    use std::arch::x86_64::*;

    pub(super) const AVX2: Option<DotFn> = Some(dot_avx2);
    pub(super) const AVX512: Option<DotFn> = Some(dot_avx512);

    /// Bytes ahead of the current block to prefetch into L1 (weights stream from DRAM).
    const PREFETCH: usize = 1024;

    fn dot_avx2(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return super::dot_scalar(w, a);
        }
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        unsafe { dot_avx2_impl(w, a.q8k) }
    }

    fn dot_avx512(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx512.supported() {
            return dot_avx2(w, a);
        }
        // SAFETY: the CPU has AVX-512 F/BW/VNNI and AVX2/FMA/F16C (checked just above).
        unsafe { dot_avx512_impl(w, a.q8k) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn f16_at(b: &[u8], at: usize) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
            u16::from_le_bytes([b[at], b[at + 1]]) as i32,
        )))
    }

    /// The sixteen signed scales (minus 32) of block `b`, as bytes (what `unpack_scales`
    /// computes, in vector registers).
    #[target_feature(enable = "avx2,fma,f16c")]
    fn scales16(b: &[u8]) -> __m128i {
        let s = &b[96..108];
        let lo8 = u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]);
        let hi4 = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
        let l = _mm_cvtsi64_si128(lo8 as i64);
        let m4 = _mm_set1_epi8(0x0f);
        // Bytes 0..8: low nibbles, 8..16: high nibbles.
        let lo = _mm_unpacklo_epi64(
            _mm_and_si128(l, m4),
            _mm_and_si128(_mm_srli_epi16::<4>(l), m4),
        );
        // Byte i: (hi4 byte i%4) >> 2(i/4), low 2 bits.
        let h = _mm_srlv_epi32(_mm_set1_epi32(hi4 as i32), _mm_setr_epi32(0, 2, 4, 6));
        let hi = _mm_slli_epi16::<4>(_mm_and_si128(h, _mm_set1_epi8(0x03)));
        _mm_sub_epi8(_mm_or_si128(lo, hi), _mm_set1_epi8(32))
    }

    /// `pshufb` controls over 8 scale words held in each 128-bit lane: for step j (groups
    /// 2j, 2j+1 of a half), lane 0 words <- word 2j, lane 1 words <- word 2j+1.
    const fn pair_ctrl() -> [[u8; 32]; 4] {
        let mut c = [[0u8; 32]; 4];
        let mut j = 0;
        while j < 4 {
            let mut i = 0;
            while i < 32 {
                c[j][i] = (2 * (2 * j + i / 16) + i % 2) as u8;
                i += 1;
            }
            j += 1;
        }
        c
    }
    static PAIR_CTRL: [[u8; 32]; 4] = pair_ctrl();

    /// AVX2: 32 elements per step with `u = low | high << 2` (q + 4, unsigned) through
    /// `maddubs`, `madd` by the signed group scales; the -4 offset is removed once per block
    /// through the activation group sums.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_avx2_impl(w: &[u8], a: &[BlockQ8K]) -> f32 {
        let m2 = _mm256_set1_epi8(0x03);
        let four = _mm256_set1_epi8(0x04);
        let ctrl: [__m256i; 4] = std::array::from_fn(|j| ld256(&PAIR_CTRL[j]));
        let mut acc = _mm256_setzero_ps();
        for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a) {
            _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().wrapping_add(PREFETCH) as *const i8);
            let s16 = _mm256_cvtepi8_epi16(scales16(b));
            let bsums = ld256(&q8.bsums);
            let corr = _mm256_madd_epi16(s16, bsums);
            let halves = [
                _mm256_broadcastsi128_si256(_mm256_castsi256_si128(s16)),
                _mm256_broadcastsi128_si256(_mm256_extracti128_si256::<1>(s16)),
            ];
            let hm = ld256(&b[..32]);
            let mut isum = _mm256_setzero_si256();
            for (h, half) in halves.iter().enumerate() {
                let q = ld256(&b[32 + 32 * h..]);
                let qj = [
                    q,
                    _mm256_srli_epi16::<2>(q),
                    _mm256_srli_epi16::<4>(q),
                    _mm256_srli_epi16::<6>(q),
                ];
                for (j, qj) in qj.into_iter().enumerate() {
                    let bit = _mm256_set1_epi8(1 << (4 * h + j));
                    let high =
                        _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit), four);
                    let u = _mm256_or_si256(_mm256_and_si256(qj, m2), high);
                    let x = ld256(&q8.qs[128 * h + 32 * j..]);
                    let p = _mm256_maddubs_epi16(u, x);
                    isum = _mm256_add_epi32(
                        isum,
                        _mm256_madd_epi16(p, _mm256_shuffle_epi8(*half, ctrl[j])),
                    );
                }
            }
            let isum = _mm256_sub_epi32(isum, _mm256_slli_epi32::<2>(corr));
            acc = _mm256_fmadd_ps(
                _mm256_set1_ps(f16_at(b, 108) * q8.d),
                _mm256_cvtepi32_ps(isum),
                acc,
            );
        }
        hsum256(acc)
    }

    /// AVX-512: 64 elements (four groups) per step; quants as in Q2_K's kernel, high bits by a
    /// byte test against the step's two hmask bits, scale words by a word permute.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    fn dot_avx512_impl(w: &[u8], a: &[BlockQ8K]) -> f32 {
        let m2 = _mm512_set1_epi8(0x03);
        let four = _mm512_set1_epi8(0x04);
        // Word shift counts: low half by 4jj, high half by 4jj + 2.
        let shifts = [
            _mm512_inserti64x4::<1>(_mm512_set1_epi16(0), _mm256_set1_epi16(2)),
            _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(6)),
        ];
        // Step t = 2h + jj: hmask bits 2t (low half) and 2t + 1 (high half).
        let bits: [__m512i; 4] = std::array::from_fn(|t| {
            _mm512_inserti64x4::<1>(
                _mm512_set1_epi8(1 << (2 * t)),
                _mm256_set1_epi8((1u8 << (2 * t + 1)) as i8),
            )
        });
        // Within a half's 8 scale words (broadcast to every lane): lane k of step jj <- word
        // 4jj + k.
        let sctrl: [__m512i; 2] = std::array::from_fn(|jj| {
            let w =
                |k: i64| (8 * jj as i64 + 2 * k) * 0x0101_0101_0101_0101 + 0x0100_0100_0100_0100;
            _mm512_set_epi64(w(3), w(3), w(2), w(2), w(1), w(1), w(0), w(0))
        });
        let mut acc = _mm256_setzero_ps();
        for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a) {
            _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().wrapping_add(PREFETCH) as *const i8);
            let s16 = _mm256_cvtepi8_epi16(scales16(b));
            let bsums = ld256(&q8.bsums);
            let corr = _mm256_madd_epi16(s16, bsums);
            let halves = [
                _mm512_broadcast_i32x4(_mm256_castsi256_si128(s16)),
                _mm512_broadcast_i32x4(_mm256_extracti128_si256::<1>(s16)),
            ];
            let hm = _mm512_broadcast_i64x4(ld256(&b[..32]));
            let mut isum = _mm512_setzero_si512();
            for (h, half) in halves.iter().enumerate() {
                let q = ld256(&b[32 + 32 * h..]);
                let q = _mm512_broadcast_i64x4(q);
                for jj in 0..2 {
                    let t = 2 * h + jj;
                    let low = _mm512_and_si512(_mm512_srlv_epi16(q, shifts[jj]), m2);
                    let u =
                        _mm512_mask_add_epi8(low, _mm512_test_epi8_mask(hm, bits[t]), low, four);
                    let x = ld512(&q8.qs[64 * t..]);
                    let p = _mm512_maddubs_epi16(u, x);
                    isum = _mm512_dpwssd_epi32(isum, p, _mm512_shuffle_epi8(*half, sctrl[jj]));
                }
            }
            let isum = _mm256_add_epi32(
                _mm512_castsi512_si256(isum),
                _mm512_extracti64x4_epi64::<1>(isum),
            );
            let isum = _mm256_sub_epi32(isum, _mm256_slli_epi32::<2>(corr));
            acc = _mm256_fmadd_ps(
                _mm256_set1_ps(f16_at(b, 108) * q8.d),
                _mm256_cvtepi32_ps(isum),
                acc,
            );
        }
        hsum256(acc)
    }
}
