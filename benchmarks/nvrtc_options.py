"""NVRTC compile time of braze's CUDA modules for the TinyBlock training step under option
variants (min of 3). Runs on the GPU machine, or anywhere NVRTC loads (BRAZE_CHECK_CUDA).
Usage: python benchmarks/nvrtc_options.py"""
import ctypes
import os
import time

os.environ.setdefault("BRAZE_CHECK_CUDA", "1")
import torch  # noqa: E402

from braze import cuda, runtime  # noqa: E402
from braze.workloads import TinyBlock  # noqa: E402

srcs = {}
_init = runtime.CompiledGraph.__init__


def _keep(self, compiled, lowered, name):
    srcs[name] = compiled.source if compiled.source.lstrip().startswith("typedef") else compiled.cuda_source
    _init(self, compiled, lowered, name)


runtime.CompiledGraph.__init__ = _keep
dev = "cuda" if torch.cuda.is_available() else "cpu"
m = TinyBlock(768, 4).to(dev)
torch.compile(m, backend="braze")(torch.randn(4, 16, 768, device=dev)).sum().backward()
lib = ctypes.CDLL(cuda.find_nvrtc()[0])


def comp(src, opts):
    prog = ctypes.c_void_p()
    lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None)
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    t = time.perf_counter()
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    dt = time.perf_counter() - t
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return dt * 1e3 if rc == 0 else float("nan")


base = ["--gpu-architecture=sm_90", "--std=c++17", "-default-device"]
comp("__global__ void k(){}", base)
print("empty program", round(min(comp("__global__ void k(){}", base) for _ in range(3)), 1), "ms")
for name, s in srcs.items():
    for extra in [[], ["--split-compile=0"], ["-Xptxas", "-O1"], ["-Xptxas", "-O2"], ["--gpu-architecture=compute_90"]]:
        print(f"{name:12s} {s.count('__global__'):2d} kernels {' '.join(extra):34s} {min(comp(s, base + extra) for _ in range(3)):7.1f} ms", flush=True)
