"""Finding NVRTC and the CUDA driver inside a PyTorch installation (no toolkit needed).

NVRTC comes from PyTorch's own NVIDIA wheels (``nvidia/cu13/lib`` for CUDA 13 wheels,
``nvidia/cuda_nvrtc/lib`` for CUDA 12 ones) or, failing that, the system library path. The
driver is ``libcuda.so.1``, which PyTorch has already mapped when it uses a GPU.
"""
from __future__ import annotations

import functools
import glob
import os
import site
import sys
import threading

from . import _core


def _roots():
    """Site-packages directories, the one the imported PyTorch lives in first."""
    roots = list(site.getsitepackages()) + [site.getusersitepackages()] + [p for p in sys.path if p.endswith("site-packages")]
    try:
        import torch

        roots.insert(0, os.path.dirname(os.path.dirname(torch.__file__)))
    except ImportError:
        pass
    return roots


def _candidates():
    seen = []
    for r in _roots():
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib"):
            d = os.path.join(r, sub)
            if os.path.isdir(d) and d not in seen:
                seen.append(d)
    return seen


def find_nvrtc():
    """(libnvrtc path, libnvrtc-builtins path or None), or None if there is none."""
    for d in _candidates():
        libs = sorted(glob.glob(os.path.join(d, "libnvrtc.so.*")))
        libs = [p for p in libs if "builtins" not in p and "alt" not in p]
        if libs:
            b = sorted(glob.glob(os.path.join(d, "libnvrtc-builtins.so.*")))
            return libs[0], (b[-1] if b else None)
    for name in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"):
        try:
            import ctypes

            ctypes.CDLL(name)
            return name, None
        except OSError:
            continue
    return None


@functools.lru_cache(None)
def nvrtc_available() -> bool:
    """Loads NVRTC (without the driver); False when it cannot be found."""
    found = find_nvrtc()
    if found is None:
        return False
    try:
        _core.cuda_init(found[0], found[1], None)
        return True
    except Exception:
        return False


def find_cublaslt():
    for d in _candidates() + [os.path.join(r, "nvidia/cublas/lib") for r in site.getsitepackages()]:
        libs = sorted(glob.glob(os.path.join(d, "libcublasLt.so.*")))
        if libs:
            return libs[0]
    return None


@functools.lru_cache(None)
def cuda_ready() -> str | None:
    """Loads NVRTC and the driver for running kernels; returns None when ready, else why not."""
    if not nvrtc_available():
        return "NVRTC not found (install PyTorch's CUDA wheels or the CUDA runtime)"
    found = find_nvrtc()
    try:
        _core.cuda_init(found[0], found[1], "libcuda.so.1")
    except Exception as e:
        return f"CUDA driver: {e}"
    return None


@functools.lru_cache(None)
def cublaslt_ready() -> bool:
    """Loads cuBLASLt (PyTorch's copy) for library matmuls; False when it cannot."""
    if cuda_ready() is not None:
        return False
    path = find_cublaslt()
    if path is None:
        return False
    found = find_nvrtc()
    try:
        _core.cuda_init(found[0], found[1], "libcuda.so.1", path)
        return True
    except Exception:
        return False


def find_cudnn():
    """cuDNN's library in PyTorch's NVIDIA wheels (the copy PyTorch itself loads), or None."""
    for r in _roots():
        libs = sorted(glob.glob(os.path.join(r, "nvidia/cudnn/lib/libcudnn.so.*")))
        if libs:
            return libs[0]
    return None


@functools.lru_cache(None)
def cudnn_ready() -> bool:
    """Loads cuDNN (PyTorch's copy) for library convolutions ([Note: library convolutions]);
    False when it cannot, or when PyTorch's cuDNN is turned off."""
    import torch

    if not torch.backends.cudnn.enabled or not torch.backends.cudnn.is_available() or cuda_ready() is not None:
        return False
    path = find_cudnn()
    if path is None:
        return False
    try:
        _core.cudnn_init(path)
        return True
    except Exception:
        return False


# A worker process ([Note: NVRTC worker processes] in braze-runtime) loads braze's extension
# module alone, by path: importing the package would import PyTorch.
_WORKER_CODE = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('braze._core', sys.argv[1])\n"
    "m = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(m)\n"
    "m.nvrtc_serve(sys.argv[2], sys.argv[3] or None)\n"
)


def start_nvrtc_workers() -> int:
    """Starts this process's NVRTC worker processes (once; ``BRAZE_NVRTC_WORKERS`` sets how
    many, 0 none): NVRTC serializes the threads of one process, so kernels compile on
    processes side by side. Returns how many run."""
    found = find_nvrtc()
    if found is None or not sys.executable:
        return 0
    return _core.nvrtc_workers_start(sys.executable, _WORKER_CODE, [_core.__file__, found[0], found[1] or ""])


_warm_up_started = set()


def start_warm_up(device_index: int) -> None:
    """Starts the NVRTC worker processes, loads NVRTC, the driver and cuBLASLt and pays NVRTC's
    first-use cost (a quarter of a second) on a background thread, once per device, while
    Dynamo and AOTAutograd trace."""
    if device_index in _warm_up_started:
        return
    _warm_up_started.add(device_index)
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)

    def run():
        try:
            start_nvrtc_workers()
            if cuda_ready() is None:
                cublaslt_ready()
                _core.nvrtc_warm_up(f"sm_{major}{minor}")
        except Exception:  # only a head start: the real compile reports any problem
            pass

    threading.Thread(target=run, name="braze-nvrtc-warm-up", daemon=True).start()
