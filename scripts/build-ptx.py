#!/usr/bin/env python3
"""Compile src/gpu/kernels.cu (followed by every src/gpu/kernels_*.cu, in name order, as one
translation unit: the later files may use kernels.cu's macros and types) to PTX for compute_90
with NVRTC and write src/gpu/kernels.ptx.

NVRTC needs no GPU: `pip install nvidia-cuda-nvrtc-cu12` brings libnvrtc. The PTX is committed
(so the crate builds and runs with no CUDA toolkit: the driver JIT-compiles it at load) and its
first line records the SHA-256 of the source it came from; a test fails when they disagree.

usage: scripts/build-ptx.py [--check]
"""
import ctypes, glob, hashlib, os, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.path.join(ROOT, "src", "gpu")
SRCS = [os.path.join(GPU, "kernels.cu")] + sorted(glob.glob(os.path.join(GPU, "kernels_*.cu")))
OUT = os.path.join(ROOT, "src", "gpu", "kernels.ptx")


def libnvrtc():
    cands = []
    try:
        import nvidia.cuda_nvrtc as m
        for p in m.__path__:
            cands += sorted(glob.glob(os.path.join(p, "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    cands += ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    for c in cands:
        if ".alt." in c or "builtins" in c:
            continue
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    sys.exit("build-ptx: libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12)")


def main():
    src = b"".join(open(p, "rb").read() for p in SRCS)
    digest = hashlib.sha256(src).hexdigest()
    nv = libnvrtc()
    prog = ctypes.c_void_p()
    r = nv.nvrtcCreateProgram(ctypes.byref(prog), src, b"kernels.cu", 0, None, None)
    if r:
        sys.exit(f"build-ptx: nvrtcCreateProgram failed ({r})")
    opts = [b"--gpu-architecture=compute_90", b"--std=c++17", b"-default-device", b"--use_fast_math=false"]
    opts = [o for o in opts if b"fast_math" not in o]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    r = nv.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nv.nvrtcGetProgramLog(prog, log)
    if log.value.strip():
        print(log.value.decode(), file=sys.stderr)
    if r:
        sys.exit(f"build-ptx: compilation failed ({r})")
    nv.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    nv.nvrtcGetPTX(prog, ptx)
    text = f"// sluice kernels.cu sha256 {digest}\n" + ptx.value.decode()
    if "--check" in sys.argv:
        ok = open(OUT).read() == text
        print("kernels.ptx is", "up to date" if ok else "STALE")
        sys.exit(0 if ok else 1)
    tmp = OUT + ".tmp"
    open(tmp, "w").write(text)
    os.replace(tmp, OUT)
    print(f"wrote {OUT} ({len(text)} bytes)")


if __name__ == "__main__":
    main()
