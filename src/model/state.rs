//! Per-sequence state: the CPU backend's buffers, the KV cache, the sequence position.
//!
//! Owns: `State` (every buffer and the KV cache, sized once) and `Prof`.
//! Invariant: after `State::new`, a forward call of at most `batch` tokens allocates nothing.

use super::config::{AttnKind, ModelConfig};
use crate::experts::ExpertCache;
use crate::kernels::kv::{f32_bytes, f32_bytes_mut, KvType};
use crate::kernels::Acts;

/// The element types of the KV cache's two sides (`-ctk`, `-ctv`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvTypes {
    pub k: KvType,
    pub v: KvType,
}

impl KvTypes {
    /// Both sides f32 (exact: what the transformers references are compared with).
    pub const F32: KvTypes = KvTypes {
        k: KvType::F32,
        v: KvType::F32,
    };
    /// llama.cpp's default, and sluice's on the CPU.
    pub const F16: KvTypes = KvTypes {
        k: KvType::F16,
        v: KvType::F16,
    };

    pub fn both(t: KvType) -> KvTypes {
        KvTypes { k: t, v: t }
    }
}

impl Default for KvTypes {
    fn default() -> Self {
        KvTypes::F16
    }
}

/// One side (keys or values) of the KV cache: `(layers, ctx)` rows of `width` elements of
/// `ty`, row r at byte `r * row_bytes`. The storage is f32 words, so an f32 cache is a plain
/// `[f32]` for the code that keeps f32 (MLA, the indexer, DeepSeek-V4).
pub struct KvRows {
    ty: KvType,
    width: usize,
    row_bytes: usize,
    rows: usize,
    words: Vec<f32>,
}

impl KvRows {
    pub fn new(ty: KvType, width: usize, rows: usize) -> KvRows {
        let row_bytes = ty.row_bytes(width);
        KvRows {
            ty,
            width,
            row_bytes,
            rows,
            words: vec![0.0; (rows * row_bytes).div_ceil(4)],
        }
    }

    pub fn ty(&self) -> KvType {
        self.ty
    }

    /// Elements per row.
    pub fn width(&self) -> usize {
        self.width
    }

    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Every row's bytes.
    pub fn bytes(&self) -> &[u8] {
        &f32_bytes(&self.words)[..self.rows * self.row_bytes]
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.rows * self.row_bytes;
        &mut f32_bytes_mut(&mut self.words)[..n]
    }

    /// The rows as f32 (an f32 cache only: asking another type for floats is a bug).
    pub fn f32s(&self) -> &[f32] {
        assert_eq!(self.ty, KvType::F32, "KV cache read as f32");
        &self.words
    }

    pub fn f32s_mut(&mut self) -> &mut [f32] {
        assert_eq!(self.ty, KvType::F32, "KV cache written as f32");
        &mut self.words
    }

    /// Bytes allocated.
    pub fn heap_bytes(&self) -> usize {
        self.words.capacity() * 4
    }

    /// Free the rows (a batch state's buffers; `Model::forward_seqs` swaps caches in).
    fn release(&mut self) {
        self.words = Vec::new();
        self.rows = 0;
    }
}

/// Buffers for one sequence: activations for up to `batch` tokens and the KV cache for `ctx`.
pub struct State {
    pub(super) batch: usize,
    pub(super) ctx: usize,
    pub(super) logit_rows: usize,
    /// Layers in the KV cache (the MTP layer included when the state has one).
    pub(super) cache_layers: usize,
    /// Elements per position and cache layer: (keys, values) (`ModelConfig::cache_dims`).
    pub(super) cache_dims: (usize, usize),
    /// Tokens already in the KV cache.
    pub pos: usize,
    pub(crate) x: Vec<f32>,      // (batch, hidden) residual stream
    pub(crate) xn: Vec<f32>,     // (batch, hidden) normed input of a sub-block
    pub(super) q: Vec<f32>,      // (batch, q_dim)
    pub(super) qa: Vec<f32>,     // (batch, q_lora) MLA q latent
    pub(super) k: Vec<f32>,      // (batch, max(kv_dim, kv_lora + rope))
    pub(super) v: Vec<f32>,      // (batch, kv_dim)
    pub(super) att: Vec<f32>,    // (batch, att_dim) attention output before o_proj
    pub(super) scores: Vec<f32>, // (n_heads, min(batch, ATT_ROW_TILE), ctx)
    pub(super) lat: Vec<f32>,    // (2, kv_lora) MLA: q folded into latent space, latent context
    pub(super) proj: Vec<f32>,   // (batch, hidden) sub-block output
    pub(crate) hfin: Vec<f32>,   // (batch, hidden) final-normed hidden states of the last chunk
    pub(super) kcache: KvRows,   // (layers, ctx, k_dim) GQA keys, or MLA latent + rope key
    pub(super) vcache: KvRows,   // (layers, ctx, v_dim) GQA values, or V3.2 indexer keys
    pub(super) idx: super::deepseek2::IndexerScratch, // V3.2 indexer buffers (empty otherwise)
    pub(super) v4: super::deepseek_v4::Scratch, // DeepSeek-V4 buffers (empty otherwise)
    pub(crate) router: Vec<f32>, // (batch, n_experts) router scores
    pub(super) choice: Vec<f32>, // (n_experts) selection scores of one token
    pub(super) groups_score: Vec<f32>, // (n_group)
    pub(super) groups_kept: Vec<usize>, // (topk_group)
    pub(crate) sel: Vec<usize>,  // (batch, k) chosen experts
    pub(crate) selw: Vec<f32>,   // (batch, k) their routing weights
    pub(crate) groups: Vec<Vec<(u32, u32)>>, // per expert: (token, slot) pairs, capacity batch
    pub(super) gathered: Vec<f32>, // (batch, hidden) inputs of one expert's tokens
    pub(super) gate: Vec<f32>,   // (batch, max(widest ffn, k x expert ffn))
    pub(super) up: Vec<f32>,     // (batch, max(widest ffn, k x expert ffn))
    pub(super) down: Vec<f32>,   // (batch, hidden)
    pub(super) slot_out: Vec<f32>, // (batch, k, hidden) each token's expert outputs, unweighted
    /// (batch, k) the tokens of every needed expert, expert after expert (resident experts).
    pub(super) order: Vec<u32>,
    /// (batch, k) row of `slot_out` holding token t's slot s output, at t * k + s.
    pub(super) row_of: Vec<u32>,
    /// The experts' down-product activations (SiLU of gate and up), as many rows as `gate`.
    pub(super) acts_ffn: Acts,
    pub(crate) acts: Acts,
    pub(crate) logits: Vec<f32>,   // (logit_rows, vocab)
    pub(crate) needed: Vec<usize>, // (n_experts) experts one MoE layer needs, ascending
    // Prefetch (`CacheConfig::prefetch`): the next layer's router applied early.
    pub(super) pf_router: Vec<f32>, // (batch, n_experts) next layer's router scores
    pub(super) pf_sel: Vec<usize>,  // (k) one token's predicted experts
    pub(super) pf_selw: Vec<f32>,   // (k) their weights (unused)
    pub(super) pf_mark: Vec<bool>,  // (n_experts) predicted by some token of the chunk
    pub(super) pf_needed: Vec<usize>, // (n_experts) the predicted union, ascending
    // Multi-token prediction (empty unless the model has an MTP layer).
    pub(crate) mtp_cat: Vec<f32>, // (batch, 2*hidden) [enorm(embed); hnorm(h)] (V4: hc*hidden)
    pub(crate) mtp_hidden: Vec<f32>, // (batch, hidden) main hidden states paired with tokens (V4: hc streams)
    pub(crate) mtp_logits: Vec<f32>, // (logit_rows, vocab)
    /// MTP slots in the MTP layer's cache (slot s pairs hidden of position s with token s+1).
    pub mtp_pos: usize,
    /// The main model's MTP input row of position `pos - 1` as the last decode left it (the
    /// head's slot there was not run yet: its token came after), and that position; lets the
    /// next turn continue a state that cannot be cut back by one (a recurrent one).
    pub(crate) mtp_pending: Vec<f32>,
    pub mtp_pending_pos: Option<usize>,
    /// Qwen3-Next / Qwen3.5 recurrent state and scratch (empty otherwise).
    pub(super) hybrid: super::qwen3next::HybridState,
    /// Streaming expert cache; `None` = experts are read through the mapped files.
    pub(crate) expert_cache: Option<ExpertCache>,
    /// Experts computed in the last forward call, summed over layers (telemetry).
    pub experts_run: usize,
    /// Seconds spent per part of the forward pass since the state was made (`--prof`).
    pub prof: Prof,
}

/// Where forward time goes (wall seconds, accumulated).
#[derive(Clone, Copy, Debug, Default)]
pub struct Prof {
    pub total: f64,
    pub attention: f64,
    /// Routed experts: waiting for bytes and computing (the cache's own wait figure splits it).
    pub experts: f64,
    pub dense_ffn: f64,
    pub lm_head: f64,
}

impl State {
    /// `batch`: most tokens per forward chunk (prefill speed vs memory); `logit_rows`: most
    /// positions whose logits one chunk returns (1 for generation).
    /// No MTP layer cache or buffers (see `with_mtp`). `kv`: the cache's element types, as
    /// `ModelConfig::kv_types` settles them for this model.
    pub fn new(
        cfg: &ModelConfig,
        ctx: usize,
        batch: usize,
        logit_rows: usize,
        kv: KvTypes,
    ) -> State {
        State::with_mtp(cfg, ctx, batch, logit_rows, false, kv)
    }

    /// `new`, plus, when `mtp` is set and the model has an MTP layer, that layer's KV cache
    /// (one more cache layer) and the MTP head's buffers: what `--mtp K > 0` needs. sluice
    /// runs only the first MTP layer, so that is the one cached.
    pub fn with_mtp(
        cfg: &ModelConfig,
        ctx: usize,
        batch: usize,
        logit_rows: usize,
        mtp: bool,
        kv: KvTypes,
    ) -> State {
        let mtp = mtp && cfg.n_mtp_layers > 0;
        // DeepSeek-V4's MTP input rows are its `hc` residual streams.
        let hc = cfg.v4.as_ref().map_or(1, |v| v.hc);
        let cache_layers = cfg.kv_layers() + usize::from(mtp);
        let (h, qd, kvd, e, k) = (
            cfg.hidden,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.n_experts,
            cfg.n_experts_used,
        );
        let (kc, vc) = cfg.cache_dims();
        let (q_lora, kv_lora) = match cfg.attn {
            AttnKind::Mla {
                q_lora, kv_lora, ..
            } => (q_lora.unwrap_or(0), kv_lora),
            AttnKind::Gqa => (0, 0),
        };
        let ffn = cfg.expert_ffn.max(cfg.dense_ffn).max(cfg.shared_ffn);
        // Gate and up hold every routed row of a chunk (batch x k rows of the expert width), so
        // the resident experts of a layer run as one group of parallel regions.
        let ffn_rows = batch.max(1) * ffn.max(k * cfg.expert_ffn);
        let batch = batch.max(1);
        let logit_rows = logit_rows.clamp(1, batch);
        let widest = (2 * h)
            .max(qd)
            .max(ffn)
            .max(cfg.att_dim())
            .max(q_lora)
            .max(kv_lora);
        State {
            batch,
            ctx,
            logit_rows,
            cache_layers,
            cache_dims: (kc, vc),
            pos: 0,
            x: vec![0.0; batch * h],
            xn: vec![0.0; batch * h],
            q: vec![0.0; batch * qd],
            qa: vec![0.0; batch * q_lora],
            k: vec![0.0; batch * kvd.max(kc)],
            v: vec![0.0; batch * kvd],
            att: vec![0.0; batch * cfg.att_dim()],
            scores: vec![0.0; cfg.n_heads * ctx * batch.min(super::cpu::ATT_ROW_TILE)],
            lat: vec![0.0; 2 * kv_lora],
            proj: vec![0.0; batch * h],
            hfin: vec![0.0; batch * h],
            kcache: KvRows::new(kv.k, kc, cache_layers * ctx),
            vcache: KvRows::new(kv.v, vc, cache_layers * ctx),
            idx: super::deepseek2::IndexerScratch::new(cfg, ctx, batch),
            v4: super::deepseek_v4::Scratch::new(cfg, ctx, batch),
            hybrid: super::qwen3next::HybridState::new(cfg, batch, mtp),
            router: vec![0.0; batch * e],
            choice: vec![0.0; e],
            groups_score: vec![0.0; cfg.routing.n_group],
            groups_kept: vec![0; cfg.routing.topk_group],
            sel: vec![0; batch * k],
            selw: vec![0.0; batch * k],
            groups: (0..e).map(|_| Vec::with_capacity(batch)).collect(),
            gathered: vec![0.0; batch * h],
            gate: vec![0.0; ffn_rows],
            up: vec![0.0; ffn_rows],
            down: vec![0.0; batch * h],
            slot_out: vec![0.0; batch * k * h],
            order: vec![0; batch * k],
            row_of: vec![0; batch * k],
            acts_ffn: Acts::with_capacity(ffn_rows / cfg.expert_ffn.max(1), cfg.expert_ffn),
            acts: Acts::with_capacity(batch, widest),
            logits: vec![0.0; logit_rows * cfg.vocab],
            needed: Vec::with_capacity(e),
            pf_router: vec![0.0; batch * e],
            pf_sel: vec![0; k],
            pf_selw: vec![0.0; k],
            pf_mark: vec![false; e],
            pf_needed: Vec::with_capacity(e),
            mtp_cat: vec![0.0; if mtp { batch * h * 2.max(hc) } else { 0 }],
            mtp_hidden: vec![0.0; if mtp { batch * h * hc } else { 0 }],
            mtp_logits: vec![0.0; if mtp { logit_rows * cfg.vocab } else { 0 }],
            mtp_pos: 0,
            mtp_pending: vec![0.0; if mtp { h * hc } else { 0 }],
            mtp_pending_pos: None,
            expert_cache: None,
            experts_run: 0,
            prof: Prof::default(),
        }
    }

    pub fn ctx(&self) -> usize {
        self.ctx
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    pub fn logit_rows(&self) -> usize {
        self.logit_rows
    }

    /// Whether this state carries the MTP layer's cache and buffers (`with_mtp`).
    pub fn has_mtp(&self) -> bool {
        !self.mtp_hidden.is_empty()
    }

    /// Bytes held by the KV cache: `ctx` x `ModelConfig::kv_bytes_per_token(mtp)`.
    /// Maps the pages of the forward's activation buffers now (one write per page) instead of
    /// by the first prompt's writes: on a DeepSeek-V3-shaped 512-token prefill at 2 threads,
    /// zeroing freshly faulted pages was ~5 % of the time (llama.cpp's warm-up run takes those
    /// faults before its timing). The KV cache and the score rows, whose touched part grows
    /// with the context actually used, stay lazy.
    pub fn prefault(&mut self) {
        use crate::kernels::act::prefault_zeros as z;
        for v in [
            &mut self.x,
            &mut self.xn,
            &mut self.q,
            &mut self.qa,
            &mut self.k,
            &mut self.v,
            &mut self.att,
            &mut self.proj,
            &mut self.hfin,
            &mut self.router,
            &mut self.gathered,
            &mut self.gate,
            &mut self.up,
            &mut self.down,
            &mut self.slot_out,
            &mut self.logits,
            &mut self.mtp_cat,
            &mut self.mtp_hidden,
            &mut self.mtp_logits,
        ] {
            z(v, 0.0);
        }
        self.acts.prefault();
        self.acts_ffn.prefault();
    }

    pub fn kv_bytes(&self) -> usize {
        self.kcache.heap_bytes() + self.vcache.heap_bytes()
    }

    /// The element types of the cache's keys and values.
    pub fn kv_types(&self) -> KvTypes {
        KvTypes {
            k: self.kcache.ty(),
            v: self.vcache.ty(),
        }
    }

    /// Free the KV cache of a state that serves only as the buffers of batched forwards
    /// (`Model::forward_seqs` swaps each sequence's own cache in while it runs that
    /// sequence's attention). No forward of its own may run on it after this.
    pub fn release_kv(&mut self) {
        self.kcache.release();
        self.vcache.release();
    }

    /// Bytes of every buffer but the KV cache (activations, router and expert scratch,
    /// logits, the MTP head's): the planner counts them against `--ram` (a chunk of `batch`
    /// tokens touches them all).
    pub fn scratch_bytes(&self) -> usize {
        let f32s = [
            &self.x,
            &self.xn,
            &self.q,
            &self.qa,
            &self.k,
            &self.v,
            &self.att,
            &self.scores,
            &self.lat,
            &self.proj,
            &self.hfin,
            &self.router,
            &self.choice,
            &self.groups_score,
            &self.selw,
            &self.gathered,
            &self.gate,
            &self.up,
            &self.down,
            &self.slot_out,
            &self.logits,
            &self.pf_router,
            &self.pf_selw,
            &self.mtp_cat,
            &self.mtp_hidden,
            &self.mtp_logits,
        ]
        .iter()
        .map(|v| v.capacity() * 4)
        .sum::<usize>();
        let u32s = (self.order.capacity() + self.row_of.capacity()) * 4;
        let usizes = (self.groups_kept.capacity()
            + self.sel.capacity()
            + self.needed.capacity()
            + self.pf_sel.capacity()
            + self.pf_needed.capacity())
            * std::mem::size_of::<usize>();
        let groups = self
            .groups
            .iter()
            .map(|g| g.capacity() * std::mem::size_of::<(u32, u32)>())
            .sum::<usize>();
        f32s + u32s
            + usizes
            + groups
            + self.pf_mark.capacity()
            + self.acts.bytes()
            + self.acts_ffn.bytes()
            + self.idx.bytes()
    }
}
