//! Quantizers that write ggml blocks (used to write models: the default model, `synth`).
//! Reading never depends on these; dequantization is tested against the gguf package.

use crate::dtype::DType;

/// Encode `x` (whole blocks) as `dtype`, appending to `out`. Supports F32, F16, BF16, Q8_0, Q4_K.
pub fn quantize(dtype: DType, x: &[f32], out: &mut Vec<u8>) -> Result<(), super::KernelError> {
    let block = dtype
        .block_elems()
        .ok_or(super::KernelError::Unsupported(dtype))?;
    if !x.len().is_multiple_of(block) {
        return Err(super::KernelError::NotWholeBlocks {
            dtype,
            elems: x.len(),
            block,
        });
    }
    match dtype {
        DType::F32 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::F16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&half::f16::from_f32(*v).to_bits().to_le_bytes())),
        DType::BF16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&half::bf16::from_f32(*v).to_bits().to_le_bytes())),
        DType::Q8_0 => {
            for b in x.chunks_exact(32) {
                // As ggml's reference quantizer: d = max|x|/127, q = round(x/d), d stored as f16.
                let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
                out.extend(b.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        DType::Q4_K => {
            x.chunks_exact(256)
                .for_each(|b| quantize_q4_k_block(b, out));
        }
        other => return Err(super::KernelError::Unsupported(other)),
    }
    Ok(())
}

/// One Q4_K super-block (256 values): 8 sub-blocks of 32 with 6-bit scales and mins under two
/// f16 super-scales; y = d*sc*q - dmin*m. A plain min/max fit (not llama.cpp's iterative
/// search): good enough for synthetic weights, which is all it writes.
fn quantize_q4_k_block(x: &[f32], out: &mut Vec<u8>) {
    let mut scale = [0f32; 8];
    let mut minv = [0f32; 8];
    for (j, sb) in x.chunks_exact(32).enumerate() {
        let lo = sb.iter().fold(f32::INFINITY, |m, v| m.min(*v)).min(0.0);
        let hi = sb.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
        scale[j] = (hi - lo) / 15.0;
        minv[j] = -lo;
    }
    let max_scale = scale.iter().fold(0f32, |m, v| m.max(*v));
    let max_min = minv.iter().fold(0f32, |m, v| m.max(*v));
    let d = half::f16::from_f32(max_scale / 63.0);
    let dmin = half::f16::from_f32(max_min / 63.0);
    let (df, dminf) = (d.to_f32(), dmin.to_f32());
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..8 {
        sc[j] = if df > 0.0 {
            (scale[j] / df).round().clamp(0.0, 63.0) as u8
        } else {
            0
        };
        mn[j] = if dminf > 0.0 {
            (minv[j] / dminf).round().clamp(0.0, 63.0) as u8
        } else {
            0
        };
    }
    out.extend_from_slice(&d.to_bits().to_le_bytes());
    out.extend_from_slice(&dmin.to_bits().to_le_bytes());
    // Scales and mins, packed as ggml's get_scale_min_k4 reads them.
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
    }
    out.extend_from_slice(&q);
    let code = |j: usize, v: f32| -> u8 {
        let s = df * sc[j] as f32;
        if s > 0.0 {
            ((v + dminf * mn[j] as f32) / s).round().clamp(0.0, 15.0) as u8
        } else {
            0
        }
    };
    for pair in 0..4 {
        for l in 0..32 {
            let (a, b) = (2 * pair, 2 * pair + 1);
            out.push(code(a, x[a * 32 + l]) | (code(b, x[b * 32 + l]) << 4));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Round trip through the gguf-verified dequantizer: each value within its sub-block's
    /// quantization step (plus the scales' own rounding).
    #[test]
    fn q4_k_round_trip() {
        let mut s = 12345u64;
        let x: Vec<f32> = (0..1024)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
            })
            .collect();
        let mut enc = Vec::new();
        quantize(DType::Q4_K, &x, &mut enc).unwrap();
        assert_eq!(enc.len(), 4 * 144);
        let mut y = vec![0f32; x.len()];
        crate::kernels::dequantize(DType::Q4_K, &enc, &mut y).unwrap();
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
        let err = (x
            .iter()
            .zip(&y)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f32>()
            / x.len() as f32)
            .sqrt();
        assert!(err < 0.1 * rms, "rms error {err} vs rms {rms}");
        let worst = x
            .iter()
            .zip(&y)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst < 0.2 / 15.0 * 1.5, "worst {worst}");
    }
}
