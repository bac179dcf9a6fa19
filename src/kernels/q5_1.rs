//! Q5_1: blocks of 32 elements, 24 bytes: `d` (f16), `m` (f16), `qh` (u32, bit i = bit 4 of
//! element i), `qs[16]` (element i < 16: low nibble of qs[i], element 16 + i: high nibble);
//! value = d * (nibble | qh_bit << 4) + m.
//!
//! Dots against `Q8_32` activations through the shared loops of `blocks32.rs`.

use super::blocks32::{self, Block32};
use super::{ActFormat, Dot4Kernels, TypeKernels};
use crate::dtype::DType;

pub(super) struct Q5_1;

impl Block32 for Q5_1 {
    const BB: usize = 24;
    const OFF: u8 = 0;
    const SIGNED_AVX2: bool = false;
    const HAS_MIN: bool = true;

    fn codes(b: &[u8]) -> [i8; 32] {
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        std::array::from_fn(|i| {
            let nib = if i < 16 {
                b[8 + i] & 0x0F
            } else {
                b[8 + i - 16] >> 4
            };
            (nib | ((((qh >> i) & 1) as u8) << 4)) as i8
        })
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn codes_avx2(b: *const u8) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        let qh = std::ptr::read_unaligned(b.add(4) as *const u32);
        let hi = _mm256_and_si256(blocks32::bits_to_bytes(qh), _mm256_set1_epi8(0x10));
        _mm256_or_si256(blocks32::nibbles(b.add(8)), hi)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    unsafe fn ucodes_avx512(b: *const u8) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        let qh = std::ptr::read_unaligned(b.add(4) as *const u32);
        let q = blocks32::nibbles(b.add(8));
        _mm256_mask_add_epi8(q, qh, q, _mm256_set1_epi8(0x10))
    }
}

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::Q5_1,
    act: ActFormat::Q8_32,
    dequant: blocks32::dequant::<Q5_1>,
    dot_scalar: blocks32::dot_scalar::<Q5_1>,
    #[cfg(target_arch = "x86_64")]
    dot_avx2: Some(blocks32::x86::dot_avx2::<Q5_1>),
    #[cfg(target_arch = "x86_64")]
    dot_avx512: Some(blocks32::x86::dot_avx512::<Q5_1>),
    #[cfg(not(target_arch = "x86_64"))]
    dot_avx2: None,
    #[cfg(not(target_arch = "x86_64"))]
    dot_avx512: None,
});

/// Four-row dots (prefill), each row with the single-row dot's bits.
pub(super) const DOT4: Dot4Kernels = Dot4Kernels {
    #[cfg(target_arch = "x86_64")]
    avx2: Some(blocks32::x86::dot4_avx2::<Q5_1>),
    #[cfg(target_arch = "x86_64")]
    avx512: Some(blocks32::x86::dot4_avx512::<Q5_1>),
    #[cfg(not(target_arch = "x86_64"))]
    avx2: None,
    #[cfg(not(target_arch = "x86_64"))]
    avx512: None,
};
