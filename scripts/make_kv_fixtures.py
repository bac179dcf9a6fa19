#!/usr/bin/env python3
"""The KV cache's row conversions (`-ctk` / `-ctv`) by references nobody here wrote: numpy's
float32 -> float16 cast for f16, and the `gguf` Python package's quantizers (llama.cpp's
reference, `gguf.quants.quantize`) for BF16 and Q8_0. sluice's `kernels::kv::store_row` must
write these bytes exactly (tests/kv_precision.rs).

Writes tests/fixtures/kv/: in.f32 (256 little-endian float32: random values of several
magnitudes, an all-zero block, f16 rounding ties, f16 subnormals and overflow, -0.0), f16.bin,
bf16.bin, q8_0.bin, and MANIFEST.json with versions. Deterministic (fixed seed).

Usage: python3 scripts/make_kv_fixtures.py [OUT_DIR]
"""
import json
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "tests/fixtures/kv")
N = 256  # 8 q8_0 blocks


def main():
    rng = np.random.default_rng(20261205)
    x = (rng.standard_normal(N) * rng.choice([1e-3, 0.1, 1.0, 20.0], N)).astype("<f4")
    x[32:64] = 0.0  # an all-zero q8_0 block (d = 0)
    x[64] = -0.0
    # f16 ties (exactly half an f16 ulp above a value): round to even.
    x[65] = np.float32(1.0 + 2.0**-11)
    x[66] = np.float32(1.0 + 3 * 2.0**-11)
    x[67] = np.float32(-(2048.0 + 1.0))
    # f16 subnormals, underflow to zero, overflow to infinity (f16's max is 65504).
    x[68] = np.float32(3e-6)
    x[69] = np.float32(-1e-8)
    x[70] = np.float32(70000.0)
    x[71] = np.float32(65519.0)
    # bf16 ties.
    x[72] = np.float32(np.uint32(0x3F808000).view(np.float32))
    x[73] = np.float32(np.uint32(0x3F818000).view(np.float32))
    # A block of one sign, and one whose largest magnitude is negative.
    x[96:128] = np.abs(x[96:128]) + 0.5
    x[128] = -50.0
    with np.errstate(over="ignore"):
        f16 = x.astype("<f2")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "in.f32").write_bytes(x.tobytes())
    (OUT / "f16.bin").write_bytes(f16.tobytes())
    for t, name in ((T.BF16, "bf16"), (T.Q8_0, "q8_0")):
        q = gguf.quants.quantize(x.reshape(1, -1), t)
        (OUT / f"{name}.bin").write_bytes(np.asarray(q, dtype=np.uint8).tobytes())
    manifest = {"script": "scripts/make_kv_fixtures.py", "numpy": np.__version__, "n": N}
    try:
        from importlib.metadata import version
        manifest["gguf"] = version("gguf")
    except Exception:
        manifest["gguf"] = None
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
