#!/bin/bash
# Session 38, last device call (issue 15): the one-token router product with a row's loads in
# flight (router_row1) — its logits byte for byte against the previous binary's, decode A B B A —
# and the streamed GPU run's expert reads against the disk's O_DIRECT ceiling measured in the
# same run (`run --prof`; a small RAM cache, `--cap 16`, so that experts come from the disk).
# DIR: bins.tar.xz (new), bins-old.tar.xz.
set -u
D=${1:-target/devrun-s38c}; OO=${OUT:-/tmp/out}; O=/tmp/o6; mkdir -p $O $OO
exec > >(tee $OO/out.txt) 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s38; mkdir -p $V/old; S=$V/sluice; SO=$V/old/sluice
M=/var/tmp/q30-8.gguf
xz -dc $D/bins.tar.xz | tar -xf - -C $V sluice; xz -dc $D/bins-old.tar.xz | tar -xf - -C $V/old sluice; chmod +x $S $SO
[ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1
el "synth"
TOK=$(seq -s, 100 140)
for b in 1 41; do
  for X in $S $SO; do timeout 60 $X logits $M --tokens $TOK --out $O/l-b$b-$(basename $(dirname $X)).npy -b $b --gpu on --experts resident -c 256 > $O/logits.log 2>&1 || tail -n 2 $O/logits.log; done
  cmp $O/l-b$b-s38.npy $O/l-b$b-old.npy && echo "logits -b $b: new == old, byte for byte"
done
el "logits"
gb() { timeout 60 $1 bench $M -p 512 -n 64 -r 1 --run-flags "--gpu on --experts resident" 2>&1 | grep -E "pp512|tg64" | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; echo; }
for X in $SO $S $S $SO; do echo "gpu d0 $(basename $(dirname $X)): $(gb $X)"; done
el "router A/B"
timeout 90 $S run $M --gpu on --experts stream --cap 16 --vram 300M -n 64 -c 512 -p "the quick brown fox jumps over the lazy dog" --temp 0 --prof 2>&1 | grep -E "^\[(experts|timing|gpu|plan\] (experts|gpu|prefetch))" | cut -c1-330
el "done"
rm -f $O/*.npy; tar -czf $OO/logs.tgz -C $O .
