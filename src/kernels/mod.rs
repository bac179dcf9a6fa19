//! Dequantization and dot/matrix-vector kernels, one file per tensor type, one function per ISA.
//!
//! Owns: turning encoded weight bytes into f32 (`dequantize`) and multiplying encoded weight
//! rows with activations (`matmul`, which is matvec when there is one activation row).
//! Does not own: where the bytes come from (format/, experts/), threads beyond the pool it is
//! handed, or model logic.
//!
//! Shape of the module:
//! - `act.rs`: activations prepared once per matmul in the format a weight type dots against
//!   (f32, 32-wide int8 blocks with their scales and sums also in contiguous arrays, or
//!   256-wide int8 super-blocks with 16-element sums).
//! - `isa.rs`: run-time ISA detection (AVX-512 > AVX2 > scalar), overridable with `SLUICE_ISA`.
//! - one file per type (`q4_k.rs`, ...): `pub(super) const KERNELS: Option<TypeKernels>` with a
//!   dequantizer (scalar, bit-identical to `gguf.quants.dequantize`) and dot functions per ISA.
//!   The scalar dot is always present and always tested; SIMD dots must agree with it within
//!   f32 summation-order noise.
//! - `kv.rs`: the KV cache's element types (`-ctk`/`-ctv`): row conversion, and attention's
//!   dots and weighted sums read straight from f16 / bf16 / q8_0 rows.
//! - `matmul.rs`: multi-threaded matrix x activations over rows.
//! - `spin.rs`: the spinning thread gang that runs decode's short regions (rayon runs the
//!   long ones).
//!
//! Invariant: a dot function receives `w` holding exactly `n / block_elems` whole blocks of its
//! type and an `ActRow` of `n` elements prepared in its `ActFormat`; the dispatcher checks both,
//! so kernels may index without re-validating.

/// `$f::<T $(, extra)*>(args)` for T = `$n` in 1..=8 (8 for anything larger): a tile kernel
/// made for each count of activation rows, chosen at run time.
macro_rules! by_tokens {
    ($n:expr, $f:ident [$($g:tt)*] ($($arg:expr),* $(,)?)) => {
        match $n {
            1 => $f::<1 $($g)*>($($arg),*),
            2 => $f::<2 $($g)*>($($arg),*),
            3 => $f::<3 $($g)*>($($arg),*),
            4 => $f::<4 $($g)*>($($arg),*),
            5 => $f::<5 $($g)*>($($arg),*),
            6 => $f::<6 $($g)*>($($arg),*),
            7 => $f::<7 $($g)*>($($arg),*),
            _ => $f::<8 $($g)*>($($arg),*),
        }
    };
}

/// `by_tokens!` for 9..=16 tokens (16 for anything above 15).
macro_rules! by_tokens16 {
    ($n:expr, $f:ident [$($g:tt)*] ($($arg:expr),* $(,)?)) => {
        match $n {
            9 => $f::<9 $($g)*>($($arg),*),
            10 => $f::<10 $($g)*>($($arg),*),
            11 => $f::<11 $($g)*>($($arg),*),
            12 => $f::<12 $($g)*>($($arg),*),
            13 => $f::<13 $($g)*>($($arg),*),
            14 => $f::<14 $($g)*>($($arg),*),
            15 => $f::<15 $($g)*>($($arg),*),
            _ => $f::<16 $($g)*>($($arg),*),
        }
    };
}

pub mod act;
pub mod attn;
pub mod isa;
pub mod kv;
mod matmul;
pub mod spin;

mod float;
mod fp8;
mod iq2_xxs;
// Grid i-quants (IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S, IQ1_S, IQ1_M).
mod iq1;
mod iq2_s;
mod iq2_xs;
mod iq3_s;
mod iq3_xxs;
pub(crate) mod iq_grids;
#[cfg(target_arch = "x86_64")]
mod iq_x86;
mod mxfp4;
mod q2_k;
mod q3_k;
mod q4_0;
mod q4_k;
mod q5_k;
mod q6_k;
mod q8_0;
pub mod quantize;
mod simd;
pub(crate) mod tables;
// quant-a types: Q4_1 Q5_0 Q5_1 IQ4_NL (shared loops in blocks32.rs), IQ4_XS, TQ1_0, TQ2_0.
mod blocks32;
pub(crate) mod iq4_nl;
mod iq4_xs;
mod q4_1;
mod q5_0;
mod q5_1;
// TQ1_0 and TQ2_0 share their four-row loop (ternary.rs).
mod ternary;
mod tq1_0;
mod tq2_0;

/// Super-block size of k-quants and i-quants.
pub const QK: usize = crate::dtype::QK_K;

pub use act::{ActFormat, ActRow, Acts, BlockQ8K, BlockQ8_32};
pub use fp8::dequantize_fp8_block_scaled;
pub use isa::Isa;
pub use matmul::{matmul, matmul_jobs, par_for, prepare_for, MatJob, WeightView, MAX_JOBS};
pub use simd::{prefetch_distance, read_sweep, set_prefetch_distance, DEFAULT_PREFETCH};

use crate::dtype::DType;

/// Dequantize whole blocks to f32. `out.len()` == blocks * block_elems.
pub type DequantFn = fn(blocks: &[u8], out: &mut [f32]);
/// Dot product of one encoded weight row with one prepared activation row.
pub type DotFn = fn(w: &[u8], a: &ActRow<'_>) -> f32;

/// The kernels of one tensor type.
pub struct TypeKernels {
    pub dtype: DType,
    /// Which activation format `dot_*` read from the `ActRow`.
    pub act: ActFormat,
    pub dequant: DequantFn,
    pub dot_scalar: DotFn,
    /// Only called after the dispatcher has checked the CPU has AVX2+FMA(+F16C).
    pub dot_avx2: Option<DotFn>,
    /// Only called after the dispatcher has checked the CPU has AVX-512 F/BW/VL(+VNNI).
    pub dot_avx512: Option<DotFn>,
}

/// One encoded weight row dotted with four activation rows: `out[r] = dot(w, a[r])`.
pub type Dot4Fn = fn(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]);

/// A type's four-row dots per ISA (prefill: the weight block is unpacked once for four rows).
/// Each must give, per row, exactly the bits of the same ISA's single-row dot.
pub struct Dot4Kernels {
    pub avx2: Option<Dot4Fn>,
    pub avx512: Option<Dot4Fn>,
}

/// Eight consecutive encoded weight rows (`w`: `8 * rb` bytes, row r at `r * rb`, each row
/// whole blocks) against one to eight activation rows: `out[t][r] = dot(row r, a[t])` for
/// t < a.len() (the other rows of `out` are left as they were).
pub type TileFn = TileNFn<8>;

/// An 8-row tile of up to N tokens: 8 weight rows `rb` bytes apart, up to N activation rows,
/// `out[t][r]` for t < a.len().
pub type TileNFn<const N: usize> =
    fn(w: &[u8], rb: usize, a: &[ActRow<'_>], out: &mut [[f32; 8]; N]);

/// An 8-row x 16-token tile: `TileFn` for up to 16 activation rows.
pub type Tile16Fn = TileNFn<16>;

/// A type's 16-token tile where it has one for `isa` (Q4_K on AVX2 and AVX-512, Q5_K on
/// AVX-512: the 8-token tile's per-block unpacking then serves twice the tokens), with the
/// single-row dot's bits (the same choice of instruction set as `tile_fn`).
pub fn tile16_fn(dtype: DType, isa: Isa) -> Option<Tile16Fn> {
    let k = kernels_for(dtype).ok()?;
    let t: &TileKernels<16> = match dtype {
        DType::Q4_K => &q4_k::TILE16,
        DType::Q5_K => &q5_k::TILE16,
        _ => return None,
    };
    match isa.min(Isa::detect()) {
        Isa::Avx512 if k.dot_avx512.is_some() => t.avx512,
        Isa::Avx512 | Isa::Avx2 if k.dot_avx2.is_some() => t.avx2,
        _ => None,
    }
}

/// A tile's result by `dot` one row and activation row at a time (a tile entry's fallback where
/// its instruction set is missing; `dot` the type's scalar dot, so the bits are the same).
pub(crate) fn tile_by_dots(
    w: &[u8],
    rb: usize,
    a: &[ActRow<'_>],
    out: &mut [[f32; 8]; 8],
    dot: fn(&[u8], &ActRow<'_>) -> f32,
) {
    for (o, t) in out.iter_mut().zip(a) {
        for (r, o) in o.iter_mut().enumerate() {
            *o = dot(&w[r * rb..(r + 1) * rb], t);
        }
    }
}

/// A type's 8-row x 8-token tile kernels per ISA (prefill: each weight block is unpacked once
/// for up to eight tokens and each activation block loaded once for several rows). Each must give,
/// per output, exactly the bits of the same ISA's single-row dot.
pub struct TileKernels<const N: usize = 8> {
    pub avx2: Option<TileNFn<N>>,
    pub avx512: Option<TileNFn<N>>,
}

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("tensor type {0} is not supported by sluice's kernels")]
    Unsupported(DType),
    #[error("{what}: expected {expected} bytes for {elems} elements of {dtype}, got {got}")]
    BadLength {
        what: &'static str,
        dtype: DType,
        elems: usize,
        expected: usize,
        got: usize,
    },
    #[error("{dtype}: {elems} elements is not a whole number of {block}-element blocks")]
    NotWholeBlocks {
        dtype: DType,
        elems: usize,
        block: usize,
    },
    #[error("shape mismatch: {0}")]
    Shape(String),
}

/// The kernel table for `dtype`, or a clear error if sluice cannot compute with it.
pub fn kernels_for(dtype: DType) -> Result<&'static TypeKernels, KernelError> {
    let k: Option<&'static TypeKernels> = match dtype {
        DType::F32 => float::F32_KERNELS.as_ref(),
        DType::F16 => float::F16_KERNELS.as_ref(),
        DType::BF16 => float::BF16_KERNELS.as_ref(),
        DType::Q8_0 => q8_0::KERNELS.as_ref(),
        DType::Q4_0 => q4_0::KERNELS.as_ref(),
        DType::Q2_K => q2_k::KERNELS.as_ref(),
        DType::Q3_K => q3_k::KERNELS.as_ref(),
        DType::Q4_K => q4_k::KERNELS.as_ref(),
        DType::Q5_K => q5_k::KERNELS.as_ref(),
        DType::Q6_K => q6_k::KERNELS.as_ref(),
        DType::IQ2_XXS => iq2_xxs::KERNELS.as_ref(),
        // Grid i-quants.
        DType::IQ3_XXS => iq3_xxs::KERNELS.as_ref(),
        DType::IQ3_S => iq3_s::KERNELS.as_ref(),
        DType::IQ2_XS => iq2_xs::KERNELS.as_ref(),
        DType::IQ2_S => iq2_s::KERNELS.as_ref(),
        DType::IQ1_S => iq1::KERNELS_S.as_ref(),
        DType::IQ1_M => iq1::KERNELS_M.as_ref(),
        DType::MXFP4 => mxfp4::KERNELS.as_ref(),
        // quant-a types
        DType::Q4_1 => q4_1::KERNELS.as_ref(),
        DType::Q5_0 => q5_0::KERNELS.as_ref(),
        DType::Q5_1 => q5_1::KERNELS.as_ref(),
        DType::IQ4_NL => iq4_nl::KERNELS.as_ref(),
        DType::IQ4_XS => iq4_xs::KERNELS.as_ref(),
        DType::TQ1_0 => tq1_0::KERNELS.as_ref(),
        DType::TQ2_0 => tq2_0::KERNELS.as_ref(),
        _ => None,
    };
    k.ok_or(KernelError::Unsupported(dtype))
}

/// Types with kernels in this build, in a stable order (tests and benchmarks iterate this).
pub fn supported_types() -> Vec<DType> {
    use DType::*;
    [
        F32, F16, BF16, Q8_0, Q4_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ2_XXS, MXFP4,
        // Grid i-quants.
        IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S, IQ1_S, IQ1_M,
    ]
    .into_iter()
    // quant-a types
    .chain([Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0])
    .filter(|t| kernels_for(*t).is_ok())
    .collect()
}

fn check_len(
    what: &'static str,
    dtype: DType,
    elems: usize,
    got: usize,
) -> Result<(), KernelError> {
    let (be, bb) = dtype
        .block_geometry()
        .ok_or(KernelError::Unsupported(dtype))?;
    if !elems.is_multiple_of(be) {
        return Err(KernelError::NotWholeBlocks {
            dtype,
            elems,
            block: be,
        });
    }
    let expected = elems / be * bb;
    if got != expected {
        return Err(KernelError::BadLength {
            what,
            dtype,
            elems,
            expected,
            got,
        });
    }
    Ok(())
}

/// Dequantize `bytes` (whole blocks of `dtype`) into `out` (one f32 per element).
pub fn dequantize(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Result<(), KernelError> {
    let k = kernels_for(dtype)?;
    check_len("dequantize", dtype, out.len(), bytes.len())?;
    (k.dequant)(bytes, out);
    Ok(())
}

/// The dot function for `dtype` at the best ISA not above `isa` that the type implements.
pub fn dot_fn(dtype: DType, isa: Isa) -> Result<DotFn, KernelError> {
    let k = kernels_for(dtype)?;
    let isa = isa.min(Isa::detect());
    Ok(match isa {
        Isa::Avx512 => k.dot_avx512.or(k.dot_avx2).unwrap_or(k.dot_scalar),
        Isa::Avx2 => k.dot_avx2.unwrap_or(k.dot_scalar),
        Isa::Scalar => k.dot_scalar,
    })
}

/// The four-row dot for `dtype` matching the single-row dot [`dot_fn`] picks at `isa`
/// (bit-identical to it, row by row), if the type has one at that ISA.
pub fn dot4_fn(dtype: DType, isa: Isa) -> Option<Dot4Fn> {
    let k = kernels_for(dtype).ok()?;
    let d4: &Dot4Kernels = match dtype {
        DType::Q4_K => &q4_k::DOT4,
        DType::Q5_K => &q5_k::DOT4,
        DType::Q6_K => &q6_k::DOT4,
        DType::Q8_0 => &q8_0::DOT4,
        DType::Q4_0 => &q4_0::DOT4,
        DType::Q4_1 => &q4_1::DOT4,
        DType::Q5_0 => &q5_0::DOT4,
        DType::Q5_1 => &q5_1::DOT4,
        DType::IQ4_NL => &iq4_nl::DOT4,
        DType::IQ4_XS => &iq4_xs::DOT4,
        DType::IQ2_XXS => &iq2_xxs::DOT4,
        DType::IQ2_XS => &iq2_xs::DOT4,
        DType::IQ2_S => &iq2_s::DOT4,
        DType::IQ3_XXS => &iq3_xxs::DOT4,
        DType::IQ3_S => &iq3_s::DOT4,
        DType::IQ1_S => &iq1::DOT4_S,
        DType::IQ1_M => &iq1::DOT4_M,
        DType::TQ1_0 => &tq1_0::DOT4,
        DType::TQ2_0 => &tq2_0::DOT4,
        _ => return None,
    };
    match isa.min(Isa::detect()) {
        Isa::Avx512 if k.dot_avx512.is_some() => d4.avx512,
        Isa::Avx512 | Isa::Avx2 if k.dot_avx2.is_some() => d4.avx2,
        _ => None,
    }
}

/// The 8x8 tile kernel for `dtype` matching the single-row dot [`dot_fn`] picks at `isa`
/// (bit-identical to it, output by output), if the type has one at that ISA.
pub fn tile_fn(dtype: DType, isa: Isa) -> Option<TileFn> {
    let k = kernels_for(dtype).ok()?;
    let t: &TileKernels = match dtype {
        DType::Q4_K => &q4_k::TILE,
        DType::Q8_0 => &q8_0::TILE,
        DType::Q5_K => &q5_k::TILE,
        DType::Q6_K => &q6_k::TILE,
        _ => return None,
    };
    match isa.min(Isa::detect()) {
        Isa::Avx512 if k.dot_avx512.is_some() => t.avx512,
        Isa::Avx512 | Isa::Avx2 if k.dot_avx2.is_some() => t.avx2,
        _ => None,
    }
}

/// One dot product of an encoded weight row with activations, checked. For tests and tools;
/// hot paths use [`matmul`].
pub fn dot(dtype: DType, isa: Isa, w: &[u8], acts: &Acts, row: usize) -> Result<f32, KernelError> {
    let k = kernels_for(dtype)?;
    check_len("dot", dtype, acts.cols(), w.len())?;
    if !acts.is_prepared(k.act) {
        return Err(KernelError::Shape(format!(
            "activations not prepared as {:?}",
            k.act
        )));
    }
    let f = dot_fn(dtype, isa)?;
    Ok(f(w, &acts.row(row)))
}
