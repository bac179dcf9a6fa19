//! The CPU's side of the GPU's hybrid placement (`--gpu-experts hybrid`, gpu/split.rs): routed
//! experts missing from the VRAM pool computed on the CPU threads with the CPU's kernels, many
//! experts in one parallel region (gate and up of all of them, then all downs), each token's
//! output written to its (token, slot) row; and the attach-time timing of those products that
//! the planner weighs against a PCIe copy (plan/gpu_experts.rs). Built without the `cuda`
//! feature too, so its arithmetic is tested on machines without a GPU.
//!
//! Owns: `CpuExperts` (its scratch, sized once), `cpu_refusal`, `measure_cpu_expert`.
//! Does not own: which experts run here (split.rs), the copies to and from the device.
//! Invariant: every output element has the bits `kernels::matmul` gives it for that expert
//! and token alone (as the CPU forward's `run_expert` computes it): batching experts and
//! tokens never changes a value.

use crate::kernels::{self, Acts, MatJob, WeightView};
use crate::model::blocks::silu;
use crate::model::{Model, ModelError};
use crate::plan::gpu_experts::CpuExpertCost;
use std::time::Instant;

/// Experts in one batch (one `matmul_jobs` call runs gate and up of each).
pub const BATCH: usize = kernels::MAX_JOBS / 2;

/// One expert for the CPU: its weights and its tokens' (token, slot) pairs.
pub struct Job<'a> {
    /// gate, up, down.
    pub w: [WeightView<'a>; 3],
    pub toks: &'a [(u32, u32)],
}

/// The products' buffers, sized once for `rows_cap` (token, expert) rows.
pub struct CpuExperts {
    acts: Acts,
    gathered: Vec<f32>, // (rows_cap, hidden)
    gate: Vec<f32>,     // (rows_cap, ffn)
    up: Vec<f32>,       // (rows_cap, ffn)
    down: Vec<f32>,     // (rows_cap, hidden)
    rows_cap: usize,
}

impl CpuExperts {
    pub fn new(rows_cap: usize, hidden: usize, ffn: usize) -> CpuExperts {
        CpuExperts {
            acts: Acts::new(),
            gathered: vec![0.0; rows_cap * hidden],
            gate: vec![0.0; rows_cap * ffn],
            up: vec![0.0; rows_cap * ffn],
            down: vec![0.0; rows_cap * hidden],
            rows_cap,
        }
    }

    /// Most (token, expert) rows one `run` takes.
    pub fn rows_cap(&self) -> usize {
        self.rows_cap
    }

    /// The SwiGLU experts of `jobs` (at most `BATCH`, their tokens at most `rows_cap`) on the
    /// rows of `xn` (`hidden` wide): token t's output of slot s into row `t * k + s` of `out`,
    /// each row written also pushed to `rows`. `None` entries are skipped. Returns the
    /// experts run.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        pool: &rayon::ThreadPool,
        isa: kernels::Isa,
        xn: &[f32],
        jobs: &[Option<Job<'_>>],
        k: usize,
        out: &mut [f32],
        rows: &mut Vec<u32>,
    ) -> Result<usize, ModelError> {
        let Some(first) = jobs.iter().flatten().next() else {
            return Ok(0);
        };
        let (h, f) = (first.w[0].cols, first.w[0].rows);
        let n_jobs = jobs.iter().flatten().count();
        let r_all: usize = jobs.iter().flatten().map(|j| j.toks.len()).sum();
        if n_jobs > BATCH || r_all > self.rows_cap {
            return Err(ModelError::Shape(format!(
                "CPU experts: {n_jobs} experts with {r_all} rows in one batch (at most {BATCH} and {})",
                self.rows_cap
            )));
        }
        let pool = Some(pool);
        let mut r = 0;
        for jb in jobs.iter().flatten() {
            for &(t, _) in jb.toks {
                let t = t as usize;
                self.gathered[r * h..(r + 1) * h].copy_from_slice(&xn[t * h..(t + 1) * h]);
                r += 1;
            }
        }
        self.acts.load(&self.gathered[..r * h], r, h);
        for jb in jobs.iter().flatten() {
            kernels::prepare_for(jb.w[0].dtype, &mut self.acts)?;
            kernels::prepare_for(jb.w[1].dtype, &mut self.acts)?;
        }
        {
            let acts = &self.acts;
            let mut mj: [Option<MatJob<'_, '_>>; kernels::MAX_JOBS] = std::array::from_fn(|_| None);
            let (mut g, mut u) = (&mut self.gate[..r * f], &mut self.up[..r * f]);
            let mut row0 = 0;
            for (i, jb) in jobs.iter().flatten().enumerate() {
                let cnt = jb.toks.len();
                let (gy, gr) = std::mem::take(&mut g).split_at_mut(cnt * f);
                let (uy, ur) = std::mem::take(&mut u).split_at_mut(cnt * f);
                (g, u) = (gr, ur);
                mj[2 * i] = Some(MatJob {
                    w: &jb.w[0],
                    acts,
                    row0,
                    rows: cnt,
                    y: gy,
                    pick: None,
                });
                mj[2 * i + 1] = Some(MatJob {
                    w: &jb.w[1],
                    acts,
                    row0,
                    rows: cnt,
                    y: uy,
                    pick: None,
                });
                row0 += cnt;
            }
            kernels::matmul_jobs(&mut mj[..2 * n_jobs], pool, isa)?;
        }
        for (g, u) in self.gate[..r * f].iter_mut().zip(&self.up[..r * f]) {
            *g = silu(*g) * u;
        }
        self.acts.load(&self.gate[..r * f], r, f);
        for jb in jobs.iter().flatten() {
            kernels::prepare_for(jb.w[2].dtype, &mut self.acts)?;
        }
        {
            let acts = &self.acts;
            let mut mj: [Option<MatJob<'_, '_>>; kernels::MAX_JOBS] = std::array::from_fn(|_| None);
            let mut d = &mut self.down[..r * h];
            let mut row0 = 0;
            for (i, jb) in jobs.iter().flatten().enumerate() {
                let cnt = jb.toks.len();
                let (dy, dr) = std::mem::take(&mut d).split_at_mut(cnt * h);
                d = dr;
                mj[i] = Some(MatJob {
                    w: &jb.w[2],
                    acts,
                    row0,
                    rows: cnt,
                    y: dy,
                    pick: None,
                });
                row0 += cnt;
            }
            kernels::matmul_jobs(&mut mj[..n_jobs], pool, isa)?;
        }
        let mut r = 0;
        for jb in jobs.iter().flatten() {
            for &(t, slot) in jb.toks {
                let dst = t as usize * k + slot as usize;
                out[dst * h..(dst + 1) * h].copy_from_slice(&self.down[r * h..(r + 1) * h]);
                rows.push(dst as u32);
                r += 1;
            }
        }
        Ok(n_jobs)
    }
}

/// Why the CPU cannot take this model's misses (None: it can): the hybrid path runs plain
/// SwiGLU experts; gpt-oss's biased clamped-SwiGLU ones are staged.
pub fn cpu_refusal(model: &Model<'_>) -> Option<String> {
    use crate::model::config::ExpertAct;
    let biased = model
        .weights
        .layers
        .iter()
        .any(|l| l.moe().is_some_and(|m| m.exp_bias.is_some()));
    (biased || !matches!(model.cfg.expert_act, ExpertAct::Silu)).then(|| {
        "the CPU's hybrid path runs plain SwiGLU experts, not this model's biased or clamped ones"
            .to_string()
    })
}

/// Times the CPU's products of the model's routed experts (its own weights, through the
/// mapped files): one token on 32 experts spread over the MoE layers (after one untimed pass
/// that pages them in), then 16 tokens on 8 of them; medians. None without routed experts or
/// when the CPU cannot run them (`cpu_refusal`).
pub fn measure_cpu_expert(model: &Model<'_>) -> Option<CpuExpertCost> {
    let moes: Vec<&crate::model::weights::Moe<'_>> = model
        .weights
        .layers
        .iter()
        .filter_map(|l| l.moe())
        .collect();
    let e = moes.first()?.experts.len();
    if e == 0 || cpu_refusal(model).is_some() {
        return None;
    }
    let picks: Vec<&crate::model::weights::Expert<'_>> = (0..32)
        .map(|i| &moes[i % moes.len()].experts[(i * 37 + i / moes.len()) % e])
        .collect();
    let (h, f) = (picks[0].gate.cols, picks[0].gate.rows);
    const T: usize = 16;
    let toks: Vec<(u32, u32)> = (0..T as u32).map(|t| (t, 0)).collect();
    let mut s = CpuExperts::new(T, h, f);
    let xn: Vec<f32> = (0..T * h)
        .map(|i| ((i * 7919) % 997) as f32 / 997.0 - 0.5)
        .collect();
    let mut out = vec![0.0f32; T * h];
    let mut rows = Vec::with_capacity(T);
    let mut time = |x: &crate::model::weights::Expert<'_>, cnt: usize| -> Option<f64> {
        let job = [Some(Job {
            w: [x.gate, x.up, x.down],
            toks: &toks[..cnt],
        })];
        rows.clear();
        let t0 = Instant::now();
        s.run(&model.pool, model.isa, &xn, &job, 1, &mut out, &mut rows)
            .ok()?;
        Some(t0.elapsed().as_secs_f64() * 1e6)
    };
    for x in &picks {
        time(x, 1)?;
    }
    let mut one: Vec<f64> = picks.iter().map(|x| time(x, 1)).collect::<Option<_>>()?;
    let mut many: Vec<f64> = picks[..8]
        .iter()
        .map(|x| time(x, T))
        .collect::<Option<_>>()?;
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (t1, tt) = (med(&mut one), med(&mut many));
    Some(CpuExpertCost {
        one_token_us: t1,
        per_token_us: ((tt - t1) / (T - 1) as f64).max(0.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    fn lcg(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        }
    }

    /// Batched experts (several experts and tokens per region, any order of tokens and slots)
    /// give each output the bits of `kernels::matmul` on that expert and token alone, the
    /// way the CPU forward's `run_expert` computes it, and write exactly the (token, slot)
    /// rows of their assignments.
    #[test]
    fn batched_products_match_one_expert_one_token() {
        let (h, f, k, n) = (256, 256, 3, 5);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let isa = kernels::Isa::hardware();
        for dtype in [DType::F32, DType::Q8_0, DType::Q4_K] {
            let mut rnd = lcg(7);
            let mut bytes: Vec<Vec<u8>> = Vec::new();
            for e in 0..4 {
                for (rows, cols) in [(f, h), (f, h), (h, f)] {
                    let w: Vec<f32> = (0..rows * cols).map(|_| rnd() * (1.0 + e as f32)).collect();
                    let mut b = Vec::new();
                    kernels::quantize::quantize(dtype, &w, &mut b).unwrap();
                    bytes.push(b);
                }
            }
            let view = |e: usize, p: usize| {
                let (rows, cols) = if p == 2 { (h, f) } else { (f, h) };
                WeightView {
                    dtype,
                    bytes: &bytes[3 * e + p],
                    rows,
                    cols,
                }
            };
            let xn: Vec<f32> = (0..n * h).map(|_| rnd()).collect();
            // Experts 0, 2, 3 with their (token, slot) pairs.
            let groups: Vec<(usize, Vec<(u32, u32)>)> = vec![
                (2, vec![(0, 1), (3, 0), (4, 2)]),
                (0, vec![(1, 0)]),
                (3, vec![(0, 0), (1, 2), (2, 1), (4, 0)]),
            ];
            let jobs: Vec<Option<Job<'_>>> = groups
                .iter()
                .map(|(e, toks)| {
                    Some(Job {
                        w: [view(*e, 0), view(*e, 1), view(*e, 2)],
                        toks,
                    })
                })
                .collect();
            let mut cpu = CpuExperts::new(8, h, f);
            let mut out = vec![f32::NAN; n * k * h];
            let mut rows = Vec::new();
            let ran = cpu
                .run(&pool, isa, &xn, &jobs, k, &mut out, &mut rows)
                .unwrap();
            assert_eq!(ran, 3);
            assert_eq!(rows.len(), 8);
            let mut acts = Acts::new();
            for (e, toks) in &groups {
                for &(t, slot) in toks {
                    let t = t as usize;
                    let (mut g, mut u, mut d) = (vec![0.0; f], vec![0.0; f], vec![0.0; h]);
                    acts.load(&xn[t * h..(t + 1) * h], 1, h);
                    kernels::matmul(&view(*e, 0), &mut acts, &mut g, Some(&pool), isa).unwrap();
                    kernels::matmul(&view(*e, 1), &mut acts, &mut u, Some(&pool), isa).unwrap();
                    for (g, u) in g.iter_mut().zip(&u) {
                        *g = silu(*g) * u;
                    }
                    acts.load(&g, 1, f);
                    kernels::matmul(&view(*e, 2), &mut acts, &mut d, Some(&pool), isa).unwrap();
                    let dst = t * k + slot as usize;
                    let got = &out[dst * h..(dst + 1) * h];
                    assert!(
                        got.iter().zip(&d).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{dtype:?}: expert {e} token {t} slot {slot} differs"
                    );
                }
            }
            // Rows nobody was assigned stay untouched.
            let written: std::collections::HashSet<u32> = rows.iter().copied().collect();
            for r in 0..n * k {
                if !written.contains(&(r as u32)) {
                    assert!(out[r * h].is_nan(), "{dtype:?}: row {r} was written");
                }
            }
            // Too many rows for the scratch: refused, not overrun.
            let mut small = CpuExperts::new(2, h, f);
            assert!(small
                .run(&pool, isa, &xn, &jobs, k, &mut out, &mut rows)
                .is_err());
        }
    }
}
