//! F32, F16 and BF16 weights: exact dequantization, dot against f32 activations.
//!
//! Owns: the three float weight types. Invariant: dequantization is exact (every f16/bf16 value
//! is an f32); dots differ between ISAs only in f32 summation order.

use super::{ActFormat, ActRow, DotFn, TypeKernels};
use crate::dtype::DType;

pub(super) const F32_KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::F32,
    act: ActFormat::F32,
    dequant: dequant_f32,
    dot_scalar: dot_f32_scalar,
    dot_avx2: simd_fn(0, false),
    dot_avx512: simd_fn(0, true),
});

pub(super) const F16_KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::F16,
    act: ActFormat::F32,
    dequant: dequant_f16,
    dot_scalar: dot_f16_scalar,
    dot_avx2: simd_fn(1, false),
    dot_avx512: simd_fn(1, true),
});

pub(super) const BF16_KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::BF16,
    act: ActFormat::F32,
    dequant: dequant_bf16,
    dot_scalar: dot_bf16_scalar,
    dot_avx2: simd_fn(2, false),
    dot_avx512: simd_fn(2, true),
});

/// The SIMD dot for type index `t` (0 = F32, 1 = F16, 2 = BF16), if this target has one.
const fn simd_fn(t: usize, avx512: bool) -> Option<DotFn> {
    #[cfg(target_arch = "x86_64")]
    {
        let f: [[DotFn; 2]; 3] = [
            [x86::dot_f32_avx2, x86::dot_f32_avx512],
            [x86::dot_f16_avx2, x86::dot_f16_avx512],
            [x86::dot_bf16_avx2, x86::dot_bf16_avx512],
        ];
        Some(f[t][avx512 as usize])
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (t, avx512);
        None
    }
}

/// Exact f16 -> f32 in integer arithmetic (branch-free in practice; the `half` crate's
/// software path without F16C is several times slower). Infinities and NaNs keep their
/// payload bits, as numpy's conversion does.
#[inline]
pub(crate) fn f16_to_f32(bits: u16) -> f32 {
    let h = bits as u32;
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7FFF;
    // Normal: move exponent and mantissa into place, rebias 15 -> 127.
    let normal = (em << 13) + ((127 - 15) << 23);
    // Zero or subnormal: m * 2^-24, exact (m < 2^10).
    let sub = (em as f32 * f32::from_bits(0x3380_0000)).to_bits();
    let special = (em << 13) | 0x7F80_0000;
    // Selects rather than branches, so loops over it vectorise.
    let out = if em < 0x0400 { sub } else { normal };
    let out = if em >= 0x7C00 { special } else { out };
    f32::from_bits(sign | out)
}

#[inline]
pub(crate) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// The little-endian f16 at byte `at` of a block, as f32.
#[inline]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_le(&b[at..])
}

/// The little-endian f16 at `b[0..2]` as f32.
#[inline]
pub(crate) fn f16_le(b: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

fn dequant_f32(b: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

fn dequant_f16(b: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
        *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

fn dequant_bf16(b: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
        *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

/// Eight independent partial sums, so the scalar path has the same summation shape as SIMD
/// (and the compiler can vectorise it). `ES` is the weight element size in bytes.
#[inline(always)]
fn dot_lanes<const ES: usize>(w: &[u8], x: &[f32], conv: impl Fn(&[u8]) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut wc = w.chunks_exact(8 * ES);
    let mut xc = x.chunks_exact(8);
    for (wb, xb) in (&mut wc).zip(&mut xc) {
        for k in 0..8 {
            acc[k] += conv(&wb[k * ES..(k + 1) * ES]) * xb[k];
        }
    }
    for (k, (wb, &xv)) in wc
        .remainder()
        .chunks_exact(ES)
        .zip(xc.remainder())
        .enumerate()
    {
        acc[k] += conv(wb) * xv;
    }
    acc.iter().sum()
}

fn dot_f32_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    dot_lanes::<4>(w, a.f32, |c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

fn dot_f16_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    dot_lanes::<2>(w, a.f32, |c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
}

fn dot_bf16_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    dot_lanes::<2>(w, a.f32, |c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::{hsum_ps256, hsum_ps512, prefetch};
    use super::{dot_bf16_scalar, dot_f16_scalar, dot_f32_scalar, ActRow, Isa};
    use std::arch::x86_64::*;

    /// Defines the safe wrapper `$name` around the `#[target_feature]` body `$imp`.
    /// `$esize` is the weight element size in bytes; the wrapper clamps `n` to what both `w`
    /// and the activations hold, so the body's reads stay in bounds for any input.
    macro_rules! wrap {
        ($name:ident, $imp:ident, $isa:expr, $esize:expr, $fallback:ident) => {
            pub(super) fn $name(w: &[u8], a: &ActRow<'_>) -> f32 {
                if !$isa.supported() {
                    return $fallback(w, a);
                }
                let n = a.f32.len().min(w.len() / $esize);
                // SAFETY: the CPU supports `$isa` (checked above) and the body reads only
                // `n` elements of `w` and `a.f32`, which both hold at least that many.
                unsafe { $imp(w.as_ptr(), a.f32.as_ptr(), n) }
            }
        };
    }

    wrap!(dot_f32_avx2, f32_avx2, Isa::Avx2, 4, dot_f32_scalar);
    wrap!(dot_f16_avx2, f16_avx2, Isa::Avx2, 2, dot_f16_scalar);
    wrap!(dot_bf16_avx2, bf16_avx2, Isa::Avx2, 2, dot_bf16_scalar);
    wrap!(dot_f32_avx512, f32_avx512, Isa::Avx512, 4, dot_f32_scalar);
    wrap!(dot_f16_avx512, f16_avx512, Isa::Avx512, 2, dot_f16_scalar);
    wrap!(
        dot_bf16_avx512,
        bf16_avx512,
        Isa::Avx512,
        2,
        dot_bf16_scalar
    );

    /// Loads 8 f32 weights from element `i` of `w` (element type `F`), as an AVX2 vector.
    trait Load8 {
        /// Bytes per element.
        const ES: usize;
        /// # Safety
        /// AVX2+F16C; `w` valid for elements `i..i + 8`.
        unsafe fn load8(w: *const u8, i: usize) -> __m256;
        /// # Safety
        /// AVX-512F; `w` valid for elements `i..i + 16`.
        unsafe fn load16(w: *const u8, i: usize) -> __m512;
        fn one(w: *const u8, i: usize) -> f32;
    }

    /// Generic body: four accumulators of one vector each, then a scalar tail.
    macro_rules! body {
        ($name:ident, $feat:literal, $vec:ty, $lanes:expr, $zero:ident, $fma:ident, $add:ident, $load:ident, $hsum:ident, $ldx:ident) => {
            /// # Safety
            /// CPU features per `target_feature`; `w` and `x` valid for `n` elements.
            #[target_feature(enable = $feat)]
            unsafe fn $name<T: Load8>(w: *const u8, x: *const f32, n: usize) -> f32 {
                const L: usize = $lanes;
                let mut acc: [$vec; 4] = [$zero(); 4];
                let mut i = 0;
                let pf = prefetch_distance();
                while i + 4 * L <= n {
                    prefetch(w.wrapping_add(i * T::ES), pf, 4 * L * T::ES);
                    for (k, a) in acc.iter_mut().enumerate() {
                        let j = i + k * L;
                        *a = $fma(T::$load(w, j), $ldx(x.add(j)), *a);
                    }
                    i += 4 * L;
                }
                while i + L <= n {
                    acc[0] = $fma(T::$load(w, i), $ldx(x.add(i)), acc[0]);
                    i += L;
                }
                let s = $add($add(acc[0], acc[1]), $add(acc[2], acc[3]));
                let mut sum = $hsum(s);
                while i < n {
                    sum += T::one(w, i) * *x.add(i);
                    i += 1;
                }
                sum
            }
        };
    }

    body!(
        body_avx2,
        "avx2,fma,f16c",
        __m256,
        8,
        _mm256_setzero_ps,
        _mm256_fmadd_ps,
        _mm256_add_ps,
        load8,
        hsum_ps256,
        _mm256_loadu_ps
    );
    body!(
        body_avx512,
        "avx512f,avx512bw,avx2,fma,f16c",
        __m512,
        16,
        _mm512_setzero_ps,
        _mm512_fmadd_ps,
        _mm512_add_ps,
        load16,
        hsum_ps512,
        _mm512_loadu_ps
    );

    struct F32W;
    struct F16W;
    struct Bf16W;

    impl Load8 for F32W {
        const ES: usize = 4;
        #[inline(always)]
        unsafe fn load8(w: *const u8, i: usize) -> __m256 {
            _mm256_loadu_ps((w as *const f32).add(i))
        }
        #[inline(always)]
        unsafe fn load16(w: *const u8, i: usize) -> __m512 {
            _mm512_loadu_ps((w as *const f32).add(i))
        }
        #[inline(always)]
        fn one(w: *const u8, i: usize) -> f32 {
            // SAFETY: the caller's contract covers element i.
            unsafe { std::ptr::read_unaligned((w as *const f32).add(i)) }
        }
    }

    impl Load8 for F16W {
        const ES: usize = 2;
        #[inline(always)]
        unsafe fn load8(w: *const u8, i: usize) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(w.add(2 * i) as *const __m128i))
        }
        #[inline(always)]
        unsafe fn load16(w: *const u8, i: usize) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(w.add(2 * i) as *const __m256i))
        }
        #[inline(always)]
        fn one(w: *const u8, i: usize) -> f32 {
            // SAFETY: the caller's contract covers element i.
            super::f16_to_f32(unsafe { std::ptr::read_unaligned((w as *const u16).add(i)) })
        }
    }

    impl Load8 for Bf16W {
        const ES: usize = 2;
        #[inline(always)]
        unsafe fn load8(w: *const u8, i: usize) -> __m256 {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(w.add(2 * i) as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
        }
        #[inline(always)]
        unsafe fn load16(w: *const u8, i: usize) -> __m512 {
            let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(w.add(2 * i) as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32(h, 16))
        }
        #[inline(always)]
        fn one(w: *const u8, i: usize) -> f32 {
            // SAFETY: the caller's contract covers element i.
            super::bf16_to_f32(unsafe { std::ptr::read_unaligned((w as *const u16).add(i)) })
        }
    }

    unsafe fn f32_avx2(w: *const u8, x: *const f32, n: usize) -> f32 {
        body_avx2::<F32W>(w, x, n)
    }
    unsafe fn f16_avx2(w: *const u8, x: *const f32, n: usize) -> f32 {
        body_avx2::<F16W>(w, x, n)
    }
    unsafe fn bf16_avx2(w: *const u8, x: *const f32, n: usize) -> f32 {
        body_avx2::<Bf16W>(w, x, n)
    }
    unsafe fn f32_avx512(w: *const u8, x: *const f32, n: usize) -> f32 {
        body_avx512::<F32W>(w, x, n)
    }
    unsafe fn f16_avx512(w: *const u8, x: *const f32, n: usize) -> f32 {
        body_avx512::<F16W>(w, x, n)
    }
    unsafe fn bf16_avx512(w: *const u8, x: *const f32, n: usize) -> f32 {
        body_avx512::<Bf16W>(w, x, n)
    }
}

#[cfg(target_arch = "x86_64")]
use super::Isa;

#[cfg(test)]
mod tests {
    /// Every f16 bit pattern converts as the `half` crate converts it (NaNs: same payload,
    /// modulo the quiet bit that `half` sets).
    #[test]
    fn f16_conversion_is_exact_for_all_values() {
        for bits in 0..=u16::MAX {
            let ours = super::f16_to_f32(bits);
            let theirs = half::f16::from_bits(bits).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{bits:#06x}");
                assert_eq!(
                    ours.to_bits() | 0x0040_0000,
                    theirs.to_bits(),
                    "{bits:#06x}"
                );
            } else {
                assert_eq!(
                    ours.to_bits(),
                    theirs.to_bits(),
                    "{bits:#06x}: {ours} vs {theirs}"
                );
            }
        }
    }
}
