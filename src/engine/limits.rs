//! Command-line sizes checked before anything is allocated with them: threads, context and
//! prefill batch against the machine's CPUs and the memory budget.
//!
//! Owns: pure functions from (flag values, model hyperparameters, budget) to a one-line error
//! or a capped value. Does not own: parsing the flags (clap), allocating (model/).
//! Invariant: a size that passes here cannot overflow `usize` arithmetic in the model's state
//! and rotary tables, and the memory they take fits in the budget given.

use crate::model::config::AttnKind;
use crate::model::ModelConfig;

/// Most compute threads per CPU the machine reports. More only adds contention; a typo such
/// as `-t 100000` would otherwise spend minutes starting threads.
pub const THREADS_PER_CPU: usize = 4;

/// `-t`: 0 means all CPUs. Returns the thread count to use and, when `threads` was capped,
/// the one-line warning to print.
pub fn threads(threads: usize, cpus: usize) -> (usize, Option<String>) {
    let cpus = cpus.max(1);
    let cap = cpus * THREADS_PER_CPU;
    if threads == 0 {
        (cpus, None)
    } else if threads > cap {
        (
            cap,
            Some(format!(
                "[sluice] warning: -t {threads} is more than {THREADS_PER_CPU} threads per CPU ({cpus} CPUs); using {cap}"
            )),
        )
    } else {
        (threads, None)
    }
}

/// Bytes the model's state takes per context position and per prefill-batch row (f32
/// buffers, including the rotary tables and, for the worst case, an MTP layer's cache and a
/// logit row per batch row). An upper estimate; `None` if it overflows.
pub fn state_bytes(cfg: &ModelConfig) -> Option<(u64, u64)> {
    let f = 4u64;
    let (kc, vc) = cfg.cache_dims();
    let (q_lora, kv_lora) = match cfg.attn {
        AttnKind::Mla {
            q_lora, kv_lora, ..
        } => (q_lora.unwrap_or(0), kv_lora),
        AttnKind::Gqa => (0, 0),
    };
    let u = |x: usize| x as u64;
    let layers = u(cfg.n_layers).checked_add(1)?;
    let ix = cfg.indexer.map_or(0, |i| u(i.heads) + u(i.head_dim));
    let per_pos = layers
        .checked_mul(u(kc).checked_add(u(vc))?)?
        .checked_add(u(cfg.rotary_dim))? // cos + sin: rotary_dim / 2 each
        .checked_add(u(cfg.n_heads))?
        .checked_add(ix)?
        .checked_mul(f)?;
    let ffn = u(cfg.expert_ffn.max(cfg.dense_ffn).max(cfg.shared_ffn));
    let (h, e, k) = (u(cfg.hidden), u(cfg.n_experts), u(cfg.n_experts_used));
    let kvd = u(cfg.kv_dim()).max(u(kc));
    let terms = [
        h.checked_mul(12)?,
        u(cfg.q_dim()),
        u(q_lora).max(u(kv_lora)),
        kvd.checked_mul(2)?,
        u(cfg.att_dim()),
        e.checked_mul(2)?.checked_add(k.checked_mul(2)?)?,
        k.checked_mul(h)?,
        ffn.checked_mul(4)?,
        u(cfg.vocab).checked_mul(2)?,
        ix,
    ];
    let per_row = terms
        .iter()
        .try_fold(0u64, |a, &t| a.checked_add(t))?
        .checked_mul(f)?;
    Some((per_pos, per_row))
}

fn human(b: u64) -> String {
    crate::plan::planner::human(b)
}

/// `-c` and `-b` against the model and the memory budget (`budget`: bytes the state may take,
/// e.g. the memory available; `None` skips the memory check, not the overflow check).
pub fn ctx_and_batch(
    ctx: usize,
    batch: usize,
    cfg: &ModelConfig,
    budget: Option<u64>,
) -> Result<(), String> {
    // Positions are stored as u32 in places (token ids, session files) and the rotary table
    // needs ctx + 1 rows: keep the context well inside both.
    const MAX_CTX: usize = u32::MAX as usize / 2;
    if ctx > MAX_CTX {
        return Err(format!(
            "-c {ctx}: the context length is absurd (at most {MAX_CTX} tokens)"
        ));
    }
    let Some((per_pos, per_row)) = state_bytes(cfg) else {
        return Err("the model's dimensions overflow the state size".to_string());
    };
    let kv = per_pos.checked_mul(ctx as u64 + 1);
    let rows = per_row.checked_mul(batch.max(1) as u64);
    let (Some(kv), Some(rows)) = (kv, rows) else {
        return Err(format!(
            "-c {ctx} -b {batch}: the model's state would overflow 64 bits"
        ));
    };
    if let Some(budget) = budget {
        if kv > budget {
            return Err(format!(
                "-c {ctx}: the KV cache and rotary tables would take {}, more than the {} of memory available",
                human(kv),
                human(budget)
            ));
        }
        if rows > budget.saturating_sub(kv) {
            return Err(format!(
                "-b {batch}: prefill buffers of {} for that many tokens at once do not fit beside the {} context state in the {} of memory available",
                human(rows),
                human(kv),
                human(budget)
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_are_capped_with_a_message() {
        assert_eq!(threads(0, 8), (8, None));
        assert_eq!(threads(3, 2), (3, None));
        let (n, msg) = threads(100_000, 2);
        assert_eq!(n, 2 * THREADS_PER_CPU);
        assert!(msg.unwrap().contains("-t 100000"));
    }
}
