#!/bin/bash
# Session 39, closing device call (issues 15, 16, 17): the new AVX-512 four-row dots (grid
# i-quants, IQ1_S/IQ1_M, TQ1_0/TQ2_0) and every kernel test on the host's AVX-512; the grid
# types' matvec at batch 1 and 4 against the old binary; the host CPU at 16 threads on ds3-2 and
# q30-8 against llama.cpp (L S S L) and the activation-buffer prefault against the old binary
# (A B B A); then three SSD-streamed GPU runs against the disk's O_DIRECT ceiling.
# DIR: bins.tar.xz (scripts/pack-device.sh), sluice-old.xz (main before this session's CPU
# changes), llama-src.tar.xz.
set -u
D=${1:-target/devrun-s39c}; OO=${OUT:-/tmp/out}; O=/tmp/o5; mkdir -p $O $OO
exec > >(tee $OO/out.txt) 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s39c; mkdir -p $V; S=$V/sluice; SO=$V/sluice-old
M=/var/tmp/q30-8.gguf; M3=/var/tmp/ds3-2.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
mkdir -p /work/main/target/tmp 2>/dev/null
L=/var/tmp/llama; LBIN=$L/build/bin/llama-bench
( [ -x $LBIN ] || ( mkdir -p $L && tar -xJf $D/llama-src.tar.xz -C $L && cd $L && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 12 ) > $O/llama-build.log 2>&1 ) &
LB=$!
xz -dc $D/bins.tar.xz | tar -xf - -C $V; xz -dc $D/sluice-old.xz > $SO; chmod +x $S $SO $V/kernels-* $V/lib-tests
( [ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11
  [ -s $M3 ] || $S synth $M3 --preset deepseek-v3 --layers 2 --quant q4_k --no-mtp --seed 11 ) > $O/synth.log 2>&1 &
SY=$!
grep -o -w -E 'avx512(f|bw|vl|vnni|vbmi|bitalg)' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
for K in kernels-tile kernels-ref kernels-iq kernels-iq-grid; do timeout 150 $V/$K > $O/$K.log 2>&1; el "$K rc $? $(grep 'test result' $O/$K.log | cut -c1-60)"; grep -E "panicked|FAILED" $O/$K.log | head -5; done
timeout 120 $V/lib-tests kernels:: > $O/lib.log 2>&1; el "lib-tests kernels:: rc $? $(grep 'test result' $O/lib.log | cut -c1-60)"
types=IQ2_XXS,IQ2_XS,IQ2_S,IQ3_XXS,IQ3_S,IQ1_S,IQ1_M,TQ1_0,TQ2_0
for batch in 1 4; do
  for b in $SO $S $S $SO; do
    echo "batch $batch $(basename $b): $(timeout 60 $b bench --kernels --threads 1 --mb 1 --reps 9 --batch $batch --types $types 2>&1 | tail -n 9 | awk '{printf "%s %s %s; ", $1, $2, $5}')"
  done
done
el "kernel bench"
wait $SY; el "synth"
sb() { timeout 150 $1 bench $2 -p 512 -n $4 -r 1 --run-flags "$3" > $O/sb.log 2>&1; grep -hE "pp512|tg$4" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
C="-t 16 --gpu off --experts resident"
for b in $SO $S $S $SO; do echo "ds3-2 pp512 t16 $(basename $b): $(sb $b $M3 "$C" 0)"; done
el "prefault A/B"
wait $LB; el "llama build"; tail -n 1 $O/llama-build.log
lb() { timeout 150 $LBIN -m $1 $2 -p 512 -n $3 -r 1 -o md 2>/dev/null | grep -E "pp512|tg$3" | tr -s ' ' | awk -F'|' '{printf "%s %s;", $(NF-2), $(NF-1)}'; echo; }
for F in $M3 $M; do
  R=""; [ $F = $M3 ] && R="--repack 0"
  echo "cpu llama.cpp $(basename $F) $R: $(CUDA_VISIBLE_DEVICES= lb $F "-ngl 0 -t 16 $R" 32)"
  echo "cpu sluice $(basename $F): $(sb $S $F "$C" 32)"
  echo "cpu sluice $(basename $F): $(sb $S $F "$C" 32)"
  echo "cpu llama.cpp $(basename $F) $R: $(CUDA_VISIBLE_DEVICES= lb $F "-ngl 0 -t 16 $R" 32)"
  el "cpu $(basename $F)"
done
G="--gpu on --experts resident"
echo "llama.cpp d0: $(lb $M "-ngl 99" 64)"; echo "sluice d0: $(sb $S $M "$G" 64)"
echo "sluice d0: $(sb $S $M "$G" 64)"; echo "llama.cpp d0: $(lb $M "-ngl 99" 64)"
el "gpu d0"
timeout 150 $S doctor --refresh $M 2>&1 | grep -E "disk ceiling|direct 1.0 MiB x1 |direct 2.5 MiB x1 "
for i in 1 2 3; do
  sync; echo 3 > /proc/sys/vm/drop_caches
  timeout 90 $S run $M --gpu on --experts stream --cap 16 --vram 300M -n 64 -c 512 -p "the quick brown fox jumps over the lazy dog" --temp 0 2>&1 | grep -E "^\[experts\] (decode|bound at)" | cut -c1-330
done
el "done"
tar -czf $OO/logs.tgz -C $O .
