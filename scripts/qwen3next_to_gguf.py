#!/usr/bin/env python3
"""Write a Qwen3-Next or Qwen3.5-MoE (text) safetensors checkpoint as a GGUF with the names and
keys llama.cpp uses for architecture `qwen3next` / `qwen35moe`.

What llama.cpp does, read from ggml-org/llama.cpp conversion/qwen.py (`Qwen3NextModel`, at
03173d5e78f8) and gguf-py 0.19.0 (constants.py: MODEL_ARCH.QWEN3NEXT's tensor list and names):
  - keys: the generic text-model ones (block_count, context_length, embedding_length,
    feed_forward_length, head_count(_kv), key/value_length, rope.freq_base,
    layer_norm_rms_epsilon, expert_count, expert_used_count), expert_feed_forward_length,
    expert_shared_feed_forward_length, ssm.conv_kernel (linear_conv_kernel_dim),
    ssm.state_size (linear_key_head_dim), ssm.group_count (linear_num_key_heads),
    ssm.time_step_rank (linear_num_value_heads), ssm.inner_size (value dim x value heads),
    full_attention_interval (layer i is full attention when (i + 1) % interval == 0) and
    rope.dimension_count (head_dim x partial_rotary_factor); expert_weights_norm from
    norm_topk_prob;
  - tensors: every `*norm.weight` except the DeltaNet's gated `linear_attn.norm` gets + 1 (the
    zero-centred RMSNorm folded in); `A_log` is written as -exp(A_log) (`ssm_a`); `dt_bias`
    as `ssm_dt.bias`; the conv kernel squeezed to (conv_dim, K); `in_proj_qkvz` regrouped from
    per-key-head [q, k, v, z] blocks into `attn_qkv` = [all q; all k; all v] and `attn_gate` =
    all z; `in_proj_ba` kept as `ssm_ba`; per-expert tensors stacked into ffn_*_exps; the rest
    by gguf-py's name map.
llama.cpp's qwen3next has no dense-MLP layers; a layer in `mlp_only_layers` is written with
the dense names other architectures use (ffn_gate / ffn_up / ffn_down), which sluice reads.
The layer pattern must be expressible as full_attention_interval (refused otherwise).
Qwen3.5-MoE (`Qwen3_5MoeTextModel` in llama-cpp-python 0.3.36's vendor/llama.cpp
conversion/qwen.py, via `_LinearAttentionVReorderBase` and `_Qwen35MRopeMixin`; names from its
gguf-py constants.py / tensor_mapping.py): the same keys plus `rope.dimension_sections`
(mrope_section padded to 4, default [11, 11, 10, 0]) and `attention.recurrent_layers`; the
separate projections keep their own names (`attn_qkv` from in_proj_qkv, `attn_gate` from
in_proj_z, `ssm_beta` from in_proj_b, `ssm_alpha` from in_proj_a); where key and value heads
differ, every value-head-indexed row, channel or column (v rows of attn_qkv, attn_gate,
ssm_beta, ssm_alpha, ssm_a, ssm_dt.bias, the conv's v channels, ssm_out's columns) goes from
HF's grouped order (value heads of key head 0 first) to the tiled order [G0 v0, G1 v0, ...,
G0 v1, G1 v1, ...], so value head j reads key head j % key_heads.
A checkpoint with an MTP module (`mtp.*`, `mtp_num_hidden_layers`) gets it as block
n_layers with the `nextn.*` tensors (see the comment in main).
Reads safetensors with numpy only (no torch). The tokenizer is not written (tests feed ids).

Usage: python3 scripts/qwen3next_to_gguf.py MODEL_DIR OUT.gguf
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gptoss_to_gguf import read_safetensors  # noqa: E402


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    c = json.loads((src / "config.json").read_text())
    t = read_safetensors(src / "model.safetensors")
    qwen35 = c["architectures"][0].startswith("Qwen3_5")
    arch = gguf.MODEL_ARCH.QWEN35MOE if qwen35 else gguf.MODEL_ARCH.QWEN3NEXT
    n_layers = c["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, n_layers + 1)
    types = list(c["layer_types"])
    full = [i for i, x in enumerate(types) if x == "full_attention"]
    interval = full[0] + 1 if full else n_layers + 1
    if any((i + 1) % interval == 0 for i in range(n_layers)) != bool(full) or any(
            (x == "full_attention") != ((i + 1) % interval == 0) for i, x in enumerate(types)):
        raise SystemExit(f"layer_types {types} is not a full_attention_interval pattern")
    # The MTP module, as llama.cpp's `_Qwen35MtpMixin` writes it (ggml-org/llama.cpp PR #22673,
    # conversion/qwen.py; read as a fork's verbatim port through the search tool, not the
    # upstream file): `mtp.layers.0.*` become block n_layers (converted like any
    # full-attention layer, norms + 1), `mtp.fc` / `pre_fc_norm_embedding` / `pre_fc_norm_hidden`
    # / `mtp.norm` become that block's `nextn.eh_proj` / `enorm` / `hnorm` / `shared_head_norm`
    # (renamed to model.layers.{n}.eh_proj/enorm/hnorm/shared_head.norm first, so the norms get
    # + 1 too), block_count counts it and `nextn_predict_layers` is written.
    n_mtp = c.get("mtp_num_hidden_layers", 0) if "mtp.fc.weight" in t else 0
    if n_mtp:
        for k in [k for k in t if k.startswith("mtp.layers.0.")]:
            t[f"model.layers.{n_layers}." + k[len("mtp.layers.0."):]] = t.pop(k)
    rope = c.get("rope_parameters") or {}
    hd = c["head_dim"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]

    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(n_layers + n_mtp)
    if n_mtp:
        w.add_uint32(f"{gguf.MODEL_ARCH_NAMES[arch]}.nextn_predict_layers", n_mtp)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    if "intermediate_size" in c:
        w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    w.add_expert_weights_norm(bool(c.get("norm_topk_prob", False)))
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(dv * nv)
    w.add_full_attention_interval(interval)
    w.add_rope_dimension_count(int(hd * rope.get("partial_rotary_factor", 0.25)))
    if qwen35:
        # gguf-py's add_recurrent_layers (newer than the installed package): the same key.
        w.add_array(f"{gguf.MODEL_ARCH_NAMES[arch]}.attention.recurrent_layers",
                    [x == "linear_attention" for x in types])
        sections = list(rope.get("mrope_section") or [11, 11, 10])
        w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])
    r = nv // nk

    def tiled(x: np.ndarray, width: int, axis: int = 0) -> np.ndarray:
        """Value heads (each `width` wide along `axis`) from grouped to tiled order."""
        if nk == nv:
            return x
        x = np.moveaxis(x, axis, 0)
        y = x.reshape(nk, r, width, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
        return np.moveaxis(y, 0, axis)

    def put(hf: str, data: np.ndarray, suffix: str = ".weight", name: str | None = None):
        name = name or names.get_name(hf)
        if name is None:
            raise SystemExit(f"gguf-py has no {arch.name} name for {hf}")
        w.add_tensor(name + suffix, np.ascontiguousarray(data, dtype=np.float32))

    put("model.embed_tokens", t["model.embed_tokens.weight"])
    put("model.norm", t["model.norm.weight"] + 1)
    put("lm_head", t["lm_head.weight"])
    dense = set(c.get("mlp_only_layers") or [])
    if n_mtp:
        types.append("full_attention")
        blk = f"blk.{n_layers}.nextn"
        put("", t["mtp.fc.weight"], name=f"{blk}.eh_proj")
        put("", t["mtp.pre_fc_norm_embedding.weight"] + 1, name=f"{blk}.enorm")
        put("", t["mtp.pre_fc_norm_hidden.weight"] + 1, name=f"{blk}.hnorm")
        put("", t["mtp.norm.weight"] + 1, name=f"{blk}.shared_head_norm")
    for l in range(n_layers + n_mtp):
        p = f"model.layers.{l}"
        put(f"{p}.input_layernorm", t[f"{p}.input_layernorm.weight"] + 1)
        put(f"{p}.post_attention_layernorm", t[f"{p}.post_attention_layernorm.weight"] + 1)
        if types[l] == "linear_attention" and qwen35:
            a = f"{p}.linear_attn"
            qkv = t[f"{a}.in_proj_qkv.weight"]
            kd = nk * dk
            qkv = np.concatenate([qkv[:2 * kd], tiled(qkv[2 * kd:], dv)])
            put("", qkv, name=f"blk.{l}.attn_qkv")
            put("", tiled(t[f"{a}.in_proj_z.weight"], dv), name=f"blk.{l}.attn_gate")
            put("", tiled(t[f"{a}.in_proj_b.weight"], 1), name=f"blk.{l}.ssm_beta")
            put("", tiled(t[f"{a}.in_proj_a.weight"], 1), name=f"blk.{l}.ssm_alpha")
            conv = t[f"{a}.conv1d.weight"].squeeze(1)
            put(f"{a}.conv1d", np.concatenate([conv[:2 * kd], tiled(conv[2 * kd:], dv)]))
            put(f"{a}.A_log", tiled(-np.exp(t[f"{a}.A_log"]), 1), suffix="")
            put(f"{a}.dt_proj", tiled(t[f"{a}.dt_bias"], 1), ".bias")
            put(f"{a}.norm", t[f"{a}.norm.weight"])
            put(f"{a}.out_proj", tiled(t[f"{a}.out_proj.weight"], dv, axis=1))
        elif types[l] == "linear_attention":
            a = f"{p}.linear_attn"
            qkvz = t[f"{a}.in_proj_qkvz.weight"]  # (nk * (2dk + 2 r dv), hidden)
            g = qkvz.reshape(nk, 2 * dk + 2 * r * dv, -1)
            q, k = g[:, :dk], g[:, dk:2 * dk]
            v, z = g[:, 2 * dk:2 * dk + r * dv], g[:, 2 * dk + r * dv:]
            h = qkvz.shape[1]
            qkv = np.concatenate([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)])
            put("", qkv, name=f"blk.{l}.attn_qkv")
            put("", z.reshape(-1, h), name=f"blk.{l}.attn_gate")
            put(f"{a}.in_proj_ba", t[f"{a}.in_proj_ba.weight"])
            put(f"{a}.conv1d", t[f"{a}.conv1d.weight"].squeeze(1))
            put(f"{a}.A_log", -np.exp(t[f"{a}.A_log"]), suffix="")
            put(f"{a}.dt_proj", t[f"{a}.dt_bias"], ".bias")
            put(f"{a}.norm", t[f"{a}.norm.weight"])
            put(f"{a}.out_proj", t[f"{a}.out_proj.weight"])
        else:
            s = f"{p}.self_attn"
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                put(f"{s}.{proj}", t[f"{s}.{proj}.weight"])
            put(f"{s}.q_norm", t[f"{s}.q_norm.weight"] + 1)
            put(f"{s}.k_norm", t[f"{s}.k_norm.weight"] + 1)
        m = f"{p}.mlp"
        if l in dense:
            for proj, gn in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                put("", t[f"{m}.{proj}.weight"], name=f"blk.{l}.{gn}")
            continue
        put(f"{m}.gate", t[f"{m}.gate.weight"])
        put(f"{m}.shared_expert_gate", t[f"{m}.shared_expert_gate.weight"])
        for proj in ("gate_proj", "up_proj", "down_proj"):
            put(f"{m}.shared_expert.{proj}", t[f"{m}.shared_expert.{proj}.weight"])
            stack = np.stack([t[f"{m}.experts.{e}.{proj}.weight"] for e in range(c["num_experts"])])
            put(f"{m}.experts.{proj}", stack)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
