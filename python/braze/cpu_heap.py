"""[Note: a kept CPU heap] glibc's malloc settings for CPU training, set once per process.

A CPU training step allocates the forward's saved activations, frees them in the backward and
allocates them again in the next forward. glibc returns the top of its heap to the system once
more than its trim threshold is free there, so at the end of each backward the activations'
pages went back, and the next forward faulted every one of them in again, zeroed by the
kernel: Swin-T's CPU training step (b2, fp32, 2 cores) took about 45,000 minor page faults per
step under braze and 11,000-23,000 under eager (`/proc/self/stat`); with the heap kept, 144
faults and a median step of 713 ms against 765 (the two settings alternated in one process;
BENCHMARKS.md). braze's own temps live in
arenas it keeps ([Note: CPU arenas] in runtime.py); the saved activations are autograd's, so
the heap they come from is kept instead: when the first CPU training graph is compiled (option
`keep_cpu_heap`, default True), braze sets glibc's trim threshold to 1 GiB and its mmap
threshold to 32 MiB (the largest its own dynamic threshold reaches; setting either option
turns that adjustment off). Freed heap memory then stays with the process for the next step,
as PyTorch's CUDA caching allocator keeps its blocks; allocations above 32 MiB are still
mappings of their own, returned when freed. Off glibc (musl, macOS, Windows) nothing is set.
"""
from __future__ import annotations

import ctypes
import platform

#: glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 1 << 30
MMAP_THRESHOLD = 32 << 20

_state = {"done": False, "kept": False}


def keep() -> bool:
    """Sets the thresholds once per process; True where glibc took them."""
    if _state["done"]:
        return _state["kept"]
    _state["done"] = True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _state["kept"] = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _state["kept"]


def kept() -> bool:
    """Whether this process's heap is kept ([Note: a kept CPU heap])."""
    return _state["kept"]
