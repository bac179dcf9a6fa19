//! Activations prepared for the dot kernels.
//!
//! Weight types dot against one of three activation formats (`ActFormat`):
//! - `F32`: plain f32 (float weight types).
//! - `Q8_32`: blocks of 32 int8 with one f32 scale (Q8_0, Q4_0, MXFP4 weights, and the
//!   32-element types of `blocks32.rs`). Beside the blocks, each row also carries every block's
//!   scale again in one contiguous array (`q8_32_d`: a SIMD kernel loads eight with one load)
//!   and every block's exact `sum(q)` (`q8_32_sum`, as ggml's `q8_1`): a type with a per-block
//!   minimum (Q4_1, Q5_1) or offset codes (`c + OFF`) needs that sum, and would otherwise add it
//!   up again in every row's dot.
//! - `Q8K`: super-blocks of 256 int8 with one f32 scale and the sums of each 16-element group
//!   (k-quants; the group sums let the kernels apply per-group minimums cheaply).
//! - `Q8KRows`: `Q8K` with each block's `qs` reordered for types whose 32-element groups are
//!   four 8-element grid rows (IQ2_XXS): position `64k + 8g + e` holds element `32g + 8k + e`
//!   (row k of group g), so 64 consecutive bytes are row k of all eight groups and a SIMD
//!   kernel's lanes keep one group each. Same `d` and `bsums` as `Q8K`. It is made from the
//!   `Q8K` copy, so preparing `Q8KRows` prepares `Q8K` too and such kernels may read either.
//!
//! Quantization: for each block, d = max|x| / 127 and q = round(x / d) (ties away from zero),
//! so |x - d*q| <= d/2. That is the whole error budget the dot tests allow for (see
//! `tests/kernels_ref.rs` and docs/PERFORMANCE.md). The AVX-512 quantizer gives the scalar
//! one's bits; neither calls libm (`f32::round` is a libm call on baseline x86_64 and made
//! preparing a 4096-element row cost 30-40 us; about 2 us now).
//!
//! Invariant: `Acts` allocates only when asked for more rows/columns than it has held before;
//! the decode loop sizes it once.

use super::{Isa, QK};

/// 32 int8 activations with their scale.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8_32 {
    pub d: f32,
    pub qs: [i8; 32],
}

/// 256 int8 activations with their scale and per-16 and per-32 sums of `qs`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; 256],
    pub bsums: [i16; 16],
    /// `bsums[2j] + bsums[2j + 1]`: the sums of each 32 (the Q4_K/Q5_K minimum terms' sub-blocks),
    /// made once per activation row instead of once per weight row.
    pub bsum32: [i16; 8],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActFormat {
    F32,
    Q8_32,
    Q8K,
    Q8KRows,
}

/// Position in a `Q8KRows` block of element `i` (< 256) of the `Q8K` block.
#[inline]
pub const fn q8k_rows_pos(i: usize) -> usize {
    let (g, k, e) = (i / 32, (i / 8) % 4, i % 8);
    64 * k + 8 * g + e
}

/// Four activation rows' `Q8K` blocks for a four-row dot: the block count that `w_blocks` and
/// every row hold, and each row's first block.
pub(super) fn q8k_rows4(w_blocks: usize, a: &[ActRow<'_>; 4]) -> (usize, [*const BlockQ8K; 4]) {
    let nb = a.iter().map(|a| a.q8k.len()).fold(w_blocks, usize::min);
    (nb, std::array::from_fn(|r| a[r].q8k.as_ptr()))
}

/// One activation row in every format that has been prepared (unprepared ones are empty).
pub struct ActRow<'a> {
    pub f32: &'a [f32],
    pub q8_32: &'a [BlockQ8_32],
    /// `q8_32[b].d` for every block `b`, contiguous.
    pub q8_32_d: &'a [f32],
    /// `sum(q8_32[b].qs)` for every block `b` (exact; |sum| <= 32 * 127).
    pub q8_32_sum: &'a [i32],
    pub q8k: &'a [BlockQ8K],
    pub q8k_rows: &'a [BlockQ8K],
}

/// A batch of activation rows (`rows` x `cols`), with lazily prepared quantized copies.
pub struct Acts {
    rows: usize,
    cols: usize,
    f32: Vec<f32>,
    q8_32: Vec<BlockQ8_32>,
    q8_32_d: Vec<f32>,
    q8_32_sum: Vec<i32>,
    q8k: Vec<BlockQ8K>,
    q8k_rows: Vec<BlockQ8K>,
    ready_q8_32: bool,
    ready_q8k: bool,
    ready_q8k_rows: bool,
}

const ZERO32: BlockQ8_32 = BlockQ8_32 {
    d: 0.0,
    qs: [0; 32],
};
const ZEROK: BlockQ8K = BlockQ8K {
    d: 0.0,
    qs: [0; 256],
    bsums: [0; 16],
    bsum32: [0; 8],
};

impl Default for Acts {
    fn default() -> Self {
        Acts::new()
    }
}

impl Acts {
    /// Bytes of the buffers it holds (their capacity), for the planner's memory budget.
    pub fn bytes(&self) -> usize {
        self.f32.capacity() * std::mem::size_of::<f32>()
            + self.q8_32.capacity() * std::mem::size_of::<BlockQ8_32>()
            + self.q8_32_d.capacity() * std::mem::size_of::<f32>()
            + self.q8_32_sum.capacity() * std::mem::size_of::<i32>()
            + (self.q8k.capacity() + self.q8k_rows.capacity()) * std::mem::size_of::<BlockQ8K>()
    }

    pub fn new() -> Acts {
        Acts {
            rows: 0,
            cols: 0,
            f32: Vec::new(),
            q8_32: Vec::new(),
            q8_32_d: Vec::new(),
            q8_32_sum: Vec::new(),
            q8k: Vec::new(),
            q8k_rows: Vec::new(),
            ready_q8_32: false,
            ready_q8k: false,
            ready_q8k_rows: false,
        }
    }

    /// Pre-size for up to `rows` x `cols` so later `load`s of that size do not allocate.
    /// Writes one element per page of every buffer's reserved capacity (`with_capacity`), so
    /// its pages are mapped now instead of by a forward's first writes (`State::prefault`).
    pub fn prefault(&mut self) {
        prefault_spare(&mut self.f32, 0.0);
        prefault_spare(&mut self.q8_32, ZERO32);
        prefault_spare(&mut self.q8_32_d, 0.0);
        prefault_spare(&mut self.q8_32_sum, 0);
        prefault_spare(&mut self.q8k, ZEROK);
        prefault_spare(&mut self.q8k_rows, ZEROK);
    }

    pub fn with_capacity(rows: usize, cols: usize) -> Acts {
        let mut a = Acts::new();
        a.f32.reserve(rows * cols);
        a.q8_32.reserve(rows * cols.div_ceil(32));
        a.q8_32_d.reserve(rows * cols.div_ceil(32));
        a.q8_32_sum.reserve(rows * cols.div_ceil(32));
        a.q8k.reserve(rows * cols.div_ceil(QK));
        a.q8k_rows.reserve(rows * cols.div_ceil(QK));
        a
    }

    /// Copy `x` (`rows` x `cols`, row-major) in; quantized copies are made on `prepare`.
    pub fn load(&mut self, x: &[f32], rows: usize, cols: usize) {
        assert_eq!(
            x.len(),
            rows * cols,
            "Acts::load: x has {} elements, expected {rows}x{cols}",
            x.len()
        );
        self.rows = rows;
        self.cols = cols;
        self.f32.clear();
        self.f32.extend_from_slice(x);
        self.ready_q8_32 = false;
        self.ready_q8k = false;
        self.ready_q8k_rows = false;
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn is_prepared(&self, fmt: ActFormat) -> bool {
        match fmt {
            ActFormat::F32 => true,
            ActFormat::Q8_32 => self.ready_q8_32 && self.cols.is_multiple_of(32),
            ActFormat::Q8K => self.ready_q8k && self.cols.is_multiple_of(QK),
            ActFormat::Q8KRows => self.ready_q8k_rows && self.cols.is_multiple_of(QK),
        }
    }

    /// The Q8_32 blocks' scales in one array and their exact sums, from `q8_32`; marks the
    /// format ready. Every path that fills `q8_32` ends here.
    fn q8_32_sides(&mut self) {
        self.q8_32_d.clear();
        self.q8_32_d.extend(self.q8_32.iter().map(|b| b.d));
        self.q8_32_sum.clear();
        self.q8_32_sum.extend(
            self.q8_32
                .iter()
                .map(|b| b.qs.iter().map(|&q| q as i32).sum::<i32>()),
        );
        self.ready_q8_32 = true;
    }

    /// Make the `fmt` copy of every row (no-op if already made since the last `load`).
    /// Columns that are not a whole number of blocks leave the format unprepared.
    pub fn prepare(&mut self, fmt: ActFormat) {
        match fmt {
            ActFormat::F32 => {}
            ActFormat::Q8_32 => {
                if self.ready_q8_32 || !self.cols.is_multiple_of(32) {
                    return;
                }
                let nb = self.cols / 32;
                self.q8_32.clear();
                self.q8_32.resize(self.rows * nb, ZERO32);
                quantize_blocks(&self.f32, &mut self.q8_32, 32, quantize_q8_32);
                self.q8_32_sides();
            }
            ActFormat::Q8K => {
                if self.ready_q8k || !self.cols.is_multiple_of(QK) {
                    return;
                }
                let nb = self.cols / QK;
                self.q8k.clear();
                self.q8k.resize(self.rows * nb, ZEROK);
                quantize_blocks(&self.f32, &mut self.q8k, QK, quantize_q8k);
                self.ready_q8k = true;
            }
            ActFormat::Q8KRows => {
                if self.ready_q8k_rows || !self.cols.is_multiple_of(QK) {
                    return;
                }
                self.prepare(ActFormat::Q8K);
                self.q8k_rows.clear();
                self.q8k_rows.extend(self.q8k.iter().map(|b| {
                    let mut r = *b;
                    for (i, &q) in b.qs.iter().enumerate() {
                        r.qs[q8k_rows_pos(i)] = q;
                    }
                    r
                }));
                self.ready_q8k_rows = true;
            }
        }
    }

    /// `rows` x `cols` activations written row by row by `fill(row, out)` (which must write
    /// every element of `out`: it holds stale values) and quantized as
    /// `fmt` in the same pass: pieces of rows run in parallel on `pool` (the spinning gang,
    /// `super::par_for`) when there are many, each piece filling its rows and quantizing their
    /// blocks while they are in cache. The same bits as `load` of the filled rows followed by
    /// `prepare(fmt)` (a block's quantization depends on that block alone).
    pub fn fill_prepared(
        &mut self,
        (rows, cols): (usize, usize),
        fmt: ActFormat,
        pool: Option<&rayon::ThreadPool>,
        fill: &(dyn Fn(usize, &mut [f32]) + Sync),
    ) {
        // Every element is written below (`fill` writes its whole row, the quantizer every
        // block), so the buffers are only resized: no pass that zeroes them first.
        fn size<T: Copy>(v: &mut Vec<T>, n: usize, zero: T) {
            if v.len() < n {
                v.resize(n, zero);
            } else {
                v.truncate(n);
            }
        }
        self.rows = rows;
        self.cols = cols;
        size(&mut self.f32, rows * cols, 0.0);
        self.ready_q8_32 = false;
        self.ready_q8k = false;
        self.ready_q8k_rows = false;
        // The quantized copy made in the pass: Q8KRows is made from Q8K afterwards.
        let q = match fmt {
            ActFormat::Q8_32 if cols.is_multiple_of(32) => Some(32),
            ActFormat::Q8K | ActFormat::Q8KRows if cols.is_multiple_of(QK) => Some(QK),
            _ => None,
        };
        match q {
            Some(32) => size(&mut self.q8_32, rows * (cols / 32), ZERO32),
            Some(_) => size(&mut self.q8k, rows * (cols / QK), ZEROK),
            None => {}
        }
        struct P<T>(*mut T);
        // SAFETY: each piece writes only its own rows of the buffers.
        unsafe impl<T> Sync for P<T> {}
        let (fp, q32, qk) = (
            P(self.f32.as_mut_ptr()),
            P(self.q8_32.as_mut_ptr()),
            P(self.q8k.as_mut_ptr()),
        );
        let piece = (4096 / cols.max(1)).max(1);
        let one = |p: usize| {
            let (fp, q32, qk) = (&fp, &q32, &qk);
            for r in p * piece..((p + 1) * piece).min(rows) {
                // SAFETY: row r belongs to piece p alone; r < rows, so its `cols` floats and
                // its blocks lie inside the buffers sized above.
                let x = unsafe { std::slice::from_raw_parts_mut(fp.0.add(r * cols), cols) };
                fill(r, x);
                match q {
                    Some(32) => {
                        let nb = cols / 32;
                        // SAFETY: as above (row r's blocks).
                        let o = unsafe { std::slice::from_raw_parts_mut(q32.0.add(r * nb), nb) };
                        for (xb, qb) in x.chunks_exact(32).zip(o) {
                            quantize_q8_32(xb, qb);
                        }
                    }
                    Some(_) => {
                        let nb = cols / QK;
                        // SAFETY: as above (row r's blocks).
                        let o = unsafe { std::slice::from_raw_parts_mut(qk.0.add(r * nb), nb) };
                        for (xb, qb) in x.chunks_exact(QK).zip(o) {
                            quantize_q8k(xb, qb);
                        }
                    }
                    None => {}
                }
            }
        };
        let threads = pool.map_or(1, |p| p.current_num_threads());
        let pieces = rows.div_ceil(piece);
        if threads < 2 || rows * cols < 4 * 4096 {
            (0..pieces).for_each(one);
        } else {
            super::par_for(pool, pieces, &one);
        }
        match q {
            Some(32) => self.q8_32_sides(),
            Some(_) => {
                self.ready_q8k = true;
                self.prepare(fmt);
            }
            None => {}
        }
    }

    /// Row `i` in every prepared format.
    pub fn row(&self, i: usize) -> ActRow<'_> {
        let c = self.cols;
        let f32 = &self.f32[i * c..(i + 1) * c];
        let (q8_32, q8_32_d, q8_32_sum) = if self.ready_q8_32 {
            let r = i * (c / 32)..(i + 1) * (c / 32);
            (
                &self.q8_32[r.clone()],
                &self.q8_32_d[r.clone()],
                &self.q8_32_sum[r],
            )
        } else {
            (&[][..], &[][..], &[][..])
        };
        let q8k = if self.ready_q8k {
            &self.q8k[i * (c / QK)..(i + 1) * (c / QK)]
        } else {
            &[][..]
        };
        let q8k_rows = if self.ready_q8k_rows {
            &self.q8k_rows[i * (c / QK)..(i + 1) * (c / QK)]
        } else {
            &[][..]
        };
        ActRow {
            f32,
            q8_32,
            q8_32_d,
            q8_32_sum,
            q8k,
            q8k_rows,
        }
    }
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// round(v) with ties away from zero (as `f32::round`), clamped to [-127, 127], for |v| well
/// below 2^31. Written with a truncating conversion so that it needs no libm call on baseline
/// x86_64 and matches the SIMD versions bit for bit.
#[inline]
fn round_clamp(v: f32) -> i8 {
    let t = v as i32;
    let f = v - t as f32;
    let r = t + (f >= 0.5) as i32 - (f <= -0.5) as i32;
    r.clamp(-127, 127) as i8
}

/// d = max|x|/127, q = round(x/d).
/// `quantize(x block b, out[b])` for every block of `be` elements: in parallel pieces (on the
/// current pool's thread count, `super::par_for`) when there are many blocks (a prefill
/// batch), serially otherwise (decode's one row). Each block's bits do not depend on which.
fn quantize_blocks<B: Send>(x: &[f32], out: &mut [B], be: usize, quantize: fn(&[f32], &mut B)) {
    // Blocks per piece: 16 KiB of f32 (one Q8K row of 4096 columns).
    let piece = (4096 / be).max(1);
    let nb = out.len().min(x.len() / be);
    if nb < 4 * piece || rayon::current_num_threads() < 2 {
        for (xb, qb) in x.chunks_exact(be).zip(out.iter_mut()) {
            quantize(xb, qb);
        }
        return;
    }
    struct Out<B>(*mut B);
    // SAFETY: each piece writes only its own blocks.
    unsafe impl<B: Send> Sync for Out<B> {}
    let op = Out(out.as_mut_ptr());
    super::par_for(None, nb.div_ceil(piece), &|t| {
        let op = &op;
        let (a, b) = (t * piece, ((t + 1) * piece).min(nb));
        // SAFETY: piece t alone writes blocks a..b (b <= nb <= out.len()).
        let o = unsafe { std::slice::from_raw_parts_mut(op.0.add(a), b - a) };
        for (xb, qb) in x[a * be..b * be].chunks_exact(be).zip(o) {
            quantize(xb, qb);
        }
    });
}

pub fn quantize_q8_32(x: &[f32], out: &mut BlockQ8_32) {
    #[cfg(target_arch = "x86_64")]
    if x.len() == 32 && Isa::detect() >= Isa::Avx512 {
        // SAFETY: AVX-512 F/BW/VL present (Isa::detect never exceeds the hardware); x holds
        // exactly 32 values and out.qs 32 bytes.
        unsafe { x86::quantize_avx512(x.as_ptr(), 32, out.qs.as_mut_ptr(), &mut out.d, None) };
        return;
    }
    out.d = quantize_scalar(x, &mut out.qs);
}

/// The scalar quantizer: fills `q` from `x`, returns d.
fn quantize_scalar(x: &[f32], q: &mut [i8]) -> f32 {
    let m = amax(x);
    let d = m / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, v) in q.iter_mut().zip(x) {
        *q = round_clamp(v * id);
    }
    d
}

/// d = max|x|/127 over 256 values, q = round(x/d), bsums = sums of each 16 q.
pub fn quantize_q8k(x: &[f32], out: &mut BlockQ8K) {
    #[cfg(target_arch = "x86_64")]
    if x.len() == QK && Isa::detect() >= Isa::Avx512 {
        // SAFETY: AVX-512 F/BW/VL present; x holds exactly 256 values, out.qs 256 bytes and
        // out.bsums 16 sums.
        unsafe {
            x86::quantize_avx512(
                x.as_ptr(),
                QK,
                out.qs.as_mut_ptr(),
                &mut out.d,
                Some(&mut out.bsums),
            )
        };
    } else {
        out.d = quantize_scalar(x, &mut out.qs);
        for (s, g) in out.bsums.iter_mut().zip(out.qs.chunks_exact(16)) {
            *s = g.iter().map(|&q| q as i16).sum();
        }
    }
    // |sum of 32| <= 32 * 127: no overflow.
    for (j, s) in out.bsum32.iter_mut().enumerate() {
        *s = out.bsums[2 * j] + out.bsums[2 * j + 1];
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The scalar quantizers' arithmetic, 16 lanes at a time: same max, same scale, same
    /// product, same rounding (truncate, then step away from zero on a fraction >= 0.5).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL; `x` valid for `n` floats and `q` for `n` bytes, `n` a multiple of 16;
    /// `bsums`, if given, has n / 16 entries.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn quantize_avx512(
        x: *const f32,
        n: usize,
        q: *mut i8,
        d_out: &mut f32,
        bsums: Option<&mut [i16; 16]>,
    ) {
        let mut m = _mm512_setzero_ps();
        for i in (0..n).step_by(16) {
            m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x.add(i))));
        }
        let d = _mm512_reduce_max_ps(m) / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        *d_out = d;
        let idv = _mm512_set1_ps(id);
        let half = _mm512_set1_ps(0.5);
        let neg_half = _mm512_set1_ps(-0.5);
        let one = _mm512_set1_epi32(1);
        let (lo, hi) = (_mm512_set1_epi32(-127), _mm512_set1_epi32(127));
        let mut sums = [0i16; 16];
        for (g, i) in (0..n).step_by(16).enumerate() {
            let v = _mm512_mul_ps(_mm512_loadu_ps(x.add(i)), idv);
            let t = _mm512_cvttps_epi32(v);
            let f = _mm512_sub_ps(v, _mm512_cvtepi32_ps(t));
            let t = _mm512_mask_add_epi32(t, _mm512_cmp_ps_mask::<_CMP_GE_OQ>(f, half), t, one);
            let t = _mm512_mask_sub_epi32(t, _mm512_cmp_ps_mask::<_CMP_LE_OQ>(f, neg_half), t, one);
            let t = _mm512_min_epi32(_mm512_max_epi32(t, lo), hi);
            _mm_storeu_si128(q.add(i) as *mut __m128i, _mm512_cvtepi32_epi8(t));
            if g < 16 {
                sums[g] = _mm512_reduce_add_epi32(t) as i16;
            }
        }
        if let Some(b) = bsums {
            *b = sums;
        }
    }
}

/// Writes `zero` into one element per 4 KiB page of `v`'s spare capacity (its length is
/// unchanged): the pages are faulted in now, not by later writes.
pub fn prefault_spare<T: Copy>(v: &mut Vec<T>, zero: T) {
    let per = (4096 / std::mem::size_of::<T>().max(1)).max(1);
    for x in v.spare_capacity_mut().iter_mut().step_by(per) {
        x.write(zero);
    }
}

/// Writes `zero` into one element per 4 KiB page of `v` (a buffer of zeros whose pages the
/// allocator may not have mapped yet).
pub fn prefault_zeros<T: Copy>(v: &mut [T], zero: T) {
    let per = (4096 / std::mem::size_of::<T>().max(1)).max(1);
    for x in v.iter_mut().step_by(per) {
        *x = zero;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SIMD quantizers give the scalar arithmetic's bits, ties included.
    #[test]
    fn simd_quantization_matches_scalar() {
        // Values with ties: with max|x| = 127 the scale is 1, so k + 0.5 are exact ties.
        let mut x: Vec<f32> = (0..256).map(|i| (i as f32 - 128.0) * 0.5).collect();
        x[7] = 127.0;
        let mut s = 1u64;
        let mut y: Vec<f32> = (0..256)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
            })
            .collect();
        y[3] = -40.0;
        for v in [&x, &y, &vec![0.0f32; 256]] {
            let mut a = BlockQ8K {
                d: 0.0,
                qs: [0; 256],
                bsums: [0; 16],
                bsum32: [0; 8],
            };
            quantize_q8k(v, &mut a);
            // Scalar reference, written out.
            let d = amax(v) / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            assert_eq!(a.d.to_bits(), d.to_bits());
            for (i, (&q, &xv)) in a.qs.iter().zip(v.iter()).enumerate() {
                let want = (xv * id).round().clamp(-127.0, 127.0) as i8;
                assert_eq!(q, want, "element {i}: x {xv}, x/d {}", xv * id);
            }
            for (g, &b) in a.bsums.iter().enumerate() {
                assert_eq!(
                    b,
                    a.qs[16 * g..16 * g + 16]
                        .iter()
                        .map(|&q| q as i16)
                        .sum::<i16>()
                );
            }
            // The scalar path (not taken above on an AVX-512 machine) agrees too.
            let mut qs = [0i8; 256];
            assert_eq!(quantize_scalar(v, &mut qs).to_bits(), a.d.to_bits());
            assert_eq!(qs, a.qs);
            for c in 0..8 {
                let mut b = BlockQ8_32 {
                    d: 0.0,
                    qs: [0; 32],
                };
                quantize_q8_32(&v[32 * c..32 * c + 32], &mut b);
                let d = amax(&v[32 * c..32 * c + 32]) / 127.0;
                let id = if d > 0.0 { 1.0 / d } else { 0.0 };
                assert_eq!(b.d.to_bits(), d.to_bits());
                for (&q, &xv) in b.qs.iter().zip(&v[32 * c..32 * c + 32]) {
                    assert_eq!(q, (xv * id).round().clamp(-127.0, 127.0) as i8);
                }
            }
        }
    }
}
