#!/bin/bash
# Session 38, closing device call (issues 15, 16): every GPU test with the 1024-thread RMSNorm
# (add_rmsnorm_q8_w); its logits byte for byte against the 256-thread kernel
# (SLUICE_GPU_NORM_WIDE=0), decode and prefill batches; decode A B B A on/off; then, with
# llama.cpp's CUDA build (made meanwhile), the standing: host CPU at 16 threads (q30-8, ds3-2
# with llama.cpp's repack off) and GPU depth 0, L S S L. DIR: bins.tar.xz, llama-src.tar.xz.
set -u
D=${1:-target/devrun-s38b}; OO=${OUT:-/tmp/out}; O=/tmp/o5; mkdir -p $O $OO
exec > >(tee $OO/out.txt) 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s38; mkdir -p $V; S=$V/sluice
M=/var/tmp/q30-8.gguf; M3=/var/tmp/ds3-2.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
mkdir -p /work/main/target/tmp 2>/dev/null
L=/var/tmp/llama; LBIN=$L/build/bin/llama-bench
( [ -x $LBIN ] || ( mkdir -p $L && tar -xJf $D/llama-src.tar.xz -C $L && cd $L && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 16 ) > $O/llama-build.log 2>&1 ) &
LB=$!
xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $S $V/gpu-tests $V/gpu-types
( [ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11
  [ -s $M3 ] || $S synth $M3 --preset deepseek-v3 --layers 2 --quant q4_k --no-mtp --seed 11 ) > $O/synth.log 2>&1 &
SY=$!
timeout 200 $V/gpu-tests --test-threads=1 --skip ptx_is_built > $O/gpu.log 2>&1; el "gpu-tests rc $?"
grep -E "test result|panicked|FAILED" $O/gpu.log | cut -c1-200 | head -10
timeout 100 $V/gpu-types --test-threads=1 > $O/gpu-types.log 2>&1; el "gpu-types rc $? $(grep 'test result' $O/gpu-types.log | cut -c1-60)"
wait $SY; el "synth"
TOK=$(seq -s, 100 140)
for b in 1 41; do
  for w in 1 0; do SLUICE_GPU_NORM_WIDE=$w timeout 100 $S logits $M --tokens $TOK --out $O/l-b$b-w$w.npy -b $b --gpu on --experts resident -c 256 > $O/logits-b$b-w$w.log 2>&1 || tail -n 2 $O/logits-b$b-w$w.log; done
  cmp $O/l-b$b-w1.npy $O/l-b$b-w0.npy && echo "logits -b $b: wide == 256-thread, byte for byte ($(stat -c %s $O/l-b$b-w1.npy) bytes)"
done
gb() { env SLUICE_GPU_NORM_WIDE=$1 timeout 100 $S bench $M -p 512 -n 64 -r 1 --run-flags "--gpu on --experts resident" 2>&1 | grep -E "pp512|tg64" | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; echo; }
for w in 0 1 1 0; do echo "gpu d0 NORM_WIDE=$w: $(gb $w)"; done
el "wide A/B"
wait $LB; el "llama build"; tail -n 1 $O/llama-build.log
lb() { timeout 150 $LBIN -m $1 $2 -p 512 -n $3 -r 1 -o md 2>/dev/null | grep -E "pp512|tg$3" | tr -s ' ' | awk -F'|' '{printf "%s %s;", $(NF-2), $(NF-1)}'; echo; }
sb() { timeout 150 $S bench $1 -p 512 -n $3 -r 1 --run-flags "$2" > $O/sb.log 2>&1; grep -hE "pp512|tg$3" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
G="--gpu on --experts resident"
echo "llama.cpp d0: $(lb $M "-ngl 99" 64)"; echo "sluice d0: $(sb $M "$G" 64)"
echo "sluice d0: $(sb $M "$G" 64)"; echo "llama.cpp d0: $(lb $M "-ngl 99" 64)"
el "gpu d0"
C="-t 16 --gpu off --experts resident"
for F in $M3 $M; do
  R=""; [ $F = $M3 ] && R="--repack 0"
  echo "cpu llama.cpp $(basename $F) $R: $(CUDA_VISIBLE_DEVICES= lb $F "-ngl 0 -t 16 $R" 32)"
  echo "cpu sluice $(basename $F): $(sb $F "$C" 32)"
  echo "cpu sluice $(basename $F): $(sb $F "$C" 32)"
  echo "cpu llama.cpp $(basename $F) $R: $(CUDA_VISIBLE_DEVICES= lb $F "-ngl 0 -t 16 $R" 32)"
  el "cpu $(basename $F)"
done
el "done"
tar -czf $OO/logs.tgz -C $O --exclude '*.npy' .
