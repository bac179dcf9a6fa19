#!/bin/bash
# Session 33, first of two back-to-back device calls (issue 15: prompt attention at depth).
# DIR/bins.tar.xz: the stripped `sluice` and tests/gpu.rs binary (`gpu-tests`), both built with
# --features cuda (xz -9e, dict 128 MiB: the two share most bytes). Runs the new tensor-core
# attention tests, then every GPU test, writes the 8-layer Qwen3-30B-A3B-shaped Q4_K file, and
# times `sluice bench` with prompt attention on the tensor cores (SLUICE_GPU_ATT_MMA=1, f16
# cache) against attention_tiled (the default), interleaved A B B A, at depth 0, 4096 and 16384.
# Next: scripts/s33-device-2.sh (llama.cpp's CUDA build and the anchor).
# On the GPU machine: bash scripts/s33-device-1.sh DIR
set -u
D=${1:-target/devrun-s33}; OO=${OUT:-/tmp/out}; O=/tmp/o1; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
V=/var/tmp/s33; mkdir -p $V
xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $V/sluice $V/gpu-tests
export SLUICE_ROOT=$PWD
S=$V/sluice; M=/var/tmp/q30-8.gguf
[ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 60 $V/gpu-tests gpu_tensor_core gpu_f16_cache --test-threads=1 --nocapture > $O/new.log 2>&1; el "new tests rc $?"
SLUICE_GPU_ATT_MMA=1 timeout 60 $V/gpu-tests gpu_f16_cache --test-threads=1 --nocapture >> $O/new.log 2>&1; el "f16 cache test with the tensor cores rc $?"
grep -E "attention_mma|f16 cache|test result|panicked" $O/new.log | head -30
timeout 240 $V/gpu-tests --test-threads=1 --skip gpu_tensor_core --skip gpu_f16_cache > $O/gpu.log 2>&1; el "gpu-tests rc $?"
grep -E "^test |test result|panicked" $O/gpu.log | head -40
wait $SY; el "synth"; ls -la $M
R="--gpu on --experts resident"
sd() { env $3 timeout 90 $S bench $M -p 512 -n 64 $2 -r 1 --run-flags "$R" > $O/sd-$1.log 2>&1; echo "sluice $1 $2 ($3): $(grep -hE 'pp512|tg64' $O/sd-$1.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' ')"; grep -iE "error|panick" $O/sd-$1.log | tail -1; }
for d in "" "-d 4096" "-d 16384"; do
  sd mma "$d" SLUICE_GPU_ATT_MMA=1; sd tiled "$d" X=1; sd tiled "$d" X=1; sd mma "$d" SLUICE_GPU_ATT_MMA=1
  el "depth $d"
done
grep -h "kv cache" $O/sd-mma.log | head -2
el "done"
tar -czf $OO/logs1.tgz -C $O .
