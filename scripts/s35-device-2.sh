#!/bin/bash
# Session 35, second device call (issue 15): llama.cpp's CUDA build in the background (the anchor,
# from DIR/llama-src.tar.xz as in scripts/s34-device.sh); every GPU test of this tree's binary
# (DIR/bins.tar.xz, scripts/pack-device.sh; the gguf package on PYTHONPATH); then, per depth,
# `sluice bench` A B B A at depth 16384, 4096 and 0: A = the default (f16 storage, grouped decode
# kernel), B = SLUICE_GPU_ATT_MMA_DEC=0 (f32 words, per-head split kernel); a partial-VRAM
# prompt's figures; then, if the build is done in time, llama-bench and A once each per depth.
# (Written for session 35, not run there: no machine; ready for the next session.) On the GPU machine: bash scripts/s35-device-2.sh DIR
set -u
D=${1:-target/devrun-s35}; OO=${OUT:-/tmp/out}; O=/tmp/o2; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s35; mkdir -p $V; S=$V/sluice; M=/var/tmp/q30-8.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
mkdir -p /work/main/target/tmp 2>/dev/null  # the test binary's CARGO_TARGET_TMPDIR
L=/var/tmp/llama; LBIN=$L/build/bin/llama-bench
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
( [ -x $LBIN ] || ( mkdir -p $L && tar -xJf $D/llama-src.tar.xz -C $L && cd $L && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 16 ) > $O/llama-build.log 2>&1 ) &
LB=$!
xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $V/sluice $V/gpu-tests $V/gpu-types $V/kernels-tile
[ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 300 $V/gpu-tests --test-threads=1 --skip ptx_is_built --nocapture > $O/gpu.log 2>&1; el "gpu-tests rc $?"
grep -E "^test |test result|panicked|FAILED|failed|stored as f16" $O/gpu.log | head -40
wait $SY; el "synth"; ls -la $M
R="--gpu on --experts resident"
lb() { timeout 120 $LBIN -m $M -ngl 99 -p 512 -n $1 $2 -r 1 -o md 2>/dev/null | grep -E "pp512|tg$1" | tr -s ' ' | awk -F'|' '{printf "%s %s;", $(NF-2), $(NF-1)}'; echo; }
sb() { env $3 timeout 100 $S bench $M -p 512 -n $1 $2 -r 1 --run-flags "$R" > $O/sb.log 2>&1; grep -hE "pp512|tg$1" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
for d in 16384 4096 0; do
  a=""; [ $d = 0 ] || a="-d $d"
  A=X=1; B=SLUICE_GPU_ATT_MMA_DEC=0
  echo "sluice A d$d: $(sb 64 "$a" $A)"; echo "sluice B($B) d$d: $(sb 64 "$a" $B)"
  echo "sluice B($B) d$d: $(sb 64 "$a" $B)"; echo "sluice A d$d: $(sb 64 "$a" $A)"
  el "depth $d"
done
grep -h "KV cache" $O/sb.log | head -n 1
# Where a partial-VRAM prompt goes (issue 15's hybrid prefill at 0.2x): a quarter of the experts
# in the pool (0.615 GB, session 32's match of llama.cpp -ncmoe 6), stage and hybrid, one
# ~490-token prompt each, the plan lines, the prefill rate and a serialized kernel profile.
P=$(python3 -c "print(' '.join('word%d' % i for i in range(100)))")
for m in stage hybrid; do
  [ $(( $(date +%s) - T0 )) -gt 570 ] && break
  timeout 25 $S run $M -p "$P" -n 4 --gpu on --experts resident -c 1024 -b 512 --vram 615M --gpu-experts $m > /dev/null 2> $O/h-$m.log
  grep -hE "^\[plan\] gpu|timing|gpu:" $O/h-$m.log | cut -c1-220
  SLUICE_GPU_PROFILE=$O/hprof-$m.txt timeout 25 $S run $M -p "$P" -n 1 --gpu on --experts resident -c 1024 -b 512 --vram 615M --gpu-experts $m > /dev/null 2>&1
  head -n 14 $O/hprof-$m.txt
done
el "hybrid"
if [ $(( $(date +%s) - T0 )) -lt 420 ]; then
  wait $LB; el "llama build"; tail -n 1 $O/llama-build.log
  for d in 0 4096 16384; do
    [ $(( $(date +%s) - T0 )) -gt 540 ] && break
    a=""; [ $d = 0 ] || a="-d $d"
    [ -x $LBIN ] && echo "llama.cpp d$d: $(lb 64 "$a")"; echo "sluice A d$d: $(sb 64 "$a" X=1)"
  done
fi
tar -czf $OO/logs2.tgz -C $O .
