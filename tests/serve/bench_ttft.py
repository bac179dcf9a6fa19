#!/usr/bin/env python3
"""Benchmark (not a test): time to first token of the second turn of a conversation, with
the first turn's KV cache reused (warm), from a fresh server (cold, full prefill), and from
a restarted server with --kv-dir (restored from disk).

    python3 tests/serve/bench_ttft.py --sluice target/release/sluice --model /tmp/x.gguf

Prints one line per case; docs/PERFORMANCE.md ("Server") records the figures.
Standard library only (no openai package needed).
"""

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import tempfile
import time


def start(args, extra):
    cmd = [args.sluice, "serve", args.model, "--port", "0", "-t", str(args.threads), "-c", str(args.ctx)] + extra
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        m = re.search(r"listening on http://(\S+)", line)
        if m:
            host, port = m.group(1).rsplit(":", 1)
            return p, host, int(port)
    raise SystemExit("server did not start")


def stop(p):
    p.terminate()
    p.wait(timeout=120)


def stream_chat(host, port, messages, max_tokens):
    """(seconds to the first content chunk, whole text, usage)."""
    body = json.dumps({"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection(host, port, timeout=3600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    ttft, text, usage = None, "", None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for ch in chunk.get("choices", []):
            piece = ch.get("delta", {}).get("content")
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
    c.close()
    return ttft, text, usage


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sluice", default="target/release/sluice")
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--words", type=int, default=400, help="length of the first user message")
    ap.add_argument("--reply", type=int, default=32)
    args = ap.parse_args()

    words = ("the river runs past the old mill and under the stone bridge where the children "
             "watch the boats go by in the long summer evenings ").split()
    long_text = " ".join(words[i % len(words)] for i in range(args.words))
    turn1 = [{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": "Summarise this:\n" + long_text}]
    kv = tempfile.mkdtemp(prefix="sluice-bench-kv-")
    try:
        # Warm: turn 2 right after turn 1 on the same server (the KV cache holds turn 1).
        p, host, port = start(args, ["--model-id", "bench"])
        t1, reply, u1 = stream_chat(host, port, turn1, args.reply)
        turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Now in one sentence."}]
        warm, text_warm, u_warm = stream_chat(host, port, turn2, args.reply)
        stop(p)

        # Cold: turn 2 on a fresh server, everything prefilled.
        p, host, port = start(args, ["--model-id", "bench"])
        cold, text_cold, u_cold = stream_chat(host, port, turn2, args.reply)
        stop(p)

        # Restored: turn 1 on a server with --kv-dir, restart, turn 2.
        p, host, port = start(args, ["--model-id", "bench", "--kv-dir", kv])
        stream_chat(host, port, turn1, args.reply)
        stop(p)
        kv_bytes = sum(os.path.getsize(os.path.join(kv, f)) for f in os.listdir(kv))
        p, host, port = start(args, ["--model-id", "bench", "--kv-dir", kv])
        disk, text_disk, u_disk = stream_chat(host, port, turn2, args.reply)
        stop(p)
    finally:
        shutil.rmtree(kv, ignore_errors=True)

    assert text_warm == text_cold == text_disk, "replies differ between warm, cold and restored runs"
    print(f"model {args.model}, threads {args.threads or 'all'}")
    print(f"turn 1: prompt {u1['prompt_tokens']} tok, TTFT {t1:.3f}s")
    for name, t, u in (("turn 2 cold (no reuse)", cold, u_cold), ("turn 2 warm (KV reuse)", warm, u_warm),
                       ("turn 2 restored from --kv-dir", disk, u_disk)):
        print(f"{name:32s} prompt {u['prompt_tokens']:5d} tok, reused {u['reused_tokens']:5d}, "
              f"prefilled {u['prefilled_tokens']:5d}, TTFT {t:.3f}s")
    print(f"turn-1 session file in --kv-dir: {kv_bytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
