#!/usr/bin/env python3
"""Coverage fixtures for the table-driven kernels, dequantized by the `gguf` Python package.

The random blocks of make_quant_fixtures.py reach only part of the IQ2_XXS grid; these blocks
use every one of its 256 grid rows, all 128 sign indices and all 16 scales, and MXFP4 blocks
use every 4-bit code and the extreme exponents (0, 1, 2, 254, 255 included).

Writes tests/fixtures/iq/<NAME>.blocks (raw blocks) and <NAME>.f32 (little-endian float32 from
gguf.quants.dequantize). Deterministic.

Usage: python3 scripts/make_iq_fixtures.py [OUT_DIR]
"""
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "tests/fixtures/iq")


def iq2_xxs_grid():
    """8 blocks: sub-block k of group g of block b uses grid row 32b + 4g + k."""
    rng = np.random.default_rng(7)
    blocks = []
    for b in range(8):
        d = np.array([rng.uniform(1e-3, 0.1) * (1 if b % 2 else -1)], dtype="<f2").view(np.uint8)
        words = []
        for g in range(8):
            rows = [32 * b + 4 * g + k for k in range(4)]
            aux0 = sum(r << (8 * k) for k, r in enumerate(rows))
            signs = [(r * 5 + b) & 0x7F for r in rows]  # covers 0..127 across the blocks
            ls = (2 * g + b) & 0xF
            aux1 = sum(s << (7 * k) for k, s in enumerate(signs)) | (ls << 28)
            words += [aux0, aux1]
        blocks.append(np.concatenate([d, np.array(words, dtype="<u4").view(np.uint8)]))
    return T.IQ2_XXS, np.concatenate(blocks)


def mxfp4_codes():
    """16 blocks: every code in every nibble position, exponents spread over 0..255 (the largest
    overflow f32 for big codes: gguf gives inf there, and so must we)."""
    exps = [0, 1, 2, 3, 60, 100, 120, 126, 127, 128, 129, 140, 200, 250, 254, 255]
    blocks = []
    for i, e in enumerate(exps):
        lo = [(j + i) & 0xF for j in range(16)]
        hi = [(5 * j + i + 3) & 0xF for j in range(16)]
        qs = [l | (h << 4) for l, h in zip(lo, hi)]
        blocks.append(np.array([e] + qs, dtype=np.uint8))
    return T.MXFP4, np.concatenate(blocks)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for name, make in [("IQ2_XXS_grid", iq2_xxs_grid), ("MXFP4_codes", mxfp4_codes)]:
        t, raw = make()
        with np.errstate(over="ignore"):
            ref = dequantize(raw.reshape(1, -1), t).astype("<f4").reshape(-1)
        if name != "MXFP4_codes":  # exponents near 255 overflow to inf in gguf too, on purpose
            assert np.isfinite(ref).all(), name
        (OUT / f"{name}.blocks").write_bytes(raw.tobytes())
        (OUT / f"{name}.f32").write_bytes(ref.tobytes())
        print(f"{name}: {ref.size} elements")


if __name__ == "__main__":
    main()
