#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (from the llama.cpp that the llama-cpp-python sdist vendors, the
# same sdist and CPU flags as scripts/build-llama-cpp.sh) into vendor-data/llama.cpp-server/, for
# scripts/serve_bench.py (the `serve --parallel N` against `llama-server -np N` benchmark in
# docs/PERFORMANCE.md). Not part of CI. Needs a C++ compiler and cmake (pip's).
# Idempotent: does nothing when the binary exists.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36
DEST=vendor-data
BUILD="$DEST/llama.cpp-server"
[[ -x "$BUILD/bin/llama-server" ]] && exit 0
command -v cmake >/dev/null || python3 -m pip install -q --disable-pip-version-check cmake

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 -m pip download -q --disable-pip-version-check --no-deps \
    --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$TMP"
SDIST="$TMP/llama_cpp_python-$VERSION.tar.gz"
[[ -f "$SDIST" ]] || { echo "build-llama-server: pip did not produce $SDIST" >&2; exit 1; }
ROOT="llama_cpp_python-$VERSION/vendor/llama.cpp"
tar -xzf "$SDIST" -C "$TMP" "$ROOT"
mkdir -p "$DEST"
cmake -S "$TMP/$ROOT" -B "$TMP/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=ON -DBUILD_SHARED_LIBS=OFF > "$TMP/cmake.log" 2>&1 \
    || { tail -20 "$TMP/cmake.log" >&2; exit 1; }
cmake --build "$TMP/build" --target llama-server -j "${JOBS:-$(nproc)}" \
    > "$TMP/build.log" 2>&1 || { tail -20 "$TMP/build.log" >&2; exit 1; }
rm -rf "$BUILD.tmp" && mkdir -p "$BUILD.tmp/bin"
cp "$TMP/build/bin/llama-server" "$BUILD.tmp/bin/"
rm -rf "$BUILD" && mv "$BUILD.tmp" "$BUILD"
echo "build-llama-server: llama-server in $BUILD/bin"
