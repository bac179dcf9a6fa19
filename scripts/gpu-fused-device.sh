#!/bin/bash
# Device call (issue 15, fused decode kernels): llama.cpp's CUDA anchor built in the background
# (as scripts/gpu-anchor.sh), the GPU tests of this branch, fused vs unfused (SLUICE_GPU_FUSED=0)
# logits byte for byte, per-kernel profiles of both, then `sluice bench` (fused, unfused) and
# `llama-bench` interleaved on the same file, and a long-context pair.
#
# On the CPU machine (DIR = target/devrun-h1 under the tree `run` copies):
#   cargo build --release --features cuda
#   cargo test --release --features cuda --no-run --test gpu --test gpu_gemm   # binary paths
#   cp target/release/sluice DIR/sluice; cp <gpu> DIR/gpu-tests; cp <gpu_gemm> DIR/gpu_gemm-tests
#   strip DIR/sluice DIR/*-tests; xz them (the originals removed); mkdir DIR/gpu;
#   cp src/gpu/kernels*.cu DIR/gpu; gzip -c src/gpu/kernels.ptx > DIR/gpu/kernels.ptx.gz
#   DIR/llama-src.tar.xz as scripts/gpu-anchor.sh's header says
# On the GPU machine, from the repository root: bash DIR/gpu-fused-device.sh DIR
set -u
# Logs go to /tmp/o and come back as one tarball (at most 8 files return), the profiles also alone.
D=${1:-target/devrun-h1}; OO=${OUT:-/tmp/out}; O=/tmp/o; mkdir -p $O $OO
T0=$(date +%s)
el() { echo "$(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
( mkdir -p /tmp/llama && tar -xJf $D/llama-src.tar.xz -C /tmp/llama && cd /tmp/llama && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 16 ) > $O/llama-build.log 2>&1 &
LB=$!
# Binaries carried xz'd (the carry limit); this branch's kernel sources (the PTX test hashes
# them, the PTX gzipped) over main's fixtures.
B=/tmp/bin; mkdir -p $B
for f in sluice gpu-tests gpu_gemm-tests; do [ -f $D/$f.xz ] && xz -dc $D/$f.xz > $B/$f && chmod +x $B/$f; done
R=/tmp/root; mkdir -p $R/src && cp -r $D/gpu $R/src/gpu && gunzip -f $R/src/gpu/kernels.ptx.gz && ln -sfn $PWD/tests $R/tests
export SLUICE_ROOT=$R
S=$B/sluice
M=/var/tmp/q30-8.gguf
[ -f $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 240 $B/gpu-tests --test-threads=1 --nocapture > $O/tests.log 2>&1; echo "gpu tests rc $? at $(el)"
grep -E "^test |test result|panicked|worst|KL|placement|identical" $O/tests.log | head -50
[ -x $B/gpu_gemm-tests ] && timeout 120 $B/gpu_gemm-tests --test-threads=1 --nocapture > $O/gemm-tests.log 2>&1; echo "gemm tests rc $? at $(el)"
grep -E "^test |test result|panicked|KL" $O/gemm-tests.log | head -20
# Fused vs unfused, byte for byte: decode steps (-b 1), flash-decoding forwards (-b 5), prefill.
TK=$(seq -s, 1 40)
for f in qwen3_moe mixtral olmoe glm4_moe deepseek_v3; do
  for b in 1 5 64; do
    for F in 0 1; do
      SLUICE_GPU_FUSED=$F $S logits tests/fixtures/models/$f/model-q8_0.gguf --tokens $TK -b $b -c 128 --gpu on --out /tmp/lg-$F.npy > /dev/null 2> /tmp/lg-$F.err
    done
    cmp -s /tmp/lg-0.npy /tmp/lg-1.npy && echo "logits $f -b $b: fused == unfused" || echo "LOGITS $f -b $b: fused != unfused ($(tail -1 /tmp/lg-1.err))"
  done
done
wait $SY; echo "model ready at $(el)"
for b in 1 7 512; do
  for F in 0 1; do
    SLUICE_GPU_FUSED=$F $S logits $M --tokens $TK -b $b -c 1024 --gpu on --experts resident --out /tmp/lg-$F.npy > /dev/null 2> /tmp/lg-$F.err
  done
  cmp -s /tmp/lg-0.npy /tmp/lg-1.npy && echo "logits q30-8 -b $b: fused == unfused" || echo "LOGITS q30-8 -b $b: fused != unfused ($(tail -1 /tmp/lg-1.err))"
done
rm -f /tmp/lg-*.npy
F="--gpu on --experts resident"
P="The history of the lighthouse begins with fires lit on hills to guide ships home"
for x in 1 0; do
  SLUICE_GPU_FUSED=$x $S run $M -p "$P" -n 128 --temp 0 $F > $O/text-$x.txt 2> $O/text-$x.err
  echo "run fused=$x: $(grep -h '^\[timing\]' $O/text-$x.err || tail -2 $O/text-$x.err)"
done
cmp -s $O/text-0.txt $O/text-1.txt && echo "text fused == unfused" || echo "TEXT fused != unfused"
for x in 1 0; do
  SLUICE_GPU_FUSED=$x SLUICE_GPU_PROFILE=$O/prof-$x.tsv $S run $M -p "$P" -n 64 --temp 0 $F > /dev/null 2> $O/prof-$x.err
  echo "== profile fused=$x (17-token prompt + 64 tokens, launches serialized)"; head -28 $O/prof-$x.tsv
done
echo "profiles done at $(el)"
cp $O/prof-1.tsv $O/prof-0.tsv $O/tests.log $OO/ 2>/dev/null
wait $LB; echo "llama build rc $? at $(el)"; tail -2 $O/llama-build.log
LBENCH=/tmp/llama/build/bin/llama-bench
sb() { SLUICE_GPU_FUSED=$1 $S bench $M -p 512 -n 128 -r 1 --run-flags "$F" > $O/sb-$1$2.log 2>&1; echo "sluice fused=$1 ($2): $(grep -hE 'pp512|tg128' $O/sb-$1$2.log | tr -s ' ' | tr '\n' ' ')"; }
lb() { $LBENCH -m $M -ngl 99 -p 512 -n 128 -r 2 > $O/lb-$1.log 2>&1; echo "llama.cpp ($1):"; grep -E "pp512|tg128" $O/lb-$1.log; }
sb 1 a; lb a; sb 0 a; sb 0 b; lb b; sb 1 b
echo "benches done at $(el)"
L=$(python3 -c "print(' '.join(['the quick brown fox jumps over the lazy dog and']*105))")
for x in 1 0; do
  SLUICE_GPU_FUSED=$x timeout 90 $S run $M -p "$L" -n 64 -c 8192 -b 512 --temp 0 $F > $O/long-$x.txt 2> $O/long-$x.err
  echo "long fused=$x: $(grep -h '^\[timing\]' $O/long-$x.err || tail -2 $O/long-$x.err)"
done
cmp -s $O/long-0.txt $O/long-1.txt && echo "long text fused == unfused" || echo "LONG TEXT fused != unfused"
timeout 90 $LBENCH -m $M -ngl 99 -p 512 -n 64 -d 4096 -r 1 > $O/lb-d4096.log 2>&1; echo "llama.cpp depth 4096:"; grep -E "pp512|tg64" $O/lb-d4096.log
echo "total $(el)"
tar -czf $OO/logs.tgz -C $O .
