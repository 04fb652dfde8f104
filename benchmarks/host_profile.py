"""cProfile of braze's compiled TinyBlock training step (host side), plus each compiled graph's
plan (steps, allocations). Usage: python benchmarks/host_profile.py"""
import cProfile
import pstats

import torch

import braze
from braze import runtime
from braze.bench import make_step, workloads

torch.set_float32_matmul_precision("high")
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
graphs = []
_init = runtime.CompiledGraph.__init__


def _keep(self, *a):
    _init(self, *a)
    graphs.append(self)


runtime.CompiledGraph.__init__ = _keep
build = dict(workloads(dev))["TinyBlock train step"]
model, inputs, shape, train = build()
step = make_step(model, inputs, train, torch.compile(model, backend="braze"))
for _ in range(20):
    step()
for g in graphs:
    print(g.name, "inputs", len(g.input_nodes), "bufs", g.n_bufs, "arena", g.arena_bytes)
    for s, a in zip(g.steps, g.allocs):
        print("   step", s[0], (s[1], s[2]) if s[0] == "kernels" else s[3], "allocs", len(a))
    print("   outputs", [(b, v is not None, c) for (b, v), c in zip(g.outputs, g.copy_out)])
pr = cProfile.Profile()
pr.enable()
for _ in range(200):
    step()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(30)
