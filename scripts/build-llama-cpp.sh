#!/usr/bin/env bash
# Build llama.cpp's `llama-simple`, `llama-quantize` and `llama-imatrix` (from the llama.cpp that the
# llama-cpp-python sdist vendors), plus scripts/llama-logits.cpp against its libllama, into
# vendor-data/llama.cpp-build/, so tests can check that sluice's synthetic GGUFs load and run in
# llama.cpp itself (tests/synth_archs.rs), and compare sluice's logits with llama.cpp's on files
# llama-quantize wrote (tests/llama_quant_e2e.rs). Needs a C++ compiler and cmake (pip's).
# CPU backend with AVX2 and no native tuning: on machines with AMX, a native build of this
# llama.cpp version crashes on quantized models (its own converted fixtures too).
# Idempotent: does nothing when all four binaries exist.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36
DEST=vendor-data
BUILD="$DEST/llama.cpp-build"
BINS=(llama-simple llama-quantize llama-imatrix llama-logits)
have=1
for b in "${BINS[@]}"; do [[ -x "$BUILD/bin/$b" ]] || have=0; done
[[ $have == 1 ]] && exit 0
command -v cmake >/dev/null || python3 -m pip install -q --disable-pip-version-check cmake

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 -m pip download -q --disable-pip-version-check --no-deps \
    --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$TMP"
SDIST="$TMP/llama_cpp_python-$VERSION.tar.gz"
[[ -f "$SDIST" ]] || { echo "build-llama-cpp: pip did not produce $SDIST" >&2; exit 1; }
ROOT="llama_cpp_python-$VERSION/vendor/llama.cpp"
tar -xzf "$SDIST" -C "$TMP" "$ROOT"
mkdir -p "$DEST"
cmake -S "$TMP/$ROOT" -B "$TMP/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF > "$TMP/cmake.log" 2>&1 \
    || { tail -20 "$TMP/cmake.log" >&2; exit 1; }
# One build of the libraries for all four (llama-quantize and llama-imatrix add a few sources).
cmake --build "$TMP/build" --target llama-simple llama-quantize llama-imatrix llama -j "$(nproc)" \
    > "$TMP/build.log" 2>&1 || { tail -20 "$TMP/build.log" >&2; exit 1; }
# llama-logits: link the static libllama/ggml the build made (ggml-cpu uses OpenMP if found).
LIBS=$(find "$TMP/build" -name 'libllama.a' -o -name 'libggml*.a' | sort -r | tr '\n' ' ')
${CXX:-c++} -O2 -std=c++17 -I "$TMP/$ROOT/include" -I "$TMP/$ROOT/ggml/include" \
    scripts/llama-logits.cpp -o "$TMP/build/bin/llama-logits" \
    -Wl,--start-group $LIBS -Wl,--end-group -fopenmp -lpthread -ldl -lm \
    > "$TMP/logits.log" 2>&1 || { tail -20 "$TMP/logits.log" >&2; exit 1; }
rm -rf "$BUILD.tmp" && mkdir -p "$BUILD.tmp/bin"
for b in "${BINS[@]}"; do cp "$TMP/build/bin/$b" "$BUILD.tmp/bin/"; done
rm -rf "$BUILD" && mv "$BUILD.tmp" "$BUILD"
echo "build-llama-cpp: ${BINS[*]} in $BUILD/bin"
