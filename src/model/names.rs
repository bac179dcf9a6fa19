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
    QNorm,
    KNorm,
    FfnNorm,
    Router,
    /// Per-expert gate (w1), up (w3) and down (w2) projections.
    ExpGate,
    ExpUp,
    ExpDown,
    /// Fused [n_expert, 2*ffn, hidden] gate+up (transformers 5 style).
    ExpGateUp,
}

/// llama.cpp's GGUF name for a role in layer `l` (`{l}` is substituted). Expert roles name the
/// 3-D `[n_expert, rows, cols]` tensors.
pub fn gguf_name(role: Role) -> &'static str {
    match role {
        Role::TokenEmbd => "token_embd.weight",
        Role::OutputNorm => "output_norm.weight",
        Role::Output => "output.weight",
        Role::AttnNorm => "blk.{l}.attn_norm.weight",
        Role::Wq => "blk.{l}.attn_q.weight",
        Role::Wk => "blk.{l}.attn_k.weight",
        Role::Wv => "blk.{l}.attn_v.weight",
        Role::Wo => "blk.{l}.attn_output.weight",
        Role::QNorm => "blk.{l}.attn_q_norm.weight",
        Role::KNorm => "blk.{l}.attn_k_norm.weight",
        Role::FfnNorm => "blk.{l}.ffn_norm.weight",
        Role::Router => "blk.{l}.ffn_gate_inp.weight",
        Role::ExpGate => "blk.{l}.ffn_gate_exps.weight",
        Role::ExpUp => "blk.{l}.ffn_up_exps.weight",
        Role::ExpDown => "blk.{l}.ffn_down_exps.weight",
        Role::ExpGateUp => "blk.{l}.ffn_gate_up_exps.weight",
    }
}

/// HF names shared by the Llama-derived families (embeddings, attention, norms).
pub fn hf_common_name(role: Role) -> Option<&'static str> {
    Some(match role {
        Role::TokenEmbd => "model.embed_tokens.weight",
        Role::OutputNorm => "model.norm.weight",
        Role::Output => "lm_head.weight",
        Role::AttnNorm => "model.layers.{l}.input_layernorm.weight",
        Role::Wq => "model.layers.{l}.self_attn.q_proj.weight",
        Role::Wk => "model.layers.{l}.self_attn.k_proj.weight",
        Role::Wv => "model.layers.{l}.self_attn.v_proj.weight",
        Role::Wo => "model.layers.{l}.self_attn.o_proj.weight",
        Role::QNorm => "model.layers.{l}.self_attn.q_norm.weight",
        Role::KNorm => "model.layers.{l}.self_attn.k_norm.weight",
        Role::FfnNorm => "model.layers.{l}.post_attention_layernorm.weight",
        _ => return None,
    })
}

/// HF names of the MoE tensors of families that call the block `mlp` (Qwen3-MoE, OLMoE, and
/// Mixtral as transformers 5 writes it). `{e}` is the expert index.
pub const HF_MLP_MOE: &[(Role, &str)] = &[
    (Role::Router, "model.layers.{l}.mlp.gate.weight"),
    (Role::ExpGate, "model.layers.{l}.mlp.experts.{e}.gate_proj.weight"),
    (Role::ExpUp, "model.layers.{l}.mlp.experts.{e}.up_proj.weight"),
    (Role::ExpDown, "model.layers.{l}.mlp.experts.{e}.down_proj.weight"),
    (Role::ExpGateUp, "model.layers.{l}.mlp.experts.gate_up_proj"),
    (Role::ExpDown, "model.layers.{l}.mlp.experts.down_proj"),
];

/// Fill `{l}` and `{e}` in a name pattern.
pub fn fill(pattern: &str, layer: usize, expert: usize) -> String {
    pattern.replace("{l}", &layer.to_string()).replace("{e}", &expert.to_string())
}
