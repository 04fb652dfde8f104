"""The main job: ``python -m braze.bench`` runs the seed workloads on eager, Inductor and braze.

For each workload it prints median time per call, speedup over eager, kernels per call,
first-call (trace + compile) time and max error against eager, all measured in one run:
eager and compiled calls are interleaved, GPU work is timed with CUDA events, the first call
is timed in a fresh process per backend with cold caches (a fresh braze cache directory,
Inductor's caches off), after Dynamo's one-time set-up.
Uses the GPU when there is one, otherwise the CPU (with smaller sizes, named in the table).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

import braze
from braze.workloads import MatmulHeavy, PointwiseHeavy, TinyBlock


#: "seed": the seed documents' sizes on the CPU too (`--sizes seed`); "default": smaller CPU sizes.
_SIZES = ["default"]
#: torch.compile mode for the compiled backends (--mode); None gives no mode.
_MODE = [None]


def workloads(device):
    gpu = device.type == "cuda"
    full = gpu or _SIZES[0] == "seed"

    def pw():
        m = PointwiseHeavy(4096).to(device)
        return m, (torch.randn(1024, 4096, device=device),), "fp32 1024x4096", False

    def mm():
        dim, rows = (4096, 1024) if full else (1024, 512)
        m = MatmulHeavy(dim, 4).to(device)
        return m, (torch.randn(rows, dim, device=device),), f"fp32 {rows}x{dim}, 4 layers", False

    def tiny_inf():
        dtype = torch.float16 if gpu else torch.float32
        b, s = (32, 128) if gpu else (8, 128) if full else (8, 64)
        m = TinyBlock(768, 4).to(device=device, dtype=dtype).eval()
        return m, (torch.randn(b, s, 768, device=device, dtype=dtype),), f"{str(dtype)[6:]} {b}x{s}x768", False

    def tiny_train():
        b, s = (32, 128) if gpu else (8, 128) if full else (8, 64)
        m = TinyBlock(768, 4).to(device)
        return m, (torch.randn(b, s, 768, device=device),), f"fp32 {b}x{s}x768 fwd+bwd", True

    out = [("pointwise-heavy", pw), ("matmul-heavy", mm), ("TinyBlock inference", tiny_inf), ("TinyBlock train step", tiny_train)]
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timer(fn, device, reps):
    """Median ms of `reps` calls of fn."""
    ts = []
    for _ in range(reps):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        else:
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
    return ts


def make_step(model, inputs, train, fn):
    if train:
        params = [p for p in model.parameters()]

        def step():
            for p in params:
                p.grad = None
            out = fn(*inputs)
            out.float().sum().backward()
            return out
        return step

    def infer():
        with torch.inference_mode():
            return fn(*inputs)
    return infer


def warm_dynamo(device):
    """Dynamo's and AOTAutograd's one-time set-up (imports, first trace), paid before any
    first call is timed, so it is no backend's cost."""
    torch.compile(lambda x: torch.sin(x) + 1, backend="aot_eager")(torch.randn(8, device=device))
    torch._dynamo.reset()


def first_call(name, be, device):
    """The cold first call (trace + compile + run) of one workload under one backend, in this
    process; returns seconds and, for braze, its compile stages."""
    warm_dynamo(device)
    torch.manual_seed(0)
    model, inputs, shape, train = dict(workloads(device))[name]()
    make_step(model, inputs, train, model)()  # what eager needs once (CUDA context, cuBLAS)
    step = make_step(model, inputs, train, torch.compile(model, backend=be, mode=_MODE[0]))
    n0 = len(braze.stats.records)
    gc.collect()
    sync(device)
    t = time.perf_counter()
    step()
    sync(device)
    res = {"first_call_s": time.perf_counter() - t}
    if be == "braze":
        stages = {}
        for r in braze.stats.records[n0:]:
            for k, v in r.get("times", {}).items():
                stages[k] = stages.get(k, 0.0) + v
        res["stages"] = stages
    return res


def first_call_subprocess(name, be, device):
    cmd = [sys.executable, "-m", "braze.bench", "--first-call", name, "--backend", be, "--device", str(device), "--sizes", _SIZES[0]] + (["--mode", _MODE[0]] if _MODE[0] else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("FIRST_CALL "):
            return json.loads(line[len("FIRST_CALL "):])
    print(f"first call of {name} under {be} failed:\n{p.stderr[-2000:]}", file=sys.stderr)
    return {}


def run_workload(name, build, device, reps, backends, cold):
    torch.manual_seed(0)
    model, inputs, shape, train = build()
    eager_step = make_step(model, inputs, train, model)
    ref = eager_step().detach().float()
    steps = {"eager": eager_step}
    first = {"eager": 0.0}
    err = {"eager": 0.0}
    kernels = {}
    for be in backends:
        first[be] = cold[be].get("first_call_s", float("nan"))
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=be, mode=_MODE[0])
        step = make_step(model, inputs, train, compiled)
        n0 = len(braze.stats.records)
        out = step()
        err[be] = (out.detach().float() - ref).abs().max().item()
        if be == "braze":
            recs = braze.stats.records[n0:]
            kernels[be] = sum(len(r.get("kernels", [])) + sum(r.get("externs", {}).values()) for r in recs)
            kernels["braze_eager_graphs"] = sum(r["status"] == "eager" for r in recs)
            kernels["braze_stages"] = cold[be].get("stages")
        steps[be] = step
    for s in steps.values():  # warm up
        for _ in range(3):
            s()
    sync(device)
    times = {k: [] for k in steps}
    rounds = 5
    for _ in range(rounds):  # interleave
        for k, s in steps.items():
            times[k] += timer(s, device, max(1, reps // rounds))
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for k in ["eager"] + list(backends):
        rows.append({
            "workload": name, "shape": shape, "backend": k, "median_ms": med[k],
            "speedup": med["eager"] / med[k], "first_call_s": first[k], "max_err": err[k],
            "kernels": kernels.get(k), "eager_graphs": kernels.get("braze_eager_graphs") if k == "braze" else None,
            "compile_stages_s": kernels.get("braze_stages") if k == "braze" else None,
        })
    return rows


def overhead_cases(device):
    """Tiny graphs whose time is host work: the framework's own cost per call."""
    x = torch.randn(8, device=device)

    def add1(x):
        return x + 1

    def chain10(x):
        for _ in range(5):
            x = torch.sin(x) * 1.5 + 0.1
        return x

    blk = TinyBlock(32, 2).to(device).eval()
    xb = torch.randn(2, 4, 32, device=device)
    return [("x + 1", add1, x), ("chain of 10 pointwise ops", chain10, x), ("LayerNorm + MLP block", blk, xb)]


def run_overhead(device, backends, calls=2000):
    """Host µs per call of each overhead case. Each backend compiles, warms up and then waits
    two seconds before it is timed, braze before Inductor: a compile's after-effects
    (Inductor's compile workers stay busy for seconds) land on no other backend's timing."""
    rows = []
    order = sorted(backends, key=lambda b: b != "braze")
    for name, fn, x in overhead_cases(device):
        res = {}
        for be in ["eager"] + order:
            torch._dynamo.reset()
            f = fn if be == "eager" else torch.compile(fn, backend=be)
            with torch.inference_mode():
                for _ in range(50):
                    f(x)
                sync(device)
                time.sleep(2.0)
                t = time.perf_counter()
                for _ in range(calls):
                    f(x)
                sync(device)
            res[be] = (time.perf_counter() - t) / calls * 1e6
        rows.append({"graph": name, **{f"{k}_us": res[k] for k in ["eager"] + backends}})
    return rows


def plot_models(rows, path, title):
    """Speedup over eager and step peak memory per workload and backend, as grouped bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    works = list(dict.fromkeys(r["workload"] for r in rows))
    bes = list(dict.fromkeys(r["backend"] for r in rows))
    get = {(r["workload"], r["backend"]): r for r in rows}
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.3 * len(works)), 8))
    width = 0.8 / len(bes)
    for ax, key, label in ((axes[0], "speedup", "speedup over eager"), (axes[1], "peak_gib", "step peak memory (GiB)")):
        for k, be in enumerate(bes):
            vals = [(get.get((w, be)) or {}).get(key) or 0.0 for w in works]
            ax.bar([i + k * width for i in range(len(works))], vals, width, label=be)
        ax.set_xticks([i + width * (len(bes) - 1) / 2 for i in range(len(works))], works, rotation=20, ha="right")
        ax.set_ylabel(label)
        ax.legend()
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    if all(r.get("peak_gib") is None for r in rows):
        axes[1].set_title("step peak memory is measured on GPUs only")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m braze.bench", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=None, help="timed calls per backend (default 50 GPU, 15 CPU)")
    p.add_argument("--json", help="write the rows as JSON to this file")
    p.add_argument("--only", help="comma-separated workload names to run")
    p.add_argument("--no-inductor", action="store_true", help="skip TorchInductor")
    p.add_argument("--no-overhead", action="store_true", help="skip the host-overhead table")
    p.add_argument("--suite", choices=("seed", "models"), default="seed",
                   help="seed: the seed documents' workloads (default); models: GPT-2, Llama, BERT, ViT, ResNet-50 "
                        "at real sizes, inference and training (small sizes on CPU)")
    p.add_argument("--fsdp", action="store_true", help="with --suite models: also GPT-2 training under FSDP2 "
                   "(fully_shard per block) on every GPU through torchrun (2 or more GPUs; 2 processes on a CPU)")
    p.add_argument("--plot", help="with --suite models: draw speedup and step peak memory per workload to this image (matplotlib)")
    p.add_argument("--sizes", choices=("default", "seed"), default="default",
                   help="seed suite on the CPU: 'seed' runs the seed documents' sizes (matmul-heavy 1024x4096, TinyBlock "
                        "8x128x768) instead of the smaller default ones; the GPU always runs the seed sizes")
    p.add_argument("--mode", choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"), default=None,
                   help="torch.compile mode for Inductor and braze (seed suite; default: none given)")
    p.add_argument("--first-call", help=argparse.SUPPRESS)  # internal: one cold first call
    p.add_argument("--backend", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # Cold caches for this process and the ones it starts (set here, not at import: tools
    # that import the benchmark's workloads keep the user's braze cache).
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    # Dynamo warns on every compile that its profile-guided cache is off with the caches.
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
    os.environ["BRAZE_CACHE_DIR"] = tempfile.mkdtemp(prefix="braze-bench-cache-")
    device = torch.device(args.device)
    _SIZES[0] = args.sizes
    _MODE[0] = args.mode
    # Cold first calls for everyone: Inductor's on-disk caches off (the environment variable
    # alone is read too late when braze's package imported torch first).
    import torch._inductor.config as inductor_config

    inductor_config.force_disable_caches = True
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    if args.first_call:
        print("FIRST_CALL " + json.dumps(first_call(args.first_call, args.backend, device)), flush=True)
        return []
    reps = args.reps or (50 if device.type == "cuda" else 15)
    backends = ["braze"] if args.no_inductor else ["inductor", "braze"]
    rows = []
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"braze {braze.__version__} | torch {torch.__version__} | {card} | {time.strftime('%Y-%m-%d')}" + (f" | mode {args.mode}" if args.mode else ""), flush=True)
    if args.suite == "models":
        from .bench_models import run_models

        only = set(args.only.split(",")) if args.only else None
        rows = run_models(device, backends[::-1], args.reps or (20 if device.type == "cuda" else 3), only)
        if args.fsdp:
            from .bench_fsdp import run_fsdp

            print("[bench models] gpt2 train under FSDP2 ...", flush=True)
            fsdp_rows = run_fsdp(device, backends[::-1], args.reps or (20 if device.type == "cuda" else 5))
            for r in fsdp_rows:
                runs = r.get("runs_per_step")
                runs = f"  runs per step: {runs[0]} replayed, {runs[1]} captured, {runs[2]} launched item by item" if runs else ""
                own = f" (eager {r['eager_ms_same_process']:.3f} ms in its process)" if r["backend"] != "eager" else ""
                print(f"  {r['backend']:9s} {r['median_ms']:9.3f} ms  {r['speedup']:5.2f}x{own}  first {r['first_call_s']:6.1f} s{runs}", flush=True)
            rows += fsdp_rows
        if args.plot:
            plot_models(rows, args.plot, f"braze {braze.__version__} | torch {torch.__version__} | {card}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"torch": torch.__version__, "device": card, "braze": braze.__version__, "suite": "models", "rows": rows}, f, indent=1)
        return rows
    todo = [(n, b) for n, b in workloads(device) if not args.only or n in args.only.split(",")]
    # Cold first calls, each in a fresh process, all before anything compiles here, braze's
    # before Inductor's: an Inductor compile leaves compile-worker processes busy for seconds
    # afterwards, which slowed a compile that followed it tenfold (braze's NVRTC stage).
    cold = {n: {} for n, _ in todo}
    for be in sorted(backends, key=lambda b: b != "braze"):
        for name, _ in todo:
            cold[name][be] = first_call_subprocess(name, be, device)
    for name, build in todo:
        rows += run_workload(name, build, device, reps, backends, cold[name])
        print(f"  done: {name}", file=sys.stderr, flush=True)
    hdr = f"{'workload':22} {'shape':28} {'backend':9} {'median ms':>10} {'vs eager':>9} {'kernels':>8} {'first call s':>13} {'max err':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        k = "" if r["kernels"] is None else str(r["kernels"])
        print(f"{r['workload']:22} {r['shape']:28} {r['backend']:9} {r['median_ms']:10.3f} {r['speedup']:8.2f}x {k:>8} {r['first_call_s']:13.3f} {r['max_err']:9.2e}")
    print("\nbraze's own compile stages in each first call (ms; the rest is Dynamo and AOTAutograd)")
    for r in rows:
        if r["compile_stages_s"]:
            st = r["compile_stages_s"]
            parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in st.items() if k != "total")
            print(f"  {r['workload']:22} total {st.get('total', 0) * 1e3:6.1f} of {r['first_call_s'] * 1e3:6.1f}: {parts}")
    over = []
    if not args.no_overhead and not args.only:
        over = run_overhead(device, backends)
        print("\nhost time per call on tiny inputs (µs, 2000 calls; kernels are negligible here)")
        print(f"{'graph':28} " + " ".join(f"{b:>10}" for b in ["eager"] + backends))
        for r in over:
            print(f"{r['graph']:28} " + " ".join(f"{r[b + '_us']:10.1f}" for b in ["eager"] + backends))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": card, "braze": braze.__version__, "rows": rows, "overhead": over}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
