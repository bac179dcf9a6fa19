#!/bin/bash
# Session 39, first device call (prepared in session 38) (issues 15, 16): every GPU test with the 1024-thread RMSNorm
# (add_rmsnorm_q8_w); its logits byte for byte against the 256-thread kernel
# (SLUICE_GPU_NORM_WIDE=0), decode and prefill batches; decode A B B A on/off; then, with
# llama.cpp's CUDA build (made meanwhile), the standing: host CPU at 16 threads (q30-8, ds3-2
# with llama.cpp's repack off) and GPU depth 0, L S S L; the kernel tests on the host's
# AVX-512 (the 16-token tiles' shared prologue of session 38 ran only on AVX2); and the streamed
# GPU run's expert reads against the disk's O_DIRECT ceiling in the same run (issue 15).
# DIR: bins.tar.xz (scripts/pack-device.sh), llama-src.tar.xz.
set -u
D=${1:-target/devrun-s39}; OO=${OUT:-/tmp/out}; O=/tmp/o1; mkdir -p $O $OO
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
chmod +x $V/kernels-* $V/lib-tests
for K in kernels-tile kernels-ref kernels-iq; do timeout 120 $V/$K > $O/$K.log 2>&1; el "$K rc $? $(grep 'test result' $O/$K.log | cut -c1-60)"; done
timeout 120 $V/lib-tests kernels:: > $O/lib.log 2>&1; el "lib-tests kernels:: rc $? $(grep 'test result' $O/lib.log | cut -c1-60)"
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
timeout 90 $S run $M --gpu on --experts stream --cap 16 --vram 300M -n 64 -c 512 -p "the quick brown fox jumps over the lazy dog" --temp 0 --prof 2>&1 | grep -E "^\[(experts|timing)" | cut -c1-330
el "done"
tar -czf $OO/logs.tgz -C $O --exclude '*.npy' .
