//! sluice: run Mixture-of-Experts language models far larger than RAM on one machine.
//!
//! Map (see docs/ARCHITECTURE.md): `format` reads model files into byte ranges; `kernels`
//! computes on encoded tensors; `model` holds shared blocks and one file per architecture
//! family; `tokenizer`, `chat` and `sample` turn text into tokens and back; `generate` runs
//! the prefill/decode loop; `inspect` summarises a model; `cli` holds the subcommands that
//! `main.rs` dispatches to.

pub mod bench;
pub mod chat;
pub mod cli;
pub mod default_model;
pub mod dtype;
pub mod experts;
pub mod format;
pub mod generate;
pub mod gpu;
pub mod inspect;
pub mod kernels;
pub mod model;
pub mod npy;
pub mod plan;
pub mod sample;
pub mod serve;
pub mod speculative;
pub mod synth;
pub mod tokenizer;
