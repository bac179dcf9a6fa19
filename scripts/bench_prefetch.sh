#!/usr/bin/env bash
# Prefetch A/B (docs/PERFORMANCE.md, "Prefetch"): a generated Qwen3-30B-A3B-shaped model of 6
# layers (Q4_K, skewed routing) streamed under budgets smaller than its experts, O_DIRECT,
# decode tok/s with --prefetch=off (A) vs --prefetch (B) as interleaved fresh processes, then
# one run of each arm for the hit rate, precision and recall lines.
# Usage: scripts/bench_prefetch.sh [SLUICE_BINARY] [DIR] [THREADS] [RAM...]
set -euo pipefail
B=${1:-target/release/sluice}
D=${2:-/tmp/pf}
T=${3:-2}
shift $(( $# < 3 ? $# : 3 ))
RAMS=${*:-1G 700M}
mkdir -p "$D"
M=$D/m.gguf
[ -f "$M" ] || "$B" synth "$M" --preset qwen3-30b-a3b --layers 6 --quant q4_k --skew 1.0 2>&1 | tail -1
for R in $RAMS; do
  F="--experts stream --ram $R --io direct -c 512 -t $T --usage-freeze"
  echo "== --ram $R, -t $T"
  "$B" bench "$M" -p 32 -n 32 -r 6 --run-flags "$F" --ab '--prefetch=off' '--prefetch'
  for P in --prefetch=off --prefetch; do
    "$B" run "$M" -p "the river runs under the old stone bridge" -n 32 --ignore-eos --temp 0 $F $P 2>&1 >/dev/null \
      | grep -E '^\[plan\] (io|experts: streamed,)|^\[experts\]|^\[timing\]'
  done
done
