#!/bin/bash
# Session 29, first of two back-to-back device calls (issue 15): session 27's opt-in GPU paths
# (PDL, grouped flash-decoding, the one-token job list by the routing warp) have never run on a
# device. This call: the tests/gpu.rs binary with them on, logits byte for byte across the
# switches that keep the sums, and sluice-only A/B benches of each switch on the 8-layer
# Qwen3-30B-A3B-shaped Q4_K synth. llama.cpp is built in the second call
# (scripts/s29-device-2.sh): the tree (54 MB) and the carry share 64 MiB, so the binaries and
# llama.cpp's sources travel in different calls and the binaries stay in /var/tmp/s29.
#
# On the CPU machine, DIR (under target/): bins.tar.xz (stripped `sluice` and the tests/gpu.rs
# binary as `gpu-tests`, xz -9e) and ggufpy.tar.xz (gguf-py/gguf from the llama-cpp-python
# 0.3.36 sdist: the device has no gguf package; the fixture GGUFs are written there).
# On the GPU machine: bash scripts/s29-device-1.sh DIR
set -u
D=${1:-target/devrun-s29}; OO=${OUT:-/tmp/out}; O=/tmp/o1; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
V=/var/tmp/s29; mkdir -p $V/gguf
xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $V/sluice $V/gpu-tests
tar -xJf $D/ggufpy.tar.xz -C $V
S=$V/sluice; M=/var/tmp/q30-8.gguf
SY=0
[ -s $M ] || { $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 & SY=$!; }
F=tests/fixtures/models
export PYTHONPATH=$V/gguf-py
for e in f32 mxfp4; do python3 scripts/gptoss_to_gguf.py $F/gpt_oss $V/gguf/gpt-oss-$e.gguf --experts $e > /dev/null || echo "gguf gpt-oss $e FAILED"; done
for f in qwen3_next qwen3_5_moe; do python3 scripts/qwen3next_to_gguf.py $F/$f $V/gguf/$f.gguf > /dev/null || echo "gguf $f FAILED"; done
python3 scripts/deepseek_v4_to_gguf.py $F/deepseek_v4 $V/gguf/deepseek_v4-f32.gguf > /dev/null || echo "gguf v4 FAILED"
for e in mxfp4 mxfp4-f32; do python3 scripts/deepseek_v4_to_gguf.py $F/deepseek_v4 $V/gguf/deepseek_v4-$e.gguf --experts $e > /dev/null || echo "gguf v4 $e FAILED"; done
el "fixture ggufs: $(ls $V/gguf | wc -l)"
export SLUICE_ROOT=$PWD SLUICE_GGUF_DIR=$V/gguf
NEW="SLUICE_GPU_PDL=1 SLUICE_GPU_ATT_GROUP=1 SLUICE_GPU_JOBS1=1"
env $NEW timeout 240 $V/gpu-tests --test-threads=1 --nocapture > $O/tests.log 2>&1; el "gpu tests with NEW ($NEW) rc $?"
grep -E "^test |test result|panicked" $O/tests.log | head -60
grep -E "worst|identical|KL|max" $O/tests.log | head -40
TK=$(seq -s, 1 40)
lg() { env $NEW ${XE:-} $S logits $1 --tokens $TK -b $2 --gpu on $3 --out $4 > /dev/null 2> $4.err; }
same() { cmp -s $1 $2 && echo "$3: identical" || echo "$3: DIFFERENT ($(tail -1 $2.err))"; }
for f in qwen3_moe olmoe mixtral; do
  G=$F/$f/model-q8_0.gguf
  for b in 1 5; do
    lg $G $b "-c 128" /tmp/a.npy
    SLUICE_GPU_FUSED=0 lg $G $b "-c 128" /tmp/b.npy; same /tmp/a.npy /tmp/b.npy "logits $f -b $b fused vs unfused"
    XE=SLUICE_GPU_PDL=0 lg $G $b "-c 128" /tmp/c.npy; same /tmp/a.npy /tmp/c.npy "logits $f -b $b PDL on vs off"
    XE=SLUICE_GPU_JOBS1=0 lg $G $b "-c 128" /tmp/c.npy; same /tmp/a.npy /tmp/c.npy "logits $f -b $b JOBS1 on vs off"
  done
done
[ $SY != 0 ] && wait $SY; el "model ready"; ls -la $M
for b in 1 7; do
  lg $M $b "-c 1024 --experts resident" /tmp/a.npy
  SLUICE_GPU_FUSED=0 lg $M $b "-c 1024 --experts resident" /tmp/b.npy; same /tmp/a.npy /tmp/b.npy "logits q30-8 -b $b fused vs unfused"
  XE=SLUICE_GPU_PDL=0 lg $M $b "-c 1024 --experts resident" /tmp/c.npy; same /tmp/a.npy /tmp/c.npy "logits q30-8 -b $b PDL on vs off"
  XE=SLUICE_GPU_JOBS1=0 lg $M $b "-c 1024 --experts resident" /tmp/c.npy; same /tmp/a.npy /tmp/c.npy "logits q30-8 -b $b JOBS1 on vs off"
done
lg $M 1 "-c 1024 --experts resident" /tmp/a.npy
XE=SLUICE_GPU_ATT_GROUP=0 lg $M 1 "-c 1024 --experts resident" /tmp/e.npy
python3 -c "
import numpy as np
a=np.load('/tmp/a.npy').astype(np.float64); e=np.load('/tmp/e.npy').astype(np.float64)
def ls(x): x=x-x.max(-1,keepdims=True); return x-np.log(np.exp(x).sum(-1,keepdims=True))
la,le=ls(a),ls(e); kl=(np.exp(la)*(la-le)).sum(-1)
print('q30-8 -b 1 grouped vs per-head flash-decoding: max|d| %.3g, worst KL %.3g, top-1 %d/%d' % (abs(a-e).max(), kl.max(), (a.argmax(-1)==e.argmax(-1)).sum(), len(a)))
" 2>&1 | tail -1
el "checks done"
R="--gpu on --experts resident"
sb() { env $2 timeout 60 $S bench $M -p 512 -n 128 -r 1 --run-flags "$R" > $O/sb-$1.log 2>&1; echo "sluice $1 ($2): $(grep -hE 'pp512|tg128' $O/sb-$1.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' ')"; }
sb base X=1; sb new "$NEW"; sb new "$NEW"; sb base X=1
sb pdl1 SLUICE_GPU_PDL=1; sb group1 SLUICE_GPU_ATT_GROUP=1; sb jobs1 SLUICE_GPU_JOBS1=1
sb new "$NEW"; sb base X=1
el "short benches done"
sd() { env $3 timeout 90 $S bench $M -p 1 -n 64 -d $2 -r 1 --run-flags "$R" > $O/sd-$1.log 2>&1; echo "sluice $1 -d $2 ($3): $(grep -hE '@ d' $O/sd-$1.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' ')"; grep -i error $O/sd-$1.log | tail -1; }
sd base16k 16384 X=1; sd group16k 16384 SLUICE_GPU_ATT_GROUP=1; sd new16k 16384 "$NEW"; sd base16k 16384 X=1
el "total"
tar -czf $OO/logs1.tgz -C $O .
