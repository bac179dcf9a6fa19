#!/bin/bash
# Session 32, second device call, back to back with scripts/s32-device-1.sh (sluice and the
# synth files in /var/tmp): llama.cpp's CUDA build from DIR/llama-src.tar.xz (scripts/gpu-anchor.sh's
# header says how it is made), then the GPU anchor on the 8-layer Qwen3-30B-A3B-shaped Q4_K file:
# llama-bench and `sluice bench` interleaved (L S P L P S: S base, P with programmatic dependent
# launch), and the depth rows.
# On the GPU machine: bash scripts/s32-device-2.sh DIR
set -u
D=${1:-target/devrun-s32}; OO=${OUT:-/tmp/out}; O=/tmp/o2; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s29; S=$V/sluice; M=/var/tmp/q30-8.gguf
[ -x $S ] && [ -s $M ] || { echo "the machine was not warm"; exit 3; }
export SLUICE_ROOT=$PWD
L=/var/tmp/llama; LBIN=$L/build/bin/llama-bench
if [ ! -x $LBIN ]; then
  ( mkdir -p $L && tar -xJf $D/llama-src.tar.xz -C $L && cd $L && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 16 ) > $O/llama-build.log 2>&1
fi
el "llama build"; tail -2 $O/llama-build.log; [ -x $LBIN ] || { tar -czf $OO/logs2.tgz -C $O .; exit 4; }
R="--gpu on --experts resident"
lb() { timeout 60 $LBIN -m $M -ngl 99 -p 512 -n 128 -r 2 -o md 2>/dev/null | grep -E "pp512|tg128" | tr -s ' ' | awk -F'|' '{printf "%s %s;", $(NF-2), $(NF-1)}' | tr '\n' ' '; echo; }
sb() { env $2 timeout 60 $S bench $M -p 512 -n 128 -r 1 --run-flags "$R" > $O/sb-$1.log 2>&1; echo "sluice $1 ($2): $(grep -hE 'pp512|tg128' $O/sb-$1.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' ')"; }
echo "llama.cpp: $(lb)"; sb base X=1; sb pdl SLUICE_GPU_PDL=1
echo "llama.cpp: $(lb)"; sb pdl SLUICE_GPU_PDL=1; sb base X=1
el "short benches"
echo "== llama.cpp depth"; timeout 100 $LBIN -m $M -ngl 99 -p 512 -n 64 -d 4096,16384 -r 1 -o md 2>/dev/null | grep -E "pp512|tg64" | tr -s ' '
sd() { env $3 timeout 60 $S bench $M -p 512 -n 64 -d $2 -r 1 --run-flags "$R" > $O/sd-$1.log 2>&1; echo "sluice $1 -d $2 ($3): $(grep -hE '@ d' $O/sd-$1.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' ')"; grep -i error $O/sd-$1.log | tail -1; }
sd d4k 4096 X=1; sd d16k 16384 X=1; sd d4k-pdl 4096 SLUICE_GPU_PDL=1; sd d16k-pdl 16384 SLUICE_GPU_PDL=1
el "done"
tar -czf $OO/logs2.tgz -C $O .
