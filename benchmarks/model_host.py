"""Host time of a real-model step (the `--suite models` configurations) under eager, Inductor
and braze: enqueue time per step (synchronized before, not after) against wall time, and for
braze the split of its graphs' call time into extern ATen calls and the rest (the Rust call
loop with its kernel runs, [Note: the call loop in Rust]).

    python benchmarks/model_host.py resnet50:inf [bert:train ...] [--steps 50] [--mode reduce-overhead]

Issue 10's fp32 convnets: mobilenet_v3_small:inf, resnet18:train (b32, no autocast).
"""
import argparse
import copy
import statistics
import time

import torch

import braze
from braze import runtime
from braze.bench_models import _make_step, autocast_of, prepared

acc = {"extern": 0, "calls": 0, "externs": 0, "graph": 0}
graphs = []
_init = runtime.CompiledGraph.__init__
_call = runtime.CompiledGraph.__call__


def _keep(self, *a):
    _init(self, *a)
    graphs.append(self)


def _timed_call(self, args, on_step=None):
    t = time.perf_counter_ns()
    r = _call(self, args, on_step)
    acc["graph"] += time.perf_counter_ns() - t
    acc["calls"] += 1
    return r


def _timed_target(target):
    def call(*a, **k):
        t = time.perf_counter_ns()
        r = target(*a, **k)
        acc["extern"] += time.perf_counter_ns() - t
        acc["externs"] += 1
        return r
    return call


def _instrument(g):
    if not g.dynamic:
        steps = [st._replace(work=st.work._replace(fn=_timed_target(st.work.fn))) if st.is_extern else st for st in g.static_plan.steps]
        g.static_plan = g.static_plan._replace(steps=steps)
        g.static_exec = g._executor(g.static_plan, [])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work", nargs="+")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--mode", default=None, help="torch.compile mode for Inductor and braze")
    ap.add_argument("--backends", default="eager,inductor,braze",
                    help="comma-separated; braze:KEY=VALUE[:KEY=VALUE] passes options (conv_layout=eager)")
    ap.add_argument("--profile", action="store_true", help="cProfile braze's timed steps (top functions by own time)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    runtime.CompiledGraph.__init__ = _keep
    for w in a.work:
        name, mode = w.split(":")
        train = mode == "train"
        base, inputs, desc = prepared(name, train, dev)
        print(f"== {desc} {'train' if train else 'inference'}{', mode ' + a.mode if a.mode else ''}", flush=True)
        for spec in a.backends.split(","):
            be, *opts = spec.split(":")
            options = {k: {"true": True, "false": False}.get(v.lower(), v) for k, v in (o.split("=", 1) for o in opts)}
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if train else None
            torch._dynamo.reset()
            graphs.clear()
            fn = model if be == "eager" else torch.compile(model, backend=be, mode=a.mode, **({"options": options} if options else {}))
            step = _make_step(model, fn, inputs, train, dev, opt, autocast_of(name))
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            if be == "braze":
                for g in graphs:
                    _instrument(g)
                runtime.CompiledGraph.__call__ = _timed_call
            for k in acc:
                acc[k] = 0
            host, wall = [], []
            prof = None
            if a.profile and be == "braze":
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            for _ in range(a.steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                step()
                t1 = time.perf_counter_ns()
                torch.cuda.synchronize()
                t2 = time.perf_counter_ns()
                host.append((t1 - t0) / 1e3)
                wall.append((t2 - t0) / 1e3)
            runtime.CompiledGraph.__call__ = _call
            if prof is not None:
                import pstats
                prof.disable()
                st = pstats.Stats(prof)
                st.sort_stats("tottime").print_stats(25)
                st.sort_stats("cumulative").print_stats(25)
            line = f"  {spec:9s} host {statistics.median(host):8.1f} us  wall {statistics.median(wall):8.1f} us"
            if be == "braze":
                n = a.steps
                rest = acc["graph"] - acc["extern"]
                line += (f"  | in graphs {acc['graph'] / n / 1e3:7.1f} us: extern calls {acc['extern'] / n / 1e3:7.1f} us ({acc['externs'] // n}),"
                         f" kernel runs and the call loop {rest / n / 1e3:6.1f} us")
            print(line, flush=True)
            if be == "braze" and a.mode:
                from braze import cudagraphs
                s = cudagraphs.stats
                print(f"    whole-graph replay: captures {s.captures}, replays {s.replays}, plain runs {s.plain_runs}, "
                      f"invalidated {s.invalidated}, not captured {s.not_captured}", flush=True)
            del step, fn, model, opt
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
