#!/usr/bin/env python3
"""Benchmark (not a test): time to first token of the second turn of a conversation, with
the first turn's KV cache reused (warm), from a fresh server (cold, full prefill), and from
a restarted server with --kv-dir (restored from disk).

    python3 tests/serve/bench_ttft.py --sluice target/release/sluice --model /tmp/x.gguf \
        [--repeat 3] [--server-args "--experts stream --cap 16"]

Each repetition runs the three cases on fresh servers; the summary gives min / median / max
over the repetitions. docs/PERFORMANCE.md ("Server") records the figures.
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
    cmd = ([args.sluice, "serve", args.model, "--port", "0", "-t", str(args.threads), "-c", str(args.ctx)]
           + args.server_args.split() + extra)
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


def one_run(args, turn1):
    """TTFT of turn 1, and of turn 2 warm, cold and restored: {case: (ttft, text, usage)}."""
    kv = tempfile.mkdtemp(prefix="sluice-bench-kv-")
    out = {}
    try:
        # Warm: turn 2 right after turn 1 on the same server (the KV cache holds turn 1).
        p, host, port = start(args, ["--model-id", "bench"])
        out["turn 1"] = stream_chat(host, port, turn1, args.reply)
        turn2 = turn1 + [{"role": "assistant", "content": out["turn 1"][1]},
                         {"role": "user", "content": "Now in one sentence."}]
        out["turn 2 warm (KV reuse)"] = stream_chat(host, port, turn2, args.reply)
        stop(p)

        # Cold: turn 2 on a fresh server, everything prefilled.
        p, host, port = start(args, ["--model-id", "bench"])
        out["turn 2 cold (no reuse)"] = stream_chat(host, port, turn2, args.reply)
        stop(p)

        # Restored: turn 1 on a server with --kv-dir, restart, turn 2.
        p, host, port = start(args, ["--model-id", "bench", "--kv-dir", kv])
        stream_chat(host, port, turn1, args.reply)
        stop(p)
        out["kv_bytes"] = sum(os.path.getsize(os.path.join(kv, f)) for f in os.listdir(kv))
        p, host, port = start(args, ["--model-id", "bench", "--kv-dir", kv])
        out["turn 2 restored (--kv-dir)"] = stream_chat(host, port, turn2, args.reply)
        stop(p)
    finally:
        shutil.rmtree(kv, ignore_errors=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sluice", default="target/release/sluice")
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--words", type=int, default=400, help="length of the first user message")
    ap.add_argument("--reply", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--server-args", default="", help="more `sluice serve` flags, one string")
    args = ap.parse_args()

    words = ("the river runs past the old mill and under the stone bridge where the children "
             "watch the boats go by in the long summer evenings ").split()
    long_text = " ".join(words[i % len(words)] for i in range(args.words))
    turn1 = [{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": "Summarise this:\n" + long_text}]
    runs = []
    for i in range(args.repeat):
        r = one_run(args, turn1)
        texts = {r[k][1] for k in r if k.startswith("turn 2")}
        assert len(texts) == 1, "replies differ between warm, cold and restored runs"
        runs.append(r)
        print(f"run {i + 1}: " + ", ".join(f"{k} {r[k][0]:.2f}s" for k in r if k.startswith("turn")), flush=True)

    print(f"model {args.model}, threads {args.threads or 'all'}, server args {args.server_args!r}, "
          f"{args.repeat} runs (min / median / max)")
    for name in ("turn 1", "turn 2 cold (no reuse)", "turn 2 warm (KV reuse)", "turn 2 restored (--kv-dir)"):
        ts = sorted(r[name][0] for r in runs)
        u = runs[0][name][2]
        print(f"{name:28s} prompt {u['prompt_tokens']:5d} tok, reused {u['reused_tokens']:5d}, "
              f"prefilled {u['prefilled_tokens']:5d}, TTFT {ts[0]:.2f} / {ts[len(ts) // 2]:.2f} / {ts[-1]:.2f} s")
    print(f"turn-1 session file in --kv-dir: {runs[0]['kv_bytes'] / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
