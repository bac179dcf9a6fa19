//! How many sequence slots pay (`serve --parallel`, issue 19 "batch size follows the
//! bottleneck"): where experts stream and decode waits on the disk, a batched step reads the
//! *union* of its rows' experts, and a sequence slot more can cost more disk per generated
//! token than it saves. This file predicts, for each slot count `n`, the expert bytes read
//! from disk per generated token, and picks the fewest slots within `TOLERANCE` of the best.
//!
//! The cost model, per MoE layer and batched step of `n` decoding rows (one per sequence):
//! - the step needs `U(n) = expert_union(E, k, n)` distinct experts (sequences route
//!   independently: measured 27.7 of 32 for 4 greedy sequences of the synth Qwen3-30B shape,
//!   the formula gives 29.1);
//! - a sequence's token reuses a share `r` of its previous token's experts (`reuse`); those
//!   are still cached when the cache's `C` slots per layer hold the previous step's union, else
//!   only a share `C / U(n)` of them; the cache's other `C - U(n)` slots hold that many of
//!   the `E - U(n)` other experts for the rest (uniform routing):
//!   `hit = r min(1, C/U) + (1 - r) max(0, C - U) / (E - U)`;
//! - expert bytes from disk per generated token `= (1 - hit) U(n) L slot / n` (the union is
//!   read once for all the step's rows).
//!
//! More slots share each expert read between more rows (the `/ n`), but a wider union evicts
//! each sequence's own recent experts (the `C / U(n)`): with one cache slot per layer the first
//! wins, with a cache near the step's union the second (measured on the 4-layer synth
//! Qwen3-30B-A3B, 4 clients: 27 -> 34 MB per token from 1 to 4 slots at 32 slots a layer, 51
//! -> 81 MB at 8; docs/PERFORMANCE.md "Batch size against expert reads").
//! Only the disk term is modelled: the dense weights a step reads once for all rows would
//! favour more slots on a memory-bound machine, but on a compute-bound one (the 2-core box:
//! a 4-row step costs nearly 4 one-row steps) they do not, so they are left out; where decode
//! is memory-bound rather than disk-bound, this cap is not applied (engine/placement.rs).
//!
//! Owns: the per-slot cost model and the cap decision. Does not own: the memory cap on KV
//! caches and when the cap applies (engine/placement.rs), the batched step (engine/batch.rs).
//! Invariant: the cap only lowers the automatic count; `--parallel N` is never changed, and
//! the reason names the figures that drove the decision.

use super::planner::{expert_union, human};

/// More slots are taken only while they read at least this share fewer expert bytes per
/// generated token than the fewest slots within it of the best.
pub const TOLERANCE: f64 = 0.02;

/// Share of a token's routed experts that its sequence's previous token also picked, when
/// nothing better is known. Measured 6.2 of 8 (0.78) on greedy decoding of the synth
/// Qwen3-30B-A3B-shaped file (`--route-trace`, docs/PERFORMANCE.md "Continuous batching");
/// trained models' consecutive tokens share fewer, so a middle value.
pub const DEFAULT_REUSE: f64 = 0.5;

/// What the slot cost model is given.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotInputs {
    pub moe_layers: usize,
    /// Routed experts per MoE layer (E) and picked per token (k).
    pub experts_per_layer: usize,
    pub top_k: usize,
    /// Bytes of one expert in one layer (a cache slot).
    pub slot_bytes: u64,
    /// Expert cache slots per MoE layer (evictable + pinned / layers) when `n` sequence slots
    /// run: entry `n - 1`. Its length is the most slots considered (more KV caches leave less
    /// for the expert cache).
    pub cache_per_layer: Vec<f64>,
    /// See `DEFAULT_REUSE`.
    pub reuse: f64,
}

/// The predicted cost of running `n` sequence slots.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotCost {
    pub n: usize,
    /// Expected distinct experts a step reads per MoE layer.
    pub union_per_layer: f64,
    /// Expert cache slots per layer at this `n`.
    pub cache_per_layer: f64,
    pub hit: f64,
    /// Expert bytes read from disk per generated token.
    pub disk_bytes_per_token: f64,
}

/// The cost of each slot count `1..=inputs.cache_per_layer.len()`.
pub fn slot_costs(s: &SlotInputs) -> Vec<SlotCost> {
    let (e, k, l) = (
        s.experts_per_layer,
        s.top_k.min(s.experts_per_layer),
        s.moe_layers as f64,
    );
    let slot = s.slot_bytes as f64;
    let r = s.reuse.clamp(0.0, 1.0);
    s.cache_per_layer
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let n = i + 1;
            let u = expert_union(e, k, n);
            let c = c.clamp(0.0, e as f64);
            let hit = if u <= 0.0 {
                1.0
            } else {
                let own = r * (c / u).min(1.0);
                let others = (e as f64 - u).max(1e-9);
                let rest = (1.0 - r) * ((c - u).max(0.0) / others).min(1.0);
                (own + rest).min(1.0)
            };
            SlotCost {
                n,
                union_per_layer: u,
                cache_per_layer: c,
                hit,
                disk_bytes_per_token: (1.0 - hit) * u * l * slot / n as f64,
            }
        })
        .collect()
}

/// The slot count to run and why (the text of the `[plan] parallel:` line after the count).
#[derive(Clone, Debug, PartialEq)]
pub struct SlotDecision {
    pub n: usize,
    pub reason: String,
}

/// The fewest slots whose expert bytes from disk per generated token are within `tolerance`
/// of the fewest bytes any count in `costs` reaches (more slots than that stop paying).
/// `costs` must be `slot_costs`' (entry i is n = i + 1); empty gives 1.
pub fn decide(costs: &[SlotCost], tolerance: f64) -> SlotDecision {
    let Some(last) = costs.last() else {
        return SlotDecision {
            n: 1,
            reason: "no slot counts to compare".into(),
        };
    };
    let bytes = |c: &SlotCost| c.disk_bytes_per_token.max(0.0);
    if costs.iter().all(|c| bytes(c) < 1.0) {
        return SlotDecision {
            n: last.n,
            reason: format!(
                "experts stream, but the cache holds every expert a step needs: no reads to share; {} slots",
                last.n
            ),
        };
    }
    let best = costs.iter().map(bytes).fold(f64::INFINITY, f64::min);
    let pick = costs
        .iter()
        .find(|c| bytes(c) <= best * (1.0 + tolerance) + 1.0)
        .unwrap_or(last);
    let mb = |c: &SlotCost| human(bytes(c).round() as u64);
    let s = |n: usize| if n == 1 { "" } else { "s" };
    let table = costs
        .iter()
        .map(|c| format!("{} at {}", mb(c), c.n))
        .collect::<Vec<_>>()
        .join(", ");
    let reason = if pick.n == last.n {
        format!(
            "experts stream and decode waits on the disk: expert bytes from disk per generated token {table} slots (a step's union is read once for all its rows); every slot up to {} pays",
            last.n
        )
    } else {
        let next = &costs[pick.n];
        format!(
            "experts stream and decode waits on the disk: expert bytes from disk per generated token {table} slots; more than {} slot{} save{} under {:.0}% (at {}: a step's union of {:.1} experts/layer in a cache of {:.1} a layer, which also holds each sequence's recent experts); --parallel N overrides",
            pick.n,
            s(pick.n),
            if pick.n == 1 { "s" } else { "" },
            100.0 * tolerance,
            next.n,
            next.union_per_layer,
            next.cache_per_layer
        )
    };
    SlotDecision { n: pick.n, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 4-layer Qwen3-30B-A3B-shaped synth of docs/PERFORMANCE.md: 128 experts of 2.67 MB,
    /// top-8, 4 slots, `cache` slots per layer at every n.
    fn inputs(cache: f64, reuse: f64) -> SlotInputs {
        SlotInputs {
            moe_layers: 4,
            experts_per_layer: 128,
            top_k: 8,
            slot_bytes: 2_666_496,
            cache_per_layer: vec![cache; 4],
            reuse,
        }
    }

    #[test]
    fn union_and_hits_follow_the_model() {
        let c = slot_costs(&inputs(32.0, 0.5));
        assert_eq!(c.len(), 4);
        assert!((c[0].union_per_layer - 8.0).abs() < 1e-9);
        // One sequence, 32 slots: its 4 reused experts hit, and 24 spare slots hold 24 of the
        // 120 other experts for the rest.
        let want = 0.5 + 0.5 * 24.0 / 120.0;
        assert!((c[0].hit - want).abs() < 1e-9, "{}", c[0].hit);
        let bytes = (1.0 - want) * 8.0 * 4.0 * 2_666_496.0;
        assert!((c[0].disk_bytes_per_token - bytes).abs() < 1.0);
        // Four: the union nearly fills the cache, so only the reused share hits.
        assert!(c[3].union_per_layer > 29.0 && c[3].union_per_layer < 29.2);
        assert!(c[3].hit < c[0].hit);
        // A cache of every expert: nothing missed, nothing to cap.
        let all = slot_costs(&inputs(128.0, 0.5));
        assert!(all.iter().all(|c| c.disk_bytes_per_token < 1.0));
        let d = decide(&all, TOLERANCE);
        assert_eq!(d.n, 4, "{}", d.reason);
        assert!(d.reason.contains("holds every expert"), "{}", d.reason);
    }

    #[test]
    fn without_reuse_sharing_the_union_takes_every_slot() {
        // Nothing of a sequence survives between tokens (reuse 0, one slot a layer): sharing
        // the union is all there is, and every slot reads fewer bytes per token.
        let c = slot_costs(&inputs(1.0, 0.0));
        assert!(c
            .windows(2)
            .all(|w| w[1].disk_bytes_per_token < w[0].disk_bytes_per_token));
        let d = decide(&c, TOLERANCE);
        assert_eq!(d.n, 4, "{}", d.reason);
        assert!(d.reason.contains("every slot up to 4 pays"), "{}", d.reason);
    }

    #[test]
    fn a_cache_near_the_union_keeps_one_slot() {
        // 32 or 8 slots a layer with the default reuse: a second sequence costs more disk per
        // token than it shares (measured 27 -> 31 MB/token at 32 slots, 51 -> 82 at 8).
        for cache in [32.0, 8.0] {
            let c = slot_costs(&inputs(cache, DEFAULT_REUSE));
            assert!(c[1].disk_bytes_per_token > c[0].disk_bytes_per_token);
            let d = decide(&c, TOLERANCE);
            assert_eq!(d.n, 1, "{}", d.reason);
            assert!(
                d.reason.contains("more than 1 slot saves under 2%"),
                "{}",
                d.reason
            );
            assert!(d.reason.contains("--parallel N overrides"), "{}", d.reason);
        }
    }

    #[test]
    fn the_fewest_slots_within_the_tolerance_of_the_best() {
        let cost = |n: usize, bytes: f64| SlotCost {
            n,
            union_per_layer: 8.0 * n as f64,
            cache_per_layer: 16.0,
            hit: 0.5,
            disk_bytes_per_token: bytes,
        };
        // Best 79 MB at 4; 80 MB at 2 is within 2% of it: 2 slots.
        let c = [cost(1, 100e6), cost(2, 80e6), cost(3, 90e6), cost(4, 79e6)];
        let d = decide(&c, TOLERANCE);
        assert_eq!(d.n, 2, "{}", d.reason);
        assert!(
            d.reason
                .contains("100.0 MB at 1, 80.0 MB at 2, 90.0 MB at 3, 79.0 MB at 4 slots"),
            "{}",
            d.reason
        );
        assert!(
            d.reason.contains("more than 2 slots save under 2%"),
            "{}",
            d.reason
        );
        // A tighter tolerance takes the fourth.
        assert_eq!(decide(&c, 0.001).n, 4);
        // Nothing to compare: one slot.
        assert_eq!(decide(&[], TOLERANCE).n, 1);
        assert_eq!(decide(&c[..1], TOLERANCE).n, 1);
    }

    #[test]
    fn fewer_kv_caches_leave_more_cache_and_that_counts() {
        // The cache grows as slots are dropped: 40 slots/layer at 1 slot down to 28 at 4.
        let mut s = inputs(0.0, DEFAULT_REUSE);
        s.cache_per_layer = vec![40.0, 36.0, 32.0, 28.0];
        let c = slot_costs(&s);
        assert_eq!(c[3].cache_per_layer, 28.0);
        assert_eq!(decide(&c, TOLERANCE).n, 1);
    }
}
