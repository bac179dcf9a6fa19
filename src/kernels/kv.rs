//! KV cache rows in a chosen precision (`-ctk` / `-ctv`, llama.cpp's spellings): the row
//! conversion done once per stored position, and attention's two reads of stored rows with no
//! dequantized copy of the cache: the dot of an f32 query with a key row, and the weighted sum
//! of value rows.
//!
//! Owns: `KvType` (f32, f16, bf16, q8_0 with GGUF's byte layouts: little-endian halves; q8_0 in
//! 34-byte blocks of 32, an f16 scale then 32 int8), `store_row` / `load_row`, and `KvKernels`
//! (dot, four dots, weighted sum) per ISA. Does not own: where rows live (model/state.rs) or
//! which cache follows which flag (model/config.rs, engine/).
//! Invariant: every stored element widens to f32 exactly (a q8_0 element `d * q` has at most
//! 11 + 8 significant bits), and the kernels sum in a fixed order with fused multiply-adds (a
//! dot in 16 lanes, lane l an FMA chain over elements 16c + l, the lanes then added in order;
//! a weighted sum per column, an FMA chain over the rows in order), so every ISA gives the
//! scalar path's bits (`f32::mul_add` is the same single rounding as the SIMD FMA).

use super::Isa;
use crate::dtype::DType;

/// Elements per q8_0 block and its bytes (f16 scale + 32 int8).
pub const Q8_BLOCK: usize = 32;
pub const Q8_BYTES: usize = 34;

/// The element type of one side (keys or values) of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvType {
    F32,
    F16,
    BF16,
    Q8_0,
}

impl KvType {
    pub const ALL: [KvType; 4] = [KvType::F32, KvType::F16, KvType::BF16, KvType::Q8_0];

    /// llama.cpp's spelling (`f32`, `f16`, `bf16`, `q8_0`).
    pub fn parse(s: &str) -> Option<KvType> {
        KvType::ALL.into_iter().find(|t| t.name() == s)
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::BF16 => "bf16",
            KvType::Q8_0 => "q8_0",
        }
    }

    /// The GGUF tensor type with this byte layout.
    pub fn dtype(self) -> DType {
        match self {
            KvType::F32 => DType::F32,
            KvType::F16 => DType::F16,
            KvType::BF16 => DType::BF16,
            KvType::Q8_0 => DType::Q8_0,
        }
    }

    /// A stable code for files that record the type (`--kv-dir` sessions).
    pub fn code(self) -> u32 {
        match self {
            KvType::F32 => 0,
            KvType::F16 => 1,
            KvType::BF16 => 2,
            KvType::Q8_0 => 3,
        }
    }

    pub fn from_code(c: u32) -> Option<KvType> {
        KvType::ALL.into_iter().find(|t| t.code() == c)
    }

    /// Elements a row width must be a multiple of (q8_0: its 32-element blocks).
    pub fn block(self) -> usize {
        match self {
            KvType::Q8_0 => Q8_BLOCK,
            _ => 1,
        }
    }

    /// Bytes of a row of `width` elements (`width` a multiple of `block()`).
    pub fn row_bytes(self, width: usize) -> usize {
        match self {
            KvType::F32 => 4 * width,
            KvType::F16 | KvType::BF16 => 2 * width,
            KvType::Q8_0 => width / Q8_BLOCK * Q8_BYTES,
        }
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The bytes of f32s (every f32 is 4 plain bytes; u8 has no alignment).
pub fn f32_bytes(x: &[f32]) -> &[u8] {
    // SAFETY: the byte view covers exactly the slice's memory; u8 needs no alignment and any
    // f32 is 4 initialised bytes.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
}

/// The writable bytes of f32s (any 4 bytes are some f32, so every write leaves valid floats).
pub fn f32_bytes_mut(x: &mut [f32]) -> &mut [u8] {
    // SAFETY: as `f32_bytes`; every bit pattern is a valid f32, and the view borrows `x`
    // mutably, so nothing else reads it meanwhile.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr() as *mut u8, std::mem::size_of_val(x)) }
}

/// f32 -> f16 bits, round to nearest even (numpy's `astype(float16)`, F16C's conversion).
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// f32 -> bf16 bits as ggml (`ggml_compute_fp32_to_bf16`, gguf's BF16 quantizer): NaN made
/// quiet, otherwise round to nearest even.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    ((u as u64 + (0x7fff + ((u >> 16) & 1)) as u64) >> 16) as u16
}

/// One q8_0 block of 32 values as gguf's reference quantizer writes it: d = max|x| / 127,
/// q = round-half-away(x / d) (computed as x * (1/d)), d stored as f16.
pub fn quantize_q8_0_block(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for (o, v) in out[2..Q8_BYTES].iter_mut().zip(x) {
        *o = (v * id).round() as i8 as u8;
    }
}

/// Write `src` (one row) as `ty` into `dst` (`ty.row_bytes(src.len())` bytes).
pub fn store_row(ty: KvType, src: &[f32], dst: &mut [u8]) {
    assert!(
        src.len().is_multiple_of(ty.block()) && dst.len() == ty.row_bytes(src.len()),
        "kv store_row: {} {ty} elements into {} bytes",
        src.len(),
        dst.len()
    );
    match ty {
        KvType::F32 => dst.copy_from_slice(f32_bytes(src)),
        KvType::F16 => {
            #[cfg(target_arch = "x86_64")]
            if Isa::detect() >= Isa::Avx2 {
                // SAFETY: the CPU has AVX2+F16C (`Isa::detect` never exceeds the hardware);
                // `dst` holds 2 bytes per element of `src` (asserted above).
                unsafe { x86::f16_store_avx2(src, dst) };
                return;
            }
            store_f16_scalar(src, dst)
        }
        KvType::BF16 => {
            for (o, v) in dst.chunks_exact_mut(2).zip(src) {
                o.copy_from_slice(&f32_to_bf16(*v).to_le_bytes());
            }
        }
        KvType::Q8_0 => {
            for (o, x) in dst
                .chunks_exact_mut(Q8_BYTES)
                .zip(src.chunks_exact(Q8_BLOCK))
            {
                quantize_q8_0_block(x, o);
            }
        }
    }
}

fn store_f16_scalar(src: &[f32], dst: &mut [u8]) {
    for (o, v) in dst.chunks_exact_mut(2).zip(src) {
        o.copy_from_slice(&f32_to_f16(*v).to_le_bytes());
    }
}

/// The f32 values of a stored row (exact; `dst.len()` elements).
pub fn load_row(ty: KvType, src: &[u8], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let (n, isa) = (dst.len(), Isa::detect());
        if n.is_multiple_of(16) && isa >= Isa::Avx2 && src.len() >= ty.row_bytes(n) {
            macro_rules! simd {
                ($e:ty) => {
                    // SAFETY: the CPU has the ISA (`Isa::detect` never exceeds the hardware);
                    // `src` holds the bytes of n elements, `dst` n floats, n a multiple of 16.
                    unsafe { x86::load_simd::<$e>(src.as_ptr(), dst, isa == Isa::Avx512) }
                };
            }
            match ty {
                KvType::F32 => simd!(F32E),
                KvType::F16 => simd!(F16E),
                KvType::BF16 => simd!(Bf16E),
                KvType::Q8_0 => simd!(Q8E),
            }
            return;
        }
    }
    for (i, o) in dst.iter_mut().enumerate() {
        *o = match ty {
            KvType::F32 => F32E::get(src, i),
            KvType::F16 => F16E::get(src, i),
            KvType::BF16 => Bf16E::get(src, i),
            KvType::Q8_0 => Q8E::get(src, i),
        };
    }
}

/// `dot(q, row)` of an f32 query with a stored row of `q.len()` elements.
pub type KvDotFn = fn(q: &[f32], row: &[u8]) -> f32;
/// Four such dots (one query, four rows), each with the single dot's bits.
pub type KvDot4Fn = fn(q: &[f32], rows: [&[u8]; 4]) -> [f32; 4];
/// `o = sum_j w[j] * row j`, row j at byte `j * stride` of `rows`, `o.len()` elements each:
/// the bits of `o.fill(0.0)` and one `axpy` per row in order.
pub type KvWeightedFn = fn(o: &mut [f32], w: &[f32], rows: &[u8], stride: usize);
/// `o += w * row` (`o.len()` elements; rows picked one by one, as a sparse selection's).
pub type KvAxpyFn = fn(o: &mut [f32], w: f32, row: &[u8]);

/// Attention's reads of one stored type at one ISA.
#[derive(Clone, Copy)]
pub struct KvKernels {
    pub ty: KvType,
    pub dot: KvDotFn,
    pub dot4: KvDot4Fn,
    pub weighted: KvWeightedFn,
    pub axpy: KvAxpyFn,
}

/// The kernels for `ty` at the best ISA not above `isa` (and this CPU).
pub fn kv_kernels(ty: KvType, isa: Isa) -> KvKernels {
    let isa = isa.min(Isa::detect());
    macro_rules! pick {
        ($e:ty) => {{
            #[cfg(target_arch = "x86_64")]
            match isa {
                Isa::Avx512 => {
                    return KvKernels {
                        ty,
                        dot: x86::dot_avx512::<$e>,
                        dot4: x86::dot4_avx512::<$e>,
                        weighted: x86::weighted_avx512::<$e>,
                        axpy: x86::axpy_avx512::<$e>,
                    }
                }
                Isa::Avx2 => {
                    return KvKernels {
                        ty,
                        dot: x86::dot_avx2::<$e>,
                        dot4: x86::dot4_avx2::<$e>,
                        weighted: x86::weighted_avx2::<$e>,
                        axpy: x86::axpy_avx2::<$e>,
                    }
                }
                Isa::Scalar => {}
            }
            KvKernels {
                ty,
                dot: dot_scalar::<$e>,
                dot4: dot4_scalar::<$e>,
                weighted: weighted_scalar::<$e>,
                axpy: axpy_scalar::<$e>,
            }
        }};
    }
    match ty {
        KvType::F32 => pick!(F32E),
        KvType::F16 => pick!(F16E),
        KvType::BF16 => pick!(Bf16E),
        KvType::Q8_0 => pick!(Q8E),
    }
}

/// One stored element type: element `i` of a row as f32 (exact), and SIMD loads of 8 / 16
/// consecutive elements starting at a multiple of 8 / 16.
trait Elem {
    /// Bytes a row of `n` elements takes.
    fn bytes(n: usize) -> usize;
    fn get(row: &[u8], i: usize) -> f32;
    #[cfg(target_arch = "x86_64")]
    /// # Safety
    /// AVX2+F16C; `row` valid for the bytes of elements `0..i + 8`, `i` a multiple of 8.
    unsafe fn load8(row: *const u8, i: usize) -> std::arch::x86_64::__m256;
    #[cfg(target_arch = "x86_64")]
    /// # Safety
    /// AVX-512F/BW + F16C; `row` valid for the bytes of elements `0..i + 16`, `i` a multiple
    /// of 16.
    unsafe fn load16(row: *const u8, i: usize) -> std::arch::x86_64::__m512;
}

struct F32E;
struct F16E;
struct Bf16E;
struct Q8E;

#[inline(always)]
fn u16_at(row: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([row[at], row[at + 1]])
}

impl Elem for F32E {
    fn bytes(n: usize) -> usize {
        4 * n
    }
    #[inline(always)]
    fn get(row: &[u8], i: usize) -> f32 {
        f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]])
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(row: *const u8, i: usize) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps((row as *const f32).add(i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(row: *const u8, i: usize) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps((row as *const f32).add(i))
    }
}

impl Elem for F16E {
    fn bytes(n: usize) -> usize {
        2 * n
    }
    #[inline(always)]
    fn get(row: &[u8], i: usize) -> f32 {
        super::float::f16_to_f32(u16_at(row, 2 * i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(row: *const u8, i: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(row.add(2 * i) as *const __m128i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(row: *const u8, i: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(row.add(2 * i) as *const __m256i))
    }
}

impl Elem for Bf16E {
    fn bytes(n: usize) -> usize {
        2 * n
    }
    #[inline(always)]
    fn get(row: &[u8], i: usize) -> f32 {
        super::float::bf16_to_f32(u16_at(row, 2 * i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(row: *const u8, i: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(row.add(2 * i) as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(row: *const u8, i: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(row.add(2 * i) as *const __m256i));
        _mm512_castsi512_ps(_mm512_slli_epi32(h, 16))
    }
}

impl Elem for Q8E {
    fn bytes(n: usize) -> usize {
        n / Q8_BLOCK * Q8_BYTES
    }
    #[inline(always)]
    fn get(row: &[u8], i: usize) -> f32 {
        let b = i / Q8_BLOCK * Q8_BYTES;
        let d = super::float::f16_to_f32(u16_at(row, b));
        d * (row[b + 2 + i % Q8_BLOCK] as i8 as f32)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(row: *const u8, i: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let b = row.add(i / Q8_BLOCK * Q8_BYTES);
        let d = _mm256_cvtph_ps(_mm_set1_epi16(std::ptr::read_unaligned(b as *const i16)));
        let q = _mm_loadl_epi64(b.add(2 + i % Q8_BLOCK) as *const __m128i);
        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(row: *const u8, i: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let b = row.add(i / Q8_BLOCK * Q8_BYTES);
        let d = _mm512_cvtph_ps(_mm256_set1_epi16(std::ptr::read_unaligned(b as *const i16)));
        let q = _mm_loadu_si128(b.add(2 + i % Q8_BLOCK) as *const __m128i);
        _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)))
    }
}

/// 16 lane sums in order after the remainder's sum: the dot's ending.
#[inline(always)]
fn finish(rem: f32, lanes: &[f32; 16]) -> f32 {
    let mut s = rem;
    for &v in lanes {
        s += v;
    }
    s
}

/// The products of elements `from..q.len()` summed in order (`Iterator::sum`, as `dot`).
#[inline(always)]
fn tail<E: Elem>(q: &[f32], row: &[u8], from: usize) -> f32 {
    (from..q.len()).map(|i| q[i] * E::get(row, i)).sum()
}

fn dot_scalar<E: Elem>(q: &[f32], row: &[u8]) -> f32 {
    assert!(row.len() >= E::bytes(q.len()), "kv dot: short row");
    let full = q.len() / 16 * 16;
    let mut acc = [0.0f32; 16];
    for c in (0..full).step_by(16) {
        for (i, a) in acc.iter_mut().enumerate() {
            *a = q[c + i].mul_add(E::get(row, c + i), *a);
        }
    }
    finish(tail::<E>(q, row, full), &acc)
}

fn dot4_scalar<E: Elem>(q: &[f32], rows: [&[u8]; 4]) -> [f32; 4] {
    rows.map(|r| dot_scalar::<E>(q, r))
}

fn weighted_scalar<E: Elem>(o: &mut [f32], w: &[f32], rows: &[u8], stride: usize) {
    check_weighted::<E>(o.len(), w.len(), rows.len(), stride);
    o.fill(0.0);
    for (j, &wj) in w.iter().enumerate() {
        let row = &rows[j * stride..];
        for (c, x) in o.iter_mut().enumerate() {
            *x = wj.mul_add(E::get(row, c), *x);
        }
    }
}

fn axpy_scalar<E: Elem>(o: &mut [f32], w: f32, row: &[u8]) {
    assert!(row.len() >= E::bytes(o.len()), "kv axpy: short row");
    for (c, x) in o.iter_mut().enumerate() {
        *x = w.mul_add(E::get(row, c), *x);
    }
}

fn check_weighted<E: Elem>(n: usize, rows: usize, have: usize, stride: usize) {
    assert!(
        rows == 0 || have >= (rows - 1) * stride + E::bytes(n),
        "kv weighted: {rows} rows of {n} at stride {stride} need more than {have} bytes"
    );
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{check_weighted, finish, tail, Elem, Isa};
    use std::arch::x86_64::*;

    /// f32 -> f16 (round to nearest even, as the scalar path), 8 at a time, scalar tail.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn f16_store_avx2(src: &[f32], dst: &mut [u8]) {
        let n = src.len();
        let mut i = 0;
        while i + 8 <= n {
            let h =
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
            _mm_storeu_si128(dst.as_mut_ptr().add(2 * i) as *mut __m128i, h);
            i += 8;
        }
        super::store_f16_scalar(&src[i..], &mut dst[2 * i..]);
    }

    // The safe wrappers: each checks the CPU and the lengths, then enters the body; rows whose
    // length is not a multiple of 16 take the scalar path (the same bits by construction).

    pub(super) fn dot_avx512<E: Elem>(q: &[f32], row: &[u8]) -> f32 {
        let n = q.len();
        if !Isa::Avx512.supported() || !n.is_multiple_of(16) || row.len() < E::bytes(n) {
            return super::dot_scalar::<E>(q, row);
        }
        // SAFETY: AVX-512 present (checked); `row` holds the bytes of n elements, `q` n.
        unsafe { dot1_512::<E>(q.as_ptr(), row.as_ptr(), n) }
    }

    pub(super) fn dot_avx2<E: Elem>(q: &[f32], row: &[u8]) -> f32 {
        let n = q.len();
        if !Isa::Avx2.supported() || !n.is_multiple_of(16) || row.len() < E::bytes(n) {
            return super::dot_scalar::<E>(q, row);
        }
        // SAFETY: AVX2+F16C present (checked); `row` holds the bytes of n elements, `q` n.
        unsafe { dot1_256::<E>(q.as_ptr(), row.as_ptr(), n) }
    }

    pub(super) fn dot4_avx512<E: Elem>(q: &[f32], rows: [&[u8]; 4]) -> [f32; 4] {
        let n = q.len();
        if !Isa::Avx512.supported()
            || !n.is_multiple_of(16)
            || rows.iter().any(|r| r.len() < E::bytes(n))
        {
            return super::dot4_scalar::<E>(q, rows);
        }
        // SAFETY: AVX-512 present (checked); every row holds the bytes of n elements.
        unsafe { dot4_512::<E>(q.as_ptr(), rows.map(|r| r.as_ptr()), n) }
    }

    pub(super) fn dot4_avx2<E: Elem>(q: &[f32], rows: [&[u8]; 4]) -> [f32; 4] {
        let n = q.len();
        if !Isa::Avx2.supported()
            || !n.is_multiple_of(16)
            || rows.iter().any(|r| r.len() < E::bytes(n))
        {
            return super::dot4_scalar::<E>(q, rows);
        }
        // SAFETY: AVX2+F16C present (checked); every row holds the bytes of n elements.
        unsafe { dot4_256::<E>(q.as_ptr(), rows.map(|r| r.as_ptr()), n) }
    }

    pub(super) fn weighted_avx512<E: Elem>(o: &mut [f32], w: &[f32], rows: &[u8], stride: usize) {
        let n = o.len();
        if !Isa::Avx512.supported() || !n.is_multiple_of(16) {
            return super::weighted_scalar::<E>(o, w, rows, stride);
        }
        check_weighted::<E>(n, w.len(), rows.len(), stride);
        // SAFETY: AVX-512 present (checked); every row read lies in `rows` (checked above),
        // `o` has n elements, a multiple of 16.
        unsafe { weighted_512::<E>(o, w, rows.as_ptr(), stride) }
    }

    pub(super) fn weighted_avx2<E: Elem>(o: &mut [f32], w: &[f32], rows: &[u8], stride: usize) {
        let n = o.len();
        if !Isa::Avx2.supported() || !n.is_multiple_of(16) {
            return super::weighted_scalar::<E>(o, w, rows, stride);
        }
        check_weighted::<E>(n, w.len(), rows.len(), stride);
        // SAFETY: AVX2+F16C present (checked); rows in bounds (checked), n a multiple of 16.
        unsafe { weighted_256::<E>(o, w, rows.as_ptr(), stride) }
    }

    pub(super) fn axpy_avx512<E: Elem>(o: &mut [f32], w: f32, row: &[u8]) {
        let n = o.len();
        if !Isa::Avx512.supported() || !n.is_multiple_of(16) || row.len() < E::bytes(n) {
            return super::axpy_scalar::<E>(o, w, row);
        }
        // SAFETY: AVX-512 present (checked); `row` holds the bytes of n elements, `o` n
        // floats, n a multiple of 16.
        unsafe { axpy_512::<E>(o, w, row.as_ptr()) }
    }

    pub(super) fn axpy_avx2<E: Elem>(o: &mut [f32], w: f32, row: &[u8]) {
        let n = o.len();
        if !Isa::Avx2.supported() || !n.is_multiple_of(16) || row.len() < E::bytes(n) {
            return super::axpy_scalar::<E>(o, w, row);
        }
        // SAFETY: AVX2+F16C present (checked); as `axpy_avx512`.
        unsafe { axpy_256::<E>(o, w, row.as_ptr()) }
    }

    /// A stored row widened to f32 (the elements `Elem::get` gives), 16 or 8 at a time.
    /// # Safety
    /// AVX2 + F16C, and AVX-512F/BW when `wide`; `row` valid for `o.len()` elements, a
    /// multiple of 16.
    pub(super) unsafe fn load_simd<E: Elem>(row: *const u8, o: &mut [f32], wide: bool) {
        if wide {
            load_512::<E>(row, o)
        } else {
            load_256::<E>(row, o)
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn load_512<E: Elem>(row: *const u8, o: &mut [f32]) {
        for c in (0..o.len()).step_by(16) {
            _mm512_storeu_ps(o.as_mut_ptr().add(c), E::load16(row, c));
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_256<E: Elem>(row: *const u8, o: &mut [f32]) {
        for c in (0..o.len()).step_by(8) {
            _mm256_storeu_ps(o.as_mut_ptr().add(c), E::load8(row, c));
        }
    }

    /// # Safety
    /// AVX-512F/BW + F16C; `row` valid for `o.len()` elements, a multiple of 16.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn axpy_512<E: Elem>(o: &mut [f32], w: f32, row: *const u8) {
        let s = _mm512_set1_ps(w);
        for c in (0..o.len()).step_by(16) {
            let p = o.as_mut_ptr().add(c);
            _mm512_storeu_ps(p, _mm512_fmadd_ps(s, E::load16(row, c), _mm512_loadu_ps(p)));
        }
    }

    /// # Safety
    /// AVX2 + F16C; `row` valid for `o.len()` elements, a multiple of 8.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy_256<E: Elem>(o: &mut [f32], w: f32, row: *const u8) {
        let s = _mm256_set1_ps(w);
        for c in (0..o.len()).step_by(8) {
            let p = o.as_mut_ptr().add(c);
            _mm256_storeu_ps(p, _mm256_fmadd_ps(s, E::load8(row, c), _mm256_loadu_ps(p)));
        }
    }

    /// # Safety
    /// AVX-512F/BW + F16C; `q` valid for n floats and `row` for n elements, n % 16 == 0.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn dot1_512<E: Elem>(q: *const f32, row: *const u8, n: usize) -> f32 {
        let mut acc = _mm512_setzero_ps();
        for c in (0..n).step_by(16) {
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(c)), E::load16(row, c), acc);
        }
        let mut l = [0.0f32; 16];
        _mm512_storeu_ps(l.as_mut_ptr(), acc);
        finish(tail::<E>(&[], &[], 0), &l)
    }

    /// # Safety
    /// AVX2 + F16C; as `dot1_512`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot1_256<E: Elem>(q: *const f32, row: *const u8, n: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 2];
        for c in (0..n).step_by(16) {
            for (h, a) in acc.iter_mut().enumerate() {
                let x = _mm256_loadu_ps(q.add(c + 8 * h));
                *a = _mm256_fmadd_ps(x, E::load8(row, c + 8 * h), *a);
            }
        }
        let mut l = [0.0f32; 16];
        _mm256_storeu_ps(l.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(l.as_mut_ptr().add(8), acc[1]);
        finish(tail::<E>(&[], &[], 0), &l)
    }

    /// # Safety
    /// As `dot1_512`, for each of the four rows.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn dot4_512<E: Elem>(q: *const f32, rows: [*const u8; 4], n: usize) -> [f32; 4] {
        let mut acc = [_mm512_setzero_ps(); 4];
        for c in (0..n).step_by(16) {
            let x = _mm512_loadu_ps(q.add(c));
            for r in 0..4 {
                acc[r] = _mm512_fmadd_ps(x, E::load16(rows[r], c), acc[r]);
            }
        }
        let mut out = [0.0f32; 4];
        for r in 0..4 {
            let mut l = [0.0f32; 16];
            _mm512_storeu_ps(l.as_mut_ptr(), acc[r]);
            out[r] = finish(tail::<E>(&[], &[], 0), &l);
        }
        out
    }

    /// # Safety
    /// As `dot1_256`, for each of the four rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot4_256<E: Elem>(q: *const f32, rows: [*const u8; 4], n: usize) -> [f32; 4] {
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        for c in (0..n).step_by(16) {
            let x = [_mm256_loadu_ps(q.add(c)), _mm256_loadu_ps(q.add(c + 8))];
            for r in 0..4 {
                for h in 0..2 {
                    let y = E::load8(rows[r], c + 8 * h);
                    acc[r][h] = _mm256_fmadd_ps(x[h], y, acc[r][h]);
                }
            }
        }
        let mut out = [0.0f32; 4];
        for r in 0..4 {
            let mut l = [0.0f32; 16];
            _mm256_storeu_ps(l.as_mut_ptr(), acc[r][0]);
            _mm256_storeu_ps(l.as_mut_ptr().add(8), acc[r][1]);
            out[r] = finish(tail::<E>(&[], &[], 0), &l);
        }
        out
    }

    /// # Safety
    /// AVX-512F/BW + F16C; `o.len()` a multiple of 16; row j's elements `0..o.len()` at
    /// `rows + j * stride` readable for every j < w.len().
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn weighted_512<E: Elem>(o: &mut [f32], w: &[f32], rows: *const u8, stride: usize) {
        // Columns in groups of up to 128 (eight registers) kept over all rows.
        let mut c0 = 0;
        while c0 < o.len() {
            let g = ((o.len() - c0) / 16).min(8);
            let mut acc = [_mm512_setzero_ps(); 8];
            for (j, &wj) in w.iter().enumerate() {
                let s = _mm512_set1_ps(wj);
                let row = rows.add(j * stride);
                for (k, a) in acc.iter_mut().enumerate().take(g) {
                    *a = _mm512_fmadd_ps(s, E::load16(row, c0 + 16 * k), *a);
                }
            }
            for (k, a) in acc.iter().enumerate().take(g) {
                _mm512_storeu_ps(o.as_mut_ptr().add(c0 + 16 * k), *a);
            }
            c0 += 16 * g;
        }
    }

    /// # Safety
    /// AVX2 + F16C; as `weighted_512`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weighted_256<E: Elem>(o: &mut [f32], w: &[f32], rows: *const u8, stride: usize) {
        // Columns in groups of up to 64 (eight registers) kept over all rows.
        let mut c0 = 0;
        while c0 < o.len() {
            let g = ((o.len() - c0) / 8).min(8);
            let mut acc = [_mm256_setzero_ps(); 8];
            for (j, &wj) in w.iter().enumerate() {
                let s = _mm256_set1_ps(wj);
                let row = rows.add(j * stride);
                for (k, a) in acc.iter_mut().enumerate().take(g) {
                    *a = _mm256_fmadd_ps(s, E::load8(row, c0 + 8 * k), *a);
                }
            }
            for (k, a) in acc.iter().enumerate().take(g) {
                _mm256_storeu_ps(o.as_mut_ptr().add(c0 + 8 * k), *a);
            }
            c0 += 8 * g;
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Deterministic values with a spread of magnitudes (a few exact ties for f16 too).
    pub(in crate::kernels) fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                let u = (s as f32 / u32::MAX as f32) * 2.0 - 1.0;
                if i % 37 == 5 {
                    1.0 + 2f32.powi(-11) // an f16 tie: rounds to even (1.0)
                } else {
                    u * [0.01f32, 1.0, 30.0][i % 3]
                }
            })
            .collect()
    }

    fn stored(ty: KvType, x: &[f32]) -> Vec<u8> {
        let mut b = vec![0u8; ty.row_bytes(x.len())];
        store_row(ty, x, &mut b);
        b
    }

    fn dequant(ty: KvType, b: &[u8], n: usize) -> Vec<f32> {
        let mut x = vec![0.0; n];
        load_row(ty, b, &mut x);
        x
    }

    /// The reference dot on dequantized rows, written out: 16 lanes, lane l a fused
    /// multiply-add chain over elements 16c + l in order, then the tail's products summed and
    /// the lanes added in order.
    fn dot_ref(q: &[f32], k: &[f32]) -> f32 {
        let full = q.len() / 16 * 16;
        let mut lanes = [0.0f32; 16];
        for c in (0..full).step_by(16) {
            for (l, a) in lanes.iter_mut().enumerate() {
                *a = q[c + l].mul_add(k[c + l], *a);
            }
        }
        let mut s: f32 = (full..q.len()).map(|i| q[i] * k[i]).sum();
        for a in lanes {
            s += a;
        }
        s
    }

    /// The reference weighted sum: o = 0, then per row in order o = fma(w_j, row_j, o).
    fn weighted_ref(o: &mut [f32], w: &[f32], rows: &[f32], n: usize) {
        o.fill(0.0);
        for (j, wj) in w.iter().enumerate() {
            for (x, v) in o.iter_mut().zip(&rows[j * n..(j + 1) * n]) {
                *x = wj.mul_add(*v, *x);
            }
        }
    }

    #[test]
    fn parse_names_and_row_bytes() {
        for t in KvType::ALL {
            assert_eq!(KvType::parse(t.name()), Some(t));
            assert_eq!(KvType::from_code(t.code()), Some(t));
            let (be, bb) = t.dtype().block_geometry().unwrap();
            assert_eq!(t.row_bytes(128), 128 / be * bb);
        }
        assert_eq!(KvType::parse("q4_0"), None);
        assert_eq!(KvType::parse("F16"), None);
    }

    #[test]
    fn scalar_and_simd_kernels_agree_bit_for_bit_with_the_f32_sums() {
        for ty in KvType::ALL {
            for n in [32usize, 64, 128, 96, 160] {
                let q = values(n, 1);
                let rows: Vec<Vec<u8>> = (0..7).map(|r| stored(ty, &values(n, 10 + r))).collect();
                let deq: Vec<Vec<f32>> = rows.iter().map(|b| dequant(ty, b, n)).collect();
                let flat: Vec<u8> = rows.concat();
                let flat_f: Vec<f32> = deq.concat();
                let w = values(7, 99);
                let mut want_o = vec![0.0f32; n];
                weighted_ref(&mut want_o, &w, &flat_f, n);
                for isa in Isa::available() {
                    let k = kv_kernels(ty, isa);
                    for r in 0..7 {
                        let got = (k.dot)(&q, &rows[r]);
                        assert_eq!(
                            got.to_bits(),
                            dot_ref(&q, &deq[r]).to_bits(),
                            "{ty} {isa:?} n={n} row {r}"
                        );
                    }
                    let d4 = (k.dot4)(&q, [&rows[0], &rows[1], &rows[2], &rows[3]]);
                    for r in 0..4 {
                        assert_eq!(
                            d4[r].to_bits(),
                            (k.dot)(&q, &rows[r]).to_bits(),
                            "{ty} {isa:?} dot4"
                        );
                    }
                    let mut o = vec![1.0f32; n];
                    (k.weighted)(&mut o, &w, &flat, ty.row_bytes(n));
                    let mut a = vec![0.0f32; n];
                    for (j, wj) in w.iter().enumerate() {
                        (k.axpy)(&mut a, *wj, &rows[j]);
                    }
                    assert_eq!(
                        a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        o.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{ty} {isa:?} n={n} axpy"
                    );
                    let ob: Vec<u32> = o.iter().map(|v| v.to_bits()).collect();
                    let wb: Vec<u32> = want_o.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(ob, wb, "{ty} {isa:?} n={n} weighted");
                }
            }
        }
    }

    #[test]
    fn stored_rows_are_close_and_f16_simd_store_matches_scalar() {
        let x = values(256, 7);
        for (ty, tol) in [
            (KvType::F32, 0.0f32),
            (KvType::F16, 1e-3),
            (KvType::BF16, 8e-3),
            (KvType::Q8_0, 1.0 / 127.0),
        ] {
            let back = dequant(ty, &stored(ty, &x), x.len());
            for (blk, (a, b)) in x.chunks(32).zip(back.chunks(32)).enumerate() {
                let amax = a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                for (u, v) in a.iter().zip(b) {
                    let bound = if ty == KvType::Q8_0 {
                        amax * tol
                    } else {
                        u.abs() * tol
                    };
                    assert!((u - v).abs() <= bound, "{ty} block {blk}: {u} -> {v}");
                }
            }
        }
        let mut scalar = vec![0u8; 2 * x.len()];
        store_f16_scalar(&x, &mut scalar);
        assert_eq!(stored(KvType::F16, &x), scalar);
        // bf16: ties to even, NaN made quiet.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0);
    }
}
