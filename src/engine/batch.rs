//! Continuous batching (`serve --parallel N`): N sequence slots, and a step that runs every
//! active sequence's next rows in ONE forward (`Model::forward_seqs`). Decoding slots each add
//! their one token; the slots still reading their prompt share the rows the batch (`-b`) has
//! left (`plan_rows`: the prompt admitted first keeps an equal share, the rest goes shortest
//! first), so prompts arriving together are read in one step when they fit and a long one a
//! chunk per step while the others keep streaming. Only the rows that are
//! sampled from (each decode row, the last row of each prompt that ends) go through the
//! output matrix. A MoE layer computes the union of the rows' experts, each read once and
//! computed once for all rows routed to it.
//!
//! Owns: `Batch` (the slots, each with its own KV cache as a `State` and the tokens it holds;
//! the scheduler: admission with prefix reuse within a slot, across slots and from
//! `--kv-dir`, the step's rows, sampling, stop conditions and cancellation per sequence,
//! saving a slot's conversation to `--kv-dir` when its request ends), `BatchStats`. Does not own: the model, the
//! buffers a step runs on (the engine's session state: its batch, its expert cache) or the
//! queue of waiting requests (the caller admits while `free() > 0`).
//! Invariant: a sequence's tokens do not depend on what it is batched with: every row of a
//! batched forward is computed as that sequence's lone forward computes it (forward.rs), its
//! sampler and stop conditions are its own, and a slot's reused prefix is exact — so at
//! temperature 0 a request returns under `--parallel N` exactly what it returns alone.

use super::decode::{Emission, Sink};
use super::{Engine, EngineError, Event, Finish, GenParams, GenStats, GenerateError, Generation};
use crate::model::{ModelError, State};
use crate::sample::Sampler;
use std::time::Instant;

/// One generation request for a slot.
pub struct SeqRequest {
    /// The whole prompt (a slot keeps the longest prefix it shares with what it holds).
    pub prompt: Vec<u32>,
    pub sampler: Sampler,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub stop: Vec<String>,
    pub special: bool,
    /// Checked once per step: true ends the generation (`Finish::Cancelled`).
    pub cancel: Box<dyn Fn() -> bool + Send>,
    /// `Started` once the slot's reuse is decided, then the text; false = stop (`Cancelled`).
    pub on_event: Box<dyn FnMut(Event<'_>) -> bool + Send>,
}

/// A finished request: its tag and its generation (or why it failed).
pub struct Done<T> {
    pub tag: T,
    pub result: Result<Generation, EngineError>,
}

/// Figures over every step so far.
#[derive(Clone, Copy, Debug, Default)]
pub struct BatchStats {
    /// Batched forwards.
    pub steps: u64,
    /// Rows they ran: decode rows (one generated token each) and prompt rows.
    pub decode_rows: u64,
    pub prefill_rows: u64,
    /// Routed experts computed, summed over steps and layers (the union per layer).
    pub experts: u64,
    /// The same over steps that ran at least one decode row.
    pub decode_experts: u64,
    /// Steps that ran at least one decode row, and the decode rows in them (mean decode
    /// batch = decode_rows / decode_steps).
    pub decode_steps: u64,
    /// Prompt positions a slot copied from another slot's cache at admission instead of
    /// computing them (a shared system prompt; counted in the request's `reused` too).
    pub shared_tokens: u64,
    /// `--kv-dir`: sessions restored into a slot at admission and the bytes read; slots'
    /// conversations saved when their request ended and the bytes written.
    pub kv_loads: u64,
    pub kv_bytes_read: u64,
    pub kv_saves: u64,
    pub kv_bytes_written: u64,
}

struct Active<T> {
    tag: T,
    req: SeqRequest,
    em: Emission,
    /// Prompt and generated tokens (the sampler's repetition history).
    history: Vec<u32>,
    /// Prompt tokens fed so far.
    fed: usize,
    /// The sampled token to feed in the next step (None while the prompt is read).
    next: Option<u32>,
    stats: GenStats,
    t0: Instant,
    t_decode: Instant,
}

struct Slot<T> {
    /// Tokens whose keys and values the slot's state holds (`tokens.len() == seqs[i].pos`).
    tokens: Vec<u32>,
    /// Admission count when last used (the least recently used free slot is taken first).
    used: u64,
    job: Option<Active<T>>,
}

/// N sequence slots over one engine (see the module doc).
pub struct Batch<T> {
    slots: Vec<Slot<T>>,
    /// Each slot's KV cache and position (a `State` of batch 1; the forward's buffers are the
    /// engine's session state).
    seqs: Vec<State>,
    admitted: u64,
    pub stats: BatchStats,
    rows: Vec<u32>,
    parts: Vec<(usize, usize)>,
    /// The rows whose logits a step samples from (each ending prompt's last, each decode row).
    want: Vec<usize>,
    plan: Plan,
    phases: Vec<Option<Phase>>,
    /// Slots whose request ended in this step (their conversation goes to `--kv-dir`).
    ended: Vec<usize>,
}

impl<T> Batch<T> {
    /// `n` slots for `engine`, which must have been opened with `parallel >= n` (its session
    /// state is the step's buffers: at least `n` rows and `n` logit rows).
    pub fn new(engine: &Engine, n: usize) -> Result<Batch<T>, EngineError> {
        let st = engine.state();
        if n == 0 || st.batch() < n || st.logit_rows() < n {
            return Err(EngineError::Input(format!(
                "--parallel {n}: the engine was opened for {} sequences",
                st.batch().min(st.logit_rows())
            )));
        }
        if engine.gpu || engine.opts.mtp > 0 {
            return Err(EngineError::Refused {
                flag: format!("--parallel {n}"),
                reason: "batched sequences run on the CPU path without --mtp".into(),
            });
        }
        let seqs = (0..n)
            .map(|_| engine.model.new_state(engine.ctx, 1, 1))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Batch {
            slots: (0..n)
                .map(|_| Slot {
                    tokens: Vec::new(),
                    used: 0,
                    job: None,
                })
                .collect(),
            seqs,
            admitted: 0,
            stats: BatchStats::default(),
            rows: Vec::with_capacity(st.batch()),
            parts: Vec::with_capacity(n),
            want: Vec::with_capacity(n),
            plan: Plan {
                prefill: Vec::with_capacity(n),
                decoders: Vec::with_capacity(n),
                waiting: Vec::with_capacity(n),
            },
            phases: Vec::with_capacity(n),
            ended: Vec::with_capacity(n),
        })
    }

    /// Slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Slots running a request.
    pub fn active(&self) -> usize {
        self.slots.iter().filter(|s| s.job.is_some()).count()
    }

    /// Slots free for `admit`.
    pub fn free(&self) -> usize {
        self.len() - self.active()
    }

    /// Each slot's state for figures: "free", "prefilling" or "decoding", and the positions
    /// its KV cache holds (a free slot keeps its last conversation for prefix reuse).
    pub fn slot_figures(&self) -> impl Iterator<Item = (&'static str, usize)> + '_ {
        self.slots.iter().map(|s| {
            let state = match &s.job {
                None => "free",
                Some(a) if a.next.is_some() => "decoding",
                Some(_) => "prefilling",
            };
            (state, s.tokens.len())
        })
    }

    /// Slots reading their prompt / decoding (for figures).
    pub fn phases(&self) -> (usize, usize) {
        let mut p = (0, 0);
        for a in self.slots.iter().filter_map(|s| s.job.as_ref()) {
            if a.next.is_some() {
                p.1 += 1;
            } else {
                p.0 += 1;
            }
        }
        p
    }

    /// Start `req` in a free slot: the one holding the longest prefix of its prompt (ties:
    /// the least recently used), cut back to that prefix, then extended with a longer prefix
    /// another slot holds (`share_prefix`: a shared system prompt is computed once). It joins
    /// at the next step. Returns its `Done` now when it ends before any step (refused,
    /// cancelled at `Started`, `max_tokens` 0), or when no slot is free.
    pub fn admit(&mut self, engine: &mut Engine, req: SeqRequest, tag: T) -> Option<Done<T>> {
        let n = req.prompt.len();
        let ctx = engine.ctx;
        let refuse = |tag, e: EngineError| {
            Some(Done {
                tag,
                result: Err(e),
            })
        };
        if n == 0 {
            return refuse(tag, GenerateError::EmptyPrompt.into());
        }
        if n > ctx {
            return refuse(tag, ModelError::ContextFull { needed: n, ctx }.into());
        }
        let Some(i) = (0..self.len())
            .filter(|&i| self.slots[i].job.is_none())
            .max_by_key(|&i| {
                let s = &self.slots[i];
                (
                    super::lcp(&s.tokens, &req.prompt),
                    std::cmp::Reverse(s.used),
                )
            })
        else {
            return refuse(tag, EngineError::Input("no free sequence slot".into()));
        };
        self.admitted += 1;
        let (slot, st) = (&mut self.slots[i], &mut self.seqs[i]);
        slot.used = self.admitted;
        let common = super::lcp(&slot.tokens, &req.prompt).min(n - 1);
        slot.tokens.truncate(st.truncate(common));
        let own = slot.tokens.len();
        // A longer prefix held by another slot (running or free): copy its keys and values
        // instead of computing them again.
        let keep = match self.share_prefix(i, &req.prompt[..n - 1]) {
            Ok(k) => k,
            Err(_) => {
                // Nothing copied can be trusted: read the prompt again from what the slot
                // held.
                self.slots[i].tokens.truncate(self.seqs[i].truncate(own));
                own
            }
        };
        self.stats.shared_tokens += (keep - own) as u64;
        let keep = self.restore(engine, i, &req.prompt[..n - 1], keep);
        let slot = &mut self.slots[i];
        let mut req = req;
        let stats = GenStats {
            prompt_tokens: n - keep,
            reused: keep,
            ..Default::default()
        };
        let ended = |tag, finish, stats| {
            Some(Done {
                tag,
                result: Ok(Generation {
                    tokens: Vec::new(),
                    stats,
                    finish,
                }),
            })
        };
        if !(req.on_event)(Event::Started {
            reused: keep,
            prefilled: n - keep,
        }) {
            return ended(tag, Finish::Cancelled, stats);
        }
        if req.max_tokens == 0 {
            return ended(tag, Finish::Length, stats);
        }
        let mut p = GenParams::new(req.max_tokens);
        p.ignore_eos = req.ignore_eos;
        p.stop = &req.stop;
        p.special = req.special;
        let em = Emission::new(&p, req.max_tokens.min(ctx));
        let mut history = Vec::with_capacity(n + req.max_tokens.min(ctx));
        history.extend_from_slice(&req.prompt);
        let now = Instant::now();
        slot.job = Some(Active {
            tag,
            req,
            em,
            history,
            fed: keep,
            next: None,
            stats,
            t0: now,
            t_decode: now,
        });
        None
    }

    /// Extend slot `i` (which holds a prefix of `prompt`) with the longest prefix of `prompt`
    /// another slot holds, copying those positions of its keys and values: the same tokens
    /// at the same positions have the same keys and values whichever slot computed them (rows
    /// do not depend on their batch), so the copy is what the slot would compute. Returns the
    /// positions slot `i` now holds.
    fn share_prefix(&mut self, i: usize, prompt: &[u32]) -> Result<usize, ModelError> {
        let own = self.slots[i].tokens.len();
        let best = (0..self.len())
            .filter(|&j| j != i)
            .map(|j| (super::lcp(&self.slots[j].tokens, prompt), j))
            .max();
        let Some((len, j)) = best.filter(|&(len, _)| len > own) else {
            return Ok(own);
        };
        // A recurrent state (hybrid layers) is held only after the source's last position: it
        // is shared only when the source holds exactly that prefix.
        if self.seqs[j].block_floats() > 0 && self.seqs[j].pos != len {
            return Ok(own);
        }
        let (dst, src) = if i < j {
            let (a, b) = self.seqs.split_at_mut(j);
            (&mut a[i], &b[0])
        } else {
            let (a, b) = self.seqs.split_at_mut(i);
            (&mut b[0], &a[j])
        };
        copy_positions(dst, src, own, len)?;
        self.slots[i].tokens.extend_from_slice(&prompt[own..len]);
        Ok(len)
    }

    /// `--kv-dir`: restore into slot `i` (holding `keep` positions of `prompt`) a saved
    /// session sharing a longer prefix of `prompt`. Returns the positions the slot holds.
    fn restore(&mut self, engine: &mut Engine, i: usize, prompt: &[u32], keep: usize) -> usize {
        let Some(store) = &mut engine.store else {
            return keep;
        };
        let Some((idx, c)) = store.best_match(prompt).filter(|&(_, c)| c > keep) else {
            return keep;
        };
        let (slot, st) = (&mut self.slots[i], &mut self.seqs[i]);
        match store.load(idx, c, st) {
            Ok(bytes) => {
                slot.tokens.clear();
                slot.tokens.extend_from_slice(&prompt[..c]);
                self.stats.kv_loads += 1;
                self.stats.kv_bytes_read += bytes;
                c
            }
            Err(e) => {
                eprintln!("[sluice] warning: cannot restore a KV session: {e}");
                // A failed load may have written part of the cache.
                st.reset();
                slot.tokens.clear();
                0
            }
        }
    }

    /// `--kv-dir`: save the conversations of the slots whose request ended this step (as the
    /// one-sequence loop saves its session after each request).
    fn save_ended(&mut self, engine: &mut Engine) {
        let Some(store) = &mut engine.store else {
            self.ended.clear();
            return;
        };
        for i in self.ended.drain(..) {
            match store.save(&self.slots[i].tokens, &self.seqs[i]) {
                Ok(Some(bytes)) => {
                    self.stats.kv_saves += 1;
                    self.stats.kv_bytes_written += bytes;
                }
                Ok(None) => {}
                Err(e) => eprintln!("[sluice] warning: cannot save the KV session: {e}"),
            }
        }
    }

    /// One step (see `step_rows`), then `--kv-dir` saves of the slots that ended.
    pub fn step(&mut self, engine: &mut Engine) -> Vec<Done<T>> {
        let done = self.step_rows(engine);
        if !self.ended.is_empty() {
            self.save_ended(engine);
        }
        done
    }

    /// One step: drop cancelled requests, then one batched forward of every decoding slot's
    /// token and the prefilling slots' next prompt chunks (`plan_rows`), then sample, emit and
    /// check stops per sequence. Returns the requests that ended.
    fn step_rows(&mut self, engine: &mut Engine) -> Vec<Done<T>> {
        let mut done = Vec::new();
        for i in 0..self.len() {
            if self.slots[i].job.as_ref().is_some_and(|a| (a.req.cancel)()) {
                self.end(engine, i, Ok(Finish::Cancelled), &mut done);
            }
        }
        self.phases.clear();
        self.phases.extend(self.slots.iter().map(|s| {
            s.job.as_ref().map(|a| Phase {
                decoding: a.next.is_some(),
                left: a.req.prompt.len() - a.fed,
                admitted: s.used,
            })
        }));
        plan_rows(engine.state().batch(), &self.phases, &mut self.plan);
        self.rows.clear();
        self.parts.clear();
        self.want.clear();
        for &(i, take) in &self.plan.prefill {
            if let Some(a) = &self.slots[i].job {
                let e = a.fed + take;
                self.rows.extend_from_slice(&a.req.prompt[a.fed..e]);
                self.parts.push((i, take));
                if e == a.req.prompt.len() {
                    self.want.push(self.rows.len() - 1);
                }
            }
        }
        let prefills = self.parts.len();
        let chunk = self.rows.len();
        for &i in &self.plan.decoders {
            if let Some(t) = self.slots[i].job.as_ref().and_then(|a| a.next) {
                self.rows.push(t);
                self.parts.push((i, 1));
                self.want.push(self.rows.len() - 1);
            }
        }
        if self.rows.is_empty() {
            return done;
        }
        let Engine { model, session, .. } = engine;
        let r = model.forward_seqs(
            &mut session.st,
            &mut self.seqs,
            &self.rows,
            &self.parts,
            &self.want,
        );
        let logits = match r {
            Ok(l) => l.to_vec(),
            Err(e) => {
                let msg = e.to_string();
                for k in 0..self.parts.len() {
                    let i = self.parts[k].0;
                    self.end(engine, i, Err(EngineError::Input(msg.clone())), &mut done);
                    self.slots[i].tokens.clear();
                    self.seqs[i].reset();
                }
                return done;
            }
        };
        engine.session.st.tick_token();
        let decoders = self.parts.len() - prefills;
        let s = &mut self.stats;
        s.steps += 1;
        s.prefill_rows += chunk as u64;
        s.decode_rows += decoders as u64;
        s.decode_steps += u64::from(decoders > 0);
        s.experts += engine.session.st.experts_run as u64;
        if decoders > 0 {
            s.decode_experts += engine.session.st.experts_run as u64;
        }
        let v = engine.model.cfg.vocab;
        // The logit rows follow the parts' order: each ending prompt's, then each decode row's.
        let mut row = 0;
        for k in 0..self.parts.len() {
            let (i, take) = self.parts[k];
            let slot = &mut self.slots[i];
            let Some(a) = slot.job.as_mut() else {
                continue;
            };
            let t = if k < prefills {
                slot.tokens
                    .extend_from_slice(&a.req.prompt[a.fed..a.fed + take]);
                a.fed += take;
                if a.fed < a.req.prompt.len() {
                    continue;
                }
                let t = a
                    .req
                    .sampler
                    .sample(&logits[row * v..(row + 1) * v], &a.history);
                a.stats.prefill_secs = a.t0.elapsed().as_secs_f64();
                a.stats.prefill_done = true;
                a.stats.experts_per_token_plain = plain_experts(engine);
                a.t_decode = Instant::now();
                t
            } else {
                let Some(fed) = a.next.take() else {
                    continue;
                };
                slot.tokens.push(fed);
                let t = a
                    .req
                    .sampler
                    .sample(&logits[row * v..(row + 1) * v], &a.history);
                a.stats.decode_steps += 1;
                t
            };
            row += 1;
            self.emit(engine, i, t, &mut done);
        }
        done
    }

    /// Emit slot `i`'s sampled token `t`; keep it for the next step unless the sequence ends
    /// (the order of the one-sequence loop: emit, then the context check).
    fn emit(&mut self, engine: &Engine, i: usize, t: u32, done: &mut Vec<Done<T>>) {
        let Some(a) = self.slots[i].job.as_mut() else {
            return;
        };
        let mut sink = Sink {
            tok: &engine.tok,
            eos: engine.tok.eos_ids(),
            cancel: Some(&*a.req.cancel),
            on_event: &mut *a.req.on_event,
        };
        let r = match a.em.emit(&mut sink, t, &mut a.history) {
            Ok(Some(f)) => Some(Ok(f)),
            Ok(None) if self.seqs[i].pos >= self.seqs[i].ctx() => Some(Ok(Finish::Length)),
            Ok(None) => {
                a.next = Some(t);
                None
            }
            Err(e) => Some(Err(e.into())),
        };
        if let Some(r) = r {
            self.end(engine, i, r, done);
        }
    }

    /// End slot `i`'s request with `r` (a natural end flushes held-back text first).
    fn end(
        &mut self,
        engine: &Engine,
        i: usize,
        r: Result<Finish, EngineError>,
        done: &mut Vec<Done<T>>,
    ) {
        let Some(mut a) = self.slots[i].job.take() else {
            return;
        };
        self.ended.push(i);
        let result = r.and_then(|f| {
            let mut sink = Sink {
                tok: &engine.tok,
                eos: engine.tok.eos_ids(),
                cancel: Some(&*a.req.cancel),
                on_event: &mut *a.req.on_event,
            };
            let finish = a.em.finish(&mut sink, f)?;
            let mut stats = a.stats;
            if stats.prefill_done {
                stats.decode_secs = a.t_decode.elapsed().as_secs_f64();
            } else {
                stats.prefill_secs = a.t0.elapsed().as_secs_f64();
            }
            stats.generated = a.em.out.len();
            stats.stopped_by_eos = finish == Finish::Eos;
            Ok(Generation {
                tokens: std::mem::take(&mut a.em.out),
                stats,
                finish,
            })
        });
        done.push(Done { tag: a.tag, result });
    }
}

/// Copy positions `from..to` of every part of `src` into `dst`, which holds `from` positions
/// of the same tokens; `dst` then holds `to`. A part that is not one row per position (a
/// recurrent state, held after the last position only) is copied whole, and only when the
/// source holds exactly `to` positions; otherwise the copy is refused before anything moves.
fn copy_positions(dst: &mut State, src: &State, from: usize, to: usize) -> Result<(), ModelError> {
    if dst.pos != from || src.pos < to || from > to {
        return Err(ModelError::Input(format!(
            "copy of positions {from}..{to}: the slot holds {}, the source {}",
            dst.pos, src.pos
        )));
    }
    if let Some(part) = src.parts().find(|p| !p.per_position && src.pos != to) {
        return Err(ModelError::Input(format!(
            "state part {part:?} holds the state after position {}, not {to}: it cannot be shared",
            src.pos
        )));
    }
    for part in src.parts() {
        if !part.per_position {
            let block = src.part_rows(part, to)?;
            dst.part_rows_mut(part, to)?.copy_from_slice(block);
            continue;
        }
        let rb = part.ty.row_bytes(part.width);
        let rows = &src.part_rows(part, to)?[from * rb..];
        dst.part_rows_mut(part, to)?[from * rb..].copy_from_slice(rows);
    }
    dst.set_pos(to);
    Ok(())
}

/// Routed experts a one-token step computes (top-k x MoE layers).
fn plain_experts(engine: &Engine) -> f64 {
    let c = &engine.model.cfg;
    if c.n_experts == 0 {
        return 0.0;
    }
    let moe = (0..c.n_layers).filter(|&l| c.is_moe_layer(l)).count();
    (moe * c.n_experts_used.min(c.n_experts)) as f64
}

/// A running slot as the scheduler sees it.
#[derive(Clone, Copy, Debug)]
struct Phase {
    decoding: bool,
    /// Prompt tokens not yet read.
    left: usize,
    /// Admission count (smaller: admitted earlier).
    admitted: u64,
}

/// The rows of one step (`plan_rows`): each prefilling slot with its chunk, and the decoding
/// slots.
#[derive(Debug, Default)]
struct Plan {
    prefill: Vec<(usize, usize)>,
    decoders: Vec<usize>,
    /// Prefilling slots with their tokens left and admission count (scratch).
    waiting: Vec<(usize, usize, u64)>,
}

/// The scheduler: the rows of one step for the running slots (`None`: free), within `batch`
/// rows (`-b`, as llama-server's n_batch). Every decoding slot gets its one row first, so a
/// prompt never stalls a stream. Of the rest, the prompt admitted first is guaranteed an
/// equal share (rows / prompts waiting, at least one), so every prompt keeps moving and none
/// starves; then the prompts take what they still need shortest first (ties: admitted
/// first) until the rows run out. Clients arriving together with prompts that fit are all
/// read in one step; a long prompt is read in chunks over several steps, interleaved with
/// the decoding rows and not in the way of short prompts; several long ones finish one after
/// the other rather than all at the end (a lower mean time to first token than equal
/// shares, the same for the last). Fills `plan` (prefill shortest first).
fn plan_rows(batch: usize, slots: &[Option<Phase>], plan: &mut Plan) {
    plan.prefill.clear();
    plan.decoders.clear();
    plan.waiting.clear();
    for (i, s) in slots.iter().enumerate() {
        match s {
            Some(p) if p.decoding => plan.decoders.push(i),
            Some(p) if p.left > 0 => plan.waiting.push((i, p.left, p.admitted)),
            _ => {}
        }
    }
    let mut room = batch.saturating_sub(plan.decoders.len());
    if room == 0 || plan.waiting.is_empty() {
        return;
    }
    plan.waiting.sort_unstable_by_key(|w| (w.1, w.2));
    let oldest = (0..plan.waiting.len())
        .min_by_key(|&k| plan.waiting[k].2)
        .unwrap_or(0);
    plan.prefill.extend(plan.waiting.iter().map(|w| (w.0, 0)));
    let floor = plan.waiting[oldest]
        .1
        .min((room / plan.waiting.len()).max(1));
    plan.prefill[oldest].1 = floor;
    room -= floor;
    for (k, w) in plan.waiting.iter().enumerate() {
        let take = (w.1 - plan.prefill[k].1).min(room);
        plan.prefill[k].1 += take;
        room -= take;
    }
    plan.prefill.retain(|p| p.1 > 0);
}

#[cfg(test)]
mod tests {
    use super::{plan_rows, Phase, Plan};

    /// Slots from (decoding, prompt tokens left); admitted in slot order.
    fn slots(s: &[Option<(bool, usize)>]) -> Vec<Option<Phase>> {
        s.iter()
            .enumerate()
            .map(|(i, p)| {
                p.map(|(decoding, left)| Phase {
                    decoding,
                    left,
                    admitted: i as u64,
                })
            })
            .collect()
    }

    fn plan(batch: usize, s: &[Option<Phase>]) -> Plan {
        let mut p = Plan::default();
        plan_rows(batch, s, &mut p);
        p
    }

    fn sorted(p: &Plan) -> Vec<(usize, usize)> {
        let mut v = p.prefill.clone();
        v.sort_unstable();
        v
    }

    #[test]
    fn decoders_all_run_and_prefill_takes_the_rest() {
        // Slots: 0 decoding, 1 prefilling 100 tokens, 2 free, 3 decoding.
        let s = slots(&[Some((true, 0)), Some((false, 100)), None, Some((true, 0))]);
        let p = plan(16, &s);
        assert_eq!(p.decoders, vec![0, 3]);
        assert_eq!(p.prefill, vec![(1, 14)]);
        // A short remainder takes only what it needs.
        let s = slots(&[Some((true, 0)), Some((false, 3))]);
        assert_eq!(plan(16, &s).prefill, vec![(1, 3)]);
    }

    #[test]
    fn every_waiting_prompt_that_fits_is_admitted_in_one_step() {
        // Eight clients arriving together, 4-8-token prompts, a 128-row batch: one step.
        let want: Vec<_> = (0..8).map(|i| (i, 4 + i % 5)).collect();
        let s = slots(&want.iter().map(|w| Some((false, w.1))).collect::<Vec<_>>());
        assert_eq!(sorted(&plan(128, &s)), want);
        // Beside decoding slots too.
        let mut s = s;
        for i in [0, 5] {
            s[i] = Some(Phase {
                decoding: true,
                left: 0,
                admitted: i as u64,
            });
        }
        let p = plan(128, &s);
        assert_eq!(p.decoders, vec![0, 5]);
        assert_eq!(p.prefill.len(), 6);
        assert!(p
            .prefill
            .iter()
            .all(|&(i, take)| take == s[i].unwrap().left));
    }

    #[test]
    fn a_long_prompt_neither_stalls_streams_nor_short_prompts() {
        // Slot 0 reads a 1000-token prompt; 1 and 2 decode; 3 brings a 10-token prompt.
        let mut s = slots(&[
            Some((false, 1000)),
            Some((true, 0)),
            Some((true, 0)),
            Some((false, 10)),
        ]);
        let p = plan(64, &s);
        assert_eq!(p.decoders, vec![1, 2], "every stream runs");
        assert_eq!(sorted(&p), vec![(0, 52), (3, 10)], "the short prompt whole");
        // The long prompt is chunked within the budget step after step, and finishes.
        s[3] = Some(Phase {
            decoding: true,
            left: 0,
            admitted: 3,
        });
        let (mut left, mut steps) = (1000, 0);
        while left > 0 {
            s[0] = Some(Phase {
                decoding: false,
                left,
                admitted: 0,
            });
            let p = plan(64, &s);
            assert_eq!(p.decoders, vec![1, 2, 3]);
            let rows: usize = p.prefill.iter().map(|x| x.1).sum::<usize>() + p.decoders.len();
            assert!(rows <= 64, "the step stays within the batch");
            left -= p.prefill[0].1;
            steps += 1;
        }
        assert_eq!(steps, 1000usize.div_ceil(61));
    }

    #[test]
    fn long_prompts_are_read_shortest_first_and_the_oldest_keeps_moving() {
        // 45 rows for prompts of 50 (admitted first), 30 and 45 tokens: the first keeps its
        // share (45 / 3 = 15), then the shortest takes all it needs (30), then the rest.
        let s = slots(&[Some((false, 50)), Some((false, 30)), Some((false, 45))]);
        assert_eq!(plan(45, &s).prefill, vec![(1, 30), (0, 15)]);
        // Shorter prompts arriving all the time cannot starve the first.
        let mut s = s;
        let mut left = 50;
        for step in 0..10 {
            s[0] = Some(Phase {
                decoding: false,
                left,
                admitted: 0,
            });
            for i in [1, 2] {
                s[i] = Some(Phase {
                    decoding: false,
                    left: 40,
                    admitted: 10 + step,
                });
            }
            let p = plan(40, &s);
            let mine = p.prefill.iter().find(|x| x.0 == 0).map_or(0, |x| x.1);
            assert!(mine >= 13.min(left), "step {step}: {mine}");
            left -= mine;
            if left == 0 {
                break;
            }
        }
        assert_eq!(left, 0);
    }

    #[test]
    fn fewer_rows_than_prompts_still_move_the_oldest() {
        // 3 rows: the two decoders and one prompt row, which goes to the prompt admitted
        // first (the others are shorter).
        let s = slots(&[
            Some((false, 50)),
            None,
            Some((false, 20)),
            Some((false, 30)),
            Some((true, 0)),
            Some((true, 0)),
        ]);
        let p = plan(3, &s);
        assert_eq!(p.decoders, vec![4, 5]);
        assert_eq!(p.prefill, vec![(0, 1)]);
    }
}
