//! Activations prepared for the dot kernels.
//!
//! Weight types dot against one of three activation formats (`ActFormat`):
//! - `F32`: plain f32 (float weight types).
//! - `Q8_32`: blocks of 32 int8 with one f32 scale (Q8_0, Q4_0, MXFP4 weights).
//! - `Q8K`: super-blocks of 256 int8 with one f32 scale and the sums of each 16-element group
//!   (k-quants and i-quants; the group sums let the kernels apply per-group minimums cheaply).
//!
//! Quantization: for each block, d = max|x| / 127 and q = round(x / d), so |x - d*q| <= d/2.
//! That is the whole error budget the dot tests allow for (see `tests/kernels_ref.rs` and
//! docs/PERFORMANCE.md).
//!
//! Invariant: `Acts` allocates only when asked for more rows/columns than it has held before;
//! the decode loop sizes it once.

use super::QK;

/// 32 int8 activations with their scale.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8_32 {
    pub d: f32,
    pub qs: [i8; 32],
}

/// 256 int8 activations with their scale and per-16 sums of `qs`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; 256],
    pub bsums: [i16; 16],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActFormat {
    F32,
    Q8_32,
    Q8K,
}

/// One activation row in every format that has been prepared (unprepared ones are empty).
pub struct ActRow<'a> {
    pub f32: &'a [f32],
    pub q8_32: &'a [BlockQ8_32],
    pub q8k: &'a [BlockQ8K],
}

/// A batch of activation rows (`rows` x `cols`), with lazily prepared quantized copies.
pub struct Acts {
    rows: usize,
    cols: usize,
    f32: Vec<f32>,
    q8_32: Vec<BlockQ8_32>,
    q8k: Vec<BlockQ8K>,
    ready_q8_32: bool,
    ready_q8k: bool,
}

const ZERO32: BlockQ8_32 = BlockQ8_32 { d: 0.0, qs: [0; 32] };
const ZEROK: BlockQ8K = BlockQ8K { d: 0.0, qs: [0; 256], bsums: [0; 16] };

impl Default for Acts {
    fn default() -> Self {
        Acts::new()
    }
}

impl Acts {
    pub fn new() -> Acts {
        Acts { rows: 0, cols: 0, f32: Vec::new(), q8_32: Vec::new(), q8k: Vec::new(), ready_q8_32: false, ready_q8k: false }
    }

    /// Pre-size for up to `rows` x `cols` so later `load`s of that size do not allocate.
    pub fn with_capacity(rows: usize, cols: usize) -> Acts {
        let mut a = Acts::new();
        a.f32.reserve(rows * cols);
        a.q8_32.reserve(rows * cols.div_ceil(32));
        a.q8k.reserve(rows * cols.div_ceil(QK));
        a
    }

    /// Copy `x` (`rows` x `cols`, row-major) in; quantized copies are made on `prepare`.
    pub fn load(&mut self, x: &[f32], rows: usize, cols: usize) {
        assert_eq!(x.len(), rows * cols, "Acts::load: x has {} elements, expected {rows}x{cols}", x.len());
        self.rows = rows;
        self.cols = cols;
        self.f32.clear();
        self.f32.extend_from_slice(x);
        self.ready_q8_32 = false;
        self.ready_q8k = false;
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
        }
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
                for (xb, qb) in self.f32.chunks_exact(32).zip(self.q8_32.iter_mut()) {
                    quantize_q8_32(xb, qb);
                }
                self.ready_q8_32 = true;
            }
            ActFormat::Q8K => {
                if self.ready_q8k || !self.cols.is_multiple_of(QK) {
                    return;
                }
                let nb = self.cols / QK;
                self.q8k.clear();
                self.q8k.resize(self.rows * nb, ZEROK);
                for (xb, qb) in self.f32.chunks_exact(QK).zip(self.q8k.iter_mut()) {
                    quantize_q8k(xb, qb);
                }
                self.ready_q8k = true;
            }
        }
    }

    /// Row `i` in every prepared format.
    pub fn row(&self, i: usize) -> ActRow<'_> {
        let c = self.cols;
        let f32 = &self.f32[i * c..(i + 1) * c];
        let q8_32 = if self.ready_q8_32 { &self.q8_32[i * (c / 32)..(i + 1) * (c / 32)] } else { &[][..] };
        let q8k = if self.ready_q8k { &self.q8k[i * (c / QK)..(i + 1) * (c / QK)] } else { &[][..] };
        ActRow { f32, q8_32, q8k }
    }
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// d = max|x|/127, q = round(x/d).
pub fn quantize_q8_32(x: &[f32], out: &mut BlockQ8_32) {
    let m = amax(x);
    let d = m / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    out.d = d;
    for (q, v) in out.qs.iter_mut().zip(x) {
        *q = (v * id).round().clamp(-127.0, 127.0) as i8;
    }
}

/// d = max|x|/127 over 256 values, q = round(x/d), bsums = sums of each 16 q.
pub fn quantize_q8k(x: &[f32], out: &mut BlockQ8K) {
    let m = amax(x);
    let d = m / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    out.d = d;
    for (q, v) in out.qs.iter_mut().zip(x) {
        *q = (v * id).round().clamp(-127.0, 127.0) as i8;
    }
    for (s, g) in out.bsums.iter_mut().zip(out.qs.chunks_exact(16)) {
        *s = g.iter().map(|&q| q as i16).sum();
    }
}
