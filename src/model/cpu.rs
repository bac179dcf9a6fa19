//! The CPU backend: `Backend`'s operations on the buffers of a `State`, with the kernels of
//! `kernels/` on the model's thread pool, and the routed MoE block (routing, expert cache
//! waves, prefetch).
//!
//! Owns: `CpuBackend` (a model and a state borrowed for one forward call), the MoE block's CPU
//! code, `route_token`. Does not own: the graph (forward.rs), the buffers' sizes (state.rs).
//! Invariant: every operation is the arithmetic the forward pass always did, loop for loop;
//! the MoE output of each token is summed in its top-k slot order, so the result does not
//! depend on the order in which experts are computed or arrive from disk.

use super::backend::{At, Backend, Buf, Cache, GqaShape, Rows, Span};
use super::blocks::{axpy, dot, rmsnorm, rmsnorm_inplace, silu, softmax, top_k};
use super::config::{AttnKind, ExpertAct, ModelConfig, RopeLayout};
use super::gptoss;
use super::qwen3next::{self, DeltaNet, GatedAttn};
use super::weights::{ExpertBias, Ffn, HeadMat, Mla, Mlp, Moe};
use super::{Model, ModelError, Prof, State};
use crate::experts::ExpertCache;
use crate::kernels::attn;
use crate::kernels::kv::{kv_kernels, load_row as kv_load_row, store_row as kv_store_row};
use crate::kernels::{self, Acts, Isa, WeightView};

/// y = M x for a per-head matrix.
fn head_matvec(
    m: &HeadMat<'_>,
    x: &[f32],
    y: &mut [f32],
    acts: &mut Acts,
    isa: Isa,
) -> Result<(), ModelError> {
    match m {
        HeadMat::View(w) => {
            acts.load(x, 1, w.cols);
            kernels::matmul(w, acts, y, None, isa)?;
        }
        HeadMat::Owned { rows, cols, data } => {
            for (r, o) in y.iter_mut().enumerate().take(*rows) {
                *o = dot(&data[r * cols..(r + 1) * cols], x);
            }
        }
    }
    Ok(())
}

/// `SLUICE_PROF_CPU=1`: wall time of the CPU backend's parts on stderr, after every forward
/// call of several tokens (prefill) and after every 64 calls of one token (decode). A
/// diagnostic: it reads the clock around each part only when on.
pub(crate) mod cpu_prof {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    use std::time::Instant;

    pub const MATMUL: usize = 0;
    pub const ATTEND: usize = 1;
    pub const ROUTER: usize = 2;
    pub const EXPERT_MATMUL: usize = 3;
    pub const EXPERT_OTHER: usize = 4;
    const NAMES: [&str; 5] = [
        "dense matmuls",
        "attention (GQA, MLA)",
        "router+select",
        "expert matmuls",
        "expert gather/quantize/act/scatter",
    ];
    static T: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];
    static TOTAL: AtomicU64 = AtomicU64::new(0);
    static CALLS: AtomicU64 = AtomicU64::new(0);
    static ROWS: AtomicU64 = AtomicU64::new(0);

    pub fn on() -> bool {
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| std::env::var("SLUICE_PROF_CPU").is_ok_and(|v| v == "1"))
    }

    /// The clock now, if profiling.
    #[inline]
    pub fn start() -> Option<Instant> {
        if on() {
            Some(Instant::now())
        } else {
            None
        }
    }

    #[inline]
    pub fn add(slot: usize, t: Option<Instant>) {
        if let Some(t) = t {
            T[slot].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }

    /// The end of a forward call of `n` tokens that began at `t`.
    pub fn end_call(n: usize, t: Option<Instant>) {
        let Some(t) = t else { return };
        TOTAL.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        ROWS.fetch_add(n as u64, Ordering::Relaxed);
        let calls = CALLS.fetch_add(1, Ordering::Relaxed) + 1;
        if n == 1 && calls < 64 {
            return;
        }
        CALLS.store(0, Ordering::Relaxed);
        let total = TOTAL.swap(0, Ordering::Relaxed) as f64 / 1e6;
        let mut line = format!(
            "[prof-cpu] {calls} calls, {} tokens: {total:.1} ms",
            ROWS.swap(0, Ordering::Relaxed)
        );
        let mut ms: [f64; 5] =
            std::array::from_fn(|i| T[i].swap(0, Ordering::Relaxed) as f64 / 1e6);
        // EXPERT_OTHER was timed around the whole expert block.
        ms[EXPERT_OTHER] -= ms[EXPERT_MATMUL];
        let mut parts = 0.0;
        for (ms, name) in ms.iter().zip(NAMES) {
            parts += ms;
            line += &format!(" | {name} {ms:.1}");
        }
        line += &format!(" | rest {:.1}", total - parts);
        eprintln!("{line}");
    }
}

/// A pointer that tasks writing disjoint elements share.
struct SendPtr(*mut f32);
// SAFETY: only used where each task writes elements no other task touches.
unsafe impl Sync for SendPtr {}
unsafe impl Send for SendPtr {}

/// The CPU backend for one forward call: the model's kernels and thread pool on `st`'s
/// buffers. Made per call (it borrows both), so it holds nothing between calls.
pub(crate) struct CpuBackend<'m, 'a, 's> {
    m: &'m Model<'a>,
    st: &'s mut State,
    /// A batched forward's sequences (`Model::forward_seqs`); empty otherwise.
    seqs: &'s mut [State],
    /// The sequence whose KV cache is swapped into `st` now (`use_sequence`); swapped back on
    /// the next call and on drop.
    cur: Option<usize>,
    /// `cpu_prof`: when this call began, and its tokens (from `embed`).
    prof: (Option<std::time::Instant>, usize),
}

/// The storage behind a buffer name.
fn vec_of(st: &mut State, b: Buf) -> &mut Vec<f32> {
    match b {
        Buf::X => &mut st.x,
        Buf::Xn => &mut st.xn,
        Buf::Q => &mut st.q,
        Buf::Qa => &mut st.qa,
        Buf::K => &mut st.k,
        Buf::V => &mut st.v,
        Buf::Att => &mut st.att,
        Buf::Proj => &mut st.proj,
        Buf::Hfin => &mut st.hfin,
        Buf::Gate => &mut st.gate,
        Buf::Up => &mut st.up,
        Buf::Logits => &mut st.logits,
        Buf::IdxQ => &mut st.idx.q,
        Buf::IdxK => &mut st.idx.k,
        Buf::IdxW => &mut st.idx.w,
        Buf::MtpCat => &mut st.mtp_cat,
        Buf::MtpHidden => &mut st.mtp_hidden,
        Buf::MtpLogits => &mut st.mtp_logits,
    }
}

/// The element range of row `i` of `r`.
#[inline]
fn row(r: Rows, i: usize) -> std::ops::Range<usize> {
    let s = (r.row0 + i) * r.stride + r.off;
    s..s + r.width
}

impl<'m, 'a, 's> CpuBackend<'m, 'a, 's> {
    pub(crate) fn new(m: &'m Model<'a>, st: &'s mut State) -> Self {
        CpuBackend {
            m,
            st,
            seqs: &mut [],
            cur: None,
            prof: (cpu_prof::start(), 0),
        }
    }

    /// The backend of a batched forward: `st`'s buffers, and the KV caches of `seqs`, each
    /// swapped into `st` while `use_sequence` selects it (a swap of two vectors, no copy).
    pub(crate) fn with_seqs(m: &'m Model<'a>, st: &'s mut State, seqs: &'s mut [State]) -> Self {
        CpuBackend {
            m,
            st,
            seqs,
            cur: None,
            prof: (cpu_prof::start(), 0),
        }
    }

    /// Give the swapped-in sequence its cache back.
    fn release(&mut self) {
        if let Some(j) = self.cur.take() {
            let s = &mut self.seqs[j];
            std::mem::swap(&mut self.st.kcache, &mut s.kcache);
            std::mem::swap(&mut self.st.vcache, &mut s.vcache);
            std::mem::swap(&mut self.st.hybrid.conv, &mut s.hybrid.conv);
            std::mem::swap(&mut self.st.hybrid.rec, &mut s.hybrid.rec);
        }
    }

    /// Run `f` on rows 0..n of `x`, each row mutable; in parallel pieces of rows when there are
    /// many (prefill) and they do not overlap. Each row's arithmetic is the same either way.
    fn each_row(&mut self, x: Rows, n: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
        let pool = &self.m.pool;
        let v = vec_of(self.st, x.buf);
        if n >= PAR_ROWS && x.off + x.width <= x.stride && pool.current_num_threads() > 1 {
            let end = row(x, n - 1).end;
            assert!(end <= v.len(), "backend: rows past the end of {:?}", x.buf);
            let vp = SendPtr(v.as_mut_ptr());
            kernels::par_for(Some(pool), n.div_ceil(ROWS_PER_TASK), &|t| {
                let vp = &vp;
                for i in t * ROWS_PER_TASK..((t + 1) * ROWS_PER_TASK).min(n) {
                    let r = row(x, i);
                    // SAFETY: rows do not overlap (off + width <= stride) and all lie inside
                    // the buffer (asserted above); each row belongs to one task.
                    f(i, unsafe {
                        std::slice::from_raw_parts_mut(vp.0.add(r.start), r.len())
                    });
                }
            });
            return;
        }
        for i in 0..n {
            f(i, &mut v[row(x, i)]);
        }
    }

    /// Run `f` on row pairs (dst row i, src row i) of two different buffers (in parallel pieces
    /// as `each_row`). The source is moved out for the call and back (no allocation: a
    /// moved-out `Vec` leaves an empty one).
    fn each_pair(
        &mut self,
        dst: Rows,
        src: Rows,
        n: usize,
        f: impl Fn(&mut [f32], &[f32]) + Sync,
    ) -> Result<(), ModelError> {
        if dst.buf == src.buf {
            return Err(ModelError::Input(format!(
                "backend: {:?} is both source and destination",
                dst.buf
            )));
        }
        let pool = &self.m.pool;
        let s = std::mem::take(vec_of(self.st, src.buf));
        let d = vec_of(self.st, dst.buf);
        if n >= PAR_ROWS && dst.off + dst.width <= dst.stride && pool.current_num_threads() > 1 {
            let end = row(dst, n - 1).end;
            assert!(
                end <= d.len(),
                "backend: rows past the end of {:?}",
                dst.buf
            );
            let dp = SendPtr(d.as_mut_ptr());
            let s = &s;
            kernels::par_for(Some(pool), n.div_ceil(ROWS_PER_TASK), &|t| {
                let dp = &dp;
                for i in t * ROWS_PER_TASK..((t + 1) * ROWS_PER_TASK).min(n) {
                    let r = row(dst, i);
                    // SAFETY: as in `each_row`.
                    let dr = unsafe { std::slice::from_raw_parts_mut(dp.0.add(r.start), r.len()) };
                    f(dr, &s[row(src, i)]);
                }
            });
        } else {
            for i in 0..n {
                f(&mut d[row(dst, i)], &s[row(src, i)]);
            }
        }
        *vec_of(self.st, src.buf) = s;
        Ok(())
    }
}

/// Fewest rows that `each_row` / `each_pair` split across threads, and rows per task.
const PAR_ROWS: usize = 16;
/// Prompt attention: rows of one head whose scores are made together (`State::scores` holds
/// this many rows per head).
pub(super) const ATT_ROW_TILE: usize = 8;
const ROWS_PER_TASK: usize = 4;

thread_local! {
    /// `attend_blocks`' widened key/value rows, transposed keys and block scores (per thread,
    /// grown once to the largest shape seen).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// `mla_blocks`' absorbed queries and latent outputs of a tile, and the activations of its
    /// per-head products.
    static MLA_SCRATCH: std::cell::RefCell<(Vec<f32>, Acts)> =
        std::cell::RefCell::new((Vec::new(), Acts::new()));
}

/// The positions a query at cache position `at` attends: first..at + 1 (causal; a sliding
/// window keeps the last W of them).
fn causal_span(at: usize, window: Option<usize>) -> (usize, usize) {
    let len = at + 1;
    (window.map_or(0, |w| len.saturating_sub(w)), len)
}

/// Queries scored together by `attend_blocks` (fixed arrays: the decode step allocates
/// nothing), and keys per block.
const MAXQ: usize = 64;
const KB: usize = 64;

/// Heads per task and rows per tile for `attend_blocks`, for tiles of up to `rows` rows: the
/// largest divisor of `group` (the heads that share a KV head) that keeps a tile's queries
/// within MAXQ and still gives every thread a task, and the rows that then fit.
fn block_split(group: usize, heads: usize, rows: usize, threads: usize) -> (usize, usize) {
    let rows = rows.clamp(1, MAXQ);
    let sub = (1..=group.min(MAXQ / rows))
        .rev()
        .find(|d| group.is_multiple_of(*d) && heads / d >= threads.max(1))
        .unwrap_or(1);
    (sub, rows.min(MAXQ / sub))
}

/// `head_matvec` of `rows` rows of `x` (`rows` x cols) into `y` (`rows` x the matrix's rows):
/// one product over the rows (each row's bits are those of its own `head_matvec`: `matmul`
/// gives every row the bits it gives a single row).
fn head_matmul(
    m: &HeadMat<'_>,
    x: &[f32],
    rows: usize,
    y: &mut [f32],
    acts: &mut Acts,
    isa: Isa,
) -> Result<(), ModelError> {
    match m {
        HeadMat::View(w) => {
            acts.load(&x[..rows * w.cols], rows, w.cols);
            kernels::matmul(w, acts, &mut y[..rows * w.rows], None, isa)?;
        }
        HeadMat::Owned {
            rows: mr,
            cols,
            data,
        } => {
            for (xr, yr) in x.chunks(*cols).zip(y.chunks_mut(*mr)).take(rows) {
                for (r, o) in yr.iter_mut().enumerate() {
                    *o = dot(&data[r * cols..(r + 1) * cols], xr);
                }
            }
        }
    }
    Ok(())
}

/// The queries of one tile for `attend_blocks`: each score is (the dot of part 0's query with
/// its key columns + part 1's ...) * scale, parts as (first key column, width, one query per
/// tile query); query x attends positions `spans[x]` with an optional sink logit.
struct BlockQueries<'q> {
    parts: &'q [(usize, usize, &'q [&'q [f32]])],
    spans: &'q [(usize, usize)],
    scale: f32,
    sink: &'q dyn Fn(usize) -> Option<f32>,
}

/// Attention of several queries that read the same KV rows, a block of KB positions at a time:
/// each block of keys is widened once (`key`: position -> `key_w` floats) and each part
/// transposed once, and scored against every query (`attn::scores`); each query's scores go to
/// `scs[x][j - first]`; after each query's softmax, each block of values is widened once
/// (`val`: position -> `os[x].len()` floats, `val_w` of them) and summed into every query's
/// output, each output taking its span's rows in order (those before the block's common part,
/// the common part for all queries at once, those after it). Each score, weight and output has
/// the bits of the one-query kernels (`kernels::attn`'s invariant).
#[allow(clippy::type_complexity)]
fn attend_blocks(
    qb: BlockQueries<'_>,
    (key_w, key): (usize, &dyn Fn(usize, &mut [f32])),
    (val_w, val): (usize, &dyn Fn(usize, &mut [f32])),
    scs: &mut [&mut [f32]],
    os: &mut [&mut [f32]],
    scr: &mut Vec<f32>,
    isa: Isa,
) {
    let nq = qb.spans.len();
    let width: usize = qb.parts.iter().map(|p| p.1).sum();
    let rw = key_w.max(val_w);
    let need = KB * rw + KB * width + qb.parts.len() * nq * KB;
    if scr.len() < need {
        scr.resize(need, 0.0);
    }
    let (rows_f, rest) = scr.split_at_mut(KB * rw);
    let (kt, blk) = rest.split_at_mut(KB * width);
    let lo = qb.spans.iter().map(|s| s.0).min().unwrap_or(0);
    let hi = qb.spans.iter().map(|s| s.1).max().unwrap_or(0);
    // Scores, a block of keys at a time.
    let mut j0 = lo;
    while j0 < hi {
        let j1 = (j0 + KB).min(hi);
        let nk = j1 - j0;
        let kb = nk.div_ceil(attn::LANES) * attn::LANES;
        for j in j0..j1 {
            key(j, &mut rows_f[(j - j0) * key_w..(j - j0 + 1) * key_w]);
        }
        let mut col = 0;
        for (p, &(off, pw, qs)) in qb.parts.iter().enumerate() {
            let kt = &mut kt[col * kb..(col + pw) * kb];
            attn::transpose(&rows_f[off..], key_w, pw, nk, kt, kb, isa);
            attn::scores(
                qs,
                kt,
                pw,
                kb,
                1.0,
                &mut blk[p * nq * kb..(p + 1) * nq * kb],
                isa,
            );
            col += pw;
        }
        for (x, sc) in scs.iter_mut().enumerate() {
            let (first, len) = qb.spans[x];
            for j in j0.max(first)..j1.min(len) {
                // The parts' dots summed in order, then scaled (one part: dot * scale).
                let mut v = blk[x * kb + j - j0];
                for p in 1..qb.parts.len() {
                    v += blk[(p * nq + x) * kb + j - j0];
                }
                sc[j - first] = v * qb.scale;
            }
        }
        j0 = j1;
    }
    for (x, sc) in scs.iter_mut().enumerate() {
        let (first, len) = qb.spans[x];
        attn::softmax(&mut sc[..len - first], (qb.sink)(x), isa);
    }
    os.iter_mut().for_each(|o| o.fill(0.0));
    // Values, a block of rows at a time.
    let mut j0 = lo;
    while j0 < hi {
        let j1 = (j0 + KB).min(hi);
        for j in j0..j1 {
            val(j, &mut rows_f[(j - j0) * val_w..(j - j0 + 1) * val_w]);
        }
        let part = |x: usize| (j0.max(qb.spans[x].0), j1.min(qb.spans[x].1));
        let a = (0..nq).map(|x| part(x).0).max().unwrap_or(j0);
        let b = (0..nq).map(|x| part(x).1).min().unwrap_or(j0);
        let one = |x: usize, s: usize, e: usize, o: &mut [f32], sc: &[f32]| {
            if s < e {
                let f = qb.spans[x].0;
                let v = &rows_f[(s - j0) * val_w..(e - j0) * val_w];
                attn::values(&[&sc[s - f..e - f]], v, val_w, &mut [o], isa);
            }
        };
        if a < b {
            for (x, (o, sc)) in os.iter_mut().zip(scs.iter()).enumerate() {
                one(x, part(x).0, a, o, sc);
            }
            let mut ws: [&[f32]; MAXQ] = [&[]; MAXQ];
            for (w, (sc, &(f, _))) in ws.iter_mut().zip(scs.iter().zip(qb.spans)) {
                *w = &sc[a - f..b - f];
            }
            let v = &rows_f[(a - j0) * val_w..(b - j0) * val_w];
            attn::values(&ws[..nq], v, val_w, os, isa);
            for (x, (o, sc)) in os.iter_mut().zip(scs.iter()).enumerate() {
                one(x, b, part(x).1, o, sc);
            }
        } else {
            for (x, (o, sc)) in os.iter_mut().zip(scs.iter()).enumerate() {
                let (s, e) = part(x);
                one(x, s, e, o, sc);
            }
        }
        j0 = j1;
    }
}

impl CpuBackend<'_, '_, '_> {
    /// `Backend::attend_rows` (grouped-query attention of rows row0..row0 + n).
    fn gqa_rows(
        &mut self,
        l: usize,
        row0: usize,
        n: usize,
        pos: usize,
        sh: GqaShape<'_>,
    ) -> Result<(), ModelError> {
        let st = &mut *self.st;
        let hd = sh.head_dim;
        let qd = sh.heads * hd;
        let group = sh.heads / sh.kv_heads;
        let scale = sh.scale;
        let ctx = st.ctx;
        let isa = self.m.isa;
        // Stored rows of this layer, read where they lie in the cache's own element type (the
        // kernels of `kernels::kv`, fused multiply-adds in a fixed order).
        let (kk, vk) = (
            kv_kernels(st.kcache.ty(), self.m.isa),
            kv_kernels(st.vcache.ty(), self.m.isa),
        );
        let (krb, vrb) = (st.kcache.row_bytes(), st.vcache.row_bytes());
        let (khb, vhb) = (kk.ty.row_bytes(hd), vk.ty.row_bytes(hd));
        let layer_k = &st.kcache.bytes()[l * ctx * krb..(l + 1) * ctx * krb];
        let layer_v = &st.vcache.bytes()[l * ctx * vrb..(l + 1) * ctx * vrb];
        let q = &st.q;
        let span = |i: usize| causal_span(pos + i, sh.window);
        // Scores of row i, head hh, for positions j0..j1 (inside its span) into sc, which holds
        // the row's span from `first` on; each score is `scale * dot` of query and key (`dot4`
        // gives each of its four keys `dot`'s bits, so how positions are grouped is free).
        let score = |i: usize, hh: usize, j0: usize, j1: usize, sc: &mut [f32]| {
            let (first, _) = span(i);
            let r = row0 + i;
            let qh = &q[r * qd + hh * hd..r * qd + (hh + 1) * hd];
            let kvh = hh / group;
            let key = |j: usize| &layer_k[j * krb + kvh * khb..j * krb + (kvh + 1) * khb];
            let sc = &mut sc[j0 - first..j1 - first];
            let mut quads = sc.chunks_exact_mut(4);
            let mut j = j0;
            for s4 in &mut quads {
                let d = (kk.dot4)(qh, [key(j), key(j + 1), key(j + 2), key(j + 3)]);
                for (s, d) in s4.iter_mut().zip(d) {
                    *s = d * scale;
                }
                j += 4;
            }
            for s in quads.into_remainder() {
                *s = (kk.dot)(qh, key(j)) * scale;
                j += 1;
            }
        };
        // Softmax of row i's scores, then o = sum_j sc[j] * v_j (the bits of a fill and an
        // axpy per position).
        let finish = |i: usize, hh: usize, o: &mut [f32], sc: &mut [f32]| {
            let (first, len) = span(i);
            let sc = &mut sc[..len - first];
            attn::softmax(sc, sh.sinks.map(|sk| sk[hh]), isa);
            (vk.weighted)(o, sc, &layer_v[first * vrb + (hh / group) * vhb..], vrb);
        };
        let head = |i: usize, hh: usize, o: &mut [f32], sc: &mut [f32]| {
            let (first, len) = span(i);
            score(i, hh, first, len, sc);
            finish(i, hh, o, sc);
        };
        let heads = sh.heads;
        let tile = st.scores.len() / (heads * ctx);
        // Work of the whole call in score elements x head width; small calls stay serial.
        let work = n * (pos + n) * qd;
        if work <= 1 << 14 {
            for i in 0..n {
                let r = row0 + i;
                let out = &mut st.att[r * qd..(r + 1) * qd];
                for (hh, (o, sc)) in out
                    .chunks_mut(hd)
                    .zip(st.scores.chunks_mut(ctx))
                    .enumerate()
                {
                    head(i, hh, o, sc);
                }
            }
            return Ok(());
        }
        if hd.is_multiple_of(attn::LANES) {
            return self.gqa_blocks(l, row0, n, pos, sh);
        }
        // Head widths the block kernels do not take: a task per head runs its rows in order
        // (each head has the same causal work, and its scores slot is its own).
        let (op, sp) = (
            SendPtr(st.att.as_mut_ptr()),
            SendPtr(st.scores.as_mut_ptr()),
        );
        debug_assert!(
            st.att.len() >= (row0 + n) * qd && tile >= 1 && st.scores.len() >= heads * tile * ctx
        );
        kernels::par_for(Some(&self.m.pool), heads, &|hh| {
            let (op, sp) = (&op, &sp);
            // SAFETY: head hh alone writes scores[hh * tile * ctx..][..ctx] and, in each row r,
            // att[r * qd + hh * hd..][..hd] (att holds row0 + n rows of qd = heads * hd, scores
            // heads * tile * ctx); no two heads share an element, and nothing else touches
            // these buffers during the region.
            let sc = unsafe { std::slice::from_raw_parts_mut(sp.0.add(hh * tile * ctx), ctx) };
            for i in 0..n {
                let r = row0 + i;
                // SAFETY: row r's slice of head hh, as above.
                let o = unsafe { std::slice::from_raw_parts_mut(op.0.add(r * qd + hh * hd), hd) };
                head(i, hh, o, sc);
            }
        });
        Ok(())
    }

    /// `gqa_rows` for head widths that are a multiple of 16, many rows or a long context: a
    /// task per group of heads that share a KV head (all of the group when that leaves a task
    /// per thread) runs the chunk's rows in tiles, each tile's queries through
    /// `attend_blocks`. Every score and output has the bits of the one-query path.
    fn gqa_blocks(
        &mut self,
        l: usize,
        row0: usize,
        n: usize,
        pos: usize,
        sh: GqaShape<'_>,
    ) -> Result<(), ModelError> {
        let st = &mut *self.st;
        let isa = self.m.isa;
        let hd = sh.head_dim;
        let heads = sh.heads;
        let qd = heads * hd;
        let group = heads / sh.kv_heads;
        let ctx = st.ctx;
        let tile = st.scores.len() / (heads * ctx);
        let (kty, vty) = (st.kcache.ty(), st.vcache.ty());
        let (krb, vrb) = (st.kcache.row_bytes(), st.vcache.row_bytes());
        let (khb, vhb) = (kty.row_bytes(hd), vty.row_bytes(hd));
        let layer_k = &st.kcache.bytes()[l * ctx * krb..(l + 1) * ctx * krb];
        let layer_v = &st.vcache.bytes()[l * ctx * vrb..(l + 1) * ctx * vrb];
        let span = |i: usize| causal_span(pos + i, sh.window);
        let (sub, tile_rows) =
            block_split(group, heads, tile.min(n), self.m.pool.current_num_threads());
        let q = &st.q;
        let (op, sp) = (
            SendPtr(st.att.as_mut_ptr()),
            SendPtr(st.scores.as_mut_ptr()),
        );
        assert!(
            st.att.len() >= (row0 + n) * qd && tile >= 1 && st.scores.len() >= heads * tile * ctx,
            "backend: attention buffers shorter than {n} rows"
        );
        kernels::par_for(Some(&self.m.pool), heads / sub, &|task| {
            let (op, sp) = (&op, &sp);
            let (h0, kvh) = (task * sub, task * sub / group);
            let key = |j: usize, o: &mut [f32]| {
                kv_load_row(
                    kty,
                    &layer_k[j * krb + kvh * khb..j * krb + (kvh + 1) * khb],
                    o,
                )
            };
            let val = |j: usize, o: &mut [f32]| {
                kv_load_row(
                    vty,
                    &layer_v[j * vrb + kvh * vhb..j * vrb + (kvh + 1) * vhb],
                    o,
                )
            };
            SCRATCH.with_borrow_mut(|scr| {
                let mut i0 = 0;
                while i0 < n {
                    let rows = tile_rows.min(n - i0);
                    // Query x of the tile: head h0 + x / rows, row i0 + x % rows.
                    let nq = sub * rows;
                    let at = |x: usize| (h0 + x / rows, i0 + x % rows);
                    let mut scs: [&mut [f32]; MAXQ] = std::array::from_fn(|_| &mut [][..]);
                    let mut os: [&mut [f32]; MAXQ] = std::array::from_fn(|_| &mut [][..]);
                    let mut qs: [&[f32]; MAXQ] = [&[]; MAXQ];
                    let mut spans = [(0usize, 0usize); MAXQ];
                    for x in 0..nq {
                        let (hh, i) = at(x);
                        let r = row0 + i;
                        // SAFETY: this task alone writes the score slots of heads h0..h0 + sub
                        // (scores[(hh * tile + t) * ctx..][..ctx], t < tile) and, in each row r,
                        // att[r * qd + hh * hd..][..hd] of those heads; no other task touches
                        // them during the region, and each (head, row) is taken once.
                        scs[x] = unsafe {
                            std::slice::from_raw_parts_mut(
                                sp.0.add((hh * tile + (i - i0)) * ctx),
                                ctx,
                            )
                        };
                        // SAFETY: as above (this task's heads in the tile's rows).
                        os[x] = unsafe {
                            std::slice::from_raw_parts_mut(op.0.add(r * qd + hh * hd), hd)
                        };
                        qs[x] = &q[r * qd + hh * hd..r * qd + (hh + 1) * hd];
                        spans[x] = span(i);
                    }
                    attend_blocks(
                        BlockQueries {
                            parts: &[(0, hd, &qs[..nq])],
                            spans: &spans[..nq],
                            scale: sh.scale,
                            sink: &|x| sh.sinks.map(|sk| sk[at(x).0]),
                        },
                        (hd, &key),
                        (hd, &val),
                        &mut scs[..nq],
                        &mut os[..nq],
                        scr,
                        isa,
                    );
                    i0 += rows;
                }
            });
        });
        Ok(())
    }

    /// `Backend::attend_mla_rows` (timed there).
    fn mla_rows(
        &mut self,
        l: usize,
        row0: usize,
        n: usize,
        pos: usize,
        a: &Mla<'_>,
    ) -> Result<(), ModelError> {
        let (m, st) = (self.m, &mut *self.st);
        let cfg = &m.cfg;
        let AttnKind::Mla {
            kv_lora,
            nope,
            rope,
            v_dim,
            ..
        } = cfg.attn
        else {
            return Err(ModelError::Config("MLA weights in a GQA model".into()));
        };
        let (nh, qk, isa) = (cfg.n_heads, cfg.head_dim, m.isa);
        // Long enough to share blocks (as `gqa_rows`' serial cut-off), no indexer, SIMD widths.
        if a.indexer.is_none()
            && !a.shares_indexer
            && n * (pos + n) * nh * (kv_lora + rope) > 1 << 14
            && kv_lora.is_multiple_of(attn::LANES)
            && rope.is_multiple_of(attn::LANES)
            && qk == nope + rope
        {
            return self.mla_blocks(l, row0, n, pos, a, (kv_lora, nope, rope, v_dim));
        }
        let ctx = st.ctx;
        let kk = kv_kernels(st.kcache.ty(), isa);
        let (krb, lat_b) = (st.kcache.row_bytes(), kk.ty.row_bytes(kv_lora));
        debug_assert_eq!(st.kcache.width(), kv_lora + rope);
        for i in 0..n {
            let len = pos + i + 1;
            // V3.2: past `index_topk` positions, attend only to those the indexer selects.
            // GLM-5: a shared layer reuses the choice of the last layer that ran its indexer.
            // Row `r` of Q and Att (one sequence's rows in a batched forward start at row0;
            // an indexer runs one sequence, row0 = 0).
            let r = row0 + i;
            let sparse = match &a.indexer {
                Some(_) => {
                    let sparse = m.indexer_select(st, l, i, len);
                    st.idx.keep(i, sparse);
                    sparse
                }
                None if a.shares_indexer => st.idx.recall(i),
                None => false,
            };
            let sel = &st.idx.sel[..if sparse { st.idx.sel.len() } else { 0 }];
            let cnt = if sparse { sel.len() } else { len };
            let layer = &st.kcache.bytes()[l * ctx * krb..(l + 1) * ctx * krb];
            let q_row = &st.q[r * nh * qk..(r + 1) * nh * qk];
            // One head of row r: absorbed query, scores over the selected (or all) positions,
            // softmax, the latent sum, v_b. Rows of [latent | rope key] are read in place in
            // the cache's element type (`-ctk`; `kernels::kv`'s dot and weighted sum).
            let head = |hh: usize,
                        lat: &mut [f32],
                        acts: &mut Acts,
                        sc: &mut [f32],
                        out: &mut [f32]|
             -> Result<(), ModelError> {
                let q = &q_row[hh * qk..(hh + 1) * qk];
                let (q_lat, c_lat) = lat[..2 * kv_lora].split_at_mut(kv_lora);
                head_matvec(&a.k_b[hh], &q[..nope], q_lat, acts, isa)?;
                let sc = &mut sc[..cnt];
                let at = |jj: usize| if sparse { sel[jj] as usize } else { jj };
                for (jj, s) in sc.iter_mut().enumerate() {
                    let j = at(jj);
                    let c = &layer[j * krb..(j + 1) * krb];
                    *s = ((kk.dot)(q_lat, &c[..lat_b]) + (kk.dot)(&q[nope..], &c[lat_b..]))
                        * cfg.attn_scale;
                }
                attn::softmax(sc, None, isa);
                if sparse {
                    c_lat.fill(0.0);
                    for (jj, s) in sc.iter().enumerate() {
                        (kk.axpy)(c_lat, *s, &layer[at(jj) * krb..][..lat_b]);
                    }
                } else {
                    // The bits of the fill and one FMA per position in order.
                    (kk.weighted)(c_lat, sc, layer, krb);
                }
                head_matvec(&a.v_b[hh], c_lat, out, acts, isa)
            };
            let att = &mut st.att[r * nh * v_dim..(r + 1) * nh * v_dim];
            if cnt * nh * (kv_lora + rope) <= 1 << 12 || m.pool.current_num_threads() <= 1 {
                for (hh, (sc, out)) in st
                    .scores
                    .chunks_mut(ctx)
                    .zip(att.chunks_mut(v_dim))
                    .take(nh)
                    .enumerate()
                {
                    head(hh, &mut st.lat, &mut st.acts, sc, out)?;
                }
                continue;
            }
            // Heads in parallel (each head's own scores slot and output; per-thread scratch).
            let tile = st.scores.len() / (nh * ctx);
            let (op, sp) = (SendPtr(att.as_mut_ptr()), SendPtr(st.scores.as_mut_ptr()));
            let failed = std::sync::Mutex::new(None);
            kernels::par_for(Some(&m.pool), nh, &|hh| {
                let (op, sp) = (&op, &sp);
                // SAFETY: head hh alone writes scores[hh * tile * ctx..][..ctx] (scores holds
                // nh * tile * ctx, tile >= 1) and att row r's [hh * v_dim..][..v_dim]; nothing
                // else touches them during the region.
                let (sc, out) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(sp.0.add(hh * tile * ctx), ctx),
                        std::slice::from_raw_parts_mut(op.0.add(hh * v_dim), v_dim),
                    )
                };
                MLA_SCRATCH.with_borrow_mut(|(lat, acts)| {
                    if lat.len() < 2 * kv_lora {
                        lat.resize(2 * kv_lora, 0.0);
                    }
                    if let Err(e) = head(hh, lat, acts, sc, out) {
                        *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    }
                });
            });
            if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// `attend_mla_rows` of a layer without an indexer, latent and rope widths multiples of
    /// 16: every head reads the same latent cache (one KV head), so a task per group of heads
    /// (all heads when that leaves a task per thread) runs the chunk's rows in tiles: each
    /// query's absorbed latent (`k_b`), the tile's queries through `attend_blocks` (score =
    /// (latent dot + rope dot) * scale, values = the latent rows), then `v_b`. Each score,
    /// weight and output has the bits of the row-by-row path.
    fn mla_blocks(
        &mut self,
        l: usize,
        row0: usize,
        n: usize,
        pos: usize,
        a: &Mla<'_>,
        (kv_lora, nope, rope, v_dim): (usize, usize, usize, usize),
    ) -> Result<(), ModelError> {
        let (m, st) = (self.m, &mut *self.st);
        let cfg = &m.cfg;
        let (nh, qk, isa) = (cfg.n_heads, cfg.head_dim, m.isa);
        let ctx = st.ctx;
        let tile = st.scores.len() / (nh * ctx);
        let kty = st.kcache.ty();
        let (krb, lat_b) = (st.kcache.row_bytes(), kty.row_bytes(kv_lora));
        let w = kv_lora + rope;
        let layer = &st.kcache.bytes()[l * ctx * krb..(l + 1) * ctx * krb];
        let (sub, tile_rows) = block_split(nh, nh, tile.min(n), m.pool.current_num_threads());
        let q = &st.q;
        let (op, sp) = (
            SendPtr(st.att.as_mut_ptr()),
            SendPtr(st.scores.as_mut_ptr()),
        );
        assert!(
            st.att.len() >= (row0 + n) * nh * v_dim
                && tile >= 1
                && st.scores.len() >= nh * tile * ctx
                && st.q.len() >= (row0 + n) * nh * qk,
            "backend: attention buffers shorter than {n} rows"
        );
        let key = |j: usize, o: &mut [f32]| kv_load_row(kty, &layer[j * krb..(j + 1) * krb], o);
        let val = |j: usize, o: &mut [f32]| kv_load_row(kty, &layer[j * krb..j * krb + lat_b], o);
        let failed = std::sync::Mutex::new(None);
        kernels::par_for(Some(&m.pool), nh / sub, &|task| {
            let (op, sp) = (&op, &sp);
            let h0 = task * sub;
            MLA_SCRATCH.with_borrow_mut(|(lat, acts)| {
                let need = 2 * MAXQ * kv_lora + MAXQ * nope.max(v_dim);
                if lat.len() < need {
                    lat.resize(need, 0.0);
                }
                let (q_lat, rest) = lat.split_at_mut(MAXQ * kv_lora);
                let (c_lat, tmp) = rest.split_at_mut(MAXQ * kv_lora);
                SCRATCH.with_borrow_mut(|scr| {
                    let mut i0 = 0;
                    while i0 < n {
                        let rows = tile_rows.min(n - i0);
                        let nq = sub * rows;
                        let at = |x: usize| (h0 + x / rows, i0 + x % rows);
                        let qrow = |x: usize| {
                            let (hh, i) = at(x);
                            let r = row0 + i;
                            &q[r * nh * qk + hh * qk..r * nh * qk + (hh + 1) * qk]
                        };
                        // Each head's rows of the tile: q_nope gathered, one product with k_b.
                        for (hx, ql) in q_lat.chunks_mut(rows * kv_lora).take(sub).enumerate() {
                            for t in 0..rows {
                                tmp[t * nope..(t + 1) * nope]
                                    .copy_from_slice(&qrow(hx * rows + t)[..nope]);
                            }
                            let r = head_matmul(&a.k_b[h0 + hx], tmp, rows, ql, acts, isa);
                            if let Err(e) = r {
                                *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                                return;
                            }
                        }
                        let mut scs: [&mut [f32]; MAXQ] = std::array::from_fn(|_| &mut [][..]);
                        let mut cs: [&mut [f32]; MAXQ] = std::array::from_fn(|_| &mut [][..]);
                        let mut qls: [&[f32]; MAXQ] = [&[]; MAXQ];
                        let mut qrs: [&[f32]; MAXQ] = [&[]; MAXQ];
                        let mut spans = [(0usize, 0usize); MAXQ];
                        for (x, c) in c_lat.chunks_mut(kv_lora).take(nq).enumerate() {
                            let (hh, i) = at(x);
                            // SAFETY: this task alone writes the score slots of heads h0..h0 +
                            // sub (scores[(hh * tile + t) * ctx..][..ctx], t < tile); each
                            // (head, row) is taken once, and nothing else touches them.
                            scs[x] = unsafe {
                                std::slice::from_raw_parts_mut(
                                    sp.0.add((hh * tile + (i - i0)) * ctx),
                                    ctx,
                                )
                            };
                            cs[x] = c;
                            qls[x] = &q_lat[x * kv_lora..(x + 1) * kv_lora];
                            qrs[x] = &qrow(x)[nope..];
                            spans[x] = causal_span(pos + i, None);
                        }
                        attend_blocks(
                            BlockQueries {
                                parts: &[(0, kv_lora, &qls[..nq]), (kv_lora, rope, &qrs[..nq])],
                                spans: &spans[..nq],
                                scale: cfg.attn_scale,
                                sink: &|_| None,
                            },
                            (w, &key),
                            (kv_lora, &val),
                            &mut scs[..nq],
                            &mut cs[..nq],
                            scr,
                            isa,
                        );
                        for (hx, c) in c_lat.chunks(rows * kv_lora).take(sub).enumerate() {
                            let hh = h0 + hx;
                            if let Err(e) = head_matmul(&a.v_b[hh], c, rows, tmp, acts, isa) {
                                *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                                return;
                            }
                            for t in 0..rows {
                                let r = row0 + i0 + t;
                                // SAFETY: row r's output of head hh (att holds row0 + n rows of
                                // nh * v_dim), written by this task alone.
                                let out = unsafe {
                                    std::slice::from_raw_parts_mut(
                                        op.0.add(r * nh * v_dim + hh * v_dim),
                                        v_dim,
                                    )
                                };
                                out.copy_from_slice(&tmp[t * v_dim..(t + 1) * v_dim]);
                            }
                        }
                        i0 += rows;
                    }
                });
            });
        });
        match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// `Backend::matmul`.
    fn matmul_rows(
        &mut self,
        src: Rows,
        n: usize,
        outs: &[(&WeightView<'_>, Buf)],
    ) -> Result<(), ModelError> {
        let (pool, isa) = (Some(&self.m.pool), self.m.isa);
        let w = src.width;
        let s = std::mem::take(vec_of(self.st, src.buf));
        self.st
            .acts
            .load(&s[src.row0 * w..(src.row0 + n) * w], n, w);
        *vec_of(self.st, src.buf) = s;
        if n == 1 && outs.len() > 1 {
            return self.matvecs(outs);
        }
        for (wv, dst) in outs {
            let mut d = std::mem::take(vec_of(self.st, *dst));
            let r = kernels::matmul(wv, &mut self.st.acts, &mut d[..n * wv.rows], pool, isa);
            *vec_of(self.st, *dst) = d;
            r?;
        }
        Ok(())
    }

    /// Decode's products of one loaded activation row with several weights (q, k and v) as
    /// one parallel region (`matmul_jobs`) instead of one per weight; each output element has
    /// the bits `kernels::matmul` gives it.
    fn matvecs(&mut self, outs: &[(&WeightView<'_>, Buf)]) -> Result<(), ModelError> {
        const MAX: usize = 8;
        if outs.len() > MAX || (1..outs.len()).any(|i| outs[..i].iter().any(|o| o.1 == outs[i].1)) {
            return Err(ModelError::Input(format!(
                "backend: {} products of one row, or an output named twice",
                outs.len()
            )));
        }
        for (wv, dst) in outs {
            if vec_of(self.st, *dst).len() < wv.rows {
                return Err(ModelError::Input(format!(
                    "backend: {dst:?} is shorter than the {} rows of its product",
                    wv.rows
                )));
            }
        }
        let (pool, isa) = (Some(&self.m.pool), self.m.isa);
        for (wv, _) in outs {
            kernels::prepare_for(wv.dtype, &mut self.st.acts)?;
        }
        let mut ys: [Vec<f32>; MAX] = Default::default();
        for (y, (_, dst)) in ys.iter_mut().zip(outs) {
            *y = std::mem::take(vec_of(self.st, *dst));
        }
        let r = {
            let acts = &self.st.acts;
            let mut jobs: [Option<kernels::MatJob<'_, '_>>; MAX] = Default::default();
            for ((job, y), (wv, _)) in jobs.iter_mut().zip(ys.iter_mut()).zip(outs) {
                *job = Some(kernels::MatJob {
                    w: wv,
                    acts,
                    row0: 0,
                    rows: 1,
                    pick: None,
                    y: &mut y[..wv.rows],
                });
            }
            kernels::matmul_jobs(&mut jobs[..outs.len()], pool, isa)
        };
        for (y, (_, dst)) in ys.iter_mut().zip(outs) {
            *vec_of(self.st, *dst) = std::mem::take(y);
        }
        r?;
        Ok(())
    }
}

impl Drop for CpuBackend<'_, '_, '_> {
    fn drop(&mut self) {
        self.release();
        cpu_prof::end_call(self.prof.1, self.prof.0);
    }
}

impl Backend for CpuBackend<'_, '_, '_> {
    fn embed(
        &mut self,
        table: &WeightView<'_>,
        tokens: &[u32],
        dst: Buf,
    ) -> Result<(), ModelError> {
        self.prof.1 += tokens.len();
        let (er, h) = (table.row_bytes(), table.cols);
        let d = vec_of(self.st, dst);
        for (i, &t) in tokens.iter().enumerate() {
            let src = &table.bytes[t as usize * er..(t as usize + 1) * er];
            kernels::dequantize(table.dtype, src, &mut d[i * h..(i + 1) * h])?;
        }
        Ok(())
    }

    fn matmul(
        &mut self,
        src: Rows,
        n: usize,
        outs: &[(&WeightView<'_>, Buf)],
    ) -> Result<(), ModelError> {
        debug_assert!(src.stride == src.width && src.off == 0);
        let t = cpu_prof::start();
        let r = self.matmul_rows(src, n, outs);
        cpu_prof::add(cpu_prof::MATMUL, t);
        r
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
        if dst.buf == src.buf {
            self.each_row(dst, n, |_, x| {
                x.chunks_exact_mut(part)
                    .for_each(|p| rmsnorm_inplace(p, w, eps))
            });
            return Ok(());
        }
        self.each_pair(dst, src, n, |d, s| {
            d.chunks_exact_mut(part)
                .zip(s.chunks_exact(part))
                .for_each(|(d, s)| rmsnorm(d, s, w, eps))
        })
    }

    fn layer_norm(
        &mut self,
        x: Rows,
        n: usize,
        w: &[f32],
        b: &[f32],
        eps: f64,
    ) -> Result<(), ModelError> {
        self.each_row(x, n, |_, r| super::deepseek2::layer_norm(r, w, b, eps));
        Ok(())
    }

    fn add_bias(&mut self, x: Rows, n: usize, b: &[f32]) -> Result<(), ModelError> {
        self.each_row(x, n, |_, r| r.iter_mut().zip(b).for_each(|(x, b)| *x += b));
        Ok(())
    }

    fn clamp(&mut self, x: Rows, n: usize, c: f32) -> Result<(), ModelError> {
        self.each_row(x, n, |_, r| r.iter_mut().for_each(|x| *x = x.clamp(-c, c)));
        Ok(())
    }

    fn scale(&mut self, x: Rows, n: usize, s: f32) -> Result<(), ModelError> {
        self.each_row(x, n, |_, r| r.iter_mut().for_each(|v| *v *= s));
        Ok(())
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
        let rope = &self.m.rope;
        self.each_row(x, n, |i, r| {
            r.chunks_exact_mut(head)
                .for_each(|hd| rope.apply_as(&mut hd[off..], pos + i, layout))
        });
        Ok(())
    }

    fn store_cache(
        &mut self,
        layer: usize,
        side: Cache,
        src: Rows,
        n: usize,
        pos: usize,
    ) -> Result<(), ModelError> {
        let (ctx, w) = (self.st.ctx, src.width);
        let s = std::mem::take(vec_of(self.st, src.buf));
        let cache = match side {
            Cache::K => &mut self.st.kcache,
            Cache::V => &mut self.st.vcache,
        };
        let (ty, rb) = (cache.ty(), cache.row_bytes());
        let fits = cache.width() == w && (layer * ctx + pos + n) * rb <= cache.bytes().len();
        if fits {
            // Each new position's row converted once into the cache's element type.
            let bytes = cache.bytes_mut();
            for i in 0..n {
                let base = (layer * ctx + pos + i) * rb;
                kv_store_row(ty, &s[row(src, i)], &mut bytes[base..base + rb]);
            }
        }
        *vec_of(self.st, src.buf) = s;
        if !fits {
            return Err(ModelError::Input(format!(
                "backend: {n} rows of {w} at position {pos} of layer {layer} do not fit the {side:?} cache"
            )));
        }
        Ok(())
    }

    fn use_sequence(&mut self, seq: usize) -> Result<(), ModelError> {
        if self.cur == Some(seq) {
            return Ok(());
        }
        self.release();
        let Some(s) = self.seqs.get_mut(seq) else {
            return Err(ModelError::Input(format!(
                "backend: sequence {seq} of {}",
                self.seqs.len()
            )));
        };
        if s.ctx != self.st.ctx
            || s.cache_dims != self.st.cache_dims
            || s.kv_types() != self.st.kv_types()
            || s.hybrid.conv.len() != self.st.hybrid.conv.len()
            || s.hybrid.rec.len() != self.st.hybrid.rec.len()
        {
            return Err(ModelError::Input(
                "backend: a sequence's cache does not match the batch state".into(),
            ));
        }
        // The KV cache and a hybrid model's recurrent state (each a swap of two vectors).
        std::mem::swap(&mut self.st.kcache, &mut s.kcache);
        std::mem::swap(&mut self.st.vcache, &mut s.vcache);
        std::mem::swap(&mut self.st.hybrid.conv, &mut s.hybrid.conv);
        std::mem::swap(&mut self.st.hybrid.rec, &mut s.hybrid.rec);
        self.cur = Some(seq);
        Ok(())
    }

    fn attend(
        &mut self,
        l: usize,
        n: usize,
        pos: usize,
        sh: GqaShape<'_>,
    ) -> Result<(), ModelError> {
        self.attend_rows(l, 0, n, pos, sh)
    }

    fn attend_rows(
        &mut self,
        l: usize,
        row0: usize,
        n: usize,
        pos: usize,
        sh: GqaShape<'_>,
    ) -> Result<(), ModelError> {
        let t = cpu_prof::start();
        let r = self.gqa_rows(l, row0, n, pos, sh);
        cpu_prof::add(cpu_prof::ATTEND, t);
        r
    }

    fn attend_mla(
        &mut self,
        l: usize,
        n: usize,
        pos: usize,
        a: &Mla<'_>,
    ) -> Result<(), ModelError> {
        self.attend_mla_rows(l, 0, n, pos, a)
    }

    fn attend_mla_rows(
        &mut self,
        l: usize,
        row0: usize,
        n: usize,
        pos: usize,
        a: &Mla<'_>,
    ) -> Result<(), ModelError> {
        let t = cpu_prof::start();
        let r = self.mla_rows(l, row0, n, pos, a);
        cpu_prof::add(cpu_prof::ATTEND, t);
        r
    }

    fn swiglu(&mut self, n: usize, f: usize) -> Result<(), ModelError> {
        let st = &mut *self.st;
        swiglu_par(&self.m.pool, &mut st.gate[..n * f], &st.up[..n * f]);
        Ok(())
    }

    fn add(&mut self, dst: Buf, src: Buf, n: usize, width: usize) -> Result<(), ModelError> {
        let (d, s) = (Rows::of(dst, n * width), Rows::of(src, n * width));
        self.each_pair(d, s, 1, |d, s| {
            for (x, p) in d.iter_mut().zip(s) {
                *x += p;
            }
        })
    }

    fn copy(&mut self, dst: Rows, src: Rows, n: usize) -> Result<(), ModelError> {
        self.each_pair(dst, src, n, |d, s| d.copy_from_slice(s))
    }

    fn moe(&mut self, layer: usize, m: &Moe<'_>, n: usize) -> Result<(), ModelError> {
        self.m.moe(self.st, layer, n, m)
    }

    fn prefetch(&mut self, next: usize, n: usize) -> Result<(), ModelError> {
        self.m.prefetch_next(self.st, next, n)
    }

    fn prof(&mut self) -> &mut Prof {
        &mut self.st.prof
    }

    // DeepSeek V4: the arithmetic is deepseek_v4.rs's `cpu_*`.

    fn v4_hc_expand(&mut self, n: usize) -> Result<(), ModelError> {
        super::deepseek_v4::cpu_hc_expand(self.m, self.st, n)
    }

    fn v4_hc_pre(&mut self, w: &super::deepseek_v4::Hc, n: usize) -> Result<(), ModelError> {
        super::deepseek_v4::cpu_hc_pre(self.m, self.st, w, n)
    }

    fn v4_hc_post(&mut self, n: usize) -> Result<(), ModelError> {
        super::deepseek_v4::cpu_hc_post(self.m, self.st, n)
    }

    fn v4_hc_head(&mut self, w: &super::deepseek_v4::HcHead, n: usize) -> Result<(), ModelError> {
        super::deepseek_v4::cpu_hc_head(self.m, self.st, w, n)
    }

    fn v4_attention(
        &mut self,
        layer: usize,
        a: &super::deepseek_v4::Attn<'_>,
        w: &super::deepseek_v4::V4Weights<'_>,
        n: usize,
        at: super::backend::At,
    ) -> Result<(), ModelError> {
        super::deepseek_v4::cpu_attention(self.m, self.st, layer, a, w, n, at.pos)
    }

    fn v4_moe(
        &mut self,
        layer: usize,
        m: &super::deepseek_v4::MoeW<'_>,
        tokens: &[u32],
        n: usize,
    ) -> Result<(), ModelError> {
        super::deepseek_v4::cpu_moe(self.m, self.st, layer, m, tokens, n)
    }

    // Qwen3-Next
    fn gated_attention(
        &mut self,
        l: usize,
        n: usize,
        at: At,
        a: &GatedAttn<'_>,
    ) -> Result<(), ModelError> {
        self.gated_proj(n, a)?;
        self.gated_core(l, 0, n, at, a)?;
        self.gated_out(n, a)
    }

    fn gated_attention_seqs(
        &mut self,
        l: usize,
        n: usize,
        spans: &[Span],
        a: &GatedAttn<'_>,
    ) -> Result<(), ModelError> {
        self.gated_proj(n, a)?;
        for s in spans {
            self.use_sequence(s.seq)?;
            self.gated_core(l, s.row0, s.n, s.at, a)?;
        }
        self.gated_out(n, a)
    }

    fn delta_net(
        &mut self,
        l: usize,
        n: usize,
        at: At,
        d: &DeltaNet<'_>,
    ) -> Result<(), ModelError> {
        let li = self.delta_proj(l, n, d)?;
        self.delta_recur(li, 0, n, at.pos, d)?;
        self.delta_out(n, d)
    }

    fn delta_net_seqs(
        &mut self,
        l: usize,
        n: usize,
        spans: &[Span],
        d: &DeltaNet<'_>,
    ) -> Result<(), ModelError> {
        let li = self.delta_proj(l, n, d)?;
        for s in spans {
            self.use_sequence(s.seq)?;
            self.delta_recur(li, s.row0, s.n, s.at.pos, d)?;
        }
        self.delta_out(n, d)
    }
}

// The hybrid layers' pieces (Qwen3-Next / Qwen3.5): what runs once over every row of a chunk
// (projections, gate, output) and what runs per sequence on its own state (the conv and delta
// rule; q/k norms, rotation, cache and attention), so a batched forward's rows each see their own
// sequence's state and compute what a lone forward computes.
impl CpuBackend<'_, '_, '_> {
    /// Gated attention's q/gate, k and v projections of rows 0..n of `Xn`.
    fn gated_proj(&mut self, n: usize, a: &GatedAttn<'_>) -> Result<(), ModelError> {
        let cfg = &self.m.cfg;
        let (h, qd, kvd, hd) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let (pool, isa) = (Some(&self.m.pool), self.m.isa);
        let st = &mut *self.st;
        st.acts.load(&st.xn[..n * h], n, h);
        kernels::matmul(
            &a.wq,
            &mut st.acts,
            &mut st.hybrid.qg[..n * 2 * qd],
            pool,
            isa,
        )?;
        kernels::matmul(&a.wk, &mut st.acts, &mut st.k[..n * kvd], pool, isa)?;
        kernels::matmul(&a.wv, &mut st.acts, &mut st.v[..n * kvd], pool, isa)?;
        for i in 0..n {
            for hh in 0..cfg.n_heads {
                let src = &st.hybrid.qg[i * 2 * qd + hh * 2 * hd..][..2 * hd];
                st.q[i * qd + hh * hd..][..hd].copy_from_slice(&src[..hd]);
                st.hybrid.gate[i * qd + hh * hd..][..hd].copy_from_slice(&src[hd..]);
            }
        }
        Ok(())
    }

    /// Gated attention's per-sequence part on rows r0..r0 + n: q/k norms, rotation, the
    /// cache writes and attention into `Att`.
    fn gated_core(
        &mut self,
        l: usize,
        r0: usize,
        n: usize,
        at: At,
        a: &GatedAttn<'_>,
    ) -> Result<(), ModelError> {
        let cfg = &self.m.cfg;
        let (qd, kvd, hd) = (cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let (q, k, v) = (
            Rows::of(Buf::Q, qd).from_row(r0),
            Rows::of(Buf::K, kvd).from_row(r0),
            Rows::of(Buf::V, kvd).from_row(r0),
        );
        self.rmsnorm(q, q, n, hd, &a.q_norm, cfg.rms_eps)?;
        self.rmsnorm(k, k, n, hd, &a.k_norm, cfg.rms_eps)?;
        self.rope(q, n, hd, 0, at.rope, cfg.rope_layout)?;
        self.rope(k, n, hd, 0, at.rope, cfg.rope_layout)?;
        // Only the full-attention layers keep KV: their own compact slots.
        let slot = cfg
            .hybrid
            .as_deref()
            .and_then(|hy| hy.kv_slot(l))
            .ok_or_else(|| {
                ModelError::Config(format!("layer {l} is not a full-attention layer"))
            })?;
        self.store_cache(slot, Cache::K, k, n, at.pos)?;
        self.store_cache(slot, Cache::V, v, n, at.pos)?;
        let shape = GqaShape {
            heads: cfg.n_heads,
            kv_heads: cfg.n_kv_heads,
            head_dim: hd,
            scale: cfg.attn_scale,
            window: None,
            sinks: None,
        };
        self.attend_rows(slot, r0, n, at.pos, shape)
    }

    /// Gated attention's output gate and o_proj over rows 0..n.
    fn gated_out(&mut self, n: usize, a: &GatedAttn<'_>) -> Result<(), ModelError> {
        let qd = self.m.cfg.q_dim();
        let st = &mut *self.st;
        for (o, g) in st.att[..n * qd].iter_mut().zip(&st.hybrid.gate[..n * qd]) {
            *o *= 1.0 / (1.0 + (-g).exp());
        }
        self.matmul(Rows::of(Buf::Att, qd), n, &[(&a.wo, Buf::Proj)])
    }

    /// Gated DeltaNet's input projections of rows 0..n of `Xn` (into [q; k; v], z, b, a);
    /// returns the layer's index among the linear layers.
    fn delta_proj(&mut self, l: usize, n: usize, d: &DeltaNet<'_>) -> Result<usize, ModelError> {
        let cfg = &self.m.cfg;
        let (Some(hy), h) = (cfg.hybrid.as_deref(), cfg.hidden) else {
            return Err(ModelError::Config(
                "Gated DeltaNet in a model without hybrid layers".into(),
            ));
        };
        let li = hy.linear_index(l).ok_or_else(|| {
            ModelError::Config(format!("layer {l} is not a linear-attention layer"))
        })?;
        let (pool, isa) = (Some(&self.m.pool), self.m.isa);
        let (kd, vd, nv, cd) = (hy.key_dim(), hy.value_dim(), hy.v_heads, hy.conv_dim());
        let st = &mut *self.st;
        let hs = &mut st.hybrid;
        st.acts.load(&st.xn[..n * h], n, h);
        if hy.fused {
            let w = 2 * kd + 2 * vd;
            kernels::matmul(&d.in_qkv, &mut st.acts, &mut hs.proj[..n * w], pool, isa)?;
            kernels::matmul(&d.in_b, &mut st.acts, &mut hs.ba[..n * 2 * nv], pool, isa)?;
            for i in 0..n {
                qwen3next::ungroup(
                    hy,
                    &hs.proj[i * w..(i + 1) * w],
                    &hs.ba[i * 2 * nv..(i + 1) * 2 * nv],
                    &mut hs.mixed[i * cd..(i + 1) * cd],
                    &mut hs.z[i * vd..(i + 1) * vd],
                    &mut hs.b[i * nv..(i + 1) * nv],
                    &mut hs.a[i * nv..(i + 1) * nv],
                );
            }
        } else {
            let Some(wz) = &d.in_z else {
                return Err(ModelError::Config(
                    "Gated DeltaNet without a z projection".into(),
                ));
            };
            kernels::matmul(&d.in_qkv, &mut st.acts, &mut hs.mixed[..n * cd], pool, isa)?;
            kernels::matmul(wz, &mut st.acts, &mut hs.z[..n * vd], pool, isa)?;
            match &d.in_a {
                Some(wa) => {
                    kernels::matmul(&d.in_b, &mut st.acts, &mut hs.b[..n * nv], pool, isa)?;
                    kernels::matmul(wa, &mut st.acts, &mut hs.a[..n * nv], pool, isa)?;
                }
                None => {
                    // Qwen3-Next GGUF: b and a still grouped per key head.
                    kernels::matmul(&d.in_b, &mut st.acts, &mut hs.ba[..n * 2 * nv], pool, isa)?;
                    for i in 0..n {
                        qwen3next::ungroup_ba(
                            hy,
                            &hs.ba[i * 2 * nv..(i + 1) * 2 * nv],
                            &mut hs.b[i * nv..(i + 1) * nv],
                            &mut hs.a[i * nv..(i + 1) * nv],
                        );
                    }
                }
            }
        }
        Ok(li)
    }

    /// Gated DeltaNet's recurrent part on rows r0..r0 + n (one sequence, at position `pos`):
    /// the conv and the delta rule token by token on linear layer `li`'s state (zeroed first
    /// at position 0), then the gated norm, into the rows of the core output.
    fn delta_recur(
        &mut self,
        li: usize,
        r0: usize,
        n: usize,
        pos: usize,
        d: &DeltaNet<'_>,
    ) -> Result<(), ModelError> {
        let cfg = &self.m.cfg;
        let Some(hy) = cfg.hybrid.as_deref() else {
            return Err(ModelError::Config(
                "Gated DeltaNet in a model without hybrid layers".into(),
            ));
        };
        let (vd, nv, cd) = (hy.value_dim(), hy.v_heads, hy.conv_dim());
        let hs = &mut self.st.hybrid;
        let conv = &mut hs.conv[li * hy.conv_state()..(li + 1) * hy.conv_state()];
        let rec = &mut hs.rec[li * hy.rec_state()..(li + 1) * hy.rec_state()];
        if pos == 0 {
            conv.fill(0.0);
            rec.fill(0.0);
        }
        for i in r0..r0 + n {
            let x = &mut hs.mixed[i * cd..(i + 1) * cd];
            qwen3next::conv_step(x, conv, &d.conv, hy.conv);
            let out = &mut hs.core[i * vd..(i + 1) * vd];
            qwen3next::delta_step(
                hy,
                d,
                x,
                &hs.b[i * nv..(i + 1) * nv],
                &hs.a[i * nv..(i + 1) * nv],
                rec,
                &mut hs.qk,
                out,
            );
            qwen3next::gated_norm(out, &hs.z[i * vd..(i + 1) * vd], &d.norm, cfg.rms_eps);
        }
        Ok(())
    }

    /// Gated DeltaNet's out_proj of rows 0..n of the core output into `Proj`.
    fn delta_out(&mut self, n: usize, d: &DeltaNet<'_>) -> Result<(), ModelError> {
        let cfg = &self.m.cfg;
        let (h, vd) = (
            cfg.hidden,
            cfg.hybrid.as_deref().map_or(0, |hy| hy.value_dim()),
        );
        let (pool, isa) = (Some(&self.m.pool), self.m.isa);
        let st = &mut *self.st;
        st.acts.load(&st.hybrid.core[..n * vd], n, vd);
        kernels::matmul(&d.out, &mut st.acts, &mut st.proj[..n * h], pool, isa)?;
        Ok(())
    }
}

impl<'a> Model<'a> {
    /// SwiGLU MLP of tokens 0..n of `st.xn`; result in `st.down` (the shared expert).
    fn shared_mlp(&self, st: &mut State, n: usize, m: &Mlp<'_>) -> Result<(), ModelError> {
        let (h, f) = (self.cfg.hidden, m.gate.rows);
        let (pool, isa) = (Some(&self.pool), self.isa);
        st.acts.load(&st.xn[..n * h], n, h);
        kernels::matmul(&m.gate, &mut st.acts, &mut st.gate[..n * f], pool, isa)?;
        kernels::matmul(&m.up, &mut st.acts, &mut st.up[..n * f], pool, isa)?;
        swiglu_par(&self.pool, &mut st.gate[..n * f], &st.up[..n * f]);
        st.acts.load(&st.gate[..n * f], n, f);
        kernels::matmul(&m.down, &mut st.acts, &mut st.down[..n * h], pool, isa)?;
        Ok(())
    }

    /// One expert for all the tokens routed to it: gather their inputs, SwiGLU, and leave
    /// each token's output in its top-k slot.
    fn run_expert(
        &self,
        st: &mut State,
        ex: usize,
        gate: &WeightView<'_>,
        up: &WeightView<'_>,
        down: &WeightView<'_>,
        bias: Option<&ExpertBias>,
    ) -> Result<(), ModelError> {
        let (h, k, f) = (
            self.cfg.hidden,
            self.cfg.n_experts_used,
            self.cfg.expert_ffn,
        );
        let (pool, isa) = (Some(&self.pool), self.isa);
        let toks = &st.groups[ex];
        let cnt = toks.len();
        st.experts_run += 1;
        for (j, &(t, _)) in toks.iter().enumerate() {
            st.gathered[j * h..(j + 1) * h]
                .copy_from_slice(&st.xn[t as usize * h..(t as usize + 1) * h]);
        }
        st.acts.load(&st.gathered[..cnt * h], cnt, h);
        let t = cpu_prof::start();
        kernels::matmul(gate, &mut st.acts, &mut st.gate[..cnt * f], pool, isa)?;
        cpu_prof::add(cpu_prof::EXPERT_MATMUL, t);
        let t = cpu_prof::start();
        kernels::matmul(up, &mut st.acts, &mut st.up[..cnt * f], pool, isa)?;
        cpu_prof::add(cpu_prof::EXPERT_MATMUL, t);
        if let Some(b) = bias {
            let (bg, bu) = (&b.gate[ex * f..(ex + 1) * f], &b.up[ex * f..(ex + 1) * f]);
            add_rows(&mut st.gate[..cnt * f], Some(bg));
            add_rows(&mut st.up[..cnt * f], Some(bu));
        }
        match self.cfg.expert_act {
            ExpertAct::Silu => {
                swiglu_par(&self.pool, &mut st.gate[..cnt * f], &st.up[..cnt * f]);
            }
            ExpertAct::ClampedSwiglu { alpha, limit } => {
                gptoss::clamped_swiglu(&mut st.gate[..cnt * f], &st.up[..cnt * f], alpha, limit)
            }
        }
        st.acts.load(&st.gate[..cnt * f], cnt, f);
        let t = cpu_prof::start();
        kernels::matmul(down, &mut st.acts, &mut st.down[..cnt * h], pool, isa)?;
        cpu_prof::add(cpu_prof::EXPERT_MATMUL, t);
        if let Some(b) = bias {
            add_rows(&mut st.down[..cnt * h], Some(&b.down[ex * h..(ex + 1) * h]));
        }
        for (j, &(t, slot)) in st.groups[ex].iter().enumerate() {
            let dst = (t as usize * k + slot as usize) * h;
            st.slot_out[dst..dst + h].copy_from_slice(&st.down[j * h..(j + 1) * h]);
        }
        Ok(())
    }

    /// Routed experts whose weights are in memory (resident or mapped) for tokens 0..n: the
    /// needed experts in groups whose rows (one per token an expert has) fit the gate and up
    /// buffers, three parallel regions per group instead of several short steps per expert:
    /// 1. every expert's gate and up products (`matmul_jobs`), each over its tokens' rows of
    ///    the input quantized once for the whole batch (picked by index: no gather);
    /// 2. each row's biases and activation written straight into the down products'
    ///    activations and quantized in the same task (`Acts::fill_prepared`);
    /// 3. every expert's down product into its rows of `slot_out` (expert after expert; the
    ///    row of token t's slot s is `row_of[t * k + s]`, which `combine` reads).
    ///
    /// Decode is the one-token case (one group; the activation step runs serially). Each
    /// output element has the bits `run_expert` gives it: the same dot on the same quantized
    /// row, the same biases and activation element by element.
    fn moe_resident(&self, st: &mut State, m: &Moe<'_>) -> Result<(), ModelError> {
        let (h, k, f) = (
            self.cfg.hidden,
            self.cfg.n_experts_used,
            self.cfg.expert_ffn,
        );
        let (pool, isa) = (Some(&self.pool), self.isa);
        st.experts_run += st.needed.len();
        // Rows in expert order: `order` holds their tokens, `row_of` where each slot went.
        let mut r = 0;
        for &ex in &st.needed {
            for &(t, slot) in &st.groups[ex] {
                st.order[r] = t;
                st.row_of[t as usize * k + slot as usize] = r as u32;
                r += 1;
            }
        }
        // `st.acts` holds xn (the router's input); the experts' formats are added to it.
        for &ex in &st.needed {
            kernels::prepare_for(m.experts[ex].gate.dtype, &mut st.acts)?;
            kernels::prepare_for(m.experts[ex].up.dtype, &mut st.acts)?;
        }
        let cap = st.gate.len().min(st.up.len()) / f.max(1);
        let (mut i, mut row0) = (0, 0);
        while i < st.needed.len() {
            // The group: experts needed[i..e], rows row0..row0 + rows.
            let (mut e, mut rows) = (i, 0);
            while e < st.needed.len()
                && 2 * (e - i + 1) <= kernels::MAX_JOBS
                && rows + st.groups[st.needed[e]].len() <= cap
            {
                rows += st.groups[st.needed[e]].len();
                e += 1;
            }
            if e == i {
                return Err(ModelError::Config(format!(
                    "expert {} has {} tokens, more than the {cap} rows of the expert buffers",
                    st.needed[i],
                    st.groups[st.needed[i]].len()
                )));
            }
            let group = &st.needed[i..e];
            // Each expert's first row, relative to row0.
            let mut at = [0usize; kernels::MAX_JOBS / 2 + 1];
            for (j, &ex) in group.iter().enumerate() {
                at[j + 1] = at[j] + st.groups[ex].len();
            }
            let at = &at[..=group.len()];

            // 1. gate and up.
            {
                let acts = &st.acts;
                let (mut g_rest, mut u_rest) = (&mut st.gate[..rows * f], &mut st.up[..rows * f]);
                let mut jobs: [Option<kernels::MatJob<'_, '_>>; kernels::MAX_JOBS] =
                    std::array::from_fn(|_| None);
                for (j, &ex) in group.iter().enumerate() {
                    let cnt = at[j + 1] - at[j];
                    let pick = &st.order[row0 + at[j]..row0 + at[j + 1]];
                    let (g, rest) = std::mem::take(&mut g_rest).split_at_mut(cnt * f);
                    g_rest = rest;
                    let (u, rest) = std::mem::take(&mut u_rest).split_at_mut(cnt * f);
                    u_rest = rest;
                    for (slot, w, y) in [
                        (2 * j, &m.experts[ex].gate, g),
                        (2 * j + 1, &m.experts[ex].up, u),
                    ] {
                        jobs[slot] = Some(kernels::MatJob {
                            w,
                            acts,
                            row0: 0,
                            rows: cnt,
                            pick: Some(pick),
                            y,
                        });
                    }
                }
                let t = cpu_prof::start();
                kernels::matmul_jobs(&mut jobs[..2 * group.len()], pool, isa)?;
                cpu_prof::add(cpu_prof::EXPERT_MATMUL, t);
            }

            // 2. biases (gpt-oss) and the activation, quantized for the down products.
            {
                let (gate, up) = (&st.gate[..rows * f], &st.up[..rows * f]);
                let bias = m.exp_bias.as_ref();
                let act = self.cfg.expert_act;
                let fill = |r: usize, out: &mut [f32]| {
                    let (g, u) = (&gate[r * f..(r + 1) * f], &up[r * f..(r + 1) * f]);
                    out.copy_from_slice(g);
                    // As `run_expert`: gate + bias and up + bias rounded to f32, then the
                    // activation of the pair.
                    let ex = group[at.partition_point(|&a| a <= r) - 1];
                    let (bg, bu) = match bias {
                        Some(b) => (&b.gate[ex * f..(ex + 1) * f], &b.up[ex * f..(ex + 1) * f]),
                        None => (&[][..], &[][..]),
                    };
                    out.iter_mut().zip(bg).for_each(|(o, b)| *o += b);
                    for (idx, (o, &u)) in out.iter_mut().zip(u).enumerate() {
                        let u = match bu.get(idx) {
                            Some(b) => u + b,
                            None => u,
                        };
                        match act {
                            ExpertAct::Silu => *o = silu(*o) * u,
                            ExpertAct::ClampedSwiglu { alpha, limit } => {
                                gptoss::clamped_swiglu(std::slice::from_mut(o), &[u], alpha, limit)
                            }
                        }
                    }
                };
                let fmt = kernels::kernels_for(m.experts[group[0]].down.dtype)?.act;
                st.acts_ffn.fill_prepared((rows, f), fmt, pool, &fill);
                for &ex in group {
                    kernels::prepare_for(m.experts[ex].down.dtype, &mut st.acts_ffn)?;
                }
            }

            // 3. down, into the group's rows of slot_out.
            {
                let acts = &st.acts_ffn;
                let mut d_rest = &mut st.slot_out[row0 * h..(row0 + rows) * h];
                let mut jobs: [Option<kernels::MatJob<'_, '_>>; kernels::MAX_JOBS] =
                    std::array::from_fn(|_| None);
                for (j, &ex) in group.iter().enumerate() {
                    let cnt = at[j + 1] - at[j];
                    let (d, rest) = std::mem::take(&mut d_rest).split_at_mut(cnt * h);
                    d_rest = rest;
                    jobs[j] = Some(kernels::MatJob {
                        w: &m.experts[ex].down,
                        acts,
                        row0: at[j],
                        rows: cnt,
                        pick: None,
                        y: d,
                    });
                }
                let t = cpu_prof::start();
                kernels::matmul_jobs(&mut jobs[..group.len()], pool, isa)?;
                cpu_prof::add(cpu_prof::EXPERT_MATMUL, t);
            }
            if let Some(b) = m.exp_bias.as_ref() {
                for (j, &ex) in group.iter().enumerate() {
                    let rs = (row0 + at[j]) * h..(row0 + at[j + 1]) * h;
                    add_rows(&mut st.slot_out[rs], Some(&b.down[ex * h..(ex + 1) * h]));
                }
            }
            row0 += rows;
            i = e;
        }
        Ok(())
    }

    /// `st.proj` row i = the sum over token i's top-k slots, in slot order, of the slot's
    /// weight times its expert's output (row `row_of[i * k + s]` of `slot_out`); pieces of
    /// rows in parallel from 16 rows up (each row's sum is the serial one).
    fn combine(&self, st: &mut State, n: usize) {
        let (h, k) = (self.cfg.hidden, self.cfg.n_experts_used);
        let (selw, row_of, slot_out) = (&st.selw, &st.row_of, &st.slot_out);
        let one = |i: usize, out: &mut [f32]| {
            out.fill(0.0);
            for slot in 0..k {
                let r = row_of[i * k + slot] as usize;
                axpy(out, selw[i * k + slot], &slot_out[r * h..(r + 1) * h]);
            }
        };
        let proj = &mut st.proj[..n * h];
        if n < 16 {
            for (i, out) in proj.chunks_exact_mut(h).enumerate() {
                one(i, out);
            }
            return;
        }
        const PIECE: usize = 4;
        let pp = SendPtr(proj.as_mut_ptr());
        kernels::par_for(Some(&self.pool), n.div_ceil(PIECE), &|p| {
            let pp = &pp;
            for i in p * PIECE..((p + 1) * PIECE).min(n) {
                // SAFETY: row i (< n) of proj belongs to piece p alone.
                let out = unsafe { std::slice::from_raw_parts_mut(pp.0.add(i * h), h) };
                one(i, out);
            }
        });
    }

    /// The needed experts through the streaming cache, in waves of at most the layer's
    /// evictable slots: all misses of a wave are read at once and each expert is computed as
    /// soon as its bytes land (hits first).
    fn moe_streamed(
        &self,
        st: &mut State,
        l: usize,
        m: &Moe<'_>,
        cache: &mut ExpertCache,
    ) -> Result<(), ModelError> {
        let cap = cache.slots(l).max(1);
        let mut i = 0;
        while i < st.needed.len() {
            let start = i;
            let mut unpinned = 0;
            while i < st.needed.len() {
                let pinned = cache.is_pinned(l, st.needed[i]);
                if !pinned && unpinned == cap {
                    break;
                }
                unpinned += usize::from(!pinned);
                i += 1;
            }
            let begun = cache.begin(l, &st.needed[start..i]);
            let wave = (|| -> Result<(), ModelError> {
                begun?;
                while let Some((ex, b)) = cache.next_ready()? {
                    let xw = &m.experts[ex];
                    let v = |w: &WeightView<'_>, bytes| WeightView { bytes, ..*w };
                    self.run_expert(
                        st,
                        ex,
                        &v(&xw.gate, b.gate),
                        &v(&xw.up, b.up),
                        &v(&xw.down, b.down),
                        m.exp_bias.as_ref(),
                    )?;
                }
                Ok(())
            })();
            cache.end();
            wave?;
        }
        Ok(())
    }

    /// Choose experts and their weights for token `i` from `st.router` (raw logits), into
    /// `st.sel` and `st.selw` (see `route_token`).
    fn route(&self, st: &mut State, i: usize, bias: Option<&[f32]>) {
        let (e, k) = (self.cfg.n_experts, self.cfg.n_experts_used);
        route_token(
            &self.cfg,
            bias,
            &mut st.router[i * e..(i + 1) * e],
            &mut Scratch {
                choice: &mut st.choice,
                groups_score: &mut st.groups_score,
                groups_kept: &mut st.groups_kept,
            },
            &mut st.sel[i * k..(i + 1) * k],
            &mut st.selw[i * k..(i + 1) * k],
        );
    }

    /// `--prefetch`: predict layer `next`'s experts for tokens 0..n by applying its router to
    /// the residual stream as it is now (after this layer's attention, before its FFN) and
    /// start reading the predicted union. Touches only scratch (`st.xn`, `st.acts`, which the
    /// caller recomputes, and the `pf_*` buffers), so results do not depend on it.
    fn prefetch_next(&self, st: &mut State, next: usize, n: usize) -> Result<(), ModelError> {
        if !st
            .expert_cache
            .as_ref()
            .is_some_and(ExpertCache::prefetching)
        {
            return Ok(());
        }
        let Some(lw) = self.weights.layers.get(next) else {
            return Ok(());
        };
        let Ffn::Moe(m) = &lw.ffn else {
            return Ok(());
        };
        let cfg = &self.cfg;
        let (h, e, k) = (cfg.hidden, cfg.n_experts, cfg.n_experts_used);
        for i in 0..n {
            rmsnorm(
                &mut st.xn[i * h..(i + 1) * h],
                &st.x[i * h..(i + 1) * h],
                &lw.ffn_norm,
                cfg.rms_eps,
            );
        }
        st.acts.load(&st.xn[..n * h], n, h);
        kernels::matmul(
            &m.router,
            &mut st.acts,
            &mut st.pf_router[..n * e],
            Some(&self.pool),
            self.isa,
        )?;
        add_rows(&mut st.pf_router[..n * e], m.router_bias.as_deref());
        st.pf_mark.fill(false);
        for i in 0..n {
            route_token(
                cfg,
                m.score_bias.as_deref(),
                &mut st.pf_router[i * e..(i + 1) * e],
                &mut Scratch {
                    choice: &mut st.choice,
                    groups_score: &mut st.groups_score,
                    groups_kept: &mut st.groups_kept,
                },
                &mut st.pf_sel[..k],
                &mut st.pf_selw[..k],
            );
            for &ex in &st.pf_sel[..k] {
                st.pf_mark[ex] = true;
            }
        }
        st.pf_needed.clear();
        st.pf_needed.extend((0..e).filter(|&ex| st.pf_mark[ex]));
        if let Some(c) = &st.expert_cache {
            c.prefetch(next, &st.pf_needed)?;
        }
        Ok(())
    }

    /// Route tokens 0..n from the router logits in `st.router`: `st.sel`/`st.selw` per token,
    /// `st.groups` (per expert, its (token, slot) pairs) and `st.needed` (experts with tokens,
    /// ascending). The GPU forward calls this too, so both choose experts by the same code.
    pub(crate) fn select_experts(&self, st: &mut State, n: usize, bias: Option<&[f32]>) {
        let (e, k) = (self.cfg.n_experts, self.cfg.n_experts_used);
        st.groups.iter_mut().for_each(Vec::clear);
        for i in 0..n {
            self.route(st, i, bias);
            for slot in 0..k {
                let ex = st.sel[i * k + slot];
                st.groups[ex].push((i as u32, slot as u32));
            }
        }
        st.needed.clear();
        for ex in 0..e {
            if !st.groups[ex].is_empty() {
                st.needed.push(ex);
            }
        }
    }

    /// Routed experts (+ shared experts) for tokens 0..n of `st.xn`; result in `st.proj`.
    fn moe(&self, st: &mut State, l: usize, n: usize, m: &Moe<'_>) -> Result<(), ModelError> {
        let cfg = &self.cfg;
        let (h, e, k) = (cfg.hidden, cfg.n_experts, cfg.n_experts_used);
        let (pool, isa) = (Some(&self.pool), self.isa);

        let t = cpu_prof::start();
        st.acts.load(&st.xn[..n * h], n, h);
        kernels::matmul(&m.router, &mut st.acts, &mut st.router[..n * e], pool, isa)?;
        add_rows(&mut st.router[..n * e], m.router_bias.as_deref());
        self.select_experts(st, n, m.score_bias.as_deref());
        cpu_prof::add(cpu_prof::ROUTER, t);
        let t_ex = cpu_prof::start();

        // Take the cache out of the state while experts run (put back on every path).
        let mut cache = st.expert_cache.take();
        let streamed = if l < cfg.n_layers {
            cache.as_mut()
        } else {
            None
        };
        let run = match streamed {
            None => self.moe_resident(st, m),
            Some(c) => {
                // run_expert leaves token t's slot s in row t * k + s.
                st.row_of[..n * k]
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, r)| *r = i as u32);
                self.moe_streamed(st, l, m, c)
            }
        };
        st.expert_cache = cache;
        if run.is_ok() {
            self.combine(st, n);
        }
        cpu_prof::add(cpu_prof::EXPERT_OTHER, t_ex);
        run?;
        if let Some(sh) = &m.shared {
            self.shared_mlp(st, n, sh)?;
            if let Some(g) = &m.shared_gate {
                // Qwen3-Next: the shared expert's output times sigmoid(g . x).
                for i in 0..n {
                    let s = 1.0 / (1.0 + (-dot(g, &st.xn[i * h..(i + 1) * h])).exp());
                    st.down[i * h..(i + 1) * h].iter_mut().for_each(|d| *d *= s);
                }
            }
            for (o, d) in st.proj[..n * h].iter_mut().zip(&st.down[..n * h]) {
                *o += d;
            }
        }
        Ok(())
    }
}

/// g = silu(g) * u element by element, in parallel pieces when there are many (the same
/// arithmetic per element as the serial loop, so the same bits).
fn swiglu_par(pool: &rayon::ThreadPool, g: &mut [f32], u: &[f32]) {
    const PIECE: usize = 1024;
    let n = g.len().min(u.len());
    if n < 4 * PIECE || pool.current_num_threads() < 2 {
        for (g, u) in g.iter_mut().zip(u) {
            *g = silu(*g) * u;
        }
        return;
    }
    let gp = SendPtr(g.as_mut_ptr());
    kernels::par_for(Some(pool), n.div_ceil(PIECE), &|t| {
        let gp = &gp;
        let (a, b) = (t * PIECE, ((t + 1) * PIECE).min(n));
        // SAFETY: piece t alone writes g[a..b] (b <= n <= g.len()).
        let g = unsafe { std::slice::from_raw_parts_mut(gp.0.add(a), b - a) };
        for (g, u) in g.iter_mut().zip(&u[a..b]) {
            *g = silu(*g) * u;
        }
    });
}

/// Add `bias` (one row's worth) to every row of `x`, if there is one.
fn add_rows(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        x.chunks_exact_mut(b.len())
            .for_each(|r| r.iter_mut().zip(b).for_each(|(x, b)| *x += b));
    }
}

/// Per-token routing buffers (one token's worth; reused).
struct Scratch<'b> {
    choice: &'b mut [f32],        // (n_experts)
    groups_score: &'b mut [f32],  // (n_group)
    groups_kept: &'b mut [usize], // (topk_group)
}

/// One token's routing from its raw router logits `scores` (turned into scores in place):
/// scores by softmax or sigmoid; selection on score + `bias` (selection only, DeepSeek's
/// `e_score_correction_bias`), limited to the best groups; the chosen experts in `sel` and their
/// weights in `selw`: the unbiased scores, optionally renormalised, times the routed scale.
fn route_token(
    cfg: &ModelConfig,
    bias: Option<&[f32]>,
    scores: &mut [f32],
    sc: &mut Scratch<'_>,
    sel: &mut [usize],
    selw: &mut [f32],
) {
    let r = &cfg.routing;
    let e = cfg.n_experts;
    if r.sigmoid {
        scores
            .iter_mut()
            .for_each(|s| *s = 1.0 / (1.0 + (-*s).exp()));
    } else {
        softmax(scores);
    }
    let choice = &mut *sc.choice;
    choice.copy_from_slice(scores);
    if let Some(b) = bias {
        choice.iter_mut().zip(b).for_each(|(c, b)| *c += b);
    }
    if r.n_group > 1 {
        // Group score = sum of its two best choice scores; keep the best `topk_group`
        // groups and zero the rest (as transformers' masked_fill(0.0)).
        let per = e / r.n_group;
        for (g, gs) in sc.groups_score.iter_mut().enumerate() {
            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &v in &choice[g * per..(g + 1) * per] {
                if v > a {
                    b = a;
                    a = v;
                } else if v > b {
                    b = v;
                }
            }
            *gs = if per >= 2 { a + b } else { a };
        }
        top_k(sc.groups_score, sc.groups_kept);
        for g in 0..r.n_group {
            if !sc.groups_kept.contains(&g) {
                choice[g * per..(g + 1) * per].fill(0.0);
            }
        }
    }
    top_k(choice, sel);
    for (wv, &ex) in selw.iter_mut().zip(sel.iter()) {
        *wv = scores[ex];
    }
    if r.norm_topk_prob {
        let s: f32 = selw.iter().sum::<f32>() + if r.sigmoid { 1e-20 } else { 0.0 };
        selw.iter_mut().for_each(|wv| *wv /= s);
    }
    if r.scale != 1.0 {
        selw.iter_mut().for_each(|wv| *wv *= r.scale);
    }
}
