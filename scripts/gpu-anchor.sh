#!/bin/bash
# Device call: llama.cpp CUDA anchor build (background), synth the 8-layer Qwen3-30B-A3B-shaped
# file, GPU tests, then sluice and llama-bench interleaved on that file.
#
# On the CPU machine (binaries as in scripts/gpu-check.sh, into DIR = target/devrun-gpu):
#   pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d /tmp/l
#   tar -xzf /tmp/l/llama_cpp_python-0.3.36.tar.gz; cd llama_cpp_python-0.3.36/vendor/llama.cpp
#   tar -cJf DIR/llama-src.tar.xz --exclude=tools/ui --exclude=tools/server \
#       --exclude=ggml/src/ggml-{cann,hexagon,hip,metal,musa,opencl,openvino,sycl,virtgpu,vulkan,webgpu,zdnn,zendnn,et} \
#       CMakeLists.txt cmake common ggml include src vendor tools licenses LICENSE
# On the GPU machine, from the repository root: scripts/gpu-anchor.sh [DIR]   (about 280 s)
set -u
D=${1:-target/devrun-gpu}; O=${OUT:-/tmp/out}; mkdir -p $O
export SLUICE_ROOT=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
( mkdir -p /tmp/llama && tar -xJf $D/llama-src.tar.xz -C /tmp/llama && cd /tmp/llama && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 16 ) > $O/llama-build.log 2>&1 &
LB=$!
M=/var/tmp/q30-8.gguf
T0=$(date +%s)
[ -f $M ] || $D/sluice synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1
echo "synth done $(( $(date +%s) - T0 )) s"
timeout 260 $D/gpu-tests --test-threads=1 --nocapture > $O/tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - T0 )) s"
grep -E "^test |test result|panicked|worst|KL|placement|identical" $O/tests.log | head -70
wait $LB; echo "llama build rc $? at $(( $(date +%s) - T0 )) s"; tail -2 $O/llama-build.log
LBENCH=/tmp/llama/build/bin/llama-bench
for r in 1 2; do
  echo "== round $r sluice"
  $D/sluice bench $M -p 512 -n 128 -r 1 --run-flags "--gpu on --experts resident" > $O/sb$r.log 2>&1; tail -6 $O/sb$r.log
  echo "== round $r llama.cpp"
  $LBENCH -m $M -ngl 99 -p 512 -n 128 -r 2 > $O/lb$r.log 2>&1; tail -6 $O/lb$r.log
done
$D/sluice run $M -p "Once upon a time there was" -n 64 --temp 0 --gpu on --experts resident --stats-json $O/run.json > $O/run.txt 2> $O/run.err; tail -3 $O/run.err
echo "total $(( $(date +%s) - T0 )) s"
