#!/bin/bash
# On the device (in target/devrun-h4, carried: sluice.xz = the build under test, stripped,
# kernels-tile.xz = tests/kernels_tile.rs built for release, llama-src.tar.xz = the
# llama-cpp-python 0.3.36 sources): the tile-kernel tests on this AVX-512 host, then 16-thread
# pp512/tg128 of sluice and llama.cpp's CPU build (llama-bench) interleaved llama sluice sluice
# llama, on an 8-layer Qwen3-30B-A3B-shaped Q4_K file. (The old build does not fit the 64 MiB
# carry beside main's tree: old vs new is measured on the dev machine.)
set -u
D=$PWD/target/devrun-h4; O=${OUT:-/tmp/out}; mkdir -p $O
T0=$(date +%s)
B=/var/tmp/h4; mkdir -p $B
for f in sluice kernels-tile; do xz -dc $D/$f.xz > $B/$f && chmod +x $B/$f; done
M=/var/tmp/q30-8.gguf
[ -f $M ] || $B/sluice synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
( rm -rf /var/tmp/lcpp && mkdir -p /var/tmp/lcpp && cd /var/tmp/lcpp && tar xJf $D/llama-src.tar.xz &&
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF &&
  cmake --build build --target llama-bench -j 16 ) > $O/build.log 2>&1 &
BU=$!
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) $(grep -o 'avx512vnni\|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ')"
$B/kernels-tile > $O/tiletest.log 2>&1; echo "tile tests rc $?"; grep -E "^test |test result" $O/tiletest.log
wait $SY; echo "synth done at $(( $(date +%s) - T0 )) s"
wait $BU; echo "llama.cpp build rc $? at $(( $(date +%s) - T0 )) s"
LB=/var/tmp/lcpp/build/bin/llama-bench
F="-t 16 --gpu off --experts resident"
for arm in llama sluice sluice llama; do
  if [ $arm = llama ]; then
    [ -x $LB ] && $LB -m $M -t 16 -ngl 0 -p 512 -n 128 -r 1 -o md 2>/dev/null | grep -E "pp512|tg128" | sed "s/^/llama.cpp: /"
  else
    $B/sluice bench $M -p 512 -n 128 -r 1 --run-flags "$F" 2>&1 | grep '^\[bench\] rep' | sed "s/^/sluice: /"
  fi
  echo "arm done at $(( $(date +%s) - T0 )) s"
done
echo "total $(( $(date +%s) - T0 )) s"
