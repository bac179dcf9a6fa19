//! `ModelFiles`: an opened model — its files, their memory maps, the tensor table, metadata and
//! config.json — whatever container it came in.
//!
//! Owns: deciding what a model path is (GGUF file, split GGUF, safetensors file, directory with
//! safetensors shards), finding every file of the model, and zero-copy views of tensor bytes.
//! Does not own: header parsing (gguf.rs, safetensors.rs), kernels.
//! Invariant: every `TensorInfo` handed out has been checked to lie inside its file, so
//! `bytes()` of a known-type tensor cannot fail for a model that opened; and routed-expert
//! tensors are only ever handed out as ranges or borrowed views, never copied.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::gguf::{self, GgufFile};
use super::safetensors;
use super::{ByteRange, FileKind, FormatError, MetaValue, TensorInfo};
use crate::dtype::DType;
use crate::kernels;

/// The files of a GGUF model: paths, maps and parsed headers, shard by shard.
type GgufShards = (Vec<PathBuf>, Vec<Mapped>, Vec<GgufFile>);

/// An opened model. See the module docs of `format` for what it guarantees.
pub struct ModelFiles {
    kind: FileKind,
    dir: PathBuf,
    paths: Vec<PathBuf>,
    maps: Vec<Mapped>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    /// safetensors dtype names that have no `DType` (index into `tensors` -> name).
    foreign_dtypes: HashMap<usize, String>,
    meta: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    config: Option<serde_json::Value>,
    gguf_version: Option<u32>,
    alignment: Option<u64>,
    /// GGUF: absolute start of each file's data section.
    data_offsets: Vec<u64>,
}

impl std::fmt::Debug for ModelFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelFiles")
            .field("kind", &self.kind)
            .field("paths", &self.paths)
            .field("tensors", &self.tensors.len())
            .field("meta", &self.meta.len())
            .finish()
    }
}

fn map_file(path: &Path) -> Result<Mapped, FormatError> {
    let f = File::open(path).map_err(|e| FormatError::io(path, "open", e))?;
    let len = f
        .metadata()
        .map_err(|e| FormatError::io(path, "stat", e))?
        .len();
    if len == 0 {
        return Err(FormatError::malformed(path, "truncated: the file is empty"));
    }
    // SAFETY: the map is read-only and lives as long as `ModelFiles`. Model files are treated as
    // immutable while open; another process truncating one underneath us makes reads of the
    // lost pages fault, which fault.rs turns into a one-line error and exit 1.
    let map = unsafe { Mmap::map(&f) }.map_err(|e| FormatError::io(path, "memory-map", e))?;
    Ok(Mapped::new(map, path))
}

/// A map whose read faults are reported (fault.rs) until it is dropped.
struct Mapped {
    map: Mmap,
    slot: Option<usize>,
}

impl Mapped {
    fn new(map: Mmap, path: &Path) -> Mapped {
        let slot = super::fault::register(map.as_ptr(), map.len(), path);
        Mapped { map, slot }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        if let Some(s) = self.slot {
            super::fault::unregister(s);
        }
    }
}

impl std::ops::Deref for Mapped {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map
    }
}

fn read_json(path: &Path) -> Result<serde_json::Value, FormatError> {
    let text = std::fs::read(path).map_err(|e| FormatError::io(path, "read", e))?;
    serde_json::from_slice(&text)
        .map_err(|e| FormatError::malformed(path, format!("not valid JSON: {e}")))
}

fn file_name(p: &Path) -> &str {
    p.file_name().and_then(|n| n.to_str()).unwrap_or("")
}

fn parent_dir(p: &Path) -> PathBuf {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn starts_with_gguf_magic(path: &Path) -> bool {
    use std::io::Read;
    let mut m = [0u8; 4];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut m))
        .is_ok()
        && &m == gguf::MAGIC
}

impl ModelFiles {
    /// Open a model: a `.gguf` file (any shard of a split model: the others are found by name),
    /// a `.safetensors` file (config.json looked up beside it), a `model.safetensors.index.json`,
    /// or a directory holding config.json + *.safetensors (+ the index when sharded) or a GGUF.
    pub fn open(path: &Path) -> Result<ModelFiles, FormatError> {
        let md = std::fs::metadata(path).map_err(|e| FormatError::io(path, "open", e))?;
        if md.is_dir() {
            return Self::open_dir(path);
        }
        let name = file_name(path);
        if name.ends_with(".gguf") || starts_with_gguf_magic(path) {
            Self::open_gguf(path)
        } else if name.ends_with(".safetensors") {
            let dir = parent_dir(path);
            Self::open_safetensors(&dir, vec![path.to_path_buf()], None)
        } else if name.ends_with(".index.json") {
            let dir = parent_dir(path);
            Self::open_index(&dir, path)
        } else {
            Err(FormatError::malformed(
                path,
                "not a model: expected a .gguf or .safetensors file, a safetensors index, or a directory",
            ))
        }
    }

    fn open_dir(dir: &Path) -> Result<ModelFiles, FormatError> {
        let index = dir.join("model.safetensors.index.json");
        if index.is_file() {
            return Self::open_index(dir, &index);
        }
        let entries = std::fs::read_dir(dir).map_err(|e| FormatError::io(dir, "list", e))?;
        let mut st = Vec::new();
        let mut gg = Vec::new();
        for e in entries {
            let p = e.map_err(|e| FormatError::io(dir, "list", e))?.path();
            let n = file_name(&p);
            if n.ends_with(".safetensors") {
                st.push(p);
            } else if n.ends_with(".gguf") {
                gg.push(p);
            }
        }
        st.sort();
        gg.sort();
        if !st.is_empty() {
            return Self::open_safetensors(dir, st, None);
        }
        // A directory holding one GGUF model (one file, or the shards of one split model).
        let firsts: Vec<&PathBuf> = gg
            .iter()
            .filter(|p| gguf::parse_split_name(file_name(p)).is_none_or(|(_, no, _)| no == 1))
            .collect();
        match firsts.as_slice() {
            [one] => Self::open_gguf(one),
            [] => Err(FormatError::malformed(
                dir,
                "not a model: no .safetensors or .gguf file in this directory",
            )),
            _ => Err(FormatError::malformed(
                dir,
                format!(
                    "{} GGUF models in this directory; name the file to open",
                    firsts.len()
                ),
            )),
        }
    }

    fn open_index(dir: &Path, index_path: &Path) -> Result<ModelFiles, FormatError> {
        let text = std::fs::read(index_path).map_err(|e| FormatError::io(index_path, "read", e))?;
        let index = safetensors::parse_index(index_path, &text)?;
        if index.shards.is_empty() {
            return Err(FormatError::malformed(
                index_path,
                "weight_map names no shard",
            ));
        }
        let mut paths = Vec::with_capacity(index.shards.len());
        for s in &index.shards {
            let p = dir.join(s);
            if !p.is_file() {
                return Err(FormatError::MissingShard {
                    path: index_path.to_path_buf(),
                    shard: p,
                });
            }
            paths.push(p);
        }
        Self::open_safetensors(dir, paths, Some((index_path, &index)))
    }

    fn open_safetensors(
        dir: &Path,
        paths: Vec<PathBuf>,
        index: Option<(&Path, &safetensors::Index)>,
    ) -> Result<ModelFiles, FormatError> {
        let mut maps = Vec::with_capacity(paths.len());
        let mut tensors = Vec::new();
        let mut foreign = HashMap::new();
        let mut where_is: HashMap<String, usize> = HashMap::new();
        for (fi, p) in paths.iter().enumerate() {
            let map = map_file(p)?;
            for t in safetensors::parse(p, &map, fi)? {
                if let Some(&prev) = where_is.get(&t.info.name) {
                    return Err(FormatError::malformed(
                        p,
                        format!(
                            "tensor `{}` is also in {}",
                            t.info.name,
                            paths[prev].display()
                        ),
                    ));
                }
                where_is.insert(t.info.name.clone(), fi);
                if matches!(t.info.dtype, DType::Unknown(_)) {
                    foreign.insert(tensors.len(), t.dtype_name);
                }
                tensors.push(t.info);
            }
            maps.push(map);
        }
        if let Some((index_path, index)) = index {
            for (name, shard) in &index.weight_map {
                let found = where_is.get(name).map(|&fi| file_name(&paths[fi]));
                if found != Some(shard.as_str()) {
                    return Err(FormatError::malformed(
                        index_path,
                        format!("weight_map puts tensor `{name}` in {shard}, but {shard} does not hold it"),
                    ));
                }
            }
        }
        let cfg_path = dir.join("config.json");
        let config = if cfg_path.is_file() {
            Some(read_json(&cfg_path)?)
        } else {
            None
        };
        Ok(ModelFiles {
            foreign_dtypes: foreign,
            config,
            ..Self::assemble(FileKind::Safetensors, dir, paths, maps, tensors, Vec::new())
        })
    }

    fn open_gguf(path: &Path) -> Result<ModelFiles, FormatError> {
        let map = map_file(path)?;
        let first = gguf::parse(path, &map, 0)?;
        let count = match first.meta("split.count") {
            None => 1,
            Some(v) => v
                .as_u64()
                .filter(|c| (1..=99_999).contains(c))
                .ok_or_else(|| {
                    FormatError::malformed(
                        path,
                        format!("split.count is {v:?}; expected a shard count"),
                    )
                })? as u32,
        };
        let (paths, maps, mut parsed) = if count == 1 {
            (vec![path.to_path_buf()], vec![map], vec![first])
        } else {
            Self::open_gguf_shards(path, count)?
        };
        let mut tensors = Vec::new();
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (i, g) in parsed.iter_mut().enumerate() {
            for t in g.tensors.drain(..) {
                if let Some(prev) = seen.insert(t.name.clone(), i) {
                    return Err(FormatError::malformed(
                        &paths[i],
                        format!("tensor `{}` is also in {}", t.name, paths[prev].display()),
                    ));
                }
                tensors.push(t);
            }
        }
        let data_offsets: Vec<u64> = parsed.iter().map(|g| g.data_offset).collect();
        let first = parsed.swap_remove(0);
        if let Some(v) = first.meta("split.tensors.count") {
            if v.as_u64() != Some(tensors.len() as u64) {
                return Err(FormatError::malformed(
                    &paths[0],
                    format!(
                        "split.tensors.count is {v:?} but the shards hold {} tensors",
                        tensors.len()
                    ),
                ));
            }
        }
        Ok(ModelFiles {
            gguf_version: Some(first.version),
            alignment: Some(first.alignment),
            data_offsets,
            ..Self::assemble(
                FileKind::Gguf,
                &parent_dir(path),
                paths,
                maps,
                tensors,
                first.meta,
            )
        })
    }

    /// Every shard of the split GGUF that `path` belongs to, mapped and parsed, in order.
    fn open_gguf_shards(path: &Path, count: u32) -> Result<GgufShards, FormatError> {
        let Some((prefix, _, named_count)) = gguf::parse_split_name(file_name(path)) else {
            return Err(FormatError::malformed(
                path,
                format!("split.count is {count} but the file name is not <name>-NNNNN-of-{count:05}.gguf, so the other shards cannot be found"),
            ));
        };
        if named_count != count {
            return Err(FormatError::malformed(
                path,
                format!("the file name says {named_count} shards but split.count says {count}"),
            ));
        }
        let paths: Vec<PathBuf> = (1..=count)
            .map(|i| path.with_file_name(gguf::split_name(prefix, i, count)))
            .collect();
        for p in &paths {
            if !p.is_file() {
                return Err(FormatError::MissingShard {
                    path: path.to_path_buf(),
                    shard: p.clone(),
                });
            }
        }
        let mut maps = Vec::with_capacity(paths.len());
        let mut parsed = Vec::with_capacity(paths.len());
        for (i, p) in paths.iter().enumerate() {
            let m = map_file(p)?;
            let g = gguf::parse(p, &m, i)?;
            let no = g.meta("split.no").and_then(|v| v.as_u64());
            if no != Some(i as u64) {
                return Err(FormatError::malformed(
                    p,
                    format!("split.no is {no:?}; this shard's name says {i}"),
                ));
            }
            let c = g.meta("split.count").and_then(|v| v.as_u64());
            if c != Some(count as u64) {
                return Err(FormatError::malformed(
                    p,
                    format!("split.count is {c:?}; the first shard says {count}"),
                ));
            }
            maps.push(m);
            parsed.push(g);
        }
        Ok((paths, maps, parsed))
    }

    /// A model with no GGUF-only or safetensors-only extras (callers fill those in).
    fn assemble(
        kind: FileKind,
        dir: &Path,
        paths: Vec<PathBuf>,
        maps: Vec<Mapped>,
        tensors: Vec<TensorInfo>,
        meta: Vec<(String, MetaValue)>,
    ) -> ModelFiles {
        let by_name = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        let meta_index = meta
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        ModelFiles {
            kind,
            dir: dir.to_path_buf(),
            paths,
            maps,
            tensors,
            by_name,
            foreign_dtypes: HashMap::new(),
            meta,
            meta_index,
            config: None,
            gguf_version: None,
            alignment: None,
            data_offsets: Vec::new(),
        }
    }

    pub fn kind(&self) -> FileKind {
        self.kind
    }

    /// The model's directory (tokenizer.json and friends live here).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The model's files; `ByteRange::file` indexes this.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Every tensor, in file order (file by file, by offset for safetensors, header order for GGUF).
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// GGUF version (2 or 3); `None` for safetensors.
    pub fn gguf_version(&self) -> Option<u32> {
        self.gguf_version
    }

    /// GGUF data alignment (`general.alignment`, default 32); `None` for safetensors.
    pub fn alignment(&self) -> Option<u64> {
        self.alignment
    }

    /// GGUF: absolute offset of the data section of file `file` (tensor offsets in the header
    /// are relative to it). `None` for safetensors.
    pub fn data_offset(&self, file: usize) -> Option<u64> {
        self.data_offsets.get(file).copied()
    }

    /// The element type as the file names it: `DType::name()`, or for safetensors dtypes sluice
    /// has no `DType` for, the header's own name (`U8`, `F8_E5M2`, ...).
    pub fn dtype_name(&self, t: &TensorInfo) -> String {
        match self
            .by_name
            .get(&t.name)
            .and_then(|i| self.foreign_dtypes.get(i))
        {
            Some(n) if matches!(t.dtype, DType::Unknown(safetensors::FOREIGN_DTYPE_ID)) => {
                n.clone()
            }
            _ => t.dtype.name(),
        }
    }

    fn path_of(&self, file: usize) -> &Path {
        self.paths
            .get(file)
            .map(|p| p.as_path())
            .unwrap_or(&self.dir)
    }

    /// Map every page of the model's files into this process now (`MADV_POPULATE_READ`), so
    /// that the first forward passes do not take a page fault per 64 KiB of weights they touch
    /// for the first time (experts first routed to, mid-benchmark). For weights that stay in
    /// memory (experts resident); it reads any part of the files not in the page cache. Returns
    /// the bytes populated; a kernel without `MADV_POPULATE_READ` (before 5.14) populates
    /// nothing and the pages fault in as they are used.
    pub fn populate(&self) -> u64 {
        let mut done = 0u64;
        for m in &self.maps {
            if m.is_empty() {
                continue;
            }
            // SAFETY: the range is one whole live read-only mapping (page-aligned by mmap);
            // MADV_POPULATE_READ only faults its pages in, as reads of it would.
            let rc = unsafe {
                libc::madvise(
                    m.as_ptr() as *mut libc::c_void,
                    m.len(),
                    libc::MADV_POPULATE_READ,
                )
            };
            if rc != 0 {
                break;
            }
            done += m.len() as u64;
        }
        done
    }

    /// The bytes of any range of the model's files (zero-copy, from the memory map).
    pub fn range_bytes(&self, r: ByteRange) -> Result<&[u8], FormatError> {
        let Some(map) = self.maps.get(r.file) else {
            return Err(FormatError::malformed(
                &self.dir,
                format!(
                    "file index {} out of range ({} files)",
                    r.file,
                    self.maps.len()
                ),
            ));
        };
        let end = r
            .offset
            .checked_add(r.len)
            .filter(|&e| e <= map.len() as u64)
            .ok_or_else(|| {
                FormatError::malformed(
                    self.path_of(r.file),
                    format!(
                        "byte range [{}, +{}) lies past the end of the file ({} bytes)",
                        r.offset,
                        r.len,
                        map.len()
                    ),
                )
            })?;
        Ok(&map[r.offset as usize..end as usize])
    }

    /// A tensor's bytes, zero-copy. Fails for tensor types whose layout sluice does not know.
    pub fn bytes(&self, t: &TensorInfo) -> Result<&[u8], FormatError> {
        if matches!(t.dtype, DType::Unknown(_)) {
            return Err(self.unsupported(t, "read"));
        }
        self.range_bytes(t.range)
    }

    fn unsupported(&self, t: &TensorInfo, op: &'static str) -> FormatError {
        FormatError::UnsupportedDType {
            path: self.path_of(t.range.file).to_path_buf(),
            tensor: t.name.clone(),
            dtype: match t.dtype {
                DType::Unknown(id) if id != safetensors::FOREIGN_DTYPE_ID => {
                    format!("#{id} (a ggml type id sluice does not know)")
                }
                _ => self.dtype_name(t),
            },
            op,
        }
    }

    fn tensor_err(&self, t: &TensorInfo, msg: impl Into<String>) -> FormatError {
        FormatError::tensor(self.path_of(t.range.file), &t.name, msg)
    }

    /// The byte range of expert `expert` alone in a 3-D expert tensor ([n_expert, rows, cols],
    /// outermost first): GGUF `blk.N.ffn_*_exps.weight` or a fused safetensors expert tensor.
    pub fn expert_range(&self, t: &TensorInfo, expert: usize) -> Result<ByteRange, FormatError> {
        let [n, rows, cols] = t.shape[..] else {
            return Err(self.tensor_err(
                t,
                format!("shape {:?} is not [n_expert, rows, cols]", t.shape),
            ));
        };
        if matches!(t.dtype, DType::Unknown(_)) {
            return Err(self.unsupported(t, "split into experts"));
        }
        if expert as u64 >= n {
            return Err(self.tensor_err(
                t,
                format!("expert {expert} out of range: the tensor holds {n} experts"),
            ));
        }
        let per = rows
            .checked_mul(cols)
            .and_then(|e| t.dtype.bytes_for(e))
            .filter(|&p| p.checked_mul(n) == Some(t.range.len))
            .ok_or_else(|| {
                self.tensor_err(
                    t,
                    format!(
                        "{} bytes do not split into {n} experts of {rows}x{cols} {}",
                        t.range.len, t.dtype
                    ),
                )
            })?;
        Ok(ByteRange {
            file: t.range.file,
            offset: t.range.offset + per * expert as u64,
            len: per,
        })
    }

    /// A GGUF metadata value (always `None` for safetensors: see `config()`).
    pub fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.meta[i].1)
    }

    /// GGUF metadata keys in file order (for split models: the first shard's).
    pub fn meta_keys(&self) -> impl Iterator<Item = &str> {
        self.meta.iter().map(|(k, _)| k.as_str())
    }

    /// config.json of a safetensors model, if there is one (`None` for GGUF).
    pub fn config(&self) -> Option<&serde_json::Value> {
        self.config.as_ref()
    }

    /// A whole tensor as f32 (allocates `n_elems` floats). FP8 E4M3 tensors with a sibling
    /// `<name>_scale_inv` get their block scales applied (DeepSeek: 128x128 tiles, or the
    /// config's `quantization_config.weight_block_size`).
    pub fn dequantize(&self, t: &TensorInfo) -> Result<Vec<f32>, FormatError> {
        let bytes = self.bytes(t)?;
        let n = usize::try_from(t.n_elems())
            .map_err(|_| self.tensor_err(t, "too many elements for this machine"))?;
        if t.dtype == DType::F8E4M3 {
            return self.dequantize_fp8(t, bytes, n);
        }
        if kernels::kernels_for(t.dtype).is_err() {
            return Err(self.unsupported(t, "dequantize"));
        }
        let mut out = vec![0f32; n];
        kernels::dequantize(t.dtype, bytes, &mut out)
            .map_err(|e| self.tensor_err(t, e.to_string()))?;
        Ok(out)
    }

    fn fp8_block(&self) -> Result<usize, String> {
        let Some(b) = self
            .config
            .as_ref()
            .and_then(|c| c.get("quantization_config"))
            .and_then(|q| q.get("weight_block_size"))
        else {
            return Ok(128);
        };
        match b
            .as_array()
            .map(|a| a.iter().map(|x| x.as_u64()).collect::<Vec<_>>())
            .as_deref()
        {
            Some([Some(r), Some(c)]) if r == c && *r > 0 => Ok(*r as usize),
            _ => Err(format!(
                "config.json quantization_config.weight_block_size {b} is not [n, n]"
            )),
        }
    }

    fn dequantize_fp8(
        &self,
        t: &TensorInfo,
        bytes: &[u8],
        n: usize,
    ) -> Result<Vec<f32>, FormatError> {
        let mut out = vec![0f32; n];
        if n == 0 {
            return Ok(out);
        }
        if bytes.len() != n {
            return Err(self.tensor_err(t, format!("{} bytes for {n} FP8 elements", bytes.len())));
        }
        // The tensor is `mats` row-major rows x cols matrices (leading dims are a batch).
        let (rows, cols) = match t.shape[..] {
            [.., r, c] => (r as usize, c as usize),
            _ => (1, n),
        };
        let mats = n / (rows * cols);
        let scale_name = format!("{}_scale_inv", t.name);
        let Some(st) = self.tensor(&scale_name) else {
            // No scales: plain E4M3 values, as one tile with scale 1.
            let all_rows = mats * rows;
            kernels::dequantize_fp8_block_scaled(
                bytes,
                &[1.0],
                all_rows,
                cols,
                all_rows.max(cols),
                &mut out,
            )
            .map_err(|e| self.tensor_err(t, e.to_string()))?;
            return Ok(out);
        };
        let block = self.fp8_block().map_err(|m| self.tensor_err(t, m))?;
        let (sr, sc) = (rows.div_ceil(block), cols.div_ceil(block));
        let shape_ok = match t.shape.len() {
            0 | 1 => st.n_elems() == sc as u64,
            k => {
                st.shape.len() == k
                    && st.shape[..k - 2] == t.shape[..k - 2]
                    && st.shape[k - 2..] == [sr as u64, sc as u64]
            }
        };
        if !shape_ok {
            return Err(self.tensor_err(
                t,
                format!(
                    "`{scale_name}` has shape {:?}, which is not {block}x{block} tiles of {:?}",
                    st.shape, t.shape
                ),
            ));
        }
        let scales = self.dequantize(st)?;
        if scales.len() != mats * sr * sc {
            return Err(self.tensor_err(
                t,
                format!(
                    "`{scale_name}` holds {} scales, expected {}",
                    scales.len(),
                    mats * sr * sc
                ),
            ));
        }
        let mat = rows * cols;
        for ((w, s), o) in bytes
            .chunks_exact(mat)
            .zip(scales.chunks_exact(sr * sc))
            .zip(out.chunks_exact_mut(mat))
        {
            kernels::dequantize_fp8_block_scaled(w, s, rows, cols, block, o)
                .map_err(|e| self.tensor_err(t, e.to_string()))?;
        }
        Ok(out)
    }
}
