#!/usr/bin/env python3
"""Train sluice's built-in model: a small DeepSeek-V3 MoE (GGUF `deepseek2`) with one MTP layer.

The model is transformers' own DeepseekV3ForCausalLM (so the checkpoint is exactly what sluice's
reference tests compare against); the MTP layer is a DeepseekV3DecoderLayer with DeepSeek's
enorm / hnorm / eh_proj / shared_head.norm around it, sharing the main embedding and lm_head,
computed as transformers' MtpModel does (see scripts/make_model_fixtures.py, mtp.json):
slot i = eh_proj([enorm(embed(t[i+1])); hnorm(h[i])]) -> decoder layer (rope position i+1)
-> shared_head.norm -> lm_head, predicting t[i+2]; h is the main model's final-normed state.

Loss = CE(main) + MTP_WEIGHT * CE(MTP) + ALPHA * sum over MoE layers of DeepSeek's
complementary balance loss; the routers' selection bias (e_score_correction_bias) gets
DeepSeek-V3's auxiliary-loss-free update (bias += GAMMA * sign(mean load - load)) each step.
The held-out loss is checked during training and the best weights are kept.

Input: DATA/train.bin, DATA/heldout.bin (uint16 tokens from scripts/tiny_corpus.py).
Output (OUT): config.json, model-0000N-of-0000M.safetensors + model.safetensors.index.json
(float32, DeepSeek-V3 checkpoint names, per-expert tensors, MTP layer as model.layers.{L}.*),
train_log.json (losses, float perplexity on the fixed held-out windows, expert loads).

  python3 scripts/train_tiny_moe.py --data .tinydata --out OUT --seconds 300   (GPU, bf16)
  python3 scripts/train_tiny_moe.py --data .tinydata --out /tmp/x --smoke      (CPU check)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ = 512
MTP_WEIGHT = 0.3
ALPHA = 1e-3  # balance loss weight
GAMMA = 1e-3  # selection-bias update speed
EVAL_WINDOWS = 64  # fixed held-out windows of SEQ+1 tokens (non-overlapping, from the start)


def make_config():
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, routed_scaling_factor=1.0,
        kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32,
        n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
        hidden_act="silu", max_position_embeddings=4096, initializer_range=0.02, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=True, attention_bias=False, tie_word_embeddings=False,
        num_nextn_predict_layers=1, scoring_func="sigmoid", topk_method="noaux_tc",
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return cfg


class Mtp(nn.Module):
    """DeepSeek-V3's MTP module (depth 1), sharing embedding and head with the main model."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer, DeepseekV3RMSNorm)

        h = cfg.hidden_size
        self.enorm = DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DeepseekV3DecoderLayer(cfg, layer_idx=cfg.num_hidden_layers)
        self.head_norm = DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)

    def forward(self, model, next_ids, hidden, positions):
        """next_ids [B, n] = t[i+1], hidden [B, n, H] = h[i], positions [B, n] = i+1 -> logits."""
        emb = model.model.embed_tokens(next_ids)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        pe = model.model.rotary_emb(x, position_ids=positions)
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf"), device=x.device).triu(1)[None, None].to(x.dtype)
        y = self.layer(x, attention_mask=mask, position_ids=positions, position_embeddings=pe)
        y = y[0] if isinstance(y, tuple) else y
        return model.lm_head(self.head_norm(y))


def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Same result as DeepseekV3Experts.forward (every expert computed, unselected ones weighted
    0): no host syncs, so the GPU stays busy. Used for training only."""
    n = hidden_states.shape[0]
    comb = torch.zeros(n, self.num_experts, device=hidden_states.device, dtype=top_k_weights.dtype)
    comb.scatter_add_(1, top_k_index, top_k_weights)
    gu = torch.einsum("nh,eih->eni", hidden_states, self.gate_up_proj.to(hidden_states.dtype))
    gate, up = gu.chunk(2, dim=-1)
    act = self.act_fn(gate) * up
    out = torch.einsum("eni,ehi->enh", act, self.down_proj.to(hidden_states.dtype))
    return torch.einsum("enh,ne->nh", out, comb.to(out.dtype))


class Routing:
    """Forward hooks on every router: balance loss terms and per-step expert loads."""

    def __init__(self, gates):
        self.gates = gates
        self.terms = []
        self.loads = [None] * len(gates)
        for i, g in enumerate(gates):
            g.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(mod, _inp, out):
            logits, _w, idx = out
            if not torch.is_grad_enabled():
                return
            e, k = mod.num_experts, mod.top_k
            scores = logits.float().sigmoid()
            p = (scores / scores.sum(-1, keepdim=True)).mean(0)
            load = torch.zeros(e, device=logits.device).scatter_add_(
                0, idx.reshape(-1), torch.ones(idx.numel(), device=logits.device))
            f = load * e / (k * logits.shape[0])
            self.terms.append((f.detach() * p).sum())
            self.loads[i] = load.detach()
        return hook

    def take_loss(self):
        loss = torch.stack(self.terms).sum() if self.terms else torch.zeros(())
        self.terms = []
        return loss

    @torch.no_grad()
    def update_bias(self):
        for g, load in zip(self.gates, self.loads):
            if load is not None:
                g.e_score_correction_bias.add_(GAMMA * torch.sign(load.mean() - load))


def losses(model, mtp, batch):
    """batch [B, SEQ+1] -> (main CE, MTP CE)."""
    x = batch[:, :SEQ]
    h = model.model(input_ids=x).last_hidden_state
    logits = model.lm_head(h)
    main = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    n = SEQ - 1
    pos = torch.arange(1, SEQ, device=x.device)[None].expand(x.shape[0], n)
    ml = mtp(model, batch[:, 1:SEQ], h[:, :n], pos)
    mt = F.cross_entropy(ml.float().reshape(-1, ml.shape[-1]), batch[:, 2:].reshape(-1))
    return main, mt


def eval_windows(held: np.ndarray, count: int) -> list[int]:
    return [i * (SEQ + 1) for i in range(min(count, len(held) // (SEQ + 1)))]


@torch.no_grad()
def evaluate(model, mtp, held, starts, device, bs=16, autocast=True):
    tot_main = tot_mtp = 0.0
    n_main = n_mtp = 0
    for j in range(0, len(starts), bs):
        b = torch.stack([torch.from_numpy(held[s:s + SEQ + 1].astype(np.int64)) for s in starts[j:j + bs]])
        b = b.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast and device.type == "cuda"):
            m, t = losses(model, mtp, b)
        tot_main += float(m) * b.shape[0] * SEQ
        n_main += b.shape[0] * SEQ
        tot_mtp += float(t) * b.shape[0] * (SEQ - 1)
        n_mtp += b.shape[0] * (SEQ - 1)
    return tot_main / n_main, tot_mtp / n_mtp


def split_experts(prefix, gate_up, down):
    out = {}
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        out[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :inter].contiguous()
        out[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, inter:].contiguous()
        out[f"{prefix}.{e}.down_proj.weight"] = down[e].contiguous()
    return out


def checkpoint_tensors(model, mtp, cfg) -> dict:
    """DeepSeek-V3 checkpoint names, float32, per-expert tensors, MTP as layer L."""
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().float().cpu()
        if k.endswith("mlp.experts.gate_up_proj"):
            p = k[: -len(".gate_up_proj")]
            sd.update(split_experts(p, v, model.state_dict()[p + ".down_proj"].detach().float().cpu()))
        elif k.endswith("mlp.experts.down_proj"):
            continue
        else:
            sd[k] = v.contiguous()
    base = f"model.layers.{cfg.num_hidden_layers}"
    for k, v in mtp.state_dict().items():
        v = v.detach().float().cpu()
        if k.startswith("layer."):
            rest = k[len("layer."):]
            if rest.endswith("mlp.experts.gate_up_proj"):
                down = mtp.state_dict()["layer.mlp.experts.down_proj"].detach().float().cpu()
                sd.update(split_experts(f"{base}.mlp.experts", v, down))
                continue
            if rest.endswith("mlp.experts.down_proj"):
                continue
            sd[f"{base}.{rest}"] = v.contiguous()
        elif k.startswith("head_norm."):
            sd[f"{base}.shared_head.norm.{k[len('head_norm.'):]}"] = v.contiguous()
        else:
            sd[f"{base}.{k}"] = v.contiguous()
    return sd


def save_sharded(sd: dict, out: Path, max_bytes=12 << 20):
    from safetensors.torch import save_file

    shards, cur, size = [], {}, 0
    for k in sorted(sd):
        nb = sd[k].numel() * 4
        if cur and size + nb > max_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = sd[k]
        size += nb
    shards.append(cur)
    weight_map = {}
    for i, sh in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in sh})
    total = sum(v.numel() * 4 for v in sd.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=".tinydata")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=300.0, help="training wall-clock budget")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max-epochs", type=float, default=24.0, help="cap on passes over the training tokens")
    ap.add_argument("--smoke", action="store_true", help="a few CPU steps with a tiny batch")
    args = ap.parse_args()
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    data = Path(args.data)
    train = np.fromfile(data / "train.bin", dtype=np.uint16)
    held = np.fromfile(data / "heldout.bin", dtype=np.uint16)
    starts = eval_windows(held, 2 if args.smoke else EVAL_WINDOWS)

    from transformers import DeepseekV3ForCausalLM

    cfg = make_config()
    cfg._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(cfg).float()
    mtp = Mtp(cfg).float()
    with torch.no_grad():  # the MTP experts get transformers' init scale too
        for name, p in mtp.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, cfg.initializer_range)
    model.to(device)
    mtp.to(device)
    experts = [m for m in list(model.modules()) + list(mtp.modules()) if type(m).__name__ == "DeepseekV3Experts"]
    for m in experts:
        m.forward = dense_experts_forward.__get__(m)
    gates = [m for m in list(model.modules()) + list(mtp.modules()) if type(m).__name__ == "DeepseekV3TopkRouter"]
    routing = Routing(gates)
    params = [p for p in list(model.parameters()) + list(mtp.parameters()) if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    rng = np.random.default_rng(args.seed)
    bs = 2 if args.smoke else args.batch
    log = {"params": n_params, "config": json.loads(cfg.to_json_string()), "steps": [], "evals": []}
    print(f"params {n_params} device {device} train tokens {train.size} held-out {held.size}", flush=True)

    warmup = 100
    total_steps = 3 if args.smoke else None  # set after timing the first steps
    step = 0
    best = (float("inf"), None)
    t_train = time.time()
    while True:
        if total_steps is None and step == 30:
            per = (time.time() - t_train) / 30
            left = args.seconds - (time.time() - t_start)
            total_steps = 30 + int(left / (per * 1.12))
            total_steps = min(total_steps, int(args.max_epochs * train.size / (bs * SEQ)))
            print(f"step time {per * 1000:.1f} ms -> {total_steps} steps", flush=True)
        if total_steps is not None and step >= total_steps:
            break
        horizon = total_steps or 10**9
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / horizon))))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = rng.integers(0, train.size - SEQ - 1, size=bs)
        b = torch.from_numpy(np.stack([train[i:i + SEQ + 1] for i in idx]).astype(np.int64)).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            main_l, mtp_l = losses(model, mtp, b)
            bal = routing.take_loss()
            loss = main_l + MTP_WEIGHT * mtp_l + ALPHA * bal
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        routing.update_bias()
        step += 1
        if step % 50 == 0 or args.smoke:
            rec = {"step": step, "t": round(time.time() - t_start, 1), "lr": lr, "main": float(main_l.detach()),
                   "mtp": float(mtp_l.detach()), "balance": float(bal.detach())}
            log["steps"].append(rec)
            print(rec, flush=True)
        if total_steps is not None and (step % 100 == 0 or step == total_steps):
            model.eval(), mtp.eval()
            ev = evaluate(model, mtp, held, starts[:16], device)
            model.train(), mtp.train()
            log["evals"].append({"step": step, "heldout_main": ev[0], "heldout_mtp": ev[1]})
            print("eval", log["evals"][-1], flush=True)
            if ev[0] < best[0]:
                best = (ev[0], step, {k: v.detach().clone() for k, v in model.state_dict().items()},
                        {k: v.detach().clone() for k, v in mtp.state_dict().items()})
    if best[1] is not None:
        model.load_state_dict(best[2])
        mtp.load_state_dict(best[3])
        log["best_step"] = best[1]
    log["train_seconds"] = round(time.time() - t_train, 1)
    log["steps_done"] = step
    log["tokens_seen"] = step * bs * SEQ

    # float32 evaluation on the fixed held-out windows (the perplexity sluice is compared with)
    model.eval(), mtp.eval()
    ev32 = evaluate(model, mtp, held, starts, device, autocast=False)
    log["heldout_windows"] = {"seq": SEQ, "starts": starts, "file": "heldout.bin"}
    log["float32_heldout"] = {"main_nll": ev32[0], "main_ppl": math.exp(ev32[0]), "mtp_nll": ev32[1],
                              "mtp_ppl": math.exp(ev32[1])}
    log["final_bias"] = [g.e_score_correction_bias.tolist() for g in gates]
    print("float32 held-out", log["float32_heldout"], flush=True)

    sd = checkpoint_tensors(model, mtp, cfg)
    save_sharded(sd, out)
    cfg.save_pretrained(str(out))
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"saved {len(sd)} tensors; total {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
