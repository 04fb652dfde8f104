"""Where the time of one call goes: host time (no synchronization) against wall time, per
backend, and the part of braze's host time spent inside its compiled graphs' runtime.
Also prints braze's compile stages of the first call. Usage: python benchmarks/host_breakdown.py
"""
import statistics
import time

import torch

import braze
from braze import runtime
from braze.bench import make_step, workloads

torch.set_float32_matmul_precision("high")
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
acc = {}
_orig = runtime.CompiledGraph.__call__


def _timed(self, args):
    t = time.perf_counter_ns()
    r = _orig(self, args)
    acc[self.name] = acc.get(self.name, 0) + time.perf_counter_ns() - t
    return r


runtime.CompiledGraph.__call__ = _timed


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


for name, build in workloads(dev):
    if "TinyBlock" not in name and "matmul" not in name:
        continue
    for be in ["eager", "inductor", "braze-aot", "braze"]:
        torch.manual_seed(0)
        model, inputs, shape, train = build()
        torch._dynamo.reset()
        n0 = len(braze.stats.records)
        if be == "eager":
            fn = model
        elif be == "braze-aot":  # braze behind AOTAutograd's runtime wrappers
            fn = torch.compile(model, backend="braze", options={"direct_autograd": False})
        else:
            fn = torch.compile(model, backend=be)
        step = make_step(model, inputs, train, fn)
        sync()
        t = time.perf_counter()
        step()
        sync()
        first = time.perf_counter() - t
        for _ in range(10):
            step()
        sync()
        acc.clear()
        host, wall = [], []
        n = 100
        for _ in range(n):
            sync()
            t0 = time.perf_counter_ns()
            step()
            t1 = time.perf_counter_ns()
            sync()
            t2 = time.perf_counter_ns()
            host.append((t1 - t0) / 1e3)
            wall.append((t2 - t0) / 1e3)
        per_graph = {k: round(v / n / 1e3, 1) for k, v in acc.items()}
        print(f"{name:22s} {be:9s} host {statistics.median(host):7.1f} us  wall {statistics.median(wall):7.1f} us  "
              f"first {first:.3f} s  braze graphs {per_graph}", flush=True)
        if be.startswith("braze"):
            for r in braze.stats.records[n0:]:
                ts = {k: round(v * 1e3, 1) for k, v in r.get("times", {}).items()}
                print(f"    {r['name']}: {len(r.get('kernels', []))} kernels, stages ms {ts}", flush=True)
