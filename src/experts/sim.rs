//! Replaying a route trace against eviction policies without running a model.
//!
//! Owns `simulate`: per-layer slots exactly like `ExpertCache` (same capacity clamp, same
//! pinned tier, same victim choice from `policy.rs` for LRU and hotness), plus Belady's optimal
//! choice (evict the expert whose next request is farthest away) as the bound to judge against.
//! Invariant: for LRU and hotness the hit/miss counts equal what `ExpertCache` with the same
//! configuration reports for the requests the trace records.

use super::policy::Policy;
use super::policy::{self, Hotness, SlotMeta, EMPTY};
use super::{ExpertError, Trace};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimPolicy {
    Lru,
    Hotness {
        halve_every: u64,
    },
    /// Farthest next use first (optimal for this request sequence; needs the future).
    Belady,
}

impl SimPolicy {
    pub fn name(&self) -> &'static str {
        match self {
            SimPolicy::Lru => "lru",
            SimPolicy::Hotness { .. } => "hotness",
            SimPolicy::Belady => "belady",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimResult {
    pub policy: SimPolicy,
    pub hits_pin: u64,
    /// Hits in the evictable tier.
    pub hits: u64,
    pub misses: u64,
}

impl SimResult {
    pub fn requests(&self) -> u64 {
        self.hits_pin + self.hits + self.misses
    }

    pub fn hit_rate(&self) -> f64 {
        let r = self.requests();
        if r == 0 {
            0.0
        } else {
            (self.hits_pin + self.hits) as f64 / r as f64
        }
    }
}

/// Replays `trace` with `slots_per_layer` evictable slots per layer and `pinned` held.
pub fn simulate(
    trace: &Trace,
    slots_per_layer: usize,
    pinned: &[(usize, usize)],
    policy: SimPolicy,
) -> Result<SimResult, ExpertError> {
    simulate_from(trace, slots_per_layer, pinned, policy, 0)
}

/// `simulate`, counting hits and misses only from line `from` on (the lines before it still
/// fill the cache: e.g. a prompt's requests before the decoded tokens').
pub fn simulate_from(
    trace: &Trace,
    slots_per_layer: usize,
    pinned: &[(usize, usize)],
    policy: SimPolicy,
    from: usize,
) -> Result<SimResult, ExpertError> {
    let epl = &trace.experts_per_layer;
    let n_layers = epl.len();
    for (i, line) in trace.lines.iter().enumerate() {
        let n = epl.get(line.layer).copied().unwrap_or(0);
        if line.layer >= n_layers || line.experts.iter().any(|&e| e >= n) {
            return Err(ExpertError::Request(format!(
                "trace request {}: layer or expert out of range",
                i + 1
            )));
        }
    }
    // Where each expert is: NONE, PINNED, or its slot index in its layer.
    const NONE: u32 = u32::MAX;
    const PINNED: u32 = u32::MAX - 1;
    let mut place: Vec<Vec<u32>> = epl.iter().map(|&n| vec![NONE; n]).collect();
    let mut pinned_in = vec![0usize; n_layers];
    for &(l, e) in pinned {
        let p = place.get_mut(l).and_then(|p| p.get_mut(e)).ok_or_else(|| {
            ExpertError::Config(format!("pinned expert {e} of layer {l} does not exist"))
        })?;
        if *p == PINNED {
            return Err(ExpertError::Config(format!(
                "expert {e} of layer {l} is pinned twice"
            )));
        }
        *p = PINNED;
        pinned_in[l] += 1;
    }
    let mut slots: Vec<Vec<SlotMeta>> = (0..n_layers)
        .map(|l| vec![SlotMeta::default(); slots_per_layer.min(epl[l] - pinned_in[l])])
        .collect();
    let (cache_policy, halve) = match policy {
        SimPolicy::Hotness { halve_every } => (Policy::Hotness { halve_every }, halve_every),
        _ => (Policy::Lru, 0),
    };
    if let SimPolicy::Hotness { halve_every: 0 } = policy {
        return Err(ExpertError::Config(
            "hotness policy needs halve_every >= 1 token".into(),
        ));
    }
    let mut hot = Hotness::new(epl, halve);
    // Belady: next request index (per line, per named expert) of the same expert in the same
    // layer; u64::MAX when never again. `next_of[slot]` lives in SlotMeta::last_use.
    let next_use = if policy == SimPolicy::Belady {
        next_uses(trace)
    } else {
        Vec::new()
    };

    let mut r = SimResult {
        policy,
        hits_pin: 0,
        hits: 0,
        misses: 0,
    };
    let mut ticks = 0u64;
    let mut flat = 0usize;
    // Counts of the lines before `from` are dropped at the end.
    let mut before = r;
    for (clock, line) in trace.lines.iter().enumerate() {
        if clock == from {
            before = r;
        }
        let clock = clock as u64 + 1;
        while ticks < line.token {
            hot.tick();
            ticks += 1;
        }
        let l = line.layer;
        let unpinned = line
            .experts
            .iter()
            .filter(|&&e| place[l][e] != PINNED)
            .count();
        if unpinned > slots[l].len() {
            return Err(ExpertError::Request(format!(
                "trace request {clock} (token {}, layer {l}): {unpinned} unpinned experts, {} slots",
                line.token,
                slots[l].len()
            )));
        }
        let stamp = |j: usize| {
            if policy == SimPolicy::Belady {
                next_use[flat + j]
            } else {
                clock
            }
        };
        for (j, &e) in line.experts.iter().enumerate() {
            if matches!(policy, SimPolicy::Hotness { .. }) {
                hot.record(l, e);
            }
            match place[l][e] {
                PINNED => r.hits_pin += 1,
                NONE => {}
                s => {
                    r.hits += 1;
                    let m = &mut slots[l][s as usize];
                    m.busy = true;
                    m.last_use = stamp(j);
                }
            }
        }
        for (j, &e) in line.experts.iter().enumerate() {
            if place[l][e] != NONE {
                continue;
            }
            r.misses += 1;
            let v = match policy {
                SimPolicy::Belady => belady_victim(&slots[l]),
                _ => policy::victim(cache_policy, &slots[l], &hot, l),
            };
            let Some(v) = v else {
                return Err(ExpertError::Request(format!(
                    "trace request {clock}: no free slot in layer {l}"
                )));
            };
            let old = slots[l][v].expert;
            if old != EMPTY {
                place[l][old as usize] = NONE;
            }
            slots[l][v] = SlotMeta {
                expert: e as u32,
                last_use: stamp(j),
                busy: true,
            };
            place[l][e] = v as u32;
        }
        for m in slots[l].iter_mut() {
            m.busy = false;
        }
        flat += line.experts.len();
    }
    if from >= trace.lines.len() {
        before = r;
    }
    Ok(SimResult {
        hits_pin: r.hits_pin - before.hits_pin,
        hits: r.hits - before.hits,
        misses: r.misses - before.misses,
        ..r
    })
}

/// Belady's choice: an empty slot, else the one whose expert is needed farthest in the future
/// (`last_use` holds the next-use index), ties to the lowest slot.
fn belady_victim(slots: &[SlotMeta]) -> Option<usize> {
    let mut best: Option<(usize, u64)> = None;
    for (i, s) in slots.iter().enumerate() {
        if s.busy {
            continue;
        }
        if s.expert == EMPTY {
            return Some(i);
        }
        if best.is_none_or(|(_, n)| s.last_use > n) {
            best = Some((i, s.last_use));
        }
    }
    best.map(|(i, _)| i)
}

/// For each named expert of each line (flattened in order), the index of the next line of the
/// same layer that names it again, or u64::MAX.
fn next_uses(trace: &Trace) -> Vec<u64> {
    let total: usize = trace.lines.iter().map(|l| l.experts.len()).sum();
    let mut out = vec![u64::MAX; total];
    let mut later: Vec<Vec<u64>> = trace
        .experts_per_layer
        .iter()
        .map(|&n| vec![u64::MAX; n])
        .collect();
    let mut flat = total;
    for (i, line) in trace.lines.iter().enumerate().rev() {
        flat -= line.experts.len();
        for (j, &e) in line.experts.iter().enumerate() {
            out[flat + j] = later[line.layer][e];
            later[line.layer][e] = i as u64;
        }
    }
    out
}
