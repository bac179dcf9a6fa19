//! Benchmarks that report figures against a ceiling measured in the same run
//! (see /work/shared/BENCHMARKS.md habits and docs/PERFORMANCE.md for recorded results).
//!
//! Owns: the measurement loops and their statistics. Does not own: printing (cli/bench.rs) or
//! the kernels themselves. Invariant: every throughput figure comes with the ceiling it is
//! compared to, measured with the same thread count on the same buffer.

pub mod kernels;
