#!/bin/bash
# Session 29, third device call, back to back with scripts/s29-device-2.sh (sluice in
# /var/tmp/s29, the synth file in /var/tmp): llama.cpp's CUDA build from DIR/llama-src.tar.xz
# (scripts/gpu-anchor.sh's header says how it is made), then on the 8-layer Qwen3-30B-A3B-shaped
# Q4_K file llama-bench and `sluice bench` interleaved (L S S L, with and without programmatic
# dependent launch), the depth rows, and --gpu-experts hybrid|stage against llama.cpp's
# -ncmoe 6 at the same VRAM bytes (scripts/gpu-experts-device.sh's comparison).
# On the GPU machine: bash scripts/s29-device-3.sh DIR
set -u
D=${1:-target/devrun-s29}; OO=${OUT:-/tmp/out}; O=/tmp/o3; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s29; S=$V/sluice; M=/var/tmp/q30-8.gguf
[ -x $S ] || { echo "no $S: the machine was not warm"; exit 3; }
export SLUICE_ROOT=$PWD
L=/var/tmp/llama; LBIN=$L/build/bin/llama-bench
if [ ! -x $LBIN ]; then
  ( mkdir -p $L && tar -xJf $D/llama-src.tar.xz -C $L && cd $L && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 16 ) > $O/llama-build.log 2>&1
  el "llama build rc $?"; tail -2 $O/llama-build.log
fi
R="--gpu on --experts resident"
lb() { timeout 60 $LBIN -m $M -ngl 99 -p 512 -n 128 -r 2 -o md 2>/dev/null | grep -E "pp512|tg128" | tr -s ' '; }
sb() { env $2 timeout 60 $S bench $M -p 512 -n 128 -r 1 --run-flags "$R" > $O/sb-$1.log 2>&1; echo "sluice $1 ($2): $(grep -hE 'pp512|tg128' $O/sb-$1.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' ')"; }
echo "== llama.cpp"; lb
sb base X=1; sb pdl SLUICE_GPU_PDL=1; sb pdl SLUICE_GPU_PDL=1; sb base X=1
echo "== llama.cpp"; lb
sb pdl SLUICE_GPU_PDL=1; sb base X=1
el "short benches"
echo "== llama.cpp depth"; timeout 90 $LBIN -m $M -ngl 99 -p 512 -n 64 -d 4096,16384 -r 1 -o md 2>/dev/null | grep -E "pp512|tg64" | tr -s ' '
sd() { env $3 timeout 60 $S bench $M -p 512 -n 64 -d $2 -r 1 --run-flags "$R" > $O/sd-$1.log 2>&1; echo "sluice $1 -d $2 ($3): $(grep -hE '@ d' $O/sd-$1.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' ')"; grep -i error $O/sd-$1.log | tail -1; }
sd d4k 4096 X=1; sd d16k 16384 X=1; sd d4k-pdl 4096 SLUICE_GPU_PDL=1; sd d16k-pdl 16384 SLUICE_GPU_PDL=1
el "depth"
[ $(( $(date +%s) - T0 )) -gt 470 ] && { el "no time left for the hybrid rows"; tar -czf $OO/logs3.tgz -C $O .; exit 0; }
F="--gpu on --experts resident -c 1024 -b 512"
timeout 60 $LBIN -m $M -ngl 99 -ncmoe 6 -p 512 -n 128 -r 1 -v -o md > $O/llama-v.log 2>&1
grep -E "CUDA0.*buffer size" $O/llama-v.log | sort | uniq | head -6
echo "== llama.cpp -ngl 99 -ncmoe 6: $(grep -E 'pp512|tg128' $O/llama-v.log | tr -s ' ' | tr '\n' ' ')"
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
echo "== llama.cpp -ncmoe 6: $(timeout 60 $LBIN -m $M -ngl 99 -ncmoe 6 -p 512 -n 128 -r 2 -o md 2>/dev/null | grep -E 'pp512|tg128' | tr -s ' ' | tr '\n' ' ')"
el "done"
tar -czf $OO/logs3.tgz -C $O .
