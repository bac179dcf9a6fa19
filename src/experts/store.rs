//! Addressing routed experts in the model's own files.
//!
//! Owns: `ExpertStore` (paths + per-(layer, expert) byte ranges of gate, up and down) and the
//! read plan of every expert: which aligned file windows to read and where in a cache slot each
//! part's bytes land. Does not read anything (that is `io.rs`).
//! Invariant: a plan's windows are `ALIGN`-aligned in the file and in the slot, never overlap in
//! the slot, and together cover every byte of the expert's three ranges; `slot_bytes()` is at
//! least every plan's total, so any expert fits any slot.

use std::path::{Path, PathBuf};

use super::{align_down, align_up, ExpertError};
use crate::format::ByteRange;

/// Names of the three parts, in `ExpertLoc::parts` order.
pub const PART_NAMES: [&str; 3] = ["gate", "up", "down"];

/// Where one expert's three projections lie: `parts = [gate, up, down]`, each an absolute range
/// in one of the store's files (in GGUF files usually three different 3-D tensors).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertLoc {
    pub parts: [ByteRange; 3],
}

/// One read of an expert: file window `[aligned_off, aligned_end)` lands at `slot_off` in the
/// slot; within it, `[data_off, data_end)` is what the expert's parts need.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlannedRead {
    pub file: usize,
    pub aligned_off: u64,
    pub aligned_end: u64,
    pub data_off: u64,
    pub data_end: u64,
    pub slot_off: u64,
}

/// How one expert is read into a slot and where its parts are found afterwards.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExpertPlan {
    reads: [PlannedRead; 3],
    n_reads: usize,
    /// (offset in the slot, length) of gate, up, down.
    parts: [(u64, u64); 3],
    /// Bytes of slot the plan occupies (sum of the aligned windows).
    slot_len: u64,
}

impl ExpertPlan {
    fn new(loc: &ExpertLoc) -> ExpertPlan {
        // Parts sorted by (file, offset) so neighbours in a file share one read.
        let mut order = [0usize, 1, 2];
        order.sort_by_key(|&i| (loc.parts[i].file, loc.parts[i].offset));
        let mut plan = ExpertPlan::default();
        let mut read_of = [usize::MAX; 3];
        for &i in &order {
            let p = loc.parts[i];
            if p.len == 0 {
                continue;
            }
            let (start, end) = (p.offset, p.offset + p.len);
            let (a_start, a_end) = (align_down(start), align_up(end));
            if plan.n_reads > 0 {
                let last = &mut plan.reads[plan.n_reads - 1];
                if last.file == p.file && a_start <= last.aligned_end {
                    last.aligned_end = last.aligned_end.max(a_end);
                    last.data_end = last.data_end.max(end);
                    read_of[i] = plan.n_reads - 1;
                    continue;
                }
            }
            plan.reads[plan.n_reads] = PlannedRead {
                file: p.file,
                aligned_off: a_start,
                aligned_end: a_end,
                data_off: start,
                data_end: end,
                slot_off: 0,
            };
            read_of[i] = plan.n_reads;
            plan.n_reads += 1;
        }
        let mut at = 0;
        for r in plan.reads[..plan.n_reads].iter_mut() {
            r.slot_off = at;
            at += r.aligned_end - r.aligned_off;
        }
        plan.slot_len = at;
        for (i, &ri) in read_of.iter().enumerate() {
            let p = loc.parts[i];
            plan.parts[i] = match plan.reads.get(ri) {
                Some(r) => (r.slot_off + (p.offset - r.aligned_off), p.len),
                None => (0, 0),
            };
        }
        plan
    }

    /// The reads that fill a slot with this expert.
    pub fn reads(&self) -> &[PlannedRead] {
        &self.reads[..self.n_reads]
    }

    /// (offset in the slot, length) of gate, up and down.
    pub fn parts(&self) -> &[(u64, u64); 3] {
        &self.parts
    }

    /// Slot bytes the plan fills (aligned windows included).
    pub fn slot_len(&self) -> u64 {
        self.slot_len
    }
}

/// The routed experts of a model: their files and where each expert's bytes are.
#[derive(Debug)]
pub struct ExpertStore {
    paths: Vec<PathBuf>,
    locs: Vec<Vec<ExpertLoc>>,
    plans: Vec<Vec<ExpertPlan>>,
    slot_bytes: u64,
}

impl ExpertStore {
    /// `experts[layer][e]` locates expert `e` of layer `layer` (a layer may have none: dense
    /// layers). Ranges index `paths` by `ByteRange::file` and use absolute offsets.
    pub fn new(
        paths: Vec<PathBuf>,
        experts: Vec<Vec<ExpertLoc>>,
    ) -> Result<ExpertStore, ExpertError> {
        let mut plans = Vec::with_capacity(experts.len());
        let mut slot_bytes = 0;
        for (l, layer) in experts.iter().enumerate() {
            let mut lp = Vec::with_capacity(layer.len());
            for (e, loc) in layer.iter().enumerate() {
                for (part, r) in PART_NAMES.iter().zip(&loc.parts) {
                    let bad = |msg: String| ExpertError::BadRange {
                        layer: l,
                        expert: e,
                        part,
                        msg,
                    };
                    if r.file >= paths.len() {
                        return Err(bad(format!(
                            "file index {} out of range ({} files)",
                            r.file,
                            paths.len()
                        )));
                    }
                    // Keep offsets far from u64::MAX so alignment arithmetic cannot overflow.
                    if r.offset
                        .checked_add(r.len)
                        .is_none_or(|end| end > u64::MAX / 2)
                    {
                        return Err(bad(format!("range [{}, +{}) overflows", r.offset, r.len)));
                    }
                }
                let plan = ExpertPlan::new(loc);
                slot_bytes = slot_bytes.max(plan.slot_len);
                lp.push(plan);
            }
            plans.push(lp);
        }
        Ok(ExpertStore {
            paths,
            locs: experts,
            plans,
            slot_bytes,
        })
    }

    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    pub fn n_layers(&self) -> usize {
        self.locs.len()
    }

    /// Experts in `layer` (0 for a dense layer or a layer out of range).
    pub fn n_experts(&self, layer: usize) -> usize {
        self.locs.get(layer).map_or(0, Vec::len)
    }

    pub fn loc(&self, layer: usize, expert: usize) -> Option<&ExpertLoc> {
        self.locs.get(layer)?.get(expert)
    }

    pub fn plan(&self, layer: usize, expert: usize) -> Option<&ExpertPlan> {
        self.plans.get(layer)?.get(expert)
    }

    /// Bytes of one cache slot: the widest expert's three ranges, each widened to `ALIGN` at
    /// both ends (what O_DIRECT reads), so every expert fits every slot. A multiple of `ALIGN`.
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// The expert's own bytes (gate + up + down, no alignment slack).
    pub fn expert_bytes(&self, layer: usize, expert: usize) -> u64 {
        self.loc(layer, expert)
            .map_or(0, |l| l.parts.iter().map(|p| p.len).sum())
    }

    /// Layers that have routed experts.
    pub fn moe_layers(&self) -> usize {
        self.locs.iter().filter(|l| !l.is_empty()).count()
    }

    /// Evictable slots per MoE layer that a byte budget for slot memory affords after
    /// `n_pinned` pinned slots (0 when the budget does not cover the pins plus one per layer).
    pub fn slots_per_layer_for_budget(&self, budget_bytes: u64, n_pinned: usize) -> usize {
        if self.slot_bytes == 0 || self.moe_layers() == 0 {
            return 0;
        }
        let slots = (budget_bytes / self.slot_bytes) as usize;
        slots.saturating_sub(n_pinned) / self.moe_layers()
    }

    /// Checks every range against the current size of its file.
    pub fn check_files(&self) -> Result<(), ExpertError> {
        let mut sizes = Vec::with_capacity(self.paths.len());
        for p in &self.paths {
            sizes.push(file_size(p)?);
        }
        for (l, layer) in self.locs.iter().enumerate() {
            for (e, loc) in layer.iter().enumerate() {
                for (part, r) in PART_NAMES.iter().zip(&loc.parts) {
                    let size = sizes.get(r.file).copied().unwrap_or(0);
                    if r.offset + r.len > size {
                        return Err(ExpertError::BadRange {
                            layer: l,
                            expert: e,
                            part,
                            msg: format!(
                                "range [{}, +{}) lies past the end of {} ({size} bytes)",
                                r.offset,
                                r.len,
                                self.paths[r.file].display()
                            ),
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

pub(crate) fn file_size(p: &Path) -> Result<u64, ExpertError> {
    std::fs::metadata(p)
        .map(|m| m.len())
        .map_err(|e| ExpertError::io(p, "stat", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(file: usize, offset: u64, len: u64) -> ByteRange {
        ByteRange { file, offset, len }
    }

    #[test]
    fn plan_separate_tensors() {
        let loc = ExpertLoc {
            parts: [r(0, 100, 5000), r(0, 1_000_000, 10), r(1, 8192, 4096)],
        };
        let p = ExpertPlan::new(&loc);
        assert_eq!(p.reads().len(), 3);
        // gate: [0, 8192) window of 2 pages, starts 100 in; up: one page; down exactly one page.
        assert_eq!(p.parts()[0], (100, 5000));
        assert_eq!(p.parts()[1], (8192 + 1_000_000 % 4096, 10));
        assert_eq!(p.parts()[2], (8192 + 4096, 4096));
        assert_eq!(p.slot_len(), 4 * 4096);
    }

    #[test]
    fn plan_merges_neighbours_in_file_order() {
        // HF per-expert tensors: w1 (gate), w2 (down), w3 (up) back to back.
        let loc = ExpertLoc {
            parts: [r(0, 10, 3000), r(0, 6010, 3000), r(0, 3010, 3000)],
        };
        let p = ExpertPlan::new(&loc);
        assert_eq!(p.reads().len(), 1);
        assert_eq!(p.parts()[0], (10, 3000));
        assert_eq!(p.parts()[1], (6010, 3000));
        assert_eq!(p.parts()[2], (3010, 3000));
        assert_eq!(p.slot_len(), 12288);
    }

    #[test]
    fn bad_file_index() {
        let loc = ExpertLoc {
            parts: [r(0, 0, 1), r(2, 0, 1), r(0, 0, 1)],
        };
        let e = ExpertStore::new(vec![PathBuf::from("a")], vec![vec![loc]]).unwrap_err();
        assert!(
            e.to_string()
                .contains("expert 0 of layer 0, up: file index 2"),
            "{e}"
        );
    }
}
