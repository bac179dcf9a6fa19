//! Model files: GGUF (single or split) and safetensors (single or sharded, with config.json).
//!
//! Owns: parsing headers and metadata, and handing out each tensor as a byte range in its file
//! (`TensorInfo`), plus memory-mapped views of resident tensors; writing GGUF (`GgufWriter`).
//! Does not own: reading routed experts on demand (experts/), dequantization (kernels/), what
//! the tensors mean (model/, inspect).
//! Invariant: nothing here copies a whole model; every tensor is (file, offset, length, dtype,
//! shape) and routed-expert tensors are only ever ranges. Everything read from a file is
//! validated before it is used: a bad file gives a `FormatError` naming the file, never a panic
//! or an allocation sized by an unchecked length.
//!
//! Map:
//! - `tensor.rs`: `TensorInfo`, `ByteRange`, `MetaValue` (the currency of the module).
//! - `gguf.rs`: the GGUF v2/v3 header parser (metadata, tensor infos, alignment, offsets).
//! - `gguf_writer.rs`: the streaming GGUF writer.
//! - `safetensors.rs`: the safetensors header parser and the sharded index.
//! - `files.rs`: `ModelFiles`, an opened model (file set, mmaps, tensor table, metadata).
//! - `fault.rs`: a read fault (SIGBUS) in a mapped file becomes a one-line error, not a crash.
//!
//! Byte layouts are written down in docs/FORMATS.md.

mod fault;
mod files;
mod gguf;
mod gguf_writer;
mod safetensors;
mod tensor;

use std::path::{Path, PathBuf};

pub use files::ModelFiles;
pub use gguf_writer::GgufWriter;
pub use tensor::{ByteRange, MetaValue, TensorInfo};

/// Which container a model came in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FileKind {
    Gguf,
    Safetensors,
}

impl FileKind {
    pub fn name(self) -> &'static str {
        match self {
            FileKind::Gguf => "GGUF",
            FileKind::Safetensors => "safetensors",
        }
    }
}

/// Everything that can go wrong reading or writing model files. Each message starts with the
/// file it is about and fits on one line.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The file system refused (open, stat, map, read, write, rename).
    #[error("{}: cannot {op}: {err}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        err: std::io::Error,
    },
    /// The bytes do not follow the format (bad magic, truncated, lengths past the end, ...).
    #[error("{}: {msg}", path.display())]
    Malformed { path: PathBuf, msg: String },
    /// A shard that a split GGUF or a safetensors index names is not there.
    #[error("{}: missing shard {}", path.display(), shard.display())]
    MissingShard { path: PathBuf, shard: PathBuf },
    /// A tensor's element type is one sluice cannot read or compute with.
    #[error("{}: tensor `{tensor}` has type {dtype}, which sluice cannot {op}", path.display())]
    UnsupportedDType {
        path: PathBuf,
        tensor: String,
        dtype: String,
        op: &'static str,
    },
    /// A request about one tensor that the tensor cannot satisfy.
    #[error("{}: tensor `{tensor}`: {msg}", path.display())]
    Tensor {
        path: PathBuf,
        tensor: String,
        msg: String,
    },
    /// `GgufWriter` used out of order or given something GGUF cannot hold.
    #[error("{}: GGUF writer: {msg}", path.display())]
    Writer { path: PathBuf, msg: String },
}

/// `s` with control characters (terminal escape codes from a hostile file's keys or names)
/// written as escapes (`\u{1b}`), so an error message prints as the one line it is. The
/// library's errors that quote a file's text apply it; the CLI applies it once more to the
/// line it prints.
pub fn printable(s: &str) -> String {
    if !s.chars().any(char::is_control) {
        return s.to_string();
    }
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

impl FormatError {
    pub(crate) fn malformed(path: &Path, msg: impl Into<String>) -> FormatError {
        FormatError::Malformed {
            path: path.to_path_buf(),
            msg: printable(&msg.into()),
        }
    }

    pub(crate) fn io(path: &Path, op: &'static str, err: std::io::Error) -> FormatError {
        FormatError::Io {
            path: path.to_path_buf(),
            op,
            err,
        }
    }

    pub(crate) fn tensor(path: &Path, tensor: &str, msg: impl Into<String>) -> FormatError {
        FormatError::Tensor {
            path: path.to_path_buf(),
            tensor: printable(tensor),
            msg: printable(&msg.into()),
        }
    }

    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            FormatError::Io { path, .. }
            | FormatError::Malformed { path, .. }
            | FormatError::MissingShard { path, .. }
            | FormatError::UnsupportedDType { path, .. }
            | FormatError::Tensor { path, .. }
            | FormatError::Writer { path, .. } => path,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn control_characters_are_escaped_in_errors() {
        let e = super::FormatError::malformed(
            std::path::Path::new("m.gguf"),
            "metadata key `a\x1b[2Jb\n` appears twice",
        );
        let s = e.to_string();
        assert!(!s.contains('\x1b') && !s.contains('\n'), "{s}");
        assert!(s.contains("\\u{1b}[2Jb\\n"), "{s}");
    }
}
