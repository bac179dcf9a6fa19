//! What a synthetic model contains: per family, its GGUF metadata (llama.cpp's keys) and its
//! tensor list (llama.cpp's names and shapes), and the per-tensor-class quantization mix.
//!
//! Owns: the three families' layouts (`qwen3moe`, `deepseek2`, `glm4moe`) as data.
//! Does not own: generating or writing the bytes (`synth.rs`).
//! Invariant: every tensor llama.cpp's loader requires for the family is listed, with the shape
//! it expects (checked against llama.cpp's `src/models/{deepseek2,glm4-moe}.cpp` loaders and
//! against the committed converter fixtures in tests/fixtures/models/).

use super::{MoeSpec, SynthArch};
use crate::dtype::DType;
use crate::format::MetaValue;

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Init {
    /// All ones (RMSNorm weights).
    Ones,
    /// All zeros (the sigmoid routers' selection bias without `--skew`).
    Zeros,
    /// Uniform in [-a, a).
    Uniform(f32),
    /// Every value `c` (Qwen3-Next's `ssm_a` = -exp(A_log) must be negative).
    Const(f32),
    /// DeepSeek-V4's hash routing table: rows of distinct expert ids below `experts` (I32).
    ExpertIds { experts: usize },
}

/// What a tensor is for, as far as choosing its type goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorClass {
    Embedding,
    Output,
    /// Every attention matrix (GQA or MLA projections).
    Attention,
    /// The leading dense layers' FFN.
    DenseFfn,
    SharedExpert,
    RoutedExperts,
    /// Norms, routers, biases: always F32.
    Vector,
}

/// The type a tensor of `class` gets when the matrices' type (`--quant`) is `bulk`.
///
/// `q4_k`, `q8_0`, `f16`, `bf16`, `f32`: every matrix in that type. `iq2_xxs` is a mix in the
/// spirit of llama.cpp's IQ2_XXS files, which keep the small, always-read tensors at higher
/// precision: routed experts IQ2_XXS; attention, dense FFN, shared experts, token embedding
/// and output Q4_K (llama.cpp uses Q2_K/Q4_K/Q5_K there, which sluice has no quantizer for).
/// A 256-block type whose block does not divide the tensor's row (GLM-4.5-Air's expert
/// `ffn_down` rows of 1408, MLA's `attn_k_b` rows of 128) falls back to Q4_0, the 4.5-bit type
/// of 32-blocks sluice can write (llama.cpp falls back to IQ4_NL / Q5_0 there); then Q8_0, F32.
pub fn mix_type(bulk: DType, class: TensorClass, row: u64) -> DType {
    let want = match (bulk, class) {
        (_, TensorClass::Vector) => DType::F32,
        (DType::IQ2_XXS, TensorClass::RoutedExperts) => DType::IQ2_XXS,
        (DType::IQ2_XXS, _) => DType::Q4_K,
        // As OpenAI ships gpt-oss (and ggml-org's GGUFs keep it): experts MXFP4, the rest 8-bit.
        (DType::MXFP4, TensorClass::RoutedExperts) => DType::MXFP4,
        (DType::MXFP4, _) => DType::Q8_0,
        (t, _) => t,
    };
    let small = if want.block_elems().unwrap_or(1) >= 256 {
        DType::Q4_0
    } else {
        DType::Q8_0
    };
    [want, small, DType::Q8_0, DType::F32]
        .into_iter()
        .find(|t| {
            t.block_elems()
                .is_some_and(|b| row.is_multiple_of(b as u64))
        })
        .unwrap_or(DType::F32)
}

/// One tensor of the plan: name, type, shape (outermost first), how to fill it.
pub(super) struct Planned {
    pub(super) name: String,
    pub(super) dtype: DType,
    pub(super) shape: Vec<u64>,
    pub(super) init: Init,
}

/// Builds the tensor list, choosing each tensor's type from its class.
struct Plan<'a> {
    spec: &'a MoeSpec,
    list: Vec<Planned>,
    /// Vocabulary size (DeepSeek-V4's tid2eid has a row per token).
    vocab: usize,
}

fn fan(n: usize) -> f32 {
    1.7 / (n as f32).sqrt()
}

impl Plan<'_> {
    fn add(&mut self, name: String, class: TensorClass, shape: &[usize], init: Init) {
        let shape: Vec<u64> = shape.iter().map(|d| *d as u64).collect();
        let row = *shape.last().unwrap_or(&1);
        self.list.push(Planned {
            name,
            dtype: mix_type(self.spec.dtype, class, row),
            shape,
            init,
        });
    }

    /// A matrix of `rows x cols` (GGUF order) initialised for fan-in `cols`.
    fn mat(&mut self, name: String, class: TensorClass, rows: usize, cols: usize) {
        self.add(name, class, &[rows, cols], Init::Uniform(fan(cols)));
    }

    fn norm(&mut self, name: String, n: usize) {
        self.add(name, TensorClass::Vector, &[n], Init::Ones);
    }

    /// Router, selection bias (sigmoid families), routed experts. Softmax routers get logits
    /// of sd ~4 (a peaked softmax); sigmoid routers and gpt-oss's biased one sd ~1, so the scores are not saturated
    /// and the selection bias (`--skew`) steers selection as it does in a real checkpoint.
    fn moe(&mut self, l: usize, bias: bool) {
        let s = self.spec;
        let (h, e, f) = (s.hidden, s.experts, s.expert_ffn);
        let b = |n: &str| format!("blk.{l}.{n}");
        // gpt-oss's router has its own bias, which `--skew` sets as a logit offset: logits of
        // sd ~1 there too, so the offset steers selection as the sigmoid families' does.
        let biased = bias || matches!(s.arch, SynthArch::GptOss { .. });
        let router = if biased { fan(h) } else { 4.0 * fan(h) };
        self.add(
            b("ffn_gate_inp.weight"),
            TensorClass::Vector,
            &[e, h],
            Init::Uniform(router),
        );
        if bias {
            self.add(
                b("exp_probs_b.bias"),
                TensorClass::Vector,
                &[e],
                Init::Zeros,
            );
        }
        let x = TensorClass::RoutedExperts;
        self.add(
            b("ffn_gate_exps.weight"),
            x,
            &[e, f, h],
            Init::Uniform(fan(h)),
        );
        self.add(
            b("ffn_up_exps.weight"),
            x,
            &[e, f, h],
            Init::Uniform(fan(h)),
        );
        self.add(
            b("ffn_down_exps.weight"),
            x,
            &[e, h, f],
            Init::Uniform(fan(f)),
        );
    }

    /// Decoder layer `l`'s tensors in the family's order (dense FFN for the leading dense
    /// layers, MoE with shared experts after them).
    fn layer(&mut self, l: usize) {
        let spec = self.spec;
        let p = self;
        let (h, nh, hd) = (spec.hidden, spec.heads, spec.head_dim);
        let a = TensorClass::Attention;
        let b = |n: &str| format!("blk.{l}.{n}.weight");
        match &spec.arch {
            // Qwen3-MoE keeps the order (and so the bytes) of the first synth writer.
            SynthArch::Qwen3Moe => {
                let kvd = spec.kv_heads * hd;
                p.norm(b("attn_norm"), h);
                p.mat(b("attn_q"), a, nh * hd, h);
                p.mat(b("attn_k"), a, kvd, h);
                p.mat(b("attn_v"), a, kvd, h);
                p.mat(b("attn_output"), a, h, nh * hd);
                p.norm(b("attn_q_norm"), hd);
                p.norm(b("attn_k_norm"), hd);
                p.norm(b("ffn_norm"), h);
                p.moe(l, false);
            }
            SynthArch::Deepseek2 { mla, moe, .. } => {
                p.norm(b("attn_norm"), h);
                p.norm(b("attn_q_a_norm"), mla.q_lora);
                p.norm(b("attn_kv_a_norm"), mla.kv_lora);
                p.mat(b("attn_q_a"), a, mla.q_lora, h);
                p.mat(b("attn_q_b"), a, nh * (mla.nope + mla.rope), mla.q_lora);
                p.mat(b("attn_kv_a_mqa"), a, mla.kv_lora + mla.rope, h);
                // kv_b split per head as llama.cpp's converter writes it: k_b transposed
                // (ggml {nope, kv_lora, heads}), v_b (ggml {kv_lora, v_dim, heads}).
                let kv = Init::Uniform(fan(mla.kv_lora));
                p.add(b("attn_k_b"), a, &[nh, mla.kv_lora, mla.nope], kv);
                p.add(b("attn_v_b"), a, &[nh, mla.v_dim, mla.kv_lora], kv);
                p.mat(b("attn_output"), a, h, nh * mla.v_dim);
                p.norm(b("ffn_norm"), h);
                if l < moe.dense_layers {
                    p.mlp(l, "", TensorClass::DenseFfn, moe.dense_ffn);
                } else {
                    p.moe(l, true);
                    let sf = moe.shared_experts * spec.expert_ffn;
                    p.mlp(l, "_shexp", TensorClass::SharedExpert, sf);
                }
            }
            SynthArch::Glm4Moe { moe, qk_norm, .. } => {
                let kvd = spec.kv_heads * hd;
                p.norm(b("attn_norm"), h);
                p.mat(b("attn_q"), a, nh * hd, h);
                p.mat(b("attn_k"), a, kvd, h);
                p.mat(b("attn_v"), a, kvd, h);
                for (n, d) in [("attn_q", nh * hd), ("attn_k", kvd), ("attn_v", kvd)] {
                    let name = format!("blk.{l}.{n}.bias");
                    p.add(name, TensorClass::Vector, &[d], Init::Uniform(0.1));
                }
                p.mat(b("attn_output"), a, h, nh * hd);
                if *qk_norm {
                    p.norm(b("attn_q_norm"), hd);
                    p.norm(b("attn_k_norm"), hd);
                }
                p.norm(b("post_attention_norm"), h);
                if l < moe.dense_layers {
                    p.mlp(l, "", TensorClass::DenseFfn, moe.dense_ffn);
                } else {
                    p.moe(l, true);
                    let sf = moe.shared_experts * spec.expert_ffn;
                    p.mlp(l, "_shexp", TensorClass::SharedExpert, sf);
                }
            }
            SynthArch::Qwen3Next { .. } => p.qwen3next_layer(l),
            SynthArch::GptOss { .. } => p.gptoss_layer(l),
            SynthArch::DeepseekV4(_) => p.deepseek4_layer(l),
        }
    }

    /// DeepSeek-V4's layer `l` (llama.cpp's `deepseek4` names and shapes, as its
    /// src/models/deepseek4.cpp loads them and scripts/deepseek_v4_to_gguf.py writes them).
    fn deepseek4_layer(&mut self, l: usize) {
        let spec = self.spec;
        let SynthArch::DeepseekV4(v) = &spec.arch else {
            return;
        };
        let (h, nh, hd) = (spec.hidden, spec.heads, spec.head_dim);
        let (a, vec) = (TensorClass::Attention, TensorClass::Vector);
        let b = |n: &str| format!("blk.{l}.{n}.weight");
        let mix = (2 + v.hc) * v.hc;
        for hc in ["hc_attn", "hc_ffn"] {
            let fn_init = Init::Uniform(fan(v.hc * h));
            self.add(b(&format!("{hc}_fn")), vec, &[mix, v.hc * h], fn_init);
            self.add(b(&format!("{hc}_base")), vec, &[mix], Init::Zeros);
            self.add(b(&format!("{hc}_scale")), vec, &[3], Init::Ones);
        }
        self.norm(b("attn_norm"), h);
        self.add(b("attn_sinks"), vec, &[nh], Init::Uniform(1.0));
        self.mat(b("attn_q_a"), a, v.q_lora, h);
        self.norm(b("attn_q_a_norm"), v.q_lora);
        self.mat(b("attn_q_b"), a, nh * hd, v.q_lora);
        self.mat(b("attn_kv"), a, hd, h);
        self.norm(b("attn_kv_a_norm"), hd);
        // llama.cpp reads wo_a as ggml {heads * hd / groups, o_lora * groups}.
        self.mat(
            b("attn_output_a"),
            a,
            v.o_groups * v.o_lora,
            nh * hd / v.o_groups,
        );
        self.mat(b("attn_output_b"), a, h, v.o_groups * v.o_lora);
        let ratio = v.ratios.get(l).copied().unwrap_or(0);
        if ratio != 0 {
            let coff = if ratio == 4 { 2 } else { 1 };
            self.mat(b("attn_compressor_kv"), a, coff * hd, h);
            self.mat(b("attn_compressor_gate"), a, coff * hd, h);
            let ape = Init::Uniform(0.1);
            self.add(b("attn_compressor_ape"), vec, &[ratio, coff * hd], ape);
            self.norm(b("attn_compressor_norm"), hd);
            if ratio == 4 {
                self.mat(b("indexer.proj"), a, v.idx_heads, h);
                self.mat(b("indexer.attn_q_b"), a, v.idx_heads * v.idx_dim, v.q_lora);
                self.mat(b("indexer_compressor_kv"), a, 2 * v.idx_dim, h);
                self.mat(b("indexer_compressor_gate"), a, 2 * v.idx_dim, h);
                self.add(b("indexer_compressor_ape"), vec, &[4, 2 * v.idx_dim], ape);
                self.norm(b("indexer_compressor_norm"), v.idx_dim);
            }
        }
        self.norm(b("ffn_norm"), h);
        let hashed = l < v.hash_layers;
        self.moe(l, !hashed);
        if hashed {
            let (vocab, k, e) = (self.vocab, spec.experts_used, spec.experts);
            self.add(
                b("ffn_gate_tid2eid"),
                vec,
                &[vocab, k],
                Init::ExpertIds { experts: e },
            );
            if let Some(t) = self.list.last_mut() {
                t.dtype = DType::I32;
            }
        }
        self.mlp(l, "_shexp", TensorClass::SharedExpert, spec.expert_ffn);
    }

    /// Qwen3-Next's layer `l` (llama.cpp's `qwen3next` names, as scripts/qwen3next_to_gguf.py
    /// and its converter write them).
    fn qwen3next_layer(&mut self, l: usize) {
        let spec = self.spec;
        let SynthArch::Qwen3Next {
            linear: la,
            shared_ffn,
            interval,
            qwen35,
            ..
        } = spec.arch
        else {
            return;
        };
        let (h, nh, hd) = (spec.hidden, spec.heads, spec.head_dim);
        let (a, v) = (TensorClass::Attention, TensorClass::Vector);
        let b = |n: &str| format!("blk.{l}.{n}.weight");
        self.norm(b("attn_norm"), h);
        if (l + 1).is_multiple_of(interval.max(1)) {
            let kvd = spec.kv_heads * hd;
            self.mat(b("attn_q"), a, 2 * nh * hd, h);
            self.mat(b("attn_k"), a, kvd, h);
            self.mat(b("attn_v"), a, kvd, h);
            self.mat(b("attn_output"), a, h, nh * hd);
            self.norm(b("attn_q_norm"), hd);
            self.norm(b("attn_k_norm"), hd);
        } else {
            let (kd, vd) = (la.k_heads * la.k_dim, la.v_heads * la.v_dim);
            self.mat(b("attn_qkv"), a, 2 * kd + vd, h);
            self.mat(b("attn_gate"), a, vd, h);
            if qwen35 {
                self.mat(b("ssm_beta"), a, la.v_heads, h);
                self.mat(b("ssm_alpha"), a, la.v_heads, h);
            } else {
                self.mat(b("ssm_ba"), a, 2 * la.v_heads, h);
            }
            let conv = Init::Uniform(fan(la.conv));
            self.add(b("ssm_conv1d"), v, &[2 * kd + vd, la.conv], conv);
            self.add(
                format!("blk.{l}.ssm_a"),
                v,
                &[la.v_heads],
                Init::Const(-1.0),
            );
            let dt = Init::Uniform(0.5);
            self.add(format!("blk.{l}.ssm_dt.bias"), v, &[la.v_heads], dt);
            self.norm(b("ssm_norm"), la.v_dim);
            self.mat(b("ssm_out"), a, h, vd);
        }
        self.norm(b("post_attention_norm"), h);
        self.moe(l, false);
        self.add(b("ffn_gate_inp_shexp"), v, &[1, h], Init::Uniform(fan(h)));
        self.mlp(l, "_shexp", TensorClass::SharedExpert, shared_ffn);
    }

    /// gpt-oss's layer `l` (llama.cpp's `gpt-oss` names, as its converter and
    /// scripts/gptoss_to_gguf.py write them): biased attention with sinks, a biased router,
    /// experts with a bias per projection.
    fn gptoss_layer(&mut self, l: usize) {
        let spec = self.spec;
        let (h, nh, hd, kvd) = (
            spec.hidden,
            spec.heads,
            spec.head_dim,
            spec.kv_heads * spec.head_dim,
        );
        let (e, f) = (spec.experts, spec.expert_ffn);
        let (a, v) = (TensorClass::Attention, TensorClass::Vector);
        let w = |n: &str| format!("blk.{l}.{n}.weight");
        let bias = |n: &str| format!("blk.{l}.{n}.bias");
        let small = Init::Uniform(0.1);
        self.norm(w("attn_norm"), h);
        for (n, rows) in [("attn_q", nh * hd), ("attn_k", kvd), ("attn_v", kvd)] {
            self.mat(w(n), a, rows, h);
            self.add(bias(n), v, &[rows], small);
        }
        self.mat(w("attn_output"), a, h, nh * hd);
        self.add(bias("attn_output"), v, &[h], small);
        self.add(w("attn_sinks"), v, &[nh], Init::Uniform(1.0));
        self.norm(w("post_attention_norm"), h);
        self.moe(l, false);
        self.add(bias("ffn_gate_inp"), v, &[e], Init::Zeros);
        self.add(bias("ffn_gate_exps"), v, &[e, f], small);
        self.add(bias("ffn_up_exps"), v, &[e, f], small);
        self.add(bias("ffn_down_exps"), v, &[e, h], small);
    }

    /// A gate/up/down MLP of width `f` under `prefix` (`ffn` or `ffn_*_shexp` naming).
    fn mlp(&mut self, l: usize, suffix: &str, class: TensorClass, f: usize) {
        let h = self.spec.hidden;
        self.mat(format!("blk.{l}.ffn_gate{suffix}.weight"), class, f, h);
        self.mat(format!("blk.{l}.ffn_up{suffix}.weight"), class, f, h);
        self.mat(format!("blk.{l}.ffn_down{suffix}.weight"), class, h, f);
    }
}

/// The tensor list of `spec`, in file order, with the vocabulary size `vocab`.
pub(super) fn tensors(spec: &MoeSpec, vocab: usize) -> Vec<Planned> {
    let mut p = Plan {
        spec,
        list: Vec::new(),
        vocab,
    };
    let (h, a) = (spec.hidden, TensorClass::Attention);
    p.mat("token_embd.weight".into(), TensorClass::Embedding, vocab, h);
    if let Some(last) = p.list.last_mut() {
        last.init = Init::Uniform(1.0);
    }
    for l in 0..spec.layers {
        p.layer(l);
    }
    p.norm("output_norm.weight".into(), h);
    p.mat("output.weight".into(), TensorClass::Output, vocab, h);
    if let SynthArch::DeepseekV4(v) = &spec.arch {
        // The hyper-connection head that collapses the streams before the final norm.
        let vec = TensorClass::Vector;
        let fn_init = Init::Uniform(fan(v.hc * h));
        p.add(
            "output_hc_fn.weight".into(),
            vec,
            &[v.hc, v.hc * h],
            fn_init,
        );
        p.add("output_hc_base.weight".into(), vec, &[v.hc], Init::Zeros);
        p.add("output_hc_scale.weight".into(), vec, &[1], Init::Ones);
    }
    // The MTP (NextN) layers come last, so the main model's tensors (and their seeded bytes) are
    // the same with and without them. Each is a full MoE decoder layer at index `layers + i`
    // plus llama.cpp's `blk.N.nextn.*` extras; `nextn.embed_tokens` and
    // `nextn.shared_head_head`, optional in llama.cpp's loader, are not written: the head then
    // shares `token_embd` and `output` (as DeepSeek-V3's MTP module shares them with the main
    // model), which spares two vocabulary-sized matrices.
    for l in spec.layers..spec.layers + spec.mtp_layers {
        p.layer(l);
        // eh_proj is a projection read for every drafted token: typed like attention.
        p.mat(format!("blk.{l}.nextn.eh_proj.weight"), a, h, 2 * h);
        p.norm(format!("blk.{l}.nextn.enorm.weight"), h);
        p.norm(format!("blk.{l}.nextn.hnorm.weight"), h);
        p.norm(format!("blk.{l}.nextn.shared_head_norm.weight"), h);
    }
    p.list
}

/// The family's hyperparameter keys (llama.cpp's names, `{arch}.` prefixed).
pub(super) fn arch_meta(spec: &MoeSpec, vocab: usize) -> Vec<(String, MetaValue)> {
    let u = |v: usize| MetaValue::U32(v as u32);
    let f = MetaValue::F32;
    let mut kv: Vec<(&str, MetaValue)> = vec![
        ("context_length", u(spec.ctx)),
        ("embedding_length", u(spec.hidden)),
        ("block_count", u(spec.layers + spec.mtp_layers)),
    ];
    if spec.mtp_layers > 0 {
        kv.push(("nextn_predict_layers", u(spec.mtp_layers)));
    }
    match &spec.arch {
        SynthArch::Qwen3Moe => kv.extend([
            ("feed_forward_length", u(spec.expert_ffn)),
            ("expert_feed_forward_length", u(spec.expert_ffn)),
            ("attention.head_count", u(spec.heads)),
            ("attention.head_count_kv", u(spec.kv_heads)),
            ("attention.key_length", u(spec.head_dim)),
            ("attention.value_length", u(spec.head_dim)),
            ("rope.freq_base", f(1_000_000.0)),
            ("attention.layer_norm_rms_epsilon", f(1e-6)),
            ("expert_count", u(spec.experts)),
            ("expert_used_count", u(spec.experts_used)),
        ]),
        SynthArch::Deepseek2 { mla, moe, yarn } => {
            // MLA as llama.cpp's converter writes it: one latent "kv head" of kv_lora + rope
            // keys and kv_lora values; the per-head sizes under the `_mla` keys.
            kv.extend([
                ("vocab_size", u(vocab)),
                ("feed_forward_length", u(moe.dense_ffn)),
                ("attention.head_count", u(spec.heads)),
                ("attention.head_count_kv", u(1)),
                ("attention.key_length", u(mla.kv_lora + mla.rope)),
                ("attention.value_length", u(mla.kv_lora)),
                ("attention.key_length_mla", u(mla.nope + mla.rope)),
                ("attention.value_length_mla", u(mla.v_dim)),
                ("attention.q_lora_rank", u(mla.q_lora)),
                ("attention.kv_lora_rank", u(mla.kv_lora)),
                ("rope.dimension_count", u(mla.rope)),
                ("rope.freq_base", f(10_000.0)),
                ("attention.layer_norm_rms_epsilon", f(1e-6)),
            ]);
            if let Some(y) = yarn {
                kv.extend([
                    ("rope.scaling.type", MetaValue::String("yarn".into())),
                    ("rope.scaling.factor", f(y.factor)),
                    ("rope.scaling.original_context_length", u(y.orig_ctx)),
                    ("rope.scaling.yarn_beta_fast", f(y.beta_fast)),
                    ("rope.scaling.yarn_beta_slow", f(y.beta_slow)),
                    // The converter writes 0.1 * mscale_all_dim.
                    (
                        "rope.scaling.yarn_log_multiplier",
                        f(0.1 * y.mscale_all_dim),
                    ),
                ]);
            }
            sigmoid_moe_meta(&mut kv, spec, moe);
        }
        SynthArch::Glm4Moe {
            moe, rotary_dim, ..
        } => {
            kv.extend([
                ("feed_forward_length", u(moe.dense_ffn)),
                ("attention.head_count", u(spec.heads)),
                ("attention.head_count_kv", u(spec.kv_heads)),
                ("attention.key_length", u(spec.head_dim)),
                ("attention.value_length", u(spec.head_dim)),
                ("rope.dimension_count", u(*rotary_dim)),
                ("rope.freq_base", f(1_000_000.0)),
                ("attention.layer_norm_rms_epsilon", f(1e-5)),
            ]);
            sigmoid_moe_meta(&mut kv, spec, moe);
        }
        SynthArch::Qwen3Next {
            linear: la,
            shared_ffn,
            interval,
            rotary_dim,
            qwen35,
        } => {
            if *qwen35 {
                // MRoPE sections (Qwen3.5's [11, 11, 10] over 64 rotary dims, padded to 4):
                // llama.cpp requires the key; for text they rotate as plain RoPE.
                let pairs = rotary_dim / 2;
                let a = pairs.div_ceil(3);
                let sections = [a, a, pairs.saturating_sub(2 * a), 0];
                kv.push((
                    "rope.dimension_sections",
                    MetaValue::Array(sections.iter().map(|v| u(*v)).collect()),
                ));
                kv.push((
                    "attention.recurrent_layers",
                    MetaValue::Array(
                        (0..spec.layers)
                            .map(|l| MetaValue::Bool(!(l + 1).is_multiple_of((*interval).max(1))))
                            .collect(),
                    ),
                ));
            }
            kv.extend([
                ("feed_forward_length", u(spec.expert_ffn)),
                ("expert_feed_forward_length", u(spec.expert_ffn)),
                ("expert_shared_feed_forward_length", u(*shared_ffn)),
                ("attention.head_count", u(spec.heads)),
                ("attention.head_count_kv", u(spec.kv_heads)),
                ("attention.key_length", u(spec.head_dim)),
                ("attention.value_length", u(spec.head_dim)),
                ("rope.dimension_count", u(*rotary_dim)),
                ("rope.freq_base", f(10_000_000.0)),
                ("attention.layer_norm_rms_epsilon", f(1e-6)),
                ("expert_count", u(spec.experts)),
                ("expert_used_count", u(spec.experts_used)),
                ("expert_weights_norm", MetaValue::Bool(true)),
                ("ssm.conv_kernel", u(la.conv)),
                ("ssm.state_size", u(la.k_dim)),
                ("ssm.group_count", u(la.k_heads)),
                ("ssm.time_step_rank", u(la.v_heads)),
                ("ssm.inner_size", u(la.v_heads * la.v_dim)),
                ("full_attention_interval", u(*interval)),
            ]);
        }
        SynthArch::GptOss { window } => kv.extend([
            ("feed_forward_length", u(spec.expert_ffn)),
            ("expert_feed_forward_length", u(spec.expert_ffn)),
            ("attention.head_count", u(spec.heads)),
            ("attention.head_count_kv", u(spec.kv_heads)),
            ("attention.key_length", u(spec.head_dim)),
            ("attention.value_length", u(spec.head_dim)),
            ("rope.freq_base", f(150_000.0)),
            ("attention.layer_norm_rms_epsilon", f(1e-5)),
            ("expert_count", u(spec.experts)),
            ("expert_used_count", u(spec.experts_used)),
            ("rope.scaling.type", MetaValue::String("yarn".into())),
            ("rope.scaling.factor", f(32.0)),
            ("rope.scaling.original_context_length", u(4096)),
            ("attention.sliding_window", u(*window)),
        ]),
        SynthArch::DeepseekV4(v) => {
            let n = spec.layers + spec.mtp_layers;
            let ratios = (0..n)
                .map(|l| MetaValue::I32(v.ratios.get(l).copied().unwrap_or(0) as i32))
                .collect();
            let clamp = || MetaValue::Array(vec![f(v.swiglu_limit); n]);
            // DeepseekV4Model.set_gguf_parameters' keys (llama.cpp's converter), in its order.
            kv.extend([
                ("attention.head_count", u(spec.heads)),
                ("attention.head_count_kv", u(1)),
                ("rope.freq_base", f(10_000.0)),
                ("attention.layer_norm_rms_epsilon", f(1e-6)),
                ("expert_count", u(spec.experts)),
                ("expert_used_count", u(spec.experts_used)),
                // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS.
                ("expert_gating_func", u(4)),
                ("attention.key_length", u(spec.head_dim)),
                ("attention.value_length", u(spec.head_dim)),
                ("rope.scaling.type", MetaValue::String("yarn".into())),
                ("rope.scaling.factor", f(v.yarn.factor)),
                ("rope.scaling.original_context_length", u(v.yarn.orig_ctx)),
                ("rope.scaling.yarn_beta_fast", f(v.yarn.beta_fast)),
                ("rope.scaling.yarn_beta_slow", f(v.yarn.beta_slow)),
                ("rope.dimension_count", u(v.rope)),
                ("attention.q_lora_rank", u(v.q_lora)),
                ("attention.sliding_window", u(v.window)),
                ("expert_feed_forward_length", u(spec.expert_ffn)),
                ("expert_shared_count", u(1)),
                ("expert_weights_scale", f(v.routed_scale)),
                ("expert_weights_norm", MetaValue::Bool(true)),
                ("swiglu_clamp_exp", clamp()),
                ("swiglu_clamp_shexp", clamp()),
                ("attention.indexer.head_count", u(v.idx_heads)),
                ("attention.indexer.key_length", u(v.idx_dim)),
                ("attention.indexer.top_k", u(v.idx_topk)),
                ("attention.output_group_count", u(v.o_groups)),
                ("attention.output_lora_rank", u(v.o_lora)),
                ("attention.compress_ratios", MetaValue::Array(ratios)),
                ("attention.compress_rope_freq_base", f(160_000.0)),
                ("hyper_connection.count", u(v.hc)),
                ("hyper_connection.sinkhorn_iterations", u(20)),
                ("hyper_connection.epsilon", f(1e-6)),
                ("hash_layer_count", u(v.hash_layers)),
                ("embedding_length_out", u(v.hc * spec.hidden)),
            ]);
        }
    }
    let arch = spec.arch.gguf_name();
    kv.into_iter()
        .map(|(k, v)| (format!("{arch}.{k}"), v))
        .collect()
}

fn sigmoid_moe_meta(kv: &mut Vec<(&str, MetaValue)>, spec: &MoeSpec, moe: &super::SigmoidMoe) {
    let u = |v: usize| MetaValue::U32(v as u32);
    kv.extend([
        ("expert_count", u(spec.experts)),
        ("expert_used_count", u(spec.experts_used)),
        ("expert_shared_count", u(moe.shared_experts)),
        ("expert_feed_forward_length", u(spec.expert_ffn)),
        ("leading_dense_block_count", u(moe.dense_layers)),
        ("expert_weights_scale", MetaValue::F32(moe.routed_scale)),
        ("expert_weights_norm", MetaValue::Bool(true)),
        // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID.
        ("expert_gating_func", u(2)),
        ("expert_group_count", u(moe.n_group)),
        ("expert_group_used_count", u(moe.topk_group)),
    ]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iq2_xxs_mix_and_fallbacks() {
        use TensorClass::*;
        assert_eq!(
            mix_type(DType::IQ2_XXS, RoutedExperts, 7168),
            DType::IQ2_XXS
        );
        assert_eq!(mix_type(DType::IQ2_XXS, Attention, 7168), DType::Q4_K);
        assert_eq!(mix_type(DType::IQ2_XXS, Attention, 128), DType::Q4_0);
        assert_eq!(mix_type(DType::IQ2_XXS, RoutedExperts, 1408), DType::Q4_0);
        assert_eq!(mix_type(DType::Q8_0, Attention, 128), DType::Q8_0);
        assert_eq!(mix_type(DType::Q4_K, Embedding, 4096), DType::Q4_K);
        assert_eq!(mix_type(DType::Q8_0, Vector, 4096), DType::F32);
        assert_eq!(mix_type(DType::Q8_0, Attention, 48), DType::F32);
    }
}
