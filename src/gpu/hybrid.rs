//! Qwen3-Next / Qwen3.5-MoE's hybrid layers on the device (kernels in `kernels_hybrid.cu`): the
//! Gated DeltaNet (projections, causal conv with its rolling state, the delta rule with its
//! recurrent state, the gated RMSNorm, out_proj), the gated full attention (q/gate split, the
//! common q/k norm + partial rope + cache store and attention, the sigmoid output gate) and the
//! shared expert's sigmoid gate.
//!
//! Owns: `HybridDev` (the per-sequence conv and delta-rule states of every linear layer, in VRAM,
//! and the mixers' scratch), the attach-time layout of the mixer weights (`upload_mixer`: the
//! Qwen3-Next checkpoints' per-key-head grouped projections are reordered once, so one product
//! gives [q; k; v; z] and [b; a] ungrouped) and the launchers `backend.rs` calls.
//! Does not own: the formulas (model/qwen3next.rs, cpu.rs), the attention and cache (model.rs).
//! Invariant: the state is the device's and follows the CPU's rule: a chunk at position 0 starts
//! from zero (the kernels read the position from the device, so a captured decode step replays
//! correctly); `State::truncate` below the end restarts the sequence at 0, so no stale state is
//! ever continued. The CPU state (`State::hybrid`) is not used while the device runs the forward.

use super::driver::{DevBuf, Gpu, Kernel};
use super::model::{Builder, GpuState, Mat};
use super::GpuError;
use crate::model::qwen3next::{DeltaNet, Hybrid, Mixer};
use crate::model::ModelConfig;

pub(super) struct HybridDev {
    conv_k: Kernel,
    delta_k: Kernel,
    split_k: Kernel,
    sigmul_k: Kernel,
    gate_k: Kernel,
    pub(super) hy: Hybrid,
    /// (n_linear, K - 1, conv_dim) the last conv inputs, oldest first.
    conv: DevBuf,
    /// (n_linear, v_heads, k_dim, v_dim) delta-rule states.
    rec: DevBuf,
    /// (batch, conv_dim + value_dim): [q; k; v] (conv'd in place), then z.
    mixed: DevBuf,
    /// (batch, 2 v_heads): [b; a].
    ba: DevBuf,
    /// (batch, value_dim) the DeltaNet's output before out_proj.
    core: DevBuf,
    /// (batch, 2 q_dim) gated attention's q_proj output; (batch, q_dim) its gate.
    pub(super) qg: DevBuf,
    pub(super) gate: DevBuf,
    /// Rows of the delta rule per column thread group (a power of two).
    parts: usize,
}

impl HybridDev {
    pub(super) fn new(
        gpu: &Gpu,
        cfg: &ModelConfig,
        hy: &Hybrid,
        batch: usize,
    ) -> Result<HybridDev, GpuError> {
        // `gpu::refusal` has refused shapes the kernels cannot take; attach checks it first.
        let parts = super::hybrid_parts(hy);
        let f = |n: usize| gpu.alloc(4 * n.max(1));
        let nl = hy.n_linear();
        let conv = f(nl * hy.conv_state())?;
        let rec = f(nl * hy.rec_state())?;
        // Zeroed once; a chunk at position 0 zeroes its layer's state again in the kernels.
        gpu.upload(conv.ptr, &vec![0u8; conv.bytes])?;
        gpu.upload(rec.ptr, &vec![0u8; rec.bytes])?;
        Ok(HybridDev {
            conv_k: gpu.function("gdn_conv")?,
            delta_k: gpu.function("gdn_delta")?,
            split_k: gpu.function("gated_split")?,
            sigmul_k: gpu.function("sigmoid_mul")?,
            gate_k: gpu.function("shared_gate_add")?,
            hy: hy.clone(),
            conv,
            rec,
            mixed: f(batch * (hy.conv_dim() + hy.value_dim()))?,
            ba: f(batch * 2 * hy.v_heads)?,
            core: f(batch * hy.value_dim())?,
            qg: f(batch * 2 * cfg.q_dim())?,
            gate: f(batch * cfg.q_dim())?,
            parts,
        })
    }

    /// Bytes of the per-sequence state (conv inputs and delta-rule states).
    pub(super) fn state_bytes(&self) -> usize {
        self.conv.bytes + self.rec.bytes
    }
}

/// The rows of Qwen3-Next's grouped in_proj_qkvz (per key head [q; k; v (r dv); z (r dv)]) in
/// the order [q; k; v; z] (`qwen3next::ungroup`).
fn qkvz_order(hy: &Hybrid) -> Vec<usize> {
    let (dk, dv, r) = (hy.k_dim, hy.v_dim, hy.v_heads / hy.k_heads);
    let group = 2 * dk + 2 * r * dv;
    let mut order = Vec::with_capacity(hy.k_heads * group);
    for (start, len) in [
        (0, dk),
        (dk, dk),
        (2 * dk, r * dv),
        (2 * dk + r * dv, r * dv),
    ] {
        for g in 0..hy.k_heads {
            order.extend(g * group + start..g * group + start + len);
        }
    }
    order
}

/// The rows of the grouped [b (r); a (r)] per key head in the order [b; a] (`ungroup_ba`).
fn ba_order(hy: &Hybrid) -> Vec<usize> {
    let r = hy.v_heads / hy.k_heads;
    let mut order = Vec::with_capacity(2 * hy.v_heads);
    for start in [0, r] {
        for g in 0..hy.k_heads {
            order.extend(g * 2 * r + start..g * 2 * r + start + r);
        }
    }
    order
}

/// A hybrid layer's mixer weights into the device arena (`GpuState::attach`).
pub(super) fn upload_mixer<'a>(
    b: &mut Builder<'a>,
    m: &Mixer<'a>,
    hy: &Hybrid,
    what: &str,
) -> Result<(), GpuError> {
    match m {
        Mixer::Gated(a) => {
            for w in [&a.wq, &a.wk, &a.wv, &a.wo] {
                b.mat(w, what)?;
            }
            b.vec(&a.q_norm);
            b.vec(&a.k_norm);
        }
        Mixer::DeltaNet(d) => {
            if hy.fused {
                b.mat_reordered(&d.in_qkv, &qkvz_order(hy), what)?;
            } else {
                b.mat(&d.in_qkv, what)?;
            }
            if d.in_a.is_none() {
                b.mat_reordered(&d.in_b, &ba_order(hy), what)?;
            } else {
                b.mat(&d.in_b, what)?;
            }
            for w in [&d.in_z, &d.in_a].into_iter().flatten() {
                b.mat(w, what)?;
            }
            b.mat(&d.out, what)?;
            for v in [&d.conv, &d.a_neg, &d.dt_bias, &d.norm] {
                b.vec(v);
            }
        }
    }
    Ok(())
}

/// Threads per block of the element-wise kernels here.
const T: u32 = 256;

impl GpuState {
    pub(super) fn hybrid(&self) -> Result<&HybridDev, GpuError> {
        self.hybrid
            .as_ref()
            .ok_or_else(|| GpuError::Config("no hybrid-layer state on the device".into()))
    }

    /// Gated DeltaNet of linear layer `li` on xn rows 0..n into proj (row i at device position
    /// + `padd` + i). `mat`/`vec` map the layer's weights to the device (`GpuBackend`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn delta_net(
        &self,
        li: usize,
        n: usize,
        padd: i32,
        d: &DeltaNet<'_>,
        mat: impl Fn(&crate::kernels::WeightView<'_>) -> Result<Mat, crate::model::ModelError>,
        vec: impl Fn(&[f32]) -> Result<u64, crate::model::ModelError>,
        h: usize,
        eps: f32,
    ) -> Result<(), crate::model::ModelError> {
        let hd = self.hybrid()?;
        let hy = &hd.hy;
        let (kd, vd, nv, cd) = (hy.key_dim(), hy.value_dim(), hy.v_heads, hy.conv_dim());
        let w = cd + vd;
        let (xn, mixed, ba) = (self.bufs.xn.ptr, hd.mixed.ptr, hd.ba.ptr);
        // [q; k; v; z] and [b; a], ungrouped (Qwen3-Next's grouped projections were reordered at
        // attach).
        let qkv = mat(&d.in_qkv)?;
        self.mm(&qkv, xn, h, n, mixed, w)?;
        if qkv.rows == cd {
            let z = d
                .in_z
                .as_ref()
                .ok_or_else(|| GpuError::Config("Gated DeltaNet without a z projection".into()))?;
            self.mm(&mat(z)?, xn, h, n, mixed + 4 * cd as u64, w)?;
        }
        self.mm(&mat(&d.in_b)?, xn, h, n, ba, 2 * nv)?;
        if let Some(a) = &d.in_a {
            self.mm(&mat(a)?, xn, h, n, ba + 4 * nv as u64, 2 * nv)?;
        }
        let pos = self.bufs.pos.ptr;
        self.launch(
            hd.conv_k,
            ((cd as u32).div_ceil(128), 1, 1),
            128,
            0,
            &[
                mixed.into(),
                (w as i32).into(),
                (n as i32).into(),
                (cd as i32).into(),
                hd.conv.f(li * hy.conv_state()).into(),
                vec(&d.conv)?.into(),
                (hy.conv as i32).into(),
                pos.into(),
                padd.into(),
            ],
        )?;
        let p = hd.parts;
        self.launch(
            hd.delta_k,
            (nv as u32, 1, 1),
            ((hy.v_dim * p) as u32).next_multiple_of(32),
            (8 * hy.k_dim) as u32,
            &[
                mixed.into(),
                (w as i32).into(),
                ba.into(),
                (2 * nv as i32).into(),
                (mixed + 4 * cd as u64).into(),
                (w as i32).into(),
                hd.core.ptr.into(),
                (vd as i32).into(),
                hd.rec.f(li * hy.rec_state()).into(),
                vec(&d.a_neg)?.into(),
                vec(&d.dt_bias)?.into(),
                vec(&d.norm)?.into(),
                (n as i32).into(),
                (hy.k_heads as i32).into(),
                (nv as i32).into(),
                (hy.k_dim as i32).into(),
                (hy.v_dim as i32).into(),
                i32::from(hy.v_tiled).into(),
                (p as i32).into(),
                eps.into(),
                pos.into(),
                padd.into(),
            ],
        )?;
        let _ = kd;
        Ok(self.mm(&mat(&d.out)?, hd.core.ptr, vd, n, self.bufs.proj.ptr, h)?)
    }

    /// Gated attention's q_proj output (hybrid `qg`, per head [q; gate]) split into q and the
    /// hybrid `gate`, rows 0..n.
    pub(super) fn gated_split(&self, n: usize, heads: usize, hd: usize) -> Result<(), GpuError> {
        let h = self.hybrid()?;
        let len = n * heads * hd;
        self.launch(
            h.split_k,
            ((len as u32).div_ceil(T), 1, 1),
            T,
            0,
            &[
                h.qg.ptr.into(),
                self.bufs.q.ptr.into(),
                h.gate.ptr.into(),
                (heads as i32).into(),
                (hd as i32).into(),
                (len as i32).into(),
            ],
        )
    }

    /// att rows 0..n (`width` wide, packed) *= sigmoid(gate).
    pub(super) fn gate_output(&self, n: usize, width: usize) -> Result<(), GpuError> {
        let h = self.hybrid()?;
        let len = n * width;
        self.launch(
            h.sigmul_k,
            ((len as u32).div_ceil(T), 1, 1),
            T,
            0,
            &[
                self.bufs.att.ptr.into(),
                h.gate.ptr.into(),
                (len as i32).into(),
            ],
        )
    }

    /// proj rows 0..n += sigmoid(g . xn) * `down` (the shared expert's output; `g` the arena
    /// offset of the gate vector).
    pub(super) fn shared_gate_add(
        &self,
        g: usize,
        down: u64,
        n: usize,
        h: usize,
    ) -> Result<(), GpuError> {
        let k = self.hybrid()?.gate_k;
        self.launch(
            k,
            (n as u32, 1, 1),
            T,
            0,
            &[
                self.bufs.proj.ptr.into(),
                down.into(),
                self.bufs.xn.ptr.into(),
                self.wa(g).into(),
                (h as i32).into(),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hy(k_heads: usize, v_heads: usize) -> Hybrid {
        Hybrid {
            linear: vec![true],
            dense: vec![false],
            k_heads,
            v_heads,
            k_dim: 2,
            v_dim: 3,
            conv: 4,
            fused: true,
            v_tiled: false,
        }
    }

    /// The reorderings are `ungroup`'s: row i of the reordered weight is the row whose output
    /// `ungroup` puts at [q; k; v; z] / [b; a] position i.
    #[test]
    fn reorders_match_ungroup() {
        let h = hy(2, 4);
        let (kd, vd, nv) = (h.key_dim(), h.value_dim(), h.v_heads);
        let qkvz: Vec<f32> = (0..2 * kd + 2 * vd).map(|i| i as f32).collect();
        let ba: Vec<f32> = (0..2 * nv).map(|i| i as f32).collect();
        let (mut mixed, mut z) = (vec![0.0; h.conv_dim()], vec![0.0; vd]);
        let (mut b, mut a) = (vec![0.0; nv], vec![0.0; nv]);
        crate::model::qwen3next::ungroup(&h, &qkvz, &ba, &mut mixed, &mut z, &mut b, &mut a);
        let want: Vec<usize> = mixed.iter().chain(&z).map(|v| *v as usize).collect();
        assert_eq!(qkvz_order(&h), want);
        let want: Vec<usize> = b.iter().chain(&a).map(|v| *v as usize).collect();
        assert_eq!(ba_order(&h), want);
    }
}
