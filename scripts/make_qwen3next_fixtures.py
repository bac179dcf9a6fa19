#!/usr/bin/env python3
"""Tiny random-weight Qwen3-Next and Qwen3.5-MoE models with transformers' float32 outputs.

Families (transformers >= 5.24; this run: see manifest.json "versions"):

  qwen3_next     Qwen3NextForCausalLM. 4 layers: linear_attention (Gated DeltaNet), full_attention
                 (gated, partial rotary 0.25), linear_attention with a dense MLP (mlp_only_layers
                 [2]), full_attention; MoE layers with a sigmoid-gated shared expert.
  qwen3_5_moe    Qwen3_5MoeForCausalLM (text only). 4 layers: linear, linear, linear, full (every
                 layer MoE, as the family); the Gated DeltaNet's separate in_proj_qkv / z / b / a.

Both: 2 key heads and 4 value heads in the DeltaNet (each key head serves 2 value heads), conv
kernel 4; 4 query heads over 2 kv heads of 16 in full attention; 8 experts, top 2, norm_topk_prob.
transformers' own init under a fixed seed, then: the zero-centred RMSNorm weights (applied as 1 + w)
drawn 0.1 N(0,1), the gated norm's 1 + 0.1 N(0,1), dt_bias 1 + 0.1 N(0,1), router weights x10,
and a seed search for clear routing and argmax choices (router gap >= 2e-4 between the k-th and
(k+1)-th softmax probability, case top-1/top-2 logit gap >= 5e-4, greedy step gap >= 2e-3).
Cases of 1, 7, 24 and 80 tokens (80 crosses transformers' 64-token chunk of the delta rule);
16 greedy tokens from a fixed prompt, computed by full recompute each step and cross-checked with
model.generate (the recurrent, cached path).

Usage: python3 scripts/make_qwen3next_fixtures.py OUT [family ...]   (OUT/<family>/)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

SEQ_LENGTHS = (1, 7, 24, 80)
VOCAB = 320
GREEDY_NEW_TOKENS = 16
ROUTER_SCALE = 10.0
NORM_JITTER = 0.1
SEED_ATTEMPTS = 16
MIN_ROUTER_MARGIN = 2e-4
MIN_LOGIT_MARGIN = 5e-4
MIN_GREEDY_MARGIN = 2e-3
MIN_GREEDY_DISTINCT = 6

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_conv_kernel_dim=4,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, norm_topk_prob=True,
    max_position_embeddings=4096, initializer_range=0.05, rms_norm_eps=1e-6,
    tie_word_embeddings=False, attention_bias=False, hidden_act="silu",
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

FAMILIES = {
    "qwen3_next": {
        "architecture": "Qwen3NextForCausalLM",
        "config_class": "Qwen3NextConfig",
        "seed": 4101,
        "config": dict(
            COMMON, intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[2],
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        ),
    },
    "qwen3_5_moe": {
        "architecture": "Qwen3_5MoeForCausalLM",
        "config_class": "Qwen3_5MoeTextConfig",
        "seed": 4201,
        "config": dict(
            COMMON,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        ),
    },
}


def write_json(p: Path, obj) -> None:
    p.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")


def tweak(model, seed, torch) -> dict:
    gen = torch.Generator().manual_seed(seed + 100)
    rep = {"centred_norms": 0, "gated_norms": 0, "routers": 0, "dt_bias": 0}
    with torch.no_grad():
        for mname, mod in model.named_modules():
            cls = type(mod).__name__
            for pname, p in mod.named_parameters(recurse=False):
                if cls.endswith("RMSNormGated"):
                    p.copy_(1.0 + NORM_JITTER * torch.randn(p.shape, generator=gen))
                    rep["gated_norms"] += 1
                elif cls.endswith("RMSNorm"):
                    p.copy_(NORM_JITTER * torch.randn(p.shape, generator=gen))
                    rep["centred_norms"] += 1
                elif "Router" in cls and pname == "weight":
                    p.mul_(ROUTER_SCALE)
                    rep["routers"] += 1
                elif pname == "dt_bias":
                    p.copy_(1.0 + NORM_JITTER * torch.randn(p.shape, generator=gen))
                    rep["dt_bias"] += 1
    return rep


def quality(model, case_ids, prompt_ids, k, torch) -> dict:
    margins: list = []

    def hook(_mod, _inp, out):
        probs = out[0].detach().float().reshape(-1, out[0].shape[-1])  # softmax probabilities
        top = probs.sort(-1, descending=True).values
        margins.append(float((top[:, k - 1] - top[:, k]).min()))

    hooks = [m.register_forward_hook(hook) for m in model.modules() if "Router" in type(m).__name__]
    case_margin = float("inf")
    with torch.no_grad():
        for ids in case_ids:
            lg = model(torch.tensor([ids])).logits[0].float()
            top2 = lg.topk(2, dim=-1).values
            case_margin = min(case_margin, float((top2[:, 0] - top2[:, 1]).min()))
        seq = list(prompt_ids)
        step = []
        for _ in range(GREEDY_NEW_TOKENS):
            last = model(torch.tensor([seq])).logits[0, -1].float()
            top2 = last.topk(2).values
            step.append(float(top2[0] - top2[1]))
            seq.append(int(last.argmax()))
    for h in hooks:
        h.remove()
    greedy = seq[len(prompt_ids):]
    return {"router_min_margin": min(margins), "case_min_margin": case_margin,
            "greedy_min_margin": min(step), "greedy_distinct": len(set(greedy)), "greedy": greedy}


def make(name: str, fam: dict, d: Path) -> dict:
    import numpy as np
    import safetensors
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    d.mkdir(parents=True, exist_ok=True)
    config = getattr(transformers, fam["config_class"])(**fam["config"])
    config.architectures = [fam["architecture"]]
    config.dtype = torch.float32
    model_cls = getattr(transformers, fam["architecture"])
    gen_ids = torch.Generator().manual_seed(fam["seed"] + 400)
    case_ids = [torch.randint(3, VOCAB, (t,), generator=gen_ids).tolist() for t in SEQ_LENGTHS]
    prompt_ids = [1] + torch.randint(3, VOCAB, (11,), generator=gen_ids).tolist()

    def build(seed):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
        model.set_attn_implementation("eager")
        model.set_experts_implementation("eager")
        return model, tweak(model, seed, torch)

    attempts, chosen = [], None
    for attempt in range(SEED_ATTEMPTS):
        seed = fam["seed"] + 17 * attempt
        model, _ = build(seed)
        q = quality(model, case_ids, prompt_ids, config.num_experts_per_tok, torch)
        ok = (q["router_min_margin"] >= MIN_ROUTER_MARGIN and q["case_min_margin"] >= MIN_LOGIT_MARGIN
              and q["greedy_min_margin"] >= MIN_GREEDY_MARGIN and q["greedy_distinct"] >= MIN_GREEDY_DISTINCT)
        attempts.append({"seed": seed, "accepted": ok, **{k: v for k, v in q.items() if k != "greedy"}})
        print("seed attempt", attempts[-1], flush=True)
        score = min(q["router_min_margin"] / MIN_ROUTER_MARGIN, q["case_min_margin"] / MIN_LOGIT_MARGIN,
                    q["greedy_min_margin"] / MIN_GREEDY_MARGIN, q["greedy_distinct"] / MIN_GREEDY_DISTINCT)
        if chosen is None or score > chosen[0]:
            chosen = (score, seed)
        if ok:
            break
    seed = chosen[1]
    model, tw = build(seed)

    # The checkpoint as the real ones store it: per-expert gate/up/down tensors.
    sd = {}
    for k, v in model.state_dict().items():
        if k.endswith("experts.gate_up_proj"):
            pre = k[: -len(".gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                sd[f"{pre}.{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                sd[f"{pre}.{e}.up_proj.weight"] = v[e, inter:].contiguous()
        elif k.endswith("experts.down_proj"):
            pre = k[: -len(".down_proj")]
            for e in range(v.shape[0]):
                sd[f"{pre}.{e}.down_proj.weight"] = v[e].contiguous()
        else:
            sd[k] = v.detach().contiguous()
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(d))

    # Reload through transformers' own loader: it must give the in-memory model.
    model2 = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager").eval()
    model2.set_experts_implementation("eager")
    sd_mem, sd2 = model.state_dict(), model2.state_dict()
    worst = max(float((sd_mem[k].float() - sd2[k].float()).abs().max()) for k in sd_mem)
    if worst != 0.0 or set(sd_mem) != set(sd2):
        raise SystemExit(f"reload differs: worst {worst}, keys {sorted(set(sd_mem) ^ set(sd2))[:6]}")

    cases = []
    with torch.no_grad():
        for ci, ids in enumerate(case_ids):
            logits = model2(torch.tensor([ids])).logits[0].float().numpy()
            fname = f"logits_case{ci}.npy"
            np.save(d / fname, logits.astype(np.float32))
            top2 = np.sort(logits, axis=-1)[:, -2:]
            cases.append({"name": f"case{ci}", "ids": ids, "logits": fname, "shape": list(logits.shape),
                          "argmax": logits.argmax(-1).tolist(),
                          "min_top1_top2_margin": float((top2[:, 1] - top2[:, 0]).min()),
                          "max_abs": float(np.abs(logits).max())})
    q = quality(model2, case_ids, prompt_ids, config.num_experts_per_tok, torch)
    with torch.no_grad():
        out = model2.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=GREEDY_NEW_TOKENS, eos_token_id=None,
                              pad_token_id=0)
    gen_new = out[0, len(prompt_ids):].tolist()
    versions = {"transformers": transformers.__version__, "torch": torch.__version__,
                "safetensors": safetensors.__version__, "numpy": np.__version__, "python": sys.version.split()[0]}
    write_json(d / "cases.json", {
        "family": name, "architecture": fam["architecture"], "versions": versions,
        "router_min_margin": q["router_min_margin"], "cases": cases,
        "greedy": {"prompt_ids": prompt_ids, "tokens": q["greedy"], "generate_new_ids": gen_new,
                   "generate_matches_recompute_loop": gen_new == q["greedy"],
                   "min_step_margin": q["greedy_min_margin"],
                   "reference": "argmax of transformers' float32 logits, full recompute each step; "
                                "cross-checked with model.generate(do_sample=False) with eos disabled"}})
    write_json(d / "manifest.json", {
        "family": name, "architecture": fam["architecture"], "seed": seed, "seed_attempts": attempts,
        "router_scale": ROUTER_SCALE, "norm_jitter": NORM_JITTER, "init_tweaks": tw,
        "tensors": {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in sorted(sd.items())},
        "versions": versions,
    })
    return {"seed": seed, "greedy": q["greedy"], "generate_ok": gen_new == q["greedy"],
            "router_min_margin": q["router_min_margin"]}


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    out = Path(sys.argv[1])
    for n in sys.argv[2:] or list(FAMILIES):
        print(f"=== {n}", flush=True)
        print(json.dumps(make(n, FAMILIES[n], out / n)), flush=True)


if __name__ == "__main__":
    main()
