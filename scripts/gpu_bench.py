#!/usr/bin/env python3
"""The CUDA backend's benchmark (issue: VRAM expert tier and residency-aware staging).

Runs `sluice run` on a synthetic model whose experts exceed the VRAM pool, as fresh processes in
interleaved order (A B C C B A per configuration), temp 0, usage statistics frozen, and prints
a markdown table: decode tok/s, GPU wall / kernel / stall, VRAM hit rate, and expert
host->device GB/s against the pinned-copy ceiling measured in the same process. Refuses to
report a configuration whose arms generated different text.

usage: gpu_bench.py SLUICE MODEL OUTDIR [--vram 0.7G,1.4G] [--arms arena,per-expert,pageable]
"""
import json, os, statistics, subprocess, sys

PROMPT = ("The history of the river valley begins with the first farmers who settled along its banks, "
          "planting barley and wheat in the rich silt left by the spring floods. Over centuries they "
          "built canals, granaries and small towns, traded copper and salt with the hill peoples, and "
          "kept records of every harvest on clay tablets. When the great drought came, the towns "
          "emptied one by one, and the canals filled with sand. Travellers who crossed the valley "
          "generations later found only mounds and broken pottery, and told stories of a kingdom "
          "that had angered the river. Modern surveys have mapped more than two hundred sites. ") * 2


def arg(name, default):
    if name in sys.argv:
        return sys.argv[sys.argv.index(name) + 1]
    return default


def main():
    sluice, model, out = sys.argv[1:4]
    os.makedirs(out, exist_ok=True)
    vrams = arg("--vram", "0.7G,1.4G,2.1G").split(",")
    arms = arg("--arms", "arena,per-expert,pageable").split(",")
    n = arg("-n", "64")
    sources = {
        "RAM": ["--experts", "stream"],
        "SSD": ["--experts", "stream", "--cap", arg("--ssd-cap", "24"), "--io", "direct"],
    }
    rows = []
    for src, sflags in sources.items():
        for vram in vrams:
            order = arms + arms[::-1]
            res = {a: [] for a in arms}
            texts = set()
            for i, arm in enumerate(order):
                js = os.path.join(out, f"{src}-{vram}-{arm}-{i}.json")
                cmd = [sluice, "run", model, "-p", PROMPT, "-n", n, "--temp", "0", "--usage-freeze",
                       "--gpu", "on", "--vram", vram, "--gpu-staging", arm, "--stats-json", js] + sflags
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode != 0:
                    print(f"FAILED: {' '.join(cmd)}\n{p.stderr[-2000:]}", file=sys.stderr)
                    sys.exit(1)
                with open(os.path.join(out, f"{src}-{vram}-{arm}-{i}.err"), "w") as f:
                    f.write(p.stderr)
                texts.add(p.stdout)
                res[arm].append(json.load(open(js)))
            same = len(texts) == 1
            for arm in arms:
                runs = res[arm]
                g = [r["gpu"] for r in runs]
                med = lambda k: statistics.median(x[k] for x in g)
                tps = statistics.median(r["decode_tok_s"] for r in runs)
                ceil = med("h2d_ceiling_gb_s")
                rows.append((src, vram, arm, tps, med("wall_s"), med("kernel_s"), med("stall_share"),
                             med("vram_hit_rate"), med("experts_h2d"), med("h2d_gb_s"),
                             med("h2d_gb_s") / ceil if ceil else 0, ceil, med("register_s"),
                             statistics.median(r.get("hit_rate", 0) for r in runs), same))
    print("| experts from | --vram | staging | decode tok/s | GPU wall s | kernel s | stall | VRAM hit | RAM hit | experts copied | H2D GB/s | ÷ pinned ceiling | register s | same text |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        (src, vram, arm, tps, wall, ker, stall, vhit, ncopy, gbs, frac, ceil, reg, rhit, same) = r
        print(f"| {src} | {vram} | {arm} | {tps:.1f} | {wall:.2f} | {ker:.2f} | {100*stall:.0f}% | {100*vhit:.1f}% | "
              f"{100*rhit:.1f}% | {ncopy:.0f} | {gbs:.1f} | {frac:.2f} (of {ceil:.1f}) | {reg:.3f} | {'yes' if same else 'NO'} |")
    if not all(r[-1] for r in rows):
        print("arms generated different text: ratios above are not comparable", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
