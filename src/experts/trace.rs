//! Route traces: which experts each request of a run named, for replay by `sluice cache-sim`.
//!
//! Format (text, one request per line; docs/FORMATS.md):
//! ```text
//! # sluice route-trace v1
//! # experts-per-layer 0 128 128 ...
//! TOKEN LAYER E1 E2 ...
//! ```
//! `TOKEN` is the number of decoded tokens before the request (the cache's `tick_token`
//! count), non-decreasing; `LAYER` and the experts are indices. A line is one `begin` of the
//! cache, so a replay sees exactly the waves the cache saw.
//! Owns `TraceWriter` and `Trace` (the parsed file). Invariant: a `Trace` that loaded has only
//! in-range, distinct experts per line and non-decreasing tokens.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::ExpertError;

const MAGIC: &str = "# sluice route-trace v1";
const SHAPE: &str = "# experts-per-layer";

/// Appends requests to a trace file (buffered; no allocation per line).
pub struct TraceWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TraceWriter {
    pub fn create(path: &Path, experts_per_layer: &[usize]) -> Result<TraceWriter, ExpertError> {
        let f = File::create(path).map_err(|e| ExpertError::io(path, "create", e))?;
        let mut w = TraceWriter {
            path: path.to_path_buf(),
            out: BufWriter::with_capacity(1 << 16, f),
        };
        let mut head = format!("{MAGIC}\n{SHAPE}");
        for n in experts_per_layer {
            head.push_str(&format!(" {n}"));
        }
        head.push('\n');
        w.out
            .write_all(head.as_bytes())
            .map_err(|e| ExpertError::io(path, "write", e))?;
        Ok(w)
    }

    pub fn record(
        &mut self,
        token: u64,
        layer: usize,
        experts: &[usize],
    ) -> Result<(), ExpertError> {
        let r = (|| {
            write!(self.out, "{token} {layer}")?;
            for e in experts {
                write!(self.out, " {e}")?;
            }
            self.out.write_all(b"\n")
        })();
        r.map_err(|e| ExpertError::io(&self.path, "write", e))
    }

    pub fn flush(&mut self) -> Result<(), ExpertError> {
        self.out
            .flush()
            .map_err(|e| ExpertError::io(&self.path, "write", e))
    }
}

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceLine {
    pub token: u64,
    pub layer: usize,
    pub experts: Vec<usize>,
}

/// A parsed route trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    pub experts_per_layer: Vec<usize>,
    pub lines: Vec<TraceLine>,
}

impl Trace {
    pub fn load(path: &Path) -> Result<Trace, ExpertError> {
        let text = std::fs::read_to_string(path).map_err(|e| ExpertError::io(path, "read", e))?;
        Trace::parse(&text, path)
    }

    /// Parses trace text; `path` only names the source in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Trace, ExpertError> {
        let err = |line: usize, msg: String| ExpertError::Trace {
            path: path.to_path_buf(),
            line,
            msg,
        };
        let mut lines_in = text.lines().enumerate();
        match lines_in.next() {
            Some((_, l)) if l.trim_end() == MAGIC => {}
            _ => {
                return Err(err(
                    1,
                    format!("not a route trace: the first line must be `{MAGIC}`"),
                ))
            }
        }
        let shape_line = lines_in.next().map(|(_, l)| l).unwrap_or("");
        let Some(rest) = shape_line.strip_prefix(SHAPE) else {
            return Err(err(2, format!("expected `{SHAPE} N N ...`")));
        };
        let mut experts_per_layer = Vec::new();
        for w in rest.split_whitespace() {
            experts_per_layer.push(
                w.parse::<usize>()
                    .map_err(|_| err(2, format!("`{w}` is not an expert count")))?,
            );
        }
        let max_e = experts_per_layer.iter().copied().max().unwrap_or(0);
        let mut seen = vec![usize::MAX; max_e];
        let mut lines = Vec::new();
        let mut last_token = 0;
        for (i, l) in lines_in {
            let n = i + 1;
            let l = l.trim();
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            let mut words = l.split_whitespace();
            let mut num = |what: &str| -> Result<u64, ExpertError> {
                let w = words
                    .next()
                    .ok_or_else(|| err(n, format!("missing {what}")))?;
                w.parse::<u64>()
                    .map_err(|_| err(n, format!("{what} `{w}` is not a number")))
            };
            let token = num("token")?;
            let layer = num("layer")? as usize;
            if token < last_token {
                return Err(err(
                    n,
                    format!("token {token} after token {last_token}: tokens must not decrease"),
                ));
            }
            last_token = token;
            let Some(&n_exp) = experts_per_layer.get(layer) else {
                return Err(err(
                    n,
                    format!(
                        "layer {layer} out of range ({} layers)",
                        experts_per_layer.len()
                    ),
                ));
            };
            let mut experts = Vec::new();
            for w in words {
                let e: usize = w
                    .parse()
                    .map_err(|_| err(n, format!("expert `{w}` is not a number")))?;
                if e >= n_exp {
                    return Err(err(
                        n,
                        format!("expert {e} out of range: layer {layer} has {n_exp}"),
                    ));
                }
                if seen[e] == n {
                    return Err(err(n, format!("expert {e} named twice")));
                }
                seen[e] = n;
                experts.push(e);
            }
            lines.push(TraceLine {
                token,
                layer,
                experts,
            });
        }
        Ok(Trace {
            experts_per_layer,
            lines,
        })
    }

    /// Tokens covered (last token index + 1; 0 for an empty trace).
    pub fn tokens(&self) -> u64 {
        self.lines.last().map_or(0, |l| l.token + 1)
    }

    /// Expert selections in all requests.
    pub fn selections(&self) -> u64 {
        self.lines.iter().map(|l| l.experts.len() as u64).sum()
    }
}
