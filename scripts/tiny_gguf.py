#!/usr/bin/env python3
"""Write sluice's built-in model as a GGUF (`deepseek2`, Q8_0 matrices, F32 norms and routers)
from the checkpoint scripts/train_tiny_moe.py saved, with its tokenizer and chat template.

Tensor names, shapes and metadata keys are llama.cpp's for deepseek2 (as its converter writes
them: attn_kv_b split into attn_k_b [heads, kv_lora, nope] and attn_v_b [heads, v, kv_lora],
experts stacked, the MTP layer as blk.{L}.nextn.*). Quantization is the `gguf` package's own
Q8_0 (the reference sluice's dequantization is tested against). Needs numpy, safetensors, gguf.

  python3 scripts/tiny_gguf.py --ckpt CKPT_DIR --tokenizer .tinydata --out assets/sluice-tiny-moe.gguf
  python3 scripts/tiny_gguf.py ... --dequant-out DIR   also write the GGUF's dequantized weights
                                                        as a float32 checkpoint (for references)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file, save_file

Q8 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32


def load_ckpt(d: Path) -> dict:
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    sd = {}
    for f in sorted(set(idx["weight_map"].values())):
        sd.update(load_file(str(d / f)))
    return sd


def tokenizer_meta(tok_dir: Path) -> dict:
    tj = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tc = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab = dict(tj["model"]["vocab"])
    types = {}
    for at in tj["added_tokens"]:
        vocab[at["content"]] = at["id"]
        types[at["id"]] = gguf.TokenType.CONTROL if at["special"] else gguf.TokenType.USER_DEFINED
    n = max(vocab.values()) + 1
    tokens = [None] * n
    for t, i in vocab.items():
        tokens[i] = t
    assert all(t is not None for t in tokens), "vocabulary has holes"
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in tj["model"]["merges"]]
    return {
        "tokens": tokens, "types": [int(types.get(i, gguf.TokenType.NORMAL)) for i in range(n)],
        "merges": merges, "bos": vocab[tc["bos_token"]], "eos": vocab[tc["eos_token"]],
        "pad": vocab[tc["pad_token"]], "add_bos": bool(tc["add_bos_token"]),
        "chat_template": tc["chat_template"],
    }


def gguf_tensors(sd: dict, cfg: dict) -> list[tuple[str, np.ndarray, bool]]:
    """(gguf name, float32 array outermost-first, quantize?)."""
    L = cfg["num_hidden_layers"]
    nh, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    kvl = cfg["kv_lora_rank"]
    out = [("token_embd.weight", sd["model.embed_tokens.weight"], True)]
    for l in range(L + cfg.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{l}."
        b = f"blk.{l}."
        out += [
            (b + "attn_norm.weight", sd[p + "input_layernorm.weight"], False),
            (b + "attn_q_a_norm.weight", sd[p + "self_attn.q_a_layernorm.weight"], False),
            (b + "attn_kv_a_norm.weight", sd[p + "self_attn.kv_a_layernorm.weight"], False),
            (b + "attn_q_a.weight", sd[p + "self_attn.q_a_proj.weight"], True),
            (b + "attn_q_b.weight", sd[p + "self_attn.q_b_proj.weight"], True),
            (b + "attn_kv_a_mqa.weight", sd[p + "self_attn.kv_a_proj_with_mqa.weight"], True),
        ]
        kvb = sd[p + "self_attn.kv_b_proj.weight"].reshape(nh, nope + v, kvl)
        out += [
            (b + "attn_k_b.weight", np.ascontiguousarray(kvb[:, :nope, :].transpose(0, 2, 1)), True),
            (b + "attn_v_b.weight", np.ascontiguousarray(kvb[:, nope:, :]), True),
            (b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"], True),
            (b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], False),
        ]
        if l < cfg["first_k_dense_replace"]:
            for n in ("gate", "up", "down"):
                out.append((b + f"ffn_{n}.weight", sd[p + f"mlp.{n}_proj.weight"], True))
        else:
            E = cfg["n_routed_experts"]
            out += [
                (b + "ffn_gate_inp.weight", sd[p + "mlp.gate.weight"], False),
                (b + "exp_probs_b.bias", sd[p + "mlp.gate.e_score_correction_bias"], False),
            ]
            for n in ("gate", "up", "down"):
                stack = np.stack([sd[p + f"mlp.experts.{e}.{n}_proj.weight"] for e in range(E)])
                out.append((b + f"ffn_{n}_exps.weight", stack, True))
            for n in ("gate", "up", "down"):
                out.append((b + f"ffn_{n}_shexp.weight", sd[p + f"mlp.shared_experts.{n}_proj.weight"], True))
        if l >= L:
            out += [
                (b + "nextn.eh_proj.weight", sd[p + "eh_proj.weight"], True),
                (b + "nextn.enorm.weight", sd[p + "enorm.weight"], False),
                (b + "nextn.hnorm.weight", sd[p + "hnorm.weight"], False),
                (b + "nextn.shared_head_norm.weight", sd[p + "shared_head.norm.weight"], False),
            ]
    out += [
        ("output_norm.weight", sd["model.norm.weight"], False),
        ("output.weight", sd["lm_head.weight"], True),
    ]
    return [(n, np.ascontiguousarray(a, dtype=np.float32), q) for n, a, q in out]


def write(ckpt: Path, tok_dir: Path, path: Path, name: str, dequant_out: Path | None, f32: bool = False) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    sd = load_ckpt(ckpt)
    tok = tokenizer_meta(tok_dir)
    assert len(tok["tokens"]) == cfg["vocab_size"], (len(tok["tokens"]), cfg["vocab_size"])
    arch = "deepseek2"
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(name)
    w.add_type("model")
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if f32 else gguf.LlamaFileType.MOSTLY_Q8_0)
    mtp = cfg.get("num_nextn_predict_layers", 0)
    u = lambda k, val: w.add_uint32(f"{arch}.{k}", int(val))  # noqa: E731
    f = lambda k, val: w.add_float32(f"{arch}.{k}", float(val))  # noqa: E731
    u("context_length", cfg["max_position_embeddings"])
    u("embedding_length", cfg["hidden_size"])
    u("block_count", cfg["num_hidden_layers"] + mtp)
    u("nextn_predict_layers", mtp)
    u("vocab_size", cfg["vocab_size"])
    u("feed_forward_length", cfg["intermediate_size"])
    u("attention.head_count", cfg["num_attention_heads"])
    u("attention.head_count_kv", 1)
    u("attention.key_length", cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    u("attention.value_length", cfg["kv_lora_rank"])
    u("attention.key_length_mla", cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    u("attention.value_length_mla", cfg["v_head_dim"])
    u("attention.q_lora_rank", cfg["q_lora_rank"])
    u("attention.kv_lora_rank", cfg["kv_lora_rank"])
    u("rope.dimension_count", cfg["qk_rope_head_dim"])
    rope = cfg.get("rope_parameters") or {}
    assert rope.get("rope_type", "default") == "default", "only plain rope is exported"
    f("rope.freq_base", rope.get("rope_theta", 10000.0))
    f("attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    u("expert_count", cfg["n_routed_experts"])
    u("expert_used_count", cfg["num_experts_per_tok"])
    u("expert_shared_count", cfg["n_shared_experts"])
    u("expert_feed_forward_length", cfg["moe_intermediate_size"])
    u("leading_dense_block_count", cfg["first_k_dense_replace"])
    f("expert_weights_scale", cfg["routed_scaling_factor"])
    w.add_bool(f"{arch}.expert_weights_norm", bool(cfg["norm_topk_prob"]))
    u("expert_gating_func", 2)  # sigmoid
    u("expert_group_count", cfg["n_group"])
    u("expert_group_used_count", cfg["topk_group"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    w.add_pad_token_id(tok["pad"])
    w.add_add_bos_token(tok["add_bos"])
    w.add_chat_template(tok["chat_template"])

    deq = {}
    for tname, arr, quant in gguf_tensors(sd, cfg):
        if quant and not f32:
            data = gguf.quants.quantize(arr, Q8)
            w.add_tensor(tname, data, raw_dtype=Q8)
            deq[tname] = gguf.quants.dequantize(data, Q8).reshape(arr.shape)
        else:
            w.add_tensor(tname, arr, raw_dtype=F32)
            deq[tname] = arr
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    print(f"wrote {path} ({path.stat().st_size} bytes, {len(deq)} tensors)")
    if dequant_out is not None:
        write_dequant_checkpoint(deq, cfg, ckpt, dequant_out)


def write_dequant_checkpoint(deq: dict, cfg: dict, ckpt: Path, out: Path) -> None:
    """The GGUF's own (dequantized) weights back under DeepSeek-V3 checkpoint names."""
    out.mkdir(parents=True, exist_ok=True)
    sd0 = load_ckpt(ckpt)
    inv = {}
    L = cfg["num_hidden_layers"]
    nh, nope, v, kvl = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    # map each checkpoint tensor through the same table, then substitute dequantized values
    for tname, arr, _q in gguf_tensors(sd0, cfg):
        inv[tname] = arr.shape
    sd = {}
    for k, a in sd0.items():
        sd[k] = a.copy()
    table = {n: a for n, a in deq.items()}
    for l in range(L + cfg.get("num_nextn_predict_layers", 0)):
        p, b = f"model.layers.{l}.", f"blk.{l}."
        pairs = [("input_layernorm.weight", "attn_norm.weight"), ("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"),
                 ("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"), ("self_attn.q_a_proj.weight", "attn_q_a.weight"),
                 ("self_attn.q_b_proj.weight", "attn_q_b.weight"), ("self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"),
                 ("self_attn.o_proj.weight", "attn_output.weight"), ("post_attention_layernorm.weight", "ffn_norm.weight")]
        kb = table[b + "attn_k_b.weight"].transpose(0, 2, 1)  # [nh, nope, kvl]
        vb = table[b + "attn_v_b.weight"]  # [nh, v, kvl]
        sd[p + "self_attn.kv_b_proj.weight"] = np.concatenate([kb, vb], axis=1).reshape(nh * (nope + v), kvl)
        if l < cfg["first_k_dense_replace"]:
            pairs += [(f"mlp.{n}_proj.weight", f"ffn_{n}.weight") for n in ("gate", "up", "down")]
        else:
            pairs += [("mlp.gate.weight", "ffn_gate_inp.weight"), ("mlp.gate.e_score_correction_bias", "exp_probs_b.bias")]
            pairs += [(f"mlp.shared_experts.{n}_proj.weight", f"ffn_{n}_shexp.weight") for n in ("gate", "up", "down")]
            for n in ("gate", "up", "down"):
                st = table[b + f"ffn_{n}_exps.weight"]
                for e in range(st.shape[0]):
                    sd[p + f"mlp.experts.{e}.{n}_proj.weight"] = st[e]
        if l >= L:
            pairs += [("eh_proj.weight", "nextn.eh_proj.weight"), ("enorm.weight", "nextn.enorm.weight"),
                      ("hnorm.weight", "nextn.hnorm.weight"), ("shared_head.norm.weight", "nextn.shared_head_norm.weight")]
        for hf, gg in pairs:
            sd[p + hf] = table[b + gg]
    sd["model.embed_tokens.weight"] = table["token_embd.weight"]
    sd["model.norm.weight"] = table["output_norm.weight"]
    sd["lm_head.weight"] = table["output.weight"]
    sd = {k: np.ascontiguousarray(a, dtype=np.float32) for k, a in sd.items()}
    for k in sd0:
        assert sd[k].shape == sd0[k].shape, k
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((ckpt / "config.json").read_text())
    print(f"dequantized checkpoint: {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tokenizer", default=".tinydata")
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="sluice-tiny-moe")
    ap.add_argument("--dequant-out")
    ap.add_argument("--f32", action="store_true", help="no quantization (to check the layout)")
    a = ap.parse_args()
    write(Path(a.ckpt), Path(a.tokenizer), Path(a.out), a.name, Path(a.dequant_out) if a.dequant_out else None, a.f32)


if __name__ == "__main__":
    main()
