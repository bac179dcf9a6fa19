#!/bin/bash
# Session 32, device call 4 (issue 16): main's CPU prefill at 16 threads on the device host after
# this session's changes (prefill batch 512, the Q4_K tile's vector scales, the 32-element
# types' joint tail, token blocks in rows_range), sluice only (llama.cpp's figures of calls 2-3
# stand: same files, same host): token block sizes A/B (SLUICE_TOKEN_BLOCK), 8 vs 16 threads,
# and the CPU backend's part times (SLUICE_PROF_CPU).
# On the GPU machine: bash scripts/s32-device-4.sh DIR   (DIR holds bins.tar.xz)
set -u
D=${1:-target/devrun-s32}; OO=${OUT:-/tmp/out}; O=/tmp/o5; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s32; mkdir -p $V
xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $V/sluice
export SLUICE_ROOT=$PWD
S=$V/sluice; M=/var/tmp/q30-8.gguf; M3=/var/tmp/ds3-2.gguf
[ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
[ -s $M3 ] || $S synth $M3 --preset deepseek-v3 --layers 2 --quant q4_k --no-mtp --seed 11 > $O/synth3.log 2>&1 &
wait; el "synths"
pp() { env $3 timeout 100 $S bench $1 -p 512 -n $2 -r 1 --run-flags "-t ${T:-16} --gpu off --experts resident" 2>&1 | grep -E "pp512|tg$2" | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; echo; }
for f in $M3 $M; do
  for tb in 786432 1099511627776 262144 1099511627776 786432; do echo "$(basename $f) t16 block $tb: $(pp $f 0 SLUICE_TOKEN_BLOCK=$tb)"; done
  echo "$(basename $f) t16 tg: $(pp $f 32 X=1)"
  echo "$(basename $f) t8: $(T=8 pp $f 0 X=1)"
done
el "benches"
P="$(python3 -c "print(' '.join(['the quick brown fox jumps over the lazy dog']*16))")"
for f in $M3 $M; do for t in 16 8; do
  SLUICE_PROF_CPU=1 timeout 100 $S run $f -p "$P" -n 1 -t $t --gpu off --experts resident -c 4096 --temp 0 2>&1 >/dev/null | grep -E "prof-cpu|timing" | sed "s/^/$(basename $f) t$t /"
done; done
el done
