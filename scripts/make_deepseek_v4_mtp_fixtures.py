#!/usr/bin/env python3
"""An MTP block for the tiny DeepSeek-V4 fixture, with reference MTP-head logits.

No library implements V4's MTP layer: transformers 5.25's `deepseek_v4` drops `mtp.*` on load
("MTP layer count in the upstream checkpoint (not instantiated here)"), and llama.cpp's
`deepseek4` converter drops the tensors and its graph has no nextn code. The equations are
DeepSeek's own inference code (DeepSeek-V4-Flash `inference/model.py`, `class MTPBlock(Block)`):

    e = enorm(embed(t[s+1]))                       # the main model's embedding
    x = hnorm(streams[s])                          # the main model's hc streams after its last
                                                   #   block, before the HyperHead: (hc, d)
    x = e_proj(e)[None, :] + h_proj(x)             # per stream
    x = Block(x)                                   # a full V4 block (hc attn/ffn, MoE)
    logits = head(norm(hc_head(x)))                # the MTP's own HyperHead and norm, the main head

So this script is a small PyTorch reimplementation of that wrapper (five lines, `mtp_logits`)
around transformers' own pieces: `DeepseekV4DecoderLayer` (the block, a sliding-window
attention layer with a top-k MoE as the real MTP block: no compressor, no hash routing),
`DeepseekV4HyperHead`, `DeepseekV4RMSNorm`, the model's rotary embedding and its sliding-window
mask. The block's weights are saved under DeepSeek's names as the real checkpoint does
(`mtp.0.*`, via transformers' own reverse mapping of a one-layer model).

Outputs (OUT/deepseek_v4_mtp/): the deepseek_v4 fixture's files with `num_nextn_predict_layers`
1, model.safetensors with the `mtp.0.*` tensors added, mtp.json, mtp_logits_case{1,2}.npy.

Usage: python3 scripts/make_deepseek_v4_mtp_fixtures.py OUT
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(2)
SRC = Path(__file__).resolve().parent.parent / "tests/fixtures/models/deepseek_v4"
SEED = 4444


def mtp_config(cfg):
    c = copy.deepcopy(cfg)
    c.num_hidden_layers = 1
    c.layer_types = ["sliding_attention"]
    c.mlp_layer_types = ["moe"]
    c._attn_implementation = "eager"
    return c


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4ForCausalLM
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    out = Path(sys.argv[1]) / "deepseek_v4_mtp"
    out.mkdir(parents=True, exist_ok=True)
    model = DeepseekV4ForCausalLM.from_pretrained(SRC, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    cfg1 = mtp_config(model.config)
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED)
    h = cfg1.hidden_size
    mtp = torch.nn.ModuleDict({
        "block": m.DeepseekV4DecoderLayer(cfg1, 0),
        "hc_head": m.DeepseekV4HyperHead(cfg1),
        "enorm": m.DeepseekV4RMSNorm(h, eps=cfg1.rms_norm_eps),
        "hnorm": m.DeepseekV4RMSNorm(h, eps=cfg1.rms_norm_eps),
        "norm": m.DeepseekV4RMSNorm(h, eps=cfg1.rms_norm_eps),
        "e_proj": torch.nn.Linear(h, h, bias=False),
        "h_proj": torch.nn.Linear(h, h, bias=False),
    }).float().eval()
    init = {}
    with torch.no_grad():
        # As the main fixture: transformers-like N(0, 0.02) matrices, then its tweaks.
        for name, p in mtp.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(".base") or name.endswith("hc_base"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith(".scale") or name.endswith("hc_scale"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
                if name.endswith("mlp.gate.weight"):
                    p.mul_(10)
                elif "experts" in name:
                    p.mul_(4)
                elif name in ("e_proj.weight", "h_proj.weight"):
                    p.mul_(5)
            init[name] = tuple(p.shape)
        for name, b in mtp.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))

    # The block under DeepSeek's checkpoint names: a one-layer V4 with it as layer 0, saved by
    # transformers (its reverse conversion), layers.0.* -> mtp.0.*.
    one = DeepseekV4ForCausalLM(cfg1).float().eval()
    with torch.no_grad():
        one.model.layers[0].load_state_dict(mtp["block"].state_dict())
    with tempfile.TemporaryDirectory() as td:
        one.save_pretrained(td, safe_serialization=True)
        one_sd = load_file(str(Path(td) / "model.safetensors"))
    extra = {"mtp.0." + k.split("layers.0.", 1)[1]: v for k, v in one_sd.items() if "layers.0." in k}
    extra["mtp.0.e_proj.weight"] = mtp["e_proj"].weight.detach().clone()
    extra["mtp.0.h_proj.weight"] = mtp["h_proj"].weight.detach().clone()
    extra["mtp.0.enorm.weight"] = mtp["enorm"].weight.detach().clone()
    extra["mtp.0.hnorm.weight"] = mtp["hnorm"].weight.detach().clone()
    extra["mtp.0.norm.weight"] = mtp["norm"].weight.detach().clone()
    extra["mtp.0.hc_head_fn"] = mtp["hc_head"].hc_fn.detach().clone()
    extra["mtp.0.hc_head_base"] = mtp["hc_head"].hc_base.detach().clone()
    extra["mtp.0.hc_head_scale"] = mtp["hc_head"].hc_scale.detach().clone()
    sd = load_file(str(SRC / "model.safetensors"))
    assert not set(sd) & set(extra)
    sd.update({k: v.contiguous() for k, v in extra.items()})
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((SRC / "config.json").read_text())
    c["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    for f in ("generation_config.json", "tokenizer.json", "greedy.json"):
        shutil.copy(SRC / f, out / f)
    # transformers reads the written checkpoint as the plain fixture (mtp.* dropped).
    again = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    same = all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))

    captured = {}
    model.model.layers[-1].register_forward_hook(lambda mod, i, o: captured.__setitem__("streams", o))

    def mtp_logits(ids):
        """DeepSeek's MTPBlock.forward over slots s = 0..T-2 (token ids[s+1], position s)."""
        t = len(ids)
        with torch.no_grad():
            model(torch.tensor([ids]), use_cache=False)
            streams = captured["streams"][:, : t - 1]               # [1, T-1, hc, d]
            tok = torch.tensor([ids[1:]])
            # DeepSeek's MTPBlock.forward(x, start_pos, ids) caches and rotates slot s at
            # start_pos + s: the position of the hidden state it takes (its own self-test
            # calls mtp(h, 0, x)), not of the token.
            pos = torch.arange(0, t - 1).unsqueeze(0)
            e = mtp["enorm"](model.model.embed_tokens(tok))
            x = mtp["e_proj"](e).unsqueeze(2) + mtp["h_proj"](mtp["hnorm"](streams))
            mask = create_sliding_window_causal_mask(config=cfg1, inputs_embeds=e, attention_mask=None,
                                                     cache=None, position_ids=pos)
            pe = {k: model.model.rotary_emb(e, position_ids=pos, layer_type=k) for k in ("main", "compress")}
            x = mtp["block"](x, position_embeddings=pe, position_ids=pos, attention_mask=mask,
                             input_ids=tok, cache=None)
            return model.lm_head(mtp["norm"](mtp["hc_head"](x)))[0].float().numpy()

    cases = json.loads((SRC / "cases.json").read_text())["cases"]
    mcases = []
    for ci, case in enumerate(cases):
        ids = case["ids"]
        if len(ids) < 2:
            continue
        lg = mtp_logits(ids)
        fname = f"mtp_logits_case{ci}.npy"
        np.save(out / fname, lg.astype(np.float32))
        top2 = np.sort(lg, -1)[:, -2:]
        mcases.append({"case": case["name"], "ids": ids, "logits": fname, "shape": list(lg.shape),
                       "argmax": lg.argmax(-1).tolist(),
                       "min_top2_gap": float((top2[:, 1] - top2[:, 0]).min()),
                       "max_abs": float(np.abs(lg).max())})
        print(case["name"], lg.argmax(-1).tolist(), mcases[-1]["min_top2_gap"], flush=True)
    (out / "mtp.json").write_text(json.dumps({
        "family": "deepseek_v4", "seed": SEED,
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "reference": "DeepSeek-V4 inference/model.py MTPBlock.forward, reimplemented here (no "
                     "library implements it) over transformers' DeepseekV4DecoderLayer, "
                     "DeepseekV4HyperHead, DeepseekV4RMSNorm, rotary embedding and mask",
        "block": "sliding_attention, moe (top-k, sqrtsoftplus + bias), layer index n_layers",
        "main_weights_reload_unchanged": same,
        "checkpoint_tensors": sorted(extra), "init": {k: list(v) for k, v in init.items()},
        "cases": mcases,
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
