//! The `sluice` command line: parses arguments and dispatches to `sluice::cli`.

use clap::{Parser, Subcommand};
use sluice::cli;

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "Run Mixture-of-Experts models far larger than RAM"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt (no MODEL: the built-in tiny model).
    Run(cli::run::RunArgs),
    /// Interactive chat with the model's chat template.
    Chat(cli::chat::ChatArgs),
    /// Teacher-forced logits of a token sequence, written as float32 .npy [T, vocab].
    Logits(cli::logits::LogitsArgs),
    /// Write a synthetic GGUF with a real model's shapes and random weights.
    Synth(cli::synth::SynthArgs),
    /// Rewrite a GGUF's weight matrices in another type (as llama.cpp's llama-quantize).
    Quantize(cli::quantize::QuantizeArgs),
    /// Describe a model: architecture, experts, quant types, resident and routed bytes.
    Inspect(cli::inspect::InspectArgs),
    /// Benchmarks (`--kernels`: matvec GB/s per type against memory bandwidth).
    Bench(cli::bench::BenchArgs),
    /// Replay a route trace against LRU, hotness and Belady-optimal expert eviction.
    CacheSim(cli::cache_sim::CacheSimArgs),
    /// Check a model's files and measure this machine (CPU, memory, storage, GPU); cached.
    Doctor(cli::doctor::DoctorArgs),
    /// OpenAI- and Anthropic-compatible HTTP server (no MODEL: the built-in tiny model).
    Serve(cli::serve::ServeArgs),
    /// The plan `run` would follow (expert placement, IO, predicted tok/s), with reasons.
    Plan(cli::plan::PlanArgs),
}

fn main() {
    let cli = Cli::parse_from(cli::llama_spellings(std::env::args_os()));
    let result = match cli.command {
        Command::Run(a) => cli::run::run(a),
        Command::Chat(a) => cli::chat::run(a),
        Command::Logits(a) => cli::logits::run(a),
        Command::Synth(a) => cli::synth::run(a),
        Command::Quantize(a) => cli::quantize::run(a),
        Command::Inspect(a) => cli::inspect::run(a),
        Command::Bench(a) => cli::bench::run(a),
        Command::CacheSim(a) => cli::cache_sim::run(a),
        Command::Doctor(a) => cli::doctor::run(a),
        Command::Serve(a) => cli::serve::run_cmd(a),
        Command::Plan(a) => cli::plan::run(a),
    };
    if let Err(e) = result {
        // One line: the chain of causes joined, no backtrace, no raw control characters
        // (text quoted from a hostile file cannot reach the terminal as escape codes).
        let msg = sluice::format::printable(&format!("{e:#}").replace('\n', " "));
        eprintln!("error: {msg}");
        std::process::exit(1);
    }
}
