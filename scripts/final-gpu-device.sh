#!/bin/bash
# One device call on merged main (issue 15 anchor + every GPU test): llama.cpp's CUDA build in
# the background, the GPU test binaries (tests/gpu.rs, tests/gpu_types.rs), then the same
# 8-layer Qwen3-30B-A3B-shaped Q4_K file through llama-bench and `sluice bench`, interleaved
# L S S L, and the long-context pair (llama-bench -d 4096 vs a 3466-token prompt).
#
# On the CPU machine (DIR under the tree `run` copies): DIR/bins.tar.xz (stripped sluice,
# gpu-tests, gpu-types-tests in one xz -9e tarball: the tree and the carry share 64 MiB), DIR/gguf/ (fixture GGUFs the device cannot write: no gguf
# package there), DIR/llama-src.tar.xz (scripts/gpu-anchor.sh's header says how it is made).
# On the GPU machine: bash scripts/final-gpu-device.sh DIR
set -u
D=${1:-target/devrun-main}; O=${OUT:-/tmp/out}; mkdir -p $O
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
( mkdir -p /tmp/llama && tar -xJf $D/llama-src.tar.xz -C /tmp/llama && cd /tmp/llama && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 16 ) > $O/llama-build.log 2>&1 &
LB=$!
xz -dc $D/bins.tar.xz | tar -xf - -C $D; chmod +x $D/sluice $D/gpu-tests $D/gpu-types-tests
export SLUICE_ROOT=$PWD SLUICE_GGUF_DIR=$PWD/$D/gguf
S=$D/sluice; M=/var/tmp/q30-8.gguf
$S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 200 $D/gpu-tests --test-threads=1 > $O/gpu.log 2>&1; el "gpu-tests rc $?"
grep -E "^test |test result|panicked" $O/gpu.log | head -20
timeout 100 $D/gpu-types-tests --test-threads=1 > $O/gpu-types.log 2>&1; el "gpu-types rc $?"
grep -E "^test |test result|panicked" $O/gpu-types.log | head -10
wait $SY; el "synth rc $?"
wait $LB; el "llama build rc $?"; tail -2 $O/llama-build.log
LBIN=/tmp/llama/build/bin/llama-bench
F="--gpu on --experts resident"
lb() { $LBIN -m $M -ngl 99 -p 512 -n 128 -r 2 -o md 2>/dev/null | grep -E "pp512|tg128"; }
sb() { $S bench $M -p 512 -n 128 -r 1 --run-flags "$F" 2>/dev/null | grep -E "^\| run"; }
echo "== llama-bench (1)"; lb
echo "== sluice (1)"; sb
echo "== sluice (2)"; sb
echo "== llama-bench (2)"; lb
el "short benches done"
L=$(python3 -c "print(' '.join(['the quick brown fox jumps over the lazy dog and']*105))")
echo "== llama-bench -d 4096"; $LBIN -m $M -ngl 99 -p 512 -n 64 -d 4096 -r 1 -o md 2>/dev/null | grep -E "pp512|tg64"
echo "== sluice run, 3466-token prompt"; timeout 90 $S run $M -p "$L" -n 64 -c 8192 --temp 0 --ignore-eos $F 2>&1 >/dev/null | grep -E "^\[timing\]"
el "done"
