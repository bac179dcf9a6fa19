//! Weights x activations over a thread pool: y[t][r] = dot(w row r, activation row t).
//!
//! Each task owns a contiguous range of weight rows and runs every activation row against
//! them, so a weight row is read from memory once per call whatever the batch size (prefill
//! streams weights once; decode is the batch-of-one case). Within a range, rows go in tiles of
//! `TILE_BYTES` so that, with many activation rows, activations are re-read per tile rather
//! than per weight row.
//!
//! With several activation rows (prefill), types that have a tile kernel (`tile_fn`) run eight
//! weight rows against four activation rows at a time, and types that have a four-row dot
//! (`dot4_fn`) unpack each weight block once for four rows (also for rows left over from
//! eights).
//!
//! Invariant: every output element has the bits of one call of the type's single-row dot on
//! the same inputs (the tile and four-row dots keep each row's float operations in the same
//! order), so results are bit-identical whatever the thread count, tiling or batch size.

use super::spin::SpinPool;
use super::{
    check_len, dot4_fn, dot_fn, kernels_for, tile16_fn, tile_fn, ActRow, Acts, Dot4Fn, DotFn, Isa,
    KernelError, Tile16Fn, TileFn, TileNFn,
};
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

/// The kernels a product uses: the single-row dot, and the multi-row ones if the type has them.
#[derive(Clone, Copy)]
struct Dots {
    dot: DotFn,
    dot4: Option<Dot4Fn>,
    tile: Option<TileFn>,
    tile16: Option<Tile16Fn>,
}

impl Dots {
    fn new(dtype: DType, isa: Isa) -> Result<Dots, KernelError> {
        Ok(Dots {
            dot: dot_fn(dtype, isa)?,
            dot4: dot4_fn(dtype, isa),
            tile: tile_fn(dtype, isa),
            tile16: tile16_fn(dtype, isa),
        })
    }
}

/// Checks `w`, `acts` and `y` agree, prepares `acts` in the weight's activation format and
/// returns the dot functions to use.
fn setup(w: &WeightView<'_>, acts: &mut Acts, y_len: usize, isa: Isa) -> Result<Dots, KernelError> {
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
    Dots::new(w.dtype, isa)
}

/// The activation rows a product runs over: rows `a0..a0 + rows` of `acts`, or, with `pick`,
/// rows `pick[0], pick[1], ..` (`rows` = its length: an expert's tokens, with no gather).
#[derive(Clone, Copy)]
struct Src<'a> {
    acts: &'a Acts,
    a0: usize,
    rows: usize,
    pick: Option<&'a [u32]>,
}

impl<'a> Src<'a> {
    fn all(acts: &'a Acts) -> Src<'a> {
        Src {
            acts,
            a0: 0,
            rows: acts.rows(),
            pick: None,
        }
    }

    /// The product's activation row `t`.
    #[inline]
    fn row(&self, t: usize) -> ActRow<'a> {
        match self.pick {
            Some(p) => self.acts.row(p[t] as usize),
            None => self.acts.row(self.a0 + t),
        }
    }
}

/// Weight rows r0..r1 against every activation row: `out(t * w.rows + r, value)`.
///
/// Weight rows go in tiles: a tile stays in L2 while every activation row passes over it, so
/// with many activation rows (prefill) each is read once per tile rather than once per weight
/// row. One activation row (decode) makes this the plain row loop.
fn rows_range(
    w: &WeightView<'_>,
    src: Src<'_>,
    dots: Dots,
    r0: usize,
    r1: usize,
    out: &mut dyn FnMut(usize, f32),
) {
    let n_rows = w.rows;
    let rb = w.row_bytes();
    // Whole eights of rows, for the tile kernels.
    let tile = (TILE_BYTES / rb.max(1) / 8 * 8).max(8);
    let Dots {
        dot,
        dot4,
        tile: tile8,
        tile16,
    } = dots;
    let t_rows = src.rows;
    // Tokens per pass: a 16-token tile takes up to sixteen, a tile eight, the four-row dot four.
    let group = match (tile16, tile8) {
        (Some(_), Some(_)) => 16,
        (_, Some(_)) => 8,
        _ => 4,
    };
    let mut t0 = r0;
    while t0 < r1 {
        let t1 = (t0 + tile).min(r1);
        let mut t = 0;
        while t < t_rows {
            let n = (t_rows - t).min(group);
            let mut r8 = t0;
            // Tiles from two tokens up. One token (decode's matvec) keeps the single-row dot:
            // the tile's eight side-by-side row streams read memory slower (Q4_K AVX-512, one
            // thread: 8.9 vs 12.5 GB/s, docs/PERFORMANCE.md issue 16) though it wins in L2.
            if let Some(tile16) = tile16.filter(|_| n > 8) {
                r8 = tiles(w, src, (t, n), (r8, t1), tile16, out);
            } else if let Some(tile8) = tile8.filter(|_| n >= 2) {
                r8 = tiles(w, src, (t, n), (r8, t1), tile8, out);
            }
            // The rows left (fewer than eight), four tokens at a time.
            let mut u = t;
            while u < t + n && r8 < t1 {
                let m = (t + n - u).min(4);
                let a: [ActRow<'_>; 4] = std::array::from_fn(|k| src.row(u + k.min(m - 1)));
                match dot4.filter(|_| m == 4) {
                    Some(dot4) => {
                        let mut o = [0.0f32; 4];
                        for r in r8..t1 {
                            dot4(&w.bytes[r * rb..(r + 1) * rb], &a, &mut o);
                            for (k, &v) in o.iter().enumerate() {
                                out((u + k) * n_rows + r, v);
                            }
                        }
                    }
                    None => {
                        for (k, a) in a[..m].iter().enumerate() {
                            for r in r8..t1 {
                                out((u + k) * n_rows + r, dot(&w.bytes[r * rb..(r + 1) * rb], a));
                            }
                        }
                    }
                }
                u += m;
            }
            t += n;
        }
        t0 = t1;
    }
}

/// Tokens t..t + n (n <= N) against the whole eights of rows from r8 up to t1 by `tile` (a
/// `TileFn` for N = 8, a `Tile16Fn` for 16: `o[k][j]` for token k, row j); returns the first
/// row left (fewer than eight before t1).
fn tiles<const N: usize>(
    w: &WeightView<'_>,
    src: Src<'_>,
    (t, n): (usize, usize),
    (mut r8, t1): (usize, usize),
    tile: TileNFn<N>,
    out: &mut dyn FnMut(usize, f32),
) -> usize {
    let rb = w.row_bytes();
    let a: [ActRow<'_>; N] = std::array::from_fn(|k| src.row(t + k.min(n - 1)));
    let mut o = [[0.0f32; 8]; N];
    while r8 + 8 <= t1 {
        tile(&w.bytes[r8 * rb..(r8 + 8) * rb], rb, &a[..n], &mut o);
        for (k, o) in o[..n].iter().enumerate() {
            for (j, &v) in o.iter().enumerate() {
                out((t + k) * w.rows + r8 + j, v);
            }
        }
        r8 += 8;
    }
    r8
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
        rows_range(w, Src::all(acts), dots, 0, n_rows, &mut |i, v| y[i] = v);
        return Ok(());
    }
    // Enough chunks to balance load across uneven cores, few enough to keep overhead low.
    let chunk = (n_rows / (threads * 8)).clamp(8, 4096).next_multiple_of(8);
    let n_chunks = n_rows.div_ceil(chunk);
    let yp = SyncPtr(y.as_mut_ptr());
    let one = |c: usize| {
        let yp = &yp;
        let r0 = c * chunk;
        let r1 = (r0 + chunk).min(n_rows);
        rows_range(w, Src::all(acts), dots, r0, r1, &mut |i, v| {
            // SAFETY: i = t*n_rows + r < y.len() (checked in `setup`); weight row r
            // belongs to exactly one chunk, so no two tasks write the same element.
            unsafe { *yp.0.add(i) = v }
        });
    };
    // The spinning gang when it is free (rayon otherwise): decode's regions are short, and
    // prefill's alternate with decode-sized ones (experts with one token), so one set of
    // threads runs both rather than two sets taking turns on the cores.
    if SpinPool::get(threads).is_some_and(|g| g.try_run(n_chunks, &one)) {
        return Ok(());
    }
    let run = || (0..n_chunks).into_par_iter().for_each(one);
    match pool {
        Some(p) => p.install(run),
        None => run(),
    }
    Ok(())
}

/// `f(i)` for every i in 0..n on `pool`'s threads: through the spinning gang of that many
/// threads when it is free (short regions, decode), else as a rayon loop on `pool` (or on the
/// current pool when `None`).
pub fn par_for(pool: Option<&rayon::ThreadPool>, n: usize, f: &(dyn Fn(usize) + Sync)) {
    let threads = pool.map_or_else(rayon::current_num_threads, |p| p.current_num_threads());
    if n > 1 && SpinPool::get(threads).is_some_and(|g| g.try_run(n, f)) {
        return;
    }
    let run = || (0..n).into_par_iter().for_each(f);
    match pool {
        Some(p) => p.install(run),
        None => run(),
    }
}

/// One product of [`matmul_jobs`]: `y` = rows `row0..row0 + rows` of `acts` x `w`^T.
pub struct MatJob<'j, 'w> {
    pub w: &'j WeightView<'w>,
    /// Prepared in `w`'s activation format (`prepare_for`); jobs may share it.
    pub acts: &'j Acts,
    pub row0: usize,
    pub rows: usize,
    /// When set, the job's activation rows are these rows of `acts` instead of `row0..`
    /// (`rows` must be its length): an expert's tokens picked from the whole batch's
    /// activations, quantized once, instead of gathered and quantized per expert.
    pub pick: Option<&'j [u32]>,
    pub y: &'j mut [f32],
}

/// Most products one [`matmul_jobs`] call runs.
pub const MAX_JOBS: usize = 256;

/// Prepare `acts` for weights of `dtype` (what `matmul` does itself; `matmul_jobs` needs it
/// done first, since its jobs may share activations).
pub fn prepare_for(dtype: crate::dtype::DType, acts: &mut Acts) -> Result<(), KernelError> {
    acts.prepare(kernels_for(dtype)?.act);
    Ok(())
}

/// Several independent products in one parallel region: the rows of every job are cut into
/// chunks and all chunks go to the pool together, so there is one join for all of them instead
/// of one per product (decode runs a layer's experts this way: small products, many threads).
/// Each output element has the bits `matmul` gives it on the same activation row. Jobs may
/// share activations but no output; `None` entries are skipped (callers fill fixed arrays).
/// Allocates nothing.
pub fn matmul_jobs(
    jobs: &mut [Option<MatJob<'_, '_>>],
    pool: Option<&rayon::ThreadPool>,
    isa: Isa,
) -> Result<(), KernelError> {
    if jobs.len() > MAX_JOBS {
        return Err(KernelError::Shape(format!(
            "{} products in one call (at most {MAX_JOBS})",
            jobs.len()
        )));
    }
    let mut dots: [Option<Dots>; MAX_JOBS] = [None; MAX_JOBS];
    for (j, job) in jobs.iter().enumerate() {
        let Some(job) = job else { continue };
        let k = kernels_for(job.w.dtype)?;
        check_len(
            "weight matrix",
            job.w.dtype,
            job.w.rows * job.w.cols,
            job.w.bytes.len(),
        )?;
        let in_range = match job.pick {
            Some(p) => p.len() == job.rows && p.iter().all(|&r| (r as usize) < job.acts.rows()),
            None => job.row0 + job.rows <= job.acts.rows(),
        };
        if job.acts.cols() != job.w.cols || !in_range {
            return Err(KernelError::Shape(format!(
                "job {j}: activation rows {}..{} of {}x{} against a weight of {} columns",
                job.row0,
                job.row0 + job.rows,
                job.acts.rows(),
                job.acts.cols(),
                job.w.cols
            )));
        }
        if job.y.len() != job.rows * job.w.rows {
            return Err(KernelError::Shape(format!(
                "job {j}: output has {} elements, expected {}x{}",
                job.y.len(),
                job.rows,
                job.w.rows
            )));
        }
        if !job.acts.is_prepared(k.act) {
            return Err(KernelError::Shape(format!(
                "job {j}: activations not prepared as {:?}",
                k.act
            )));
        }
        dots[j] = Some(Dots::new(job.w.dtype, isa)?);
    }
    let threads = pool.map(|p| p.current_num_threads()).unwrap_or(1);
    // Chunk sizes and the first chunk of each job (prefix sums), on the stack.
    let mut chunk = [0usize; MAX_JOBS];
    let mut first = [0usize; MAX_JOBS + 1];
    let mut outs = [SyncPtr(std::ptr::null_mut()); MAX_JOBS];
    // One activation row per job (decode): a chunk is a share of the job's weight rows. Several
    // (prefill's experts, whose token counts differ): a chunk is about an eighth of a thread's
    // share of the region's work (weight bytes x activation rows), so tasks are not tiny and
    // the experts with many tokens are cut finer.
    let work = |job: &MatJob<'_, '_>| job.w.bytes.len() * job.rows;
    let batched = jobs.iter().flatten().any(|j| j.rows > 1);
    let per_task = jobs.iter().flatten().map(work).sum::<usize>() / (threads * 8);
    for (j, job) in jobs.iter_mut().enumerate() {
        first[j + 1] = first[j];
        let Some(job) = job else { continue };
        let rows = if batched {
            per_task / (job.w.row_bytes() * job.rows).max(1)
        } else {
            job.w.rows / (threads * 2)
        };
        chunk[j] = rows.clamp(8, 4096).next_multiple_of(8);
        first[j + 1] += job.w.rows.div_ceil(chunk[j]);
        outs[j] = SyncPtr(job.y.as_mut_ptr());
    }
    let n = jobs.len();
    let total = first[n];
    let jobs = &*jobs;
    let (dots, chunk, first, outs) = (&dots, &chunk, &first, &outs);
    let one = |c: usize| {
        // The job whose chunks hold c: the last with first[j] <= c < first[j + 1].
        let j = first[1..=n].partition_point(|&f| f <= c);
        let Some(Some(job)) = jobs.get(j) else { return };
        let r0 = (c - first[j]) * chunk[j];
        let r1 = (r0 + chunk[j]).min(job.w.rows);
        let yp = &outs[j];
        if let Some(d) = dots[j] {
            let src = Src {
                acts: job.acts,
                a0: job.row0,
                rows: job.rows,
                pick: job.pick,
            };
            rows_range(job.w, src, d, r0, r1, &mut |i, v| {
                // SAFETY: i = t*rows + r < y.len() (checked above); weight row r of job j
                // belongs to exactly one chunk and jobs share no output.
                unsafe { *yp.0.add(i) = v }
            });
        }
    };
    match pool {
        // Decode's short products: the spinning gang when it is free, else rayon.
        Some(p) if threads > 1 && total > 1 => {
            if !SpinPool::get(threads).is_some_and(|g| g.try_run(total, &one)) {
                p.install(|| (0..total).into_par_iter().for_each(one))
            }
        }
        _ => (0..total).for_each(one),
    }
    Ok(())
}

/// Bytes of weight rows per tile in `matmul` (well inside a 1-2 MiB L2).
const TILE_BYTES: usize = 64 * 1024;
