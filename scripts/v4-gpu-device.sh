#!/bin/bash
# DeepSeek-V4 on the GPU machine (it has CUDA but no Rust toolchain and no gguf package): the
# tests/gpu.rs `deepseek_v4` cases, then a 4-layer deepseek-v4-flash synth (15.4 GB, MXFP4
# experts; ~95 s to write there) benched resident, GPU against the CPU at 16 threads.
#
# On the CPU machine (DIR under target/, passed to `run` as carry):
#   cargo build --release --features cuda
#   cargo test --release --features cuda --no-run --test gpu     # prints the test binary path
#   mkdir -p DIR/pack DIR/gguf && cp target/release/sluice DIR/pack/ && cp <that path> DIR/pack/gpu-tests
#   strip DIR/pack/* && tar cJf DIR/bin.tar.xz -C DIR/pack sluice gpu-tests && rm -r DIR/pack
#   for e in f32 mxfp4 mxfp4-f32; do python3 scripts/deepseek_v4_to_gguf.py \
#     tests/fixtures/models/deepseek_v4 DIR/gguf/deepseek_v4-$e.gguf $([ $e = f32 ] || echo --experts $e); done
# On the GPU machine, from the repository root:
#   scripts/v4-gpu-device.sh DIR
set -u
D=${1:?usage: scripts/v4-gpu-device.sh DIR}
O=${OUT:-/tmp/v4-gpu}
mkdir -p "$O"
[ -x "$D/sluice" ] || tar xJf "$D/bin.tar.xz" -C "$D"
export SLUICE_ROOT=$PWD SLUICE_GGUF_DIR=$PWD/$D/gguf
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
T0=$(date +%s)
timeout 90 "$D/gpu-tests" --test-threads=1 --nocapture deepseek_v4 > "$O/tests.log" 2>&1
echo "tests exit $? in $(( $(date +%s) - T0 ))s"
grep -E "^test |test result|panicked|Δ|greedy" "$O/tests.log" | head -40
M=/tmp/v4flash4.gguf
T1=$(date +%s)
[ -f $M ] || timeout 200 "$D/sluice" synth $M --preset deepseek-v4-flash --layers 4 --seed 1 > "$O/synth.log" 2>&1
echo "synth exit $? in $(( $(date +%s) - T1 ))s"; ls -la $M || exit 1
for arm in "--gpu on" "--gpu off -t 16"; do
  T2=$(date +%s)
  timeout 150 "$D/sluice" bench $M -p 256 -n 64 -r 1 --run-flags "--experts resident $arm" > "$O/bench.log" 2>&1
  echo "bench [$arm] exit $? in $(( $(date +%s) - T2 ))s"; grep -vE "^\s*$" "$O/bench.log" | tail -8
done
