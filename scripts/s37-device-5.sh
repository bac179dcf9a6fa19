#!/bin/bash
# Session 37's closing device call (issues 15, 16): every GPU test, then in one call against
# llama.cpp's CUDA build made here: decode/prefill at depth 4096 and 16384 (the new split rule),
# partial VRAM (`-ncmoe 6` against `--vram 615M --gpu-experts stage`), and the host CPU at 16
# threads (llama.cpp's CUDA build with no device visible, `-ngl 0`, against `--gpu off`) on the
# Qwen3-30B-A3B-shaped and DeepSeek-V3-shaped files. While llama.cpp compiles, an Nsight Systems
# trace of depth-0 decode steps (true kernel durations and gaps inside the replayed graph).
# DIR holds bins.tar.xz (scripts/pack-device.sh) and llama-src.tar.xz. Output: $OUT/out.txt.
set -u
D=${1:-target/devrun-s37}; OO=${OUT:-/tmp/out}; O=/tmp/o5; mkdir -p $O $OO
exec > >(tee $OO/out.txt) 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s37e; mkdir -p $V; S=$V/sluice; M=/var/tmp/q30-8.gguf; M3=/var/tmp/ds3-2.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
mkdir -p /work/main/target/tmp 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
L=/var/tmp/llama; LBIN=$L/build/bin/llama-bench
( [ -x $LBIN ] || ( mkdir -p $L && tar -xJf $D/llama-src.tar.xz -C $L && cd $L && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 16 ) > $O/llama-build.log 2>&1 ) &
LB=$!
xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $V/sluice $V/gpu-tests $V/gpu-types $V/kernels-tile
( [ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11
  [ -s $M3 ] || $S synth $M3 --preset deepseek-v3 --layers 2 --quant q4_k --no-mtp --seed 11 ) > $O/synth.log 2>&1 &
SY=$!
timeout 200 $V/gpu-tests --test-threads=1 --skip ptx_is_built --nocapture > $O/gpu.log 2>&1; el "gpu-tests rc $?"
grep -E "^test |test result|panicked|FAILED|failed" $O/gpu.log | cut -c1-200 | head -40
timeout 60 $V/gpu-types --test-threads=1 > $O/gpu-types.log 2>&1; el "gpu-types rc $?"; grep "test result" $O/gpu-types.log
wait $SY; el "synth"
NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -n 1)
if [ -n "$NSYS" ]; then
  timeout 90 $NSYS profile --cuda-graph-trace=node -t cuda -o $O/d0 -f true $S run $M -p "hello there" -n 64 --temp 0 --gpu on --experts resident -c 4096 > $O/nsys.log 2>&1; el "nsys rc $?"
  timeout 60 $NSYS stats -r cuda_gpu_kern_sum -f csv $O/d0.nsys-rep 2>/dev/null | cut -d, -f1-9 | head -n 24 | tee $O/kern.csv
  grep -h "timing" $O/nsys.log
else echo "no nsys"; fi
wait $LB; el "llama build"; tail -n 1 $O/llama-build.log
lb() { timeout 150 $LBIN -m $1 $2 -p 512 -n $3 -r 1 -o md 2>/dev/null | grep -E "pp512|tg$3" | tr -s ' ' | awk -F'|' '{printf "%s %s;", $(NF-2), $(NF-1)}'; echo; }
sb() { timeout 150 $S bench $1 -p 512 -n $3 $4 -r 1 --run-flags "$2" > $O/sb.log 2>&1; grep -hE "pp512|tg$3" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
G="--gpu on --experts resident"
for d in 4096 16384; do
  echo "llama.cpp d$d: $(lb $M "-ngl 99 -d $d" 64)"; echo "sluice d$d: $(sb $M "$G" 64 "-d $d")"
  echo "sluice d$d: $(sb $M "$G" 64 "-d $d")"; echo "llama.cpp d$d: $(lb $M "-ngl 99 -d $d" 64)"
  el "depth $d"
done
echo "llama.cpp -ncmoe 6: $(lb $M "-ngl 99 -ncmoe 6" 64)"
echo "sluice --vram 615M stage: $(sb $M "$G --vram 615M --gpu-experts stage" 64 "")"
echo "sluice --vram 615M stage: $(sb $M "$G --vram 615M --gpu-experts stage" 64 "")"
echo "llama.cpp -ncmoe 6: $(lb $M "-ngl 99 -ncmoe 6" 64)"
el "partial"
C="-t 16 --gpu off --experts resident"
for F in $M $M3; do
  echo "cpu llama.cpp $(basename $F): $(CUDA_VISIBLE_DEVICES= lb $F "-ngl 0 -t 16" 32)"
  echo "cpu sluice $(basename $F): $(sb $F "$C" 32 "")"
  echo "cpu sluice $(basename $F): $(sb $F "$C" 32 "")"
  echo "cpu llama.cpp $(basename $F): $(CUDA_VISIBLE_DEVICES= lb $F "-ngl 0 -t 16" 32)"
  el "cpu $(basename $F)"
done
el "done"
tar -czf $OO/logs.tgz -C $O --exclude='*.nsys-rep' --exclude='*.sqlite' .
