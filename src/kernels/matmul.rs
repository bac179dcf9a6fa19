//! Weights x activations over a thread pool: y[t][r] = dot(w row r, activation row t).
//!
//! Each task owns a contiguous range of weight rows and runs every activation row against
//! them, so a weight row is read from memory once per call whatever the batch size (prefill
//! streams weights once; decode is the batch-of-one case). Within a range, rows go in tiles of
//! `TILE_BYTES` so that, with many activation rows, activations are re-read per tile rather
//! than per weight row.
//!
//! With several activation rows (prefill), types that have a four-row dot (`dot4_fn`) unpack
//! each weight block once for four rows.
//!
//! Invariant: every output element has the bits of one call of the type's single-row dot on
//! the same inputs (the four-row dots keep each row's float operations in the same order), so
//! results are bit-identical whatever the thread count, tiling or batch size.

use super::{check_len, dot4_fn, dot_fn, kernels_for, Acts, Dot4Fn, DotFn, Isa, KernelError};
use crate::dtype::DType;
use rayon::prelude::*;

/// A row-major encoded matrix: `rows` rows of `cols` elements, each row whole blocks of `dtype`.
#[derive(Clone, Copy, Debug)]
pub struct WeightView<'a> {
    pub dtype: DType,
    pub bytes: &'a [u8],
    pub rows: usize,
    pub cols: usize,
}

impl<'a> WeightView<'a> {
    pub fn new(
        dtype: DType,
        bytes: &'a [u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self, KernelError> {
        check_len("weight matrix", dtype, rows * cols, bytes.len())?;
        Ok(WeightView {
            dtype,
            bytes,
            rows,
            cols,
        })
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.bytes.len() / self.rows.max(1)
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.bytes[r * rb..(r + 1) * rb]
    }
}

#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: tasks write disjoint elements (distinct weight rows) through this pointer.
unsafe impl Sync for SyncPtr {}
unsafe impl Send for SyncPtr {}

/// Checks `w`, `acts` and `y` agree, prepares `acts` in the weight's activation format and
/// returns the dot functions to use.
fn setup(
    w: &WeightView<'_>,
    acts: &mut Acts,
    y_len: usize,
    isa: Isa,
) -> Result<(DotFn, Option<Dot4Fn>), KernelError> {
    let k = kernels_for(w.dtype)?;
    if acts.cols() != w.cols {
        return Err(KernelError::Shape(format!(
            "activations have {} columns, weight has {}",
            acts.cols(),
            w.cols
        )));
    }
    check_len("weight matrix", w.dtype, w.rows * w.cols, w.bytes.len())?;
    let t_rows = acts.rows();
    if y_len != t_rows * w.rows {
        return Err(KernelError::Shape(format!(
            "output has {y_len} elements, expected {}x{}",
            t_rows, w.rows
        )));
    }
    acts.prepare(k.act);
    if !acts.is_prepared(k.act) {
        return Err(KernelError::Shape(format!(
            "{} columns cannot be prepared as {:?}",
            w.cols, k.act
        )));
    }
    Ok((dot_fn(w.dtype, isa)?, dot4_fn(w.dtype, isa)))
}

/// Weight rows r0..r1 against every activation row: `out(t * w.rows + r, value)`.
///
/// Weight rows go in tiles: a tile stays in L2 while every activation row passes over it, so
/// with many activation rows (prefill) each is read once per tile rather than once per weight
/// row. One activation row (decode) makes this the plain row loop.
fn rows_range(
    w: &WeightView<'_>,
    acts: &Acts,
    (dot, dot4): (DotFn, Option<Dot4Fn>),
    r0: usize,
    r1: usize,
    out: &mut dyn FnMut(usize, f32),
) {
    let (n_rows, t_rows) = (w.rows, acts.rows());
    let rb = w.row_bytes();
    let tile = (TILE_BYTES / rb.max(1)).max(1);
    let mut t0 = r0;
    while t0 < r1 {
        let t1 = (t0 + tile).min(r1);
        let mut t = 0;
        if let Some(dot4) = dot4 {
            while t + 4 <= t_rows {
                let a = [
                    acts.row(t),
                    acts.row(t + 1),
                    acts.row(t + 2),
                    acts.row(t + 3),
                ];
                let mut o = [0.0f32; 4];
                for r in t0..t1 {
                    dot4(&w.bytes[r * rb..(r + 1) * rb], &a, &mut o);
                    for (k, &v) in o.iter().enumerate() {
                        out((t + k) * n_rows + r, v);
                    }
                }
                t += 4;
            }
        }
        for t in t..t_rows {
            let a = acts.row(t);
            for r in t0..t1 {
                out(t * n_rows + r, dot(&w.bytes[r * rb..(r + 1) * rb], &a));
            }
        }
        t0 = t1;
    }
}

/// y (acts.rows() x w.rows, row-major) = activations x w^T. Prepares `acts` in the weight's
/// activation format. `isa` caps the instruction set (use `Isa::detect()` normally).
pub fn matmul(
    w: &WeightView<'_>,
    acts: &mut Acts,
    y: &mut [f32],
    pool: Option<&rayon::ThreadPool>,
    isa: Isa,
) -> Result<(), KernelError> {
    let dots = setup(w, acts, y.len(), isa)?;
    let acts = &*acts;
    let n_rows = w.rows;
    let threads = pool.map(|p| p.current_num_threads()).unwrap_or(1);
    let total_bytes = w.bytes.len() * acts.rows().max(1);
    if threads <= 1 || total_bytes < 256 * 1024 || n_rows < 2 {
        rows_range(w, acts, dots, 0, n_rows, &mut |i, v| y[i] = v);
        return Ok(());
    }
    // Enough chunks to balance load across uneven cores, few enough to keep overhead low.
    let chunk = (n_rows / (threads * 8)).clamp(8, 4096);
    let n_chunks = n_rows.div_ceil(chunk);
    let yp = SyncPtr(y.as_mut_ptr());
    let run = || {
        (0..n_chunks).into_par_iter().for_each(|c| {
            let yp = &yp;
            let r0 = c * chunk;
            let r1 = (r0 + chunk).min(n_rows);
            rows_range(w, acts, dots, r0, r1, &mut |i, v| {
                // SAFETY: i = t*n_rows + r < y.len() (checked in `setup`); weight row r
                // belongs to exactly one chunk, so no two tasks write the same element.
                unsafe { *yp.0.add(i) = v }
            });
        })
    };
    match pool {
        Some(p) => p.install(run),
        None => run(),
    }
    Ok(())
}

/// One product of [`matmul_jobs`]: `y` = `acts` x `w`^T.
pub struct MatJob<'j, 'w> {
    pub w: &'j WeightView<'w>,
    pub acts: &'j mut Acts,
    pub y: &'j mut [f32],
}

/// Most products one [`matmul_jobs`] call runs.
pub const MAX_JOBS: usize = 64;

/// Several independent products in one parallel region: the rows of every job are cut into
/// chunks and all chunks go to the pool together, so there is one join for all of them instead
/// of one per product (decode runs a layer's experts this way: small products, many threads).
/// Each output element has the bits `matmul` gives it. Jobs may share no output; a job's
/// activations are prepared here (several jobs may use equal activations in separate `Acts`).
/// Allocates nothing.
pub fn matmul_jobs(
    jobs: &mut [MatJob<'_, '_>],
    pool: Option<&rayon::ThreadPool>,
    isa: Isa,
) -> Result<(), KernelError> {
    if jobs.len() > MAX_JOBS {
        return Err(KernelError::Shape(format!(
            "{} products in one call (at most {MAX_JOBS})",
            jobs.len()
        )));
    }
    let mut dots: [Option<(DotFn, Option<Dot4Fn>)>; MAX_JOBS] = [None; MAX_JOBS];
    for (j, job) in jobs.iter_mut().enumerate() {
        dots[j] = Some(setup(job.w, job.acts, job.y.len(), isa)?);
    }
    let threads = pool.map(|p| p.current_num_threads()).unwrap_or(1);
    // Chunk sizes and the first chunk of each job (prefix sums), on the stack.
    let mut chunk = [0usize; MAX_JOBS];
    let mut first = [0usize; MAX_JOBS + 1];
    let mut outs = [(SyncPtr(std::ptr::null_mut()), 0usize); MAX_JOBS];
    for (j, job) in jobs.iter_mut().enumerate() {
        chunk[j] = (job.w.rows / (threads * 2)).clamp(8, 4096);
        first[j + 1] = first[j] + job.w.rows.div_ceil(chunk[j]);
        outs[j] = (SyncPtr(job.y.as_mut_ptr()), job.y.len());
    }
    let n = jobs.len();
    let total = first[n];
    let jobs = &*jobs;
    let (dots, chunk, first, outs) = (&dots, &chunk, &first, &outs);
    let one = |c: usize| {
        let j = (0..n).rfind(|&j| first[j] <= c).unwrap_or(0);
        let job = &jobs[j];
        let r0 = (c - first[j]) * chunk[j];
        let r1 = (r0 + chunk[j]).min(job.w.rows);
        let (yp, len) = &outs[j];
        if let Some(d) = dots[j] {
            rows_range(job.w, job.acts, d, r0, r1, &mut |i, v| {
                debug_assert!(i < *len);
                // SAFETY: i = t*rows + r < len (checked in `setup`); weight row r of job j
                // belongs to exactly one chunk and jobs share no output.
                unsafe { *yp.0.add(i) = v }
            });
        }
    };
    match pool {
        Some(p) if threads > 1 && total > 1 => {
            p.install(|| (0..total).into_par_iter().for_each(one))
        }
        _ => (0..total).for_each(one),
    }
    Ok(())
}

/// Bytes of weight rows per tile in `matmul` (well inside a 1-2 MiB L2).
const TILE_BYTES: usize = 64 * 1024;
