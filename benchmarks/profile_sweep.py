"""Per-kernel GPU time of one of `gpu_sweep.py`'s models (bf16 autocast, its real sizes) under
eager, braze and Inductor, one process: step time, braze's compile stages, and the kernels by
total GPU time per step (torch.profiler). braze runs with programmatic launch off, so each
kernel's duration is its own work.

    python benchmarks/profile_sweep.py convnext_tiny [--train] [--rows 22] [--no-inductor]

What found ConvNeXt-T's NCHW-ordered layer-scale kernels ([Note: permuted views keep their
order] in braze-ir); `BRAZE_LOGS=output_code` then shows a kernel's code.
"""
import argparse
import copy
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import braze

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_sweep import _main_output, build  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--rows", type=int, default=22)
    ap.add_argument("--no-inductor", action="store_true")
    a = ap.parse_args()
    base, inf_inputs, train_inputs = build(a.name, False, torch.device("cuda"))
    base.train(a.train)
    inputs = train_inputs if a.train else inf_inputs
    for be in ["eager", "braze"] + ([] if a.no_inductor else ["inductor"]):
        m = copy.deepcopy(base)
        torch._dynamo.reset()
        braze.stats.reset()
        opts = {"options": {"on_unsupported": "error", "programmatic_launch": False}} if be == "braze" else {}
        fn = m if be == "eager" else torch.compile(m, backend=be, **opts)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) if a.train else None

        def step(fn=fn, opt=opt):
            with torch.autocast("cuda", dtype=torch.bfloat16), torch.set_grad_enabled(a.train):
                out = fn(inputs["x"]) if "x" in inputs else fn(**inputs)
            if a.train:
                loss = out.loss if getattr(out, "loss", None) is not None else _main_output(out).float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first = time.perf_counter() - t
        for r in braze.stats.records if be == "braze" else []:
            print(f"  {r['name']} stages: " + ", ".join(f"{k} {v:.3f} s" for k, v in r.get("times", {}).items()))
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        print(f"== {be}: {(time.perf_counter() - t) / 20 * 1e3:.3f} ms/step, first call {first:.1f} s", flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        kernels = {}
        for e in p.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = kernels.setdefault(e.name, [0, 0.0])
                k[0] += 1
                k[1] += e.device_time_total
        total = sum(v[1] for v in kernels.values()) / 5
        print(f"   GPU time per step {total:.1f} us, kernels per step {sum(v[0] for v in kernels.values()) / 5:.0f}")
        for n, (c, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:a.rows]:
            print(f"   {us / 5:9.1f} us {c // 5:4d}x  {n[:110]}")


if __name__ == "__main__":
    main()
