#!/bin/bash
# Session 37, third device call (issue 15): the decode kernel's least split length
# (SLUICE_GPU_DEC_MIN_CHUNK, default 256) against the old 64 and 512 at depth 1024 / 4096 /
# 16384 (tg64, interleaved), the decode-attention and model tests, and per-kernel times of the
# replayed decode graph at depth 0 and 4096. DIR holds bins.tar.xz (scripts/pack-device.sh).
set -u
D=${1:-target/devrun-s37}; OO=${OUT:-/tmp/out}; O=/tmp/o3; mkdir -p $O $OO
exec > >(tee $OO/out.txt) 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s37b; mkdir -p $V; S=$V/sluice; M=/var/tmp/q30-8.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
mkdir -p /work/main/target/tmp 2>/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $V/sluice $V/gpu-tests
[ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 200 $V/gpu-tests --test-threads=1 --nocapture gpu_tensor_core_decode gpu_f16_cache gpu_tokens_identical gpu_logits_match gpu_q8_0 > $O/gpu.log 2>&1; el "gpu-tests rc $?"
grep -E "^test |test result|panicked|FAILED|failed" $O/gpu.log | cut -c1-220 | head -20
wait $SY; el "synth"
F="--gpu on --experts resident"
for d in 0 4096; do
  SLUICE_GPU_PROFILE_GRAPH=$O/gprof-d$d.tsv timeout 120 $S run $M -p "hello there" -n 64 --depth $d -c 8192 --temp 0 $F > $O/gp-d$d.txt 2> $O/gp-d$d.err
  echo "== graph profile d$d: $(grep -h '^\[timing\]' $O/gp-d$d.err)"; head -n 24 $O/gprof-d$d.tsv; tail -n 2 $O/gp-d$d.err
done
el "profiles"
sb() { SLUICE_GPU_DEC_MIN_CHUNK=$2 timeout 100 $S bench $M -p 512 -n 64 -d $1 -r 1 --run-flags "$F" > $O/sb.log 2>&1; grep -hE "tg64" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
for d in 4096 1024 16384; do
  for c in 64 256 512 512 256 64; do echo "d$d min chunk $c: $(sb $d $c)"; done
  el "d$d"
done
tar -czf $OO/logs.tgz -C $O .
