//! IQ3_XXS kernels: dequantize and dot against `Q8K` activations (scalar, AVX2, AVX-512).
//!
//! Block (98 bytes, 256 elements, ggml `block_iq3_xxs`): `d` (f16), `qs[64]` (the grid row of
//! each 4 elements, `IQ3XXS_GRID`), then 8 little-endian u32, one per 32-element group g:
//! four 7-bit sign indices (bits 7k..7k+7 for elements 32g+8k..32g+8k+8, through
//! `KSIGNS_IQ2XS`) and a 4-bit scale `ls` (bits 28..32).
//! Value: `((d * (0.5 + ls)) * 0.5) * grid * sign` (gguf's numpy order; every step is exact).
//!
//! Dot: `(0.5 + ls) * 0.5 = (2 ls + 1) / 4`, so a block contributes
//! `d * da / 4 * sum_g (2 ls_g + 1) * <±grid, a>_g`, an exact integer sum.
//! The AVX-512 kernel (VBMI) reads `Q8KRows` activations (`act.rs`); the others read the `Q8K`
//! copy that preparing `Q8KRows` makes too.

use super::float::f16_at;
use super::iq_grids::IQ3XXS_GRID;
use super::tables::KSIGNS_IQ2XS;
use super::{ActFormat, ActRow, Dot4Kernels, TypeKernels};
use crate::dtype::DType;

const BLOCK_BYTES: usize = 98;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::IQ3_XXS,
    act: ActFormat::Q8KRows,
    dequant,
    dot_scalar,
    dot_avx2: simd::AVX2,
    dot_avx512: simd::AVX512,
});

/// Four-row dots (prefill), each row with the same ISA's single-row dot's bits.
pub(super) const DOT4: Dot4Kernels = Dot4Kernels {
    avx2: simd::DOT4,
    avx512: simd::DOT4_AVX512,
};

/// The scale-and-signs word of group `g` (< 8).
#[inline]
fn group_word(b: &[u8], g: usize) -> u32 {
    let at = 66 + 4 * g;
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn dequant(blocks: &[u8], out: &mut [f32]) {
    for (b, y) in blocks
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(256))
    {
        let d = f16_at(b, 0);
        for (g, yg) in y.chunks_exact_mut(32).enumerate() {
            let aux = group_word(b, g);
            let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
            for (k, y8) in yg.chunks_exact_mut(8).enumerate() {
                let signs = KSIGNS_IQ2XS[((aux >> (7 * k)) & 0x7f) as usize];
                for (c, v) in y8.iter_mut().enumerate() {
                    let grid = IQ3XXS_GRID[b[2 + 8 * g + 2 * k + c / 4] as usize].to_le_bytes();
                    let sg = if (signs >> c) & 1 == 0 { 1.0f32 } else { -1.0 };
                    *v = db * grid[c % 4] as f32 * sg;
                }
            }
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a.q8k) {
        let mut isum = 0i32;
        for g in 0..8 {
            let aux = group_word(b, g);
            let mut gi = 0i32;
            for k in 0..4 {
                let signs = KSIGNS_IQ2XS[((aux >> (7 * k)) & 0x7f) as usize];
                for c in 0..8 {
                    let grid = IQ3XXS_GRID[b[2 + 8 * g + 2 * k + c / 4] as usize].to_le_bytes();
                    let p = grid[c % 4] as i32 * q8.qs[32 * g + 8 * k + c] as i32;
                    gi += if (signs >> c) & 1 == 0 { p } else { -p };
                }
            }
            isum += (2 * (aux >> 28) as i32 + 1) * gi;
        }
        sum += q8.d * f16_at(b, 0) * 0.25 * isum as f32;
    }
    sum
}

#[cfg(not(target_arch = "x86_64"))]
mod simd {
    pub(super) const AVX2: Option<super::super::DotFn> = None;
    pub(super) const AVX512: Option<super::super::DotFn> = None;
    pub(super) const DOT4: Option<super::super::Dot4Fn> = None;
    pub(super) const DOT4_AVX512: Option<super::super::Dot4Fn> = None;
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::super::iq_grids::IQ3XXS_GRID;
    use super::super::iq_x86::avx512::{self, V64};
    use super::super::iq_x86::{common_blocks, hsums, rows4, rows8};
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, ld256, ld512, prefetch};
    use super::super::tables::{KSIGNS_IQ2XS, KSIGNS_IQ2XS_PM1};
    use super::super::{ActRow, BlockQ8K, Dot4Fn, DotFn};
    use super::{group_word, BLOCK_BYTES};
    use crate::kernels::Isa;
    use std::arch::x86_64::*;

    pub(super) const AVX2: Option<DotFn> = Some(dot_avx2);
    pub(super) const AVX512: Option<DotFn> = Some(dot_avx512);
    pub(super) const DOT4: Option<Dot4Fn> = Some(dot4_avx2);
    pub(super) const DOT4_AVX512: Option<Dot4Fn> = Some(dot4_avx512);

    fn dot_avx512(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !avx512::has_vbmi() {
            return dot_avx2(w, a);
        }
        // SAFETY: the CPU has AVX-512 F/BW/VBMI/BITALG/VNNI and AVX2/FMA/F16C (checked above).
        unsafe { dot_avx512_impl::<1>(w, [a.q8k_rows])[0] }
    }

    /// Four activation rows: each block's codes, magnitudes, sign masks and scales are made
    /// once; per row the arithmetic is the single-row dot's (the same `dot_avx512_impl`), so
    /// each row gets its bits. Without VBMI, as the single-row dot, the AVX2 kernel.
    fn dot4_avx512(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !avx512::has_vbmi() {
            return dot4_avx2(w, a, out);
        }
        let rows = [a[0].q8k_rows, a[1].q8k_rows, a[2].q8k_rows, a[3].q8k_rows];
        // SAFETY: the CPU has AVX-512 F/BW/VBMI/BITALG/VNNI and AVX2/FMA/F16C (checked above).
        *out = unsafe { dot_avx512_impl::<4>(w, rows) };
    }

    /// Half k (0, 1) of a `C` vector: byte j of every qword <- the bit offset of element j % 4 of
    /// local row 2k + j / 4, whose codes sit in bytes 2r (elements 0, 1) and 2r + 1 (2, 3).
    const fn ctrl_code(k: usize) -> V64 {
        let mut f = [0u8; 8];
        let mut j = 0;
        while j < 8 {
            let (r, e) = (2 * k + j / 4, j % 4);
            f[j] = (16 * r + 8 * (e / 2) + 3 * (e % 2)) as u8;
            j += 1;
        }
        avx512::per_qword(f)
    }

    /// Vector h (0, 1): byte 8g + 2m <- `lo` byte 8g + 4h + m, byte 8g + 2m + 1 <- `hi` byte
    /// 8g + 4h + m (m < 4): the codes of rows 8g + 4h .. 8g + 4h + 4, a row's two bytes together.
    const fn ctrl_pack(h: usize) -> V64 {
        let mut t = V64([0; 64]);
        let mut i = 0;
        while i < 64 {
            let (g, m) = (i / 8, (i % 8) / 2);
            t.0[i] = (8 * g + 4 * h + m + 64 * (i % 2)) as u8;
            i += 1;
        }
        t
    }

    /// What every activation row needs of one block, per activation vector k: the magnitudes
    /// and the negate mask. `lo`/`hi` hold the 3-bit codes of its 64 grid rows (row i in byte
    /// i), `signs` its sign bytes (byte 8g + k: the 8 elements of row k of group g).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bitalg")]
    fn block_rows(
        r: &Regs,
        lo: __m512i,
        hi: __m512i,
        signs: __m512i,
    ) -> ([__m512i; 4], [__mmask64; 4]) {
        let cv = [
            _mm512_permutex2var_epi8(lo, r.pack[0], hi),
            _mm512_permutex2var_epi8(lo, r.pack[1], hi),
        ];
        let mut mag = [_mm512_setzero_si512(); 4];
        let mut neg: [__mmask64; 4] = [0; 4];
        for k in 0..4 {
            let c = _mm512_multishift_epi64_epi8(r.code[k % 2], cv[k / 2]);
            mag[k] = _mm512_permutexvar_epi8(c, r.levels);
            neg[k] = _mm512_bitshuffle_epi64_mask(signs, r.sbit[k]);
        }
        (mag, neg)
    }

    /// The constant vectors, in registers.
    struct Regs {
        pack: [__m512i; 2],
        code: [__m512i; 2],
        sbit: [__m512i; 4],
        levels: __m512i,
    }

    /// The magnitudes of `IQ3XXS_GRID`, codes 0..8.
    const LEVELS: [u8; 8] = [4, 12, 20, 28, 36, 44, 52, 62];

    /// The AVX-512 kernel's constant vectors.
    struct Consts {
        /// `IQ3XXS_GRID` as 3-bit codes, elements 0, 1 (`lo`) and 2, 3 (`hi`), 256 rows.
        codes: ([V64; 4], [V64; 4]),
        ksigns: [V64; 2],
        /// Byte 8g + k <- bit 7k of qword g (k < 4): sign index k of group g.
        ctrl_sign: V64,
        pack: [V64; 2],
        code: [V64; 2],
        sbit: [V64; 4],
        levels: V64,
    }

    static CONSTS: Consts = Consts {
        codes: avx512::codes3x2::<4>(&IQ3XXS_GRID, &LEVELS),
        ksigns: avx512::bytes_table::<2>(&KSIGNS_IQ2XS),
        ctrl_sign: avx512::per_qword([0, 7, 14, 21, 0, 7, 14, 21]),
        pack: [ctrl_pack(0), ctrl_pack(1)],
        code: [ctrl_code(0), ctrl_code(1)],
        sbit: avx512::sign_bits(),
        levels: avx512::level_table(&LEVELS),
    };

    /// AVX-512 (VBMI, BITALG, VNNI) on `Q8KRows` activations, no table loads: the block's 64
    /// grid indices are one vector, looked up as 3-bit codes in two 256-byte tables held in 8
    /// registers (`vpermi2b` x2 and a blend each); `vpermi2b` packs the codes of the rows that
    /// activation vector k needs (rows 8g + 2k, 8g + 2k + 1 in qword g), `multishift` and
    /// `vpermb` make the magnitudes. The sign words (zero-extended so group g is qword g) give
    /// the sign indices by `multishift`, `KSIGNS_IQ2XS` by `vpermi2b`, masks by `vpshufbitqmb`;
    /// `vpdpbusd` sums, one multiply by 2ls+1 per block. For `N` activation rows at once (the
    /// weight side made once per block).
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bitalg,avx512vnni,avx2,fma,f16c")]
    fn dot_avx512_impl<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
        let c = &CONSTS;
        let (lo_t, hi_t) = (avx512::ldcs(&c.codes.0), avx512::ldcs(&c.codes.1));
        let (ks_lo, ks_hi) = (avx512::ldc(&c.ksigns[0]), avx512::ldc(&c.ksigns[1]));
        let ctrl_sign = avx512::ldc(&c.ctrl_sign);
        let r = Regs {
            pack: avx512::ldcs(&c.pack),
            code: avx512::ldcs(&c.code),
            sbit: avx512::ldcs(&c.sbit),
            levels: avx512::ldc(&c.levels),
        };
        let one = _mm512_set1_epi64(1);
        let pf = prefetch_distance();
        let mut acc = [_mm512_setzero_ps(); N];
        let nb = common_blocks(w, BLOCK_BYTES, &a);
        for (i, b) in w.chunks_exact(BLOCK_BYTES).take(nb).enumerate() {
            prefetch(b.as_ptr(), pf, BLOCK_BYTES);
            let qs = ld512(&b[2..66]);
            let lo = avx512::lookup_b(&lo_t, qs, 0);
            let hi = avx512::lookup_b(&hi_t, qs, 0);
            let aux = _mm512_cvtepu32_epi64(ld256(&b[66..98]));
            let sidx = _mm512_multishift_epi64_epi8(ctrl_sign, aux);
            let signs = _mm512_permutex2var_epi8(ks_lo, sidx, ks_hi);
            let (mag, neg) = block_rows(&r, lo, hi, signs);
            // 2ls + 1 in both dwords of qword g.
            let sc = _mm512_or_si512(_mm512_srli_epi64::<27>(aux), one);
            let sc = _mm512_or_si512(sc, _mm512_slli_epi64::<32>(sc));
            // SAFETY: `b` holds the block's f16 `d` in its first two bytes; F16C is enabled.
            let fd = unsafe { f16_at(b.as_ptr()) };
            for (acc, a) in acc.iter_mut().zip(&a) {
                let q8 = &a[i];
                let isum = avx512::row_isum(&mag, &neg, &q8.qs);
                let f = q8.d * fd * 0.25;
                *acc = avx512::add_block(*acc, isum, sc, f);
            }
        }
        avx512::reduce_sums(&acc)
    }

    fn dot_avx2(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return super::dot_scalar(w, a);
        }
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        unsafe { dot_avx2_impl::<1>(w, [a.q8k])[0] }
    }

    /// Four activation rows: the grid rows, signs and scales of each group are made once; per
    /// row the arithmetic is the single-row dot's, so each row gets its bits.
    fn dot4_avx2(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !Isa::Avx2.supported() {
            *out = std::array::from_fn(|r| super::dot_scalar(w, &a[r]));
            return;
        }
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        *out = unsafe { dot_avx2_impl::<4>(w, [a[0].q8k, a[1].q8k, a[2].q8k, a[3].q8k]) };
    }

    /// Per 32-element group: eight 4-byte grid rows and four sign rows (±1 bytes) from
    /// tables, `maddubs` of magnitudes with sign-applied activations, `madd` with 2ls+1; for
    /// `N` activation rows at once.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_avx2_impl<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
        let mut acc = [_mm256_setzero_ps(); N];
        let pf = prefetch_distance();
        let nb = common_blocks(w, BLOCK_BYTES, &a);
        for (i, b) in w.chunks_exact(BLOCK_BYTES).take(nb).enumerate() {
            prefetch(b.as_ptr(), pf, BLOCK_BYTES);
            let q8: [&BlockQ8K; N] = std::array::from_fn(|r| &a[r][i]);
            let mut isum = [_mm256_setzero_si256(); N];
            for g in 0..8 {
                let aux = group_word(b, g);
                let grid = rows4(
                    &IQ3XXS_GRID,
                    std::array::from_fn(|i| b[2 + 8 * g + i] as usize),
                );
                let signs = rows8(
                    &KSIGNS_IQ2XS_PM1,
                    std::array::from_fn(|k| ((aux >> (7 * k)) & 0x7f) as usize),
                );
                let ls = _mm256_set1_epi16((2 * (aux >> 28) + 1) as i16);
                for (isum, q8) in isum.iter_mut().zip(&q8) {
                    let x = &q8.qs[32 * g..32 * g + 32];
                    // SAFETY: `x` is 32 bytes.
                    let x = unsafe { _mm256_loadu_si256(x.as_ptr() as *const __m256i) };
                    let p = _mm256_maddubs_epi16(grid, _mm256_sign_epi8(x, signs));
                    *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(p, ls));
                }
            }
            // SAFETY: `b` holds the block's f16 `d` in its first two bytes; F16C is enabled.
            let fd = unsafe { f16_at(b.as_ptr()) };
            for r in 0..N {
                let f = q8[r].d * fd * 0.25;
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(isum[r]), acc[r]);
            }
        }
        hsums(&acc)
    }
}
