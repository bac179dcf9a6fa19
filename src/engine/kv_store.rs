//! KV sessions on disk (`--kv-dir`): the tokens of a conversation and the keys and values the
//! model computed for them, so a restarted server (or a conversation that was pushed out of
//! memory by another) resumes without prefilling again.
//!
//! File `session-<hash>.slkv`, little-endian:
//! `b"SLUICEKV"`, u32 version (2), u64 model fingerprint, u32 cache layers, u32 key width,
//! u32 value width, u32 n, n x u32 tokens, then for each layer n*key_width f32 keys followed
//! by n*value_width f32 values (widths from `ModelConfig::cache_dims`; MLA has no values,
//! except DeepSeek-V3.2, whose value row holds the lightning indexer's key).
//! Files are written to a temporary name, synced, and renamed into place (atomic).
//!
//! Owns: the directory's session files, their index (tokens per file) and eviction (oldest
//! first past `max_sessions`). Does not own: the state itself: it writes and reads the state's parts in
//! `State::parts` order (model/seq.rs), which for a KV-only state is the v2 layout above.
//! Invariant: a session is restored only into a model with the same fingerprint (file shapes,
//! metadata and a sample of every tensor's bytes) and layout, and only as a prefix of the
//! tokens it was computed for, so restored rows equal freshly computed ones bit for bit.

use crate::format::ModelFiles;
use crate::model::{ModelConfig, State};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"SLUICEKV";
const VERSION: u32 = 2;
const HEAD: u64 = 8 + 4 + 8 + 4 + 4 + 4 + 4;

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
    /// Floats per position and layer: (keys, values).
    dims: (usize, usize),
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
    /// Open (creating) `dir` and index the sessions in it that belong to this model.
    pub fn open(
        dir: &Path,
        fingerprint: u64,
        layers: usize,
        dims: (usize, usize),
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
        let want = (layers as u64)
            .checked_mul((kd + vd) as u64)
            .and_then(|x| x.checked_mul(n))
            .and_then(|x| x.checked_mul(4))
            .and_then(|x| x.checked_add(HEAD + n * 4));
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

    /// The stored session sharing the longest token prefix with `tokens`: (index, length).
    pub fn best_match(&self, tokens: &[u32]) -> Option<(usize, usize)> {
        self.sessions
            .iter()
            .enumerate()
            .map(|(i, s)| (i, super::decode::lcp(&s.tokens, tokens)))
            .filter(|&(_, c)| c > 0)
            .max_by_key(|&(i, c)| (c, self.sessions[i].used))
    }

    /// Load the first `n` positions of session `idx` into `st` (sets `st.pos = n`). Returns
    /// the bytes read.
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
        let io = |op, err| KvStoreError::Io {
            path: path.clone(),
            op,
            err,
        };
        let mut f = File::open(&path).map_err(|e| io("open", e))?;
        let (kd, vd) = self.dims;
        let base = HEAD + total * 4;
        let mut buf = Vec::new();
        st.pos = 0;
        // The main layers' parts (an MTP layer's cache is not saved: its slots are re-made).
        let parts: Vec<_> = st.parts().filter(|p| p.layer < self.layers).collect();
        if parts.len() != 2 * self.layers || parts.iter().any(|p| !p.per_position) {
            return Err(KvStoreError::Bad {
                path: path.clone(),
                msg: format!(
                    "the state has {} parts, a version {VERSION} session holds {} positional ones",
                    parts.len(),
                    2 * self.layers
                ),
            });
        }
        // Part i starts after the `total` rows of every part before it.
        let mut at = base;
        for part in parts {
            let dst = st.part_rows_mut(part, n).map_err(|e| KvStoreError::Bad {
                path: path.clone(),
                msg: e.to_string(),
            })?;
            buf.resize(dst.len() * 4, 0);
            f.seek(SeekFrom::Start(at)).map_err(|e| io("seek", e))?;
            f.read_exact(&mut buf).map_err(|e| io("read", e))?;
            for (x, c) in dst.iter_mut().zip(buf.chunks_exact(4)) {
                *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            at += total * (part.width * 4) as u64;
        }
        st.set_pos(n);
        Ok(self.layers as u64 * n as u64 * ((kd + vd) * 4) as u64)
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
        let (kd, vd) = self.dims;
        let bytes = HEAD + n as u64 * 4 + (self.layers * n * (kd + vd) * 4) as u64;

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
        for t in tokens {
            head.extend_from_slice(&t.to_le_bytes());
        }
        let write = |w: &mut BufWriter<File>, b: &[u8]| w.write_all(b).map_err(|e| io("write", e));
        write(&mut w, &head)?;
        let mut buf = Vec::with_capacity(n * kd.max(vd) * 4);
        for part in st.parts().filter(|p| p.layer < self.layers) {
            let rows = st.part_rows(part, n).map_err(|e| KvStoreError::Bad {
                path: tmp.to_path_buf(),
                msg: e.to_string(),
            })?;
            buf.clear();
            for x in rows {
                buf.extend_from_slice(&x.to_le_bytes());
            }
            write(&mut w, &buf)?;
        }
        let f = w.into_inner().map_err(|e| io("write", e.into_error()))?;
        f.sync_all().map_err(|e| io("sync", e))?;
        Ok(())
    }
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
        for x in [layers, kvd, kvd, tokens.len() as u32] {
            b.extend_from_slice(&x.to_le_bytes());
        }
        for t in tokens {
            b.extend_from_slice(&t.to_le_bytes());
        }
        b.extend(std::iter::repeat_n(0u8, kv_floats * 4));
        b
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
        let store =
            KvStore::open(&dir, fp, layers as usize, (kvd as usize, kvd as usize), 8).unwrap();
        assert_eq!(store.len(), 1);
        assert_eq!(store.best_match(&[1, 2, 9]), Some((0, 2)));
        assert_eq!(store.best_match(&[5]), None);
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
