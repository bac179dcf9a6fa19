//! A sequence's state as parts that can be truncated, saved and restored: what prefix reuse
//! (`truncate`), in-memory snapshots (`snapshot` / `restore`) and `--kv-dir` session files
//! (serve/kv_store.rs, through `parts` / `part_rows`) go through.
//!
//! Today every part is positional: the KV cache, per cache layer one part of keys (`k` elements
//! per position; MLA: latent + rope key) and one of values (`v` elements; V3.2: the indexer key;
//! 0 for plain MLA), the widths of `ModelConfig::cache_dims()`, each stored in its cache's
//! element type (`Part::ty`, `-ctk` / `-ctv`): parts are read and written as bytes. A positional part can keep any
//! prefix of its rows. A recurrent layer (Gated DeltaNet's conv and recurrent state) joins as
//! a `PartKind` with `per_position == false`: one block, the state after the last position,
//! which cannot be cut to a shorter prefix: `truncate` then resets the sequence and reports
//! position 0, and a snapshot restores only at the position it was taken.
//!
//! Owns: the part layout and the copy of rows in and out. Does not own: file formats
//! (serve/kv_store.rs), the forward pass.
//! Invariant: rows read with `part_rows` (or a `Snapshot`) and written back with
//! `part_rows_mut` + `set_pos` (or `restore`) leave the state exactly as it was, so a resumed
//! generation is bit-identical.

use super::{ModelError, State};
use crate::kernels::kv::{f32_bytes, f32_bytes_mut, KvType};

/// Widths of one cached position in one layer: (key floats, value floats).
pub type CacheDims = (usize, usize);

/// What a part of the state holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartKind {
    /// Cached keys (GQA), or MLA's latent + rope key.
    Keys,
    /// Cached values (GQA), or V3.2's indexer keys (MLA otherwise: 0 wide).
    Values,
    /// A Gated DeltaNet layer's last conv inputs (a block, qwen3next.rs).
    Conv,
    /// A Gated DeltaNet layer's delta-rule state (a block).
    Recurrent,
}

/// One part of a sequence's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    /// Cache layer (the MTP layer, when the state has one, is `n_layers`).
    pub layer: usize,
    pub kind: PartKind,
    /// Elements per position (per_position) or in all (a block).
    pub width: usize,
    /// Their element type (a recurrent block: f32).
    pub ty: KvType,
    /// One row per position (any prefix can be kept), or one block for the whole sequence.
    pub per_position: bool,
}

/// A copy of the state of positions `0..pos` (see `State::snapshot`).
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pos: usize,
    mtp_pos: usize,
    /// The parts' bytes, in `State::parts` order, each `pos` rows (a block: one).
    data: Vec<Vec<u8>>,
}

impl Snapshot {
    /// Positions the snapshot holds.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.iter().map(|d| d.len()).sum()
    }
}

impl State {
    /// Cache layers (every layer that caches, including the MTP layer when the state has one).
    pub fn cache_layers(&self) -> usize {
        self.cache_layers
    }

    /// The parts of this state, in the order files and snapshots keep them: for each cache
    /// layer its keys, then its values.
    pub fn parts(&self) -> impl Iterator<Item = Part> + '_ {
        let (kd, vd) = self.cache_dims;
        let (kt, vt) = (self.kcache.ty(), self.vcache.ty());
        let hy = &self.hybrid;
        (0..self.cache_layers)
            .flat_map(move |layer| {
                [(PartKind::Keys, kd, kt), (PartKind::Values, vd, vt)].map(|(kind, width, ty)| {
                    Part {
                        layer,
                        kind,
                        width,
                        ty,
                        per_position: true,
                    }
                })
            })
            .chain(hy.layers.iter().flat_map(move |&layer| {
                [
                    (PartKind::Conv, hy.conv_width),
                    (PartKind::Recurrent, hy.rec_width),
                ]
                .map(|(kind, width)| Part {
                    layer,
                    kind,
                    width,
                    ty: KvType::F32,
                    per_position: false,
                })
            }))
    }

    /// Floats of the parts that are one block for the whole sequence (a hybrid model's conv
    /// and recurrent state; 0 for a KV-only state).
    pub fn block_floats(&self) -> usize {
        self.parts()
            .filter(|p| !p.per_position)
            .map(|p| p.width)
            .sum()
    }

    /// The block of a recurrent part (the state after the last position fed).
    fn block_range(&self, part: Part) -> Result<std::ops::Range<usize>, ModelError> {
        let hy = &self.hybrid;
        let i = hy.layers.iter().position(|l| *l == part.layer);
        let w = match part.kind {
            PartKind::Conv => hy.conv_width,
            _ => hy.rec_width,
        };
        match i {
            Some(i) if part.width == w && !part.per_position && part.ty == KvType::F32 => {
                Ok(i * w..(i + 1) * w)
            }
            _ => Err(ModelError::Input(format!(
                "state part {part:?} does not match the state's recurrent layers {:?}",
                hy.layers
            ))),
        }
    }

    /// The bytes of `part` for positions `0..n` (`n` rows of `part.ty.row_bytes(width)`; a
    /// block: its f32s).
    pub fn part_rows(&self, part: Part, n: usize) -> Result<&[u8], ModelError> {
        match part.kind {
            PartKind::Conv => return Ok(f32_bytes(&self.hybrid.conv[self.block_range(part)?])),
            PartKind::Recurrent => return Ok(f32_bytes(&self.hybrid.rec[self.block_range(part)?])),
            _ => {}
        }
        let r = self.part_range(part, n)?;
        Ok(match part.kind {
            PartKind::Values => &self.vcache.bytes()[r],
            _ => &self.kcache.bytes()[r],
        })
    }

    /// Writable bytes of `part` for positions `0..n`; call `set_pos(n)` when every part is
    /// written.
    pub fn part_rows_mut(&mut self, part: Part, n: usize) -> Result<&mut [u8], ModelError> {
        match part.kind {
            PartKind::Conv => {
                let r = self.block_range(part)?;
                return Ok(f32_bytes_mut(&mut self.hybrid.conv[r]));
            }
            PartKind::Recurrent => {
                let r = self.block_range(part)?;
                return Ok(f32_bytes_mut(&mut self.hybrid.rec[r]));
            }
            _ => {}
        }
        let r = self.part_range(part, n)?;
        Ok(match part.kind {
            PartKind::Values => &mut self.vcache.bytes_mut()[r],
            _ => &mut self.kcache.bytes_mut()[r],
        })
    }

    /// The byte range of positions `0..n` of a positional part.
    fn part_range(&self, part: Part, n: usize) -> Result<std::ops::Range<usize>, ModelError> {
        let (kd, vd) = self.cache_dims;
        let (want, cache) = match part.kind {
            PartKind::Values => (vd, &self.vcache),
            _ => (kd, &self.kcache),
        };
        if part.layer >= self.cache_layers
            || part.width != want
            || part.ty != cache.ty()
            || n > self.ctx
        {
            return Err(ModelError::Input(format!(
                "state part {part:?} for {n} positions does not match the state ({} cache layers, widths ({kd}, {vd}), types (-ctk {}, -ctv {}), {} positions)",
                self.cache_layers, self.kcache.ty(), self.vcache.ty(), self.ctx
            )));
        }
        let rb = cache.row_bytes();
        let base = part.layer * self.ctx * rb;
        Ok(base..base + n * rb)
    }

    /// After writing parts with `part_rows_mut`: the sequence holds positions `0..n` (the MTP
    /// head's slots, which depend on positions after them, are forgotten).
    pub fn set_pos(&mut self, n: usize) {
        self.pos = n.min(self.ctx);
        self.mtp_pos = 0;
        self.mtp_pending_pos = None;
    }

    /// Drop cached positions from `pos` on (prompt reuse keeps a prefix) and return the
    /// position the sequence now holds: `min(pos, self.pos)` while every part is positional
    /// (a part that cannot be cut would make it 0: feed from the returned position). The MTP
    /// head's slots depend on the positions after them, so they go back to `pos - 1`.
    pub fn truncate(&mut self, pos: usize) -> usize {
        if self.hybrid.is_recurrent() && pos < self.pos {
            // A recurrent part holds only the state after the last position: restart.
            self.reset();
            return 0;
        }
        if pos < self.pos {
            self.mtp_pending_pos = None;
        }
        self.pos = self.pos.min(pos);
        self.mtp_pos = self.mtp_pos.min(pos.saturating_sub(1));
        self.pos
    }

    /// Forget the sequence (the buffers stay allocated).
    pub fn reset(&mut self) {
        self.pos = 0;
        self.mtp_pos = 0;
        self.mtp_pending_pos = None;
    }

    /// A copy of positions `0..n` (at most `pos`) of every part.
    pub fn snapshot(&self, n: usize) -> Result<Snapshot, ModelError> {
        if self.hybrid.is_recurrent() && n != self.pos {
            return Err(ModelError::Input(format!(
                "snapshot of {n} positions: a recurrent state is only held at its current position {}",
                self.pos
            )));
        }
        if n > self.pos {
            return Err(ModelError::Input(format!(
                "snapshot of {n} positions, the state holds {}",
                self.pos
            )));
        }
        let data = self
            .parts()
            .map(|p| self.part_rows(p, n).map(<[u8]>::to_vec))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Snapshot {
            pos: n,
            mtp_pos: self.mtp_pos.min(n.saturating_sub(1)),
            data,
        })
    }

    /// Put a snapshot back: the state then holds exactly its positions (later ones are
    /// forgotten), as when it was taken.
    pub fn restore(&mut self, s: &Snapshot) -> Result<(), ModelError> {
        let parts: Vec<Part> = self.parts().collect();
        if parts.len() != s.data.len() {
            return Err(ModelError::Input(format!(
                "snapshot of {} parts, this state has {}",
                s.data.len(),
                parts.len()
            )));
        }
        for (p, d) in parts.into_iter().zip(&s.data) {
            let dst = self.part_rows_mut(p, s.pos)?;
            if dst.len() != d.len() {
                return Err(ModelError::Input(format!(
                    "snapshot part {p:?} holds {} bytes, the state wants {}",
                    d.len(),
                    dst.len()
                )));
            }
            dst.copy_from_slice(d);
        }
        self.pos = s.pos;
        self.mtp_pos = s.mtp_pos;
        self.mtp_pending_pos = None;
        Ok(())
    }

    /// Layers in the KV cache given the row widths (`cache_layers` when they are this state's).
    pub fn kv_layers(&self, dims: CacheDims) -> usize {
        if dims == self.cache_dims {
            self.cache_layers
        } else {
            0
        }
    }

    /// The cached keys (`n` rows of `dims.0` elements) and values (`dims.1`) of positions
    /// `0..n` of cache layer `layer`, as bytes of the cache's element types.
    pub fn kv_rows(
        &self,
        layer: usize,
        dims: CacheDims,
        n: usize,
    ) -> Result<(&[u8], &[u8]), ModelError> {
        let (k, v) = self.kv_parts(layer, dims);
        Ok((self.part_rows(k, n)?, self.part_rows(v, n)?))
    }

    /// Writable keys and values of positions `0..n` of `layer`; `set_pos(n)` afterwards.
    pub fn kv_rows_mut(
        &mut self,
        layer: usize,
        dims: CacheDims,
        n: usize,
    ) -> Result<(&mut [u8], &mut [u8]), ModelError> {
        let (k, v) = self.kv_parts(layer, dims);
        let (kr, vr) = (self.part_range(k, n)?, self.part_range(v, n)?);
        Ok((
            &mut self.kcache.bytes_mut()[kr],
            &mut self.vcache.bytes_mut()[vr],
        ))
    }

    fn kv_parts(&self, layer: usize, (kd, vd): CacheDims) -> (Part, Part) {
        let p = |kind, width, ty| Part {
            layer,
            kind,
            width,
            ty,
            per_position: true,
        };
        (
            p(PartKind::Keys, kd, self.kcache.ty()),
            p(PartKind::Values, vd, self.vcache.ty()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::ModelFiles;
    use crate::model::{LoadOptions, Model};

    fn tiny() -> ModelFiles {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-moe.gguf");
        ModelFiles::open(std::path::Path::new(path)).expect("tiny-moe fixture")
    }

    const TOKENS: [u32; 12] = [1, 7, 3, 9, 4, 4, 2, 11, 5, 8, 6, 10];

    /// Feed `TOKENS[from..]` one chunk at a time and return every logit row.
    fn feed_rest(m: &Model<'_>, st: &mut State, from: usize) -> Vec<f32> {
        let mut out = Vec::new();
        for &t in &TOKENS[from..] {
            out.extend_from_slice(m.forward_chunk(st, &[t], 0).unwrap());
        }
        out
    }

    #[test]
    fn snapshot_restore_and_truncate_resume_bit_identically() {
        let files = tiny();
        let m = Model::load(&files, &LoadOptions::default()).unwrap();
        let mut st = m.new_state(32, 4, 1).unwrap();
        let whole = feed_rest(&m, &mut st, 0);
        let v = m.cfg.vocab;

        // Snapshot at 5, run on, restore: the rest comes out as before.
        st.reset();
        let head = feed_rest(&m, &mut st, 0);
        assert_eq!(head, whole);
        let snap = st.snapshot(5).unwrap();
        assert_eq!(snap.pos(), 5);
        assert!(snap.bytes() > 0);
        st.restore(&snap).unwrap();
        assert_eq!(st.pos, 5);
        assert_eq!(feed_rest(&m, &mut st, 5), whole[5 * v..]);

        // Truncate keeps a prefix and says so.
        assert_eq!(st.truncate(7), 7);
        assert_eq!(st.truncate(100), 7);
        assert_eq!(feed_rest(&m, &mut st, 7), whole[7 * v..]);

        // A snapshot restored into a fresh state of the same shape.
        let mut fresh = m.new_state(32, 4, 1).unwrap();
        fresh.restore(&snap).unwrap();
        assert_eq!(feed_rest(&m, &mut fresh, 5), whole[5 * v..]);

        // Parts round trip through part_rows / part_rows_mut + set_pos.
        let mut other = m.new_state(32, 4, 1).unwrap();
        let parts: Vec<Part> = st.parts().collect();
        assert_eq!(parts.len(), 2 * st.cache_layers());
        for p in &parts {
            let rows = st.part_rows(*p, 6).unwrap().to_vec();
            other.part_rows_mut(*p, 6).unwrap().copy_from_slice(&rows);
        }
        other.set_pos(6);
        assert_eq!(feed_rest(&m, &mut other, 6), whole[6 * v..]);
    }

    #[test]
    fn mismatched_snapshots_and_parts_are_refused() {
        let files = tiny();
        let m = Model::load(&files, &LoadOptions::default()).unwrap();
        let mut st = m.new_state(16, 2, 1).unwrap();
        assert!(st.snapshot(1).is_err(), "nothing fed yet");
        m.forward_chunk(&mut st, &[1, 2], 1).unwrap();
        let snap = st.snapshot(2).unwrap();
        let mut small = m.new_state(1, 1, 1).unwrap();
        assert!(
            small.restore(&snap).is_err(),
            "2 positions into a 1-position state"
        );
        let mut p = st.parts().next().unwrap();
        p.width += 1;
        assert!(st.part_rows(p, 1).is_err());
    }
}
