//! The engine: one object that owns a running model — its files, weights, tokenizer, the
//! planner's placement (streamed expert cache, the device backend the forward runs on: the
//! CUDA backend or none for the CPU) and the session (the per-sequence state and the tokens it
//! holds) — and the one decode loop every command uses.
//!
//! Map: `options.rs` is the plain options struct, the flag parsers and the one place that
//! refuses unsupported combinations; `placement.rs` runs the planner and attaches the expert
//! cache and the GPU; `decode.rs` is the decode loop (prefill, plain or MTP decoding, stop
//! conditions, streaming, cancellation); `kv_store.rs` keeps sessions on disk (`--kv-dir`).
//! `run`, `chat`, `logits`, `serve` (and so `bench`, whose arms are `run` processes) are thin
//! clients: they turn flags into `EngineOptions`, call `Engine::open`, then `generate` or
//! `logits`, and print.
//!
//! Ownership: `Model<'a>` borrows the mapped `ModelFiles`. The engine leaks the files
//! (`Box::leak`, so they live for the rest of the process) and holds `Model<'static>`. Every
//! command opens one engine per process and runs it until the process ends, so the leak is the
//! mapping the process would hold anyway; unmapping earlier would need a self-referential
//! struct, which safe Rust cannot express without a crate built on `unsafe`. A caller that
//! opens engines repeatedly in one process (tests) holds one mapping per open; the decode loop
//! (`decode::decode`) also takes a borrowed model and state, for callers that own their files.
//!
//! Invariant: the session's token list is exactly what its state holds (`tokens.len() ==
//! st.pos`), so reusing a prefix — kept from the last generation or restored from `--kv-dir`
//! — is exact, and at temperature 0 a reply does not depend on what was cached before.

pub mod batch;
pub mod decode;
pub mod kv_store;
pub mod limits;
pub mod options;
pub mod placement;

pub use decode::{lcp, Event, Finish, GenParams, GenStats, GenerateError, Generation, StopScanner};
pub use options::{EngineOptions, ExpertOptions, GpuRequest, GpuWant};

use crate::format::{FileKind, ModelFiles};
use crate::model::backend::Device;
use crate::model::{LoadOptions, Model, ModelConfig, ModelError, State};
use crate::plan::planner::Plan;
use crate::sample::Sampler;
use crate::tokenizer::{Tokenizer, TokenizerError};
use kv_store::KvStore;
use placement::Say;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A flag (or combination) that cannot be honoured: `{flag}: {reason}`.
    #[error("{flag}: {reason}")]
    Refused { flag: String, reason: String },
    #[error(transparent)]
    Format(#[from] crate::format::FormatError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Generate(#[from] GenerateError),
    #[error(transparent)]
    Plan(#[from] crate::plan::planner::PlanError),
    #[error(transparent)]
    Experts(#[from] crate::experts::ExpertError),
    #[error(transparent)]
    Gpu(#[from] crate::gpu::GpuError),
    #[error("--kv-dir {}: {msg}", path.display())]
    KvDir {
        path: std::path::PathBuf,
        msg: String,
    },
    #[error("{what}: {err}")]
    Io { what: String, err: std::io::Error },
    /// A size or value that cannot be run (one line naming the flag).
    #[error("{0}")]
    Input(String),
}

/// The tokenizer of a model: `tokenizer.json` beside a safetensors model (or a GGUF, if one
/// is there), else the vocabulary embedded in the GGUF.
pub fn load_tokenizer(files: &ModelFiles) -> Result<Tokenizer, TokenizerError> {
    let json = files.dir().join("tokenizer.json");
    if files.kind() == FileKind::Safetensors
        || json.is_file() && files.meta("tokenizer.ggml.model").is_none()
    {
        return Tokenizer::from_file(&json);
    }
    Tokenizer::from_gguf_meta(&|k| files.meta(k))
}

/// The engine's device backend for one call (the trait object's lifetime shortened to it).
fn device(d: &mut Option<Box<dyn Device>>) -> Option<&mut dyn Device> {
    match d {
        Some(b) => Some(&mut **b),
        None => None,
    }
}

/// One sequence: the model's per-sequence state (KV cache, MTP head, buffers) and the tokens
/// it holds.
pub struct Session {
    pub st: State,
    /// Tokens whose keys and values are in `st` (`tokens.len() == st.pos`).
    tokens: Vec<u32>,
}

impl Session {
    /// The tokens the session holds.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Forget the sequence (buffers stay allocated).
    pub fn reset(&mut self) {
        self.st.reset();
        self.tokens.clear();
    }
}

/// A generation's result at the engine level.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub generation: Generation,
    /// Bytes read from `--kv-dir` to restore a session (None: nothing restored).
    pub restored_bytes: Option<u64>,
}

/// A loaded, placed model with its session.
pub struct Engine {
    pub files: &'static ModelFiles,
    pub model: Model<'static>,
    pub tok: Tokenizer,
    /// The planner's plan (for predicted vs measured).
    pub plan: Plan,
    /// Context length.
    pub ctx: usize,
    /// Whether the GPU runs the forward.
    pub gpu: bool,
    pub opts: EngineOptions,
    /// The device backend running the forward (`--gpu`), beside the session's state; `None`:
    /// the CPU backend over the state's own buffers. Declared before `session` so it is
    /// dropped first: it stages from (and registered) the state's RAM expert cache.
    device: Option<Box<dyn Device>>,
    pub session: Session,
    store: Option<KvStore>,
}

impl Engine {
    /// Open the model files, refuse what cannot be honoured (before binding weights), load
    /// the model and tokenizer, run the planner and attach the expert cache and the GPU
    /// (printing `[plan]` lines unless `opts.quiet`), and make the session.
    pub fn open(opts: EngineOptions) -> Result<Engine, EngineError> {
        let files: &'static ModelFiles = Box::leak(Box::new(ModelFiles::open(&opts.model)?));
        let cfg = ModelConfig::from_files(files)?;
        let mut opts = opts;
        let parallel_line = opts.resolve_parallel(&cfg);
        opts.check(&cfg)?;
        let ctx = opts.ctx_for(&cfg)?;
        // Sizes from the command line, checked before anything is allocated with them.
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let (threads, warning) = limits::threads(opts.threads, cpus);
        if let Some(w) = warning {
            eprintln!("{w}");
        }
        // A prefill batch holds at most the context (llama.cpp clamps n_batch to n_ctx too), at
        // least the MTP drafts + 1 and one row per sequence slot. A `-b` past the default that the
        // context cuts is said (the default itself is cut silently).
        if opts.batch > ctx && opts.batch > crate::engine::options::DEFAULT_BATCH {
            eprintln!(
                "[sluice] warning: -b {} is more than the context ({ctx} tokens); using {ctx}",
                opts.batch
            );
        }
        let batch = opts
            .batch
            .min(ctx)
            .max(1)
            .max(opts.mtp + 1)
            .max(opts.parallel);
        limits::ctx_and_batch(ctx, batch, &cfg, placement::mem_available())
            .map_err(EngineError::Input)?;
        let (kv, kv_why) = opts.kv_types();
        let model = Model::load(files, &LoadOptions { threads, ctx, kv })?;
        let tok = load_tokenizer(files)?;
        let k = opts.mtp;
        // The MTP layer's KV cache is allocated only with --mtp.
        // With --parallel N the session state is the batched step's buffers: N rows at least
        // (one per decoding sequence) and N logit rows.
        let rows = opts.logit_rows.max(k + 1).max(opts.parallel);
        let mut st = if k > 0 {
            model.new_state_mtp(ctx, batch, rows)?
        } else {
            model.new_state(ctx, batch, rows)?
        };
        let say = Say { quiet: opts.quiet };
        // The cache's element types and why (its bytes are the plan's `kv cache` line).
        let values = match model.cfg.cache_dims().1 {
            0 => "none".to_string(),
            _ => model.kv.v.to_string(),
        };
        say.line(&format!(
            "[plan] kv cache types: keys {}, values {values} ({kv_why}{})",
            model.kv.k,
            model
                .kv_note
                .as_ref()
                .map_or(String::new(), |n| format!("; {n}"))
        ));
        let parallel_line =
            placement::cap_auto_parallel(&mut opts, st.kv_bytes() as u64).or(parallel_line);
        // Where experts stream, the automatic count may be capped again by expert reads (its
        // line then replaces this one).
        let (plan, read_line) = placement::place_experts(&model, files, &mut st, &mut opts, &say)?;
        if let Some(l) = read_line.or(parallel_line) {
            say.line(&l);
        }
        let device = placement::place_gpu(&model, files, &mut st, &opts, &plan, &say)?;
        if !plan.stream && device.is_none() {
            // Experts resident and computed here: their pages mapped now rather than faulted
            // in one 64 KiB piece at a time by the tokens that first route to them (~27,000
            // faults in 128 tokens of an 8-layer Qwen3-30B-A3B shape; llama.cpp copies its
            // weights at load).
            files.populate();
        }
        if device.is_none() {
            // The CPU's activation buffers mapped now, not by the first prompt's writes.
            st.prefault();
        }
        if opts.parallel > 1 && device.is_none() {
            // The session state is the batched step's buffers; each slot has its own cache.
            st.release_kv();
        }
        let store = match &opts.kv_dir {
            None => None,
            Some(dir) => {
                let mut fp = kv_store::fingerprint(files, &model.cfg);
                if k > 0 {
                    // Sessions of an MTP engine also hold the MTP layer's cache.
                    fp = fp.rotate_left(17) ^ 0x6d74_7000;
                }
                let dims = model.cfg.cache_dims();
                let layers = st.kv_layers(dims);
                Some(
                    KvStore::open(
                        dir,
                        fp,
                        layers,
                        dims,
                        st.kv_types(),
                        st.block_floats(),
                        opts.kv_max_sessions,
                    )
                    .map_err(|e| EngineError::KvDir {
                        path: dir.clone(),
                        msg: e.to_string(),
                    })?,
                )
            }
        };
        st.reset();
        Ok(Engine {
            files,
            model,
            tok,
            plan,
            ctx,
            gpu: device.is_some(),
            opts,
            device,
            session: Session {
                st,
                tokens: Vec::new(),
            },
            store,
        })
    }

    /// Whether the session holds a KV cache of its own: not when the engine was opened for
    /// `--parallel N > 1` (its state is then the buffers of `engine::batch` steps).
    fn one_sequence(&self) -> Result<(), EngineError> {
        if self.opts.parallel > 1 && !self.gpu {
            return Err(EngineError::Input(format!(
                "this engine decodes {} sequences together (--parallel); it runs them through engine::batch, not generate",
                self.opts.parallel
            )));
        }
        Ok(())
    }

    /// The session's state (for figures).
    pub fn state(&self) -> &State {
        &self.session.st
    }

    /// The device's figures since attach (None: the CPU runs the forward).
    pub fn gpu_stats(&self) -> Option<crate::gpu::GpuStats> {
        self.device.as_ref().map(|d| d.stats())
    }

    /// The pinned host -> device GB/s measured at attach, if it was.
    pub fn gpu_h2d_ceiling(&self) -> Option<f64> {
        self.device.as_ref().and_then(|d| d.h2d_ceiling())
    }

    /// Sessions saved in `--kv-dir` for this model (None without one).
    pub fn saved_sessions(&self) -> Option<usize> {
        self.store.as_ref().map(|s| s.len())
    }

    /// A sampler with the engine's default parameters.
    pub fn sampler(&self) -> Sampler {
        Sampler::new(self.opts.sampling.clone(), self.model.cfg.vocab)
    }

    /// Generate a reply to `prompt`, the whole token sequence (the session keeps the longest
    /// prefix it shares with what it holds, or restores a longer one from `--kv-dir`, and
    /// feeds the rest). `on_event` gets `Started` once reuse is decided, then the text.
    /// `p.mtp` is set from the engine's options. On error the session is reset.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        sampler: &mut Sampler,
        p: &GenParams<'_>,
        on_event: &mut dyn FnMut(Event<'_>) -> bool,
    ) -> Result<Outcome, EngineError> {
        let res = self.generate_inner(prompt, sampler, p, on_event);
        if res.is_err() {
            // Whatever happened, keep the cache consistent with its token list.
            self.session.reset();
        }
        res
    }

    fn generate_inner(
        &mut self,
        prompt: &[u32],
        sampler: &mut Sampler,
        p: &GenParams<'_>,
        on_event: &mut dyn FnMut(Event<'_>) -> bool,
    ) -> Result<Outcome, EngineError> {
        self.one_sequence()?;
        let n = prompt.len();
        if n == 0 {
            return Err(GenerateError::EmptyPrompt.into());
        }
        let restored_bytes = self.sync(prompt);
        let keep = self.session.tokens.len();
        if !on_event(Event::Started {
            reused: keep,
            prefilled: n - keep,
        }) {
            let mut generation = Generation {
                tokens: Vec::new(),
                stats: GenStats::default(),
                finish: Finish::Cancelled,
            };
            generation.stats.reused = keep;
            return Ok(Outcome {
                generation,
                restored_bytes,
            });
        }
        let params = GenParams {
            mtp: self.opts.mtp,
            ..*p
        };
        let s = &mut self.session;
        let generation = decode::decode_on(
            device(&mut self.device),
            &self.model,
            &self.tok,
            &mut s.st,
            &mut s.tokens,
            &prompt[..keep],
            &prompt[keep..],
            sampler,
            &params,
            on_event,
        )?;
        Ok(Outcome {
            generation,
            restored_bytes,
        })
    }

    /// Prefix sync: keep the longest common prefix of `prompt` with what the session holds
    /// (always leaving one token to feed, for fresh logits), or restore a longer one from
    /// `--kv-dir`. With MTP the main cache is cut back to the head's slots, so the first
    /// prefill chunk re-levels them. Returns the bytes restored, if any.
    fn sync(&mut self, prompt: &[u32]) -> Option<u64> {
        let n = prompt.len();
        let s = &mut self.session;
        let mut common = lcp(&s.tokens, prompt).min(n - 1);
        // A recurrent state (Qwen3-Next / Qwen3.5) is held only after the session's last
        // token: a shorter common prefix cannot be kept (`truncate` restarts at 0).
        let kept = if s.st.block_floats() > 0 && common < s.st.pos {
            0
        } else {
            common
        };
        let mut restored = None;
        if let Some(store) = &mut self.store {
            if let Some((idx, c)) = store.best_match(prompt) {
                let c = c.min(n - 1);
                if c > kept {
                    match store.load(idx, c, &mut s.st) {
                        Ok(bytes) => {
                            s.tokens.clear();
                            s.tokens.extend_from_slice(&prompt[..c]);
                            // The MTP layer's rows were restored with the others: slots
                            // 0..c-1 pair positions whose next token is known.
                            s.st.mtp_pos = c.saturating_sub(1);
                            s.st.mtp_pending_pos = None;
                            common = c;
                            restored = Some(bytes);
                        }
                        Err(e) => {
                            eprintln!("[sluice] warning: cannot restore a KV session: {e}");
                            // A failed load may have written part of the cache.
                            s.st.reset();
                            s.tokens.clear();
                            common = 0;
                        }
                    }
                }
            }
        }
        s.st.truncate(common);
        if self.opts.mtp > 0 {
            if s.st.is_recurrent() && s.st.mtp_pos < s.st.pos {
                // The head's slots lag the cache; a recurrent state cannot be cut back to
                // them: continue from the kept row if the last decode left one, else restart
                // (the turn is computed from 0).
                if !decode::resumes_mtp(&s.st) {
                    s.st.reset();
                }
            } else {
                s.st.pos = s.st.mtp_pos.min(s.st.pos);
            }
        }
        s.tokens.truncate(s.st.pos);
        restored
    }

    /// Write the session to `--kv-dir`, if one is set. Returns the bytes written (None:
    /// nothing to write or unchanged).
    pub fn save_session(&mut self) -> Result<Option<u64>, EngineError> {
        let Some(store) = &mut self.store else {
            return Ok(None);
        };
        let s = &self.session;
        if s.tokens.is_empty() {
            return Ok(None);
        }
        store
            .save(&s.tokens, &s.st)
            .map_err(|e| EngineError::KvDir {
                path: self.opts.kv_dir.clone().unwrap_or_default(),
                msg: e.to_string(),
            })
    }

    /// Teacher-forced logits of every position of `tokens` (a fresh sequence), appended to
    /// `out` (T x vocab).
    pub fn logits(&mut self, tokens: &[u32], out: &mut Vec<f32>) -> Result<(), EngineError> {
        self.one_sequence()?;
        self.session.reset();
        let r =
            self.model
                .logits_all_on(device(&mut self.device), &mut self.session.st, tokens, out);
        // The session holds no token list for teacher-forced runs.
        self.session.reset();
        Ok(r?)
    }

    /// At the end: add this run's expert selections to the saved usage statistics.
    pub fn save_usage(&self) -> Result<(), EngineError> {
        placement::save_usage(self.files, &self.session.st, &self.opts.experts)
    }

    /// After a streamed run: this run's expert reads against the cached machine profile's
    /// disk ceiling (`MachineProfile::check_run_reads`); a ceiling the run beat is raised and
    /// saved. The line to print, if any.
    pub fn check_disk_profile(&self) -> Option<String> {
        placement::check_disk_profile(self.files, &self.session.st)
    }
}
