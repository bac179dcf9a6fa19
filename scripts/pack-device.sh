#!/bin/bash
# Packs what a device call needs into DIR/bins.tar.xz (the device has no Rust and no `gguf`
# Python package): `sluice`, the library's unit tests and the test binaries of tests/gpu.rs,
# gpu_types.rs, kernels_tile.rs, kernels_ref.rs, kernels_iq.rs and kernels_iq_grid.rs built with --features cuda (stripped), and the pure-Python `gguf` package
# (py/gguf, for the fixture converters the GPU tests call). The binaries embed
# src/gpu/kernels.ptx, so a `run` call may leave that file behind (the carry limit counts the
# tree). Usage: bash scripts/pack-device.sh DIR
set -eu
D=${1:?DIR}; mkdir -p $D
cargo build --release --features cuda --bin sluice --tests >&2
T=$(mktemp -d); trap 'rm -rf $T' EXIT
newest() { ls -t target/release/deps/$1-* | grep -v '\.d$' | head -n 1; }
cp target/release/sluice $T/sluice
cp "$(newest gpu)" $T/gpu-tests; cp "$(newest gpu_types)" $T/gpu-types; cp "$(newest kernels_tile)" $T/kernels-tile
cp "$(newest kernels_ref)" $T/kernels-ref; cp "$(newest kernels_iq)" $T/kernels-iq; cp "$(newest kernels_iq_grid)" $T/kernels-iq-grid
# The library's own unit tests (the attention kernels' tests live there), for the device
# host's AVX-512, which this machine may lack.
cp "$(cargo test --release --features cuda --lib --no-run 2>&1 | sed -n 's/.*Executable .*(\(.*\)).*/\1/p' | head -n 1)" $T/lib-tests
strip $T/sluice $T/gpu-tests $T/gpu-types $T/kernels-tile $T/kernels-ref $T/kernels-iq $T/kernels-iq-grid $T/lib-tests
G=$(python3 -c "import gguf, os; print(os.path.dirname(gguf.__file__))")
mkdir -p $T/py && cp -r $G $T/py/gguf && find $T/py -name __pycache__ -prune -exec rm -rf {} +
tar -C $T -cf - sluice gpu-tests gpu-types kernels-tile kernels-ref kernels-iq kernels-iq-grid lib-tests py | xz -9e --lzma2=dict=128MiB -T2 > $D/bins.tar.xz.tmp
mv $D/bins.tar.xz.tmp $D/bins.tar.xz
ls -la $D/bins.tar.xz >&2
