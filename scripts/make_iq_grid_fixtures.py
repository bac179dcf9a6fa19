#!/usr/bin/env python3
"""Fixture blocks of IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M, dequantized by the `gguf`
Python package (gguf.quants.dequantize, llama.cpp's reference in numpy).

Each type's blocks use every row of its grid once (a random permutation of the rows; IQ1_M
shares IQ1_S's grid and uses a random quarter of it), with random f16 scales in [1e-3, 0.1)
of either sign, random sub-block scales, sign bits and IQ1 deltas. So dequantizing them
bit-identically also proves src/kernels/iq_grids.rs equals gguf's grids.

Writes tests/fixtures/iq_grid/<TYPE>.blocks (raw blocks) and <TYPE>.f32 (little-endian
float32). Deterministic (fixed seed).

Usage: python3 scripts/make_iq_grid_fixtures.py [OUT_DIR]
"""
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "tests/fixtures/iq_grid")

rng = np.random.default_rng(20261203)


def f16(n):
    """n little-endian f16 values uniform in [1e-3, 0.1), random sign, as (n, 2) bytes."""
    v = rng.uniform(1e-3, 0.1, n) * rng.choice([-1.0, 1.0], n)
    return v.astype("<f2").view(np.uint8).reshape(n, 2)


def rows_for(n_rows, n_blocks, per_block):
    """Grid row of each slot: every row once (then random rows if there are more slots)."""
    need = n_blocks * per_block
    idx = rng.permutation(n_rows)
    if need > n_rows:
        idx = np.concatenate([idx, rng.integers(0, n_rows, need - n_rows)])
    return idx[:need].reshape(n_blocks, per_block)


def u8(nb, n):
    return rng.integers(0, 256, size=(nb, n), dtype=np.uint8)


def iq2_xs():  # d, qs[32] u16 (9-bit row | 7-bit sign index << 9), scales[8]
    nb = 16
    rows = rows_for(512, nb, 32).astype(np.uint16)
    qs = rows | (rng.integers(0, 128, size=(nb, 32), dtype=np.uint16) << 9)
    return np.concatenate([f16(nb), qs.astype("<u2").view(np.uint8), u8(nb, 8)], axis=1)


def iq2_s():  # d, qs[32] (low 8 bits of row), signs[32], qh[8] (2 high bits per row), scales[8]
    nb = 32
    rows = rows_for(1024, nb, 32)
    qh = np.zeros((nb, 8), dtype=np.uint8)
    for i in range(32):
        qh[:, i // 4] |= ((rows[:, i] >> 8) << (2 * (i % 4))).astype(np.uint8)
    return np.concatenate([f16(nb), (rows & 0xFF).astype(np.uint8), u8(nb, 32), qh, u8(nb, 8)], axis=1)


def iq3_xxs():  # d, qs[64] (row per 4 elements), 8 x u32 (4 x 7-bit sign index | scale << 28)
    nb = 8
    rows = rows_for(256, nb, 64)
    words = rng.integers(0, 1 << 32, size=(nb, 8), dtype=np.uint64).astype("<u4")
    return np.concatenate([f16(nb), rows.astype(np.uint8), words.view(np.uint8)], axis=1)


def iq3_s():  # d, qs[64] (low 8 bits), qh[8] (9th bit per row), signs[32], scales[4]
    nb = 8
    rows = rows_for(512, nb, 64)
    qh = np.zeros((nb, 8), dtype=np.uint8)
    for i in range(64):
        qh[:, i // 8] |= ((rows[:, i] >> 8) << (i % 8)).astype(np.uint8)
    return np.concatenate([f16(nb), (rows & 0xFF).astype(np.uint8), qh, u8(nb, 32), u8(nb, 4)], axis=1)


def iq1_s():  # d, qs[32] (low 8 bits), 8 x u16 qh (4 x 3 high bits | scale << 12 | delta sign << 15)
    nb = 64
    rows = rows_for(2048, nb, 32)
    qh = rng.integers(0, 16, size=(nb, 8)).astype(np.uint16) << 12
    for i in range(32):
        qh[:, i // 4] |= ((rows[:, i] >> 8) << (3 * (i % 4))).astype(np.uint16)
    return np.concatenate([f16(nb), (rows & 0xFF).astype(np.uint8), qh.astype("<u2").view(np.uint8)], axis=1)


def iq1_m():  # qs[32], qh[16] (per row a nibble: 3 high bits | delta sign << 3), 4 x u16 scales
    nb = 16
    rows = rows_for(2048, nb, 32)
    qh = np.zeros((nb, 16), dtype=np.uint8)
    for i in range(32):
        nib = (rows[:, i] >> 8) | (rng.integers(0, 2, size=nb) << 3)
        qh[:, i // 2] |= (nib << (4 * (i % 2))).astype(np.uint8)
    d = f16(nb).view("<u2").reshape(nb).astype(np.uint16)
    sc = rng.integers(0, 1 << 12, size=(nb, 4)).astype(np.uint16)  # 4 x 3-bit scales per word
    for w in range(4):  # the f16 d, a nibble in the top of each word (lowest nibble first)
        sc[:, w] |= ((d >> (4 * w)) & 0xF) << 12
    return np.concatenate([(rows & 0xFF).astype(np.uint8), qh, sc.astype("<u2").view(np.uint8)], axis=1)


MAKERS = [(T.IQ2_XS, iq2_xs), (T.IQ2_S, iq2_s), (T.IQ3_XXS, iq3_xxs), (T.IQ3_S, iq3_s),
          (T.IQ1_S, iq1_s), (T.IQ1_M, iq1_m)]


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    from gguf.constants import GGML_QUANT_SIZES
    for t, make in MAKERS:
        raw = make()
        assert raw.dtype == np.uint8 and raw.shape[1] == GGML_QUANT_SIZES[t][1], (t.name, raw.shape)
        raw = raw.reshape(-1)
        ref = dequantize(raw.reshape(1, -1), t).astype("<f4").reshape(-1)
        assert np.isfinite(ref).all(), t.name
        (OUT / f"{t.name}.blocks").write_bytes(raw.tobytes())
        (OUT / f"{t.name}.f32").write_bytes(ref.tobytes())
        print(f"{t.name}: {raw.size // GGML_QUANT_SIZES[t][1]} blocks")


if __name__ == "__main__":
    main()
