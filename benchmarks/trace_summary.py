"""Prints one profiled step of a Chrome trace written by trace_steps.py as a timeline: host
events (ops, CUDA runtime and driver calls, braze's Python calls) and GPU kernels, in µs
from the step's start. Usage: python benchmarks/trace_summary.py TRACE.json [STEP_INDEX]"""
import json
import sys

trace = json.load(open(sys.argv[1]))
which = int(sys.argv[2]) if len(sys.argv) > 2 else 1
ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
steps = sorted((e for e in ev if e.get("name") == "STEP" and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
step = steps[which]
t0, t1 = step["ts"], step["ts"] + step["dur"]
gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
# GPU work launched inside the step: kernels correlated to launches in the step's time span.
launch_ts = {e["args"].get("correlation"): e["ts"] for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver") and t0 <= e["ts"] <= t1}
rows = []
for e in ev:
    if e is step or not (t0 <= e["ts"] <= t1):
        continue
    if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "python_function", "user_annotation"):
        if e["dur"] >= 2 or e.get("cat") in ("cuda_runtime", "cuda_driver"):
            rows.append((e["ts"] - t0, e["dur"], "host", e["name"][:70]))
for e in gpu:
    if e["args"].get("correlation") in launch_ts:
        rows.append((e["ts"] - t0, e["dur"], "GPU ", e["name"][:70]))
rows.sort()
print(f"step {which}: {step['dur']:.0f} us")
for ts, dur, where, name in rows:
    print(f"{ts:8.1f} {dur:7.1f} {where} {name}")
busy = sum(d for _, d, w, _ in rows if w == "GPU ")
print(f"GPU busy {busy:.0f} us of {step['dur']:.0f}")
