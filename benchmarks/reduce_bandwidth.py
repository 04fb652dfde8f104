"""Bandwidth of reductions over non-innermost dims and of layout copies on the GPU (issue 9,
items 2 and 3), as a share of the card's copy bandwidth measured in the same run.

    python benchmarks/reduce_bandwidth.py [--shape 64,256,56,56] [--dtype bf16] [--only NAME ...] [--tuned]

--tuned adds braze with option kernel_tune (max-autotune's kernel configurations, [Note: kernel
configurations]) and prints what it chose for each kernel: threads per block, a column
kernel's geometry (vector columns: threads across points by threads along the rows, points per
thread), vector rows' width, the reduction loop's unrolling, a tiled copy's tile.

Cases, each under eager, Inductor and braze (`on_unsupported="error"`):
  bn_stats_cl / bn_stats_nchw   var_mean(x.float(), (0, 2, 3)): BatchNorm statistics of a
                                channels_last / contiguous activation
  bn_bwd_cl / bn_bwd_nchw       the two sums of BatchNorm's backward over N, H, W:
                                sum(g) and sum(g * (x - mean))
  to_cl                         a contiguous activation laid out channels_last (a copy)
  transpose                     a 2-d transpose made contiguous (rows = N * C, cols = H * W)

GPU time per call is the time some kernel of the call ran in torch.profiler (the union of
their intervals: launch gaps left out, overlapping kernels counted once), the median over
rounds. Bytes are what the work must read and write at least. Copy bandwidth is
`out.copy_(x)` of the activation, (read + written bytes) / time. The issue's targets: the
BatchNorm statistics >= 70% of copy bandwidth in either layout; an unavoidable copy (to_cl,
transpose) >= 80%.
"""
import argparse
import re
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cases(shape, dtype, device="cuda"):
    """name -> (function, arguments, bytes it must read and write at least)."""
    n, c, h, w = shape
    x = torch.randn(shape, device=device, dtype=dtype)
    x_cl = x.contiguous(memory_format=torch.channels_last)
    g = torch.randn_like(x)
    g_cl = g.contiguous(memory_format=torch.channels_last)
    mean = torch.randn(1, c, 1, 1, device=device)
    el = x.numel() * x.element_size()
    stats = lambda t: torch.var_mean(t.float(), (0, 2, 3), correction=0)  # noqa: E731
    bwd = lambda g, t, m: (g.float().sum((0, 2, 3)), (g.float() * (t.float() - m)).sum((0, 2, 3)))  # noqa: E731
    return {
        "bn_stats_cl": (stats, (x_cl,), el),
        "bn_stats_nchw": (stats, (x,), el),
        "bn_bwd_cl": (bwd, (g_cl, x_cl, mean), 2 * el),
        "bn_bwd_nchw": (bwd, (g, x, mean), 2 * el),
        "to_cl": (lambda t: t.contiguous(memory_format=torch.channels_last), (x,), 2 * el),
        "transpose": (lambda t: t.reshape(n * c, h * w).t().contiguous(), (x,), 2 * el),
    }


def gpu_us(fn, args, calls=20, rounds=5):
    """Median over rounds of the GPU time of one call (µs): its kernels' device time summed."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    per_round = []
    for _ in range(rounds):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn(*args)
            torch.cuda.synchronize()
        per_round.append(_busy_us(prof) / calls)
    return statistics.median(per_round)


def _busy_us(prof):
    """The time some kernel of the profile ran (µs): the union of the kernels' intervals.
    A sum of their durations would count twice where kernels overlap: under programmatic
    launch ([Note: programmatic launch]) a kernel starts while its predecessor runs and waits
    for it inside, so its duration includes that wait."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="64,256,56,56")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--tuned", action="store_true", help="also braze with kernel_tune, and the configurations it chose")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("reduce_bandwidth.py measures GPU kernels: no CUDA device here")
    from braze import runtime

    made = []
    init = runtime.CompiledGraph.__init__

    def keep(self, *args):
        init(self, *args)
        made.append(self)
    runtime.CompiledGraph.__init__ = keep

    shape = [int(v) for v in a.shape.split(",")]
    dtype = DTYPES[a.dtype]
    table = cases(shape, dtype)
    x = table["bn_stats_nchw"][1][0]
    out = torch.empty_like(x)
    copy_us = gpu_us(lambda: out.copy_(x), ())
    copy_bw = 2 * x.numel() * x.element_size() / copy_us / 1e3  # GB/s
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {a.dtype} {tuple(shape)}")
    print(f"copy: {copy_us:.1f} us, {copy_bw:.0f} GB/s (read + written)")
    print(f"{'case':14s} {'eager us':>9s} {'inductor us':>12s} {'braze us':>9s}   braze GB/s  (% of copy)" + ("  tuned us  (% of copy)" if a.tuned else ""))
    for name, (fn, args, nbytes) in table.items():
        if a.only and name not in a.only:
            continue
        row = [gpu_us(fn, args)]
        runs = [("inductor", None), ("braze", {"on_unsupported": "error"})]
        if a.tuned:
            runs.append(("braze", {"on_unsupported": "error", "kernel_tune": True}))
        for backend, opts in runs:
            torch._dynamo.reset()
            made.clear()
            row.append(gpu_us(torch.compile(fn, backend=backend, options=opts), args))
        chosen = [k for g in made for k in _configs(g.c.source)]
        bw = nbytes / row[2] / 1e3
        tuned = f"  {row[3]:8.1f}  ({100 * nbytes / row[3] / 1e3 / copy_bw:4.0f}%)" if a.tuned else ""
        print(f"{name:14s} {row[0]:9.1f} {row[1]:12.1f} {row[2]:9.1f}   {bw:10.0f}  ({100 * bw / copy_bw:4.0f}%){tuned}", flush=True)
        for line in chosen if a.tuned else ():
            print(f"    {line}")


def _configs(source):
    """Each kernel of a CUDA module's source: its name, threads per block, column geometry,
    vector width, reduction-loop unrolling and tile, as the code says."""
    out = []
    for part in source.split("/* braze_")[1:]:
        name = part.split(":", 1)[0]
        bounds = re.search(r"__launch_bounds__\((\d+)\)", part)
        col = re.search(r"bz_col_\w+<(\d+), (\d+)>", part)
        colv = re.search(r"bz_colv_\w+<(\d+), (\d+), (\d+)>", part)
        rows = re.search(r"rv \* (\d+)", part)
        tile = re.search(r"__shared__ float tile0\[(\d+)\]\[(\d+)\]", part)
        unroll = re.search(r"#pragma unroll (\d+)", part)
        out.append(f"braze_{name}: {bounds.group(1) if bounds else '?'} threads" + (f", columns {col.group(1)}x{col.group(2)}" if col else "")
                   + (f", vector columns {colv.group(1)}x{colv.group(2)} threads, {colv.group(3)} points each" if colv else "")
                   + (f", vector rows of {rows.group(1)}" if rows else "")
                   + (f", unroll {unroll.group(1)}" if unroll else "") + (f", tiles {tile.group(1)}x{int(tile.group(2)) - 1}" if tile else ""))
    return out


if __name__ == "__main__":
    main()
