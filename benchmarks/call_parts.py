"""Host cost of the parts of one call of braze's compiled TinyBlock forward and backward graphs
(no profiler): the whole call, the Rust run alone, the allocations. Usage: python
benchmarks/call_parts.py"""
import time

import torch

from braze import runtime
from braze.bench import make_step, workloads

torch.set_float32_matmul_precision("high")
dev = torch.device("cuda")
graphs, last_args = [], {}
_init, _call = runtime.CompiledGraph.__init__, runtime.CompiledGraph.__call__


def _keep(self, *a):
    _init(self, *a)
    graphs.append(self)


def _spy(self, args):
    last_args[self.name] = list(args)
    return _call(self, args)


runtime.CompiledGraph.__init__ = _keep
runtime.CompiledGraph.__call__ = _spy
model, inputs, shape, train = dict(workloads(dev))["TinyBlock train step"]()
step = make_step(model, inputs, train, torch.compile(model, backend="braze"))
for _ in range(5):
    step()
torch.cuda.synchronize()
runtime.CompiledGraph.__call__ = _call


def per_call(fn, n=200):
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter_ns()
        for _ in range(n):
            fn()
        dt = (time.perf_counter_ns() - t) / n / 1e3
        torch.cuda.synchronize()
        best = min(best, dt)
    return best


for g in graphs:
    args = last_args[g.name]
    inputs_, plan, outs, simple = g.static_plan
    bufs = [None] * g.n_bufs
    for b, idx, shp, st in inputs_[0]:
        bufs[b] = g.tensor_args_of(args)[idx]
    allocs = [a for _, al, _, _, _ in plan for a in al]
    for buf, shp, st, dt in allocs:
        bufs[buf] = torch.empty_strided(shp, st, dtype=dt, device=dev)
    arena = torch.empty(g.arena_bytes, dtype=torch.uint8, device=dev)
    ptrs = [0 if t is None else t.data_ptr() for t in bufs]
    stream = g.raw_stream(g.device_index)
    kind, _, _, lo, hi = plan[0]
    print(f"{g.name}: {len(plan)} step(s), items {lo}..{hi}, {len(allocs)} allocations, arena {g.arena_bytes} B")
    print(f"   whole call          {per_call(lambda: g(args)):7.1f} us")
    print(f"   run() alone         {per_call(lambda: g.c.run(lo, hi, ptrs, [], stream, arena.data_ptr())):7.1f} us")
    for i in range(lo, hi):
        print(f"     item {i}           {per_call(lambda: g.c.run(i, i + 1, ptrs, [], stream, arena.data_ptr())):7.1f} us")
    print(f"   allocations         {per_call(lambda: [torch.empty_strided(s, st, dtype=d, device=dev) for _, s, st, d in allocs]):7.1f} us")
    print(f"   data_ptr list       {per_call(lambda: [0 if t is None else t.data_ptr() for t in bufs]):7.1f} us")
    print(f"   arena torch.empty   {per_call(lambda: torch.empty(g.arena_bytes, dtype=torch.uint8, device=dev)):7.1f} us")
x = torch.randn(1024, device=dev)
print(f"eager x + 1            {per_call(lambda: x + 1):7.1f} us")
print(f"torch.mm 1024x768x3072 {per_call(lambda: torch.mm(inputs[0].view(-1, 768)[:1024], model.fc1.weight.t())):7.1f} us")
