#!/bin/bash
# Device call (issue 15, written in session 27, when no device was lent: not yet run): llama.cpp's
# CUDA build in the background, the GPU tests with session 27's opt-in paths on (NEW: programmatic
# dependent launch, grouped-query flash-decoding, the one-token job list by the routing warp),
# logits byte for byte across the switches that keep the sums (PDL, rows per warp, the job list)
# and fused vs unfused, then on the 8-layer
# Qwen3-30B-A3B-shaped Q4_K file llama-bench and `sluice bench` interleaved (L S S L with NEW on,
# then the A/B arms of each switch), the depth rows (llama-bench -d 4096,16384 against `sluice
# bench -d`), and graph-replay profiles.
#
# On the CPU machine (DIR = target/devrun-h1/cN under the tree `run` copies): DIR/bins.tar.xz
# (stripped `sluice` and the tests/gpu.rs binary `gpu-tests`, one xz -9e tarball: the tree and
# the carry share 64 MiB), DIR/gguf.tar.xz (the gpt-oss fixture GGUFs: no gguf package on the
# device), DIR/llama-src.tar.xz (scripts/gpu-anchor.sh's header says how it is made).
# On the GPU machine: ANCHOR=0|1 bash DIR/gpu-s27-device.sh DIR
set -u
D=${1:-target/devrun-h1/c1}; OO=${OUT:-/tmp/out}; O=/tmp/o; mkdir -p $O $OO
ANCHOR=${ANCHOR:-1}
T0=$(date +%s)
el() { echo "$(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "$ANCHOR" = 1 ]; then
  ( mkdir -p /tmp/llama && tar -xJf $D/llama-src.tar.xz -C /tmp/llama && cd /tmp/llama && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 16 ) > $O/llama-build.log 2>&1 &
  LB=$!
fi
B=/tmp/bin; mkdir -p $B
xz -dc $D/bins.tar.xz | tar -xf - -C $B; chmod +x $B/*
mkdir -p /tmp/gg && xz -dc $D/gguf.tar.xz | tar -xf - -C /tmp/gg
export SLUICE_ROOT=$PWD SLUICE_GGUF_DIR=/tmp/gg/gguf
S=$B/sluice
M=/var/tmp/q30-8.gguf
SY=0
if [ ! -f $M ]; then $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 & SY=$!; fi
NEW="SLUICE_GPU_PDL=1 SLUICE_GPU_ATT_GROUP=1 SLUICE_GPU_JOBS1=1"
env $NEW timeout 240 $B/gpu-tests --test-threads=1 --nocapture > $O/tests.log 2>&1; echo "gpu tests ($NEW) rc $? at $(el)"
grep -E "^test |test result|panicked|worst|identical" $O/tests.log | head -40
TK=$(seq -s, 1 40)
# lg FILE B FLAGS OUT, with NEW on and then XE (an override of NEW, e.g. XE=SLUICE_GPU_PDL=0).
lg() { env $NEW ${XE:-} $S logits $1 --tokens $TK -b $2 --gpu on $3 --out $4 > /dev/null 2> $4.err; }
same() { cmp -s $1 $2 && echo "$3: identical" || echo "$3: DIFFERENT ($(tail -1 $2.err))"; }
for f in qwen3_moe olmoe mixtral; do
  F=tests/fixtures/models/$f/model-q8_0.gguf
  for b in 1 5; do
    lg $F $b "-c 128" /tmp/a.npy
    SLUICE_GPU_FUSED=0 lg $F $b "-c 128" /tmp/b.npy; same /tmp/a.npy /tmp/b.npy "logits $f -b $b fused vs unfused"
    XE=SLUICE_GPU_PDL=0 lg $F $b "-c 128" /tmp/c.npy; same /tmp/a.npy /tmp/c.npy "logits $f -b $b PDL on vs off"
  done
done
[ $SY != 0 ] && wait $SY; echo "model ready at $(el)"
for b in 1 7; do
  lg $M $b "-c 1024 --experts resident" /tmp/a.npy
  SLUICE_GPU_FUSED=0 lg $M $b "-c 1024 --experts resident" /tmp/b.npy; same /tmp/a.npy /tmp/b.npy "logits q30-8 -b $b fused vs unfused"
  XE=SLUICE_GPU_PDL=0 lg $M $b "-c 1024 --experts resident" /tmp/c.npy; same /tmp/a.npy /tmp/c.npy "logits q30-8 -b $b PDL on vs off"
done
lg $M 1 "-c 1024 --experts resident" /tmp/a.npy
for e in SLUICE_GPU_DOWN_ROWS=2 SLUICE_GPU_DOWN_ROWS=4 SLUICE_GPU_MMQ_ROWS=2 SLUICE_GPU_JOBS1=0; do
  env $NEW $e $S logits $M --tokens $TK -b 1 --gpu on -c 1024 --experts resident --out /tmp/d.npy > /dev/null 2> /tmp/d.npy.err
  same /tmp/a.npy /tmp/d.npy "logits q30-8 -b 1 $e"
done
XE=SLUICE_GPU_ATT_GROUP=0 lg $M 1 "-c 1024 --experts resident" /tmp/e.npy
python3 -c "
import numpy as np
a=np.load('/tmp/a.npy').astype(np.float64); e=np.load('/tmp/e.npy').astype(np.float64)
def ls(x): x=x-x.max(-1,keepdims=True); return x-np.log(np.exp(x).sum(-1,keepdims=True))
la,le=ls(a),ls(e); kl=(np.exp(la)*(la-le)).sum(-1)
print('q30-8 -b 1 grouped vs per-head flash-decoding: max|d| %.3g, worst KL %.3g, top-1 %d/%d' % (abs(a-e).max(), kl.max(), (a.argmax(-1)==e.argmax(-1)).sum(), len(a)))
" 2>&1 | tail -1
F="--gpu on --experts resident"
P="The history of the lighthouse begins with fires lit on hills to guide ships home"
for x in short; do
  env $NEW SLUICE_GPU_PROFILE_GRAPH=$O/gprof-short.tsv $S run $M -p "$P" -n 64 --temp 0 $F > $O/gp.txt 2> $O/gp.err
  echo "== graph profile (PDL off while profiling): $(grep -h '^\[timing\]' $O/gp.err)"; head -16 $O/gprof-short.tsv
done
echo "checks done at $(el)"
if [ "$ANCHOR" = 1 ]; then wait $LB; echo "llama build rc $? at $(el)"; tail -2 $O/llama-build.log; fi
LBENCH=/tmp/llama/build/bin/llama-bench
sb() { env $NEW $2 $S bench $M -p 512 -n 128 -r 1 --run-flags "$F" > $O/sb-$1.log 2>&1; echo "sluice $1 ($2): $(grep -hE 'pp512|tg128' $O/sb-$1.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' ')"; }
lb() { [ -x $LBENCH ] || return; $LBENCH -m $M -ngl 99 -p 512 -n 128 -r 2 > $O/lb-$1.log 2>&1; echo "llama.cpp ($1):"; grep -E "pp512|tg128" $O/lb-$1.log; }
lb a; sb this1 X=1; sb this2 X=1; lb b
sb pdl0 SLUICE_GPU_PDL=0; sb down2 SLUICE_GPU_DOWN_ROWS=2; sb down4 SLUICE_GPU_DOWN_ROWS=4; sb mm2 SLUICE_GPU_MMQ_ROWS=2
sb group0 SLUICE_GPU_ATT_GROUP=0; sb jobs0 SLUICE_GPU_JOBS1=0
sb base "SLUICE_GPU_PDL=0 SLUICE_GPU_ATT_GROUP=0 SLUICE_GPU_JOBS1=0"; sb this3 X=1
echo "short benches done at $(el)"
[ -x $LBENCH ] && { timeout 120 $LBENCH -m $M -ngl 99 -p 512 -n 64 -d 4096,16384 -r 1 > $O/lb-depth.log 2>&1; echo "llama.cpp depth:"; grep -E "pp512|tg64" $O/lb-depth.log; }
sd() { env $NEW $3 $S bench $M -p $4 -n 64 -d $2 -r 1 --run-flags "$F" > $O/sd-$1.log 2>&1; echo "sluice $1 -d $2 -p $4 ($3): $(grep -hE '@ d' $O/sd-$1.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' ')"; tail -1 $O/sd-$1.log | grep -i error; }
sd d4k 4096 X=1 512; sd d16k 16384 X=1 512; sd d16k-g0 16384 SLUICE_GPU_ATT_GROUP=0 512
sd d4k-tg 4096 X=1 1; sd d16k-tg 16384 X=1 1
env $NEW SLUICE_GPU_PROFILE_GRAPH=$O/gprof-16k.tsv $S bench $M -p 1 -n 64 -d 16384 -r 1 --run-flags "$F" > $O/gp16.log 2>&1
echo "== graph profile at depth 16384"; head -14 $O/gprof-16k.tsv
echo "total $(el)"
cp $O/gprof-*.tsv $OO/ 2>/dev/null
tar -czf $OO/logs.tgz -C $O .
