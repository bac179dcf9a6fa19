#!/bin/bash
# Session 38, third device call (issues 15, 16): why the DeepSeek-V3-shaped prompt's attention
# takes 40 % of the prefill at 16 threads on the device host (7.2 core-seconds against 2.35 on
# the 2-core dev machine): its parts by thread count, by instruction set and on rayon instead
# of the spinning gang; and every GPU decode kernel's own duration (Nsight Compute with
# programmatic dependent launch and graphs off, so that it sees every launch).
# DIR: bins.tar.xz, p512.txt.
set -u
D=${1:-target/devrun-s38b}; OO=${OUT:-/tmp/out}; O=/tmp/o3; mkdir -p $O $OO
exec > >(tee $OO/out.txt) 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s38; mkdir -p $V; S=$V/sluice
M=/var/tmp/q30-8.gguf; M3=/var/tmp/ds3-2.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
[ -x $S ] || { xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $S; }
( [ -s $M3 ] || $S synth $M3 --preset deepseek-v3 --layers 2 --quant q4_k --no-mtp --seed 11
  [ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 ) > $O/synth.log 2>&1
el "synth"
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|MHz|L2|L3" | tr -s ' '
P="$(head -c 700 $D/p512.txt)"
for t in 16 8 4 2 1; do echo "t$t avx512: $(env SLUICE_PROF_CPU=1 timeout 120 $S run $M3 -t $t --gpu off --experts resident -c 4096 -p "$P" -n 1 2>&1 | grep prof-cpu | sed 's/\[prof-cpu\] 1 calls, //' | cut -c1-230)"; el "t$t"; done
for t in 16 2; do echo "t$t avx2: $(env SLUICE_ISA=avx2 SLUICE_PROF_CPU=1 timeout 120 $S run $M3 -t $t --gpu off --experts resident -c 4096 -p "$P" -n 1 2>&1 | grep prof-cpu | sed 's/\[prof-cpu\] 1 calls, //' | cut -c1-230)"; done
echo "t16 rayon: $(env SLUICE_SPIN=0 SLUICE_PROF_CPU=1 timeout 120 $S run $M3 -t 16 --gpu off --experts resident -c 4096 -p "$P" -n 1 2>&1 | grep prof-cpu | sed 's/\[prof-cpu\] 1 calls, //' | cut -c1-230)"
echo "t16 again: $(env SLUICE_PROF_CPU=1 timeout 120 $S run $M3 -t 16 --gpu off --experts resident -c 4096 -p "$P" -n 1 2>&1 | grep prof-cpu | sed 's/\[prof-cpu\] 1 calls, //' | cut -c1-230)"
el "cpu"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
SLUICE_GPU_PDL=0 SLUICE_GPU_GRAPH=0 timeout 200 $NCU --clock-control none --launch-skip 1500 --launch-count 750 --metrics gpu__time_duration.sum \
  $S run $M -p "hello there" -n 40 --gpu on --experts resident -c 4096 > $O/ncu-d0.txt 2>&1; el "ncu d0 rc $?"
awk '/^  [a-zA-Z_0-9]+ \(/{k=$1} /gpu__time_duration.sum/{v=$NF; if ($(NF-1)=="ms") v*=1000; if ($(NF-1)=="ns"||$(NF-1)=="nsecond") v/=1000; print k, v}' $O/ncu-d0.txt \
  | awk '{s[$1]+=$2; c[$1]++; t+=$2} END{for(k in s) printf "%-34s n=%3d mean %7.2f us total %8.1f\n", k, c[k], s[k]/c[k], s[k]; printf "all %.1f us over %d launches\n", t, NR}' | sort -k7 -g -r | head -30
grep -c "gpu__time_duration" $O/ncu-d0.txt; grep -E "==PROF==|==WARNING==|==ERROR==" $O/ncu-d0.txt | sort | uniq -c | head -5
for e in "SLUICE_GPU_PDL=1" "SLUICE_GPU_PDL=0" "SLUICE_GPU_PDL=1"; do echo "decode $e: $(env $e timeout 100 $S bench $M -p 512 -n 64 -r 1 --run-flags "--gpu on --experts resident" 2>&1 | grep -E "tg64" | tr -s ' ' | cut -d'|' -f4,5)"; done
el "done"
tar -czf $OO/logs.tgz -C $O .
