//! Small x86 SIMD helpers shared by the per-type kernels (horizontal sums, f16 scale loads), and
//! the read-only memory sweep that benchmarks use as their bandwidth ceiling.
//!
//! Owns: nothing type-specific. Invariant: every `unsafe fn` here needs only the CPU features
//! named in its `#[target_feature]` and valid pointers for the bytes it reads; callers inline
//! them into kernels compiled with a superset of those features.

use super::Isa;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Sum of `bytes` read as little-endian u64 words (the tail shorter than 8 bytes is ignored),
/// with the widest loads the CPU allows under `isa`, and software prefetch `prefetch` bytes
/// ahead as the kernels do it (0: none). Its only purpose is to read memory as fast as the
/// machine can: `sluice bench` uses it as the read-bandwidth ceiling for matvec kernels.
pub fn read_sweep(bytes: &[u8], isa: Isa, prefetch: usize) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = isa.min(Isa::hardware());
        if isa == Isa::Avx512 {
            // SAFETY: the CPU has AVX-512F (Isa::hardware checked it); the function reads only
            // whole 64-byte chunks inside `bytes`.
            return unsafe { x86::sweep_avx512(bytes, prefetch) };
        }
        if isa == Isa::Avx2 {
            // SAFETY: as above for AVX2, 32-byte chunks inside `bytes`.
            return unsafe { x86::sweep_avx2(bytes, prefetch) };
        }
    }
    let _ = (isa, prefetch);
    let mut acc = [0u64; 8];
    let mut chunks = bytes.chunks_exact(64);
    for c in &mut chunks {
        for (k, w) in c.chunks_exact(8).enumerate() {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            acc[k] = acc[k].wrapping_add(u64::from_le_bytes(b));
        }
    }
    let mut s = acc.iter().fold(0u64, |s, v| s.wrapping_add(*v));
    for w in chunks.remainder().chunks_exact(8) {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        s = s.wrapping_add(u64::from_le_bytes(b));
    }
    s
}

/// How far ahead of the block being computed the SIMD kernels prefetch weight bytes (0: no
/// software prefetch). Starts at `SLUICE_PREFETCH=BYTES` if set, else [`DEFAULT_PREFETCH`].
///
/// Why: the L2 streamer does not cross 4 KiB pages, and a dot kernel keeps too few loads in
/// flight to cover DRAM latency by itself; on the 2-core Xeon of docs/PERFORMANCE.md software
/// prefetch took Q4_K matvec from ~50% to ~85% of the read sweep.
pub fn prefetch_distance() -> usize {
    let d = PREFETCH.load(Ordering::Relaxed);
    if d != usize::MAX {
        return d;
    }
    let d = std::env::var("SLUICE_PREFETCH")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_PREFETCH);
    PREFETCH.store(d, Ordering::Relaxed);
    d
}

/// Set the prefetch distance for all later kernel calls (benchmarks A/B it; 0 turns it off).
pub fn set_prefetch_distance(bytes: usize) {
    PREFETCH.store(bytes.min(usize::MAX - 1), Ordering::Relaxed);
}

/// Default prefetch distance in bytes (see `prefetch_distance`).
pub const DEFAULT_PREFETCH: usize = 3072;

static PREFETCH: AtomicUsize = AtomicUsize::new(usize::MAX);

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// Prefetch the `len` bytes that start `dist` bytes after `p` into L2, and those `dist / 2`
    /// after `p` into L1: one prefetch of each kind per 64 bytes of `len`. Called once per
    /// block of `len` bytes, this covers the whole stream twice over. Never faults and never
    /// reads in Rust's sense, so the addresses may lie past the buffer.
    ///
    /// Why two levels: L2 prefetches far ahead keep many more lines in flight than L1 fill
    /// buffers allow, and the near L1 prefetch hides the L2 latency (docs/PERFORMANCE.md has
    /// the A/B: L1 only at 2 KiB reached 77-82% of the read sweep for Q4_K, this 85-88%).
    #[inline(always)]
    pub fn prefetch(p: *const u8, dist: usize, len: usize) {
        if dist == 0 {
            return;
        }
        let far = p.wrapping_add(dist) as *const i8;
        let near = p.wrapping_add(dist / 2) as *const i8;
        let mut off = 0;
        while off < len {
            // SAFETY: a prefetch is a hint: it neither faults nor dereferences (the addresses
            // are formed with wrapping arithmetic, so no out-of-bounds pointer offset either).
            // SSE is part of x86_64's baseline.
            unsafe {
                _mm_prefetch(far.wrapping_add(off), _MM_HINT_T1);
                _mm_prefetch(near.wrapping_add(off), _MM_HINT_T0);
            }
            off += 64;
        }
    }

    /// The f16 values at `p` and `p + 2` (little-endian, unaligned) as f32 in lanes 0 and 1.
    ///
    /// Written in `asm!` on purpose: from intrinsics LLVM narrows the load and emits
    /// `vpinsrw` into an arbitrary register, whose old value then becomes a false dependency;
    /// it picked loop accumulators and serialised whole kernels on the FMA chain (Q8_0 ran at
    /// half speed). `vmovd` from memory writes the full register.
    ///
    /// # Safety
    /// F16C available; `p` valid for 4 bytes.
    #[inline(always)]
    pub unsafe fn f16x2_at(p: *const u8) -> __m128 {
        let x: __m128;
        std::arch::asm!(
            "vmovd {x}, dword ptr [{p}]",
            "vcvtph2ps {x}, {x}",
            p = in(reg) p,
            x = out(xmm_reg) x,
            options(pure, readonly, nostack, preserves_flags)
        );
        x
    }

    /// The f16 at `p` (little-endian, unaligned) as f32; see [`f16x2_at`] for why `asm!`.
    ///
    /// # Safety
    /// F16C available; `p` valid for 2 bytes.
    #[inline(always)]
    pub unsafe fn f16_at(p: *const u8) -> f32 {
        let x: __m128;
        std::arch::asm!(
            "movzx {t:e}, word ptr [{p}]",
            "vmovd {x}, {t:e}",
            "vcvtph2ps {x}, {x}",
            p = in(reg) p,
            t = out(reg) _,
            x = out(xmm_reg) x,
            options(pure, readonly, nostack, preserves_flags)
        );
        _mm_cvtss_f32(x)
    }

    /// The sum of the 8 i32 lanes of `v` (exact in any order). Always inlined into the
    /// AVX2/AVX-512 kernel that calls it (no target feature of its own, so the callers' generic
    /// `inline(always)` loops can use it too).
    ///
    /// # Safety
    /// AVX2 available.
    #[inline(always)]
    pub unsafe fn hsum_epi32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s)))
    }

    /// # Safety
    /// AVX available.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn hsum_ps256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        hsum_ps128(s)
    }

    /// # Safety
    /// SSE3 available.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn hsum_ps128(s: __m128) -> f32 {
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// `hsum_ps256` for safe `#[target_feature]` kernels (the i-quant and low-bit k-quant files).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub fn hsum256(v: __m256) -> f32 {
        // SAFETY: this function is compiled with the features `hsum_ps256` needs.
        unsafe { hsum_ps256(v) }
    }

    /// Plain integer element types the block loaders below may read.
    pub trait Plain: Copy {}
    impl Plain for u8 {}
    impl Plain for i8 {}
    impl Plain for i16 {}

    /// Unaligned load of the first 16 bytes of a slice. The length check panics on a short
    /// slice; callers pass fixed-size block fields, so it folds away.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub fn ld128<T: Plain>(s: &[T]) -> __m128i {
        assert!(std::mem::size_of_val(s) >= 16);
        // SAFETY: `s` has at least 16 readable bytes of plain integers.
        unsafe { _mm_loadu_si128(s.as_ptr() as *const __m128i) }
    }

    /// Unaligned load of the first 32 bytes of a slice (see `ld128`).
    #[target_feature(enable = "avx2")]
    #[inline]
    pub fn ld256<T: Plain>(s: &[T]) -> __m256i {
        assert!(std::mem::size_of_val(s) >= 32);
        // SAFETY: `s` has at least 32 readable bytes of plain integers.
        unsafe { _mm256_loadu_si256(s.as_ptr() as *const __m256i) }
    }

    /// Unaligned load of the first 64 bytes of a slice (see `ld128`).
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub fn ld512<T: Plain>(s: &[T]) -> __m512i {
        assert!(std::mem::size_of_val(s) >= 64);
        // SAFETY: `s` has at least 64 readable bytes of plain integers.
        unsafe { _mm512_loadu_si512(s.as_ptr() as *const __m512i) }
    }

    /// # Safety
    /// AVX-512F available.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn hsum_ps512(v: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
        hsum_ps256(_mm256_add_ps(lo, hi))
    }

    /// Sums u64 words over whole 32-byte chunks of `b` (tail bytes ignored).
    ///
    /// # Safety
    /// AVX2 available.
    #[target_feature(enable = "avx2")]
    pub unsafe fn sweep_avx2(b: &[u8], pf: usize) -> u64 {
        let n = b.len() / 128;
        let p = b.as_ptr();
        let mut a = [_mm256_setzero_si256(); 4];
        for i in 0..n {
            prefetch(p.add(i * 128), pf, 128);
            let q = p.add(i * 128) as *const __m256i;
            for (k, acc) in a.iter_mut().enumerate() {
                *acc = _mm256_add_epi64(*acc, _mm256_loadu_si256(q.add(k)));
            }
        }
        let mut s = _mm256_add_epi64(_mm256_add_epi64(a[0], a[1]), _mm256_add_epi64(a[2], a[3]));
        for i in (n * 4)..(b.len() / 32) {
            s = _mm256_add_epi64(s, _mm256_loadu_si256((p as *const __m256i).add(i)));
        }
        let mut out = [0u64; 4];
        _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, s);
        out.iter().fold(0u64, |x, v| x.wrapping_add(*v))
    }

    /// Sums u64 words over whole 64-byte chunks of `b` (tail bytes ignored).
    ///
    /// # Safety
    /// AVX-512F available.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn sweep_avx512(b: &[u8], pf: usize) -> u64 {
        let n = b.len() / 256;
        let p = b.as_ptr();
        let mut a = [_mm512_setzero_si512(); 4];
        for i in 0..n {
            prefetch(p.add(i * 256), pf, 256);
            let q = p.add(i * 256) as *const __m512i;
            for (k, acc) in a.iter_mut().enumerate() {
                *acc = _mm512_add_epi64(*acc, _mm512_loadu_si512(q.add(k)));
            }
        }
        let mut s = _mm512_add_epi64(_mm512_add_epi64(a[0], a[1]), _mm512_add_epi64(a[2], a[3]));
        for i in (n * 4)..(b.len() / 64) {
            s = _mm512_add_epi64(s, _mm512_loadu_si512((p as *const __m512i).add(i)));
        }
        _mm512_reduce_add_epi64(s) as u64
    }
}
