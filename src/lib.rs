//! sluice: run Mixture-of-Experts language models far larger than RAM on one machine.
//!
//! Map (see docs/ARCHITECTURE.md): `format` reads model files into byte ranges; `kernels`
//! computes on encoded tensors; `model` holds shared blocks and one file per architecture
//! family; `cli` holds the subcommands that `main.rs` dispatches to.

pub mod bench;
pub mod cli;
pub mod dtype;
pub mod format;
pub mod kernels;
