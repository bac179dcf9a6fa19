#!/usr/bin/env python3
"""References for sluice's built-in model, from transformers (CPU, float32).

  logits  transformers' DeepseekV3ForCausalLM on a checkpoint (e.g. the GGUF's own dequantized
          weights from scripts/tiny_gguf.py --dequant-out) for a fixed token sequence; writes
          tests/fixtures/tiny_model/reference.json + logits.npy (and MTP logits of the same
          sequence, computed as transformers' MtpModel does).
  compare compare a sluice `logits` .npy with a reference .npy (max abs diff, argmax agreement).
  ppl     perplexity from sluice `logits` runs over the held-out windows train_tiny_moe.py used.
  words   share of the words of sampled continuations (`sluice run`, temp 0.7) found in
          /usr/share/dict/words (Debian's wamerican).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def transformers_logits(ckpt: Path, ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM
    from safetensors.numpy import load_file

    sys.path.insert(0, str(HERE))
    from train_tiny_moe import Mtp

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    cfg = model.config
    L = cfg.num_hidden_layers
    with torch.no_grad():
        x = torch.tensor([ids])
        h = model.model(input_ids=x).last_hidden_state
        logits = model.lm_head(h)[0].float().numpy()
        full = model(x).logits[0].float().numpy()
        assert np.array_equal(full, logits) or np.abs(full - logits).max() < 1e-5
        # MTP: the layer's tensors from the checkpoint (model.layers.L.*)
        st = {}
        for f in sorted(Path(ckpt).glob("*.safetensors")):
            st.update(load_file(str(f)))
        mtp = Mtp(cfg).float().eval()
        msd = {}
        base = f"model.layers.{L}."
        for k, v in st.items():
            if not k.startswith(base):
                continue
            rest = k[len(base):]
            if rest.startswith("shared_head.norm."):
                msd["head_norm." + rest[len("shared_head.norm."):]] = torch.from_numpy(v)
            elif rest.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
                msd[rest] = torch.from_numpy(v)
            elif rest.startswith("mlp.experts."):
                continue
            else:
                msd["layer." + rest] = torch.from_numpy(v)
        E = cfg.n_routed_experts
        gate = [st[f"{base}mlp.experts.{e}.gate_proj.weight"] for e in range(E)]
        up = [st[f"{base}mlp.experts.{e}.up_proj.weight"] for e in range(E)]
        down = [st[f"{base}mlp.experts.{e}.down_proj.weight"] for e in range(E)]
        msd["layer.mlp.experts.gate_up_proj"] = torch.from_numpy(np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)]))
        msd["layer.mlp.experts.down_proj"] = torch.from_numpy(np.stack(down))
        missing, unexpected = mtp.load_state_dict(msd, strict=True), None
        T = len(ids)
        pos = torch.arange(1, T)[None]
        mlog = mtp(model, x[:, 1:], h[:, : T - 1], pos)[0].float().numpy()
    return logits, mlog


def cmd_logits(a):
    tok_ids = [int(t) for t in a.tokens.split(",")]
    logits, mlog = transformers_logits(Path(a.ckpt), tok_ids)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "logits.npy", logits.astype(np.float32))
    np.save(out / "mtp_logits.npy", mlog.astype(np.float32))
    top2 = np.sort(logits, axis=-1)[:, -2:]
    import torch
    import transformers
    (out / "reference.json").write_text(json.dumps({
        "reference": "transformers DeepseekV3ForCausalLM (eager, float32, CPU) on the shipped GGUF's own "
                     "dequantized weights (scripts/tiny_gguf.py --dequant-out); mtp_logits: the MTP layer "
                     "as transformers' MtpModel computes it (scripts/train_tiny_moe.py Mtp), row i predicts ids[i+2]",
        "ids": tok_ids, "argmax": logits.argmax(-1).tolist(), "mtp_argmax": mlog.argmax(-1).tolist(),
        "min_top1_top2_margin": float((top2[:, 1] - top2[:, 0]).min()),
        "max_abs": float(np.abs(logits).max()),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }, indent=1) + "\n")
    print("argmax", logits.argmax(-1).tolist())


TOKENIZER_TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\t\tnew\nlines\n\n\nand  runs   of    spaces",
    "It's late; they're tired, we've waited, I'm sure you'll agree.",
    "Numbers 1234567 and 3.14159 and -17 and 1e-6",
    "Français : l'été, à Montréal. Straße, Bäume. 中文 🚀",
    "def route(scores, k):\n    return sorted(scores)[:k]\n",
    "<｜User｜>apt-get install python3<｜Assistant｜></think>",
]


def cmd_tokcases(a):
    """Add `tokenizer_cases` (the `tokenizers` package's ids, BOS added) to reference.json."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(a.tokenizer)
    p = Path(a.reference)
    ref = json.loads(p.read_text(encoding="utf-8"))
    ref["tokenizer_cases"] = [{"text": t, "ids": tok.encode(t, add_special_tokens=True).ids,
                               "decoded": tok.decode(tok.encode(t, add_special_tokens=True).ids,
                                                     skip_special_tokens=False)}
                              for t in TOKENIZER_TEXTS]
    p.write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def cmd_compare(a):
    x, y = np.load(a.a), np.load(a.b)
    d = np.abs(x - y)
    print(f"shape {x.shape} max abs diff {d.max():.4g} (max |ref| {np.abs(y).max():.3g}); "
          f"argmax agree {(x.argmax(-1) == y.argmax(-1)).mean():.3f}")


def log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def cmd_ppl(a):
    log = json.loads(Path(a.train_log).read_text())
    win = log["heldout_windows"]
    seq = win["seq"]
    held = np.fromfile(Path(a.data) / win["file"], dtype=np.uint16)
    starts = win["starts"][: a.windows] if a.windows else win["starts"]
    nll, n = 0.0, 0
    tmp = Path(a.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(starts):
        w = held[s:s + seq + 1].astype(np.int64)
        out = tmp / f"w{i}.npy"
        subprocess.run([a.sluice, "logits", a.model, "--tokens", ",".join(map(str, w[:seq])), "--out", str(out),
                        "--gpu", "off", "-b", "512"], check=True, capture_output=True)
        lp = log_softmax(np.load(out).astype(np.float64))
        nll -= lp[np.arange(seq), w[1:]].sum()
        n += seq
    ppl = math.exp(nll / n)
    ref = log["float32_heldout"]["main_ppl"] if not a.windows else None
    res = {"model": a.model, "windows": len(starts), "tokens": n, "nll": nll / n, "ppl": ppl,
           "pytorch_float32_ppl": ref, "ratio": ppl / ref if ref else None}
    print(json.dumps(res))


PROMPTS = ["The", "Python is", "A module", "Debian", "To install a package,", "The function returns",
           "In this chapter", "The following example", "When the interpreter", "The file system",
           "Each thread", "The server"]


def cmd_words(a):
    """Share of generated words (runs of letters) found in a word list, over sampled continuations."""
    import re
    words = {w.strip().lower() for w in Path(a.dict).read_text(encoding="utf-8", errors="replace").split()}
    found = total = 0
    samples = []
    for i, prompt in enumerate(PROMPTS):
        for seed in range(a.seeds):
            r = subprocess.run([a.sluice, "run", *([a.model] if a.model else []), "-p", prompt, "-n", str(a.n),
                                "--temp", str(a.temp), "--seed", str(seed), "--gpu", "off"],
                               check=True, capture_output=True, text=True)
            gen = r.stdout[len(prompt):]
            ws = re.findall(r"[A-Za-z]+", gen)
            found += sum(w.lower() in words for w in ws)
            total += len(ws)
            samples.append({"prompt": prompt, "seed": seed, "text": r.stdout})
    res = {"model": a.model or "(default)", "temp": a.temp, "tokens_per_sample": a.n, "samples": len(samples),
           "words": total, "in_word_list": found, "share": found / max(total, 1), "word_list": a.dict}
    print(json.dumps(res))
    if a.samples_out:
        Path(a.samples_out).write_text(json.dumps({**res, "samples": samples}, indent=1) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("logits")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    p = sub.add_parser("ppl")
    p.add_argument("--model", required=True)
    p.add_argument("--train-log", required=True)
    p.add_argument("--data", default=".tinydata")
    p.add_argument("--sluice", default="target/release/sluice")
    p.add_argument("--tmp", default="/tmp/sluice-ppl")
    p.add_argument("--windows", type=int, default=0)
    p = sub.add_parser("tokcases")
    p.add_argument("--tokenizer", default=".tinydata/tokenizer.json")
    p.add_argument("--reference", default="tests/fixtures/tiny_model/reference.json")
    p = sub.add_parser("words")
    p.add_argument("--model", default="")
    p.add_argument("--sluice", default="target/release/sluice")
    p.add_argument("--dict", default="/usr/share/dict/words")
    p.add_argument("--temp", type=float, default=0.7)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--samples-out")
    a = ap.parse_args()
    {"logits": cmd_logits, "compare": cmd_compare, "ppl": cmd_ppl, "words": cmd_words,
     "tokcases": cmd_tokcases}[a.cmd](a)


if __name__ == "__main__":
    main()
