#!/usr/bin/env bash
# KV cache precision A/B (issue 16 item 3): decode and prefill at depth 0 and 4096 with
# -ctk/-ctv f32, f16 and q8_0, each arm a fresh `sluice bench -r 1` process, interleaved
# A B C C B A per depth. Usage: scripts/kv-precision-bench.sh [FILE] (default /tmp/h1-q30-4l.gguf,
# made by: sluice synth FILE --preset qwen3-30b-a3b --layers 4 --quant q4_k --skew 1.0 --seed 11).
set -euo pipefail
cd "$(dirname "$0")/.."
FILE=${1:-/tmp/h1-q30-4l.gguf}
for depth in 0 4096; do
    for t in f32 f16 q8_0 q8_0 f16 f32; do
        echo "== depth $depth kv $t load $(cut -d' ' -f1-3 /proc/loadavg)"
        target/release/sluice bench "$FILE" -p 512 -n 64 -d "$depth" -r 1 \
            --run-flags "--experts resident -t 2 -c 8192 -ctk $t -ctv $t" 2>&1 | grep -E '^\| run'
    done
done
