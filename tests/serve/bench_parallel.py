#!/usr/bin/env python3
"""Benchmark (not a test): aggregate decode throughput of N concurrent requests against
`sluice serve --parallel P`, for several P, on fresh servers, arms interleaved A B B A.

    python3 tests/serve/bench_parallel.py --sluice target/release/sluice --model /tmp/x.gguf \
        --parallel 1,4 --clients 4 --max-tokens 48 [--rounds 2] \
        [--server-args "--experts stream --cap 8 --io direct"]   (an arm "auto": no --parallel)

Per arm and round: start a server, send one warm-up request (1 token; its figures are
subtracted), then `--clients` completions at once (different prompts, temperature 0,
ignore_eos), and read /metrics before and after. Reports per run: wall seconds from the first
send to the last answer, generated tokens, aggregate tok/s, mean per-request tok/s, expert
bytes read (sluice_expert_bytes_read_total) per generated token (prompt reads included, the
prompts are short), routed experts computed per generated token (sluice_experts_computed_total:
decode steps only; a batched step's union counts once for all its rows), decode rows per
batched step. Checks that every arm returned the same
texts (temperature 0). Standard library only. docs/PERFORMANCE.md records the figures.
"""

import argparse
import http.client
import json
import re
import statistics
import subprocess
import threading
import time

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


def start(args, parallel):
    # "auto": no --parallel, the planner's count (its `[plan] parallel:` line is printed).
    slots = [] if parallel == "auto" else ["--parallel", str(parallel)]
    cmd = ([args.sluice, "serve", args.model, "--port", "0", "-t", str(args.threads), "-c", str(args.ctx)]
           + slots + ["--temp", "0"] + args.server_args.split())
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    log = []
    for line in p.stderr:
        log.append(line)
        if "[plan] parallel:" in line and parallel == "auto":
            print(line.rstrip(), flush=True)
        m = re.search(r"listening on http://(\S+)", line)
        if m:
            host, port = m.group(1).rsplit(":", 1)
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
            return p, host, int(port), log
    raise SystemExit("server did not start:\n" + "".join(log))


def request(host, port, method, path, body=None):
    c = http.client.HTTPConnection(host, port, timeout=3600)
    c.request(method, path, body=json.dumps(body) if body else None,
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read().decode()
    c.close()
    return r.status, data


def metrics(host, port):
    _, text = request(host, port, "GET", "/metrics")
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{")[0].split(" ")[0]
        out[name] = float(line.rsplit(" ", 1)[1])
    return out


def one(host, port, model, prompt, n, out, i):
    t0 = time.time()
    st, data = request(host, port, "POST", "/v1/completions",
                       {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                        "ignore_eos": True})
    if st != 200:
        raise SystemExit(f"status {st}: {data}")
    v = json.loads(data)
    out[i] = (v["choices"][0]["text"], v["usage"]["completion_tokens"], time.time() - t0)


def run(args, parallel):
    p, host, port, log = start(args, parallel)
    try:
        _, models = request(host, port, "GET", "/v1/models")
        model = json.loads(models)["data"][0]["id"]
        one(host, port, model, "Hello", 1, {}, 0)
        m0 = metrics(host, port)
        out = {}
        ts = [threading.Thread(target=one, args=(host, port, model, PROMPTS[i % len(PROMPTS)],
                                                 args.max_tokens, out, i))
              for i in range(args.clients)]
        t0 = time.time()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        wall = time.time() - t0
        m1 = metrics(host, port)
    finally:
        p.terminate()
        p.wait(timeout=120)
    d = lambda k: m1.get(k, 0.0) - m0.get(k, 0.0)
    gen = sum(out[i][1] for i in out)
    steps = d("sluice_batch_steps_total")
    return {
        "parallel": parallel,
        "wall": wall,
        "generated": gen,
        "agg_tps": gen / wall,
        "per_req_tps": statistics.mean(out[i][1] / out[i][2] for i in out),
        "bytes_per_tok": d("sluice_expert_bytes_read_total") / max(gen, 1),
        "experts_per_tok": d("sluice_experts_computed_total") / max(gen, 1),
        "rows_per_step": d("sluice_batch_decode_rows_total") / steps if steps else 1.0,
        "texts": [out[i][0] for i in sorted(out)],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sluice", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--parallel", default="1,4")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--server-args", default="")
    args = ap.parse_args()
    arms = [x if x == "auto" else int(x) for x in args.parallel.split(",")]
    order = []
    for r in range(args.rounds):
        order += arms if r % 2 == 0 else arms[::-1]
    res = {a: [] for a in arms}
    for a in order:
        r = run(args, a)
        res[a].append(r)
        print(f"--parallel {a}: {r['generated']} tok in {r['wall']:.2f} s = {r['agg_tps']:.2f} tok/s aggregate, "
              f"{r['per_req_tps']:.2f} tok/s per request, expert bytes/token {r['bytes_per_tok'] / 1e6:.1f} MB, "
              f"experts computed/token {r['experts_per_tok']:.1f}, decode rows/step {r['rows_per_step']:.2f}", flush=True)
    texts = {a: res[a][0]["texts"] for a in arms}
    same = all(texts[a] == texts[arms[0]] for a in arms)
    print("texts identical across arms:", same)
    for a in arms:
        ag = [r["agg_tps"] for r in res[a]]
        bt = [r["bytes_per_tok"] / 1e6 for r in res[a]]
        print(f"summary --parallel {a}: aggregate tok/s median {statistics.median(ag):.2f} "
              f"(min {min(ag):.2f}, max {max(ag):.2f}); expert MB/token median {statistics.median(bt):.1f}")


if __name__ == "__main__":
    main()
