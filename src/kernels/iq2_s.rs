//! IQ2_S kernels: dequantize and dot against `Q8K` activations (scalar, AVX2, AVX-512).
//!
//! Block (82 bytes, 256 elements, ggml `block_iq2_s`): `d` (f16), `qs[32]` (low 8 bits of the
//! grid row of each 8-element row, `IQ2S_GRID`), `signs[32]` (byte i: the sign bits of row i,
//! bit c set = element c negative), `qh[8]` (byte g: bits 2k..2k+2 are bits 8..10 of row 4g+k's
//! grid index), `scales[8]` (as IQ2_XS: byte g, low nibble for elements 32g..32g+16, high
//! nibble for the next 16).
//! Value: `((d * (0.5 + s)) * 0.25) * grid * sign` (gguf's numpy order; every step is exact).
//!
//! Dot: `d * da / 8 * sum_h (2 s_h + 1) * <±grid, a>_h` over the 16 half-groups, as IQ2_XS.
//! The AVX-512 kernel (VBMI) reads `Q8KRows` activations (`act.rs`); the others read the `Q8K`
//! copy that preparing `Q8KRows` makes too.

use super::float::f16_at;
use super::iq_grids::IQ2S_GRID;
use super::{ActFormat, ActRow, Dot4Kernels, TypeKernels};
use crate::dtype::DType;

const BLOCK_BYTES: usize = 82;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::IQ2_S,
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

/// Grid row of 8-element row `i` (< 32) of block `b`.
#[inline]
fn grid_row(b: &[u8], i: usize) -> usize {
    b[2 + i] as usize | (((b[66 + i / 4] >> (2 * (i % 4))) & 3) as usize) << 8
}

/// Scale nibble of half-group `h` (< 16).
#[inline]
fn scale(b: &[u8], h: usize) -> u32 {
    ((b[74 + h / 2] >> (4 * (h % 2))) & 0xf) as u32
}

fn dequant(blocks: &[u8], out: &mut [f32]) {
    for (b, y) in blocks
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(256))
    {
        let d = f16_at(b, 0);
        for (i, y8) in y.chunks_exact_mut(8).enumerate() {
            let db = d * (0.5 + scale(b, i / 2) as f32) * 0.25;
            let grid = IQ2S_GRID[grid_row(b, i)].to_le_bytes();
            let signs = b[34 + i];
            for (c, v) in y8.iter_mut().enumerate() {
                let sg = if (signs >> c) & 1 == 0 { 1.0f32 } else { -1.0 };
                *v = db * grid[c] as f32 * sg;
            }
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a.q8k) {
        let mut isum = 0i32;
        for h in 0..16 {
            let mut hi = 0i32;
            for i in 2 * h..2 * h + 2 {
                let grid = IQ2S_GRID[grid_row(b, i)].to_le_bytes();
                let signs = b[34 + i];
                for (c, &x) in q8.qs[8 * i..8 * i + 8].iter().enumerate() {
                    let p = grid[c] as i32 * x as i32;
                    hi += if (signs >> c) & 1 == 0 { p } else { -p };
                }
            }
            isum += (2 * scale(b, h) as i32 + 1) * hi;
        }
        sum += q8.d * f16_at(b, 0) * 0.125 * isum as f32;
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
    use super::super::iq_grids::IQ2S_GRID;
    use super::super::iq_x86::avx512::{self, V64};
    use super::super::iq_x86::{common_blocks, hsums, rows8, scale_pair, signs_pm1};
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, ld256, prefetch};
    use super::super::{ActRow, BlockQ8K, Dot4Fn, DotFn};
    use super::BLOCK_BYTES;
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

    /// Four activation rows: each block pair's codes, and each block's magnitudes, sign masks
    /// and scales, are made once; per row the arithmetic is the single-row dot's (the same
    /// `dot_avx512_impl`), so each row gets its bits. Without VBMI, as the single-row dot, the
    /// AVX2 kernel.
    fn dot4_avx512(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !avx512::has_vbmi() {
            return dot4_avx2(w, a, out);
        }
        let rows = [a[0].q8k_rows, a[1].q8k_rows, a[2].q8k_rows, a[3].q8k_rows];
        // SAFETY: the CPU has AVX-512 F/BW/VBMI/BITALG/VNNI and AVX2/FMA/F16C (checked above).
        *out = unsafe { dot_avx512_impl::<4>(w, rows) };
    }

    /// The AVX-512 kernel's constant vectors.
    struct Consts {
        /// `IQ2S_GRID` as u16 codes (`avx512::codes16_bytes`), low and high bytes, 1024 rows.
        codes: ([V64; 16], [V64; 16]),
        /// Row 8q + j of a pair of blocks (qword q of their 16 `qh` bytes zero-extended from
        /// u16): byte j <- bit 8 (`[0]`) and 9 (`[1]`) of its grid index.
        ctrl_qh: [V64; 2],
        ctrl_words: [V64; 2],
        /// Row k: byte j of every qword <- bit 16k + 2j, element j's code in row 4g+k's u16.
        ctrl_code: [V64; 4],
        ctrl_sbit: [V64; 4],
        levels: V64,
    }

    const fn ctrl_code(k: usize) -> V64 {
        let mut f = [0u8; 8];
        let mut j = 0;
        while j < 8 {
            f[j] = (16 * k + 2 * j) as u8;
            j += 1;
        }
        avx512::per_qword(f)
    }

    static CONSTS: Consts = Consts {
        codes: avx512::codes16_bytes::<16>(&IQ2S_GRID),
        ctrl_qh: [
            avx512::per_qword([0, 2, 4, 6, 8, 10, 12, 14]),
            avx512::per_qword([1, 3, 5, 7, 9, 11, 13, 15]),
        ],
        ctrl_words: [
            avx512::ctrl_words_of_bytes(0),
            avx512::ctrl_words_of_bytes(1),
        ],
        ctrl_code: [ctrl_code(0), ctrl_code(1), ctrl_code(2), ctrl_code(3)],
        ctrl_sbit: avx512::sign_bits(),
        levels: avx512::level_table(&avx512::LEVELS2),
    };

    /// The constant vectors, in registers.
    struct Regs {
        lo_t: [__m512i; 16],
        hi_t: [__m512i; 16],
        ctrl_qh: [__m512i; 2],
        ctrl_words: [__m512i; 2],
        ctrl_code: [__m512i; 4],
        ctrl_sbit: [__m512i; 4],
        levels: __m512i,
    }

    /// The u16 codes of two blocks' rows (block h's codes in vector h): the 64 low index bytes
    /// of both are one vector, bits 8 and 9 masks cut from the `qh` bytes by `vpshufbitqmb`,
    /// so one pair of 1024-byte lookups serves both blocks.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bitalg")]
    fn pair_codes(r: &Regs, ba: &[u8], bb: &[u8]) -> [__m512i; 2] {
        let low =
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ld256(&ba[2..34])), ld256(&bb[2..34]));
        let qa = u64::from_le_bytes(ba[66..74].try_into().expect("8 bytes"));
        let qb = u64::from_le_bytes(bb[66..74].try_into().expect("8 bytes"));
        let qh = _mm512_cvtepu16_epi64(_mm_set_epi64x(qb as i64, qa as i64));
        let bit8 = _mm512_bitshuffle_epi64_mask(qh, r.ctrl_qh[0]);
        let bit9 = _mm512_bitshuffle_epi64_mask(qh, r.ctrl_qh[1]);
        let lo = avx512::lookup_b1024(&r.lo_t, low, bit8, bit9);
        let hi = avx512::lookup_b1024(&r.hi_t, low, bit8, bit9);
        [
            _mm512_permutex2var_epi8(lo, r.ctrl_words[0], hi),
            _mm512_permutex2var_epi8(lo, r.ctrl_words[1], hi),
        ]
    }

    /// One block's scaled sum added into each row's accumulator: `cv` its rows' u16 codes,
    /// `q8[r]` row r's activation block. The magnitudes, sign masks and scales are made once;
    /// each row's integer sums and f32 operations do not depend on `N`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bitalg,avx512vnni,avx2,fma,f16c")]
    fn add_block<const N: usize>(
        r: &Regs,
        acc: &mut [__m512; N],
        b: &[u8],
        cv: __m512i,
        q8: [&BlockQ8K; N],
    ) {
        let signs = _mm512_cvtepu32_epi64(ld256(&b[34..66]));
        let mut mag = [_mm512_setzero_si512(); 4];
        let mut neg: [__mmask64; 4] = [0; 4];
        for k in 0..4 {
            mag[k] =
                _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(r.ctrl_code[k], cv), r.levels);
            neg[k] = _mm512_bitshuffle_epi64_mask(signs, r.ctrl_sbit[k]);
        }
        let scales = avx512::nibble_scales(&b[74..82]);
        // SAFETY: `b` holds the block's f16 `d` in its first two bytes; F16C is enabled.
        let fd = unsafe { f16_at(b.as_ptr()) };
        avx512::add_half_scaled(acc, &mag, &neg, scales, fd, q8);
    }

    /// AVX-512 (VBMI, BITALG, VNNI) on `Q8KRows` activations, no table loads: the 1024-row grid
    /// lives in 32 vectors of u16 codes split into low and high bytes, and two blocks share one
    /// pair of byte lookups (`pair_codes`; a first version made each block's u16 indices and
    /// read the codes with 16 word permutes and 15 blends: 5.6 GB/s in L2 on one Zen 4 thread).
    /// u16 k of qword g = row 4g+k (the activations' layout). Then as IQ2_XS: `multishift` +
    /// `vpermb` per activation vector, the sign bytes (zero-extended so qword g holds rows
    /// 4g..4g+4) made masks by `vpshufbitqmb`, `vpdpbusd` for half-groups 2g and 2g+1 apart,
    /// each times its 2s+1. For `N` activation rows at once (the weight side made once per
    /// block).
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bitalg,avx512vnni,avx2,fma,f16c")]
    fn dot_avx512_impl<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
        let c = &CONSTS;
        let r = Regs {
            lo_t: avx512::ldcs(&c.codes.0),
            hi_t: avx512::ldcs(&c.codes.1),
            ctrl_qh: avx512::ldcs(&c.ctrl_qh),
            ctrl_words: avx512::ldcs(&c.ctrl_words),
            ctrl_code: avx512::ldcs(&c.ctrl_code),
            ctrl_sbit: avx512::ldcs(&c.ctrl_sbit),
            levels: avx512::ldc(&c.levels),
        };
        let pf = prefetch_distance();
        let mut acc = [_mm512_setzero_ps(); N];
        let nb = common_blocks(w, BLOCK_BYTES, &a);
        let block = |i: usize| &w[i * BLOCK_BYTES..(i + 1) * BLOCK_BYTES];
        let q8 = |i: usize| -> [&BlockQ8K; N] { std::array::from_fn(|r| &a[r][i]) };
        let mut i = 0;
        while i + 2 <= nb {
            let (ba, bb) = (block(i), block(i + 1));
            prefetch(ba.as_ptr(), pf, 2 * BLOCK_BYTES);
            let cv = pair_codes(&r, ba, bb);
            add_block(&r, &mut acc, ba, cv[0], q8(i));
            add_block(&r, &mut acc, bb, cv[1], q8(i + 1));
            i += 2;
        }
        if i < nb {
            let b = block(i);
            let cv = pair_codes(&r, b, b);
            add_block(&r, &mut acc, b, cv[0], q8(i));
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

    /// Per 32-element group: four grid rows from the table, the group's 32 sign bits as ±1
    /// bytes, `maddubs` of magnitudes with sign-applied activations, `madd` with the two
    /// half-group scales (2s+1, low lane / high lane); for `N` activation rows at once.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_avx2_impl<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
        let mut acc = [_mm256_setzero_ps(); N];
        let pf = prefetch_distance();
        let mask = _mm_set1_epi8(0x0f);
        let nb = common_blocks(w, BLOCK_BYTES, &a);
        for (i, b) in w.chunks_exact(BLOCK_BYTES).take(nb).enumerate() {
            prefetch(b.as_ptr(), pf, BLOCK_BYTES);
            let sc = u64::from_le_bytes(b[74..82].try_into().expect("8 bytes"));
            let sc = _mm_cvtsi64_si128(sc as i64);
            let sc = _mm_unpacklo_epi8(
                _mm_and_si128(sc, mask),
                _mm_and_si128(_mm_srli_epi16(sc, 4), mask),
            );
            let sc =
                _mm256_broadcastsi128_si256(_mm_or_si128(_mm_add_epi8(sc, sc), _mm_set1_epi8(1)));
            let q8: [&BlockQ8K; N] = std::array::from_fn(|r| &a[r][i]);
            let mut isum = [_mm256_setzero_si256(); N];
            for g in 0..8 {
                let qh = b[66 + g] as usize;
                let rows =
                    std::array::from_fn(|k| b[2 + 4 * g + k] as usize | ((qh >> (2 * k)) & 3) << 8);
                let grid = rows8(&IQ2S_GRID, rows);
                let bits = u32::from_le_bytes(b[34 + 4 * g..38 + 4 * g].try_into().expect("4"));
                let signs = signs_pm1(bits);
                let s = scale_pair(sc, g);
                for (isum, q8) in isum.iter_mut().zip(&q8) {
                    let x = &q8.qs[32 * g..32 * g + 32];
                    // SAFETY: `x` is 32 bytes.
                    let x = unsafe { _mm256_loadu_si256(x.as_ptr() as *const __m256i) };
                    let p = _mm256_maddubs_epi16(grid, _mm256_sign_epi8(x, signs));
                    *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(p, s));
                }
            }
            // SAFETY: `b` holds the block's f16 `d` in its first two bytes; F16C is enabled.
            let fd = unsafe { f16_at(b.as_ptr()) };
            for r in 0..N {
                let f = q8[r].d * fd * 0.125;
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(isum[r]), acc[r]);
            }
        }
        hsums(&acc)
    }
}
