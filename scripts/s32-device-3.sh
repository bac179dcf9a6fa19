#!/bin/bash
# Session 32, third device call, back to back with scripts/s32-device-2.sh (sluice, the two
# synth files and llama.cpp's CUDA build in /var/tmp): the host CPU at 16 threads against
# llama.cpp's CPU backend (the same build with no CUDA device visible) on the Qwen3 and
# DeepSeek-V3 shapes (L S S L), then --gpu-experts hybrid|stage against llama.cpp's -ncmoe 6.
# On the GPU machine: bash scripts/s32-device-3.sh
set -u
OO=${OUT:-/tmp/out}; O=/tmp/o3; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s29; S=$V/sluice; M=/var/tmp/q30-8.gguf; M3=/var/tmp/ds3-2.gguf
LBIN=/var/tmp/llama/build/bin/llama-bench
[ -x $S ] && [ -x $LBIN ] || { echo "the machine was not warm"; exit 3; }
export SLUICE_ROOT=$PWD
lc() { CUDA_VISIBLE_DEVICES= timeout 150 $LBIN -m $1 -t 16 -ngl 0 -p 512 -n $2 -r 1 -o md 2>$O/lc.err | grep -E "pp512|tg$2" | tr -s ' ' | awk -F'|' '{printf "%s %s;", $(NF-2), $(NF-1)}'; echo; }
sc() { timeout 150 $S bench $1 -p 512 -n $2 -r 1 --run-flags "-t 16 --gpu off --experts resident" > $O/sc.log 2>&1; grep -hE "pp512|tg$2" $O/sc.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; echo; }
for f in $M $M3; do
  n=128; [ $f = $M3 ] && n=32
  echo "$(basename $f) llama.cpp cpu16: $(lc $f $n)"; echo "$(basename $f) sluice cpu16: $(sc $f $n)"
  echo "$(basename $f) sluice cpu16: $(sc $f $n)"; echo "$(basename $f) llama.cpp cpu16: $(lc $f $n)"
  el "$f"
done
grep -iE "cuda|error|amx" $O/lc.err | head -4
[ $(( $(date +%s) - T0 )) -gt 400 ] && { el "no time left for the hybrid rows"; tar -czf $OO/logs3.tgz -C $O .; exit 0; }
F="--gpu on --experts resident -c 1024 -b 512"
timeout 60 $LBIN -m $M -ngl 99 -ncmoe 6 -p 512 -n 128 -r 1 -v -o md > $O/llama-v.log 2>&1
echo "== llama.cpp -ngl 99 -ncmoe 6: $(grep -E 'pp512|tg128' $O/llama-v.log | tr -s ' ' | awk -F'|' '{printf "%s %s;", $(NF-2), $(NF-1)}')"
timeout 60 $S run $M -p hi -n 1 $F --vram 1G --gpu-experts stage 2> $O/probe.log >/dev/null
VR=$(python3 - $O/llama-v.log $O/probe.log <<'PY'
import re, sys
l = open(sys.argv[1]).read(); p = open(sys.argv[2]).read()
best = {}
for kind, mib in re.findall(r'CUDA0 (\w+) buffer size =\s*([\d.]+) MiB', l):
    best[kind] = max(best.get(kind, 0.0), float(mib))
llama = sum(best.values()) * 2**20
m = re.search(r'dense weights ([\d.]+) GB, KV cache ([\d.]+) GB, scratch ([\d.]+) GB', p)
fixed = sum(float(x) for x in m.groups()) * 1e9
slot = float(re.search(r'slots/layer of ([\d.]+) MB', p).group(1)) * 1e6
every = float(re.search(r'of all experts \(([\d.]+) GB\)', p).group(1)) * 1e9
pool = llama - fixed
if not best or pool <= 8 * slot:
    print(f"llama.cpp VRAM unreadable ({best}): a quarter of the experts", file=sys.stderr); pool = every / 4
print(f"llama.cpp VRAM {llama/1e9:.3f} GB; sluice fixed {fixed/1e9:.3f} GB; pool {pool/1e9:.3f} GB = {pool/slot/8:.1f} slots/layer ({100*pool/every:.0f}% of the experts)", file=sys.stderr)
print(int(pool))
PY
)
el "vram for the pool: $VR"
hb() { timeout 90 $S bench $M -p 512 -n 128 -r 1 --run-flags "$F --vram $VR --gpu-experts $1" 2>&1 | grep -E "pp512|tg128|rror" | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; echo; }
echo "sluice hybrid: $(hb hybrid)"; echo "sluice stage: $(hb stage)"; echo "sluice stage: $(hb stage)"; echo "sluice hybrid: $(hb hybrid)"
echo "== llama.cpp -ncmoe 6: $(timeout 60 $LBIN -m $M -ngl 99 -ncmoe 6 -p 512 -n 128 -r 2 -o md 2>/dev/null | grep -E 'pp512|tg128' | tr -s ' ' | awk -F'|' '{printf "%s %s;", $(NF-2), $(NF-1)}')"
el "done"
tar -czf $OO/logs3.tgz -C $O .
