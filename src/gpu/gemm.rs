//! Prefill GEMM on the tensor cores: the matrix products of forwards with more than a few
//! tokens (prompt prefill), dense and per routed expert.
//!
//! Owns: the launch shapes of kernels.cu's `gemm_*`, `moe_gemm_gate_up_*` and `moe_gemm_down_*`
//! (its "prefill GEMM" section) and when they replace the one-warp-per-row matvec kernels
//! (`takes`). Does not own: the activations' quantization (model.rs quantizes once per input,
//! `quantize_q8`), the job lists (`build_jobs` on the device or the host's), the combine.
//!
//! The GEMM multiplies the same int8 codes as the matvec kernels (the weights' own codes, the
//! activations quantized per 32 values) with `mma.sync` s8 -> s32, and scales each 32-value
//! chunk's exact integer sum in f32 by the same formula, so it differs from them only in the
//! order of the f32 sums; each output element's sum runs over the chunks in index order
//! whatever tile it falls in, so an expert's results do not depend on which tokens share it.
//! The entry points take the matvec kernels' arguments; only the kernel and grid change.

use super::driver::{Gpu, Kernel, Stream};
use super::GpuError;

/// Weight rows, tokens and input values per block tile (kernels.cu GBM, GBN, GBK).
pub const TILE_ROWS: usize = 64;
pub const TILE_TOKENS: usize = 64;
pub const TILE_K: usize = 128;
/// Threads per block (kernels.cu GTHREADS).
pub const THREADS: u32 = 128;
/// Forwards of at least this many tokens take the GEMM; fewer (decode, drafts) the matvec
/// kernels, which read each weight once per 4 tokens and win when there are few.
pub const MIN_TOKENS: usize = 9;

/// A weight type's three GEMM kernels (the types of model.rs `Q8_TYPES`).
#[derive(Clone, Copy)]
pub struct GemmFns {
    pub mm: Kernel,
    pub gate_up: Kernel,
    pub down: Kernel,
}

impl GemmFns {
    /// `name`: the type's kernel suffix (`q4_k`, ...).
    pub fn load(gpu: &Gpu, name: &str) -> Result<GemmFns, GpuError> {
        Ok(GemmFns {
            mm: gpu.function(&format!("gemm_{name}"))?,
            gate_up: gpu.function(&format!("moe_gemm_gate_up_{name}"))?,
            down: gpu.function(&format!("moe_gemm_down_{name}"))?,
        })
    }
}

/// Whether a product of `n` tokens over `cols` inputs takes the GEMM. `SLUICE_GPU_GEMM=0`
/// turns the GEMM off (every forward on the matvec kernels), for A/B runs.
pub fn takes(n: usize, cols: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    n >= MIN_TOKENS
        && cols.is_multiple_of(TILE_K)
        && *ON.get_or_init(|| std::env::var("SLUICE_GPU_GEMM").map_or(true, |v| v != "0"))
}

fn grid(rows: usize, tokens: usize, jobs: usize) -> (u32, u32, u32) {
    (
        rows.div_ceil(TILE_ROWS) as u32,
        tokens.div_ceil(TILE_TOKENS) as u32,
        jobs as u32,
    )
}

/// y (n x rows, row stride ldy) = x W^T, W `rows` x `cols` quantized (row bytes `rb`) at `w`,
/// x already quantized at `xq`/`xd` (quantize_q8: row strides cols and cols/32).
#[allow(clippy::too_many_arguments)]
pub fn mm(
    gpu: &Gpu,
    f: &GemmFns,
    w: u64,
    rb: usize,
    rows: usize,
    cols: usize,
    xq: u64,
    xd: u64,
    n: usize,
    y: u64,
    ldy: usize,
) -> Result<(), GpuError> {
    gpu.launch(
        f.mm,
        grid(rows, n, 1),
        THREADS,
        0,
        Stream::Compute,
        &[
            w.into(),
            (rb as i64).into(),
            (rows as i32).into(),
            (cols as i32).into(),
            xq.into(),
            xd.into(),
            (n as i32).into(),
            y.into(),
            (ldy as i32).into(),
        ],
    )
}

/// The routed experts' gate and up products over `jobs` (device, kernels.cu `Job`: `grid_jobs`
/// of them, or the device count at `nj` when non-zero): hb[a] = silu(gate x_tok[a]) * (up
/// x_tok[a]) for each assignment a, `ffn` values per row; x quantized at `xq`/`xd` (h values
/// per token). `max_tokens`: the most assignments any job has (at most the forward's tokens).
#[allow(clippy::too_many_arguments)]
pub fn moe_gate_up(
    gpu: &Gpu,
    f: &GemmFns,
    jobs: u64,
    nj: u64,
    grid_jobs: usize,
    max_tokens: usize,
    ffn: usize,
    h: usize,
    rb: usize,
    xq: u64,
    xd: u64,
    tok: u64,
    hb: u64,
) -> Result<(), GpuError> {
    gpu.launch(
        f.gate_up,
        grid(ffn, max_tokens, grid_jobs),
        THREADS,
        0,
        Stream::Compute,
        &[
            jobs.into(),
            nj.into(),
            (ffn as i32).into(),
            (h as i32).into(),
            (rb as i64).into(),
            xq.into(),
            xd.into(),
            tok.into(),
            hb.into(),
        ],
    )
}

/// The routed experts' down products: so[dst[a]] = down hb[a] (h values) for each assignment
/// a of the jobs, hb quantized at `hq`/`hd` (ffn values per assignment).
#[allow(clippy::too_many_arguments)]
pub fn moe_down(
    gpu: &Gpu,
    f: &GemmFns,
    jobs: u64,
    nj: u64,
    grid_jobs: usize,
    max_tokens: usize,
    h: usize,
    ffn: usize,
    rb: usize,
    hq: u64,
    hd: u64,
    dst: u64,
    so: u64,
) -> Result<(), GpuError> {
    gpu.launch(
        f.down,
        grid(h, max_tokens, grid_jobs),
        THREADS,
        0,
        Stream::Compute,
        &[
            jobs.into(),
            nj.into(),
            (h as i32).into(),
            (ffn as i32).into(),
            (rb as i64).into(),
            hq.into(),
            hd.into(),
            dst.into(),
            so.into(),
        ],
    )
}

/// The GEMM and the matvec kernels it replaces on host data, for tests and the benchmark.
pub mod check {
    use super::*;
    use crate::dtype::DType;
    use crate::gpu::driver::DevBuf;
    use std::time::Instant;

    fn name(d: DType) -> Result<String, GpuError> {
        if !crate::gpu::model::Q8_TYPES.contains(&d) {
            return Err(GpuError::Config(format!("no GEMM kernel for {}", d.name())));
        }
        Ok(d.name().to_ascii_lowercase())
    }

    fn upload(gpu: &Gpu, bytes: &[u8]) -> Result<DevBuf, GpuError> {
        let b = gpu.alloc(bytes.len().max(1))?;
        gpu.upload(b.ptr, bytes)?;
        Ok(b)
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn i32_bytes(v: &[i32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn download(gpu: &Gpu, src: &DevBuf, n: usize) -> Result<Vec<f32>, GpuError> {
        let mut host = gpu.alloc_pinned(4 * n)?;
        // SAFETY: `host` holds 4n bytes and lives until after the sync.
        unsafe {
            gpu.download_async(
                host.as_mut_slice().as_mut_ptr(),
                src.ptr,
                4 * n,
                Stream::Compute,
            )?
        };
        gpu.sync(Stream::Compute)?;
        Ok(host.f32s().to_vec())
    }

    /// Quantizes `rows` x `cols` of x on the device (quantize_q8), into new buffers.
    fn quantize(
        gpu: &Gpu,
        x: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<(DevBuf, DevBuf), GpuError> {
        let xd = upload(gpu, &f32_bytes(x))?;
        let q = gpu.alloc(rows * cols)?;
        let s = gpu.alloc(4 * rows * cols / 32)?;
        gpu.launch(
            gpu.function("quantize_q8")?,
            (((rows * cols / 32) as u32).div_ceil(8), 1, 1),
            256,
            0,
            Stream::Compute,
            &[
                xd.ptr.into(),
                (cols as i32).into(),
                (cols as i32).into(),
                (rows as i32).into(),
                q.ptr.into(),
                s.ptr.into(),
            ],
        )?;
        Ok((q, s))
    }

    /// y (n x rows) = x (n x cols) W^T by the GEMM (`gemm: true`) or by the matvec kernel
    /// `mmq_*`, both on x quantized by `quantize_q8`.
    pub fn matmul(
        d: DType,
        w: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        n: usize,
        gemm: bool,
    ) -> Result<Vec<f32>, GpuError> {
        let name = name(d)?;
        if gemm && !cols.is_multiple_of(TILE_K) {
            return Err(GpuError::Config(format!(
                "GEMM input of {cols} values: not a multiple of {TILE_K}"
            )));
        }
        let gpu = Gpu::open()?;
        let wd = upload(&gpu, w)?;
        let (xq, xs) = quantize(&gpu, x, n, cols)?;
        let y = gpu.alloc(4 * n * rows)?;
        let rb = w.len() / rows;
        if gemm {
            mm(
                &gpu,
                &GemmFns::load(&gpu, &name)?,
                wd.ptr,
                rb,
                rows,
                cols,
                xq.ptr,
                xs.ptr,
                n,
                y.ptr,
                rows,
            )?;
        } else {
            gpu.launch(
                gpu.function(&format!("mmq_{name}"))?,
                ((rows as u32).div_ceil(8), 1, 1),
                256,
                0,
                Stream::Compute,
                &[
                    wd.ptr.into(),
                    (rb as i64).into(),
                    (rows as i32).into(),
                    (cols as i32).into(),
                    xq.ptr.into(),
                    xs.ptr.into(),
                    (n as i32).into(),
                    y.ptr.into(),
                    (rows as i32).into(),
                ],
            )?;
        }
        download(&gpu, &y, n * rows)
    }

    /// One MoE layer's routed experts, `gate_up` and `down` typed weights of `experts` experts
    /// (each `ffn` x `h` gate and up, `h` x `ffn` down, concatenated per expert), for tokens
    /// x (n x h) routed to `sel` (n x k expert ids, distinct per token): the hidden rows (n*k x
    /// ffn, in job order: experts ascending, each expert's assignments in order) and the
    /// outputs (n*k x h, row t*k + s for token t's slot s), by the grouped GEMM (`gemm: true`)
    /// or by the matvec expert kernels.
    #[allow(clippy::too_many_arguments)]
    pub fn moe(
        types: (DType, DType),
        gate: &[u8],
        up: &[u8],
        down: &[u8],
        experts: usize,
        ffn: usize,
        h: usize,
        x: &[f32],
        sel: &[usize],
        k: usize,
        gemm: bool,
    ) -> Result<(Vec<f32>, Vec<f32>), GpuError> {
        let (gn, dn) = (name(types.0)?, name(types.1)?);
        let n = x.len() / h;
        let gpu = Gpu::open()?;
        let (gw, uw, dw) = (upload(&gpu, gate)?, upload(&gpu, up)?, upload(&gpu, down)?);
        let (ge, de) = (gate.len() / experts, down.len() / experts);
        let (mut tok, mut dst, mut jobs) = (Vec::new(), Vec::new(), Vec::new());
        let mut max_tokens = 0;
        for e in 0..experts {
            let a0 = tok.len();
            for (a, &s) in sel.iter().enumerate() {
                if s == e {
                    tok.push((a / k) as i32);
                    dst.push(a as i32);
                }
            }
            let cnt = tok.len() - a0;
            if cnt > 0 {
                max_tokens = max_tokens.max(cnt);
                let mut j = Vec::with_capacity(32);
                for p in [gw.at(e * ge), uw.at(e * ge), dw.at(e * de)] {
                    j.extend_from_slice(&p.to_le_bytes());
                }
                j.extend_from_slice(&(a0 as i32).to_le_bytes());
                j.extend_from_slice(&(cnt as i32).to_le_bytes());
                jobs.push(j);
            }
        }
        let nj = jobs.len();
        let jobs_d = upload(&gpu, &jobs.concat())?;
        let (tok_d, dst_d) = (
            upload(&gpu, &i32_bytes(&tok))?,
            upload(&gpu, &i32_bytes(&dst))?,
        );
        let (xq, xs) = quantize(&gpu, x, n, h)?;
        let na = sel.len();
        let hb = gpu.alloc(4 * na * ffn)?;
        let so = gpu.alloc(4 * na * h)?;
        let (rg, rd) = (ge / ffn, de / h);
        let gf = (gemm)
            .then(|| Ok::<_, GpuError>((GemmFns::load(&gpu, &gn)?, GemmFns::load(&gpu, &dn)?)))
            .transpose()?;
        if let Some((fg, _)) = &gf {
            moe_gate_up(
                &gpu, fg, jobs_d.ptr, 0, nj, max_tokens, ffn, h, rg, xq.ptr, xs.ptr, tok_d.ptr,
                hb.ptr,
            )?;
        } else {
            gpu.launch(
                gpu.function(&format!("moe_gate_up_q_{gn}"))?,
                ((ffn as u32).div_ceil(8), nj as u32, 1),
                256,
                0,
                Stream::Compute,
                &[
                    jobs_d.ptr.into(),
                    0u64.into(),
                    (ffn as i32).into(),
                    (h as i32).into(),
                    (rg as i64).into(),
                    xq.ptr.into(),
                    xs.ptr.into(),
                    tok_d.ptr.into(),
                    hb.ptr.into(),
                ],
            )?;
        }
        let hbv = download(&gpu, &hb, na * ffn)?;
        let (hq, hs) = quantize(&gpu, &hbv, na, ffn)?;
        if let Some((_, fd)) = &gf {
            moe_down(
                &gpu, fd, jobs_d.ptr, 0, nj, max_tokens, h, ffn, rd, hq.ptr, hs.ptr, dst_d.ptr,
                so.ptr,
            )?;
        } else {
            gpu.launch(
                gpu.function(&format!("moe_down_q_{dn}"))?,
                ((h as u32).div_ceil(8), nj as u32, 1),
                256,
                0,
                Stream::Compute,
                &[
                    jobs_d.ptr.into(),
                    0u64.into(),
                    (h as i32).into(),
                    (ffn as i32).into(),
                    (rd as i64).into(),
                    hq.ptr.into(),
                    hs.ptr.into(),
                    dst_d.ptr.into(),
                    so.ptr.into(),
                ],
            )?;
        }
        Ok((hbv, download(&gpu, &so, na * h)?))
    }

    /// Seconds per dense product (`reps` launches after one warm-up, event-free: timed around
    /// a sync) of a `rows` x `cols` matrix of `d` (random-looking codes from `w`, repeated)
    /// against n tokens, by the GEMM or the matvec kernel.
    #[allow(clippy::too_many_arguments)]
    pub fn time_mm(
        d: DType,
        w: &[u8],
        rows: usize,
        cols: usize,
        n: usize,
        reps: usize,
        gemm: bool,
    ) -> Result<f64, GpuError> {
        let name = name(d)?;
        let gpu = Gpu::open()?;
        let wd = upload(&gpu, w)?;
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let (xq, xs) = quantize(&gpu, &x, n, cols)?;
        let y = gpu.alloc(4 * n * rows)?;
        let rb = w.len() / rows;
        let f = GemmFns::load(&gpu, &name)?;
        let v = gpu.function(&format!("mmq_{name}"))?;
        let run = || -> Result<(), GpuError> {
            if gemm {
                mm(
                    &gpu, &f, wd.ptr, rb, rows, cols, xq.ptr, xs.ptr, n, y.ptr, rows,
                )
            } else {
                gpu.launch(
                    v,
                    ((rows as u32).div_ceil(8), 1, 1),
                    256,
                    0,
                    Stream::Compute,
                    &[
                        wd.ptr.into(),
                        (rb as i64).into(),
                        (rows as i32).into(),
                        (cols as i32).into(),
                        xq.ptr.into(),
                        xs.ptr.into(),
                        (n as i32).into(),
                        y.ptr.into(),
                        (rows as i32).into(),
                    ],
                )
            }
        };
        run()?;
        gpu.sync(Stream::Compute)?;
        let t = Instant::now();
        for _ in 0..reps {
            run()?;
        }
        gpu.sync(Stream::Compute)?;
        Ok(t.elapsed().as_secs_f64() / reps as f64)
    }
}
