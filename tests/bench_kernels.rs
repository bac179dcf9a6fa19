//! Smoke test of `sluice bench --kernels`: it runs end to end on a tiny buffer and prints a
//! header and one row per type (per prefetch arm). Only the shape of the output is checked;
//! speed is measured by running the benchmark, never asserted here.

use sluice::kernels;
use std::process::Command;

/// Run `sluice bench --kernels` with a 1 MiB buffer, one repetition, one thread, plus `extra`;
/// return stdout's lines after checking it succeeded.
fn bench(extra: &[&str]) -> Vec<String> {
    let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["bench", "--kernels", "--mb", "1", "--reps", "1"])
        .args(["--threads", "1", "--cols", "256"])
        .args(extra)
        .output()
        .expect("run sluice");
    assert!(
        o.status.success(),
        "sluice bench --kernels {extra:?}: {:?}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout)
        .expect("utf-8 output")
        .lines()
        .map(str::to_owned)
        .collect()
}

/// One result row: `type isa prefetch MB matvec read ratio% plain min..max`.
struct Row {
    name: String,
    isa: String,
    prefetch: usize,
}

fn parse_row(line: &str) -> Row {
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(f.len(), 9, "9 fields in {line:?}");
    let num = |s: &str| -> f64 {
        let v: f64 = s.parse().unwrap_or_else(|_| panic!("{s:?} in {line:?}"));
        assert!(v.is_finite() && v >= 0.0, "{s:?} in {line:?}");
        v
    };
    for s in [f[3], f[4], f[5], f[7]] {
        num(s);
    }
    num(f[6].strip_suffix('%').expect("ratio ends in %"));
    let (lo, hi) = f[8].split_once("..").expect("min..max");
    assert!(num(lo) <= num(hi), "{line:?}");
    Row {
        name: f[0].to_owned(),
        isa: f[1].to_owned(),
        prefetch: f[2].parse().expect("prefetch bytes"),
    }
}

fn check_header(lines: &[String]) {
    assert!(lines.len() >= 3, "{lines:?}");
    assert!(
        lines[0].starts_with("sluice bench --kernels: "),
        "{}",
        lines[0]
    );
    assert!(lines[0].contains("1 threads"), "{}", lines[0]);
    assert!(lines[1].starts_with("read GB/s"), "{}", lines[1]);
    let cols: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(&cols[..3], ["type", "isa", "prefetch"], "{}", lines[2]);
}

#[test]
fn one_row_per_supported_type() {
    let lines = bench(&[]);
    check_header(&lines);
    let rows: Vec<Row> = lines[3..].iter().map(|l| parse_row(l)).collect();
    let want: Vec<String> = kernels::supported_types()
        .iter()
        .map(|t| t.name())
        .collect();
    let got: Vec<String> = rows.iter().map(|r| r.name.clone()).collect();
    assert_eq!(got, want);
    for r in &rows {
        assert!(["scalar", "avx2", "avx512"].contains(&r.isa.as_str()));
    }
}

#[test]
fn types_isa_and_prefetch_arms() {
    let lines = bench(&[
        "--types",
        "Q4_K,IQ2_XXS",
        "--isa",
        "scalar",
        "--prefetch",
        "0,1024",
    ]);
    check_header(&lines);
    let rows: Vec<(String, String, usize)> = lines[3..]
        .iter()
        .map(|l| parse_row(l))
        .map(|r| (r.name, r.isa, r.prefetch))
        .collect();
    let s = |t: &str, p| (t.to_owned(), "scalar".to_owned(), p);
    assert_eq!(
        rows,
        [
            s("Q4_K", 0),
            s("Q4_K", 1024),
            s("IQ2_XXS", 0),
            s("IQ2_XXS", 1024)
        ]
    );
}

#[test]
fn bad_options_fail_in_one_line() {
    for (args, needle) in [
        (&["--types", "Q4_K,NOPE"][..], "NOPE"),
        (&["--mb", "0"][..], "--mb"),
        (&["--isa", "sse9"][..], "sse9"),
        (&["--prefetch", "far"][..], "far"),
        (&["--json"][..], "--json is for a MODEL"),
        (&["--csv"][..], "--csv is for a MODEL"),
        (&["--sweep", "ram=1G"][..], "--sweep is for a MODEL"),
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["bench", "--kernels"])
            .args(args)
            .output()
            .expect("run sluice");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
