#!/bin/bash
# On the device (binaries in target/devrun-final: sluice, sluice-old = an earlier build, gpu-tests;
# carried): GPU tests, a GPU bench, and a CPU A/B of two binaries at 16 threads plus a thread curve.
set -u
D=target/devrun-final; O=${OUT:-/tmp/out}; mkdir -p $O
export SLUICE_ROOT=$PWD
T0=$(date +%s)
M=/var/tmp/q30-8.gguf
[ -f $M ] || $D/sluice synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 200 $D/gpu-tests --test-threads=1 --nocapture > $O/tests.log 2>&1; echo "gpu tests rc $? at $(( $(date +%s) - T0 )) s"
grep -E "^test |test result|panicked" $O/tests.log | head -20
wait $SY
echo "synth done at $(( $(date +%s) - T0 )) s"
F="--gpu on --experts resident"
$D/sluice bench $M -p 512 -n 128 -r 1 --run-flags "$F" > $O/gpubench.log 2>&1
echo "gpu: $(grep -h '^\[bench\]' $O/gpubench.log | tr '\n' ' ')"
P=$(python3 -c "print(' '.join(['the quick brown fox jumps over the lazy dog and']*12))")
for r in 1 2; do
  for b in sluice-old sluice sluice sluice-old; do
    $D/$b run $M -p "$P" -n 32 --temp 0 -t 16 --gpu off --experts resident > $O/cpu-$b-$r.txt 2> $O/cpu-$b-$r.err
    echo "cpu16 $b: $(grep -h '^\[timing\]' $O/cpu-$b-$r.err)"
  done
done
cmp $O/cpu-sluice-1.txt $O/cpu-sluice-old-1.txt && echo "cpu: same text old and new"
for t in 1 2 4 8 16; do
  $D/sluice run $M -p "$P" -n 32 --temp 0 -t $t --gpu off --experts resident > /dev/null 2> $O/t$t.err
  echo "threads $t: $(grep -h '^\[timing\]' $O/t$t.err)"
done
echo "total $(( $(date +%s) - T0 )) s"
