#!/bin/bash
# Session 37, second device call (issue 15): where depth's decode time goes. Per-kernel times of
# the replayed decode graph (SLUICE_GPU_PROFILE_GRAPH) at depth 0 and 4096, then tg64 at depth
# 4096 and 16384 with SLUICE_GPU_DEC_SPLITS 16 / 32 / 64 (the default), interleaved.
# DIR holds bins.tar.xz (scripts/pack-device.sh). On the GPU machine: bash THIS DIR
set -u
D=${1:-target/devrun-s37}; OO=${OUT:-/tmp/out}; O=/tmp/o2; mkdir -p $O $OO
exec > >(tee $OO/out.txt) 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s37; mkdir -p $V; S=$V/sluice; M=/var/tmp/q30-8.gguf
export SLUICE_ROOT=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
[ -x $S ] || { xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $V/sluice; }
[ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1
el "ready"
F="--gpu on --experts resident"
for d in 0 4096; do
  SLUICE_GPU_PROFILE_GRAPH=$O/gprof-d$d.tsv timeout 120 $S run $M -p "hello there" -n 64 -d $d -c 8192 --temp 0 $F > $O/gp-d$d.txt 2> $O/gp-d$d.err
  echo "== graph profile d$d: $(grep -h '^\[timing\]' $O/gp-d$d.err)"; head -24 $O/gprof-d$d.tsv
done
el "profiles"
sb() { SLUICE_GPU_DEC_SPLITS=$2 timeout 100 $S bench $M -p 512 -n 64 -d $1 -r 1 --run-flags "$F" > $O/sb.log 2>&1; grep -hE "tg64" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
for d in 4096 16384; do
  for sp in 64 32 16 16 32 64; do echo "d$d splits $sp: $(sb $d $sp)"; done
  el "d$d"
done
tar -czf $OO/logs.tgz -C $O .
