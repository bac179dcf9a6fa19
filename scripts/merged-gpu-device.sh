#!/bin/bash
# Device call after merging the GPU branches: the GPU test binaries of this tree, then gpt-oss-20b
# (4 layers, MXFP4 experts) CPU vs GPU, resident, decode and prefill.
# On the CPU machine: cargo build --release --features cuda; cargo test --release --features cuda
#   --no-run --test gpu --test gpu_types; copy sluice, the two test binaries (as gpu-tests,
#   gpu-types-tests) into DIR, strip, xz.
set -u
D=${1:-target/devrun-main}; O=${OUT:-/tmp/out}; mkdir -p $O
# The device has no gguf package: the gpt-oss GGUFs (scripts/gptoss_to_gguf.py of the fixture)
# travel in DIR/gguf.
export SLUICE_ROOT=$PWD SLUICE_GGUF_DIR=$PWD/$D/gguf
for f in $D/*.xz; do xz -d $f; done; chmod +x $D/*
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
timeout 150 $D/gpu-tests --test-threads=1 > $O/gpu.log 2>&1; el "gpu-tests rc $?"
grep -E "^test |test result|panicked" $O/gpu.log | head -20
timeout 100 $D/gpu-types-tests --test-threads=1 > $O/gpu-types.log 2>&1; el "gpu-types rc $?"
grep -E "^test |test result|panicked" $O/gpu-types.log | head -10
M=/var/tmp/goss20-4.gguf
[ "${SKIP_BENCH:-}" = 1 ] && exit 0
$D/sluice synth $M --preset gpt-oss-20b --layers 4 --skew 1.0 --seed 11 > $O/synth.log 2>&1; el "synth rc $?"
P="The history of the lighthouse begins with the earliest fires lit on hills near harbours"
for a in "--gpu off -t 16" "--gpu on"; do
  timeout 60 $D/sluice bench $M -p 256 -n 64 -r 1 --run-flags "--experts resident $a" > $O/b.log 2>&1
  echo "== $a"; grep -E "^\| run" $O/b.log
  timeout 60 $D/sluice run $M -p "$P" -n 24 --temp 0 --ignore-eos --experts resident $a 2>&1 >/dev/null | grep -E "timing|gpu:" | tail -2
  el "$a done"
done
