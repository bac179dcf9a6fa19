#!/bin/bash
# Issue 16, 2 threads, RAM-resident: sluice against llama.cpp's native (AVX-512) CPU build on the
# same files, interleaved L S S L, the 1-minute load average beside each figure. For the quiet
# machine (all helpers stopped): about 6 minutes with the Q8_0 file, 3 without.
#
#   scripts/cpu-tg2-quiet.sh [SLUICE] [q8]
#
# SLUICE: the binary (default target/release/sluice). "q8" also synthesizes a 4-layer Q8_0
# Qwen3-30B-A3B-shaped file (3.4 GB, under the 4 GB limit for /tmp files; 8 layers would be
# ~6 GB), measures it, and deletes it. llama.cpp: /tmp/llsrc/build-cpu (0.3.36 sources,
# -DGGML_NATIVE=ON; CPU repacking on, its default).
set -u
S=${1:-target/release/sluice}
LB=/tmp/llsrc/build-cpu/bin/llama-bench
ld() { cut -d' ' -f1 /proc/loadavg; }
L() { # file
    echo "llama.cpp (load $(ld)): $($LB -m "$1" -t 2 -p 512 -n 128 -r 1 2>/dev/null |
        awk -F'|' '/pp512|tg128/ {printf "%s %s  ", $(NF-2), $(NF-1)}')"
}
SL() { # file: pp512 as llama-bench's (an empty cache, one 512-token batch), then tg128 from one token
    local pp tg
    pp=$($S bench "$1" -p 512 -n 1 -r 1 --run-flags "-t 2 --experts resident" 2>&1 | awk -F'|' '/pp512/ {print $(NF-5)}')
    tg=$($S bench "$1" -p 1 -n 128 -r 1 --run-flags "-t 2 --experts resident" 2>&1 | awk -F'|' '/tg128/ {print $(NF-5)}')
    echo "sluice    (load $(ld)): pp512 $pp  tg128 $tg"
}
round() { echo "== $1"; L "$1"; SL "$1"; SL "$1"; L "$1"; }
round /tmp/q30-8.gguf
if [ "${2:-}" = q8 ]; then
    Q8=/tmp/q30-4-q8.gguf
    $S synth $Q8 --preset qwen3-30b-a3b --layers 4 --quant q8_0 --skew 1.0 --seed 11 >/dev/null 2>&1
    round $Q8
    rm -f $Q8
fi
for isa in avx512 avx2; do
    echo "== matvec at 2 threads, $isa (load $(ld))"
    $S bench --kernels --threads 2 --mb 256 --reps 5 --isa $isa --types Q4_K,Q8_0 2>&1 | tail -2
done
