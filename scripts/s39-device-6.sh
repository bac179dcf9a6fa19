#!/bin/bash
# Session 39, last device call (issue 17; 257 s of device time left): the AVX-512 four-row dots
# of the grid i-quants, IQ1_S/IQ1_M's AVX-512 dots and TQ1_0/TQ2_0's four-row dots on the
# host's AVX-512 (their first run on such hardware): the four kernel test binaries, then the
# types' matvec at batch 1 and 4, one thread, weights in L2, old new new old.
# DIR: bins.tar.xz (kernels-tile, kernels-ref, kernels-iq, kernels-iq-grid, sluice, sluice-old; no CUDA).
set -u
D=${1:-target/devrun-s39d}; OO=${OUT:-/tmp/out}; mkdir -p $OO
exec > >(tee $OO/out.txt) 2>&1
V=/var/tmp/s39d; mkdir -p $V; xz -dc $D/bins.tar.xz | tar -xf - -C $V
export SLUICE_ROOT=$PWD
grep -o -w -E 'avx512(f|bw|vl|vnni|vbmi|bitalg)' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
for K in kernels-tile kernels-ref kernels-iq kernels-iq-grid; do timeout 60 $V/$K > $OO/$K.log 2>&1; echo "$K rc $? $(grep 'test result' $OO/$K.log | cut -c1-60)"; grep -E "panicked|FAILED" $OO/$K.log | head -5; done
types=IQ2_XXS,IQ2_XS,IQ2_S,IQ3_XXS,IQ3_S,IQ1_S,IQ1_M,TQ1_0,TQ2_0
for batch in 1 4; do
  for b in old new new old; do
    S=$V/sluice; [ $b = old ] && S=$V/sluice-old
    echo "batch $batch $b: $(timeout 30 $S bench --kernels --threads 1 --mb 1 --reps 5 --batch $batch --types $types 2>&1 | tail -n 9 | awk '{printf "%s %s %s; ", $1, $2, $5}')"
  done
done
