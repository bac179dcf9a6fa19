#!/bin/bash
# On the device (in target/devrun-h6, carried: bins.tar.xz = sluice-base.s (main e6f1795) and
# sluice-new.s (h6-s27: prefill's resident experts as one group of parallel regions per layer)
# and the kernels_jobs test binary, stripped, one xz stream; llama-src.tar.xz = the
# llama-cpp-python 0.3.36 sources): 16-thread pp512/tg128 of llama.cpp (llama-bench) and both
# sluice builds interleaved on an 8-layer Qwen3-30B-A3B-shaped Q4_K file, and new's time split.
set -u
D=$PWD/target/devrun-h6; O=${OUT:-/tmp/out}; mkdir -p $O
T0=$(date +%s)
B=/var/tmp/h6; mkdir -p $B
xz -dc $D/bins.tar.xz | tar xf - -C $B && chmod +x $B/*
M=/var/tmp/q30-8.gguf
[ -f $M ] || $B/sluice-new.s synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
( rm -rf /var/tmp/lcpp && mkdir -p /var/tmp/lcpp && cd /var/tmp/lcpp && tar xJf $D/llama-src.tar.xz &&
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF &&
  cmake --build build --target llama-bench -j 14 ) > $O/build.log 2>&1 &
BU=$!
$B/kernels_jobs 2>&1 | grep -E 'test result|FAILED|panicked' | sed 's/^/kernels_jobs: /'
wait $SY; echo "synth done at $(( $(date +%s) - T0 )) s"
F="-t 16 --gpu off --experts resident"
P=""; for i in $(seq 12); do P="$P the quick brown fox jumps over the lazy dog and"; done
for arm in base new; do SLUICE_PROF_CPU=1 $B/sluice-$arm.s run $M -p "$P" -n 16 --temp 0 $F 2>$O/err-$arm.txt > $O/text-$arm.txt; grep -E 'timing|prof-cpu.*128 tokens' $O/err-$arm.txt | sed "s/^/$arm: /"; done
cmp -s $O/text-base.txt $O/text-new.txt && echo "text identical base/new" || echo "text DIFFERS base/new"
wait $BU; echo "llama.cpp build rc $? at $(( $(date +%s) - T0 )) s"
LB=/var/tmp/lcpp/build/bin/llama-bench
for arm in llama base new new base llama; do
  case $arm in
    llama) [ -x $LB ] && $LB -m $M -t 16 -ngl 0 -p 512 -n 128 -r 1 -o md 2>/dev/null | grep -E "pp512|tg128" | sed "s/^/llama.cpp: /" ;;
    *) $B/sluice-$arm.s bench $M -p 512 -n 128 -r 1 --run-flags "$F" 2>&1 | grep '^\[bench\] rep' | sed "s/^/$arm: /" ;;
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
