#!/bin/bash
# Session 35, first device call (issue 15): the KV cache stored as f16 where the tensor-core
# kernels serve every step (kv_half_storage), and empty decode splits that compute nothing.
# DIR/bins.tar.xz from scripts/pack-device.sh (this tree), DIR/base/sluice.xz the binary before
# (c5c79b2). Runs the new attention tests, then `sluice bench` base (B) against new (N), B N N B,
# tg64 and pp512 at depth 0, 4096 and 16384 (N0: new with SLUICE_GPU_ATT_MMA_DEC=0, f32 storage
# and the per-head split kernel, at depth 0), then where a decode token's time goes in the new
# binary (SLUICE_GPU_PROFILE_GRAPH) at depth 0 and 16384, then every GPU test while time is left.
# On the GPU machine: bash scripts/s35-device-1.sh DIR
set -u
D=${1:-target/devrun-s35}; OO=${OUT:-/tmp/out}; O=/tmp/o1; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s35; mkdir -p $V; S=$V/sluice; M=/var/tmp/q30-8.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; grep -m1 "model name" /proc/cpuinfo
xz -dc $D/bins.tar.xz | tar -xf - -C $V; xz -dc $D/base/sluice.xz > $V/sluice-base
chmod +x $V/sluice $V/sluice-base $V/gpu-tests $V/gpu-types $V/kernels-tile
[ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 120 $V/gpu-tests gpu_tensor_core gpu_f16_cache --test-threads=1 --nocapture > $O/new.log 2>&1; el "new tests rc $?"
grep -E "attention_mma|f16 cache|test result|panicked" $O/new.log | head -40
wait $SY; el "synth"; ls -la $M
R="--gpu on --experts resident"
sb() { env ${3:-X=1} timeout 100 ${4:-$S} bench $M -p 512 -n $1 $2 -r 1 --run-flags "$R" > $O/sb.log 2>&1; grep -hE "pp512|tg$1" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
for d in 16384 0 4096; do
  a=""; [ $d = 0 ] || a="-d $d"
  echo "B  d$d: $(sb 64 "$a" X=1 $V/sluice-base)"
  echo "N  d$d: $(sb 64 "$a")"
  [ $d = 0 ] && echo "N0 d$d: $(sb 64 "$a" SLUICE_GPU_ATT_MMA_DEC=0)"
  echo "N  d$d: $(sb 64 "$a")"
  [ $d = 0 ] && echo "N0 d$d: $(sb 64 "$a" SLUICE_GPU_ATT_MMA_DEC=0)"
  echo "B  d$d: $(sb 64 "$a" X=1 $V/sluice-base)"
  el "depth $d"
done
grep -h "KV cache" $O/sb.log | head -n 2
for d in 0 16384; do
  a=""; [ $d = 0 ] || a="-d $d"
  env SLUICE_GPU_PROFILE_GRAPH=$O/prof-d$d.txt timeout 100 $S bench $M -p 0 -n 64 $a -r 1 --run-flags "$R" > $O/prof.log 2>&1
  head -n 32 $O/prof-d$d.txt
done
el "profiles"
timeout $(( 560 - ($(date +%s) - T0) )) $V/gpu-tests --test-threads=1 --skip ptx_is_built --skip gpu_tensor_core --skip gpu_f16_cache > $O/gpu.log 2>&1; el "gpu-tests rc $?"
grep -E "^test |test result|panicked|FAILED|failed" $O/gpu.log | head -40
tar -czf $OO/logs1.tgz -C $O .
