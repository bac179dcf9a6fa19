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
    elif t in EXTRA_A:
        return EXTRA_A[t](b, nb)
    else:
        raise SystemExit(f"no generator for {t.name}")
    return b.reshape(-1)


# --- quant-a types (Q4_1 Q5_0 Q5_1 IQ4_NL IQ4_XS TQ1_0 TQ2_0). Each draws from its own
# generator seeded by its ggml id, so adding types elsewhere in this file never changes these
# fixtures. Scale fields as in ggml's block structs; every other byte stays random (any byte is
# a valid code for these types).
def _own_rng(t):
    return np.random.default_rng(20261203 + int(t))


def _f16(r, lo, hi, n):
    v = r.uniform(lo, hi, n) * r.choice([-1.0, 1.0], n)
    return v.astype("<f2").view(np.uint8).reshape(n, 2)


def _extra(t, fields):
    def gen(b, nb):
        r = _own_rng(t)
        b = r.integers(0, 256, size=b.shape, dtype=np.uint8)
        for off in fields:
            b[:, off:off + 2] = _f16(r, 1e-3, 0.1, nb)
        return b.reshape(-1)
    return gen


EXTRA_A = {
    T.Q4_1: _extra(T.Q4_1, [0, 2]),  # d m qs[16]
    T.Q5_0: _extra(T.Q5_0, [0]),  # d qh[4] qs[16]
    T.Q5_1: _extra(T.Q5_1, [0, 2]),  # d m qh[4] qs[16]
    T.IQ4_NL: _extra(T.IQ4_NL, [0]),  # d qs[16]
    T.IQ4_XS: _extra(T.IQ4_XS, [0]),  # d scales_h scales_l[4] qs[128]
    T.TQ1_0: _extra(T.TQ1_0, [52]),  # qs[48] qh[4] d
    T.TQ2_0: _extra(T.TQ2_0, [64]),  # qs[64] d
}
TYPES_A = list(EXTRA_A)
# --- end quant-a types


TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ2_XXS, T.MXFP4]
TYPES += TYPES_A


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
    # quant-a: what gguf's own quantizers write for one f32 input, for the types sluice's
    # quantizer (src/kernels/quantize.rs) must reproduce byte for byte.
    qin = _own_rng(T.F32).standard_normal(N_ELEMS).astype("<f4")
    qin[:32] *= 0.0  # an all-zero block (d = 0)
    qin[32:64] += 3.0  # a block of one sign (min > 0)
    (OUT / "quantize_in.f32").write_bytes(qin.tobytes())
    for t in (T.Q5_0, T.Q4_1, T.Q5_1, T.MXFP4):
        q = gguf.quants.quantize(qin.reshape(1, -1), t)
        (OUT / f"{t.name}.quantized").write_bytes(np.asarray(q, dtype=np.uint8).tobytes())
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {len(TYPES)} types to {OUT}")


if __name__ == "__main__":
    main()
