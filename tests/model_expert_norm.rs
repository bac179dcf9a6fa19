//! A DeepSeek-V3 model with `norm_topk_prob: false` against transformers: its sigmoid routing
//! weights are not renormalised. Fixture tests/fixtures/models/deepseek_v3_nonorm (made by
//! scripts/make_variant_fixtures.py with transformers 5.25; the deepseek_v3 fixture's config
//! with that one field changed). Checked from the safetensors and from a `deepseek2` GGUF that,
//! as llama.cpp's converter writes it for such a model, has no `deepseek2.expert_weights_norm`
//! key: llama.cpp reads the missing key as false, and so must sluice (issue 18, item 5). The
//! control: the same GGUF with the key set to true is far from the reference.

mod model_util;

use model_util::{compare, dir, ids, json};
use sluice::format::ModelFiles;
use sluice::model::{LoadOptions, Model};
use std::path::{Path, PathBuf};
use std::process::Command;

const NAME: &str = "deepseek_v3_nonorm";

/// The fixture as a llama.cpp `deepseek2` GGUF; `norm_key`: "omit" (the converter's output for
/// this model) or "write" (key set to true).
fn gguf(norm_key: &str) -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ds-nonorm-{norm_key}.gguf"));
    let run = Command::new("python3")
        .arg("-c")
        .arg(WRITE_DEEPSEEK2)
        .arg(dir(NAME))
        .arg(&out)
        .arg(norm_key)
        .output()
        .expect("python3 with the gguf package (.ci/run installs it)");
    assert!(
        run.status.success(),
        "writing the deepseek2 GGUF failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    out
}

/// Worst max|Δ|/max|ref| over the cases (argmax must agree when `want_close`).
fn worst(path: &Path, want_close: bool) -> f32 {
    let d = dir(NAME);
    let files = ModelFiles::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let model = Model::load(
        &files,
        &LoadOptions {
            kv: sluice::model::KvTypes::F32,
            threads: 2,
            ctx: 64,
        },
    )
    .unwrap();
    assert!(!model.cfg.routing.norm_topk_prob || !want_close);
    let mut w = 0f32;
    for case in json(&d.join("cases.json"))["cases"].as_array().unwrap() {
        let toks = ids(&case["ids"]);
        let (_, refr) = sluice::npy::read_f32(&d.join(case["logits"].as_str().unwrap())).unwrap();
        for batch in [1, 8] {
            let mut st = model.new_state(64, batch, batch).unwrap();
            let mut ours = Vec::new();
            model.logits_all(&mut st, &toks, &mut ours).unwrap();
            let (err, same) = compare(&ours, &refr, model.cfg.vocab);
            assert!(!want_close || same, "{}: argmax differs", path.display());
            w = w.max(err);
        }
    }
    w
}

#[test]
fn unnormalised_routing_matches_transformers() {
    let st = worst(&dir(NAME), true);
    let no_key = worst(&gguf("omit"), true);
    let with_key = worst(&gguf("write"), false);
    eprintln!(
        "safetensors {st:.2e}, GGUF without the key {no_key:.2e}, with it true {with_key:.2e}"
    );
    assert!(st <= 1e-4 && no_key <= 1e-4, "{st:.2e} {no_key:.2e}");
    assert!(
        with_key > 1e-2,
        "renormalising changes nothing ({with_key:.2e})"
    );
}

/// Writes the fixture's safetensors as a llama.cpp `deepseek2` GGUF (argv: fixture folder,
/// output path, omit|write for expert_weights_norm), as tests/model_v32.rs writes its
/// `deepseek32` file: gguf-py's own name map and `add_*` methods, kv_b_proj split per head.
const WRITE_DEEPSEEK2: &str = r#"
import json, struct, sys
from pathlib import Path
import numpy as np
import gguf
d, out, norm_key = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
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
w = gguf.GGUFWriter(out, "deepseek2")
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
# llama.cpp's converter writes the key only when norm_topk_prob is true
if norm_key == "write":
    w.add_expert_weights_norm(True)
elif c["norm_topk_prob"]:
    w.add_expert_weights_norm(True)
w.add_rope_dimension_count(rope)
names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, L)
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
