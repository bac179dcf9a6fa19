//! The generator: one thread that owns the model's `State`, takes jobs from a FIFO queue one at
//! a time, reuses the longest common token prefix of the KV cache (in memory, else from a
//! `--kv-dir` session), prefills the rest, and decodes token by token, sending text events.
//!
//! Owns: the queue, the KV cache and the list of tokens it holds, stop sequences, cancellation.
//! Does not own: HTTP, JSON, chat templates (the connection threads turn requests into token
//! jobs), the disk format of sessions (kv_store.rs).
//! Invariant: `cached` always lists exactly the tokens whose keys and values are in `st`
//! (`cached.len() == st.pos`), so reusing a prefix is exact and, at temperature 0, a reply
//! does not depend on what was cached before.

use super::error::ApiError;
use super::kv_store::KvStore;
use super::metrics::Metrics;
use crate::model::{Model, ModelError, State};
use crate::sample::{Sampler, SamplingParams};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

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

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token.
    Eos,
    /// `max_tokens` reached or the context is full.
    Length,
    /// This stop sequence appeared.
    Stop(String),
    /// The client went away or the server is stopping.
    Cancelled,
}

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
}

struct QueueInner {
    jobs: VecDeque<Job>,
    closed: bool,
    busy: bool,
}

impl Queue {
    pub fn new(max: usize) -> Queue {
        Queue {
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
            return Err(ApiError::new(
                429,
                format!(
                    "{} requests are already waiting (--max-queue); retry later",
                    q.jobs.len()
                ),
            ));
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
}

/// The generator's state: the model and the one conversation it holds in its KV cache.
pub struct Engine {
    pub model: Model<'static>,
    pub tok: Tokenizer,
    st: State,
    /// Tokens whose KV is in `st` (`cached.len() == st.pos`).
    cached: Vec<u32>,
    store: Option<KvStore>,
    metrics: Arc<Metrics>,
}

impl Engine {
    /// `st`: a fresh state of `model` (its expert cache, if any, already set up).
    pub fn new(
        model: Model<'static>,
        tok: Tokenizer,
        mut st: State,
        store: Option<KvStore>,
        metrics: Arc<Metrics>,
    ) -> Engine {
        st.reset();
        metrics.set_expert_stats(st.expert_stats());
        Engine {
            model,
            tok,
            st,
            cached: Vec::new(),
            store,
            metrics,
        }
    }

    /// Serve jobs until the queue is closed and empty. `abort`: cancel the running job.
    /// Returns the state (for the caller's end-of-run figures).
    pub fn run(mut self, queue: &Queue, abort: &AtomicBool) -> State {
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
            let outcome = self.run_job(&job, abort);
            self.metrics.in_flight.store(0, Ordering::Relaxed);
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
            self.metrics.set_expert_stats(self.st.expert_stats());
            self.save_session();
            queue.idle();
        }
        self.st
    }

    /// Write the conversation in the KV cache to `--kv-dir`, if one is set.
    fn save_session(&mut self) {
        let Some(store) = &mut self.store else { return };
        if self.cached.is_empty() {
            return;
        }
        match store.save(&self.cached, &self.st) {
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

    fn run_job(&mut self, job: &Job, abort: &AtomicBool) -> Result<Finished, ApiError> {
        let res = self.generate(job, abort);
        if res.is_err() {
            // Whatever happened, keep the cache consistent with its token list.
            self.st.reset();
            self.cached.clear();
        }
        res
    }

    fn generate(&mut self, job: &Job, abort: &AtomicBool) -> Result<Finished, ApiError> {
        let ids = &job.tokens;
        let n = ids.len();
        let ctx = self.st.ctx();
        if n == 0 {
            return Err(ApiError::new(400, "the prompt is empty after tokenization"));
        }
        if n >= ctx {
            return Err(context_error(n, ctx));
        }
        let cancelled = || job.cancel.load(Ordering::Relaxed) || abort.load(Ordering::Relaxed);

        // Prompt reuse: the longest common prefix, always leaving one token to feed for logits.
        let mut common = lcp(&self.cached, ids).min(n - 1);
        if let Some(store) = &mut self.store {
            if let Some((idx, c)) = store.best_match(ids) {
                let c = c.min(n - 1);
                if c > common {
                    match store.load(idx, c, &mut self.st) {
                        Ok(bytes) => {
                            self.cached.clear();
                            self.cached.extend_from_slice(&ids[..c]);
                            common = c;
                            self.metrics.kv_loads.fetch_add(1, Ordering::Relaxed);
                            self.metrics
                                .kv_bytes_read
                                .fetch_add(bytes, Ordering::Relaxed);
                        }
                        Err(e) => {
                            eprintln!("[serve] warning: cannot restore a KV session: {e}");
                            // A failed load may have written part of the cache.
                            self.st.reset();
                            self.cached.clear();
                            common = 0;
                        }
                    }
                }
            }
        }
        self.st.truncate(common);
        self.cached.truncate(common);
        let prefilled = n - common;
        let mut fin = Finished {
            reason: FinishReason::Cancelled,
            prompt_tokens: n,
            completion_tokens: 0,
            reused: common,
            prefilled,
            prefill_secs: 0.0,
            decode_secs: 0.0,
        };
        if job
            .events
            .send(Event::Started {
                reused: common,
                prefilled,
            })
            .is_err()
        {
            return Ok(fin);
        }

        let mut sampler = Sampler::new(job.sampling.clone(), self.model.cfg.vocab);
        let mut history: Vec<u32> = Vec::with_capacity(n + job.max_tokens.min(ctx));
        history.extend_from_slice(ids);

        // Prefill in batches, looking for a cancel between them.
        let t0 = Instant::now();
        let rest = &ids[common..];
        let b = self.st.batch();
        let chunks = rest.len().div_ceil(b);
        let mut next = 0u32;
        for (i, chunk) in rest.chunks(b).enumerate() {
            if cancelled() {
                fin.prefill_secs = t0.elapsed().as_secs_f64();
                return Ok(fin);
            }
            let last = i + 1 == chunks;
            let from = if last { chunk.len() - 1 } else { chunk.len() };
            let logits = self
                .model
                .forward_chunk(&mut self.st, chunk, from)
                .map_err(model_error)?;
            if last {
                next = sampler.sample(logits, &history);
            }
            self.cached.extend_from_slice(chunk);
        }
        fin.prefill_secs = t0.elapsed().as_secs_f64();
        self.metrics
            .prompt_tokens
            .fetch_add(n as u64, Ordering::Relaxed);
        self.metrics
            .reused_tokens
            .fetch_add(common as u64, Ordering::Relaxed);
        self.metrics
            .prefilled_tokens
            .fetch_add(prefilled as u64, Ordering::Relaxed);
        self.metrics
            .prefill_us
            .fetch_add((fin.prefill_secs * 1e6) as u64, Ordering::Relaxed);
        self.metrics
            .set_speeds(Some(prefilled as f64 / fin.prefill_secs.max(1e-9)), None);

        // Decode.
        let t1 = Instant::now();
        let mut dec = if job.special {
            StreamDecoder::with_special()
        } else {
            StreamDecoder::new()
        };
        let mut stops = StopScanner::new(&job.stop);
        let mut steps = 0u64;
        let mut experts = 0u64;
        let mut generated = 0usize;
        let eos = self.tok.eos_ids().to_vec();
        let reason = loop {
            if job.max_tokens == 0 {
                break FinishReason::Length;
            }
            if !job.ignore_eos && eos.contains(&next) {
                break FinishReason::Eos;
            }
            generated += 1;
            history.push(next);
            if let Some(piece) = dec
                .push(&self.tok, next)
                .map_err(|e| ApiError::new(500, format!("decoding token {next}: {e}")))?
            {
                let (emit, hit) = stops.push(&piece);
                if !emit.is_empty() && job.events.send(Event::Text(emit)).is_err() {
                    break FinishReason::Cancelled;
                }
                if let Some(s) = hit {
                    break FinishReason::Stop(s);
                }
            }
            if cancelled() {
                break FinishReason::Cancelled;
            }
            if generated >= job.max_tokens || self.st.pos >= ctx {
                break FinishReason::Length;
            }
            let logits = self
                .model
                .forward_chunk(&mut self.st, &[next], 0)
                .map_err(model_error)?;
            let sampled = sampler.sample(logits, &history);
            self.cached.push(next);
            experts += self.st.experts_run as u64;
            self.st.tick_token();
            steps += 1;
            next = sampled;
        };
        if matches!(reason, FinishReason::Eos | FinishReason::Length) {
            let tail = dec
                .flush(&self.tok)
                .map_err(|e| ApiError::new(500, format!("decoding: {e}")))?
                .unwrap_or_default();
            let (mut emit, hit) = stops.push(&tail);
            if hit.is_none() {
                emit.push_str(&stops.finish());
            }
            if !emit.is_empty() {
                let _ = job.events.send(Event::Text(emit));
            }
            fin.reason = match hit {
                Some(s) => FinishReason::Stop(s),
                None => reason,
            };
        } else {
            fin.reason = reason;
        }
        fin.decode_secs = t1.elapsed().as_secs_f64();
        fin.completion_tokens = generated;
        let m = &self.metrics;
        m.generations.fetch_add(1, Ordering::Relaxed);
        m.generated_tokens
            .fetch_add(generated as u64, Ordering::Relaxed);
        m.decode_steps.fetch_add(steps, Ordering::Relaxed);
        m.experts_computed.fetch_add(experts, Ordering::Relaxed);
        m.decode_us
            .fetch_add((fin.decode_secs * 1e6) as u64, Ordering::Relaxed);
        if steps > 0 {
            m.set_speeds(None, Some(steps as f64 / fin.decode_secs.max(1e-9)));
        }
        Ok(fin)
    }
}

pub fn context_error(n: usize, ctx: usize) -> ApiError {
    ApiError {
        status: 400,
        message: format!("the prompt is {n} tokens; this server's context holds {ctx} (one more must fit for the reply; raise -c)"),
        param: Some("messages".into()),
        code: Some("context_length_exceeded"),
    }
}

fn model_error(e: ModelError) -> ApiError {
    match e {
        ModelError::ContextFull { needed, ctx } => context_error(needed, ctx),
        other => ApiError::new(500, format!("model error: {other}")),
    }
}

/// Length of the longest common prefix.
pub fn lcp(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Finds stop sequences in streamed text. Text that could still turn out to be the start of
/// a stop sequence is held back until it cannot.
pub struct StopScanner {
    stops: Vec<String>,
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
}

impl StopScanner {
    pub fn new(stops: &[String]) -> StopScanner {
        StopScanner {
            stops: stops.to_vec(),
            text: String::new(),
            emitted: 0,
        }
    }

    /// Add text; returns what may be sent now and the stop sequence found, if one was (the
    /// text from it on is dropped).
    pub fn push(&mut self, piece: &str) -> (String, Option<String>) {
        self.text.push_str(piece);
        if self.stops.is_empty() {
            let out = self.text[self.emitted..].to_string();
            self.emitted = self.text.len();
            return (out, None);
        }
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let mut from = self.emitted.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|p| (from + p, s)))
            .min_by_key(|(p, _)| *p);
        if let Some((pos, s)) = hit {
            let pos = pos.max(self.emitted);
            let out = self.text[self.emitted..pos].to_string();
            self.emitted = self.text.len();
            return (out, Some(s.clone()));
        }
        // Hold back the longest tail that is a proper prefix of some stop sequence.
        let len = self.text.len();
        let mut keep = 0;
        for s in &self.stops {
            for k in (1..s.len()).rev() {
                if k <= len - self.emitted
                    && self.text.is_char_boundary(len - k)
                    && s.is_char_boundary(k)
                    && self.text.ends_with(&s[..k])
                {
                    keep = keep.max(k);
                    break;
                }
            }
        }
        let out = self.text[self.emitted..len - keep].to_string();
        self.emitted = len - keep;
        (out, None)
    }

    /// Everything held back (generation ended without a stop sequence).
    pub fn finish(&mut self) -> String {
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut sc = StopScanner::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let (e, hit) = sc.push(p);
            out.push_str(&e);
            if hit.is_some() {
                return (out, hit);
            }
        }
        out.push_str(&sc.finish());
        (out, None)
    }

    #[test]
    fn stop_sequence_split_across_pieces_is_cut() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "D tail"]),
            ("abc ".to_string(), Some("END".to_string()))
        );
        assert_eq!(
            run(&["\n\n", "xyz"], &["one\n", "two", "\n", "\nthree"]),
            ("one\ntwo".to_string(), Some("\n\n".to_string()))
        );
    }

    #[test]
    fn near_misses_are_released() {
        assert_eq!(run(&["END"], &["E", "N", "d"]), ("ENd".to_string(), None));
        assert_eq!(run(&["é!"], &["aé", "b"]), ("aéb".to_string(), None));
        assert_eq!(run(&[], &["a", "b"]), ("ab".to_string(), None));
    }

    #[test]
    fn earliest_stop_wins() {
        assert_eq!(
            run(&["c", "ab"], &["xabc"]),
            ("x".to_string(), Some("ab".to_string()))
        );
    }
}
