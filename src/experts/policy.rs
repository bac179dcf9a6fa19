//! Eviction choices for the evictable tier, shared by `ExpertCache` and the trace simulator so
//! `cache-sim` numbers are what the cache does, not an approximation of it.
//!
//! Owns: `Policy` (the choice, parsed from `--policy`), `SlotMeta` (what a slot holds, when
//! it was last used, whether it is busy), decayed hotness counts, and `victim`. Invariant: a busy slot (handed out in the open wave, or being
//! read) is never chosen; an empty slot is always chosen before an occupied one; ties fall to
//! the least recently used, then to the lowest slot index (deterministic).

/// Eviction policy of the evictable tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Least recently used (one use-clock tick per request).
    Lru,
    /// Coldest first: +1 per selection, every count halved each `halve_every` tokens; ties go
    /// to the least recently used.
    Hotness { halve_every: u64 },
}

impl Policy {
    /// `lru` or `hotness` (which then halves every `halve_every` tokens).
    pub fn parse(name: &str, halve_every: u64) -> Result<Policy, String> {
        match name {
            "lru" => Ok(Policy::Lru),
            "hotness" => Ok(Policy::Hotness { halve_every }),
            _ => Err(format!(
                "unknown cache policy `{name}` (expected lru or hotness)"
            )),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::Hotness { .. } => "hotness",
        }
    }
}

/// `SlotMeta::expert` of a slot holding nothing.
pub(crate) const EMPTY: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
pub(crate) struct SlotMeta {
    pub expert: u32,
    /// Use clock (one tick per request) of the last request that named this slot's expert.
    pub last_use: u64,
    pub busy: bool,
}

impl Default for SlotMeta {
    fn default() -> SlotMeta {
        SlotMeta {
            expert: EMPTY,
            last_use: 0,
            busy: false,
        }
    }
}

/// Per (layer, expert) selection counts, halved every `halve_every` tokens. Halving is lazy:
/// a count carries the epoch it was last brought up to date in, and `count >> (epoch - stamp)`
/// equals halving (rounding down) once per epoch passed.
#[derive(Clone, Debug)]
pub(crate) struct Hotness {
    halve_every: u64,
    tokens: u64,
    epoch: u32,
    layer_base: Vec<usize>,
    counts: Vec<u32>,
    stamp: Vec<u32>,
}

impl Hotness {
    /// `halve_every == 0` never halves.
    pub fn new(experts_per_layer: &[usize], halve_every: u64) -> Hotness {
        let mut layer_base = Vec::with_capacity(experts_per_layer.len());
        let mut n = 0;
        for &e in experts_per_layer {
            layer_base.push(n);
            n += e;
        }
        Hotness {
            halve_every,
            tokens: 0,
            epoch: 0,
            layer_base,
            counts: vec![0; n],
            stamp: vec![0; n],
        }
    }

    fn index(&self, layer: usize, expert: usize) -> Option<usize> {
        self.layer_base
            .get(layer)
            .map(|b| b + expert)
            .filter(|&i| i < self.counts.len())
    }

    fn current(&self, i: usize) -> u32 {
        let passed = self.epoch - self.stamp[i];
        self.counts[i].checked_shr(passed).unwrap_or(0)
    }

    pub fn record(&mut self, layer: usize, expert: usize) {
        if let Some(i) = self.index(layer, expert) {
            self.counts[i] = self.current(i).saturating_add(1);
            self.stamp[i] = self.epoch;
        }
    }

    pub fn score(&self, layer: usize, expert: usize) -> u32 {
        self.index(layer, expert).map_or(0, |i| self.current(i))
    }

    /// One decoded token passed.
    pub fn tick(&mut self) {
        self.tokens += 1;
        if self.halve_every > 0 && self.tokens.is_multiple_of(self.halve_every) {
            self.epoch += 1;
        }
    }
}

/// The slot to evict in `layer` for a miss, or `None` when every slot is busy.
pub(crate) fn victim(
    policy: Policy,
    slots: &[SlotMeta],
    hot: &Hotness,
    layer: usize,
) -> Option<usize> {
    let mut best: Option<(usize, (u32, u64))> = None;
    for (i, s) in slots.iter().enumerate() {
        if s.busy {
            continue;
        }
        if s.expert == EMPTY {
            return Some(i);
        }
        let key = match policy {
            Policy::Lru => (0, s.last_use),
            Policy::Hotness { .. } => (hot.score(layer, s.expert as usize), s.last_use),
        };
        if best.is_none_or(|(_, k)| key < k) {
            best = Some((i, key));
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lazy_halving_equals_eager() {
        let mut h = Hotness::new(&[4], 3);
        let mut eager = [0u32; 4];
        let mut x = 12345u64;
        for t in 0..200 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let e = (x >> 60) as usize % 4;
            h.record(0, e);
            eager[e] += 1;
            h.tick();
            if (t + 1) % 3 == 0 {
                eager.iter_mut().for_each(|c| *c /= 2);
            }
            for (i, &c) in eager.iter().enumerate() {
                assert_eq!(h.score(0, i), c, "token {t} expert {i}");
            }
        }
    }

    #[test]
    fn victim_skips_busy_prefers_empty() {
        let hot = Hotness::new(&[8], 0);
        let s = |expert, last_use, busy| SlotMeta {
            expert,
            last_use,
            busy,
        };
        let slots = [s(1, 1, true), s(2, 5, false), s(3, 2, false)];
        assert_eq!(victim(Policy::Lru, &slots, &hot, 0), Some(2));
        let slots = [s(1, 1, false), s(EMPTY, 0, false)];
        assert_eq!(victim(Policy::Lru, &slots, &hot, 0), Some(1));
        let slots = [s(1, 1, true)];
        assert_eq!(victim(Policy::Lru, &slots, &hot, 0), None);
    }
}
