#!/bin/bash
# Session 38, fourth device call (issues 15, 16): the matmul's weight tile size at 16 threads
# on the DeepSeek-V3-shaped prefill (SLUICE_TILE_KB, A B B A), the one-token job list by the
# routing warp against the block's (SLUICE_GPU_JOBS1, A B B A), and Nsight Compute's stall
# sections for the two slowest decode kernels (router_route_jobs, add_rmsnorm_q8).
# DIR: bins.tar.xz.
set -u
D=${1:-target/devrun-s38b}; OO=${OUT:-/tmp/out}; O=/tmp/o4; mkdir -p $O $OO
exec > >(tee $OO/out.txt) 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s38; mkdir -p $V; S=$V/sluice
M=/var/tmp/q30-8.gguf; M3=/var/tmp/ds3-2.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $S
( [ -s $M3 ] || $S synth $M3 --preset deepseek-v3 --layers 2 --quant q4_k --no-mtp --seed 11
  [ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 ) > $O/synth.log 2>&1
el "synth"
sb() { env $2 timeout 150 $S bench $M3 -p 512 -n 0 -r 1 --run-flags "-t $1 --gpu off --experts resident" 2>&1 | grep -hE "pp512" | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' '; echo; }
for kb in 64 512 512 64 2048 256; do echo "ds3-2 t16 tile ${kb}K: $(sb 16 SLUICE_TILE_KB=$kb)"; done
el "tile"
gb() { env $1 timeout 100 $S bench $M -p 512 -n 64 -r 1 --run-flags "--gpu on --experts resident" 2>&1 | grep -E "tg64" | tr -s ' ' | cut -d'|' -f4,5; }
for j in 0 1 1 0; do echo "decode JOBS1=$j: $(gb SLUICE_GPU_JOBS1=$j)"; done
el "jobs1"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
SLUICE_GPU_PDL=0 SLUICE_GPU_GRAPH=0 timeout 200 $NCU --clock-control none -k regex:"router_route_jobs|add_rmsnorm_q8" --launch-skip 60 --launch-count 6 \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  $S run $M -p "hello there" -n 16 --gpu on --experts resident -c 4096 > $O/ncu-k.txt 2>&1; el "ncu rc $?"
grep -vE "^ *----|^$" $O/ncu-k.txt | grep -E "router_route_jobs|add_rmsnorm_q8|Duration|Elapsed Cycles|SM Frequency|Stall|Warp Cycles Per Issued|Issued Warp|Active Warps|Block Size|Grid Size|Registers|Shared Memory Config|Dynamic Shared|Achieved Occupancy|Memory Throughput|DRAM Throughput|L2 Hit|One or More|No Eligible|OPT|WRN" | cut -c1-160 | head -150
el "done"
tar -czf $OO/logs.tgz -C $O .
