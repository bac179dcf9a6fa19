#!/bin/bash
# Session 30, device call after scripts/s29-device-3.sh (back to back: sluice in /var/tmp/s29, the
# 8-layer Qwen3-30B-A3B-shaped Q4_K file in /var/tmp): where a decode token's GPU time goes at
# depth 0 and 16384, with per-head flash-decoding (attention_split_merge) and with the grouped
# kernel (SLUICE_GPU_ATT_GROUP=1), from the graph-replay profiler (SLUICE_GPU_PROFILE_GRAPH).
# The grouped kernel reads each K/V row once per group instead of 8 times but measured slower
# (docs/PERFORMANCE.md, session 29): this says which kernel pays.
# On the GPU machine: bash scripts/s30-device-4.sh
set -u
OO=${OUT:-/tmp/out}; O=/tmp/o4; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s29; S=$V/sluice; M=/var/tmp/q30-8.gguf
[ -x $S ] || { echo "no $S: the machine was not warm"; exit 3; }
export SLUICE_ROOT=$PWD
P="The history of the lighthouse begins with fires lit on hills to guide ships home"
pr() { env $3 SLUICE_GPU_PROFILE_GRAPH=$O/prof-$1.txt timeout 120 $S run $M -p "$P" -n 64 --temp 0 --ignore-eos --gpu on --experts resident -c 20480 --depth $2 > $O/run-$1.log 2>&1
  el "$1 (depth $2, $3) rc $?: $(grep -ihE 'tok/s|timing' $O/run-$1.log | tail -2 | tr '\n' ' ')"; }
pr d0 0 X=1; pr d0-group 0 SLUICE_GPU_ATT_GROUP=1
pr d16k 16384 X=1; pr d16k-group 16384 SLUICE_GPU_ATT_GROUP=1
for f in $O/prof-*.txt; do echo "== $f"; head -30 $f; done
el done
tar -czf $OO/logs4.tgz -C $O .
