//! Binding checkpoint tensors to the forward pass: finds each role's tensor, checks its shape
//! against the config, and keeps matrices as zero-copy views of the mapped files.
//!
//! Owns: `Weights` and `Layer` (one field per weight, shapes in comments). Small vectors
//! (norms, biases) are dequantized to f32 once; matrices stay encoded in place.
//! Invariant: after `Weights::load` succeeds every view has the shape the config implies and a
//! type the kernels support, so the forward pass can not fail on a weight.

use super::config::{AttnKind, ModelConfig, QkNorm};
use super::names::{self, Role};
use super::{gptoss, qwen3next, ModelError};
use crate::dtype::DType;
use crate::format::{ByteRange, FileKind, ModelFiles, TensorInfo};
use crate::kernels::{self, WeightView};

/// One routed expert's three projections, as views of the mapped files and as the byte
/// ranges they occupy there (what the streaming expert cache reads).
#[derive(Clone, Copy)]
pub struct Expert<'a> {
    pub gate: WeightView<'a>, // (ffn, hidden)
    pub up: WeightView<'a>,   // (ffn, hidden)
    pub down: WeightView<'a>, // (hidden, ffn)
    /// gate, up, down
    pub ranges: [ByteRange; 3],
}

/// A SwiGLU MLP: dense FFN layers and shared experts.
pub struct Mlp<'a> {
    pub gate: WeightView<'a>, // (ffn, hidden)
    pub up: WeightView<'a>,   // (ffn, hidden)
    pub down: WeightView<'a>, // (hidden, ffn)
}

/// Grouped-query attention.
pub struct Gqa<'a> {
    pub wq: WeightView<'a>,       // (n_heads*head_dim, hidden)
    pub wk: WeightView<'a>,       // (n_kv_heads*head_dim, hidden)
    pub wv: WeightView<'a>,       // (n_kv_heads*head_dim, hidden)
    pub wo: WeightView<'a>,       // (hidden, n_heads*head_dim)
    pub bq: Option<Vec<f32>>,     // (n_heads*head_dim)
    pub bk: Option<Vec<f32>>,     // (n_kv_heads*head_dim)
    pub bv: Option<Vec<f32>>,     // (n_kv_heads*head_dim)
    pub q_norm: Option<Vec<f32>>, // (head_dim) per-head, or (n_heads*head_dim) whole
    pub k_norm: Option<Vec<f32>>, // (head_dim) per-head, or (n_kv_heads*head_dim) whole
    pub bo: Option<Vec<f32>>,     // (hidden) output-projection bias (gpt-oss)
    pub sinks: Option<Vec<f32>>,  // (n_heads) attention sink logits (gpt-oss)
}

/// A per-head matrix: a view of the file, or an owned f32 copy when the checkpoint stores
/// it transposed relative to what the kernels need.
pub enum HeadMat<'a> {
    View(WeightView<'a>),
    Owned {
        rows: usize,
        cols: usize,
        data: Vec<f32>,
    },
}

/// Multi-head latent attention (DeepSeek-V3).
pub struct Mla<'a> {
    pub q_a: Option<WeightView<'a>>, // (q_lora, hidden)
    pub q_a_norm: Option<Vec<f32>>,  // (q_lora)
    pub q_b: WeightView<'a>,         // (n_heads*(nope+rope), q_lora or hidden)
    pub kv_a: WeightView<'a>,        // (kv_lora+rope, hidden)
    pub kv_a_norm: Vec<f32>,         // (kv_lora)
    pub k_b: Vec<HeadMat<'a>>,       // n_heads x (kv_lora, nope): folds k's up-projection into q
    pub v_b: Vec<HeadMat<'a>>,       // n_heads x (v_dim, kv_lora)
    pub wo: WeightView<'a>,          // (hidden, n_heads*v_dim)
    /// DeepSeek-V3.2's lightning indexer (absent: dense attention, unless `shares_indexer`).
    pub indexer: Option<Indexer<'a>>,
    /// GLM-5's "shared" layers: no indexer of their own; each query attends to the positions
    /// the previous layer with an indexer chose for it.
    pub shares_indexer: bool,
}

/// DeepSeek-V3.2's lightning indexer (DSA): scores every cached position for each query and
/// keeps the best `index_topk` for attention.
pub struct Indexer<'a> {
    pub wq_b: WeightView<'a>,    // (idx_heads*idx_dim, q_lora) from the q latent
    pub wk: WeightView<'a>,      // (idx_dim, hidden) one shared key per token
    pub k_norm: Vec<f32>,        // (idx_dim) LayerNorm weight
    pub k_norm_bias: Vec<f32>,   // (idx_dim) LayerNorm bias
    pub weights: WeightView<'a>, // (idx_heads, hidden) per-head weights of the scores
}

pub enum Attention<'a> {
    Gqa(Gqa<'a>),
    Mla(Mla<'a>),
    /// Qwen3-Next / Qwen3.5: a Gated DeltaNet or a gated full attention (qwen3next.rs).
    Hybrid(qwen3next::Mixer<'a>),
}

/// A routed MoE block.
pub struct Moe<'a> {
    pub router: WeightView<'a>,        // (n_experts, hidden)
    pub score_bias: Option<Vec<f32>>,  // (n_experts) selection-only bias of sigmoid routers
    pub experts: Vec<Expert<'a>>,      // n_experts
    pub shared: Option<Mlp<'a>>,       // (shared_ffn)
    pub router_bias: Option<Vec<f32>>, // (n_experts) added to the router logits (gpt-oss)
    /// Biases of every expert projection (gpt-oss); resident, small.
    pub exp_bias: Option<ExpertBias>,
    /// (hidden) the shared expert's output is scaled by sigmoid(this . x) (Qwen3-Next).
    pub shared_gate: Option<Box<[f32]>>,
}

/// Per-expert biases, expert-major: gate and up (n_experts, ffn), down (n_experts, hidden).
pub struct ExpertBias {
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
}

pub enum Ffn<'a> {
    Dense(Mlp<'a>),
    Moe(Moe<'a>),
}

pub struct Layer<'a> {
    pub attn_norm: Vec<f32>, // (hidden)
    pub attn: Attention<'a>,
    pub ffn_norm: Vec<f32>, // (hidden)
    pub ffn: Ffn<'a>,
}

impl<'a> Layer<'a> {
    /// The routed block, if this layer has one.
    pub fn moe(&self) -> Option<&Moe<'a>> {
        match &self.ffn {
            Ffn::Moe(m) => Some(m),
            Ffn::Dense(_) => None,
        }
    }
}

pub struct Weights<'a> {
    pub token_embd: WeightView<'a>, // (vocab, hidden)
    pub output_norm: Vec<f32>,      // (hidden)
    pub output: WeightView<'a>,     // (vocab, hidden); token_embd when tied
    pub layers: Vec<Layer<'a>>,
    /// The first multi-token-prediction layer, when the file has one.
    pub mtp: Option<MtpWeights<'a>>,
    /// DeepSeek-V4's layers (then `layers` is empty): deepseek_v4.rs.
    pub v4: Option<super::deepseek_v4::V4Weights<'a>>,
}

/// A multi-token-prediction module: x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]) -> one
/// decoder layer -> head_norm -> head, predicting t_{i+2}.
pub struct MtpWeights<'a> {
    pub enorm: Vec<f32>,         // (hidden)
    pub hnorm: Vec<f32>,         // (hidden)
    pub eh_proj: WeightView<'a>, // (hidden, 2*hidden)
    pub layer: Layer<'a>,
    pub head_norm: Vec<f32>,   // (hidden)
    pub head: WeightView<'a>,  // (vocab, hidden); the main lm_head when not stored
    pub embed: WeightView<'a>, // (vocab, hidden); the main embedding when not stored
}

/// A matrix view and where its bytes are.
#[derive(Clone, Copy)]
struct Located<'a> {
    view: WeightView<'a>,
    range: ByteRange,
}

struct Binder<'a, 'c> {
    files: &'a ModelFiles,
    cfg: &'c ModelConfig,
    hf_moe: &'static [(Role, &'static str)],
}

impl<'a> Binder<'a, '_> {
    fn is_gguf(&self) -> bool {
        self.files.kind() == FileKind::Gguf
    }

    fn patterns(&self, role: Role) -> &'static [&'static str] {
        if self.is_gguf() {
            names::gguf_names(role)
        } else {
            names::hf_common_names(role)
        }
    }

    /// The tensor called `name`. A Qwen3-Next / Qwen3.5 safetensors checkpoint keeps its MTP
    /// layer (cache layer `n_layers`) under `mtp.layers.0.` instead of `model.layers.{n}.`.
    fn tensor(&self, name: &str) -> Option<&'a TensorInfo> {
        if self.cfg.hybrid.is_some() && !self.is_gguf() {
            let main = format!("model.layers.{}.", self.cfg.n_layers);
            if let Some(rest) = name.strip_prefix(&main) {
                return self.files.tensor(&format!("mtp.layers.0.{rest}"));
            }
        }
        self.files.tensor(name)
    }

    /// The tensor for a non-expert role, if present.
    fn find(&self, role: Role, layer: usize) -> Option<&'a TensorInfo> {
        self.patterns(role)
            .iter()
            .find_map(|p| self.tensor(&names::fill(p, layer, 0)))
    }

    fn require(&self, role: Role, layer: usize) -> Result<&'a TensorInfo, ModelError> {
        self.find(role, layer).ok_or_else(|| {
            let p = self.patterns(role).first().copied().unwrap_or("?");
            ModelError::MissingTensor(format!("{} ({role:?})", names::fill(p, layer, 0)))
        })
    }

    fn view(
        &self,
        t: &'a TensorInfo,
        rows: usize,
        cols: usize,
    ) -> Result<WeightView<'a>, ModelError> {
        check_shape(t, &[rows, cols])?;
        let bytes = self.files.bytes(t)?;
        view_of(self.files, t, bytes, rows, cols)
    }

    fn vector(&self, t: &TensorInfo, n: usize) -> Result<Vec<f32>, ModelError> {
        if t.n_elems() != n as u64 {
            return Err(ModelError::Shape(format!(
                "{}: has {} elements ({:?}), config implies {n}",
                t.name,
                t.n_elems(),
                t.shape
            )));
        }
        Ok(self.files.dequantize(t)?)
    }

    fn mat(
        &self,
        role: Role,
        layer: usize,
        rows: usize,
        cols: usize,
    ) -> Result<WeightView<'a>, ModelError> {
        let t = self.require(role, layer)?;
        self.view(t, rows, cols)
    }

    fn norm(&self, role: Role, layer: usize, n: usize) -> Result<Vec<f32>, ModelError> {
        let t = self.require(role, layer)?;
        self.vector(t, n)
    }

    fn opt_vector(
        &self,
        role: Role,
        layer: usize,
        n: usize,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        self.find(role, layer)
            .map(|t| self.vector(t, n))
            .transpose()
    }

    fn mlp(&self, roles: [Role; 3], layer: usize, ffn: usize) -> Result<Mlp<'a>, ModelError> {
        let h = self.cfg.hidden;
        Ok(Mlp {
            gate: self.mat(roles[0], layer, ffn, h)?,
            up: self.mat(roles[1], layer, ffn, h)?,
            down: self.mat(roles[2], layer, h, ffn)?,
        })
    }

    fn router(&self, layer: usize) -> Result<WeightView<'a>, ModelError> {
        let (e, h) = (self.cfg.n_experts, self.cfg.hidden);
        if self.is_gguf() {
            return self.mat(Role::Router, layer, e, h);
        }
        let t = self
            .hf_moe
            .iter()
            .filter(|(r, _)| *r == Role::Router)
            .find_map(|(_, p)| self.tensor(&names::fill(p, layer, 0)))
            .ok_or_else(|| {
                ModelError::MissingTensor(format!(
                    "router of layer {layer} ({})",
                    self.hf_moe[0].1.replace("{l}", &layer.to_string())
                ))
            })?;
        self.view(t, e, h)
    }

    fn located(
        &self,
        t: &'a TensorInfo,
        rows: usize,
        cols: usize,
    ) -> Result<Located<'a>, ModelError> {
        Ok(Located {
            view: self.view(t, rows, cols)?,
            range: t.range,
        })
    }

    /// Per-slice views of a 3-D [n, rows, cols] tensor (experts, or MLA heads).
    fn split_3d(
        &self,
        t: &'a TensorInfo,
        n: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<Located<'a>>, ModelError> {
        check_shape(t, &[n, rows, cols])?;
        let all = self.files.bytes(t)?;
        let mut out = Vec::with_capacity(n);
        for e in 0..n {
            let r = self.files.expert_range(t, e)?;
            let start = (r.offset - t.range.offset) as usize;
            let bytes = all.get(start..start + r.len as usize).ok_or_else(|| {
                ModelError::Shape(format!("{}: slice {e} lies outside the tensor", t.name))
            })?;
            out.push(Located {
                view: view_of(self.files, t, bytes, rows, cols)?,
                range: r,
            });
        }
        Ok(out)
    }

    fn experts(&self, layer: usize) -> Result<Vec<Expert<'a>>, ModelError> {
        let (n, f, h) = (self.cfg.n_experts, self.cfg.expert_ffn, self.cfg.hidden);
        if self.is_gguf() {
            let get = |role| self.require(role, layer);
            let down = self.split_3d(get(Role::ExpDown)?, n, h, f)?;
            let (gate, up) = match self.find(Role::ExpGate, layer) {
                Some(g) => (
                    self.split_3d(g, n, f, h)?,
                    self.split_3d(get(Role::ExpUp)?, n, f, h)?,
                ),
                None => split_gate_up(self.split_3d(get(Role::ExpGateUp)?, n, 2 * f, h)?, f)?,
            };
            return Ok(zip_experts(gate, up, down));
        }
        let spec = self.cfg.family.spec();
        if let Some(what) = spec.hf_experts_refused {
            return Err(ModelError::Unsupported(format!(
                "{} experts from safetensors (layer {layer}: {what}) are not supported yet; convert the checkpoint to GGUF (llama.cpp's convert_hf_to_gguf.py) and load that",
                spec.name
            )));
        }
        // HF: per-expert tensors, or fused 3-D tensors.
        let pattern = |role: Role, fused: bool| {
            self.hf_moe
                .iter()
                .filter(move |(r, p)| *r == role && p.contains("{e}") != fused)
                .map(|(_, p)| *p)
        };
        let per_expert = pattern(Role::ExpGate, false)
            .find(|p| self.tensor(&names::fill(p, layer, 0)).is_some());
        if let Some(gate_p) = per_expert {
            let prefix_len = gate_p.find("{e}").unwrap_or(0);
            // The up/down patterns that share the gate pattern's prefix (same naming scheme).
            let sibling = |role: Role| {
                pattern(role, false)
                    .find(|p| p[..prefix_len.min(p.len())] == gate_p[..prefix_len])
                    .ok_or_else(|| ModelError::MissingTensor(format!("{role:?} of layer {layer}")))
            };
            let (up_p, down_p) = (sibling(Role::ExpUp)?, sibling(Role::ExpDown)?);
            let mut out = Vec::with_capacity(n);
            for e in 0..n {
                let get = |p: &str| {
                    let name = names::fill(p, layer, e);
                    self.tensor(&name).ok_or(ModelError::MissingTensor(name))
                };
                let (g, u, d) = (
                    self.located(get(gate_p)?, f, h)?,
                    self.located(get(up_p)?, f, h)?,
                    self.located(get(down_p)?, h, f)?,
                );
                out.push(Expert {
                    gate: g.view,
                    up: u.view,
                    down: d.view,
                    ranges: [g.range, u.range, d.range],
                });
            }
            return Ok(out);
        }
        let fused = |role: Role| {
            pattern(role, true)
                .find_map(|p| self.tensor(&names::fill(p, layer, 0)))
                .ok_or_else(|| ModelError::MissingTensor(format!("experts of layer {layer} (neither per-expert nor fused {role:?} tensors found)")))
        };
        let (gate, up) = split_gate_up(self.split_3d(fused(Role::ExpGateUp)?, n, 2 * f, h)?, f)?;
        let down = self.split_3d(fused(Role::ExpDown)?, n, h, f)?;
        Ok(zip_experts(gate, up, down))
    }

    fn gqa(&self, l: usize) -> Result<Gqa<'a>, ModelError> {
        let c = self.cfg;
        let (h, qd, kvd, hd) = (c.hidden, c.q_dim(), c.kv_dim(), c.head_dim);
        let (q_norm, k_norm) = match c.qk_norm {
            QkNorm::None => (None, None),
            QkNorm::PerHead => (
                Some(self.norm(Role::QNorm, l, hd)?),
                Some(self.norm(Role::KNorm, l, hd)?),
            ),
            QkNorm::Whole => (
                Some(self.norm(Role::QNorm, l, qd)?),
                Some(self.norm(Role::KNorm, l, kvd)?),
            ),
        };
        let bias = |role| {
            if c.attn_bias {
                self.norm(role, l, if role == Role::BiasQ { qd } else { kvd })
                    .map(Some)
            } else {
                Ok(None)
            }
        };
        Ok(Gqa {
            wq: self.mat(Role::Wq, l, qd, h)?,
            wk: self.mat(Role::Wk, l, kvd, h)?,
            wv: self.mat(Role::Wv, l, kvd, h)?,
            wo: self.mat(Role::Wo, l, h, c.att_dim())?,
            bq: bias(Role::BiasQ)?,
            bk: bias(Role::BiasK)?,
            bv: bias(Role::BiasV)?,
            q_norm,
            k_norm,
            bo: if c.o_bias {
                Some(self.named_vector(gptoss::O_BIAS, l, h)?)
            } else {
                None
            },
            sinks: if c.attn_sinks {
                Some(self.named_vector(gptoss::SINKS, l, c.n_heads)?)
            } else {
                None
            },
        })
    }

    /// A vector named by a (GGUF, HF) pair of patterns.
    fn named_vector(
        &self,
        pair: (&str, &str),
        layer: usize,
        n: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let name = gptoss::name(self.files, pair, layer);
        let t = self
            .files
            .tensor(&name)
            .ok_or(ModelError::MissingTensor(name))?;
        self.vector(t, n)
    }

    /// gpt-oss's expert biases (GGUF: gate/up/down tensors; HF: gate and up interleaved).
    fn expert_bias(&self, l: usize) -> Result<ExpertBias, ModelError> {
        let c = self.cfg;
        let (e, f, h) = (c.n_experts, c.expert_ffn, c.hidden);
        let down = self.named_vector(gptoss::DOWN_BIAS, l, e * h)?;
        if self.is_gguf() {
            let g = (gptoss::GATE_BIAS_GGUF, "");
            let u = (gptoss::UP_BIAS_GGUF, "");
            return Ok(ExpertBias {
                gate: self.named_vector(g, l, e * f)?,
                up: self.named_vector(u, l, e * f)?,
                down,
            });
        }
        let gu = self.named_vector(("", gptoss::GATE_UP_BIAS_HF), l, e * 2 * f)?;
        Ok(ExpertBias {
            gate: gu.iter().step_by(2).copied().collect(),
            up: gu.iter().skip(1).step_by(2).copied().collect(),
            down,
        })
    }

    fn mla(&self, l: usize) -> Result<Mla<'a>, ModelError> {
        let c = self.cfg;
        let AttnKind::Mla {
            q_lora,
            kv_lora,
            nope,
            rope,
            v_dim,
        } = c.attn
        else {
            return Err(ModelError::Config(
                "MLA weights requested for a GQA model".into(),
            ));
        };
        let (h, nh) = (c.hidden, c.n_heads);
        let (q_a, q_a_norm, q_b) = match q_lora {
            Some(r) => (
                Some(self.mat(Role::QA, l, r, h)?),
                Some(self.norm(Role::QANorm, l, r)?),
                self.mat(Role::QB, l, nh * (nope + rope), r)?,
            ),
            None => (None, None, self.mat(Role::Wq, l, nh * (nope + rope), h)?),
        };
        let (k_b, v_b) = match (self.find(Role::KB, l), self.find(Role::VB, l)) {
            (Some(kb), Some(vb)) => (
                self.split_3d(kb, nh, kv_lora, nope)?
                    .into_iter()
                    .map(|x| HeadMat::View(x.view))
                    .collect(),
                self.split_3d(vb, nh, v_dim, kv_lora)?
                    .into_iter()
                    .map(|x| HeadMat::View(x.view))
                    .collect(),
            ),
            _ => {
                // kv_b: (n_heads*(nope+v), kv_lora); per head `nope` k rows then `v_dim` v rows.
                let t = self.require(Role::KVB, l)?;
                let w = self.view(t, nh * (nope + v_dim), kv_lora)?;
                let all = self.files.dequantize(t)?;
                let rb = w.row_bytes();
                let mut k_b = Vec::with_capacity(nh);
                let mut v_b = Vec::with_capacity(nh);
                for hh in 0..nh {
                    let r0 = hh * (nope + v_dim);
                    // k part transposed to (kv_lora, nope) so q folds into latent space.
                    let mut data = vec![0f32; kv_lora * nope];
                    for i in 0..nope {
                        for j in 0..kv_lora {
                            data[j * nope + i] = all[(r0 + i) * kv_lora + j];
                        }
                    }
                    k_b.push(HeadMat::Owned {
                        rows: kv_lora,
                        cols: nope,
                        data,
                    });
                    let vb = &w.bytes[(r0 + nope) * rb..(r0 + nope + v_dim) * rb];
                    v_b.push(HeadMat::View(WeightView {
                        dtype: w.dtype,
                        bytes: vb,
                        rows: v_dim,
                        cols: kv_lora,
                    }));
                }
                (k_b, v_b)
            }
        };
        Ok(Mla {
            q_a,
            q_a_norm,
            q_b,
            kv_a: self.mat(Role::KVA, l, kv_lora + rope, h)?,
            kv_a_norm: self.norm(Role::KVANorm, l, kv_lora)?,
            k_b,
            v_b,
            wo: self.mat(Role::Wo, l, h, nh * v_dim)?,
            indexer: self.indexer(l, q_lora)?,
            shares_indexer: self.shares_indexer(l),
        })
    }

    /// Whether main layer `l` reuses an earlier layer's indexer choice (GLM-5).
    fn shares_indexer(&self, l: usize) -> bool {
        l < self.cfg.n_layers && self.cfg.indexer_full.get(l) == Some(&false)
    }

    /// The V3.2 indexer of layer `l`: required in the main layers of a model that has one
    /// (but GLM-5's shared layers); an MTP layer (l >= n_layers) without indexer tensors
    /// attends densely.
    fn indexer(&self, l: usize, q_lora: Option<usize>) -> Result<Option<Indexer<'a>>, ModelError> {
        let (Some(ix), Some(r)) = (self.cfg.indexer, q_lora) else {
            return Ok(None);
        };
        if self.shares_indexer(l) {
            return Ok(None);
        }
        if l >= self.cfg.n_layers && self.find(Role::IdxK, l).is_none() {
            return Ok(None);
        }
        let (h, d) = (self.cfg.hidden, ix.head_dim);
        Ok(Some(Indexer {
            wq_b: self.mat(Role::IdxQB, l, ix.heads * d, r)?,
            wk: self.mat(Role::IdxK, l, d, h)?,
            k_norm: self.norm(Role::IdxKNorm, l, d)?,
            k_norm_bias: self.norm(Role::IdxKNormBias, l, d)?,
            weights: self.mat(Role::IdxProj, l, ix.heads, h)?,
        }))
    }

    fn moe(&self, l: usize) -> Result<Moe<'a>, ModelError> {
        let c = self.cfg;
        let score_bias = if c.routing.sigmoid {
            self.opt_vector(Role::ScoreBias, l, c.n_experts)?
        } else {
            None
        };
        let shared = if c.shared_ffn > 0 {
            Some(self.mlp([Role::ShGate, Role::ShUp, Role::ShDown], l, c.shared_ffn)?)
        } else {
            None
        };
        let (router_bias, exp_bias) = if c.expert_bias {
            (
                Some(self.named_vector(gptoss::ROUTER_BIAS, l, c.n_experts)?),
                Some(self.expert_bias(l)?),
            )
        } else {
            (None, None)
        };
        Ok(Moe {
            router: self.router(l)?,
            score_bias,
            experts: self.experts(l)?,
            shared,
            router_bias,
            exp_bias,
            shared_gate: self.shared_gate(l)?,
        })
    }
}

fn zip_experts<'a>(
    gate: Vec<Located<'a>>,
    up: Vec<Located<'a>>,
    down: Vec<Located<'a>>,
) -> Vec<Expert<'a>> {
    gate.into_iter()
        .zip(up)
        .zip(down)
        .map(|((g, u), d)| Expert {
            gate: g.view,
            up: u.view,
            down: d.view,
            ranges: [g.range, u.range, d.range],
        })
        .collect()
}

/// Split fused [2*ffn, hidden] gate+up matrices into gate (first ffn rows) and up (the rest).
fn split_gate_up<'a>(
    fused: Vec<Located<'a>>,
    ffn: usize,
) -> Result<(Vec<Located<'a>>, Vec<Located<'a>>), ModelError> {
    let mut gates = Vec::with_capacity(fused.len());
    let mut ups = Vec::with_capacity(fused.len());
    for Located { view: w, range } in fused {
        let half = ffn * w.row_bytes();
        let (g, u) = w.bytes.split_at(half);
        let h = half as u64;
        gates.push(Located {
            view: WeightView {
                dtype: w.dtype,
                bytes: g,
                rows: ffn,
                cols: w.cols,
            },
            range: ByteRange { len: h, ..range },
        });
        ups.push(Located {
            view: WeightView {
                dtype: w.dtype,
                bytes: u,
                rows: ffn,
                cols: w.cols,
            },
            range: ByteRange {
                offset: range.offset + h,
                len: range.len - h,
                ..range
            },
        });
    }
    Ok((gates, ups))
}

fn check_shape(t: &TensorInfo, want: &[usize]) -> Result<(), ModelError> {
    let ok = t.shape.len() == want.len() && t.shape.iter().zip(want).all(|(a, b)| *a == *b as u64);
    if ok {
        Ok(())
    } else {
        Err(ModelError::Shape(format!(
            "{}: shape {:?} in the file, config implies {:?}",
            t.name, t.shape, want
        )))
    }
}

/// A weight matrix view, refusing (at load, naming the file, the tensor and its ggml type id)
/// a type sluice has no kernels for.
fn view_of<'a>(
    files: &ModelFiles,
    t: &TensorInfo,
    bytes: &'a [u8],
    rows: usize,
    cols: usize,
) -> Result<WeightView<'a>, ModelError> {
    if t.dtype == DType::F8E4M3 {
        return Err(ModelError::Unsupported(format!(
            "{}: FP8 matrices are dequantize-only in this build",
            t.name
        )));
    }
    kernels::kernels_for(t.dtype).map_err(|_| {
        let file = files
            .paths()
            .get(t.range.file)
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| files.dir().display().to_string());
        let id = t
            .dtype
            .ggml_id()
            .map(|i| format!(" (ggml type id {i})"))
            .unwrap_or_default();
        ModelError::Unsupported(format!(
            "{file}: tensor `{}` has type {}{id}, which sluice has no kernels for",
            t.name, t.dtype
        ))
    })?;
    WeightView::new(t.dtype, bytes, rows, cols)
        .map_err(|e| ModelError::Shape(format!("{}: {e}", t.name)))
}

impl<'a> Weights<'a> {
    pub fn load(files: &'a ModelFiles, cfg: &mut ModelConfig) -> Result<Weights<'a>, ModelError> {
        if cfg.v4.is_some() {
            let (token_embd, output_norm, output, v4) = super::deepseek_v4::load(files, cfg)?;
            return Ok(Weights {
                token_embd,
                output_norm,
                output,
                layers: Vec::new(),
                mtp: None,
                v4: Some(v4),
            });
        }
        let hf_moe = cfg.family.spec().hf_moe;
        let (h, v) = (cfg.hidden, cfg.vocab);
        // GGUF does not say which q/k norm a family has; the weights' lengths do.
        if files.kind() == FileKind::Gguf && cfg.attn == AttnKind::Gqa {
            let b = Binder { files, cfg, hf_moe };
            cfg.qk_norm = match b.find(Role::QNorm, 0) {
                None => QkNorm::None,
                Some(t) if t.n_elems() == cfg.head_dim as u64 => QkNorm::PerHead,
                Some(_) => QkNorm::Whole,
            };
        }
        let cfg: &ModelConfig = cfg;
        let b = Binder { files, cfg, hf_moe };
        let token_embd = b.mat(Role::TokenEmbd, 0, v, h)?;
        let output = match (b.find(Role::Output, 0), cfg.tie_embeddings) {
            (_, true) => token_embd,
            (Some(t), false) => b.view(t, v, h)?,
            (None, false) => {
                return Err(ModelError::MissingTensor(
                    "lm_head / output.weight (embeddings are not tied)".into(),
                ))
            }
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let attn = match cfg.attn {
                _ if cfg.hybrid.is_some() => b.hybrid_mixer(l)?,
                AttnKind::Gqa => Attention::Gqa(b.gqa(l)?),
                AttnKind::Mla { .. } => Attention::Mla(b.mla(l)?),
            };
            let ffn = if cfg.is_moe_layer(l) {
                Ffn::Moe(b.moe(l)?)
            } else {
                Ffn::Dense(b.mlp(
                    [Role::DenseGate, Role::DenseUp, Role::DenseDown],
                    l,
                    cfg.dense_ffn,
                )?)
            };
            layers.push(Layer {
                attn_norm: b.norm(Role::AttnNorm, l, h)?,
                attn,
                ffn_norm: b.norm(Role::FfnNorm, l, h)?,
                ffn,
            });
        }
        let mtp = if cfg.n_mtp_layers > 0 && b.find(Role::MtpEh, cfg.n_layers).is_some() {
            let l = cfg.n_layers;
            let attn = match cfg.attn {
                // Qwen3-Next / Qwen3.5: a gated full-attention layer.
                _ if cfg.hybrid.is_some() => b.hybrid_mixer(l)?,
                AttnKind::Gqa => Attention::Gqa(b.gqa(l)?),
                AttnKind::Mla { .. } => Attention::Mla(b.mla(l)?),
            };
            let layer = Layer {
                attn_norm: b.norm(Role::AttnNorm, l, h)?,
                attn,
                ffn_norm: b.norm(Role::FfnNorm, l, h)?,
                ffn: Ffn::Moe(b.moe(l)?),
            };
            Some(MtpWeights {
                enorm: b.norm(Role::MtpEnorm, l, h)?,
                hnorm: b.norm(Role::MtpHnorm, l, h)?,
                eh_proj: b.mat(Role::MtpEh, l, h, 2 * h)?,
                layer,
                head_norm: b.norm(Role::MtpHeadNorm, l, h)?,
                head: match b.find(Role::MtpHead, l) {
                    Some(t) => b.view(t, v, h)?,
                    None => output,
                },
                embed: match b.find(Role::MtpEmbed, l) {
                    Some(t) => b.view(t, v, h)?,
                    None => token_embd,
                },
            })
        } else {
            None
        };
        let mut w = Weights {
            token_embd,
            output_norm: b.norm(Role::OutputNorm, 0, h)?,
            output,
            layers,
            mtp,
            v4: None,
        };
        b.center_hybrid_norms(&mut w);
        Ok(w)
    }
}

// Qwen3-Next / Qwen3.5 (qwen3next.rs): the mixers, the shared-expert gate, the (1 + w) norms.
impl<'a> Binder<'a, '_> {
    fn named(&self, pattern: &str, l: usize) -> Result<&'a TensorInfo, ModelError> {
        let name = pattern.replace("{l}", &l.to_string());
        self.tensor(&name).ok_or(ModelError::MissingTensor(name))
    }

    fn named_mat(
        &self,
        p: &str,
        l: usize,
        rows: usize,
        cols: usize,
    ) -> Result<WeightView<'a>, ModelError> {
        self.view(self.named(p, l)?, rows, cols)
    }

    fn named_vec(&self, p: &str, l: usize, n: usize) -> Result<Vec<f32>, ModelError> {
        self.vector(self.named(p, l)?, n)
    }

    /// Layer `l`'s Gated DeltaNet or gated attention (HF or llama.cpp's GGUF names).
    fn hybrid_mixer(&self, l: usize) -> Result<Attention<'a>, ModelError> {
        use qwen3next::{gguf, hf};
        let c = self.cfg;
        let hy = c.hybrid.as_deref().ok_or_else(|| {
            ModelError::Config("hybrid mixer requested for a model without hybrid layers".into())
        })?;
        let (h, g) = (c.hidden, self.is_gguf());
        let pick = |gguf_name: &'static str, hf_name: &'static str| {
            if g {
                gguf_name
            } else {
                hf_name
            }
        };
        // Layer `n_layers` is the MTP layer: gated full attention (further ones are not run).
        if l > hy.linear.len() {
            return Err(ModelError::Unsupported(format!(
                "layer {l}: only the first MTP layer of {} is run",
                c.family.name()
            )));
        }
        if !hy.linear.get(l).copied().unwrap_or(false) {
            let (qd, kvd, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
            // GGUF norms already hold 1 + w (llama.cpp's converter adds it).
            let one = if g { 0.0 } else { 1.0 };
            let centred = |p: &str| -> Result<Vec<f32>, ModelError> {
                Ok(self
                    .named_vec(p, l, hd)?
                    .into_iter()
                    .map(|w| one + w)
                    .collect())
            };
            return Ok(Attention::Hybrid(qwen3next::Mixer::Gated(
                qwen3next::GatedAttn {
                    wq: self.named_mat(pick(gguf::Q, hf::Q), l, 2 * qd, h)?,
                    wk: self.named_mat(pick(gguf::K, hf::K), l, kvd, h)?,
                    wv: self.named_mat(pick(gguf::V, hf::V), l, kvd, h)?,
                    wo: self.named_mat(pick(gguf::O, hf::O), l, h, qd)?,
                    q_norm: centred(pick(gguf::Q_NORM, hf::Q_NORM))?,
                    k_norm: centred(pick(gguf::K_NORM, hf::K_NORM))?,
                },
            )));
        }
        let (kd, vd, nv) = (hy.key_dim(), hy.value_dim(), hy.v_heads);
        let (in_qkv, in_b, in_z, in_a) = if g && hy.v_tiled {
            (
                self.named_mat(gguf::QKV, l, hy.conv_dim(), h)?,
                self.named_mat(gguf::BETA, l, nv, h)?,
                Some(self.named_mat(gguf::Z, l, vd, h)?),
                Some(self.named_mat(gguf::ALPHA, l, nv, h)?),
            )
        } else if g {
            (
                self.named_mat(gguf::QKV, l, hy.conv_dim(), h)?,
                self.named_mat(gguf::BA, l, 2 * nv, h)?,
                Some(self.named_mat(gguf::Z, l, vd, h)?),
                None,
            )
        } else if hy.fused {
            (
                self.named_mat(hf::IN_QKVZ, l, 2 * kd + 2 * vd, h)?,
                self.named_mat(hf::IN_BA, l, 2 * nv, h)?,
                None,
                None,
            )
        } else {
            (
                self.named_mat(hf::IN_QKV, l, hy.conv_dim(), h)?,
                self.named_mat(hf::IN_B, l, nv, h)?,
                Some(self.named_mat(hf::IN_Z, l, vd, h)?),
                Some(self.named_mat(hf::IN_A, l, nv, h)?),
            )
        };
        let conv_t = self.named(pick(gguf::CONV, hf::CONV), l)?;
        if g {
            check_shape(conv_t, &[hy.conv_dim(), hy.conv])?;
        } else {
            check_shape(conv_t, &[hy.conv_dim(), 1, hy.conv])?;
        }
        let a_neg = if g {
            self.named_vec(gguf::A, l, nv)?
        } else {
            self.named_vec(hf::A_LOG, l, nv)?
                .into_iter()
                .map(|x| -x.exp())
                .collect()
        };
        Ok(Attention::Hybrid(qwen3next::Mixer::DeltaNet(
            qwen3next::DeltaNet {
                in_qkv,
                in_b,
                in_z,
                in_a,
                conv: self.files.dequantize(conv_t)?,
                a_neg,
                dt_bias: self.named_vec(pick(gguf::DT_BIAS, hf::DT_BIAS), l, nv)?,
                norm: self.named_vec(pick(gguf::NORM, hf::NORM), l, hy.v_dim)?,
                out: self.named_mat(pick(gguf::OUT, hf::OUT), l, h, vd)?,
            },
        )))
    }

    fn shared_gate(&self, l: usize) -> Result<Option<Box<[f32]>>, ModelError> {
        if self.cfg.hybrid.is_none() {
            return Ok(None);
        }
        let p = if self.is_gguf() {
            qwen3next::gguf::SHARED_GATE
        } else {
            qwen3next::hf::SHARED_GATE
        };
        Ok(Some(
            self.named_vec(p, l, self.cfg.hidden)?.into_boxed_slice(),
        ))
    }

    /// transformers' zero-centred RMSNorms multiply by (1 + w): the 1 is added here, once.
    fn center_hybrid_norms(&self, w: &mut Weights<'_>) {
        if self.cfg.hybrid.is_none() || self.is_gguf() {
            return;
        }
        let add1 = |v: &mut Vec<f32>| v.iter_mut().for_each(|x| *x += 1.0);
        add1(&mut w.output_norm);
        for lw in &mut w.layers {
            add1(&mut lw.attn_norm);
            add1(&mut lw.ffn_norm);
        }
        if let Some(m) = &mut w.mtp {
            for v in [
                &mut m.enorm,
                &mut m.hnorm,
                &mut m.head_norm,
                &mut m.layer.attn_norm,
                &mut m.layer.ffn_norm,
            ] {
                add1(v);
            }
        }
    }
}
