//! The prefill tile kernels (`kernels::dot4_fn`: one weight row against four activation rows)
//! give, row by row, exactly the bits of the single-row dot that `kernels::dot_fn` picks at the
//! same ISA, on random blocks and on blocks at the extremes of their integer ranges (largest
//! codes and scales against activations quantized to +-127, where an i16 fold would overflow
//! first). Every ISA this CPU can run is tried; at the scalar ISA `dot4_fn` gives no tile kernel
//! and `matmul` uses the single-row dot (tests/kernels_ref.rs `matmul_matches_per_row_dots`
//! covers that path and the threaded matmul).
//!
//! The 8-row x 8-token tiles (`kernels::tile_fn`) likewise give each output the single-row
//! dot's bits, alone and inside `matmul` over odd shapes.
//!
//! Also: every Q4_K, Q6_K and Q8_0 SIMD dot (AVX2 and AVX-512, single-row and four-row; Q8_0's
//! tiles too) computes the scalar dot's per-block integers and float operations in the same
//! order, so they give the scalar dot's bits.

use sluice::dtype::DType;
use sluice::kernels::{self, Acts, Isa, MatJob, WeightView};

/// splitmix64, so failures reproduce.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn normal(&mut self) -> f32 {
        let u = ((self.next() >> 11) as f64 / (1u64 << 53) as f64).max(1e-300);
        let v = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    }
    /// A finite f16 of magnitude about 2^-10 .. 2^-1, either sign, as little-endian bytes.
    fn f16(&mut self) -> [u8; 2] {
        let r = self.next();
        let e = 5 + (r % 10) as u16;
        let bits = ((r >> 8) as u16 & 1) << 15 | e << 10 | (r >> 16) as u16 & 0x3FF;
        bits.to_le_bytes()
    }
}

/// Byte offsets of the f16 scales inside one block of `t` (the rest may hold any bits).
fn f16_offsets(t: DType) -> &'static [usize] {
    match t {
        DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q6_K => &[208],
        DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::IQ4_NL | DType::IQ4_XS => &[0],
        DType::IQ2_XXS | DType::IQ2_XS | DType::IQ2_S | DType::IQ3_XXS | DType::IQ3_S => &[0],
        DType::IQ1_S => &[0],
        // IQ1_M's d is the top nibbles of four words: set in `blocks`.
        DType::IQ1_M => &[],
        DType::Q4_1 | DType::Q5_1 => &[0, 2],
        DType::TQ1_0 => &[52],
        DType::TQ2_0 => &[64],
        other => panic!("no block layout for {other} in this test; add it"),
    }
}

/// `n` blocks of `t`: random bytes with finite f16 scales, or (`extreme`) every byte 0xFF
/// (largest codes, scales and mins) with positive scales.
fn blocks(t: DType, n: usize, rng: &mut Rng, extreme: bool) -> Vec<u8> {
    let (_, bb) = t.block_geometry().unwrap();
    let mut w = vec![0u8; n * bb];
    for blk in w.chunks_exact_mut(bb) {
        for b in blk.iter_mut() {
            *b = if extreme { 0xFF } else { rng.next() as u8 };
        }
        for &o in f16_offsets(t) {
            let mut h = rng.f16();
            if extreme {
                h[1] &= 0x7F;
            }
            blk[o..o + 2].copy_from_slice(&h);
        }
        if t == DType::IQ1_M {
            // f16 d in the top nibbles of the words at bytes 48, 50, 52, 54.
            let mut h = rng.f16();
            if extreme {
                h[1] &= 0x7F;
            }
            let d = u16::from_le_bytes(h);
            for w in 0..4 {
                let at = 49 + 2 * w;
                blk[at] = (blk[at] & 0x0F) | ((((d >> (4 * w)) & 0xF) as u8) << 4);
            }
        }
    }
    w
}

/// Four activation rows of `cols`: normal, normal with outliers, all +1 (codes +127), and
/// alternating +-1 (codes +-127).
fn activations(cols: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x = Vec::with_capacity(4 * cols);
    x.extend((0..cols).map(|_| rng.normal()));
    x.extend((0..cols).map(|i| {
        let v = rng.normal();
        if i % 53 == 7 {
            v * 80.0
        } else {
            v
        }
    }));
    x.extend((0..cols).map(|_| 1.0f32));
    x.extend((0..cols).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }));
    x
}

/// Types with a tile kernel at some ISA of this machine.
fn tiled_types() -> Vec<(DType, Isa)> {
    let mut v = Vec::new();
    for t in kernels::supported_types() {
        for isa in Isa::available() {
            if kernels::dot4_fn(t, isa).is_some() {
                v.push((t, isa));
            }
        }
    }
    v
}

#[test]
fn four_row_dots_equal_single_row_dots() {
    let cases = tiled_types();
    if Isa::hardware() >= Isa::Avx2 {
        for t in [
            DType::Q4_K,
            DType::Q6_K,
            DType::Q8_0,
            DType::TQ1_0,
            DType::TQ2_0,
        ] {
            for isa in Isa::available().into_iter().filter(|i| *i >= Isa::Avx2) {
                assert!(
                    cases.contains(&(t, isa)),
                    "{t} has no four-row dot at {isa:?} on this machine"
                );
            }
        }
    }
    let mut rng = Rng(16);
    for (t, isa) in cases {
        let (be, _) = t.block_geometry().unwrap();
        // 32-element types: 67 blocks, so the kernels' 8-block steps leave a tail, and 4
        // blocks (DeepSeek's 128-wide attn_k_b: all tail). 9 blocks and 1: the AVX-512 grid
        // kernels that look up two blocks at once (IQ2_XXS, IQ2_XS, IQ2_S) end on a lone block.
        let long = 8 * 256usize.max(be) + if be == 32 { 3 * 32 } else { 0 };
        let fmt = kernels::kernels_for(t).unwrap().act;
        let dot = kernels::dot_fn(t, isa).unwrap();
        let dot4 = kernels::dot4_fn(t, isa).unwrap();
        let shapes = [
            (long, false),
            (long, true),
            (4 * be, false),
            (4 * be, true),
            (9 * be, false),
            (be, true),
        ];
        for (cols, extreme) in shapes {
            let w = blocks(t, cols / be * 3, &mut rng, extreme);
            let rb = w.len() / 3;
            let mut acts = Acts::new();
            acts.load(&activations(cols, &mut rng), 4, cols);
            acts.prepare(fmt);
            let rows = [acts.row(0), acts.row(1), acts.row(2), acts.row(3)];
            for r in 0..3 {
                let wr = &w[r * rb..(r + 1) * rb];
                let mut got = [f32::NAN; 4];
                dot4(wr, &rows, &mut got);
                for (k, g) in got.iter().enumerate() {
                    let want = dot(wr, &rows[k]);
                    assert!(want.is_finite(), "{t} {isa:?}: non-finite reference");
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "{t} {isa:?} extreme={extreme} weight row {r} act row {k}: {g} vs {want}"
                    );
                }
            }
        }
    }
}

/// Types whose AVX-512 prefill has no four-row dot: Q5_K's goes through its 8x8 and 16-token
/// tiles.
const NO_AVX512_DOT4: [DType; 1] = [DType::Q5_K];

/// On an AVX-512 machine every type with an AVX2 four-row dot has one at AVX-512 too (so
/// `four_row_dots_equal_single_row_dots` checks it there): the grid i-quants IQ2_XXS, IQ2_XS,
/// IQ2_S, IQ3_XXS and IQ3_S run their VBMI kernels, or the AVX2 ones where the CPU lacks VBMI or
/// BITALG, as their single-row dots do; IQ1_S and IQ1_M their AVX-512 (F/BW/VNNI) kernels.
#[test]
fn avx512_has_a_four_row_dot_wherever_avx2_has_one() {
    if !Isa::available().contains(&Isa::Avx512) {
        eprintln!("avx512_has_a_four_row_dot_wherever_avx2_has_one: skipped: no AVX-512 here");
        return;
    }
    for t in kernels::supported_types() {
        if kernels::dot4_fn(t, Isa::Avx2).is_some() && !NO_AVX512_DOT4.contains(&t) {
            assert!(
                kernels::dot4_fn(t, Isa::Avx512).is_some(),
                "{t}: a four-row dot at AVX2 but none at AVX-512"
            );
        }
    }
    for t in [
        DType::IQ2_XXS,
        DType::IQ2_XS,
        DType::IQ2_S,
        DType::IQ3_XXS,
        DType::IQ3_S,
        DType::IQ1_S,
        DType::IQ1_M,
    ] {
        assert!(
            kernels::dot4_fn(t, Isa::Avx512).is_some(),
            "{t} has no AVX-512 four-row dot"
        );
    }
}

/// Types with an 8x8 tile kernel at some ISA of this machine.
fn tile8_types() -> Vec<(DType, Isa)> {
    let mut v = Vec::new();
    for t in kernels::supported_types() {
        for isa in Isa::available() {
            if kernels::tile_fn(t, isa).is_some() {
                v.push((t, isa));
            }
        }
    }
    v
}

/// The 8-row x 8-token tiles give, output by output, the bits of the single-row dot, on random
/// and extreme blocks, with the eight rows at a stride (as `matmul` hands them).
#[test]
fn tile_dots_equal_single_row_dots() {
    let cases = tile8_types();
    for isa in Isa::available().into_iter().filter(|&i| i >= Isa::Avx2) {
        let t = DType::Q4_K;
        assert!(
            cases.contains(&(t, isa)),
            "{t} has no 8x8 tile kernel at {isa:?} on this machine"
        );
    }
    if Isa::available().contains(&Isa::Avx2) {
        for t in [DType::Q6_K, DType::Q8_0] {
            assert!(
                cases.contains(&(t, Isa::Avx2)),
                "{t} has no AVX2 8x8 tile kernel on this machine"
            );
        }
    }
    let mut rng = Rng(88);
    for (t, isa) in cases {
        let tile = kernels::tile_fn(t, isa).unwrap();
        tile_matches_dots(t, isa, tile, &mut rng);
    }
}

/// `tile` (8 weight rows x up to N activation rows) gives, for every token count 1..=N, each
/// output the bits of the single-row dot at `isa`, on random and extreme blocks with the eight
/// rows at a stride (as `matmul` hands them); only the first n rows of its output are read.
fn tile_matches_dots<const N: usize>(t: DType, isa: Isa, tile: kernels::TileNFn<N>, rng: &mut Rng) {
    let (be, _) = t.block_geometry().unwrap();
    let dot = kernels::dot_fn(t, isa).unwrap();
    let fmt = kernels::kernels_for(t).unwrap().act;
    for (cols, extreme) in [(8 * 256usize.max(be), false), (3 * 256usize.max(be), true)] {
        let w = blocks(t, cols / be * 8, rng, extreme);
        let rb = w.len() / 8;
        let mut acts = Acts::new();
        // `activations` gives four rows.
        let x: Vec<f32> = (0..N.div_ceil(4))
            .flat_map(|_| activations(cols, rng))
            .collect();
        acts.load(&x, 4 * N.div_ceil(4), cols);
        acts.prepare(fmt);
        let all: Vec<_> = (0..N).map(|t| acts.row(t)).collect();
        for n in 1..=N {
            let rows = &all[..n];
            let mut got = [[f32::NAN; 8]; N];
            tile(&w, rb, rows, &mut got);
            for (k, g) in got[..n].iter().enumerate() {
                for (r, g) in g.iter().enumerate() {
                    let want = dot(&w[r * rb..(r + 1) * rb], &rows[k]);
                    assert!(want.is_finite(), "{t} {isa:?}: non-finite reference");
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "{t} {isa:?} extreme={extreme} n={n} weight row {r} act row {k}: {g} vs {want}"
                    );
                }
            }
        }
    }
}

/// The 8-row x 16-token tiles (`kernels::tile16_fn`: Q4_K on AVX2 and AVX-512, Q5_K on
/// AVX-512) give, output by output, the
/// bits of the single-row dot for every token count they take (1..=16), on random and extreme
/// blocks.
#[test]
fn tile16_dots_equal_single_row_dots() {
    let mut rng = Rng(89);
    let mut tried = 0;
    for t in kernels::supported_types() {
        for isa in Isa::available() {
            if let Some(tile) = kernels::tile16_fn(t, isa) {
                tried += 1;
                tile_matches_dots(t, isa, tile, &mut rng);
            }
        }
    }
    if Isa::available().contains(&Isa::Avx2) {
        assert!(tried > 0, "no 16-token tile on an AVX2 machine");
    }
}

/// `matmul` over row counts that are not multiples of 8 and token counts that are not
/// multiples of 4 (tiles, four-row dots and single-row dots all in play), one and two threads,
/// gives each output the single-row dot's bits.
#[test]
fn matmul_with_tiles_matches_single_row_dots() {
    let mut rng = Rng(5);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for (t, isa) in tile8_types() {
        let (be, _) = t.block_geometry().unwrap();
        // Large enough (rows x tokens x row bytes >= 256 KiB) for `matmul` to use the pool.
        let cols = 8 * 256usize.max(be);
        for (rows, toks) in [(37usize, 7usize), (64, 9), (203, 4), (45, 29)] {
            let w = blocks(t, rows * cols / be, &mut rng, false);
            let view = WeightView::new(t, &w, rows, cols).unwrap();
            let x: Vec<f32> = (0..toks * cols).map(|_| rng.normal()).collect();
            for threads in [None, Some(&pool)] {
                let mut acts = Acts::new();
                acts.load(&x, toks, cols);
                let mut y = vec![f32::NAN; toks * rows];
                kernels::matmul(&view, &mut acts, &mut y, threads, isa).unwrap();
                for k in 0..toks {
                    for r in 0..rows {
                        let want = kernels::dot(t, isa, view.row(r), &acts, k).unwrap();
                        let got = y[k * rows + r];
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{t} {isa:?} {rows}x{toks} token {k} row {r}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn q4_k_simd_dots_have_the_scalar_bits() {
    k_quant_dots_have_the_scalar_bits(DType::Q4_K, &Isa::available());
}

/// Every Q6_K dot (scalar, AVX2, AVX-512; single-row and four-row) gives the scalar dot's
/// bits, so its AVX2 tile stands in for any of them.
#[test]
fn q6_k_simd_dots_have_the_scalar_bits() {
    k_quant_dots_have_the_scalar_bits(DType::Q6_K, &Isa::available());
}

/// Q5_K's AVX-512 dot (which its 8x8 tile matches) follows the scalar dot's order too.
#[test]
fn q5_k_avx512_dot_has_the_scalar_bits() {
    let isas: Vec<Isa> = Isa::available()
        .into_iter()
        .filter(|&i| i != Isa::Avx2)
        .collect();
    k_quant_dots_have_the_scalar_bits(DType::Q5_K, &isas);
}

fn k_quant_dots_have_the_scalar_bits(t: DType, isas: &[Isa]) {
    let mut rng = Rng(4);
    // 16 blocks (groups of four), 3 (Qwen3-30B-A3B's expert down rows: only a tail), 5, 6, 7.
    for (cols, extreme) in [4096, 768, 1280, 1536, 1792]
        .into_iter()
        .flat_map(|c| [(c, false), (c, true)])
    {
        let w = blocks(t, cols / 256 * 5, &mut rng, extreme);
        let rb = w.len() / 5;
        let mut acts = Acts::new();
        acts.load(&activations(cols, &mut rng), 4, cols);
        acts.prepare(kernels::kernels_for(t).unwrap().act);
        for &isa in isas {
            let dot4 = kernels::dot4_fn(t, isa);
            for r in 0..5 {
                let wr = &w[r * rb..(r + 1) * rb];
                let mut four = [f32::NAN; 4];
                if let Some(dot4) = dot4 {
                    let rows = [acts.row(0), acts.row(1), acts.row(2), acts.row(3)];
                    dot4(wr, &rows, &mut four);
                }
                for (k, four) in four.iter().enumerate() {
                    let s = kernels::dot(t, Isa::Scalar, wr, &acts, k);
                    let a = kernels::dot(t, isa, wr, &acts, k);
                    let (s, a) = (s.unwrap(), a.unwrap());
                    assert_eq!(
                        s.to_bits(),
                        a.to_bits(),
                        "{t} {isa:?} row {r} act {k}: {s} vs {a}"
                    );
                    if dot4.is_some() {
                        assert_eq!(
                            s.to_bits(),
                            four.to_bits(),
                            "{t} {isa:?} four-row dot, row {r} act {k}"
                        );
                    }
                }
            }
        }
    }
}

/// Every Q8_0 SIMD dot (AVX2 and AVX-512: single-row, four-row, 8x8 tile) adds the blocks'
/// products in block order as the scalar dot does: the scalar bits, on whole groups of 8 and 16
/// blocks, tails (67 blocks, Qwen3's 768-wide expert rows: 24), short rows (4 blocks, DeepSeek's
/// 128-wide k_b; 1) and extremes, so a tile stands in for the single-token dot at any ISA.
#[test]
fn q8_0_simd_dots_have_the_scalar_bits() {
    let t = DType::Q8_0;
    let isas: Vec<Isa> = Isa::available()
        .into_iter()
        .filter(|&i| i >= Isa::Avx2)
        .collect();
    if isas.is_empty() {
        eprintln!("q8_0_simd_dots_have_the_scalar_bits: skipped: no AVX2 here");
        return;
    }
    let mut rng = Rng(8);
    for (cols, extreme) in [2048usize, 32 * 67, 768, 128, 32]
        .into_iter()
        .flat_map(|c| [(c, false), (c, true)])
    {
        let w = blocks(t, cols / 32 * 8, &mut rng, extreme);
        let rb = w.len() / 8;
        let mut acts = Acts::new();
        let mut x = activations(cols, &mut rng);
        x.extend(activations(cols, &mut rng));
        acts.load(&x, 8, cols);
        acts.prepare(kernels::kernels_for(t).unwrap().act);
        let rows: Vec<_> = (0..8).map(|k| acts.row(k)).collect();
        for &isa in &isas {
            let tile = kernels::tile_fn(t, isa).expect("Q8_0 has a tile at AVX2 and AVX-512");
            let dot4 = kernels::dot4_fn(t, isa).unwrap();
            let mut got = [[f32::NAN; 8]; 8];
            tile(&w, rb, &rows, &mut got);
            for r in 0..8 {
                let wr = &w[r * rb..(r + 1) * rb];
                let mut four = [f32::NAN; 4];
                dot4(
                    wr,
                    &[acts.row(4), acts.row(5), acts.row(6), acts.row(7)],
                    &mut four,
                );
                for k in 0..8 {
                    let s = kernels::dot(t, Isa::Scalar, wr, &acts, k).unwrap();
                    let a = kernels::dot(t, isa, wr, &acts, k).unwrap();
                    assert!(s.is_finite(), "non-finite reference");
                    let what = format!("{isa:?} cols {cols} extreme={extreme} row {r} act {k}");
                    assert_eq!(s.to_bits(), a.to_bits(), "dot, {what}: {s} vs {a}");
                    assert_eq!(s.to_bits(), got[k][r].to_bits(), "tile, {what}");
                    if k >= 4 {
                        assert_eq!(s.to_bits(), four[k - 4].to_bits(), "dot4, {what}");
                    }
                }
            }
        }
    }
}

/// `matmul_jobs` over a window of activation rows that starts past row 0 and is long enough
/// for the tile kernels (rows 3..8 of 9) gives each output the single-row dot of the row it
/// names (the tile path once read rows from 0 whatever the window).
#[test]
fn jobs_with_an_offset_window_use_that_window() {
    let mut rng = Rng(23);
    for (t, isa) in tiled_types() {
        let (be, _) = t.block_geometry().unwrap();
        let cols = 2 * 256usize.max(be);
        let rows = 16usize;
        let w = blocks(t, rows * cols / be, &mut rng, false);
        let view = WeightView::new(t, &w, rows, cols).unwrap();
        let x: Vec<f32> = (0..9 * cols).map(|_| rng.normal()).collect();
        let mut acts = Acts::new();
        acts.load(&x, 9, cols);
        kernels::prepare_for(t, &mut acts).unwrap();
        let (row0, n) = (3usize, 5usize);
        let mut y = vec![f32::NAN; n * rows];
        let mut jobs = [Some(MatJob {
            w: &view,
            acts: &acts,
            row0,
            rows: n,
            pick: None,
            y: &mut y,
        })];
        kernels::matmul_jobs(&mut jobs, None, isa).unwrap();
        for k in 0..n {
            for r in 0..rows {
                let want = kernels::dot(t, isa, view.row(r), &acts, row0 + k).unwrap();
                let got = y[k * rows + r];
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{t} {isa:?} window row {k} weight row {r}: {got} vs {want}"
                );
            }
        }
    }
}
