#!/bin/bash
# Session 36, third call (issue 15, partial VRAM): the RAM expert cache read at load when the
# VRAM pool holds a quarter of the experts. DIR as for s36-device-1.sh. Runs the placement and
# hybrid GPU tests; then `sluice bench -p 512 -n 32` with `--vram 615M` (30 slots a layer, 24 %
# of the experts), B = main at e0ebcb8, N = this tree: stage B N N B, hybrid N B; the plan lines.
# Everything printed goes to $OUT/out.txt too. On the GPU machine: bash scripts/s36-device-3.sh DIR
set -u
D=${1:-target/devrun-s36}; OO=${OUT:-/tmp/out}; O=/tmp/o3; mkdir -p $O $OO
exec > >(tee $OO/out.txt) 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s36; mkdir -p $V; N=$V/sluice; B=$V/sluice-base; M=/var/tmp/q30-8.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
mkdir -p /work/main/target/tmp 2>/dev/null
xz -dc $D/bins.tar.xz | tar -xf - -C $V; xz -dc $D/base/sluice.xz > $B
chmod +x $V/sluice $V/gpu-tests $B
[ -s $M ] || $N synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 100 $V/gpu-tests --test-threads=1 --nocapture placement hybrid_experts > $O/gpu.log 2>&1; el "gpu-tests rc $?"
grep -E "^test |test result|panicked|FAILED|failed" $O/gpu.log | cut -c1-200 | head -10
wait $SY; el "synth"
sb() { timeout 60 $1 bench $M -p 512 -n 32 -r 1 --run-flags "--gpu on --experts resident --vram 615M --gpu-experts $2" > $O/sb.log 2>&1; grep -hE "pp512|tg32" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
echo "B stage: $(sb $B stage)"; echo "N stage: $(sb $N stage)"; grep -h "RAM cache" $O/sb.log | head -n 1 | cut -c1-250
echo "N stage: $(sb $N stage)"; echo "B stage: $(sb $B stage)"
echo "N hybrid: $(sb $N hybrid)"; echo "B hybrid: $(sb $B hybrid)"
el "done"
