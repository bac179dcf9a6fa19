#!/usr/bin/env python3
"""Write a DeepSeek-V4 checkpoint (transformers' `save_pretrained` layout, float) as a GGUF with
the names and keys llama.cpp uses for architecture `deepseek4`.

Why not llama.cpp's converter itself: convert_hf_to_gguf.py's DeepseekV4Model
(conversion/deepseek.py in the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp, see
scripts/fetch_llama_cpp_converter.py) needs torch, expects DeepSeek's own release layout
(`embed.weight`, `attn.kv_norm.weight`, `hc_head_fn`, `compress_ratios`, `num_hash_layers`,
`rope_scaling`) and routed experts as FP4 `weight` + E8M0 `scale` pairs, which it repacks to
MXFP4 (a float expert raises KeyError there). A float test fixture can't go through it, so this
script writes what it writes, with the same names, keys and transforms, reading the
safetensors with numpy only:
  - keys (DeepseekV4Model.set_gguf_parameters and TextModel.set_gguf_parameters): block_count,
    context_length, embedding_length, attention.head_count(_kv), rope.freq_base (the main
    rope), attention.layer_norm_rms_epsilon, expert_count, expert_used_count,
    expert_gating_func, attention.key_length / value_length (head_dim), rope.scaling.* (YaRN
    of the compressed layers, from `rope_scaling`), rope.dimension_count (qk_rope_head_dim),
    attention.q_lora_rank, attention.sliding_window, expert_feed_forward_length,
    expert_shared_count, expert_weights_scale, expert_weights_norm, swiglu_clamp_exp and
    swiglu_clamp_shexp (one value per layer), attention.indexer.{head_count, key_length,
    top_k}, attention.output_group_count, attention.output_lora_rank,
    attention.compress_ratios (0 sliding, 4 CSA, else HCA), attention.compress_rope_freq_base,
    hyper_connection.{count, sinkhorn_iterations, epsilon}, hash_layer_count,
    embedding_length_out (hc_mult * hidden);
  - tensors: DeepseekV4Model._map_dsv4_tensor_name (the table TENSORS below, gguf-py's
    MODEL_ARCH.DEEPSEEK4 names); routed experts stacked per layer into ffn_{gate,up,down}_exps
    (F32 here, MXFP4 in the converter); `tid2eid` as I32; the router bias of hash layers
    dropped; no other layout change (GGUF stores dims reversed, as always).
The pip `gguf` package writes the file (only generic writer calls; its constants lack
DEEPSEEK4). `--check GGUF_PY_DIR` compares TENSORS and KEYS with llama.cpp's own gguf-py
(vendor/llama.cpp/gguf-py of the sdist) and fails on any difference. The tokenizer is not
written (tests feed ids).

Usage: python3 scripts/deepseek_v4_to_gguf.py MODEL_DIR OUT.gguf [--check GGUF_PY_DIR]
       [--experts f32|mxfp4|mxfp4-f32] [--drop KEY_SUFFIX]... [--set KEY_SUFFIX=INT]...
`--experts mxfp4` quantizes the routed experts to ggml MXFP4 with gguf's quantizer (the type the
converter writes; the float weights are rounded), `mxfp4-f32` writes those rounded values back
as F32 (the twin to compare an MXFP4 run with). `--drop` / `--set` edit the keys, for tests of
what sluice refuses.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

import numpy as np

ARCH = "deepseek4"
DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}

# transformers / DeepSeek tensor name (after `model.` and `layers.{l}.`) -> (gguf-py
# MODEL_TENSOR, GGUF name without the `blk.{l}.` prefix): DeepseekV4Model._map_dsv4_tensor_name.
ROOT = {
    "embed_tokens.weight": ("TOKEN_EMBD", "token_embd.weight"),
    "embed.weight": ("TOKEN_EMBD", "token_embd.weight"),
    "norm.weight": ("OUTPUT_NORM", "output_norm.weight"),
    "head.weight": ("OUTPUT", "output.weight"),
    "lm_head.weight": ("OUTPUT", "output.weight"),
    "hc_head.hc_fn": ("HC_HEAD_FN", "output_hc_fn.weight"),
    "hc_head.hc_base": ("HC_HEAD_BASE", "output_hc_base.weight"),
    "hc_head.hc_scale": ("HC_HEAD_SCALE", "output_hc_scale.weight"),
    "hc_head_fn": ("HC_HEAD_FN", "output_hc_fn.weight"),
    "hc_head_base": ("HC_HEAD_BASE", "output_hc_base.weight"),
    "hc_head_scale": ("HC_HEAD_SCALE", "output_hc_scale.weight"),
}
LAYER = {
    "hc_attn_fn": ("HC_ATTN_FN", "hc_attn_fn.weight"),
    "hc_attn_base": ("HC_ATTN_BASE", "hc_attn_base.weight"),
    "hc_attn_scale": ("HC_ATTN_SCALE", "hc_attn_scale.weight"),
    "hc_ffn_fn": ("HC_FFN_FN", "hc_ffn_fn.weight"),
    "hc_ffn_base": ("HC_FFN_BASE", "hc_ffn_base.weight"),
    "hc_ffn_scale": ("HC_FFN_SCALE", "hc_ffn_scale.weight"),
    "attn.attn_sink": ("ATTN_SINKS", "attn_sinks.weight"),
    "attn.wq_a.weight": ("ATTN_Q_A", "attn_q_a.weight"),
    "attn.wq_b.weight": ("ATTN_Q_B", "attn_q_b.weight"),
    "attn.q_norm.weight": ("ATTN_Q_A_NORM", "attn_q_a_norm.weight"),
    "attn.wkv.weight": ("ATTN_KV", "attn_kv.weight"),
    "attn.kv_norm.weight": ("ATTN_KV_NORM", "attn_kv_a_norm.weight"),
    "attn.norm.weight": ("ATTN_KV_NORM", "attn_kv_a_norm.weight"),  # transformers' name
    "attn.wo_a.weight": ("ATTN_OUT_A", "attn_output_a.weight"),
    "attn.wo_b.weight": ("ATTN_OUT_B", "attn_output_b.weight"),
    "attn.compressor.ape": ("ATTN_COMPRESSOR_APE", "attn_compressor_ape.weight"),
    "attn.compressor.wkv.weight": ("ATTN_COMPRESSOR_WKV", "attn_compressor_kv.weight"),
    "attn.compressor.wgate.weight": ("ATTN_COMPRESSOR_WGATE", "attn_compressor_gate.weight"),
    "attn.compressor.norm.weight": ("ATTN_COMPRESSOR_NORM", "attn_compressor_norm.weight"),
    "attn.indexer.wq_b.weight": ("INDEXER_ATTN_Q_B", "indexer.attn_q_b.weight"),
    "attn.indexer.weights_proj.weight": ("INDEXER_PROJ", "indexer.proj.weight"),
    "attn.indexer.compressor.ape": ("INDEXER_COMPRESSOR_APE", "indexer_compressor_ape.weight"),
    "attn.indexer.compressor.wkv.weight": ("INDEXER_COMPRESSOR_WKV", "indexer_compressor_kv.weight"),
    "attn.indexer.compressor.wgate.weight": ("INDEXER_COMPRESSOR_WGATE", "indexer_compressor_gate.weight"),
    "attn.indexer.compressor.norm.weight": ("INDEXER_COMPRESSOR_NORM", "indexer_compressor_norm.weight"),
    "attn_norm.weight": ("ATTN_NORM", "attn_norm.weight"),
    "ffn_norm.weight": ("FFN_NORM", "ffn_norm.weight"),
    "ffn.gate.weight": ("FFN_GATE_INP", "ffn_gate_inp.weight"),
    "ffn.gate.bias": ("FFN_EXP_PROBS_B", "exp_probs_b.bias"),
    "ffn.gate.tid2eid": ("FFN_GATE_TID2EID", "ffn_gate_tid2eid.weight"),
    "ffn.shared_experts.w1.weight": ("FFN_GATE_SHEXP", "ffn_gate_shexp.weight"),
    "ffn.shared_experts.w2.weight": ("FFN_DOWN_SHEXP", "ffn_down_shexp.weight"),
    "ffn.shared_experts.w3.weight": ("FFN_UP_SHEXP", "ffn_up_shexp.weight"),
}
# routed experts w1 / w3 / w2 -> stacked
EXPERTS = {"w1": ("FFN_GATE_EXP", "ffn_gate_exps.weight"),
           "w3": ("FFN_UP_EXP", "ffn_up_exps.weight"),
           "w2": ("FFN_DOWN_EXP", "ffn_down_exps.weight")}
# key suffix (after `deepseek4.`) -> gguf-py Keys attribute path
KEYS = {
    "block_count": "LLM.BLOCK_COUNT",
    "context_length": "LLM.CONTEXT_LENGTH",
    "embedding_length": "LLM.EMBEDDING_LENGTH",
    "attention.head_count": "Attention.HEAD_COUNT",
    "attention.head_count_kv": "Attention.HEAD_COUNT_KV",
    "rope.freq_base": "Rope.FREQ_BASE",
    "attention.layer_norm_rms_epsilon": "Attention.LAYERNORM_RMS_EPS",
    "expert_count": "LLM.EXPERT_COUNT",
    "expert_used_count": "LLM.EXPERT_USED_COUNT",
    "expert_gating_func": "LLM.EXPERT_GATING_FUNC",
    "attention.key_length": "Attention.KEY_LENGTH",
    "attention.value_length": "Attention.VALUE_LENGTH",
    "rope.scaling.type": "Rope.SCALING_TYPE",
    "rope.scaling.factor": "Rope.SCALING_FACTOR",
    "rope.scaling.original_context_length": "Rope.SCALING_ORIG_CTX_LEN",
    "rope.scaling.yarn_attn_factor": "Rope.SCALING_YARN_ATTN_FACTOR",
    "rope.scaling.yarn_beta_fast": "Rope.SCALING_YARN_BETA_FAST",
    "rope.scaling.yarn_beta_slow": "Rope.SCALING_YARN_BETA_SLOW",
    "rope.dimension_count": "Rope.DIMENSION_COUNT",
    "attention.q_lora_rank": "Attention.Q_LORA_RANK",
    "attention.sliding_window": "Attention.SLIDING_WINDOW",
    "expert_feed_forward_length": "LLM.EXPERT_FEED_FORWARD_LENGTH",
    "expert_shared_count": "LLM.EXPERT_SHARED_COUNT",
    "expert_weights_scale": "LLM.EXPERT_WEIGHTS_SCALE",
    "expert_weights_norm": "LLM.EXPERT_WEIGHTS_NORM",
    "swiglu_clamp_exp": "LLM.SWIGLU_CLAMP_EXP",
    "swiglu_clamp_shexp": "LLM.SWIGLU_CLAMP_SHEXP",
    "attention.indexer.head_count": "Attention.Indexer.HEAD_COUNT",
    "attention.indexer.key_length": "Attention.Indexer.KEY_LENGTH",
    "attention.indexer.top_k": "Attention.Indexer.TOP_K",
    "attention.output_group_count": "Attention.OUTPUT_GROUP_COUNT",
    "attention.output_lora_rank": "Attention.OUTPUT_LORA_RANK",
    "attention.compress_ratios": "Attention.COMPRESS_RATIOS",
    "attention.compress_rope_freq_base": "Attention.COMPRESS_ROPE_FREQ_BASE",
    "hyper_connection.count": "HyperConnection.COUNT",
    "hyper_connection.sinkhorn_iterations": "HyperConnection.SINKHORN_ITERATIONS",
    "hyper_connection.epsilon": "HyperConnection.EPSILON",
    "hash_layer_count": "LLM.HASH_LAYER_COUNT",
    "embedding_length_out": "LLM.EMBEDDING_LENGTH_OUT",
}
GATING = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 4}  # gguf ExpertGatingFuncType


def check(gguf_py: str) -> None:
    """Fail unless TENSORS and KEYS are llama.cpp gguf-py's names for DEEPSEEK4."""
    sys.path.insert(0, gguf_py)
    for m in [m for m in sys.modules if m == "gguf" or m.startswith("gguf.")]:
        del sys.modules[m]
    import gguf as g  # llama.cpp's own
    arch = g.MODEL_ARCH.DEEPSEEK4
    assert g.MODEL_ARCH_NAMES[arch] == ARCH
    allowed = set(g.MODEL_TENSORS[arch])
    bad = []
    for key, name in list(ROOT.values()) + list(LAYER.values()) + list(EXPERTS.values()):
        t = g.MODEL_TENSOR[key]
        want = g.TENSOR_NAMES[t].replace("blk.{bid}.", "")
        if t not in allowed or name.rsplit(".", 1)[0] != want:
            bad.append(f"{key}: ours {name}, gguf-py {want}")
    for suffix, path in KEYS.items():
        v = g.Keys
        for part in path.split("."):
            v = getattr(v, part)
        if v.format(arch=ARCH) != f"{ARCH}.{suffix}":
            bad.append(f"key {suffix}: gguf-py {v.format(arch=ARCH)}")
    for name, value in GATING.items():
        if g.ExpertGatingFuncType[name.upper()].value != value:
            bad.append(f"gating {name}")
    if bad:
        raise SystemExit("differs from llama.cpp's gguf-py:\n" + "\n".join(bad))
    print(f"names and keys match llama.cpp gguf-py at {gguf_py}")


def read_safetensors(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        s, e = t["data_offsets"]
        out[name] = np.frombuffer(raw[base + s:base + e], dtype=DTYPES[t["dtype"]]).reshape(t["shape"])
    return out


def layer_kinds(cfg: dict) -> tuple[list[int], int]:
    """compress_ratios per layer and the hash layer count, from either config layout."""
    n = cfg["num_hidden_layers"]
    if "compress_ratios" in cfg:
        ratios = list(cfg["compress_ratios"])
    else:
        rates = cfg.get("compress_rates", {})
        rate = {"sliding_attention": 0,
                "compressed_sparse_attention": rates.get("compressed_sparse_attention", 4),
                "heavily_compressed_attention": rates.get("heavily_compressed_attention", 128)}
        ratios = [rate[t] for t in cfg["layer_types"]]
    if "num_hash_layers" in cfg:
        hashed = cfg["num_hash_layers"]
    else:
        kinds = cfg["mlp_layer_types"]
        hashed = sum(1 for t in kinds if t == "hash_moe")
        assert kinds == ["hash_moe"] * hashed + ["moe"] * (n - hashed), "hash layers must lead"
    return ratios, hashed


def main() -> None:
    args = sys.argv[1:]
    if "--check" in args:
        i = args.index("--check")
        check(args[i + 1])
        del args[i:i + 2]
        for m in [m for m in sys.modules if m == "gguf" or m.startswith("gguf.")]:
            del sys.modules[m]
        sys.path.pop(0)
    experts_as = "f32"
    if "--experts" in args:
        i = args.index("--experts")
        experts_as = args[i + 1]
        del args[i:i + 2]
        assert experts_as in ("f32", "mxfp4", "mxfp4-f32"), experts_as
    drop: set[str] = set()
    extra: dict[str, int] = {}
    while "--drop" in args or "--set" in args:
        opt = "--drop" if "--drop" in args else "--set"
        i = args.index(opt)
        if opt == "--drop":
            drop.add(args[i + 1])
        else:
            key, value = args[i + 1].split("=")
            extra[key] = int(value)
        del args[i:i + 2]
    if len(args) != 2:
        raise SystemExit(__doc__)
    src, out = Path(args[0]), Path(args[1])
    import gguf  # the writer (pip package)

    cfg = json.loads((src / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    ratios, hashed = layer_kinds(cfg)
    # transformers folds a CSA rate other than 4 into layer_types; llama.cpp tells CSA by ratio 4
    if any(r not in (0, 4) for r, t in zip(ratios, cfg.get("layer_types", [])) if t == "compressed_sparse_attention"):
        raise SystemExit("compressed_sparse_attention with a rate other than 4 has no deepseek4 GGUF form")
    rp = cfg.get("rope_parameters") or {}
    main_rope = rp.get("main", {})
    compress = cfg.get("rope_scaling") or rp.get("compress") or {}
    hd = cfg["head_dim"]

    w = gguf.GGUFWriter(str(out), ARCH)
    if drop or extra:
        real = {m: getattr(w, m) for m in ("add_uint32", "add_float32", "add_bool", "add_array", "add_string")}
        for m, fn in real.items():
            setattr(w, m, lambda key, v, fn=fn: None if key.removeprefix(f"{ARCH}.") in drop else fn(key, v))
    k = lambda s: f"{ARCH}.{s}"  # noqa: E731
    w.add_uint32(k("block_count"), n)
    w.add_uint32(k("context_length"), cfg["max_position_embeddings"])
    w.add_uint32(k("embedding_length"), cfg["hidden_size"])
    w.add_uint32(k("attention.head_count"), cfg["num_attention_heads"])
    w.add_uint32(k("attention.head_count_kv"), cfg["num_key_value_heads"])
    w.add_float32(k("rope.freq_base"), main_rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_float32(k("attention.layer_norm_rms_epsilon"), cfg["rms_norm_eps"])
    w.add_uint32(k("expert_count"), cfg["n_routed_experts"])
    w.add_uint32(k("expert_used_count"), cfg["num_experts_per_tok"])
    w.add_uint32(k("expert_gating_func"), GATING[cfg.get("scoring_func", "sqrtsoftplus")])
    w.add_uint32(k("attention.key_length"), hd)
    w.add_uint32(k("attention.value_length"), hd)
    if compress.get("rope_type", compress.get("type")) == "yarn":
        w.add_string(k("rope.scaling.type"), "yarn")
        w.add_float32(k("rope.scaling.factor"), compress["factor"])
        w.add_uint32(k("rope.scaling.original_context_length"), compress["original_max_position_embeddings"])
        if "attention_factor" in compress:
            w.add_float32(k("rope.scaling.yarn_attn_factor"), compress["attention_factor"])
        if "beta_fast" in compress:
            w.add_float32(k("rope.scaling.yarn_beta_fast"), compress["beta_fast"])
        if "beta_slow" in compress:
            w.add_float32(k("rope.scaling.yarn_beta_slow"), compress["beta_slow"])
    w.add_uint32(k("rope.dimension_count"), cfg["qk_rope_head_dim"])
    w.add_uint32(k("attention.q_lora_rank"), cfg["q_lora_rank"])
    w.add_uint32(k("attention.sliding_window"), cfg["sliding_window"])
    w.add_uint32(k("expert_feed_forward_length"), cfg["moe_intermediate_size"])
    w.add_uint32(k("expert_shared_count"), cfg["n_shared_experts"])
    w.add_float32(k("expert_weights_scale"), cfg["routed_scaling_factor"])
    w.add_bool(k("expert_weights_norm"), cfg["norm_topk_prob"])
    w.add_array(k("swiglu_clamp_exp"), [float(cfg["swiglu_limit"])] * n)
    w.add_array(k("swiglu_clamp_shexp"), [float(cfg["swiglu_limit"])] * n)
    w.add_uint32(k("attention.indexer.head_count"), cfg["index_n_heads"])
    w.add_uint32(k("attention.indexer.key_length"), cfg["index_head_dim"])
    w.add_uint32(k("attention.indexer.top_k"), cfg["index_topk"])
    w.add_uint32(k("attention.output_group_count"), cfg["o_groups"])
    w.add_uint32(k("attention.output_lora_rank"), cfg["o_lora_rank"])
    w.add_array(k("attention.compress_ratios"), ratios)
    w.add_float32(k("attention.compress_rope_freq_base"), rp.get("compress", {}).get("rope_theta", cfg.get("compress_rope_theta", 160000.0)))
    w.add_uint32(k("hyper_connection.count"), cfg["hc_mult"])
    w.add_uint32(k("hyper_connection.sinkhorn_iterations"), cfg["hc_sinkhorn_iters"])
    w.add_float32(k("hyper_connection.epsilon"), cfg["hc_eps"])
    w.add_uint32(k("hash_layer_count"), hashed)
    w.add_uint32(k("embedding_length_out"), cfg["hidden_size"] * cfg["hc_mult"])
    for key, value in extra.items():
        w.add_uint32(k(key), value)

    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(read_safetensors(f))
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, a in tensors.items():
        rel = name.removeprefix("model.")
        if rel.startswith("mtp."):
            continue  # the converter skips MTP layers by default
        if rel in ROOT:
            w.add_tensor(ROOT[rel][1], np.ascontiguousarray(a, dtype=np.float32))
            continue
        m = re.match(r"layers\.(\d+)\.(.+)$", rel)
        if m is None:
            raise SystemExit(f"unsupported DeepSeek-V4 tensor {name!r}")
        l, rest = int(m.group(1)), m.group(2)
        if (e := re.match(r"ffn\.experts\.(\d+)\.(w[123])\.weight$", rest)) is not None:
            experts.setdefault((l, e.group(2)), {})[int(e.group(1))] = a
            continue
        if rest == "ffn.gate.bias" and l < hashed:
            continue  # hash layers route by tid2eid; the converter drops their bias
        if rest not in LAYER:
            raise SystemExit(f"unsupported DeepSeek-V4 tensor {name!r}")
        gname = f"blk.{l}.{LAYER[rest][1]}"
        if rest == "ffn.gate.tid2eid":
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.int32))
        else:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
    for (l, proj), per in sorted(experts.items()):
        stacked = np.stack([per[i] for i in range(len(per))]).astype(np.float32)
        name = f"blk.{l}.{EXPERTS[proj][1]}"
        if experts_as == "f32":
            w.add_tensor(name, stacked)
            continue
        mx = gguf.GGMLQuantizationType.MXFP4
        q = gguf.quants.quantize(stacked, mx)
        if experts_as == "mxfp4":
            w.add_tensor(name, q, raw_dtype=mx)
        else:
            w.add_tensor(name, gguf.quants.dequantize(q, mx).astype(np.float32))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out}: {len(tensors)} checkpoint tensors, compress_ratios {ratios}, {hashed} hash layers")


if __name__ == "__main__":
    main()
