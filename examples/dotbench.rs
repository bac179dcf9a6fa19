//! Single-row dot kernels compute-bound: for each type, 128 KiB of random valid blocks (rows of
//! 4096 columns, L2-resident) dotted with one activation row through `kernels::dot_fn`, all
//! types and ISAs interleaved per round, best of 1000 rounds; ns per 256 weights and GB/s of
//! weight bytes on one core.
//!
//! `cargo run --release --features cuda --example dotbench -- Q4_1,Q5_0 avx2,avx512 [KIB]`
use sluice::bench::kernels::fill_valid_blocks;
use sluice::dtype::DType;
use sluice::kernels::{self, Acts, Isa};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let types: Vec<DType> = args
        .get(1)
        .map(|s| s.as_str())
        .unwrap_or("Q4_1")
        .split(',')
        .map(|n| {
            kernels::supported_types()
                .into_iter()
                .find(|t| t.name().eq_ignore_ascii_case(n))
                .unwrap_or_else(|| panic!("unknown type {n}"))
        })
        .collect();
    let isas: Vec<Isa> = args
        .get(2)
        .map(|s| s.as_str())
        .unwrap_or("avx2")
        .split(',')
        .map(|n| Isa::parse(n).expect("isa"))
        .collect();
    let kib: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(128);
    let cols = 4096usize;
    let x: Vec<f32> = (0..cols)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let mut acts = Acts::new();
    acts.load(&x, 1, cols);
    struct Case {
        t: DType,
        isa: Isa,
        w: Vec<u8>,
        rb: usize,
        best: f64,
        sum: f32,
    }
    let mut cases = Vec::new();
    for &t in &types {
        let (be, bb) = t.block_geometry().unwrap();
        let rb = cols / be * bb;
        let rows = (kib * 1024 / rb).max(1);
        let mut w = vec![0u8; rows * rb];
        fill_valid_blocks(t, &mut w, 7);
        acts.prepare(kernels::kernels_for(t).unwrap().act);
        for &isa in &isas {
            cases.push(Case {
                t,
                isa,
                w: w.clone(),
                rb,
                best: f64::MAX,
                sum: 0.0,
            });
        }
    }
    let row = acts.row(0);
    for _ in 0..1000 {
        for c in cases.iter_mut() {
            let dot = kernels::dot_fn(c.t, c.isa).unwrap();
            let t0 = Instant::now();
            let mut s = 0.0f32;
            for r in c.w.chunks_exact(c.rb) {
                s += dot(r, &row);
            }
            c.best = c.best.min(t0.elapsed().as_secs_f64());
            c.sum = s;
        }
    }
    for c in &cases {
        let n = c.w.len() / c.rb * cols;
        println!(
            "{:8} {:6} {:6.2} ns/256  {:6.2} GB/s  (sum {:e})",
            c.t.name(),
            c.isa.name(),
            c.best * 1e9 / (n / 256) as f64,
            c.w.len() as f64 / c.best / 1e9,
            c.sum
        );
    }
}
