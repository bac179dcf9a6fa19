//! Experts computed where they live (`--gpu-experts hybrid`): with a VRAM pool smaller than
//! the routed experts, a layer's pool hits run on the GPU in one launch while its misses of
//! few tokens run on the CPU threads at the same time, from the RAM expert cache (or read from
//! the SSD into it), with the CPU's own kernels: no PCIe hop for their weights. Misses of more
//! tokens than the planner's cut (plan/gpu_experts.rs) are staged into pool slots as before.
//!
//! ```text
//! router sync (selection + the chunk's xn rows to the host)
//!   VRAM hits ------------------------------> one launch (gate_up, down) on the compute stream
//!   misses: ExpertCache::begin -> next_ready
//!     many tokens (or a free pool slot) ----> copy into a pool slot, its launch after the copy
//!     few tokens -----------------------> CPU products (kernels::matmul_jobs) into `out` rows
//!                                           -> uploaded into slot_out's (token, slot) rows
//! combine (slot order) as for every placement
//! ```
//!
//! Owns: `Split` (the host copies of xn and of the CPU's outputs) and the wave loop of a
//! partial pool's misses (`--gpu-experts hybrid`, and `stage` through the same waves).
//! Does not own: the choice (plan/gpu_experts.rs), the CPU's products and their timing
//! (cpu_experts.rs), staging one expert (`GpuState::stage_one`), the pool's bookkeeping
//! (pool.rs).
//! Invariant: each expert's output lands in its tokens' top-k rows of `slot_out` and the one
//! combine sums them in slot order, so where an expert ran never changes which products are
//! summed or in which order; CPU and GPU products of one expert differ by f32 summation order
//! only (both quantize activations per 32 values for 8-bit weights; f32 weights keep f32).

use super::cpu_experts::{cpu_refusal, CpuExperts, Job, BATCH};
use super::driver::{PinnedBuf, Stream};
use super::model::{GpuState, MoeGeo};
use crate::experts::ExpertCache;
use crate::kernels::WeightView;
use crate::model::{Model, ModelError, State};
use crate::plan::gpu_experts::CPU_MAX_TOKENS;

/// The hybrid path's host side.
pub(super) struct Split {
    /// Misses with at most this many tokens run on the CPU; larger ones are staged.
    pub(super) cpu_max_tokens: usize,
    /// The chunk's normed rows (xn), downloaded with the selection: (batch, hidden).
    xn: PinnedBuf,
    /// The CPU's expert outputs in slot layout: (batch, k, hidden), uploaded row by row into
    /// `slot_out` (the rows the GPU's experts write are never touched).
    out: PinnedBuf,
    /// Per expert of the layer: its miss runs on the CPU.
    on_cpu: Vec<bool>,
    /// `out` rows the open layer wrote (token * k + slot), uploaded in runs.
    rows: Vec<u32>,
    cpu: CpuExperts,
    /// Experts computed on the CPU since attach.
    pub(super) experts_cpu: u64,
    /// Whether xn of the running chunk was downloaded at its router sync.
    have_xn: bool,
}

impl Split {
    /// The CPU's products of `jobs` into `out`'s (token, slot) rows, noted for upload.
    fn run(
        &mut self,
        model: &Model<'_>,
        jobs: &[Option<Job<'_>>],
        k: usize,
    ) -> Result<(), ModelError> {
        let out = self.out.f32s_mut();
        let ran = self.cpu.run(
            &model.pool,
            model.isa,
            self.xn.f32s(),
            jobs,
            k,
            out,
            &mut self.rows,
        )?;
        self.experts_cpu += ran as u64;
        Ok(())
    }

    fn new(
        g: &GpuState,
        bsz: usize,
        k: usize,
        e: usize,
        h: usize,
        f: usize,
        cpu_max_tokens: usize,
    ) -> Result<Split, ModelError> {
        let cpu_max_tokens = cpu_max_tokens.min(CPU_MAX_TOKENS);
        let rows_cap = (BATCH * cpu_max_tokens).min(bsz * k).max(cpu_max_tokens);
        // Staging only (no CPU products): no host copies of xn or outputs.
        let (xb, ob) = if cpu_max_tokens == 0 {
            (0, 0)
        } else {
            (4 * bsz * h, 4 * bsz * k * h)
        };
        Ok(Split {
            cpu_max_tokens,
            xn: g.gpu.alloc_pinned(xb)?,
            out: g.gpu.alloc_pinned(ob)?,
            on_cpu: vec![false; e],
            rows: Vec::with_capacity(bsz * k),
            cpu: CpuExperts::new(rows_cap, h, f),
            experts_cpu: 0,
            have_xn: false,
        })
    }
}

impl GpuState {
    /// Sets where pool misses run: `Some(m)`: misses of at most `m` tokens on the CPU (0: none,
    /// `--gpu-experts stage`), the rest staged in waves that turn over at most a quarter of a
    /// layer's slots, the pool keeping the experts selected most lately (its frequency
    /// policy); `None`: every miss staged in waves as large as the pool, LRU (the default).
    pub fn set_cpu_misses(
        &mut self,
        model: &Model<'_>,
        cpu_max_tokens: Option<usize>,
    ) -> Result<(), ModelError> {
        let Some(m) = cpu_max_tokens else {
            self.split = None;
            self.pool.frequency = false;
            return Ok(());
        };
        if m > 0 {
            if let Some(why) = cpu_refusal(model) {
                return Err(ModelError::Unsupported(why));
            }
        }
        self.pool.frequency = true;
        let cfg = &model.cfg;
        let bsz = self.bufs.tok.bytes / (4 * self.k.max(1));
        let s = Split::new(
            self,
            bsz,
            self.k,
            cfg.n_experts,
            cfg.hidden,
            cfg.expert_ffn,
            m,
        )?;
        self.split = Some(s);
        Ok(())
    }

    /// Experts computed on the CPU since attach.
    pub fn experts_cpu(&self) -> u64 {
        self.split.as_ref().map_or(0, |s| s.experts_cpu)
    }

    /// Before a hybrid layer's router sync: the chunk's xn rows to the host with the selection.
    pub(super) fn split_fetch_xn(&mut self, n: usize, h: usize) -> Result<(), ModelError> {
        let Some(s) = self.split.as_mut() else {
            return Ok(());
        };
        s.have_xn = true;
        if s.cpu_max_tokens == 0 {
            return Ok(());
        }
        // SAFETY: the pinned xn buffer holds batch x hidden floats and is read only after the
        // compute stream's sync that follows.
        unsafe {
            self.gpu.download_async(
                s.xn.as_mut_slice().as_mut_ptr(),
                self.bufs.xn.ptr,
                4 * n * h,
                Stream::Compute,
            )?;
        }
        Ok(())
    }

    /// Whether this layer's misses go through `misses_split`.
    pub(super) fn splits_misses(&self) -> bool {
        self.split.as_ref().is_some_and(|s| s.have_xn)
    }

    /// A hybrid layer's misses: in waves that fit the RAM cache's free slots (and, for the
    /// staged ones, the pool's); each wave's staged experts are copied and launched as their
    /// bytes are ready, then its CPU experts are computed while those copies and kernels run,
    /// and their outputs uploaded into `slot_out` before the combine.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn misses_split(
        &mut self,
        model: &Model<'_>,
        st: &State,
        cache: &mut ExpertCache,
        l: usize,
        mo: &MoeGeo,
        misses: &[(usize, usize, usize)],
        mut j: usize,
        n: usize,
        h: usize,
    ) -> Result<(), ModelError> {
        let Some(mut s) = self.split.take() else {
            return Err(ModelError::Backend(
                "hybrid misses without host buffers".into(),
            ));
        };
        s.have_xn = false;
        s.rows.clear();
        let r = self.split_waves(model, st, cache, &mut s, l, mo, misses, &mut j, n, h);
        let up = r.and_then(|()| self.upload_rows(&mut s, h));
        self.split = Some(s);
        up
    }

    #[allow(clippy::too_many_arguments)]
    fn split_waves(
        &mut self,
        model: &Model<'_>,
        st: &State,
        cache: &mut ExpertCache,
        s: &mut Split,
        l: usize,
        mo: &MoeGeo,
        misses: &[(usize, usize, usize)],
        j: &mut usize,
        n: usize,
        h: usize,
    ) -> Result<(), ModelError> {
        let Some(moe) = model.weights.layers.get(l).and_then(|ly| ly.moe()) else {
            return Err(ModelError::Config(format!(
                "layer {l} has no routed experts"
            )));
        };
        let ram_cap = cache.slots(l).max(1);
        let mut wave: Vec<usize> = Vec::with_capacity(misses.len());
        let mut i = 0;
        while i < misses.len() {
            self.pool.begin_wave();
            // At most a quarter of the layer's slots turn over in a wave (the experts selected
            // most lately stay: the frequency policy evicts the least selected), so a prompt
            // that needs every expert streams the rest through a few slots.
            let ring = (self.pool.slots(mo.idx) / 4).max(2);
            let vram_cap = self.pool.free_for_wave(mo.idx).min(ring);
            wave.clear();
            let (mut ram_n, mut vram_n) = (0, 0);
            while i < misses.len() {
                let (ex, _, cnt) = misses[i];
                let ram_pinned = cache.is_pinned(l, ex);
                // A miss of few tokens runs on the CPU unless a pool slot is still empty (the
                // pool fills first) or it was selected clearly more than the expert it would
                // evict; staged, it needs a slot of this wave.
                let cpu = cnt > 0
                    && cnt <= s.cpu_max_tokens
                    && self.pool.empty_slots(mo.idx) <= vram_n
                    && !self.pool.worth_admitting(mo.idx, ex);
                let vram_reserved = self.pool.reserved(mo.idx, ex);
                let needs_slot = !cpu && !vram_reserved;
                if (!ram_pinned && ram_n == ram_cap) || (needs_slot && vram_n == vram_cap.max(1)) {
                    if wave.is_empty() && needs_slot && vram_cap == 0 {
                        return Err(ModelError::Backend(format!(
                            "no VRAM slot free for expert {ex} of layer {l}"
                        )));
                    }
                    break;
                }
                ram_n += usize::from(!ram_pinned);
                vram_n += usize::from(needs_slot);
                s.on_cpu[ex] = cpu;
                wave.push(ex);
                i += 1;
            }
            if let Err(e) = cache.begin(l, &wave) {
                cache.end();
                return Err(e.into());
            }
            let mut registered: Vec<usize> = Vec::new();
            let r = self.split_wave(
                model,
                st,
                cache,
                s,
                moe,
                l,
                mo,
                misses,
                j,
                n,
                h,
                &mut registered,
            );
            // Copies from the RAM slots must land before the cache may reuse them.
            let synced = self.gpu.sync(Stream::Copy);
            for p in registered {
                // SAFETY: registered by stage_one; the copy stream is idle (synced above).
                let _ = unsafe { self.gpu.unregister(p as *const u8) };
            }
            cache.end();
            r?;
            synced?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn split_wave(
        &mut self,
        model: &Model<'_>,
        st: &State,
        cache: &ExpertCache,
        s: &mut Split,
        moe: &crate::model::weights::Moe<'_>,
        l: usize,
        mo: &MoeGeo,
        misses: &[(usize, usize, usize)],
        j: &mut usize,
        n: usize,
        h: usize,
        registered: &mut Vec<usize>,
    ) -> Result<(), ModelError> {
        let k = self.k;
        let mut jobs: [Option<Job<'_>>; BATCH] = std::array::from_fn(|_| None);
        let (mut nj, mut rows) = (0, 0);
        while let Some((ex, bytes)) = cache.next_ready()? {
            let Some(&(_, a0, cnt)) = misses.iter().find(|m| m.0 == ex) else {
                return Err(ModelError::Backend(format!(
                    "the RAM cache returned expert {ex} of layer {l}, not a miss"
                )));
            };
            if !s.on_cpu[ex] {
                self.stage_one(l, mo, ex, &bytes, a0, cnt, *j, n, h, registered)?;
                *j += 1;
                continue;
            }
            let xw = &moe.experts[ex];
            let v = |w: &WeightView<'_>, b| WeightView { bytes: b, ..*w };
            let toks = &st.groups[ex][..];
            if nj == BATCH || rows + toks.len() > s.cpu.rows_cap() {
                s.run(model, &jobs[..nj], k)?;
                jobs.iter_mut().for_each(|j| *j = None);
                (nj, rows) = (0, 0);
            }
            jobs[nj] = Some(Job {
                w: [
                    v(&xw.gate, bytes.gate),
                    v(&xw.up, bytes.up),
                    v(&xw.down, bytes.down),
                ],
                toks,
            });
            nj += 1;
            rows += toks.len();
        }
        s.run(model, &jobs[..nj], k)
    }

    /// Uploads the CPU's output rows of this layer into `slot_out`, one copy per run of
    /// consecutive rows, on the compute stream (before the combine).
    fn upload_rows(&mut self, s: &mut Split, h: usize) -> Result<(), ModelError> {
        s.rows.sort_unstable();
        let row_bytes = 4 * h;
        let mut i = 0;
        while i < s.rows.len() {
            let r0 = s.rows[i] as usize;
            let mut r1 = r0 + 1;
            i += 1;
            while i < s.rows.len() && s.rows[i] as usize == r1 {
                r1 += 1;
                i += 1;
            }
            // SAFETY: rows r0..r1 of the pinned `out` (batch x k x hidden) were written by
            // this layer's CPU products and are not rewritten before the next router sync,
            // which waits for this copy; slot_out holds batch x k rows of `hidden`.
            unsafe {
                self.gpu.upload_async(
                    self.bufs.slot_out.at(r0 * row_bytes),
                    s.out.as_slice()[r0 * row_bytes..].as_ptr(),
                    (r1 - r0) * row_bytes,
                    Stream::Compute,
                )?;
            }
        }
        Ok(())
    }
}
