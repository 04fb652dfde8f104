"""Host timeline of the TinyBlock training step under braze, without a profiler: when each
part of the step starts and ends (µs from the step's start, median over many steps), with
braze's runtime call split into its parts, and the step's wall time (synchronized).
Usage: python benchmarks/step_timeline.py"""
import statistics
import time

import torch

from braze import autograd as direct, runtime
from braze.bench import make_step, workloads

torch.set_float32_matmul_precision("high")
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
now = time.perf_counter_ns
marks = []
_run_orig = None


def mark(label):
    marks.append((label, now()))


class _Timed:
    """Wraps a Compiled object: marks the start and end of each run() call."""

    def __init__(self, c, name):
        self.c, self.name = c, name

    def run(self, *a):
        mark(f"{self.name} run start")
        r = self.c.run(*a)
        mark(f"{self.name} run end")
        return r

    def __getattr__(self, k):
        return getattr(self.c, k)


_init, _call = runtime.CompiledGraph.__init__, runtime.CompiledGraph.__call__


def _init_timed(self, compiled, lowered, name):
    _init(self, compiled, lowered, name)
    self.c = _Timed(self.c, name)
    empty = self.empty

    def empty_timed(*a):
        r = empty(*a)
        mark(f"{name} allocated {a[0]}")
        return r
    self.empty = empty_timed


def _call_timed(self, args):
    mark(f"{self.name} call start")
    r = _call(self, args)
    mark(f"{self.name} call end")
    return r


_relayout = runtime.CompiledGraph._relayout


def _relayout_timed(self, t, shape, stride, stream):
    mark(f"relayout of an input {tuple(shape)} starts")
    r = _relayout(self, t, shape, stride, stream)
    mark(f"relaid out an input {tuple(shape)}")
    return r


runtime.CompiledGraph._relayout = _relayout_timed
runtime.CompiledGraph.__init__ = _init_timed
runtime.CompiledGraph.__call__ = _call_timed
_fw, _bw = direct._BrazeFunction.forward, direct._BrazeFunction.backward


def _fw_timed(ctx, *a):
    mark("Function.forward start")
    return _fw(ctx, *a)


def _bw_timed(ctx, *g):
    mark("Function.backward start")
    r = _bw(ctx, *g)
    mark("Function.backward end")
    return r


direct._BrazeFunction.forward = staticmethod(_fw_timed)
direct._BrazeFunction.backward = staticmethod(_bw_timed)


model, inputs, shape, train = dict(workloads(dev))["TinyBlock train step"]()
fn = torch.compile(model, backend="braze")
params = list(model.parameters())


def step():
    for p in params:
        p.grad = None
    mark("step start")
    out = fn(*inputs)
    mark("forward returned")
    loss = out.float().sum()
    mark("loss computed")
    loss.backward()
    mark("backward returned")


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


for _ in range(20):
    step()
sync()
rows, walls = {}, []
for _ in range(200):
    marks.clear()
    sync()
    t0 = now()
    step()
    sync()
    walls.append((now() - t0) / 1e3)
    start = marks[0][1]
    for i, (label, t) in enumerate(marks):
        rows.setdefault((i, label), []).append((t - start) / 1e3)
for (i, label), ts in sorted(rows.items()):
    print(f"{statistics.median(ts):8.1f} us  {label}")
print(f"{statistics.median(walls):8.1f} us  wall (synchronized)")
