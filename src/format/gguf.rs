//! GGUF header parser: magic, version (2 or 3), metadata of every value type, tensor infos,
//! `general.alignment`, and the absolute byte range of every tensor.
//!
//! Owns: turning the bytes of one GGUF file into metadata and `TensorInfo`s, and the value-type
//! numbering shared with the writer. Does not own: finding split shards (files.rs).
//! Invariant: every length read from the file is checked against the bytes that remain before
//! anything is allocated or sliced with it, so a corrupt header gives an error, not a panic or
//! a huge allocation.

use std::collections::HashSet;
use std::path::Path;

use super::{ByteRange, FormatError, MetaValue, TensorInfo};
use crate::dtype::DType;

pub(crate) const MAGIC: &[u8; 4] = b"GGUF";
pub(crate) const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's GGML_MAX_DIMS.
pub(crate) const MAX_DIMS: usize = 4;
/// Arrays inside arrays inside ...: real files use one level; more than this is corruption.
const MAX_NESTING: usize = 8;
/// Sanity limits for lengths in a header. A length is first checked against the bytes left in
/// the file, but a model file can be hundreds of GB, so a corrupt length could still ask for
/// that much. Real headers stay far below these (the largest arrays are tokenizer vocabularies
/// and merge lists of ~10^6 entries; the largest strings embedded tokenizer JSON of ~10^7 bytes).
const MAX_STRING: u64 = 256 << 20;
const MAX_ARRAY: u64 = 1 << 24;

/// GGUF metadata value type ids.
pub(crate) mod vt {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// The value type id of a metadata value.
pub(crate) fn value_type(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => vt::U8,
        MetaValue::I8(_) => vt::I8,
        MetaValue::U16(_) => vt::U16,
        MetaValue::I16(_) => vt::I16,
        MetaValue::U32(_) => vt::U32,
        MetaValue::I32(_) => vt::I32,
        MetaValue::F32(_) => vt::F32,
        MetaValue::Bool(_) => vt::BOOL,
        MetaValue::String(_) => vt::STRING,
        MetaValue::Array(_) => vt::ARRAY,
        MetaValue::U64(_) => vt::U64,
        MetaValue::I64(_) => vt::I64,
        MetaValue::F64(_) => vt::F64,
    }
}

/// Smallest encoded size of one value of type `t` (an empty string is its 8-byte length; an
/// empty array its 4-byte type and 8-byte count). Bounds array counts before allocating.
fn min_value_size(t: u32) -> u64 {
    match t {
        vt::U8 | vt::I8 | vt::BOOL => 1,
        vt::U16 | vt::I16 => 2,
        vt::U32 | vt::I32 | vt::F32 => 4,
        vt::U64 | vt::I64 | vt::F64 | vt::STRING => 8,
        vt::ARRAY => 12,
        _ => 1,
    }
}

/// One parsed GGUF file.
#[derive(Debug)]
pub(crate) struct GgufFile {
    pub version: u32,
    pub alignment: u64,
    /// Absolute offset of the data section (tensor offsets in the header are relative to it).
    pub data_offset: u64,
    pub meta: Vec<(String, MetaValue)>,
    /// In header order; `range.file` is the index the caller passed.
    pub tensors: Vec<TensorInfo>,
}

impl GgufFile {
    pub fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.meta.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

/// A bounds-checked little-endian reader over the file's bytes.
struct Reader<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn err(&self, msg: String) -> FormatError {
        FormatError::malformed(self.path, msg)
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], FormatError> {
        if n > self.remaining() {
            return Err(self.err(format!(
                "truncated: {} at offset {} needs {} bytes but the file ends at {}",
                what(),
                self.pos,
                n,
                self.buf.len()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], FormatError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, FormatError> {
        let at = self.pos;
        let len = self.u64(what)?;
        if len > self.remaining() {
            return Err(self.err(format!(
                "{}: string length {} at offset {} runs past the end of the file ({} bytes)",
                what(),
                len,
                at,
                self.buf.len()
            )));
        }
        if len > MAX_STRING {
            return Err(self.err(format!(
                "{}: string length {len} at offset {at} is implausible (limit {MAX_STRING})",
                what()
            )));
        }
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| {
            self.err(format!(
                "{}: string at offset {} is not valid UTF-8",
                what(),
                at
            ))
        })
    }

    fn value(
        &mut self,
        t: u32,
        depth: usize,
        what: &dyn Fn() -> String,
    ) -> Result<MetaValue, FormatError> {
        Ok(match t {
            vt::U8 => MetaValue::U8(self.array::<1>(what)?[0]),
            vt::I8 => MetaValue::I8(self.array::<1>(what)?[0] as i8),
            vt::U16 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            vt::I16 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            vt::U32 => MetaValue::U32(self.u32(what)?),
            vt::I32 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            vt::F32 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            vt::BOOL => MetaValue::Bool(self.array::<1>(what)?[0] != 0),
            vt::STRING => MetaValue::String(self.string(what)?),
            vt::U64 => MetaValue::U64(self.u64(what)?),
            vt::I64 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            vt::F64 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            vt::ARRAY => {
                if depth >= MAX_NESTING {
                    return Err(self.err(format!(
                        "{}: arrays nested more than {MAX_NESTING} deep",
                        what()
                    )));
                }
                let at = self.pos;
                let et = self.u32(what)?;
                if et > vt::F64 {
                    return Err(self.err(format!(
                        "{}: unknown array element type {et} at offset {at}",
                        what()
                    )));
                }
                let n = self.u64(what)?;
                let need = n.checked_mul(min_value_size(et));
                if need.is_none_or(|need| need > self.remaining()) {
                    return Err(self.err(format!(
                        "{}: array of {} elements at offset {} runs past the end of the file ({} bytes)",
                        what(),
                        n,
                        at,
                        self.buf.len()
                    )));
                }
                if n > MAX_ARRAY {
                    return Err(self.err(format!(
                        "{}: array of {n} elements at offset {at} is implausible (limit {MAX_ARRAY})",
                        what()
                    )));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(et, depth + 1, what)?);
                }
                MetaValue::Array(items)
            }
            other => {
                return Err(self.err(format!(
                    "{}: unknown metadata value type {} at offset {}",
                    what(),
                    other,
                    self.pos.saturating_sub(4)
                )))
            }
        })
    }
}

/// Tensor info as it stands in the header, before ranges are worked out.
struct RawInfo {
    name: String,
    dims: Vec<u64>, // innermost first, as stored
    type_id: u32,
    rel_offset: u64,
}

/// Parse the GGUF file `buf` (the whole file) found at `path`; tensor ranges get `file` as their
/// file index.
pub(crate) fn parse(path: &Path, buf: &[u8], file: usize) -> Result<GgufFile, FormatError> {
    let mut r = Reader { path, buf, pos: 0 };
    let magic = r.array::<4>(&|| "the magic".to_string())?;
    if &magic != MAGIC {
        return Err(r.err(format!(
            "not a GGUF file: magic is {:02x} {:02x} {:02x} {:02x}, expected \"GGUF\"",
            magic[0], magic[1], magic[2], magic[3]
        )));
    }
    let version = r.u32(&|| "the version".to_string())?;
    match version {
        2 | 3 => {}
        1 => return Err(r.err("GGUF version 1 is not supported (v2 and v3 are)".to_string())),
        v if v != 0 && v & 0xFFFF == 0 => {
            return Err(r.err(format!(
                "big-endian GGUF (version field {v:#x}) is not supported"
            )))
        }
        v => {
            return Err(r.err(format!(
                "unknown GGUF version {v} (v2 and v3 are supported)"
            )))
        }
    }
    let n_tensors = r.u64(&|| "the tensor count".to_string())?;
    let n_kv = r.u64(&|| "the metadata count".to_string())?;
    // A key/value takes at least 13 bytes (8-byte key length, 4-byte type, 1-byte value); a
    // tensor info at least 24. Counts beyond what the file can hold are corruption.
    let min_header = n_kv
        .checked_mul(13)
        .and_then(|kv| n_tensors.checked_mul(24).and_then(|t| t.checked_add(kv)));
    if min_header.is_none_or(|n| n > r.remaining()) {
        return Err(r.err(format!(
            "truncated or corrupt: {n_kv} metadata entries and {n_tensors} tensor infos cannot fit in the {} bytes after offset {}",
            r.remaining(),
            r.pos
        )));
    }

    let mut meta = Vec::with_capacity(n_kv.min(1 << 12) as usize);
    let mut keys = HashSet::new();
    for i in 0..n_kv {
        let key = r.string(&|| format!("metadata key #{i}"))?;
        let what = || format!("metadata `{key}`");
        let at = r.pos;
        let t = r.u32(&what)?;
        if t > vt::F64 {
            return Err(r.err(format!(
                "metadata `{key}`: unknown value type {t} at offset {at}"
            )));
        }
        let v = r.value(t, 0, &what)?;
        if !keys.insert(key.clone()) {
            return Err(r.err(format!("metadata key `{key}` appears twice")));
        }
        meta.push((key, v));
    }

    let mut raw = Vec::with_capacity(n_tensors.min(1 << 16) as usize);
    let mut names = HashSet::new();
    for i in 0..n_tensors {
        let name = r.string(&|| format!("tensor info #{i}"))?;
        let what = || format!("tensor info `{name}`");
        let n_dims = r.u32(&what)? as usize;
        if n_dims > MAX_DIMS {
            return Err(r.err(format!(
                "tensor `{name}`: {n_dims} dimensions (at most {MAX_DIMS})"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            dims.push(r.u64(&what)?);
        }
        let type_id = r.u32(&what)?;
        let rel_offset = r.u64(&what)?;
        if !names.insert(name.clone()) {
            return Err(r.err(format!("tensor `{name}` appears twice")));
        }
        raw.push(RawInfo {
            name,
            dims,
            type_id,
            rel_offset,
        });
    }

    let alignment = match meta.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && !matches!(v, MetaValue::Bool(_)) => a,
            _ => {
                return Err(r.err(format!(
                    "general.alignment is {v:?}; it must be a power of two"
                )))
            }
        },
    };
    let header_end = r.pos as u64;
    let data_offset = header_end.div_ceil(alignment) * alignment;
    let file_len = buf.len() as u64;
    let tensors = tensor_ranges(path, raw, data_offset, alignment, file_len, file)?;
    Ok(GgufFile {
        version,
        alignment,
        data_offset,
        meta,
        tensors,
    })
}

fn tensor_ranges(
    path: &Path,
    raw: Vec<RawInfo>,
    data_offset: u64,
    alignment: u64,
    file_len: u64,
    file: usize,
) -> Result<Vec<TensorInfo>, FormatError> {
    // Absolute starts, validated; used to infer the length of tensors of unknown type.
    let mut starts = Vec::with_capacity(raw.len());
    for t in &raw {
        if t.rel_offset % alignment != 0 {
            return Err(FormatError::malformed(
                path,
                format!(
                    "tensor `{}`: offset {} is not a multiple of the alignment {alignment}",
                    t.name, t.rel_offset
                ),
            ));
        }
        let abs = data_offset
            .checked_add(t.rel_offset)
            .filter(|&a| a <= file_len)
            .ok_or_else(|| {
                FormatError::malformed(
                    path,
                    format!(
                    "tensor `{}`: data offset {} lies past the end of the file ({file_len} bytes)",
                    t.name,
                    data_offset.saturating_add(t.rel_offset)
                ),
                )
            })?;
        starts.push(abs);
    }
    let mut sorted = starts.clone();
    sorted.sort_unstable();

    let mut out = Vec::with_capacity(raw.len());
    for (t, &abs) in raw.into_iter().zip(&starts) {
        let dtype = DType::from_ggml_id(t.type_id);
        let n_elems = t
            .dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64);
        let Some(n_elems) = n_elems else {
            return Err(FormatError::malformed(
                path,
                format!("tensor `{}`: dimensions {:?} overflow", t.name, t.dims),
            ));
        };
        let len = match dtype.block_geometry() {
            Some((be, _)) => {
                let inner = t.dims.first().copied().unwrap_or(1);
                if !inner.is_multiple_of(be as u64) {
                    return Err(FormatError::malformed(
                        path,
                        format!(
                            "tensor `{}`: innermost dimension {inner} is not a multiple of {dtype}'s block of {be}",
                            t.name
                        ),
                    ));
                }
                dtype.bytes_for(n_elems).ok_or_else(|| {
                    FormatError::malformed(
                        path,
                        format!("tensor `{}`: byte size overflows", t.name),
                    )
                })?
            }
            // Unknown type: up to the next tensor's start, or the end of the file.
            None => {
                let next = sorted
                    .iter()
                    .copied()
                    .find(|&s| s > abs)
                    .unwrap_or(file_len);
                next - abs
            }
        };
        let end = abs.checked_add(len).filter(|&e| e <= file_len).ok_or_else(|| {
            FormatError::malformed(
                path,
                format!(
                    "tensor `{}` ({dtype}, {len} bytes at offset {abs}) runs past the end of the file ({file_len} bytes)",
                    t.name
                ),
            )
        })?;
        debug_assert!(end <= file_len);
        let mut shape = t.dims;
        shape.reverse();
        out.push(TensorInfo {
            name: t.name,
            dtype,
            shape,
            range: ByteRange {
                file,
                offset: abs,
                len,
            },
        });
    }
    check_layout(path, &out, data_offset, alignment, file_len)?;
    Ok(out)
}

/// The data section's layout as llama.cpp's reader demands it: in header order, each tensor
/// starts where the previous one ends, padded to the alignment (`gguf_init_from_file`: "tensor
/// has offset X, expected Y"). A wrong `general.alignment`, or tensors that overlap or leave
/// gaps, would otherwise be read from the wrong bytes. A tensor of a type sluice does not know
/// has no known length, so the tensor after it is not checked against it. When every length
/// is known, the data must also end where the file ends (llama.cpp and gguf-py pad every
/// tensor, the last included): a data section that starts at the wrong place fails this.
fn check_layout(
    path: &Path,
    tensors: &[TensorInfo],
    data_offset: u64,
    alignment: u64,
    file_len: u64,
) -> Result<(), FormatError> {
    let mut expect = Some(0u64);
    for (i, t) in tensors.iter().enumerate() {
        let rel = t.range.offset - data_offset;
        if let Some(e) = expect {
            if rel != e {
                let (a, b) = (t.range.offset, t.range.offset + t.range.len);
                let hit = tensors[..i].iter().find(|o| {
                    let (c, d) = (o.range.offset, o.range.offset + o.range.len);
                    a < d && c < b
                });
                return Err(FormatError::malformed(
                    path,
                    match hit {
                        Some(o) => format!(
                            "tensor `{}` (data offset {rel}) overlaps tensor `{}`",
                            t.name, o.name
                        ),
                        None => format!(
                            "tensor `{}` has data offset {rel}, expected {e} (tensors must follow one another, each padded to the alignment {alignment}: is general.alignment right?)",
                            t.name
                        ),
                    },
                ));
            }
        }
        expect = match t.dtype {
            DType::Unknown(_) => None,
            _ => rel
                .checked_add(t.range.len.div_ceil(alignment) * alignment)
                .filter(|_| t.range.len.checked_add(alignment).is_some()),
        };
    }
    if let (Some(end), Some(last)) = (expect, tensors.last()) {
        let unpadded = last.range.offset + last.range.len;
        let end = data_offset.saturating_add(end);
        if file_len != end && file_len != unpadded {
            return Err(FormatError::malformed(
                path,
                format!(
                    "the tensor data ends at byte {end} but the file has {file_len} bytes (is general.alignment {alignment} right?)"
                ),
            ));
        }
    }
    Ok(())
}

/// Split shard naming as llama.cpp writes it: `<prefix>-00001-of-00004.gguf`.
/// Returns (prefix, shard number starting at 1, shard count) for a file name that follows it.
pub(crate) fn parse_split_name(file_name: &str) -> Option<(&str, u32, u32)> {
    let stem = file_name.strip_suffix(".gguf")?;
    let (head, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = head.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(count) || !digits(no) {
        return None;
    }
    let (no, count) = (no.parse().ok()?, count.parse().ok()?);
    (no >= 1 && no <= count).then_some((prefix, no, count))
}

/// The file name of shard `no` (from 1) of `count`.
pub(crate) fn split_name(prefix: &str, no: u32, count: u32) -> String {
    format!("{prefix}-{no:05}-of-{count:05}.gguf")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_names() {
        assert_eq!(parse_split_name("m-00002-of-00004.gguf"), Some(("m", 2, 4)));
        assert_eq!(
            parse_split_name("a-b-00001-of-00001.gguf"),
            Some(("a-b", 1, 1))
        );
        assert_eq!(parse_split_name("m-00005-of-00004.gguf"), None);
        assert_eq!(parse_split_name("m-2-of-4.gguf"), None);
        assert_eq!(parse_split_name("m.gguf"), None);
        assert_eq!(split_name("x", 3, 12), "x-00003-of-00012.gguf");
    }

    fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(n_tensors.to_le_bytes());
        b.extend(n_kv.to_le_bytes());
        b
    }

    #[test]
    fn huge_array_count_is_an_error_not_an_allocation() {
        let mut b = header(0, 1);
        b.extend(1u64.to_le_bytes());
        b.push(b'k');
        b.extend(vt::ARRAY.to_le_bytes());
        b.extend(vt::U64.to_le_bytes());
        b.extend((u64::MAX / 2).to_le_bytes());
        let e = parse(Path::new("x.gguf"), &b, 0).unwrap_err().to_string();
        assert!(e.contains("array of") && e.contains("past the end"), "{e}");
    }

    #[test]
    fn deep_nesting_is_an_error() {
        let mut b = header(0, 1);
        b.extend(1u64.to_le_bytes());
        b.push(b'k');
        b.extend(vt::ARRAY.to_le_bytes());
        for _ in 0..20 {
            b.extend(vt::ARRAY.to_le_bytes());
            b.extend(1u64.to_le_bytes());
        }
        b.extend([0u8; 64]);
        let e = parse(Path::new("x.gguf"), &b, 0).unwrap_err().to_string();
        assert!(e.contains("nested"), "{e}");
    }

    #[test]
    fn too_many_dims() {
        let mut b = header(1, 0);
        b.extend(1u64.to_le_bytes());
        b.push(b't');
        b.extend(5u32.to_le_bytes());
        b.extend([0u8; 64]);
        let e = parse(Path::new("x.gguf"), &b, 0).unwrap_err().to_string();
        assert!(e.contains("5 dimensions"), "{e}");
    }
}
