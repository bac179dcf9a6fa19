#!/bin/bash
# Device call (issue 18): the 2026 families' synth presets at real shapes (cut in depth), decode
# and prefill on the CPU (16 threads) and the GPU, experts resident and streamed, with the
# planner's predicted bound beside each figure (`sluice doctor` profile of the device).
# On the CPU machine: cargo build --release --features cuda; mkdir -p target/devrun-main;
#   cp target/release/sluice target/devrun-main/; strip target/devrun-main/sluice
# On the GPU machine, from the repository root: scripts/families-device.sh [DIR]
set -u
D=${1:-target/devrun-main}; O=${OUT:-/tmp/out}; mkdir -p $O
S=$D/sluice
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nproc; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
G=/var/tmp/goss120-8.gguf; Q=/var/tmp/q35-4.gguf
[ -f $G ] || $S synth $G --preset gpt-oss-120b --layers 8 --skew 1.0 --seed 11 > $O/synth-g.log 2>&1
el "synth gpt-oss done"
[ -f $Q ] || $S synth $Q --preset qwen3.5-397b-a17b --layers 4 --quant q4_k --skew 1.0 --seed 11 > $O/synth-q.log 2>&1
el "synth qwen3.5 done"
$S doctor $G --refresh > $O/doctor.txt 2>&1; grep -E "memory read|direct 1.0 MiB x4|direct .* x8|gpu|copy" $O/doctor.txt | head -8
for M in $G $Q; do $S inspect $M | grep -E "architecture|resident|routed|per token|kv cache|state"; done
P="The history of the lighthouse begins with the earliest fires lit on hills near harbours"
bench() { # name file flags
  local n=$1 f=$2; shift 2
  timeout 150 $S bench $f -p 256 -n 64 -r 1 --run-flags "$*" > $O/b-$n.log 2>&1
  echo "== $n: $*"; grep -E "^\| run|error" $O/b-$n.log | tail -3
  timeout 120 $S run $f -p "$P" -n 32 --temp 0 --ignore-eos $* > $O/r-$n.txt 2> $O/r-$n.log
  grep -E "predicted|timing|hit|read/token|bound|gpu:" $O/r-$n.log | tail -6
  el "$n done"
}
bench g-cpu-res $G --gpu off --experts resident -t 16
bench g-cpu-str $G --gpu off --experts stream --ram 4G --io direct -t 16 --usage-freeze
bench g-gpu-res $G --gpu on --experts resident
bench g-gpu-str $G --gpu on --experts stream --ram 4G --vram 1G --io direct
bench q-cpu-res $Q --gpu off --experts resident -t 16
bench q-cpu-str $Q --gpu off --experts stream --ram 6G --io direct -t 16 --usage-freeze
timeout 60 $S run $Q -p "$P" -n 4 --gpu on 2>&1 | grep -iE "gpu|refus" | head -3
for a in g-cpu-str g-gpu-res g-gpu-str; do cmp -s $O/r-g-cpu-res.txt $O/r-$a.txt && echo "text $a = g-cpu-res" || echo "text $a DIFFERS from g-cpu-res"; done
cmp -s $O/r-q-cpu-res.txt $O/r-q-cpu-str.txt && echo "text q-cpu-str = q-cpu-res" || echo "text q-cpu-str DIFFERS"
el all done
