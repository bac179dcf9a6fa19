//! FP8 E4M3 weights with 2-D block scales (DeepSeek's `weight_scale_inv`), dequantization only.
//!
//! E4M3 ("FN" flavour, as safetensors `F8_E4M3` and PyTorch `float8_e4m3fn`): 1 sign bit, 4
//! exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m/8 * 2^-6); no infinities;
//! S.1111.111 is NaN, so the largest finite value is 448. Each value converts to f32 exactly;
//! the scale product is one f32 multiply, so results are bit-identical to numpy's
//! `w.astype(float32) * scale`.

use super::KernelError;
use crate::dtype::DType;

/// E4M3FN byte -> f32, exact.
const fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0f32 };
    let e = (b >> 3) & 0x0F;
    let m = (b & 0x07) as u32;
    if e == 0x0F && m == 0x07 {
        return f32::NAN;
    }
    if e == 0 {
        // m * 2^-9, exact in f32.
        return sign * (m as f32) * (1.0 / 512.0);
    }
    let bits = ((b as u32 & 0x80) << 24) | ((e as u32 + 127 - 7) << 23) | (m << 20);
    f32::from_bits(bits)
}

const fn build_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e4m3_to_f32(i as u8);
        i += 1;
    }
    t
}

/// Every E4M3FN value as f32.
pub(crate) static E4M3_TABLE: [f32; 256] = build_table();

/// Dequantize a `rows` x `cols` FP8 E4M3 matrix whose scales are given per
/// `block` x `block` tile (`scales` is ceil(rows/block) x ceil(cols/block), f32).
pub fn dequantize_fp8_block_scaled(
    bytes: &[u8],
    scales: &[f32],
    rows: usize,
    cols: usize,
    block: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    if block == 0 {
        return Err(KernelError::Shape("FP8 block size 0".to_string()));
    }
    let n = rows
        .checked_mul(cols)
        .ok_or_else(|| KernelError::Shape(format!("FP8 {rows}x{cols} overflows")))?;
    if bytes.len() != n {
        return Err(KernelError::BadLength {
            what: "fp8 weights",
            dtype: DType::F8E4M3,
            elems: n,
            expected: n,
            got: bytes.len(),
        });
    }
    if out.len() != n {
        return Err(KernelError::Shape(format!(
            "FP8 output holds {} floats, need {n}",
            out.len()
        )));
    }
    let sc = cols.div_ceil(block);
    let want = rows.div_ceil(block) * sc;
    if scales.len() != want {
        return Err(KernelError::Shape(format!(
            "FP8 {rows}x{cols} in {block}x{block} tiles needs {want} scales, got {}",
            scales.len()
        )));
    }
    if n == 0 {
        return Ok(());
    }
    for (r, (w, o)) in bytes
        .chunks_exact(cols)
        .zip(out.chunks_exact_mut(cols))
        .enumerate()
    {
        let srow = &scales[(r / block) * sc..(r / block + 1) * sc];
        for ((wc, oc), &s) in w.chunks(block).zip(o.chunks_mut(block)).zip(srow) {
            for (x, y) in wc.iter().zip(oc.iter_mut()) {
                *y = E4M3_TABLE[*x as usize] * s;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        assert_eq!(E4M3_TABLE[0x00], 0.0);
        assert!(E4M3_TABLE[0x80] == 0.0 && E4M3_TABLE[0x80].is_sign_negative());
        assert_eq!(E4M3_TABLE[0x38], 1.0); // e=7, m=0
        assert_eq!(E4M3_TABLE[0x7E], 448.0); // largest finite
        assert_eq!(E4M3_TABLE[0xFE], -448.0);
        assert_eq!(E4M3_TABLE[0x01], 2f32.powi(-9)); // smallest subnormal
        assert_eq!(E4M3_TABLE[0x08], 2f32.powi(-6)); // smallest normal
        assert!(E4M3_TABLE[0x7F].is_nan() && E4M3_TABLE[0xFF].is_nan());
    }

    #[test]
    fn tiles_and_partial_tiles() {
        // 3x5 matrix of 1.0 with 2x2 tiles: scales 2x3.
        let w = vec![0x38u8; 15];
        let s = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut o = vec![0.0; 15];
        dequantize_fp8_block_scaled(&w, &s, 3, 5, 2, &mut o).unwrap();
        assert_eq!(&o[0..5], &[1.0, 1.0, 2.0, 2.0, 3.0]);
        assert_eq!(&o[10..15], &[4.0, 4.0, 5.0, 5.0, 6.0]);
        assert!(dequantize_fp8_block_scaled(&w, &s[..5], 3, 5, 2, &mut o).is_err());
        assert!(dequantize_fp8_block_scaled(&w[..14], &s, 3, 5, 2, &mut o).is_err());
    }
}
