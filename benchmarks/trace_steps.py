"""Chrome traces (CPU + CUDA) of a few calls of the TinyBlock training step, eager and braze,
written to $OUT (or /tmp). Read them with chrome://tracing or benchmarks/trace_summary.py.
Usage: python benchmarks/trace_steps.py (env BRAZE_TRACE_WORKLOADS, BRAZE_TRACE_BACKENDS:
comma-separated names)"""
import os

import torch
from torch.profiler import ProfilerActivity, profile

import braze  # noqa: F401
from braze.bench import make_step, workloads

torch.set_float32_matmul_precision("high")
out = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
for name, build in workloads(dev):
    if name not in os.environ.get("BRAZE_TRACE_WORKLOADS", "TinyBlock train step,TinyBlock inference").split(","):
        continue
    for be in os.environ.get("BRAZE_TRACE_BACKENDS", "eager,braze,inductor").split(","):
        torch.manual_seed(0)
        model, inputs, shape, train = build()
        torch._dynamo.reset()
        fn = model if be == "eager" else torch.compile(model, backend=be)
        step = make_step(model, inputs, train, fn)
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                torch.cuda.synchronize()
                with torch.profiler.record_function("STEP"):
                    step()
                torch.cuda.synchronize()
        tag = name.split()[-1]
        prof.export_chrome_trace(os.path.join(out, f"trace_{tag}_{be}.json"))
        print("wrote", tag, be, flush=True)
