//! safetensors header parser and the sharded-checkpoint index (`model.safetensors.index.json`).
//!
//! Owns: turning one .safetensors file's header into `TensorInfo`s with absolute ranges, the
//! dtype-name mapping, and reading the index's weight map. Does not own: finding the files of a
//! model or config.json (files.rs).
//! Invariant: the header length is checked against the file before it is read, and every
//! tensor's range is checked against both the file and (when the dtype's size is known) its
//! shape.

use std::collections::HashSet;
use std::path::Path;

use super::{ByteRange, FormatError, TensorInfo};
use crate::dtype::DType;

/// `DType::Unknown` id given to safetensors dtypes sluice has no `DType` for (U8, BOOL,
/// F8_E5M2, ...). The original name is kept beside the tensor (`SafeTensor::dtype_name`).
pub(crate) const FOREIGN_DTYPE_ID: u32 = u32::MAX;

const MAX_HEADER: u64 = 100_000_000;

/// One tensor of a safetensors file.
#[derive(Debug)]
pub(crate) struct SafeTensor {
    pub info: TensorInfo,
    /// The dtype as the header spells it (`BF16`, `F8_E4M3`, `U8`, ...).
    pub dtype_name: String,
}

/// Map a safetensors dtype name to (DType, element size in bytes if known).
fn map_dtype(name: &str) -> (DType, Option<u64>) {
    match name {
        "F64" => (DType::F64, Some(8)),
        "F32" => (DType::F32, Some(4)),
        "F16" => (DType::F16, Some(2)),
        "BF16" => (DType::BF16, Some(2)),
        "I64" => (DType::I64, Some(8)),
        "I32" => (DType::I32, Some(4)),
        "I16" => (DType::I16, Some(2)),
        "I8" => (DType::I8, Some(1)),
        "F8_E4M3" => (DType::F8E4M3, Some(1)),
        "U8" | "BOOL" | "F8_E5M2" | "F8_E8M0" => (DType::Unknown(FOREIGN_DTYPE_ID), Some(1)),
        "U16" => (DType::Unknown(FOREIGN_DTYPE_ID), Some(2)),
        "U32" => (DType::Unknown(FOREIGN_DTYPE_ID), Some(4)),
        "U64" | "C64" => (DType::Unknown(FOREIGN_DTYPE_ID), Some(8)),
        // Sub-byte and future types: trust data_offsets for the length.
        _ => (DType::Unknown(FOREIGN_DTYPE_ID), None),
    }
}

/// Parse the safetensors file `buf` (the whole file) at `path`; ranges get `file` as file index.
/// Tensors come back in data order.
pub(crate) fn parse(path: &Path, buf: &[u8], file: usize) -> Result<Vec<SafeTensor>, FormatError> {
    let bad = |msg: String| FormatError::malformed(path, msg);
    let file_len = buf.len() as u64;
    let Some(head) = buf.get(..8) else {
        return Err(bad(format!(
            "truncated: {file_len} bytes, too short for a safetensors header"
        )));
    };
    let mut n = [0u8; 8];
    n.copy_from_slice(head);
    let n = u64::from_le_bytes(n);
    if n > file_len - 8 {
        return Err(bad(format!(
            "header length {n} runs past the end of the file ({file_len} bytes)"
        )));
    }
    // The safetensors reference implementation refuses headers over 100 MB; so do we, rather
    // than parse gigabytes of tensor data as JSON when the length is corrupt.
    if n > MAX_HEADER {
        return Err(bad(format!(
            "header length {n} is implausible (limit {MAX_HEADER})"
        )));
    }
    let data_start = 8 + n;
    let json = &buf[8..data_start as usize];
    let header: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
    let Some(obj) = header.as_object() else {
        return Err(bad("header is not a JSON object".to_string()));
    };
    let data_len = file_len - data_start;
    let mut out = Vec::with_capacity(obj.len());
    for (name, entry) in obj {
        if name == "__metadata__" {
            continue;
        }
        let field = |key: &str| {
            entry
                .get(key)
                .ok_or_else(|| bad(format!("tensor `{name}`: header entry has no `{key}`")))
        };
        let dtype_name = field("dtype")?
            .as_str()
            .ok_or_else(|| bad(format!("tensor `{name}`: `dtype` is not a string")))?
            .to_string();
        let shape = field("shape")?
            .as_array()
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| {
                bad(format!(
                    "tensor `{name}`: `shape` is not a list of non-negative integers"
                ))
            })?;
        let offs = field("data_offsets")?
            .as_array()
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect::<Option<Vec<u64>>>())
            .filter(|a| a.len() == 2)
            .ok_or_else(|| {
                bad(format!(
                    "tensor `{name}`: `data_offsets` is not [begin, end]"
                ))
            })?;
        let (begin, end) = (offs[0], offs[1]);
        if begin > end || end > data_len {
            return Err(bad(format!(
                "tensor `{name}`: data_offsets [{begin}, {end}] lie outside the data section ({data_len} bytes; file is {file_len} bytes)"
            )));
        }
        let (dtype, elem) = map_dtype(&dtype_name);
        let n_elems = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        if let Some(elem) = elem {
            let want = n_elems.and_then(|n| n.checked_mul(elem));
            if want != Some(end - begin) {
                return Err(bad(format!(
                    "tensor `{name}`: shape {shape:?} of {dtype_name} needs {} bytes but data_offsets give {}",
                    want.map_or("too many".to_string(), |w| w.to_string()),
                    end - begin
                )));
            }
        }
        out.push(SafeTensor {
            info: TensorInfo {
                name: name.clone(),
                dtype,
                shape,
                range: ByteRange {
                    file,
                    offset: data_start + begin,
                    len: end - begin,
                },
            },
            dtype_name,
        });
    }
    out.sort_by_key(|t| (t.info.range.offset, t.info.range.len));
    // As the safetensors library (`Metadata::validate`): sorted by offset, each tensor starts
    // where the previous one ends and the last ends at the end of the file. Overlapping data,
    // gaps, or a header length that is off (which shifts the data section) are refused.
    let mut at = data_start;
    for t in &out {
        let r = t.info.range;
        if r.offset != at {
            return Err(bad(format!(
                "tensor `{}`: data_offsets begin at {}, but the previous tensor ends at {} ({})",
                t.info.name,
                r.offset - data_start,
                at - data_start,
                if r.offset < at {
                    "tensor data overlaps"
                } else {
                    "a gap in the data section"
                }
            )));
        }
        at = r.offset + r.len;
    }
    if at != file_len {
        return Err(bad(format!(
            "the tensors' data ends at byte {at} but the file has {file_len} bytes (is the header length {n} right?)"
        )));
    }
    Ok(out)
}

/// The shard file names of `model.safetensors.index.json`, in sorted order, and for each
/// tensor the shard that holds it.
#[derive(Debug)]
pub(crate) struct Index {
    pub shards: Vec<String>,
    pub weight_map: Vec<(String, String)>,
}

pub(crate) fn parse_index(path: &Path, text: &[u8]) -> Result<Index, FormatError> {
    let bad = |msg: String| FormatError::malformed(path, msg);
    let v: serde_json::Value =
        serde_json::from_slice(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no `weight_map` object".to_string()))?;
    let mut weight_map = Vec::with_capacity(map.len());
    let mut shards = HashSet::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("weight_map[`{name}`] is not a file name")))?;
        // Shards live beside the index: a name with a directory part would reach elsewhere.
        if file.is_empty()
            || file.contains('/')
            || file.contains('\\')
            || file == "."
            || file == ".."
        {
            return Err(bad(format!(
                "weight_map[`{name}`] = `{file}` is not a plain file name"
            )));
        }
        shards.insert(file.to_string());
        weight_map.push((name.clone(), file.to_string()));
    }
    let mut shards: Vec<String> = shards.into_iter().collect();
    shards.sort();
    Ok(Index { shards, weight_map })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(header: &str, data: usize) -> Vec<u8> {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend(header.as_bytes());
        b.extend(vec![0u8; data]);
        b
    }

    #[test]
    fn parses_and_orders_by_offset() {
        let h = r#"{"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},"__metadata__":{"format":"pt"},"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
        let t = parse(Path::new("m.safetensors"), &file(h, 12), 0).unwrap();
        assert_eq!(t[0].info.name, "a");
        assert_eq!(t[0].dtype_name, "U8");
        assert_eq!(t[0].info.dtype, DType::Unknown(FOREIGN_DTYPE_ID));
        assert_eq!(
            t[1].info.range,
            ByteRange {
                file: 0,
                offset: 8 + h.len() as u64 + 4,
                len: 8
            }
        );
    }

    #[test]
    fn rejects_bad_headers() {
        let p = Path::new("m.safetensors");
        let mut huge = file("{}", 0);
        huge[..8].copy_from_slice(&1000u64.to_le_bytes());
        assert!(parse(p, &huge, 0)
            .unwrap_err()
            .to_string()
            .contains("header length 1000"));
        let h = r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
        assert!(parse(p, &file(h, 8), 0)
            .unwrap_err()
            .to_string()
            .contains("needs 12 bytes"));
        let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        assert!(parse(p, &file(h, 4), 0)
            .unwrap_err()
            .to_string()
            .contains("outside the data section"));
        assert!(parse(p, &file("[1]", 0), 0)
            .unwrap_err()
            .to_string()
            .contains("not a JSON object"));
        assert!(parse(p, &[1, 2, 3], 0)
            .unwrap_err()
            .to_string()
            .contains("truncated"));
    }

    #[test]
    fn index_rejects_paths() {
        let p = Path::new("model.safetensors.index.json");
        let ok = parse_index(
            p,
            br#"{"weight_map":{"a":"m2.safetensors","b":"m1.safetensors"}}"#,
        )
        .unwrap();
        assert_eq!(ok.shards, vec!["m1.safetensors", "m2.safetensors"]);
        assert!(parse_index(p, br#"{"weight_map":{"a":"../x.safetensors"}}"#).is_err());
    }
}
