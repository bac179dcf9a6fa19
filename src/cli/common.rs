//! Arguments shared by the commands that load a model and generate.

use crate::sample::SamplingParams;
use clap::Args;

/// Model-loading and compute options (llama.cpp spellings).
#[derive(Args, Debug, Clone)]
pub struct ComputeArgs {
    /// Compute threads (default: all cores).
    #[arg(short = 't', long = "threads", default_value_t = 0)]
    pub threads: usize,
    /// Context length in tokens (KV cache size).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx: usize,
    /// Prompt tokens per prefill batch.
    #[arg(short = 'b', long = "batch-size", default_value_t = 128)]
    pub batch: usize,
}

/// Sampling options (llama.cpp spellings and defaults).
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Nucleus sampling threshold (1.0 = off).
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens below min_p x the top probability (0 = off).
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalty for tokens among the last `--repeat-last-n` (1.0 = off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed (default: fixed 0xC0FFEE, so runs repeat; pass your own to vary).
    #[arg(long, default_value_t = 0xC0FFEE)]
    pub seed: u64,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed,
        }
    }
}
