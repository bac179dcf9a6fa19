//! The architecture families as data: what the shared readers (`config.rs`, `weights.rs`) ask
//! a family instead of matching on it. Each family file (`qwen3moe.rs`, `mixtral.rs`,
//! `olmoe.rs`, `deepseek2.rs`, `glm4moe.rs`, `gptoss.rs`) holds one `FamilySpec`: its names in GGUF and HF
//! configs, its HF tensor names, its rope layout, router kind and defaults, the attention
//! features it reads, and hooks for hyperparameters only it has (DeepSeek's MLA and indexer).
//!
//! Adding a family: its own file with a `SPEC`, a `Family` variant and one line in `FAMILIES`.
//! Owns: `FamilySpec`, the registry, the two small metadata accessors the hooks read through.
//! Does not own: the shared reading of common keys (config.rs), the forward graph.
//! Invariant: every registered family answers every question; lookups never fall through to a
//! default family.

use super::config::{Family, ModelConfig, QkNorm, RopeLayout};
use super::names::Role;
use super::ModelError;
use crate::format::{MetaValue, ModelFiles};
use serde_json::Value;

/// What an HF config's `attention_bias` means for a family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BiasRule {
    /// The family's transformers model never reads it.
    Ignored,
    /// It would add biases sluice does not run: `true` is refused by name.
    Refused,
    /// q/k/v carry biases when it is true (GLM).
    Read,
}

/// One family's answers (see the module doc).
pub struct FamilySpec {
    pub family: Family,
    /// The name in messages (llama.cpp's architecture name).
    pub name: &'static str,
    /// GGUF `general.architecture` values (Mixtral: `llama` with experts).
    pub gguf_archs: &'static [&'static str],
    /// HF `architectures[0]` / `model_type` values.
    pub hf_archs: &'static [&'static str],
    /// HF names of the MoE block, in preference order (names.rs has the shared ones).
    pub hf_moe: &'static [(Role, &'static str)],
    /// Rope pairing of GGUF files (llama.cpp's converter permutes some families' q/k).
    pub gguf_rope_layout: RopeLayout,
    /// Sigmoid scores with group-limited top-k, a selection bias and a routed scale
    /// (DeepSeek style), instead of softmax top-k.
    pub sigmoid_router: bool,
    /// `norm_topk_prob` when a GGUF file has no `expert_weights_norm`: llama.cpp's graphs
    /// renormalise always for qwen3moe and Mixtral, never for olmoe, and for
    /// deepseek2/deepseek32/glm4moe only when the key says so (their loaders read a missing key
    /// as false; the converter omits it when the checkpoint's `norm_topk_prob` is false).
    pub gguf_norm_topk: bool,
    /// `norm_topk_prob` fixed by the family's HF model whatever the config says (Mixtral).
    pub hf_norm_topk: Option<bool>,
    /// The HF key of one routed expert's intermediate size.
    pub hf_expert_ffn_key: &'static str,
    /// rope_theta when an HF config has none (transformers' default for the family).
    pub hf_default_rope_theta: f64,
    pub hf_attention_bias: BiasRule,
    /// OLMoE's clip_qkv (refused by name for the others).
    pub clip_qkv: bool,
    /// llama.cpp's graph cancels YaRN's cos/sin magnitude (DeepSeek: mscale == mscale_all_dim),
    /// and the YaRN keys other families refuse are read by the hook.
    pub gguf_yarn_cancelled: bool,
    /// The q/k norm of an HF model (GGUF files tell by their tensors).
    pub hf_qk_norm: fn(&HfKeys<'_>) -> QkNorm,
    /// The sliding window an HF config sets, read where the family's model reads it.
    pub hf_sliding_window: fn(&HfKeys<'_>) -> Result<Option<usize>, ModelError>,
    /// A GGUF `attention.sliding_window_pattern` (a per-layer window) is the family's own,
    /// read by its hook (gpt-oss); refused for the others.
    pub gguf_window_pattern: bool,
    /// Why the family's routed experts cannot be read from an HF checkpoint (the tensors named
    /// in the refusal), if they cannot: such a checkpoint is refused at load, naming the layer.
    pub hf_experts_refused: Option<&'static str>,
    /// The family's graph has run on the GPU against transformers (tests/gpu.rs); without it
    /// the CUDA backend refuses the family by name (`gpu::refusal`) rather than run it
    /// unchecked.
    pub gpu_validated: bool,
    /// Family-only hyperparameters of a GGUF file, applied to the shared reading.
    pub gguf_hparams: fn(&GgufKeys<'_>, &mut ModelConfig) -> Result<(), ModelError>,
    /// Family-only hyperparameters of an HF config, applied to the shared reading.
    pub hf_hparams: fn(&HfKeys<'_>, &mut ModelConfig) -> Result<(), ModelError>,
}

/// Every family sluice runs: the one registration a new family adds (besides `Family`).
pub static FAMILIES: &[&FamilySpec] = &[
    &super::qwen3moe::SPEC,
    &super::mixtral::SPEC,
    &super::olmoe::SPEC,
    &super::deepseek2::SPEC,
    &super::glm4moe::SPEC,
    &super::gptoss::SPEC,
    &super::deepseek_v4::SPEC,
    &super::glmdsa::SPEC,
    &super::qwen3next::SPEC,
    &super::qwen3next::SPEC35,
];

impl Family {
    /// This family's answers.
    pub fn spec(self) -> &'static FamilySpec {
        FAMILIES
            .iter()
            .find(|s| s.family == self)
            .copied()
            .unwrap_or_else(|| unreachable!("family {self:?} is not in FAMILIES"))
    }

    pub fn name(self) -> &'static str {
        self.spec().name
    }
}

/// 2026 families sluice recognises but does not run yet, by HF architecture / model_type or
/// GGUF architecture, with what is missing: they are refused by name, not as unknown.
fn not_yet_supported(arch: &str) -> Option<String> {
    let (name, missing) = match arch {
        "Qwen3_5MoeForConditionalGeneration" | "qwen3_5_moe" => (
            "Qwen3.5-MoE (the multimodal checkpoint)",
            "only the text model is supported (Qwen3_5MoeForCausalLM with its text config)",
        ),
        _ => return None,
    };
    Some(format!("{arch}: {name} is not supported yet: {missing}"))
}

/// The family of a GGUF `general.architecture` (`llama` needs experts: Mixtral).
pub fn by_gguf_arch(arch: &str, n_experts: usize) -> Result<&'static FamilySpec, ModelError> {
    if let Some(m) = not_yet_supported(arch) {
        return Err(ModelError::Config(format!("GGUF architecture {m}")));
    }
    if arch == "llama" && n_experts == 0 {
        return Err(ModelError::Config(
            "GGUF architecture llama without experts (dense models are not supported)".into(),
        ));
    }
    FAMILIES
        .iter()
        .find(|s| s.gguf_archs.contains(&arch))
        .copied()
        .ok_or_else(|| {
            let all: Vec<&str> = FAMILIES
                .iter()
                .flat_map(|s| s.gguf_archs)
                .copied()
                .collect();
            ModelError::Config(format!(
                "unknown architecture {arch:?} (supported: {}; llama means Mixtral, with experts)",
                all.join(", ")
            ))
        })
}

/// The family of an HF `architectures[0]` or `model_type`.
pub fn by_hf_arch(arch: &str) -> Result<&'static FamilySpec, ModelError> {
    if let Some(m) = not_yet_supported(arch) {
        return Err(ModelError::Config(format!("config.json: architecture {m}")));
    }
    FAMILIES
        .iter()
        .find(|s| s.hf_archs.contains(&arch))
        .copied()
        .ok_or_else(|| {
            let all: Vec<&str> = FAMILIES
                .iter()
                .filter_map(|s| s.hf_archs.first())
                .copied()
                .collect();
            ModelError::Config(format!(
                "config.json: unknown architecture {arch:?} (supported: {})",
                all.join(", ")
            ))
        })
}

/// GGUF metadata of one architecture, read by key suffix (`{arch}.` is prefixed).
pub struct GgufKeys<'f> {
    pub files: &'f ModelFiles,
    pub arch: &'f str,
}

impl GgufKeys<'_> {
    /// The full key name.
    pub fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    pub fn get(&self, k: &str) -> Option<&MetaValue> {
        self.files.meta(&self.key(k))
    }

    pub fn opt_u(&self, k: &str) -> Option<usize> {
        self.get(k).and_then(MetaValue::as_u64).map(|v| v as usize)
    }

    pub fn opt_f(&self, k: &str) -> Option<f64> {
        self.get(k).and_then(MetaValue::as_f64)
    }

    pub fn req_u(&self, k: &str) -> Result<usize, ModelError> {
        self.opt_u(k).ok_or_else(|| {
            ModelError::Config(format!(
                "GGUF metadata {} is missing or not an integer",
                self.key(k)
            ))
        })
    }

    /// Length of axis `axis` of tensor `name`, if the file has it.
    pub fn dim_of(&self, name: &str, axis: usize) -> Option<usize> {
        self.files
            .tensor(name)
            .and_then(|t| t.shape.get(axis).copied())
            .map(|v| v as usize)
    }
}

/// An HF `config.json`, with transformers 5's `rope_parameters` (or the older
/// `rope_scaling`) dictionary.
pub struct HfKeys<'v> {
    pub cfg: &'v Value,
}

impl HfKeys<'_> {
    pub fn opt_u(&self, k: &str) -> Option<usize> {
        self.cfg.get(k).and_then(Value::as_u64).map(|v| v as usize)
    }

    pub fn opt_f(&self, k: &str) -> Option<f64> {
        self.cfg.get(k).and_then(Value::as_f64)
    }

    pub fn req_u(&self, k: &str) -> Result<usize, ModelError> {
        self.opt_u(k).ok_or_else(|| {
            ModelError::Config(format!("config.json: {k} is missing or not an integer"))
        })
    }

    /// A boolean, false when absent.
    pub fn flag(&self, k: &str) -> bool {
        self.cfg.get(k).and_then(Value::as_bool).unwrap_or(false)
    }

    /// A boolean with a default.
    pub fn bool_or(&self, k: &str, default: bool) -> bool {
        self.cfg.get(k).and_then(Value::as_bool).unwrap_or(default)
    }

    /// The rope dictionary, if any.
    pub fn rope(&self) -> Option<&Value> {
        self.cfg
            .get("rope_parameters")
            .or_else(|| self.cfg.get("rope_scaling"))
            .filter(|v| v.is_object())
    }

    /// A number of the rope dictionary.
    pub fn rget(&self, k: &str) -> Option<f64> {
        self.rope().and_then(|r| r.get(k)).and_then(Value::as_f64)
    }

    /// The rope dictionary's type (`default` when there is none).
    pub fn rope_type(&self) -> &str {
        self.rope()
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default")
    }

    /// A positive window size under `k` (absent or null: none).
    pub fn window(&self, k: &str) -> Result<Option<usize>, ModelError> {
        match self.cfg.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(w) if w > 0 => Ok(Some(w as usize)),
                _ => Err(ModelError::Config(format!(
                    "config.json: {k} {v} is not a positive integer"
                ))),
            },
        }
    }
}

/// Hooks of families with nothing of their own to read.
pub fn no_gguf_hparams(_: &GgufKeys<'_>, _: &mut ModelConfig) -> Result<(), ModelError> {
    Ok(())
}

pub fn no_hf_hparams(_: &HfKeys<'_>, _: &mut ModelConfig) -> Result<(), ModelError> {
    Ok(())
}

pub fn no_sliding_window(_: &HfKeys<'_>) -> Result<Option<usize>, ModelError> {
    Ok(None)
}

pub fn no_qk_norm(_: &HfKeys<'_>) -> QkNorm {
    QkNorm::None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_registered_once_with_distinct_names() {
        for f in [
            Family::Qwen3Moe,
            Family::Mixtral,
            Family::Olmoe,
            Family::DeepseekV3,
            Family::Glm4Moe,
            Family::GptOss,
            Family::DeepseekV4,
            Family::GlmDsa,
            Family::Qwen3Next,
            Family::Qwen35Moe,
        ] {
            assert_eq!(FAMILIES.iter().filter(|s| s.family == f).count(), 1);
            assert_eq!(f.spec().family, f);
        }
        // GGUF and HF names are separate namespaces (`olmoe` is in both); within each, a name
        // belongs to one family.
        for names in [
            FAMILIES
                .iter()
                .flat_map(|s| s.gguf_archs)
                .collect::<Vec<_>>(),
            FAMILIES.iter().flat_map(|s| s.hf_archs).collect::<Vec<_>>(),
        ] {
            let mut sorted = names.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(
                sorted.len(),
                names.len(),
                "a name maps to two families: {names:?}"
            );
        }
    }

    #[test]
    fn lookups_refuse_by_name() {
        assert_eq!(by_gguf_arch("llama", 8).unwrap().family, Family::Mixtral);
        assert!(by_gguf_arch("llama", 0)
            .map(|s| s.name)
            .unwrap_err()
            .to_string()
            .contains("without experts"));
        assert!(by_gguf_arch("gptoss", 8)
            .map(|s| s.name)
            .unwrap_err()
            .to_string()
            .contains("\"gptoss\""));
        assert_eq!(
            by_hf_arch("deepseek_v32").unwrap().family,
            Family::DeepseekV3
        );
        assert_eq!(by_gguf_arch("gpt-oss", 32).unwrap().family, Family::GptOss);
        assert_eq!(by_hf_arch("qwen3_next").unwrap().family, Family::Qwen3Next);
        assert!(by_hf_arch("Qwen3_5MoeForConditionalGeneration")
            .map(|s| s.name)
            .unwrap_err()
            .to_string()
            .contains("only the text model"));
        assert_eq!(
            by_gguf_arch("deepseek4", 8).unwrap().family,
            Family::DeepseekV4
        );
        assert!(by_hf_arch("Nope")
            .map(|s| s.name)
            .unwrap_err()
            .to_string()
            .contains("Nope"));
    }
}
