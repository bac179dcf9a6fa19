#!/bin/bash
# On the GPU machine (binaries as in scripts/gpu-check.sh, in DIR): scripts/gpu-decode-ab.sh [DIR].
# GPU tests, then decode with and without the CUDA graph,
# interleaved, on the 8-layer Qwen3-30B-A3B-shaped file.
set -u
D=${1:-target/devrun-gpu}; O=${OUT:-/tmp/out}; mkdir -p $O
export SLUICE_ROOT=$PWD
T0=$(date +%s)
M=/var/tmp/q30-8.gguf
[ -f $M ] || $D/sluice synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 200 $D/gpu-tests --test-threads=1 --nocapture > $O/tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - T0 )) s"
grep -E "^test |test result|panicked|KL|placement" $O/tests.log | head -30
wait $SY
F="--gpu on --experts resident"
for r in 1 2; do
  for g in 1 0; do
    SLUICE_GPU_GRAPH=$g $D/sluice bench $M -p 512 -n 128 -r 1 --run-flags "$F" > $O/b$r$g.log 2>&1
    echo "round $r graph=$g: $(grep -h '^\[bench\]' $O/b$r$g.log)"
  done
done
for g in 1 0; do
  SLUICE_GPU_GRAPH=$g $D/sluice run $M -p "Once upon a time there was" -n 128 --temp 0 $F --stats-json $O/run$g.json > $O/run$g.txt 2> $O/run$g.err
  echo "graph=$g: $(grep -h '^\[experts\]\|^gpu:' $O/run$g.err | tr '\n' ' ')"
done
cmp $O/run1.txt $O/run0.txt && echo "same text with and without the graph"
L=$(python3 -c "print(' '.join(['the quick brown fox jumps over the lazy dog and']*120))")
for g in 1 0; do
  SLUICE_GPU_GRAPH=$g $D/sluice run $M -p "$L" -n 64 -c 8192 --temp 0 $F > $O/long$g.txt 2> $O/long$g.err
  echo "long graph=$g: $(grep -h '^\[timing\]' $O/long$g.err)"
done
echo "total $(( $(date +%s) - T0 )) s"
