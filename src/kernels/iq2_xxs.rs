//! IQ2_XXS kernels: dequantize and dot against `Q8K` activations (scalar, AVX2, AVX-512).
//!
//! Block (66 bytes, 256 elements, ggml `block_iq2_xxs`): `d` (f16), then 8 groups of 32
//! elements, each two little-endian u32: `aux0` holds four 8-bit grid indices (one per 8
//! elements: `IQ2XXS_GRID` row), `aux1` four 7-bit sign indices (bits 7k..7k+7, through
//! `KSIGNS_IQ2XS`) and a 4-bit scale `ls` (bits 28..32).
//! Value: `((d * (0.5 + ls)) * 0.25) * grid * sign` (gguf's numpy order).
//!
//! Dot: `(0.5 + ls) * 0.25 = (2 ls + 1) / 8`, so a block contributes
//! `d * da / 8 * sum_g (2 ls_g + 1) * <±grid, a>_g`, an exact integer sum.

use super::float::f16_at;
use super::tables::{IQ2XXS_GRID, KSIGNS_IQ2XS};
use super::{ActFormat, ActRow, TypeKernels};
use crate::dtype::DType;

const BLOCK_BYTES: usize = 66;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::IQ2_XXS,
    act: ActFormat::Q8K,
    dequant,
    dot_scalar,
    dot_avx2: simd::AVX2,
    dot_avx512: simd::AVX512,
});

/// (aux0, aux1) of group `g` of block `b`.
#[inline]
fn group_words(b: &[u8], g: usize) -> (u32, u32) {
    let at = 2 + 8 * g;
    let w = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    (w(at), w(at + 4))
}

fn dequant(blocks: &[u8], out: &mut [f32]) {
    for (b, y) in blocks
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(256))
    {
        let d = f16_at(b, 0);
        for (g, yg) in y.chunks_exact_mut(32).enumerate() {
            let (aux0, aux1) = group_words(b, g);
            let db = d * (0.5 + (aux1 >> 28) as f32) * 0.25;
            for (k, y8) in yg.chunks_exact_mut(8).enumerate() {
                let grid = IQ2XXS_GRID[((aux0 >> (8 * k)) & 0xff) as usize].to_le_bytes();
                let signs = KSIGNS_IQ2XS[((aux1 >> (7 * k)) & 0x7f) as usize];
                for (c, v) in y8.iter_mut().enumerate() {
                    let s = if (signs >> c) & 1 == 0 { 1.0f32 } else { -1.0 };
                    *v = db * grid[c] as f32 * s;
                }
            }
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a.q8k) {
        let mut isum = 0i32;
        for (g, ag) in q8.qs.chunks_exact(32).enumerate() {
            let (aux0, aux1) = group_words(b, g);
            let mut gi = 0i32;
            for (k, a8) in ag.chunks_exact(8).enumerate() {
                let grid = IQ2XXS_GRID[((aux0 >> (8 * k)) & 0xff) as usize].to_le_bytes();
                let signs = KSIGNS_IQ2XS[((aux1 >> (7 * k)) & 0x7f) as usize];
                for c in 0..8 {
                    let p = grid[c] as i32 * a8[c] as i32;
                    gi += if (signs >> c) & 1 == 0 { p } else { -p };
                }
            }
            isum += (2 * (aux1 >> 28) as i32 + 1) * gi;
        }
        sum += q8.d * f16_at(b, 0) * 0.125 * isum as f32;
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
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, hsum256, ld512, prefetch};
    use super::super::tables::{IQ2XXS_GRID, KSIGNS_IQ2XS, KSIGNS_IQ2XS_PM1};
    use super::super::{ActRow, BlockQ8K, DotFn};
    use super::BLOCK_BYTES;
    use crate::kernels::Isa;
    use std::arch::x86_64::*;

    pub(super) const AVX2: Option<DotFn> = Some(dot_avx2);
    pub(super) const AVX512: Option<DotFn> = Some(dot_avx512);

    /// AVX-512 as `Isa::Avx512` guarantees, plus VBMI and BITALG (Ice Lake, Zen 4 and later;
    /// Skylake-X and Cascade Lake lack them and take the AVX2 kernel).
    fn has_avx512() -> bool {
        Isa::Avx512.supported()
            && is_x86_feature_detected!("avx512vbmi")
            && is_x86_feature_detected!("avx512bitalg")
    }

    fn dot_avx2(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return super::dot_scalar(w, a);
        }
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        unsafe { dot_avx2_impl(w, a.q8k) }
    }

    fn dot_avx512(w: &[u8], a: &ActRow<'_>) -> f32 {
        // The kernel needs VBMI and BITALG on top of what `Isa::Avx512` guarantees.
        if !has_avx512() {
            return dot_avx2(w, a);
        }
        // SAFETY: the CPU has AVX-512 F/BW/VBMI/BITALG/VNNI and AVX2/FMA/F16C (checked above).
        unsafe { dot_avx512_impl(w, a.q8k) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn f16_to_f32(b: &[u8]) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
            u16::from_le_bytes([b[0], b[1]]) as i32,
        )))
    }

    /// AVX2: grid rows and sign bytes (as ±1) come from tables, one 32-element group per
    /// 256-bit vector; `maddubs` multiplies grid magnitudes by sign-applied activations.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_avx2_impl(w: &[u8], a: &[BlockQ8K]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let pf = prefetch_distance();
        for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a) {
            prefetch(b.as_ptr(), pf, BLOCK_BYTES);
            let mut isum = _mm256_setzero_si256();
            for (g, x) in q8.qs.chunks_exact(32).enumerate() {
                let at = 2 + 8 * g;
                let aux0 = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                let aux1 = u32::from_le_bytes([b[at + 4], b[at + 5], b[at + 6], b[at + 7]]);
                let [g0, g1, g2, g3] =
                    [0, 8, 16, 24].map(|s| IQ2XXS_GRID[((aux0 >> s) & 0xff) as usize] as i64);
                let [s0, s1, s2, s3] =
                    [0, 7, 14, 21].map(|s| KSIGNS_IQ2XS_PM1[((aux1 >> s) & 0x7f) as usize] as i64);
                // SAFETY: `x` is 32 bytes.
                let x = unsafe { _mm256_loadu_si256(x.as_ptr() as *const __m256i) };
                let x = _mm256_sign_epi8(x, _mm256_set_epi64x(s3, s2, s1, s0));
                let p = _mm256_maddubs_epi16(_mm256_set_epi64x(g3, g2, g1, g0), x);
                let ls = (2 * (aux1 >> 28) + 1) as i16;
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, _mm256_set1_epi16(ls)));
            }
            let f = q8.d * f16_to_f32(b) * 0.125;
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(isum), acc);
        }
        hsum256(acc)
    }

    /// 64 bytes, aligned for vector loads.
    #[repr(C, align(64))]
    struct V64([u8; 64]);

    /// The magnitudes of IQ2_XXS grid rows, 8, 25 and 43, as 2-bit codes 0, 1, 2.
    const LEVELS: [u8; 3] = [0x08, 0x19, 0x2b];

    /// Code of grid byte `v` (compile-time check that the grid holds only `LEVELS`).
    const fn level_code(v: u8) -> u8 {
        let mut c = 0;
        while c < 3 {
            if LEVELS[c] == v {
                return c as u8;
            }
            c += 1;
        }
        panic!("IQ2XXS_GRID holds a byte outside LEVELS");
    }

    /// The constant vectors of the AVX-512 kernel, built at compile time.
    struct Consts {
        /// Grid row i as 2-bit codes: elements 0..4 in `code_lo[i]` (element c in bits 2c..2c+2),
        /// elements 4..8 in `code_hi[i]`; 256 bytes each, as four vectors.
        code_lo: [V64; 4],
        code_hi: [V64; 4],
        /// `KSIGNS_IQ2XS`, 128 bytes.
        ksigns: [V64; 2],
        /// Byte 8g+4+k <- bit offset 32 + 7k (sign index k of group g); bytes 8g+k unused.
        ctrl_sign: V64,
        /// Vector z, qword q (grid row r = 8z + q, group g = r / 4, k = r % 4):
        /// byte 0 <- low codes (M byte 8g+k), byte 1 <- high codes (H byte 8g+k, index 64 + ..),
        /// byte 2 <- sign byte (M byte 8g+4+k).
        ctrl_place: [V64; 4],
        /// Byte j of every qword <- bit offset 2j: element j's code in bits 0..2.
        ctrl_code: V64,
        /// `LEVELS[i & 3]` for the 6-bit indices `vpermb` uses.
        levels: V64,
        /// Byte j of every qword <- bit 16 + j: element j's sign in the placed row.
        ctrl_sbit: V64,
        /// Vector z: every word of qword q <- the word at byte 8(2z + q/4) (scale of its group).
        ctrl_scale: [V64; 4],
    }

    const fn build_consts() -> Consts {
        let mut c = Consts {
            code_lo: [const { V64([0; 64]) }; 4],
            code_hi: [const { V64([0; 64]) }; 4],
            ksigns: [const { V64([0; 64]) }; 2],
            ctrl_sign: V64([0; 64]),
            ctrl_place: [const { V64([0; 64]) }; 4],
            ctrl_code: V64([0; 64]),
            levels: V64([0; 64]),
            ctrl_sbit: V64([0; 64]),
            ctrl_scale: [const { V64([0; 64]) }; 4],
        };
        let mut i = 0;
        while i < 256 {
            let row = IQ2XXS_GRID[i].to_le_bytes();
            let (mut lo, mut hi) = (0u8, 0u8);
            let mut e = 0;
            while e < 4 {
                lo |= level_code(row[e]) << (2 * e);
                hi |= level_code(row[e + 4]) << (2 * e);
                e += 1;
            }
            c.code_lo[i / 64].0[i % 64] = lo;
            c.code_hi[i / 64].0[i % 64] = hi;
            if i < 128 {
                c.ksigns[i / 64].0[i % 64] = KSIGNS_IQ2XS[i];
            }
            i += 1;
        }
        i = 0;
        while i < 64 {
            let (q, j) = (i / 8, i % 8);
            if j >= 4 {
                c.ctrl_sign.0[i] = 32 + 7 * (j as u8 - 4);
            }
            c.ctrl_code.0[i] = 2 * j as u8;
            c.levels.0[i] = if i % 4 < 3 { LEVELS[i % 4] } else { 0 };
            c.ctrl_sbit.0[i] = 16 + j as u8;
            let mut z = 0;
            while z < 4 {
                let r = 8 * z + q;
                let (g, k) = (r / 4, r % 4);
                c.ctrl_place[z].0[i] = match j {
                    0 => (8 * g + k) as u8,
                    1 => (64 + 8 * g + k) as u8,
                    2 => (8 * g + 4 + k) as u8,
                    _ => 0,
                };
                c.ctrl_scale[z].0[i] = (8 * (2 * z + q / 4) + j % 2) as u8;
                z += 1;
            }
            i += 1;
        }
        c
    }

    static CONSTS: Consts = build_consts();

    #[inline(always)]
    fn ldc(v: &V64) -> __m512i {
        // SAFETY: `V64` is 64 readable bytes.
        unsafe { _mm512_loadu_si512(v.0.as_ptr() as *const __m512i) }
    }

    /// Byte i <- `t[idx_i]` for a 256-byte table held in four vectors.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    fn lookup256(t: &[__m512i; 4], idx: __m512i, high: __mmask64) -> __m512i {
        let a = _mm512_permutex2var_epi8(t[0], idx, t[1]);
        let b = _mm512_permutex2var_epi8(t[2], idx, t[3]);
        _mm512_mask_blend_epi8(high, a, b)
    }

    /// AVX-512 (VBMI, BITALG): one block per iteration, without gathers or table loads: every
    /// table lives in registers and is read with byte permutes.
    ///
    /// The block's 64 bytes of groups are one vector `qv`, group g in qword g (aux0 low, aux1
    /// high): bytes 8g..8g+4 are its four grid indices.
    /// - Grid rows as 2-bit codes: two 256-entry byte lookups (`vpermi2b` x2 + blend each)
    ///   turn the index bytes into the codes of elements 0..4 (`L`) and 4..8 (`H`).
    /// - Signs: `multishift` cuts the four 7-bit sign indices of group g into bytes 8g+4..8g+8
    ///   of `L` (merge-masked), and a merge-masked `vpermi2b` looks them up in `KSIGNS_IQ2XS`
    ///   in place, giving `M` (codes low, sign bytes high in each qword).
    /// - Per 64 elements (vector z, rows 8z..8z+8): one `vpermi2b` places row 8z+q's low codes,
    ///   high codes and sign byte in bytes 0..3 of qword q; `multishift` moves element j's code
    ///   to the bottom of byte j, `vpermb` maps it to 8/25/43; `vpshufbitqmb` turns the sign
    ///   bits into a 64-bit mask that negates activations (`|q8| <= 127`, so never overflows).
    /// - `maddubs` (magnitude x signed activation), then `vpdpwssd` by 2ls+1 of each group.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bitalg,avx512vnni,avx2,fma,f16c")]
    fn dot_avx512_impl(w: &[u8], a: &[BlockQ8K]) -> f32 {
        let c = &CONSTS;
        let code_lo: [__m512i; 4] = std::array::from_fn(|i| ldc(&c.code_lo[i]));
        let code_hi: [__m512i; 4] = std::array::from_fn(|i| ldc(&c.code_hi[i]));
        let (ks_lo, ks_hi) = (ldc(&c.ksigns[0]), ldc(&c.ksigns[1]));
        let ctrl_sign = ldc(&c.ctrl_sign);
        let ctrl_place: [__m512i; 4] = std::array::from_fn(|z| ldc(&c.ctrl_place[z]));
        let ctrl_scale: [__m512i; 4] = std::array::from_fn(|z| ldc(&c.ctrl_scale[z]));
        let (ctrl_code, levels, ctrl_sbit) = (ldc(&c.ctrl_code), ldc(&c.levels), ldc(&c.ctrl_sbit));
        let one = _mm512_set1_epi64(1);
        let zero = _mm512_setzero_si512();
        const SIGN_BYTES: __mmask64 = 0xf0f0_f0f0_f0f0_f0f0;
        let pf = prefetch_distance();
        let mut acc = _mm512_setzero_ps();
        for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a) {
            prefetch(b.as_ptr(), pf, BLOCK_BYTES);
            let qv = ld512(&b[2..]);
            let high = _mm512_movepi8_mask(qv);
            let lo = lookup256(&code_lo, qv, high);
            let hi = lookup256(&code_hi, qv, high);
            let m = _mm512_mask_multishift_epi64_epi8(lo, SIGN_BYTES, ctrl_sign, qv);
            let m = _mm512_mask2_permutex2var_epi8(ks_lo, m, SIGN_BYTES, ks_hi);
            // 2ls + 1 in byte 8g: bit 59 is the top sign-index bit, which or-ing 1 overwrites.
            let sc = _mm512_or_si512(_mm512_srli_epi64::<59>(qv), one);
            let mut isum = zero;
            for z in 0..4 {
                let placed = _mm512_permutex2var_epi8(m, ctrl_place[z], hi);
                let codes = _mm512_multishift_epi64_epi8(ctrl_code, placed);
                let mag = _mm512_permutexvar_epi8(codes, levels);
                let neg = _mm512_bitshuffle_epi64_mask(placed, ctrl_sbit);
                let x = ld512(&q8.qs[64 * z..]);
                let x = _mm512_mask_sub_epi8(x, neg, zero, x);
                let p = _mm512_maddubs_epi16(mag, x);
                let s = _mm512_permutexvar_epi8(ctrl_scale[z], sc);
                isum = _mm512_dpwssd_epi32(isum, p, s);
            }
            // SAFETY: `b` holds the block's f16 `d` in its first two bytes; F16C is enabled.
            let f = q8.d * unsafe { f16_at(b.as_ptr()) } * 0.125;
            acc = _mm512_fmadd_ps(_mm512_set1_ps(f), _mm512_cvtepi32_ps(isum), acc);
        }
        _mm512_reduce_add_ps(acc)
    }
}
