//! Q3_K kernels: dequantize and dot against `Q8K` activations (scalar, AVX2, AVX-512).
//!
//! Block (110 bytes, 256 elements, ggml `block_q3_K`): `hmask[32]` (high bits), `qs[64]` (low
//! 2 bits), `scales[12]` (sixteen 6-bit scales, offset by 32), `d` (f16).
//! Element `e = 128h + 32j + l`: low bits `(qs[32h + l] >> 2j) & 3`, high bit
//! `(hmask[l] >> (4h + j)) & 1`; `q = low - 4` when the high bit is clear, `low` when set
//! (q in -4..=3). Value: `(d * (scale - 32)) * q` (gguf's numpy order).
//!
//! Dot: with `u = q + 4 = low | high << 2` (0..=7, unsigned, so it fits `maddubs`),
//! `sum_g s_g <q, a>_g = sum_g s_g <u, a>_g - 4 sum_g s_g bsum_g`, all integer.

use super::{ActFormat, ActRow, TypeKernels};
use crate::dtype::DType;

const BLOCK_BYTES: usize = 110;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::Q3_K,
    act: ActFormat::Q8K,
    dequant,
    dot_scalar,
    dot_avx2: simd::AVX2,
    dot_avx512: simd::AVX512,
});

#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The sixteen signed scales (already minus 32) of a block's packed `scales[12]`.
///
/// Scale i: low 4 bits from byte i (i < 8, low nibble) or byte i-8 (high nibble); high 2
/// bits from byte `8 + i % 4` at bit `2 * (i / 4)`.
#[inline]
fn unpack_scales(s: &[u8]) -> [i8; 16] {
    let word = |i: usize| u32::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
    let (lo0, lo1, hi) = (word(0), word(4), word(8));
    const LO: u32 = 0x0f0f_0f0f;
    const HI: u32 = 0x0303_0303;
    let parts = [
        (lo0 & LO) | ((hi & HI) << 4),
        (lo1 & LO) | (((hi >> 2) & HI) << 4),
        ((lo0 >> 4) & LO) | (((hi >> 4) & HI) << 4),
        ((lo1 >> 4) & LO) | (((hi >> 6) & HI) << 4),
    ];
    let mut out = [0i8; 16];
    for (o, p) in out.chunks_exact_mut(4).zip(parts) {
        for (k, v) in o.iter_mut().enumerate() {
            *v = ((p >> (8 * k)) & 0xff) as i8 - 32;
        }
    }
    out
}

fn dequant(blocks: &[u8], out: &mut [f32]) {
    for (b, y) in blocks.chunks_exact(BLOCK_BYTES).zip(out.chunks_exact_mut(256)) {
        let (hmask, qs) = (&b[0..32], &b[32..96]);
        let sc = unpack_scales(&b[96..108]);
        let d = f16_at(b, 108);
        for (e, v) in y.iter_mut().enumerate() {
            let (h, j, l) = (e / 128, (e / 32) % 4, e % 32);
            let low = ((qs[32 * h + l] >> (2 * j)) & 3) as i8;
            let high = (hmask[l] >> (4 * h + j)) & 1;
            let q = if high == 0 { low - 4 } else { low };
            *v = (d * sc[e / 16] as f32) * q as f32;
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a.q8k) {
        let (hmask, qs) = (&b[0..32], &b[32..96]);
        let sc = unpack_scales(&b[96..108]);
        let mut isum = 0i32;
        for (g, &s) in sc.iter().enumerate() {
            let (h, j, l0) = (g / 8, (g / 2) % 4, 16 * (g % 2));
            let mut gi = 0i32;
            for l in l0..l0 + 16 {
                let low = ((qs[32 * h + l] >> (2 * j)) & 3) as i32;
                let high = ((hmask[l] >> (4 * h + j)) & 1) as i32;
                gi += (low | (high << 2)) * q8.qs[16 * g + l - l0] as i32;
            }
            isum += s as i32 * (gi - 4 * q8.bsums[g] as i32);
        }
        sum += q8.d * (f16_at(b, 108) * isum as f32);
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
    use super::super::DotFn;
    pub(super) const AVX2: Option<DotFn> = None;
    pub(super) const AVX512: Option<DotFn> = None;
}
