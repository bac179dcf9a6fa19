//! Matvec throughput per tensor type, as GB/s of weight bytes read, beside the machine's memory
//! read bandwidth measured on the same buffer with the same threads.
//!
//! For each type: one buffer of random valid blocks much larger than the last-level cache (the
//! weights), one f32 activation row; repetitions alternate a read-only sweep of the buffer
//! (the ceiling) and a matvec over it (A B B A ...), and medians are reported. The ceiling is
//! the better of two sweeps, plain and with the kernels' software prefetch, since either can
//! win depending on the machine.

use crate::dtype::DType;
use crate::kernels::{self, Acts, Isa, KernelError, WeightView};
use rayon::prelude::*;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("cannot allocate {mib} MiB for the {dtype} weight buffer")]
    Alloc { dtype: DType, mib: usize },
    #[error("{cols} columns is not a whole number of {dtype} blocks ({block} elements)")]
    Cols {
        dtype: DType,
        cols: usize,
        block: usize,
    },
    #[error("--mb {mib} holds no whole {dtype} row of {cols} columns")]
    TooSmall {
        dtype: DType,
        mib: usize,
        cols: usize,
    },
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct KernelBenchOpts {
    /// Weight buffer size per type, MiB (should be several times the last-level cache).
    pub mib: usize,
    /// Columns per weight row (a multiple of 256 suits every type).
    pub cols: usize,
    /// Timed repetitions of each of matvec and sweep (after one warm-up of each).
    pub reps: usize,
    /// ISA cap for the matvec kernels (the sweep always uses the widest loads available).
    pub isa: Isa,
    /// Kernel prefetch distances to compare (bytes; 0 = off), each an arm of an interleaved
    /// A/B on the same buffer. Empty: the current distance only.
    pub prefetch: Vec<usize>,
    /// Activation rows per matmul (1: matvec, as in decode; more: a prefill-like batch, where
    /// GB/s still counts each weight byte once).
    pub batch: usize,
}

/// Median, min and max of a set of GB/s figures.
#[derive(Clone, Copy, Debug)]
pub struct Stats {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Stats {
    fn of(mut v: Vec<f64>) -> Stats {
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        let median = if n == 0 {
            0.0
        } else if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Stats {
            median,
            min: v.first().copied().unwrap_or(0.0),
            max: v.last().copied().unwrap_or(0.0),
        }
    }
}

/// One type's result.
#[derive(Clone, Debug)]
pub struct KernelResult {
    pub dtype: DType,
    /// The ISA the matvec actually ran (the cap, lowered to what the type and CPU have).
    pub isa: Isa,
    /// Kernel prefetch distance of this arm, bytes.
    pub prefetch: usize,
    pub rows: usize,
    pub cols: usize,
    /// Weight bytes read per matvec.
    pub bytes: usize,
    /// Matvec, GB/s (1e9 bytes) of weight bytes.
    pub matvec: Stats,
    /// Read-only sweep of the same buffer, GB/s: the better (by median) of a plain sweep and
    /// one with the kernels' software prefetch at `DEFAULT_PREFETCH`.
    pub read: Stats,
    /// The plain sweep alone (no software prefetch), GB/s.
    pub read_plain: Stats,
}

impl KernelResult {
    /// Matvec median over read-sweep median.
    pub fn ratio(&self) -> f64 {
        if self.read.median > 0.0 {
            self.matvec.median / self.read.median
        } else {
            0.0
        }
    }
}

/// Read every byte of `bytes` with `pool`'s threads, each over contiguous chunks, with
/// software prefetch `prefetch` bytes ahead (0: none); returns a checksum so the reads cannot
/// be optimised away.
pub fn parallel_read_sweep(bytes: &[u8], pool: &rayon::ThreadPool, prefetch: usize) -> u64 {
    let threads = pool.current_num_threads().max(1);
    let chunk = (bytes.len() / (threads * 8))
        .max(1 << 20)
        .next_multiple_of(256);
    let isa = Isa::hardware();
    pool.install(|| {
        bytes
            .par_chunks(chunk)
            .map(|c| kernels::read_sweep(c, isa, prefetch))
            .reduce(|| 0, u64::wrapping_add)
    })
}

/// Measure the matvec of `dtype` against the read sweep, one result per prefetch arm; see the
/// module doc. Leaves the prefetch distance as it found it.
pub fn bench_type(
    dtype: DType,
    opts: &KernelBenchOpts,
    pool: &rayon::ThreadPool,
) -> Result<Vec<KernelResult>, BenchError> {
    let before = kernels::prefetch_distance();
    let r = bench_arms(dtype, opts, pool);
    kernels::set_prefetch_distance(before);
    r
}

fn bench_arms(
    dtype: DType,
    opts: &KernelBenchOpts,
    pool: &rayon::ThreadPool,
) -> Result<Vec<KernelResult>, BenchError> {
    let arms = if opts.prefetch.is_empty() {
        vec![kernels::prefetch_distance()]
    } else {
        opts.prefetch.clone()
    };
    let k = kernels::kernels_for(dtype)?;
    let (be, bb) = dtype
        .block_geometry()
        .ok_or(KernelError::Unsupported(dtype))?;
    if opts.cols == 0 || !opts.cols.is_multiple_of(be) {
        return Err(BenchError::Cols {
            dtype,
            cols: opts.cols,
            block: be,
        });
    }
    let row_bytes = opts.cols / be * bb;
    let rows = opts.mib * (1 << 20) / row_bytes;
    if rows == 0 {
        return Err(BenchError::TooSmall {
            dtype,
            mib: opts.mib,
            cols: opts.cols,
        });
    }
    let n = rows * row_bytes;
    let mut w: Vec<u8> = Vec::new();
    w.try_reserve_exact(n).map_err(|_| BenchError::Alloc {
        dtype,
        mib: opts.mib,
    })?;
    w.resize(n, 0);
    pool.install(|| {
        w.par_chunks_mut(bb * 4096)
            .enumerate()
            .for_each(|(i, c)| fill_valid_blocks(dtype, c, 0x5EED ^ i as u64))
    });
    let view = WeightView::new(dtype, &w, rows, opts.cols)?;

    let mut rng = SplitMix(42);
    let batch = opts.batch.max(1);
    let x: Vec<f32> = (0..opts.cols * batch)
        .map(|_| rng.unit() * 2.0 - 1.0)
        .collect();
    let mut acts = Acts::new();
    acts.load(&x, batch, opts.cols);
    let mut y = vec![0.0f32; rows * batch];

    let gbps = |secs: f64| n as f64 / secs / 1e9;
    let mut sink = 0u64;
    // Warm-up: faults the pages in, prepares the activations, spins the pool up.
    kernels::matmul(&view, &mut acts, &mut y, Some(pool), opts.isa)?;
    sink ^= parallel_read_sweep(&w, pool, 0);
    let (mut rd, mut rd_pf) = (Vec::new(), Vec::new());
    let mut mv = vec![Vec::new(); arms.len()];
    let steps = arms.len() + 1;
    for r in 0..opts.reps.max(1) {
        // Rotate the order each repetition (sweep first, then last, ...): A B B A for one arm.
        for k in 0..steps {
            let step = if r % 2 == 0 { k } else { steps - 1 - k };
            if step == 0 {
                let t = Instant::now();
                sink ^= parallel_read_sweep(&w, pool, 0);
                rd.push(gbps(t.elapsed().as_secs_f64()));
                let t = Instant::now();
                sink ^= parallel_read_sweep(&w, pool, kernels::DEFAULT_PREFETCH);
                rd_pf.push(gbps(t.elapsed().as_secs_f64()));
            } else {
                kernels::set_prefetch_distance(arms[step - 1]);
                let t = Instant::now();
                kernels::matmul(&view, &mut acts, &mut y, Some(pool), opts.isa)?;
                mv[step - 1].push(gbps(t.elapsed().as_secs_f64()));
            }
        }
    }
    std::hint::black_box((sink, &y));
    let isa_used = match opts.isa.min(Isa::detect()) {
        Isa::Avx512 if k.dot_avx512.is_some() => Isa::Avx512,
        Isa::Avx512 | Isa::Avx2 if k.dot_avx2.is_some() => Isa::Avx2,
        _ => Isa::Scalar,
    };
    let (read_plain, read_pf) = (Stats::of(rd), Stats::of(rd_pf));
    let read = if read_pf.median > read_plain.median {
        read_pf
    } else {
        read_plain
    };
    Ok(arms
        .iter()
        .zip(mv)
        .map(|(&prefetch, mv)| KernelResult {
            dtype,
            isa: isa_used,
            prefetch,
            rows,
            cols: opts.cols,
            bytes: n,
            matvec: Stats::of(mv),
            read,
            read_plain,
        })
        .collect())
}

/// Deterministic pseudo-random numbers (splitmix64).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// An f16 scale of magnitude in [1e-3, 0.1) and random sign, little-endian.
    fn scale_f16(&mut self) -> [u8; 2] {
        let v = 1e-3 + self.unit() * 0.099;
        let v = if self.next() & 1 == 0 { v } else { -v };
        half::f16::from_f32(v).to_bits().to_le_bytes()
    }
}

/// Fill `buf` (whole blocks of `dtype`) with random but valid blocks: random codes, finite
/// moderate scales at the positions of ggml's block structs (random bytes there would give
/// inf/NaN or denormal scales, which no quantizer writes and which would distort timings).
pub fn fill_valid_blocks(dtype: DType, buf: &mut [u8], seed: u64) {
    let mut r = SplitMix(seed);
    match dtype {
        DType::F32 => {
            for c in buf.chunks_exact_mut(4) {
                c.copy_from_slice(&(r.unit() * 2.0 - 1.0).to_le_bytes());
            }
            return;
        }
        DType::F16 => {
            for c in buf.chunks_exact_mut(2) {
                c.copy_from_slice(
                    &half::f16::from_f32(r.unit() * 2.0 - 1.0)
                        .to_bits()
                        .to_le_bytes(),
                );
            }
            return;
        }
        DType::BF16 => {
            for c in buf.chunks_exact_mut(2) {
                c.copy_from_slice(
                    &half::bf16::from_f32(r.unit() * 2.0 - 1.0)
                        .to_bits()
                        .to_le_bytes(),
                );
            }
            return;
        }
        _ => {}
    }
    for c in buf.chunks_mut(8) {
        let v = r.next().to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
    // Offsets of the f16 scale fields in each block.
    let scales: &[usize] = match dtype {
        DType::Q4_0 | DType::Q8_0 | DType::IQ2_XXS => &[0],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q6_K => &[208],
        // quant-a types
        DType::Q5_0 | DType::IQ4_NL | DType::IQ4_XS => &[0],
        DType::Q4_1 | DType::Q5_1 => &[0, 2],
        DType::TQ1_0 => &[52],
        DType::TQ2_0 => &[64],
        // Grid i-quants (IQ1_M's d is spread over four nibbles: set below).
        DType::IQ3_XXS | DType::IQ3_S | DType::IQ2_XS | DType::IQ2_S | DType::IQ1_S => &[0],
        _ => &[],
    };
    let Some((_, bb)) = dtype.block_geometry() else {
        return;
    };
    for blk in buf.chunks_exact_mut(bb) {
        for &off in scales {
            blk[off..off + 2].copy_from_slice(&r.scale_f16());
        }
        if dtype == DType::IQ1_M {
            // f16 d in the top nibbles of the four scale words (bytes 49, 51, 53, 55).
            let d = u16::from_le_bytes(r.scale_f16());
            for w in 0..4 {
                let at = 49 + 2 * w;
                blk[at] = (blk[at] & 0x0f) | ((((d >> (4 * w)) & 0xf) as u8) << 4);
            }
        }
        if dtype == DType::MXFP4 {
            // E8M0 shared exponent near 2^0.
            blk[0] = 110 + (r.next() % 25) as u8;
        }
    }
}

/// The CPU model as /proc/cpuinfo names it, if readable.
pub fn cpu_model() -> Option<String> {
    let s = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    s.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|m| m.trim().to_string())
}
