#!/bin/bash
# Device call (issue 15, session 26, second call): this branch's GPU tests, fused vs unfused
# logits byte for byte, per-kernel times of the decode graph replay (SLUICE_GPU_PROFILE_GRAPH)
# at a short and a 3.5k-token context, a serialized per-kernel profile of a 512-token prefill,
# the A/B switches of this branch (SLUICE_GPU_ATT_TILED, SLUICE_GPU_MMQ_ROWS), then `sluice
# bench` base / this / this / base. With ANCHOR=1: llama.cpp's CUDA build in the background and
# llama-bench interleaved with the benches.
#
# On the CPU machine (DIR = target/devrun-h1/cN under the tree `run` copies): DIR/pair.tar.xz
# (this branch's stripped `sluice` and the base `sluice-base`, one xz -9e tarball: the carry
# limit), DIR/gpu-tests.xz (tests/gpu.rs), DIR/gpu/ (src/gpu/kernels*.cu, kernels.ptx gzipped:
# the PTX test hashes them), DIR/gguf/ (the gpt-oss fixture GGUFs: no gguf package there),
# DIR/llama-src.tar.xz with ANCHOR=1 (scripts/gpu-anchor.sh's header). On the GPU machine:
# ANCHOR=0|1 bash DIR/THIS DIR
set -u
D=${1:-target/devrun-h1/c2}; OO=${OUT:-/tmp/out}; O=/tmp/o; mkdir -p $O $OO
ANCHOR=${ANCHOR:-0}
T0=$(date +%s)
el() { echo "$(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "$ANCHOR" = 1 ]; then
  ( mkdir -p /tmp/llama && tar -xJf $D/llama-src.tar.xz -C /tmp/llama && cd /tmp/llama && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 16 ) > $O/llama-build.log 2>&1 &
  LB=$!
fi
B=/tmp/bin; mkdir -p $B
xz -dc $D/pair.tar.xz | tar -xf - -C $B
[ -f $D/gpu-tests.xz ] && xz -dc $D/gpu-tests.xz > $B/gpu-tests; chmod +x $B/*
R=/tmp/root; mkdir -p $R/src && cp -r $D/gpu $R/src/gpu && gunzip -f $R/src/gpu/kernels.ptx.gz
ln -sfn $PWD/tests $R/tests; ln -sfn $PWD/scripts $R/scripts
export SLUICE_ROOT=$R SLUICE_GGUF_DIR=$PWD/$D/gguf
S=$B/sluice; SB=$B/sluice-base
M=/var/tmp/q30-8.gguf
[ -f $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
# Without DIR/gpu-tests.xz (an anchor-only call under the carry limit) the tests are skipped.
TR=0; [ -x $B/gpu-tests ] && { timeout 200 $B/gpu-tests --test-threads=1 --nocapture > $O/tests.log 2>&1; TR=$?; echo "gpu tests rc $TR at $(el)"; }
[ -f $O/tests.log ] && grep -E "^test |test result|panicked|worst|identical" $O/tests.log | head -40
if [ $TR != 0 ]; then
  # Isolate: the run again with this branch's new paths off, and go on with them off.
  export SLUICE_GPU_ATT_TILED=0 SLUICE_GPU_T1=0
  timeout 200 $B/gpu-tests --test-threads=1 > $O/tests-off.log 2>&1; echo "gpu tests with ATT_TILED=0 T1=0: rc $?"
  grep -E "test result|panicked" $O/tests-off.log | head
fi
TK=$(seq -s, 1 40)
lg() { $1 logits $2 --tokens $TK -b $3 --gpu on $4 --out $5 > /dev/null 2> $5.err; }
for f in qwen3_moe olmoe deepseek_v3 glm4_moe; do
  for b in 1 5 40; do
    SLUICE_GPU_FUSED=0 lg $S tests/fixtures/models/$f/model-q8_0.gguf $b "-c 128" /tmp/a.npy
    lg $S tests/fixtures/models/$f/model-q8_0.gguf $b "-c 128" /tmp/b.npy
    cmp -s /tmp/a.npy /tmp/b.npy && echo "logits $f -b $b: fused == unfused" || echo "LOGITS $f -b $b: FUSED != UNFUSED"
  done
done
wait $SY; echo "model ready at $(el)"
for b in 1 7 512; do
  SLUICE_GPU_FUSED=0 lg $S $M $b "-c 1024 --experts resident" /tmp/a.npy
  lg $S $M $b "-c 1024 --experts resident" /tmp/b.npy
  cmp -s /tmp/a.npy /tmp/b.npy && echo "logits q30-8 -b $b: fused == unfused" || echo "LOGITS q30-8 -b $b: FUSED != UNFUSED ($(tail -1 /tmp/a.npy.err))"
done
for f in tests/fixtures/models/qwen3_moe/model-q8_0.gguf $M; do
  SLUICE_GPU_T1=0 lg $S $f 1 "-c 128 --experts resident" /tmp/a.npy
  lg $S $f 1 "-c 128 --experts resident" /tmp/b.npy
  cmp -s /tmp/a.npy /tmp/b.npy && echo "logits $(basename $f) -b 1: t1 == 4-token kernels" || echo "LOGITS $(basename $f) -b 1: T1 != 4-TOKEN KERNELS"
done
F="--gpu on --experts resident"
P="The history of the lighthouse begins with fires lit on hills to guide ships home"
L=$(python3 -c "print(' '.join(['the quick brown fox jumps over the lazy dog and']*105))")
P5=$(python3 -c "print(' '.join(['the quick brown fox jumps over the lazy dog and']*15))")
for r in 1 2 0; do
  SLUICE_GPU_T1=$r SLUICE_GPU_PROFILE_GRAPH=$O/gprof-t1$r.tsv $S run $M -p "$P" -n 64 --temp 0 $F > $O/gp-$r.txt 2> $O/gp-$r.err
  echo "== graph profile, T1 $r: $(grep -h '^\[timing\]' $O/gp-$r.err)"; head -16 $O/gprof-t1$r.tsv
done
cmp -s $O/gp-1.txt $O/gp-0.txt && cmp -s $O/gp-1.txt $O/gp-2.txt && echo "text T1 == T1n == 4-token kernels" || echo "TEXT T1 / T1n / 4-token kernels DIFFER"
SLUICE_GPU_PROFILE_GRAPH=$O/gprof-long.tsv timeout 90 $S run $M -p "$L" -n 64 -c 8192 -b 512 --temp 0 $F > $O/long.txt 2> $O/long.err
echo "== graph profile, 3.5k context: $(grep -h '^\[timing\]' $O/long.err)"; head -14 $O/gprof-long.tsv
for a in 1; do
  SLUICE_GPU_ATT_TILED=$a SLUICE_GPU_PROFILE=$O/pprof-att$a.tsv timeout 90 $S run $M -p "$P5" -n 2 -b 512 --temp 0 $F > $O/pp-$a.txt 2> $O/pp-$a.err
  echo "== serialized profile, prefill, tiled attention $a: $(grep -h '^\[timing\]' $O/pp-$a.err)"; head -16 $O/pprof-att$a.tsv
done
cmp -s $O/pp-0.txt $O/pp-1.txt && echo "text tiled == untiled" || echo "text tiled != untiled (expected possible: other sums)"
echo "profiles done at $(el)"
if [ "$ANCHOR" = 1 ]; then wait $LB; echo "llama build rc $? at $(el)"; tail -2 $O/llama-build.log; fi
LBENCH=/tmp/llama/build/bin/llama-bench
sb() { $1 bench $M -p 512 -n 128 -r 1 --run-flags "$F $3" > $O/sb-$2.log 2>&1; echo "sluice $2 ($3): $(grep -hE 'pp512|tg128' $O/sb-$2.log | tr -s ' ' | tr '\n' ' ')"; }
lb() { [ -x $LBENCH ] || return; $LBENCH -m $M -ngl 99 -p 512 -n 128 -r 2 > $O/lb-$1.log 2>&1; echo "llama.cpp ($1):"; grep -E "pp512|tg128" $O/lb-$1.log; }
sb $SB base1 "-b 512"; sb $S this1 ""; lb a; sb $S this2 ""; sb $SB base2 "-b 512"; lb b
SLUICE_GPU_T1=0 sb $S t1off ""; SLUICE_GPU_T1=2 sb $S t1n ""; SLUICE_GPU_ATT_TILED=0 sb $S untiled ""; sb $S this3 ""
for x in this base; do
  B2=$S; [ $x = base ] && B2=$SB
  timeout 90 $B2 run $M -p "$L" -n 64 -c 8192 -b 512 --temp 0 $F > $O/long-$x.txt 2> $O/long-$x.err
  echo "long $x: $(grep -h '^\[timing\]' $O/long-$x.err)"
done
[ -x $LBENCH ] && { timeout 90 $LBENCH -m $M -ngl 99 -p 512 -n 64 -d 4096 -r 1 > $O/lb-d4096.log 2>&1; echo "llama.cpp depth 4096:"; grep -E "pp512|tg64" $O/lb-d4096.log; }
echo "total $(el)"
cp $O/gprof-*.tsv $O/pprof-*.tsv $OO/ 2>/dev/null
tar -czf $OO/logs.tgz -C $O .
