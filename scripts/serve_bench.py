#!/usr/bin/env python3
"""Benchmark (not a test): N concurrent streaming clients (the official `openai` package)
against `sluice serve --parallel N` and `llama-server -np N` on the same GGUF, fresh server per
run, arms interleaved A B B A. docs/PERFORMANCE.md ("Concurrent streaming clients against
llama-server") records the figures.

    python3 scripts/serve_bench.py --model /tmp/x.gguf --clients 1,2,4,8 --max-tokens 64 \
        --sluice target/release/sluice --llama-server vendor-data/llama.cpp-server/bin/llama-server \
        [--arms sluice,sluice-avx2,llama,base] [--sluice-base /tmp/main-sluice] [--rounds 2] \
        [--threads 2] [--ctx 512] [--prompt-repeat 1] [--slots S] \
        [--sluice-args "--experts resident"] [--llama-args "--mlock"] [--json out.json]

Per client count N and arm: start the server with N slots of `--ctx` positions each (sluice:
`--parallel N -c CTX`; llama-server: `-np N -c N*CTX`, whose slots split `-c`), the same
threads (`-t`, and llama-server's `-tb`), send one 1-token warm-up request, then N streaming
completions at once (`/v1/completions`, prompts[i], temperature 0, `max_tokens`, ignore_eos so
every request generates exactly `max_tokens`). Per request: time to first token (send to the
first chunk with text), decode tok/s ((tokens - 1) / (last chunk - first chunk)). Per run:
aggregate tok/s = all generated tokens / (first send to last chunk), and the 1-minute load
average at the start (the machine may be shared). Tokens per request are the stream's usage
figure (`stream_options.include_usage`) where the server sends one, else the text chunks.
Arms: `sluice`, `base` (another sluice binary, `--sluice-base`: before/after a change), `sluice-avx2` (the same binary with SLUICE_ISA=avx2: its kernels capped at
AVX2, like for like with scripts/build-llama-server.sh's AVX2 build), `llama`. With several arms
the order per N is A B C, then C B A. Against sluice, also expert bytes read from disk per
generated token (/metrics). Needs `pip install openai`.
"""

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import threading
import time
import urllib.request

import openai

PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over",
    "In the beginning there was",
    "A long time ago in a galaxy far",
    "It was a bright cold day in April",
    "Call me Ishmael. Some years ago",
    "All happy families are alike",
    "It is a truth universally acknowledged",
]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def drain(stream, log):
    for line in stream:
        log.append(line)


def start_sluice(args, n, isa=None, binary=None):
    cmd = ([binary or args.sluice, "serve", args.model, "--port", "0", "-t", str(args.threads), "-c", str(args.ctx),
            "--parallel", str(args.slots or n), "--temp", "0"] + args.sluice_args.split())
    env = dict(os.environ)
    if isa:
        env["SLUICE_ISA"] = isa
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    log = []
    for line in p.stderr:
        log.append(line)
        m = re.search(r"listening on http://(\S+)", line)
        if m:
            threading.Thread(target=drain, args=(p.stderr, log), daemon=True).start()
            return p, "http://" + m.group(1), log
    raise SystemExit("sluice did not start:\n" + "".join(log[-30:]))


def start_llama(args, n):
    port = free_port()
    cmd = ([args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
            "-t", str(args.threads), "-tb", str(args.threads), "-np", str(args.slots or n),
            "-c", str((args.slots or n) * args.ctx),
            "--no-kv-unified", "--temp", "0"] + args.llama_args.split())
    p = subprocess.Popen(cmd, stderr=subprocess.STDOUT, stdout=subprocess.PIPE, text=True)
    log = []
    threading.Thread(target=drain, args=(p.stdout, log), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < 600:
        if p.poll() is not None:
            raise SystemExit("llama-server exited:\n" + "".join(log[-30:]))
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return p, url, log
        except Exception:
            pass
        time.sleep(0.5)
    p.kill()
    raise SystemExit("llama-server did not become healthy:\n" + "".join(log[-30:]))


def expert_bytes(url):
    """sluice's expert bytes read from disk so far (/metrics), or None (llama-server)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("sluice_expert_bytes_read_total"):
                    return float(line.rsplit(" ", 1)[1])
    except Exception:
        pass
    return None


def one(client, model, prompt, max_tokens, out, i):
    t0 = time.time()
    first = last = None
    chunks = 0
    usage = None
    text = []
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for ev in stream:
        if getattr(ev, "usage", None) is not None and ev.usage.completion_tokens:
            usage = ev.usage.completion_tokens
        for c in ev.choices or []:
            if c.text:
                now = time.time()
                if first is None:
                    first = now
                last = now
                chunks += 1
                text.append(c.text)
    n = usage if usage else chunks
    out[i] = {"t0": t0, "first": first, "last": last, "tokens": n, "chunks": chunks, "text": "".join(text)}


def run(args, arm, n):
    load = os.getloadavg()[0]
    if arm == "llama":
        p, url, log = start_llama(args, n)
    else:
        # "sluice-avx2": the same binary with its kernels capped at AVX2 (SLUICE_ISA), like
        # for like with a llama.cpp built without AVX-512.
        # "base": another sluice binary (`--sluice-base`, e.g. main's build) for a before/after.
        p, url, log = start_sluice(args, n, arm.split("-", 1)[1] if "-" in arm else None,
                                   args.sluice_base if arm.startswith("base") else None)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=3600, max_retries=0)
        model = client.models.list().data[0].id
        one(client, model, "Hello", 1, {}, 0)
        b0 = expert_bytes(url) if arm != "llama" else None
        out = {}
        ts = [threading.Thread(target=one, args=(client, model,
                                                 " ".join([PROMPTS[i % len(PROMPTS)]] * args.prompt_repeat),
                                                 args.max_tokens, out, i)) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        b1 = expert_bytes(url) if b0 is not None else None
    finally:
        p.terminate()
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if len(out) != n:
        raise SystemExit(f"{arm} N={n}: {n - len(out)} requests failed:\n" + "".join(log[-30:]))
    start = min(r["t0"] for r in out.values())
    end = max(r["last"] for r in out.values())
    gen = sum(r["tokens"] for r in out.values())
    dec = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in out.values() if r["last"] > r["first"]]
    ttft = [r["first"] - r["t0"] for r in out.values()]
    return {"arm": arm, "n": n, "load": load, "wall": end - start, "generated": gen,
            "agg_tps": gen / (end - start), "decode_tps": statistics.mean(dec) if dec else 0.0,
            "ttft": statistics.mean(ttft), "ttft_max": max(ttft),
            "mb_per_tok": (b1 - b0) / gen / 1e6 if b1 is not None else None,
            "texts": [out[i]["text"] for i in range(n)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--sluice", default="target/release/sluice")
    ap.add_argument("--sluice-base", default="", help="the binary of the `base` arm")
    ap.add_argument("--slots", type=int, default=0,
                    help="server slots whatever the client count (default: as many as clients)")
    ap.add_argument("--prompt-repeat", type=int, default=1,
                    help="each prompt repeated K times (longer prompts: TTFT under prefill)")
    ap.add_argument("--llama-server", default="vendor-data/llama.cpp-server/bin/llama-server")
    ap.add_argument("--arms", default="sluice,llama")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--sluice-args", default="--experts resident")
    ap.add_argument("--llama-args", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    arms = args.arms.split(",")
    ns = [int(x) for x in args.clients.split(",")]
    results = []
    for n in ns:
        order = []
        for r in range(args.rounds):
            order += arms if r % 2 == 0 else arms[::-1]
        for arm in order:
            r = run(args, arm, n)
            results.append(r)
            print(f"{arm:6} N={n}: {r['generated']} tok in {r['wall']:.2f} s = {r['agg_tps']:.2f} tok/s aggregate, "
                  f"decode {r['decode_tps']:.2f} tok/s per request, TTFT {r['ttft'] * 1000:.0f} ms "
                  f"(max {r['ttft_max'] * 1000:.0f}), load {r['load']:.1f}"
                  + (f", expert MB read/token {r['mb_per_tok']:.1f}" if r["mb_per_tok"] is not None else ""),
                  flush=True)
        for arm in arms:
            rs = [r for r in results if r["arm"] == arm and r["n"] == n]
            same = all(r["texts"] == rs[0]["texts"] for r in rs)
            if not same:
                print(f"{arm} N={n}: texts differ between rounds", flush=True)
        if "sluice" in arms and "base" in arms:
            a = [r["texts"] for r in results if r["arm"] == "sluice" and r["n"] == n]
            b = [r["texts"] for r in results if r["arm"] == "base" and r["n"] == n]
            print(f"N={n}: sluice and base texts {'identical' if a[0] == b[0] else 'DIFFER'}", flush=True)
    print("\n| N | arm | aggregate tok/s (runs) | decode tok/s per request | TTFT ms mean / max | load |")
    print("| --- | --- | --- | --- | --- | --- |")
    med = {}
    for n in ns:
        for arm in arms:
            rs = [r for r in results if r["arm"] == arm and r["n"] == n]
            ag = [r["agg_tps"] for r in rs]
            med[(arm, n)] = statistics.median(ag)
            print(f"| {n} | {arm} | {med[(arm, n)]:.2f} ({', '.join(f'{x:.2f}' for x in ag)}) | "
                  f"{statistics.median(r['decode_tps'] for r in rs):.2f} | "
                  f"{statistics.median(r['ttft'] for r in rs) * 1000:.0f} / "
                  f"{statistics.median(r['ttft_max'] for r in rs) * 1000:.0f} | "
                  f"{', '.join('%.1f' % r['load'] for r in rs)} |")
    if "llama" in arms:
        for a in arms:
            if a != "llama":
                for n in ns:
                    print(f"N={n}: {a}/llama-server aggregate {med[(a, n)] / med[('llama', n)]:.2f}x")
    if "sluice" in arms and 1 in ns:
        for n in ns:
            print(f"N={n}: sluice aggregate / sluice N=1 {med[('sluice', n)] / med[('sluice', 1)]:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
