#!/bin/bash
# Session 32, first of three back-to-back device calls (issues 15, 16). The carry holds 64 MiB
# with the tree, so the bundle travels in two calls: here DIR/bins.tar.xz (the stripped `sluice`
# built with --features cuda, xz -9e), unpacked into /var/tmp/s29 for the next calls; then the
# 8-layer Qwen3-30B-A3B-shaped Q4_K file and the 2-layer DeepSeek-V3-shaped Q4_K file are
# written, and the graph-replay profile of decode runs (scripts/s30-device-4.sh).
# Next: scripts/s32-device-2.sh (llama.cpp's CUDA build and the anchor), scripts/s32-device-3.sh.
# On the GPU machine: bash scripts/s32-device-1.sh DIR
set -u
D=${1:-target/devrun-s32}; OO=${OUT:-/tmp/out}; O=/tmp/o1; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
grep -o -m1 'amx[a-z_0-9]*' /proc/cpuinfo | head -1
V=/var/tmp/s29; mkdir -p $V
xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $V/sluice
export SLUICE_ROOT=$PWD
S=$V/sluice; M=/var/tmp/q30-8.gguf; M3=/var/tmp/ds3-2.gguf
[ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
[ -s $M3 ] || $S synth $M3 --preset deepseek-v3 --layers 2 --quant q4_k --no-mtp --seed 11 > $O/synth3.log 2>&1 &
wait; el "synths"; ls -la $M $M3
OUT=$OO bash scripts/s30-device-4.sh
el "done"
tar -czf $OO/logs1.tgz -C $O .
