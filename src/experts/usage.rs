//! `UsageStats`: how often each (layer, expert) was selected, kept across runs beside the model
//! so `--autopin` can pin the most used experts from the start.
//!
//! Owns the counts and their file: versioned JSON tied to a model identity string, written to a
//! temporary file and renamed. Does not decide where the file lives or how many to pin.
//! Invariant: a saved file is either the previous complete file or the new complete one (never
//! half written), and `load` refuses a file made for another model or another format version.
//! `load_matching` never blocks a run: a damaged file or one of the wrong shape is set aside
//! as `.bad`, and temporary files of dead processes are removed.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::ExpertError;

/// Format name and version written in every usage file.
const FORMAT: &str = "sluice-usage";
const VERSION: u32 = 1;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsageStats {
    counts: Vec<Vec<u64>>,
}

#[derive(Serialize, Deserialize)]
struct UsageFile {
    format: String,
    version: u32,
    model: String,
    /// counts[layer][expert]
    layers: Vec<Vec<u64>>,
}

impl UsageStats {
    /// All zero, `experts_per_layer[l]` experts in layer `l`.
    pub fn new(experts_per_layer: &[usize]) -> UsageStats {
        UsageStats {
            counts: experts_per_layer.iter().map(|&n| vec![0; n]).collect(),
        }
    }

    /// One selection of `expert` in `layer` (ignored when out of range).
    pub fn record(&mut self, layer: usize, expert: usize) {
        if let Some(c) = self.counts.get_mut(layer).and_then(|l| l.get_mut(expert)) {
            *c += 1;
        }
    }

    pub fn count(&self, layer: usize, expert: usize) -> u64 {
        self.counts
            .get(layer)
            .and_then(|l| l.get(expert))
            .copied()
            .unwrap_or(0)
    }

    pub fn experts_per_layer(&self) -> Vec<usize> {
        self.counts.iter().map(Vec::len).collect()
    }

    pub fn total(&self) -> u64 {
        self.counts.iter().flatten().sum()
    }

    /// Adds another run's counts (same model shape).
    pub fn add(&mut self, other: &UsageStats) -> Result<(), ExpertError> {
        if self.experts_per_layer() != other.experts_per_layer() {
            return Err(ExpertError::Config(format!(
                "usage counts of different shapes: {} vs {} layers",
                self.counts.len(),
                other.counts.len()
            )));
        }
        for (a, b) in self
            .counts
            .iter_mut()
            .flatten()
            .zip(other.counts.iter().flatten())
        {
            *a += b;
        }
        Ok(())
    }

    /// The `n` most selected (layer, expert) pairs, most selected first; ties go to the lower
    /// layer, then the lower expert. Never-selected experts are not listed.
    pub fn top_n(&self, n: usize) -> Vec<(usize, usize)> {
        let mut all: Vec<(u64, usize, usize)> = Vec::new();
        for (l, layer) in self.counts.iter().enumerate() {
            for (e, &c) in layer.iter().enumerate() {
                if c > 0 {
                    all.push((c, l, e));
                }
            }
        }
        all.sort_by(|a, b| b.0.cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
        all.into_iter().take(n).map(|(_, l, e)| (l, e)).collect()
    }

    /// Writes the counts for model `model_id` to `path` (via a temporary file and a rename).
    pub fn save(&self, path: &Path, model_id: &str) -> Result<(), ExpertError> {
        let f = UsageFile {
            format: FORMAT.into(),
            version: VERSION,
            model: model_id.into(),
            layers: self.counts.clone(),
        };
        let json = serde_json::to_vec(&f).map_err(|e| ExpertError::Usage {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        let tmp = temp_path(path);
        let write = || -> std::io::Result<()> {
            let mut out = std::fs::File::create(&tmp)?;
            out.write_all(&json)?;
            out.sync_all()
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(ExpertError::io(&tmp, "write", e));
        }
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            ExpertError::io(path, "rename the temporary usage file onto", e)
        })
    }

    /// Reads counts saved for model `model_id`. Fails (with the reason) when the file is not a
    /// usage file, has another version, or belongs to another model.
    pub fn load(path: &Path, model_id: &str) -> Result<UsageStats, ExpertError> {
        let bad = |msg: String| ExpertError::Usage {
            path: path.to_path_buf(),
            msg,
        };
        let bytes = std::fs::read(path).map_err(|e| ExpertError::io(path, "read", e))?;
        let f: UsageFile =
            serde_json::from_slice(&bytes).map_err(|e| bad(format!("not a usage file: {e}")))?;
        if f.format != FORMAT {
            return Err(bad(format!("format `{}`, expected `{FORMAT}`", f.format)));
        }
        if f.version != VERSION {
            return Err(bad(format!(
                "version {}, this sluice reads version {VERSION}",
                f.version
            )));
        }
        if f.model != model_id {
            return Err(bad(format!(
                "made for model `{}`, not `{model_id}`",
                f.model
            )));
        }
        Ok(UsageStats { counts: f.layers })
    }
}

/// What `load_matching` found.
#[derive(Debug)]
pub enum Loaded {
    /// Counts for this model, of its shape.
    Stats(UsageStats),
    /// No file, or one for another model or format version (the next save replaces it).
    Nothing(String),
    /// A file that is not a usage file, or whose counts do not fit this model's shape: it was
    /// renamed to the path given, so it never blocks a later run. The text says why.
    SetAside(PathBuf, String),
}

impl UsageStats {
    /// `load` for a model whose layer `l` holds `shape[l]` experts, that never fails a run:
    /// a damaged file or one of another shape is renamed `<path>.bad` (see `Loaded`). Stale
    /// temporary files of processes that no longer run are removed first.
    pub fn load_matching(path: &Path, model_id: &str, shape: &[usize]) -> Loaded {
        remove_stale_temps(path);
        if !path.exists() {
            return Loaded::Nothing(format!("{}: no usage statistics yet", path.display()));
        }
        let why = match Self::load(path, model_id) {
            Ok(u) if u.experts_per_layer() == shape => return Loaded::Stats(u),
            Ok(u) => format!(
                "counts for {} layers ({} experts) do not fit this model's {} layers ({} experts)",
                u.counts.len(),
                u.counts.iter().map(Vec::len).sum::<usize>(),
                shape.len(),
                shape.iter().sum::<usize>()
            ),
            Err(e @ ExpertError::Usage { .. }) if e.to_string().contains("not a usage file") => {
                e.to_string()
            }
            Err(e) => return Loaded::Nothing(e.to_string()),
        };
        let mut bad = path.as_os_str().to_os_string();
        bad.push(".bad");
        let bad = PathBuf::from(bad);
        match std::fs::rename(path, &bad) {
            Ok(()) => Loaded::SetAside(bad, why),
            Err(e) => Loaded::Nothing(format!(
                "{why}; and it cannot be renamed to {}: {e}",
                bad.display()
            )),
        }
    }
}

/// Remove `<name>.tmp<PID>` files beside `path` left by processes that are gone (a run
/// killed while saving). Files of live processes, including this one, are left alone.
fn remove_stale_temps(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let prefix = format!("{}.tmp", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let n = e.file_name();
        let n = n.to_string_lossy();
        let Some(pid) = n.strip_prefix(&prefix) else {
            continue;
        };
        if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let alive = pid == std::process::id().to_string()
            || Path::new("/proc").join(pid).exists()
            || !Path::new("/proc/self").exists();
        if !alive {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn temp_path(path: &Path) -> PathBuf {
    let mut name = path
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(format!(".tmp{}", std::process::id()));
    path.with_file_name(name)
}

/// A model identity for usage files: each file's size and a hash (FNV-1a, 64 bit) of its first
/// MiB, where the header lives: `size:hash` per file, joined by `+`.
pub fn model_identity(paths: &[PathBuf]) -> Result<String, ExpertError> {
    use std::io::Read;
    let mut parts = Vec::with_capacity(paths.len());
    for p in paths {
        let f = std::fs::File::open(p).map_err(|e| ExpertError::io(p, "open", e))?;
        let size = f
            .metadata()
            .map_err(|e| ExpertError::io(p, "stat", e))?
            .len();
        let mut head = Vec::with_capacity(1 << 20);
        f.take(1 << 20)
            .read_to_end(&mut head)
            .map_err(|e| ExpertError::io(p, "read", e))?;
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in &head {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        parts.push(format!("{size}:{h:016x}"));
    }
    Ok(parts.join("+"))
}
