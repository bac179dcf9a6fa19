#!/usr/bin/env bash
# Grid i-quant matvec kernels, two binaries interleaved (A B B A), with the load average beside
# each run (docs/PERFORMANCE.md, "Grid i-quants at AVX-512 and AVX2", session 28).
# Usage: scripts/bench-iq-kernels.sh OLD_SLUICE NEW_SLUICE [THREADS] [MB]
#   THREADS 2, MB 256: the matvec against memory (issue 16 item 5's figure);
#   THREADS 1, MB 1: weights in L2, the kernels' compute rate alone (steadier on a busy machine).
set -euo pipefail
old=$1 new=$2 threads=${3:-2} mb=${4:-256}
types=IQ2_XXS,IQ2_XS,IQ2_S,IQ3_XXS,IQ3_S,IQ1_S,IQ1_M,TQ1_0
for isa in avx512 avx2; do
  for b in "$old" "$new" "$new" "$old"; do
    echo "== $isa $b load $(cut -d' ' -f1 /proc/loadavg)"
    "$b" bench --kernels --threads "$threads" --mb "$mb" --reps 5 --isa "$isa" --types "$types" |
      tail -n 8 | awk '{printf "%-8s %-7s %6s GB/s  read %6s  %s\n", $1, $2, $5, $6, $7}'
  done
done
