//! Models: the forward pass written once over backend operations, one file per architecture
//! family, and the per-sequence state.
//!
//! Map: `backend.rs` is the `Backend` trait (the operations and buffer names the forward is
//! written in); `forward.rs` the graph (embed, decoder layer, GQA, MLP, final rows) and
//! `forward_chunk`; `cpu.rs` the CPU backend; `state.rs` the buffers and KV cache; `seq.rs` the
//! sequence state as parts (truncate, snapshot/restore); `family.rs` what a family answers
//! (`FamilySpec`), each family file (`qwen3moe.rs`, `mixtral.rs`, `olmoe.rs`, `glm4moe.rs`,
//! `deepseek2.rs`) its own; `config.rs` the shared reading of hyperparameters into
//! `ModelConfig`; `names.rs` tensor roles; `weights.rs` binding with shape checks; `blocks.rs`
//! the primitives (RMSNorm, RoPE, softmax, top-k).
//! Does not own: sampling (`sample`), tokenization (`tokenizer`), reading experts from disk.
//! Invariant: what is computed never depends on where weights live; placement is elsewhere.

pub mod backend;
pub mod blocks;
pub mod config;
mod cpu;
pub mod deepseek2;
pub mod deepseek_v4;
pub mod family;
mod forward;
pub mod glm4moe;
pub mod glmdsa;
pub mod gptoss;
pub mod mixtral;
mod mtp;
pub mod names;
pub mod olmoe;
pub mod qwen3moe;
pub mod qwen3next;
mod seq;
mod state;
mod streaming;
pub mod weights;

pub use config::{Family, ModelConfig};
pub use seq::{CacheDims, Part, PartKind, Snapshot};
pub use state::{KvRows, KvTypes, Prof, State};
pub use weights::Weights;

use crate::format::{FormatError, ModelFiles};
use crate::kernels::{Isa, KernelError};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{0}")]
    Config(String),
    #[error("missing tensor {0}")]
    MissingTensor(String),
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("{0}")]
    Input(String),
    #[error("context full: {needed} tokens needed, context is {ctx} (raise -c)")]
    ContextFull { needed: usize, ctx: usize },
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Experts(#[from] crate::experts::ExpertError),
    /// A device backend's failure (its own error type converts into this, in its module).
    #[error("{0}")]
    Backend(String),
}

/// A loaded model: config, weights bound to the mapped files, rotary tables and a thread pool.
pub struct Model<'a> {
    pub cfg: ModelConfig,
    pub weights: Weights<'a>,
    pub rope: blocks::Rope,
    pub pool: rayon::ThreadPool,
    pub isa: Isa,
    /// The KV cache's element types of every state made here (`ModelConfig::kv_types` of the
    /// asked ones), and why a side stays f32 where it was asked otherwise.
    pub kv: KvTypes,
    pub kv_note: Option<String>,
}

/// How a model is loaded. Threads and context change only how; `kv` (the KV cache's
/// precision) changes what is computed: f32 is exact, the default f16 (llama.cpp's) rounds
/// each cached key and value once.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Compute threads (0 = all cores).
    pub threads: usize,
    /// Longest sequence the rotary tables cover (the run's context length).
    pub ctx: usize,
    /// The KV cache's element types asked for (`-ctk`, `-ctv`).
    pub kv: KvTypes,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            threads: 0,
            ctx: 4096,
            kv: KvTypes::default(),
        }
    }
}

impl<'a> Model<'a> {
    pub fn load(files: &'a ModelFiles, opts: &LoadOptions) -> Result<Model<'a>, ModelError> {
        let mut cfg = ModelConfig::from_files(files)?;
        let (kv, kv_note) = cfg.kv_types(opts.kv)?;
        let weights = Weights::load(files, &mut cfg)?;
        let rope = blocks::Rope::new(
            cfg.rotary_dim,
            opts.ctx.max(1) + 1,
            cfg.rope_theta,
            cfg.rope_scaling,
            cfg.rope_layout,
        );
        let threads = if opts.threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            opts.threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("sluice-compute-{i}"))
            .build()
            .map_err(|e| {
                ModelError::Config(format!("cannot start {threads} compute threads: {e}"))
            })?;
        Ok(Model {
            cfg,
            weights,
            rope,
            pool,
            isa: Isa::detect(),
            kv,
            kv_note,
        })
    }

    /// A state sized for this model: `ctx` positions, prefill chunks of `batch` tokens; no
    /// MTP layer cache (see `new_state_mtp`).
    pub fn new_state(
        &self,
        ctx: usize,
        batch: usize,
        logit_rows: usize,
    ) -> Result<State, ModelError> {
        self.new_state_with(ctx, batch, logit_rows, false)
    }

    /// `new_state` plus the MTP layer's KV cache and buffers, for `--mtp K > 0`.
    pub fn new_state_mtp(
        &self,
        ctx: usize,
        batch: usize,
        logit_rows: usize,
    ) -> Result<State, ModelError> {
        if !self.has_mtp() {
            return Err(ModelError::Input(
                "--mtp: this model has no MTP layer".into(),
            ));
        }
        self.new_state_with(ctx, batch, logit_rows, true)
    }

    fn new_state_with(
        &self,
        ctx: usize,
        batch: usize,
        logit_rows: usize,
        mtp: bool,
    ) -> Result<State, ModelError> {
        if ctx + 1 > self.rope.ctx() {
            return Err(ModelError::Input(format!(
                "context {ctx} exceeds the {} positions the model was loaded for",
                self.rope.ctx()
            )));
        }
        Ok(State::with_mtp(
            &self.cfg, ctx, batch, logit_rows, mtp, self.kv,
        ))
    }

    /// Feed `tokens` (prefill, in batches) and return the logits of the last one.
    pub fn feed<'s>(&self, st: &'s mut State, tokens: &[u32]) -> Result<&'s [f32], ModelError> {
        self.feed_on(None, st, tokens)
    }

    /// `feed` on a device backend (`None`: the CPU), see `forward_on`.
    pub fn feed_on<'s>(
        &self,
        mut dev: Option<&mut dyn backend::Device>,
        st: &'s mut State,
        tokens: &[u32],
    ) -> Result<&'s [f32], ModelError> {
        if tokens.is_empty() {
            return Err(ModelError::Input("no tokens to feed".into()));
        }
        if st.pos + tokens.len() > st.ctx() {
            return Err(ModelError::ContextFull {
                needed: st.pos + tokens.len(),
                ctx: st.ctx(),
            });
        }
        let b = st.batch();
        let chunks = tokens.len().div_ceil(b);
        for c in 0..chunks - 1 {
            self.forward_on(
                backend::reborrow(&mut dev),
                st,
                &tokens[c * b..(c + 1) * b],
                b,
            )?;
        }
        let last = &tokens[(chunks - 1) * b..];
        self.forward_on(dev, st, last, last.len() - 1)
    }

    /// Teacher-forced logits of every position of `tokens`, appended to `out` (T x vocab).
    pub fn logits_all(
        &self,
        st: &mut State,
        tokens: &[u32],
        out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        self.logits_all_on(None, st, tokens, out)
    }

    /// `logits_all` on a device backend (`None`: the CPU), see `forward_on`.
    pub fn logits_all_on(
        &self,
        mut dev: Option<&mut dyn backend::Device>,
        st: &mut State,
        tokens: &[u32],
        out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        if st.pos + tokens.len() > st.ctx() {
            return Err(ModelError::ContextFull {
                needed: st.pos + tokens.len(),
                ctx: st.ctx(),
            });
        }
        let step = st.logit_rows().min(st.batch());
        for chunk in tokens.chunks(step) {
            let l = self.forward_on(backend::reborrow(&mut dev), st, chunk, 0)?;
            out.extend_from_slice(l);
        }
        Ok(())
    }
}
