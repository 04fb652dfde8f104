"""Where a compiled model's time and memory go, plan step by plan step (braze's debugging
workflow, seed 003): each graph's steps with the wall time between steps and, on CUDA, the
allocator's peak during the step and the graph's live buffers at the step of its peak.

    python benchmarks/step_probe.py NAME:MODE [...]     (NAME from `braze.bench --suite models`:
                                                         gpt2, llama, bert, vit, resnet50;
                                                         MODE inference | train)

Uses `CompiledGraph.__call__(args, on_step=...)`; runs the model as the models suite does
(bf16 autocast; real sizes on a GPU, small ones on the CPU). Times on CUDA are host times
unless BRAZE_PROBE_SYNC=1 synchronizes after each step.
"""
import collections
import os
import sys
import time

import torch

from braze import bench_models as bm
from braze import runtime as rt

MiB = 2**20
SYNC = os.environ.get("BRAZE_PROBE_SYNC") == "1"


def probe(spec, dev):
    name, mode = spec.split(":")
    train = mode == "train"
    build, make_inputs, desc = bm._configs(dev.type == "cuda")[name]
    torch.manual_seed(0)
    model = build().to(dev)
    model.train(train)
    inf_in, tr_in = make_inputs(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda") if train else None
    torch._dynamo.reset()
    step = bm._make_step(model, torch.compile(model, backend="braze"), tr_in if train else inf_in, train, dev, opt)
    for _ in range(3):
        step()
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() if cuda else 0
    windows = {}
    graphs = {}
    log = []  # (graph, step, label, seconds, peak bytes above base, live [(buf, bytes)])
    orig = rt.CompiledGraph.__call__

    def traced(self, args, on_step=None):
        last = [time.perf_counter()]
        n = [0]

        def seen(kind, what, bufs):
            if SYNC and cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            label = f"kernels {what}" if kind == 0 else f"extern {getattr(what, '__name__', what)}"
            peak = torch.cuda.max_memory_allocated() - base if cuda else 0
            live = [(b, t.untyped_storage().nbytes(), f"{self.bufs[b][0]}:{str(t.dtype)[6:]}{list(t.shape)}") for b, t in enumerate(bufs) if t is not None]
            log.append((self.name, n[0], label, now - last[0], peak, live))
            windows[self.name] = self.arena_windows
            graphs[self.name] = self
            n[0] += 1
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            last[0] = time.perf_counter()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        return orig(self, args, on_step=seen)
    rt.CompiledGraph.__call__ = traced
    try:
        step()
    finally:
        rt.CompiledGraph.__call__ = orig
    if cuda:
        torch.cuda.synchronize()
    print(f"== {desc} {mode}: {len(log)} steps, {base / MiB:.0f} MiB resident before the step")
    per_kind = collections.Counter()
    for g, i, label, sec, peak, live in log:
        per_kind[label.split(" ")[0] + " " + (label.split(" ")[1] if label.startswith("extern") else "")] += sec
    for k, v in per_kind.most_common(12):
        print(f"  {k:60s} {v * 1e3:9.2f} ms")
    if cuda:
        g, i, label, sec, peak, live = max(log, key=lambda r: r[4])
        top = ", ".join(f"b{b} {d} {n / MiB:.1f}" for b, n, d in sorted(live, key=lambda x: -x[1])[:10])
        print(f"  peak {peak / MiB:.0f} MiB above resident in {g} step {i} ({label}); {sum(x[1] for x in live) / MiB:.0f} MiB in {len(live)} live tensors; largest: {top}")
        _plan_near(graphs[g], i)
        for name, ws in windows.items():
            print(f"  {name} arena windows (first step, last step, MiB): {[(lo, hi, round(n / MiB, 1)) for lo, hi, n in ws]}")
        by_step = {}
        for g, i, label, sec, peak, live in log:
            by_step.setdefault(g, []).append((i, round(peak / MiB), round(sum(x[1] for x in live) / MiB), label[:40]))
        for name, rows in by_step.items():
            print(f"  {name} (step, peak MiB during it, live tensor MiB after it, step):")
            for r in rows[:: max(1, len(rows) // 24)]:
                print(f"    {r}")


def _plan_near(g, peak_step):
    """The plan around the peak step: what each step allocates outside the arena (buffer,
    kind, dtype, shape, MiB, and the buffer whose memory it takes), the operands an extern
    call gets as arena views, what it frees, and the arena window it opens."""
    plan = (g.static_plan if not g.dynamic else g.template_plan).steps
    for s in range(max(0, peak_step - 3), min(len(plan), peak_step + 2)):
        st = plan[s]
        label = f"extern {getattr(st.work.target, '__name__', st.work.target)}" if st.is_extern else "kernels"
        def desc(b):
            kind_, _, dt, *_ = g.bufs[b]
            shape = g.static[1][b] if not g.dynamic else "?"
            n = 1
            for d in (shape if shape != "?" else ()):
                n *= d
            return f"b{b} {kind_}:{dt}{list(shape) if shape != '?' else shape} {n * rt._TORCH_DTYPES[dt].itemsize / MiB:.1f}"
        print(f"    step {s} {label}: arena opens {st.arena_opens / MiB:.1f} MiB{', closes' if st.arena_closes else ''}")
        for x in st.allocs:
            print(f"      alloc {desc(x.buf)}" + (f" (memory of b{x.dying})" if isinstance(x, rt.ReuseBuf) else ""))
        if st.is_extern and st.work.in_arena:
            print("      arena operands " + ", ".join(desc(x[0]) for x in st.work.in_arena))
        if st.frees:
            print("      frees " + ", ".join(desc(b) for b in st.frees if g.bufs[b][0] != "input"))


if __name__ == "__main__":
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for spec in sys.argv[1:] or ["gpt2:inference"]:
        probe(spec, dev)
