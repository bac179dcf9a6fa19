#!/bin/bash
# Session 33, second device call, back to back with scripts/s33-device-1.sh (sluice and the
# synth file in /var/tmp): llama.cpp's CUDA build from DIR/llama-src.tar.xz (scripts/gpu-anchor.sh's
# header says how it is made), then the GPU anchor on the 8-layer Qwen3-30B-A3B-shaped Q4_K file,
# llama-bench and `sluice bench` interleaved L S S L at depth 0, 4096 and 16384 (both with an
# f16 KV cache, each program's default; sluice's prompt attention on the tensor cores unless
# MMA=0).
# On the GPU machine: bash scripts/s33-device-2.sh DIR
set -u
D=${1:-target/devrun-s33}; OO=${OUT:-/tmp/out}; O=/tmp/o2; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s33; S=$V/sluice; M=/var/tmp/q30-8.gguf
[ -x $S ] && [ -s $M ] || { echo "the machine was not warm"; exit 3; }
export SLUICE_ROOT=$PWD
L=/var/tmp/llama; LBIN=$L/build/bin/llama-bench
if [ ! -x $LBIN ]; then
  ( mkdir -p $L && tar -xJf $D/llama-src.tar.xz -C $L && cd $L && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 16 ) > $O/llama-build.log 2>&1
fi
el "llama build"; tail -2 $O/llama-build.log; [ -x $LBIN ] || { tar -czf $OO/logs2.tgz -C $O .; exit 4; }
R="--gpu on --experts resident"; export SLUICE_GPU_ATT_MMA=${MMA:-1}
lb() { timeout 120 $LBIN -m $M -ngl 99 -p 512 -n $1 $2 -r 1 -o md 2>/dev/null | grep -E "pp512|tg$1" | tr -s ' ' | awk -F'|' '{printf "%s %s;", $(NF-2), $(NF-1)}'; echo; }
sb() { timeout 90 $S bench $M -p 512 -n $1 $2 -r 1 --run-flags "$R" > $O/sb.log 2>&1; grep -hE "pp512|tg$1" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -1; echo; }
echo "llama.cpp d0: $(lb 128 '')"; echo "sluice d0: $(sb 128 '')"; echo "sluice d0: $(sb 128 '')"; echo "llama.cpp d0: $(lb 128 '')"
el "d0"
for d in 4096 16384; do
  echo "llama.cpp d$d: $(lb 64 "-d $d")"; echo "sluice d$d: $(sb 64 "-d $d")"; echo "sluice d$d: $(sb 64 "-d $d")"; echo "llama.cpp d$d: $(lb 64 "-d $d")"
  el "d$d"
done
el "done"
tar -czf $OO/logs2.tgz -C $O .
