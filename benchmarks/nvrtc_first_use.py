"""Cost of loading NVRTC/driver/cuBLASLt and of NVRTC's first compile in a fresh process.
Usage: python benchmarks/nvrtc_first_use.py"""
import time

t0 = time.perf_counter()
import torch  # noqa: E402

import braze  # noqa: E402
from braze import _core, cuda  # noqa: E402

t1 = time.perf_counter()
torch.zeros(1, device="cuda")
t2 = time.perf_counter()
print(f"import torch+braze {t1 - t0:.3f} s, CUDA context {t2 - t1:.3f} s")
for label, fn in [("cuda_ready (NVRTC + driver load)", cuda.cuda_ready), ("cublaslt_ready (cuBLASLt load)", cuda.cublaslt_ready),
                  ("first NVRTC compile", lambda: _core.nvrtc_warm_up("sm_90")), ("second NVRTC compile", lambda: _core.nvrtc_warm_up("sm_90"))]:
    t = time.perf_counter()
    fn()
    print(f"{label:36s} {time.perf_counter() - t:.3f} s", flush=True)
