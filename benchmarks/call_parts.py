"""Host cost of the parts of one call of braze's compiled TinyBlock forward and backward graphs
(no profiler): the whole call, the Rust runs alone (graphs without extern calls), the
allocations. On the GPU where there is one, else the CPU. Usage: python
benchmarks/call_parts.py"""
import time

import torch

from braze import runtime
from braze.bench import make_step, workloads

torch.set_float32_matmul_precision("high")
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
graphs, last_args = [], {}
_init, _call = runtime.CompiledGraph.__init__, runtime.CompiledGraph.__call__


def _keep(self, *a):
    _init(self, *a)
    graphs.append(self)


def _spy(self, args, on_step=None):
    last_args[self.name] = list(args)
    return _call(self, args, on_step)


runtime.CompiledGraph.__init__ = _keep
runtime.CompiledGraph.__call__ = _spy
model, inputs, shape, train = dict(workloads(dev))["TinyBlock train step"]()
step = make_step(model, inputs, train, torch.compile(model, backend="braze"))
for _ in range(5):
    step()
sync()
runtime.CompiledGraph.__call__ = _call


def per_call(fn, n=200):
    best = float("inf")
    for _ in range(5):
        sync()
        t = time.perf_counter_ns()
        for _ in range(n):
            fn()
        dt = (time.perf_counter_ns() - t) / n / 1e3
        sync()
        best = min(best, dt)
    return best


for g in graphs:
    args = last_args[g.name]
    if g.dynamic:
        print(f"{g.name}: dynamic sizes, skipped")
        continue
    plan = g.static_plan.steps
    bufs = [None] * g.n_bufs
    tensor_args = [*(args[i] for i in g.tensor_inputs), *g.constants]
    for b, i in zip(g.static_plan.inputs.bufs, g.static_plan.inputs.args):
        bufs[b] = tensor_args[i]
    # Fresh allocations (not the in-place stores into inputs nor reused dying buffers).
    allocs = [a for st in plan for a in st.allocs if isinstance(a, runtime.NewBuf)]
    for buf, shp, st, dt in allocs:
        bufs[buf] = g.empty(shp, st, dt)
    arena = torch.empty(max(g.arena_bytes, 1), dtype=torch.uint8, device=dev)
    ptrs = [0 if t is None else t.data_ptr() for t in bufs]
    stream = g.raw_stream(g.device_index) if g.cuda else 0
    runs = [st.work for st in plan if not st.is_extern]
    n_ext = len(plan) - len(runs)
    print(f"{g.name}: {len(plan)} step(s) ({len(runs)} kernel runs, {n_ext} extern calls), {len(allocs)} allocations, arena {g.arena_bytes} B")
    print(f"   whole call          {per_call(lambda: g(list(args))):7.1f} us")
    if n_ext == 0:  # every buffer a run reads is bound above
        print(f"   runs alone          {per_call(lambda: [g.c.run(r, ptrs, [], stream, arena.data_ptr()) for r in runs]):7.1f} us")
    print(f"   allocations         {per_call(lambda: [g.empty(s, st, d) for _, s, st, d in allocs]):7.1f} us")
    print(f"   data_ptr list       {per_call(lambda: [0 if t is None else t.data_ptr() for t in bufs]):7.1f} us")
    print(f"   arena allocation    {per_call(lambda: g.empty((g.arena_bytes,), (1,), torch.uint8)):7.1f} us")
x = torch.randn(1024, device=dev)
print(f"eager x + 1            {per_call(lambda: x + 1):7.1f} us")
print(f"torch.mm 1024x768x3072 {per_call(lambda: torch.mm(inputs[0].view(-1, 768)[:1024], model.fc1.weight.t())):7.1f} us")
