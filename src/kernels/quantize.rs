//! Quantizers that write ggml blocks (used to write models: the default model, `synth`).
//! Reading never depends on these; dequantization is tested against the gguf package.

use crate::dtype::DType;

/// Encode `x` (whole blocks) as `dtype`, appending to `out`. Supports F32, F16, BF16, Q8_0.
pub fn quantize(dtype: DType, x: &[f32], out: &mut Vec<u8>) -> Result<(), super::KernelError> {
    match dtype {
        DType::F32 => x.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::F16 => x.iter().for_each(|v| out.extend_from_slice(&half::f16::from_f32(*v).to_bits().to_le_bytes())),
        DType::BF16 => x.iter().for_each(|v| out.extend_from_slice(&half::bf16::from_f32(*v).to_bits().to_le_bytes())),
        DType::Q8_0 => {
            if !x.len().is_multiple_of(32) {
                return Err(super::KernelError::NotWholeBlocks { dtype, elems: x.len(), block: 32 });
            }
            for b in x.chunks_exact(32) {
                // As ggml's reference quantizer: d = max|x|/127, q = round(x/d), d stored as f16.
                let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
                out.extend(b.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        other => return Err(super::KernelError::Unsupported(other)),
    }
    Ok(())
}
