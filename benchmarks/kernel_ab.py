"""Per-kernel GPU time of real-model workloads (the `--suite models` configurations) under two
braze option sets in one process (torch.profiler): which of braze's kernels an option makes
faster or slower, and by how much per step.

    python benchmarks/kernel_ab.py mobilenet_v3_small:train resnet18:train \\
        --b column_clusters=false [--a KEY=VALUE ...] [--steps 10] [--pdl]

Both variants run with programmatic launch off unless `--pdl`: under it a kernel starts before
the one ahead of it has finished and its measured duration includes that wait. Rows are per
kernel name, µs per step in A and in B (kernels of several graphs that share a name are summed),
with the kernel's cluster size, threads per block, kind (`col`: a scalar column kernel, `colv`:
a vector column kernel) and loop shape (outer × inner) from A's source and schedule, sorted by
A − B. The end-to-end figure is the sum of all kernels' time per step; time steps with
`benchmarks/option_ab.py`.
"""
import argparse
import copy
import re

import torch
from torch.profiler import ProfilerActivity, profile

import braze
from braze.bench_models import _make_step, autocast_of, prepared


def _options(pairs, pdl):
    opts = {k: {"true": True, "false": False}.get(v.lower(), v) for k, v in (p.split("=", 1) for p in pairs)}
    opts.setdefault("programmatic_launch", pdl)
    return opts


def _kernel_facts(records):
    """Kernel name -> (cluster, threads, kind, shape) from the compiled graphs' CUDA source and
    schedule text."""
    facts = {}
    for r in records:
        src, sched = r.get("source") or "", r.get("schedule") or ""
        shapes = {m.group(1): f"{m.group(2)} x {m.group(3)}" for m in re.finditer(r"kernel (\w+) outer=(\[[^\]]*\]) inner=(\[[^\]]*\])", sched)}
        for m in re.finditer(r"__global__ void (?:__cluster_dims__\((\d+), 1, 1\) )?__launch_bounds__\((\d+)\) (\w+)\(", src):
            body = src[m.end():src.find("\n}\n", m.end())]
            kind = "colv" if "bz_colv_" in body else ("col" if "bz_col_" in body else "")
            facts[m.group(3)] = (m.group(1) or "1", m.group(2), kind, shapes.get(m.group(3), ""))
    return facts


def _per_step(step, steps):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / steps for e in prof.key_averages() if e.device_time_total > 0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work", nargs="+", help="NAME:infer|train (NAME from --suite models)")
    ap.add_argument("--a", nargs="*", default=[], help="braze options of variant A (KEY=VALUE)")
    ap.add_argument("--b", nargs="*", default=[], help="braze options of variant B (KEY=VALUE)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--pdl", action="store_true", help="keep programmatic launch on in both")
    ap.add_argument("--min-us", type=float, default=1.0, help="rows whose A - B is smaller are left out")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernel_ab.py profiles GPU kernels: no CUDA device here")
    dev = torch.device("cuda")
    variants = {"A": _options(a.a, a.pdl), "B": _options(a.b, a.pdl)}
    for w in a.work:
        name, kind = w.split(":")
        train = kind == "train"
        base, inputs, desc = prepared(name, train, dev)
        times, facts = {}, {}
        for v, opts in variants.items():
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if train else None
            torch._dynamo.reset()
            n0 = len(braze.stats.records)
            fn = torch.compile(model, backend="braze", options=opts)
            step = _make_step(model, fn, inputs, train, dev, opt, autocast_of(name))
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            facts[v] = _kernel_facts(braze.stats.records[n0:])
            times[v] = _per_step(step, a.steps)
            braze_us = sum(t for k, t in times[v].items() if k.startswith("braze"))
            print(f"== {desc} {kind}, {v} {opts}: GPU {sum(times[v].values()) / 1e3:.3f} ms per step, braze's kernels {braze_us / 1e3:.3f}", flush=True)
        rows = []
        for k in set(times["A"]) | set(times["B"]):
            if k.startswith("braze"):
                ta, tb = times["A"].get(k, 0.0), times["B"].get(k, 0.0)
                rows.append((ta - tb, k, ta, tb, facts["A"].get(k, ("?", "?", "", ""))))
        rows.sort()
        print(f"  {'A-B us':>8} {'A':>8} {'B':>8}  cluster threads kind  kernel  shape")
        for d, k, ta, tb, (cl, thr, kd, shape) in rows:
            if abs(d) >= a.min_us:
                print(f"  {d:8.1f} {ta:8.1f} {tb:8.1f}  {cl:>7} {thr:>7} {kd:4}  {k[:60]}  {shape[:80]}")


if __name__ == "__main__":
    main()
