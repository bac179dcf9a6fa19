#!/usr/bin/env python3
"""GPU machine check of `sluice serve --gpu on`: prompt reuse with the KV cache in VRAM.

Turn 2 of a conversation is answered twice at temperature 0: right after turn 1 on the same
server (the GPU KV cache is truncated to the common prefix and only the rest is prefilled) and on
a fresh server (everything prefilled). The replies must be identical; the times to first token
are printed (benchmark figures, not assertions).

    python3 scripts/gpu_serve_check.py --sluice .devrun/sluice --model /tmp/m.gguf [--vram 1G]
Standard library only; reuses tests/serve/bench_ttft.py's client.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "serve"))
import bench_ttft  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sluice", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--vram", default=None, help="--vram for the server (default: its own)")
    ap.add_argument("--words", type=int, default=400)
    ap.add_argument("--reply", type=int, default=32)
    a = ap.parse_args()
    args = argparse.Namespace(sluice=a.sluice, model=a.model, threads=0, ctx=4096, server_args="")
    extra = ["--model-id", "bench", "--gpu", "on"] + (["--vram", a.vram] if a.vram else [])

    words = ("the river runs past the old mill and under the stone bridge where the children "
             "watch the boats go by in the long summer evenings ").split()
    turn1 = [{"role": "user", "content": "Summarise this:\n" + " ".join(words[i % len(words)] for i in range(a.words))}]
    p, host, port = bench_ttft.start(args, extra)
    t1, reply, u1 = bench_ttft.stream_chat(host, port, turn1, a.reply)
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Now in one sentence."}]
    warm, text_warm, u_warm = bench_ttft.stream_chat(host, port, turn2, a.reply)
    bench_ttft.stop(p)
    p, host, port = bench_ttft.start(args, extra)
    cold, text_cold, u_cold = bench_ttft.stream_chat(host, port, turn2, a.reply)
    bench_ttft.stop(p)
    print(f"serve --gpu on, model {a.model}, vram {a.vram or 'default'}")
    print(f"turn 1: prompt {u1['prompt_tokens']} tok, TTFT {t1:.3f}s")
    for name, t, u in (("turn 2 cold (no reuse)", cold, u_cold), ("turn 2 warm (KV reuse)", warm, u_warm)):
        print(f"{name:24s} prompt {u['prompt_tokens']:5d} tok, reused {u['reused_tokens']:5d}, "
              f"prefilled {u['prefilled_tokens']:5d}, TTFT {t:.3f}s")
    same = text_warm == text_cold
    print("replies identical (warm vs cold):", same)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
