//! AVX2 building blocks shared by the grid i-quant kernels (IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
//! IQ1_S, IQ1_M): grid rows gathered into a vector, sign bits turned into ±1 bytes, per-16
//! scale vectors. Owns no type's layout; each kernel file says which pieces it uses.
//!
//! Invariant: every function here is `#[target_feature(enable = "avx2")]` (or inlined into such
//! a kernel) and safe to call from kernels compiled with AVX2; callers check the CPU first.

use std::arch::x86_64::*;

/// Grid rows `r0..r3` of an 8-byte-per-row table as one vector (row k in qword k).
#[inline(always)]
pub(super) fn rows8(t: &[u64], r: [usize; 4]) -> __m256i {
    // SAFETY: AVX is implied by the callers' `avx2` target feature (this is inlined into them).
    unsafe {
        _mm256_set_epi64x(
            t[r[3]] as i64,
            t[r[2]] as i64,
            t[r[1]] as i64,
            t[r[0]] as i64,
        )
    }
}

/// Grid rows of a 4-byte-per-row table as one vector (row k in dword k).
#[inline(always)]
pub(super) fn rows4(t: &[u32], r: [usize; 8]) -> __m256i {
    // SAFETY: as `rows8`.
    unsafe {
        _mm256_set_epi32(
            t[r[7]] as i32,
            t[r[6]] as i32,
            t[r[5]] as i32,
            t[r[4]] as i32,
            t[r[3]] as i32,
            t[r[2]] as i32,
            t[r[1]] as i32,
            t[r[0]] as i32,
        )
    }
}

/// The 32 sign bits `bits` (bit j: element j negative) as bytes +1 / -1.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn signs_pm1(bits: u32) -> __m256i {
    // Byte j <- byte j / 8 of `bits`, then test bit j % 8.
    let spread = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0,
    );
    let bit = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
    let v = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), spread);
    let neg = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    _mm256_or_si256(neg, _mm256_set1_epi8(1))
}

/// Sixteen per-16-element scales (bytes, in element order) held in `s`; returns, for 32-element
/// group `g`, scale `2g` in the eight i16 of the low lane and `2g + 1` in the high lane (the
/// layout `_mm256_maddubs_epi16` leaves its sums in).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn scale_pair(s: __m256i, g: usize) -> __m256i {
    // Byte pairs (2g, 0x80) in the low lane and (2g + 1, 0x80) in the high lane: i16 = scale.
    let lo = (2 * g as i16) | (0x80u8 as i8 as i16) << 8;
    let hi = lo + 1;
    let ctrl = _mm256_set_epi16(
        hi, hi, hi, hi, hi, hi, hi, hi, lo, lo, lo, lo, lo, lo, lo, lo,
    );
    _mm256_shuffle_epi8(s, ctrl)
}

/// `<w, x>` per pair of bytes for signed weights `w` (|w| <= 127) and signed activations `x`
/// (|x| <= 127): `maddubs(|w|, sign(x, w))`, 16 i16 sums of two products each.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn mul_signed(w: __m256i, x: __m256i) -> __m256i {
    _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
}

/// The number of whole `bb`-byte blocks of `w` that every activation row of `a` also holds.
#[inline]
pub(super) fn common_blocks<const N: usize>(
    w: &[u8],
    bb: usize,
    a: &[&[super::BlockQ8K]; N],
) -> usize {
    a.iter().map(|a| a.len()).fold(w.len() / bb, usize::min)
}

/// The horizontal sum of each accumulator (the last step of every kernel here).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn hsums<const N: usize>(acc: &[__m256; N]) -> [f32; N] {
    let mut out = [0.0f32; N];
    for (o, &v) in out.iter_mut().zip(acc) {
        *o = super::simd::x86::hsum256(v);
    }
    out
}

/// AVX-512 (VBMI, BITALG, VNNI) building blocks of the grid i-quant kernels that keep their grid
/// in registers: grids as 2- or 3-bit codes per element in tables that byte and word permutes
/// read, code-to-magnitude permutes, sign masks. Every kernel here runs on `Q8KRows` activations
/// (vector k = 8-element row k of each 32-element group, group g in qword g), so a block's
/// per-group scales apply per qword after the rows are summed.
///
/// Invariant: callers check AVX-512 F/BW/VBMI/BITALG/VNNI first (`has_vbmi`).
pub(super) mod avx512 {
    use crate::kernels::Isa;
    use std::arch::x86_64::*;

    /// AVX-512 as `Isa::Avx512` guarantees, plus VBMI and BITALG (Ice Lake, Zen 4 and later).
    pub(in crate::kernels) fn has_vbmi() -> bool {
        Isa::Avx512.supported()
            && is_x86_feature_detected!("avx512vbmi")
            && is_x86_feature_detected!("avx512bitalg")
    }

    /// 64 bytes, aligned for vector loads.
    #[repr(C, align(64))]
    pub(in crate::kernels) struct V64(pub [u8; 64]);

    /// Loads a constant vector.
    #[inline(always)]
    pub(in crate::kernels) fn ldc(v: &V64) -> __m512i {
        // SAFETY: `V64` is 64 readable bytes; AVX-512F is enabled in every caller.
        unsafe { _mm512_loadu_si512(v.0.as_ptr() as *const __m512i) }
    }

    /// Loads `N` constant vectors.
    #[inline(always)]
    pub(in crate::kernels) fn ldcs<const N: usize>(v: &[V64; N]) -> [__m512i; N] {
        std::array::from_fn(|i| ldc(&v[i]))
    }

    /// Index of `v` in `levels` (compile-time: panics if a grid holds another value).
    pub(in crate::kernels) const fn code_of(levels: &[u8], v: u8) -> u8 {
        let mut c = 0;
        while c < levels.len() {
            if levels[c] == v {
                return c as u8;
            }
            c += 1;
        }
        panic!("grid byte outside its levels");
    }

    /// The magnitudes of the 8-byte grids (IQ2_XS, IQ2_S), codes 0, 1, 2.
    pub(in crate::kernels) const LEVELS2: [u8; 3] = [0x08, 0x19, 0x2b];

    /// An 8-byte-per-row grid as u16 codes (element c in bits 2c..2c+2) split into byte tables,
    /// 64 rows per vector: low bytes (elements 0..4) and high bytes (elements 4..8).
    pub(in crate::kernels) const fn codes16_bytes<const V: usize>(
        grid: &[u64],
    ) -> ([V64; V], [V64; V]) {
        assert!(grid.len() == 64 * V);
        let mut lo = [const { V64([0; 64]) }; V];
        let mut hi = [const { V64([0; 64]) }; V];
        let mut i = 0;
        while i < grid.len() {
            let row = grid[i].to_le_bytes();
            let mut c = 0u16;
            let mut e = 0;
            while e < 8 {
                c |= (code_of(&LEVELS2, row[e]) as u16) << (2 * e);
                e += 1;
            }
            lo[i / 64].0[i % 64] = c as u8;
            hi[i / 64].0[i % 64] = (c >> 8) as u8;
            i += 1;
        }
        (lo, hi)
    }

    /// For `vpermt2b` over two 32-word blocks: byte i <- byte `2i + odd` of the first (i < 32)
    /// or of the second (i >= 32): the low (`odd` 0) or high bytes of both blocks' words.
    pub(in crate::kernels) const fn ctrl_bytes_of_words(odd: usize) -> V64 {
        let mut t = V64([0; 64]);
        let mut i = 0;
        while i < 64 {
            t.0[i] = (2 * (i % 32) + odd + 64 * (i / 32)) as u8;
            i += 1;
        }
        t
    }

    /// For `vpermt2b(lo, ctrl, hi)`: word r <- (`lo` byte 32h + r, `hi` byte 32h + r), block h's
    /// u16 codes again from the byte lookups of a pair of blocks.
    pub(in crate::kernels) const fn ctrl_words_of_bytes(h: usize) -> V64 {
        let mut t = V64([0; 64]);
        let mut i = 0;
        while i < 64 {
            t.0[i] = (32 * h + i / 2 + 64 * (i % 2)) as u8;
            i += 1;
        }
        t
    }

    /// A 4-byte-per-row grid as two byte tables of 3-bit codes (`lo`: elements 0, 1 in bits
    /// 0..3 and 3..6; `hi`: elements 2, 3), `V` vectors of 64 rows each.
    pub(in crate::kernels) const fn codes3x2<const V: usize>(
        grid: &[u32],
        levels: &[u8; 8],
    ) -> ([V64; V], [V64; V]) {
        assert!(grid.len() == 64 * V);
        let mut lo = [const { V64([0; 64]) }; V];
        let mut hi = [const { V64([0; 64]) }; V];
        let mut i = 0;
        while i < grid.len() {
            let r = grid[i].to_le_bytes();
            lo[i / 64].0[i % 64] = code_of(levels, r[0]) | code_of(levels, r[1]) << 3;
            hi[i / 64].0[i % 64] = code_of(levels, r[2]) | code_of(levels, r[3]) << 3;
            i += 1;
        }
        (lo, hi)
    }

    /// Byte i = `levels[i % levels.len()]`: `vpermb` maps a code in the low bits of a byte to its
    /// magnitude whatever the bits above it hold (`levels.len()` is 4 or 8).
    pub(in crate::kernels) const fn level_table(levels: &[u8]) -> V64 {
        let mut t = V64([0; 64]);
        let n = if levels.len() <= 4 { 4 } else { 8 };
        let mut i = 0;
        while i < 64 {
            t.0[i] = if i % n < levels.len() {
                levels[i % n]
            } else {
                0
            };
            i += 1;
        }
        t
    }

    /// Row k: byte j of every qword <- bit 8k + j (element j's sign in a qword of sign bytes
    /// whose byte k belongs to row k), for `vpshufbitqmb`.
    pub(in crate::kernels) const fn sign_bits() -> [V64; 4] {
        let mut t = [const { V64([0; 64]) }; 4];
        let mut k = 0;
        while k < 4 {
            let mut i = 0;
            while i < 64 {
                t[k].0[i] = (8 * k + i % 8) as u8;
                i += 1;
            }
            k += 1;
        }
        t
    }

    /// A table of bytes as vectors of 64.
    pub(in crate::kernels) const fn bytes_table<const V: usize>(b: &[u8]) -> [V64; V] {
        assert!(b.len() == 64 * V);
        let mut t = [const { V64([0; 64]) }; V];
        let mut i = 0;
        while i < b.len() {
            t[i / 64].0[i % 64] = b[i];
            i += 1;
        }
        t
    }

    /// Every qword: byte j <- `f(j)` (a `multishift` control).
    pub(in crate::kernels) const fn per_qword(f: [u8; 8]) -> V64 {
        let mut t = V64([0; 64]);
        let mut i = 0;
        while i < 64 {
            t.0[i] = f[i % 8];
            i += 1;
        }
        t
    }

    /// Byte i <- `t[idx_i]` for a table of `64 V` bytes in `V` vectors (`V` 2, 4 or 8): index
    /// bits 0..7 from `idx`, bit 8 from `bit8` (bit i: row i's).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub(in crate::kernels) fn lookup_b<const V: usize>(
        t: &[__m512i; V],
        idx: __m512i,
        bit8: __mmask64,
    ) -> __m512i {
        let mut r = [_mm512_setzero_si512(); 4];
        for p in 0..V / 2 {
            r[p] = _mm512_permutex2var_epi8(t[2 * p], idx, t[2 * p + 1]);
        }
        if V == 2 {
            return r[0];
        }
        let m7 = _mm512_movepi8_mask(idx);
        let lo = _mm512_mask_blend_epi8(m7, r[0], r[1]);
        if V == 4 {
            return lo;
        }
        let hi = _mm512_mask_blend_epi8(m7, r[2], r[3]);
        _mm512_mask_blend_epi8(bit8, lo, hi)
    }

    /// Byte i <- `t[idx_i]` for a 1024-byte table in 16 vectors: index bits 0..7 from `idx`,
    /// bits 8 and 9 from the masks (bit i: row i's): eight `vpermi2b` and seven blends.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub(in crate::kernels) fn lookup_b1024(
        t: &[__m512i; 16],
        idx: __m512i,
        bit8: __mmask64,
        bit9: __mmask64,
    ) -> __m512i {
        let r: [__m512i; 8] =
            std::array::from_fn(|p| _mm512_permutex2var_epi8(t[2 * p], idx, t[2 * p + 1]));
        let m7 = _mm512_movepi8_mask(idx);
        let s: [__m512i; 4] =
            std::array::from_fn(|p| _mm512_mask_blend_epi8(m7, r[2 * p], r[2 * p + 1]));
        let lo = _mm512_mask_blend_epi8(bit8, s[0], s[1]);
        let hi = _mm512_mask_blend_epi8(bit8, s[2], s[3]);
        _mm512_mask_blend_epi8(bit9, lo, hi)
    }

    /// `d da s (2ls + 1)` scaled integer sums of one block, added into `acc`: `isum` holds the
    /// block's integer sums (dwords 2g, 2g+1 for group g), `sc` the per-group factors 2ls+1 as
    /// i32 in both dwords of qword g, `f` the block's f32 factor.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in crate::kernels) fn add_block(acc: __m512, isum: __m512i, sc: __m512i, f: f32) -> __m512 {
        let s = _mm512_mullo_epi32(isum, sc);
        _mm512_fmadd_ps(_mm512_set1_ps(f), _mm512_cvtepi32_ps(s), acc)
    }

    /// The horizontal sum of each accumulator (`_mm512_reduce_add_ps`, the single-row
    /// kernels' last step, so a four-row kernel's row r has the single-row bits).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in crate::kernels) fn reduce_sums<const N: usize>(acc: &[__m512; N]) -> [f32; N] {
        let mut out = [0.0f32; N];
        for (o, &v) in out.iter_mut().zip(acc) {
            *o = _mm512_reduce_add_ps(v);
        }
        out
    }

    /// `x` with the bytes selected by `neg` negated (`|x| <= 127`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(in crate::kernels) fn negate(x: __m512i, neg: __mmask64) -> __m512i {
        _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x)
    }

    /// One block's integer sums against one activation row `x`: four 64-byte groups of
    /// magnitudes `mag` (u8) by `x` with the bytes in `neg` negated, `vpdpbusd` into one
    /// accumulator (IQ3_XXS, IQ3_S).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(in crate::kernels) fn row_isum(
        mag: &[__m512i; 4],
        neg: &[__mmask64; 4],
        x: &[i8; 256],
    ) -> __m512i {
        let mut isum = _mm512_setzero_si512();
        for k in 0..4 {
            let x = negate(super::super::simd::x86::ld512(&x[64 * k..]), neg[k]);
            isum = _mm512_dpbusd_epi32(isum, mag[k], x);
        }
        isum
    }

    /// One block added into each row's accumulator for the half-group-scaled types (IQ2_XS,
    /// IQ2_S): per row, the integer sums of groups 0-1 and 2-3 (`vpdpbusd` of the magnitudes
    /// by the sign-applied activations) times the scales `s0` / `s1` (`nibble_scales`), then
    /// `acc += (d_a * fd / 8) * isum`. Each row's operations do not depend on `N`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
    pub(in crate::kernels) fn add_half_scaled<const N: usize>(
        acc: &mut [__m512; N],
        mag: &[__m512i; 4],
        neg: &[__mmask64; 4],
        (s0, s1): (__m512i, __m512i),
        fd: f32,
        q8: [&crate::kernels::BlockQ8K; N],
    ) {
        for (acc, q8) in acc.iter_mut().zip(q8) {
            let mut isum = [_mm512_setzero_si512(); 2];
            for k in 0..4 {
                let x = negate(super::super::simd::x86::ld512(&q8.qs[64 * k..]), neg[k]);
                isum[k / 2] = _mm512_dpbusd_epi32(isum[k / 2], mag[k], x);
            }
            let isum = _mm512_add_epi32(
                _mm512_mullo_epi32(isum[0], s0),
                _mm512_mullo_epi32(isum[1], s1),
            );
            let f = q8.d * fd * 0.125;
            *acc = _mm512_fmadd_ps(_mm512_set1_ps(f), _mm512_cvtepi32_ps(isum), *acc);
        }
    }

    /// The low and high nibble of the 8 bytes at `b[..8]`, as i32 `2s + 1` in both dwords of
    /// qword g (byte g's nibbles): the half-group scales of IQ2_XS and IQ2_S.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in crate::kernels) fn nibble_scales(b: &[u8]) -> (__m512i, __m512i) {
        let v = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        let q = _mm512_cvtepu8_epi64(_mm_cvtsi64_si128(v as i64));
        let m = _mm512_set1_epi64(0xf);
        let one = _mm512_set1_epi64(1);
        let lo = _mm512_and_si512(q, m);
        let hi = _mm512_srli_epi64::<4>(q);
        let both = |s: __m512i| {
            let s = _mm512_or_si512(_mm512_add_epi64(s, s), one);
            _mm512_or_si512(s, _mm512_slli_epi64::<32>(s))
        };
        (both(lo), both(hi))
    }
}
