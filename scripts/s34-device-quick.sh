#!/bin/bash
# Session 34, a short device call (little device time left): the tensor-core attention tests, the
# f16-cache test with decode on the tensor cores, then `sluice bench` with decode attention on
# the tensor cores (X: SLUICE_GPU_ATT_MMA_DEC=1) and without (T), X T T X, at depth 0 and 16384.
# DIR/bins.tar.xz as for scripts/s34-device.sh. On the GPU machine: bash scripts/s34-device-quick.sh DIR
set -u
D=${1:-target/devrun-s34}; OO=${OUT:-/tmp/out}; O=/tmp/oq; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s34; mkdir -p $V; S=$V/sluice; M=/var/tmp/q30-8.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
nvidia-smi --query-gpu=name --format=csv,noheader
xz -dc $D/bins.tar.xz | tar -xf - -C $V sluice gpu-tests; chmod +x $S $V/gpu-tests
[ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 60 $V/gpu-tests gpu_tensor_core gpu_f16_cache --test-threads=1 --nocapture > $O/new.log 2>&1; el "tests rc $?"
SLUICE_GPU_ATT_MMA_DEC=1 timeout 30 $V/gpu-tests gpu_f16_cache --test-threads=1 --nocapture >> $O/new.log 2>&1; el "f16 cache, decode on tensor cores rc $?"
grep -E "attention_mma|f16 cache|test result|panicked" $O/new.log | head -30
wait $SY; el synth
R="--gpu on --experts resident"
sb() { env $3 timeout 60 $S bench $M -p 512 -n $1 $2 -r 1 --run-flags "$R" > $O/sb.log 2>&1; grep -hE "pp512|tg$1" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
for d in 16384 0; do
  a=""; [ $d = 0 ] || a="-d $d"
  for e in 1 0 0 1; do echo "sluice dec-mma=$e d$d: $(sb 64 "$a" SLUICE_GPU_ATT_MMA_DEC=$e)"; done
  el "depth $d"
done
tar -czf $OO/logsq.tgz -C $O .
