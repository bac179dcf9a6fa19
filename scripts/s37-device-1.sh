#!/bin/bash
# Next session's first device call (issue 15): the anchor for everything session 36 changed, in
# one call. DIR holds bins.tar.xz (scripts/pack-device.sh, built in /work/main so the test
# binary's CARGO_TARGET_TMPDIR exists there) and llama-src.tar.xz (the llama-cpp-python 0.3.36
# sdist's llama.cpp sources, as scripts/s34-device.sh packs them). llama.cpp's CUDA build runs
# in the background while every GPU test runs (the tests are not timed); the timed runs start
# after the build: per depth 0 / 4096 / 16384 llama-bench then sluice (resident), then partial
# VRAM: llama.cpp `-ngl 99 -ncmoe 6` against sluice `--vram 615M` stage and hybrid (pp512, tg64).
# Everything printed goes to $OUT/out.txt. On the GPU machine: bash scripts/s37-device-1.sh DIR
set -u
D=${1:-target/devrun-s37}; OO=${OUT:-/tmp/out}; O=/tmp/o1; mkdir -p $O $OO
exec > >(tee $OO/out.txt) 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s37; mkdir -p $V; S=$V/sluice; M=/var/tmp/q30-8.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
mkdir -p /work/main/target/tmp 2>/dev/null  # the test binary's CARGO_TARGET_TMPDIR
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
L=/var/tmp/llama; LBIN=$L/build/bin/llama-bench
( [ -x $LBIN ] || ( mkdir -p $L && tar -xJf $D/llama-src.tar.xz -C $L && cd $L && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 16 ) > $O/llama-build.log 2>&1 ) &
LB=$!
xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $V/sluice $V/gpu-tests $V/gpu-types $V/kernels-tile
[ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 280 $V/gpu-tests --test-threads=1 --skip ptx_is_built --nocapture > $O/gpu.log 2>&1; el "gpu-tests rc $?"
grep -E "^test |test result|panicked|FAILED|failed" $O/gpu.log | cut -c1-220 | head -40
timeout 60 $V/gpu-types --test-threads=1 > $O/gpu-types.log 2>&1; el "gpu-types rc $?"; grep "test result" $O/gpu-types.log
wait $SY; el "synth"
wait $LB; el "llama build"; tail -n 1 $O/llama-build.log
lb() { timeout 150 $LBIN -m $M -ngl 99 -p 512 -n 64 $1 -r 1 -o md 2>/dev/null | grep -E "pp512|tg64" | tr -s ' ' | awk -F'|' '{printf "%s %s;", $(NF-2), $(NF-1)}'; echo; }
sb() { timeout 150 $S bench $M -p 512 -n 64 $1 -r 1 --run-flags "--gpu on --experts resident $2" > $O/sb.log 2>&1; grep -hE "pp512|tg64" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
for d in 0 4096 16384; do
  a=""; [ $d = 0 ] || a="-d $d"
  echo "llama.cpp d$d: $(lb "$a")"; echo "sluice d$d: $(sb "$a" "")"
  echo "sluice d$d: $(sb "$a" "")"; echo "llama.cpp d$d: $(lb "$a")"
  el "depth $d"
done
echo "llama.cpp -ncmoe 6: $(lb "-ncmoe 6")"
for m in stage hybrid; do echo "sluice --vram 615M $m: $(sb "" "--vram 615M --gpu-experts $m")"; done
grep -h "RAM cache" $O/sb.log | head -n 1 | cut -c1-250
echo "llama.cpp -ncmoe 6: $(lb "-ncmoe 6")"
# Where a depth-0 decode step goes, kernel by kernel (Nsight Compute's durations, serialized, no
# launch gaps): a short prompt, then decode steps; the first 60 launches (load, prompt) skipped.
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
if [ -n "$NCU" ]; then
  timeout 120 $NCU --launch-skip 60 --launch-count 150 --metrics gpu__time_duration.sum \
    $S run $M -p "hello there" -n 8 --gpu on --experts resident -c 4096 > $O/ncu-d0.txt 2>&1; el "ncu d0 rc $?"
  awk '/^  [a-z_0-9]+ \(/{k=$1} /gpu__time_duration.sum/{v=$NF; if ($(NF-1)=="ms") v*=1000; print k, v}' $O/ncu-d0.txt \
    | awk '{s[$1]+=$2; c[$1]++; t+=$2} END{for(k in s) printf "%-34s n=%3d mean %7.2f us total %8.1f\n", k, c[k], s[k]/c[k], s[k]; printf "all %.1f us over %d launches\n", t, NR}' | sort -k7 -g -r | head -30
fi
el "done"
tar -czf $OO/logs.tgz -C $O .
