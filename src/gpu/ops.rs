//! The forward's less common operations on the device (kernels in `kernels_ops.cu`): clip_qkv's
//! clamp, attention with a sliding window and attention sinks (gpt-oss, Mistral/Qwen sliding
//! windows), and gpt-oss's expert path (biases on gate, up and down; the clamped SwiGLU).
//!
//! Owns: `Ops` (those kernels, loaded at attach), `ExpertAct` (a MoE layer's expert biases and
//! activation as the device holds them) and the `GpuState` launchers for them.
//! Does not own: the graph (model/), the common kernels and the MoE step (`model.rs`, which calls
//! `run_jobs_act` for a layer with an `ExpertAct`).
//! Invariant: each operation is the CPU backend's formula (`model::cpu`, `gptoss`): the window
//! keeps positions `len - window .. len`, the sink logit joins each head's softmax and adds no
//! value, the expert biases are added to the raw products before the activation (gate, up) and
//! after the down product; expert outputs still land in their top-k slot, so the combine (and
//! placement invariance) is the common one.

use super::driver::{Arg, DevBuf, Gpu, Kernel, Stream};
use super::model::{GpuState, SPLIT_ROWS};
use super::GpuError;
use crate::dtype::DType;

/// The kernels of kernels_ops.cu that do not depend on a weight type.
pub(super) struct Ops {
    clamp: Kernel,
    att_ws: Kernel,
    att_split_ws: Kernel,
    att_merge_sink: Kernel,
    act_bias: Kernel,
    down_bias: Kernel,
    scale: Kernel,
    layer_norm: Kernel,
    idx_scores: Kernel,
    idx_select: Kernel,
    att_list: Kernel,
}

impl Ops {
    pub(super) fn load(gpu: &Gpu) -> Result<Ops, GpuError> {
        Ok(Ops {
            clamp: gpu.function("clamp_rows")?,
            att_ws: gpu.function("attention_ws")?,
            att_split_ws: gpu.function("attention_split_ws")?,
            att_merge_sink: gpu.function("attention_merge_sink")?,
            act_bias: gpu.function("moe_act_bias")?,
            down_bias: gpu.function("moe_down_bias")?,
            scale: gpu.function("scale_rows")?,
            layer_norm: gpu.function("layer_norm_rows")?,
            idx_scores: gpu.function("idx_scores")?,
            idx_select: gpu.function("idx_select")?,
            att_list: gpu.function("attention_list")?,
        })
    }
}

/// DeepSeek-V3.2 / GLM-5's lightning indexer on the device: its per-chunk buffers and each
/// row's selection (kept across layers, so GLM-5's shared layers reuse the last full layer's).
pub(super) struct IdxState {
    /// (batch, heads * dim) queries, (batch, dim) keys, (batch, heads) head weights.
    q: DevBuf,
    k: DevBuf,
    w: DevBuf,
    /// (rows, ctx) index scores of up to `rows` query rows per launch.
    sc: DevBuf,
    rows: usize,
    /// (batch, topk) positions each row attends to, ascending, and their count (i32).
    sel: DevBuf,
    cnt: DevBuf,
    /// index_topk capped at the context.
    topk: usize,
    heads: usize,
    dim: usize,
}

impl IdxState {
    pub(super) fn new(
        gpu: &Gpu,
        ix: crate::model::config::IndexerDims,
        batch: usize,
        ctx: usize,
    ) -> Result<IdxState, GpuError> {
        let f = |n: usize| gpu.alloc(4 * n.max(1));
        let rows = batch.min(((1usize << 24) / ctx.max(1)).max(1));
        let topk = ix.topk.min(ctx).max(1);
        Ok(IdxState {
            q: f(batch * ix.heads * ix.head_dim)?,
            k: f(batch * ix.head_dim)?,
            w: f(batch * ix.heads)?,
            sc: f(rows * ctx)?,
            rows,
            sel: f(batch * topk)?,
            cnt: f(batch)?,
            topk,
            heads: ix.heads,
            dim: ix.head_dim,
        })
    }
}

/// A MoE layer's experts as gpt-oss computes them: arena offsets of the per-expert biases
/// (expert-major, `ExpertBias`'s layout) and the activation.
#[derive(Clone, Copy)]
pub(super) struct ExpertAct {
    /// `moe_gate_up_raw_<type>` of the layer's gate/up type.
    raw: Kernel,
    gate: Option<usize>,
    up: Option<usize>,
    down: Option<usize>,
    /// gpt-oss's (alpha, limit); None: silu(gate) * up.
    clamped: Option<(f32, f32)>,
}

impl ExpertAct {
    pub(super) fn new(
        gpu: &Gpu,
        gate_up: DType,
        biases: Option<(usize, usize, usize)>,
        act: crate::model::config::ExpertAct,
    ) -> Result<ExpertAct, GpuError> {
        use crate::model::config::ExpertAct as A;
        let name = gate_up.name().to_ascii_lowercase();
        Ok(ExpertAct {
            raw: gpu.function(&format!("moe_gate_up_raw_{name}"))?,
            gate: biases.map(|b| b.0),
            up: biases.map(|b| b.1),
            down: biases.map(|b| b.2),
            clamped: match act {
                A::Silu => None,
                A::ClampedSwiglu { alpha, limit } => Some((alpha, limit)),
            },
        })
    }
}

/// Threads per block of the element-wise kernels here.
const T: u32 = 256;
/// Warps per block of a matrix product (kernels.cu WARPS).
const WARPS: u32 = 8;

impl GpuState {
    /// The device address of an indexer buffer (None: not one, or no indexer).
    pub(super) fn idx_buf(&self, b: crate::model::backend::Buf) -> Option<u64> {
        use crate::model::backend::Buf;
        let ix = self.idx.as_ref()?;
        match b {
            Buf::IdxQ => Some(ix.q.ptr),
            Buf::IdxK => Some(ix.k.ptr),
            Buf::IdxW => Some(ix.w.ptr),
            _ => None,
        }
    }

    /// x *= s over `len` values from `x`.
    pub(super) fn scale(&self, x: u64, len: usize, s: f32) -> Result<(), GpuError> {
        self.launch(
            self.ops.scale,
            ((len as u32).div_ceil(T), 1, 1),
            T,
            0,
            &[x.into(), s.into(), (len as i32).into()],
        )
    }

    /// torch LayerNorm of `rows` rows of `dim` values (row stride `ld`) in place; `w`, `b`
    /// device addresses.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_norm(
        &self,
        x: u64,
        ld: usize,
        w: u64,
        b: u64,
        dim: usize,
        rows: usize,
        eps: f64,
    ) -> Result<(), GpuError> {
        self.launch(
            self.ops.layer_norm,
            (rows as u32, 1, 1),
            T,
            0,
            &[
                x.into(),
                (ld as i32).into(),
                w.into(),
                b.into(),
                (dim as i32).into(),
                Arg::from(eps.to_bits()),
            ],
        )
    }

    /// The indexer's choice for rows 0..n (row i at device position + `padd` + i) over cache
    /// layer `l`'s indexer keys: scores, then each row's positions (`IdxState::sel`).
    pub(super) fn index_select(&self, l: usize, n: usize, padd: i32) -> Result<(), GpuError> {
        let Some(ix) = &self.idx else {
            return Err(GpuError::Config(
                "no lightning indexer on the device".into(),
            ));
        };
        let (d, nh, ctx) = (ix.dim, ix.heads, self.ctx);
        let keys = self.bufs.vcache.f(l * ctx * d);
        let scale = (d as f32).powf(-0.5);
        let mut c0 = 0;
        while c0 < n {
            let cn = ix.rows.min(n - c0);
            self.launch(
                self.ops.idx_scores,
                ((ctx as u32).div_ceil(8), cn as u32, 1),
                T,
                0,
                &[
                    ix.q.f(c0 * nh * d).into(),
                    ix.w.f(c0 * nh).into(),
                    keys.into(),
                    (nh as i32).into(),
                    (d as i32).into(),
                    scale.into(),
                    self.bufs.pos.ptr.into(),
                    (c0 as i32 + padd).into(),
                    ix.sc.ptr.into(),
                    (ctx as i32).into(),
                ],
            )?;
            self.launch(
                self.ops.idx_select,
                (cn as u32, 1, 1),
                1024,
                0,
                &[
                    ix.sc.ptr.into(),
                    (ctx as i32).into(),
                    (ix.topk as i32).into(),
                    self.bufs.pos.ptr.into(),
                    (c0 as i32 + padd).into(),
                    ix.sel.f(c0 * ix.topk).into(),
                    ix.cnt.f(c0).into(),
                ],
            )?;
            c0 += cn;
        }
        Ok(())
    }

    /// MLA in absorbed form (model.rs `attend_mla`) over the positions the indexer chose for
    /// each row (`index_select`, this layer's or, for GLM-5's shared layers, the last one's).
    pub(super) fn attend_mla_sparse(
        &self,
        model: &crate::model::Model<'_>,
        l: usize,
        n: usize,
        (k_b, v_b): (usize, usize),
    ) -> Result<(), GpuError> {
        use crate::model::config::AttnKind;
        let cfg = &model.cfg;
        let AttnKind::Mla {
            kv_lora,
            nope,
            rope,
            v_dim,
            ..
        } = cfg.attn
        else {
            return Err(GpuError::Config("MLA weights in a GQA model".into()));
        };
        let Some(ix) = &self.idx else {
            return Err(GpuError::Config(
                "no lightning indexer on the device".into(),
            ));
        };
        let (nh, qk) = (cfg.n_heads, cfg.head_dim);
        let kc = kv_lora + rope;
        let (qcat, clat) = (self.bufs.qcat.ptr, self.bufs.clat.ptr);
        self.mla_qcat(k_b, (nh, qk), (kv_lora, nope, rope), n)?;
        let layer = self.bufs.kcache.f(l * self.ctx * kc);
        let mut c0 = 0;
        while c0 < n {
            let cn = self.att_rows.min(n - c0);
            self.launch(
                self.ops.att_list,
                (nh as u32, cn as u32, 1),
                128,
                (4 * kc) as u32,
                &[
                    (qcat + 4 * (c0 * nh * kc) as u64).into(),
                    ((nh * kc) as i32).into(),
                    (kc as i32).into(),
                    layer.into(),
                    (kc as i32).into(),
                    0i32.into(),
                    layer.into(),
                    (kc as i32).into(),
                    0i32.into(),
                    (kc as i32).into(),
                    (kv_lora as i32).into(),
                    (nh as i32).into(),
                    ix.sel.f(c0 * ix.topk).into(),
                    (ix.topk as i32).into(),
                    ix.cnt.f(c0).into(),
                    cfg.attn_scale.into(),
                    self.bufs.scores.ptr.into(),
                    (self.ctx as i32).into(),
                    (clat + 4 * (c0 * nh * kv_lora) as u64).into(),
                    ((nh * kv_lora) as i32).into(),
                    (kv_lora as i32).into(),
                ],
            )?;
            c0 += cn;
        }
        self.head_mv(
            self.wa(v_b),
            v_dim,
            kv_lora,
            nh,
            n,
            (clat, nh * kv_lora, kv_lora),
            (self.bufs.att.ptr, nh * v_dim, v_dim),
        )
    }

    /// x = clamp(x, -c, c) over `len` values from `x`.
    pub(super) fn clamp(&self, x: u64, len: usize, c: f32) -> Result<(), GpuError> {
        self.launch(
            self.ops.clamp,
            ((len as u32).div_ceil(T), 1, 1),
            T,
            0,
            &[x.into(), c.into(), (len as i32).into()],
        )
    }

    /// `attention` (model.rs) with a sliding window (`window` > 0: the last `window` positions)
    /// and per-head sink logits (`sinks`: a device address, 0 for none).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_ws(
        &self,
        q: (u64, usize, usize),
        k: (u64, usize, usize),
        v: (u64, usize, usize),
        dk: usize,
        dv: usize,
        group: usize,
        heads: usize,
        n: usize,
        scale: f32,
        padd: i32,
        o: (u64, usize, usize),
        window: usize,
        sinks: u64,
    ) -> Result<(), GpuError> {
        self.half_unserved()?;
        let b = &self.bufs;
        if n <= SPLIT_ROWS {
            let (splits, chunk) = (self.splits, self.chunk);
            self.launch(
                self.ops.att_split_ws,
                (heads as u32, n as u32, splits as u32),
                128,
                (4 * (dk + chunk)) as u32,
                &[
                    q.0.into(),
                    (q.1 as i32).into(),
                    (q.2 as i32).into(),
                    k.0.into(),
                    (k.1 as i32).into(),
                    (k.2 as i32).into(),
                    v.0.into(),
                    (v.1 as i32).into(),
                    (v.2 as i32).into(),
                    (dk as i32).into(),
                    (dv as i32).into(),
                    (group as i32).into(),
                    b.pos.ptr.into(),
                    padd.into(),
                    scale.into(),
                    (chunk as i32).into(),
                    b.pm.ptr.into(),
                    b.pl.ptr.into(),
                    b.po.ptr.into(),
                    (window as i32).into(),
                ],
            )?;
            return self.launch(
                self.ops.att_merge_sink,
                (heads as u32, n as u32, 1),
                128,
                0,
                &[
                    b.pm.ptr.into(),
                    b.pl.ptr.into(),
                    b.po.ptr.into(),
                    (splits as i32).into(),
                    (dv as i32).into(),
                    o.0.into(),
                    (o.1 as i32).into(),
                    (o.2 as i32).into(),
                    sinks.into(),
                ],
            );
        }
        let mut c0 = 0;
        while c0 < n {
            let cn = self.att_rows.min(n - c0);
            self.launch(
                self.ops.att_ws,
                (heads as u32, cn as u32, 1),
                128,
                (4 * dk) as u32,
                &[
                    (q.0 + 4 * (c0 * q.1) as u64).into(),
                    (q.1 as i32).into(),
                    (q.2 as i32).into(),
                    k.0.into(),
                    (k.1 as i32).into(),
                    (k.2 as i32).into(),
                    v.0.into(),
                    (v.1 as i32).into(),
                    (v.2 as i32).into(),
                    (dk as i32).into(),
                    (dv as i32).into(),
                    (group as i32).into(),
                    b.pos.ptr.into(),
                    (c0 as i32 + padd).into(),
                    scale.into(),
                    b.scores.ptr.into(),
                    (self.ctx as i32).into(),
                    (o.0 + 4 * (c0 * o.1) as u64).into(),
                    (o.1 as i32).into(),
                    (o.2 as i32).into(),
                    (window as i32).into(),
                    sinks.into(),
                ],
            )?;
            c0 += cn;
        }
        Ok(())
    }

    /// `run_jobs` (model.rs) for a layer with gpt-oss experts: raw gate and up products of the
    /// jobs' tokens (f32 activations), their biases and the activation, the down product
    /// (`down`: the type's f32-activation `moe_down` kernel), its bias. `grid_y` jobs at `jobs`
    /// (device), bounded by the device count at `nj` when it is not 0.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_jobs_act(
        &self,
        a: &ExpertAct,
        down: Kernel,
        (ffn, rb_gate, rb_down): (usize, usize, usize),
        jobs: u64,
        grid_y: usize,
        nj: u64,
        h: usize,
    ) -> Result<(), GpuError> {
        let b = &self.bufs;
        let w = |o: Option<usize>| o.map_or(0, |o| self.wa(o));
        self.launch(
            a.raw,
            ((ffn as u32).div_ceil(WARPS), grid_y as u32, 1),
            32 * WARPS,
            0,
            &[
                jobs.into(),
                nj.into(),
                (ffn as i32).into(),
                (h as i32).into(),
                (rb_gate as i64).into(),
                b.xn.ptr.into(),
                (h as i32).into(),
                b.tok.ptr.into(),
                b.hb.ptr.into(),
                b.hu.ptr.into(),
            ],
        )?;
        let (act, (alpha, limit)) = match a.clamped {
            Some(c) => (1i32, c),
            None => (0, (0.0, 0.0)),
        };
        self.launch(
            self.ops.act_bias,
            ((ffn as u32).div_ceil(T), grid_y as u32, 1),
            T,
            0,
            &[
                jobs.into(),
                nj.into(),
                (ffn as i32).into(),
                b.hb.ptr.into(),
                b.hu.ptr.into(),
                b.dst.ptr.into(),
                b.sel.ptr.into(),
                w(a.gate).into(),
                w(a.up).into(),
                act.into(),
                alpha.into(),
                limit.into(),
            ],
        )?;
        self.launch(
            down,
            ((h as u32).div_ceil(WARPS), grid_y as u32, 1),
            32 * WARPS,
            0,
            &[
                jobs.into(),
                nj.into(),
                (h as i32).into(),
                (ffn as i32).into(),
                (rb_down as i64).into(),
                b.hb.ptr.into(),
                b.dst.ptr.into(),
                b.slot_out.ptr.into(),
            ],
        )?;
        if let Some(bd) = a.down {
            self.launch(
                self.ops.down_bias,
                ((h as u32).div_ceil(T), grid_y as u32, 1),
                T,
                0,
                &[
                    jobs.into(),
                    nj.into(),
                    (h as i32).into(),
                    b.slot_out.ptr.into(),
                    b.dst.ptr.into(),
                    b.sel.ptr.into(),
                    self.wa(bd).into(),
                ],
            )?;
        }
        Ok(())
    }

    /// The router's bias (gpt-oss) added to rows 0..n of the router logits (`e` wide). Not
    /// through `launch`: the quantized xn stays valid (the router output is not xn).
    pub(super) fn router_bias(
        &self,
        router: u64,
        bias: usize,
        e: usize,
        n: usize,
    ) -> Result<(), GpuError> {
        let len = n * e;
        self.gpu.launch(
            self.small.add_bias,
            ((len as u32).div_ceil(T), 1, 1),
            T,
            0,
            Stream::Compute,
            &[
                router.into(),
                self.wa(bias).into(),
                (e as i32).into(),
                (len as i32).into(),
            ],
        )
    }
}
