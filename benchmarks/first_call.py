"""First calls of the `--suite models` workloads, each in its own process (issue 12):
Dynamo + AOTAutograd alone (`aot_eager`: the same tracing and partitioning, graphs run by
eager), braze with a cold cache, braze again with that cache warm, and optionally Inductor
(its caches off). Prints seconds, braze's own stages, and the ratios the issue's targets
name: cold braze / Inductor (<= 0.5) and warm braze / Dynamo + AOTAutograd (<= 1.2), the latter
against `aot_eager` (no decompositions, the default partitioner) and against Dynamo and
AOTAutograd as braze sets them up (its decompositions, the min-cut partitioner; graphs run by
eager), which is what braze's first call takes outside its own stages.

    python benchmarks/first_call.py gpt2:train bert:inf ... [--inductor] [--device cuda] [--profile DIR] [--repeat N]

With `--repeat N` each child runs N times (fresh processes; the cold braze call with a fresh
cache each time) and the fastest is kept: on the H100 machines single first calls of ~10 s
spread by 2-3 s, more than the differences the targets measure. The warm call's braze stages
are printed one by one.

A first call is the model's first step (forward, and in training the backward and the
optimizer step) from a fresh process with the model built and moved to the device.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r'''
import json, os, sys, time
import torch
from braze.bench_models import _make_step, autocast_of, prepared
backend, work, device = sys.argv[1], sys.argv[2], torch.device(sys.argv[3])
name, mode = work.split(":")
train = mode == "train"
model, inputs, _ = prepared(name, train, device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda") if train else None
if backend == "braze":
    import braze
    fn = torch.compile(model, backend="braze", options={"on_unsupported": "error"})
elif backend == "braze_aot":
    # Dynamo and AOTAutograd as braze configures them (its decompositions, the min-cut
    # partitioner, input mutations kept), the graphs run by eager: what braze's first call
    # takes outside its own stages.
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from braze.backend import _partition
    from braze.decomp import decomposition_table
    nop = lambda gm, ex: make_boxed_func(gm.forward)
    fn = torch.compile(model, backend=aot_autograd(fw_compiler=nop, bw_compiler=nop, inference_compiler=nop,
                                                   decompositions=decomposition_table(), partition_fn=_partition,
                                                   keep_inference_input_mutations=True))
else:
    fn = torch.compile(model, backend=backend)
step = _make_step(model, fn, inputs, train, device, opt, autocast_of(name))
if device.type == "cuda":
    torch.cuda.synchronize()
profile = os.environ.get("FIRST_CALL_PROFILE")
if profile:
    import cProfile
    pr = cProfile.Profile()
    pr.enable()
t = time.perf_counter()
step()
if device.type == "cuda":
    torch.cuda.synchronize()
wall = time.perf_counter() - t
if profile:
    import pstats
    pr.disable()
    with open(profile, "w") as f:
        pstats.Stats(pr, stream=f).sort_stats("cumulative").print_stats(80)
        pstats.Stats(pr, stream=f).sort_stats("tottime").print_stats(40)
stages = {}
if backend == "braze":
    for r in braze.stats.records:
        for k, v in r.get("times", {}).items():
            stages[k] = round(stages.get(k, 0) + v, 3)
print(json.dumps({"wall": wall, "stages": stages}))
'''


def child(backend, work, device, env, profile=None):
    if profile:
        env = dict(env, FIRST_CALL_PROFILE=profile)
    r = subprocess.run([sys.executable, "-c", CHILD, backend, work, device], env=env, capture_output=True, text=True)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{backend} {work} failed:\n{r.stderr[-3000:]}")
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work", nargs="+", help="workload:inf or workload:train (bench_models names)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--inductor", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each child; the fastest is kept")
    ap.add_argument("--profile", metavar="DIR", help="write cProfile statistics of the warm braze first call and of "
                    "Dynamo + AOTAutograd as braze sets them up to DIR/<workload>.{braze,aot}.txt (the profiler slows both)")
    a = ap.parse_args()
    for work in a.work:
        cache = tempfile.mkdtemp(prefix="braze-first-call-")
        env = dict(os.environ, BRAZE_CACHE_DIR=cache, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
        # Dynamo + AOTAutograd first, so the cold braze call does not pay the process's
        # first-import costs alone (each child is a fresh process anyway).
        def fastest(backend, fresh_cache=False):
            runs = []
            for _ in range(a.repeat):
                e = dict(env, BRAZE_CACHE_DIR=tempfile.mkdtemp(prefix="braze-first-call-")) if fresh_cache else env
                runs.append(child(backend, work, a.device, e))
            return min(runs, key=lambda r: r["wall"])

        aot = fastest("aot_eager")
        aot_b = fastest("braze_aot")
        cold = fastest("braze", fresh_cache=a.repeat > 1)
        if a.repeat > 1:
            child("braze", work, a.device, env)  # fills `cache`: the cold runs had caches of their own
        warm = fastest("braze")
        if a.profile:
            os.makedirs(a.profile, exist_ok=True)
            stem = os.path.join(a.profile, work.replace(":", "_"))
            child("braze", work, a.device, env, stem + ".braze.txt")
            child("braze_aot", work, a.device, env, stem + ".aot.txt")
        row = (f"{work:18s} Dynamo+AOT {aot['wall']:6.2f} s, as braze sets them up {aot_b['wall']:6.2f} s | braze cold {cold['wall']:6.2f} s "
               f"(stages {cold['stages'].get('total', 0):5.2f}) | warm {warm['wall']:6.2f} s (stages {warm['stages'].get('total', 0):5.2f}, "
               f"{warm['wall'] / aot['wall']:.2f}x Dynamo+AOT, {warm['wall'] / aot_b['wall']:.2f}x as braze sets them up)")
        stages = ", ".join(f"{k} {v:.2f}" for k, v in warm["stages"].items() if k != "total" and v >= 0.005)
        row += f"\n{'':18s} warm braze stages: {stages or 'none over 5 ms'}"
        if a.inductor:
            ind = fastest("inductor")
            row += f" | Inductor {ind['wall']:6.2f} s (cold braze {cold['wall'] / ind['wall']:.2f}x)"
        print(row, flush=True)


if __name__ == "__main__":
    main()
