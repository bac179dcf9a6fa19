#!/bin/bash
# Session 38, second device call (issues 15, 16): the kernel tests on the host's AVX-512 (with
# the new 16-token AVX-512 Q4_K/Q5_K tiles), their single-thread rate old against new, the
# DeepSeek-V3-shaped prefill at 16 threads (old against new, A B B A, and where its time goes),
# and every decode kernel's own duration on the GPU (Nsight Compute, graphs off, clocks not
# locked) against the step's time. DIR: bins.tar.xz (new), old/sluice.xz, p512.txt.
set -u
D=${1:-target/devrun-s38}; OO=${OUT:-/tmp/out}; O=/tmp/o2; mkdir -p $O $OO
exec > >(tee $OO/out.txt) 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s38; mkdir -p $V; S=$V/sluice; SO=$V/sluice-old
M=/var/tmp/q30-8.gguf; M3=/var/tmp/ds3-2.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
xz -dc $D/bins.tar.xz | tar -xf - -C $V; xz -dc $D/old/sluice.xz > $SO
chmod +x $V/sluice $SO $V/gpu-tests $V/gpu-types $V/kernels-* $V/lib-tests
( [ -s $M3 ] || $S synth $M3 --preset deepseek-v3 --layers 2 --quant q4_k --no-mtp --seed 11
  [ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 ) > $O/synth.log 2>&1 &
SY=$!
for K in kernels-tile kernels-ref kernels-iq; do timeout 120 $V/$K > $O/$K.log 2>&1; el "$K rc $? $(grep 'test result' $O/$K.log | cut -c1-60)"; done
timeout 120 $V/lib-tests kernels:: > $O/lib.log 2>&1; el "lib-tests kernels:: rc $? $(grep 'test result' $O/lib.log | cut -c1-60)"
grep -hE "panicked|FAILED" $O/kernels-*.log $O/lib.log | cut -c1-200 | head -10
wait $SY; el "synth"
kb() { $1 bench --kernels --threads 1 --mb 1 --reps 30 --isa avx512 --types Q4_K,Q5_K --batch $2 2>&1 | grep -E "^Q[45]_K" | awk '{printf "%s %s; ", $1, $5}'; echo; }
for B in 8 16; do for X in $SO $S $S $SO; do echo "kernels batch $B $(basename $X): $(kb $X $B)"; done; done
el "kernel bench"
sb() { timeout 150 $1 bench $M3 -p 512 -n 0 -r 1 --run-flags "-t $2 --gpu off --experts resident" > $O/sb.log 2>&1; grep -hE "pp512" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
for X in $SO $S $S $SO; do echo "ds3-2 t16 $(basename $X): $(sb $X 16)"; done
for X in $SO $S; do echo "ds3-2 t8 $(basename $X): $(sb $X 8)"; done
el "ds3 prefill"
P="$(head -c 2300 $D/p512.txt)"
for t in 16 8; do
  SLUICE_PROF_CPU=1 timeout 100 $S run $M3 -t $t --gpu off --experts resident -c 4096 -p "$P" -n 1 2>&1 | grep -E "prof-cpu|timing" | cut -c1-400
done
el "ds3 profile"
command -v perf && { timeout 60 perf record -g -o $O/perf.data $S run $M3 -t 16 --gpu off --experts resident -c 4096 -p "$(head -c 700 $D/p512.txt)" -n 1 > /dev/null 2>&1; perf report -i $O/perf.data --no-children --percent-limit 1 --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -30; }
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
SLUICE_GPU_GRAPH=0 timeout 200 $NCU --clock-control none --launch-skip 900 --launch-count 750 --metrics gpu__time_duration.sum \
  $S run $M -p "hello there" -n 40 --gpu on --experts resident -c 4096 > $O/ncu-d0.txt 2>&1; el "ncu d0 rc $?"
awk '/^  [a-zA-Z_0-9]+ \(/{k=$1} /gpu__time_duration.sum/{v=$NF; if ($(NF-1)=="ms") v*=1000; if ($(NF-1)=="ns"||$(NF-1)=="nsecond") v/=1000; print k, v}' $O/ncu-d0.txt \
  | awk '{s[$1]+=$2; c[$1]++; t+=$2} END{for(k in s) printf "%-34s n=%3d mean %7.2f us total %8.1f\n", k, c[k], s[k]/c[k], s[k]; printf "all %.1f us over %d launches\n", t, NR}' | sort -k7 -g -r | head -30
grep -m2 "gpu__time_duration" $O/ncu-d0.txt
for g in 1 0 1; do echo "decode graph=$g: $(SLUICE_GPU_GRAPH=$g timeout 100 $S bench $M -p 512 -n 64 -r 1 --run-flags "--gpu on --experts resident" 2>&1 | grep -E "tg64" | tr -s ' ' | cut -d'|' -f4,5)"; done
el "done"
tar -czf $OO/logs.tgz -C $O --exclude perf.data .
