#!/usr/bin/env bash
# A/B of `sluice bench --kernels` between two builds, arms interleaved A B B A as fresh
# processes, each line with the 1-minute load average (docs/PERFORMANCE.md, session 28).
# Usage: scripts/kernels-ab.sh OLD_BINARY NEW_BINARY [TYPES] [ISAS] [EXTRA BENCH ARGS...]
#   e.g. scripts/kernels-ab.sh /tmp/sluice-main target/release/sluice Q4_0,IQ4_XS avx512,avx2
set -euo pipefail
a=$1 b=$2 types=${3:-Q4_0,IQ4_XS} isas=${4:-avx512,avx2}
shift $(($# < 4 ? $# : 4))
for isa in ${isas//,/ }; do
  for arm in A B B A; do
    bin=$a; [ "$arm" = B ] && bin=$b
    load=$(cut -d' ' -f1 /proc/loadavg)
    "$bin" bench --kernels --threads 2 --mb 256 --reps 5 --isa "$isa" --types "$types" "$@" 2>&1 \
      | awk -v arm="$arm" -v load="$load" 'f {print arm, "load", load, $0} /^type/ {f=1}'
  done
done
