//! IQ4_XS: super-blocks of 256 elements, 136 bytes: `d` (f16), `scales_h` (u16), `scales_l[4]`,
//! `qs[128]`. Sub-block j (32 elements) has the 6-bit scale
//! `ls_j = (scales_l[j / 2] >> 4 (j % 2)) & 15 | ((scales_h >> 2 j) & 3) << 4` and reads
//! qs[16 j..16 j + 16]: low nibbles are its elements 0..16, high nibbles 16..32.
//! Value: `(d * (ls_j - 32)) * KVALUES[nibble]` (gguf's f32 order; codebook of `iq4_nl.rs`).
//!
//! Dots against `Q8K` activations: per super-block the exact integer
//! `sum_j (ls_j - 32) * sum(KVALUES[q] * a)`, scaled by d * d_a (the AVX-512 loop keeps it as
//! 16 exact i32 lanes, converted and scaled lane by lane: another f32 order). Scalar, AVX2 and
//! AVX-512 (VNNI, with VBMI `vpermb` lookups where present) dots, each with a four-row form.

use super::float::f16_le;
use super::iq4_nl::KVALUES;
use super::{ActFormat, ActRow, Dot4Kernels, TypeKernels};
use crate::dtype::DType;

const BB: usize = 136;

pub(super) const KERNELS: Option<TypeKernels> = Some(TypeKernels {
    dtype: DType::IQ4_XS,
    act: ActFormat::Q8K,
    dequant,
    dot_scalar,
    #[cfg(target_arch = "x86_64")]
    dot_avx2: Some(x86::dot_avx2),
    #[cfg(target_arch = "x86_64")]
    dot_avx512: Some(x86::dot_avx512),
    #[cfg(not(target_arch = "x86_64"))]
    dot_avx2: None,
    #[cfg(not(target_arch = "x86_64"))]
    dot_avx512: None,
});

/// Four-row dots (prefill), each row with the single-row dot's bits.
pub(super) const DOT4: Dot4Kernels = Dot4Kernels {
    #[cfg(target_arch = "x86_64")]
    avx2: Some(x86::dot4_avx2),
    #[cfg(target_arch = "x86_64")]
    avx512: Some(x86::dot4_avx512),
    #[cfg(not(target_arch = "x86_64"))]
    avx2: None,
    #[cfg(not(target_arch = "x86_64"))]
    avx512: None,
};

/// The eight sub-block scales `ls_j - 32` of the block at the start of `b`.
#[inline]
fn scales(b: &[u8]) -> [i32; 8] {
    let h = u16::from_le_bytes([b[2], b[3]]);
    std::array::from_fn(|j| {
        let lo = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
        let hi = ((h >> (2 * j)) & 3) as u8;
        (lo | (hi << 4)) as i32 - 32
    })
}

/// Element i (< 32) of sub-block j's codebook index.
#[inline]
fn index(b: &[u8], j: usize, i: usize) -> usize {
    let q = b[8 + 16 * j + (i % 16)];
    (if i < 16 { q & 0x0F } else { q >> 4 }) as usize
}

fn dequant(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(BB).zip(out.chunks_exact_mut(256)) {
        let d = f16_le(blk);
        let sc = scales(blk);
        for (j, o) in o.chunks_exact_mut(32).enumerate() {
            let dl = d * sc[j] as f32;
            for (i, o) in o.iter_mut().enumerate() {
                *o = dl * KVALUES[index(blk, j, i)] as f32;
            }
        }
    }
}

fn dot_scalar(w: &[u8], a: &ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (blk, ab) in w.chunks_exact(BB).zip(a.q8k) {
        let sc = scales(blk);
        let mut isum = 0i32;
        for (j, &s) in sc.iter().enumerate() {
            let x = &ab.qs[32 * j..32 * j + 32];
            let p: i32 = (0..32)
                .map(|i| KVALUES[index(blk, j, i)] as i32 * x[i] as i32)
                .sum();
            isum += s * p;
        }
        sum += f16_le(blk) * ab.d * isum as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::blocks32::nibbles;
    use super::super::iq4_nl::KVALUES_U;
    use super::super::simd::prefetch_distance;
    use super::super::simd::x86::hsum_ps512;
    use super::super::simd::x86::{f16_at, hsum_ps256, prefetch};
    use super::{dot_scalar, ActRow, BB, KVALUES};
    use crate::kernels::{BlockQ8K, Isa};
    use std::arch::x86_64::*;

    pub(super) fn dot_avx2(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx2.supported() {
            return dot_scalar(w, a);
        }
        let nb = a.q8k.len().min(w.len() / BB);
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` holds `nb` whole blocks and
        // `a.q8k` at least `nb` blocks.
        unsafe { avx2(w, a.q8k.as_ptr(), nb) }
    }

    pub(super) fn dot_avx512(w: &[u8], a: &ActRow<'_>) -> f32 {
        if !Isa::Avx512.supported() {
            return dot_scalar(w, a);
        }
        let nb = a.q8k.len().min(w.len() / BB);
        let mut out = [0.0f32];
        // SAFETY: AVX-512 F/BW/VL/VNNI present (checked above), VBMI where `vbmi()` says so;
        // lengths as in `dot_avx2`.
        unsafe {
            if vbmi() {
                avx512_vbmi::<1>(w.as_ptr(), [a.q8k.as_ptr()], nb, &mut out)
            } else {
                avx512::<1>(w.as_ptr(), [a.q8k.as_ptr()], nb, &mut out)
            }
        };
        out[0]
    }

    pub(super) fn dot4_avx512(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !Isa::Avx512.supported() {
            *out = std::array::from_fn(|r| dot_scalar(w, &a[r]));
            return;
        }
        let nb = a.iter().map(|a| a.q8k.len()).fold(w.len() / BB, usize::min);
        let ap = std::array::from_fn(|r| a[r].q8k.as_ptr());
        // SAFETY: AVX-512 F/BW/VL/VNNI present (checked above), VBMI where `vbmi()` says so;
        // `w` and every row hold `nb` blocks.
        unsafe {
            if vbmi() {
                avx512_vbmi::<4>(w.as_ptr(), ap, nb, out)
            } else {
                avx512::<4>(w.as_ptr(), ap, nb, out)
            }
        }
    }

    /// The single-row AVX-512 dot with each lookup: (VBMI `vpermb`, `vpshufb`).
    #[cfg(test)]
    pub(super) fn avx512_both(w: &[u8], a: &ActRow<'_>) -> (f32, f32) {
        assert!(Isa::Avx512.supported() && vbmi());
        let nb = a.q8k.len().min(w.len() / BB);
        let (mut v, mut s) = ([0.0f32], [0.0f32]);
        // SAFETY: AVX-512 F/BW/VL/VNNI and VBMI present (asserted); lengths as in `dot_avx2`.
        unsafe {
            avx512_vbmi::<1>(w.as_ptr(), [a.q8k.as_ptr()], nb, &mut v);
            avx512::<1>(w.as_ptr(), [a.q8k.as_ptr()], nb, &mut s);
        }
        (v[0], s[0])
    }

    /// Whether the AVX-512 loop may look the codes up with VBMI's `vpermb` (Ice Lake, Zen 4 and
    /// later). Both forms make the same codes, so the dots have the same bits either way.
    fn vbmi() -> bool {
        is_x86_feature_detected!("avx512vbmi")
    }

    /// 64-entry `vpermb` tables of `KVALUES + 128`: indexed by a code byte's low 6 bits (its low
    /// nibble, bits 4-5 ignored), and by the byte's bits 2-7 (after a 16-bit shift right by 2,
    /// which brings the neighbour byte's bits into 6-7, also ignored: its high nibble).
    static VPERMB_LO: [u8; 64] = vpermb_table(0);
    static VPERMB_HI: [u8; 64] = vpermb_table(2);
    const fn vpermb_table(shift: usize) -> [u8; 64] {
        let mut t = [0u8; 64];
        let mut e = 0;
        while e < 64 {
            t[e] = KVALUES_U[(e >> shift) & 15];
            e += 1;
        }
        t
    }

    /// The eight sub-block scales `ls_j - 32` of the block at `b` as i32 lanes 0..8 (vector
    /// shifts on the scale bytes, no scalar unpacking).
    ///
    /// # Safety
    /// AVX2; `b` valid for 8 bytes.
    #[inline(always)]
    unsafe fn scales_i32(b: *const u8) -> __m256i {
        let sh = _mm256_set1_epi32(std::ptr::read_unaligned(b.add(2) as *const u16) as i32);
        let sl = _mm256_set1_epi32(std::ptr::read_unaligned(b.add(4) as *const u32) as i32);
        let lo = _mm256_and_si256(
            _mm256_srlv_epi32(sl, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
            _mm256_set1_epi32(0x0F),
        );
        // Bits 2j, 2j + 1 of `scales_h` to bits 4, 5 of lane j.
        let hi = _mm256_and_si256(
            _mm256_sllv_epi32(sh, _mm256_setr_epi32(4, 2, 0, 32, 32, 32, 32, 32)),
            _mm256_set1_epi32(0x30),
        );
        let hi = _mm256_or_si256(
            hi,
            _mm256_and_si256(
                _mm256_srlv_epi32(sh, _mm256_setr_epi32(32, 32, 32, 2, 4, 6, 8, 10)),
                _mm256_set1_epi32(0x30),
            ),
        );
        _mm256_sub_epi32(_mm256_or_si256(lo, hi), _mm256_set1_epi32(32))
    }

    /// `scales_i32` as i16 words 0..8 of both 128-bit lanes.
    ///
    /// # Safety
    /// AVX2; `b` valid for 8 bytes.
    #[inline(always)]
    unsafe fn scales_i16(b: *const u8) -> __m256i {
        let l = scales_i32(b);
        // Words [l0..3 l0..3 | l4..7 l4..7] -> [l0..7 | l0..7].
        let w = _mm256_packs_epi32(l, l);
        _mm256_permute4x64_epi64(w, 0b10_00_10_00)
    }

    /// # Safety
    /// AVX2+FMA+F16C; `w` holds `nb` blocks, `a` is valid for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2(w: &[u8], a: *const BlockQ8K, nb: usize) -> f32 {
        let table =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES.as_ptr() as *const __m128i));
        let mut acc = _mm256_setzero_ps();
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.as_ptr().add(i * BB);
            prefetch(b, pf, BB);
            let ab = &*a.add(i);
            let sc = scales_i16(b);
            let mut sumi = _mm256_setzero_si256();
            for j in 0..8 {
                let c = _mm256_shuffle_epi8(table, nibbles(b.add(8 + 16 * j)));
                let x = _mm256_loadu_si256(ab.qs.as_ptr().add(32 * j) as *const __m256i);
                // |c| * (x * sign c): |c|, |x| <= 127, so the i16 pair sums cannot saturate.
                let p = _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(x, c));
                // Scale j (word j of each lane) in every word.
                let sj = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((0x0100 + 0x0202 * j) as i16));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sj));
            }
            let d = _mm256_set1_ps(f16_at(b) * ab.d);
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
        }
        hsum_ps256(acc)
    }

    pub(super) fn dot4_avx2(w: &[u8], a: &[ActRow<'_>; 4], out: &mut [f32; 4]) {
        if !Isa::Avx2.supported() {
            *out = std::array::from_fn(|r| dot_scalar(w, &a[r]));
            return;
        }
        let nb = a.iter().map(|a| a.q8k.len()).fold(w.len() / BB, usize::min);
        let ap = std::array::from_fn(|r| a[r].q8k.as_ptr());
        // SAFETY: AVX2/FMA/F16C present (checked above); `w` and every row hold `nb` blocks.
        unsafe { avx2_4(w, ap, nb, out) }
    }

    /// `avx2` for four activation rows: each sub-block's codes, their magnitudes and its
    /// scale are made once for the four rows; per row the integer sums and f32 operations are
    /// `avx2`'s, in its order, so each row gets exactly the single-row bits.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; `w` holds `nb` blocks, every `a[r]` is valid for `nb` activation blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_4(w: &[u8], a: [*const BlockQ8K; 4], nb: usize, out: &mut [f32; 4]) {
        let table =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES.as_ptr() as *const __m128i));
        let mut acc = [_mm256_setzero_ps(); 4];
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.as_ptr().add(i * BB);
            prefetch(b, pf, BB);
            let sc = scales_i16(b);
            let mut sumi = [_mm256_setzero_si256(); 4];
            for j in 0..8 {
                let c = _mm256_shuffle_epi8(table, nibbles(b.add(8 + 16 * j)));
                let ac = _mm256_sign_epi8(c, c);
                let sj = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((0x0100 + 0x0202 * j) as i16));
                for (r, sumi) in sumi.iter_mut().enumerate() {
                    let x = (*a[r].add(i)).qs.as_ptr().add(32 * j);
                    let x = _mm256_loadu_si256(x as *const __m256i);
                    let p = _mm256_maddubs_epi16(ac, _mm256_sign_epi8(x, c));
                    *sumi = _mm256_add_epi32(*sumi, _mm256_madd_epi16(p, sj));
                }
            }
            let fd = f16_at(b);
            for r in 0..4 {
                let d = _mm256_set1_ps(fd * (*a[r].add(i)).d);
                acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            }
        }
        *out = std::array::from_fn(|r| hsum_ps256(acc[r]));
    }

    /// The AVX-512 loop for `R` activation rows (1: the single-row dot; 4: prefill, each row
    /// with the single-row bits, as the codes and scales are made once and every row's integer
    /// and f32 operations are the single row's, in its order).
    ///
    /// Per super-block: the 128 code bytes in two 512-bit loads, nibbles looked up as unsigned
    /// codes `KVALUES + 128` (`vpshufb`) and put in element order two sub-blocks per register
    /// (`vpermt2q`); per row one VNNI `dpbusd` per 64 elements, each sub-block's 8 lanes times
    /// its scale (`vpmulld`), less `128 * sum_j (ls_j - 32) * sum(a over sub-block j)` from the
    /// activations' 16-element sums (`bsums`), then one convert and FMA into 16 f32 lanes.
    /// (The earlier tries, with the AVX2 loop's 256-bit shapes: `dpbusd` + `vpmulld` per 32
    /// elements, 12.4 GB/s in L2, and unsigned codes with the `bsums` correction, 10.4, against
    /// the AVX2 loop's 14.1: docs/PERFORMANCE.md, session 28, has this loop's figures.)
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + AVX2/FMA/F16C; `w` holds `nb` blocks, every `a[r]` is valid for
    /// `nb` activation blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512<const R: usize>(
        w: *const u8,
        a: [*const BlockQ8K; R],
        nb: usize,
        out: &mut [f32; R],
    ) {
        body512::<R, false>(w, a, nb, out)
    }

    /// `avx512` with the nibbles looked up by VBMI `vpermb` from 64-entry tables (no masking:
    /// 3 instead of 5 operations per 64 code bytes; 18.4 against 17.3 GB/s in L2 on Zen 4).
    ///
    /// # Safety
    /// As `avx512`, plus AVX-512 VBMI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    unsafe fn avx512_vbmi<const R: usize>(
        w: *const u8,
        a: [*const BlockQ8K; R],
        nb: usize,
        out: &mut [f32; R],
    ) {
        body512::<R, true>(w, a, nb, out)
    }

    /// The loop of `avx512` and `avx512_vbmi`.
    #[inline(always)]
    unsafe fn body512<const R: usize, const VBMI: bool>(
        w: *const u8,
        a: [*const BlockQ8K; R],
        nb: usize,
        out: &mut [f32; R],
    ) {
        let (vlo, vhi) = (
            _mm512_loadu_si512(VPERMB_LO.as_ptr() as *const __m512i),
            _mm512_loadu_si512(VPERMB_HI.as_ptr() as *const __m512i),
        );
        let table = _mm512_broadcast_i32x4(_mm_loadu_si128(KVALUES_U.as_ptr() as *const __m128i));
        let m4 = _mm512_set1_epi8(0x0F);
        // Qwords of [lo, hi] nibble codes to [lo 0, hi 0, lo 1, hi 1] (sub-blocks 0, 1 of the
        // load) and [lo 2, hi 2, lo 3, hi 3].
        let order = [
            _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11),
            _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15),
        ];
        // Scale lanes: sub-block 2k in lanes 0..8, 2k + 1 in lanes 8..16.
        let spread: [__m512i; 4] = std::array::from_fn(|k| {
            let (e, o) = (2 * k as i32, 2 * k as i32 + 1);
            _mm512_setr_epi32(e, e, e, e, e, e, e, e, o, o, o, o, o, o, o, o)
        });
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm512_setzero_ps(); R];
        let pf = prefetch_distance();
        for i in 0..nb {
            let b = w.add(i * BB);
            prefetch(b, pf, BB);
            let sc = scales_i32(b);
            let sc512 = _mm512_castsi256_si512(sc);
            let s: [__m512i; 4] =
                std::array::from_fn(|k| _mm512_permutexvar_epi32(spread[k], sc512));
            let mut c = [_mm512_setzero_si512(); 4];
            for h in 0..2 {
                let q = _mm512_loadu_si512(b.add(8 + 64 * h) as *const __m512i);
                let (lo, hi) = if VBMI {
                    (
                        _mm512_permutexvar_epi8(q, vlo),
                        _mm512_permutexvar_epi8(_mm512_srli_epi16(q, 2), vhi),
                    )
                } else {
                    (
                        _mm512_shuffle_epi8(table, _mm512_and_si512(q, m4)),
                        _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(q, 4), m4)),
                    )
                };
                c[2 * h] = _mm512_permutex2var_epi64(lo, order[0], hi);
                c[2 * h + 1] = _mm512_permutex2var_epi64(lo, order[1], hi);
            }
            let fd = f16_at(b);
            for (r, acc) in acc.iter_mut().enumerate() {
                let ab = &*a[r].add(i);
                let mut isum = _mm512_setzero_si512();
                for (k, (c, s)) in c.iter().zip(&s).enumerate() {
                    let x = _mm512_loadu_si512(ab.qs.as_ptr().add(64 * k) as *const __m512i);
                    let p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), *c, x);
                    isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(p, *s));
                }
                // The codes carried + 128: 128 * sum_j s_j * sum(a over sub-block j).
                let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
                let sums = _mm256_madd_epi16(bs, ones);
                let corr = _mm256_slli_epi32(_mm256_mullo_epi32(sums, sc), 7);
                isum = _mm512_sub_epi32(isum, _mm512_zextsi256_si512(corr));
                let d = _mm512_set1_ps(fd * ab.d);
                *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(isum), *acc);
            }
        }
        *out = std::array::from_fn(|r| hsum_ps512(acc[r]));
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::x86::{avx512_both, dot4_avx512};
    use crate::kernels::{ActFormat, Acts, Isa};

    /// The AVX-512 loop's two lookups (VBMI `vpermb`, `vpshufb`) give the same bits, for one
    /// row and for four; the kernel tests run whichever this CPU picks.
    #[test]
    fn vpermb_and_vpshufb_lookups_give_the_same_bits() {
        if !Isa::Avx512.supported() || !is_x86_feature_detected!("avx512vbmi") {
            eprintln!("skipped: no AVX-512 VBMI here");
            return;
        }
        let (nb, cols) = (5usize, 5 * 256);
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut w: Vec<u8> = (0..nb * super::BB).map(|_| next() as u8).collect();
        for b in w.chunks_exact_mut(super::BB) {
            // d = 2^-4 .. 2^3 (a finite f16), any scales and codes.
            b[0] = 0;
            b[1] = 0x2C + (next() % 7) as u8 * 4;
        }
        let x: Vec<f32> = (0..4 * cols)
            .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let mut acts = Acts::new();
        acts.load(&x, 4, cols);
        acts.prepare(ActFormat::Q8K);
        let rows = [acts.row(0), acts.row(1), acts.row(2), acts.row(3)];
        for r in &rows {
            let (vbmi, shufb) = avx512_both(&w, r);
            assert!(vbmi.is_finite() && vbmi != 0.0, "dot {vbmi}");
            assert_eq!(vbmi.to_bits(), shufb.to_bits(), "{vbmi} vs {shufb}");
        }
        let mut four = [0.0f32; 4];
        dot4_avx512(&w, &rows, &mut four);
        for (r, got) in rows.iter().zip(four) {
            assert_eq!(got.to_bits(), avx512_both(&w, r).1.to_bits());
        }
    }
}
