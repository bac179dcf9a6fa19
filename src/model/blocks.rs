//! Shared building blocks: RMSNorm, rotary embeddings, softmax, SiLU, top-k selection.
//!
//! Free functions over slices, no allocation: the forward pass calls them on buffers it owns.

use super::config::{RopeLayout, RopeScaling};

/// out = x / sqrt(mean(x^2) + eps) * w (HF RMSNorm, computed in f32 with an f64 sum).
pub fn rmsnorm(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let ss: f64 = x.iter().map(|v| (*v as f64) * (*v as f64)).sum();
    let mean = (ss / x.len() as f64) as f32;
    let inv = 1.0 / (mean + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = g * (v * inv);
    }
}

/// RMSNorm in place.
pub fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let ss: f64 = x.iter().map(|v| (*v as f64) * (*v as f64)).sum();
    let mean = (ss / x.len() as f64) as f32;
    let inv = 1.0 / (mean + eps).sqrt();
    for (v, g) in x.iter_mut().zip(w) {
        *v = g * (*v * inv);
    }
}

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b));
    let mut s = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    let inv = 1.0 / s;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// f32 dot product with 16 independent partial sums, so the compiler vectorises it. On x86 the
/// same loop is compiled for AVX-512 or AVX2 as well and picked at run time: lane i still sums
/// the products of elements 16c + i in order, each product and sum rounded on its own (no FMA),
/// so every ISA gives the same bits (attention's scores go through here).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernels::Isa;
        match Isa::detect() {
            // SAFETY: the CPU has the features (`Isa::detect` never exceeds the hardware).
            Isa::Avx512 => return unsafe { dot_avx512(a, b) },
            Isa::Avx2 => return unsafe { dot_avx2(a, b) },
            Isa::Scalar => {}
        }
    }
    dot_body(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    dot_body(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_body(a, b)
}

#[inline(always)]
fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    for v in acc {
        s += v;
    }
    s
}

/// `dot(q, k[r])` for four rows at once, each with `dot`'s bits: the four independent sums
/// hide the add latency that one 16-lane sum chain waits on (attention's scores).
#[inline]
pub fn dot4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if q.len().is_multiple_of(16) && k.iter().all(|k| k.len() == q.len()) {
        use crate::kernels::Isa;
        match Isa::detect() {
            // SAFETY: the CPU has the features (`Isa::detect` never exceeds the hardware); every
            // row has q.len() elements, a multiple of 16.
            Isa::Avx512 => return unsafe { dot4_avx512(q, k) },
            Isa::Avx2 => return unsafe { dot4_avx2(q, k) },
            Isa::Scalar => {}
        }
    }
    k.map(|k| dot(q, k))
}

/// `dot`'s ending: the (empty here) remainder's sum, then the 16 lanes in order.
#[inline(always)]
fn lanes_sum(acc: &[f32; 16]) -> f32 {
    let mut s: f32 = std::iter::empty::<f32>().sum();
    for &v in acc {
        s += v;
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot4_avx512(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 4];
    for c in (0..q.len()).step_by(16) {
        let x = _mm512_loadu_ps(q.as_ptr().add(c));
        for r in 0..4 {
            let y = _mm512_loadu_ps(k[r].as_ptr().add(c));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(x, y));
        }
    }
    let mut l = [[0.0f32; 16]; 4];
    for r in 0..4 {
        _mm512_storeu_ps(l[r].as_mut_ptr(), acc[r]);
    }
    [
        lanes_sum(&l[0]),
        lanes_sum(&l[1]),
        lanes_sum(&l[2]),
        lanes_sum(&l[3]),
    ]
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot4_avx2(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    // Lanes 0..8 and 8..16 of each row's 16 sums.
    let mut acc = [[_mm256_setzero_ps(); 2]; 4];
    for c in (0..q.len()).step_by(16) {
        let x = [
            _mm256_loadu_ps(q.as_ptr().add(c)),
            _mm256_loadu_ps(q.as_ptr().add(c + 8)),
        ];
        for r in 0..4 {
            for h in 0..2 {
                let y = _mm256_loadu_ps(k[r].as_ptr().add(c + 8 * h));
                acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(x[h], y));
            }
        }
    }
    let mut l = [[0.0f32; 16]; 4];
    for r in 0..4 {
        _mm256_storeu_ps(l[r].as_mut_ptr(), acc[r][0]);
        _mm256_storeu_ps(l[r].as_mut_ptr().add(8), acc[r][1]);
    }
    [
        lanes_sum(&l[0]),
        lanes_sum(&l[1]),
        lanes_sum(&l[2]),
        lanes_sum(&l[3]),
    ]
}

/// y += a * x (wider vectors where the CPU has them; each element's result is the same).
#[inline]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernels::Isa;
        match Isa::detect() {
            // SAFETY: as in `dot`.
            Isa::Avx512 => return unsafe { axpy_avx512(y, a, x) },
            Isa::Avx2 => return unsafe { axpy_avx2(y, a, x) },
            Isa::Scalar => {}
        }
    }
    axpy_body(y, a, x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpy_avx512(y: &mut [f32], a: f32, x: &[f32]) {
    axpy_body(y, a, x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn axpy_avx2(y: &mut [f32], a: f32, x: &[f32]) {
    axpy_body(y, a, x)
}

#[inline(always)]
fn axpy_body(y: &mut [f32], a: f32, x: &[f32]) {
    for (o, v) in y.iter_mut().zip(x) {
        *o += a * v;
    }
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Indices of the `out.len()` largest values of `x`, largest first; ties go to the lower index.
pub fn top_k(x: &[f32], out: &mut [usize]) {
    let k = out.len();
    for slot in 0..k {
        let mut best = usize::MAX;
        for (i, v) in x.iter().enumerate() {
            if out[..slot].contains(&i) {
                continue;
            }
            if best == usize::MAX || *v > x[best] {
                best = i;
            }
        }
        out[slot] = best;
    }
}

/// Precomputed rotary tables for positions `0..ctx`.
pub struct Rope {
    layout: RopeLayout,
    half: usize,
    cos: Vec<f32>, // (ctx, half)
    sin: Vec<f32>, // (ctx, half)
}

/// Rotary inverse frequencies for `dim` rotating dimensions, as transformers computes them
/// (f32 arithmetic; YaRN per `_compute_yarn_parameters`), and the cos/sin scale.
pub fn rope_inv_freq(dim: usize, theta: f64, scaling: RopeScaling) -> (Vec<f32>, f32) {
    let half = dim / 2;
    let pos_freqs: Vec<f32> = (0..half)
        .map(|i| (theta as f32).powf((2 * i) as f32 / dim as f32))
        .collect();
    match scaling {
        RopeScaling::None => (pos_freqs.iter().map(|p| 1.0 / p).collect(), 1.0),
        RopeScaling::Linear(f) => (pos_freqs.iter().map(|p| 1.0 / p / f as f32).collect(), 1.0),
        RopeScaling::Yarn {
            factor,
            orig_ctx,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate,
        } => {
            let corr = |rot: f64| {
                (dim as f64 * (orig_ctx / (rot * 2.0 * std::f64::consts::PI)).ln())
                    / (2.0 * theta.ln())
            };
            let (low, high) = (corr(beta_fast), corr(beta_slow));
            let (low, high) = if truncate {
                (low.floor(), high.ceil())
            } else {
                (low, high)
            };
            let low = low.max(0.0);
            let mut high = high.min(dim as f64 - 1.0);
            if low == high {
                high += 0.001;
            }
            let inv: Vec<f32> = pos_freqs
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let ramp = ((i as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
                    let extra = 1.0 - ramp; // extrapolation weight
                    let (fe, fi) = (1.0 / p, 1.0 / (factor as f32 * p));
                    fi * (1.0 - extra) + fe * extra
                })
                .collect();
            (inv, attention_factor as f32)
        }
    }
}

impl Rope {
    /// Tables for `dim` rotating dimensions: angle = pos * inv_freq in f32, as HF computes it.
    pub fn new(
        dim: usize,
        ctx: usize,
        theta: f64,
        scaling: RopeScaling,
        layout: RopeLayout,
    ) -> Rope {
        let half = dim / 2;
        let (inv_freq, mscale) = rope_inv_freq(dim, theta, scaling);
        let mut cos = Vec::with_capacity(ctx * half);
        let mut sin = Vec::with_capacity(ctx * half);
        for p in 0..ctx {
            for f in &inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos() * mscale);
                sin.push(a.sin() * mscale);
            }
        }
        Rope {
            layout,
            half,
            cos,
            sin,
        }
    }

    pub fn ctx(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Rotating pairs per head.
    pub fn half(&self) -> usize {
        self.half
    }

    /// cos table, (ctx, half), scale included.
    pub fn cos_table(&self) -> &[f32] {
        &self.cos
    }

    /// sin table, (ctx, half), scale included.
    pub fn sin_table(&self) -> &[f32] {
        &self.sin
    }

    /// Rotate the first `2*half` values of one head for position `pos` (the rest, if any, is
    /// the non-rotating part of a partial-rotary head).
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        self.apply_as(x, pos, self.layout);
    }

    /// `apply` in `layout` whatever the tables' own (V3.2's indexer rotates half-split with
    /// MLA's interleaved model's tables: the same angles, another pairing).
    #[inline]
    pub fn apply_as(&self, x: &mut [f32], pos: usize, layout: RopeLayout) {
        let h = self.half;
        let c = &self.cos[pos * h..(pos + 1) * h];
        let s = &self.sin[pos * h..(pos + 1) * h];
        match layout {
            RopeLayout::HalfSplit => {
                for i in 0..h {
                    let (a, b) = (x[i], x[i + h]);
                    x[i] = a * c[i] - b * s[i];
                    x[i + h] = b * c[i] + a * s[i];
                }
            }
            RopeLayout::Interleaved => {
                for i in 0..h {
                    let (a, b) = (x[2 * i], x[2 * i + 1]);
                    x[2 * i] = a * c[i] - b * s[i];
                    x[2 * i + 1] = b * c[i] + a * s[i];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn dot4_has_dot_s_bits() {
        let mut seed = 7u64;
        let mut r = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
        };
        for n in [16, 64, 100, 128, 256] {
            let q: Vec<f32> = (0..n).map(|_| r()).collect();
            let k: Vec<Vec<f32>> = (0..4).map(|_| (0..n).map(|_| r()).collect()).collect();
            let got = super::dot4(&q, [&k[0], &k[1], &k[2], &k[3]]);
            for (g, k) in got.iter().zip(&k) {
                assert_eq!(g.to_bits(), super::dot_body(&q, k).to_bits(), "n = {n}");
                assert_eq!(g.to_bits(), super::dot(&q, k).to_bits(), "n = {n}");
            }
        }
    }
    use super::*;

    #[test]
    fn top_k_orders_and_breaks_ties_low() {
        let mut out = [0usize; 3];
        top_k(&[0.1, 0.5, 0.5, 0.9, 0.0], &mut out);
        assert_eq!(out, [3, 1, 2]);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = [1.0f32, 2.0, 3.0, -1.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[2] > x[1] && x[1] > x[0]);
    }

    #[test]
    fn rope_layouts_agree_up_to_permutation() {
        // Rotating an interleaved vector equals rotating its half-split permutation.
        let d = 8;
        let a = Rope::new(d, 4, 10000.0, RopeScaling::None, RopeLayout::Interleaved);
        let b = Rope::new(d, 4, 10000.0, RopeScaling::None, RopeLayout::HalfSplit);
        let x: Vec<f32> = (0..d).map(|i| i as f32 * 0.3 - 1.0).collect();
        let mut xi = x.clone();
        let mut xh: Vec<f32> = (0..d)
            .map(|i| {
                if i < d / 2 {
                    x[2 * i]
                } else {
                    x[2 * (i - d / 2) + 1]
                }
            })
            .collect();
        a.apply(&mut xi, 3);
        b.apply(&mut xh, 3);
        for i in 0..d / 2 {
            assert!((xi[2 * i] - xh[i]).abs() < 1e-6);
            assert!((xi[2 * i + 1] - xh[i + d / 2]).abs() < 1e-6);
        }
    }
}
