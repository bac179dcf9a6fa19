//! Q4_0: blocks of 32 elements, 18 bytes: `d` (f16), `qs[16]`; element i < 16 is the low nibble
//! of qs[i], element 16 + i the high nibble; value = (nibble - 8) * d.
//!
//! Dots against `Q8_32` activations through the shared loops of `blocks32.rs` (codes
//! `nibble - 8`, so the SIMD loops multiply the nibbles themselves, `OFF = 8`, and subtract
//! `8 * sum(q)` once per 8 blocks). Session 28: this replaced Q4_0's own loops, whose AVX-512
//! form (two blocks per 512-bit register, scales gathered 16 at a time) ran at 68% of the read
//! sweep on Zen 4 against 77% for its AVX2 form (docs/PERFORMANCE.md).

use super::blocks32::{self, Block32};
use super::{ActFormat, Dot4Kernels, TypeKernels};
use crate::dtype::DType;

pub(super) struct Q4_0;

impl Block32 for Q4_0 {
    const BB: usize = 18;
    const OFF: u8 = 8;
    const SIGNED_AVX2: bool = false;
    const HAS_MIN: bool = false;

    fn codes(b: &[u8]) -> [i8; 32] {
        std::array::from_fn(|i| {
            (if i < 16 {
                b[2 + i] & 0x0F
            } else {
                b[2 + i - 16] >> 4
            }) as i8
                - 8
        })
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn codes_avx2(b: *const u8) -> std::arch::x86_64::__m256i {
        blocks32::nibbles(b.add(2))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    unsafe fn ucodes_avx512(b: *const u8) -> std::arch::x86_64::__m256i {
        blocks32::nibbles(b.add(2))
    }
}

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::Q4_0,
    act: ActFormat::Q8_32,
    dequant: blocks32::dequant::<Q4_0>,
    dot_scalar: blocks32::dot_scalar::<Q4_0>,
    #[cfg(target_arch = "x86_64")]
    dot_avx2: Some(blocks32::x86::dot_avx2::<Q4_0>),
    #[cfg(target_arch = "x86_64")]
    dot_avx512: Some(blocks32::x86::dot_avx512::<Q4_0>),
    #[cfg(not(target_arch = "x86_64"))]
    dot_avx2: None,
    #[cfg(not(target_arch = "x86_64"))]
    dot_avx512: None,
});

/// Four-row dots (prefill), each row with the single-row dot's bits.
pub(super) const DOT4: Dot4Kernels = Dot4Kernels {
    #[cfg(target_arch = "x86_64")]
    avx2: Some(blocks32::x86::dot4_avx2::<Q4_0>),
    #[cfg(target_arch = "x86_64")]
    avx512: Some(blocks32::x86::dot4_avx512::<Q4_0>),
    #[cfg(not(target_arch = "x86_64"))]
    avx2: None,
    #[cfg(not(target_arch = "x86_64"))]
    avx512: None,
};
