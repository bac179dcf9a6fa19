//! IQ1_S and IQ1_M kernels: dequantize and dot against `Q8K` activations (scalar, AVX2,
//! AVX-512). Both
//! read `IQ1S_GRID` (2048 rows of 8 values -1/0/+1) and shift every value by ±1/8 ("delta").
//!
//! IQ1_S block (50 bytes, ggml `block_iq1_s`): `d` (f16), `qs[32]` (low 8 bits of each 8-element
//! row's grid index), `qh[8]` (u16 per 32-element group g: bits 3k..3k+3 are bits 8..11 of
//! row 4g+k's index, bits 12..15 the scale s, bit 15 the delta sign).
//! Value: `(d * (2s + 1)) * (grid + delta)`, delta = -1/8 if bit 15 else +1/8.
//!
//! IQ1_M block (56 bytes, ggml `block_iq1_m`): `qs[32]` (as IQ1_S), `qh[16]` (one nibble per row,
//! low nibble first: bits 0..3 are bits 8..11 of the index, bit 3 the row's delta sign), then
//! four u16 words: bits 3m..3m+3 of word w hold the scale of 16-element half-group 4w + m, and
//! the top nibbles of words 0..3 (lowest first) form the f16 `d`.
//! Value: `(d * (2s + 1)) * (grid + delta)`, the scale per 16 elements, the delta per row.
//!
//! Every step is exact in f32. Dot: `(2s + 1) * (grid ± 1/8) = (2s + 1) (8 grid ± 1) / 8`, so a
//! block contributes `d * da / 8 * sum (2s + 1) * <8 grid ± 1, a>`, an exact integer sum.
//! The AVX-512 kernels (F/BW/VNNI) are the AVX2 ones at 512 bits: the 2048-row grid is too large
//! for the register-held code tables of the other grid types, so rows still come from the table.

use super::float::{f16_at, f16_to_f32};
use super::iq_grids::IQ1S_GRID;
use super::{ActFormat, ActRow, Dot4Kernels, TypeKernels};
use crate::dtype::DType;

const S_BYTES: usize = 50;
const M_BYTES: usize = 56;

pub(super) const KERNELS_S: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::IQ1_S,
    act: ActFormat::Q8K,
    dequant: dequant_s,
    dot_scalar: dot_scalar_s,
    dot_avx2: simd::AVX2_S,
    dot_avx512: simd::AVX512_S,
});

pub(super) const KERNELS_M: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::IQ1_M,
    act: ActFormat::Q8K,
    dequant: dequant_m,
    dot_scalar: dot_scalar_m,
    dot_avx2: simd::AVX2_M,
    dot_avx512: simd::AVX512_M,
});

/// Four-row dots (prefill), each row with the same ISA's single-row dot's bits.
pub(super) const DOT4_S: Dot4Kernels = Dot4Kernels {
    avx2: simd::DOT4_S,
    avx512: simd::DOT4_AVX512_S,
};

pub(super) const DOT4_M: Dot4Kernels = Dot4Kernels {
    avx2: simd::DOT4_M,
    avx512: simd::DOT4_AVX512_M,
};

/// The `qh` word of IQ1_S group `g` (< 8).
#[inline]
fn s_qh(b: &[u8], g: usize) -> u32 {
    u16::from_le_bytes([b[34 + 2 * g], b[35 + 2 * g]]) as u32
}

/// Grid row `i` (< 32) of an IQ1_S block as 8 signed values.
#[inline]
fn s_grid(b: &[u8], i: usize) -> [u8; 8] {
    let hi = (s_qh(b, i / 4) >> (3 * (i % 4))) & 7;
    IQ1S_GRID[b[2 + i] as usize | (hi as usize) << 8].to_le_bytes()
}

fn dequant_s(blocks: &[u8], out: &mut [f32]) {
    for (b, y) in blocks.chunks_exact(S_BYTES).zip(out.chunks_exact_mut(256)) {
        let d = f16_at(b, 0);
        for (i, y8) in y.chunks_exact_mut(8).enumerate() {
            let qh = s_qh(b, i / 4);
            let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
            let delta = if qh & 0x8000 == 0 { 0.125f32 } else { -0.125 };
            for (v, &g) in y8.iter_mut().zip(&s_grid(b, i)) {
                *v = dl * (g as i8 as f32 + delta);
            }
        }
    }
}

fn dot_scalar_s(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, q8) in w.chunks_exact(S_BYTES).zip(a.q8k) {
        let mut isum = 0i32;
        for g in 0..8 {
            let qh = s_qh(b, g);
            let delta = if qh & 0x8000 == 0 { 1 } else { -1 };
            let mut gi = 0i32;
            for k in 0..4 {
                let i = 4 * g + k;
                for (&gv, &x) in s_grid(b, i).iter().zip(&q8.qs[8 * i..8 * i + 8]) {
                    gi += (8 * gv as i8 as i32 + delta) * x as i32;
                }
            }
            isum += (2 * ((qh >> 12) & 7) as i32 + 1) * gi;
        }
        sum += q8.d * f16_at(b, 0) * 0.125 * isum as f32;
    }
    sum
}

/// The four scale words of an IQ1_M block.
#[inline]
fn m_words(b: &[u8]) -> [u16; 4] {
    std::array::from_fn(|w| u16::from_le_bytes([b[48 + 2 * w], b[49 + 2 * w]]))
}

/// IQ1_M's f16 `d`, from the top nibbles of the scale words.
#[inline]
fn m_d(sc: &[u16; 4]) -> f32 {
    f16_to_f32((sc[0] >> 12) | ((sc[1] >> 8) & 0xf0) | ((sc[2] >> 4) & 0xf00) | (sc[3] & 0xf000))
}

/// Scale (3 bits) of IQ1_M half-group `m` (< 16).
#[inline]
fn m_scale(sc: &[u16; 4], m: usize) -> u32 {
    ((sc[m / 4] >> (3 * (m % 4))) & 7) as u32
}

/// Grid row `i` (< 32) of an IQ1_M block as 8 signed values, and its delta sign (+1/-1).
#[inline]
fn m_row(b: &[u8], i: usize) -> ([u8; 8], i32) {
    let nib = (b[32 + i / 2] >> (4 * (i % 2))) & 0xf;
    let grid = IQ1S_GRID[b[i] as usize | ((nib & 7) as usize) << 8].to_le_bytes();
    (grid, if nib & 8 == 0 { 1 } else { -1 })
}

fn dequant_m(blocks: &[u8], out: &mut [f32]) {
    for (b, y) in blocks.chunks_exact(M_BYTES).zip(out.chunks_exact_mut(256)) {
        let sc = m_words(b);
        let d = m_d(&sc);
        for (i, y8) in y.chunks_exact_mut(8).enumerate() {
            let dl = d * (2 * m_scale(&sc, i / 2) + 1) as f32;
            let (grid, ds) = m_row(b, i);
            let delta = if ds > 0 { 0.125f32 } else { -0.125 };
            for (v, &g) in y8.iter_mut().zip(&grid) {
                *v = dl * (g as i8 as f32 + delta);
            }
        }
    }
}

fn dot_scalar_m(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, q8) in w.chunks_exact(M_BYTES).zip(a.q8k) {
        let sc = m_words(b);
        let mut isum = 0i32;
        for h in 0..16 {
            let mut hi = 0i32;
            for i in 2 * h..2 * h + 2 {
                let (grid, ds) = m_row(b, i);
                for (&gv, &x) in grid.iter().zip(&q8.qs[8 * i..8 * i + 8]) {
                    hi += (8 * gv as i8 as i32 + ds) * x as i32;
                }
            }
            isum += (2 * m_scale(&sc, h) as i32 + 1) * hi;
        }
        sum += q8.d * m_d(&sc) * 0.125 * isum as f32;
    }
    sum
}

#[cfg(not(target_arch = "x86_64"))]
mod simd {
    pub(super) const AVX2_S: Option<super::super::DotFn> = None;
    pub(super) const AVX2_M: Option<super::super::DotFn> = None;
    pub(super) const DOT4_S: Option<super::super::Dot4Fn> = None;
    pub(super) const DOT4_M: Option<super::super::Dot4Fn> = None;
    pub(super) const AVX512_S: Option<super::super::DotFn> = None;
    pub(super) const AVX512_M: Option<super::super::DotFn> = None;
    pub(super) const DOT4_AVX512_S: Option<super::super::Dot4Fn> = None;
    pub(super) const DOT4_AVX512_M: Option<super::super::Dot4Fn> = None;
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::super::iq_grids::IQ1S_GRID;
    use super::super::iq_x86::avx512;
    use super::super::iq_x86::{common_blocks, hsums, mul_signed, rows8, scale_pair};
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{f16_at, hsum256, ld128, ld256, ld512, prefetch};
    use super::super::{ActRow, BlockQ8K, Dot4Fn, DotFn};
    use super::{m_d, m_scale, m_words, s_qh, M_BYTES, S_BYTES};
    use crate::kernels::Isa;
    use std::arch::x86_64::*;

    pub(super) const AVX2_S: Option<DotFn> = Some(dot_avx2_s);
    pub(super) const AVX2_M: Option<DotFn> = Some(dot_avx2_m);
    pub(super) const DOT4_S: Option<Dot4Fn> = Some(dot4_avx2_s);
    pub(super) const DOT4_M: Option<Dot4Fn> = Some(dot4_avx2_m);
    pub(super) const AVX512_S: Option<DotFn> = Some(dot_avx512_s);
    pub(super) const AVX512_M: Option<DotFn> = Some(dot_avx512_m);
    pub(super) const DOT4_AVX512_S: Option<Dot4Fn> = Some(dot4_avx512_s);
    pub(super) const DOT4_AVX512_M: Option<Dot4Fn> = Some(dot4_avx512_m);

    fn dot_avx512_s(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx512.supported() {
            return dot_avx2_s(w, a);
        }
        // SAFETY: the CPU has AVX-512 F/BW/VNNI and AVX2/FMA/F16C (checked just above).
        unsafe { dot_avx512_s_impl::<1>(w, [a.q8k])[0] }
    }

    /// Four activation rows: the grid rows, deltas and scales of each pair of groups are made
    /// once; per row the arithmetic is the single-row dot's (the same `dot_avx512_s_impl`), so
    /// each row gets its bits.
    fn dot4_avx512_s(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !Isa::Avx512.supported() {
            return dot4_avx2_s(w, a, out);
        }
        // SAFETY: the CPU has AVX-512 F/BW/VNNI and AVX2/FMA/F16C (checked just above).
        *out = unsafe { dot_avx512_s_impl::<4>(w, [a[0].q8k, a[1].q8k, a[2].q8k, a[3].q8k]) };
    }

    fn dot_avx512_m(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx512.supported() {
            return dot_avx2_m(w, a);
        }
        // SAFETY: the CPU has AVX-512 F/BW/VNNI and AVX2/FMA/F16C (checked just above).
        unsafe { dot_avx512_m_impl::<1>(w, [a.q8k])[0] }
    }

    /// Four activation rows, as `dot4_avx512_s`.
    fn dot4_avx512_m(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !Isa::Avx512.supported() {
            return dot4_avx2_m(w, a, out);
        }
        // SAFETY: the CPU has AVX-512 F/BW/VNNI and AVX2/FMA/F16C (checked just above).
        *out = unsafe { dot_avx512_m_impl::<4>(w, [a[0].q8k, a[1].q8k, a[2].q8k, a[3].q8k]) };
    }

    /// Grid rows `r[0..8]` of an 8-byte-per-row table as one vector (row k in qword k).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn rows8x8(t: &[u64], r: [usize; 8]) -> __m512i {
        _mm512_set_epi64(
            t[r[7]] as i64,
            t[r[6]] as i64,
            t[r[5]] as i64,
            t[r[4]] as i64,
            t[r[3]] as i64,
            t[r[2]] as i64,
            t[r[1]] as i64,
            t[r[0]] as i64,
        )
    }

    /// `8 grid ± 1` per byte (-9..9) for grid bytes -1/0/+1 in `grid`, minus 1 where `neg` is
    /// set and plus 1 elsewhere. Shifting 16-bit lanes carries into the next byte's low three
    /// bits, which the mask clears.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn weights(grid: __m512i, neg: __mmask64) -> __m512i {
        let w8 = _mm512_and_si512(_mm512_slli_epi16::<3>(grid), _mm512_set1_epi8(0xf8u8 as i8));
        let one = _mm512_set1_epi8(1);
        _mm512_mask_sub_epi8(_mm512_add_epi8(w8, one), neg, w8, one)
    }

    /// `isum + sum (w x) s` per dword for weights `w` (|w| <= 9, never 0) and activations `x`
    /// (|x| <= 127): `maddubs(|w|, x negated where w < 0)`, then `vpdpwssd` with the i16
    /// scales `s`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    fn add_products(
        isum: __m512i,
        aw: __m512i,
        wneg: __mmask64,
        x: __m512i,
        s: __m512i,
    ) -> __m512i {
        let x = avx512::negate(x, wneg);
        _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(aw, x), s)
    }

    /// IQ1_S at AVX-512 (F/BW/VNNI), the AVX2 kernel at 512 bits with the delta in the weights:
    /// per pair of groups (64 activations), eight grid rows from the table at the indices
    /// `s_indices` makes, made `8 grid ± 1` with each group's delta sign; `maddubs` of their
    /// magnitudes with the activations negated where they are negative, `vpdpwssd` with the
    /// groups' 2s+1 (low half, high half). For `N` activation rows at once.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    fn dot_avx512_s_impl<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
        let mut acc = [_mm512_setzero_ps(); N];
        let pf = prefetch_distance();
        let nb = common_blocks(w, S_BYTES, &a);
        for (i, b) in w.chunks_exact(S_BYTES).take(nb).enumerate() {
            prefetch(b.as_ptr(), pf, S_BYTES);
            let idx = s_indices(b);
            let mut isum = [_mm512_setzero_si512(); N];
            for v in 0..4 {
                let grid = rows8x8(&IQ1S_GRID, std::array::from_fn(|k| idx[8 * v + k] as usize));
                let (q0, q1) = (s_qh(b, 2 * v), s_qh(b, 2 * v + 1));
                // Delta -1/8 where bit 15 is set: the group's 32 bytes of the mask.
                let dneg = ((q0 >> 15) as u64).wrapping_neg() & 0xffff_ffff
                    | ((q1 >> 15) as u64).wrapping_neg() << 32;
                let wv = weights(grid, dneg);
                let (aw, wneg) = (_mm512_abs_epi8(wv), _mm512_movepi8_mask(wv));
                let s = |q: u32| _mm256_set1_epi16((2 * ((q >> 12) & 7) + 1) as i16);
                let sv = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(s(q0)), s(q1));
                for (isum, a) in isum.iter_mut().zip(&a) {
                    let x = ld512(&a[i].qs[64 * v..64 * v + 64]);
                    *isum = add_products(*isum, aw, wneg, x, sv);
                }
            }
            // SAFETY: `b` holds the block's f16 `d` in its first two bytes; F16C is enabled.
            let fd = unsafe { f16_at(b.as_ptr()) };
            for (acc, (isum, a)) in acc.iter_mut().zip(isum.iter().zip(&a)) {
                let f = a[i].d * fd * 0.125;
                *acc = _mm512_fmadd_ps(_mm512_set1_ps(f), _mm512_cvtepi32_ps(*isum), *acc);
            }
        }
        avx512::reduce_sums(&acc)
    }

    /// IQ1_M at AVX-512 (F/BW/VNNI), as IQ1_S's: per pair of groups, eight grid rows made
    /// `8 grid ± 1` with each row's delta sign (bit 3 of its `qh` nibble, tested per qword with
    /// one `vpshufb` and `vptestmb`), the four half-groups' 2s+1 one per 128-bit lane
    /// (`vpermw`). For `N` activation rows at once.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    fn dot_avx512_m_impl<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
        let mut acc = [_mm512_setzero_ps(); N];
        let pf = prefetch_distance();
        // Qword k (row k of the pair of groups): every byte <- byte k / 2 of the groups' two
        // `qh` words, whose bit 3 (k even) or 7 (k odd) is the row's delta sign.
        let dctrl = _mm512_set_epi64(
            0x0303_0303_0303_0303,
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0x0101_0101_0101_0101,
            0,
            0,
        );
        let dbit = _mm512_set_epi64(
            0x8080_8080_8080_8080u64 as i64,
            0x0808_0808_0808_0808,
            0x8080_8080_8080_8080u64 as i64,
            0x0808_0808_0808_0808,
            0x8080_8080_8080_8080u64 as i64,
            0x0808_0808_0808_0808,
            0x8080_8080_8080_8080u64 as i64,
            0x0808_0808_0808_0808,
        );
        // Word j <- scale j / 8 (128-bit lane l: half-group 4v + l after adding 4v).
        let lane = _mm512_set_epi64(
            0x0003_0003_0003_0003,
            0x0003_0003_0003_0003,
            0x0002_0002_0002_0002,
            0x0002_0002_0002_0002,
            0x0001_0001_0001_0001,
            0x0001_0001_0001_0001,
            0,
            0,
        );
        let nb = common_blocks(w, M_BYTES, &a);
        for (i, b) in w.chunks_exact(M_BYTES).take(nb).enumerate() {
            prefetch(b.as_ptr(), pf, M_BYTES);
            let sc = m_words(b);
            let scales: [i16; 16] = std::array::from_fn(|m| (2 * m_scale(&sc, m) + 1) as i16);
            // SAFETY: `scales` is 32 bytes.
            let scales = unsafe { _mm256_loadu_si256(scales.as_ptr() as *const __m256i) };
            let scales = _mm512_castsi256_si512(scales);
            let mut isum = [_mm512_setzero_si512(); N];
            for v in 0..4 {
                let qh = u32::from_le_bytes(b[32 + 4 * v..36 + 4 * v].try_into().expect("4 bytes"));
                let rows = std::array::from_fn(|k| {
                    b[8 * v + k] as usize | ((qh >> (4 * k)) as usize & 7) << 8
                });
                let grid = rows8x8(&IQ1S_GRID, rows);
                let dq = _mm512_shuffle_epi8(_mm512_set1_epi32(qh as i32), dctrl);
                let wv = weights(grid, _mm512_test_epi8_mask(dq, dbit));
                let (aw, wneg) = (_mm512_abs_epi8(wv), _mm512_movepi8_mask(wv));
                let sel = _mm512_add_epi16(lane, _mm512_set1_epi16(4 * v as i16));
                let sv = _mm512_permutexvar_epi16(sel, scales);
                for (isum, a) in isum.iter_mut().zip(&a) {
                    let x = ld512(&a[i].qs[64 * v..64 * v + 64]);
                    *isum = add_products(*isum, aw, wneg, x, sv);
                }
            }
            let fm = m_d(&sc);
            for (acc, (isum, a)) in acc.iter_mut().zip(isum.iter().zip(&a)) {
                let f = a[i].d * fm * 0.125;
                *acc = _mm512_fmadd_ps(_mm512_set1_ps(f), _mm512_cvtepi32_ps(*isum), *acc);
            }
        }
        avx512::reduce_sums(&acc)
    }

    fn dot_avx2_s(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return super::dot_scalar_s(w, a);
        }
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        unsafe { dot_avx2_s_impl::<1>(w, [a.q8k])[0] }
    }

    /// Four activation rows: the grid rows, deltas and scales of each group are made once;
    /// per row the arithmetic is the single-row dot's, so each row gets its bits.
    fn dot4_avx2_s(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !Isa::Avx2.supported() {
            *out = std::array::from_fn(|r| super::dot_scalar_s(w, &a[r]));
            return;
        }
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        *out = unsafe { dot_avx2_s_impl::<4>(w, [a[0].q8k, a[1].q8k, a[2].q8k, a[3].q8k]) };
    }

    fn dot_avx2_m(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return super::dot_scalar_m(w, a);
        }
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        unsafe { dot_avx2_m_impl1(w, a.q8k) }
    }

    /// Four activation rows: the grid rows, deltas and scales of each group are made once;
    /// per row the arithmetic is the single-row dot's, so each row gets its bits.
    fn dot4_avx2_m(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !Isa::Avx2.supported() {
            *out = std::array::from_fn(|r| super::dot_scalar_m(w, &a[r]));
            return;
        }
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        *out = unsafe { dot_avx2_m_impl::<4>(w, [a[0].q8k, a[1].q8k, a[2].q8k, a[3].q8k]) };
    }

    /// IQ1_S's 32 grid indices of block `b` (row r in word r): the low bytes zero-extended, bits
    /// 8..11 cut from the group's `qh` word with shifts chosen per word by `vpblendw`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn s_indices(b: &[u8]) -> [u16; 32] {
        let q = _mm256_broadcastsi128_si256(ld128(&b[34..50]));
        let m = _mm256_set1_epi16(0x700);
        let mut out = [0u16; 32];
        for h in 0..2 {
            // Word r <- qh word 4h + r / 4 (bytes 2(4h + r/4), +1), in both lanes.
            let w = |r: usize| (2 * (4 * h + r / 4)) as i8;
            let ctrl = _mm256_setr_epi8(
                w(0),
                w(0) + 1,
                w(1),
                w(1) + 1,
                w(2),
                w(2) + 1,
                w(3),
                w(3) + 1,
                w(4),
                w(4) + 1,
                w(5),
                w(5) + 1,
                w(6),
                w(6) + 1,
                w(7),
                w(7) + 1,
                w(8),
                w(8) + 1,
                w(9),
                w(9) + 1,
                w(10),
                w(10) + 1,
                w(11),
                w(11) + 1,
                w(12),
                w(12) + 1,
                w(13),
                w(13) + 1,
                w(14),
                w(14) + 1,
                w(15),
                w(15) + 1,
            );
            let qw = _mm256_shuffle_epi8(q, ctrl);
            // Row 4g + k takes bits 3k..3k+3: shifted to bits 8..11.
            let t = _mm256_slli_epi16::<8>(qw);
            let t = _mm256_blend_epi16::<0b0010_0010>(t, _mm256_slli_epi16::<5>(qw));
            let t = _mm256_blend_epi16::<0b0100_0100>(t, _mm256_slli_epi16::<2>(qw));
            let t = _mm256_blend_epi16::<0b1000_1000>(t, _mm256_srli_epi16::<1>(qw));
            let lo = _mm256_cvtepu8_epi16(ld128(&b[2 + 16 * h..18 + 16 * h]));
            let idx = _mm256_or_si256(lo, _mm256_and_si256(t, m));
            // SAFETY: `out[16h..16h + 16]` is 32 writable bytes.
            unsafe { _mm256_storeu_si256(out[16 * h..].as_mut_ptr() as *mut __m256i, idx) };
        }
        out
    }

    /// IQ1_S, per 32-element group: four grid rows (-1/0/+1) from the table at indices made
    /// with vector operations (`s_indices`); `sign` applies them to the activations, `maddubs`
    /// by 8 sums pairs, `madd` with 2s+1. The deltas' part, `sum_g ±(2s_g+1) sum a_g`, is one
    /// `madd` of the activations' 16-element sums with the signed scales per block. For `N`
    /// activation rows at once.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_avx2_s_impl<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
        let mut acc = [_mm256_setzero_ps(); N];
        let pf = prefetch_distance();
        let eight = _mm256_set1_epi8(8);
        let nb = common_blocks(w, S_BYTES, &a);
        for (i, b) in w.chunks_exact(S_BYTES).take(nb).enumerate() {
            prefetch(b.as_ptr(), pf, S_BYTES);
            let idx = s_indices(b);
            // ±(2s + 1) per group, each twice (one per 16-element sum).
            let qh = ld128(&b[34..50]);
            let sc = _mm_and_si128(_mm_srli_epi16::<12>(qh), _mm_set1_epi16(7));
            let sc = _mm_or_si128(_mm_add_epi16(sc, sc), _mm_set1_epi16(1));
            let neg = _mm_srai_epi16::<15>(qh);
            let sd = _mm_sub_epi16(_mm_xor_si128(sc, neg), neg);
            let sd = _mm256_set_m128i(_mm_unpackhi_epi16(sd, sd), _mm_unpacklo_epi16(sd, sd));
            let mut isum: [__m256i; N] =
                std::array::from_fn(|r| _mm256_madd_epi16(ld256(&a[r][i].bsums), sd));
            for g in 0..8 {
                let grid = rows8(&IQ1S_GRID, std::array::from_fn(|k| idx[4 * g + k] as usize));
                let s = 2 * ((s_qh(b, g) >> 12) & 7) + 1;
                let sv = _mm256_set1_epi16(s as i16);
                for r in 0..N {
                    let x = ld256(&a[r][i].qs[32 * g..32 * g + 32]);
                    let p = _mm256_maddubs_epi16(eight, _mm256_sign_epi8(x, grid));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, sv));
                }
            }
            // SAFETY: `b` holds the block's f16 `d` in its first two bytes; F16C is enabled.
            let fd = unsafe { f16_at(b.as_ptr()) };
            for r in 0..N {
                let f = a[r][i].d * fd * 0.125;
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(isum[r]), acc[r]);
            }
        }
        hsums(&acc)
    }

    /// The IQ1_M single-row dot: `dot_avx2_m_impl::<1>` in a shape that runs 8% faster
    /// (decode); the same integer sums and f32 operations, so the same bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_avx2_m_impl1(w: &[u8], a: &[BlockQ8K]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let pf = prefetch_distance();
        let high5 = _mm256_set1_epi8(0xf8u8 as i8);
        let one = _mm256_set1_epi8(1);
        // Qword k: the delta bit of row k (bit 3 + 4k of the group's two qh bytes).
        let dbit = _mm256_set_epi64x(
            0x8000_8000_8000_8000u64 as i64,
            0x0800_0800_0800_0800,
            0x0080_0080_0080_0080,
            0x0008_0008_0008_0008,
        );
        for (b, q8) in w.chunks_exact(M_BYTES).zip(a) {
            prefetch(b.as_ptr(), pf, M_BYTES);
            let sc = m_words(b);
            let scales: [u8; 16] = std::array::from_fn(|m| (2 * m_scale(&sc, m) + 1) as u8);
            // SAFETY: `scales` is 16 bytes.
            let scales = unsafe { _mm_loadu_si128(scales.as_ptr() as *const __m128i) };
            let scales = _mm256_broadcastsi128_si256(scales);
            let mut isum = _mm256_setzero_si256();
            for (g, x) in q8.qs.chunks_exact(32).enumerate() {
                let qh = u16::from_le_bytes([b[32 + 2 * g], b[33 + 2 * g]]) as usize;
                let rows =
                    std::array::from_fn(|k| b[4 * g + k] as usize | ((qh >> (4 * k)) & 7) << 8);
                let grid = rows8(&IQ1S_GRID, rows);
                // 8 * grid per byte: shifting 16-bit lanes carries into the next byte's low
                // three bits, which the mask clears.
                let w8 = _mm256_and_si256(_mm256_slli_epi16(grid, 3), high5);
                let dq = _mm256_and_si256(_mm256_set1_epi16(qh as i16), dbit);
                let delta = _mm256_or_si256(_mm256_cmpeq_epi16(dq, dbit), one);
                // SAFETY: `x` is 32 bytes.
                let x = unsafe { _mm256_loadu_si256(x.as_ptr() as *const __m256i) };
                let p = mul_signed(_mm256_add_epi8(w8, delta), x);
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, scale_pair(scales, g)));
            }
            let f = q8.d * m_d(&sc) * 0.125;
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(isum), acc);
        }
        hsum256(acc)
    }

    /// IQ1_M, per 32-element group: four grid rows from the table, made `8 grid ± 1` with the
    /// rows' delta signs (bytes in -9..9), multiplied with `abs`/`sign`/`maddubs`; `madd` with
    /// the two half-group scales (low lane / high lane). For `N` activation rows at once.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_avx2_m_impl<const N: usize>(w: &[u8], a: [&[BlockQ8K]; N]) -> [f32; N] {
        let mut acc = [_mm256_setzero_ps(); N];
        let pf = prefetch_distance();
        let high5 = _mm256_set1_epi8(0xf8u8 as i8);
        let one = _mm256_set1_epi8(1);
        // Qword k: the delta bit of row k (bit 3 + 4k of the group's two qh bytes).
        let dbit = _mm256_set_epi64x(
            0x8000_8000_8000_8000u64 as i64,
            0x0800_0800_0800_0800,
            0x0080_0080_0080_0080,
            0x0008_0008_0008_0008,
        );
        let nb = common_blocks(w, M_BYTES, &a);
        for (i, b) in w.chunks_exact(M_BYTES).take(nb).enumerate() {
            prefetch(b.as_ptr(), pf, M_BYTES);
            let sc = m_words(b);
            let scales: [u8; 16] = std::array::from_fn(|m| (2 * m_scale(&sc, m) + 1) as u8);
            // SAFETY: `scales` is 16 bytes.
            let scales = unsafe { _mm_loadu_si128(scales.as_ptr() as *const __m128i) };
            let scales = _mm256_broadcastsi128_si256(scales);
            let q8: [&BlockQ8K; N] = std::array::from_fn(|r| &a[r][i]);
            let mut isum = [_mm256_setzero_si256(); N];
            for g in 0..8 {
                let qh = u16::from_le_bytes([b[32 + 2 * g], b[33 + 2 * g]]) as usize;
                let rows =
                    std::array::from_fn(|k| b[4 * g + k] as usize | ((qh >> (4 * k)) & 7) << 8);
                let grid = rows8(&IQ1S_GRID, rows);
                // 8 * grid per byte: shifting 16-bit lanes carries into the next byte's low
                // three bits, which the mask clears.
                let w8 = _mm256_and_si256(_mm256_slli_epi16(grid, 3), high5);
                let dq = _mm256_and_si256(_mm256_set1_epi16(qh as i16), dbit);
                let delta = _mm256_or_si256(_mm256_cmpeq_epi16(dq, dbit), one);
                let wv = _mm256_add_epi8(w8, delta);
                let s = scale_pair(scales, g);
                for (isum, q8) in isum.iter_mut().zip(&q8) {
                    let x = &q8.qs[32 * g..32 * g + 32];
                    // SAFETY: `x` is 32 bytes.
                    let x = unsafe { _mm256_loadu_si256(x.as_ptr() as *const __m256i) };
                    let p = mul_signed(wv, x);
                    *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(p, s));
                }
            }
            let fm = m_d(&sc);
            for r in 0..N {
                let f = q8[r].d * fm * 0.125;
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(isum[r]), acc[r]);
            }
        }
        hsums(&acc)
    }
}
