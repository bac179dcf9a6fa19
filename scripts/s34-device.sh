#!/bin/bash
# Session 34 device calls (issue 15), back to back on one machine. DIR holds bins.tar.xz (the
# stripped `sluice` and the test binaries of tests/gpu.rs, gpu_types.rs and kernels_tile.rs,
# built with --features cuda; xz -9e, dict 128 MiB) and llama-src.tar.xz (scripts/gpu-anchor.sh's
# header says how it is made). The binaries embed src/gpu/kernels.ptx, so it may stay behind
# (the carry limit is 64 MiB with the tree).
#   phase 1: llama.cpp's CUDA build in the background; the AVX-512 tile tests on the host CPU;
#            the tensor-core attention tests and every GPU test; the 8-layer Qwen3-30B-A3B-shaped
#            Q4_K file; then, per depth in DEPTHS (0 4096 16384), llama-bench and `sluice bench`
#            with decode attention on the tensor cores (X: SLUICE_GPU_ATT_MMA_DEC=1) and without
#            (T: attention_split_merge), prompts on the tensor cores in both, L X T T X L.
#            Depths left when 500 s have gone are skipped.
#   phase 2: the same bench rows for DEPTHS (the machine warm from phase 1).
# On the GPU machine: bash scripts/s34-device.sh DIR PHASE
set -u
D=${1:-target/devrun-s34}; P=${2:-1}; OO=${OUT:-/tmp/out}; O=/tmp/o$P; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s34; mkdir -p $V; S=$V/sluice; M=/var/tmp/q30-8.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py  # py: the gguf package (pure Python) for the fixture converters
L=/var/tmp/llama; LBIN=$L/build/bin/llama-bench
build_llama() {
  [ -x $LBIN ] && return
  ( mkdir -p $L && tar -xJf $D/llama-src.tar.xz -C $L && cd $L && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 16 ) > $O/llama-build.log 2>&1
}
if [ "$P" = 1 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; grep -m1 "model name" /proc/cpuinfo
  build_llama &
  LB=$!
  xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $V/sluice $V/gpu-tests $V/gpu-types $V/kernels-tile
  [ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
  SY=$!
  timeout 60 $V/kernels-tile --test-threads=2 > $O/tile.log 2>&1; r=$?; el "kernels_tile (host $(grep -o -m1 avx512vnni /proc/cpuinfo)) rc $r"; grep "test result" $O/tile.log
  timeout 90 $V/gpu-tests gpu_tensor_core gpu_f16_cache --test-threads=1 --nocapture > $O/new.log 2>&1; el "new tests rc $?"
  SLUICE_GPU_ATT_MMA=1 timeout 60 $V/gpu-tests gpu_f16_cache --test-threads=1 --nocapture >> $O/new.log 2>&1; el "f16 cache, prompt on tensor cores rc $?"
  SLUICE_GPU_ATT_MMA_DEC=1 timeout 60 $V/gpu-tests gpu_f16_cache --test-threads=1 --nocapture >> $O/new.log 2>&1; el "f16 cache, decode on tensor cores rc $?"
  grep -E "attention_mma|f16 cache|worst|test result|panicked" $O/new.log | head -40
  timeout 200 $V/gpu-tests --test-threads=1 --skip gpu_tensor_core --skip gpu_f16_cache --skip ptx_is_built > $O/gpu.log 2>&1; el "gpu-tests rc $?"
  grep -E "test result|panicked|FAILED|failed" $O/gpu.log | head -20
  timeout 100 $V/gpu-types --test-threads=1 > $O/gpu-types.log 2>&1; el "gpu-types rc $?"; grep -E "test result|panicked|FAILED" $O/gpu-types.log | head -8
  wait $SY; el "synth"; ls -la $M
  wait $LB; el "llama build"; tail -n 2 $O/llama-build.log
else
  [ -x $S ] && [ -s $M ] || { echo "the machine was not warm"; exit 3; }
  build_llama; el "llama build"
fi
R="--gpu on --experts resident"
lb() { timeout 120 $LBIN -m $M -ngl 99 -p 512 -n $1 $2 -r 1 -o md 2>/dev/null | grep -E "pp512|tg$1" | tr -s ' ' | awk -F'|' '{printf "%s %s;", $(NF-2), $(NF-1)}'; echo; }
sb() { env ${3:-X=1} timeout 100 $S bench $M -p 512 -n $1 $2 -r 1 --run-flags "$R" > $O/sb.log 2>&1; grep -hE "pp512|tg$1" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
for d in ${DEPTHS:-0 16384 4096}; do
  [ $(( $(date +%s) - T0 )) -gt ${BUDGET:-500} ] && { el "out of time before depth $d"; break; }
  n=64; a=""; [ $d = 0 ] || a="-d $d"
  x="SLUICE_GPU_ATT_MMA_DEC=1"; t="SLUICE_GPU_ATT_MMA_DEC=0"
  [ -x $LBIN ] && echo "llama.cpp d$d: $(lb $n "$a")"
  echo "sluice dec-mma d$d: $(sb $n "$a" "$x")"; echo "sluice dec-split d$d: $(sb $n "$a" "$t")"
  echo "sluice dec-split d$d: $(sb $n "$a" "$t")"; echo "sluice dec-mma d$d: $(sb $n "$a" "$x")"
  [ -x $LBIN ] && echo "llama.cpp d$d: $(lb $n "$a")"
  el "depth $d"
done
grep -hiE "kv cache|attention" $O/sb.log | head -n 3
el "done"
tar -czf $OO/logs$P.tgz -C $O .
