//! DeepSeek-V3.2 sparse attention (DSA) against transformers 5.17 (a reference nobody here
//! wrote): tests/fixtures/models/deepseek_v32_sparse has `index_topk` 4 and 8 indexer heads, so
//! beyond the 4th token the lightning indexer decides which positions each query attends to.
//! The fixture's seed was chosen so that no top-k cut is a tie (smallest gap 5.9e-4, f32
//! rounding ~1e-6): every position is compared as for the other families
//! (max|Δlogits| / max|ref| <= 1e-4, same argmax), for prefill batches of 1 (every token a
//! decode step), 3 and 24, and the 16-token greedy continuation must be identical. The same
//! weights are also written as a llama.cpp `deepseek32` GGUF by the `gguf` package's own
//! GGUFWriter, tensor names from its own name map, and must match the same references.

mod model_util;

use model_util::{argmax, compare, dir, ids, json};
use sluice::format::ModelFiles;
use sluice::model::config::IndexerDims;
use sluice::model::{LoadOptions, Model};
use std::path::Path;
use std::process::Command;

fn load(path: &Path) -> ModelFiles {
    ModelFiles::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every case's teacher-forced logits through the model at `path` (fixture folder `d` holds
/// the references), for several prefill batch sizes.
fn check_cases(d: &Path, path: &Path, what: &str) {
    let files = load(path);
    let model = Model::load(
        &files,
        &LoadOptions {
            threads: 2,
            ctx: 64,
        },
    )
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    let ix = model.cfg.indexer.expect("the fixture has an indexer");
    assert_eq!((ix.heads, ix.head_dim, ix.topk), (8, 16, 4), "{what}");
    let cases = json(&d.join("cases.json"));
    for case in cases["cases"].as_array().unwrap() {
        let toks = ids(&case["ids"]);
        let (shape, refr) =
            sluice::npy::read_f32(&d.join(case["logits"].as_str().unwrap())).unwrap();
        for batch in [1, 3, 24] {
            let mut st = model.new_state(64, batch, batch).unwrap();
            let mut ours = Vec::new();
            model.logits_all(&mut st, &toks, &mut ours).unwrap();
            assert_eq!(shape, vec![toks.len(), model.cfg.vocab], "{what}: shape");
            let (err, same) = compare(&ours, &refr, model.cfg.vocab);
            eprintln!(
                "deepseek_v32_sparse {what} {} batch {batch}: max|Δ|/max|ref| = {err:.2e}",
                case["name"]
            );
            assert!(
                err <= 1e-4 && same,
                "{what} {} batch {batch}: max|Δ|/max|ref| = {err:.2e}, argmax same: {same}",
                case["name"]
            );
        }
    }
}

fn check_greedy(d: &Path, path: &Path, what: &str) {
    let g = &json(&d.join("cases.json"))["greedy"];
    let (prompt, want) = (ids(&g["prompt_ids"]), ids(&g["tokens"]));
    let files = load(path);
    let model = Model::load(
        &files,
        &LoadOptions {
            threads: 2,
            ctx: 64,
        },
    )
    .unwrap();
    for batch in [1, 16] {
        let mut st = model.new_state(64, batch, 1).unwrap();
        let mut next = argmax(model.feed(&mut st, &prompt).unwrap()) as u32;
        let mut got = vec![next];
        while got.len() < want.len() {
            next = argmax(model.forward_chunk(&mut st, &[next], 0).unwrap()) as u32;
            got.push(next);
        }
        assert_eq!(got, want, "{what} batch {batch}: greedy continuation");
    }
}

#[test]
fn sparse_attention_logits_match_transformers() {
    let d = dir("deepseek_v32_sparse");
    check_cases(&d, &d, "safetensors");
}

#[test]
fn sparse_attention_greedy_matches_transformers() {
    let d = dir("deepseek_v32_sparse");
    check_greedy(&d, &d, "safetensors");
}

/// The control: the same weights with `index_topk` raised to the context (so every query
/// attends to every causal position: dense MLA) do not match transformers past `index_topk` tokens, so the comparisons above do
/// test the selection.
#[test]
fn dense_attention_does_not_match_past_index_topk() {
    let d = dir("deepseek_v32_sparse");
    let files = load(&d);
    let mut model = Model::load(
        &files,
        &LoadOptions {
            threads: 2,
            ctx: 64,
        },
    )
    .unwrap();
    let ix = model.cfg.indexer.unwrap();
    model.cfg.indexer = Some(IndexerDims { topk: 64, ..ix });
    let case = &json(&d.join("cases.json"))["cases"][2];
    let toks = ids(&case["ids"]);
    let (_, refr) = sluice::npy::read_f32(&d.join(case["logits"].as_str().unwrap())).unwrap();
    let mut st = model.new_state(64, 8, 8).unwrap();
    let mut ours = Vec::new();
    model.logits_all(&mut st, &toks, &mut ours).unwrap();
    let v = model.cfg.vocab;
    // Within index_topk (the first 4 positions) dense is exact; past it, it is not.
    let (err_in, _) = compare(&ours[..4 * v], &refr[..4 * v], v);
    let (err_past, _) = compare(&ours[4 * v..], &refr[4 * v..], v);
    eprintln!(
        "dense MLA vs sparse reference: first 4 positions {err_in:.2e}, later {err_past:.2e}"
    );
    assert!(err_in <= 1e-4, "{err_in}");
    assert!(err_past > 1e-2, "{err_past}");
}

/// Writes the fixture's safetensors as a llama.cpp `deepseek32` GGUF (argv: fixture folder,
/// output path). Names come from gguf-py's own tables (`get_tensor_name_map` of the DSA arch
/// that shares DeepSeek-V3.2's indexer tensors; `TENSOR_NAMES` for the split kv_b) and keys
/// from GGUFWriter's own `add_*` methods, with the values llama.cpp's deepseek2 converter
/// writes (tests/fixtures/models/deepseek_v3/gguf_tensors.json); kv_b_proj is split per head
/// into k_b (transposed) and v_b as that converter does.
const WRITE_DEEPSEEK32: &str = r#"
import json, struct, sys
from pathlib import Path
import numpy as np
import gguf
d, out = Path(sys.argv[1]), sys.argv[2]
c = json.loads((d / "config.json").read_text())
raw = (d / "model.safetensors").read_bytes()
n = struct.unpack("<Q", raw[:8])[0]
hdr = json.loads(raw[8:8 + n])
def t(name):
    e = hdr[name]
    assert e["dtype"] == "F32", name
    a, b = e["data_offsets"]
    return np.frombuffer(raw[8 + n + a:8 + n + b], dtype=np.float32).reshape(e["shape"]).copy()
L, E = c["num_hidden_layers"], c["n_routed_experts"]
nh, nope, vd, kvl, rope = (c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"],
                           c["kv_lora_rank"], c["qk_rope_head_dim"])
rp = c["rope_parameters"]
w = gguf.GGUFWriter(out, "deepseek32")
w.add_block_count(L)
w.add_context_length(c["max_position_embeddings"])
w.add_embedding_length(c["hidden_size"])
w.add_feed_forward_length(c["intermediate_size"])
w.add_head_count(nh)
w.add_head_count_kv(1)
w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
w.add_rope_scaling_factor(rp["factor"])
w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
w.add_rope_scaling_yarn_beta_fast(rp["beta_fast"])
w.add_rope_scaling_yarn_beta_slow(rp["beta_slow"])
w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
w.add_rope_freq_base(rp["rope_theta"])
w.add_layer_norm_rms_eps(c["rms_norm_eps"])
w.add_expert_count(E)
w.add_expert_used_count(c["num_experts_per_tok"])
w.add_expert_group_count(c["n_group"])
w.add_expert_group_used_count(c["topk_group"])
w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
w.add_key_length(kvl + rope)
w.add_value_length(kvl)
w.add_leading_dense_block_count(c["first_k_dense_replace"])
w.add_vocab_size(c["vocab_size"])
w.add_q_lora_rank(c["q_lora_rank"])
w.add_kv_lora_rank(kvl)
w.add_key_length_mla(nope + rope)
w.add_value_length_mla(vd)
w.add_expert_feed_forward_length(c["moe_intermediate_size"])
w.add_expert_shared_count(c["n_shared_experts"])
w.add_expert_weights_scale(c["routed_scaling_factor"])
w.add_expert_weights_norm(c["norm_topk_prob"])
w.add_rope_dimension_count(rope)
w.add_indexer_head_count(c["index_n_heads"])
w.add_indexer_key_length(c["index_head_dim"])
w.add_indexer_top_k(c["index_topk"])
names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM_DSA, L)
def gname(hf):
    if hf.endswith("e_score_correction_bias"):
        return names.get_name(hf[:-len("_bias")]) + ".bias"
    g = names.get_name(hf, try_suffixes=(".weight", ".bias"))
    assert g is not None, hf
    return g
done = set()
for name in sorted(hdr):
    if name == "__metadata__" or name in done:
        continue
    if ".mlp.experts." in name:
        pre, rest = name.split(".mlp.experts.")
        part = rest.split(".", 1)[1]
        stack = [f"{pre}.mlp.experts.{e}.{part}" for e in range(E)]
        done.update(stack)
        w.add_tensor(gname(f"{pre}.mlp.experts.{part}"), np.stack([t(s) for s in stack]))
    elif name.endswith("kv_b_proj.weight"):
        bid = int(name.split(".")[2])
        kv = t(name).reshape(nh, nope + vd, kvl)
        k_b = np.ascontiguousarray(kv[:, :nope, :].transpose(0, 2, 1))
        v_b = np.ascontiguousarray(kv[:, nope:, :])
        for mt, a in ((gguf.MODEL_TENSOR.ATTN_K_B, k_b), (gguf.MODEL_TENSOR.ATTN_V_B, v_b)):
            w.add_tensor(gguf.TENSOR_NAMES[mt].format(bid=bid) + ".weight", a)
    else:
        w.add_tensor(gname(name), t(name))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
"#;

#[test]
fn deepseek32_gguf_matches_transformers() {
    let d = dir("deepseek_v32_sparse");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("v32-sparse-deepseek32.gguf");
    let run = Command::new("python3")
        .arg("-c")
        .arg(WRITE_DEEPSEEK32)
        .arg(&d)
        .arg(&out)
        .output()
        .expect("python3 with the gguf package (.ci/run installs it)");
    assert!(
        run.status.success(),
        "writing the deepseek32 GGUF failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let files = load(&out);
    let names: Vec<&str> = files.tensors().iter().map(|t| t.name.as_str()).collect();
    for want in [
        "blk.1.indexer.attn_q_b.weight",
        "blk.1.indexer.attn_k.weight",
        "blk.1.indexer.k_norm.weight",
        "blk.1.indexer.k_norm.bias",
        "blk.1.indexer.proj.weight",
    ] {
        assert!(names.contains(&want), "{want} not in {names:?}");
    }
    drop(files);
    check_cases(&d, &out, "gguf deepseek32");
    check_greedy(&d, &out, "gguf deepseek32");
}
