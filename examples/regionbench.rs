//! Cost of a short parallel region: rayon vs the spinning gang (kernels::par_for).
use std::hint::black_box;
use std::time::Instant;
fn work(k: usize) -> f64 {
    let mut x = 0.0f64;
    for i in 0..k {
        x += (i as f64).sqrt();
    }
    x
}
fn main() {
    let t: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let tasks: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(64);
    let per: usize = std::env::args()
        .nth(3)
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(t)
        .build()
        .unwrap();
    let iters = 20000;
    for round in 0..3 {
        for spin in [false, true] {
            let t0 = Instant::now();
            pool.install(|| {
                for _ in 0..iters {
                    black_box(work(500));
                    if spin {
                        sluice::kernels::par_for(Some(&pool), tasks, &|i| {
                            black_box(work(per + i % 2));
                        });
                    } else {
                        use rayon::prelude::*;
                        (0..tasks).into_par_iter().for_each(|i| {
                            black_box(work(per + i % 2));
                        });
                    }
                }
            });
            let dt = t0.elapsed().as_secs_f64() / iters as f64 * 1e6;
            println!(
                "round {round} {} {t} threads {tasks} tasks: {dt:.2} us per step",
                if spin { "spin " } else { "rayon" }
            );
        }
    }
    // serial reference
    let t0 = Instant::now();
    for _ in 0..iters {
        black_box(work(500));
        for i in 0..tasks {
            black_box(work(per + i % 2));
        }
    }
    println!(
        "serial: {:.2} us per step",
        t0.elapsed().as_secs_f64() / iters as f64 * 1e6
    );
}
