//! The built-in models, written into the user's cache directory on first use so `sluice run`,
//! `chat` and `serve` work with no download.
//!
//! - `ensure()`: the default model, `assets/sluice-tiny-moe.gguf` embedded in the binary — a
//!   6.6M-parameter DeepSeek-V3-style MoE (GGUF `deepseek2`: MLA, 16 routed experts of which 4
//!   per token plus a shared one, one MTP layer) trained by the project on Python's and Debian's
//!   documentation (scripts/train_tiny_moe.py; data, licenses and quality in docs/MODELS.md).
//!   It writes English with real, skewed routing.
//! - `ensure_random()`: a Qwen3-MoE-shaped GGUF with seeded random weights (`spec()`), for tests
//!   and benchmarks that need its exact shapes; its text is noise.
//!
//! Invariant: each file is a pure function of its version constant — same bytes on every
//! machine (the trained model's bytes are the embedded asset's).

use crate::dtype::DType;
use crate::format::FormatError;
use crate::synth::{write_random_qwen3moe, MoeSpec};
use std::path::PathBuf;

/// Bump when the random model's contents change, so stale caches are not reused.
const VERSION: u32 = 3;

/// Bump when the embedded trained model changes.
const TINY_VERSION: u32 = 2;

/// The trained model's GGUF, as committed under assets/.
static TINY_GGUF: &[u8] = include_bytes!("../assets/sluice-tiny-moe.gguf");

/// What the default model is, for the one-line note of `run` / `serve` with no MODEL.
pub const DESCRIPTION: &str = "sluice-tiny-moe, a 6.6M-parameter DeepSeek-V3-style MoE (16 experts, MTP head) trained by the project on Python and Debian documentation";

/// The default model's name as the server lists it (its file stem).
pub fn model_id() -> String {
    format!("sluice-tiny-moe-v{TINY_VERSION}")
}

/// The random test model's name (its file stem).
pub fn random_model_id() -> String {
    format!("default-moe-v{VERSION}")
}

/// The cache directory: `$SLUICE_CACHE_DIR`, else `$XDG_CACHE_HOME/sluice`, else `~/.cache/sluice`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SLUICE_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("sluice");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".cache").join("sluice"),
        None => std::env::temp_dir().join("sluice-cache"),
    }
}

/// Path of the default (trained) model, writing it first if it is not there or not whole.
pub fn ensure() -> Result<PathBuf, FormatError> {
    let path = cache_dir().join(format!("{}.gguf", model_id()));
    let whole = |p: &std::path::Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.len() == TINY_GGUF.len() as u64)
    };
    write_cached(&path, whole, &mut |tmp| {
        std::fs::write(tmp, TINY_GGUF).map_err(|e| FormatError::Io {
            path: tmp.to_path_buf(),
            op: "write",
            err: e,
        })
    })
}

/// Path of the random Qwen3-MoE test model (`spec()`), writing it first if it is not there.
pub fn ensure_random() -> Result<PathBuf, FormatError> {
    let path = cache_dir().join(format!("{}.gguf", random_model_id()));
    write_cached(&path, |p| p.is_file(), &mut |tmp| write(tmp))
}

/// Write `path` through a per-process temporary name and a rename (another process may be
/// writing it too), unless `ready(path)` already holds.
fn write_cached(
    path: &std::path::Path,
    ready: impl Fn(&std::path::Path) -> bool,
    write: &mut dyn FnMut(&std::path::Path) -> Result<(), FormatError>,
) -> Result<PathBuf, FormatError> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let path = path.to_path_buf();
    if ready(&path) {
        return Ok(path);
    }
    let dir = path.parent().map(|d| d.to_path_buf()).unwrap_or_default();
    std::fs::create_dir_all(&dir).map_err(|e| FormatError::Io {
        path: dir.clone(),
        op: "create directory",
        err: e,
    })?;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    let mine = dir.join(format!("{stem}.{}.gguf", std::process::id()));
    write(&mine)?;
    std::fs::rename(&mine, &path).map_err(|e| FormatError::Io {
        path: path.clone(),
        op: "rename",
        err: e,
    })?;
    Ok(path)
}

/// The random test model's shape: small enough to write in a moment, big enough to route.
pub fn spec() -> MoeSpec {
    MoeSpec {
        hidden: 256,
        layers: 4,
        heads: 8,
        kv_heads: 2,
        head_dim: 32,
        experts: 16,
        experts_used: 4,
        expert_ffn: 256,
        vocab: 0,
        ctx: 4096,
        dtype: DType::Q8_0,
        seed: 0x5EED_0000 + VERSION as u64,
        name: "sluice default tiny MoE (random weights)".into(),
        skew: 0.0,
        arch: crate::synth::SynthArch::Qwen3Moe,
        mtp_layers: 0,
    }
}

fn write(path: &std::path::Path) -> Result<(), FormatError> {
    write_random_qwen3moe(path, &spec(), &mut |_, _| {})
}
