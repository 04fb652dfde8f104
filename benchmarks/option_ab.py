"""A/B of backends and braze option sets on the models suite's workloads, in one process:
each variant's first call (and braze's compile stages), then interleaved rounds of steps,
timed synchronized one by one and back to back (what a training loop sees).

    python benchmarks/option_ab.py mobilenet_v3_small:reduce-overhead:train gpt2:default:train \\
        --variants "braze;braze:programmatic_launch=false" [--rounds 8 --steps 10]

A workload is NAME:MODE:infer|train (NAME from `--suite models`, MODE default or
reduce-overhead); a variant is a backend (eager, inductor, braze) with braze options as
:KEY=VALUE, and environment variables as :env.NAME=VALUE (set while the variant compiles,
its first call and warm-up steps: a trial switch read by the compiler, `braze:env.BZX_X=off`).
Compare figures within one run: machines differ by more than most changes.
"""
import argparse
import copy
import os
import statistics
import time
from unittest import mock

import torch

import braze
from braze.bench_models import _make_step, autocast_of, prepared


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work", nargs="+")
    ap.add_argument("--variants", default="braze;braze:programmatic_launch=false")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for w in a.work:
        name, mode, kind = w.split(":")
        train = kind == "train"
        base, inputs, desc = prepared(name, train, dev)
        print(f"== {desc} {kind} mode={mode}", flush=True)
        runs = {}
        for spec in a.variants.split(";"):
            be, *opts = spec.split(":")
            pairs = [o.split("=", 1) for o in opts]
            env = {k[4:]: v for k, v in pairs if k.startswith("env.")}
            options = {k: {"true": True, "false": False}.get(v.lower(), v) for k, v in pairs if not k.startswith("env.")}
            env_set = mock.patch.dict(os.environ, env)
            env_set.start()
            model = copy.deepcopy(base)
            opt = None
            if train:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
            torch._dynamo.reset()
            if be == "eager":
                fn = model
            elif be == "braze":
                if mode == "reduce-overhead":
                    options["whole_graph_replay"] = True
                fn = torch.compile(model, backend="braze", options=options or None)
            else:
                fn = torch.compile(model, backend=be, mode=None if mode == "default" else mode)
            step = _make_step(model, fn, inputs, train, dev, opt, autocast_of(name))
            n0 = len(braze.stats.records)
            t0 = time.perf_counter()
            step()
            sync()
            first = time.perf_counter() - t0
            stages = {}
            for r in braze.stats.records[n0:]:
                for k, v in r.get("times", {}).items():
                    stages[k] = stages.get(k, 0.0) + v
            line = f"  {spec}: first call {first:.2f} s"
            if stages:
                line += ", braze stages " + " ".join(f"{k} {v:.2f}" for k, v in stages.items())
            print(line, flush=True)
            for _ in range(3):
                step()
            sync()
            env_set.stop()
            runs[spec] = step
        synced = {s: [] for s in runs}
        b2b = {s: [] for s in runs}
        for _ in range(a.rounds):
            for s, step in runs.items():
                for _ in range(a.steps):
                    sync()
                    t = time.perf_counter()
                    step()
                    sync()
                    synced[s].append((time.perf_counter() - t) * 1e3)
                sync()
                t = time.perf_counter()
                for _ in range(a.steps):
                    step()
                sync()
                b2b[s].append((time.perf_counter() - t) * 1e3 / a.steps)
        for s in runs:
            print(f"  {s:45s} synced median {statistics.median(synced[s]):8.3f} ms, min {min(synced[s]):8.3f} | "
                  f"back to back per round {' '.join(f'{v:.3f}' for v in b2b[s])} (median {statistics.median(b2b[s]):.3f})", flush=True)
        del runs
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
