//! `sluice bench --sweep ... --plot out.svg`: a hand-written SVG of decode tok/s and expert hit
//! rate against the swept flag's values, in two panels sharing the x axis.
//!
//! Owns: the drawing. Does not own: the figures (`model_bench.rs`).
//! Invariant: the file appears whole or not at all (written to a temporary name, then renamed).

use std::fmt::Write as _;
use std::path::Path;

/// One swept value: its label, median decode tok/s, median hit rate (0..1) if the runs
/// streamed experts.
pub struct SweepPoint {
    pub value: String,
    pub tg: f64,
    pub hit: Option<f64>,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A tick step of 1, 2 or 5 times a power of ten giving about five ticks up to `max`.
fn tick_step(max: f64) -> f64 {
    let raw = (max / 5.0).max(1e-9);
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * p)
}

const W: f64 = 760.0;
const LEFT: f64 = 90.0;
const RIGHT: f64 = 30.0;

/// A panel's y axis: label, top value (axis from 0), factor from data to labels, line colour.
struct YAxis<'a> {
    label: &'a str,
    max: f64,
    unit_scale: f64,
    colour: &'a str,
}

/// One panel over [top, bottom] pixels; points at the x positions.
fn panel(
    svg: &mut String,
    (top, bottom): (f64, f64),
    axis: &YAxis,
    xs: &[f64],
    ys: &[Option<f64>],
) {
    let YAxis {
        label: ylabel,
        max: ymax,
        unit_scale,
        colour,
    } = *axis;
    let y_of = |v: f64| bottom - (v / ymax) * (bottom - top);
    let _ = writeln!(
        svg,
        r##"<rect x="{LEFT}" y="{top}" width="{}" height="{}" fill="none" stroke="#888"/>"##,
        W - LEFT - RIGHT,
        bottom - top
    );
    let step = tick_step(ymax);
    let mut t = 0.0;
    while t <= ymax + 1e-9 {
        let y = y_of(t);
        let _ = writeln!(
            svg,
            r##"<line x1="{}" y1="{y:.1}" x2="{LEFT}" y2="{y:.1}" stroke="#888"/><text x="{}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"##,
            LEFT - 5.0,
            LEFT - 8.0,
            y + 4.0,
            (t * unit_scale * 1000.0).round() / 1000.0
        );
        t += step;
    }
    let mid = (top + bottom) / 2.0;
    let _ = writeln!(
        svg,
        r#"<text x="22" y="{mid:.1}" font-size="13" text-anchor="middle" transform="rotate(-90 22 {mid:.1})">{}</text>"#,
        esc(ylabel)
    );
    let pts: Vec<(f64, f64, f64)> = xs
        .iter()
        .zip(ys)
        .filter_map(|(x, y)| y.map(|v| (*x, y_of(v), v)))
        .collect();
    if pts.is_empty() {
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{mid:.1}" font-size="12" text-anchor="middle">no hit rate (the runs had no expert cache)</text>"#,
            (LEFT + W - RIGHT) / 2.0
        );
        return;
    }
    let line: Vec<String> = pts
        .iter()
        .map(|(x, y, _)| format!("{x:.1},{y:.1}"))
        .collect();
    let _ = writeln!(
        svg,
        r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#,
        line.join(" ")
    );
    for (x, y, v) in pts {
        let _ = writeln!(
            svg,
            r#"<circle cx="{x:.1}" cy="{y:.1}" r="4" fill="{colour}"/><text x="{x:.1}" y="{:.1}" font-size="11" text-anchor="middle">{:.2}</text>"#,
            y - 8.0,
            v * unit_scale
        );
    }
}

/// The SVG text of the sweep plot.
pub fn sweep_svg(model: &str, flag: &str, points: &[SweepPoint]) -> String {
    let n = points.len().max(1);
    let span = W - LEFT - RIGHT;
    let xs: Vec<f64> = (0..points.len())
        .map(|i| LEFT + span * (i as f64 + 0.5) / n as f64)
        .collect();
    let mut svg = String::new();
    let h = 560.0;
    let _ = writeln!(
        svg,
        r#"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" font-family="sans-serif">
<rect width="100%" height="100%" fill="white"/>
<text x="{:.1}" y="26" font-size="15" text-anchor="middle">{}</text>"#,
        W / 2.0,
        esc(&format!(
            "sluice bench {model}: decode tok/s and expert hit rate vs --{flag}"
        ))
    );
    let tg_max = points.iter().map(|p| p.tg).fold(0.0, f64::max);
    let tg_max = if tg_max.is_finite() && tg_max > 0.0 {
        tg_max * 1.15
    } else {
        1.0
    };
    let tg: Vec<Option<f64>> = points
        .iter()
        .map(|p| p.tg.is_finite().then_some(p.tg))
        .collect();
    let tg_axis = YAxis {
        label: "decode tok/s (median)",
        max: tg_max,
        unit_scale: 1.0,
        colour: "#1f77b4",
    };
    panel(&mut svg, (50.0, 250.0), &tg_axis, &xs, &tg);
    let hit: Vec<Option<f64>> = points.iter().map(|p| p.hit).collect();
    let hit_axis = YAxis {
        label: "expert hit rate (%)",
        max: 1.0,
        unit_scale: 100.0,
        colour: "#d62728",
    };
    panel(&mut svg, (290.0, 490.0), &hit_axis, &xs, &hit);
    for (x, p) in xs.iter().zip(points) {
        let _ = writeln!(
            svg,
            r#"<text x="{x:.1}" y="508" font-size="12" text-anchor="middle">{}</text>"#,
            esc(&p.value)
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="540" font-size="13" text-anchor="middle">{}</text>
</svg>"#,
        LEFT + span / 2.0,
        esc(&format!("--{flag}"))
    );
    svg
}

/// Write the plot to `path` (through a temporary file in the same directory, then renamed).
pub fn write_sweep_svg(
    path: &Path,
    model: &str,
    flag: &str,
    points: &[SweepPoint],
) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp);
    std::fs::write(&tmp, sweep_svg(model, flag, points))?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round() {
        assert_eq!(tick_step(1.0), 0.2);
        assert_eq!(tick_step(37.0), 10.0);
        assert_eq!(tick_step(0.9), 0.2);
    }

    #[test]
    fn escapes_text() {
        let svg = sweep_svg(
            "a&b<c>.gguf",
            "ram",
            &[SweepPoint {
                value: "2G".into(),
                tg: 3.0,
                hit: None,
            }],
        );
        assert!(svg.contains("a&amp;b&lt;c&gt;.gguf"));
        assert!(svg.contains("no hit rate"));
    }
}
