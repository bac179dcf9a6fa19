#!/usr/bin/env python3
"""Random but valid blocks of every tensor type sluice computes with, and their dequantization
by the `gguf` Python package (llama.cpp's own reference implementation in numpy).

Writes tests/fixtures/quant/<TYPE>.blocks (raw block bytes, N_BLOCKS blocks) and
<TYPE>.f32 (little-endian float32, what gguf.quants.dequantize returns for them), plus
MANIFEST.json with versions. Deterministic (fixed seed).

Usage: python3 scripts/make_quant_fixtures.py [OUT_DIR]
"""
import json
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "tests/fixtures/quant")
N_ELEMS = 8 * 256  # 8 super-blocks: enough rows for dot tests, small enough to commit

rng = np.random.default_rng(20261202)


def f16_bytes(lo, hi, n):
    """n little-endian f16 values uniform in [lo, hi), random sign."""
    v = rng.uniform(lo, hi, n) * rng.choice([-1.0, 1.0], n)
    return v.astype("<f2").view(np.uint8).reshape(n, 2)


def blocks_for(t):
    block, size = gguf.GGML_QUANT_SIZES[t]
    nb = N_ELEMS // block
    if t == T.F32:
        return rng.standard_normal(N_ELEMS).astype("<f4").view(np.uint8)
    if t == T.F16:
        return rng.standard_normal(N_ELEMS).astype("<f2").view(np.uint8)
    if t == T.BF16:
        f = rng.standard_normal(N_ELEMS).astype("<f4").view("<u4")
        return (f >> 16).astype("<u2").view(np.uint8)
    b = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    # Scale fields get finite, moderate f16 values (random bytes would give inf/NaN scales,
    # which no quantizer writes). Positions follow ggml's block structs.
    if t in (T.Q4_0, T.Q8_0):
        b[:, 0:2] = f16_bytes(1e-3, 0.1, nb)
    elif t == T.Q2_K:  # scales[16] qs[64] d dmin
        b[:, 80:82] = f16_bytes(1e-3, 0.1, nb)
        b[:, 82:84] = f16_bytes(1e-3, 0.1, nb)
    elif t == T.Q3_K:  # hmask[32] qs[64] scales[12] d
        b[:, 108:110] = f16_bytes(1e-3, 0.1, nb)
    elif t in (T.Q4_K, T.Q5_K):  # d dmin scales[12] ...
        b[:, 0:2] = f16_bytes(1e-3, 0.1, nb)
        b[:, 2:4] = f16_bytes(1e-3, 0.1, nb)
    elif t == T.Q6_K:  # ql[128] qh[64] scales[16] d
        b[:, 208:210] = f16_bytes(1e-3, 0.1, nb)
    elif t == T.IQ2_XXS:  # d qs[32 x u16]
        b[:, 0:2] = f16_bytes(1e-3, 0.1, nb)
    elif t == T.MXFP4:  # e (E8M0) qs[16]
        b[:, 0] = rng.integers(110, 135, size=nb, dtype=np.uint8)
    else:
        raise SystemExit(f"no generator for {t.name}")
    return b.reshape(-1)


TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ2_XXS, T.MXFP4]


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    manifest = {"script": "scripts/make_quant_fixtures.py", "gguf": gguf.__version__ if hasattr(gguf, "__version__") else None,
                "numpy": np.__version__, "n_elems": N_ELEMS, "types": []}
    try:
        from importlib.metadata import version
        manifest["gguf"] = version("gguf")
    except Exception:
        pass
    for t in TYPES:
        raw = blocks_for(t)
        ref = dequantize(raw.reshape(1, -1), t).astype("<f4").reshape(-1)
        assert ref.size == N_ELEMS, (t, ref.size)
        assert np.isfinite(ref).all(), t
        (OUT / f"{t.name}.blocks").write_bytes(raw.tobytes())
        (OUT / f"{t.name}.f32").write_bytes(ref.tobytes())
        manifest["types"].append(t.name)
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {len(TYPES)} types to {OUT}")


if __name__ == "__main__":
    main()
