#!/usr/bin/env python3
"""MTP layers for the Qwen3-Next and Qwen3.5-MoE fixtures, with transformers' MTP-head logits.

The reference: transformers' generic `MtpModel` / `MtpLayer` (transformers/modeling_layers.py,
5.25.0) over the family's own decoder layer. transformers 5.25 does not wire MTP up for these
two families (their configs have no `num_mtp_layers`; their models drop `mtp.*` on load), but
its `MtpModel` reads exactly their checkpoint layout (conversion_mapping.py's "Mellum" renames:
`mtp.fc` -> eh_proj, `mtp.pre_fc_norm_embedding` -> enorm, `mtp.pre_fc_norm_hidden` -> hnorm,
`mtp.norm` -> post_norm, `mtp.layers.0.*` -> the decoder block), so this script sets
`num_mtp_layers = 1` and `mtp_layer_types = ["full_attention"]` on the config and lets it run:

    x = eh_proj([enorm(embed(t[s+1])); hnorm(h[s])])      (norms zero-centred: x * (1 + w))
    x = decoder layer (gated full attention + MoE with shared expert), rotary position s+1
    logits = lm_head(post_norm(x))                        (lm_head shared with the main model)

where h[s] is the main model's final-normed hidden state at position s
(`output_hidden_states` [-1], what transformers' MTPCandidateGenerator feeds). Nobody here
wrote these equations; the script only draws random weights for the MTP layer.

For each family (read from tests/fixtures/models/<family>, written to OUT/<family>_mtp):
  config.json        the fixture's, plus `mtp_num_hidden_layers: 1` (the real checkpoints' key)
  tokenizer*.json    the qwen3_moe fixture's (vocabulary 320), for the decode-loop tests
  model.safetensors  the fixture's tensors plus `mtp.*` under the real checkpoints' names
                     (per-expert `mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight`)
  mtp.json           the MTP cases (row i = logits of slot i, predicting token i+2), the
                     reload check (MtpModel.from_pretrained reads back the same weights), and
                     transformers' generate(use_mtp=True) tokens beside plain greedy
  mtp_logits_case{1,2,3}.npy  float32 (T-1, vocab)
MTP weights: transformers' init under seed 4242 (+1 for qwen3_5_moe), then zero-centred norm
weights 0.1 N(0,1), every matrix N(0, 0.05), router x10 (as the main fixture).

Usage: python3 scripts/make_qwen3next_mtp_fixtures.py OUT   (tests read tests/fixtures/models)
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(2)
ROOT = Path(__file__).resolve().parent.parent / "tests/fixtures/models"
FAMILIES = {"qwen3_next": 4242, "qwen3_5_moe": 4243}


def mtp_config(cfg):
    cfg.num_mtp_layers = 1
    cfg.mtp_layer_types = ["full_attention"]
    if getattr(cfg, "mlp_only_layers", None):
        cfg.mtp_mlp_only_layers = []
    return cfg


def load_main(d: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = mtp_config(AutoConfig.from_pretrained(d))
    m = AutoModelForCausalLM.from_pretrained(d, config=cfg, dtype=torch.float32).eval()
    m.set_attn_implementation("eager")
    try:
        m.set_experts_implementation("eager")
    except Exception as e:  # noqa: BLE001
        print("experts implementation:", e, flush=True)
    return m


def randomize(mtp, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    done = {}
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if not name.startswith("layers."):
                continue
            leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
            if p.dim() == 1 and "norm" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
                done[name] = "norm 0.1 N(0,1)"
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
                done[name] = "N(0, 0.05)"
                if leaf == "gate" and name.endswith("mlp.gate.weight"):
                    p.mul_(10.0)
                    done[name] += " x10 (router)"
    return done


def checkpoint_names(mtp) -> dict:
    """MtpModel's parameters -> the real checkpoints' `mtp.*` names (experts per expert)."""
    out = {}
    for k, v in mtp.state_dict().items():
        if not k.startswith("layers.0."):
            continue
        rest = k[len("layers.0."):]
        v = v.detach().clone().contiguous()
        simple = {
            "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
            "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
            "eh_proj.weight": "mtp.fc.weight",
            "post_norm.weight": "mtp.norm.weight",
        }
        if rest in simple:
            out[simple[rest]] = v
            continue
        assert rest.startswith("mtp_block."), k
        rest = rest[len("mtp_block."):]
        if rest == "mlp.experts.gate_up_proj":  # (E, 2I, H), gate rows first
            i = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = v[e, :i].contiguous()
                out[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = v[e, i:].contiguous()
        elif rest == "mlp.experts.down_proj":  # (E, H, I)
            for e in range(v.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out["mtp.layers.0." + rest] = v
    return out


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    from safetensors.torch import load_file, save_file
    import transformers
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel

    out_root = Path(sys.argv[1])
    for fam, seed in FAMILIES.items():
        src, out = ROOT / fam, out_root / f"{fam}_mtp"
        out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(seed)
        model = load_main(src)
        mtp = MtpModel(copy.deepcopy(model), 1).to(torch.float32).eval()
        init = randomize(mtp, seed)
        extra = checkpoint_names(mtp)
        sd = load_file(str(src / "model.safetensors"))
        assert not set(sd) & set(extra)
        sd.update(extra)
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        c = json.loads((src / "config.json").read_text())
        c["mtp_num_hidden_layers"] = 1
        (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
        for f in ("generation_config.json",):
            if (src / f).exists():
                shutil.copy(src / f, out / f)
        # A tokenizer for the decode-loop tests (ids only matter): the qwen3_moe fixture's
        # byte-level BPE, whose vocabulary is the same 320.
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(ROOT / "qwen3_moe" / f, out / f)

        # Reload both from the written directory, as a user of transformers would.
        model2 = load_main(out)
        mtp2 = MtpModel.from_pretrained(model2, device_map={"": "cpu"}).to(torch.float32).eval()
        mtp2.set_attn_implementation("eager")
        try:
            mtp2.set_experts_implementation("eager")
        except Exception as e:  # noqa: BLE001
            print("mtp experts implementation:", e, flush=True)
        ref = {k: v for k, v in mtp.state_dict().items() if k.startswith("layers.")}
        got = mtp2.state_dict()
        bad = [k for k, v in ref.items() if k not in got or not torch.equal(got[k], v)]
        if bad:
            raise SystemExit(f"{fam}: MTP weights reloaded by transformers differ: {bad[:5]}")

        cases = json.loads((src / "cases.json").read_text())
        mcases = []
        for ci, case in enumerate(cases["cases"]):
            ids = case["ids"]
            t = len(ids)
            if t < 2:
                continue
            with torch.no_grad():
                o = model2(torch.tensor([ids]), output_hidden_states=True)
                h = o.hidden_states[-1]
                h_post = model2.model(torch.tensor([ids])).last_hidden_state
                which = "post_final_norm" if torch.equal(h, h_post) else "other"
                mtp_ids = torch.tensor([ids[1:]])
                pos = torch.arange(1, t).unsqueeze(0)
                hid = h[:, : t - 1]
                hs = mtp2.forward_layer(0, hid, pos, MtpCache(config=model2.config.get_mtp_config()),
                                        input_ids=mtp_ids)
                logits = mtp2._project_to_logits(hs)[0].float().numpy()
                # transformers' own drafting call (its last slot), as generate(use_mtp) makes it
                _c, cand, _ = mtp2(input_ids=mtp_ids, last_hidden_states=hid, attention_mask=None,
                                   position_ids=pos,
                                   mtp_cache=MtpCache(config=model2.config.get_mtp_config()))
                cross = float(np.abs(cand[0, -1].float().numpy() - logits[-1]).max())
            fname = f"mtp_logits_case{ci}.npy"
            np.save(out / fname, logits.astype(np.float32))
            top2 = np.sort(logits, -1)[:, -2:]
            mcases.append({
                "case": case["name"], "ids": ids, "logits": fname, "shape": list(logits.shape),
                "hidden_state_used": which, "argmax": logits.argmax(-1).tolist(),
                "min_top2_gap": float((top2[:, 1] - top2[:, 0]).min()),
                "max_abs": float(np.abs(logits).max()),
                "last_row_vs_MtpModel_forward_max_abs_diff": cross,
            })
            print(fam, case["name"], "argmax", logits.argmax(-1).tolist()[:10], "cross", cross, which,
                  flush=True)
        greedy = cases.get("greedy", {})
        gen = {}
        if greedy:
            p = torch.tensor([greedy["prompt_ids"]])
            n = len(greedy["tokens"])
            for use in (False, True):
                try:
                    with torch.no_grad():
                        r = model2.generate(p, attention_mask=torch.ones_like(p), do_sample=False,
                                            max_new_tokens=n, eos_token_id=None, pad_token_id=0,
                                            use_mtp=use)
                    gen["use_mtp" if use else "plain"] = r[0, p.shape[1]:].tolist()
                except Exception as e:  # noqa: BLE001
                    gen["use_mtp" if use else "plain"] = f"{type(e).__name__}: {e}"
            gen["fixture_greedy"] = greedy["tokens"]
            print(fam, "generate", gen, flush=True)
        info = {
            "family": fam,
            "seed": seed,
            "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                         "numpy": np.__version__},
            "reference": "transformers.modeling_layers.MtpModel over the family's decoder layer "
                         "(config.num_mtp_layers = 1, mtp_layer_types = ['full_attention'])",
            "definition": "row i = MTP logits of slot i: eh_proj([enorm(embed(ids[i+1])); "
                          "hnorm(h[i])]) -> decoder layer (causal over slots, rotary position "
                          "i+1) -> post_norm -> lm_head; h = output_hidden_states[-1]. Row i "
                          "predicts the token at position i+2.",
            "reloaded_by_transformers_MtpModel": True,
            "checkpoint_tensors": sorted(extra),
            "init": init,
            "cases": mcases,
            "generate": gen,
        }
        (out / "mtp.json").write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    main()
