#!/usr/bin/env python3
"""Write an MLA + DSA fixture's safetensors (scripts/make_variant_fixtures.py:
deepseek_v32_sparse, glm_moe_dsa) as a llama.cpp GGUF: `deepseek32` (DeepSeek-V3.2) or
`glm-dsa` (GLM-5).

Names come from gguf-py's own tables (`get_tensor_name_map` of GLM_DSA, which shares
DeepSeek-V3.2's indexer tensors; `TENSOR_NAMES` for the split kv_b) and keys from GGUFWriter's
own `add_*` methods, with the values llama.cpp's deepseek2 converter writes
(tests/fixtures/models/deepseek_v3/gguf_tensors.json); kv_b_proj is split per head into k_b
(transposed) and v_b as that converter does. A GLM-5 "shared" layer has no indexer tensors in
the safetensors, so none in the GGUF either.

  python3 scripts/mla_fixture_to_gguf.py FIXTURE_DIR OUT.gguf [--arch glm-dsa] [--no-indexer-types]
"""
import argparse, json, struct
from pathlib import Path
import numpy as np
import gguf
ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("fixture", type=Path)
ap.add_argument("out")
ap.add_argument("--arch", default="deepseek32", choices=["deepseek32", "glm-dsa"])
ap.add_argument("--no-indexer-types", action="store_true",
                help="glm-dsa: leave out attention.indexer.types (readers infer it from the tensors)")
args = ap.parse_args()
d, out = args.fixture, args.out
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
w = gguf.GGUFWriter(out, args.arch)
w.add_block_count(L)
w.add_context_length(c["max_position_embeddings"])
w.add_embedding_length(c["hidden_size"])
w.add_feed_forward_length(c["intermediate_size"])
w.add_head_count(nh)
w.add_head_count_kv(1)
if rp.get("rope_type") == "yarn":
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
types = c.get("indexer_types")
if args.arch == "glm-dsa" and types and not args.no_indexer_types:
    # llama.cpp's GlmMoeDsaModel converter: one bool per layer, true = "full"
    # (gguf 0.19 has no add_indexer_types yet).
    w.add_array(f"{args.arch}.attention.indexer.types", [t == "full" for t in types])
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
