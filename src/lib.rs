//! sluice: run Mixture-of-Experts language models far larger than RAM on one machine.
//!
//! Map (see docs/ARCHITECTURE.md): `format` reads model files into byte ranges; `kernels`
//! computes on encoded tensors; `model` holds shared blocks and one file per architecture
//! family; `tokenizer`, `chat` and `sample` turn text into tokens and back; `engine` owns a
//! running model (placement, session) and the one prefill/decode loop (`generate` keeps its
//! old entry points); `inspect` summarises a model; `cli` holds the subcommands, thin clients
//! of the engine, that `main.rs` dispatches to.

pub mod bench;
pub mod chat;
pub mod cli;
pub mod convert;
pub mod default_model;
pub mod dtype;
pub mod engine;
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
