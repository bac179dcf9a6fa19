//! Q2_K kernels: dequantize and dot against `Q8K` activations (scalar, AVX2, AVX-512).
//!
//! Block (84 bytes, 256 elements, ggml `block_q2_K`): `scales[16]` (low nibble: scale, high
//! nibble: min, one pair per 16 elements), `qs[64]` (2-bit quants), `d` and `dmin` (f16).
//! Element `e = 128h + 32j + l` (h < 2, j < 4, l < 32) is `(qs[32h + l] >> 2j) & 3`; its group
//! is `e / 16`. Value: `d * scale * q - dmin * min`, in that float order (gguf's numpy).
//!
//! Dot: per super-block, `da * (d * sum_g scale_g * <q, a>_g - dmin * sum_g min_g * bsum_g)`
//! with exact integer inner products; the activation group sums make the minimums one madd.
//! Does not own activation quantization (act.rs) or dispatch (mod.rs).

use super::{ActFormat, ActRow, TypeKernels};
use crate::dtype::DType;

const BLOCK_BYTES: usize = 84;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::Q2_K,
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

fn dequant(blocks: &[u8], out: &mut [f32]) {
    for (b, y) in blocks.chunks_exact(BLOCK_BYTES).zip(out.chunks_exact_mut(256)) {
        let (scales, qs) = (&b[0..16], &b[16..80]);
        let d = f16_at(b, 80);
        let dmin = f16_at(b, 82);
        for (e, v) in y.iter_mut().enumerate() {
            let (h, j, l) = (e / 128, (e / 32) % 4, e % 32);
            let q = ((qs[32 * h + l] >> (2 * j)) & 3) as f32;
            let s = scales[e / 16];
            let dl = d * (s & 0xF) as f32;
            let ml = dmin * (s >> 4) as f32;
            *v = dl * q - ml;
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, q8) in w.chunks_exact(BLOCK_BYTES).zip(a.q8k) {
        let (scales, qs) = (&b[0..16], &b[16..80]);
        let mut summ = 0i32;
        for (s, bs) in scales.iter().zip(q8.bsums) {
            summ += (s >> 4) as i32 * bs as i32;
        }
        let mut isum = 0i32;
        for (g, s) in scales.iter().enumerate() {
            // Group g covers elements 16g..16g+16: h = g/8, j = (g/2)%4, l = 16*(g%2)..+16.
            let (h, j, l0) = (g / 8, (g / 2) % 4, 16 * (g % 2));
            let mut gi = 0i32;
            for l in l0..l0 + 16 {
                let q = ((qs[32 * h + l] >> (2 * j)) & 3) as i32;
                gi += q * q8.qs[16 * g + l - l0] as i32;
            }
            isum += (s & 0xF) as i32 * gi;
        }
        sum += q8.d * (f16_at(b, 80) * isum as f32 - f16_at(b, 82) * summ as f32);
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
