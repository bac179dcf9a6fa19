//! A model's health, for `sluice doctor MODEL`: header and byte-range checks that read no
//! tensor data, and (`--deep`) a checksum of every tensor's bytes.
//!
//! Checks: every tensor range lies inside its file (against the file's size on disk, on top of
//! the check `ModelFiles::open` already made on its map), no two tensors overlap, each tensor's
//! length is what its type and shape need, GGUF offsets keep the file's alignment, and every
//! fused routed-expert tensor splits into whole experts. A failed check is a `FormatError`
//! naming the file and tensor; a tensor type sluice cannot compute with is a warning.
//!
//! Deep: FNV-1a 64 over each tensor's bytes (the checksum tests/fixtures/format/expected.json
//! holds, computed from the `gguf` Python package's reading), read with `pread` so an I/O error
//! is reported as a bad tensor instead of killing the process as a fault on a memory map would.
//! Float tensors (F32, F16, BF16, F64) holding NaN or infinity are bad too. Each file's
//! checksum is FNV-1a 64 over its tensors' checksums (little-endian u64) in file order.
//!
//! Owns: those checks and the checksum definition. Does not own: parsing (format/), printing.
//! Invariant: nothing here panics on a bad file, and a checksum is always of the bytes on disk.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::Instant;

use rayon::prelude::*;

use crate::dtype::DType;
use crate::format::{FileKind, FormatError, ModelFiles, TensorInfo};
use crate::inspect::{routed_expert_tensor, summarize};

/// One check's outcome (failures are errors, not reports).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    pub name: String,
    /// "ok" or "warn".
    pub status: String,
    pub detail: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileReport {
    pub path: String,
    pub bytes: u64,
    pub tensors: usize,
}

/// What `sluice doctor MODEL` found.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelReport {
    pub path: String,
    pub format: String,
    pub gguf_version: Option<u32>,
    pub files: Vec<FileReport>,
    pub tensors: usize,
    pub checks: Vec<Check>,
    /// One expert's bytes in one routed tensor (the largest such slice): one read.
    pub expert_slice_bytes: Option<u64>,
    /// One expert's bytes over its tensors in one layer (`inspect`'s figure).
    pub expert_bytes_per_layer: u64,
    pub deep: Option<DeepReport>,
}

/// One tensor's checksum.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSum {
    pub name: String,
    pub file: usize,
    pub bytes: u64,
    /// FNV-1a 64 of the bytes, hex; `None` when they could not be read.
    pub fnv1a64: Option<String>,
    /// NaN or infinite values (float types only).
    pub non_finite: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSum {
    pub path: String,
    pub tensors: usize,
    pub bytes: u64,
    /// FNV-1a 64 over the file's tensor checksums in file order, hex.
    pub fnv1a64: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadTensor {
    pub name: String,
    pub path: String,
    pub reason: String,
}

/// `--deep`'s result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeepReport {
    pub algorithm: String,
    pub files: Vec<FileSum>,
    pub tensors: Vec<TensorSum>,
    pub bad: Vec<BadTensor>,
    pub bytes: u64,
    pub seconds: f64,
    pub threads: usize,
}

/// The read sizes a streaming expert reader issues for this model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertSizes {
    /// Largest single-tensor expert slice (`None`: no routed experts).
    pub slice_bytes: Option<u64>,
    /// One expert over its tensors in one layer.
    pub per_layer_bytes: u64,
}

/// The model's expert read sizes (see `ExpertSizes`).
pub fn expert_sizes(m: &ModelFiles) -> ExpertSizes {
    let slice = m
        .tensors()
        .iter()
        .filter_map(|t| match routed_expert_tensor(&t.name)?.expert {
            Some(_) => Some(t.range.len),
            None => m.expert_range(t, 0).ok().map(|r| r.len),
        })
        .max();
    ExpertSizes {
        slice_bytes: slice,
        per_layer_bytes: summarize(m).one_expert_bytes_per_layer,
    }
}

fn ok(name: &str, detail: String) -> Check {
    Check {
        name: name.into(),
        status: "ok".into(),
        detail,
    }
}

/// Header and range checks (no tensor data read). `Err` on the first failure.
pub fn check_model(m: &ModelFiles) -> Result<ModelReport, FormatError> {
    let paths = m.paths();
    let mut files = Vec::with_capacity(paths.len());
    for p in paths {
        let len = std::fs::metadata(p)
            .map_err(|e| FormatError::Io {
                path: p.clone(),
                op: "stat",
                err: e,
            })?
            .len();
        files.push(FileReport {
            path: p.display().to_string(),
            bytes: len,
            tensors: 0,
        });
    }
    let path_of = |t: &TensorInfo| {
        paths
            .get(t.range.file)
            .cloned()
            .unwrap_or_else(|| m.dir().to_path_buf())
    };
    let fail = |t: &TensorInfo, msg: String| FormatError::tensor(&path_of(t), &t.name, msg);
    let mut checks = Vec::new();
    let s = summarize(m);
    checks.push(ok(
        "header",
        match m.kind() {
            FileKind::Gguf => format!(
                "GGUF v{}, {} metadata keys, alignment {}, {} tensors",
                m.gguf_version().unwrap_or(0),
                m.meta_keys().count(),
                m.alignment().unwrap_or(0),
                m.tensors().len()
            ),
            FileKind::Safetensors => format!(
                "safetensors, {} tensors, config.json {}",
                m.tensors().len(),
                if m.config().is_some() {
                    "present"
                } else {
                    "absent"
                }
            ),
        },
    ));

    // Ranges, against the size on disk.
    for t in m.tensors() {
        let Some(f) = files.get_mut(t.range.file) else {
            return Err(fail(
                t,
                format!("names file index {} of {}", t.range.file, paths.len()),
            ));
        };
        f.tensors += 1;
        let end = t.range.offset.checked_add(t.range.len);
        if end.is_none_or(|e| e > f.bytes) {
            return Err(fail(
                t,
                format!(
                    "bytes [{}, +{}) lie past the end of the file ({} bytes)",
                    t.range.offset, t.range.len, f.bytes
                ),
            ));
        }
        if let Some(d) = m.data_offset(t.range.file) {
            if t.range.offset < d {
                return Err(fail(
                    t,
                    format!(
                        "starts at byte {} inside the header (data starts at {d})",
                        t.range.offset
                    ),
                ));
            }
        }
    }
    checks.push(ok(
        "ranges",
        format!(
            "{} tensors inside their {} file(s)",
            m.tensors().len(),
            files.len()
        ),
    ));

    // Overlaps, file by file in offset order (empty tensors overlap nothing).
    let mut by_file: BTreeMap<usize, Vec<&TensorInfo>> = BTreeMap::new();
    for t in m.tensors().iter().filter(|t| t.range.len > 0) {
        by_file.entry(t.range.file).or_default().push(t);
    }
    for ts in by_file.values_mut() {
        ts.sort_by_key(|t| t.range.offset);
        for w in ts.windows(2) {
            if let [a, b] = w {
                if b.range.offset < a.range.offset + a.range.len {
                    return Err(fail(
                        b,
                        format!(
                            "bytes [{}, +{}) overlap tensor `{}` at [{}, +{})",
                            b.range.offset, b.range.len, a.name, a.range.offset, a.range.len
                        ),
                    ));
                }
            }
        }
    }
    checks.push(ok("overlap", "no two tensors share a byte".into()));

    // Lengths against type and shape.
    let mut unknown = Vec::new();
    for t in m.tensors() {
        if matches!(t.dtype, DType::Unknown(_)) {
            unknown.push(format!("`{}` ({})", t.name, m.dtype_name(t)));
            continue;
        }
        let want = t.dtype.bytes_for(t.n_elems());
        if want != Some(t.range.len) {
            return Err(fail(
                t,
                format!(
                    "{} bytes, but {} elements of {} take {:?}",
                    t.range.len,
                    t.n_elems(),
                    t.dtype,
                    want
                ),
            ));
        }
    }
    checks.push(ok(
        "sizes",
        format!(
            "{} tensors of known type have the bytes their shape needs",
            m.tensors().len() - unknown.len()
        ),
    ));

    if let (Some(a), FileKind::Gguf) = (m.alignment(), m.kind()) {
        for t in m.tensors() {
            let rel = t
                .range
                .offset
                .saturating_sub(m.data_offset(t.range.file).unwrap_or(0));
            if a > 0 && rel % a != 0 {
                return Err(fail(
                    t,
                    format!("data offset {rel} is not a multiple of the alignment {a}"),
                ));
            }
        }
        checks.push(ok(
            "alignment",
            format!("every tensor offset is a multiple of {a}"),
        ));
    }

    // Routed experts.
    let mut fused = 0;
    let mut counts = BTreeMap::new();
    for t in m.tensors() {
        if routed_expert_tensor(&t.name).is_some_and(|r| r.expert.is_none())
            && !matches!(t.dtype, DType::Unknown(_))
        {
            m.expert_range(t, 0)?;
            fused += 1;
            *counts
                .entry(t.shape.first().copied().unwrap_or(0))
                .or_insert(0usize) += 1;
        }
    }
    let sizes = expert_sizes(m);
    if s.routed_expert_bytes == 0 {
        checks.push(ok(
            "experts",
            "no routed-expert tensors (a dense model)".into(),
        ));
    } else {
        let per = s.experts_per_layer;
        let odd: Vec<u64> = counts
            .keys()
            .copied()
            .filter(|&n| per.is_some_and(|p| p != n))
            .collect();
        let detail = format!(
            "{} routed tensors ({fused} fused ones split into whole experts); one expert: {} bytes per tensor, {} bytes per layer",
            m.tensors().iter().filter(|t| routed_expert_tensor(&t.name).is_some()).count(),
            sizes.slice_bytes.unwrap_or(0),
            sizes.per_layer_bytes
        );
        if odd.is_empty() {
            checks.push(ok("experts", detail));
        } else {
            checks.push(Check {
                name: "experts".into(),
                status: "warn".into(),
                detail: format!(
                    "{detail}; tensors hold {odd:?} experts but the metadata says {}",
                    per.unwrap_or(0)
                ),
            });
        }
    }
    if !unknown.is_empty() {
        let shown: Vec<&str> = unknown.iter().take(5).map(String::as_str).collect();
        checks.push(Check {
            name: "types".into(),
            status: "warn".into(),
            detail: format!(
                "{} tensor(s) of a type sluice cannot compute with: {}{}",
                unknown.len(),
                shown.join(", "),
                if unknown.len() > 5 { ", ..." } else { "" }
            ),
        });
    }
    Ok(ModelReport {
        path: paths.first().map_or_else(
            || m.dir().display().to_string(),
            |p| p.display().to_string(),
        ),
        format: m.kind().name().to_string(),
        gguf_version: m.gguf_version(),
        files,
        tensors: m.tensors().len(),
        checks,
        expert_slice_bytes: sizes.slice_bytes,
        expert_bytes_per_layer: sizes.per_layer_bytes,
        deep: None,
    })
}

const FNV_OFFSET: u64 = 0xCBF2_9CE4_8422_2325;
const FNV_PRIME: u64 = 0x100_0000_01B3;

/// FNV-1a 64 continued over `bytes`.
pub fn fnv1a64(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h = (h ^ b as u64).wrapping_mul(FNV_PRIME);
    }
    h
}

/// NaN/inf count of whole little-endian elements of `dtype` in `bytes` (0 for non-float types).
pub fn non_finite(dtype: DType, bytes: &[u8]) -> u64 {
    let c = |n: usize, bad: &dyn Fn(&[u8]) -> bool| {
        bytes.chunks_exact(n).filter(|e| bad(e)).count() as u64
    };
    match dtype {
        DType::F32 => c(4, &|e| {
            u32::from_le_bytes([e[0], e[1], e[2], e[3]]) & 0x7F80_0000 == 0x7F80_0000
        }),
        DType::F16 => c(2, &|e| u16::from_le_bytes([e[0], e[1]]) & 0x7C00 == 0x7C00),
        DType::BF16 => c(2, &|e| u16::from_le_bytes([e[0], e[1]]) & 0x7F80 == 0x7F80),
        DType::F64 => c(8, &|e| {
            let mut a = [0u8; 8];
            a.copy_from_slice(e);
            u64::from_le_bytes(a) & 0x7FF0_0000_0000_0000 == 0x7FF0_0000_0000_0000
        }),
        _ => 0,
    }
}

/// Checksum one tensor with `pread`s of at most `CHUNK` bytes.
fn sum_tensor(f: &File, t: &TensorInfo, buf: &mut Vec<u8>) -> Result<(u64, u64), String> {
    const CHUNK: u64 = 4 << 20; // a multiple of every float element size
    let mut h = FNV_OFFSET;
    let mut bad = 0;
    let mut off = 0;
    while off < t.range.len {
        let n = (t.range.len - off).min(CHUNK) as usize;
        buf.resize(n, 0);
        f.read_exact_at(&mut buf[..n], t.range.offset + off)
            .map_err(|e| format!("cannot read bytes [{}, +{n}): {e}", t.range.offset + off))?;
        h = fnv1a64(h, &buf[..n]);
        bad += non_finite(t.dtype, &buf[..n]);
        off += n as u64;
    }
    Ok((h, bad))
}

/// Checksum every tensor with `threads` threads (tensors in parallel).
pub fn deep_check(m: &ModelFiles, threads: usize) -> Result<DeepReport, FormatError> {
    let t0 = Instant::now();
    let paths = m.paths();
    let files: Vec<File> = paths
        .iter()
        .map(|p| {
            File::open(p).map_err(|e| FormatError::Io {
                path: p.clone(),
                op: "open",
                err: e,
            })
        })
        .collect::<Result<_, _>>()?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .map_err(|e| FormatError::Malformed {
            path: m.dir().to_path_buf(),
            msg: format!("cannot start {threads} threads: {e}"),
        })?;
    let results: Vec<Result<(u64, u64), String>> = pool.install(|| {
        m.tensors()
            .par_iter()
            .map_init(Vec::new, |buf, t| match files.get(t.range.file) {
                Some(f) => sum_tensor(f, t, buf),
                None => Err(format!("file index {} out of range", t.range.file)),
            })
            .collect()
    });
    let mut tensors = Vec::with_capacity(results.len());
    let mut bad = Vec::new();
    let mut per_file: Vec<(usize, u64, u64)> = vec![(0, 0, FNV_OFFSET); paths.len()];
    let mut order: Vec<usize> = (0..m.tensors().len()).collect();
    for (t, r) in m.tensors().iter().zip(&results) {
        let path = paths
            .get(t.range.file)
            .map_or_else(String::new, |p| p.display().to_string());
        let (sum, nf) = match r {
            Ok((h, nf)) => (Some(*h), *nf),
            Err(msg) => {
                bad.push(BadTensor {
                    name: t.name.clone(),
                    path: path.clone(),
                    reason: msg.clone(),
                });
                (None, 0)
            }
        };
        if nf > 0 {
            bad.push(BadTensor {
                name: t.name.clone(),
                path,
                reason: format!("{nf} values are NaN or infinite"),
            });
        }
        tensors.push(TensorSum {
            name: t.name.clone(),
            file: t.range.file,
            bytes: t.range.len,
            fnv1a64: sum.map(|h| format!("{h:016x}")),
            non_finite: nf,
        });
    }
    // File checksums in file (offset) order.
    order.sort_by_key(|&i| m.tensors().get(i).map(|t| (t.range.file, t.range.offset)));
    for i in order {
        let (Some(t), Some(Ok((h, _)))) = (m.tensors().get(i), results.get(i)) else {
            continue;
        };
        if let Some(f) = per_file.get_mut(t.range.file) {
            f.0 += 1;
            f.1 += t.range.len;
            f.2 = fnv1a64(f.2, &h.to_le_bytes());
        }
    }
    let bytes = m.tensors().iter().map(|t| t.range.len).sum();
    Ok(DeepReport {
        algorithm: "fnv1a64".into(),
        files: paths
            .iter()
            .zip(per_file)
            .map(|(p, (n, b, h))| FileSum {
                path: p.display().to_string(),
                tensors: n,
                bytes: b,
                fnv1a64: format!("{h:016x}"),
            })
            .collect(),
        tensors,
        bad,
        bytes,
        seconds: super::sig6(t0.elapsed().as_secs_f64()),
        threads: pool.current_num_threads(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_reference_values() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a64(FNV_OFFSET, b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a64(FNV_OFFSET, b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a64(FNV_OFFSET, b"foobar"), 0x85944171f73967e8);
        assert_eq!(
            fnv1a64(fnv1a64(FNV_OFFSET, b"foo"), b"bar"),
            0x85944171f73967e8
        );
    }

    #[test]
    fn non_finite_counts() {
        let f32s: Vec<u8> = [1.0f32, f32::NAN, f32::INFINITY, -0.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(non_finite(DType::F32, &f32s), 2);
        let f16s: Vec<u8> = [0x3C00u16, 0x7C00, 0xFE00]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(non_finite(DType::F16, &f16s), 2);
        assert_eq!(non_finite(DType::Q8_0, &f32s), 0);
    }
}
