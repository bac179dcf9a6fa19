#!/usr/bin/env python3
"""Fetch llama.cpp's HF->GGUF converter from the llama-cpp-python sdist on PyPI.

Downloads llama_cpp_python-VERSION.tar.gz with pip (source distribution only, no build) and
extracts from its vendor/llama.cpp/ the converter (convert_hf_to_gguf.py, conversion/), the
gguf-py package it imports, models/templates/ (chat templates, used as data) and LICENSE into
vendor-data/llama.cpp/ (git-ignored). Nothing is built.

Usage: python3 scripts/fetch_llama_cpp_converter.py [--version 0.3.36] [--dest vendor-data/llama.cpp]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/", "LICENSE")
# sha256 of the sdist the committed fixtures were made from
KNOWN_SHA256 = {"0.3.36": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--version", default="0.3.36")
    ap.add_argument("--dest", default=str(REPO / "vendor-data" / "llama.cpp"))
    ap.add_argument("--sdist", help="use this already downloaded llama_cpp_python-*.tar.gz")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.sdist:
            sdist = Path(args.sdist)
        else:
            # only llama-cpp-python itself as source: its build requirements may come as wheels
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                            "llama-cpp-python", f"llama-cpp-python=={args.version}", "-d", tmp], check=True)
            sdist = Path(tmp) / f"llama_cpp_python-{args.version}.tar.gz"
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        want = KNOWN_SHA256.get(args.version)
        print(f"{sdist.name} sha256 {digest}")
        if want and digest != want:
            raise SystemExit(f"sha256 mismatch for {sdist.name}: got {digest}, expected {want}")
        dest = Path(args.dest)
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        prefix = f"llama_cpp_python-{args.version}/vendor/llama.cpp/"
        n = 0
        with tarfile.open(sdist) as tf:
            for m in tf.getmembers():
                if not m.name.startswith(prefix) or not m.isfile():
                    continue
                rel = m.name[len(prefix):]
                if not any(rel == k or (k.endswith("/") and rel.startswith(k)) for k in KEEP):
                    continue
                out = dest / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                src = tf.extractfile(m)
                if src is None:
                    continue
                out.write_bytes(src.read())
                n += 1
        (dest / "SOURCE.txt").write_text(f"llama-cpp-python {args.version} sdist, sha256 {digest}\n")
        print(f"extracted {n} files into {dest}")


if __name__ == "__main__":
    main()
