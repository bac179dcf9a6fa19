//! Command-line subcommands: each file holds one command's clap arguments and its `run`, and
//! calls into the library. `main.rs` only dispatches.

pub mod bench;
pub mod bench_plot;
pub mod cache_sim;
pub mod chat;
pub mod common;
pub mod doctor;
pub mod gpu;
pub mod inspect;
pub mod logits;
pub mod model_bench;
pub mod plan;
pub mod quantize;
pub mod run;
pub mod serve;
pub mod synth;
