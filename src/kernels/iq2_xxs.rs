//! IQ2_XXS kernels: dequantize and dot against `Q8KRows` activations (scalar, AVX2, AVX-512).
//!
//! Block (66 bytes, 256 elements, ggml `block_iq2_xxs`): `d` (f16), then 8 groups of 32
//! elements, each two little-endian u32: `aux0` holds four 8-bit grid indices (one per 8
//! elements: `IQ2XXS_GRID` row), `aux1` four 7-bit sign indices (bits 7k..7k+7, through
//! `KSIGNS_IQ2XS`) and a 4-bit scale `ls` (bits 28..32).
//! Value: `((d * (0.5 + ls)) * 0.25) * grid * sign` (gguf's numpy order).
//!
//! Dot: `(0.5 + ls) * 0.25 = (2 ls + 1) / 8`, so a block contributes
//! `d * da / 8 * sum_g (2 ls_g + 1) * <±grid, a>_g`, an exact integer sum.
//!
//! Activations come as `Q8KRows` (row k of every group side by side, see `act.rs`): a 64-byte
//! vector then holds one 8-element grid row per qword, qword g always from group g, so the
//! SIMD kernels never move weights or scales across lanes.

use super::act::q8k_rows_pos;
use super::float::f16_at;
use super::tables::{IQ2XXS_GRID, KSIGNS_IQ2XS};
use super::{ActFormat, ActRow, Dot4Kernels, TypeKernels};
use crate::dtype::DType;

const BLOCK_BYTES: usize = 66;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::IQ2_XXS,
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
    for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a.q8k_rows) {
        let mut isum = 0i32;
        for g in 0..8 {
            let (aux0, aux1) = group_words(b, g);
            let mut gi = 0i32;
            for k in 0..4 {
                let grid = IQ2XXS_GRID[((aux0 >> (8 * k)) & 0xff) as usize].to_le_bytes();
                let signs = KSIGNS_IQ2XS[((aux1 >> (7 * k)) & 0x7f) as usize];
                let at = q8k_rows_pos(32 * g + 8 * k);
                for (c, &x) in q8.qs[at..at + 8].iter().enumerate() {
                    let p = grid[c] as i32 * x as i32;
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
    pub(super) const DOT4: Option<super::super::Dot4Fn> = None;
    pub(super) const DOT4_AVX512: Option<super::super::Dot4Fn> = None;
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::super::iq_x86::{avx512, hsums, rows8};
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, hsum256, ld256, ld512, prefetch};
    use super::super::tables::{IQ2XXS_GRID, KSIGNS_IQ2XS};
    use super::super::{ActRow, BlockQ8K, Dot4Fn, DotFn};
    use super::BLOCK_BYTES;
    use crate::kernels::Isa;
    use std::arch::x86_64::*;

    pub(super) const AVX2: Option<DotFn> = Some(dot_avx2);
    pub(super) const AVX512: Option<DotFn> = Some(dot_avx512);
    pub(super) const DOT4: Option<Dot4Fn> = Some(dot4_avx2);
    pub(super) const DOT4_AVX512: Option<Dot4Fn> = Some(dot4_avx512);

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
        unsafe { dot_avx512_impl::<1>(w, [a.q8k_rows])[0] }
    }

    /// Four activation rows (prefill) with `dot_avx512`'s bits per row: each block pair's
    /// lookups, and each block's magnitudes, sign masks and scales, are made once; per row the
    /// arithmetic is the single-row dot's (the same `dot_avx512_impl`). Without VBMI and
    /// BITALG, as the single-row dot, the AVX2 kernel.
    fn dot4_avx512(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !has_avx512() {
            return dot4_avx2(w, a, out);
        }
        let rows = [a[0].q8k_rows, a[1].q8k_rows, a[2].q8k_rows, a[3].q8k_rows];
        // SAFETY: the CPU has AVX-512 F/BW/VBMI/BITALG/VNNI and AVX2/FMA/F16C (checked above).
        *out = unsafe { dot_avx512_impl::<4>(w, rows) };
    }

    /// A block's sign words and scales, both dot kernels' first step: byte k of each word of
    /// `s` is sign index k (bits 7k..7k+7) with its parity in bit 7; `sc` holds 2ls + 1 in both
    /// i16 halves (bit 27, the top sign-index bit, is overwritten by 1). Group g's dword is at
    /// `POS[g]` (the `shufps` puts groups 0, 1, 4, 5 in lane 0, 2, 3, 6, 7 in lane 1).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn signs_and_scales(b: &[u8]) -> (__m256i, __m256i) {
        let m7f = _mm256_set1_epi32(0x7f);
        let lsb = _mm256_set1_epi32(0x0101_0101);
        let v0 = _mm256_castsi256_ps(ld256(&b[2..34]));
        let v1 = _mm256_castsi256_ps(ld256(&b[34..66]));
        let a1 = _mm256_castps_si256(_mm256_shuffle_ps::<0b11_01_11_01>(v0, v1));
        let s = _mm256_or_si256(
            _mm256_or_si256(
                _mm256_and_si256(a1, m7f),
                _mm256_and_si256(_mm256_slli_epi32::<1>(a1), _mm256_slli_epi32::<8>(m7f)),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_slli_epi32::<2>(a1), _mm256_slli_epi32::<16>(m7f)),
                _mm256_and_si256(_mm256_slli_epi32::<3>(a1), _mm256_slli_epi32::<24>(m7f)),
            ),
        );
        let p = _mm256_xor_si256(s, _mm256_srli_epi32::<4>(s));
        let p = _mm256_xor_si256(p, _mm256_srli_epi32::<2>(p));
        let p = _mm256_xor_si256(p, _mm256_srli_epi32::<1>(p));
        let s = _mm256_or_si256(s, _mm256_slli_epi32::<7>(_mm256_and_si256(p, lsb)));
        let sc = _mm256_or_si256(_mm256_srli_epi32::<27>(a1), _mm256_set1_epi32(1));
        let sc = _mm256_or_si256(sc, _mm256_slli_epi32::<16>(sc));
        (s, sc)
    }

    /// The four grid rows of the group whose index bytes start at `b[at]` (row k in qword k).
    /// The indices come from one scalar 32-bit load and shifts: built from byte loads, LLVM
    /// reused the block's vector loads and extracted each index with `vpextrb` (two uops on
    /// the vector-to-integer path), which bounded the loop.
    #[inline(always)]
    fn grid_rows(b: &[u8], at: usize) -> __m256i {
        let q = u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        rows8(
            &IQ2XXS_GRID,
            std::array::from_fn(|k| (q >> (8 * k)) as u8 as usize),
        )
    }

    /// AVX2 (natural `Q8K` order, which preparing `Q8KRows` provides too). Per block, the
    /// eight aux1 words are read as one vector (`shufps` of the block's two halves) and turned
    /// into the groups' 32 sign bits (the 7-bit indices spread to bytes, the eighth bit their
    /// parity, as `KSIGNS_IQ2XS` defines it) and their scales 2ls+1, with no table loads. Per
    /// 32-element group: `vpermd` broadcasts the group's sign word and scale, the sign bits
    /// become byte masks (`pshufb`, `and`, `cmpeq`) that negate activations (xor, subtract),
    /// four grid rows come from the table, then `maddubs` and `madd`.
    ///
    /// The earlier version looked up the sign rows as ±1 bytes in `KSIGNS_IQ2XS_PM1` (four
    /// table loads and inserts per group plus scalar index arithmetic): 21.4-21.7 vs 18.2-18.3
    /// ns per block with the weights in L2 on Zen 4; gathering the grid rows with
    /// `vpgatherdq` instead of four loads measured the same (docs/PERFORMANCE.md).
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_avx2_impl(w: &[u8], a: &[BlockQ8K]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let pf = prefetch_distance();
        let spread = _mm256_set_epi64x(
            0x0303030303030303,
            0x0202020202020202,
            0x0101010101010101,
            0,
        );
        let bitsel = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
        // Dword of group g in the `shufps` result: lane 0 holds groups 0, 1, 4, 5, lane 1
        // groups 2, 3, 6, 7.
        const POS: [i32; 8] = [0, 1, 4, 5, 2, 3, 6, 7];
        for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a) {
            prefetch(b.as_ptr(), pf, BLOCK_BYTES);
            let (s, sc) = signs_and_scales(b);
            let mut isum = _mm256_setzero_si256();
            for (g, x) in q8.qs.chunks_exact(32).enumerate() {
                let at = 2 + 8 * g;
                let sel = _mm256_set1_epi32(POS[g]);
                let sg = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(s, sel), spread);
                let neg = _mm256_cmpeq_epi8(_mm256_and_si256(sg, bitsel), bitsel);
                let x = ld256(x);
                let x = _mm256_sub_epi8(_mm256_xor_si256(x, neg), neg);
                let grid = grid_rows(b, at);
                let p = _mm256_maddubs_epi16(grid, x);
                let scg = _mm256_permutevar8x32_epi32(sc, sel);
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, scg));
            }
            // SAFETY: `b` holds the block's f16 `d` in its first two bytes; F16C is enabled.
            let f = q8.d * unsafe { f16_at(b.as_ptr()) } * 0.125;
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(isum), acc);
        }
        hsum256(acc)
    }

    /// Four activation rows (prefill) with `dot_avx2`'s bits per row: the signs, scales and
    /// grid rows of each group are made once, each row then negates its activations, `maddubs`
    /// and `madd` as `dot_avx2_impl` does.
    fn dot4_avx2(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !Isa::Avx2.supported() {
            *out = std::array::from_fn(|r| super::dot_scalar(w, &a[r]));
            return;
        }
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        *out = unsafe { dot4_avx2_impl(w, [a[0].q8k, a[1].q8k, a[2].q8k, a[3].q8k]) };
    }

    /// `dot_avx2_impl` for four activation rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot4_avx2_impl(w: &[u8], a: [&[BlockQ8K]; 4]) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        let pf = prefetch_distance();
        let spread = _mm256_set_epi64x(
            0x0303030303030303,
            0x0202020202020202,
            0x0101010101010101,
            0,
        );
        let bitsel = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
        const POS: [i32; 8] = [0, 1, 4, 5, 2, 3, 6, 7];
        let nb = a
            .iter()
            .map(|a| a.len())
            .fold(w.len() / BLOCK_BYTES, usize::min);
        for (i, b) in w.chunks_exact(BLOCK_BYTES).take(nb).enumerate() {
            prefetch(b.as_ptr(), pf, BLOCK_BYTES);
            let (s, sc) = signs_and_scales(b);
            let mut isum = [_mm256_setzero_si256(); 4];
            for (g, &pos) in POS.iter().enumerate() {
                let at = 2 + 8 * g;
                let sel = _mm256_set1_epi32(pos);
                let sg = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(s, sel), spread);
                let neg = _mm256_cmpeq_epi8(_mm256_and_si256(sg, bitsel), bitsel);
                let grid = grid_rows(b, at);
                let scg = _mm256_permutevar8x32_epi32(sc, sel);
                for r in 0..4 {
                    let x = ld256(&a[r][i].qs[32 * g..32 * g + 32]);
                    let x = _mm256_sub_epi8(_mm256_xor_si256(x, neg), neg);
                    let p = _mm256_maddubs_epi16(grid, x);
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, scg));
                }
            }
            // SAFETY: `b` holds the block's f16 `d` in its first two bytes; F16C is enabled.
            let fd = unsafe { f16_at(b.as_ptr()) };
            for r in 0..4 {
                let f = a[r][i].d * fd * 0.125;
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(isum[r]), acc[r]);
            }
        }
        hsums(&acc)
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
        /// Bytes 8g+k and 8g+4+k (k < 4) <- bit offset 32 + 7k: sign index k of group g.
        ctrl_sign: V64,
        /// Byte 8g+j <- bit offset 7j (j < 4) or 32 + 7(j-4): the sign indices of a qword
        /// holding the aux1 words of two groups.
        ctrl_sign2: V64,
        /// Row k: byte j of every qword <- bit offset of element j's code in the qword of codes
        /// (low codes of rows 0..4 in bytes 0..4, high codes in bytes 4..8).
        ctrl_code: [V64; 4],
        /// `LEVELS[i & 3]` for the 6-bit indices `vpermb` uses.
        levels: V64,
        /// Row k: byte j of every qword <- bit 8k + j, element j's sign in the sign bytes.
        ctrl_sbit: [V64; 4],
    }

    const fn build_consts() -> Consts {
        let mut c = Consts {
            code_lo: [const { V64([0; 64]) }; 4],
            code_hi: [const { V64([0; 64]) }; 4],
            ksigns: [const { V64([0; 64]) }; 2],
            ctrl_sign: V64([0; 64]),
            ctrl_sign2: V64([0; 64]),
            ctrl_code: [const { V64([0; 64]) }; 4],
            levels: V64([0; 64]),
            ctrl_sbit: [const { V64([0; 64]) }; 4],
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
            let j = i % 8;
            c.ctrl_sign.0[i] = 32 + 7 * (j % 4) as u8;
            c.ctrl_sign2.0[i] = (32 * (j / 4) + 7 * (j % 4)) as u8;
            c.levels.0[i] = if i % 4 < 3 { LEVELS[i % 4] } else { 0 };
            let mut k = 0;
            while k < 4 {
                c.ctrl_code[k].0[i] = (8 * k + 2 * (j % 4) + 32 * (j / 4)) as u8;
                c.ctrl_sbit[k].0[i] = (8 * k + j) as u8;
                k += 1;
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

    /// Byte i <- `t[idx_i]` for a 256-byte table held in four vectors (`high`: idx_i >= 128).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    fn lookup256(t: &[__m512i; 4], idx: __m512i, high: __mmask64) -> __m512i {
        let a = _mm512_permutex2var_epi8(t[0], idx, t[1]);
        let b = _mm512_permutex2var_epi8(t[2], idx, t[3]);
        _mm512_mask_blend_epi8(high, a, b)
    }

    /// The constant vectors of the AVX-512 kernel, loaded into registers once per call.
    struct Regs {
        code_lo: [__m512i; 4],
        code_hi: [__m512i; 4],
        ks_lo: __m512i,
        ks_hi: __m512i,
        ctrl_sign: __m512i,
        ctrl_sign2: __m512i,
        ctrl_code: [__m512i; 4],
        ctrl_sbit: [__m512i; 4],
        levels: __m512i,
        one: __m512i,
    }

    /// What every activation row needs of one block, per activation vector k: the magnitudes
    /// and the negate mask. `codes`: qword g holds the low codes of rows 0..4 in bytes 0..4 and
    /// the high codes in bytes 4..8; `signs`: byte 8g+k is row k's sign byte.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bitalg")]
    fn block_rows(r: &Regs, codes: __m512i, signs: __m512i) -> ([__m512i; 4], [__mmask64; 4]) {
        let mut mag = [_mm512_setzero_si512(); 4];
        let mut neg: [__mmask64; 4] = [0; 4];
        for k in 0..4 {
            let c = _mm512_multishift_epi64_epi8(r.ctrl_code[k], codes);
            mag[k] = _mm512_permutexvar_epi8(c, r.levels);
            neg[k] = _mm512_bitshuffle_epi64_mask(signs, r.ctrl_sbit[k]);
        }
        (mag, neg)
    }

    /// The integer dot of one block (`block_rows`) with one activation row `x` per group,
    /// `<±grid, q8>_g` in the two dwords of qword g.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    fn row_isum(mag: &[__m512i; 4], neg: &[__mmask64; 4], x: &[i8; 256]) -> __m512i {
        let zero = _mm512_setzero_si512();
        let mut isum = zero;
        for k in 0..4 {
            let xk = ld512(&x[64 * k..]);
            let xk = _mm512_mask_sub_epi8(xk, neg[k], zero, xk);
            isum = _mm512_dpbusd_epi32(isum, mag[k], xk);
        }
        isum
    }

    /// `d * da / 8 * (2 ls_g + 1)` in both lanes of qword g, for the block whose groups are
    /// `qv` and whose `d * da / 8` is `f`. 2ls + 1: bit 59 is the top sign-index bit, which
    /// or-ing 1 overwrites.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn group_scale(qv: __m512i, one: __m512i, f: f32) -> __m512 {
        let s = _mm512_srli_epi64::<59>(qv);
        let s = _mm512_ternarylogic_epi32::<0xfe>(s, _mm512_slli_epi64::<32>(s), one);
        _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(f))
    }

    /// What the rows of two blocks need, per block: `codes` and `signs` as `block_rows` takes
    /// them, and 2ls+1 as i32 in both dwords of qword g.
    struct Pair {
        codes: [__m512i; 2],
        signs: [__m512i; 2],
        scales: [__m512i; 2],
    }

    /// Reads two blocks and does their table lookups together. The 32-bit words of both are
    /// regrouped with `shufps` so that one 128-bit lane holds, for groups 2l and 2l+1, block
    /// 0's words then block 1's; `unpacklo/hi` of the lookup results then give each block's
    /// vectors with group g in qword g again.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    fn prepare_pair(r: &Regs, b: &[u8; 2 * BLOCK_BYTES]) -> Pair {
        let (qa, qb) = (ld512(&b[2..]), ld512(&b[BLOCK_BYTES + 2..]));
        let (fa, fb) = (_mm512_castsi512_ps(qa), _mm512_castsi512_ps(qb));
        // Lane l: aux0 (resp. aux1) of groups 2l, 2l+1 of block 0, then of block 1.
        let v = _mm512_castps_si512(_mm512_shuffle_ps::<0b10_00_10_00>(fa, fb));
        let sv = _mm512_castps_si512(_mm512_shuffle_ps::<0b11_01_11_01>(fa, fb));
        let high = _mm512_movepi8_mask(v);
        let lo = lookup256(&r.code_lo, v, high);
        let hi = lookup256(&r.code_hi, v, high);
        let signs = _mm512_permutex2var_epi8(
            r.ks_lo,
            _mm512_multishift_epi64_epi8(r.ctrl_sign2, sv),
            r.ks_hi,
        );
        // 2ls + 1: bit 27 is the top sign-index bit, which or-ing 1 overwrites.
        let sc = _mm512_or_si512(_mm512_srli_epi32::<27>(sv), r.one);
        Pair {
            codes: [_mm512_unpacklo_epi32(lo, hi), _mm512_unpackhi_epi32(lo, hi)],
            signs: [
                _mm512_unpacklo_epi32(signs, signs),
                _mm512_unpackhi_epi32(signs, signs),
            ],
            scales: [_mm512_unpacklo_epi32(sc, sc), _mm512_unpackhi_epi32(sc, sc)],
        }
    }

    /// AVX-512 (VBMI, BITALG, VNNI): two blocks per iteration, without gathers or table loads:
    /// every table lives in registers and is read with byte permutes.
    ///
    /// A block's 64 bytes of groups are one vector, group g in qword g (aux0 low, aux1 high),
    /// and each activation vector k is row k of the eight groups (`Q8KRows`), group g in qword
    /// g too, so nothing crosses qwords after the table lookups:
    /// - Codes: the grid-index words of two blocks share one vector (`prepare_pair`); two
    ///   256-entry byte lookups (`vpermt2b` x2 + blend each) give the 2-bit codes of elements
    ///   0..4 and 4..8 of every row of both blocks. Per block, one vector `codes` holds qword
    ///   g's low codes in bytes 0..4 and high codes in bytes 4..8.
    /// - Per row k: `multishift` moves element j's code to the bottom of byte j, `vpermb` maps
    ///   it to 8/25/43.
    /// - Signs: `multishift` cuts the 7-bit sign indices of both blocks into bytes, one
    ///   `vpermi2b` looks them up in `KSIGNS_IQ2XS`; per row, `vpshufbitqmb` turns the row's
    ///   sign byte into a 64-bit mask that negates activations (`|q8| <= 127`: no overflow).
    /// - `vpdpbusd` (magnitude x signed activation) sums the four rows; dwords 2g and 2g+1
    ///   belong to group g, so the f32 scale vector `d da (2ls+1) / 8` applies per qword.
    ///
    /// Measured on Zen 4 (docs/PERFORMANCE.md): the lookups were the dearest part per block,
    /// which is why two blocks share them; `vpshufbitqmb` and `vpmovb2m` occupy both the
    /// permute and the multiply pipe for a cycle each. For `N` activation rows at once (the
    /// weight side made once per block; each row's arithmetic does not depend on `N`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bitalg,avx512vnni,avx2,fma,f16c")]
    fn dot_avx512_impl<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
        let c = &CONSTS;
        let r = Regs {
            code_lo: std::array::from_fn(|i| ldc(&c.code_lo[i])),
            code_hi: std::array::from_fn(|i| ldc(&c.code_hi[i])),
            ks_lo: ldc(&c.ksigns[0]),
            ks_hi: ldc(&c.ksigns[1]),
            ctrl_sign: ldc(&c.ctrl_sign),
            ctrl_sign2: ldc(&c.ctrl_sign2),
            ctrl_code: std::array::from_fn(|k| ldc(&c.ctrl_code[k])),
            ctrl_sbit: std::array::from_fn(|k| ldc(&c.ctrl_sbit[k])),
            levels: ldc(&c.levels),
            one: _mm512_set1_epi32(1),
        };
        let pf = prefetch_distance();
        let mut acc = [_mm512_setzero_ps(); N];
        // SAFETY (for `f16_at` below): each block holds its f16 `d` in its first two bytes;
        // F16C is enabled.
        let d_of = |b: &[u8]| unsafe { f16_at(b.as_ptr()) };
        // Blocks every activation row holds.
        let na = a.iter().map(|a| a.len()).fold(usize::MAX, usize::min);
        let wp: &[[u8; 2 * BLOCK_BYTES]] = w.as_chunks::<{ 2 * BLOCK_BYTES }>().0;
        let np = wp.len().min(na / 2);
        if np > 0 {
            // Software-pipelined: the lookups of pair i + 1 are issued before the rows of pair
            // i, so their latency hides behind independent work (7.2 -> 6.8 ns per block in
            // L2 on Zen 4; out-of-order execution alone did not find it a pair ahead).
            let mut cur = prepare_pair(&r, &wp[0]);
            for i in 0..np {
                prefetch(wp[i].as_ptr(), pf, 2 * BLOCK_BYTES);
                let next = prepare_pair(&r, &wp[(i + 1).min(np - 1)]);
                for h in 0..2 {
                    let fd = d_of(&wp[i][h * BLOCK_BYTES..]);
                    let (mag, neg) = block_rows(&r, cur.codes[h], cur.signs[h]);
                    let sc = _mm512_cvtepi32_ps(cur.scales[h]);
                    for (acc, a) in acc.iter_mut().zip(&a) {
                        let q8 = &a[2 * i + h];
                        let isum = row_isum(&mag, &neg, &q8.qs);
                        let f = _mm512_mul_ps(sc, _mm512_set1_ps(q8.d * fd * 0.125));
                        *acc = _mm512_fmadd_ps(f, _mm512_cvtepi32_ps(isum), *acc);
                    }
                }
                cur = next;
            }
        }
        let nb = (w.len() / BLOCK_BYTES).min(na);
        if nb > 2 * np {
            let b = &w[(nb - 1) * BLOCK_BYTES..nb * BLOCK_BYTES];
            let qv = ld512(&b[2..]);
            let high = _mm512_movepi8_mask(qv);
            let lo = lookup256(&r.code_lo, qv, high);
            let hi = lookup256(&r.code_hi, qv, high);
            let codes = _mm512_mask_blend_epi32(0xaaaa, lo, _mm512_slli_epi64::<32>(hi));
            let sidx = _mm512_multishift_epi64_epi8(r.ctrl_sign, qv);
            let signs = _mm512_permutex2var_epi8(r.ks_lo, sidx, r.ks_hi);
            let (mag, neg) = block_rows(&r, codes, signs);
            let fd = d_of(b);
            for (acc, a) in acc.iter_mut().zip(&a) {
                let q8 = &a[nb - 1];
                let i = row_isum(&mag, &neg, &q8.qs);
                let f = group_scale(qv, r.one, q8.d * fd * 0.125);
                *acc = _mm512_fmadd_ps(f, _mm512_cvtepi32_ps(i), *acc);
            }
        }
        avx512::reduce_sums(&acc)
    }
}
