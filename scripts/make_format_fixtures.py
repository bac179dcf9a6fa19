#!/usr/bin/env python3
"""Model-file fixtures for sluice's format/ readers, and what reference readers say about them.

Writes (deterministic, fixed seed):
  tests/fixtures/tiny-moe.gguf            qwen3moe MoE in llama.cpp's layout, written by the `gguf`
                                          package's GGUFWriter (mixed F32 / Q8_0 / Q4_K / Q6_K)
  tests/fixtures/format/split-0000N-of-00003.gguf
                                          a small model split in 3 shards by GGUFWriter's own
                                          split support (split.no / split.count / split.tensors.count)
  tests/fixtures/format/all-types.gguf    every metadata value type, incl. nested and typed arrays
  tests/fixtures/format/all-types-v2.gguf the same bytes with the version field set to 2 (v2 and v3
                                          share the little-endian layout)
  tests/fixtures/format/unknown-type.gguf all-types.gguf with one tensor's ggml type id patched to 99
  tests/fixtures/format/hf-deepseek/      DeepSeek-V3 layout: config.json, 2 safetensors shards +
                                          model.safetensors.index.json, FP8 E4M3 weights with
                                          128x128 `weight_scale_inv` block scales (safetensors pkg)
  tests/fixtures/format/hf-fused/         qwen3_moe in transformers-5 layout: fused 3-D experts
                                          (`mlp.experts.gate_up_proj`), BF16, one model.safetensors
  tests/fixtures/format/fp8-reference.f32 numpy/ml_dtypes dequantization of one FP8 tensor
  tests/fixtures/format/expected.json     tensor tables and metadata as GGUFReader / the safetensors
                                          package read them, per-expert and dequantization checksums
                                          (FNV-1a 64), and the numbers `sluice inspect` must print

Needs: pip install gguf numpy safetensors ml_dtypes
Usage: python3 scripts/make_format_fixtures.py
"""
import json
import struct
from importlib.metadata import version
from pathlib import Path

import ml_dtypes
import numpy as np
import gguf
from gguf import GGMLQuantizationType as T, GGUFValueType as V
from gguf.quants import dequantize, quantize
from safetensors import safe_open
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests/fixtures"
OUT = FIX / "format"

rng = np.random.default_rng(20261203)


# ---------------------------------------------------------------------------------------------
# helpers


def fnv1a64(data: bytes) -> str:
    """FNV-1a 64-bit, as hex (the Rust tests compute the same)."""
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def f16_bytes(lo, hi, n):
    v = rng.uniform(lo, hi, n) * rng.choice([-1.0, 1.0], n)
    return v.astype("<f2").view(np.uint8).reshape(n, 2)


def kquant_blocks(t, shape):
    """Random but valid blocks of a k-quant for a tensor of float `shape` (outermost first):
    random bytes, with the f16 scale fields set to moderate finite values as a quantizer would."""
    block, size = gguf.GGML_QUANT_SIZES[t]
    n = int(np.prod(shape))
    nb = n // block
    b = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    if t == T.Q4_K:  # d dmin scales[12] qs[128]
        b[:, 0:2] = f16_bytes(1e-3, 0.05, nb)
        b[:, 2:4] = f16_bytes(1e-3, 0.05, nb)
    elif t == T.Q6_K:  # ql[128] qh[64] scales[16] d
        b[:, 208:210] = f16_bytes(1e-3, 0.05, nb)
    else:
        raise SystemExit(f"no generator for {t.name}")
    return b.reshape(*shape[:-1], shape[-1] // block * size)


def tensor_data(t, shape):
    """(numpy array to hand GGUFWriter, raw_dtype) for a tensor of float `shape`."""
    if t == T.F32:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32), None
    if t == T.F16:
        return (rng.standard_normal(shape) * 0.1).astype(np.float16), None
    if t in (T.Q8_0, T.Q4_0):
        return quantize((rng.standard_normal(shape) * 0.1).astype(np.float32), t), t
    return kquant_blocks(t, shape), t


def value_type_name(vt):
    return V(vt).name


def gguf_metadata(reader):
    """Metadata as GGUFReader reads it: [{key, type, (elem), value}], GGUF.* pseudo-fields skipped."""
    out = []
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        entry = {"key": key, "type": value_type_name(f.types[0])}
        if f.types[0] == V.ARRAY:
            entry["elem"] = value_type_name(f.types[1]) if len(f.types) > 1 else None
            if len(f.types) > 1 and f.types[1] == V.ARRAY:
                entry["value"] = None  # GGUFReader flattens nested arrays; see NESTED below
            else:
                entry["value"] = f.contents()
        else:
            entry["value"] = f.contents()
        out.append(entry)
    return out


def gguf_tensors(reader, file_index, with_checksums=True):
    out = []
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape.tolist())]  # outermost first
        e = {
            "name": t.name,
            "type": T(t.tensor_type).name,
            "type_id": int(t.tensor_type),
            "shape": shape,
            "file": file_index,
            "offset": int(t.data_offset),
            "n_bytes": int(t.n_bytes),
        }
        if with_checksums:
            raw = np.ascontiguousarray(t.data)
            e["fnv"] = fnv1a64(raw.tobytes())
            if "_exps." in t.name and len(shape) == 3:
                # expert e = the outermost index of GGUFReader's data array
                e["experts_fnv"] = [fnv1a64(np.ascontiguousarray(raw[i]).tobytes()) for i in range(shape[0])]
            if t.tensor_type in (T.F32, T.F16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K):
                deq = dequantize(raw, t.tensor_type).astype("<f4")
                e["dequant_fnv"] = fnv1a64(deq.tobytes())
        out.append(e)
    return out


# ---------------------------------------------------------------------------------------------
# (a) tiny-moe.gguf: qwen3moe as llama.cpp's converter + llama-quantize lay it out

ARCH = "qwen3moe"
N_EMBD = 256        # k-quants need rows that are a multiple of 256
N_LAYER = 2
N_EXPERT = 8
N_EXPERT_USED = 2
N_FF_EXP = 32
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = 32


def gpt2_byte_tokens():
    """The 256 byte tokens of GPT-2 style byte-level BPE, in bytes_to_unicode order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def tiny_tokenizer():
    tokens = gpt2_byte_tokens()
    merges = ["Ġ t", "Ġ a", "h e", "i n", "Ġt he"]
    tokens += ["Ġt", "Ġa", "he", "in", "Ġthe"]
    types = [1] * len(tokens)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += specials
    types += [3] * len(specials)
    return tokens, types, merges


def tiny_moe_tensors():
    """(name, ggml type, float shape outermost-first) in the order the converter writes them."""
    n_vocab = len(tiny_tokenizer()[0])
    ts = [("token_embd.weight", T.Q4_K, (n_vocab, N_EMBD))]
    for i in range(N_LAYER):
        b = f"blk.{i}."
        ts += [
            (b + "attn_norm.weight", T.F32, (N_EMBD,)),
            (b + "attn_q.weight", T.Q4_K, (N_HEAD * HEAD_DIM, N_EMBD)),
            (b + "attn_k.weight", T.Q4_K, (N_HEAD_KV * HEAD_DIM, N_EMBD)),
            (b + "attn_v.weight", T.Q6_K, (N_HEAD_KV * HEAD_DIM, N_EMBD)),
            # rows of 128 / 32 elements cannot hold 256-element k-quant blocks: llama-quantize
            # falls back to Q8_0 for those, and so do we
            (b + "attn_output.weight", T.Q8_0, (N_EMBD, N_HEAD * HEAD_DIM)),
            (b + "attn_q_norm.weight", T.F32, (HEAD_DIM,)),
            (b + "attn_k_norm.weight", T.F32, (HEAD_DIM,)),
            (b + "ffn_norm.weight", T.F32, (N_EMBD,)),
            (b + "ffn_gate_inp.weight", T.F32, (N_EXPERT, N_EMBD)),
            (b + "ffn_gate_exps.weight", T.Q4_K, (N_EXPERT, N_FF_EXP, N_EMBD)),
            (b + "ffn_up_exps.weight", T.Q4_K, (N_EXPERT, N_FF_EXP, N_EMBD)),
            (b + "ffn_down_exps.weight", T.Q8_0, (N_EXPERT, N_EMBD, N_FF_EXP)),
        ]
    ts += [("output_norm.weight", T.F32, (N_EMBD,)), ("output.weight", T.Q6_K, (n_vocab, N_EMBD))]
    return ts


def write_tiny_moe(path):
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_type("model")
    w.add_name("Tiny MoE")
    w.add_size_label("8x22K")
    w.add_license("apache-2.0")
    w.add_block_count(N_LAYER)
    w.add_context_length(4096)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF_EXP * 3)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_used_count(N_EXPERT_USED)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_expert_count(N_EXPERT)
    w.add_expert_feed_forward_length(N_FF_EXP)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, types, merges = tiny_tokenizer()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    for name, t, shape in tiny_moe_tensors():
        data, raw = tensor_data(t, shape)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------------------------
# (b) a split GGUF via GGUFWriter(split_max_tensors=...)


def write_split(base):
    w = gguf.GGUFWriter(str(base), "llama", split_max_tensors=3)
    w.add_name("Tiny split")
    w.add_block_count(2)
    w.add_embedding_length(32)
    names = ["token_embd.weight"]
    for i in range(2):
        names += [f"blk.{i}.attn_norm.weight", f"blk.{i}.attn_q.weight", f"blk.{i}.ffn_down.weight"]
    names += ["output_norm.weight"]
    for n in names:
        if n.endswith("norm.weight"):
            t, shape = T.F32, (32,)
        elif n.startswith("token_embd"):
            t, shape = T.F16, (16, 32)
        else:
            t, shape = T.Q8_0, (8, 32)
        data, raw = tensor_data(t, shape)
        w.add_tensor(n, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------------------------
# every metadata value type; v2 copy; unknown tensor type

NESTED = {"sluice.test.nested": [[1, 2, 3], [4], ["a", "b"], [[True], [False, True]]]}


def write_all_types(path):
    w = gguf.GGUFWriter(str(path), "sluice-test")
    w.add_custom_alignment(64)
    w.add_uint8("sluice.test.u8", 200)
    w.add_int8("sluice.test.i8", -100)
    w.add_uint16("sluice.test.u16", 60000)
    w.add_int16("sluice.test.i16", -30000)
    w.add_uint32("sluice.test.u32", 4000000000)
    w.add_int32("sluice.test.i32", -2000000000)
    w.add_float32("sluice.test.f32", 0.1)
    w.add_uint64("sluice.test.u64", 18000000000000000000)
    w.add_int64("sluice.test.i64", -9000000000000000000)
    w.add_float64("sluice.test.f64", 2.718281828459045)
    w.add_bool("sluice.test.bool", True)
    w.add_string("sluice.test.string", "héllo ✓ wörld")
    w.add_array("sluice.test.arr_i32", [1, -2, 3])
    w.add_array("sluice.test.arr_f32", [0.5, -1.25])
    w.add_array("sluice.test.arr_str", ["x", "", "zz"])
    w.add_array("sluice.test.arr_bool", [True, False])
    w.add_key_value("sluice.test.arr_u64", [1, 2**63], V.ARRAY, sub_type=V.UINT64)
    w.add_key_value("sluice.test.arr_u8", [0, 255], V.ARRAY, sub_type=V.UINT8)
    w.add_key_value("sluice.test.arr_f64", [1.5, -0.0], V.ARRAY, sub_type=V.FLOAT64)
    for k, v in NESTED.items():
        w.add_key_value(k, v, V.ARRAY, sub_type=V.ARRAY)
    for name, t, shape in [("a.weight", T.F32, (3, 5)), ("b.weight", T.Q4_0, (2, 64)),
                           ("c.weight", T.F16, (7,)), ("d.weight", T.Q8_0, (2, 3, 32))]:
        data, raw = tensor_data(t, shape)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def patch_version(src, dst, ver):
    b = bytearray(src.read_bytes())
    assert struct.unpack_from("<I", b, 4)[0] == 3
    struct.pack_into("<I", b, 4, ver)
    dst.write_bytes(bytes(b))


def patch_tensor_type(src, dst, tensor_name, new_id):
    """Overwrite the ggml type id in `tensor_name`'s tensor info (GGUFReader says where it is)."""
    r = gguf.GGUFReader(str(src))
    t = next(t for t in r.tensors if t.name == tensor_name)
    f = t.field
    # parts: name_len, name, n_dims, dims, raw_dtype, offset
    pos = f.offset + sum(int(p.nbytes) for p in f.parts[:4])
    b = bytearray(src.read_bytes())
    assert struct.unpack_from("<I", b, pos)[0] == int(t.tensor_type)
    struct.pack_into("<I", b, pos, new_id)
    dst.write_bytes(bytes(b))


# ---------------------------------------------------------------------------------------------
# (c) HF layouts


def fp8_random(shape):
    """Every E4M3FN code but NaN (0x7f / 0xff), so subnormals, zeros and +-448 all appear."""
    codes = rng.integers(0, 254, size=shape, dtype=np.uint8)
    codes = np.where(codes >= 0x7F, codes + 1, codes).astype(np.uint8)  # skip 0x7f, 0xff
    return codes.view(ml_dtypes.float8_e4m3fn)


def fp8_dequant(w, s, block=128):
    """Reference: value * scale_inv of its 128x128 tile, in f32 (numpy + ml_dtypes)."""
    wf = w.astype(np.float32)
    rows, cols = wf.shape
    full = np.repeat(np.repeat(s.astype(np.float32), block, axis=0), block, axis=1)[:rows, :cols]
    return (wf * full).astype(np.float32)


def bf16(shape, scale=0.1):
    return (rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16)


DS = dict(vocab=128, hidden=136, inter=144, moe_inter=32, layers=3, dense=1, experts=4, used=2,
          shared=1, heads=2, q_lora=48, kv_lora=32, nope=16, rope=8, v=16)


def deepseek_tensors():
    d = DS
    ts = {}

    def fp8(name, shape):
        ts[name + ".weight"] = fp8_random(shape)
        sr, sc = -(-shape[0] // 128), -(-shape[1] // 128)
        ts[name + ".weight_scale_inv"] = rng.uniform(1e-3, 1e-2, size=(sr, sc)).astype(np.float32)

    ts["model.embed_tokens.weight"] = bf16((d["vocab"], d["hidden"]))
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        ts[p + "input_layernorm.weight"] = bf16((d["hidden"],))
        ts[p + "post_attention_layernorm.weight"] = bf16((d["hidden"],))
        qk = d["nope"] + d["rope"]
        fp8(p + "self_attn.q_a_proj", (d["q_lora"], d["hidden"]))
        ts[p + "self_attn.q_a_layernorm.weight"] = bf16((d["q_lora"],))
        fp8(p + "self_attn.q_b_proj", (d["heads"] * qk, d["q_lora"]))
        fp8(p + "self_attn.kv_a_proj_with_mqa", (d["kv_lora"] + d["rope"], d["hidden"]))
        ts[p + "self_attn.kv_a_layernorm.weight"] = bf16((d["kv_lora"],))
        fp8(p + "self_attn.kv_b_proj", (d["heads"] * (d["nope"] + d["v"]), d["kv_lora"]))
        fp8(p + "self_attn.o_proj", (d["hidden"], d["heads"] * d["v"]))
        if i < d["dense"]:
            fp8(p + "mlp.gate_proj", (d["inter"], d["hidden"]))
            fp8(p + "mlp.up_proj", (d["inter"], d["hidden"]))
            fp8(p + "mlp.down_proj", (d["hidden"], d["inter"]))
        else:
            ts[p + "mlp.gate.weight"] = bf16((d["experts"], d["hidden"]))
            ts[p + "mlp.gate.e_score_correction_bias"] = rng.standard_normal(d["experts"]).astype(np.float32)
            for e in range(d["experts"]):
                q = p + f"mlp.experts.{e}."
                fp8(q + "gate_proj", (d["moe_inter"], d["hidden"]))
                fp8(q + "up_proj", (d["moe_inter"], d["hidden"]))
                fp8(q + "down_proj", (d["hidden"], d["moe_inter"]))
            fp8(p + "mlp.shared_experts.gate_proj", (d["moe_inter"] * d["shared"], d["hidden"]))
            fp8(p + "mlp.shared_experts.up_proj", (d["moe_inter"] * d["shared"], d["hidden"]))
            fp8(p + "mlp.shared_experts.down_proj", (d["hidden"], d["moe_inter"] * d["shared"]))
    ts["model.norm.weight"] = bf16((d["hidden"],))
    ts["lm_head.weight"] = bf16((d["vocab"], d["hidden"]))
    return ts


def write_hf_deepseek(root):
    root.mkdir(parents=True, exist_ok=True)
    d = DS
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": d["vocab"], "hidden_size": d["hidden"], "intermediate_size": d["inter"],
        "moe_intermediate_size": d["moe_inter"], "num_hidden_layers": d["layers"],
        "first_k_dense_replace": d["dense"], "n_routed_experts": d["experts"],
        "n_shared_experts": d["shared"], "num_experts_per_tok": d["used"],
        "num_attention_heads": d["heads"], "num_key_value_heads": d["heads"],
        "q_lora_rank": d["q_lora"], "kv_lora_rank": d["kv_lora"], "qk_nope_head_dim": d["nope"],
        "qk_rope_head_dim": d["rope"], "v_head_dim": d["v"], "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
    }
    (root / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    ts = deepseek_tensors()
    shard_of = {}
    for n in ts:
        shard_of[n] = 1 if (n.startswith("model.embed") or ".layers.0." in n or ".layers.1." in n) else 2
    files = {1: "model-00001-of-00002.safetensors", 2: "model-00002-of-00002.safetensors"}
    for s, fname in files.items():
        save_file({n: v for n, v in ts.items() if shard_of[n] == s}, str(root / fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": int(sum(v.nbytes for v in ts.values()))},
             "weight_map": {n: files[shard_of[n]] for n in sorted(ts)}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return ts, [files[1], files[2]]


FU = dict(vocab=96, hidden=64, inter=128, moe_inter=32, layers=2, experts=4, used=2, heads=2, kv_heads=1, head_dim=32)


def write_hf_fused(root):
    root.mkdir(parents=True, exist_ok=True)
    d = FU
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": d["vocab"],
        "hidden_size": d["hidden"], "intermediate_size": d["inter"], "moe_intermediate_size": d["moe_inter"],
        "num_hidden_layers": d["layers"], "num_experts": d["experts"], "num_experts_per_tok": d["used"],
        "num_attention_heads": d["heads"], "num_key_value_heads": d["kv_heads"], "head_dim": d["head_dim"],
        "norm_topk_prob": True, "rms_norm_eps": 1e-6, "dtype": "bfloat16",
    }
    (root / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    ts = {"model.embed_tokens.weight": bf16((d["vocab"], d["hidden"]))}
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        ts[p + "input_layernorm.weight"] = bf16((d["hidden"],))
        ts[p + "post_attention_layernorm.weight"] = bf16((d["hidden"],))
        ts[p + "self_attn.q_proj.weight"] = bf16((d["heads"] * d["head_dim"], d["hidden"]))
        ts[p + "self_attn.k_proj.weight"] = bf16((d["kv_heads"] * d["head_dim"], d["hidden"]))
        ts[p + "self_attn.v_proj.weight"] = bf16((d["kv_heads"] * d["head_dim"], d["hidden"]))
        ts[p + "self_attn.o_proj.weight"] = bf16((d["hidden"], d["heads"] * d["head_dim"]))
        ts[p + "self_attn.q_norm.weight"] = bf16((d["head_dim"],))
        ts[p + "self_attn.k_norm.weight"] = bf16((d["head_dim"],))
        ts[p + "mlp.gate.weight"] = bf16((d["experts"], d["hidden"]))
        ts[p + "mlp.experts.gate_up_proj"] = bf16((d["experts"], 2 * d["moe_inter"], d["hidden"]))
        ts[p + "mlp.experts.down_proj"] = bf16((d["experts"], d["hidden"], d["moe_inter"]))
    ts["model.norm.weight"] = bf16((d["hidden"],))
    ts["lm_head.weight"] = bf16((d["vocab"], d["hidden"]))
    save_file(ts, str(root / "model.safetensors"), metadata={"format": "pt"})
    return ts


def safetensors_table(root, files, arrays):
    """Tensor table as the safetensors package reads it; offsets from the header it wrote."""
    out = []
    for fi, fname in enumerate(files):
        raw = (root / fname).read_bytes()
        n = struct.unpack_from("<Q", raw, 0)[0]
        header = json.loads(raw[8:8 + n])
        with safe_open(str(root / fname), framework="numpy") as f:
            for name in f.keys():
                sl = f.get_slice(name)  # dtype and shape as the safetensors package reads them
                begin, end = header[name]["data_offsets"]
                arr = arrays[name]
                assert list(sl.get_shape()) == list(arr.shape)
                assert raw[8 + n + begin:8 + n + end] == arr.tobytes()
                e = {"name": name, "dtype": sl.get_dtype(), "shape": list(sl.get_shape()), "file": fi,
                     "offset": 8 + n + begin, "n_bytes": end - begin,
                     "fnv": fnv1a64(arr.tobytes())}
                if arr.dtype == ml_dtypes.float8_e4m3fn:
                    s = arrays[name + "_scale_inv"]
                    e["dequant_fnv"] = fnv1a64(fp8_dequant(arr, s).tobytes())
                elif arr.dtype in (np.float32, ml_dtypes.bfloat16):
                    e["dequant_fnv"] = fnv1a64(arr.astype("<f4").tobytes())
                if arr.ndim == 3:
                    e["experts_fnv"] = [fnv1a64(np.ascontiguousarray(arr[i]).tobytes()) for i in range(arr.shape[0])]
                out.append(e)
    out.sort(key=lambda e: (e["file"], e["offset"]))
    return out


# ---------------------------------------------------------------------------------------------
# what `sluice inspect` must report, computed here from the reference readers' tables


def summary_from_table(tensors, routed_of, n_layers, n_experts, n_used, n_shared, arch):
    """routed_of(name, shape) -> (layer, n_experts_in_tensor) or None."""
    by_type = {}
    routed = resident = 0
    per_layer = {}
    for t in tensors:
        ty = t.get("type") or t.get("dtype")
        c = by_type.setdefault(ty, [0, 0])
        c[0] += 1
        c[1] += t["n_bytes"]
        r = routed_of(t["name"], t["shape"])
        if r is None:
            resident += t["n_bytes"]
        else:
            layer, per_tensor_experts = r
            routed += t["n_bytes"]
            per_layer[layer] = per_layer.get(layer, 0) + t["n_bytes"] // per_tensor_experts
    one = max(per_layer.values())
    return {
        "architecture": arch, "layers": n_layers, "moe_layers": len(per_layer),
        "experts_per_layer": n_experts, "experts_used_per_token": n_used, "shared_experts": n_shared,
        "tensors": len(tensors),
        "quant_types": {k: {"tensors": v[0], "bytes": v[1]} for k, v in by_type.items()},
        "resident_bytes": resident, "routed_expert_bytes": routed,
        "one_expert_bytes_per_layer": one,
        "routed_bytes_per_token": n_used * sum(per_layer.values()),
    }


def gguf_routed(name, shape):
    parts = name.split(".")
    if parts[0] == "blk" and "_exps" in parts[2]:
        return int(parts[1]), shape[0]
    return None


def deepseek_routed(name, shape):
    parts = name.split(".")
    if len(parts) > 5 and parts[3] == "mlp" and parts[4] == "experts":
        return int(parts[2]), 1 if parts[5].isdigit() else shape[0]
    return None


def ds_routed_per_expert(name, shape):
    # per-expert HF tensors: one expert's bytes in a layer = routed bytes of the layer / n_expert
    parts = name.split(".")
    if len(parts) > 5 and parts[3] == "mlp" and parts[4] == "experts":
        return int(parts[2]), DS["experts"]
    return None


# ---------------------------------------------------------------------------------------------


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    expected = {"script": "scripts/make_format_fixtures.py",
                "versions": {p: version(p) for p in ("gguf", "numpy", "safetensors", "ml_dtypes")},
                "gguf": {}, "safetensors": {}, "inspect": {}}

    tiny = FIX / "tiny-moe.gguf"
    write_tiny_moe(tiny)
    r = gguf.GGUFReader(str(tiny))
    tiny_tensors = gguf_tensors(r, 0)
    expected["gguf"]["tiny-moe.gguf"] = {
        "files": ["tiny-moe.gguf"], "version": 3, "alignment": int(r.alignment),
        "data_offset": int(r.data_offset), "file_size": tiny.stat().st_size,
        "metadata": gguf_metadata(r), "tensors": tiny_tensors}
    expected["inspect"]["tiny-moe.gguf"] = summary_from_table(
        tiny_tensors, gguf_routed, N_LAYER, N_EXPERT, N_EXPERT_USED, 0, ARCH)

    for old in OUT.glob("split-*.gguf"):
        old.unlink()
    write_split(OUT / "split.gguf")
    shards = sorted(OUT.glob("split-*-of-*.gguf"))
    assert len(shards) == 3, shards
    metas, tables = [], []
    for i, s in enumerate(shards):
        rs = gguf.GGUFReader(str(s))
        metas.append(gguf_metadata(rs))
        tables += gguf_tensors(rs, i)
    expected["gguf"]["format/" + shards[0].name] = {
        "files": ["format/" + s.name for s in shards], "version": 3, "alignment": 32,
        "metadata": metas[0], "shard_metadata": metas, "tensors": tables}

    all_types = OUT / "all-types.gguf"
    write_all_types(all_types)
    r = gguf.GGUFReader(str(all_types))
    at = {"files": ["format/all-types.gguf"], "version": 3, "alignment": int(r.alignment),
          "data_offset": int(r.data_offset), "metadata": gguf_metadata(r), "nested": NESTED,
          "tensors": gguf_tensors(r, 0)}
    expected["gguf"]["format/all-types.gguf"] = at
    patch_version(all_types, OUT / "all-types-v2.gguf", 2)
    r2 = gguf.GGUFReader(str(OUT / "all-types-v2.gguf"))
    assert gguf_tensors(r2, 0) == at["tensors"]
    expected["gguf"]["format/all-types-v2.gguf"] = dict(at, files=["format/all-types-v2.gguf"], version=2)
    # unknown type: GGUFReader cannot open the patched file, so record the table it read before the
    # patch; sluice must infer b.weight's length from the next tensor's offset
    patch_tensor_type(all_types, OUT / "unknown-type.gguf", "b.weight", 99)
    ut = [dict(t) for t in at["tensors"]]
    for i, t in enumerate(ut):
        for k in ("fnv", "dequant_fnv"):
            t.pop(k, None)
        if t["name"] == "b.weight":
            t["type"], t["type_id"] = "type#99", 99
            t["n_bytes"] = ut[i + 1]["offset"] - t["offset"]
    expected["gguf"]["format/unknown-type.gguf"] = dict(at, files=["format/unknown-type.gguf"], tensors=ut)

    ds_root = OUT / "hf-deepseek"
    ds, ds_files = write_hf_deepseek(ds_root)
    ds_table = safetensors_table(ds_root, ds_files, ds)
    expected["safetensors"]["format/hf-deepseek"] = {
        "files": ["format/hf-deepseek/" + f for f in ds_files], "tensors": ds_table}
    expected["inspect"]["format/hf-deepseek"] = summary_from_table(
        ds_table, ds_routed_per_expert, DS["layers"], DS["experts"], DS["used"], DS["shared"], "DeepseekV3ForCausalLM")
    # the full reference for one FP8 tensor (two row blocks and two column blocks, both partial)
    name = "model.layers.0.mlp.gate_proj.weight"
    ref = fp8_dequant(ds[name], ds[name + "_scale_inv"])
    (OUT / "fp8-reference.f32").write_bytes(ref.astype("<f4").tobytes())
    expected["fp8_reference"] = {"model": "format/hf-deepseek", "tensor": name, "shape": list(ref.shape),
                                 "file": "format/fp8-reference.f32"}

    fu_root = OUT / "hf-fused"
    fu = write_hf_fused(fu_root)
    fu_table = safetensors_table(fu_root, ["model.safetensors"], fu)
    expected["safetensors"]["format/hf-fused/model.safetensors"] = {
        "files": ["format/hf-fused/model.safetensors"], "tensors": fu_table}
    expected["inspect"]["format/hf-fused/model.safetensors"] = summary_from_table(
        fu_table, deepseek_routed, FU["layers"], FU["experts"], FU["used"], 0, "Qwen3MoeForCausalLM")

    (OUT / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    print(f"tiny-moe.gguf: {tiny.stat().st_size} bytes; fixtures in {OUT}")


if __name__ == "__main__":
    main()
