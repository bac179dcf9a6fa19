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
    use super::super::simd::x86::hsum256;
    use super::super::tables::{IQ2XXS_GRID, KSIGNS_IQ2XS, KSIGNS_IQ2XS_PM1};
    use super::super::{ActRow, BlockQ8K, DotFn};
    use super::BLOCK_BYTES;
    use crate::kernels::Isa;
    use std::arch::x86_64::*;

    pub(super) const AVX2: Option<DotFn> = Some(dot_avx2);
    pub(super) const AVX512: Option<DotFn> = Some(dot_avx512);

    /// Bytes ahead of the current block to prefetch into L1 (weights stream from DRAM).
    const PREFETCH: usize = 1024;

    /// AVX-512 as `Isa::Avx512` guarantees, plus VBMI (Cascade Lake lacks it).
    fn has_avx512() -> bool {
        Isa::Avx512.supported() && is_x86_feature_detected!("avx512vbmi")
    }

    fn dot_avx2(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return super::dot_scalar(w, a);
        }
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        unsafe { dot_avx2_impl(w, a.q8k) }
    }

    fn dot_avx512(w: &[u8], a: &ActRow<'_>) -> f32 {
        // The kernel needs VBMI on top of what `Isa::Avx512` guarantees (Cascade Lake lacks it).
        if !has_avx512() {
            return dot_avx2(w, a);
        }
        // SAFETY: the CPU has AVX-512 F/BW/VBMI/VNNI and AVX2/FMA/F16C (checked just above).
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
        for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a) {
            _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().wrapping_add(PREFETCH) as *const i8);
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

    /// The constant vectors of the AVX-512 kernel, built at compile time.
    struct Consts {
        ksigns: [V64; 2],
        /// Per qword: bit offsets 32 + 7k of the four sign indices (k = i % 4).
        ctrl_sign: V64,
        /// Byte 4g + k <- sign byte k of group g (qword g, byte k).
        ctrl_compact: V64,
        /// Dword k (k < 16) <- grid index k (block byte 8(k/4) + k%4), and k + 16; other bytes
        /// are zeroed by the mask.
        ctrl_index: [V64; 2],
        /// Vector z: dword i <- low dword of qword 2z + i/8 (the scale of group 2z or 2z+1).
        ctrl_scale: [V64; 4],
    }

    const fn build_consts() -> Consts {
        let mut c = Consts {
            ksigns: [const { V64([0; 64]) }; 2],
            ctrl_sign: V64([0; 64]),
            ctrl_compact: V64([0; 64]),
            ctrl_index: [const { V64([0; 64]) }; 2],
            ctrl_scale: [const { V64([0; 64]) }; 4],
        };
        let mut i = 0;
        while i < 128 {
            c.ksigns[i / 64].0[i % 64] = KSIGNS_IQ2XS[i];
            i += 1;
        }
        i = 0;
        while i < 64 {
            c.ctrl_sign.0[i] = 32 + 7 * (i % 4) as u8;
            c.ctrl_compact.0[i] = (8 * ((i / 4) % 8) + i % 4) as u8;
            let k = i / 4;
            c.ctrl_index[0].0[i] = (8 * (k / 4) + k % 4) as u8;
            c.ctrl_index[1].0[i] = (8 * (k / 4 + 4) + k % 4) as u8;
            let mut z = 0;
            while z < 4 {
                // Dword i/4 <- dword 2(2z + i/32) (low dword of qword 2z or 2z+1).
                c.ctrl_scale[z].0[i] = if i % 4 == 0 {
                    (2 * (2 * z + i / 32)) as u8
                } else {
                    0
                };
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

    /// AVX-512 (VBMI, VNNI): one block per iteration, as four 64-element vectors z (sub-blocks
    /// 8z..8z+8, groups 2z and 2z+1).
    ///
    /// The block's 64 bytes of groups are one vector, group g in qword g (aux0 low, aux1 high).
    /// - Weights: the grid rows are gathered (`vpgatherdq`, 8 rows per vector) from
    ///   `IQ2XXS_GRID` by the 32 index bytes, zero-extended to dwords by a masked byte permute.
    /// - Signs: `multishift` cuts the four 7-bit sign indices of each group, a two-register
    ///   byte permute looks them up in `KSIGNS_IQ2XS`; the 32 sign bytes, stored, are the four
    ///   64-bit masks that negate activations.
    /// - Scales: 2ls+1 is `(qword >> 59) | 1`, copied into both words of the low dword; a dword
    ///   permute spreads it over its group.
    /// - `maddubs` (magnitude x signed activation), then `vpdpwssd` by the scale words.
    /// - Block scales d_w * d_a / 8 are computed 16 blocks at a time (two gathers) and picked
    ///   per block with one permute.
    ///
    /// Measured on the development machine (Xeon, AVX-512): ~36 cycles per block with the
    /// weights in L2, of which the four gathers are ~8-11. Looking the grid up through 2-bit
    /// codes held in registers (byte permutes, no gathers) measured ~49: the two-register byte
    /// permutes it needs take two cycles each on port 5, where most of this kernel runs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vnni,avx2,fma,f16c")]
    fn dot_avx512_impl(w: &[u8], a: &[BlockQ8K]) -> f32 {
        let c = &CONSTS;
        let (ks_lo, ks_hi) = (ldc(&c.ksigns[0]), ldc(&c.ksigns[1]));
        let (ctrl_sign, ctrl_compact) = (ldc(&c.ctrl_sign), ldc(&c.ctrl_compact));
        let (ctrl_i0, ctrl_i1) = (ldc(&c.ctrl_index[0]), ldc(&c.ctrl_index[1]));
        let ctrl_scale: [__m512i; 4] = std::array::from_fn(|z| ldc(&c.ctrl_scale[z]));
        let one = _mm512_set1_epi64(1);
        let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let off_w = _mm512_mullo_epi32(lane, _mm512_set1_epi32(BLOCK_BYTES as i32));
        let off_a = _mm512_mullo_epi32(
            lane,
            _mm512_set1_epi32(std::mem::size_of::<BlockQ8K>() as i32),
        );
        /// The four 64-bit sign masks of a block, read back by `kmovq` from memory.
        #[repr(C, align(32))]
        struct Masks([u64; 4]);
        let mut masks = Masks([0; 4]);
        let mut acc = _mm512_setzero_ps();
        let nb = (w.len() / BLOCK_BYTES).min(a.len());
        for c0 in (0..nb).step_by(16) {
            let n = (nb - c0).min(16);
            let live: u16 = if n == 16 { 0xffff } else { (1u16 << n) - 1 };
            // SAFETY: lane j < n reads the first 4 bytes of weight block c0 + j (66 bytes) and
            // the `d` of activation block c0 + j; masked-off lanes read nothing.
            let (dw, da) = unsafe {
                let wp = w.as_ptr().add(c0 * BLOCK_BYTES) as *const i32;
                let ap = &a[c0].d as *const f32;
                (
                    _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), live, off_w, wp),
                    _mm512_mask_i32gather_ps::<1>(_mm512_setzero_ps(), live, off_a, ap),
                )
            };
            let dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dw));
            let scales = _mm512_mul_ps(_mm512_mul_ps(dw, da), _mm512_set1_ps(0.125));
            let mut pick = _mm512_setzero_si512();
            let wb = w[c0 * BLOCK_BYTES..(c0 + n) * BLOCK_BYTES].chunks_exact(BLOCK_BYTES);
            for (b, q8) in wb.zip(&a[c0..c0 + n]) {
                _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().wrapping_add(PREFETCH) as *const i8);
                // SAFETY: b[2..] is 64 bytes.
                let qv = unsafe { _mm512_loadu_si512(b[2..].as_ptr() as *const __m512i) };
                let sidx = _mm512_multishift_epi64_epi8(ctrl_sign, qv);
                let sb = _mm512_permutex2var_epi8(ks_lo, sidx, ks_hi);
                let sb = _mm512_permutexvar_epi8(ctrl_compact, sb);
                // SAFETY: `masks` is 32 aligned bytes.
                unsafe {
                    _mm256_store_si256(
                        masks.0.as_mut_ptr() as *mut __m256i,
                        _mm512_castsi512_si256(sb),
                    )
                };
                // 2ls + 1: bit 59 is the top sign-index bit, which or-ing 1 overwrites.
                let s = _mm512_or_si512(_mm512_srli_epi64(qv, 59), one);
                let s = _mm512_or_si512(s, _mm512_slli_epi64::<16>(s));
                let ilo = _mm512_maskz_permutexvar_epi8(0x1111_1111_1111_1111, ctrl_i0, qv);
                let ihi = _mm512_maskz_permutexvar_epi8(0x1111_1111_1111_1111, ctrl_i1, qv);
                let idx = [
                    _mm512_castsi512_si256(ilo),
                    _mm512_extracti64x4_epi64::<1>(ilo),
                    _mm512_castsi512_si256(ihi),
                    _mm512_extracti64x4_epi64::<1>(ihi),
                ];
                let mut isum = _mm512_setzero_si512();
                for z in 0..4 {
                    // SAFETY: every index is a byte (< 256 rows of IQ2XXS_GRID).
                    let g = unsafe {
                        _mm512_i32gather_epi64::<8>(idx[z], IQ2XXS_GRID.as_ptr() as *const i64)
                    };
                    let m: u64;
                    // SAFETY: reads masks.0[z] (in bounds), no other effect. Loading the mask
                    // straight from memory keeps it off port 5 (the compiler would otherwise
                    // extract it from the vector).
                    unsafe {
                        std::arch::asm!(
                            "kmovq {k}, qword ptr [{p}]",
                            k = lateout(kreg) m,
                            p = in(reg) masks.0.as_ptr().add(z),
                            options(readonly, nostack, preserves_flags)
                        );
                    }
                    // SAFETY: q8.qs has 256 bytes; 64z + 64 <= 256.
                    let x =
                        unsafe { _mm512_loadu_si512(q8.qs.as_ptr().add(64 * z) as *const __m512i) };
                    let x = _mm512_mask_sub_epi8(x, m, _mm512_setzero_si512(), x);
                    let p = _mm512_maddubs_epi16(g, x);
                    let sc = _mm512_permutexvar_epi32(ctrl_scale[z], s);
                    if z == 0 {
                        isum = _mm512_madd_epi16(p, sc);
                    } else {
                        // SAFETY: register-only AVX512-VNNI instruction (the CPU has it).
                        // Written out because the compiler splits it into madd + add.
                        unsafe {
                            std::arch::asm!(
                                "vpdpwssd {acc}, {p}, {s}",
                                acc = inout(zmm_reg) isum,
                                p = in(zmm_reg) p,
                                s = in(zmm_reg) sc,
                                options(pure, nomem, nostack, preserves_flags)
                            );
                        }
                    }
                }
                let f = _mm512_permutexvar_ps(pick, scales);
                pick = _mm512_add_epi32(pick, _mm512_set1_epi32(1));
                acc = _mm512_fmadd_ps(f, _mm512_cvtepi32_ps(isum), acc);
            }
        }
        _mm512_reduce_add_ps(acc)
    }
}
