#!/usr/bin/env python3
"""Write a gpt-oss checkpoint in the original OpenAI layout (MXFP4 expert `*_blocks`/`*_scales`)
as a GGUF with the names and keys llama.cpp uses for architecture `gpt-oss`.

What llama.cpp does, read from ggml-org/llama.cpp (conversion/gpt_oss.py at 2bbcf7fc93a4,
src/models/openai-moe-iswa.cpp at 5c880d94fc8e) and gguf-py 0.19.0 (constants.py: MODEL_ARCH.GPT_OSS
tensor list and names):
  - keys: the generic text-model ones (block_count, context_length, embedding_length,
    feed_forward_length, head_count(_kv), key/value_length, rope.freq_base,
    layer_norm_rms_epsilon, expert_count, expert_used_count, rope.scaling.{type, factor,
    original_context_length, yarn_beta_fast, yarn_beta_slow}) plus attention.sliding_window
    and expert_feed_forward_length;
  - tensors: gguf-py's name map for GPT_OSS; `sinks` gets a `.weight` suffix; gate_up is split
    into ffn_gate_exps (even rows) and ffn_up_exps (odd rows), weights and biases alike;
  - MXFP4 experts repacked to ggml's block (1 E8M0 byte, then 16 bytes whose low nibbles are
    values 0..15 and high nibbles values 16..31), from the checkpoint's bytes (low nibble = value
    2j, high = 2j+1).
`--experts f32` writes the experts dequantized to F32 instead (with gguf-py's own MXFP4
dequantizer), as the converter does for a checkpoint that is not MXFP4.
Reads safetensors with numpy only (no torch). The tokenizer is not written (tests feed ids).

Usage: python3 scripts/gptoss_to_gguf.py MODEL_DIR OUT.gguf [--experts mxfp4|f32]
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import gguf
import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "I32": np.int32}


def read_safetensors(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t["dtype"] == "BF16":
            a = np.frombuffer(raw, dtype=np.uint16, count=int(np.prod(t["shape"])), offset=base + t["data_offsets"][0])
            out[name] = (a.astype(np.uint32) << 16).view(np.float32).reshape(t["shape"])
            continue
        dt = DTYPES[t["dtype"]]
        s, e = t["data_offsets"]
        out[name] = np.frombuffer(raw[base + s:base + e], dtype=dt).reshape(t["shape"])
    return out


def repack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[E, rows, G, 16] checkpoint bytes + [E, rows, G] exponents -> [E, rows, G * 17] ggml MXFP4."""
    lo, hi = blocks & 0x0F, blocks >> 4
    vals = np.empty(blocks.shape[:-1] + (32,), dtype=np.uint8)
    vals[..., 0::2], vals[..., 1::2] = lo, hi
    qs = vals[..., :16] | (vals[..., 16:] << 4)
    out = np.concatenate([scales[..., None], qs], axis=-1)
    return np.ascontiguousarray(out.reshape(out.shape[0], out.shape[1], -1))


def main() -> None:
    args = sys.argv[1:]
    experts = "mxfp4"
    if "--experts" in args:
        i = args.index("--experts")
        experts = args[i + 1]
        del args[i:i + 2]
    src, out = Path(args[0]), Path(args[1])
    c = json.loads((src / "config.json").read_text())
    t = read_safetensors(src / "model.safetensors")
    arch = gguf.MODEL_ARCH.GPT_OSS
    n_layers = c["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, n_layers)
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    w.add_block_count(n_layers)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(rope.get("rope_theta", c.get("rope_theta", 150000.0)))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_sliding_window(c["sliding_window"])
    w.add_expert_feed_forward_length(c["intermediate_size"])

    def put(hf: str, data: np.ndarray, suffix: str = ".weight", raw=None):
        name = names.get_name(hf)
        if name is None:
            raise SystemExit(f"gguf-py has no GPT_OSS name for {hf}")
        if raw is None:
            w.add_tensor(name + suffix, np.ascontiguousarray(data, dtype=np.float32))
        else:
            w.add_tensor(name + suffix, data, raw_dtype=raw)

    put("model.embed_tokens", t["model.embed_tokens.weight"])
    put("model.norm", t["model.norm.weight"])
    put("lm_head", t["lm_head.weight"])
    for l in range(n_layers):
        p = f"model.layers.{l}"
        put(f"{p}.input_layernorm", t[f"{p}.input_layernorm.weight"])
        put(f"{p}.post_attention_layernorm", t[f"{p}.post_attention_layernorm.weight"])
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            put(f"{p}.self_attn.{proj}", t[f"{p}.self_attn.{proj}.weight"])
            put(f"{p}.self_attn.{proj}", t[f"{p}.self_attn.{proj}.bias"], ".bias")
        put(f"{p}.self_attn.sinks", t[f"{p}.self_attn.sinks"])
        put(f"{p}.mlp.router", t[f"{p}.mlp.router.weight"])
        put(f"{p}.mlp.router", t[f"{p}.mlp.router.bias"], ".bias")
        e = f"{p}.mlp.experts"
        gu_b, gu_s = t[f"{e}.gate_up_proj_blocks"], t[f"{e}.gate_up_proj_scales"]
        d_b, d_s = t[f"{e}.down_proj_blocks"], t[f"{e}.down_proj_scales"]
        parts = {
            "gate_proj": (gu_b[:, 0::2], gu_s[:, 0::2]),
            "up_proj": (gu_b[:, 1::2], gu_s[:, 1::2]),
            "down_proj": (d_b, d_s),
        }
        for proj, (b, s) in parts.items():
            packed = repack_mxfp4(b, s)
            if experts == "mxfp4":
                put(f"{e}.{proj}", packed, raw=gguf.GGMLQuantizationType.MXFP4)
            else:
                deq = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.MXFP4)
                put(f"{e}.{proj}", deq)
        gub = t[f"{e}.gate_up_proj_bias"]
        put(f"{e}.gate_proj", gub[:, 0::2], ".bias")
        put(f"{e}.up_proj", gub[:, 1::2], ".bias")
        put(f"{e}.down_proj", t[f"{e}.down_proj_bias"], ".bias")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
