//! F32, F16 and BF16 weights: exact dequantization, dot against f32 activations.

use super::{ActFormat, ActRow, TypeKernels};
use crate::dtype::DType;

pub(super) const F32_KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::F32,
    act: ActFormat::F32,
    dequant: dequant_f32,
    dot_scalar: dot_f32_scalar,
    dot_avx2: None,
    dot_avx512: None,
});

pub(super) const F16_KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::F16,
    act: ActFormat::F32,
    dequant: dequant_f16,
    dot_scalar: dot_f16_scalar,
    dot_avx2: None,
    dot_avx512: None,
});

pub(super) const BF16_KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::BF16,
    act: ActFormat::F32,
    dequant: dequant_bf16,
    dot_scalar: dot_bf16_scalar,
    dot_avx2: None,
    dot_avx512: None,
});

#[inline]
pub(crate) fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

#[inline]
pub(crate) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
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

/// Eight independent partial sums, so the scalar path has the same summation shape as SIMD.
fn dot_lanes(n: usize, w: impl Fn(usize) -> f32, x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for i in 0..n {
        acc[i % 8] += w(i) * x[i];
    }
    acc.iter().sum()
}

fn dot_f32_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    dot_lanes(a.f32.len(), |i| f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]), a.f32)
}

fn dot_f16_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    dot_lanes(a.f32.len(), |i| f16_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])), a.f32)
}

fn dot_bf16_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    dot_lanes(a.f32.len(), |i| bf16_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])), a.f32)
}
