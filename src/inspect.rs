//! What a model is and what it costs: architecture, expert counts, tensor types, and the bytes
//! that must stay resident versus the bytes of routed experts that can be streamed.
//!
//! Owns: `ModelSummary` and the naming rules that tell a routed-expert tensor from a resident
//! one, for GGUF (llama.cpp names) and HF checkpoints (per-expert, Mixtral and fused layouts).
//! Does not own: printing (cli/inspect.rs), parsing files (format/).
//! Invariant: resident_bytes + routed_expert_bytes == total_bytes; a tensor is routed exactly
//! when `routed_expert_tensor` says so, and the streaming code can use the same function.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::format::{FileKind, ModelFiles, TensorInfo};

/// A routed-expert tensor, as recognised from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoutedTensor {
    /// The transformer layer (block) it belongs to.
    pub layer: u64,
    /// `Some(e)`: a tensor of expert `e` alone (HF `...experts.E.gate_proj.weight`).
    /// `None`: a fused tensor of every expert, expert = outermost dimension (GGUF
    /// `blk.N.ffn_gate_exps.weight`, HF `...mlp.experts.gate_up_proj`).
    pub expert: Option<u64>,
}

/// Recognise a routed-expert tensor by name:
/// - GGUF: `blk.N.ffn_{gate,up,down,gate_up}_exps.{weight,bias,...}`
/// - HF per-expert: `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight` (+ `weight_scale_inv`),
///   Mixtral `model.layers.N.block_sparse_moe.experts.E.{w1,w2,w3}.weight`
/// - HF fused (transformers 5, Llama 4): `model.layers.N.{mlp,feed_forward}.experts.{gate_up_proj,down_proj}`
///
/// Shared experts (`ffn_*_shexp`, `mlp.shared_experts.`, `mlp.shared_expert.`) are resident.
pub fn routed_expert_tensor(name: &str) -> Option<RoutedTensor> {
    let parts: Vec<&str> = name.split('.').collect();
    if let ["blk", n, ffn, ..] = parts[..] {
        if ffn.starts_with("ffn_") && ffn.ends_with("_exps") {
            return Some(RoutedTensor {
                layer: n.parse().ok()?,
                expert: None,
            });
        }
        return None;
    }
    let li = parts.iter().position(|p| *p == "layers")?;
    let layer: u64 = parts.get(li + 1)?.parse().ok()?;
    let rest = &parts[li + 2..];
    let ei = rest.iter().position(|p| *p == "experts")?;
    let next = rest.get(ei + 1)?;
    if next.bytes().all(|b| b.is_ascii_digit()) {
        Some(RoutedTensor {
            layer,
            expert: Some(next.parse().ok()?),
        })
    } else {
        Some(RoutedTensor {
            layer,
            expert: None,
        })
    }
}

/// Tensors of one element type.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct QuantTypeCount {
    pub dtype: String,
    pub tensors: usize,
    pub bytes: u64,
    /// Of `bytes`, those of tensors that stay resident (everything but routed experts).
    pub resident_bytes: u64,
    /// Of `bytes`, those of routed-expert tensors (streamed).
    pub routed_bytes: u64,
    /// Whether sluice has CPU kernels for this type (a model using it loads).
    pub kernels: bool,
}

/// A model's summary, as `sluice inspect` prints it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ModelSummary {
    pub path: String,
    /// "gguf" or "safetensors".
    pub format: String,
    pub files: usize,
    pub architecture: Option<String>,
    /// Transformer layers (GGUF `{arch}.block_count`, config `num_hidden_layers`).
    pub layers: Option<u64>,
    /// Layers (below `layers`) that hold routed experts.
    pub moe_layers: u64,
    pub experts_per_layer: Option<u64>,
    pub experts_used_per_token: Option<u64>,
    pub shared_experts: u64,
    pub tensors: usize,
    /// By bytes, largest first.
    pub quant_types: Vec<QuantTypeCount>,
    pub total_bytes: u64,
    /// Everything but routed experts: what must stay in memory.
    pub resident_bytes: u64,
    /// All routed-expert tensors.
    pub routed_expert_bytes: u64,
    /// gate + up + down (and their scales) of one expert in one layer (largest layer).
    pub one_expert_bytes_per_layer: u64,
    /// experts used per token x one expert's bytes, summed over the MoE layers.
    pub routed_bytes_per_token: u64,
    /// KV-cache bytes per token of context over the main layers, as sluice allocates it with
    /// the default cache types (`kv_cache_types`; `ModelConfig::kv_bytes_per_token`): MLA caches the compressed latent and the rope
    /// key per layer, GQA keys and values. `None` when sluice cannot read the model's config.
    pub kv_bytes_per_token: Option<u64>,
    /// The cache's element types those bytes are counted in: the CPU default (`-ctk f16
    /// -ctv f16`, as llama.cpp), or f32 where the model's caches stay f32 (MLA, DeepSeek-V4).
    pub kv_cache_types: Option<String>,
    /// Multi-token-prediction (NextN) layers in the checkpoint (not counted in `layers`).
    pub mtp_layers: u64,
    /// KV-cache bytes per token the MTP layer adds, allocated only with `--mtp K > 0`.
    pub mtp_kv_bytes_per_token: Option<u64>,
    /// Recurrent state bytes per sequence, whatever its length (Qwen3-Next's Gated DeltaNet
    /// layers: conv inputs + delta-rule state, f32); `None` for models without one.
    pub recurrent_state_bytes: Option<u64>,
}

/// A number from GGUF metadata or config.json (also looked up in config's `text_config`).
fn number(m: &ModelFiles, gguf_key: Option<&str>, config_keys: &[&str]) -> Option<u64> {
    if let Some(k) = gguf_key {
        if let Some(v) = m.meta(k).and_then(|v| v.as_u64()) {
            return Some(v);
        }
    }
    let cfg = m.config()?;
    for scope in [Some(cfg), cfg.get("text_config")].into_iter().flatten() {
        for k in config_keys {
            if let Some(v) = scope.get(*k).and_then(|v| v.as_u64()) {
                return Some(v);
            }
        }
    }
    None
}

#[derive(Default)]
struct LayerExperts {
    /// Bytes of one expert, summed over fused tensors.
    fused_per_expert: u64,
    fused_experts: u64,
    /// Bytes of per-expert tensors, and which experts they belong to.
    per_expert_total: u64,
    experts: BTreeSet<u64>,
}

impl LayerExperts {
    fn one_expert(&self) -> u64 {
        let n = self.experts.len() as u64;
        self.fused_per_expert + self.per_expert_total.checked_div(n).unwrap_or(0)
    }
}

/// Summarise an opened model.
pub fn summarize(m: &ModelFiles) -> ModelSummary {
    let arch = match m.kind() {
        FileKind::Gguf => m
            .meta("general.architecture")
            .and_then(|v| v.as_str())
            .map(str::to_string),
        FileKind::Safetensors => m.config().and_then(|c| {
            c.get("architectures")
                .and_then(|a| a.get(0))
                .and_then(|a| a.as_str())
                .or_else(|| c.get("model_type").and_then(|t| t.as_str()))
                .map(str::to_string)
        }),
    };
    let a = arch.clone().unwrap_or_default();
    let key = |suffix: &str| {
        if m.kind() == FileKind::Gguf {
            Some(format!("{a}.{suffix}"))
        } else {
            None
        }
    };

    // name -> (tensors, bytes, routed bytes, has kernels)
    let mut types: BTreeMap<String, (usize, u64, u64, bool)> = BTreeMap::new();
    let mut layers: BTreeMap<u64, LayerExperts> = BTreeMap::new();
    let (mut total, mut routed) = (0u64, 0u64);
    let mut max_layer = None;
    let mut has_shexp = false;
    for t in m.tensors() {
        let e = types.entry(m.dtype_name(t)).or_default();
        e.0 += 1;
        e.1 += t.range.len;
        e.3 = crate::kernels::kernels_for(t.dtype).is_ok();
        if routed_expert_tensor(&t.name).is_some() {
            e.2 += t.range.len;
        }
        total += t.range.len;
        if t.name.contains("_shexp") || t.name.contains(".shared_expert") {
            has_shexp = true;
        }
        if let Some(l) = layer_of(t) {
            max_layer = max_layer.max(Some(l));
        }
        let Some(r) = routed_expert_tensor(&t.name) else {
            continue;
        };
        routed += t.range.len;
        let acc = layers.entry(r.layer).or_default();
        match r.expert {
            Some(e) => {
                acc.per_expert_total += t.range.len;
                acc.experts.insert(e);
            }
            None => {
                let n = t.shape.first().copied().unwrap_or(1).max(1);
                acc.fused_per_expert += t.range.len / n;
                acc.fused_experts = acc.fused_experts.max(n);
            }
        }
    }

    // GGUF's block_count counts the MTP (NextN) layers after the main ones; config.json's
    // num_hidden_layers does not.
    let mtp_layers = number(
        m,
        key("nextn_predict_layers").as_deref(),
        &["num_nextn_predict_layers"],
    )
    .unwrap_or(0);
    let n_layers = number(
        m,
        key("block_count").as_deref(),
        &["num_hidden_layers", "n_layer", "num_layers"],
    )
    .map(|n| match m.kind() {
        FileKind::Gguf => n.saturating_sub(mtp_layers),
        FileKind::Safetensors => n,
    })
    .or(max_layer.map(|l| l + 1));
    let cfg = crate::model::config::ModelConfig::from_files(m).ok();
    let kv_types = |c: &crate::model::ModelConfig| {
        c.kv_types(crate::model::KvTypes::default())
            .map_or(crate::model::KvTypes::F32, |(t, _)| t)
    };
    let kv = |mtp: bool| {
        cfg.as_ref()
            .map(|c| c.kv_bytes_per_token(mtp, kv_types(c)) as u64)
    };
    let counted: Vec<&LayerExperts> = layers
        .iter()
        .filter(|(l, _)| n_layers.is_none_or(|n| **l < n))
        .map(|(_, e)| e)
        .collect();
    let experts = number(
        m,
        key("expert_count").as_deref(),
        &["num_experts", "n_routed_experts", "num_local_experts"],
    )
    .or_else(|| {
        layers
            .values()
            .map(|e| e.fused_experts.max(e.experts.len() as u64))
            .max()
    });
    let used = number(
        m,
        key("expert_used_count").as_deref(),
        &["num_experts_per_tok", "num_experts_per_token"],
    );
    let shared = number(
        m,
        key("expert_shared_count").as_deref(),
        &["n_shared_experts", "num_shared_experts"],
    )
    .or_else(|| number(m, None, &["shared_expert_intermediate_size"]).map(|s| u64::from(s > 0)))
    .unwrap_or(u64::from(has_shexp));
    let one = counted.iter().map(|e| e.one_expert()).max().unwrap_or(0);
    let per_token = used.unwrap_or(0) * counted.iter().map(|e| e.one_expert()).sum::<u64>();

    let mut quant_types: Vec<QuantTypeCount> = types
        .into_iter()
        .map(
            |(dtype, (tensors, bytes, routed, kernels))| QuantTypeCount {
                dtype,
                tensors,
                bytes,
                resident_bytes: bytes - routed,
                routed_bytes: routed,
                kernels,
            },
        )
        .collect();
    quant_types.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.dtype.cmp(&b.dtype)));

    let shown = match m.kind() {
        FileKind::Gguf => m
            .paths()
            .first()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        FileKind::Safetensors => m.dir().display().to_string(),
    };
    ModelSummary {
        path: shown,
        format: match m.kind() {
            FileKind::Gguf => "gguf",
            FileKind::Safetensors => "safetensors",
        }
        .to_string(),
        files: m.paths().len(),
        architecture: arch,
        layers: n_layers,
        moe_layers: counted.len() as u64,
        experts_per_layer: experts,
        experts_used_per_token: used,
        shared_experts: shared,
        tensors: m.tensors().len(),
        quant_types,
        total_bytes: total,
        resident_bytes: total - routed,
        routed_expert_bytes: routed,
        one_expert_bytes_per_layer: one,
        routed_bytes_per_token: per_token,
        kv_bytes_per_token: kv(false),
        kv_cache_types: cfg.as_ref().map(|c| {
            let t = kv_types(c);
            match c.cache_dims().1 {
                0 => format!("keys {}, values none", t.k),
                _ => format!("keys {}, values {}", t.k, t.v),
            }
        }),
        mtp_layers,
        mtp_kv_bytes_per_token: kv(true)
            .zip(kv(false))
            .map(|(a, b)| a - b)
            .filter(|_| mtp_layers > 0),
        recurrent_state_bytes: cfg
            .as_ref()
            .and_then(|c| c.hybrid.as_ref())
            .map(|h| h.state_bytes() as u64),
    }
}

/// The layer index in a GGUF (`blk.N.`) or HF (`.layers.N.`) tensor name.
fn layer_of(t: &TensorInfo) -> Option<u64> {
    let mut parts = t.name.split('.');
    while let Some(p) = parts.next() {
        if p == "blk" || p == "layers" {
            return parts.next()?.parse().ok();
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routed_names() {
        let r = |l, e| {
            Some(RoutedTensor {
                layer: l,
                expert: e,
            })
        };
        assert_eq!(
            routed_expert_tensor("blk.3.ffn_gate_exps.weight"),
            r(3, None)
        );
        assert_eq!(
            routed_expert_tensor("blk.0.ffn_gate_up_exps.weight"),
            r(0, None)
        );
        assert_eq!(routed_expert_tensor("blk.0.ffn_down_exps.bias"), r(0, None));
        assert_eq!(routed_expert_tensor("blk.0.ffn_gate_shexp.weight"), None);
        assert_eq!(routed_expert_tensor("blk.0.ffn_gate_inp.weight"), None);
        assert_eq!(
            routed_expert_tensor("model.layers.7.mlp.experts.12.up_proj.weight"),
            r(7, Some(12))
        );
        assert_eq!(
            routed_expert_tensor("model.layers.7.mlp.experts.12.up_proj.weight_scale_inv"),
            r(7, Some(12))
        );
        assert_eq!(
            routed_expert_tensor("model.layers.1.block_sparse_moe.experts.5.w2.weight"),
            r(1, Some(5))
        );
        assert_eq!(
            routed_expert_tensor("model.layers.2.mlp.experts.gate_up_proj"),
            r(2, None)
        );
        assert_eq!(
            routed_expert_tensor("language_model.model.layers.2.feed_forward.experts.down_proj"),
            r(2, None)
        );
        assert_eq!(
            routed_expert_tensor("model.layers.2.mlp.shared_experts.up_proj.weight"),
            None
        );
        assert_eq!(
            routed_expert_tensor("model.layers.2.mlp.shared_expert.up_proj.weight"),
            None
        );
        assert_eq!(routed_expert_tensor("model.layers.2.mlp.gate.weight"), None);
        assert_eq!(routed_expert_tensor("model.embed_tokens.weight"), None);
    }
}
