//! Prompt attention on blocks of f32 keys and values shared by many queries: the scores of
//! several queries against a block of keys held transposed (keys in SIMD lanes, so a score
//! needs no horizontal sum), and the weighted values of several queries accumulated one block
//! of rows after another. A block is widened from the cache once (`kv::load_row`, exact) and
//! then read by every query of a KV group's heads and a tile of rows.
//!
//! Owns: `transpose` (rows -> columns), `scores`, `values`, and attention's `softmax` (an exp
//! of our own, so SIMD and scalar code give the same bits), per ISA. Does not own: spans, masks
//! or which queries share a block (model/cpu.rs's `gqa_rows`).
//! Invariant: each score has the bits of `kv`'s dot of the query with that key (16 lanes,
//! lane l a fused multiply-add chain over dimensions 16c + l in order, then the lane sums in
//! order after the empty tail's sum) times `scale`, and each output of `values` has the bits
//! of `kv`'s weighted sum (per column, an FMA chain over the rows in order, from the value the
//! output holds), so a row's attention has the same bits whether it runs here or through
//! `kv`'s one-query kernels, at every ISA. `softmax` is defined by its scalar code
//! (each operation rounded on its own, the sum in 16 lanes), which the SIMD code repeats.

use super::Isa;

/// The lane count of the score definition (`kv`'s dot sums in 16 lanes).
pub const LANES: usize = 16;

/// The tail's sum in `kv`'s dot for a head width that is a multiple of 16 (an empty sum).
#[inline(always)]
fn empty_sum() -> f32 {
    std::iter::empty::<f32>().sum()
}

/// Scores of `qs` (each `hd` floats) against `kb` keys held transposed in `kt` (element d of key
/// j at `kt[kt_row(d, hd) * kb + j]`, as `transpose` leaves them): `out[i * kb + j] = dot(qs[i],
/// key j) * scale`. `hd` a multiple of 16, `kb` a multiple of 16.
pub fn scores(
    qs: &[&[f32]],
    kt: &[f32],
    hd: usize,
    kb: usize,
    scale: f32,
    out: &mut [f32],
    isa: Isa,
) {
    assert!(
        hd.is_multiple_of(LANES) && kb.is_multiple_of(LANES),
        "attn scores: head width {hd} and key block {kb} must be multiples of 16"
    );
    assert!(
        kt.len() >= hd * kb && out.len() >= qs.len() * kb,
        "attn scores: short buffers"
    );
    assert!(qs.iter().all(|q| q.len() >= hd), "attn scores: short query");
    let isa = isa.min(Isa::detect());
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: the CPU has the features (`Isa::detect` never exceeds the hardware); every
        // query holds hd floats, kt hd * kb, out qs.len() * kb (asserted above).
        Isa::Avx512 => {
            return unsafe { x86::scores_512(qs, kt.as_ptr(), hd, kb, scale, out.as_mut_ptr()) }
        }
        // SAFETY: as above, AVX2 + F16C.
        Isa::Avx2 => {
            return unsafe { x86::scores_256(qs, kt.as_ptr(), hd, kb, scale, out.as_mut_ptr()) }
        }
        Isa::Scalar => {}
    }
    scores_scalar(qs, kt, hd, kb, scale, out)
}

/// The row of a transposed key block (`transpose`, `scores`) that holds element d of every key:
/// the elements a dot sums into one lane (d = l, l + 16, l + 32, ..) sit in consecutive rows.
/// (Rows in d order put those 16 rows apart: at 64 keys 4 KiB, so every row a lane's sum reads
/// fell in one L1 set and the AVX2 scores ran at half speed, docs/PERFORMANCE.md session 37.)
#[inline(always)]
pub fn kt_row(d: usize, hd: usize) -> usize {
    (d % LANES) * (hd / LANES) + d / LANES
}

fn scores_scalar(qs: &[&[f32]], kt: &[f32], hd: usize, kb: usize, scale: f32, out: &mut [f32]) {
    let rem = empty_sum();
    for (q, o) in qs.iter().zip(out.chunks_mut(kb)) {
        for (j, o) in o.iter_mut().enumerate() {
            let mut s = rem;
            for l in 0..LANES {
                let mut p = 0.0f32;
                for d in (l..hd).step_by(LANES) {
                    p = q[d].mul_add(kt[kt_row(d, hd) * kb + j], p);
                }
                s += p;
            }
            *o = s * scale;
        }
    }
}

/// `os[i][c] += sum_j ws[i][j] * v[j * stride + c]`, rows j in order, one fused multiply-add
/// each (every `ws[i]` has the same length m; every `os[i]` `hd` floats; `v`
/// holds m rows `stride` apart, the first `hd` of each read). `hd` a multiple of 16.
pub fn values(ws: &[&[f32]], v: &[f32], stride: usize, os: &mut [&mut [f32]], isa: Isa) {
    let m = ws.first().map_or(0, |w| w.len());
    let hd = os.first().map_or(0, |o| o.len());
    assert!(
        hd.is_multiple_of(LANES)
            && hd <= stride
            && ws.len() == os.len()
            && ws.iter().all(|w| w.len() == m)
            && os.iter().all(|o| o.len() == hd)
            && (m == 0 || v.len() >= (m - 1) * stride + hd),
        "attn values: {} weight rows, {} outputs, {m} rows of {hd} at stride {stride} in {} floats",
        ws.len(),
        os.len(),
        v.len()
    );
    let isa = isa.min(Isa::detect());
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: the CPU has the features; every output holds hd floats, v m rows of hd, every
        // weight row m (asserted above).
        Isa::Avx512 => return unsafe { x86::values_512(ws, v.as_ptr(), stride, hd, m, os) },
        // SAFETY: as above, AVX2.
        Isa::Avx2 => return unsafe { x86::values_256(ws, v.as_ptr(), stride, hd, m, os) },
        Isa::Scalar => {}
    }
    for (w, o) in ws.iter().zip(os.iter_mut()) {
        for (j, &wj) in w.iter().enumerate() {
            for (x, y) in o.iter_mut().zip(&v[j * stride..j * stride + hd]) {
                *x = wj.mul_add(*y, *x);
            }
        }
    }
}

/// `kt[kt_row(d, hd) * kb + j] = rows[j * stride + d]` for d < hd and the `nk` rows given, zero
/// for j in nk..kb (`kb` a multiple of 16, `hd` of 16, `hd <= stride`).
pub fn transpose(
    rows: &[f32],
    stride: usize,
    hd: usize,
    nk: usize,
    kt: &mut [f32],
    kb: usize,
    isa: Isa,
) {
    assert!(
        hd.is_multiple_of(LANES) && kb.is_multiple_of(LANES) && nk <= kb && hd <= stride,
        "attn transpose: {nk} rows of {hd} (stride {stride}) into a block of {kb}"
    );
    assert!(
        (nk == 0 || rows.len() >= (nk - 1) * stride + hd) && kt.len() >= hd * kb,
        "attn transpose: short buffers"
    );
    let isa = isa.min(Isa::detect());
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: AVX-512 present; rows holds nk rows of hd floats `stride` apart, kt hd * kb
        // (asserted above).
        return unsafe { x86::transpose_512(rows.as_ptr(), stride, hd, nk, kt.as_mut_ptr(), kb) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: AVX2 present; rows holds nk rows of hd floats `stride` apart, kt hd * kb
        // (asserted above).
        return unsafe { x86::transpose_256(rows.as_ptr(), stride, hd, nk, kt.as_mut_ptr(), kb) };
    }
    for d in 0..hd {
        let col = &mut kt[kt_row(d, hd) * kb..(kt_row(d, hd) + 1) * kb];
        for (j, x) in col.iter_mut().enumerate() {
            *x = if j < nk { rows[j * stride + d] } else { 0.0 };
        }
    }
}

// exp(x) = 2^n * e^r with n = round(x / ln 2) and r = x - n ln 2 (ln 2 in two parts, the
// first exact in few bits), e^r from a degree-7 polynomial on |r| <= ln 2 / 2 (the classic
// single-precision minimax coefficients). Below EXP_LO the result is 0 (e^-87 < 2^-125).
const EXP_LO: f32 = -87.0;
const EXP_HI: f32 = 88.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// Attention's exp: the scalar definition the SIMD code repeats operation by operation.
#[inline(always)]
fn exp1(x: f32) -> f32 {
    if x.is_nan() || x < EXP_LO {
        return 0.0;
    }
    let x = x.min(EXP_HI);
    let n = (x * LOG2E).round_ties_even();
    let r = x - n * LN2_HI;
    let r = r - n * LN2_LO;
    let mut p = EXP_P[0];
    for c in &EXP_P[1..] {
        p = p * r + c;
    }
    let y = p * (r * r) + r + 1.0;
    y * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// Softmax of attention scores in place, with an optional sink (a logit that takes part in the
/// normalisation and has no value row): m = max (with the sink), e_j = exp(x_j - m), the sum
/// in 16 lanes (lane l adds e_{16c + l} in order; then the sink's term, each lane in order and
/// the elements past the last full 16 in order), x_j = e_j * (1 / sum).
pub fn softmax(x: &mut [f32], sink: Option<f32>, isa: Isa) {
    let isa = isa.min(Isa::detect());
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: the CPU has the features (`Isa::detect` never exceeds the hardware).
        Isa::Avx512 => return unsafe { x86::softmax_512(x, sink) },
        // SAFETY: as above, AVX2.
        Isa::Avx2 => return unsafe { x86::softmax_256(x, sink) },
        Isa::Scalar => {}
    }
    let m = x
        .iter()
        .fold(sink.unwrap_or(f32::NEG_INFINITY), |a, &b| a.max(b));
    let full = x.len() / LANES * LANES;
    let mut acc = [0.0f32; LANES];
    for (i, v) in x.iter_mut().enumerate() {
        *v = exp1(*v - m);
        if i < full {
            acc[i % LANES] += *v;
        }
    }
    let s = softmax_sum(&acc, sink.map(|k| exp1(k - m)), &x[full..]);
    let inv = 1.0 / s;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// The sum's ending: the sink's term, the lanes in order, then the tail in order.
#[inline(always)]
fn softmax_sum(acc: &[f32; LANES], sink: Option<f32>, tail: &[f32]) -> f32 {
    let mut s = sink.unwrap_or(0.0);
    for a in acc {
        s += a;
    }
    for t in tail {
        s += t;
    }
    s
}

#[cfg(target_arch = "x86_64")]
// Register tiles index their accumulators by query and vector: indices read clearer there.
#[allow(clippy::needless_range_loop)]
mod x86 {
    use super::{empty_sum, LANES};
    use std::arch::x86_64::*;

    /// e^x of 16 lanes: `exp1`'s operations.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn exp16(x: __m512) -> __m512 {
        use super::{EXP_HI, EXP_LO, EXP_P, LN2_HI, LN2_LO, LOG2E};
        let keep = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(EXP_LO));
        let x = _mm512_min_ps(x, _mm512_set1_ps(EXP_HI));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
        );
        let r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(LN2_HI)));
        let r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(LN2_LO)));
        let mut p = _mm512_set1_ps(EXP_P[0]);
        for c in &EXP_P[1..] {
            p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(*c));
        }
        let y = _mm512_add_ps(
            _mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r),
            _mm512_set1_ps(1.0),
        );
        let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        _mm512_maskz_mul_ps(keep, y, _mm512_castsi512_ps(e))
    }

    /// e^x of 8 lanes: `exp1`'s operations.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp8(x: __m256) -> __m256 {
        use super::{EXP_HI, EXP_LO, EXP_P, LN2_HI, LN2_LO, LOG2E};
        let keep = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(EXP_LO));
        let x = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI)));
        let r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)));
        let mut p = _mm256_set1_ps(EXP_P[0]);
        for c in &EXP_P[1..] {
            p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(*c));
        }
        let y = _mm256_add_ps(
            _mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r),
            _mm256_set1_ps(1.0),
        );
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_and_ps(keep, _mm256_mul_ps(y, _mm256_castsi256_ps(e)))
    }

    /// # Safety
    /// AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn softmax_512(x: &mut [f32], sink: Option<f32>) {
        let full = x.len() / LANES * LANES;
        let p = x.as_mut_ptr();
        let mut mv = _mm512_set1_ps(f32::NEG_INFINITY);
        for c in (0..full).step_by(LANES) {
            mv = _mm512_max_ps(mv, _mm512_loadu_ps(p.add(c)));
        }
        let m = x[full..].iter().fold(
            _mm512_reduce_max_ps(mv).max(sink.unwrap_or(f32::NEG_INFINITY)),
            |a, &b| a.max(b),
        );
        let ms = _mm512_set1_ps(m);
        let mut acc = _mm512_setzero_ps();
        for c in (0..full).step_by(LANES) {
            let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p.add(c)), ms));
            _mm512_storeu_ps(p.add(c), e);
            acc = _mm512_add_ps(acc, e);
        }
        for v in &mut x[full..] {
            *v = super::exp1(*v - m);
        }
        let mut lanes = [0.0f32; LANES];
        _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
        let s = super::softmax_sum(&lanes, sink.map(|k| super::exp1(k - m)), &x[full..]);
        let inv = _mm512_set1_ps(1.0 / s);
        for c in (0..full).step_by(LANES) {
            _mm512_storeu_ps(p.add(c), _mm512_mul_ps(_mm512_loadu_ps(p.add(c)), inv));
        }
        let inv = 1.0 / s;
        x[full..].iter_mut().for_each(|v| *v *= inv);
    }

    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn softmax_256(x: &mut [f32], sink: Option<f32>) {
        let full = x.len() / LANES * LANES;
        let p = x.as_mut_ptr();
        let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
        for c in (0..full).step_by(8) {
            mv = _mm256_max_ps(mv, _mm256_loadu_ps(p.add(c)));
        }
        let mut ml = [0.0f32; 8];
        _mm256_storeu_ps(ml.as_mut_ptr(), mv);
        let m = ml
            .iter()
            .chain(&x[full..])
            .fold(sink.unwrap_or(f32::NEG_INFINITY), |a, &b| a.max(b));
        let ms = _mm256_set1_ps(m);
        let mut acc = [_mm256_setzero_ps(); 2];
        for c in (0..full).step_by(LANES) {
            for (h, a) in acc.iter_mut().enumerate() {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(c + 8 * h)), ms));
                _mm256_storeu_ps(p.add(c + 8 * h), e);
                *a = _mm256_add_ps(*a, e);
            }
        }
        for v in &mut x[full..] {
            *v = super::exp1(*v - m);
        }
        let mut lanes = [0.0f32; LANES];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
        let s = super::softmax_sum(&lanes, sink.map(|k| super::exp1(k - m)), &x[full..]);
        let inv = _mm256_set1_ps(1.0 / s);
        for c in (0..full).step_by(8) {
            _mm256_storeu_ps(p.add(c), _mm256_mul_ps(_mm256_loadu_ps(p.add(c)), inv));
        }
        let inv = 1.0 / s;
        x[full..].iter_mut().for_each(|v| *v *= inv);
    }

    /// # Safety
    /// AVX-512F; every query holds `hd` floats, `kt` `hd * kb`, `out` `qs.len() * kb`; hd and
    /// kb multiples of 16.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores_512(
        qs: &[&[f32]],
        kt: *const f32,
        hd: usize,
        kb: usize,
        scale: f32,
        out: *mut f32,
    ) {
        let nv = kb / LANES;
        let mut i = 0;
        while i < qs.len() {
            let m = (qs.len() - i).min(4);
            let mut v = 0;
            while v < nv {
                let w = (nv - v).min(2);
                let k = kt.add(LANES * v);
                let o = out.add(i * kb + LANES * v);
                let q = &qs[i..i + m];
                match (m, w) {
                    (4, 2) => tile_512::<4, 2>(q, k, hd, kb, scale, o),
                    (4, _) => tile_512::<4, 1>(q, k, hd, kb, scale, o),
                    (3, 2) => tile_512::<3, 2>(q, k, hd, kb, scale, o),
                    (3, _) => tile_512::<3, 1>(q, k, hd, kb, scale, o),
                    (2, 2) => tile_512::<2, 2>(q, k, hd, kb, scale, o),
                    (2, _) => tile_512::<2, 1>(q, k, hd, kb, scale, o),
                    (_, 2) => tile_512::<1, 2>(q, k, hd, kb, scale, o),
                    _ => tile_512::<1, 1>(q, k, hd, kb, scale, o),
                }
                v += w;
            }
            i += m;
        }
    }

    /// M queries against W vectors of 16 keys starting at `kt` (columns `kb` apart).
    /// # Safety
    /// As `scores_512`, for `q` (M queries) and W * 16 keys from `kt`, `out` M rows of `kb`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tile_512<const M: usize, const W: usize>(
        q: &[&[f32]],
        kt: *const f32,
        hd: usize,
        kb: usize,
        scale: f32,
        out: *mut f32,
    ) {
        let qp: [*const f32; M] = std::array::from_fn(|r| q[r].as_ptr());
        let mut s = [[_mm512_set1_ps(empty_sum()); W]; M];
        for l in 0..LANES {
            let mut p = [[_mm512_setzero_ps(); W]; M];
            for (i, d) in (l..hd).step_by(LANES).enumerate() {
                let kr = kt.add((l * (hd / LANES) + i) * kb);
                let k: [__m512; W] = std::array::from_fn(|w| _mm512_loadu_ps(kr.add(LANES * w)));
                for r in 0..M {
                    let b = _mm512_set1_ps(*qp[r].add(d));
                    for w in 0..W {
                        p[r][w] = _mm512_fmadd_ps(b, k[w], p[r][w]);
                    }
                }
            }
            for r in 0..M {
                for w in 0..W {
                    s[r][w] = _mm512_add_ps(s[r][w], p[r][w]);
                }
            }
        }
        let sc = _mm512_set1_ps(scale);
        for r in 0..M {
            for w in 0..W {
                _mm512_storeu_ps(out.add(r * kb + LANES * w), _mm512_mul_ps(s[r][w], sc));
            }
        }
    }

    /// # Safety
    /// AVX2; as `scores_512`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores_256(
        qs: &[&[f32]],
        kt: *const f32,
        hd: usize,
        kb: usize,
        scale: f32,
        out: *mut f32,
    ) {
        // Two vectors of 8 keys per tile (kb is a multiple of 16): 4M independent FMA chains
        // instead of M, so the FMA latency no longer bounds the tile (1.x faster scores).
        let nv = kb / LANES;
        let mut i = 0;
        while i < qs.len() {
            let m = (qs.len() - i).min(4);
            let q = &qs[i..i + m];
            for v in 0..nv {
                let k = kt.add(LANES * v);
                let o = out.add(i * kb + LANES * v);
                match m {
                    4 => tile_256::<4>(q, k, hd, kb, scale, o),
                    3 => tile_256::<3>(q, k, hd, kb, scale, o),
                    2 => tile_256::<2>(q, k, hd, kb, scale, o),
                    _ => tile_256::<1>(q, k, hd, kb, scale, o),
                }
            }
            i += m;
        }
    }

    /// M queries against two vectors of 8 keys (16 keys from `kt`).
    /// # Safety
    /// As `tile_512`, for 16 keys.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_256<const M: usize>(
        q: &[&[f32]],
        kt: *const f32,
        hd: usize,
        kb: usize,
        scale: f32,
        out: *mut f32,
    ) {
        let qp: [*const f32; M] = std::array::from_fn(|r| q[r].as_ptr());
        let mut s = [[_mm256_set1_ps(empty_sum()); 2]; M];
        for l in 0..LANES {
            let mut p = [[_mm256_setzero_ps(); 2]; M];
            // Row kt_row(d, hd) = l * hd / 16 + i for d = l + 16 i.
            for (i, d) in (l..hd).step_by(LANES).enumerate() {
                let kr = kt.add((l * (hd / LANES) + i) * kb);
                let k = [_mm256_loadu_ps(kr), _mm256_loadu_ps(kr.add(8))];
                for r in 0..M {
                    let b = _mm256_set1_ps(*qp[r].add(d));
                    p[r][0] = _mm256_fmadd_ps(b, k[0], p[r][0]);
                    p[r][1] = _mm256_fmadd_ps(b, k[1], p[r][1]);
                }
            }
            for r in 0..M {
                s[r][0] = _mm256_add_ps(s[r][0], p[r][0]);
                s[r][1] = _mm256_add_ps(s[r][1], p[r][1]);
            }
        }
        let sc = _mm256_set1_ps(scale);
        for r in 0..M {
            _mm256_storeu_ps(out.add(r * kb), _mm256_mul_ps(s[r][0], sc));
            _mm256_storeu_ps(out.add(r * kb + 8), _mm256_mul_ps(s[r][1], sc));
        }
    }

    /// # Safety
    /// AVX-512F; every output `hd` floats, `v` m rows `stride` apart of at least `hd`, every
    /// weight row m; hd a multiple of 16.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn values_512(
        ws: &[&[f32]],
        v: *const f32,
        stride: usize,
        hd: usize,
        m: usize,
        os: &mut [&mut [f32]],
    ) {
        let mut i = 0;
        while i < ws.len() {
            let n = (ws.len() - i).min(4);
            let mut c = 0;
            while c < hd {
                let g = ((hd - c) / LANES).min(4);
                let (w, o) = (&ws[i..i + n], &mut os[i..i + n]);
                match (n, g) {
                    (4, 4) => vtile_512::<4, 4>(w, v, stride, m, c, o),
                    (4, _) => vtile_512::<4, 1>(w, v, stride, m, c, o),
                    (3, 4) => vtile_512::<3, 4>(w, v, stride, m, c, o),
                    (3, _) => vtile_512::<3, 1>(w, v, stride, m, c, o),
                    (2, 4) => vtile_512::<2, 4>(w, v, stride, m, c, o),
                    (2, _) => vtile_512::<2, 1>(w, v, stride, m, c, o),
                    (_, 4) => vtile_512::<1, 4>(w, v, stride, m, c, o),
                    _ => vtile_512::<1, 1>(w, v, stride, m, c, o),
                }
                c += if g == 4 { 4 * LANES } else { LANES };
            }
            i += n;
        }
    }

    /// M outputs, columns c..c + 16G, over all m rows.
    /// # Safety
    /// As `values_512`, with c + 16G <= hd.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn vtile_512<const M: usize, const G: usize>(
        w: &[&[f32]],
        v: *const f32,
        stride: usize,
        m: usize,
        c: usize,
        o: &mut [&mut [f32]],
    ) {
        let mut acc: [[__m512; G]; M] = std::array::from_fn(|r| {
            std::array::from_fn(|g| _mm512_loadu_ps(o[r].as_ptr().add(c + LANES * g)))
        });
        let wp: [*const f32; M] = std::array::from_fn(|r| w[r].as_ptr());
        for j in 0..m {
            let row = v.add(j * stride + c);
            let x: [__m512; G] = std::array::from_fn(|g| _mm512_loadu_ps(row.add(LANES * g)));
            for r in 0..M {
                let b = _mm512_set1_ps(*wp[r].add(j));
                for g in 0..G {
                    acc[r][g] = _mm512_fmadd_ps(b, x[g], acc[r][g]);
                }
            }
        }
        for r in 0..M {
            for g in 0..G {
                _mm512_storeu_ps(o[r].as_mut_ptr().add(c + LANES * g), acc[r][g]);
            }
        }
    }

    /// # Safety
    /// AVX2; as `values_512`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn values_256(
        ws: &[&[f32]],
        v: *const f32,
        stride: usize,
        hd: usize,
        m: usize,
        os: &mut [&mut [f32]],
    ) {
        let mut i = 0;
        while i < ws.len() {
            let n = (ws.len() - i).min(4);
            for c in (0..hd).step_by(16) {
                let (w, o) = (&ws[i..i + n], &mut os[i..i + n]);
                match n {
                    4 => vtile_256::<4>(w, v, stride, m, c, o),
                    3 => vtile_256::<3>(w, v, stride, m, c, o),
                    2 => vtile_256::<2>(w, v, stride, m, c, o),
                    _ => vtile_256::<1>(w, v, stride, m, c, o),
                }
            }
            i += n;
        }
    }

    /// M outputs, columns c..c + 16, over all m rows.
    /// # Safety
    /// As `values_512`, with c + 16 <= hd.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn vtile_256<const M: usize>(
        w: &[&[f32]],
        v: *const f32,
        stride: usize,
        m: usize,
        c: usize,
        o: &mut [&mut [f32]],
    ) {
        let mut acc: [[__m256; 2]; M] = std::array::from_fn(|r| {
            std::array::from_fn(|g| _mm256_loadu_ps(o[r].as_ptr().add(c + 8 * g)))
        });
        let wp: [*const f32; M] = std::array::from_fn(|r| w[r].as_ptr());
        for j in 0..m {
            let row = v.add(j * stride + c);
            let x = [_mm256_loadu_ps(row), _mm256_loadu_ps(row.add(8))];
            for r in 0..M {
                let b = _mm256_set1_ps(*wp[r].add(j));
                for g in 0..2 {
                    acc[r][g] = _mm256_fmadd_ps(b, x[g], acc[r][g]);
                }
            }
        }
        for r in 0..M {
            for g in 0..2 {
                _mm256_storeu_ps(o[r].as_mut_ptr().add(c + 8 * g), acc[r][g]);
            }
        }
    }

    /// # Safety
    /// AVX-512F; `rows` holds nk rows of hd floats `stride` apart, `kt` hd * kb; hd and kb
    /// multiples of 16, nk <= kb.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose_512(
        rows: *const f32,
        stride: usize,
        hd: usize,
        nk: usize,
        kt: *mut f32,
        kb: usize,
    ) {
        for j0 in (0..kb).step_by(LANES) {
            for d0 in (0..hd).step_by(LANES) {
                let r: [__m512; 16] = std::array::from_fn(|i| {
                    if j0 + i < nk {
                        _mm512_loadu_ps(rows.add((j0 + i) * stride + d0))
                    } else {
                        _mm512_setzero_ps()
                    }
                });
                let c = transpose16(r);
                for (d, x) in c.iter().enumerate() {
                    _mm512_storeu_ps(kt.add(super::kt_row(d0 + d, hd) * kb + j0), *x);
                }
            }
        }
    }

    /// `transpose_512` in 8 x 8 blocks.
    /// # Safety
    /// AVX2; `rows` holds nk rows of hd floats `stride` apart, `kt` hd * kb; hd and kb
    /// multiples of 8, nk <= kb.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn transpose_256(
        rows: *const f32,
        stride: usize,
        hd: usize,
        nk: usize,
        kt: *mut f32,
        kb: usize,
    ) {
        for j0 in (0..kb).step_by(8) {
            for d0 in (0..hd).step_by(8) {
                let r: [__m256; 8] = std::array::from_fn(|i| {
                    if j0 + i < nk {
                        _mm256_loadu_ps(rows.add((j0 + i) * stride + d0))
                    } else {
                        _mm256_setzero_ps()
                    }
                });
                // Pairs of rows interleaved, then groups of four, then the 128-bit halves.
                let t: [__m256; 8] = std::array::from_fn(|i| {
                    let (a, b) = (r[i & !1], r[i | 1]);
                    if i % 2 == 0 {
                        _mm256_unpacklo_ps(a, b)
                    } else {
                        _mm256_unpackhi_ps(a, b)
                    }
                });
                // u[4k + m]: in 128-bit lane L, column 4L + m of rows 4k..4k + 4.
                let u: [__m256; 8] = std::array::from_fn(|i| {
                    let (k, m) = (i / 4, i % 4);
                    let (a, b) = (t[4 * k + m / 2], t[4 * k + 2 + m / 2]);
                    if m % 2 == 0 {
                        _mm256_shuffle_ps::<0x44>(a, b)
                    } else {
                        _mm256_shuffle_ps::<0xEE>(a, b)
                    }
                });
                for c in 0..8 {
                    let (lo, hi) = (u[c % 4], u[4 + c % 4]);
                    let x = if c < 4 {
                        _mm256_permute2f128_ps::<0x20>(lo, hi)
                    } else {
                        _mm256_permute2f128_ps::<0x31>(lo, hi)
                    };
                    _mm256_storeu_ps(kt.add(super::kt_row(d0 + c, hd) * kb + j0), x);
                }
            }
        }
    }

    /// Rows r[i] (16 floats each) -> columns: out[c] lane i = r[i] lane c.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
        // Within 128-bit lanes: pairs of rows interleaved, then groups of four rows.
        let t: [__m512; 16] = std::array::from_fn(|i| {
            let (a, b) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_ps(a, b)
            } else {
                _mm512_unpackhi_ps(a, b)
            }
        });
        // u[4k + m]: in 128-bit lane L, column 4L + m of rows 4k..4k + 4.
        let u: [__m512; 16] = std::array::from_fn(|i| {
            let (k, m) = (i / 4, i % 4);
            let (a, b) = (t[4 * k + m / 2], t[4 * k + 2 + m / 2]);
            if m % 2 == 0 {
                _mm512_shuffle_ps::<0x44>(a, b)
            } else {
                _mm512_shuffle_ps::<0xEE>(a, b)
            }
        });
        let mut out = [_mm512_setzero_ps(); 16];
        for m in 0..4 {
            let (a, b, c, d) = (u[m], u[4 + m], u[8 + m], u[12 + m]);
            let v0 = _mm512_shuffle_f32x4::<0x44>(a, b);
            let v1 = _mm512_shuffle_f32x4::<0xEE>(a, b);
            let w0 = _mm512_shuffle_f32x4::<0x44>(c, d);
            let w1 = _mm512_shuffle_f32x4::<0xEE>(c, d);
            out[m] = _mm512_shuffle_f32x4::<0x88>(v0, w0);
            out[m + 4] = _mm512_shuffle_f32x4::<0xDD>(v0, w0);
            out[m + 8] = _mm512_shuffle_f32x4::<0x88>(v1, w1);
            out[m + 12] = _mm512_shuffle_f32x4::<0xDD>(v1, w1);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::kv::{kv_kernels, KvType};

    /// kv's test values (a spread of magnitudes, a few exact f16 ties).
    fn values_of(n: usize, seed: u32) -> Vec<f32> {
        crate::kernels::kv::tests::values(n, seed)
    }

    fn isas() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|i| i.supported())
            .collect()
    }

    #[test]
    fn transpose_puts_rows_in_columns() {
        for isa in isas() {
            // (hd, stride, nk, kb): rows packed and rows wider than hd (MLA's key parts).
            for (hd, stride, nk, kb) in [
                (16, 16, 16, 16),
                (64, 64, 37, 48),
                (128, 128, 64, 64),
                (32, 96, 13, 16),
            ] {
                let rows = values_of(nk * stride, 3);
                let mut kt = vec![f32::NAN; hd * kb];
                transpose(&rows, stride, hd, nk, &mut kt, kb, isa);
                for d in 0..hd {
                    for j in 0..kb {
                        let want = if j < nk { rows[j * stride + d] } else { 0.0 };
                        assert_eq!(
                            kt[kt_row(d, hd) * kb + j].to_bits(),
                            want.to_bits(),
                            "{isa:?} d {d} j {j}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn scores_have_the_one_query_dots_bits() {
        for isa in isas() {
            let kv = kv_kernels(KvType::F32, isa);
            for (hd, nk, nq) in [
                (16usize, 5usize, 1usize),
                (64, 48, 7),
                (128, 64, 9),
                (256, 17, 4),
            ] {
                let kb = nk.div_ceil(16) * 16;
                let keys = values_of(nk * hd, 5);
                let q = values_of(nq * hd, 7);
                let qs: Vec<&[f32]> = q.chunks(hd).collect();
                let mut kt = vec![0.0; hd * kb];
                transpose(&keys, hd, hd, nk, &mut kt, kb, isa);
                let mut out = vec![0.0; nq * kb];
                let scale = 0.0883;
                scores(&qs, &kt, hd, kb, scale, &mut out, isa);
                for (i, qi) in qs.iter().enumerate() {
                    for j in 0..nk {
                        let key = crate::kernels::kv::f32_bytes(&keys[j * hd..(j + 1) * hd]);
                        let want = (kv.dot)(qi, key) * scale;
                        assert_eq!(
                            out[i * kb + j].to_bits(),
                            want.to_bits(),
                            "{isa:?} hd {hd} q {i} key {j}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn values_have_the_weighted_sums_bits() {
        for isa in isas() {
            let kv = kv_kernels(KvType::F32, isa);
            for (hd, m, nq) in [
                (16, 3, 1),
                (64, 40, 5),
                (128, 64, 8),
                (256, 9, 3),
                (48, 7, 2),
            ] {
                let v = values_of(m * hd, 11);
                let w = values_of(nq * m, 13);
                let ws: Vec<&[f32]> = w.chunks(m).collect();
                // Two blocks: rows 0..h then h..m, carried in the outputs.
                let h = m / 2;
                let mut o = vec![0.0f32; nq * hd];
                {
                    let mut os: Vec<&mut [f32]> = o.chunks_mut(hd).collect();
                    let a: Vec<&[f32]> = ws.iter().map(|w| &w[..h]).collect();
                    values(&a, &v[..h * hd], hd, &mut os, isa);
                    let b: Vec<&[f32]> = ws.iter().map(|w| &w[h..]).collect();
                    values(&b, &v[h * hd..], hd, &mut os, isa);
                }
                for (i, wi) in ws.iter().enumerate() {
                    let mut want = vec![0.0f32; hd];
                    (kv.weighted)(&mut want, wi, crate::kernels::kv::f32_bytes(&v), hd * 4);
                    for c in 0..hd {
                        assert_eq!(
                            o[i * hd + c].to_bits(),
                            want[c].to_bits(),
                            "{isa:?} hd {hd} q {i} col {c}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn softmax_is_the_scalar_definition_at_every_isa_and_close_to_exp() {
        for n in [1usize, 5, 16, 17, 40, 64, 301] {
            for sink in [None, Some(0.7f32), Some(-50.0)] {
                let mut x = values_of(n, n as u32 + 1);
                if n > 3 {
                    x[2] = -200.0; // below exp's range: 0
                }
                let mut want = x.clone();
                softmax(&mut want, sink, Isa::Scalar);
                // Against f64: each weight within a few ulps of the exact softmax.
                let m = x
                    .iter()
                    .copied()
                    .fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max)
                    as f64;
                let e: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp()).collect();
                let s: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |k| (k as f64 - m).exp());
                for (w, e) in want.iter().zip(&e) {
                    let exact = e / s;
                    assert!(
                        ((*w as f64) - exact).abs() <= 3e-6 * exact + 1e-30,
                        "n {n} {w} vs {exact}"
                    );
                }
                for isa in isas() {
                    let mut got = x.clone();
                    softmax(&mut got, sink, isa);
                    for (g, w) in got.iter().zip(&want) {
                        assert_eq!(g.to_bits(), w.to_bits(), "{isa:?} n {n} sink {sink:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn exp_is_accurate_over_its_range() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = (x as f64).exp();
            let got = exp1(x) as f64;
            worst = worst.max((got - want).abs() / want);
            x += 0.0137;
        }
        assert!(worst < 3e-7, "exp's worst relative error {worst}");
        assert_eq!(exp1(-87.5), 0.0);
        assert_eq!(exp1(0.0), 1.0);
        assert_eq!(exp1(-0.0), 1.0);
    }
}
