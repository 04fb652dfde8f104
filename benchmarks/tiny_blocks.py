"""Issue 10's host-bound case: 12 tiny LayerNorm + MLP blocks (TinyBlock(64), input 2×64, fp32,
inference) per call, µs per call over 2000 calls (synchronized at the end: the GPU work is a
few µs, so this is the host's cost), for eager and each backend and mode.

    python benchmarks/tiny_blocks.py [--calls N]
"""
import argparse
import time

import torch

import braze  # noqa: F401  (registers the backend)
from braze.workloads import TinyBlock


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[TinyBlock(64) for _ in range(12)]).to(dev).eval()
    x = torch.randn(2, 64, device=dev)
    with torch.no_grad():
        ref = model(x)
    runs = [("eager", None, None), ("inductor", "default", "inductor"), ("inductor", "reduce-overhead", "inductor"),
            ("braze", "default", "braze"), ("braze", "reduce-overhead", "braze")]
    print(f"12 × TinyBlock(64), input 2×64 fp32, inference, {dev}; µs per call over {a.calls} calls")
    for name, mode, backend in runs:
        torch._dynamo.reset()
        fn = model if backend is None else torch.compile(model, backend=backend, mode=mode)
        with torch.no_grad():
            t0 = time.perf_counter()
            out = fn(x)
            first = time.perf_counter() - t0
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            for _ in range(50):
                fn(x)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            time.sleep(1.0)  # compile workers settle
            t = time.perf_counter()
            for _ in range(a.calls):
                fn(x)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            us = (time.perf_counter() - t) / a.calls * 1e6
            torch.testing.assert_close(fn(x), ref, rtol=1e-4, atol=1e-4)
        print(f"  {name:9s} {mode or '':16s} {us:8.1f} us per call   first call {first:6.2f} s", flush=True)


if __name__ == "__main__":
    main()
