//! The generator: one thread that owns the engine (model, placement, session) and takes jobs
//! from a FIFO queue. With one slot it runs each through the engine's decode loop (which
//! reuses the longest common token prefix of the session, or restores one from `--kv-dir`);
//! with `--parallel N` it admits jobs into the slots of `engine::batch` at step boundaries
//! (prefix reuse within and across slots, `--kv-dir` per slot) and steps them together. Text
//! events go back to each job's handler; before every step each job's client mark is looked at
//! (set by the HTTP layer when the connection goes), so a client that leaves is cancelled
//! within one step. A full queue refuses with 503 and
//! `Retry-After` (`Queue::push`).
//!
//! Owns: the queue, job events, the server's generation metrics. Does not own: HTTP, JSON,
//! chat templates (the connection threads turn requests into token jobs), the decode loop,
//! prompt reuse, stop strings or sessions on disk (crate::engine).
//! Invariant: a failed job leaves the engine's session empty and consistent, so the next job
//! starts clean; at temperature 0 a reply does not depend on what was cached before.

use super::error::ApiError;
use super::http::PeerWatch;
use super::metrics::Metrics;
use crate::engine::batch::{Batch, BatchStats, Done, SeqRequest};
use crate::engine::{Engine, EngineError, GenParams, GenerateError};
use crate::model::ModelError;
use crate::sample::{Sampler, SamplingParams};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex};

/// One generation request, already tokenized.
pub struct Job {
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop sequences: generation ends where one appears, and it is cut from the text.
    pub stop: Vec<String>,
    /// Generate past end-of-generation tokens (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// Render control tokens in the text (see `GenRequest::special`).
    pub special: bool,
    /// Set by the connection when its client goes away.
    pub cancel: Arc<AtomicBool>,
    /// The client's mark, looked at before every step (a disconnect cancels the job within
    /// one step, whatever the connection thread is doing).
    pub peer: Option<PeerWatch>,
    pub events: Sender<Event>,
}

/// What the generator tells the connection that submitted a job.
#[derive(Debug)]
pub enum Event {
    /// The job left the queue; prompt reuse is decided.
    Started {
        reused: usize,
        prefilled: usize,
    },
    /// Generated text (stop sequences already removed).
    Text(String),
    Done(Finished),
    Failed(ApiError),
}

/// Why a job ended (`Length`: `max_tokens` reached or the context is full; `Cancelled`: the
/// client went away or the server is stopping).
pub type FinishReason = crate::engine::Finish;

#[derive(Clone, Debug)]
pub struct Finished {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub reused: usize,
    pub prefilled: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
}

/// The FIFO of jobs waiting for the generator.
pub struct Queue {
    inner: Mutex<QueueInner>,
    cv: Condvar,
    max: usize,
    metrics: Arc<Metrics>,
}

struct QueueInner {
    jobs: VecDeque<Job>,
    closed: bool,
    busy: bool,
}

impl Queue {
    pub fn new(max: usize, metrics: Arc<Metrics>) -> Queue {
        Queue {
            metrics,
            inner: Mutex::new(QueueInner {
                jobs: VecDeque::new(),
                closed: false,
                busy: false,
            }),
            cv: Condvar::new(),
            max,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QueueInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Jobs waiting (not counting the one running).
    pub fn len(&self) -> usize {
        self.lock().jobs.len()
    }

    /// A generation is running now.
    pub fn busy(&self) -> bool {
        self.lock().busy
    }

    pub fn push(&self, job: Job) -> Result<(), ApiError> {
        let mut q = self.lock();
        if q.closed {
            return Err(ApiError::new(503, "the server is shutting down"));
        }
        if q.jobs.len() >= self.max {
            // A waiting job whose client has left holds no place: answer it now rather than
            // when the generator comes to it.
            let metrics = &self.metrics;
            q.jobs.retain(|j| {
                let gone = j.cancel.load(Ordering::Relaxed)
                    || j.peer.as_ref().is_some_and(PeerWatch::gone);
                if gone {
                    metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    let _ = j.events.send(Event::Failed(ApiError::new(
                        499,
                        "cancelled before it started",
                    )));
                }
                !gone
            });
        }
        if q.jobs.len() >= self.max {
            // Every slot is busy (a job waits only then) and the queue is full: 503 with
            // Retry-After (the caller puts its estimate in place of this 1 s).
            return Err(ApiError::new(
                503,
                format!(
                    "the server is busy: every sequence slot runs and {} requests are already waiting (--max-queue); retry later",
                    q.jobs.len()
                ),
            )
            .with_retry_after(1));
        }
        q.jobs.push_back(job);
        self.cv.notify_all();
        Ok(())
    }

    /// Stop taking jobs; those still waiting are answered 503.
    pub fn close(&self) {
        let mut q = self.lock();
        q.closed = true;
        for job in q.jobs.drain(..) {
            let _ = job.events.send(Event::Failed(ApiError::new(
                503,
                "the server is shutting down",
            )));
        }
        self.cv.notify_all();
    }

    /// Next job; None once closed and empty.
    fn pop(&self) -> Option<Job> {
        let mut q = self.lock();
        q.busy = false;
        loop {
            if let Some(j) = q.jobs.pop_front() {
                q.busy = true;
                return Some(j);
            }
            if q.closed {
                return None;
            }
            q = self.cv.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn idle(&self) {
        self.lock().busy = false;
    }

    /// The next job if one waits (the batched generator, which has sequences to step).
    fn try_pop(&self) -> Option<Job> {
        let mut q = self.lock();
        let j = q.jobs.pop_front();
        if j.is_some() {
            q.busy = true;
        }
        j
    }

    /// Closed and nothing waits.
    fn drained(&self) -> bool {
        let q = self.lock();
        q.closed && q.jobs.is_empty()
    }
}

/// The generator: the engine and the server's figures.
pub struct Generator {
    engine: Engine,
    metrics: Arc<Metrics>,
    /// With `--parallel N > 1`: the slots, made before the server listens (so `/metrics`
    /// shows them from the first request on), or why they could not be.
    batch: Option<Result<Batch<Slotted>, String>>,
}

impl Generator {
    pub fn new(engine: Engine, metrics: Arc<Metrics>) -> Generator {
        metrics.set_expert_stats(engine.state().expert_stats());
        let n = engine.opts.parallel;
        let batch = (n > 1).then(|| Batch::new(&engine, n).map_err(|e| e.to_string()));
        if let Some(Ok(b)) = &batch {
            metrics.slots.store(b.len() as u64, Ordering::Relaxed);
            metrics.set_slot_figures(b.slot_figures());
        }
        Generator {
            engine,
            metrics,
            batch,
        }
    }

    /// Serve jobs until the queue is closed and empty. `abort`: cancel the running job(s).
    /// Returns the engine (for the caller's end-of-run figures). With `--parallel N > 1` the
    /// jobs share the batched loop (`run_batched`).
    pub fn run(mut self, queue: &Queue, abort: &Arc<AtomicBool>) -> Engine {
        match self.batch.take() {
            Some(Ok(b)) => return self.run_batched(b, queue, abort),
            Some(Err(e)) => eprintln!(
                "[serve] --parallel {}: {e}; serving one request at a time",
                self.engine.opts.parallel
            ),
            None => {}
        }
        while let Some(job) = queue.pop() {
            if job.cancel.load(Ordering::Relaxed) || abort.load(Ordering::Relaxed) {
                self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                let _ = job.events.send(Event::Failed(ApiError::new(
                    499,
                    "cancelled before it started",
                )));
                continue;
            }
            self.metrics.in_flight.store(1, Ordering::Relaxed);
            let outcome = self.generate(&job, abort);
            self.metrics.in_flight.store(0, Ordering::Relaxed);
            // The figures before the answer: a client that reads /metrics after its reply
            // sees its own generation's reads.
            self.metrics
                .set_expert_stats(self.engine.state().expert_stats());
            match outcome {
                Ok(f) => {
                    if f.reason == FinishReason::Cancelled {
                        self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                    let _ = job.events.send(Event::Done(f));
                }
                Err(e) => {
                    let _ = job.events.send(Event::Failed(e));
                }
            }
            drop(job);
            self.save_session();
            queue.idle();
        }
        self.engine
    }

    /// Continuous batching: admit waiting jobs into free slots at step boundaries, run one
    /// batched step over every running sequence, answer the jobs that ended. A job's events
    /// and figures are those of the one-at-a-time loop.
    fn run_batched(
        mut self,
        mut b: Batch<Slotted>,
        queue: &Queue,
        abort: &Arc<AtomicBool>,
    ) -> Engine {
        self.metrics.slots.store(b.len() as u64, Ordering::Relaxed);
        self.metrics.set_slot_figures(b.slot_figures());
        loop {
            // Admit: block for a job only when nothing runs.
            while b.free() > 0 {
                let job = if b.active() == 0 {
                    match queue.pop() {
                        Some(j) => j,
                        None => return self.engine,
                    }
                } else {
                    match queue.try_pop() {
                        Some(j) => j,
                        None => break,
                    }
                };
                let before = b.stats;
                if let Some(d) = self.admit(&mut b, job, abort) {
                    self.answer(d);
                }
                self.add_kv_figures(&before, &b.stats);
            }
            if b.active() == 0 {
                if queue.drained() {
                    return self.engine;
                }
                continue;
            }
            self.metrics
                .in_flight
                .store(b.active() as u64, Ordering::Relaxed);
            let before = b.stats;
            let done = b.step(&mut self.engine);
            let m = &self.metrics;
            m.batch_steps
                .fetch_add(b.stats.steps - before.steps, Ordering::Relaxed);
            m.batch_decode_rows
                .fetch_add(b.stats.decode_rows - before.decode_rows, Ordering::Relaxed);
            m.batch_prefill_rows.fetch_add(
                b.stats.prefill_rows - before.prefill_rows,
                Ordering::Relaxed,
            );
            m.experts_computed.fetch_add(
                b.stats.decode_experts - before.decode_experts,
                Ordering::Relaxed,
            );
            self.add_kv_figures(&before, &b.stats);
            let any = !done.is_empty();
            if any {
                // Before the answers, as in the one-at-a-time loop.
                self.metrics
                    .set_expert_stats(self.engine.state().expert_stats());
            }
            for d in done {
                self.answer(d);
            }
            self.metrics.set_slot_figures(b.slot_figures());
            if any {
                self.metrics
                    .in_flight
                    .store(b.active() as u64, Ordering::Relaxed);
            }
        }
    }

    /// Put `job` into a free slot (the checks of the one-at-a-time loop first); Some when it
    /// ended without a step.
    fn admit(
        &mut self,
        b: &mut Batch<Slotted>,
        job: Job,
        abort: &Arc<AtomicBool>,
    ) -> Option<Done<Slotted>> {
        let n = job.tokens.len();
        let ctx = self.engine.ctx;
        let tag = Slotted {
            events: job.events.clone(),
            prompt_tokens: n,
        };
        let fail = |e: ApiError| {
            let _ = job.events.send(Event::Failed(e));
            None
        };
        if job.cancel.load(Ordering::Relaxed) || abort.load(Ordering::Relaxed) {
            self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            return fail(ApiError::new(499, "cancelled before it started"));
        }
        if n == 0 {
            return fail(ApiError::new(400, "the prompt is empty after tokenization"));
        }
        if n >= ctx {
            return fail(context_error(n, ctx));
        }
        let events = job.events.clone();
        let (cancel, abort, peer) = (job.cancel.clone(), abort.clone(), job.peer);
        let req = SeqRequest {
            sampler: Sampler::new(job.sampling.clone(), self.engine.model.cfg.vocab),
            max_tokens: job.max_tokens,
            ignore_eos: job.ignore_eos,
            stop: job.stop,
            special: job.special,
            cancel: Box::new(move || {
                cancel.load(Ordering::Relaxed)
                    || abort.load(Ordering::Relaxed)
                    || peer.as_ref().is_some_and(|p| {
                        let gone = p.gone();
                        if gone {
                            cancel.store(true, Ordering::Relaxed);
                        }
                        gone
                    })
            }),
            on_event: Box::new(move |e| {
                let ev = match e {
                    crate::engine::Event::Started { reused, prefilled } => {
                        Event::Started { reused, prefilled }
                    }
                    crate::engine::Event::Text(t) => Event::Text(t.to_string()),
                };
                events.send(ev).is_ok()
            }),
            prompt: job.tokens,
        };
        b.admit(&mut self.engine, req, tag)
    }

    /// The batch's shared-prefix and `--kv-dir` figures since `before`, into the metrics.
    fn add_kv_figures(&self, before: &BatchStats, now: &BatchStats) {
        let m = &self.metrics;
        let add = |a: &std::sync::atomic::AtomicU64, d: u64| a.fetch_add(d, Ordering::Relaxed);
        add(
            &m.batch_shared_tokens,
            now.shared_tokens - before.shared_tokens,
        );
        add(&m.kv_loads, now.kv_loads - before.kv_loads);
        add(&m.kv_bytes_read, now.kv_bytes_read - before.kv_bytes_read);
        add(&m.kv_saves, now.kv_saves - before.kv_saves);
        add(
            &m.kv_bytes_written,
            now.kv_bytes_written - before.kv_bytes_written,
        );
    }

    /// Answer a job that ended in the batched loop.
    fn answer(&self, d: Done<Slotted>) {
        let ev = match d.result {
            Ok(g) => {
                let f = self.record(d.tag.prompt_tokens, &g);
                if f.reason == FinishReason::Cancelled {
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                Event::Done(f)
            }
            Err(e) => Event::Failed(engine_error(e)),
        };
        let _ = d.tag.events.send(ev);
    }

    /// Write the conversation in the session to `--kv-dir`, if one is set.
    fn save_session(&mut self) {
        match self.engine.save_session() {
            Ok(Some(bytes)) => {
                self.metrics.kv_saves.fetch_add(1, Ordering::Relaxed);
                self.metrics
                    .kv_bytes_written
                    .fetch_add(bytes, Ordering::Relaxed);
            }
            Ok(None) => {}
            Err(e) => eprintln!("[serve] warning: cannot save the KV session: {e}"),
        }
    }

    fn generate(&mut self, job: &Job, abort: &AtomicBool) -> Result<Finished, ApiError> {
        let n = job.tokens.len();
        let ctx = self.engine.ctx;
        if n == 0 {
            return Err(ApiError::new(400, "the prompt is empty after tokenization"));
        }
        if n >= ctx {
            return Err(context_error(n, ctx));
        }
        let cancelled = || {
            job.cancel.load(Ordering::Relaxed)
                || abort.load(Ordering::Relaxed)
                || job.peer.as_ref().is_some_and(PeerWatch::gone)
        };
        let mut sampler = Sampler::new(job.sampling.clone(), self.engine.model.cfg.vocab);
        let mut params = GenParams::new(job.max_tokens);
        params.ignore_eos = job.ignore_eos;
        params.stop = &job.stop;
        params.special = job.special;
        params.cancel = Some(&cancelled);
        let out = self
            .engine
            .generate(&job.tokens, &mut sampler, &params, &mut |e| {
                let ev = match e {
                    crate::engine::Event::Started { reused, prefilled } => {
                        Event::Started { reused, prefilled }
                    }
                    crate::engine::Event::Text(t) => Event::Text(t.to_string()),
                };
                job.events.send(ev).is_ok()
            })
            .map_err(engine_error)?;
        if let Some(bytes) = out.restored_bytes {
            self.metrics.kv_loads.fetch_add(1, Ordering::Relaxed);
            self.metrics
                .kv_bytes_read
                .fetch_add(bytes, Ordering::Relaxed);
        }
        let fin = self.record(n, &out.generation);
        self.metrics.experts_computed.fetch_add(
            (out.generation.stats.experts_main + out.generation.stats.experts_head) as u64,
            Ordering::Relaxed,
        );
        Ok(fin)
    }

    /// A generation's answer, and its figures added to the server's (the routed experts
    /// computed are added by the caller: a batched step computes them for all its rows).
    fn record(&self, n: usize, g: &crate::engine::Generation) -> Finished {
        let s = &g.stats;
        let fin = Finished {
            reason: g.finish.clone(),
            prompt_tokens: n,
            completion_tokens: s.generated,
            reused: s.reused,
            prefilled: n - s.reused,
            prefill_secs: s.prefill_secs,
            decode_secs: s.decode_secs,
        };
        if !s.prefill_done {
            // Cancelled before the prefill ended: no figures.
            return fin;
        }
        let m = &self.metrics;
        m.prompt_tokens.fetch_add(n as u64, Ordering::Relaxed);
        m.reused_tokens
            .fetch_add(fin.reused as u64, Ordering::Relaxed);
        m.prefilled_tokens
            .fetch_add(fin.prefilled as u64, Ordering::Relaxed);
        m.prefill_us
            .fetch_add((fin.prefill_secs * 1e6) as u64, Ordering::Relaxed);
        m.set_speeds(
            Some(fin.prefilled as f64 / fin.prefill_secs.max(1e-9)),
            None,
        );
        m.generations.fetch_add(1, Ordering::Relaxed);
        m.generated_tokens
            .fetch_add(s.generated as u64, Ordering::Relaxed);
        m.decode_steps
            .fetch_add(s.decode_steps as u64, Ordering::Relaxed);
        m.decode_us
            .fetch_add((fin.decode_secs * 1e6) as u64, Ordering::Relaxed);
        if s.decode_steps > 0 {
            m.set_speeds(None, Some(s.decoded() as f64 / fin.decode_secs.max(1e-9)));
        }
        fin
    }
}

/// What the batched loop keeps of a job while it runs: where its events go.
struct Slotted {
    events: Sender<Event>,
    prompt_tokens: usize,
}

pub fn context_error(n: usize, ctx: usize) -> ApiError {
    ApiError {
        status: 400,
        message: format!("the prompt is {n} tokens; this server's context holds {ctx} (one more must fit for the reply; raise -c)"),
        param: Some("messages".into()),
        code: Some("context_length_exceeded"),
        retry_after: None,
    }
}

fn engine_error(e: EngineError) -> ApiError {
    match e {
        EngineError::Generate(GenerateError::Model(ModelError::ContextFull { needed, ctx }))
        | EngineError::Model(ModelError::ContextFull { needed, ctx }) => context_error(needed, ctx),
        EngineError::Generate(GenerateError::Tokenizer(t)) => {
            ApiError::new(500, format!("decoding: {t}"))
        }
        other => ApiError::new(500, format!("model error: {other}")),
    }
}
