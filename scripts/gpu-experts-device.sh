#!/bin/bash
# Issue 15 items 3-4 (h2, session 27; not run yet: the device was paused that session):
# --gpu-experts hybrid vs stage vs llama.cpp -ngl 99 --n-cpu-moe 6 (2 of 8 layers' experts in
# VRAM = 1/4) at the same VRAM bytes, on the 8-layer Qwen3-30B-A3B-shaped Q4_K synth (q30-8);
# first tests/gpu.rs's hybrid case (its all-GPU reference stages every expert through the
# default path).
# llama.cpp is built in the background (FlashAttention kernels off to fit the budget) unless
# a warm machine still has one; every bench runs after the build (the CPU is part of both).
#
# On the CPU machine: DIR (default target/devrun-h2, under the tree `run` copies) holds
# bins.tar.xz (stripped `sluice` and the tests/gpu.rs binary as `gpu-tests`, xz -9e) and
# llama-src.tar.xz (scripts/gpu-anchor.sh's header says how it is made). On the GPU machine:
# bash scripts/gpu-experts-device.sh DIR (carry DIR). Prints: the hybrid test's per-case
# figures, llama.cpp's CUDA buffer sizes and sluice's pool that matches them, then L S_h S_s
# S_s S_h L (pp512, tg128) and one `run` per mode with its [plan] and gpu: lines.
set -u
D=${1:-target/devrun-h2}; O=${OUT:-/tmp/h2out}; mkdir -p $O
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
LBIN=/tmp/llama/build/bin/llama-bench
LB=
if [ ! -x $LBIN ]; then
  ( mkdir -p /tmp/llama && tar -xJf $D/llama-src.tar.xz -C /tmp/llama && cd /tmp/llama && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_CUDA_FA=${FA:-OFF} -DLLAMA_CURL=OFF && cmake --build build --target llama-bench -j 16 ) > $O/llama-build.log 2>&1 &
  LB=$!
else el "llama-bench already built on this machine"; fi
xz -dc $D/bins.tar.xz | tar -xf - -C $D
export SLUICE_ROOT=$PWD
S=$D/sluice; M=/var/tmp/q30-8.gguf
SY=
if [ ! -s $M ]; then $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 & SY=$!; fi
timeout 150 $D/gpu-tests --test-threads=1 --nocapture gpu_hybrid_experts_match_all_gpu > $O/gpu.log 2>&1; el "gpu-tests rc $?"
grep -E "experts on the CPU|placements|^test |test result|panicked|no expert|err " $O/gpu.log | head -60
[ -n "$SY" ] && wait $SY; el "synth"; ls -la $M
[ -n "$LB" ] && wait $LB; el "llama build rc $?"; tail -1 $O/llama-build.log
F="--gpu on --experts resident -c 1024 -b 512"
# llama.cpp's VRAM at -ncmoe 6, from its own log; sluice's dense + KV + scratch from its [plan] line.
timeout 60 $LBIN -m $M -ngl 99 -ncmoe 6 -p 512 -n 128 -r 1 -v -o md > $O/llama-v.log 2>&1
grep -E "CUDA0.*buffer size|CUDA_Host.*buffer size|CPU.*buffer size" $O/llama-v.log | sort | uniq | head -12
grep -E "pp512|tg128" $O/llama-v.log
timeout 60 $S run $M -p hi -n 1 $F --vram 1G --gpu-experts stage 2> $O/probe.log >/dev/null
grep -E "\[plan\] gpu" $O/probe.log
V=$(python3 - $O/llama-v.log $O/probe.log <<'EOF'
import re, sys
l = open(sys.argv[1]).read(); p = open(sys.argv[2]).read()
best = {}
for kind, mib in re.findall(r'CUDA0 (\w+) buffer size =\s*([\d.]+) MiB', l):
    best[kind] = max(best.get(kind, 0.0), float(mib))
llama = sum(best.values()) * 2**20
m = re.search(r'dense weights ([\d.]+) GB, KV cache ([\d.]+) GB, scratch ([\d.]+) GB', p)
fixed = sum(float(x) for x in m.groups()) * 1e9
slot = float(re.search(r'slots/layer of ([\d.]+) MB', p).group(1)) * 1e6
every = float(re.search(r'of all experts \(([\d.]+) GB\)', p).group(1)) * 1e9
pool = llama - fixed
if not best or pool <= 8 * slot:
    # No llama.cpp figure (or a nonsensical one): a quarter of the experts.
    print(f"llama.cpp VRAM unreadable ({best}): the pool is a quarter of the experts", file=sys.stderr)
    pool = every / 4
print(f"llama.cpp VRAM {best} = {llama/1e9:.3f} GB; sluice fixed {fixed/1e9:.3f} GB; pool {pool/1e9:.3f} GB = {pool/slot/8:.1f} slots/layer of 128 ({100*pool/every:.0f}% of the experts)", file=sys.stderr)
print(int(pool))
EOF
)
el "vram for sluice's pool: $V"
sb() { timeout 90 $S bench $M -p 512 -n 128 -r 1 --run-flags "$F --vram $V --gpu-experts $1" 2>&1 | grep -E "^\| run|rror|failed"; }
lb() { timeout 60 $LBIN -m $M -ngl 99 -ncmoe 6 -p 512 -n 128 -r 2 -o md $@ 2>/dev/null | grep -E "pp512|tg128"; }
echo "== llama.cpp -ngl 99 -ncmoe 6"; lb
echo "== sluice hybrid"; sb hybrid
echo "== sluice stage"; sb stage
echo "== sluice stage"; sb stage
echo "== sluice hybrid"; sb hybrid
echo "== llama.cpp -ngl 99 -ncmoe 6"; lb
echo "== llama.cpp -ngl 99 -ncmoe 6 -mmp 0"; lb -mmp 0
el "benches done"
P=$(python3 -c "print(' '.join(['the quick brown fox jumps over the lazy dog and']*16))")
for m in hybrid stage; do echo "== sluice run --gpu-experts $m"; timeout 60 $S run $M -p "$P" -n 128 --temp 0 --ignore-eos $F --vram $V --gpu-experts $m 2>&1 >/dev/null | grep -E "\[plan\] gpu|\[timing\]|^gpu:"; done
el "done"
