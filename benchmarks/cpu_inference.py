"""CPU fp32 inference: eager vs braze vs Inductor (default, and with freezing) on the seed
matmul-heavy model, TinyBlock, ResNet-18, BERT-base and GPT-2 (random weights).

    python benchmarks/cpu_inference.py [--threads 2] [--only NAME ...] [--json OUT]

Calls of the backends are interleaved round by round; the table gives the median and the
minimum ms per call (on a shared machine the minimum is the steadier figure).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
os.environ.setdefault("BRAZE_CACHE_DIR", tempfile.mkdtemp(prefix="braze-cpu-bench-"))

import torch  # noqa: E402

import braze  # noqa: E402
from braze.workloads import MatmulHeavy, TinyBlock  # noqa: E402


def models():
    def mm():
        return MatmulHeavy(1024, 4), (torch.randn(512, 1024),)

    def tiny():
        return TinyBlock(768, 4), (torch.randn(8, 64, 768),)

    def resnet18():
        import torchvision
        return torchvision.models.resnet18(), (torch.randn(8, 3, 224, 224),)

    def bert():
        import transformers
        m = transformers.BertModel(transformers.BertConfig())
        return m, (torch.randint(0, 30522, (1, 128)),)

    def gpt2():
        import transformers
        m = transformers.GPT2Model(transformers.GPT2Config())
        return m, (torch.randint(0, 50257, (1, 128)),)

    return {"matmul-heavy": mm, "TinyBlock": tiny, "ResNet-18 b8": resnet18, "BERT-base s128": bert, "GPT-2 s128": gpt2}


def _out(r):
    if isinstance(r, torch.Tensor):
        return r
    if hasattr(r, "last_hidden_state"):
        return r.last_hidden_state
    return r[0]


def _inductor_freezing(gm, example_inputs):
    import torch._inductor.config as ic
    from torch._inductor.compile_fx import compile_fx
    with ic.patch(freezing=True):
        return compile_fx(gm, example_inputs)


def _braze_aten(gm, example_inputs):
    """braze with every CPU linear left to aten.mm/addmm (the code before prepacked linears)."""
    os.environ["BRAZE_CPU_LINEAR"] = "0"
    try:
        return braze.backend.braze_backend(gm, example_inputs)
    finally:
        del os.environ["BRAZE_CPU_LINEAR"]


# Distinct callables, so Dynamo never reuses one backend's compiled code for another.
_BACKENDS = {"braze": "braze", "braze-aten": _braze_aten, "inductor": "inductor", "inductor-freezing": _inductor_freezing}


def run(name, build, backends, rounds):
    torch.manual_seed(0)
    model, inputs = build()
    model.eval()
    fns = {}
    for be in backends:
        if be == "eager":
            fns[be] = model
        elif be == "braze-freeze":  # parameters constant between updates: prepacked weights
            fns[be] = torch.compile(model, backend="braze", options={"freeze_weights": True})
        else:
            fns[be] = torch.compile(model, backend=_BACKENDS[be])
    res = {}
    ref = None
    with torch.inference_mode():
        for be, f in fns.items():
            t0 = time.perf_counter()
            out = _out(f(*inputs)).float()
            first = time.perf_counter() - t0
            ref = out if ref is None else ref
            res[be] = {"first_s": first, "err": (out - ref).abs().max().item(), "ts": []}
            for _ in range(2):
                f(*inputs)
        for _ in range(rounds):
            for be, f in fns.items():
                t0 = time.perf_counter()
                f(*inputs)
                res[be]["ts"].append((time.perf_counter() - t0) * 1e3)
    for be, r in res.items():
        ts = r.pop("ts")
        r["median_ms"] = statistics.median(ts)
        r["min_ms"] = min(ts)
    torch._dynamo.reset()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--backends", nargs="*", default=["eager", "braze-aten", "braze", "braze-freeze", "inductor", "inductor-freezing"])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    all_res = {}
    print(f"torch {torch.__version__}, {a.threads} threads, fp32 inference; ms per call: median / min")
    for name, build in models().items():
        if a.only and name not in a.only:
            continue
        res = run(name, build, a.backends, a.rounds)
        all_res[name] = res
        e = res["eager"]["min_ms"]
        cells = "  ".join(f"{be} {r['median_ms']:.2f}/{r['min_ms']:.2f} (x{e / r['min_ms']:.2f}, err {r['err']:.1e}, 1st {r['first_s']:.1f}s)"
                          for be, r in res.items())
        print(f"{name:16s} {cells}", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(all_res, f, indent=1)
    ext = {k: v for k, v in braze.stats.extern_ops.items()}
    print("braze extern ops:", ext)


if __name__ == "__main__":
    sys.exit(main())
