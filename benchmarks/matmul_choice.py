"""Which GEMM kernels the seed suite's matmul-heavy model runs under eager and braze, and
their GPU time (torch.profiler, 20 calls), in one process per variant:

    python benchmarks/matmul_choice.py eager|braze [--dim 4096 --rows 1024]
    python benchmarks/matmul_choice.py wall     # whole calls, eager and braze in one process

Run braze with BRAZE_MATMUL_TUNE=0 for cuBLASLt's heuristic favourite and with a fresh
BRAZE_CACHE_DIR for a fresh timing of its candidates. `wall` times whole calls of both
backends in alternating rounds (CUDA events around each call, median of 50; then 50 calls
back to back), so a machine's drift shows in both."""
import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import braze  # noqa: F401
from braze.workloads import MatmulHeavy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("backend")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args()
    torch.set_float32_matmul_precision("high")
    m = MatmulHeavy(a.dim, 4).cuda()
    x = torch.randn(a.rows, a.dim, device="cuda")
    if a.backend == "wall":
        return wall(m, x)
    fn = m if a.backend == "eager" else torch.compile(m, backend=a.backend)
    with torch.no_grad():
        for _ in range(10):
            fn(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.calls):
                fn(x)
            torch.cuda.synchronize()
    total = 0.0
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total <= 0:
            continue
        total += e.device_time_total
        print(f"{e.device_time_total / a.calls:9.1f} us/call  x{e.count // a.calls:<3} {e.key[:110]}")
    print(f"{a.backend}: GPU time {total / a.calls:.1f} us per call")


def wall(m, x):
    c = torch.compile(m, backend="braze")
    for name, fn in (("eager", m), ("braze", c)) * 2:
        with torch.no_grad():
            for _ in range(10):
                fn(x)
            torch.cuda.synchronize()
            ts = []
            for _ in range(50):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn(x)
                e.record()
                torch.cuda.synchronize()
                ts.append(s.elapsed_time(e))
            t0 = time.perf_counter()
            for _ in range(50):
                fn(x)
            torch.cuda.synchronize()
            bb = (time.perf_counter() - t0) / 50 * 1e3
        print(f"{name}: call {statistics.median(ts):.3f} ms (events, median), back to back {bb:.3f} ms")


if __name__ == "__main__":
    main()
