//! The built-in default model: a small Qwen3-MoE-shaped GGUF with random (seeded) weights that
//! sluice writes into the user's cache directory on first use, so `sluice run` works with no
//! download. Its text is noise; it exists to exercise the whole path (GGUF reading, tokenizer,
//! routing, experts, sampling) on any machine.
//!
//! Invariant: the file is a pure function of `VERSION` — same bytes on every machine.

use crate::dtype::DType;
use crate::format::FormatError;
use crate::synth::{write_random_qwen3moe, MoeSpec};
use std::path::PathBuf;

/// Bump when the model's contents change, so stale caches are not reused.
const VERSION: u32 = 3;

/// The default model's name as the server lists it (its file stem).
pub fn model_id() -> String {
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

/// Path of the default model, writing it first if it is not there.
pub fn ensure() -> Result<PathBuf, FormatError> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let dir = cache_dir();
    let path = dir.join(format!("{}.gguf", model_id()));
    if path.is_file() {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).map_err(|e| FormatError::Io {
        path: dir.clone(),
        op: "create directory",
        err: e,
    })?;
    // Another process may be writing it too: write under our own name, then rename into place.
    let mine = dir.join(format!(
        "default-moe-v{VERSION}.{}.gguf",
        std::process::id()
    ));
    write(&mine)?;
    std::fs::rename(&mine, &path).map_err(|e| FormatError::Io {
        path: path.clone(),
        op: "rename",
        err: e,
    })?;
    Ok(path)
}

/// The default model's shape: small enough to write in a moment, big enough to route.
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
