//! Q2_K kernels: dequantize and dot against `Q8K` activations (scalar, AVX2, AVX-512).
//!
//! Block (84 bytes, 256 elements, ggml `block_q2_K`): `scales[16]` (low nibble: scale, high
//! nibble: min, one pair per 16 elements), `qs[64]` (2-bit quants), `d` and `dmin` (f16).
//! Element `e = 128h + 32j + l` (h < 2, j < 4, l < 32) is `(qs[32h + l] >> 2j) & 3`; its group
//! is `e / 16`. Value: `d * scale * q - dmin * min`, in that float order (gguf's numpy).
//!
//! Dot: per super-block, `da * (d * sum_g scale_g * <q, a>_g - dmin * sum_g min_g * bsum_g)`
//! with exact integer inner products; the activation group sums make the minimums one madd.
//! Does not own activation quantization (act.rs) or dispatch (mod.rs).

use super::float::f16_at;
use super::{ActFormat, ActRow, TypeKernels};
use crate::dtype::DType;

const BLOCK_BYTES: usize = 84;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::Q2_K,
    act: ActFormat::Q8K,
    dequant,
    dot_scalar,
    dot_avx2: simd::AVX2,
    dot_avx512: simd::AVX512,
});

fn dequant(blocks: &[u8], out: &mut [f32]) {
    for (b, y) in blocks
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(256))
    {
        let (scales, qs) = (&b[0..16], &b[16..80]);
        let d = f16_at(b, 80);
        let dmin = f16_at(b, 82);
        for (e, v) in y.iter_mut().enumerate() {
            let (h, j, l) = (e / 128, (e / 32) % 4, e % 32);
            let q = ((qs[32 * h + l] >> (2 * j)) & 3) as f32;
            let s = scales[e / 16];
            let dl = d * (s & 0xF) as f32;
            let ml = dmin * (s >> 4) as f32;
            *v = dl * q - ml;
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a.q8k) {
        let (scales, qs) = (&b[0..16], &b[16..80]);
        let mut summ = 0i32;
        for (s, bs) in scales.iter().zip(q8.bsums) {
            summ += (s >> 4) as i32 * bs as i32;
        }
        let mut isum = 0i32;
        for (g, s) in scales.iter().enumerate() {
            // Group g covers elements 16g..16g+16: h = g/8, j = (g/2)%4, l = 16*(g%2)..+16.
            let (h, j, l0) = (g / 8, (g / 2) % 4, 16 * (g % 2));
            let mut gi = 0i32;
            for l in l0..l0 + 16 {
                let q = ((qs[32 * h + l] >> (2 * j)) & 3) as i32;
                gi += q * q8.qs[16 * g + l - l0] as i32;
            }
            isum += (s & 0xF) as i32 * gi;
        }
        sum += q8.d * (f16_at(b, 80) * isum as f32 - f16_at(b, 82) * summ as f32);
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
    use super::super::simd::x86::{hsum256, ld128, ld256, ld512};
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

    /// d and dmin of a block as f32.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn d_dmin(b: &[u8]) -> (f32, f32) {
        let v = u32::from_le_bytes([b[80], b[81], b[82], b[83]]);
        let f = _mm_cvtph_ps(_mm_cvtsi32_si128(v as i32));
        (_mm_cvtss_f32(f), _mm_cvtss_f32(_mm_movehdup_ps(f)))
    }

    /// `pshufb` controls that spread scale bytes over 16-bit words: for group pair p (groups
    /// 2p, 2p+1), lane 0 words <- byte 2p, lane 1 words <- byte 2p+1 (high bytes zeroed).
    const fn pair_ctrl() -> [[u8; 32]; 8] {
        let mut c = [[0x80u8; 32]; 8];
        let mut p = 0;
        while p < 8 {
            let mut i = 0;
            while i < 32 {
                if i % 2 == 0 {
                    c[p][i] = (2 * p + i / 16) as u8;
                }
                i += 1;
            }
            p += 1;
        }
        c
    }
    static PAIR_CTRL: [[u8; 32]; 8] = pair_ctrl();

    /// AVX2: 32 elements (two groups of 16) per step; `maddubs` of the 2-bit quants with the
    /// activations, `madd` by the group scales; the mins go through the activation group sums.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_avx2_impl(w: &[u8], a: &[BlockQ8K]) -> f32 {
        let m4 = _mm_set1_epi8(0x0f);
        let m2 = _mm256_set1_epi8(0x03);
        let ctrl: [__m256i; 8] = std::array::from_fn(|p| ld256(&PAIR_CTRL[p]));
        let mut acc = _mm256_setzero_ps();
        let mut acc_m = _mm256_setzero_ps();
        for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a) {
            _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().wrapping_add(PREFETCH) as *const i8);
            let raw = ld128(&b[..16]);
            let sc = _mm256_broadcastsi128_si256(_mm_and_si128(raw, m4));
            let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
            let bsums = ld256(&q8.bsums);
            let summ = _mm256_madd_epi16(mins, bsums);
            let mut isum = _mm256_setzero_si256();
            for h in 0..2 {
                let q = ld256(&b[16 + 32 * h..]);
                let qj = [
                    q,
                    _mm256_srli_epi16::<2>(q),
                    _mm256_srli_epi16::<4>(q),
                    _mm256_srli_epi16::<6>(q),
                ];
                for (j, qj) in qj.into_iter().enumerate() {
                    let x = ld256(&q8.qs[128 * h + 32 * j..]);
                    let p = _mm256_maddubs_epi16(_mm256_and_si256(qj, m2), x);
                    let scw = _mm256_shuffle_epi8(sc, ctrl[4 * h + j]);
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, scw));
                }
            }
            let (d, dmin) = d_dmin(b);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * q8.d), _mm256_cvtepi32_ps(isum), acc);
            acc_m = _mm256_fmadd_ps(_mm256_set1_ps(dmin * q8.d), _mm256_cvtepi32_ps(summ), acc_m);
        }
        hsum256(acc) - hsum256(acc_m)
    }

    /// `pshufb` controls for 64 elements (four groups): 128-bit lane k of step t (t = 2h + jj)
    /// words <- scale byte 4t + k.
    const fn quad_ctrl() -> [[u8; 64]; 4] {
        let mut c = [[0x80u8; 64]; 4];
        let mut t = 0;
        while t < 4 {
            let mut i = 0;
            while i < 64 {
                if i % 2 == 0 {
                    c[t][i] = (4 * t + i / 16) as u8;
                }
                i += 1;
            }
            t += 1;
        }
        c
    }
    static QUAD_CTRL: [[u8; 64]; 4] = quad_ctrl();

    /// AVX-512: 64 elements (four groups) per step. The 32 quant bytes of a half are
    /// broadcast to both 256-bit halves and shifted by different amounts per half, so one
    /// vector holds the 2-bit quants of 64 consecutive elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    fn dot_avx512_impl(w: &[u8], a: &[BlockQ8K]) -> f32 {
        let m4 = _mm_set1_epi8(0x0f);
        let m2 = _mm512_set1_epi8(0x03);
        let ctrl: [__m512i; 4] = std::array::from_fn(|t| ld512(&QUAD_CTRL[t]));
        // Word shift counts: low half by 4jj, high half by 4jj + 2.
        let shifts = [
            _mm512_inserti64x4::<1>(_mm512_set1_epi16(0), _mm256_set1_epi16(2)),
            _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(6)),
        ];
        let mut acc = _mm256_setzero_ps();
        let mut acc_m = _mm256_setzero_ps();
        for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a) {
            _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().wrapping_add(PREFETCH) as *const i8);
            let raw = ld128(&b[..16]);
            let sc = _mm512_broadcast_i32x4(_mm_and_si128(raw, m4));
            let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
            let bsums = ld256(&q8.bsums);
            let summ = _mm256_madd_epi16(mins, bsums);
            let mut isum = _mm512_setzero_si512();
            for h in 0..2 {
                let q = ld256(&b[16 + 32 * h..]);
                let q = _mm512_broadcast_i64x4(q);
                for jj in 0..2 {
                    let qj = _mm512_and_si512(_mm512_srlv_epi16(q, shifts[jj]), m2);
                    let x = ld512(&q8.qs[128 * h + 64 * jj..]);
                    let p = _mm512_maddubs_epi16(qj, x);
                    isum = _mm512_dpwssd_epi32(isum, p, _mm512_shuffle_epi8(sc, ctrl[2 * h + jj]));
                }
            }
            let isum = _mm256_add_epi32(
                _mm512_castsi512_si256(isum),
                _mm512_extracti64x4_epi64::<1>(isum),
            );
            let (d, dmin) = d_dmin(b);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * q8.d), _mm256_cvtepi32_ps(isum), acc);
            acc_m = _mm256_fmadd_ps(_mm256_set1_ps(dmin * q8.d), _mm256_cvtepi32_ps(summ), acc_m);
        }
        hsum256(acc) - hsum256(acc_m)
    }
}
