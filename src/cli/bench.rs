//! `sluice bench --kernels`: kernel throughput against the machine's memory read bandwidth.
//! `sluice bench MODEL`: prompt processing and generation tok/s like llama-bench, each test of
//! each repetition a fresh `sluice run` process (pp from the prompt, tg from a one-token prompt,
//! both at the depth; `--tg-after-prompt` times tg after the prompt in one run); `--ab 'FLAGS_A' 'FLAGS_B'` compares two flag sets
//! (see `model_bench.rs`).

use crate::bench::kernels::{bench_type, cpu_model, KernelBenchOpts};
use crate::dtype::DType;
use crate::kernels::{self, Isa};
use anyhow::{bail, Context};
use clap::Args;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// A model to benchmark pp/tg on (`.gguf` or safetensors directory).
    pub model: Option<std::path::PathBuf>,
    /// Prompt tokens (pp test).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    pub n_prompt: usize,
    /// Generated tokens (tg test).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub n_gen: usize,
    /// Tokens already in the KV cache before the pp and tg tests (llama-bench's `-d`): each run
    /// first fills the cache with this many tokens, untimed (`sluice run --depth`).
    #[arg(short = 'd', long = "depth", default_value_t = 0)]
    pub depth: usize,
    /// Time generation in the prompt's run, after the prompt (at depth + prompt tokens, with
    /// the experts the prompt brought in), instead of as llama-bench does: the tg test in its
    /// own run from a one-token prompt at the depth.
    #[arg(long)]
    pub tg_after_prompt: bool,
    /// Repetitions for a MODEL (default 3).
    #[arg(short = 'r', long = "repetitions")]
    pub repetitions: Option<usize>,
    /// Print results as JSON.
    #[arg(long)]
    pub json: bool,
    /// Print results as CSV.
    #[arg(long)]
    pub csv: bool,
    /// Two flag sets for `sluice run` (split on whitespace; no quoting), run as fresh
    /// processes interleaved A B B A ...; the ratio B/A is refused if their text differs.
    #[arg(long, num_args = 2, value_names = ["FLAGS_A", "FLAGS_B"], allow_hyphen_values = true)]
    pub ab: Option<Vec<String>>,
    /// Sweep one `sluice run` flag: `NAME=V1,V2,..` runs the bench once per value, passing
    /// `--NAME V` (`-N V` for a one-letter NAME), each repetition a fresh process (values
    /// interleaved, reversed every other repetition), and prints tok/s and hit rate per value.
    /// E.g. `--sweep ram=2G,4G,8G`.
    #[arg(long)]
    pub sweep: Option<String>,
    /// With --sweep: write an SVG of decode tok/s and expert hit rate against the values.
    #[arg(long)]
    pub plot: Option<std::path::PathBuf>,
    /// Extra flags for every `sluice run` (split on whitespace).
    #[arg(long = "run-flags", allow_hyphen_values = true)]
    pub run_flags: Option<String>,
    /// Benchmark the matvec kernels of every supported type.
    #[arg(long)]
    pub kernels: bool,
    /// Threads for the matvec and for the bandwidth sweep (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Weight buffer per type, in MiB; make it several times the last-level cache.
    #[arg(long, default_value_t = 1024)]
    pub mb: usize,
    /// Timed repetitions (medians are reported).
    #[arg(long, default_value_t = 7)]
    pub reps: usize,
    /// Columns per weight row.
    #[arg(long, default_value_t = 4096)]
    pub cols: usize,
    /// Comma-separated types to run (default: every supported type), e.g. `Q4_K,Q8_0`.
    #[arg(long)]
    pub types: Option<String>,
    /// Cap the kernels' instruction set: scalar, avx2 or avx512 (as `SLUICE_ISA`).
    #[arg(long)]
    pub isa: Option<String>,
    /// Kernel prefetch distances in bytes to compare, comma-separated (0 = off), e.g.
    /// `0,2048`: each is an interleaved arm on the same buffer. Default: the current distance.
    #[arg(long)]
    pub prefetch: Option<String>,
    /// Activation rows per matmul: 1 is the decode matvec; more measures a prefill-like batch
    /// (GB/s still counts each weight byte once per matmul).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if let Some(m) = &args.model {
        if args.kernels {
            bail!("bench: give either MODEL or --kernels, not both");
        }
        let mb = super::model_bench::ModelBench {
            n_prompt: args.n_prompt,
            n_gen: args.n_gen,
            depth: args.depth,
            tg_after_prompt: args.tg_after_prompt,
            repetitions: args.repetitions,
            json: args.json,
            csv: args.csv,
            ab: args.ab.clone(),
            sweep: args.sweep.clone(),
            plot: args.plot.clone(),
            run_flags: args.run_flags.clone(),
            threads: args.threads,
        };
        return super::model_bench::run(m, &mb);
    }
    if !args.kernels {
        bail!("bench: say what to benchmark (MODEL or --kernels)");
    }
    // Flags of a MODEL benchmark mean nothing here: refused rather than ignored.
    for (flag, given) in [
        ("--json", args.json),
        ("--csv", args.csv),
        ("--ab", args.ab.is_some()),
        ("--sweep", args.sweep.is_some()),
        ("--plot", args.plot.is_some()),
        ("--run-flags", args.run_flags.is_some()),
        ("-r", args.repetitions.is_some()),
        ("-d", args.depth > 0),
    ] {
        if given {
            bail!("bench --kernels: {flag} is for a MODEL benchmark (the kernel table is text only; use --reps for repetitions)");
        }
    }
    let threads = match args.threads {
        Some(0) => bail!("bench: --threads must be at least 1"),
        Some(n) => n,
        None => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    };
    if args.mb == 0 {
        bail!("bench: --mb must be at least 1");
    }
    let isa = match &args.isa {
        Some(s) => Isa::parse(s)
            .with_context(|| format!("bench: --isa {s:?}: expected scalar, avx2 or avx512"))?,
        None => Isa::detect(),
    };
    let types = match &args.types {
        Some(list) => list
            .split(',')
            .map(|s| {
                let t = DType::from_name(s.trim())
                    .with_context(|| format!("bench: --types: unknown type {s:?}"))?;
                kernels::kernels_for(t).with_context(|| format!("bench: --types {s}"))?;
                Ok(t)
            })
            .collect::<anyhow::Result<Vec<_>>>()?,
        None => kernels::supported_types(),
    };
    let prefetch = match &args.prefetch {
        Some(list) => list
            .split(',')
            .map(|s| {
                s.trim()
                    .parse::<usize>()
                    .with_context(|| format!("bench: --prefetch: {s:?} is not a byte count"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?,
        None => Vec::new(),
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("bench: thread pool")?;
    let opts = KernelBenchOpts {
        mib: args.mb,
        cols: args.cols,
        reps: args.reps,
        isa,
        prefetch,
        batch: args.batch,
    };
    if args.batch == 0 {
        bail!("bench: --batch must be at least 1");
    }

    println!(
        "sluice bench --kernels: {} | {threads} threads | isa cap {} (hardware {}) | {} MiB per type, {} cols, batch {}, {} reps, medians",
        cpu_model().unwrap_or_else(|| "unknown CPU".into()),
        isa.min(Isa::detect()).name(),
        Isa::hardware().name(),
        args.mb,
        args.cols,
        args.batch,
        args.reps
    );
    println!("read GB/s: the better median of a plain read sweep and a prefetching one (plain shown apart)");
    println!(
        "{:<8} {:<7} {:>8} {:>7} {:>12} {:>10} {:>7} {:>11}   matvec min..max",
        "type", "isa", "prefetch", "MB", "matvec GB/s", "read GB/s", "ratio", "plain read"
    );
    for t in types {
        for r in bench_type(t, &opts, &pool).with_context(|| format!("bench: {t}"))? {
            println!(
                "{:<8} {:<7} {:>8} {:>7.0} {:>12.2} {:>10.2} {:>6.0}% {:>11.2}   {:.2}..{:.2}",
                t.name(),
                r.isa.name(),
                r.prefetch,
                r.bytes as f64 / 1e6,
                r.matvec.median,
                r.read.median,
                100.0 * r.ratio(),
                r.read_plain.median,
                r.matvec.min,
                r.matvec.max
            );
        }
    }
    Ok(())
}
