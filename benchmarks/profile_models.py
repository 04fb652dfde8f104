"""Per-kernel GPU time of a real-model workload (the `--suite models` configurations) under
eager, braze and optionally Inductor (torch.profiler), with the step time and peak memory.

    python benchmarks/profile_models.py bert:inf bert:train resnet50:inf [--inductor] [--rows 25]

Prints, per backend, the kernels sorted by total GPU time, the launch count and the sum of
GPU time per step, so a workload slower than eager shows where the time goes. braze runs
with programmatic launch off, so that each kernel's duration is its own work.
"""
import argparse
import copy

import torch
from torch.profiler import ProfilerActivity, profile

import braze
from braze.bench_models import _make_step, autocast_of, prepared


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work", nargs="+")
    ap.add_argument("--inductor", action="store_true")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    dev = torch.device("cuda")
    for w in a.work:
        name, mode = w.split(":")
        train = mode == "train"
        base, inputs, desc = prepared(name, train, dev)
        backends = ["eager", "braze"] + (["inductor"] if a.inductor else [])
        for be in backends:
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if train else None
            torch._dynamo.reset()
            braze.stats.reset()
            # Programmatic launch off: a kernel launched early waits inside for the one before
            # it, and the profiler would count that wait in its duration.
            opts = {"options": {"programmatic_launch": False}} if be == "braze" else {}
            fn = model if be == "eager" else torch.compile(model, backend=be, **opts)
            step = _make_step(model, fn, inputs, train, dev, opt, autocast_of(name))
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            m0 = torch.cuda.memory_allocated()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(a.steps):
                    step()
                torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - m0) / 2**30
            evs = [e for e in prof.key_averages() if e.device_time_total > 0]
            total = sum(e.device_time_total for e in evs) / a.steps / 1e3
            launches = sum(e.count for e in evs) / a.steps
            print(f"==== {desc} {'train' if train else 'inference'} / {be}: GPU {total:.2f} ms per step, "
                  f"{launches:.0f} kernels, peak {peak:.2f} GiB")
            own = sum(e.device_time_total for e in evs if e.key.startswith(("braze_", "triton_"))) / a.steps / 1e3
            print(f"  generated kernels (braze_*, triton_*) {own:.3f} ms, the rest {total - own:.3f} ms")
            for e in sorted(evs, key=lambda e: -e.device_time_total)[:a.rows]:
                print(f"  {e.device_time_total / a.steps / 1e3:8.3f} ms {e.count // a.steps:5d}x  {e.key[:110]}")
            if be == "braze":
                st = braze.stats
                print(f"  braze: graphs {st.graphs_compiled}, eager graphs {st.graphs_eager}, extern ops {st.extern_ops}")
            del model, opt, fn, step
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
