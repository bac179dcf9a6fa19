//! IQ4_NL: blocks of 32 elements, 18 bytes: `d` (f16), `qs[16]` (element i < 16: low nibble of
//! qs[i], element 16 + i: high nibble); value = d * KVALUES[nibble], a fixed non-linear
//! 16-entry codebook (ggml's `kvalues_iq4nl`, also used by IQ4_XS).
//!
//! Dots against `Q8_32` activations through the shared loops of `blocks32.rs`.

use super::blocks32::{self, Block32};
use super::{ActFormat, Dot4Kernels, TypeKernels};
use crate::dtype::DType;

/// The IQ4_NL / IQ4_XS codebook (`gguf.quants.IQ4_NL.kvalues`).
pub(crate) const KVALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// `KVALUES` + 128 as unsigned bytes (the AVX-512 dots' `OFF = 128` form, IQ4_XS's too).
pub(super) const KVALUES_U: [u8; 16] = {
    let mut u = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        u[i] = (KVALUES[i] as i16 + 128) as u8;
        i += 1;
    }
    u
};

pub(super) struct Iq4Nl;

impl Block32 for Iq4Nl {
    const BB: usize = 18;
    const OFF: u8 = 128;
    const SIGNED_AVX2: bool = true;
    const HAS_MIN: bool = false;

    fn codes(b: &[u8]) -> [i8; 32] {
        std::array::from_fn(|i| {
            KVALUES[(if i < 16 {
                b[2 + i] & 0x0F
            } else {
                b[2 + i - 16] >> 4
            }) as usize]
        })
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn codes_avx2(b: *const u8) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        let table =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES.as_ptr() as *const __m128i));
        _mm256_shuffle_epi8(table, blocks32::nibbles(b.add(2)))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    unsafe fn ucodes_avx512(b: *const u8) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        let table =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_U.as_ptr() as *const __m128i));
        _mm256_shuffle_epi8(table, blocks32::nibbles(b.add(2)))
    }
}

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::IQ4_NL,
    act: ActFormat::Q8_32,
    dequant: blocks32::dequant::<Iq4Nl>,
    dot_scalar: blocks32::dot_scalar::<Iq4Nl>,
    #[cfg(target_arch = "x86_64")]
    dot_avx2: Some(blocks32::x86::dot_avx2::<Iq4Nl>),
    #[cfg(target_arch = "x86_64")]
    dot_avx512: Some(blocks32::x86::dot_avx512::<Iq4Nl>),
    #[cfg(not(target_arch = "x86_64"))]
    dot_avx2: None,
    #[cfg(not(target_arch = "x86_64"))]
    dot_avx512: None,
});

/// Four-row dots (prefill), each row with the single-row dot's bits.
pub(super) const DOT4: Dot4Kernels = Dot4Kernels {
    #[cfg(target_arch = "x86_64")]
    avx2: Some(blocks32::x86::dot4_avx2::<Iq4Nl>),
    #[cfg(target_arch = "x86_64")]
    avx512: Some(blocks32::x86::dot4_avx512::<Iq4Nl>),
    #[cfg(not(target_arch = "x86_64"))]
    avx2: None,
    #[cfg(not(target_arch = "x86_64"))]
    avx512: None,
};
