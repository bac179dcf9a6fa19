//! `sluice quantize IN OUT TYPE`: rewrite a GGUF with its weight matrices in another type, as
//! llama.cpp's `llama-quantize` does, for the types sluice has quantizers for.
//!
//! Owns: which tensors are rewritten and into what (`target_type`), and streaming the
//! conversion row chunk by row chunk (so a tensor larger than RAM converts) through
//! `GgufWriter` (the output appears only when whole).
//! Does not own: the block encoders (kernels/quantize.rs), the per-class mix and the whole-block
//! fallbacks (synth/plan.rs `mix_type`, shared with `sluice synth`).
//! Invariant: metadata and tensor order are the input's; a tensor that stays in its type is
//! copied byte for byte; a converted one is exactly what the encoder makes of the dequantized
//! input (tests/quantize_cmd.rs holds the bytes to the `gguf` package's quantizers).

use std::path::Path;

use crate::dtype::DType;
use crate::format::{FileKind, FormatError, GgufWriter, MetaValue, ModelFiles, TensorInfo};
use crate::synth::{mix_type, TensorClass};

/// The types `quantize` writes (those with an encoder in kernels/quantize.rs).
pub const TARGETS: &[DType] = &[
    DType::Q4_K,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::IQ4_NL,
    DType::IQ2_XXS,
    DType::MXFP4,
    DType::F16,
    DType::BF16,
    DType::F32,
];

/// What a conversion did, for the summary line.
#[derive(Debug, Default)]
pub struct Summary {
    pub tensors: usize,
    /// Tensors re-encoded (the rest were copied as they were).
    pub converted: usize,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// (type, tensors, bytes) of the output, most bytes first.
    pub by_type: Vec<(DType, usize, u64)>,
}

/// The role of a tensor, from llama.cpp's tensor names.
pub fn classify(name: &str, shape: &[u64]) -> TensorClass {
    // As llama-quantize: only 2-D and larger `.weight` tensors are matrices; routers
    // (`ffn_gate_inp`), convolution kernels (`ssm_conv1d`) and the rest stay as they are.
    let kept = shape.len() < 2
        || !name.ends_with(".weight")
        || ["ffn_gate_inp", "ssm_conv1d", "pos_embd", "token_types"]
            .iter()
            .any(|k| name.contains(k));
    if kept {
        TensorClass::Vector
    } else if name.contains("_exps") {
        TensorClass::RoutedExperts
    } else if name.contains("_shexp") {
        TensorClass::SharedExpert
    } else if name.starts_with("token_embd") {
        TensorClass::Embedding
    } else if name.starts_with("output.") {
        TensorClass::Output
    } else if name.contains("attn") || name.contains("ssm_") {
        TensorClass::Attention
    } else {
        TensorClass::DenseFfn
    }
}

/// The type tensor `t` gets: `None` keeps it as it is (vectors, routers, integer tables).
/// `overrides` (pattern, type) are tried in order on matrices: the first pattern the name
/// contains gives the type; else `target`'s mix (`mix_type`: `iq2_xxs` and `mxfp4` convert the
/// routed experts and write the rest Q4_K / Q8_0; a row the block does not divide falls back).
pub fn target_type(t: &TensorInfo, target: DType, overrides: &[(String, DType)]) -> Option<DType> {
    let class = classify(&t.name, &t.shape);
    if class == TensorClass::Vector || !is_numeric(t.dtype) {
        return None;
    }
    let row = *t.shape.last()?;
    let bulk = overrides
        .iter()
        .find(|(p, _)| t.name.contains(p.as_str()))
        .map(|(_, d)| *d);
    // An override names the type of this tensor, not a mix.
    let class = if bulk.is_some() {
        TensorClass::DenseFfn
    } else {
        class
    };
    Some(mix_type(bulk.unwrap_or(target), class, row))
}

/// Float and block-quantized types (what can be dequantized); integer tables are copied.
fn is_numeric(d: DType) -> bool {
    d.is_quantized() || matches!(d, DType::F32 | DType::F16 | DType::BF16)
}

/// llama.cpp's `general.file_type` (llama_ftype) for a file mostly of `t`.
fn file_type(t: DType) -> Option<u32> {
    Some(match t {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q8_0 => 7,
        DType::Q5_0 => 8,
        DType::Q5_1 => 9,
        DType::Q4_K => 14, // MOSTLY_Q4_K_S: every matrix Q4_K
        DType::IQ2_XXS => 19,
        DType::IQ4_NL => 25,
        DType::BF16 => 32,
        DType::MXFP4 => 38, // MOSTLY_MXFP4_MOE
        _ => return None,
    })
}

/// Elements converted per step: bounds the f32 buffer (64 MB) whatever the tensor's size.
const CHUNK_ELEMS: usize = 16 << 20;

/// Convert `input` (a GGUF, split or not) into `out` (one GGUF). `progress` gets (bytes of
/// input done, total) after each chunk.
pub fn quantize_file(
    input: &Path,
    out: &Path,
    target: DType,
    overrides: &[(String, DType)],
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Summary, FormatError> {
    let writer_err = |msg: String| FormatError::Writer {
        path: out.to_path_buf(),
        msg,
    };
    for d in std::iter::once(target).chain(overrides.iter().map(|o| o.1)) {
        if !TARGETS.contains(&d) {
            return Err(writer_err(format!("no quantizer for {d}")));
        }
    }
    let files = ModelFiles::open(input)?;
    if files.kind() != FileKind::Gguf {
        return Err(FormatError::malformed(
            input,
            format!(
                "{} input: quantize reads GGUF files (convert a checkpoint with llama.cpp's \
                 convert_hf_to_gguf.py first)",
                files.kind().name()
            ),
        ));
    }
    let plan: Vec<(&TensorInfo, DType)> = files
        .tensors()
        .iter()
        .map(|t| (t, target_type(t, target, overrides).unwrap_or(t.dtype)))
        .collect();
    // Refuse before writing anything: a tensor to convert that cannot be read.
    for (t, d) in &plan {
        if *d != t.dtype && crate::kernels::kernels_for(t.dtype).is_err() {
            return Err(FormatError::UnsupportedDType {
                path: input.to_path_buf(),
                tensor: t.name.clone(),
                dtype: files.dtype_name(t),
                op: "dequantize (to convert it)",
            });
        }
    }

    let mut w = GgufWriter::new(out)?;
    let converted = plan.iter().any(|(t, d)| *d != t.dtype);
    for k in files.meta_keys() {
        let Some(v) = files.meta(k) else { continue };
        let v = match k {
            _ if k.starts_with("split.") => continue,
            "general.file_type" if converted => match file_type(target) {
                Some(ft) => MetaValue::U32(ft),
                None => continue,
            },
            _ => v.clone(),
        };
        w.add_meta(k, v)?;
    }
    if converted && files.meta("general.file_type").is_none() {
        if let Some(ft) = file_type(target) {
            w.add_meta("general.file_type", MetaValue::U32(ft))?;
        }
    }
    if converted && files.meta("general.quantization_version").is_none() {
        w.add_meta("general.quantization_version", MetaValue::U32(2))?;
    }
    for (t, d) in &plan {
        w.add_tensor_info(&t.name, *d, &t.shape)?;
    }

    let total: u64 = plan.iter().map(|(t, _)| t.range.len).sum();
    let mut sum = Summary {
        tensors: plan.len(),
        ..Summary::default()
    };
    let mut done = 0u64;
    let mut f32s: Vec<f32> = Vec::new();
    let mut enc: Vec<u8> = Vec::new();
    for (t, d) in &plan {
        let bytes = files.bytes(t)?;
        sum.bytes_in += bytes.len() as u64;
        if *d == t.dtype {
            w.write_tensor_data(bytes)?;
            done += bytes.len() as u64;
            progress(done, total);
        } else {
            sum.converted += 1;
            let row = *t.shape.last().unwrap_or(&1) as usize;
            let rows = (t.n_elems() as usize) / row.max(1);
            let row_bytes = bytes.len() / rows.max(1);
            let per = (CHUNK_ELEMS / row.max(1)).max(1);
            for r0 in (0..rows).step_by(per) {
                let n = per.min(rows - r0);
                let src = &bytes[r0 * row_bytes..(r0 + n) * row_bytes];
                f32s.resize(n * row, 0.0);
                crate::kernels::dequantize(t.dtype, src, &mut f32s)
                    .map_err(|e| writer_err(format!("tensor `{}`: {e}", t.name)))?;
                enc.clear();
                crate::synth::quantize_rows(*d, &f32s, row, &mut enc)
                    .map_err(|e| writer_err(format!("tensor `{}`: {e}", t.name)))?;
                w.write_tensor_data(&enc)?;
                done += src.len() as u64;
                progress(done, total);
            }
        }
        let out_bytes = d.bytes_for(t.n_elems()).unwrap_or(0);
        sum.bytes_out += out_bytes;
        match sum.by_type.iter_mut().find(|e| e.0 == *d) {
            Some(e) => {
                e.1 += 1;
                e.2 += out_bytes;
            }
            None => sum.by_type.push((*d, 1, out_bytes)),
        }
    }
    w.finish()?;
    sum.by_type.sort_by_key(|e| std::cmp::Reverse(e.2));
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, dtype: DType, shape: &[u64]) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            range: crate::format::ByteRange {
                file: 0,
                offset: 0,
                len: 0,
            },
        }
    }

    #[test]
    fn what_converts_and_into_what() {
        let q = |n: &str, s: &[u64], t: DType| target_type(&info(n, DType::F32, s), t, &[]);
        assert_eq!(q("blk.0.attn_norm.weight", &[256], DType::Q8_0), None);
        assert_eq!(
            q("blk.1.ffn_gate_inp.weight", &[16, 256], DType::Q8_0),
            None
        );
        assert_eq!(q("blk.1.exp_probs_b.bias", &[16], DType::Q8_0), None);
        assert_eq!(
            q("blk.0.attn_q.weight", &[256, 256], DType::Q8_0),
            Some(DType::Q8_0)
        );
        // A row the 256-block does not divide falls back (as synth does).
        assert_eq!(
            q("blk.0.attn_k_b.weight", &[4, 64, 32], DType::Q4_K),
            Some(DType::Q4_0)
        );
        // Mixes: experts in the low type, the rest at higher precision.
        assert_eq!(
            q("blk.1.ffn_up_exps.weight", &[16, 64, 256], DType::MXFP4),
            Some(DType::MXFP4)
        );
        assert_eq!(
            q("output.weight", &[4096, 256], DType::MXFP4),
            Some(DType::Q8_0)
        );
        let o = [("ffn_down".to_string(), DType::Q8_0)];
        let t = info("blk.1.ffn_down_exps.weight", DType::F16, &[16, 256, 64]);
        assert_eq!(target_type(&t, DType::Q4_K, &o), Some(DType::Q8_0));
        // Integer tables (DeepSeek-V4's tid2eid) are copied.
        let t = info("blk.0.ffn_gate_tid2eid.weight", DType::I32, &[4096, 6]);
        assert_eq!(target_type(&t, DType::Q8_0, &[]), None);
    }
}
