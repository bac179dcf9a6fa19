//! `sluice bench MODEL`: pp (prompt processing) and tg (generation) tok/s like llama-bench.
//!
//! Every repetition is a fresh `sluice run` process (this executable), greedy (`--temp 0`), with
//! a fixed seed, `--ignore-eos` and `--usage-freeze` (so one run's statistics cannot change the
//! next), unless an arm's own flags say otherwise. The figures come from the run's `[timing]`
//! line, and the expert hit rate from its `--stats-json` file. With `--ab 'A' 'B'` the arms
//! alternate A B B A A B ... (so drift in a noisy machine falls on both arms alike) with the
//! same prompt, and the B/A ratio is refused when the arms' generated text differs: a ratio
//! between runs that computed different things is not a speed-up. With `--sweep NAME=V1,V2,..`
//! there is one arm per value (`--NAME V`), in order on even repetitions and reversed on odd
//! ones; the arms may generate different text (a swept flag may change the computation), which
//! is reported, not refused. `--plot` draws the sweep (`bench_plot.rs`).
//!
//! Owns: the process loop, parsing and statistics. Does not own: what a run does.

use super::bench_plot::{write_sweep_svg, SweepPoint};
use crate::engine::load_tokenizer;
use crate::format::ModelFiles;
use anyhow::{bail, Context};
use std::path::Path;
use std::process::Command;

/// One arm's samples.
struct Arm {
    name: String,
    flags: Vec<String>,
    pp: Vec<f64>,
    tg: Vec<f64>,
    hit: Vec<f64>,
    texts: Vec<String>,
    prompt_tokens: usize,
    generated: usize,
}

/// median, mean, sample sd, min, max.
fn summary(v: &[f64]) -> (f64, f64, f64, f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN, f64::NAN, f64::NAN);
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let median = if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    };
    let mean = s.iter().sum::<f64>() / n as f64;
    let sd = if n > 1 {
        (s.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
    } else {
        0.0
    };
    (median, mean, sd, s[0], s[n - 1])
}

/// A prompt of at least `n` tokens of plain English words, and its token count.
fn make_prompt(files: &ModelFiles, n: usize) -> anyhow::Result<(String, usize)> {
    let tok = load_tokenizer(files)?;
    let words = [
        "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "rivers",
        "carry", "water", "to", "distant", "seas",
    ];
    let mut text = String::from("The");
    let mut i = 0usize;
    let mut len = tok.encode(&text, true)?.len();
    while len < n.max(1) {
        text.push(' ');
        text.push_str(words[i % words.len()]);
        i += 1;
        if i > 64 * n + 64 {
            bail!("bench: could not build a {n}-token prompt with this tokenizer");
        }
        len = tok.encode(&text, true)?.len();
    }
    Ok((text, len))
}

/// `[timing] prompt P tok, prefill X tok/s | generated G tok, decode Y tok/s | ...`.
fn parse_timing(stderr: &str) -> Option<(usize, f64, usize, f64)> {
    let line = stderr.lines().find(|l| l.starts_with("[timing]"))?;
    let num_after = |key: &str| -> Option<f64> {
        let rest = &line[line.find(key)? + key.len()..];
        rest.split_whitespace().next()?.parse().ok()
    };
    Some((
        num_after("prompt")? as usize,
        num_after("prefill")?,
        num_after("generated")? as usize,
        num_after("decode")?,
    ))
}

/// `--sweep NAME=V1,V2,..` as (NAME, the flag as `sluice run` takes it, the values).
fn parse_sweep(s: &str) -> anyhow::Result<(String, String, Vec<String>)> {
    let (name, values) = s.split_once('=').with_context(|| {
        format!("bench: --sweep {s:?}: expected NAME=V1,V2,.. (e.g. ram=2G,4G)")
    })?;
    let name = name.trim().trim_start_matches('-').to_string();
    if name.is_empty() || name.contains(char::is_whitespace) {
        bail!("bench: --sweep {s:?}: the flag name is empty or has spaces");
    }
    let values: Vec<String> = values.split(',').map(|v| v.trim().to_string()).collect();
    if values.iter().any(String::is_empty) {
        bail!("bench: --sweep {s:?}: an empty value");
    }
    let flag = if name.chars().count() == 1 {
        format!("-{name}")
    } else {
        format!("--{name}")
    };
    Ok((name, flag, values))
}

fn has_flag(flags: &[String], name: &str) -> bool {
    flags
        .iter()
        .any(|f| f == name || f.starts_with(&format!("{name}=")))
}

/// What a MODEL benchmark is asked for (`sluice bench`'s flags, see cli/bench.rs).
#[derive(Clone, Debug, Default)]
pub struct ModelBench {
    pub n_prompt: usize,
    pub n_gen: usize,
    /// Tokens in the cache before the tests (`--depth` of each run).
    pub depth: usize,
    /// Generation timed after the prompt in one run (else in its own run, as llama-bench).
    pub tg_after_prompt: bool,
    pub repetitions: Option<usize>,
    pub json: bool,
    pub csv: bool,
    pub ab: Option<Vec<String>>,
    pub sweep: Option<String>,
    pub plot: Option<std::path::PathBuf>,
    pub run_flags: Option<String>,
    pub threads: Option<usize>,
}

pub fn run(model: &Path, args: &ModelBench) -> anyhow::Result<()> {
    let reps = args.repetitions.unwrap_or(3);
    if reps == 0 {
        bail!("bench: -r must be at least 1");
    }
    if args.json && args.csv {
        bail!("bench: give --json or --csv, not both");
    }
    let sweep = args.sweep.as_deref().map(parse_sweep).transpose()?;
    if sweep.is_some() && args.ab.is_some() {
        bail!("bench: give --ab or --sweep, not both");
    }
    if args.plot.is_some() && sweep.is_none() {
        bail!("bench: --plot draws a --sweep; give --sweep NAME=V1,V2,..");
    }
    let files = ModelFiles::open(model)?;
    let (prompt, prompt_len) = make_prompt(&files, args.n_prompt)?;
    let (one, _) = make_prompt(&files, 1)?;
    drop(files);
    let exe = std::env::current_exe().context("bench: finding the sluice executable")?;
    let common: Vec<String> = args
        .run_flags
        .as_deref()
        .unwrap_or("")
        .split_whitespace()
        .map(String::from)
        .collect();
    let arm = |name: String, flags: Vec<String>| Arm {
        name,
        flags,
        pp: vec![],
        tg: vec![],
        hit: vec![],
        texts: vec![],
        prompt_tokens: 0,
        generated: 0,
    };
    let mut arms: Vec<Arm> = match (&args.ab, &sweep) {
        (_, Some((name, flag, values))) => values
            .iter()
            .map(|v| {
                if has_flag(&common, flag) {
                    bail!("bench: --sweep {name}: {flag} is also in --run-flags");
                }
                Ok(arm(format!("{name}={v}"), vec![flag.clone(), v.clone()]))
            })
            .collect::<anyhow::Result<_>>()?,
        (Some(v), None) if v.len() == 2 => v
            .iter()
            .zip(["A", "B"])
            .map(|(f, n)| arm(n.into(), f.split_whitespace().map(String::from).collect()))
            .collect(),
        (Some(_), None) => bail!("bench: --ab takes two flag sets"),
        (None, None) => vec![arm("run".into(), vec![])],
    };
    let stats_path = std::env::temp_dir().join(format!("sluice-bench-{}.json", std::process::id()));
    for r in 0..reps {
        // A B, B A, ... (and for a sweep: in order, then reversed).
        let order: Vec<usize> = if r % 2 == 0 {
            (0..arms.len()).collect()
        } else {
            (0..arms.len()).rev().collect()
        };
        for i in order {
            let arm = &mut arms[i];
            let mut flags: Vec<String> = common.iter().chain(arm.flags.iter()).cloned().collect();
            for (name, value) in [
                ("--temp", Some("0")),
                ("--seed", Some("42")),
                ("--usage-freeze", None),
                ("--ignore-eos", None),
            ] {
                if !has_flag(&flags, name) {
                    flags.push(name.into());
                    flags.extend(value.map(String::from));
                }
            }
            if args.depth > 0 {
                if !has_flag(&flags, "--depth") {
                    flags.extend(["--depth".to_string(), args.depth.to_string()]);
                }
                if !has_flag(&flags, "-c") && !has_flag(&flags, "--ctx-size") {
                    let ctx = args.depth + prompt_len + args.n_gen + 16;
                    flags.extend(["-c".to_string(), ctx.to_string()]);
                }
            }
            if let Some(t) = args.threads {
                if !has_flag(&flags, "-t") && !has_flag(&flags, "--threads") {
                    flags.extend(["-t".to_string(), t.to_string()]);
                }
            }
            // llama-bench's tests: pp in a run that generates nothing, tg in a run of its own
            // from a one-token prompt (both at the depth); or tg after the prompt in one run.
            let split = !args.tg_after_prompt && args.n_gen > 0 && prompt_len > 1;
            let runs: Vec<(&str, usize)> = if split {
                vec![(prompt.as_str(), 0), (one.as_str(), args.n_gen)]
            } else {
                vec![(prompt.as_str(), args.n_gen)]
            };
            let mut got = Vec::new();
            for (text, n_gen) in runs {
                let _ = std::fs::remove_file(&stats_path);
                let out = Command::new(&exe)
                    .arg("run")
                    .arg(model)
                    .args(["-p", text, "-n", &n_gen.to_string(), "--stats-json"])
                    .arg(&stats_path)
                    .args(&flags)
                    .output()
                    .with_context(|| format!("bench: starting {}", exe.display()))?;
                let stderr = String::from_utf8_lossy(&out.stderr);
                if !out.status.success() {
                    let last = stderr.lines().last().unwrap_or("").to_string();
                    bail!(
                        "bench: arm {} (`sluice run ... {}`) failed: {last}",
                        arm.name,
                        flags.join(" ")
                    );
                }
                let timing = parse_timing(&stderr).with_context(|| {
                    format!(
                        "bench: arm {}: no [timing] line in the run's output",
                        arm.name
                    )
                })?;
                got.push((timing, out.stdout));
            }
            let ((p, pp, _, _), _) = got[0];
            let ((_, _, g, tg), ref stdout) = got[got.len() - 1];
            arm.pp.push(pp);
            arm.tg.push(tg);
            arm.prompt_tokens = p;
            arm.generated = g;
            if let Some(h) = std::fs::read_to_string(&stats_path)
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .and_then(|v| v["hit_rate"].as_f64())
            {
                arm.hit.push(h);
            }
            arm.texts.push(String::from_utf8_lossy(stdout).to_string());
            if !args.json && !args.csv {
                eprintln!(
                    "[bench] rep {} arm {}: pp {pp:.2} tok/s, tg {tg:.2} tok/s",
                    r + 1,
                    arm.name
                );
            }
        }
    }
    let _ = std::fs::remove_file(&stats_path);

    let same_within = arms
        .iter()
        .all(|a| a.texts.windows(2).all(|w| w[0] == w[1]));
    let same_across = arms
        .windows(2)
        .all(|w| w[0].texts.first() == w[1].texts.first());
    let ratio =
        |f: fn(&Arm) -> &Vec<f64>| -> f64 { summary(f(&arms[1])).0 / summary(f(&arms[0])).0 };
    let is_ab = args.ab.is_some();
    let ratios =
        (is_ab && same_within && same_across).then(|| (ratio(|a| &a.pp), ratio(|a| &a.tg)));
    let model_name = model.display().to_string();
    let mut rows = Vec::new();
    let at = if args.depth > 0 {
        format!(" @ d{}", args.depth)
    } else {
        String::new()
    };
    for a in &arms {
        for (test, v) in [
            (format!("pp{}{at}", a.prompt_tokens), &a.pp),
            (format!("tg{}{at}", a.generated), &a.tg),
        ] {
            // `-n 0` times prefill alone (llama-bench prints no tg row then).
            if test.starts_with("tg") && args.n_gen == 0 {
                continue;
            }
            let (med, mean, sd, min, max) = summary(v);
            let hit = if a.hit.is_empty() {
                None
            } else {
                Some(summary(&a.hit).0)
            };
            rows.push(serde_json::json!({"model": model_name, "arm": a.name, "flags": a.flags.join(" "), "test": test, "reps": v.len(), "median": med, "mean": mean, "sd": sd, "min": min, "max": max, "samples": v, "hit_rate": hit}));
        }
    }
    // The sweep table: one row per value.
    let points: Vec<SweepPoint> = arms
        .iter()
        .map(|a| SweepPoint {
            value: a.flags.get(1).cloned().unwrap_or_default(),
            tg: summary(&a.tg).0,
            hit: (!a.hit.is_empty()).then(|| summary(&a.hit).0),
        })
        .collect();
    let sweep_rows: Vec<serde_json::Value> = arms
        .iter()
        .zip(&points)
        .map(|(a, p)| {
            serde_json::json!({"value": p.value, "tg_median": p.tg, "pp_median": summary(&a.pp).0, "hit_rate": p.hit})
        })
        .collect();
    if let (Some(path), Some((name, _, _))) = (&args.plot, &sweep) {
        let file = model
            .file_name()
            .map(|f| f.to_string_lossy().to_string())
            .unwrap_or_else(|| model_name.clone());
        write_sweep_svg(path, &file, name, &points)
            .with_context(|| format!("bench: writing the plot {}", path.display()))?;
    }
    if args.json {
        let mut v = serde_json::json!({
            "results": rows,
            "text_identical": same_within && same_across,
            "ratio_b_over_a": ratios.map(|(p, t)| serde_json::json!({"pp": p, "tg": t})),
        });
        if let Some((name, _, _)) = &sweep {
            v["sweep"] = serde_json::json!({"flag": name, "rows": sweep_rows});
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else if args.csv {
        // A sweep adds its flag and value to every row (the tg rows are the sweep table).
        let sweep_name = sweep.as_ref().map(|(n, _, _)| n.as_str());
        println!(
            "model,arm,flags,test,reps,median,mean,sd,min,max,hit_rate{}",
            if sweep_name.is_some() {
                ",sweep_flag,sweep_value"
            } else {
                ""
            }
        );
        for r in &rows {
            let extra = match sweep_name {
                Some(n) => format!(
                    ",{n},{}",
                    r["arm"]
                        .as_str()
                        .and_then(|a| a.split_once('='))
                        .map(|x| x.1)
                        .unwrap_or("")
                ),
                None => String::new(),
            };
            println!(
                "{},{},\"{}\",{},{},{:.4},{:.4},{:.4},{:.4},{:.4},{}{extra}",
                r["model"].as_str().unwrap_or(""),
                r["arm"].as_str().unwrap_or(""),
                r["flags"].as_str().unwrap_or(""),
                r["test"].as_str().unwrap_or(""),
                r["reps"],
                r["median"].as_f64().unwrap_or(f64::NAN),
                r["mean"].as_f64().unwrap_or(f64::NAN),
                r["sd"].as_f64().unwrap_or(f64::NAN),
                r["min"].as_f64().unwrap_or(f64::NAN),
                r["max"].as_f64().unwrap_or(f64::NAN),
                r["hit_rate"]
                    .as_f64()
                    .map(|h| format!("{h:.4}"))
                    .unwrap_or_default()
            );
        }
    } else {
        println!(
            "| {:<4} | {:<40} | {:>7} | {:>10} | {:>8} | {:>8} | {:>10} | {:>6} |",
            "arm", "flags", "test", "t/s median", "mean", "sd", "min..max", "hit"
        );
        for r in &rows {
            let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
            println!(
                "| {:<4} | {:<40} | {:>7} | {:>10.2} | {:>8.2} | {:>8.2} | {:>10} | {:>6} |",
                r["arm"].as_str().unwrap_or(""),
                r["flags"].as_str().unwrap_or(""),
                r["test"].as_str().unwrap_or(""),
                f("median"),
                f("mean"),
                f("sd"),
                format!("{:.1}..{:.1}", f("min"), f("max")),
                r["hit_rate"]
                    .as_f64()
                    .map(|h| format!("{:.1}%", 100.0 * h))
                    .unwrap_or_else(|| "-".into())
            );
        }
        if let Some((p, t)) = ratios {
            println!(
                "B/A (medians): pp {p:.3}x, tg {t:.3}x; generated text identical across all runs"
            );
        }
        if let Some((name, _, _)) = &sweep {
            println!();
            println!(
                "| {:<12} | {:>13} | {:>13} | {:>7} |",
                name, "tg t/s median", "pp t/s median", "hit"
            );
            for r in &sweep_rows {
                println!(
                    "| {:<12} | {:>13.2} | {:>13.2} | {:>7} |",
                    r["value"].as_str().unwrap_or(""),
                    r["tg_median"].as_f64().unwrap_or(f64::NAN),
                    r["pp_median"].as_f64().unwrap_or(f64::NAN),
                    r["hit_rate"]
                        .as_f64()
                        .map(|h| format!("{:.1}%", 100.0 * h))
                        .unwrap_or_else(|| "-".into())
                );
            }
            if !same_across {
                println!("(the values generated different text: the swept flag changes what is computed)");
            }
        }
    }
    if is_ab && ratios.is_none() {
        bail!("bench --ab: the arms generated different text (or a run differed from its own arm), so no ratio is reported: a speed ratio between runs that computed different things is meaningless");
    }
    if !same_within {
        bail!("bench: repetitions of one run generated different text (nondeterministic flags?)");
    }
    Ok(())
}
