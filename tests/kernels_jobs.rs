//! `matmul_jobs` (several products in one parallel region) gives every output element the
//! bits `matmul` gives it, for every ISA, with and without a pool, across types and with
//! one or several activation rows (the four-row dots included).

use sluice::dtype::DType;
use sluice::kernels::{self, quantize::quantize, Acts, Isa, MatJob, WeightView};

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn jobs_equal_single_products_bit_for_bit() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    // (type, rows, cols) of five products, as a MoE layer's gate/up/down of two experts and a
    // float one.
    let shapes = [
        (DType::Q4_K, 96usize, 512usize),
        (DType::Q4_K, 96, 512),
        (DType::Q8_0, 512, 96 * 4 / 3 * 3),
        (DType::F32, 40, 64),
        (DType::Q4_0, 200, 256),
    ];
    let mut enc = Vec::new();
    for (j, &(t, rows, cols)) in shapes.iter().enumerate() {
        let mut b = Vec::new();
        quantize(t, &values(rows * cols, 7 + j as u64), &mut b).unwrap();
        enc.push(b);
    }
    let views: Vec<WeightView<'_>> = shapes
        .iter()
        .zip(&enc)
        .map(|(&(t, rows, cols), b)| WeightView::new(t, b, rows, cols).unwrap())
        .collect();
    for t_rows in [1usize, 5] {
        let xs: Vec<Vec<f32>> = shapes
            .iter()
            .enumerate()
            .map(|(j, &(_, _, cols))| values(t_rows * cols, 100 + j as u64))
            .collect();
        for isa in Isa::available() {
            // Reference: one matmul per product.
            let want: Vec<Vec<f32>> = views
                .iter()
                .zip(&xs)
                .map(|(w, x)| {
                    let mut a = Acts::new();
                    a.load(x, t_rows, w.cols);
                    let mut y = vec![f32::NAN; t_rows * w.rows];
                    kernels::matmul(w, &mut a, &mut y, Some(&pool), isa).unwrap();
                    y
                })
                .collect();
            for p in [None, Some(&pool)] {
                let acts: Vec<Acts> = views
                    .iter()
                    .zip(&xs)
                    .map(|(w, x)| {
                        let mut a = Acts::new();
                        a.load(x, t_rows, w.cols);
                        kernels::prepare_for(w.dtype, &mut a).unwrap();
                        a
                    })
                    .collect();
                let mut ys: Vec<Vec<f32>> = views
                    .iter()
                    .map(|w| vec![f32::NAN; t_rows * w.rows])
                    .collect();
                let mut jobs: Vec<Option<MatJob<'_, '_>>> = views
                    .iter()
                    .zip(acts.iter())
                    .zip(ys.iter_mut())
                    .map(|((w, acts), y)| {
                        Some(MatJob {
                            w,
                            acts,
                            row0: 0,
                            rows: t_rows,
                            pick: None,
                            y,
                        })
                    })
                    .collect();
                kernels::matmul_jobs(&mut jobs, p, isa).unwrap();
                for (j, (got, want)) in ys.iter().zip(&want).enumerate() {
                    for (i, (g, w)) in got.iter().zip(want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "job {j} ({:?}) {isa:?} rows {t_rows} element {i}: {g} vs {w}",
                            shapes[j].0
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn jobs_refuse_bad_shapes_and_too_many() {
    let mut b = Vec::new();
    quantize(DType::Q8_0, &values(64 * 32, 1), &mut b).unwrap();
    let w = WeightView::new(DType::Q8_0, &b, 64, 32).unwrap();
    let mut a = Acts::new();
    a.load(&values(64, 2), 2, 32);
    let mut y = vec![0.0; 63];
    // Wrong output size; then activations not prepared; then rows past the activations.
    let mut jobs = [Some(MatJob {
        w: &w,
        acts: &a,
        row0: 0,
        rows: 1,
        pick: None,
        y: &mut y,
    })];
    assert!(kernels::matmul_jobs(&mut jobs, None, Isa::detect()).is_err());
    let mut y = vec![0.0; 64];
    let mut jobs = [Some(MatJob {
        w: &w,
        acts: &a,
        row0: 1,
        rows: 1,
        pick: None,
        y: &mut y,
    })];
    assert!(kernels::matmul_jobs(&mut jobs, None, Isa::detect()).is_err());
    kernels::prepare_for(DType::Q8_0, &mut a).unwrap();
    let mut jobs = [Some(MatJob {
        w: &w,
        acts: &a,
        row0: 2,
        rows: 1,
        pick: None,
        y: &mut y,
    })];
    assert!(kernels::matmul_jobs(&mut jobs, None, Isa::detect()).is_err());
    let mut jobs = [Some(MatJob {
        w: &w,
        acts: &a,
        row0: 1,
        rows: 1,
        pick: None,
        y: &mut y,
    })];
    kernels::matmul_jobs(&mut jobs, None, Isa::detect()).unwrap();
}

/// A job over picked rows (`MatJob::pick`, an expert's tokens out of the whole batch) gives
/// the bits of `matmul` on those rows gathered; `Acts::fill_prepared` (rows written and
/// quantized in one parallel pass) gives the bits of `load` + `prepare`. Picks cover the
/// tile (8x4), four-row and single-row paths.
#[test]
fn picked_rows_and_filled_acts_equal_gathered_bit_for_bit() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let batch = 40usize;
    for (t, rows, cols) in [
        (DType::Q4_K, 72usize, 512usize),
        (DType::Q8_0, 40, 256),
        (DType::F32, 24, 64),
    ] {
        let mut b = Vec::new();
        quantize(t, &values(rows * cols, 3), &mut b).unwrap();
        let w = WeightView::new(t, &b, rows, cols).unwrap();
        let x = values(batch * cols, 9);
        for isa in Isa::available() {
            let mut all = Acts::new();
            all.load(&x, batch, cols);
            kernels::prepare_for(t, &mut all).unwrap();
            // The same rows written by fill_prepared (in parallel pieces: 40 x 512 >= 4 x 4096).
            let mut filled = Acts::new();
            let fmt = kernels::kernels_for(t).unwrap().act;
            filled.fill_prepared((batch, cols), fmt, Some(&pool), &|r, out| {
                out.copy_from_slice(&x[r * cols..(r + 1) * cols])
            });
            for pick in [
                vec![3u32],
                vec![0, 7, 39],
                vec![5, 1, 30, 2, 11, 12, 13, 38, 20],
            ] {
                let gathered: Vec<f32> = pick
                    .iter()
                    .flat_map(|&r| x[r as usize * cols..(r as usize + 1) * cols].to_vec())
                    .collect();
                let mut a = Acts::new();
                a.load(&gathered, pick.len(), cols);
                let mut want = vec![f32::NAN; pick.len() * rows];
                kernels::matmul(&w, &mut a, &mut want, None, isa).unwrap();
                for acts in [&all, &filled] {
                    let mut y = vec![f32::NAN; pick.len() * rows];
                    let mut jobs = [Some(MatJob {
                        w: &w,
                        acts,
                        row0: 0,
                        rows: pick.len(),
                        pick: Some(&pick),
                        y: &mut y,
                    })];
                    kernels::matmul_jobs(&mut jobs, Some(&pool), isa).unwrap();
                    for (i, (g, w)) in y.iter().zip(&want).enumerate() {
                        assert_eq!(g.to_bits(), w.to_bits(), "{t:?} {isa:?} {pick:?} {i}");
                    }
                }
            }
            // A pick past the activations is refused.
            let mut y = vec![0.0; rows];
            let bad = [batch as u32];
            let mut jobs = [Some(MatJob {
                w: &w,
                acts: &all,
                row0: 0,
                rows: 1,
                pick: Some(&bad),
                y: &mut y,
            })];
            assert!(kernels::matmul_jobs(&mut jobs, None, isa).is_err());
        }
    }
}
