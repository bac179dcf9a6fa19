#!/bin/bash
# Ready for the next session's first device call (issues 15, 16): llama.cpp's CUDA build in the
# background while every GPU test runs, then the host CPU at 16 threads against llama.cpp on the
# three files of issue 16 (Qwen3-30B-A3B shape Q4_K and Q8_0, DeepSeek-V3 shape Q4_K; llama.cpp's
# CPU repack off for the DeepSeek file, where it stops with it on), then the GPU at depth 0
# (decode goal 1.2x). DIR holds bins.tar.xz (scripts/pack-device.sh) and llama-src.tar.xz.
# On the GPU machine: bash scripts/s38-device-1.sh DIR. Output: $OUT/out.txt.
set -u
D=${1:-target/devrun-s38}; OO=${OUT:-/tmp/out}; O=/tmp/o1; mkdir -p $O $OO
exec > >(tee $OO/out.txt) 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s38; mkdir -p $V; S=$V/sluice
M=/var/tmp/q30-8.gguf; M8=/var/tmp/q30-8-q8.gguf; M3=/var/tmp/ds3-2.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
mkdir -p /work/main/target/tmp 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
L=/var/tmp/llama; LBIN=$L/build/bin/llama-bench
( [ -x $LBIN ] || ( mkdir -p $L && tar -xJf $D/llama-src.tar.xz -C $L && cd $L && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 16 ) > $O/llama-build.log 2>&1 ) &
LB=$!
xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $V/sluice $V/gpu-tests $V/gpu-types $V/kernels-* $V/lib-tests
grep -o -m1 'avx512[a-z]*' /proc/cpuinfo | head -n 1
for K in kernels-tile kernels-ref kernels-iq; do timeout 120 $V/$K > $O/$K.log 2>&1; el "$K rc $? $(grep 'test result' $O/$K.log | cut -c1-80)"; done
timeout 120 $V/lib-tests kernels:: > $O/lib.log 2>&1; el "lib-tests kernels:: rc $? $(grep 'test result' $O/lib.log | cut -c1-80)"
grep -hE "panicked|FAILED" $O/kernels-*.log $O/lib.log | cut -c1-200 | head -10
( [ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11
  [ -s $M3 ] || $S synth $M3 --preset deepseek-v3 --layers 2 --quant q4_k --no-mtp --seed 11
  [ -s $M8 ] || $S synth $M8 --preset qwen3-30b-a3b --layers 8 --quant q8_0 --skew 1.0 --seed 11 ) > $O/synth.log 2>&1 &
SY=$!
timeout 200 $V/gpu-tests --test-threads=1 --skip ptx_is_built --nocapture > $O/gpu.log 2>&1; el "gpu-tests rc $?"
grep -E "test result|panicked|FAILED" $O/gpu.log | cut -c1-200 | head -20
wait $SY; el "synth"; wait $LB; el "llama build"; tail -n 1 $O/llama-build.log
lb() { timeout 150 $LBIN -m $1 $2 -p 512 -n $3 -r 1 -o md 2>/dev/null | grep -E "pp512|tg$3" | tr -s ' ' | awk -F'|' '{printf "%s %s;", $(NF-2), $(NF-1)}'; echo; }
sb() { timeout 150 $S bench $1 -p 512 -n $3 -r 1 --run-flags "$2" > $O/sb.log 2>&1; grep -hE "pp512|tg$3" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
C="-t 16 --gpu off --experts resident"
for F in $M $M8 $M3; do
  R=""; [ $F = $M3 ] && R="--repack 0"
  echo "cpu llama.cpp $(basename $F) $R: $(CUDA_VISIBLE_DEVICES= lb $F "-ngl 0 -t 16 $R" 32)"
  echo "cpu sluice $(basename $F): $(sb $F "$C" 32)"
  echo "cpu sluice $(basename $F): $(sb $F "$C" 32)"
  echo "cpu llama.cpp $(basename $F) $R: $(CUDA_VISIBLE_DEVICES= lb $F "-ngl 0 -t 16 $R" 32)"
  el "cpu $(basename $F)"
done
G="--gpu on --experts resident"
echo "llama.cpp d0: $(lb $M "-ngl 99" 64)"; echo "sluice d0: $(sb $M "$G" 64)"
echo "sluice d0: $(sb $M "$G" 64)"; echo "llama.cpp d0: $(lb $M "-ngl 99" 64)"
el "done"
tar -czf $OO/logs.tgz -C $O .
