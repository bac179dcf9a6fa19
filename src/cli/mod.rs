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

/// llama.cpp's multi-letter short flags as sluice's long ones (`-ctk f16` -> `--cache-type-k
/// f16`, also `-ctk=f16`): clap's short flags are one letter, and `-ctk` would otherwise read
/// as `-c tk`. Only whole arguments are rewritten; everything else passes through unchanged.
pub fn llama_spellings(
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    const MAP: [(&str, &str); 2] = [("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v")];
    args.into_iter()
        .map(|a| {
            let Some(s) = a.to_str() else { return a };
            for (short, long) in MAP {
                if s == short {
                    return long.into();
                }
                if let Some(v) = s.strip_prefix(short).and_then(|r| r.strip_prefix('=')) {
                    return format!("{long}={v}").into();
                }
            }
            a
        })
        .collect()
}
