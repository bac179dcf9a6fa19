//! The operations the forward pass is written in (`Backend`), and the buffers they name.
//!
//! Owns: the contract between the forward graph (`forward.rs`, `deepseek2.rs`, `mtp.rs`,
//! which decide *what* is computed, in which order, on which weights) and a backend (which
//! decides *where and how*: `cpu.rs`; `gpu::backend` through the `Device` trait below). The
//! graph never reads or writes activations itself: it names buffers (`Buf`) and passes
//! weights (`&WeightView`, norm vectors, the weight structs of `weights.rs`); the backend owns
//! the memory behind the names, so a device backend keeps them in VRAM and needs no host
//! round trip between operations.
//! Does not own: the weights (the graph passes them; a device backend maps each view to the
//! device copy it built at attach, by its host address), sampling, the expert store.
//! Invariant: for the CPU backend every operation is the arithmetic the forward always did
//! (same loops, same summation order), so outputs are bit-identical to the reference tests'
//! figures and no operation allocates once the state is built.
//!
//! # Shapes
//! A buffer holds up to `batch` rows. `Rows` selects a strided window of them: row `i` of the
//! window is `buf[(row0 + i) * stride + off ..][..width]`. Most operations act on rows `0..n`
//! of the chunk (the tokens of one `forward_chunk`, at positions `pos..pos + n`).
//!
//! # How a backend implements each operation
//! Element-wise operations (`add_bias`, `clamp`, `scale`, `add`, `swiglu`, `rope`, norms) must
//! use the formulas of `blocks.rs` on each element in the same order to match the CPU bit for
//! bit; a GPU backend may differ in the last bits (fused multiply-add, parallel sums): it is
//! held to the reference tests' tolerance (1e-4 on logits, identical argmax), not to
//! bit-equality with the CPU. What must be exact on every backend: which experts each token
//! chooses given the router logits it computed (same `route_token` rules, ties to the lower
//! index) and that a token's expert outputs are summed in its top-k slot order, so the result
//! never depends on the order in which experts are computed or arrive from disk.

use super::config::RopeLayout;
use super::deepseek_v4::{Attn as V4Attn, Hc, HcHead, MoeW as V4Moe, V4Weights};
use super::qwen3next::{DeltaNet, GatedAttn};
use super::weights::{Mla, Moe};
use super::{Model, ModelError, Prof, State};
use crate::kernels::WeightView;

/// The activation buffers a backend owns, each `batch` rows wide at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buf {
    /// (batch, hidden) the residual stream.
    X,
    /// (batch, hidden) the normed input of a sub-block (and scratch for the MTP head).
    Xn,
    /// (batch, q_dim) queries (MLA: n_heads x (nope + rope)).
    Q,
    /// (batch, q_lora) MLA's q latent.
    Qa,
    /// (batch, max(kv_dim, kv_lora + rope)) keys (MLA: kv latent and the shared rope key).
    K,
    /// (batch, kv_dim) values.
    V,
    /// (batch, att_dim) attention output before the output projection.
    Att,
    /// (batch, hidden) a sub-block's output, added to `X` by the graph.
    Proj,
    /// (batch, hidden) final-normed hidden states of the last chunk (the MTP head reads them).
    Hfin,
    /// (batch, widest ffn) SwiGLU gate, then the activated product.
    Gate,
    /// (batch, widest ffn) SwiGLU up projection.
    Up,
    /// (logit_rows, vocab) logits of the main head.
    Logits,
    /// (batch, idx_heads * idx_dim) V3.2 indexer queries.
    IdxQ,
    /// (batch, idx_dim) V3.2 indexer keys.
    IdxK,
    /// (batch, idx_heads) V3.2 indexer head weights.
    IdxW,
    /// (batch, 2 * hidden) MTP input: [enorm(embed); hnorm(hidden)].
    MtpCat,
    /// (batch, hidden) main hidden states paired with the MTP head's tokens.
    MtpHidden,
    /// (logit_rows, vocab) logits of the MTP head.
    MtpLogits,
}

/// A strided window of rows of one buffer (see the module doc).
#[derive(Clone, Copy, Debug)]
pub struct Rows {
    pub buf: Buf,
    pub row0: usize,
    pub stride: usize,
    pub off: usize,
    pub width: usize,
}

impl Rows {
    /// Rows of `width` packed one after the other, from row 0.
    pub fn of(buf: Buf, width: usize) -> Rows {
        Rows {
            buf,
            row0: 0,
            stride: width,
            off: 0,
            width,
        }
    }

    /// The same window starting `row0` rows further.
    pub fn from_row(self, row0: usize) -> Rows {
        Rows { row0, ..self }
    }

    /// The columns `off..off + width` of each row of a packed window.
    pub fn cols(self, off: usize, width: usize) -> Rows {
        Rows {
            off: self.off + off,
            width,
            ..self
        }
    }
}

/// Which half of a cache layer a row goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cache {
    /// GQA keys; MLA's latent + rope key.
    K,
    /// GQA values; V3.2's indexer keys.
    V,
}

/// Grouped-query attention over the cache (`Backend::attend`).
#[derive(Clone, Copy, Debug)]
pub struct GqaShape<'s> {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies q.k before the softmax.
    pub scale: f32,
    /// Attend to the last `w` positions only (this layer's window: gpt-oss alternates).
    pub window: Option<usize>,
    /// One learned "sink" logit per head (gpt-oss): it joins the head's softmax, takes its
    /// share of the probability mass and contributes no value (`gptoss::softmax_with_sink`).
    pub sinks: Option<&'s [f32]>,
}

/// The per-head steps between the q/k/v projections and grouped-query attention
/// (`Backend::qk_prep`).
#[derive(Clone, Copy, Debug)]
pub struct QkPrep<'s> {
    pub q: Rows,
    pub k: Rows,
    pub v: Rows,
    pub head_dim: usize,
    /// q/k RMSNorm, as `Backend::rmsnorm` takes them.
    pub norm: Option<HeadNorms<'s>>,
    /// OLMoE's clip_qkv.
    pub clip: Option<f32>,
    pub layout: RopeLayout,
}

/// QkPrep's q and k RMSNorms: each `q_part`/`k_part`-wide piece of a row, scaled by `q`/`k`.
#[derive(Clone, Copy, Debug)]
pub struct HeadNorms<'s> {
    pub q_part: usize,
    pub k_part: usize,
    pub q: &'s [f32],
    pub k: &'s [f32],
    pub eps: f32,
}

/// `Backend::qk_prep` as its operations, in order: q and k norms, the clip, rope of q and k,
/// k and v into cache layer `l`.
pub fn qk_prep_ops<B: Backend + ?Sized>(
    b: &mut B,
    l: usize,
    n: usize,
    at: At,
    p: QkPrep<'_>,
) -> Result<(), ModelError> {
    if let Some(m) = p.norm {
        b.rmsnorm(p.q, p.q, n, m.q_part, m.q, m.eps)?;
        b.rmsnorm(p.k, p.k, n, m.k_part, m.k, m.eps)?;
    }
    if let Some(c) = p.clip {
        for x in [p.q, p.k, p.v] {
            b.clamp(x, n, c)?;
        }
    }
    b.rope(p.q, n, p.head_dim, 0, at.rope, p.layout)?;
    b.rope(p.k, n, p.head_dim, 0, at.rope, p.layout)?;
    b.store_cache(l, Cache::K, p.k, n, at.pos)?;
    b.store_cache(l, Cache::V, p.v, n, at.pos)
}

/// One sequence's rows in a batched forward (`Model::forward_seqs`): rows `row0..row0 + n`
/// go to sequence `seq`'s cache (and recurrent state) at `at`.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    pub seq: usize,
    pub row0: usize,
    pub n: usize,
    pub at: At,
}

/// Where the chunk sits in its sequence.
#[derive(Clone, Copy, Debug)]
pub struct At {
    /// Cache position of row 0 (row i is at `pos + i`).
    pub pos: usize,
    /// Rotary position of row 0 (the MTP head's slots rotate one ahead of their cache slot).
    pub rope: usize,
}

/// The operations of the forward pass. Every method acts on rows `0..n` unless it says
/// otherwise and returns only errors: results stay in the backend's buffers until the graph
/// asks for the logits (`forward_chunk` returns them).
///
/// The trait is object safe (a session may hold a `Box<dyn Backend>`) and coarse where a
/// device backend needs it: `moe` is one call (route, group tokens per expert, run the
/// experts, combine in slot order) so routing can stay on the device with no host sync per
/// layer; `attend` / `attend_mla` include the whole softmax over the cache.
pub trait Backend {
    /// `dst` rows 0..tokens.len() = the dequantized rows `tokens` of `table` (hidden wide).
    fn embed(&mut self, table: &WeightView<'_>, tokens: &[u32], dst: Buf)
        -> Result<(), ModelError>;

    /// For each `(w, dst)`: `dst` rows 0..n (packed, `w.rows` wide) = `src` rows x `w`^T.
    /// `src` must be packed (`stride == width == w.cols`). Sharing one input across several
    /// weights lets the CPU quantize the activations once.
    fn matmul(
        &mut self,
        src: Rows,
        n: usize,
        outs: &[(&WeightView<'_>, Buf)],
    ) -> Result<(), ModelError>;

    /// RMSNorm (`blocks::rmsnorm`, f64 sum of squares) of each `part`-wide piece of each `src`
    /// row, scaled by `w` (`part` long), into the same place of `dst` (in place when `dst` and
    /// `src` name the same buffer: then they must be the same window). `part == width`: the
    /// whole row; `part == head_dim`: per-head q/k norm.
    fn rmsnorm(
        &mut self,
        dst: Rows,
        src: Rows,
        n: usize,
        part: usize,
        w: &[f32],
        eps: f32,
    ) -> Result<(), ModelError>;

    /// torch LayerNorm (biased variance, f64 sums, as `deepseek2::layer_norm`) of each row,
    /// in place.
    fn layer_norm(
        &mut self,
        x: Rows,
        n: usize,
        w: &[f32],
        b: &[f32],
        eps: f64,
    ) -> Result<(), ModelError>;

    /// x[i][j] += b[j].
    fn add_bias(&mut self, x: Rows, n: usize, b: &[f32]) -> Result<(), ModelError>;

    /// Grouped-query attention's per-head steps of layer `l` (`QkPrep`): `qk_prep_ops`, which a
    /// device backend may run as fewer launches with the same arithmetic.
    fn qk_prep(&mut self, l: usize, n: usize, at: At, p: QkPrep<'_>) -> Result<(), ModelError> {
        qk_prep_ops(self, l, n, at, p)
    }

    /// x = clamp(x, -c, c) (OLMoE's clip_qkv).
    fn clamp(&mut self, x: Rows, n: usize, c: f32) -> Result<(), ModelError>;

    /// x *= s.
    fn scale(&mut self, x: Rows, n: usize, s: f32) -> Result<(), ModelError>;

    /// Rotary embedding: for row i at rotary position `pos + i`, each `head`-wide piece of the
    /// row is rotated on its values `off..off + rotary_dim` (`blocks::Rope::apply_as`) in
    /// `layout` (the model's own, or half-split for V3.2's indexer).
    fn rope(
        &mut self,
        x: Rows,
        n: usize,
        head: usize,
        off: usize,
        pos: usize,
        layout: RopeLayout,
    ) -> Result<(), ModelError>;

    /// Write `src` rows 0..n (each `src.width` wide: the cache's row width on that side) to
    /// cache layer `layer`, positions `pos..pos + n`, on `side`.
    fn store_cache(
        &mut self,
        layer: usize,
        side: Cache,
        src: Rows,
        n: usize,
        pos: usize,
    ) -> Result<(), ModelError>;

    /// Causal grouped-query attention: `Att` row i = softmax(q_i . K / scale) V over cache
    /// layer `layer`'s positions `first..=pos + i` (`first` from the sliding window), per head,
    /// heads sharing a kv head in groups of `heads / kv_heads`; with `s.sinks`, each head's
    /// softmax includes its sink logit. Reads `Q`.
    fn attend(
        &mut self,
        layer: usize,
        n: usize,
        pos: usize,
        s: GqaShape<'_>,
    ) -> Result<(), ModelError>;

    /// `attend_mla` for rows `row0..row0 + n` of `Q` into the same rows of `Att` (one
    /// sequence's rows in a batched forward, as `attend_rows`). A backend that runs one
    /// sequence per forward refuses any `row0 > 0`.
    fn attend_mla_rows(
        &mut self,
        layer: usize,
        row0: usize,
        n: usize,
        pos: usize,
        a: &Mla<'_>,
    ) -> Result<(), ModelError> {
        if row0 == 0 {
            return self.attend_mla(layer, n, pos, a);
        }
        Err(one_sequence())
    }

    /// `attend` for rows `row0..row0 + n` of `Q` into the same rows of `Att` (row i of the
    /// window at cache position `pos + i`): one sequence's rows in a batched forward over
    /// several sequences (`Model::forward_seqs`). A backend that runs one sequence per forward
    /// refuses any `row0 > 0`.
    fn attend_rows(
        &mut self,
        layer: usize,
        row0: usize,
        n: usize,
        pos: usize,
        s: GqaShape<'_>,
    ) -> Result<(), ModelError> {
        if row0 == 0 {
            return self.attend(layer, n, pos, s);
        }
        Err(one_sequence())
    }

    /// Make sequence `seq`'s cache the one `store_cache` and `attend_rows` use, until the next
    /// call (a batched forward over several sequences, `Model::forward_seqs`). A backend that
    /// runs one sequence per forward refuses it.
    fn use_sequence(&mut self, seq: usize) -> Result<(), ModelError> {
        let _ = seq;
        Err(one_sequence())
    }

    /// Multi-head latent attention in absorbed form (DeepSeek): per head, q's nope part is
    /// folded into latent space by `a.k_b`, scored against the cached latent + rope key,
    /// the softmax-weighted latent context is expanded by `a.v_b` into `Att`. With an indexer
    /// (V3.2), past `index_topk` causal positions only the positions with the best index
    /// scores (from `IdxQ`, `IdxW` and the indexer keys of cache side V) are attended, ties to
    /// the lower position. Reads `Q`.
    fn attend_mla(
        &mut self,
        layer: usize,
        n: usize,
        pos: usize,
        a: &Mla<'_>,
    ) -> Result<(), ModelError>;

    /// `Gate` rows 0..n (`f` wide) = silu(Gate) * Up.
    fn swiglu(&mut self, n: usize, f: usize) -> Result<(), ModelError>;

    /// `dst` rows 0..n += `src` rows 0..n (both `width` wide, packed): the residual add.
    fn add(&mut self, dst: Buf, src: Buf, n: usize, width: usize) -> Result<(), ModelError>;

    /// Copy `src` rows 0..n into `dst` rows 0..n.
    fn copy(&mut self, dst: Rows, src: Rows, n: usize) -> Result<(), ModelError>;

    /// The routed block of layer `layer` (cache layer; the MTP layer's is `n_layers`) on `Xn`
    /// rows 0..n into `Proj`: router logits, expert choice per token (`route_token`), each
    /// chosen expert's SwiGLU on the tokens routed to it, each token's outputs summed in its
    /// top-k slot order, plus the shared expert. Where the expert bytes come from (mapped
    /// files, the streaming cache, VRAM) is the backend's business. `m` also carries what
    /// gpt-oss adds, which a backend must apply or refuse: `router_bias` (added to the router
    /// logits before routing, the prefetch prediction included), `exp_bias` (added to each
    /// expert's gate, up and down outputs) and the model's `cfg.expert_act`
    /// (`ExpertAct::ClampedSwiglu`: `gptoss::clamped_swiglu` instead of silu(gate) * up).
    fn moe(&mut self, layer: usize, m: &Moe<'_>, n: usize) -> Result<(), ModelError>;

    /// A hint, called after layer `next - 1`'s attention: start fetching the experts layer
    /// `next` will probably need for rows 0..n of `X`. May clobber `Xn` (the graph recomputes
    /// it); must not change any result. Backends without an expert cache do nothing.
    fn prefetch(&mut self, next: usize, n: usize) -> Result<(), ModelError>;

    /// Where forward time went (the graph adds to it around each part).
    fn prof(&mut self) -> &mut Prof;

    // DeepSeek V4 (deepseek_v4.rs has the formulas; a backend without them refuses V4).

    /// V4: each of rows 0..n of `X` copied into every hyper-connection stream.
    fn v4_hc_expand(&mut self, _n: usize) -> Result<(), ModelError> {
        Err(v4_unsupported("hyper-connection streams"))
    }

    /// V4: one hyper-connection's mix of rows 0..n: the `pre`-collapsed streams into `Xn`;
    /// `post` and `comb` kept for `v4_hc_post`.
    fn v4_hc_pre(&mut self, _w: &Hc, _n: usize) -> Result<(), ModelError> {
        Err(v4_unsupported("hyper-connections"))
    }

    /// V4: streams of rows 0..n = post x `Proj` + comb^T x streams.
    fn v4_hc_post(&mut self, _n: usize) -> Result<(), ModelError> {
        Err(v4_unsupported("hyper-connections"))
    }

    /// V4: the final collapse of the streams of rows 0..n into `X`.
    fn v4_hc_head(&mut self, _w: &HcHead, _n: usize) -> Result<(), ModelError> {
        Err(v4_unsupported("the hyper-connection head"))
    }

    /// V4 attention of rows 0..n of `Xn` (sliding window, CSA or HCA by the layer) into
    /// `Proj`, its rows written to cache layer `layer` (the `deepseek_v4` module doc).
    fn v4_attention(
        &mut self,
        _layer: usize,
        _a: &V4Attn<'_>,
        _w: &V4Weights<'_>,
        _n: usize,
        _at: At,
    ) -> Result<(), ModelError> {
        Err(v4_unsupported("compressed sparse attention"))
    }

    /// V4's MoE block of rows 0..n of `Xn` (hash or top-k routing; `tokens` are the rows'
    /// ids) into `Proj`.
    fn v4_moe(
        &mut self,
        _layer: usize,
        _m: &V4Moe<'_>,
        _tokens: &[u32],
        _n: usize,
    ) -> Result<(), ModelError> {
        Err(v4_unsupported("hash-routed MoE"))
    }

    // Qwen3-Next / Qwen3.5 (qwen3next.rs). A backend without them refuses those families.

    /// Gated full attention of rows 0..n of `Xn` into `Proj`: `a.wq` gives per head [q; gate],
    /// q and k are RMS-normed per head (`a.q_norm`, `a.k_norm`), rotated (partial rotary) and
    /// cached in cache layer `layer`, attention as `attend` (no window, no sinks), the result
    /// multiplied by sigmoid(gate), then `a.wo`.
    fn gated_attention(
        &mut self,
        layer: usize,
        n: usize,
        at: At,
        a: &GatedAttn<'_>,
    ) -> Result<(), ModelError> {
        let _ = (layer, n, at, a);
        Err(ModelError::Unsupported(
            "Qwen3-Next gated attention is unsupported on this backend".into(),
        ))
    }

    /// Gated DeltaNet of rows 0..n of `Xn` into `Proj` (see qwen3next.rs), token by token on
    /// layer `layer`'s conv and recurrent state, which a chunk at position 0 first zeroes.
    fn delta_net(
        &mut self,
        layer: usize,
        n: usize,
        at: At,
        d: &DeltaNet<'_>,
    ) -> Result<(), ModelError> {
        let _ = (layer, n, at, d);
        Err(ModelError::Unsupported(
            "Qwen3-Next Gated DeltaNet is unsupported on this backend".into(),
        ))
    }
    /// `delta_net` over the rows of several sequences (`spans`, a batched forward): the
    /// projections once over rows 0..n, then each span's rows through the conv and the delta
    /// rule on its own sequence's state (`use_sequence`; a span at position 0 first zeroes
    /// it), the output projection once. A backend that runs one sequence per forward refuses.
    fn delta_net_seqs(
        &mut self,
        layer: usize,
        n: usize,
        spans: &[Span],
        d: &DeltaNet<'_>,
    ) -> Result<(), ModelError> {
        let _ = (layer, n, spans, d);
        Err(one_sequence())
    }

    /// `gated_attention` over the rows of several sequences (`spans`): projections, gate and
    /// output once over rows 0..n; q/k norms, rotation, cache and attention per span against
    /// its own sequence's cache. A backend that runs one sequence per forward refuses.
    fn gated_attention_seqs(
        &mut self,
        layer: usize,
        n: usize,
        spans: &[Span],
        a: &GatedAttn<'_>,
    ) -> Result<(), ModelError> {
        let _ = (layer, n, spans, a);
        Err(one_sequence())
    }
}

fn one_sequence() -> ModelError {
    ModelError::Unsupported(
        "this backend runs one sequence per forward (batched decoding needs --parallel 1)".into(),
    )
}

fn v4_unsupported(what: &str) -> ModelError {
    ModelError::Unsupported(format!("DeepSeek-V4 {what} on this backend"))
}

/// The trait stays object safe: a session may hold its backend as `Box<dyn Backend>`.
#[allow(dead_code)]
fn object_safe(_: &mut dyn Backend, _: &mut dyn Device) {}

/// A backend that keeps its own memory across chunks (weights, KV cache, buffers): a device
/// (`gpu::backend`). The engine holds one beside the `State` and runs each chunk through
/// `Model::forward_on`; the device's `forward_chunk` runs the same graph
/// (`Model::forward_tokens`) over a `Backend` of its own. `model/` defines this interface and
/// never names an implementation.
pub trait Device: Send {
    /// One chunk, its contract already checked (`forward_on`): `tokens` at positions
    /// `st.pos..`, the logits of rows `logits_from..` into `st.logits`, `st.pos` advanced and
    /// `st.experts_run` set to the experts this chunk ran.
    fn forward_chunk(
        &mut self,
        model: &Model<'_>,
        st: &mut State,
        tokens: &[u32],
        logits_from: usize,
    ) -> Result<(), ModelError>;

    /// Figures since the device was attached.
    fn stats(&self) -> DeviceStats;

    /// The pinned host -> device GB/s measured at attach, if it was (`--prof`).
    fn h2d_ceiling(&self) -> Option<f64> {
        None
    }
}

/// `dev` again for one call, leaving it usable after (a plain `as_deref_mut` would hold the
/// borrow for the trait object's whole lifetime).
pub fn reborrow<'a>(dev: &'a mut Option<&mut dyn Device>) -> Option<&'a mut dyn Device> {
    match dev {
        Some(d) => Some(&mut **d),
        None => None,
    }
}

/// A device's figures since attach (or `since` a snapshot).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DeviceStats {
    /// Forward calls and their host wall seconds.
    pub forwards: u64,
    pub wall_secs: f64,
    /// Seconds the compute stream spent in kernels (event-timed segments).
    pub kernel_secs: f64,
    /// Seconds the copy stream spent copying experts, and the bytes it copied.
    pub copy_secs: f64,
    pub bytes_h2d: u64,
    pub experts_h2d: u64,
    /// Host seconds spent registering/unregistering staged experts (per-expert staging).
    pub register_secs: f64,
    /// VRAM pool hits and misses (selections; `vram_misses` counts the staged ones).
    pub vram_hits: u64,
    pub vram_misses: u64,
    /// Pool misses computed on the CPU instead (`--gpu-experts hybrid`), experts per layer.
    pub experts_cpu: u64,
}

impl DeviceStats {
    pub fn since(&self, b: &DeviceStats) -> DeviceStats {
        DeviceStats {
            forwards: self.forwards - b.forwards,
            wall_secs: self.wall_secs - b.wall_secs,
            kernel_secs: self.kernel_secs - b.kernel_secs,
            copy_secs: self.copy_secs - b.copy_secs,
            bytes_h2d: self.bytes_h2d - b.bytes_h2d,
            experts_h2d: self.experts_h2d - b.experts_h2d,
            register_secs: self.register_secs - b.register_secs,
            vram_hits: self.vram_hits - b.vram_hits,
            vram_misses: self.vram_misses - b.vram_misses,
            experts_cpu: self.experts_cpu - b.experts_cpu,
        }
    }
    /// Achieved host -> device GB/s while copying experts.
    pub fn h2d_gbps(&self) -> f64 {
        if self.copy_secs > 0.0 {
            self.bytes_h2d as f64 / self.copy_secs / 1e9
        } else {
            0.0
        }
    }
    pub fn vram_hit_rate(&self) -> f64 {
        let r = self.vram_hits + self.vram_misses + self.experts_cpu;
        if r == 0 {
            0.0
        } else {
            self.vram_hits as f64 / r as f64
        }
    }
    /// Share of wall time the device was not running kernels.
    pub fn stall_share(&self) -> f64 {
        if self.wall_secs > 0.0 {
            ((self.wall_secs - self.kernel_secs) / self.wall_secs).max(0.0)
        } else {
            0.0
        }
    }
}
