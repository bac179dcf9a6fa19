//! DeepSeek-V4 on the device (kernels in `kernels_v4.cu`): the hyper-connection streams, V4
//! attention (sliding window, CSA with its compressors and lightning indexer, HCA; sinks; the
//! grouped low-rank output), and V4's MoE (hash or biased top-k routing over sqrtsoftplus /
//! sigmoid / softmax scores, the clamped SwiGLU for routed and shared experts).
//!
//! Owns: `V4Dev` (the streams, the per-chunk scratch, the per-layer expert tables) and the
//! attach-time upload of V4's weights (`upload`: every tensor the graph passes, the routed
//! experts included: V4's experts are resident in VRAM, not staged through the expert pool),
//! and the `GpuState` launchers the `Backend` methods of `backend.rs` call.
//! Does not own: the formulas (model/deepseek_v4.rs's `cpu_*`), the common products (`mm`) and
//! the expert kernels it reuses (kernels.cu's `build_jobs` and `moe_down_*`, kernels_ops.cu's
//! `moe_gate_up_raw_*`).
//! Invariant: each launch is its `cpu_*` counterpart's arithmetic on the same cache layout (K row
//! [kv | pooled entry | indexer key], V row [compressor kv, gate | indexer kv, gate]), and every
//! position is read from the device, so the decode step is captured once and replayed; routed
//! outputs land in their top-k slots and are summed in slot order after the shared expert, as
//! the CPU sums them.

use super::driver::{DevBuf, Gpu, Kernel};
use super::model::{key, Builder, GpuState, Mat};
use super::GpuError;
use crate::kernels::WeightView;
use crate::model::deepseek_v4::{
    Attn, Hc, HcHead, LayerKind, MoeW, Pool, Score, V4Params, V4Weights,
};
use crate::model::{Model, ModelConfig};

/// kernels_v4.cu's kernels, and kernels.cu's job builder.
#[derive(Clone, Copy)]
struct Kern {
    expand: Kernel,
    mix: Kernel,
    weights: Kernel,
    collapse: Kernel,
    post: Kernel,
    norm_rope: Kernel,
    store: Kernel,
    pool: Kernel,
    idx_scores: Kernel,
    idx_select: Kernel,
    attend: Kernel,
    route: Kernel,
    swiglu: Kernel,
    combine: Kernel,
    build_jobs: Kernel,
}

/// One layer's routed experts on the device.
pub(super) struct V4Layer {
    /// `moe_gate_up_raw_<type>` and `moe_down_<type>` of the experts' types.
    raw: Kernel,
    down: Kernel,
    ffn: usize,
    rb_gate: usize,
    rb_down: usize,
    /// Per expert: arena offsets of gate, up, down.
    experts: Vec<[usize; 3]>,
    /// Arena offset of the hash layers' tid2eid table (i32, vocab x k).
    t2e: Option<usize>,
}

/// What `upload` put in the arena (offsets; the device addresses come with the arena).
pub(super) struct V4Up {
    layers: Vec<V4Layer>,
    /// The tid2eid tables as f32 bit patterns, alive until the arena is built (the builder keys
    /// vectors by their host address).
    _t2e: Vec<Vec<f32>>,
}

/// The V4 state on the device: the streams and the scratch of one chunk, sized at attach.
pub(super) struct V4Dev {
    k: Kern,
    layers: Vec<V4Layer>,
    /// (batch, hc, hidden) the residual streams.
    streams: DevBuf,
    /// (batch, (2 + hc) hc) a hyper-connection's mix; (batch, hc) post; (batch, hc, hc) comb.
    mix: DevBuf,
    post: DevBuf,
    comb: DevBuf,
    /// (batch, q_lora), (batch, head_dim), (batch, 2 max(head_dim, idx_dim)) x 2.
    qr: DevBuf,
    kv: DevBuf,
    ckv: DevBuf,
    cgate: DevBuf,
    /// (batch, idx_heads idx_dim), (batch, idx_heads).
    iq: DevBuf,
    iw: DevBuf,
    /// (irows, entries) index scores; (batch, topk) chosen entries (i32).
    isc: DevBuf,
    irows: usize,
    entries: usize,
    isel: DevBuf,
    /// (arows, heads, nmax) attention logits.
    sc: DevBuf,
    arows: usize,
    nmax: usize,
    /// (batch, groups o_lora) the grouped output's first product.
    oa: DevBuf,
    /// (batch, experts) router logits; (batch, k) weights; jobs, their count; (batch k, ffn)
    /// the raw up products; per layer and expert: gate, up, down addresses.
    router: DevBuf,
    selw: DevBuf,
    jobs: DevBuf,
    njobs: DevBuf,
    hu: DevBuf,
    etab: DevBuf,
}

/// A rotation: the inverse frequencies and cos/sin scale, the rotated width, and whether back.
type Rot<'f> = (&'f (Vec<f32>, f32), usize, bool);

const T: u32 = 256;
const WARPS: u32 = 8;
/// kernels.cu `Job`: three pointers, a0, cnt.
const JOB_BYTES: usize = 32;

fn p(cfg: &ModelConfig) -> Result<&V4Params, GpuError> {
    cfg.v4
        .as_deref()
        .ok_or_else(|| GpuError::Config("V4 operations on a model that is not DeepSeek-V4".into()))
}

/// Group `g` of o_a: its `o_lora` rows (the graph passes the whole matrix; each group is mapped
/// by this sub-view's address).
fn o_a_group<'a>(a: &WeightView<'a>, o_lora: usize, g: usize) -> WeightView<'a> {
    let rb = a.row_bytes();
    WeightView {
        dtype: a.dtype,
        bytes: &a.bytes[g * o_lora * rb..(g + 1) * o_lora * rb],
        rows: o_lora,
        cols: a.cols,
    }
}

fn pool_up<'a>(b: &mut Builder<'a>, p: &Pool<'a>, what: &str) -> Result<(), GpuError> {
    b.mat(&p.kv, what)?;
    b.mat(&p.gate, what)?;
    b.vec(&p.bias);
    b.vec(&p.norm);
    Ok(())
}

fn hc_up(b: &mut Builder<'_>, h: &Hc) {
    b.vec(&h.fn_);
    b.vec(&h.base);
}

/// Every weight V4's graph passes, into the arena (`GpuState::attach`).
pub(super) fn upload<'a>(
    b: &mut Builder<'a>,
    gpu: &Gpu,
    cfg: &ModelConfig,
    w: &'a V4Weights<'a>,
) -> Result<V4Up, GpuError> {
    let v = p(cfg)?;
    // The routed experts are resident (the VRAM pool does not stage V4's yet): refuse by name
    // a model whose experts alone exceed the free VRAM, before the arena is allocated.
    let experts: usize = w
        .layers
        .iter()
        .flat_map(|l| {
            let x = &l.moe.experts;
            x.gate.iter().chain(&x.up).chain(&x.down)
        })
        .map(|m| m.bytes.len())
        .sum();
    let (free, _) = gpu.mem_info()?;
    if experts > free {
        return Err(GpuError::Config(format!(
            "DeepSeek-V4's routed experts ({:.1} GB) stay resident in VRAM on the GPU path and exceed the {:.1} GB free (streaming them through the VRAM pool is not implemented); use --gpu off or fewer layers",
            experts as f64 / 1e9,
            free as f64 / 1e9
        )));
    }
    b.vec(&w.main_freq.0);
    b.vec(&w.compress_freq.0);
    b.vec(&w.head.fn_);
    b.vec(&w.head.base);
    let mut layers = Vec::with_capacity(w.layers.len());
    let mut keep = Vec::new();
    for (l, lw) in w.layers.iter().enumerate() {
        let what = format!("layer {l}");
        hc_up(b, &lw.attn_hc);
        hc_up(b, &lw.ffn_hc);
        b.vec(&lw.attn_norm);
        b.vec(&lw.ffn_norm);
        let a = &lw.attn;
        for m in [&a.q_a, &a.q_b, &a.kv, &a.o_b] {
            b.mat(m, &what)?;
        }
        for g in 0..v.o_groups {
            b.mat(&o_a_group(&a.o_a, v.o_lora, g), &what)?;
        }
        for x in [&a.q_a_norm, &a.kv_norm, &a.sinks] {
            b.vec(x);
        }
        if let Some(c) = &a.comp {
            pool_up(b, c, &what)?;
        }
        if let Some(ix) = &a.indexer {
            pool_up(b, &ix.pool, &what)?;
            b.mat(&ix.q_b, &what)?;
            b.mat(&ix.w, &what)?;
        }
        let m = &lw.moe;
        b.mat(&m.router, &what)?;
        b.vec(&m.bias);
        for x in [&m.sh_gate, &m.sh_up, &m.sh_down] {
            b.mat(x, &what)?;
        }
        let x = &m.experts;
        let (Some(g0), Some(d0)) = (x.gate.first(), x.down.first()) else {
            return Err(GpuError::Config(format!(
                "{what}: MoE layer without experts"
            )));
        };
        if x.up.iter().chain(&x.gate).any(|u| u.dtype != g0.dtype) {
            return Err(GpuError::Config(format!(
                "{what}: expert gate and up types differ; the GPU kernel takes one type for both"
            )));
        }
        let t = |d: crate::dtype::DType| d.name().to_ascii_lowercase();
        let raw = gpu.function(&format!("moe_gate_up_raw_{}", t(g0.dtype))).map_err(|_| {
            GpuError::Config(format!(
                "{what}: DeepSeek-V4 experts of type {} have no GPU kernel (the clamped SwiGLU takes F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ2_XXS, MXFP4)",
                g0.dtype.name()
            ))
        })?;
        let down = gpu.function(&format!("moe_down_{}", t(d0.dtype)))?;
        let mut experts = Vec::with_capacity(x.gate.len());
        for ((g, u), d) in x.gate.iter().zip(&x.up).zip(&x.down) {
            if d.dtype != d0.dtype {
                return Err(GpuError::Config(format!(
                    "{what}: expert down projections of several types"
                )));
            }
            experts.push([
                b.mat(g, &what)?.off,
                b.mat(u, &what)?.off,
                b.mat(d, &what)?.off,
            ]);
        }
        let t2e = m.tid2eid.as_ref().map(|t| {
            let bits: Vec<f32> = t.iter().map(|&e| f32::from_bits(e)).collect();
            let off = b.vec(&bits);
            keep.push(bits);
            off
        });
        layers.push(V4Layer {
            raw,
            down,
            ffn: g0.rows,
            rb_gate: g0.row_bytes(),
            rb_down: d0.row_bytes(),
            experts,
            t2e,
        });
    }
    Ok(V4Up { layers, _t2e: keep })
}

impl V4Dev {
    /// The scratch for `batch` rows and a context of `ctx`, the expert tables of the arena at
    /// `arena` (device address).
    pub(super) fn new(
        gpu: &Gpu,
        cfg: &ModelConfig,
        up: V4Up,
        arena: u64,
        batch: usize,
        ctx: usize,
    ) -> Result<V4Dev, GpuError> {
        let v = p(cfg)?;
        let f = |n: usize| gpu.alloc(4 * n.max(1));
        let (h, hd, heads, e, k) = (
            cfg.hidden,
            cfg.head_dim,
            cfg.n_heads,
            cfg.n_experts,
            cfg.n_experts_used,
        );
        if e > 1024 {
            return Err(GpuError::Config(format!(
                "DeepSeek-V4 with {e} experts: the GPU job builder takes at most 1024"
            )));
        }
        let fmax = up.layers.iter().map(|l| l.ffn).max().unwrap_or(0);
        let k_fn = |n: &str| gpu.function(n);
        let kern = Kern {
            expand: k_fn("v4_hc_expand")?,
            mix: k_fn("v4_hc_mix")?,
            weights: k_fn("v4_hc_weights")?,
            collapse: k_fn("v4_hc_collapse")?,
            post: k_fn("v4_hc_post")?,
            norm_rope: k_fn("v4_norm_rope")?,
            store: k_fn("v4_store")?,
            pool: k_fn("v4_pool")?,
            idx_scores: k_fn("v4_idx_scores")?,
            idx_select: k_fn("v4_idx_select")?,
            attend: k_fn("v4_attend")?,
            route: k_fn("v4_route")?,
            swiglu: k_fn("v4_swiglu")?,
            combine: k_fn("v4_combine")?,
            build_jobs: k_fn("build_jobs")?,
        };
        let entries = ctx / v.csa_rate.max(1) + 1;
        let irows = batch.min(((1usize << 24) / entries).max(1));
        let has = |kind| v.kinds.contains(&kind);
        let mut extra = 0;
        if has(LayerKind::Csa) {
            extra = extra.max(v.idx_topk.min(ctx / v.csa_rate.max(1)));
        }
        if has(LayerKind::Hca) {
            extra = extra.max(ctx / v.hca_rate.max(1));
        }
        let nmax = v.window.min(ctx) + extra;
        let arows = batch.min(((1usize << 26) / (heads * nmax).max(1)).max(1));
        let mut etab = Vec::with_capacity(24 * e * up.layers.len());
        for l in &up.layers {
            for x in &l.experts {
                for o in x {
                    etab.extend_from_slice(&(arena + *o as u64).to_le_bytes());
                }
            }
        }
        let etab_buf = gpu.alloc(etab.len().max(1))?;
        gpu.upload(etab_buf.ptr, &etab)?;
        let cw = 2 * hd.max(v.idx_dim);
        Ok(V4Dev {
            k: kern,
            layers: up.layers,
            streams: f(batch * v.hc * h)?,
            mix: f(batch * (2 + v.hc) * v.hc)?,
            post: f(batch * v.hc)?,
            comb: f(batch * v.hc * v.hc)?,
            qr: f(batch * v.q_lora)?,
            kv: f(batch * hd)?,
            ckv: f(batch * cw)?,
            cgate: f(batch * cw)?,
            iq: f(batch * v.idx_heads * v.idx_dim)?,
            iw: f(batch * v.idx_heads)?,
            isc: f(irows * entries)?,
            irows,
            entries,
            isel: f(batch * v.idx_topk)?,
            sc: f(arows * heads * nmax)?,
            arows,
            nmax,
            oa: f(batch * v.o_groups * v.o_lora)?,
            router: f(batch * e)?,
            selw: f(batch * k)?,
            jobs: gpu.alloc(JOB_BYTES * e.max(1))?,
            njobs: gpu.alloc(4)?,
            hu: f(batch * k * fmax)?,
            etab: etab_buf,
        })
    }
}

impl GpuState {
    fn v4(&self) -> Result<&V4Dev, GpuError> {
        self.v4
            .as_ref()
            .ok_or_else(|| GpuError::Config("no DeepSeek-V4 state on the device".into()))
    }

    fn v4_vec(&self, v: &[f32]) -> Result<u64, GpuError> {
        let off = self.vecs.get(&key(v)).copied().ok_or_else(|| {
            GpuError::Config(format!(
                "a {}-float V4 vector not uploaded at attach",
                v.len()
            ))
        })?;
        Ok(self.wa(off))
    }

    fn v4_mat(&self, w: &WeightView<'_>) -> Result<Mat, GpuError> {
        self.mats.get(&key(w.bytes)).copied().ok_or_else(|| {
            GpuError::Config(format!(
                "a {}x{} V4 weight not uploaded at attach",
                w.rows, w.cols
            ))
        })
    }

    /// Product of rows 0..n of `x` (row stride ldx) with `w` into `y` (row stride ldy).
    fn v4_mm(
        &self,
        w: &WeightView<'_>,
        x: u64,
        ldx: usize,
        n: usize,
        y: u64,
        ldy: usize,
    ) -> Result<(), GpuError> {
        let m = self.v4_mat(w)?;
        self.mm(&m, x, ldx, n, y, ldy)
    }

    /// Offset of the graph's position `pos` from the chunk's (what the device holds).
    fn v4_padd(&self, pos: usize) -> i32 {
        (pos as i64 - self.at.0 as i64) as i32
    }

    /// Rows 0..n of X copied into every stream.
    pub(super) fn v4_hc_expand(&self, cfg: &ModelConfig, n: usize) -> Result<(), GpuError> {
        let (d, v) = (self.v4()?, p(cfg)?);
        let len = n * v.hc * cfg.hidden;
        self.launch(
            d.k.expand,
            ((len as u32).div_ceil(T), 1, 1),
            T,
            0,
            &[
                self.bufs.x.ptr.into(),
                d.streams.ptr.into(),
                (cfg.hidden as i32).into(),
                (v.hc as i32).into(),
                (len as i32).into(),
            ],
        )
    }

    /// The mix of `fn_` (`mix_n` rows) over each row's normed streams, into `mix`.
    fn v4_mix(
        &self,
        cfg: &ModelConfig,
        fn_: &[f32],
        mix_n: usize,
        n: usize,
    ) -> Result<(), GpuError> {
        let (d, v) = (self.v4()?, p(cfg)?);
        self.launch(
            d.k.mix,
            (mix_n as u32, n as u32, 1),
            T,
            0,
            &[
                d.streams.ptr.into(),
                self.v4_vec(fn_)?.into(),
                (mix_n as i32).into(),
                ((v.hc * cfg.hidden) as i32).into(),
                cfg.rms_eps.into(),
                d.mix.ptr.into(),
            ],
        )
    }

    /// The streams of rows 0..n collapsed by sigmoid(mix[..hc] * s + base) + eps into `out`.
    fn v4_collapse(
        &self,
        cfg: &ModelConfig,
        ms: usize,
        base: &[f32],
        s: f32,
        n: usize,
        out: u64,
    ) -> Result<(), GpuError> {
        let (d, v) = (self.v4()?, p(cfg)?);
        let h = cfg.hidden;
        self.launch(
            d.k.collapse,
            ((h as u32).div_ceil(T), n as u32, 1),
            T,
            0,
            &[
                d.mix.ptr.into(),
                (ms as i32).into(),
                self.v4_vec(base)?.into(),
                s.into(),
                v.hc_eps.into(),
                d.streams.ptr.into(),
                (v.hc as i32).into(),
                (h as i32).into(),
                out.into(),
            ],
        )
    }

    /// A hyper-connection's mix of rows 0..n: pre-collapsed streams into xn, post and comb kept.
    pub(super) fn v4_hc_pre(&self, cfg: &ModelConfig, w: &Hc, n: usize) -> Result<(), GpuError> {
        let (d, v) = (self.v4()?, p(cfg)?);
        let mix_n = (2 + v.hc) * v.hc;
        self.v4_mix(cfg, &w.fn_, mix_n, n)?;
        self.launch(
            d.k.weights,
            ((n as u32).div_ceil(64), 1, 1),
            64,
            0,
            &[
                d.mix.ptr.into(),
                self.v4_vec(&w.base)?.into(),
                w.scale[1].into(),
                w.scale[2].into(),
                (v.hc as i32).into(),
                (v.hc_iters as i32).into(),
                v.hc_eps.into(),
                d.post.ptr.into(),
                d.comb.ptr.into(),
                (n as i32).into(),
            ],
        )?;
        self.v4_collapse(cfg, mix_n, &w.base, w.scale[0], n, self.bufs.xn.ptr)
    }

    /// Streams of rows 0..n = post x proj + comb^T x streams.
    pub(super) fn v4_hc_post(&self, cfg: &ModelConfig, n: usize) -> Result<(), GpuError> {
        let (d, v) = (self.v4()?, p(cfg)?);
        let h = cfg.hidden;
        self.launch(
            d.k.post,
            ((h as u32).div_ceil(T), n as u32, 1),
            T,
            0,
            &[
                d.streams.ptr.into(),
                self.bufs.proj.ptr.into(),
                d.post.ptr.into(),
                d.comb.ptr.into(),
                (v.hc as i32).into(),
                (h as i32).into(),
            ],
        )
    }

    /// The final collapse of the streams of rows 0..n into x.
    pub(super) fn v4_hc_head(
        &self,
        cfg: &ModelConfig,
        w: &HcHead,
        n: usize,
    ) -> Result<(), GpuError> {
        let v = p(cfg)?;
        self.v4_mix(cfg, &w.fn_, v.hc, n)?;
        self.v4_collapse(cfg, v.hc, &w.base, w.scale, n, self.bufs.x.ptr)
    }

    /// `v4_norm_rope` over `parts` pieces of `part` values of rows 0..n of x (row stride ld).
    #[allow(clippy::too_many_arguments)]
    fn v4_norm_rope(
        &self,
        x: u64,
        ld: usize,
        (part, parts): (usize, usize),
        norm: Option<Option<&[f32]>>,
        eps: f32,
        rope: Option<Rot<'_>>,
        n: usize,
        padd: i32,
    ) -> Result<(), GpuError> {
        let d = self.v4()?;
        let (mode, w) = match norm {
            None => (0i32, 0u64),
            Some(None) => (1, 0),
            Some(Some(w)) => (2, self.v4_vec(w)?),
        };
        let (rd, fr, ms, back) = match rope {
            Some((f, rd, back)) => (rd, self.v4_vec(&f.0)?, f.1, back),
            None => (0, 0, 1.0, false),
        };
        self.launch(
            d.k.norm_rope,
            (parts as u32, n as u32, 1),
            128,
            0,
            &[
                x.into(),
                (ld as i32).into(),
                (part as i32).into(),
                mode.into(),
                w.into(),
                eps.into(),
                (rd as i32).into(),
                fr.into(),
                ms.into(),
                self.bufs.pos.ptr.into(),
                padd.into(),
                i32::from(back).into(),
            ],
        )
    }

    /// Rows 0..n of src (row stride ss, `width` values) to rows pos.. of a cache layer (row
    /// stride ds) at column doff.
    #[allow(clippy::too_many_arguments)]
    fn v4_store(
        &self,
        src: u64,
        ss: usize,
        dst: u64,
        ds: usize,
        doff: usize,
        width: usize,
        n: usize,
        padd: i32,
    ) -> Result<(), GpuError> {
        let d = self.v4()?;
        self.launch(
            d.k.store,
            (n as u32, 1, 1),
            128,
            0,
            &[
                src.into(),
                (ss as i32).into(),
                dst.into(),
                (ds as i32).into(),
                (doff as i32).into(),
                (width as i32).into(),
                self.bufs.pos.ptr.into(),
                padd.into(),
            ],
        )
    }

    /// V4 attention of rows 0..n of xn at position `pos` into proj, rows written to cache
    /// layer `l` (`deepseek_v4::cpu_attention`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn v4_attention(
        &self,
        model: &Model<'_>,
        l: usize,
        a: &Attn<'_>,
        w: &V4Weights<'_>,
        n: usize,
        pos: usize,
    ) -> Result<(), GpuError> {
        let cfg = &model.cfg;
        let (d, v) = (self.v4()?, p(cfg)?);
        let (h, hd, heads, eps) = (cfg.hidden, cfg.head_dim, cfg.n_heads, cfg.rms_eps);
        let (rd, ctx) = (v.rope_dim, self.ctx);
        let kind = v.kinds[l];
        let freq = if kind == LayerKind::Sliding {
            &w.main_freq
        } else {
            &w.compress_freq
        };
        let (kw, vw) = (v.k_width(hd), v.v_width(hd));
        let padd = self.v4_padd(pos);
        let (xn, q, ql) = (self.bufs.xn.ptr, self.bufs.q.ptr, v.q_lora);
        let kl = self.bufs.kcache.f(l * ctx * kw);
        let vl = self.bufs.vcache.f(l * ctx * vw);
        // q: q_a -> q_a_norm -> q_b -> per-head unweighted norm -> rope.
        self.v4_mm(&a.q_a, xn, h, n, d.qr.ptr, ql)?;
        self.v4_norm_rope(
            d.qr.ptr,
            ql,
            (ql, 1),
            Some(Some(&a.q_a_norm)),
            eps,
            None,
            n,
            padd,
        )?;
        self.v4_mm(&a.q_b, d.qr.ptr, ql, n, q, heads * hd)?;
        let rope = Some((freq, rd, false));
        self.v4_norm_rope(q, heads * hd, (hd, heads), Some(None), eps, rope, n, padd)?;
        // The shared kv, into the K rows.
        self.v4_mm(&a.kv, xn, h, n, d.kv.ptr, hd)?;
        self.v4_norm_rope(
            d.kv.ptr,
            hd,
            (hd, 1),
            Some(Some(&a.kv_norm)),
            eps,
            rope,
            n,
            padd,
        )?;
        self.v4_store(d.kv.ptr, hd, kl, kw, 0, hd, n, padd)?;
        // The compressors: raw projections into the V rows, then each window closing in the
        // chunk pooled into the K row of its last position.
        let rate = match kind {
            LayerKind::Csa => v.csa_rate,
            LayerKind::Hca => v.hca_rate,
            LayerKind::Sliding => 0,
        };
        let pools = [
            (
                a.comp.as_ref(),
                if kind == LayerKind::Csa { 2 } else { 1 },
                hd,
                0,
                hd,
            ),
            (
                a.indexer.as_ref().map(|x| &x.pool),
                2,
                v.idx_dim,
                4 * hd,
                2 * hd,
            ),
        ];
        for (pl, coff, dim, voff, koff) in pools {
            let Some(pl) = pl else { continue };
            let wd = coff * dim;
            self.v4_mm(&pl.kv, xn, h, n, d.ckv.ptr, wd)?;
            self.v4_mm(&pl.gate, xn, h, n, d.cgate.ptr, wd)?;
            self.v4_store(d.ckv.ptr, wd, vl, vw, voff, wd, n, padd)?;
            self.v4_store(d.cgate.ptr, wd, vl, vw, voff + 2 * dim, wd, n, padd)?;
            self.launch(
                d.k.pool,
                (n as u32, 1, 1),
                128,
                (4 * dim) as u32,
                &[
                    vl.into(),
                    (vw as i32).into(),
                    kl.into(),
                    (kw as i32).into(),
                    (koff as i32).into(),
                    self.v4_vec(&pl.bias)?.into(),
                    self.v4_vec(&pl.norm)?.into(),
                    (rate as i32).into(),
                    (coff as i32).into(),
                    (dim as i32).into(),
                    (voff as i32).into(),
                    eps.into(),
                    (rd as i32).into(),
                    self.v4_vec(&w.compress_freq.0)?.into(),
                    w.compress_freq.1.into(),
                    self.bufs.pos.ptr.into(),
                    padd.into(),
                ],
            )?;
        }
        // The indexer: queries and head weights, then per row its top entries (rows with more
        // closed windows than index_topk).
        if let Some(ix) = &a.indexer {
            let (ih, id) = (v.idx_heads, v.idx_dim);
            self.v4_mm(&ix.q_b, d.qr.ptr, ql, n, d.iq.ptr, ih * id)?;
            self.v4_mm(&ix.w, xn, h, n, d.iw.ptr, ih)?;
            let rope = Some((&w.compress_freq, rd, false));
            self.v4_norm_rope(d.iq.ptr, ih * id, (id, ih), None, eps, rope, n, padd)?;
            self.scale(d.iw.ptr, n * ih, (ih as f32).powf(-0.5))?;
            let mut c0 = 0;
            while c0 < n {
                let cn = d.irows.min(n - c0);
                let pc = padd + c0 as i32;
                self.launch(
                    d.k.idx_scores,
                    ((d.entries as u32).div_ceil(8), cn as u32, 1),
                    T,
                    0,
                    &[
                        d.iq.f(c0 * ih * id).into(),
                        d.iw.f(c0 * ih).into(),
                        kl.into(),
                        (kw as i32).into(),
                        ((2 * hd) as i32).into(),
                        (rate as i32).into(),
                        (ih as i32).into(),
                        (id as i32).into(),
                        (id as f32).powf(-0.5).into(),
                        (v.idx_topk as i32).into(),
                        self.bufs.pos.ptr.into(),
                        pc.into(),
                        d.isc.ptr.into(),
                        (d.entries as i32).into(),
                    ],
                )?;
                self.launch(
                    d.k.idx_select,
                    (cn as u32, 1, 1),
                    1024,
                    0,
                    &[
                        d.isc.ptr.into(),
                        (d.entries as i32).into(),
                        (v.idx_topk as i32).into(),
                        (rate as i32).into(),
                        self.bufs.pos.ptr.into(),
                        pc.into(),
                        d.isel.f(c0 * v.idx_topk).into(),
                    ],
                )?;
                c0 += cn;
            }
        }
        // Attention over the window and the compressed entries.
        let kind_i = match kind {
            LayerKind::Sliding => 0i32,
            LayerKind::Csa => 1,
            LayerKind::Hca => 2,
        };
        let mut c0 = 0;
        while c0 < n {
            let cn = d.arows.min(n - c0);
            self.launch(
                d.k.attend,
                (heads as u32, cn as u32, 1),
                128,
                (4 * hd) as u32,
                &[
                    (q + 4 * (c0 * heads * hd) as u64).into(),
                    kl.into(),
                    (kw as i32).into(),
                    (hd as i32).into(),
                    (v.window as i32).into(),
                    kind_i.into(),
                    (rate.max(1) as i32).into(),
                    (v.idx_topk as i32).into(),
                    d.isel.f(c0 * v.idx_topk).into(),
                    self.v4_vec(&a.sinks)?.into(),
                    (hd as f32).powf(-0.5).into(),
                    d.sc.ptr.into(),
                    (d.nmax as i32).into(),
                    self.bufs.att.f(c0 * heads * hd).into(),
                    (rd as i32).into(),
                    self.v4_vec(&freq.0)?.into(),
                    freq.1.into(),
                    self.bufs.pos.ptr.into(),
                    (padd + c0 as i32).into(),
                ],
            )?;
            c0 += cn;
        }
        // Grouped output projection: each group's heads through its block of o_a, then o_b.
        let (g, ol) = (v.o_groups, v.o_lora);
        let gw = heads * hd / g;
        for gi in 0..g {
            let m = o_a_group(&a.o_a, ol, gi);
            let x = self.bufs.att.f(gi * gw);
            self.v4_mm(&m, x, heads * hd, n, d.oa.f(gi * ol), g * ol)?;
        }
        self.v4_mm(&a.o_b, d.oa.ptr, g * ol, n, self.bufs.proj.ptr, h)
    }

    /// V4's MoE block of rows 0..n of xn (layer `l`) into proj (`deepseek_v4::cpu_moe`).
    pub(super) fn v4_moe(
        &self,
        cfg: &ModelConfig,
        l: usize,
        m: &MoeW<'_>,
        n: usize,
    ) -> Result<(), GpuError> {
        let (d, v) = (self.v4()?, p(cfg)?);
        let (h, e, k) = (cfg.hidden, cfg.n_experts, cfg.n_experts_used);
        let ly = d.layers.get(l).ok_or_else(|| {
            GpuError::Config(format!(
                "DeepSeek-V4 layer {l} has no experts on the device"
            ))
        })?;
        let xn = self.bufs.xn.ptr;
        self.v4_mm(&m.router, xn, h, n, d.router.ptr, e)?;
        let score = match v.score {
            Score::SqrtSoftplus => 0i32,
            Score::Sigmoid => 1,
            Score::Softmax => 2,
        };
        self.launch(
            d.k.route,
            (n as u32, 1, 1),
            32,
            (4 * e) as u32,
            &[
                d.router.ptr.into(),
                (e as i32).into(),
                (k as i32).into(),
                score.into(),
                self.v4_vec(&m.bias)?.into(),
                ly.t2e.map_or(0, |o| self.wa(o)).into(),
                self.bufs.tokens.ptr.into(),
                v.routed_scale.into(),
                self.bufs.sel.ptr.into(),
                d.selw.ptr.into(),
            ],
        )?;
        self.launch(
            d.k.build_jobs,
            (1, 1, 1),
            (e as u32).next_multiple_of(32),
            (12 * e) as u32,
            &[
                self.bufs.sel.ptr.into(),
                (n as i32).into(),
                (k as i32).into(),
                (e as i32).into(),
                d.etab.at(l * e * 24).into(),
                d.jobs.ptr.into(),
                self.bufs.tok.ptr.into(),
                self.bufs.dst.ptr.into(),
                d.njobs.ptr.into(),
                self.bufs.stat.ptr.into(),
            ],
        )?;
        let (f, jobs, nj) = (ly.ffn, d.jobs.ptr, d.njobs.ptr);
        let grid_y = e.min(n * k) as u32;
        self.launch(
            ly.raw,
            ((f as u32).div_ceil(WARPS), grid_y, 1),
            32 * WARPS,
            0,
            &[
                jobs.into(),
                nj.into(),
                (f as i32).into(),
                (h as i32).into(),
                (ly.rb_gate as i64).into(),
                xn.into(),
                (h as i32).into(),
                self.bufs.tok.ptr.into(),
                self.bufs.hb.ptr.into(),
                d.hu.ptr.into(),
            ],
        )?;
        self.v4_swiglu(self.bufs.hb.ptr, d.hu.ptr, n * k * f, v.limit)?;
        self.launch(
            ly.down,
            ((h as u32).div_ceil(WARPS), grid_y, 1),
            32 * WARPS,
            0,
            &[
                jobs.into(),
                nj.into(),
                (h as i32).into(),
                (f as i32).into(),
                (ly.rb_down as i64).into(),
                self.bufs.hb.ptr.into(),
                self.bufs.dst.ptr.into(),
                self.bufs.slot_out.ptr.into(),
            ],
        )?;
        // The shared expert into proj, then each row's routed outputs in slot order.
        let sf = m.sh_gate.rows;
        let (g, u) = (self.bufs.gate.ptr, self.bufs.up.ptr);
        self.v4_mm(&m.sh_gate, xn, h, n, g, sf)?;
        self.v4_mm(&m.sh_up, xn, h, n, u, sf)?;
        self.v4_swiglu(g, u, n * sf, v.limit)?;
        self.v4_mm(&m.sh_down, g, sf, n, self.bufs.proj.ptr, h)?;
        self.launch(
            d.k.combine,
            ((h as u32).div_ceil(T), n as u32, 1),
            T,
            0,
            &[
                self.bufs.proj.ptr.into(),
                self.bufs.slot_out.ptr.into(),
                d.selw.ptr.into(),
                (k as i32).into(),
                (h as i32).into(),
            ],
        )
    }

    fn v4_swiglu(&self, g: u64, u: u64, len: usize, limit: f32) -> Result<(), GpuError> {
        let d = self.v4()?;
        self.launch(
            d.k.swiglu,
            ((len as u32).div_ceil(T), 1, 1),
            T,
            0,
            &[g.into(), u.into(), (len as i32).into(), limit.into()],
        )
    }
}
