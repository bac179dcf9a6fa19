#!/bin/bash
# On the GPU machine: the CUDA backend's tests, then the old GPU forward (A: a sluice built from
# main before the backend change) against the new (B: the same GPU running the shared graph
# through `Backend`), interleaved, on the 8-layer Qwen3-30B-A3B-shaped file.
#   DIR holds sluice (B), sluice-old (A) and gpu-tests (B's tests/gpu.rs), all built with
#   `--features cuda` on the CPU machine and stripped.
# Usage, from the repository root: scripts/gpu-backend-ab.sh DIR [1|2]   (writes to $OUT)
#   1: tests; bench A B B A; same text old/new for decode, a 3961-token prompt and a 0.8 GB pool
#   2: tests; the long prompt A B B A A B B A; bench B A A B; scripts/gpu-check.sh (200 s cap)
set -u
D=${1:-target/devrun-h1}; PHASE=${2:-1}; O=${OUT:-/tmp/out}; mkdir -p $O
export SLUICE_ROOT=$PWD
T0=$(date +%s)
M=/var/tmp/q30-8.gguf
[ -f $M ] || $D/sluice synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 240 $D/gpu-tests --test-threads=1 --nocapture > $O/tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - T0 )) s"
grep -E "^test |test result|panicked|worst|placements|gpu max" $O/tests.log | head -60
wait $SY
F="--gpu on --experts resident"
bin() { if [ $1 = A ]; then echo $D/sluice-old; else echo $D/sluice; fi; }
L=$(python3 -c "print(' '.join(['the quick brown fox jumps over the lazy dog and']*120))")
if [ "$PHASE" = 2 ]; then
for r in A B B A A B B A; do
  $(bin $r) run $M -p "$L" -n 64 -c 8192 --temp 0 $F > $O/long$r.txt 2> $O/long$r.err
  echo "long $r: $(grep -h '^\[timing\]' $O/long$r.err)"
done
for r in B A A B; do
  $(bin $r) bench $M -p 512 -n 128 -r 1 --run-flags "$F" > $O/bench$r.log 2>&1
  echo "bench $r: $(grep -h '^\[bench\]' $O/bench$r.log | tr '\n' ' ')"
done
echo "at $(( $(date +%s) - T0 )) s: gpu-check.sh"
ln -sf $M /tmp/gpu-bench-model.gguf
timeout 200 bash scripts/gpu-check.sh $D $O/check 2>&1 | tail -30
else
i=0
for r in A B B A; do
  i=$((i+1))
  $(bin $r) bench $M -p 512 -n 128 -r 1 --run-flags "$F" > $O/bench$i$r.log 2>&1
  echo "bench $i $r: $(grep -h '^\[bench\]' $O/bench$i$r.log | tr '\n' ' ')"
done
for r in A B; do
  $(bin $r) run $M -p "Once upon a time there was" -n 128 --temp 0 $F > $O/run$r.txt 2> $O/run$r.err
  echo "run $r: $(grep -h '^\[timing\]\|^gpu:' $O/run$r.err | tr '\n' ' ')"
done
cmp $O/runA.txt $O/runB.txt && echo "same text, old and new (128 tokens, graph decode)"
for r in A B B A; do
  $(bin $r) run $M -p "$L" -n 64 -c 8192 --temp 0 $F > $O/long$r.txt 2> $O/long$r.err
  echo "long $r: $(grep -h '^\[timing\]' $O/long$r.err)"
done
cmp $O/longA.txt $O/longB.txt && echo "same text, old and new (3961-token prompt)"
for r in A B; do
  $(bin $r) run $M -p "Once upon a time there was" -n 32 --temp 0 --gpu on --experts stream --vram 0.8G > $O/vram$r.txt 2> $O/vram$r.err
  echo "vram 0.8G $r: $(grep -h '^\[timing\]\|^gpu:' $O/vram$r.err | tr '\n' ' ')"
done
cmp $O/vramA.txt $O/vramB.txt && echo "same text, old and new (VRAM pool of 0.8 GB: staging, host-routed job lists)"
fi
echo "total $(( $(date +%s) - T0 )) s"
