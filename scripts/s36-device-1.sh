#!/bin/bash
# Session 36, first kernel call (issue 15): where the decode step's time goes, and the decode
# kernel's merge by the whole block. DIR holds bins.tar.xz (this tree, scripts/pack-device.sh)
# and base/sluice.xz (main at e0ebcb8, the anchor's binary). Runs: the attention and placement
# GPU tests of this tree; `sluice bench` B N N B per depth (16384, 4096, 0); the decode kernel
# with 32 and 16 splits (SLUICE_GPU_DEC_SPLITS) at 16384; Nsight Compute (if the machine has it)
# on the decode step's kernels at depth 16384 and 0; a partial-VRAM bench (a quarter of the
# experts in the pool). On the GPU machine: bash scripts/s36-device-1.sh DIR
set -u
D=${1:-target/devrun-s36}; OO=${OUT:-/tmp/out}; O=/tmp/o1; mkdir -p $O $OO
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s36; mkdir -p $V; N=$V/sluice; B=$V/sluice-base; M=/var/tmp/q30-8.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
mkdir -p /work/main/target/tmp 2>/dev/null  # the test binary's CARGO_TARGET_TMPDIR
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
xz -dc $D/bins.tar.xz | tar -xf - -C $V; xz -dc $D/base/sluice.xz > $B
chmod +x $V/sluice $V/gpu-tests $V/gpu-types $V/kernels-tile $B
[ -s $M ] || $N synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
[ -n "${SKIP_TESTS:-}" ] || timeout 200 $V/gpu-tests --test-threads=1 --nocapture tensor_core f16_cache placement long_run_matches > $O/gpu.log 2>&1; el "gpu-tests rc $?"
grep -E "^test |test result|panicked|FAILED|failed|stored as f16" $O/gpu.log | cut -c1-200 | head -30
wait $SY; el "synth"; ls -la $M
R="--gpu on --experts resident"
sb() { env $4 timeout 100 $1 bench $M -p 512 -n $2 $3 -r 1 --run-flags "$R ${5:-}" > $O/sb.log 2>&1; grep -hE "pp512|tg$2" $O/sb.log | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; grep -iE "error|panick" $O/sb.log | tail -n 1; echo; }
for d in 16384 4096 0; do
  a=""; [ $d = 0 ] || a="-d $d"
  echo "B d$d: $(sb $B 64 "$a" X=1)"; echo "N d$d: $(sb $N 64 "$a" X=1)"
  echo "N d$d: $(sb $N 64 "$a" X=1)"; echo "B d$d: $(sb $B 64 "$a" X=1)"
  el "depth $d"
done
for s in 32 16; do echo "N splits $s d16384: $(sb $N 64 "-d 16384" SLUICE_GPU_DEC_SPLITS=$s)"; done
el "splits"
echo "N partial VRAM stage: $(sb $N 64 "" X=1 "--vram 615M --gpu-experts stage")"
echo "N partial VRAM hybrid: $(sb $N 64 "" X=1 "--vram 615M --gpu-experts hybrid")"
grep -h "^\[plan\] gpu" $O/sb.log | cut -c1-200 | head -8
el "partial"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
echo "ncu: ${NCU:-none}"
if [ -n "$NCU" ]; then
  SEC="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats"
  timeout 150 $NCU --target-processes all -k regex:attention_mma_dec_h --launch-skip 40 --launch-count 2 $SEC \
    $N bench $M -p 16 -n 8 -d 16384 -r 1 --run-flags "$R" > $O/ncu-d16k.txt 2>&1; el "ncu d16k rc $?"
  grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Block Limit|Warp Cycles Per Issued|Stall|L2 Hit|Issued Ipc|One or More|No Eligible|Compute \(SM\)" $O/ncu-d16k.txt | head -60
  timeout 120 $NCU --target-processes all -k regex:"attention_mma_dec_h|add_rmsnorm_q8|router_route_jobs|moe_down_qs|moe_gate_up|mmq|qk_rope" --launch-skip 300 --launch-count 24 --section SpeedOfLight \
    $N bench $M -p 16 -n 16 -r 1 --run-flags "$R" > $O/ncu-d0.txt 2>&1; el "ncu d0 rc $?"
  grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput" $O/ncu-d0.txt | head -90
fi
tar -czf $OO/logs1.tgz -C $O .
