//! The CUDA backend: the forward graph's operations (`model::backend::Backend`) as kernel
//! launches on `GpuState`'s buffers, and whole chunks (`model::backend::Device`), the decode
//! step captured once as a CUDA graph and replayed.
//!
//! Owns: `GpuBackend` (one chunk's view: the device state, the model, the sequence state) and
//! `impl Device for GpuState`. Weights arrive as the graph passes them (`&WeightView`, f32
//! slices, per-head matrix lists) and are found in the maps `GpuState::attach` built from their
//! host addresses (no allocation per call). Buffers are the device's (`Buf` -> `DevBuf`).
//! Does not own: the graph (`model::forward`), the kernels and the MoE step (`model.rs`).
//! Invariant: every position-dependent launch reads the chunk's position from the device
//! (`bufs.pos`, written from pinned memory by the chunk's first copy) plus a constant offset,
//! so a captured decode step replays correctly at any position. What the device has no
//! kernel for is refused before weights are bound (`gpu::refusal`); an operation reached
//! anyway returns an error, never a silent skip. The one exception is an MLA model's
//! indexer buffers when it has no indexer (`skipped`): DSA's lightning indexer (V3.2, GLM-5)
//! runs on the device (`ops.rs`) and keeps its keys on cache side V.

use super::driver::Stream;
use super::model::{key, GpuState, Mat, Residual};
use crate::kernels::WeightView;
use crate::model::backend::{
    qk_prep_ops, At, Backend, Buf, Cache, Device, DeviceStats, GqaShape, HeadNorms, QkPrep, Rows,
};
use crate::model::config::RopeLayout;
use crate::model::deepseek_v4::{Attn as V4Attn, Hc, HcHead, MoeW as V4Moe, V4Weights};
use crate::model::qwen3next::{DeltaNet, GatedAttn};
use crate::model::weights::{Mla, Moe};
use crate::model::{Model, ModelError, Prof, State};
use std::time::Instant;

/// One chunk's backend: the device, the model whose weights it holds, the sequence state (its
/// expert cache, routing scratch, figures).
struct GpuBackend<'s, 'm> {
    g: &'s mut GpuState,
    model: &'s Model<'m>,
    st: &'s mut State,
    /// Work held back to be fused into the next operation (`flush` runs it as it was asked).
    pending: Pending,
}

/// Held-back work: a MoE layer's combine (into `Proj`) and a residual add `y += x` (`len`
/// values), which the next whole-row RMSNorm of `y` does in its own launch.
#[derive(Clone, Copy, Default)]
struct Pending {
    /// Rows of the MoE output not yet combined into `Proj`.
    combine: Option<usize>,
    add: Option<(u64, u64, usize)>,
}

fn unsupported(what: String) -> ModelError {
    ModelError::Unsupported(format!("GPU backend: {what}"))
}

impl GpuBackend<'_, '_> {
    /// Runs the held-back work as separate launches.
    fn flush(&mut self) -> Result<(), ModelError> {
        let p = std::mem::take(&mut self.pending);
        if let Some(n) = p.combine {
            self.g.combine(n, self.model.cfg.hidden)?;
        }
        if let Some((y, x, len)) = p.add {
            self.g.add(y, x, len)?;
        }
        Ok(())
    }

    /// The indexer's buffers of an MLA model without an indexer (MTP heads), not kept.
    fn skipped(&self, b: Buf) -> bool {
        self.g.mla && self.g.idx.is_none() && matches!(b, Buf::IdxQ | Buf::IdxK | Buf::IdxW)
    }

    fn ptr(&self, b: Buf) -> Result<u64, ModelError> {
        let bufs = &self.g.bufs;
        Ok(match b {
            Buf::X => bufs.x.ptr,
            Buf::Xn => bufs.xn.ptr,
            Buf::Q => bufs.q.ptr,
            Buf::Qa => bufs.qa.ptr,
            Buf::K => bufs.k.ptr,
            Buf::V => bufs.v.ptr,
            Buf::Att => bufs.att.ptr,
            Buf::Proj => bufs.proj.ptr,
            Buf::Hfin => bufs.hfin.ptr,
            Buf::Gate => bufs.gate.ptr,
            Buf::Up => bufs.up.ptr,
            Buf::Logits => bufs.logits.ptr,
            other => match self.g.idx_buf(other) {
                Some(p) => p,
                None => {
                    return Err(unsupported(format!(
                        "buffer {other:?} is not on the device"
                    )))
                }
            },
        })
    }

    /// Device address of row 0 of a window.
    fn at(&self, r: Rows) -> Result<u64, ModelError> {
        Ok(self.ptr(r.buf)? + 4 * (r.row0 * r.stride + r.off) as u64)
    }

    fn mat(&self, w: &WeightView<'_>) -> Result<Mat, ModelError> {
        self.g.mats.get(&key(w.bytes)).copied().ok_or_else(|| {
            unsupported(format!(
                "a {}x{} {} weight that was not uploaded at attach",
                w.rows,
                w.cols,
                w.dtype.name()
            ))
        })
    }

    fn vec(&self, v: &[f32]) -> Result<u64, ModelError> {
        let off = self.g.vecs.get(&key(v)).copied().ok_or_else(|| {
            unsupported(format!("a {}-float vector not uploaded at attach", v.len()))
        })?;
        Ok(self.g.wa(off))
    }

    /// Offset of cache position `pos` from the chunk's (the device reads the chunk's).
    fn padd(&self, pos: usize) -> i32 {
        (pos as i64 - self.g.at.0 as i64) as i32
    }

    fn rope_padd(&self, pos: usize) -> i32 {
        (pos as i64 - self.g.at.1 as i64) as i32
    }

    /// `f(x, dim, len)` over the rows of a window as packed `len`-long runs: one launch when
    /// the window is packed, else one per row.
    fn rowwise(
        &self,
        x: Rows,
        n: usize,
        mut f: impl FnMut(u64, usize) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let base = self.at(x)?;
        if x.stride == x.width {
            return f(base, n * x.width);
        }
        for i in 0..n {
            f(base + 4 * (i * x.stride) as u64, x.width)?;
        }
        Ok(())
    }
}

impl Backend for GpuBackend<'_, '_> {
    fn embed(
        &mut self,
        table: &WeightView<'_>,
        tokens: &[u32],
        dst: Buf,
    ) -> Result<(), ModelError> {
        self.flush()?;
        let m = self.mat(table)?;
        let dst = self.ptr(dst)?;
        Ok(self.g.embed(&m, tokens, dst)?)
    }

    fn matmul(
        &mut self,
        src: Rows,
        n: usize,
        outs: &[(&WeightView<'_>, Buf)],
    ) -> Result<(), ModelError> {
        self.flush()?;
        let x = self.at(src)?;
        let mut ms = [None; 3];
        let mut count = 0;
        for (w, dst) in outs {
            if self.skipped(*dst) {
                continue;
            }
            let m = self.mat(w)?;
            if m.cols != src.width {
                return Err(ModelError::Shape(format!(
                    "GPU matmul: {} inputs for a {}-column weight",
                    src.width, m.cols
                )));
            }
            let y = self.ptr(*dst)?;
            if count < ms.len() {
                ms[count] = Some((m, y, m.rows));
                count += 1;
            } else {
                self.g.mm(&m, x, src.stride, n, y, m.rows)?;
            }
        }
        let Some(first) = ms[0] else {
            return Ok(());
        };
        let ms = ms.map(|m| m.unwrap_or(first));
        Ok(self.g.mm_multi(&ms[..count], x, src.stride, n)?)
    }

    fn rmsnorm(
        &mut self,
        dst: Rows,
        src: Rows,
        n: usize,
        part: usize,
        w: &[f32],
        eps: f32,
    ) -> Result<(), ModelError> {
        let (x, y, wp) = (self.at(src)?, self.at(dst)?, self.vec(w)?);
        if part == src.width && self.g.fused {
            // The held-back residual add into these rows (and the MoE combine it adds) runs
            // in the norm's launch.
            let mut add = Residual::None;
            if let Some((ya, xa, len)) = self.pending.add {
                if ya == x && src.stride == src.width && len == n * src.width {
                    match self.pending.combine {
                        None => add = Residual::Rows(xa),
                        Some(cn) if cn == n && xa == self.g.bufs.proj.ptr => {
                            add = Residual::Combine
                        }
                        Some(_) => {}
                    }
                    if add != Residual::None {
                        self.pending = Pending::default();
                    }
                }
            }
            self.flush()?;
            let g = &self.g;
            return Ok(g.add_rmsnorm(x, src.stride, add, wp, part, n, eps, y, dst.stride)?);
        }
        self.flush()?;
        let g = &self.g;
        if part == src.width {
            return Ok(g.rmsnorm(x, src.stride, wp, part, n, eps, y, dst.stride)?);
        }
        if part == 0 || !src.width.is_multiple_of(part) {
            return Err(ModelError::Shape(format!(
                "GPU rmsnorm: {}-wide rows in {part}-wide parts",
                src.width
            )));
        }
        let per = src.width / part;
        if src.stride == src.width && dst.stride == dst.width {
            return Ok(g.rmsnorm(x, part, wp, part, n * per, eps, y, part)?);
        }
        for i in 0..n {
            let (xi, yi) = (
                x + 4 * (i * src.stride) as u64,
                y + 4 * (i * dst.stride) as u64,
            );
            g.rmsnorm(xi, part, wp, part, per, eps, yi, part)?;
        }
        Ok(())
    }

    fn layer_norm(
        &mut self,
        x: Rows,
        n: usize,
        w: &[f32],
        b: &[f32],
        eps: f64,
    ) -> Result<(), ModelError> {
        self.flush()?;
        if self.skipped(x.buf) {
            return Ok(());
        }
        let (p, wp, bp) = (self.at(x)?, self.vec(w)?, self.vec(b)?);
        Ok(self.g.layer_norm(p, x.stride, wp, bp, x.width, n, eps)?)
    }

    fn add_bias(&mut self, x: Rows, n: usize, b: &[f32]) -> Result<(), ModelError> {
        self.flush()?;
        let bp = self.vec(b)?;
        let (f, dim) = (self.g.small.add_bias, x.width);
        let g = &self.g;
        self.rowwise(x, n, |p, len| {
            Ok(g.launch(
                f,
                ((len as u32).div_ceil(256), 1, 1),
                256,
                0,
                &[
                    p.into(),
                    bp.into(),
                    (dim as i32).into(),
                    (len as i32).into(),
                ],
            )?)
        })
    }

    fn clamp(&mut self, x: Rows, n: usize, c: f32) -> Result<(), ModelError> {
        self.flush()?;
        let g = &self.g;
        self.rowwise(x, n, |p, len| Ok(g.clamp(p, len, c)?))
    }

    fn scale(&mut self, x: Rows, n: usize, s: f32) -> Result<(), ModelError> {
        self.flush()?;
        if self.skipped(x.buf) {
            return Ok(());
        }
        let g = &self.g;
        self.rowwise(x, n, |p, len| Ok(g.scale(p, len, s)?))
    }

    fn rope(
        &mut self,
        x: Rows,
        n: usize,
        head: usize,
        off: usize,
        pos: usize,
        layout: RopeLayout,
    ) -> Result<(), ModelError> {
        self.flush()?;
        if self.skipped(x.buf) {
            return Ok(());
        }
        if head == 0 || !x.width.is_multiple_of(head) {
            return Err(ModelError::Shape(format!(
                "GPU rope: {}-wide rows in {head}-wide heads",
                x.width
            )));
        }
        let p = self.at(x)?;
        let padd = self.rope_padd(pos);
        Ok(self.g.rope(
            self.model,
            p,
            x.stride,
            head,
            off,
            x.width / head,
            n,
            layout,
            padd,
        )?)
    }

    fn store_cache(
        &mut self,
        layer: usize,
        side: Cache,
        src: Rows,
        n: usize,
        pos: usize,
    ) -> Result<(), ModelError> {
        self.flush()?;
        if side == Cache::V && self.g.mla && self.g.idx.is_none() {
            // Plain MLA has no V side (V3.2's indexer keys go there).
            return Ok(());
        }
        if pos != self.g.at.0 || layer >= self.model.cfg.kv_layers() {
            return Err(unsupported(format!(
                "cache write of layer {layer} at {pos} (the chunk is at {})",
                self.g.at.0
            )));
        }
        let (kc, vc) = self.model.cfg.cache_dims();
        let (cols, cache, h16) = match side {
            Cache::K => (kc, &self.g.bufs.kcache, self.g.kv16[0]),
            Cache::V => (vc, &self.g.bufs.vcache, self.g.kv16[1]),
        };
        if src.width != cols {
            return Err(ModelError::Shape(format!(
                "GPU cache rows are {cols} wide, got {}",
                src.width
            )));
        }
        let dst = self.g.cache_layer(cache, layer, cols);
        let s = self.at(src)?;
        Ok(self.g.kv_store(s, src.stride, cols, dst, n, h16)?)
    }

    fn attend(
        &mut self,
        layer: usize,
        n: usize,
        pos: usize,
        s: GqaShape<'_>,
    ) -> Result<(), ModelError> {
        self.flush()?;
        let hd = s.head_dim;
        let (qd, kvd) = (s.heads * hd, s.kv_heads * hd);
        let g = &self.g;
        let (kl, vl) = (
            g.cache_layer(&g.bufs.kcache, layer, kvd),
            g.cache_layer(&g.bufs.vcache, layer, kvd),
        );
        let padd = self.padd(pos);
        if s.window.is_some() || s.sinks.is_some() {
            // ops.rs: the last `window` positions, each head's sink logit in its softmax.
            let sinks = s.sinks.map(|v| self.vec(v)).transpose()?.unwrap_or(0);
            return Ok(g.attention_ws(
                (g.bufs.q.ptr, qd, hd),
                (kl, kvd, hd),
                (vl, kvd, hd),
                hd,
                hd,
                s.heads / s.kv_heads.max(1),
                s.heads,
                n,
                s.scale,
                padd,
                (g.bufs.att.ptr, qd, hd),
                s.window.unwrap_or(0),
                sinks,
            )?);
        }
        Ok(g.attention(
            (g.bufs.q.ptr, qd, hd),
            (kl, kvd, hd),
            (vl, kvd, hd),
            hd,
            hd,
            s.heads / s.kv_heads.max(1),
            s.heads,
            n,
            s.scale,
            padd,
            (g.bufs.att.ptr, qd, hd),
        )?)
    }

    fn attend_mla(
        &mut self,
        layer: usize,
        n: usize,
        pos: usize,
        a: &Mla<'_>,
    ) -> Result<(), ModelError> {
        self.flush()?;
        let heads = |hs| {
            self.g
                .head_mats
                .get(&hs)
                .copied()
                .ok_or_else(|| unsupported("MLA per-head matrices not uploaded".into()))
        };
        let kv = (heads(key(&a.k_b))?, heads(key(&a.v_b))?);
        let padd = self.padd(pos);
        if self.g.idx.is_some() && (a.indexer.is_some() || a.shares_indexer) {
            // DSA (ops.rs): this layer's indexer chooses each row's positions (all of them
            // within index_topk, decided on the device so a captured decode step replays at
            // any position); GLM-5's shared layers reuse the last full layer's choice (layer 0
            // is always full).
            if a.indexer.is_some() {
                self.g.index_select(layer, n, padd)?;
            }
            return Ok(self.g.attend_mla_sparse(self.model, layer, n, kv)?);
        }
        Ok(self.g.attend_mla(self.model, layer, n, kv, padd)?)
    }

    fn swiglu(&mut self, n: usize, f: usize) -> Result<(), ModelError> {
        self.flush()?;
        let g = &self.g;
        let len = n * f;
        Ok(g.launch(
            g.small.silu_mul,
            ((len as u32).div_ceil(256), 1, 1),
            256,
            0,
            &[
                g.bufs.gate.ptr.into(),
                g.bufs.up.ptr.into(),
                (len as i32).into(),
            ],
        )?)
    }

    fn add(&mut self, dst: Buf, src: Buf, n: usize, width: usize) -> Result<(), ModelError> {
        let (y, x) = (self.ptr(dst)?, self.ptr(src)?);
        // Held back for the next RMSNorm of `dst` (a combine pending into `src` stays pending).
        if self.pending.add.is_some() || (self.pending.combine.is_some() && src != Buf::Proj) {
            self.flush()?;
        }
        self.pending.add = Some((y, x, n * width));
        Ok(())
    }

    fn copy(&mut self, dst: Rows, src: Rows, n: usize) -> Result<(), ModelError> {
        self.flush()?;
        if dst.width != src.width {
            return Err(ModelError::Shape(format!(
                "GPU copy of {}-wide rows into {}-wide rows",
                src.width, dst.width
            )));
        }
        let (s, d) = (self.at(src)?, self.at(dst)?);
        let g = &self.g;
        Ok(g.launch(
            g.small.copy2d,
            (n as u32, 1, 1),
            256,
            0,
            &[
                s.into(),
                (src.stride as i32).into(),
                d.into(),
                (dst.stride as i32).into(),
                (src.width as i32).into(),
            ],
        )?)
    }

    fn moe(&mut self, layer: usize, _m: &Moe<'_>, n: usize) -> Result<(), ModelError> {
        // The router bias, expert biases and activation were taken from the same weights at
        // attach (model.rs `GMoe`, ops.rs `ExpertAct`).
        self.flush()?;
        if self.g.moe(self.model, self.st, layer, n, true)? {
            self.pending.combine = Some(n);
        }
        Ok(())
    }

    fn qk_prep(&mut self, l: usize, n: usize, at: At, p: QkPrep<'_>) -> Result<(), ModelError> {
        self.flush()?;
        let hd = p.head_dim;
        let (kc, vc) = self.model.cfg.cache_dims();
        let norms = match p.norm {
            Some(m) if m.q_part == hd && m.k_part == hd => {
                Some((self.vec(m.q)?, self.vec(m.k)?, m.eps))
            }
            Some(_) => None,
            None => Some((0, 0, 0.0)),
        };
        let fits = self.g.fused
            && !self.g.mla
            && p.clip.is_none()
            && (1..=256).contains(&hd)
            && 2 * self.model.rope.half() <= hd
            && at.pos == self.g.at.0
            && l < self.model.cfg.kv_layers()
            && p.q.width.is_multiple_of(hd)
            && p.k.width == kc
            && p.v.width == vc
            && kc == vc
            && kc.is_multiple_of(hd);
        let Some(norms) = norms.filter(|_| fits) else {
            return qk_prep_ops(self, l, n, at, p);
        };
        let norms = p.norm.map(|_| norms);
        let qkv = [
            (self.at(p.q)?, p.q.stride),
            (self.at(p.k)?, p.k.stride),
            (self.at(p.v)?, p.v.stride),
        ];
        let rpadd = self.rope_padd(at.rope);
        Ok(self.g.qk_rope_store(
            self.model,
            qkv,
            p.q.width / hd,
            kc / hd,
            hd,
            norms,
            p.layout,
            rpadd,
            l,
            n,
        )?)
    }

    // DeepSeek V4 (v4.rs has the launchers, kernels_v4.cu the kernels).
    fn v4_hc_expand(&mut self, n: usize) -> Result<(), ModelError> {
        self.flush()?;
        Ok(self.g.v4_hc_expand(&self.model.cfg, n)?)
    }

    fn v4_hc_pre(&mut self, w: &Hc, n: usize) -> Result<(), ModelError> {
        self.flush()?;
        Ok(self.g.v4_hc_pre(&self.model.cfg, w, n)?)
    }

    fn v4_hc_post(&mut self, n: usize) -> Result<(), ModelError> {
        self.flush()?;
        Ok(self.g.v4_hc_post(&self.model.cfg, n)?)
    }

    fn v4_hc_head(&mut self, w: &HcHead, n: usize) -> Result<(), ModelError> {
        self.flush()?;
        Ok(self.g.v4_hc_head(&self.model.cfg, w, n)?)
    }

    fn v4_attention(
        &mut self,
        layer: usize,
        a: &V4Attn<'_>,
        w: &V4Weights<'_>,
        n: usize,
        at: At,
    ) -> Result<(), ModelError> {
        self.flush()?;
        if at.pos + n > self.g.ctx {
            return Err(ModelError::ContextFull {
                needed: at.pos + n,
                ctx: self.g.ctx,
            });
        }
        Ok(self.g.v4_attention(self.model, layer, a, w, n, at.pos)?)
    }

    fn v4_moe(
        &mut self,
        layer: usize,
        m: &V4Moe<'_>,
        _tokens: &[u32],
        n: usize,
    ) -> Result<(), ModelError> {
        // The rows' token ids are on the device already (the embedding's upload).
        self.flush()?;
        Ok(self.g.v4_moe(&self.model.cfg, layer, m, n)?)
    }

    // Qwen3-Next / Qwen3.5 (hybrid.rs has the launchers, kernels_hybrid.cu the kernels).
    fn gated_attention(
        &mut self,
        l: usize,
        n: usize,
        at: At,
        a: &GatedAttn<'_>,
    ) -> Result<(), ModelError> {
        self.flush()?;
        let cfg = &self.model.cfg;
        let (h, qd, kvd, hd) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        // Only the full-attention layers keep KV: their own compact slots.
        let slot = cfg
            .hybrid
            .as_deref()
            .and_then(|hy| hy.kv_slot(l))
            .ok_or_else(|| {
                ModelError::Config(format!("layer {l} is not a full-attention layer"))
            })?;
        let (wq, wk, wv) = (self.mat(&a.wq)?, self.mat(&a.wk)?, self.mat(&a.wv)?);
        let g = &self.g;
        let xn = g.bufs.xn.ptr;
        g.mm(&wq, xn, h, n, g.hybrid()?.qg.ptr, 2 * qd)?;
        g.mm(&wk, xn, h, n, g.bufs.k.ptr, kvd)?;
        g.mm(&wv, xn, h, n, g.bufs.v.ptr, kvd)?;
        g.gated_split(n, cfg.n_heads, hd)?;
        let prep = QkPrep {
            q: Rows::of(Buf::Q, qd),
            k: Rows::of(Buf::K, kvd),
            v: Rows::of(Buf::V, kvd),
            head_dim: hd,
            norm: Some(HeadNorms {
                q_part: hd,
                k_part: hd,
                q: &a.q_norm,
                k: &a.k_norm,
                eps: cfg.rms_eps,
            }),
            clip: None,
            layout: cfg.rope_layout,
        };
        self.qk_prep(slot, n, at, prep)?;
        let shape = GqaShape {
            heads: cfg.n_heads,
            kv_heads: cfg.n_kv_heads,
            head_dim: hd,
            scale: cfg.attn_scale,
            window: None,
            sinks: None,
        };
        self.attend(slot, n, at.pos, shape)?;
        self.g.gate_output(n, qd)?;
        self.matmul(Rows::of(Buf::Att, qd), n, &[(&a.wo, Buf::Proj)])
    }

    fn delta_net(
        &mut self,
        l: usize,
        n: usize,
        at: At,
        d: &DeltaNet<'_>,
    ) -> Result<(), ModelError> {
        self.flush()?;
        let cfg = &self.model.cfg;
        let li = cfg
            .hybrid
            .as_deref()
            .and_then(|hy| hy.linear_index(l))
            .ok_or_else(|| {
                ModelError::Config(format!("layer {l} is not a linear-attention layer"))
            })?;
        let padd = self.padd(at.pos);
        let (h, eps) = (cfg.hidden, cfg.rms_eps);
        let this = &*self;
        this.g
            .delta_net(li, n, padd, d, |w| this.mat(w), |v| this.vec(v), h, eps)
    }

    fn prefetch(&mut self, _next: usize, _n: usize) -> Result<(), ModelError> {
        // A hint: the VRAM pool stages what a layer chose when it runs. No device work, so
        // held-back work stays held (the attention's residual add joins the FFN norm).
        Ok(())
    }

    fn prof(&mut self) -> &mut Prof {
        &mut self.st.prof
    }
}

impl GpuState {
    /// Every launch and copy of one chunk up to (not including) the wait for its logits: the
    /// position upload, the graph, the logits and expert-count downloads.
    fn record(
        &mut self,
        model: &Model<'_>,
        st: &mut State,
        tokens: &[u32],
        logits_from: usize,
    ) -> Result<(), ModelError> {
        let compute = Stream::Compute;
        let (n, v) = (tokens.len(), model.cfg.vocab);
        let pos = st.pos;
        self.xq_src.set(None);
        self.seg_start()?;
        let p = self.host.pos.i32s_mut();
        p[0] = pos as i32;
        p[1] = pos as i32;
        // SAFETY: the pinned position pair is not written again before this chunk's sync (a
        // graph replay rewrites it only after the previous chunk's sync).
        unsafe {
            self.gpu.upload_async(
                self.bufs.pos.ptr,
                self.host.pos.as_slice().as_ptr(),
                8,
                compute,
            )?;
        }
        let mut b = GpuBackend {
            g: self,
            model,
            st,
            pending: Pending::default(),
        };
        model.forward_tokens(&mut b, tokens, pos, logits_from)?;
        b.flush()?;
        self.gpu.profile_capture_end()?;
        self.seg_stop()?;
        let n_logits = n.saturating_sub(logits_from);
        if n_logits > 0 {
            // SAFETY: the pinned logits buffer holds logit_rows x vocab >= n_logits x vocab
            // and nothing else touches it until the sync in `forward_chunk`.
            unsafe {
                self.gpu.download_async(
                    self.host.logits.as_mut_slice().as_mut_ptr(),
                    self.bufs.logits.ptr,
                    4 * n_logits * v,
                    compute,
                )?;
            }
        }
        // SAFETY: the pinned counter is read only after the sync in `forward_chunk`.
        unsafe {
            self.gpu.download_async(
                self.host.stat.as_mut_slice().as_mut_ptr(),
                self.bufs.stat.ptr,
                4,
                compute,
            )?;
        }
        Ok(())
    }

    /// Replays the captured decode step at `st.pos` with `token`.
    fn replay(&mut self, pos: usize, token: u32) -> Result<(), ModelError> {
        let compute = Stream::Compute;
        self.host.tokens.i32s_mut()[0] = token as i32;
        let p = self.host.pos.i32s_mut();
        p[0] = pos as i32;
        p[1] = pos as i32;
        let ti = self.timer_start(compute)?;
        if let Some(g) = &self.graph {
            self.gpu.launch_graph(g, compute)?;
        }
        self.timer_stop(ti, compute, false)?;
        let moe_layers = self.layer_ready.len();
        self.pool.count_hits((self.k * moe_layers) as u64);
        Ok(())
    }

    fn chunk(
        &mut self,
        model: &Model<'_>,
        st: &mut State,
        tokens: &[u32],
        logits_from: usize,
    ) -> Result<(), ModelError> {
        let compute = Stream::Compute;
        let n = tokens.len();
        let pos = st.pos;
        self.at = (pos, pos);
        st.experts_run = 0;
        // A one-token decode step with every MoE layer device-routed waits for nothing on the
        // host: it is captured as a CUDA graph once and replayed after. Its inputs are the
        // pinned token and position, copied by its first nodes; its outputs the pinned logits
        // and expert counter.
        let graph = self.graphs
            && n == 1
            && logits_from == 0
            && self.device_route
            && self.layer_ready.iter().all(|&r| r);
        if graph && self.graph.is_some() {
            self.replay(pos, tokens[0])?;
        } else if graph {
            self.gpu.begin_capture(compute)?;
            self.capturing = true;
            let r = self.record(model, st, tokens, logits_from);
            self.capturing = false;
            let g = self.gpu.end_capture(compute);
            r?;
            self.graph = Some(g?);
            self.replay(pos, tokens[0])?;
        } else {
            self.record(model, st, tokens, logits_from)?;
        }
        // Wait, then take the logits and counters.
        let (n_logits, v) = (n.saturating_sub(logits_from), model.cfg.vocab);
        self.gpu.sync(compute)?;
        if graph {
            self.gpu.profile_replay()?;
        }
        self.harvest()?;
        let runs = self.host.stat.i32s_mut()[0];
        st.experts_run += runs.wrapping_sub(self.stat_last) as u32 as usize;
        self.stat_last = runs;
        st.logits[..n_logits * v].copy_from_slice(&self.host.logits.f32s()[..n_logits * v]);
        st.pos += n;
        Ok(())
    }
}

impl Device for GpuState {
    fn forward_chunk(
        &mut self,
        model: &Model<'_>,
        st: &mut State,
        tokens: &[u32],
        logits_from: usize,
    ) -> Result<(), ModelError> {
        let t0 = Instant::now();
        self.gpu.bind()?;
        let r = self.chunk(model, st, tokens, logits_from);
        if r.is_err() {
            // Leave both streams idle so the next call starts clean.
            let _ = self.gpu.sync(Stream::Copy);
            let _ = self.gpu.sync(Stream::Compute);
            self.clear_timers();
        }
        self.stats.forwards += 1;
        self.stats.wall_secs += t0.elapsed().as_secs_f64();
        r
    }

    fn stats(&self) -> DeviceStats {
        GpuState::stats(self)
    }

    fn h2d_ceiling(&self) -> Option<f64> {
        self.h2d_ceiling_gbps
    }
}
