"""How the operand layouts of TinyBlock's weight-gradient GEMM (dW = dY^T @ H, K = tokens)
change cuBLAS's time on this card (torch.mm, CUDA events, median of 50).
Usage: python benchmarks/gemm_layouts.py"""
import statistics

import torch

torch.set_float32_matmul_precision("high")
dev = "cuda"


def t(fn, n=50):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


for dtype in (torch.float32, torch.float16):
    M, K, N = 768, 4096, 3072
    dy = torch.randn(K, M, device=dev, dtype=dtype)   # tokens x out (row-major, as the backward has it)
    h = torch.randn(K, N, device=dev, dtype=dtype)    # tokens x hidden
    dyt_c = dy.t().contiguous()
    h_cm = h.t().contiguous().t()
    print(dtype)
    print(f"  dY^T (view) @ H            {t(lambda: torch.mm(dy.t(), h)):7.1f} us")
    print(f"  dY^T (copied) @ H          {t(lambda: torch.mm(dyt_c, h)):7.1f} us")
    print(f"  dY^T (view) @ H (col-major){t(lambda: torch.mm(dy.t(), h_cm)):7.1f} us")
    print(f"  (H^T @ dY)^T  (other order){t(lambda: torch.mm(h.t(), dy)):7.1f} us")
    print(f"  copy dY^T                  {t(lambda: dy.t().contiguous()):7.1f} us")
    print(f"  copy H col-major           {t(lambda: h.t().contiguous()):7.1f} us")
    x = torch.randn(K, 768, device=dev, dtype=dtype)
    w = torch.randn(768, N, device=dev, dtype=dtype)
    print(f"  forward-shape X @ W ({K}x768x{N}) {t(lambda: torch.mm(x, w)):7.1f} us")
