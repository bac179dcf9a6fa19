#!/bin/bash
# On the device (sluice + llama-src.tar.xz of the llama-cpp-python 0.3.36 sources in
# target/devrun-final, carried): llama.cpp CPU build, then llama-bench and sluice bench alternating.
set -u
D=$PWD/target/devrun-final; O=${OUT:-/tmp/out}; mkdir -p $O
T0=$(date +%s)
M=/var/tmp/q30-8.gguf
[ -f $M ] || $D/sluice synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
rm -rf /var/tmp/lcpp; mkdir -p /var/tmp/lcpp && cd /var/tmp/lcpp && tar xJf $D/llama-src.tar.xz
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF > $O/cmake.log 2>&1
cmake --build build --target llama-bench -j 16 > $O/build.log 2>&1; echo "build rc $? at $(( $(date +%s) - T0 )) s"
wait $SY
LB=/var/tmp/lcpp/build/bin/llama-bench
grep -m3 -i "avx512\|AMX" $O/cmake.log | head -3
for r in 1 2; do
  $LB -m $M -t 16 -ngl 0 -p 512 -n 128 -r 1 -o md 2>/dev/null | grep -E "pp512|tg128" | sed "s/^/llama.cpp r$r: /"
  $D/sluice bench $M -p 512 -n 128 -r 1 --run-flags "-t 16 --gpu off --experts resident" 2>&1 | grep '^\[bench\]' | sed "s/^/sluice r$r: /"
done
echo "total $(( $(date +%s) - T0 )) s"
