#!/bin/bash
# Session 35, a short device call (little device time left; issue 15): the tensor-core attention
# and f16-cache tests of this tree's binary (DIR/bins.tar.xz from scripts/pack-device.sh), then
# `sluice bench` A B B A: at depth 16384 and 4096 A = the default (decode splits at most 64),
# B = SLUICE_GPU_DEC_SPLITS=256; at depth 0 A = the default (a short context: f32 words, per-head
# split kernel), B = SLUICE_GPU_ATT_MMA_DEC=1 (f16 storage, grouped kernel: one split writes the
# output itself); then a partial-VRAM
# prompt's plan lines and prefill rate (stage, hybrid). (The split-count switch was removed after
# this call: 256 splits measured slower.) On the GPU machine:
# bash scripts/s35-device-3.sh DIR
set -u
D=${1:-target/devrun-s35}; OO=${OUT:-/tmp/out}; O=/tmp/o3; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s35; mkdir -p $V; S=$V/sluice; M=/var/tmp/q30-8.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
mkdir -p /work/main/target/tmp 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
xz -dc $D/bins.tar.xz | tar -xf - -C $V sluice gpu-tests py; chmod +x $V/sluice $V/gpu-tests
[ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 90 $V/gpu-tests gpu_tensor_core gpu_f16_cache gpu_q8_0 --test-threads=1 --nocapture > $O/new.log 2>&1; el "tests rc $?"
grep -E "attention_mma|f16 cache|test result|panicked|max" $O/new.log | head -30
wait $SY; el "synth"
R="--gpu on --experts resident"
sb() { env $3 timeout 60 $S bench $M -p 512 -n $1 $2 -r 1 --run-flags "$R" > $O/sb.log 2>&1; grep -hE "pp512|tg$1" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
for d in 16384 0 4096; do
  [ $(( $(date +%s) - T0 )) -gt 250 ] && { el "out of time before depth $d"; break; }
  a=""; [ $d = 0 ] || a="-d $d"
  A=X=1; B=SLUICE_GPU_DEC_SPLITS=256; [ $d = 0 ] && B=SLUICE_GPU_ATT_MMA_DEC=1
  echo "sluice A d$d: $(sb 64 "$a" $A)"; echo "sluice B($B) d$d: $(sb 64 "$a" $B)"
  echo "sluice B($B) d$d: $(sb 64 "$a" $B)"; echo "sluice A d$d: $(sb 64 "$a" $A)"
  el "depth $d"
done
P=$(python3 -c "print(' '.join('word%d' % i for i in range(100)))")
for m in stage hybrid; do
  [ $(( $(date +%s) - T0 )) -gt 300 ] && break
  timeout 25 $S run $M -p "$P" -n 4 --gpu on --experts resident -c 1024 -b 512 --vram 615M --gpu-experts $m > /dev/null 2> $O/h-$m.log
  grep -hE "^\[plan\] gpu|timing|gpu:" $O/h-$m.log | cut -c1-220
done
el "done"
tar -czf $OO/logs3.tgz -C $O .
