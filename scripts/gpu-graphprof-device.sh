#!/bin/bash
# Device call (issue 15, session 26, first call): this branch's GPU tests, logits byte for byte
# (fused vs unfused, this binary vs the base binary), per-kernel times of the decode graph as it
# replays (SLUICE_GPU_PROFILE_GRAPH) at a short and a 3.5k-token context, a serialized per-kernel
# profile of a 512-token prefill forward, then `sluice bench` base / this / this / base.
#
# On the CPU machine (DIR = target/devrun-h1 under the tree `run` copies): this branch's
# `sluice` and `tests/gpu.rs` binaries and the base (main) `sluice`, stripped and xz'd as
# DIR/pair.tar.xz (sluice, sluice-base), DIR/gpu-tests.xz; DIR/gpu/ = src/gpu/kernels*.cu and
# kernels.ptx gzipped (the PTX test hashes them). On the GPU machine: bash DIR/THIS DIR
set -u
D=${1:-target/devrun-h1}; OO=${OUT:-/tmp/out}; O=/tmp/o; mkdir -p $O $OO
T0=$(date +%s)
el() { echo "$(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
B=/tmp/bin; mkdir -p $B
# The two sluice binaries come as one tarball (xz -9e, 192 MiB dictionary: the second costs
# little), to fit the carry limit.
[ -f $D/pair.tar.xz ] && xz -dc $D/pair.tar.xz | tar -xf - -C $B
for f in sluice sluice-base gpu-tests; do [ -f $D/$f.xz ] && xz -dc $D/$f.xz > $B/$f; chmod +x $B/$f; done
R=/tmp/root; mkdir -p $R/src && cp -r $D/gpu $R/src/gpu && gunzip -f $R/src/gpu/kernels.ptx.gz && ln -sfn $PWD/tests $R/tests
export SLUICE_ROOT=$R
S=$B/sluice; SB=$B/sluice-base
M=/var/tmp/q30-8.gguf
[ -f $M ] || $S synth $M --preset qwen3-30b-a3b --layers 8 --quant q4_k --skew 1.0 --seed 11 > $O/synth.log 2>&1 &
SY=$!
timeout 200 $B/gpu-tests --test-threads=1 --nocapture > $O/tests.log 2>&1; echo "gpu tests rc $? at $(el)"
grep -E "^test |test result|panicked" $O/tests.log | head -30
TK=$(seq -s, 1 40)
lg() { $1 logits $2 --tokens $TK -b $3 --gpu on $4 --out $5 > /dev/null 2> $5.err; }
for f in qwen3_moe olmoe deepseek_v3; do
  for b in 1 5; do
    SLUICE_GPU_FUSED=0 lg $S tests/fixtures/models/$f/model-q8_0.gguf $b "-c 128" /tmp/a.npy
    lg $S tests/fixtures/models/$f/model-q8_0.gguf $b "-c 128" /tmp/b.npy
    lg $SB tests/fixtures/models/$f/model-q8_0.gguf $b "-c 128" /tmp/c.npy
    cmp -s /tmp/a.npy /tmp/b.npy && x="fused == unfused" || x="FUSED != UNFUSED"
    cmp -s /tmp/b.npy /tmp/c.npy && y="this == base" || y="THIS != BASE"
    echo "logits $f -b $b: $x; $y"
  done
done
wait $SY; echo "model ready at $(el)"
for b in 1 7 512; do
  SLUICE_GPU_FUSED=0 lg $S $M $b "-c 1024 --experts resident" /tmp/a.npy
  lg $S $M $b "-c 1024 --experts resident" /tmp/b.npy
  lg $SB $M $b "-c 1024 --experts resident" /tmp/c.npy
  cmp -s /tmp/a.npy /tmp/b.npy && x="fused == unfused" || x="FUSED != UNFUSED ($(tail -1 /tmp/a.npy.err))"
  cmp -s /tmp/b.npy /tmp/c.npy && y="this == base" || y="THIS != BASE ($(tail -1 /tmp/b.npy.err))"
  echo "logits q30-8 -b $b: $x; $y"
done
F="--gpu on --experts resident"
P="The history of the lighthouse begins with fires lit on hills to guide ships home"
for q in 1 0; do
  SLUICE_GPU_Q6_STAGE=$q SLUICE_GPU_PROFILE_GRAPH=$O/gprof-q6s$q.tsv $S run $M -p "$P" -n 64 --temp 0 $F > $O/gp-$q.txt 2> $O/gp-$q.err
  echo "== graph profile, Q6 stage $q: $(grep -h '^\[timing\]' $O/gp-$q.err)"; head -16 $O/gprof-q6s$q.tsv
done
$SB run $M -p "$P" -n 64 --temp 0 $F > $O/gp-base.txt 2> $O/gp-base.err
cmp -s $O/gp-1.txt $O/gp-base.txt && echo "text this == base" || echo "TEXT THIS != BASE"
L=$(python3 -c "print(' '.join(['the quick brown fox jumps over the lazy dog and']*105))")
P5=$(python3 -c "print(' '.join(['the quick brown fox jumps over the lazy dog and']*46))")
SLUICE_GPU_PROFILE_GRAPH=$O/gprof-long.tsv timeout 90 $S run $M -p "$L" -n 64 -c 8192 -b 512 --temp 0 $F > $O/long.txt 2> $O/long.err
echo "== graph profile, 3.5k context: $(grep -h '^\[timing\]' $O/long.err)"; head -16 $O/gprof-long.tsv
SLUICE_GPU_PROFILE=$O/pprof.tsv timeout 90 $S run $M -p "$P5" -n 2 -b 512 --temp 0 $F > /dev/null 2> $O/pp.err
echo "== serialized profile, ~510-token prefill: $(grep -h '^\[timing\]' $O/pp.err)"; head -30 $O/pprof.tsv
echo "profiles done at $(el)"
sb() { $1 bench $M -p 512 -n 128 -r 1 --run-flags "$F" > $O/sb-$2.log 2>&1; echo "sluice $2: $(grep -hE 'pp512|tg128' $O/sb-$2.log | tr -s ' ' | tr '\n' ' ')"; }
sb $SB base1; sb $S this1; sb $S this2; sb $SB base2
for x in this base; do
  B2=$S; [ $x = base ] && B2=$SB
  timeout 90 $B2 run $M -p "$L" -n 64 -c 8192 -b 512 --temp 0 $F > $O/long-$x.txt 2> $O/long-$x.err
  echo "long $x: $(grep -h '^\[timing\]' $O/long-$x.err)"
done
cmp -s $O/long-this.txt $O/long-base.txt && echo "long text this == base" || echo "LONG TEXT THIS != BASE"
echo "total $(el)"
cp $O/gprof-*.tsv $O/pprof.tsv $OO/ 2>/dev/null
tar -czf $OO/logs.tgz -C $O .
