"""What is alive at the peak of one steady step of a real-model workload, by allocation
site: replays the CUDA caching allocator's trace (`torch.cuda.memory._record_memory_history`)
of the step and prints the live blocks at the highest point with the Python frames that
allocated them. Complements `step_probe.py`, which sees only braze's plan steps.

    python benchmarks/mem_peak.py NAME:MODE [BACKEND]   (NAME, MODE as in step_probe.py;
                                                         BACKEND braze (default) | inductor | eager)
"""
import sys

import torch

from braze import bench_models as bm

MiB = 2**20


def main():
    name, mode = sys.argv[1].split(":")
    backend = sys.argv[2] if len(sys.argv) > 2 else "braze"
    train = mode == "train"
    dev = torch.device("cuda")
    model, inputs, desc = bm.prepared(name, train, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if train else None
    fn = model if backend == "eager" else torch.compile(model, backend=backend)
    step = bm._make_step(model, fn, inputs, train, dev, opt, bm.autocast_of(name))
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated() - base
    live, cur, best, best_live = {}, 0, -1, {}
    for ev in snap["device_traces"][0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]
        if cur > best:
            best, best_live = cur, dict(live)
    print(f"== {desc} {mode} under {backend}: peak {peak / MiB:.0f} MiB above the {base / MiB:.0f} MiB resident; "
          f"{best / MiB:.0f} MiB allocated within the step at its highest point")
    # Live blocks at the peak grouped by allocation site (the innermost two Python frames) and
    # by pass: "backward" where AOTAutograd's backward is on the stack.
    groups = {}
    for ev in best_live.values():
        frames = [f for f in ev.get("frames", []) if f["filename"].endswith(".py")]
        site = " < ".join(f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames[:2])
        where = "backward" if any("backward" in f["name"] for f in frames) else "forward/other"
        n, total = groups.get((where, site), (0, 0))
        groups[(where, site)] = (n + 1, total + ev["size"])
    for (where, site), (n, total) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:16]:
        print(f"  {total / MiB:8.1f} MiB in {n:3d} blocks  {where:13s} {site}")


if __name__ == "__main__":
    main()
