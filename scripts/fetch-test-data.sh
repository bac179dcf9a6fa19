#!/usr/bin/env bash
# Fetch reference data that is too big or not ours to commit, into vendor-data/ (git-ignored):
#   vendor-data/vocab/ggml-vocab-*.gguf          llama.cpp's vocabulary-only GGUF files
#   vendor-data/vocab/ggml-vocab-*.gguf.inp/.out  its tokenizer test strings and expected ids
#                                                 (ids produced by the models' HF tokenizers)
#   vendor-data/templates/*.jinja                 real chat templates collected by llama.cpp
# Source: the llama-cpp-python sdist (it vendors llama.cpp), fetched with pip.
# Idempotent: does nothing when the stamp matches.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36
DEST=vendor-data
STAMP="$DEST/.llama-cpp-python-$VERSION"

if [[ -f "$STAMP" ]]; then
    exit 0
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# --no-binary for this package only: build dependencies (cmake, ...) may come as wheels, so pip
# can prepare the sdist's metadata without compiling cmake from source.
python3 -m pip download -q --disable-pip-version-check --no-deps \
    --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$TMP"
SDIST="$TMP/llama_cpp_python-$VERSION.tar.gz"
[[ -f "$SDIST" ]] || { echo "fetch-test-data: pip did not produce $SDIST" >&2; exit 1; }

ROOT="llama_cpp_python-$VERSION/vendor/llama.cpp"
tar -xzf "$SDIST" -C "$TMP" --wildcards "$ROOT/models/ggml-vocab-*" "$ROOT/models/templates/*"

mkdir -p "$DEST/vocab" "$DEST/templates"
cp "$TMP/$ROOT"/models/ggml-vocab-* "$DEST/vocab/"
cp "$TMP/$ROOT"/models/templates/*.jinja "$DEST/templates/"
touch "$STAMP"
echo "fetch-test-data: $(ls "$DEST/vocab" | wc -l) vocabulary files, $(ls "$DEST/templates" | wc -l) templates in $DEST/"
