#!/bin/bash
# Session 29, second device call (issue 15, issue 18): unpack the binaries into /var/tmp/s29
# (kept for the back-to-back third call, scripts/s29-device-3.sh, which carries llama.cpp's
# sources: both do not fit one carry), write the two synth files, and bench DeepSeek-V4-Flash
# (4 layers, MXFP4 experts) resident on the GPU against the CPU at 16 threads.
# On the GPU machine: bash scripts/s29-device-2.sh DIR   (DIR holds bins.tar.xz)
set -u
D=${1:-target/devrun-s29}; OO=${OUT:-/tmp/out}; O=/tmp/o2; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s29; mkdir -p $V
[ -x $V/sluice ] || { xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $V/sluice $V/gpu-tests; }
export SLUICE_ROOT=$PWD
S=$V/sluice; M=/var/tmp/q30-8.gguf; M4=/var/tmp/v4flash4.gguf
[ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
[ -s $M4 ] || timeout 250 $S synth $M4 --preset deepseek-v4-flash --layers 4 --seed 1 > $O/synth4.log 2>&1 &
wait; el "synths"; ls -la $M $M4
for arm in "--gpu on" "--gpu off -t 16" "--gpu on"; do
  timeout 150 $S bench $M4 -p 256 -n 64 -r 1 --run-flags "--experts resident $arm" > $O/b4.log 2>&1
  el "v4flash4 [$arm] rc $?: $(grep -hE 'pp256|tg64' $O/b4.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' ')"; grep -iE "error|refus" $O/b4.log | tail -2
done
el "done"
tar -czf $OO/logs2.tgz -C $O .
