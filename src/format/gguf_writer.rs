//! Streaming GGUF (v3) writer: metadata and tensor infos first, then each tensor's bytes in
//! order, in as many pieces as the caller likes, so no model has to be held in memory.
//!
//! Owns: the byte layout of files sluice writes (the same layout as the `gguf` Python package's
//! GGUFWriter and llama.cpp: header, key/values, tensor infos, zero padding to the alignment,
//! then tensor data with each tensor padded to the alignment).
//! Does not own: what goes in the file (`sluice synth`, the embedded default model).
//! Invariant: the file appears at its final path only when `finish` succeeds: bytes go to
//! `<path>.tmp`, renamed on finish and removed if the writer is dropped unfinished.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::gguf::{self, vt};
use super::{FormatError, MetaValue};
use crate::dtype::DType;

/// llama.cpp's GGML_MAX_NAME: tensor names must be shorter than this.
const MAX_NAME: usize = 64;

struct PlannedTensor {
    name: String,
    dtype: DType,
    /// Outermost first.
    shape: Vec<u64>,
    len: u64,
}

/// A GGUF file being written. Use: `new`, `add_meta`* and `add_tensor_info`* (any order), then
/// `write_tensor_data` for each tensor in the order the infos were added, then `finish`.
pub struct GgufWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: Option<BufWriter<File>>,
    alignment: u64,
    meta: Vec<(String, MetaValue)>,
    keys: HashSet<String>,
    tensors: Vec<PlannedTensor>,
    names: HashSet<String>,
    header_written: bool,
    /// Index of the tensor whose bytes come next, and how many of them have been written.
    current: usize,
    current_written: u64,
    pos: u64,
}

impl GgufWriter {
    /// Start writing `path` (through `<path>.tmp`).
    pub fn new(path: impl AsRef<Path>) -> Result<GgufWriter, FormatError> {
        let path = path.as_ref().to_path_buf();
        let mut tmp = path.clone().into_os_string();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let f = File::create(&tmp).map_err(|e| FormatError::io(&tmp, "create", e))?;
        Ok(GgufWriter {
            path,
            tmp,
            out: Some(BufWriter::with_capacity(1 << 20, f)),
            alignment: gguf::DEFAULT_ALIGNMENT,
            meta: Vec::new(),
            keys: HashSet::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
            header_written: false,
            current: 0,
            current_written: 0,
            pos: 0,
        })
    }

    fn err(&self, msg: impl Into<String>) -> FormatError {
        FormatError::Writer {
            path: self.path.clone(),
            msg: msg.into(),
        }
    }

    /// Add a metadata key/value (every GGUF value type; arrays take their element type from
    /// their first element and must be homogeneous; an empty array is written as UINT8).
    /// `general.alignment` (a power-of-two U32) also sets the data alignment.
    pub fn add_meta(&mut self, key: &str, value: MetaValue) -> Result<(), FormatError> {
        if self.header_written {
            return Err(self.err(format!("metadata `{key}` added after tensor data started")));
        }
        if !self.keys.insert(key.to_string()) {
            return Err(self.err(format!("metadata key `{key}` added twice")));
        }
        check_value(&value).map_err(|m| self.err(format!("metadata `{key}`: {m}")))?;
        if key == "general.alignment" {
            match value {
                MetaValue::U32(a) if a.is_power_of_two() => self.alignment = a as u64,
                _ => {
                    return Err(self.err(format!(
                        "general.alignment must be a power-of-two U32, got {value:?}"
                    )))
                }
            }
        }
        self.meta.push((key.to_string(), value));
        Ok(())
    }

    /// Add a tensor's description: name (< 64 bytes), type, shape outermost-first.
    pub fn add_tensor_info(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[u64],
    ) -> Result<(), FormatError> {
        if self.header_written {
            return Err(self.err(format!("tensor `{name}` added after tensor data started")));
        }
        if name.len() >= MAX_NAME {
            return Err(self.err(format!(
                "tensor name `{name}` is {} bytes; GGUF readers allow < {MAX_NAME}",
                name.len()
            )));
        }
        if !self.names.insert(name.to_string()) {
            return Err(self.err(format!("tensor `{name}` added twice")));
        }
        if shape.is_empty() || shape.len() > gguf::MAX_DIMS {
            return Err(self.err(format!(
                "tensor `{name}`: {} dimensions (1 to {})",
                shape.len(),
                gguf::MAX_DIMS
            )));
        }
        if dtype.ggml_id().is_none() {
            return Err(self.err(format!(
                "tensor `{name}`: type {dtype} cannot be stored in GGUF"
            )));
        }
        let (be, _) = dtype
            .block_geometry()
            .ok_or_else(|| self.err(format!("tensor `{name}`: type {dtype} has no known size")))?;
        let inner = shape[shape.len() - 1];
        if !inner.is_multiple_of(be as u64) {
            return Err(self.err(format!("tensor `{name}`: innermost dimension {inner} is not a multiple of {dtype}'s block of {be}")));
        }
        let len = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|n| dtype.bytes_for(n))
            .ok_or_else(|| self.err(format!("tensor `{name}`: shape {shape:?} overflows")))?;
        self.tensors.push(PlannedTensor {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            len,
        });
        Ok(())
    }

    /// Bytes each tensor occupies in the data section, padded to the alignment.
    fn padded(&self, len: u64) -> u64 {
        len.div_ceil(self.alignment) * self.alignment
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), FormatError> {
        let Some(out) = self.out.as_mut() else {
            return Err(FormatError::Writer {
                path: self.path.clone(),
                msg: "already finished".to_string(),
            });
        };
        out.write_all(bytes)
            .map_err(|e| FormatError::io(&self.tmp, "write", e))?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    fn pad_to_alignment(&mut self) -> Result<(), FormatError> {
        let pad = self.padded(self.pos) - self.pos;
        self.put(&vec![0u8; pad as usize])
    }

    fn write_header(&mut self) -> Result<(), FormatError> {
        let mut h = Vec::new();
        h.extend_from_slice(gguf::MAGIC);
        h.extend(3u32.to_le_bytes());
        h.extend((self.tensors.len() as u64).to_le_bytes());
        h.extend((self.meta.len() as u64).to_le_bytes());
        for (k, v) in &self.meta {
            put_string(&mut h, k);
            h.extend(gguf::value_type(v).to_le_bytes());
            put_value(&mut h, v);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_string(&mut h, &t.name);
            h.extend((t.shape.len() as u32).to_le_bytes());
            for d in t.shape.iter().rev() {
                h.extend(d.to_le_bytes());
            }
            // add_tensor_info admitted only types with a ggml id.
            h.extend(t.dtype.ggml_id().unwrap_or(u32::MAX).to_le_bytes());
            h.extend(offset.to_le_bytes());
            offset += self.padded(t.len);
        }
        self.put(&h)?;
        self.pad_to_alignment()?;
        self.header_written = true;
        Ok(())
    }

    /// Append the next bytes of the current tensor (tensors in the order their infos were
    /// added; a tensor may come in several pieces, but a piece may not run into the next tensor).
    pub fn write_tensor_data(&mut self, bytes: &[u8]) -> Result<(), FormatError> {
        if !self.header_written {
            self.write_header()?;
        }
        let Some(t) = self.tensors.get(self.current) else {
            return Err(self.err(format!("{} more bytes after the last tensor", bytes.len())));
        };
        let left = t.len - self.current_written;
        if bytes.len() as u64 > left {
            return Err(self.err(format!(
                "tensor `{}` takes {} bytes; {} written, {} more offered",
                t.name,
                t.len,
                self.current_written,
                bytes.len()
            )));
        }
        self.put(bytes)?;
        self.current_written += bytes.len() as u64;
        if self.current_written == self.tensors[self.current].len {
            self.pad_to_alignment()?;
            self.current += 1;
            self.current_written = 0;
        }
        Ok(())
    }

    /// Check every tensor was written, flush, sync and move the file to its final path.
    pub fn finish(mut self) -> Result<PathBuf, FormatError> {
        if !self.header_written {
            self.write_header()?;
        }
        if let Some(t) = self.tensors.get(self.current) {
            return Err(self.err(format!(
                "finished with tensor `{}` at {} of {} bytes ({} tensors not complete)",
                t.name,
                self.current_written,
                t.len,
                self.tensors.len() - self.current
            )));
        }
        let Some(out) = self.out.take() else {
            return Err(self.err("already finished"));
        };
        let f = out
            .into_inner()
            .map_err(|e| FormatError::io(&self.tmp, "write", e.into_error()))?;
        f.sync_all()
            .map_err(|e| FormatError::io(&self.tmp, "sync", e))?;
        drop(f);
        std::fs::rename(&self.tmp, &self.path)
            .map_err(|e| FormatError::io(&self.path, "rename the .tmp file to", e))?;
        Ok(self.path.clone())
    }
}

impl Drop for GgufWriter {
    fn drop(&mut self) {
        if self.out.take().is_some() {
            // Unfinished: leave no partial file behind. Nothing useful to do if removal fails.
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

fn check_value(v: &MetaValue) -> Result<(), String> {
    if let MetaValue::Array(items) = v {
        if let Some(first) = items.first() {
            let t = gguf::value_type(first);
            if items.iter().any(|x| gguf::value_type(x) != t) {
                return Err("array elements are not all of one type".to_string());
            }
            for x in items {
                check_value(x)?;
            }
        }
    }
    Ok(())
}

fn put_string(h: &mut Vec<u8>, s: &str) {
    h.extend((s.len() as u64).to_le_bytes());
    h.extend(s.as_bytes());
}

fn put_value(h: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => h.push(*x),
        MetaValue::I8(x) => h.push(*x as u8),
        MetaValue::U16(x) => h.extend(x.to_le_bytes()),
        MetaValue::I16(x) => h.extend(x.to_le_bytes()),
        MetaValue::U32(x) => h.extend(x.to_le_bytes()),
        MetaValue::I32(x) => h.extend(x.to_le_bytes()),
        MetaValue::U64(x) => h.extend(x.to_le_bytes()),
        MetaValue::I64(x) => h.extend(x.to_le_bytes()),
        MetaValue::F32(x) => h.extend(x.to_le_bytes()),
        MetaValue::F64(x) => h.extend(x.to_le_bytes()),
        MetaValue::Bool(x) => h.push(*x as u8),
        MetaValue::String(s) => put_string(h, s),
        MetaValue::Array(items) => {
            let et = items.first().map_or(vt::U8, gguf::value_type);
            h.extend(et.to_le_bytes());
            h.extend((items.len() as u64).to_le_bytes());
            for x in items {
                put_value(h, x);
            }
        }
    }
}
