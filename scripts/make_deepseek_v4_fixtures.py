#!/usr/bin/env python3
"""A tiny random DeepSeek-V4 (`DeepseekV4ForCausalLM`) with transformers' float32 outputs.

The model has every kind of layer V4 has at least once:
  attention  layer 0 sliding_attention (window 6), layers 1 and 3 compressed_sparse_attention
             (CSA: overlapping windows of 4, Lightning Indexer with 8 heads keeping the top 2 entries),
             layer 2 heavily_compressed_attention (HCA: windows of 8); shared-KV MQA with
             partial interleaved RoPE (8 of 32 dims), per-head sinks, grouped output projection;
             the compressed layers rotate with the `compress` rope (YaRN, factor 4 over 16).
  MoE        layers 0-1 hash_moe (experts from tid2eid[token]), layers 2-3 top-k MoE with
             sqrtsoftplus scores and a selection bias; clamped SwiGLU (limit 0.6: a share of
             values is clamped, recorded) in routed and shared experts.
  residual   4 hyper-connection streams (mHC, Sinkhorn 20 iterations) and the final HyperHead.

Random values beyond transformers' init so every parameter matters: norms 1 + 0.1 N(0,1),
sinks N(0,1), position biases N(0,0.5), hc base N(0,0.5) and scale 1 + 0.2 N(0,1), selection
bias 0.05 N(0,1), router x10, tid2eid a random permutation prefix per token.

Seed search: router gap (k-th vs (k+1)-th of score + bias) >= 2e-4, indexer gap (k-th vs
(k+1)-th causal index score, where top-k drops something) >= 2e-4, logits top-1/top-2 gap >= 5e-4
per position, greedy step gap >= 2e-3. Self-check: the whole-prompt forward and a
token-by-token forward with the cache agree (the reference's own causality).

Outputs (OUT/): config.json, generation_config.json, model.safetensors (transformers'
save_pretrained: DeepSeek's own tensor names), tokenizer.json (gpt_oss fixture's BPE), logits_case*.npy (float32, (tokens, vocab)), cases.json, greedy.json.

Usage: python3 scripts/make_deepseek_v4_fixtures.py OUT   (tests read tests/fixtures/models/deepseek_v4)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(1)

VOCAB = 320
PROMPT = [5, 77, 301, 12, 9, 150, 42, 42, 260, 3, 88, 199, 64, 7, 230, 111, 18, 95, 270, 33]
CASES = [("one", PROMPT[:1]), ("seven", PROMPT[:7]), ("twenty", PROMPT)]
N_GREEDY = 16


def config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
        partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1,
        scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, max_position_embeddings=64,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 32.0, "beta_slow": 1.0},
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention", "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=0.6, sliding_window=6,
        o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=2,
        num_nextn_predict_layers=0, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
        pad_token_id=None, tie_word_embeddings=False,
    )


def build(seed: int):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    cfg = config()
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("position_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith(".base") or name.endswith("hc_base"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith(".scale") or name.endswith("hc_scale"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.mul_(10)
            elif "experts" in name or "shared_experts" in name:
                p.mul_(4)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
            elif name.endswith("tid2eid"):
                k = cfg.num_experts_per_tok
                rows = [torch.randperm(cfg.n_routed_experts, generator=g)[:k] for _ in range(cfg.vocab_size)]
                b.copy_(torch.stack(rows))
    return model


class Probe:
    """Router and indexer gaps, and the clamp share, seen during forwards."""

    def __init__(self, model, cfg):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

        self.router_gap = float("inf")
        self.index_gap = float("inf")
        self.clamped = [0, 0]
        self.handles = []
        k = cfg.num_experts_per_tok
        for mod in model.modules():
            if isinstance(mod, m.DeepseekV4TopKRouter):
                def rhook(mod, inp, _out):
                    flat = inp[0].reshape(-1, mod.hidden_dim)
                    s = mod.score_fn(torch.nn.functional.linear(flat, mod.weight)) + mod.e_score_correction_bias
                    top = s.topk(k + 1, dim=-1).values
                    self.router_gap = min(self.router_gap, float((top[:, k - 1] - top[:, k]).min()))
                self.handles.append(mod.register_forward_hook(rhook))
            if isinstance(mod, m.DeepseekV4Indexer):
                def ipre(mod, args, kwargs):
                    mod._pos = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
                self.handles.append(mod.register_forward_pre_hook(ipre, with_kwargs=True))

                def shook(sc, _inp, out, mod=mod):
                    pos = mod._pos
                    thr = (pos + 1) // mod.compress_rate  # [B, S]
                    t = out.shape[-1]
                    for s in range(out.shape[1]):
                        vis = int(thr[0, s])
                        vis = min(vis, t)
                        if vis > mod.index_topk:
                            v = out[0, s, :vis].sort(descending=True).values
                            kk = mod.index_topk
                            self.index_gap = min(self.index_gap, float(v[kk - 1] - v[kk]))
                self.handles.append(mod.scorer.register_forward_hook(shook))
            if isinstance(mod, m.DeepseekV4Experts):
                orig = mod._apply_gate

                def wrap(gate_up, orig=orig, mod=mod):
                    gate, up = gate_up.chunk(2, dim=-1)
                    self.clamped[0] += int((gate > mod.limit).sum()) + int((up.abs() > mod.limit).sum())
                    self.clamped[1] += 2 * gate.numel()
                    return orig(gate_up)
                mod._apply_gate = wrap

    def close(self):
        for h in self.handles:
            h.remove()


def logits_full(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def logits_stepwise(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    rows = []
    with torch.no_grad():
        for i, t in enumerate(ids):
            out = model(torch.tensor([[t]]), cache=cache, use_cache=True,
                        position_ids=torch.tensor([[i]]))
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def greedy(model, ids, n):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out_ids, gaps = [], []
    with torch.no_grad():
        out = model(torch.tensor([ids]), cache=cache, use_cache=True)
        pos = len(ids)
        for _ in range(n):
            last = out.logits[0, -1].float()
            top = last.topk(2).values
            gaps.append(float(top[0] - top[1]))
            t = int(last.argmax())
            out_ids.append(t)
            out = model(torch.tensor([[t]]), cache=cache, use_cache=True, position_ids=torch.tensor([[pos]]))
            pos += 1
    return out_ids, min(gaps)


def top_gap(logits):
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def main() -> None:
    import transformers
    from safetensors.torch import load_file

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    chosen = None
    for seed in range(4001, 4101):
        model = build(seed)
        probe = Probe(model, model.config)
        full = logits_full(model, PROMPT)
        step = logits_stepwise(model, PROMPT)
        toks, ggap = greedy(model, PROMPT, N_GREEDY)
        probe.close()
        self_err = float((full - step).abs().max() / full.abs().max())
        ok = (probe.router_gap >= 2e-4 and probe.index_gap >= 2e-4 and top_gap(full) >= 5e-4
              and ggap >= 2e-3 and self_err < 1e-5)
        print(f"seed {seed}: router gap {probe.router_gap:.2e} index gap {probe.index_gap:.2e} "
              f"logit gap {top_gap(full):.2e} greedy gap {ggap:.2e} full-vs-step {self_err:.1e}", flush=True)
        if ok:
            chosen = (seed, model, probe, toks, ggap, self_err)
            break
    if chosen is None:
        raise SystemExit("no seed gave clear routing and argmax choices")
    seed, model, probe, toks, ggap, self_err = chosen
    model.save_pretrained(str(out), safe_serialization=True)
    # The CLI needs a tokenizer: the byte-level BPE of the other family fixtures (same vocabulary
    # size, made by scripts/make_family_fixtures.py); the tests use token ids only.
    tok = Path(__file__).resolve().parent.parent / "tests/fixtures/models/gpt_oss/tokenizer.json"
    shutil.copy(tok, out / "tokenizer.json")
    names = sorted(load_file(str(out / "model.safetensors")).keys())
    cases = []
    for i, (name, ids) in enumerate(CASES):
        lg = logits_full(model, ids).numpy().astype(np.float32)
        fname = f"logits_case{i}.npy"
        np.save(out / fname, lg)
        cases.append({"name": name, "ids": ids, "logits": fname})
    versions = {"transformers": transformers.__version__, "torch": torch.__version__}
    (out / "cases.json").write_text(json.dumps({
        "family": "deepseek_v4", "architecture": "DeepseekV4ForCausalLM", "seed": seed,
        "versions": versions, "cases": cases,
        "router_gap": probe.router_gap, "index_gap": probe.index_gap,
        "clamp_share": probe.clamped[0] / max(1, probe.clamped[1]),
        "full_vs_stepwise": self_err, "tensors": names,
    }, indent=1) + "\n")
    (out / "greedy.json").write_text(json.dumps({
        "prompt_ids": PROMPT, "tokens": toks, "min_gap": ggap, "versions": versions,
    }, indent=1) + "\n")
    print(json.dumps({"seed": seed, "tokens": toks, "clamp_share": probe.clamped[0] / max(1, probe.clamped[1])}))


if __name__ == "__main__":
    main()
