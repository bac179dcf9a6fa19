#!/bin/bash
# Session 36, second kernel call (issue 15). DIR as for s36-device-1.sh. Everything printed goes
# to $OUT/out.txt too. Runs: the tensor-core attention tests (128 splits now among the cases)
# and the f16-cache logits of the tiny families; `sluice bench` B N N B per depth (16384, 4096,
# 0), B = main at e0ebcb8, N = this tree (the decode merge by the whole block); N with 96 and
# 128 decode splits (SLUICE_GPU_DEC_SPLITS) at 16384 and 4096; Nsight Compute's kernel times of
# whole decode steps at depth 0 (every kernel, serialized). On the GPU machine:
# bash scripts/s36-device-2.sh DIR
set -u
D=${1:-target/devrun-s36}; OO=${OUT:-/tmp/out}; O=/tmp/o2; mkdir -p $O $OO
exec > >(tee $OO/out.txt) 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s36; mkdir -p $V; N=$V/sluice; B=$V/sluice-base; M=/var/tmp/q30-8.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
mkdir -p /work/main/target/tmp 2>/dev/null  # the test binary's CARGO_TARGET_TMPDIR
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
xz -dc $D/bins.tar.xz | tar -xf - -C $V; xz -dc $D/base/sluice.xz > $B
chmod +x $V/sluice $V/gpu-tests $V/gpu-types $V/kernels-tile $B
[ -s $M ] || $N synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 150 $V/gpu-tests --test-threads=1 --nocapture tensor_core f16_cache > $O/gpu.log 2>&1; el "gpu-tests rc $?"
grep -E "^test |test result|panicked|FAILED|failed|stored as f16" $O/gpu.log | cut -c1-200 | head -30
wait $SY; el "synth"; ls -la $M
R="--gpu on --experts resident"
sb() { env $4 timeout 100 $1 bench $M -p 512 -n $2 $3 -r 1 --run-flags "$R ${5:-}" > $O/sb.log 2>&1; grep -hE "pp512|tg$2" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
for d in 16384 4096 0; do
  a=""; [ $d = 0 ] || a="-d $d"
  echo "B d$d: $(sb $B 64 "$a" X=1)"; echo "N d$d: $(sb $N 64 "$a" X=1)"
  echo "N d$d: $(sb $N 64 "$a" X=1)"; echo "B d$d: $(sb $B 64 "$a" X=1)"
  el "depth $d"
done
for d in 16384 4096; do for s in 96 128; do echo "N splits $s d$d: $(sb $N 64 "-d $d" SLUICE_GPU_DEC_SPLITS=$s)"; done; done
el "splits"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
if [ -n "$NCU" ]; then
  timeout 150 $NCU --target-processes all --launch-skip 400 --launch-count 160 --section SpeedOfLight \
    $N bench $M -p 16 -n 16 -r 1 --run-flags "$R" > $O/ncu-d0.txt 2>&1; el "ncu d0 rc $?"
  awk '/^  [a-z_0-9]+ \(/{k=$1} /Duration/{print k, $3}' $O/ncu-d0.txt | awk '{s[$1]+=$2; c[$1]++; t+=$2} END{for(k in s) printf "%-32s n=%3d mean %6.2f us total %7.1f\n", k, c[k], s[k]/c[k], s[k]; printf "all %.1f us over %d kernels\n", t, NR}' | sort -k5 -n -r
fi
tar -czf $OO/logs2.tgz -C $O .
