//! `--verify-experts`: one hash per routed expert, computed once from the model's files and
//! kept beside the usage statistics; the streaming cache checks every expert it reads against
//! it, so a corrupt expert stops the run with an error instead of changing the output.
//!
//! Owns: the hash function, computing the table, and its file (versioned JSON tied to the
//! model identity, written to a temporary name and renamed). Does not own: where the file
//! lives (cli/common.rs) or when bytes are checked (cache.rs calls `check`).
//! Invariant: a table is only used for the model identity and expert shape it was made for;
//! anything else is recomputed.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::store::ExpertLoc;
use super::ExpertError;
use crate::format::ModelFiles;

const FORMAT: &str = "sluice-expert-hashes";
const VERSION: u32 = 1;

/// Hash of one expert: its parts (gate, up, down) in order, folded 8 bytes at a time by
/// multiply and rotate, with each part's length. Catches corruption, not forgery.
pub fn expert_hash(parts: [&[u8]; 3]) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut word = |w: u64| h = (h ^ w).wrapping_mul(0xff51_afd7_ed55_8ccd).rotate_left(29);
    for p in parts {
        let mut c = p.chunks_exact(8);
        for w in &mut c {
            word(u64::from_le_bytes(w.try_into().unwrap_or([0; 8])));
        }
        let mut tail = [0u8; 8];
        tail[..c.remainder().len()].copy_from_slice(c.remainder());
        word(u64::from_le_bytes(tail));
        word(p.len() as u64);
    }
    h
}

/// Hashes of every routed expert, `[layer][expert]` (dense layers have none).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertHashes {
    layers: Vec<Vec<u64>>,
}

#[derive(Serialize, Deserialize)]
struct HashFile {
    format: String,
    version: u32,
    model: String,
    /// Hex, `[layer][expert]`.
    layers: Vec<Vec<String>>,
}

impl ExpertHashes {
    /// Read every expert of `locs` from the mapped `files` and hash it.
    pub fn compute(
        files: &ModelFiles,
        locs: &[Vec<ExpertLoc>],
    ) -> Result<ExpertHashes, ExpertError> {
        let mut layers = Vec::with_capacity(locs.len());
        for (l, layer) in locs.iter().enumerate() {
            let mut hs = Vec::with_capacity(layer.len());
            for (e, loc) in layer.iter().enumerate() {
                let mut parts: [&[u8]; 3] = [&[]; 3];
                for (i, r) in loc.parts.iter().enumerate() {
                    if r.len == 0 {
                        continue;
                    }
                    parts[i] = files.range_bytes(*r).map_err(|err| ExpertError::BadRange {
                        layer: l,
                        expert: e,
                        part: ["gate", "up", "down"][i],
                        msg: err.to_string(),
                    })?;
                }
                hs.push(expert_hash(parts));
            }
            layers.push(hs);
        }
        Ok(ExpertHashes { layers })
    }

    /// The recorded hash of expert `expert` of `layer`.
    pub fn get(&self, layer: usize, expert: usize) -> Option<u64> {
        self.layers.get(layer)?.get(expert).copied()
    }

    fn shape(&self) -> Vec<usize> {
        self.layers.iter().map(Vec::len).collect()
    }

    /// The table saved at `path` for `model_id` if it fits `locs`' shape; else computed from
    /// `files` and saved there. Returns the table and whether it was computed now.
    pub fn load_or_compute(
        path: &Path,
        model_id: &str,
        files: &ModelFiles,
        locs: &[Vec<ExpertLoc>],
    ) -> Result<(ExpertHashes, bool), ExpertError> {
        let shape: Vec<usize> = locs.iter().map(Vec::len).collect();
        if let Some(h) = Self::load(path, model_id).filter(|h| h.shape() == shape) {
            return Ok((h, false));
        }
        let h = Self::compute(files, locs)?;
        h.save(path, model_id)?;
        Ok((h, true))
    }

    fn load(path: &Path, model_id: &str) -> Option<ExpertHashes> {
        let f: HashFile = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
        if f.format != FORMAT || f.version != VERSION || f.model != model_id {
            return None;
        }
        let layers = f
            .layers
            .iter()
            .map(|l| {
                l.iter()
                    .map(|x| u64::from_str_radix(x, 16).ok())
                    .collect::<Option<Vec<u64>>>()
            })
            .collect::<Option<Vec<_>>>()?;
        Some(ExpertHashes { layers })
    }

    fn save(&self, path: &Path, model_id: &str) -> Result<(), ExpertError> {
        let f = HashFile {
            format: FORMAT.into(),
            version: VERSION,
            model: model_id.into(),
            layers: self
                .layers
                .iter()
                .map(|l| l.iter().map(|h| format!("{h:016x}")).collect())
                .collect(),
        };
        let json = serde_json::to_vec(&f).map_err(|e| ExpertError::Usage {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        let mut tmp = path.as_os_str().to_os_string();
        tmp.push(format!(".tmp{}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let write = || -> std::io::Result<()> {
            let mut out = std::fs::File::create(&tmp)?;
            out.write_all(&json)?;
            out.sync_all()
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(ExpertError::io(&tmp, "write", e));
        }
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            ExpertError::io(path, "rename the temporary expert-hash file onto", e)
        })
    }

    /// Check expert `expert` of `layer` as read (`parts`) against the table.
    pub fn check(&self, layer: usize, expert: usize, parts: [&[u8]; 3]) -> Result<(), ExpertError> {
        match self.get(layer, expert) {
            Some(want) if expert_hash(parts) != want => Err(ExpertError::Corrupt { layer, expert }),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_sees_one_bit_and_part_boundaries() {
        let a = vec![7u8; 100];
        let h = expert_hash([&a, &a[..3], &[]]);
        let mut b = a.clone();
        b[50] ^= 2;
        assert_ne!(h, expert_hash([&b, &a[..3], &[]]));
        assert_ne!(h, expert_hash([&a[..99], &a[..4], &[]]));
        assert_eq!(h, expert_hash([&a, &a[..3], &[]]));
    }
}
