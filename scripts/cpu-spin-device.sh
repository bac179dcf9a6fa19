#!/bin/bash
# On the device (in target/devrun-h5, carried: both.tar.xz = sluice-base.s (the binary before
# this branch) and sluice-new.s (this branch), stripped, in one xz stream with a dictionary
# that spans both (11 MB instead of 21); regionbench.xz = examples/regionbench;
# llama-src.tar.xz = the llama-cpp-python 0.3.36 sources): after llama.cpp's CPU build and the
# synth, the cost of one short parallel region at 16 threads (rayon vs the spinning gang), the
# CPU backend's time split (SLUICE_PROF_CPU=1) and `--prof` shares of decode and prefill, then
# 16-thread pp512/tg128 of llama.cpp (llama-bench) and sluice (base, this branch, this branch
# with SLUICE_SPIN=0) interleaved, on an 8-layer Qwen3-30B-A3B-shaped Q4_K file.
set -u
D=$PWD/target/devrun-h5; O=${OUT:-/tmp/out}; mkdir -p $O
T0=$(date +%s)
B=/var/tmp/h5; mkdir -p $B
xz -dc $D/both.tar.xz | tar xf - -C $B && mv $B/sluice-new.s $B/sluice && mv $B/sluice-base.s $B/sluice-base
xz -dc $D/regionbench.xz > $B/regionbench; chmod +x $B/sluice $B/sluice-base $B/regionbench
M=/var/tmp/q30-8.gguf
[ -f $M ] || $B/sluice synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
( rm -rf /var/tmp/lcpp && mkdir -p /var/tmp/lcpp && cd /var/tmp/lcpp && tar xJf $D/llama-src.tar.xz &&
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF &&
  cmake --build build --target llama-bench -j 16 ) > $O/build.log 2>&1 &
BU=$!
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) $(nproc) cpus"
wait $SY; echo "synth done at $(( $(date +%s) - T0 )) s"
wait $BU; echo "llama.cpp build rc $? at $(( $(date +%s) - T0 )) s"
for a in "16 64 20" "16 32 2000"; do $B/regionbench $a 2>&1 | tail -3; done
echo "regionbench done at $(( $(date +%s) - T0 )) s"
F="-t 16 --gpu off --experts resident"
P=""; for i in $(seq 12); do P="$P the quick brown fox jumps over the lazy dog and"; done
for arm in base new; do
  S=$B/sluice; [ $arm = base ] && S=$B/sluice-base
  SLUICE_PROF_CPU=1 $S run $M -p "hi" -n 129 --temp 0 $F --prof 2>&1 >$O/text-$arm.txt | grep -E 'timing|prof\] [0-9]|prof-cpu\] 64' | sed "s/^/$arm decode: /"
  SLUICE_PROF_CPU=1 $S run $M -p "$P" -n 1 --temp 0 $F --prof 2>&1 >/dev/null | grep -E 'timing|prof\] [0-9]|prof-cpu' | sed "s/^/$arm prefill: /"
done
cmp -s $O/text-base.txt $O/text-new.txt && echo "decode text identical base/new" || echo "decode text DIFFERS base/new"
echo "prof done at $(( $(date +%s) - T0 )) s"
LB=/var/tmp/lcpp/build/bin/llama-bench
for arm in llama base new spin0 spin0 new base llama; do
  case $arm in
    llama) [ -x $LB ] && $LB -m $M -t 16 -ngl 0 -p 512 -n 128 -r 1 -o md 2>/dev/null | grep -E "pp512|tg128" | sed "s/^/llama.cpp: /" ;;
    base) $B/sluice-base bench $M -p 512 -n 128 -r 1 --run-flags "$F" 2>&1 | grep '^\[bench\] rep' | sed "s/^/base: /" ;;
    new) $B/sluice bench $M -p 512 -n 128 -r 1 --run-flags "$F" 2>&1 | grep '^\[bench\] rep' | sed "s/^/new: /" ;;
    spin0) SLUICE_SPIN=0 $B/sluice bench $M -p 512 -n 128 -r 1 --run-flags "$F" 2>&1 | grep '^\[bench\] rep' | sed "s/^/new SLUICE_SPIN=0: /" ;;
  esac
  echo "arm $arm done at $(( $(date +%s) - T0 )) s"
done
echo "total $(( $(date +%s) - T0 )) s"
