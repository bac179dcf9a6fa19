//! Quantizers that write ggml blocks (used to write models: the default model, `synth`).
//! Reading never depends on these; dequantization is tested against the gguf package, and the
//! IQ2_XXS encoder's output against the gguf package's dequantizer (tests/synth_iq2_xxs.rs).

use crate::dtype::DType;

/// Encode `x` (whole blocks) as `dtype`, appending to `out`. Supports F32, F16, BF16, Q8_0,
/// Q4_0, Q4_K, IQ2_XXS, Q5_0, Q4_1, Q5_1, IQ4_NL, MXFP4.
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
        // The KV cache's row conversion (kv.rs), one writer for both.
        DType::F16 | DType::BF16 | DType::Q8_0 => {
            let ty = match dtype {
                DType::F16 => super::kv::KvType::F16,
                DType::BF16 => super::kv::KvType::BF16,
                _ => super::kv::KvType::Q8_0,
            };
            let at = out.len();
            out.resize(at + ty.row_bytes(x.len()), 0);
            super::kv::store_row(ty, x, &mut out[at..]);
        }
        DType::Q4_0 => {
            for b in x.chunks_exact(32) {
                // As ggml's reference quantizer: d = (the value of largest magnitude) / -8,
                // q = min(15, trunc(x / d + 8.5)); element i < 16 low nibble of byte i, 16 + i high.
                let max = b
                    .iter()
                    .fold(0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as u8).min(15);
                out.extend((0..16).map(|i| q(b[i]) | (q(b[i + 16]) << 4)));
            }
        }
        DType::Q4_K => {
            x.chunks_exact(256)
                .for_each(|b| quantize_q4_k_block(b, out));
        }
        DType::IQ2_XXS => {
            let t = iq2_tables();
            x.chunks_exact(256)
                .for_each(|b| quantize_iq2_xxs_block(t, b, out));
        }
        // quant-a types
        DType::Q5_0 => x.chunks_exact(32).for_each(|b| quantize_q5_0_block(b, out)),
        DType::Q4_1 => x
            .chunks_exact(32)
            .for_each(|b| quantize_min_block(b, 4, out)),
        DType::Q5_1 => x
            .chunks_exact(32)
            .for_each(|b| quantize_min_block(b, 5, out)),
        DType::IQ4_NL => x
            .chunks_exact(32)
            .for_each(|b| quantize_iq4_nl_block(b, out)),
        DType::MXFP4 => x
            .chunks_exact(32)
            .for_each(|b| quantize_mxfp4_block(b, out)),
        other => return Err(super::KernelError::Unsupported(other)),
    }
    Ok(())
}

fn put_f16(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
}

/// Codes `q` (< 32) as ggml's `qs[16]` nibbles (element i low nibble of byte i, 16 + i high)
/// and, for 5-bit types, `qh` (bit i = bit 4 of element i).
fn put_nibbles(q: &[u8; 32], qh: bool, out: &mut Vec<u8>) {
    if qh {
        let h = (0..32).fold(0u32, |h, i| h | (((q[i] >> 4) as u32 & 1) << i));
        out.extend_from_slice(&h.to_le_bytes());
    }
    out.extend((0..16).map(|i| (q[i] & 0x0F) | ((q[i + 16] & 0x0F) << 4)));
}

/// Q5_0 as gguf's reference quantizer: d = (the first value of largest magnitude) / -16,
/// q = min(31, trunc(x / d + 16.5)), in f32. (Taking the first such value, as numpy's argmax,
/// also gives gguf's sign of zero for an all-zero block.)
fn quantize_q5_0_block(b: &[f32], out: &mut Vec<u8>) {
    let max = b[1..]
        .iter()
        .fold(b[0], |m, v| if v.abs() > m.abs() { *v } else { m });
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(out, d);
    let q: [u8; 32] = std::array::from_fn(|i| ((b[i] * id + 16.5) as u8).min(31));
    put_nibbles(&q, true, out);
}

/// Q4_1 (`bits` 4) and Q5_1 (`bits` 5) as ggml's reference quantizer: m = min, d = (max - min)
/// / (2^bits - 1), q = min(2^bits - 1, trunc((x - m) / d + 0.5)), in f32.
fn quantize_min_block(b: &[f32], bits: u32, out: &mut Vec<u8>) {
    let top = ((1u32 << bits) - 1) as u8;
    let min = b.iter().fold(f32::INFINITY, |m, v| m.min(*v));
    let max = b.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
    // Zeros count as +0 whatever their sign (as in gguf's numpy: an all-zero block gets +0).
    let min = if min == 0.0 { 0.0 } else { min };
    let max = if max == 0.0 { 0.0 } else { max };
    let d = (max - min) / top as f32;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(out, d);
    put_f16(out, min);
    let q: [u8; 32] = std::array::from_fn(|i| (((b[i] - min) * id + 0.5) as u8).min(top));
    put_nibbles(&q, bits == 5, out);
}

/// IQ4_NL: a scale from the value of largest magnitude (it maps to the codebook end of its
/// sign), each element the nearest codebook entry, then d refit by least squares to those
/// codes. Simpler than ggml's scale search; the output is valid IQ4_NL for any reader.
/// MXFP4 as gguf-py's reference (`quants.MXFP4.quantize_blocks`, ggml's `quantize_row_mxfp4_ref`):
/// the E8M0 exponent `e = floor(log2(max|x|)) - 2 + 127` (0 for an all-zero block), the
/// "half" scale `d = 2^(e - 128)`, and each value the first of the 16 doubled e2m1 codes
/// `k` that minimises `|d * k - x|`; value i < 16 in the low nibble of byte i, 16 + i high.
fn quantize_mxfp4_block(b: &[f32], out: &mut Vec<u8>) {
    const K: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
    let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let e = if amax > 0.0 {
        (amax.log2().floor() - 2.0 + 127.0).clamp(0.0, 255.0) as u8
    } else {
        0
    };
    let d = f32::from_bits(if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    });
    // The first minimum of |d * K[k] - v| over all 16 codes, found among the 8 magnitudes:
    // |-d m - v| = |d m - |v||, so for v >= 0 the non-negative codes 0..8 win every tie with
    // their negatives (which come later), and for v < 0 the negative codes 9..16 win strictly
    // but zero stays code 0. Over magnitudes the error falls then rises: scan to the turn.
    let code = |v: f32| -> u8 {
        let a = v.abs();
        let mut best = 0usize;
        let mut err = a;
        for (j, &m) in K[1..8].iter().enumerate() {
            let e = (d * m as f32 - a).abs();
            if e < err {
                (best, err) = (j + 1, e);
            } else {
                break;
            }
        }
        if v < 0.0 && best > 0 {
            best as u8 + 8
        } else {
            best as u8
        }
    };
    out.push(e);
    out.extend((0..16).map(|i| code(b[i]) | (code(b[i + 16]) << 4)));
}

fn quantize_iq4_nl_block(b: &[f32], out: &mut Vec<u8>) {
    use super::iq4_nl::KVALUES;
    let max = b
        .iter()
        .fold(0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
    let d0 = if max < 0.0 {
        max / KVALUES[0] as f32
    } else {
        max / KVALUES[15] as f32
    };
    let nearest = |v: f32| -> u8 {
        let mut best = 0usize;
        for (k, &c) in KVALUES.iter().enumerate() {
            if (v - c as f32).abs() < (v - KVALUES[best] as f32).abs() {
                best = k;
            }
        }
        best as u8
    };
    let id = if d0 != 0.0 { 1.0 / d0 } else { 0.0 };
    let q: [u8; 32] = std::array::from_fn(|i| nearest(b[i] * id));
    let (sxk, skk) = q.iter().zip(b).fold((0f32, 0f32), |(a, c), (&q, &x)| {
        let k = KVALUES[q as usize] as f32;
        (a + x * k, c + k * k)
    });
    let d = if skk > 0.0 && sxk != 0.0 {
        sxk / skk
    } else {
        d0
    };
    put_f16(out, d);
    put_nibbles(&q, false, out);
}

/// The IQ2_XXS grid as floats, each row's squared norm, and the row (if any) of each point of
/// {8, 25, 43}^8 (base-3 code, element c the c-th digit; -1 = not on the grid).
struct Iq2Tables {
    /// Transposed: `grid[c][e]` is element c of row e.
    grid: [[f32; 256]; 8],
    norm2: [f32; 256],
    row_of: Vec<i16>,
}

fn iq2_tables() -> &'static Iq2Tables {
    static T: std::sync::OnceLock<Iq2Tables> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let mut t = Iq2Tables {
            grid: [[0.0; 256]; 8],
            norm2: [0.0; 256],
            row_of: vec![-1; 6561],
        };
        for (e, row) in super::tables::IQ2XXS_GRID.iter().enumerate() {
            let mut code = 0usize;
            for (c, b) in row.to_le_bytes().iter().enumerate() {
                t.grid[c][e] = *b as f32;
                let level = match b {
                    8 => 0,
                    25 => 1,
                    _ => 2,
                };
                code += level * 3usize.pow(c as u32);
            }
            t.norm2[e] = (0..8).map(|c| t.grid[c][e] * t.grid[c][e]).sum();
            t.row_of[code] = e as i16;
        }
        t
    })
}

/// Eight values with their signs fixed: the sign byte (even parity) and the magnitudes the
/// grid must match (negative where parity forced a sign against the data), with each grid
/// row's dot product against them.
struct Oct {
    signs: u8,
    a: [f32; 8],
    dot: [f32; 256],
}

impl Oct {
    fn new(t: &Iq2Tables, x: &[f32]) -> Oct {
        let mut signs = 0u8;
        let mut a = [0f32; 8];
        for (c, v) in x.iter().enumerate() {
            if *v < 0.0 {
                signs |= 1 << c;
            }
            a[c] = v.abs();
        }
        if signs.count_ones() % 2 == 1 {
            // IQ2_XXS stores 7 sign bits; the 8th is implied by even parity. Flip the value
            // that costs least to get wrong.
            let c = (0..8).fold(0, |m, c| if a[c] < a[m] { c } else { m });
            signs ^= 1 << c;
            a[c] = -a[c];
        }
        let mut dot = [0f32; 256];
        for (ac, gc) in a.iter().zip(&t.grid) {
            for (d, g) in dot.iter_mut().zip(gc) {
                *d += g * ac;
            }
        }
        Oct { signs, a, dot }
    }

    /// The grid row that best fits at `scale`, and its error less the constant sum of a^2:
    /// |a - s g|^2 - |a|^2 = s^2 |g|^2 - 2 s <a, g>.
    fn best(&self, t: &Iq2Tables, scale: f32) -> (usize, f32) {
        let (s2, two_s) = (scale * scale, 2.0 * scale);
        // The error is a sum over elements, so the point with each element at its nearest
        // level is the best of all of {8, 25, 43}^8; when the grid has it, it is the answer.
        let mut code = 0usize;
        let mut pow = 1usize;
        for a in self.a {
            let q = a / scale;
            code += pow * (q > 16.5) as usize + pow * (q > 34.0) as usize;
            pow *= 3;
        }
        if let Some(&e) = t.row_of.get(code).filter(|e| **e >= 0) {
            let e = e as usize;
            return (e, s2 * t.norm2[e] - two_s * self.dot[e]);
        }
        // Otherwise every row (written to vectorise: all errors, their minimum, its first row).
        let mut err = [0f32; 256];
        for ((r, n), d) in err.iter_mut().zip(&t.norm2).zip(&self.dot) {
            *r = s2 * n - two_s * d;
        }
        let min = err
            .iter()
            .fold(f32::INFINITY, |m, v| if *v < m { *v } else { m });
        (err.iter().position(|v| *v == min).unwrap_or(0), min)
    }
}

/// One IQ2_XXS super-block (256 values; layout in `kernels/iq2_xxs.rs`): value =
/// d * (0.5 + ls) / 4 * grid * sign. An exhaustive search: per 32 values, the scale that fits
/// best over six candidates (each with the best grid row per 8), refined by least squares; d
/// maps the largest of those scales to ls = 15; each group then takes the ls among its nearest
/// three (and the grid rows) with the least squared error at the f16-rounded d. About 3.5 M
/// values/s per core (the grid rows' errors dominate); the synth writer spreads it over cores.
fn quantize_iq2_xxs_block(t: &Iq2Tables, x: &[f32], out: &mut Vec<u8>) {
    let octs: Vec<Oct> = x.chunks_exact(8).map(|o| Oct::new(t, o)).collect();
    // Per group: the best continuous scale.
    let mut group_scale = [0f32; 8];
    for (g, gs) in group_scale.iter_mut().enumerate() {
        let amax = x[32 * g..32 * g + 32]
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 {
            continue;
        }
        let mut best = (f32::INFINITY, 0f32);
        for k in 0..6 {
            // Largest magnitude mapped to grid levels from 50 down to 6 (so a flat group can
            // sit on the smallest level, 8).
            let s = amax / (50.0 * (6.0f32 / 50.0).powf(k as f32 / 5.0));
            let err: f32 = octs[4 * g..4 * g + 4].iter().map(|o| o.best(t, s).1).sum();
            if err < best.0 {
                best = (err, s);
            }
        }
        // Least-squares scale for the rows chosen at the best candidate.
        let (mut num, mut den) = (0f32, 0f32);
        for o in &octs[4 * g..4 * g + 4] {
            let (e, _) = o.best(t, best.1);
            num += o.dot[e];
            den += t.norm2[e];
        }
        *gs = if num > 0.0 && den > 0.0 {
            num / den
        } else {
            best.1
        };
    }
    let smax = group_scale.iter().fold(0f32, |m, v| m.max(*v));
    let d = half::f16::from_f32((smax / 3.875).min(half::f16::MAX.to_f32()));
    let df = d.to_f32();
    out.extend_from_slice(&d.to_bits().to_le_bytes());
    for (g, gs) in group_scale.iter().enumerate() {
        let mut aux0 = 0u32;
        let mut aux1 = 0u32;
        if df > 0.0 {
            let ideal = (4.0 * gs / df - 0.5).round().clamp(0.0, 15.0) as u32;
            let mut best = (f32::INFINITY, 0u32, [0usize; 4]);
            for ls in ideal.saturating_sub(1)..=(ideal + 1).min(15) {
                let s = df * (0.5 + ls as f32) * 0.25;
                let mut rows = [0usize; 4];
                let mut err = 0f32;
                for (k, o) in octs[4 * g..4 * g + 4].iter().enumerate() {
                    let (e, r) = o.best(t, s);
                    rows[k] = e;
                    err += r;
                }
                if err < best.0 {
                    best = (err, ls, rows);
                }
            }
            for (k, e) in best.2.iter().enumerate() {
                aux0 |= (*e as u32) << (8 * k);
                aux1 |= ((octs[4 * g + k].signs & 0x7f) as u32) << (7 * k);
            }
            aux1 |= best.1 << 28;
        }
        out.extend_from_slice(&aux0.to_le_bytes());
        out.extend_from_slice(&aux1.to_le_bytes());
    }
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
