#!/bin/bash
# Session 37, fourth device call (issue 15): the decode kernel's split rule (splits of at least
# min(256, len / 16) positions) against the old one (SLUICE_GPU_DEC_MIN_CHUNK=64) at depth 1024 /
# 2048 / 4096 (tg64, A B B A), the decode-attention test, and Nsight Compute's durations of one
# depth-0 decode step's kernels (no launch gaps). DIR holds bins.tar.xz (scripts/pack-device.sh).
set -u
D=${1:-target/devrun-s37}; OO=${OUT:-/tmp/out}; O=/tmp/o4; mkdir -p $O $OO
exec > >(tee $OO/out.txt) 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s37c; mkdir -p $V; S=$V/sluice; M=/var/tmp/q30-8.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
mkdir -p /work/main/target/tmp 2>/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $V/sluice $V/gpu-tests
[ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 100 $V/gpu-tests --test-threads=1 --nocapture gpu_tensor_core_decode gpu_f16_cache > $O/gpu.log 2>&1; el "gpu-tests rc $?"
grep -E "^test |test result|panicked|FAILED|failed" $O/gpu.log | cut -c1-220 | head -20
wait $SY; el "synth"
F="--gpu on --experts resident"
sb() { SLUICE_GPU_DEC_MIN_CHUNK=$2 timeout 100 $S bench $M -p 512 -n 64 -d $1 -r 1 --run-flags "$F" > $O/sb.log 2>&1; grep -hE "tg64" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
for d in 2048 1024 4096; do
  for c in 64 256 256 64; do echo "d$d min chunk $c: $(sb $d $c)"; done
  el "d$d"
done
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
timeout 150 $NCU --launch-skip 600 --launch-count 75 --metrics gpu__time_duration.sum \
  $S run $M -p "hello there" -n 24 --gpu on --experts resident -c 4096 > $O/ncu-d0.txt 2>&1; el "ncu d0 rc $?"
awk '/^  [a-zA-Z_0-9]+ \(/{k=$1} /gpu__time_duration.sum/{v=$NF; if ($(NF-1)=="ms") v*=1000; if ($(NF-1)=="ns"||$(NF-1)=="nsecond") v/=1000; print k, v}' $O/ncu-d0.txt \
  | awk '{s[$1]+=$2; c[$1]++; t+=$2} END{for(k in s) printf "%-34s n=%3d mean %7.2f us total %8.1f\n", k, c[k], s[k]/c[k], s[k]; printf "all %.1f us over %d launches\n", t, NR}' | sort -k7 -g -r | head -30
grep -m3 "gpu__time_duration" $O/ncu-d0.txt
tar -czf $OO/logs.tgz -C $O .
