#!/usr/bin/env python3
"""DeepSeek-V3.2 (DeepseekV32ForCausalLM) tiny random model + transformers float32 logits.

Runs where torch + transformers >= 5.17 exist (the GPU machine's CPU). Writes OUT/ with
config.json, model.safetensors and cases.json + logits_case*.npy (same layout as
scripts/make_model_fixtures.py). index_topk is larger than every case, so DSA selects every
causal token and V3.2 must equal V3-style dense MLA attention.
Usage: python3 make_v32_fixture.py OUT_DIR
"""
import json, sys
from pathlib import Path
import numpy as np
import torch
import transformers
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(3202)
cfg = DeepseekV32Config(
    vocab_size=320, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32,
    qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=4, topk_group=2,
    num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
    max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.05,
    index_topk=64, index_head_dim=16, index_n_heads=2,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
    bos_token_id=0, eos_token_id=1,
)
cfg._attn_implementation = "eager"
model = DeepseekV32ForCausalLM(cfg).float().eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif name.endswith("mlp.gate.weight"):
            p.mul_(10.0)
        elif name.endswith("e_score_correction_bias"):
            p.copy_(0.05 * torch.randn_like(p))
model.save_pretrained(out, safe_serialization=True)
cases = []
rng = np.random.default_rng(3202)
for i, n in enumerate([1, 7, 24]):
    ids = rng.integers(0, 320, n).tolist()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    np.save(out / f"logits_case{i}.npy", logits.astype("<f4"))
    cases.append({"name": f"case{i}", "ids": ids, "logits": f"logits_case{i}.npy", "shape": list(logits.shape)})
from safetensors import safe_open
with safe_open(out / "model.safetensors", "pt") as f:
    keys = sorted(f.keys())
json.dump({"versions": {"transformers": transformers.__version__, "torch": torch.__version__, "device": "cpu", "dtype": "float32"},
           "cases": cases, "saved_keys": keys}, open(out / "cases.json", "w"), indent=1)
print("ok", len(keys), "tensors;", [k for k in keys if "layers.1." in k and "experts." not in k])
