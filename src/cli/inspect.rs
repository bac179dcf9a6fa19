//! `sluice inspect MODEL [--json] [--tensors] [--check]`: print a model's summary
//! (`sluice::inspect::ModelSummary`), optionally its tensor table, optionally after reading and
//! dequantizing every tensor.

use anyhow::Context;
use clap::Args;
use std::path::PathBuf;

use crate::format::{ModelFiles, TensorInfo};
use crate::inspect::{summarize, ModelSummary};
use crate::kernels;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A .gguf file (the first shard of a split model) or a directory with config.json + safetensors.
    pub model: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also list every tensor: name, type, shape, file, offset, bytes.
    #[arg(long)]
    pub tensors: bool,
    /// Read and dequantize every tensor (one at a time); fail on the first that sluice cannot
    /// compute with or that holds NaN/inf.
    #[arg(long)]
    pub check: bool,
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let m = ModelFiles::open(&args.model)?;
    let s = summarize(&m);
    if args.check {
        check_all(&m)?;
    }
    if args.json {
        let mut v = serde_json::to_value(&s).context("serialising the summary")?;
        if args.tensors {
            let list: Vec<serde_json::Value> =
                m.tensors().iter().map(|t| tensor_json(&m, t)).collect();
            if let Some(o) = v.as_object_mut() {
                o.insert("tensor_list".to_string(), list.into());
            }
        }
        if args.check {
            if let Some(o) = v.as_object_mut() {
                o.insert("checked".to_string(), true.into());
            }
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&v).context("serialising the summary")?
        );
    } else {
        print_text(&s);
        if args.tensors {
            println!();
            for t in m.tensors() {
                println!(
                    "{:<48} {:<8} {:<20} file {} offset {} bytes {}",
                    t.name,
                    m.dtype_name(t),
                    format!("{:?}", t.shape),
                    t.range.file,
                    t.range.offset,
                    t.range.len
                );
            }
        }
        if args.check {
            println!(
                "check         all {} tensors read and dequantized, all values finite",
                m.tensors().len()
            );
        }
    }
    Ok(())
}

fn tensor_json(m: &ModelFiles, t: &TensorInfo) -> serde_json::Value {
    serde_json::json!({
        "name": t.name, "dtype": m.dtype_name(t), "shape": t.shape,
        "file": t.range.file, "offset": t.range.offset, "bytes": t.range.len,
    })
}

/// Dequantize every tensor. Large tensors go through the kernels a slab of rows at a time so
/// memory stays bounded; FP8 with block scales goes through `ModelFiles::dequantize`.
fn check_all(m: &ModelFiles) -> anyhow::Result<()> {
    const SLAB: usize = 1 << 22; // floats per step
    let mut buf = Vec::new();
    for t in m.tensors() {
        let bad = |n: usize| {
            anyhow::anyhow!(
                "{}: tensor `{}`: {n} values are NaN or infinite",
                m.paths()[t.range.file].display(),
                t.name
            )
        };
        if t.dtype == crate::dtype::DType::F8E4M3 {
            let v = m.dequantize(t)?;
            let n = v.iter().filter(|x| !x.is_finite()).count();
            if n > 0 {
                return Err(bad(n));
            }
            continue;
        }
        let bytes = m.bytes(t)?;
        if kernels::kernels_for(t.dtype).is_err() {
            // Let the library phrase the error (names the file, tensor and type).
            m.dequantize(t)?;
        }
        let cols = t.shape.last().copied().unwrap_or(1).max(1) as usize;
        let row_bytes = t.dtype.bytes_for(cols as u64).unwrap_or(0) as usize;
        let rows_per = (SLAB / cols).max(1);
        let mut n_bad = 0;
        if row_bytes == 0 {
            continue;
        }
        for chunk in bytes.chunks(rows_per * row_bytes) {
            let n = chunk.len() / row_bytes * cols;
            buf.resize(n, 0f32);
            kernels::dequantize(t.dtype, chunk, &mut buf).with_context(|| {
                format!("{}: tensor `{}`", m.paths()[t.range.file].display(), t.name)
            })?;
            n_bad += buf.iter().filter(|x| !x.is_finite()).count();
        }
        if n_bad > 0 {
            return Err(bad(n_bad));
        }
    }
    Ok(())
}

fn human(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {} ({b} bytes)", UNITS[u])
    }
}

/// `human` without the exact byte count.
fn short(b: u64) -> String {
    human(b).split(" (").next().unwrap_or("").to_string()
}

fn opt(v: Option<u64>) -> String {
    v.map_or("?".to_string(), |v| v.to_string())
}

fn print_text(s: &ModelSummary) {
    let files = if s.files == 1 {
        "1 file".to_string()
    } else {
        format!("{} files", s.files)
    };
    println!("model         {} ({}, {files})", s.path, s.format);
    println!("architecture  {}", s.architecture.as_deref().unwrap_or("?"));
    println!(
        "layers        {} ({} with routed experts)",
        opt(s.layers),
        s.moe_layers
    );
    println!(
        "experts       {} per layer, {} used per token, {} shared",
        opt(s.experts_per_layer),
        opt(s.experts_used_per_token),
        s.shared_experts
    );
    println!("tensors       {}", s.tensors);
    for (i, q) in s.quant_types.iter().enumerate() {
        let label = if i == 0 { "types" } else { "" };
        println!(
            "{label:<13} {:<8} {:>5} tensors  {}  resident {}  routed {}{}",
            q.dtype,
            q.tensors,
            human(q.bytes),
            short(q.resident_bytes),
            short(q.routed_bytes),
            if q.kernels {
                ""
            } else {
                "  (no kernels in sluice)"
            }
        );
    }
    println!("total         {}", human(s.total_bytes));
    println!("resident      {}", human(s.resident_bytes));
    println!("routed        {}", human(s.routed_expert_bytes));
    println!(
        "one expert    {} per layer",
        human(s.one_expert_bytes_per_layer)
    );
    println!(
        "per token     {} of routed experts",
        human(s.routed_bytes_per_token)
    );
    if let Some(kv) = s.kv_bytes_per_token {
        let types = s.kv_cache_types.as_deref().unwrap_or("f32");
        println!(
            "kv cache      {} per token of context ({types}, the default -ctk/-ctv; -c N holds N x this)",
            human(kv)
        );
    }
    if let Some(b) = s.recurrent_state_bytes {
        println!(
            "state         {} per sequence (recurrent layers' conv + delta-rule state, f32)",
            human(b)
        );
    }
    if s.mtp_layers > 0 {
        let kv = s.mtp_kv_bytes_per_token.map_or(String::new(), |b| {
            format!(", its KV cache {} per token", human(b))
        });
        println!(
            "mtp           {} layer(s){kv} (allocated only with --mtp K)",
            s.mtp_layers
        );
    }
}
