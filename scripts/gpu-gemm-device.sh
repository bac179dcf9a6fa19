#!/bin/bash
# The prefill GEMM on the GPU machine (issue 15 item 2): its tests, its TFLOP/s, warm prefill
# with the GEMM on and off, and `sluice bench` pp512/tg128 with the GEMM on and off.
#
# On the CPU machine:
#   cargo build --release --features cuda
#   cargo test --release --features cuda --no-run --test gpu_gemm   # prints the test binary
#   cp target/release/sluice <that binary> DIR/ (as DIR/sluice, DIR/gpu_gemm); strip DIR/*
# On the GPU machine, from the repository root: scripts/gpu-gemm-device.sh DIR [OUTDIR]
set -u
B=$1
O=${2:-${OUT:-/tmp/gpu-gemm}}
mkdir -p "$O"
export SLUICE_ROOT=$PWD
M=/var/tmp/q30-8.gguf
[ -f $M ] || "$B/sluice" synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > "$O/synth.log" 2>&1 &
SP=$!
timeout 150 "$B/gpu_gemm" --test-threads=1 --nocapture > "$O/gemm-tests.log" 2>&1
echo "gemm tests rc $?"
grep -E "^test |test result|worst|KL|panicked" "$O/gemm-tests.log"
timeout 60 "$B/gpu_gemm" --ignored gemm_tflops_report --nocapture 2>&1 | grep -E "TFLOP|panicked"
wait $SP
for b in 512 128; do for g in 1 0; do
  echo "warm prefill, batch $b, SLUICE_GPU_GEMM=$g"
  SLUICE_GEMM_MODEL=$M SLUICE_GEMM_BATCH=$b SLUICE_GPU_GEMM=$g timeout 100 "$B/gpu_gemm" --ignored prefill_report --nocapture 2>&1 | grep -E "^prefill|panicked"
done; done
for r in 1 2; do for g in 1 0; do
  echo "bench round $r, SLUICE_GPU_GEMM=$g"
  SLUICE_GPU_GEMM=$g timeout 100 "$B/sluice" bench $M -p 512 -n 128 -r 1 --run-flags "--gpu on --experts resident" 2>&1 | grep -E "pp512|tg128"
done; done
