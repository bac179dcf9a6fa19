#!/bin/bash
# Session 39 (branch s39-avx512): the grid i-quants' AVX-512 four-row dots on the device host's
# AVX-512. DIR holds, built on this machine without CUDA and stripped: kernels-tile,
# kernels-ref, kernels-iq, kernels-iq-grid (the four test binaries of tests/kernels_tile.rs,
# kernels_ref.rs, kernels_iq.rs, kernels_iq_grid.rs) and sluice-base (main) / sluice-new (this
# branch), all xz-compressed. Runs the kernel tests, then the grid types' matvec (batch 1:
# the single-row dots, batch 4: the four-row dots) at one thread with the weights in L2, A B B A
# (main runs IQ1_S/IQ1_M on AVX2 at every batch and the other grid types' single-row AVX-512
# dot per row at batch 4).
# Usage: bash THIS DIR [BUILD_ROOT] (output also in $OUT/out.txt); BUILD_ROOT is the checkout the
# test binaries were built in (they read tests/fixtures from that path; default /work/wt/avx512).
# Packing, on the build machine: build the four tests (`cargo test --release --no-run --test
# kernels_tile --test kernels_ref --test kernels_iq --test kernels_iq_grid`) and `sluice`, copy
# the binaries under those names (and main's `sluice` as sluice-base), strip, `xz` each.
set -u
D=${1:?DIR}; OO=${OUT:-/tmp/out}; mkdir -p $OO
exec > >(tee $OO/out.txt) 2>&1
V=/var/tmp/s39-avx512; mkdir -p $V
for f in $D/*.xz; do xz -dc $f > $V/$(basename $f .xz); chmod +x $V/$(basename $f .xz); done
grep -o -w -E 'avx512(f|bw|vl|dq|vnni|vbmi|bitalg)' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
grep -m1 'model name' /proc/cpuinfo
export SLUICE_ROOT=$PWD
# The kernel tests read their fixtures from the path they were built in.
B=${2:-/work/wt/avx512}
[ -d $B/tests/fixtures ] || { mkdir -p $(dirname $B) && ln -sfn "$PWD" $B; }
for K in kernels-tile kernels-ref kernels-iq kernels-iq-grid; do
  timeout 200 $V/$K > $OO/$K.log 2>&1; echo "$K rc $? $(grep 'test result' $OO/$K.log | cut -c1-70)"
  grep -E "panicked|FAILED|skipped" $OO/$K.log | head -5
done
types=IQ2_XXS,IQ2_XS,IQ2_S,IQ3_XXS,IQ3_S,IQ1_S,IQ1_M
for batch in 1 4; do
  for b in base new new base; do
    echo "== batch $batch $b load $(cut -d' ' -f1 /proc/loadavg)"
    timeout 60 $V/sluice-$b bench --kernels --threads 1 --mb 1 --reps 9 --isa avx512 --batch $batch --types $types |
      tail -n 7 | awk '{printf "%-8s %-7s %6s GB/s\n", $1, $2, $5}'
  done
done
