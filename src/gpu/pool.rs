//! Which routed expert sits in which slot of the VRAM expert pool: the bookkeeping only, no
//! device calls (so it is tested on machines without a GPU).
//!
//! Owns: the per-layer slot maps, the pinned tier and the LRU order. Does not own: the device
//! memory (gpu/model.rs allocates one buffer of `slots * slot_bytes`) or the copies.
//! Invariants: a slot holds at most one expert and an expert at most one slot; a pinned
//! expert's slot is never given to another expert; a slot used by the current step of its
//! layer is never evicted in that step (`assign` says when one used by an earlier wave of the
//! same step is reused, so the caller can order the copy after that wave's compute).

/// Where `assign` put an expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Assigned {
    /// Global slot index.
    pub slot: usize,
    /// The expert that was evicted from the slot, if any.
    pub evicted: Option<usize>,
    /// The evicted expert was computed earlier in this same step (an earlier wave): its compute
    /// must finish before the slot is overwritten.
    pub reused_this_step: bool,
}

struct Layer {
    base: usize,
    /// Per expert: its slot within the layer.
    slot_of: Vec<Option<u32>>,
    /// Per slot: the expert it holds.
    owner: Vec<Option<usize>>,
    /// Per slot: reserved for this expert (pinned tier), loaded on first use.
    pinned_for: Vec<Option<usize>>,
    /// Per slot: clock of the last use (LRU order).
    last_use: Vec<u64>,
    /// Per slot: step stamp of the last use; equal to the layer's current step = in use.
    step_of: Vec<u64>,
    /// Per slot: wave stamp of the last use (slots of the open wave are never evicted).
    wave_of: Vec<u64>,
    /// Per expert: tokens routed to it lately (halved when the layer's sum passes
    /// `DECAY_AT`), for the frequency policy.
    count: Vec<u32>,
    count_sum: u64,
}

/// A layer's selection counts are halved when their sum passes this (a memory of the last
/// few thousand selections).
const DECAY_AT: u64 = 1 << 15;

pub struct VramPool {
    layers: Vec<Layer>,
    slot_bytes: u64,
    clock: u64,
    step: u64,
    wave: u64,
    pub hits: u64,
    pub misses: u64,
    /// Evict the slot whose expert was selected least lately (else the least recently used).
    pub frequency: bool,
}

impl VramPool {
    /// `slots_per_layer` slots for each of `experts_per_layer.len()` MoE layers; `pinned` lists
    /// (layer, expert) pairs to reserve slots for, at most half of a layer's slots each (the
    /// rest are ignored, most-wanted first, so the LRU tier keeps at least half).
    pub fn new(
        experts_per_layer: &[usize],
        slots_per_layer: usize,
        slot_bytes: u64,
        pinned: &[(usize, usize)],
    ) -> VramPool {
        let mut layers: Vec<Layer> = experts_per_layer
            .iter()
            .enumerate()
            .map(|(i, &e)| {
                let s = slots_per_layer.min(e);
                Layer {
                    base: i * slots_per_layer,
                    slot_of: vec![None; e],
                    owner: vec![None; s],
                    pinned_for: vec![None; s],
                    last_use: vec![0; s],
                    step_of: vec![0; s],
                    wave_of: vec![0; s],
                    count: vec![0; e],
                    count_sum: 0,
                }
            })
            .collect();
        for &(l, e) in pinned {
            let Some(ly) = layers.get_mut(l) else {
                continue;
            };
            let n_pinned = ly.pinned_for.iter().filter(|p| p.is_some()).count();
            if e >= ly.slot_of.len()
                || 2 * (n_pinned + 1) > ly.owner.len()
                || ly.pinned_for.contains(&Some(e))
            {
                continue;
            }
            if let Some(i) = ly.pinned_for.iter().position(|p| p.is_none()) {
                ly.pinned_for[i] = Some(e);
            }
        }
        VramPool {
            layers,
            slot_bytes,
            clock: 0,
            step: 0,
            wave: 0,
            hits: 0,
            misses: 0,
            frequency: false,
        }
    }

    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// Slots of MoE layer `l`.
    pub fn slots(&self, l: usize) -> usize {
        self.layers.get(l).map_or(0, |ly| ly.owner.len())
    }

    /// Slots reserved for pinned experts, all layers.
    pub fn n_pinned(&self) -> usize {
        self.layers
            .iter()
            .map(|ly| ly.pinned_for.iter().filter(|p| p.is_some()).count())
            .sum()
    }

    /// Whether a pinned-tier slot of layer `l` is kept for expert `e`.
    pub fn reserved(&self, l: usize, e: usize) -> bool {
        self.layers
            .get(l)
            .is_some_and(|ly| ly.pinned_for.contains(&Some(e)))
    }

    /// A new step of a layer's MoE (one forward of one layer): earlier uses are done.
    pub fn begin_step(&mut self) {
        self.step += 1;
        self.wave += 1;
    }

    /// A new wave within the step: the previous wave's slots may be reused (after its compute).
    pub fn begin_wave(&mut self) {
        self.wave += 1;
    }

    /// The global slots of every expert of layer `l`, if all of them are resident (then, with
    /// at least as many slots as experts, none is ever evicted again).
    pub fn all_resident(&self, l: usize) -> Option<Vec<usize>> {
        let ly = self.layers.get(l)?;
        if ly.owner.len() < ly.slot_of.len() {
            return None;
        }
        ly.slot_of
            .iter()
            .map(|s| s.map(|s| ly.base + s as usize))
            .collect()
    }

    /// Whether expert `e` of layer `l` is in the pool (no use is recorded).
    pub fn holds(&self, l: usize, e: usize) -> bool {
        self.layers
            .get(l)
            .is_some_and(|ly| ly.slot_of.get(e).is_some_and(Option::is_some))
    }

    /// Slots of MoE layer `l` that hold no expert and are not reserved for a pinned one (a
    /// hybrid layer stages misses into them before it computes any on the CPU).
    pub fn empty_slots(&self, l: usize) -> usize {
        self.layers.get(l).map_or(0, |ly| {
            (0..ly.owner.len())
                .filter(|&s| ly.owner[s].is_none() && ly.pinned_for[s].is_none())
                .count()
        })
    }

    /// Notes `tokens` selections of expert `e` of layer `l` (the frequency policy's figure).
    pub fn note(&mut self, l: usize, e: usize, tokens: usize) {
        let Some(ly) = self.layers.get_mut(l) else {
            return;
        };
        let Some(c) = ly.count.get_mut(e) else {
            return;
        };
        *c = c.saturating_add(tokens as u32);
        ly.count_sum += tokens as u64;
        if ly.count_sum > DECAY_AT {
            ly.count.iter_mut().for_each(|c| *c /= 2);
            ly.count_sum = ly.count.iter().map(|&c| c as u64).sum();
        }
    }

    /// Under the frequency policy, whether expert `e` of layer `l` (not resident) was
    /// selected clearly more lately than the expert `assign` would evict for it (twice as
    /// often, and by more than a few tokens): then it is worth copying in.
    pub fn worth_admitting(&self, l: usize, e: usize) -> bool {
        let Some(ly) = self.layers.get(l) else {
            return false;
        };
        if !self.frequency {
            return false;
        }
        let mine = ly.count.get(e).copied().unwrap_or(0);
        let victim = (0..ly.owner.len())
            .filter(|&s| ly.pinned_for[s].is_none() && ly.wave_of[s] != self.wave)
            .map(|s| ly.owner[s].map_or(0, |o| ly.count[o]))
            .min();
        victim.is_some_and(|v| mine > 2 * v + 4)
    }

    /// Counts `n` selections served from the pool without a lookup (device-built job lists).
    pub fn count_hits(&mut self, n: u64) {
        self.hits += n;
    }

    /// The slot holding expert `e` of layer `l`, marking it used now.
    pub fn lookup(&mut self, l: usize, e: usize) -> Option<usize> {
        let ly = self.layers.get_mut(l)?;
        let s = (*ly.slot_of.get(e)?)? as usize;
        self.clock += 1;
        ly.last_use[s] = self.clock;
        ly.step_of[s] = self.step;
        ly.wave_of[s] = self.wave;
        self.hits += 1;
        Some(ly.base + s)
    }

    /// Slots a wave of misses in layer `l` may fill: slots not used by the open wave and not
    /// reserved for another expert (pinned slots for experts in `misses` count).
    pub fn free_for_wave(&self, l: usize) -> usize {
        self.layers.get(l).map_or(0, |ly| {
            (0..ly.owner.len())
                .filter(|&s| ly.wave_of[s] != self.wave && ly.pinned_for[s].is_none())
                .count()
        })
    }

    /// A slot for expert `e` of layer `l` (not resident): its pinned slot, else a free slot,
    /// else the least recently used slot not used by the open wave. `None` if every slot is
    /// busy in this wave or reserved.
    pub fn assign(&mut self, l: usize, e: usize) -> Option<Assigned> {
        let (step, wave) = (self.step, self.wave);
        let ly = self.layers.get_mut(l)?;
        if ly.slot_of.get(e).copied().flatten().is_some() {
            return None;
        }
        let pinned = ly.pinned_for.iter().position(|p| *p == Some(e));
        let s = match pinned {
            Some(s) => s,
            None => {
                let freq = self.frequency;
                let count = |s: usize| match (freq, ly.owner[s]) {
                    (true, Some(o)) => ly.count[o],
                    _ => 0,
                };
                (0..ly.owner.len())
                    .filter(|&s| ly.pinned_for[s].is_none() && ly.wave_of[s] != wave)
                    .min_by_key(|&s| (ly.owner[s].is_some(), count(s), ly.last_use[s]))?
            }
        };
        let evicted = ly.owner[s];
        let reused_this_step = evicted.is_some() && ly.step_of[s] == step;
        if let Some(old) = evicted {
            ly.slot_of[old] = None;
        }
        ly.owner[s] = Some(e);
        ly.slot_of[e] = Some(s as u32);
        self.clock += 1;
        ly.last_use[s] = self.clock;
        ly.step_of[s] = step;
        ly.wave_of[s] = wave;
        self.misses += 1;
        Some(Assigned {
            slot: ly.base + s,
            evicted,
            reused_this_step,
        })
    }

    /// Forget expert `e` of layer `l` (its copy failed): the slot holds garbage.
    pub fn drop_expert(&mut self, l: usize, e: usize) {
        if let Some(ly) = self.layers.get_mut(l) {
            if let Some(Some(s)) = ly.slot_of.get(e).copied() {
                ly.owner[s as usize] = None;
                ly.slot_of[e] = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn all_resident_only_when_every_expert_has_a_slot() {
        let mut p = VramPool::new(&[3], 3, 1, &[]);
        assert_eq!(p.all_resident(0), None);
        for e in 0..3 {
            p.begin_step();
            assert!(p.assign(0, e).is_some());
        }
        let slots = p.all_resident(0).unwrap();
        assert_eq!(slots.len(), 3);
        let mut sorted = slots.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 3);
        // Fewer slots than experts: never all resident.
        let q = VramPool::new(&[4], 2, 1, &[]);
        assert_eq!(q.all_resident(0), None);
    }

    use super::*;

    #[test]
    fn lru_evicts_oldest_and_never_the_open_wave() {
        let mut p = VramPool::new(&[8], 2, 1024, &[]);
        p.begin_step();
        let a = p.assign(0, 1).unwrap();
        let b = p.assign(0, 2).unwrap();
        assert_ne!(a.slot, b.slot);
        assert_eq!(a.evicted, None);
        // Both slots belong to the open wave: no third expert fits in it.
        assert!(p.assign(0, 3).is_none());
        assert_eq!(p.free_for_wave(0), 0);
        p.begin_wave();
        // Next wave of the same step: the oldest (expert 1) goes, and the caller is told that
        // its compute from this step must finish first.
        let c = p.assign(0, 3).unwrap();
        assert_eq!(c.slot, a.slot);
        assert_eq!(c.evicted, Some(1));
        assert!(c.reused_this_step);
        assert_eq!(p.lookup(0, 1), None);
        p.begin_step();
        assert_eq!(p.lookup(0, 2), Some(b.slot));
        let d = p.assign(0, 4).unwrap();
        assert_eq!(d.slot, a.slot, "expert 3 is older than the just-used 2");
        assert!(!d.reused_this_step);
    }

    #[test]
    fn frequency_policy_evicts_the_least_selected_and_admits_the_clearly_more_selected() {
        let mut p = VramPool::new(&[8], 2, 1024, &[]);
        p.frequency = true;
        p.begin_step();
        p.note(0, 1, 50);
        p.note(0, 2, 3);
        let a = p.assign(0, 1).unwrap();
        let b = p.assign(0, 2).unwrap();
        p.begin_step();
        // Expert 1 was used longer ago but selected far more: expert 2's slot goes.
        assert_eq!(p.lookup(0, 2), Some(b.slot));
        p.begin_wave();
        p.note(0, 3, 5);
        assert!(!p.worth_admitting(0, 3), "5 is not more than 2 x 3 + 4");
        p.note(0, 3, 10);
        assert!(p.worth_admitting(0, 3));
        let c = p.assign(0, 3).unwrap();
        assert_eq!((c.slot, c.evicted), (b.slot, Some(2)));
        assert_ne!(c.slot, a.slot);
        // Counts decay: a layer's sum never passes DECAY_AT by much.
        for _ in 0..100 {
            p.note(0, 4, 1000);
        }
        assert!(p.layers[0].count_sum <= DECAY_AT + 1000);
    }

    #[test]
    fn pinned_slots_are_kept_for_their_expert_and_at_most_half() {
        let mut p = VramPool::new(&[16, 16], 4, 1024, &[(0, 5), (0, 6), (0, 7), (1, 9)]);
        assert_eq!(
            p.n_pinned(),
            3,
            "layer 0 keeps 2 of 4 slots for the LRU tier"
        );
        p.begin_step();
        for e in 0..10 {
            if e != 5 && e != 6 {
                p.begin_wave();
                let a = p.assign(0, e).unwrap();
                assert!(a.evicted != Some(5) && a.evicted != Some(6));
            }
        }
        p.begin_wave();
        let s5 = p.assign(0, 5).unwrap();
        assert_eq!(s5.evicted, None);
        p.begin_step();
        assert_eq!(p.lookup(0, 5), Some(s5.slot));
        // Layer 1's slots are separate.
        assert!(p.assign(1, 9).unwrap().slot >= 4);
    }
}
