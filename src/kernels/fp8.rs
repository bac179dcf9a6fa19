//! FP8 E4M3 weights with 2-D block scales (DeepSeek's `weight_scale_inv`), dequantization only.

use super::KernelError;

/// Dequantize a `rows` x `cols` FP8 E4M3 matrix whose scales are given per
/// `block` x `block` tile (`scales` is ceil(rows/block) x ceil(cols/block), f32).
pub fn dequantize_fp8_block_scaled(
    _bytes: &[u8],
    _scales: &[f32],
    _rows: usize,
    _cols: usize,
    _block: usize,
    _out: &mut [f32],
) -> Result<(), KernelError> {
    Err(KernelError::Unsupported(crate::dtype::DType::F8E4M3))
}
