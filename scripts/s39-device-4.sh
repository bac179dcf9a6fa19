#!/bin/bash
# (The SLUICE_GPU_ROUTER variants it measured were taken out after this call: docs/PERFORMANCE.md
# "The router kernel's one-token variants", session 39.)
# Session 39, fourth device call (issue 15, decode at depth 0): the router kernel's variants
# (SLUICE_GPU_ROUTER bits: 1 = router_row1, all of a lane's loads in flight; 2 = the softmax's
# logits read once into registers; the same bits) — their logits byte for byte against the old
# path, each variant's own duration in Nsight Compute (no cache flush, PDL and graphs off), the
# step's kernels by grid size, a source-level sample of the router kernel, and decode A B B A.
# DIR: bins.tar.xz (scripts/pack-device.sh).
set -u
D=${1:-target/devrun-s39b}; OO=${OUT:-/tmp/out}; O=/tmp/o4; mkdir -p $O $OO
exec > >(tee $OO/out.txt) 2>&1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
V=/var/tmp/s39; mkdir -p $V; S=$V/sluice
M=/var/tmp/q30-8.gguf
export SLUICE_ROOT=$PWD PYTHONPATH=$V/py
mkdir -p /work/main/target/tmp 2>/dev/null
xz -dc $D/bins.tar.xz | tar -xf - -C $V; chmod +x $S $V/gpu-tests
[ -s $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1
el "synth"
TOK=$(seq -s, 100 140)
for b in 1 41; do
  for r in 0 3; do SLUICE_GPU_ROUTER=$r timeout 100 $S logits $M --tokens $TOK --out $O/l-b$b-r$r.npy -b $b --gpu on --experts resident -c 256 > $O/logits-b$b-r$r.log 2>&1 || tail -n 2 $O/logits-b$b-r$r.log; done
  cmp $O/l-b$b-r0.npy $O/l-b$b-r3.npy && echo "logits -b $b: ROUTER=3 == ROUTER=0, byte for byte ($(stat -c %s $O/l-b$b-r0.npy) bytes)"
done
SLUICE_GPU_ROUTER=3 timeout 150 $V/gpu-tests --test-threads=1 gpu_tokens_identical_across_placement gpu_logits_match_transformers > $O/gpu.log 2>&1; el "gpu-tests (ROUTER=3) rc $? $(grep 'test result' $O/gpu.log | cut -c1-60)"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
ncu_t() { awk '/^  [a-zA-Z_0-9]+ \(/{k=$1} /launch__grid_size/{g=$NF} /gpu__time_duration.sum/{v=$NF; if ($(NF-1)=="ms") v*=1000; if ($(NF-1)=="ns"||$(NF-1)=="nsecond") v/=1000; print k"@"g, v}' $1 \
  | awk '{s[$1]+=$2; c[$1]++; t+=$2} END{for(k in s) printf "%-44s n=%3d mean %7.2f us total %8.1f\n", k, c[k], s[k]/c[k], s[k]; printf "all %.1f us over %d launches\n", t, NR}' | sort -k6 -g -r | head -${2:-30}; }
for e in SLUICE_GPU_ROUTER=0 SLUICE_GPU_ROUTER=1 SLUICE_GPU_ROUTER=2 SLUICE_GPU_ROUTER=3 SLUICE_GPU_JOBS1=1 "SLUICE_GPU_JOBS1=1 SLUICE_GPU_ROUTER=3"; do
  env $e SLUICE_GPU_PDL=0 SLUICE_GPU_GRAPH=0 timeout 100 $NCU --clock-control none --cache-control none -k regex:router_route_jobs --launch-skip 200 --launch-count 80 --metrics gpu__time_duration.sum,launch__grid_size \
    $S run $M -p "hello there" -n 40 --gpu on --experts resident -c 4096 > $O/ncu-r.txt 2>&1
  echo "router $e: $(ncu_t $O/ncu-r.txt 1)"
done
el "router variants"
SLUICE_GPU_PDL=0 SLUICE_GPU_GRAPH=0 timeout 150 $NCU --clock-control none --cache-control none --launch-skip 1500 --launch-count 750 --metrics gpu__time_duration.sum,launch__grid_size \
  $S run $M -p "hello there" -n 40 --gpu on --experts resident -c 4096 > $O/ncu-d0.txt 2>&1; el "ncu d0 rc $?"
ncu_t $O/ncu-d0.txt 30
SLUICE_GPU_PDL=0 SLUICE_GPU_GRAPH=0 timeout 120 $NCU --clock-control none --cache-control none -k regex:router_route_jobs --launch-skip 200 --launch-count 1 --section SourceCounters --section WarpStateStats \
  --page source --print-source sass --csv $S run $M -p "hello there" -n 40 --gpu on --experts resident -c 4096 > $OO/router-sass.csv 2> $O/ncu-src.err; el "ncu source rc $? $(wc -l < $OO/router-sass.csv) lines"
tail -n 3 $O/ncu-src.err
for r in 0 3 3 0; do echo "decode ROUTER=$r: $(SLUICE_GPU_ROUTER=$r timeout 100 $S bench $M -p 512 -n 64 -r 1 --run-flags "--gpu on --experts resident" 2>&1 | grep -E "pp512|tg64" | tr -s ' ' | cut -d'|' -f4,5 | tr '\n' ' ')"; done
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|MHz|L2|L3|NUMA node\(s\)" | tr -s ' '
M3=/var/tmp/ds3-2.gguf; LBIN=/var/tmp/llama/build/bin/llama-bench
[ -s $M3 ] || timeout 120 $S synth $M3 --preset deepseek-v3 --layers 2 --quant q4_k --no-mtp --seed 11 > $O/synth3.log 2>&1
for t in 16 8 16 8; do
  echo "ds3-2 pp512 t$t: sluice $(timeout 100 $S bench $M3 -p 512 -n 0 -r 1 --run-flags "-t $t --gpu off --experts resident" 2>&1 | grep pp512 | tr -s ' ' | cut -d'|' -f5) llama.cpp $([ -x $LBIN ] && CUDA_VISIBLE_DEVICES= timeout 100 $LBIN -m $M3 -ngl 0 -t $t --repack 0 -p 512 -n 0 -r 1 -o md 2>/dev/null | grep pp512 | tr -s ' ' | awk -F'|' '{print $(NF-1)}')"
done
el "done"
tar -czf $OO/logs.tgz -C $O --exclude '*.npy' .
