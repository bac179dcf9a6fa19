//! KV sessions on disk (`--kv-dir`): the tokens of a conversation and the keys and values the
//! model computed for them, so a restarted server (or a conversation that was pushed out of
//! memory by another) resumes without prefilling again.
//!
//! File `session-<hash>.slkv`, little-endian:
//! `b"SLUICEKV"`, u32 version (4), u64 model fingerprint, u32 cache layers, u32 key width,
//! u32 value width, u32 n, u32 key type, u32 value type (`KvType::code`: 0 f32, 1 f16, 2 bf16,
//! 3 q8_0), n x u32 tokens, then for each layer n key rows followed by n value rows, each row
//! its width in the cache's type (`KvType::row_bytes`: f32 4 bytes an element, f16 / bf16 2,
//! q8_0 34 per 32) (widths from `ModelConfig::cache_dims`; MLA has no values,
//! except DeepSeek-V3.2, whose value row holds the lightning indexer's key), then a u64
//! checksum (`Sum64`) of every byte before it. A hybrid model's session (Qwen3-Next /
//! Qwen3.5) adds, between the last layer's rows and the checksum, each linear layer's conv
//! block then its delta-rule block (`State::parts` order, widths from the config): the
//! recurrent state after the session's last token.
//! Files are written to a temporary name, synced, and renamed into place (atomic). A file
//! whose checksum does not match is refused with a warning and renamed `.bad`, never restored.
//!
//! Owns: the directory's session files, their index (tokens per file) and eviction (oldest
//! first past `max_sessions`). Does not own: the state itself: it writes and reads the state's parts in
//! `State::parts` order (model/seq.rs), which for a KV-only state is the v2 layout above.
//! A session saved with other cache types (`-ctk` / `-ctv`) is skipped with a warning naming
//! both (rows are never converted: a restored session must equal a fresh prefill).
//! Invariant: a session is restored only into a model with the same fingerprint (file shapes,
//! metadata and a sample of every tensor's bytes), layout and cache types, and only as a prefix of the
//! tokens it was computed for, so restored rows equal freshly computed ones bit for bit. A
//! recurrent state cannot be cut to a prefix: a hybrid model's session is restored only whole,
//! into a prompt that extends all of its tokens (`best_match` offers no other); any other
//! prompt is computed from position 0.

use crate::format::ModelFiles;
use crate::kernels::kv::KvType;
use crate::model::{KvTypes, ModelConfig, State};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"SLUICEKV";
const VERSION: u32 = 4;
/// The checksum after the data.
const TRAILER: u64 = 8;
const HEAD: u64 = 8 + 4 + 8 + 4 + 4 + 4 + 4 + 4 + 4;

#[derive(Debug, thiserror::Error)]
pub enum KvStoreError {
    #[error("{}: {op}: {err}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        err: std::io::Error,
    },
    #[error("{}: {msg}", path.display())]
    Bad { path: PathBuf, msg: String },
}

/// One session file, as indexed.
struct Session {
    path: PathBuf,
    tokens: Vec<u32>,
    /// Order of last use (higher = newer).
    used: u64,
}

pub struct KvStore {
    dir: PathBuf,
    fingerprint: u64,
    layers: usize,
    /// Elements per position and layer: (keys, values).
    dims: (usize, usize),
    /// Their element types (`-ctk`, `-ctv`).
    kv: KvTypes,
    /// Floats of the state's blocks (a hybrid model's conv + recurrent state; 0 otherwise),
    /// saved once per session, after the rows.
    blocks: usize,
    max_sessions: usize,
    sessions: Vec<Session>,
    clock: u64,
}

/// FNV-1a, 64 bit.
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn add(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// The checksum of a session file: 64-bit words (the tail zero-padded) folded by multiply and
/// rotate, plus the length. Catches damaged floats; not a defence against a forger.
struct Sum64 {
    h: u64,
    len: u64,
    tail: Vec<u8>,
}

impl Sum64 {
    fn new() -> Sum64 {
        Sum64 {
            h: 0x9e37_79b9_7f4a_7c15,
            len: 0,
            tail: Vec::with_capacity(8),
        }
    }

    fn word(&mut self, w: u64) {
        self.h = (self.h ^ w)
            .wrapping_mul(0xff51_afd7_ed55_8ccd)
            .rotate_left(29);
    }

    fn add(&mut self, mut bytes: &[u8]) {
        self.len += bytes.len() as u64;
        if !self.tail.is_empty() {
            let take = (8 - self.tail.len()).min(bytes.len());
            self.tail.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.tail.len() < 8 {
                return;
            }
            let w = u64::from_le_bytes(self.tail[..8].try_into().unwrap_or([0; 8]));
            self.word(w);
            self.tail.clear();
        }
        let mut words = bytes.chunks_exact(8);
        for c in &mut words {
            self.word(u64::from_le_bytes(c.try_into().unwrap_or([0; 8])));
        }
        self.tail.extend_from_slice(words.remainder());
    }

    fn finish(mut self) -> u64 {
        if !self.tail.is_empty() {
            let mut w = [0u8; 8];
            w[..self.tail.len()].copy_from_slice(&self.tail);
            self.word(u64::from_le_bytes(w));
        }
        let len = self.len;
        self.word(len);
        self.h
    }
}

/// A model's identity for sessions: its config, every tensor's name, type, shape and first
/// bytes, and every metadata key with its value.
pub fn fingerprint(files: &ModelFiles, cfg: &ModelConfig) -> u64 {
    let mut h = Fnv::new();
    h.add(format!("{cfg:?}").as_bytes());
    for t in files.tensors() {
        h.add(t.name.as_bytes());
        h.add(files.dtype_name(t).as_bytes());
        h.add(format!("{:?}", t.shape).as_bytes());
        if let Ok(b) = files.bytes(t) {
            h.add(&b[..b.len().min(256)]);
        }
    }
    let mut keys: Vec<&str> = files.meta_keys().collect();
    keys.sort_unstable();
    for k in keys {
        h.add(k.as_bytes());
        if let Some(v) = files.meta(k) {
            h.add(format!("{v:?}").as_bytes());
        }
    }
    if let Some(c) = files.config() {
        h.add(c.to_string().as_bytes());
    }
    h.0
}

impl KvStore {
    /// Open (creating) `dir` and index the sessions in it that belong to this model. `blocks`:
    /// the floats of the state's non-positional parts (`State::block_floats`).
    pub fn open(
        dir: &Path,
        fingerprint: u64,
        layers: usize,
        dims: (usize, usize),
        kv: KvTypes,
        blocks: usize,
        max_sessions: usize,
    ) -> Result<KvStore, KvStoreError> {
        let io = |op, err| KvStoreError::Io {
            path: dir.to_path_buf(),
            op,
            err,
        };
        std::fs::create_dir_all(dir).map_err(|e| io("create directory", e))?;
        let mut store = KvStore {
            dir: dir.to_path_buf(),
            fingerprint,
            layers,
            dims,
            kv,
            blocks,
            max_sessions: max_sessions.max(1),
            sessions: Vec::new(),
            clock: 0,
        };
        let mut found: Vec<(std::time::SystemTime, PathBuf)> = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(|e| io("list", e))? {
            let Ok(entry) = entry else { continue };
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if stale_temp(&name) {
                // A write that a crash cut short: never renamed into place, never read.
                let _ = std::fs::remove_file(&path);
                continue;
            }
            if name.starts_with("session-") && name.ends_with(".slkv") {
                let mtime = entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .unwrap_or(std::time::UNIX_EPOCH);
                found.push((mtime, path));
            }
        }
        found.sort();
        for (_, path) in found {
            match store.read_index(&path) {
                Ok(Some(tokens)) => {
                    store.clock += 1;
                    store.sessions.push(Session {
                        path,
                        tokens,
                        used: store.clock,
                    });
                }
                Ok(None) => {} // another model's session: leave it alone
                Err(e) => eprintln!("[serve] warning: skipping KV session: {e}"),
            }
        }
        Ok(store)
    }

    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// Header and tokens of a session file; None if it is another model's.
    fn read_index(&self, path: &Path) -> Result<Option<Vec<u32>>, KvStoreError> {
        let f = File::open(path).map_err(|err| KvStoreError::Io {
            path: path.into(),
            op: "open",
            err,
        })?;
        let size = f
            .metadata()
            .map_err(|err| KvStoreError::Io {
                path: path.into(),
                op: "stat",
                err,
            })?
            .len();
        let mut r = BufReader::new(f);
        let bad = |msg: String| KvStoreError::Bad {
            path: path.into(),
            msg,
        };
        let mut head = [0u8; HEAD as usize];
        r.read_exact(&mut head)
            .map_err(|_| bad("shorter than a session header".into()))?;
        if &head[..8] != MAGIC {
            return Err(bad("not a sluice KV session (bad magic)".into()));
        }
        let u32_at =
            |o: usize| u32::from_le_bytes([head[o], head[o + 1], head[o + 2], head[o + 3]]);
        let version = u32_at(8);
        if version != VERSION {
            return Err(bad(format!(
                "session format version {version}, this build reads {VERSION}"
            )));
        }
        let mut fp = [0u8; 8];
        fp.copy_from_slice(&head[12..20]);
        if u64::from_le_bytes(fp) != self.fingerprint {
            return Ok(None);
        }
        let (layers, kd, vd, n) = (
            u32_at(20) as usize,
            u32_at(24) as usize,
            u32_at(28) as usize,
            u32_at(32) as u64,
        );
        if layers != self.layers || (kd, vd) != self.dims {
            return Err(bad(format!(
                "{layers} cache layers of widths ({kd}, {vd}), the model has {} of {:?}",
                self.layers, self.dims
            )));
        }
        let ty = |c: u32| {
            KvType::from_code(c).ok_or_else(|| bad(format!("unknown KV cache type code {c}")))
        };
        let saved = KvTypes {
            k: ty(u32_at(36))?,
            v: ty(u32_at(40))?,
        };
        if saved != self.kv {
            return Err(bad(format!(
                "saved with -ctk {} -ctv {}, this run caches -ctk {} -ctv {}; not restored (run with the same -ctk/-ctv to use it)",
                saved.k, saved.v, self.kv.k, self.kv.v
            )));
        }
        let want = (layers as u64)
            .checked_mul(self.row_bytes())
            .and_then(|x| x.checked_mul(n))
            .and_then(|x| x.checked_add(self.blocks as u64 * 4))
            .and_then(|x| x.checked_add(HEAD + n * 4 + TRAILER));
        if want != Some(size) {
            return Err(bad(format!(
                "{size} bytes, not the size of a session of {n} tokens"
            )));
        }
        let mut raw = vec![0u8; n as usize * 4];
        r.read_exact(&mut raw).map_err(|err| KvStoreError::Io {
            path: path.into(),
            op: "read",
            err,
        })?;
        Ok(Some(
            raw.chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ))
    }

    /// Bytes of one position's key and value rows in one layer.
    fn row_bytes(&self) -> u64 {
        (self.kv.k.row_bytes(self.dims.0) + self.kv.v.row_bytes(self.dims.1)) as u64
    }

    /// The stored session sharing the longest token prefix with `tokens`: (index, length).
    /// With a recurrent state only whole sessions that `tokens` extends (by one token at
    /// least) match: their state is held at their end only.
    pub fn best_match(&self, tokens: &[u32]) -> Option<(usize, usize)> {
        let whole_only = self.blocks > 0;
        self.sessions
            .iter()
            .enumerate()
            .map(|(i, s)| (i, super::decode::lcp(&s.tokens, tokens)))
            .filter(|&(i, c)| {
                c > 0 && (!whole_only || c == self.sessions[i].tokens.len() && c < tokens.len())
            })
            .max_by_key(|&(i, c)| (c, self.sessions[i].used))
    }

    /// Load the first `n` positions of session `idx` into `st` (sets `st.pos = n`); with a
    /// recurrent state `n` must be the session's length. Returns the bytes read.
    pub fn load(&mut self, idx: usize, n: usize, st: &mut State) -> Result<u64, KvStoreError> {
        let Some(s) = self.sessions.get_mut(idx) else {
            return Err(KvStoreError::Bad {
                path: self.dir.clone(),
                msg: format!("no session {idx}"),
            });
        };
        self.clock += 1;
        s.used = self.clock;
        let path = s.path.clone();
        let total = s.tokens.len() as u64;
        let n = n.min(s.tokens.len());
        if self.blocks > 0 && n as u64 != total {
            return Err(KvStoreError::Bad {
                path,
                msg: format!(
                    "a recurrent state is held at the session's end ({total} tokens) only, not at {n}"
                ),
            });
        }
        let io = |op, err| KvStoreError::Io {
            path: path.clone(),
            op,
            err,
        };
        let mut f = File::open(&path).map_err(|e| io("open", e))?;
        if let Err(msg) = verify(&mut f) {
            // Damaged: never restored, and out of the way of later matches.
            self.sessions.remove(idx);
            let mut bad = path.as_os_str().to_os_string();
            bad.push(".bad");
            let _ = std::fs::rename(&path, &bad);
            return Err(KvStoreError::Bad {
                path,
                msg: format!("{msg}; renamed to .bad, not restored"),
            });
        }
        let base = HEAD + total * 4;
        st.pos = 0;
        // The main layers' parts (an MTP layer's cache is not saved: its slots are re-made),
        // then the blocks.
        let parts: Vec<_> = st.parts().filter(|p| self.saved(p)).collect();
        let rows = parts.iter().filter(|p| p.per_position).count();
        let blocks: usize = parts
            .iter()
            .filter(|p| !p.per_position)
            .map(|p| p.width)
            .sum();
        if rows != 2 * self.layers || blocks != self.blocks {
            return Err(KvStoreError::Bad {
                path: path.clone(),
                msg: format!(
                    "the state has {rows} positional parts and {blocks} block floats, the session holds {} and {}",
                    2 * self.layers,
                    self.blocks
                ),
            });
        }
        // Part i starts after the `total` rows (or the block) of every part before it.
        let mut at = base;
        for part in parts {
            let dst = st.part_rows_mut(part, n).map_err(|e| KvStoreError::Bad {
                path: path.clone(),
                msg: e.to_string(),
            })?;
            // Rows are little-endian in the file as in memory (x86-64, aarch64).
            f.seek(SeekFrom::Start(at)).map_err(|e| io("seek", e))?;
            f.read_exact(dst).map_err(|e| io("read", e))?;
            at += if part.per_position { total } else { 1 } * part.ty.row_bytes(part.width) as u64;
        }
        st.set_pos(n);
        Ok(self.layers as u64 * n as u64 * self.row_bytes() + self.blocks as u64 * 4)
    }

    /// Whether a session file holds `part`: the main layers' rows and every block.
    fn saved(&self, part: &crate::model::Part) -> bool {
        !part.per_position || part.layer < self.layers
    }

    /// Save the conversation `tokens` (whose KV is in `st`, `st.pos == tokens.len()`).
    /// Sessions it extends are replaced. Returns the bytes written, None if nothing changed.
    pub fn save(&mut self, tokens: &[u32], st: &State) -> Result<Option<u64>, KvStoreError> {
        if tokens.is_empty() || st.pos != tokens.len() {
            return Ok(None);
        }
        if let Some(s) = self.sessions.iter_mut().find(|s| s.tokens == tokens) {
            self.clock += 1;
            s.used = self.clock;
            return Ok(None);
        }
        let mut h = Fnv::new();
        for t in tokens {
            h.add(&t.to_le_bytes());
        }
        let path = self.dir.join(format!("session-{:016x}.slkv", h.0));
        let tmp = self
            .dir
            .join(format!(".session-{:016x}.{}.tmp", h.0, std::process::id()));
        let n = tokens.len();
        if let Err(e) = self.write_file(&tmp, tokens, st) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        std::fs::rename(&tmp, &path).map_err(|err| {
            let _ = std::fs::remove_file(&tmp);
            KvStoreError::Io {
                path: path.clone(),
                op: "rename into place",
                err,
            }
        })?;
        if let Ok(d) = File::open(&self.dir) {
            let _ = d.sync_all();
        }
        let bytes = HEAD
            + n as u64 * 4
            + self.layers as u64 * n as u64 * self.row_bytes()
            + self.blocks as u64 * 4
            + TRAILER;

        // Sessions this one extends are superseded.
        self.sessions.retain(|s| {
            let superseded = s.tokens.len() < tokens.len() && tokens.starts_with(&s.tokens);
            if superseded {
                let _ = std::fs::remove_file(&s.path);
            }
            !superseded
        });
        self.sessions.retain(|s| s.path != path);
        self.clock += 1;
        self.sessions.push(Session {
            path,
            tokens: tokens.to_vec(),
            used: self.clock,
        });
        while self.sessions.len() > self.max_sessions {
            let Some((oldest, _)) = self.sessions.iter().enumerate().min_by_key(|(_, s)| s.used)
            else {
                break;
            };
            let s = self.sessions.remove(oldest);
            let _ = std::fs::remove_file(&s.path);
        }
        Ok(Some(bytes))
    }

    /// The whole session file at `tmp`, synced.
    fn write_file(&self, tmp: &Path, tokens: &[u32], st: &State) -> Result<(), KvStoreError> {
        let io = |op, err| KvStoreError::Io {
            path: tmp.to_path_buf(),
            op,
            err,
        };
        let f = File::create(tmp).map_err(|e| io("create", e))?;
        let mut w = BufWriter::with_capacity(1 << 20, f);
        let n = tokens.len();
        let (kd, vd) = self.dims;
        let mut head = Vec::with_capacity(HEAD as usize + n * 4);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&VERSION.to_le_bytes());
        head.extend_from_slice(&self.fingerprint.to_le_bytes());
        head.extend_from_slice(&(self.layers as u32).to_le_bytes());
        head.extend_from_slice(&(kd as u32).to_le_bytes());
        head.extend_from_slice(&(vd as u32).to_le_bytes());
        head.extend_from_slice(&(n as u32).to_le_bytes());
        head.extend_from_slice(&self.kv.k.code().to_le_bytes());
        head.extend_from_slice(&self.kv.v.code().to_le_bytes());
        for t in tokens {
            head.extend_from_slice(&t.to_le_bytes());
        }
        let mut sum = Sum64::new();
        let mut write = |w: &mut BufWriter<File>, b: &[u8]| {
            sum.add(b);
            w.write_all(b).map_err(|e| io("write", e))
        };
        write(&mut w, &head)?;
        for part in st.parts().filter(|p| self.saved(p)) {
            let rows = st.part_rows(part, n).map_err(|e| KvStoreError::Bad {
                path: tmp.to_path_buf(),
                msg: e.to_string(),
            })?;
            // Little-endian in memory (x86-64, aarch64), as the file wants.
            write(&mut w, rows)?;
        }
        w.write_all(&sum.finish().to_le_bytes())
            .map_err(|e| io("write", e))?;
        let f = w.into_inner().map_err(|e| io("write", e.into_error()))?;
        f.sync_all().map_err(|e| io("sync", e))?;
        Ok(())
    }
}

/// Check the checksum of the whole session file `f` (reads it through; seeks back after).
fn verify(f: &mut File) -> Result<(), String> {
    let size = f
        .seek(SeekFrom::End(0))
        .map_err(|e| format!("cannot seek: {e}"))?;
    f.seek(SeekFrom::Start(0))
        .map_err(|e| format!("cannot seek: {e}"))?;
    let Some(body) = size.checked_sub(TRAILER) else {
        return Err("shorter than its checksum".into());
    };
    let mut sum = Sum64::new();
    let mut left = body;
    let mut buf = vec![0u8; 1 << 20];
    while left > 0 {
        let take = left.min(buf.len() as u64) as usize;
        f.read_exact(&mut buf[..take])
            .map_err(|e| format!("cannot read: {e}"))?;
        sum.add(&buf[..take]);
        left -= take as u64;
    }
    let mut want = [0u8; 8];
    f.read_exact(&mut want)
        .map_err(|e| format!("cannot read: {e}"))?;
    if sum.finish() != u64::from_le_bytes(want) {
        return Err("checksum mismatch: the session file is damaged".into());
    }
    Ok(())
}

/// `.session-<hash>.<pid>.tmp` of a process that is gone (a write cut short by a crash).
fn stale_temp(name: &str) -> bool {
    let Some(rest) = name.strip_prefix(".session-") else {
        return false;
    };
    let Some(rest) = rest.strip_suffix(".tmp") else {
        return false;
    };
    let Some(pid) = rest.rsplit('.').next().and_then(|p| p.parse::<u32>().ok()) else {
        return false;
    };
    pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session_bytes(fp: u64, layers: u32, kvd: u32, tokens: &[u32], kv_floats: usize) -> Vec<u8> {
        // Keys and values of the same width `kvd`.
        let mut b = Vec::new();
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&fp.to_le_bytes());
        for x in [layers, kvd, kvd, tokens.len() as u32, 0, 0] {
            b.extend_from_slice(&x.to_le_bytes());
        }
        for t in tokens {
            b.extend_from_slice(&t.to_le_bytes());
        }
        b.extend(std::iter::repeat_n(0u8, kv_floats * 4));
        let mut sum = Sum64::new();
        sum.add(&b);
        b.extend_from_slice(&sum.finish().to_le_bytes());
        b
    }

    #[test]
    fn checksum_catches_one_flipped_bit_and_splits_do_not_matter() {
        let data: Vec<u8> = (0..1001u32).map(|i| (i * 7) as u8).collect();
        let whole = {
            let mut s = Sum64::new();
            s.add(&data);
            s.finish()
        };
        let split = {
            let mut s = Sum64::new();
            s.add(&data[..3]);
            s.add(&data[3..500]);
            s.add(&data[500..]);
            s.finish()
        };
        assert_eq!(whole, split);
        let mut bad = data.clone();
        bad[700] ^= 1;
        let mut s = Sum64::new();
        s.add(&bad);
        assert_ne!(s.finish(), whole);
    }

    #[test]
    fn damaged_and_foreign_sessions_are_skipped() {
        let dir = std::env::temp_dir().join(format!("sluice-kv-store-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (fp, layers, kvd) = (7u64, 2u32, 4u32);
        let good = session_bytes(fp, layers, kvd, &[1, 2, 3], 2 * 2 * 3 * 4);
        std::fs::write(dir.join("session-a.slkv"), &good).unwrap();
        std::fs::write(dir.join("session-b.slkv"), &good[..good.len() - 1]).unwrap(); // truncated
        std::fs::write(
            dir.join("session-c.slkv"),
            session_bytes(99, layers, kvd, &[1], 16),
        )
        .unwrap(); // other model
        std::fs::write(dir.join("session-d.slkv"), b"SLUICEKV\x01").unwrap();
        let mut huge = session_bytes(fp, u32::MAX, u32::MAX, &[], 0);
        huge[32..36].copy_from_slice(&u32::MAX.to_le_bytes());
        std::fs::write(dir.join("session-e.slkv"), huge).unwrap(); // sizes that overflow
        let store = KvStore::open(
            &dir,
            fp,
            layers as usize,
            (kvd as usize, kvd as usize),
            KvTypes::F32,
            0,
            8,
        )
        .unwrap();
        assert_eq!(store.len(), 1);
        assert_eq!(store.best_match(&[1, 2, 9]), Some((0, 2)));
        assert_eq!(store.best_match(&[5]), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A session records its cache types; another run's types are refused by name (rows are
    /// never converted), the same types are restored.
    #[test]
    fn sessions_of_other_cache_types_are_refused_naming_both() {
        let dir = std::env::temp_dir().join(format!("sluice-kv-types-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (fp, layers, kvd) = (7u64, 2u32, 32u32);
        // f16 rows (2 bytes an element): 2 tokens x 2 layers x 2 sides x 32 x 2 bytes.
        let mut f16 = session_bytes(fp, layers, kvd, &[1, 2], 2 * 2 * 2 * 32 * 2 / 4);
        f16[36..40].copy_from_slice(&KvType::F16.code().to_le_bytes());
        f16[40..44].copy_from_slice(&KvType::F16.code().to_le_bytes());
        let n = f16.len() - 8;
        let mut sum = Sum64::new();
        sum.add(&f16[..n]);
        f16[n..].copy_from_slice(&sum.finish().to_le_bytes());
        let path = dir.join("session-f.slkv");
        std::fs::write(&path, &f16).unwrap();
        let open = |kv| KvStore::open(&dir, fp, layers as usize, (32, 32), kv, 0, 8).unwrap();
        let f32_store = open(KvTypes::F32);
        assert_eq!(f32_store.len(), 0);
        let err = f32_store.read_index(&path).unwrap_err().to_string();
        assert!(
            err.contains("saved with -ctk f16 -ctv f16, this run caches -ctk f32 -ctv f32"),
            "{err}"
        );
        assert_eq!(open(KvTypes::F16).len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_temporary_files_of_dead_processes_are_stale() {
        assert!(!stale_temp(".session-00ab.1.tmp") || !Path::new("/proc/1").exists());
        let me = std::process::id();
        assert!(!stale_temp(&format!(".session-00ab.{me}.tmp")));
        // Pids are below 2^22 on Linux: this one is never alive.
        assert!(stale_temp(".session-00ab.4294967000.tmp"));
        assert!(!stale_temp("session-00ab.slkv"));
        assert!(!stale_temp(".session-00ab.x.tmp"));
        assert!(!stale_temp("notes.tmp"));
    }
}
