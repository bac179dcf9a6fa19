#!/bin/bash
# The GPU machine's script (it has CUDA but no Rust toolchain): takes binaries built on the CPU
# machine, runs the GPU tests and the staging benchmark, and prints a table last.
#
# On the CPU machine:
#   cargo build --release --features cuda
#   cargo test --release --features cuda --no-run --test gpu   # prints the test binary path
#   mkdir -p .devrun && cp target/release/sluice .devrun/sluice && cp <that path> .devrun/gpu-tests
#   (optionally tests/gpu_types.rs's binary as .devrun/gpu-types: its ignored bandwidth report)
#   strip .devrun/*
# On the GPU machine, from the repository root:
#   scripts/gpu-check.sh [.devrun] [OUTDIR]
set -u
BIN=${1:-.devrun}
OUTDIR=${2:-${OUT:-/tmp/gpu-check}}
mkdir -p "$OUTDIR"
export SLUICE_ROOT=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== GPU tests"
timeout 400 "$BIN/gpu-tests" --test-threads=1 --nocapture > "$OUTDIR/tests.log" 2>&1
echo "tests exit $?"
grep -E "^test |test result|panicked" "$OUTDIR/tests.log"
grep -E "worst|placements|KL" "$OUTDIR/tests.log" | head -40
if [ -x "$BIN/gpu-types" ]; then
  echo "== matvec bandwidth per GPU type (tests/gpu_types.rs, ignored in cargo test)"
  timeout 120 "$BIN/gpu-types" --ignored gpu_types_bandwidth_report --nocapture 2>&1 | grep -vE "^$|running|test result"
fi
echo "== benchmark"
M=/tmp/gpu-bench-model.gguf
[ -f $M ] || "$BIN/sluice" synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 > "$OUTDIR/synth.log" 2>&1
echo "== prefill and decode, GPU vs CPU (experts in RAM)"
P=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import gpu_bench; print(gpu_bench.PROMPT * 2)")
for g in on off; do
  "$BIN/sluice" run $M -p "$P" -n 16 --temp 0 --gpu $g --experts stream > /dev/null 2> "$OUTDIR/pp-$g.err"
  echo "--gpu $g: $(grep -h '^\[timing\]' "$OUTDIR/pp-$g.err")"
done
python3 scripts/gpu_bench.py "$BIN/sluice" $M "$OUTDIR/bench" "${@:3}" 2> "$OUTDIR/bench.err" | tee "$OUTDIR/table.md"
