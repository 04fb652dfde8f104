"""Issue 10's host-bound case: 12 tiny LayerNorm + MLP blocks (TinyBlock(64), input 2×64, fp32,
inference) per call, µs per call over 2000 calls (synchronized at the end: the GPU work is a
few µs, so this is mostly the host's cost), for eager and each backend and mode. Also the host
time alone: 100 calls issued without waiting for the GPU (the launch queue holds them); when
the wall time per call is above it, the GPU is the bound.

    python benchmarks/tiny_blocks.py [--calls N] [--profile] [--floor] [--replay-parts]

`--profile` (CUDA): per backend, the GPU side of 50 calls from torch.profiler: kernels per
call, their summed duration, and the GPU's span per call (first kernel's start to the last
one's end over the 50, divided by 50), then the costliest kernels. `--floor` adds two rows
that run no kernels: Dynamo with a backend whose compiled graph returns its first call's outputs,
and the same under AOTAutograd: the part of a call no backend of `torch.compile` avoids.
`--replay-parts` (CUDA) times the pieces of braze's reduce-overhead replay alone, best of 7 ×
100 calls each: the CUDA graph's launch, the copy of the inputs into the graph's buffers, the
check that parameters are where they were at capture, and the liveness check of the pool's
outputs ([Note: whole-graph replay] in braze/cudagraphs.py).
"""
import argparse
import time

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import braze  # noqa: F401  (registers the backend)
from braze.workloads import TinyBlock


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--floor", action="store_true")
    ap.add_argument("--replay-parts", action="store_true")
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
    if a.floor:
        runs += [("dynamo", "constant outputs", _constant), ("dynamo+aot", "constant outputs", aot_autograd(fw_compiler=_constant_boxed))]
    for name, mode, backend in runs:
        torch._dynamo.reset()
        if backend is None:
            fn = model
        elif callable(backend):
            fn = torch.compile(model, backend=backend)
        else:
            fn = torch.compile(model, backend=backend, mode=mode)
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
            host = _best_us(lambda: fn(x), calls=100, rounds=5)
            torch.testing.assert_close(fn(x), ref, rtol=1e-4, atol=1e-4)
        print(f"  {name:9s} {mode or '':16s} {us:8.1f} us per call (host alone {host:6.1f})   first call {first:6.2f} s", flush=True)
        if a.profile and dev.type == "cuda":
            gpu_side(fn, x)
        if a.replay_parts and dev.type == "cuda" and name == "braze" and mode == "reduce-overhead":
            replay_parts(x)


def _constant(gm, example_inputs):
    """A backend that runs nothing: the graph's outputs of its first call, for every call."""
    first = []

    def run(*args):
        if not first:
            first.append(gm(*args))
        return first[0]
    return run


def _constant_boxed(gm, example_inputs):
    run = _constant(gm, example_inputs)
    return make_boxed_func(lambda *args: list(run(*args)))


def _best_us(fn, calls=100, rounds=7):
    """Host µs per call of `fn`: the best of `rounds` runs of `calls` calls issued without
    waiting (the device idle at each run's start)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    best = float("inf")
    for _ in range(rounds):
        sync()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    sync()
    return best


def replay_parts(x):
    """The pieces of the latest captured whole graph's replay, each timed alone."""
    from braze import cudagraphs

    graphs = [ref() for pool in cudagraphs._POOLS.values() for _, ref in pool.graphs.values()]
    graphs = [g for g in graphs if g is not None and g.graph is not None]
    if not graphs:
        print("      (no captured whole graph)")
        return
    g = graphs[-1]
    srcs = [d.clone() for d in g.copy_dst]
    # The call's arguments as the check reads them: the parameters (by their pointers), the
    # input elsewhere.
    args = [g.pool.static.get(p, x) if p is not None else x for p in g.check_ptrs]
    # The input copy in the form the replay uses: `copy_` for one input, else `_foreach_copy_`.
    if getattr(g, "copy_one", False):
        copy = ("input copy (1 tensor, copy_)", lambda: g.copy_dst[0].copy_(srcs[0]))
    else:
        copy = (f"input copy ({len(srcs)} tensors, _foreach_copy_)", lambda: torch._foreach_copy_(g.copy_dst, srcs))
    parts = {
        "CUDAGraph.replay()": lambda: g.graph.replay(),
        copy[0]: copy[1],
        f"parameter check ({len(g.check_idx)} pointers)": lambda: torch._C._tensors_data_ptrs_at_indices_equal(args, g.check_ptrs, g.check_idx),
        "pool.alive (outputs in use)": lambda: g.pool.alive(g.order),
    }
    for what, fn in parts.items():
        print(f"      {_best_us(fn):6.1f} us  {what}")


def gpu_side(fn, x, calls=50):
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    if not kernels:
        print("      (no kernels recorded)")
        return
    span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    busy = sum(e.device_time_total for e in kernels)
    print(f"      GPU: {len(kernels) / calls:.0f} kernels per call, {busy / calls:.1f} us of kernel time, span {span / calls:.1f} us per call")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:6]:
        if e.device_time_total > 0:
            print(f"      {e.device_time_total / calls:7.2f} us {e.count // calls:3d}x  {e.key[:90]}")


if __name__ == "__main__":
    main()
