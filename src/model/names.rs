//! Tensor naming as data: which checkpoint tensor plays which role, per format and family.
//!
//! GGUF names are llama.cpp's (the same for every family we run). HF names differ per family
//! and per transformers version; each family file lists its candidates in preference order.

/// What a tensor is for, independent of how a checkpoint names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    TokenEmbd,
    OutputNorm,
    Output,
    AttnNorm,
    Wq,
    Wk,
    Wv,
    Wo,
    BiasQ,
    BiasK,
    BiasV,
    QNorm,
    KNorm,
    /// MLA: q down-projection, its norm, q up-projection.
    QA,
    QANorm,
    QB,
    /// MLA: joint kv down-projection (+ rope key), its norm, kv up-projection (HF, and old
    /// GGUFs), or the up-projection split per head into k (transposed) and v (new GGUFs).
    KVA,
    KVANorm,
    KVB,
    KB,
    VB,
    /// DeepSeek-V3.2 lightning indexer: query up-projection (from the q latent), key
    /// projection, the key's LayerNorm weight and bias, and the per-head weight projection.
    IdxQB,
    IdxK,
    IdxKNorm,
    IdxKNormBias,
    IdxProj,
    FfnNorm,
    Router,
    /// Selection bias of sigmoid routers (DeepSeek's `e_score_correction_bias`).
    ScoreBias,
    /// Per-expert gate (w1), up (w3) and down (w2) projections.
    ExpGate,
    ExpUp,
    ExpDown,
    /// Fused [n_expert, 2*ffn, hidden] gate+up (transformers 5 style).
    ExpGateUp,
    /// Shared experts (one MLP of n_shared * expert_ffn).
    ShGate,
    ShUp,
    ShDown,
    /// Dense FFN of the leading dense layers.
    DenseGate,
    DenseUp,
    DenseDown,
    /// Multi-token-prediction layer extras (DeepSeek-V3 / GLM-4.5 `nextn`).
    MtpEnorm,
    MtpHnorm,
    MtpEh,
    MtpHeadNorm,
    MtpHead,
    MtpEmbed,
}

/// llama.cpp's GGUF names for a role in layer `l` (`{l}` is substituted), in preference
/// order. Expert roles name the 3-D `[n_expert, rows, cols]` tensors.
pub fn gguf_names(role: Role) -> &'static [&'static str] {
    match role {
        Role::TokenEmbd => &["token_embd.weight"],
        Role::OutputNorm => &["output_norm.weight"],
        Role::Output => &["output.weight"],
        Role::AttnNorm => &["blk.{l}.attn_norm.weight"],
        Role::Wq => &["blk.{l}.attn_q.weight"],
        Role::Wk => &["blk.{l}.attn_k.weight"],
        Role::Wv => &["blk.{l}.attn_v.weight"],
        Role::Wo => &["blk.{l}.attn_output.weight"],
        Role::BiasQ => &["blk.{l}.attn_q.bias"],
        Role::BiasK => &["blk.{l}.attn_k.bias"],
        Role::BiasV => &["blk.{l}.attn_v.bias"],
        Role::QNorm => &["blk.{l}.attn_q_norm.weight"],
        Role::KNorm => &["blk.{l}.attn_k_norm.weight"],
        Role::QA => &["blk.{l}.attn_q_a.weight"],
        Role::QANorm => &["blk.{l}.attn_q_a_norm.weight"],
        Role::QB => &["blk.{l}.attn_q_b.weight"],
        Role::KVA => &["blk.{l}.attn_kv_a_mqa.weight"],
        Role::KVANorm => &["blk.{l}.attn_kv_a_norm.weight"],
        Role::KVB => &["blk.{l}.attn_kv_b.weight"],
        Role::KB => &["blk.{l}.attn_k_b.weight"],
        Role::VB => &["blk.{l}.attn_v_b.weight"],
        Role::IdxQB => &["blk.{l}.indexer.attn_q_b.weight"],
        Role::IdxK => &["blk.{l}.indexer.attn_k.weight"],
        Role::IdxKNorm => &["blk.{l}.indexer.k_norm.weight"],
        Role::IdxKNormBias => &["blk.{l}.indexer.k_norm.bias"],
        Role::IdxProj => &["blk.{l}.indexer.proj.weight"],
        Role::FfnNorm => &[
            "blk.{l}.ffn_norm.weight",
            "blk.{l}.post_attention_norm.weight",
        ],
        Role::Router => &["blk.{l}.ffn_gate_inp.weight"],
        Role::ScoreBias => &["blk.{l}.exp_probs_b.bias", "blk.{l}.exp_probs_b"],
        Role::ExpGate => &["blk.{l}.ffn_gate_exps.weight"],
        Role::ExpUp => &["blk.{l}.ffn_up_exps.weight"],
        Role::ExpDown => &["blk.{l}.ffn_down_exps.weight"],
        Role::ExpGateUp => &["blk.{l}.ffn_gate_up_exps.weight"],
        Role::ShGate => &["blk.{l}.ffn_gate_shexp.weight"],
        Role::ShUp => &["blk.{l}.ffn_up_shexp.weight"],
        Role::ShDown => &["blk.{l}.ffn_down_shexp.weight"],
        Role::DenseGate => &["blk.{l}.ffn_gate.weight"],
        Role::DenseUp => &["blk.{l}.ffn_up.weight"],
        Role::DenseDown => &["blk.{l}.ffn_down.weight"],
        Role::MtpEnorm => &["blk.{l}.nextn.enorm.weight"],
        Role::MtpHnorm => &["blk.{l}.nextn.hnorm.weight"],
        Role::MtpEh => &["blk.{l}.nextn.eh_proj.weight"],
        Role::MtpHeadNorm => &["blk.{l}.nextn.shared_head_norm.weight"],
        Role::MtpHead => &["blk.{l}.nextn.shared_head_head.weight"],
        Role::MtpEmbed => &["blk.{l}.nextn.embed_tokens.weight"],
    }
}

/// HF names shared by the Llama-derived families (everything but the routed experts and the
/// router, which the family files list), in preference order.
pub fn hf_common_names(role: Role) -> &'static [&'static str] {
    match role {
        Role::TokenEmbd => &["model.embed_tokens.weight"],
        Role::OutputNorm => &["model.norm.weight"],
        Role::Output => &["lm_head.weight"],
        Role::AttnNorm => &["model.layers.{l}.input_layernorm.weight"],
        Role::Wq => &["model.layers.{l}.self_attn.q_proj.weight"],
        Role::Wk => &["model.layers.{l}.self_attn.k_proj.weight"],
        Role::Wv => &["model.layers.{l}.self_attn.v_proj.weight"],
        Role::Wo => &["model.layers.{l}.self_attn.o_proj.weight"],
        Role::BiasQ => &["model.layers.{l}.self_attn.q_proj.bias"],
        Role::BiasK => &["model.layers.{l}.self_attn.k_proj.bias"],
        Role::BiasV => &["model.layers.{l}.self_attn.v_proj.bias"],
        Role::QNorm => &["model.layers.{l}.self_attn.q_norm.weight"],
        Role::KNorm => &["model.layers.{l}.self_attn.k_norm.weight"],
        Role::QA => &["model.layers.{l}.self_attn.q_a_proj.weight"],
        Role::QANorm => &["model.layers.{l}.self_attn.q_a_layernorm.weight"],
        Role::QB => &["model.layers.{l}.self_attn.q_b_proj.weight"],
        Role::KVA => &["model.layers.{l}.self_attn.kv_a_proj_with_mqa.weight"],
        Role::KVANorm => &["model.layers.{l}.self_attn.kv_a_layernorm.weight"],
        Role::KVB => &["model.layers.{l}.self_attn.kv_b_proj.weight"],
        Role::IdxQB => &["model.layers.{l}.self_attn.indexer.wq_b.weight"],
        Role::IdxK => &["model.layers.{l}.self_attn.indexer.wk.weight"],
        Role::IdxKNorm => &["model.layers.{l}.self_attn.indexer.k_norm.weight"],
        Role::IdxKNormBias => &["model.layers.{l}.self_attn.indexer.k_norm.bias"],
        Role::IdxProj => &["model.layers.{l}.self_attn.indexer.weights_proj.weight"],
        Role::FfnNorm => &["model.layers.{l}.post_attention_layernorm.weight"],
        Role::ScoreBias => &["model.layers.{l}.mlp.gate.e_score_correction_bias"],
        Role::ShGate => &[
            "model.layers.{l}.mlp.shared_experts.gate_proj.weight",
            "model.layers.{l}.mlp.shared_expert.gate_proj.weight",
        ],
        Role::ShUp => &[
            "model.layers.{l}.mlp.shared_experts.up_proj.weight",
            "model.layers.{l}.mlp.shared_expert.up_proj.weight",
        ],
        Role::ShDown => &[
            "model.layers.{l}.mlp.shared_experts.down_proj.weight",
            "model.layers.{l}.mlp.shared_expert.down_proj.weight",
        ],
        Role::DenseGate => &["model.layers.{l}.mlp.gate_proj.weight"],
        Role::DenseUp => &["model.layers.{l}.mlp.up_proj.weight"],
        Role::DenseDown => &["model.layers.{l}.mlp.down_proj.weight"],
        // DeepSeek-V3 / GLM-4.5's MTP layer, then Qwen3-Next / Qwen3.5's `mtp.*` module.
        Role::MtpEnorm => &[
            "model.layers.{l}.enorm.weight",
            "mtp.pre_fc_norm_embedding.weight",
        ],
        Role::MtpHnorm => &[
            "model.layers.{l}.hnorm.weight",
            "mtp.pre_fc_norm_hidden.weight",
        ],
        Role::MtpEh => &["model.layers.{l}.eh_proj.weight", "mtp.fc.weight"],
        Role::MtpHeadNorm => &[
            "model.layers.{l}.shared_head.norm.weight",
            "mtp.norm.weight",
        ],
        Role::MtpHead => &["model.layers.{l}.shared_head.head.weight"],
        Role::MtpEmbed => &["model.layers.{l}.embed_tokens.weight"],
        _ => &[],
    }
}

/// HF names of the MoE tensors of families that call the block `mlp` (Qwen3-MoE, OLMoE, and
/// Mixtral as transformers 5 writes it). `{e}` is the expert index.
pub const HF_MLP_MOE: &[(Role, &str)] = &[
    (Role::Router, "model.layers.{l}.mlp.gate.weight"),
    (
        Role::ExpGate,
        "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
    ),
    (
        Role::ExpUp,
        "model.layers.{l}.mlp.experts.{e}.up_proj.weight",
    ),
    (
        Role::ExpDown,
        "model.layers.{l}.mlp.experts.{e}.down_proj.weight",
    ),
    (Role::ExpGateUp, "model.layers.{l}.mlp.experts.gate_up_proj"),
    (Role::ExpDown, "model.layers.{l}.mlp.experts.down_proj"),
];

/// Fill `{l}` and `{e}` in a name pattern.
pub fn fill(pattern: &str, layer: usize, expert: usize) -> String {
    pattern
        .replace("{l}", &layer.to_string())
        .replace("{e}", &expert.to_string())
}
