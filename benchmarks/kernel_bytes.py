"""DRAM bytes and time of every kernel of one step of a models-suite workload, read from the
hardware counters by Nsight Compute, so each generated kernel's bandwidth shows (a kernel far
below the card's copy bandwidth is worth a look; one moving more bytes than its rival's is a
fusion or layout question).

On the GPU machine (Firecracker runtimes: ncu reads the counters there):

    ncu --clock-control none --profile-from-start off --csv --metrics \\
        gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        python3 benchmarks/kernel_bytes.py resnet18:train braze > braze.csv
        # [--options '{"column_clusters": false}']: braze options for the step
    python3 benchmarks/kernel_bytes.py --report braze.csv inductor.csv

The step runs three times before the profiled one (compilation, warm caches); only the
fourth is inside the profiler range. braze runs with programmatic launch off (a kernel
launched early would count its wait for the one before it).
"""
import argparse
import copy
import csv
import io
import sys
from collections import defaultdict


def run(work, backend, options=None):
    import json

    import torch

    import braze  # noqa: F401
    from braze.bench_models import _make_step, autocast_of, prepared

    name, mode = work.split(":")
    train = mode == "train"
    dev = torch.device("cuda")
    base, inputs, _ = prepared(name, train, dev)
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if train else None
    opts = {"options": {"programmatic_launch": False, **json.loads(options or "{}")}} if backend == "braze" else {}
    fn = model if backend == "eager" else torch.compile(model, backend=backend, **opts)
    step = _make_step(model, fn, inputs, train, dev, opt, autocast_of(name))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def read(path):
    """{kernel name: [launches, ns, bytes read, bytes written]} from an ncu --csv file."""
    text = open(path).read()
    start = text.find('"ID"')
    rows = csv.DictReader(io.StringIO(text[start:]))
    per = defaultdict(lambda: {})
    for r in rows:
        key = (r["ID"], r["Kernel Name"])
        v = float(r["Metric Value"].replace(",", ""))
        unit = r["Metric Unit"]
        scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1, "usecond": 1e3, "msecond": 1e6}.get(unit, 1)
        per[key][r["Metric Name"]] = v * scale
    out = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for (_, name), m in per.items():
        o = out[name]
        o[0] += 1
        o[1] += m.get("gpu__time_duration.sum", 0)
        o[2] += m.get("dram__bytes_read.sum", 0)
        o[3] += m.get("dram__bytes_write.sum", 0)
    return out


def report(paths, rows):
    for p in paths:
        k = read(p)
        gen = {n: v for n, v in k.items() if n.startswith(("braze_", "triton_"))}
        tot = [sum(v[i] for v in k.values()) for i in range(4)]
        g = [sum(v[i] for v in gen.values()) for i in range(4)]
        print(f"== {p}: {tot[0]} launches, {tot[1] / 1e3:.1f} us, {(tot[2] + tot[3]) / 1e6:.1f} MB; "
              f"generated {g[0]} launches, {g[1] / 1e3:.1f} us, {(g[2] + g[3]) / 1e6:.1f} MB "
              f"({(g[2] + g[3]) / max(g[1], 1):.0f} GB/s)")
        print(f"  {'us':>8s} {'n':>3s} {'MB read':>8s} {'MB written':>10s} {'GB/s':>6s}  kernel")
        for n, (c, ns, rd, wr) in sorted(k.items(), key=lambda kv: -kv[1][1])[:rows]:
            print(f"  {ns / 1e3:8.1f} {c:3d} {rd / 1e6:8.2f} {wr / 1e6:10.2f} {(rd + wr) / max(ns, 1):6.0f}  {n[:100]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("args", nargs="+")
    ap.add_argument("--report", action="store_true", help="the arguments are ncu CSV files")
    ap.add_argument("--rows", type=int, default=60)
    ap.add_argument("--options", default=None, help='braze options as JSON: {"column_clusters": false}')
    a = ap.parse_args()
    if a.report:
        report(a.args, a.rows)
    else:
        run(*a.args, options=a.options)


if __name__ == "__main__":
    sys.exit(main())
