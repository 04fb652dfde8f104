"""Compile time grows no faster than the graph.

A BERT-base-sized training graph (12 encoder blocks, bf16 autocast, forward and backward) is
compiled next to a 1-block one, and each of braze's own stages (lowering in Python, passes,
scheduling, code generation) must take at most ``SLACK`` times as long, relative to the
small graph, as the graphs' node counts say. A stage that is quadratic in the graph's size
is about 10x over that budget at this size. The C compiler is left out (it runs on every
unit in parallel; its time is the system compiler's), and so is NVRTC's check.

The model is plain ``torch.nn`` (no transformers needed): BERT's layer, narrow, since the
graph's size, not its tensors', is what is measured. Stage times are the fastest of a few
recompiles of the same graphs (the C compiler's disk cache answers those), so a slow or
busy machine measures both graphs alike.
"""
import math
import os
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import braze
from braze import backend

SLACK = 2.0  # allowed (big/small time) / (big/small nodes)
FLOOR_S = 0.002  # small-graph stage times below this count as this (timer noise)
STAGES = ("lower", "passes", "schedule", "codegen")
REPEATS = 5  # fastest of: a loaded 2-core CI machine times single runs loosely


class Layer(nn.Module):
    """BERT's encoder layer: self-attention, add & norm, GELU feed-forward, add & norm."""

    def __init__(self, h, heads, ffn, p):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.up, self.down = nn.Linear(h, ffn), nn.Linear(ffn, h)
        self.drop = nn.Dropout(p)

    def forward(self, x, mask):
        b, s, h = x.shape
        split = lambda t: t.view(b, s, self.heads, h // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = q @ k.transpose(-1, -2) / math.sqrt(h // self.heads) + mask
        ctx = self.drop(att.softmax(-1)) @ v
        x = self.ln1(x + self.drop(self.o(ctx.transpose(1, 2).reshape(b, s, h))))
        return self.ln2(x + self.drop(self.down(F.gelu(self.up(x)))))


class Bert(nn.Module):
    """Embeddings, `n` layers, the masked-LM head and its loss."""

    def __init__(self, n, h=64, heads=4, ffn=256, vocab=128, seq=16, p=0.1):
        super().__init__()
        self.tok, self.pos, self.typ = nn.Embedding(vocab, h), nn.Embedding(seq, h), nn.Embedding(2, h)
        self.ln = nn.LayerNorm(h)
        self.drop = nn.Dropout(p)
        self.layers = nn.ModuleList(Layer(h, heads, ffn, p) for _ in range(n))
        self.head, self.head_ln, self.dec = nn.Linear(h, h), nn.LayerNorm(h), nn.Linear(h, vocab)

    def forward(self, ids, labels, attn):
        s = ids.shape[1]
        x = self.drop(self.ln(self.tok(ids) + self.pos(torch.arange(s, device=ids.device)) + self.typ(torch.zeros_like(ids))))
        mask = (1.0 - attn[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, mask)
        logits = self.dec(self.head_ln(F.gelu(self.head(x))))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1))


def stage_times(n_layers, monkeypatch):
    """(FX nodes, {stage: seconds}) over the forward and backward graphs of an n-layer step."""
    torch._dynamo.reset()
    seen = []
    lower = backend.lower_graph

    def keep(gm, name, *rest, **kw):
        lowered = lower(gm, name, *rest, **kw)
        seen.append((gm, name, lowered))
        return lowered

    monkeypatch.setattr(backend, "lower_graph", keep)
    torch.manual_seed(0)
    model = Bert(n_layers).train()
    ids = torch.randint(0, 128, (2, 16))
    labels = torch.randint(0, 128, (2, 16))
    attn = torch.ones(2, 16, dtype=torch.long)
    n0 = len(braze.stats.records)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.compile(model, backend="braze")(ids, labels, attn)
    loss.backward()  # the backward graph was compiled ahead of time, with the forward
    recs = braze.stats.records[n0:]
    assert [r["status"] for r in recs] == ["compiled", "compiled"], [r.get("reason") for r in recs]
    monkeypatch.setattr(backend, "lower_graph", lower)
    nodes = sum(len(gm.graph.nodes) for gm, _, _ in seen)
    best = {s: 0.0 for s in STAGES}
    for gm, name, _ in seen:
        per = {s: math.inf for s in STAGES}
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            lowered = lower(gm, name)
            per["lower"] = min(per["lower"], time.perf_counter() - t0)
            times = dict(lowered.builder.compile(device="cpu", check_cuda=False).times)
            for s in STAGES[1:]:
                per[s] = min(per[s], times[s])
        for s in STAGES:
            best[s] += per[s]
    return nodes, best


def test_stage_times_grow_linearly(monkeypatch):
    # The first compile of each graph runs cc on every unit; NVRTC's check of the CUDA code
    # would double that and is not what is measured.
    monkeypatch.setenv("BRAZE_CHECK_CUDA", "0")
    small_nodes, small = stage_times(1, monkeypatch)
    big_nodes, big = stage_times(12, monkeypatch)
    ratio = big_nodes / small_nodes
    assert ratio > 5, (small_nodes, big_nodes)
    report = ", ".join(f"{s} {small[s] * 1e3:.1f} -> {big[s] * 1e3:.1f} ms" for s in STAGES)
    over = [s for s in STAGES if big[s] > SLACK * ratio * max(small[s], FLOOR_S)]
    assert not over, f"stages {over} grew faster than the graph ({small_nodes} -> {big_nodes} FX nodes, x{ratio:.1f}): {report}"


def _train_step(n_layers, compiled):
    torch.manual_seed(0)
    model = Bert(n_layers).train()
    ids = torch.randint(0, 128, (2, 16))
    attn = torch.ones(2, 16, dtype=torch.long)
    torch.manual_seed(1)
    # eager_random: the compiled step's dropout draws eager's masks, so the two steps compare.
    fn = torch.compile(model, backend="braze", options={"on_unsupported": "error", "eager_random": True}) if compiled else model
    loss = fn(ids, ids, attn)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def test_kernels_cached_one_by_one(monkeypatch, tmp_path):
    """[Note: kernel dedup] and [Note: per-kernel cache]: a 3-layer training step emits each
    repeated layer's kernels once, and a 2-layer model compiled afterwards (other graphs,
    other buffer ids) finds every kernel in the disk cache and compiles nothing; both match
    eager (dropout included: with option eager_random both draw eager's masks from one seed)."""
    monkeypatch.setenv("BRAZE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BRAZE_CHECK_CUDA", "0")
    for layers, cached in ((3, False), (2, True)):
        torch._dynamo.reset()
        n0 = len(braze.stats.records)
        loss, grads = _train_step(layers, compiled=True)
        recs = braze.stats.records[n0:]
        assert [r["status"] for r in recs] == ["compiled", "compiled"]
        assert all(r["cached"] == cached for r in recs), [(r["name"], r["cached"], r["times"].get("cc")) for r in recs]
        if layers == 3:
            fns = sum(r["source"].count("\nvoid braze_") for r in recs)
            kernels = sum(len(r["kernels"]) for r in recs)
            assert fns < 0.6 * kernels, (fns, kernels)
        want_loss, want_grads = _train_step(layers, compiled=False)
        torch.testing.assert_close(loss, want_loss, atol=1e-4, rtol=1e-4)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-3)
    assert _one_kernel_more(braze._core.cc_kernels_compiled) == [3, 1]


@pytest.mark.skipif(not braze.cuda.nvrtc_available(), reason="needs NVRTC")
def test_cuda_kernels_cached_one_by_one(monkeypatch, tmp_path):
    """[Note: per-kernel CUDA cache]: the CUDA kernels of CPU graphs (checked with NVRTC,
    BRAZE_CHECK_CUDA) are cached one by one. A 2-layer training step after a 3-layer one
    compiles no kernel; a graph with one kernel more than one compiled before, its inputs
    numbered the other way round (parameters in first-use order, not by buffer id), compiles
    that kernel alone. Every result matches eager."""
    monkeypatch.setenv("BRAZE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BRAZE_CHECK_CUDA", "1")
    compiled = braze._core.nvrtc_kernels_compiled
    for layers, none_new in ((3, False), (2, True)):
        torch._dynamo.reset()
        n0 = compiled()
        loss, grads = _train_step(layers, compiled=True)
        assert (compiled() == n0) == none_new, (layers, compiled() - n0)
        want_loss, want_grads = _train_step(layers, compiled=False)
        torch.testing.assert_close(loss, want_loss, atol=1e-4, rtol=1e-4)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-3)

    assert _one_kernel_more(compiled) == [3, 1]


_WORKERS_CHILD = r"""
import os, sys, torch, braze
from braze import _core, cuda
assert cuda.nvrtc_available()
print("started", cuda.start_nvrtc_workers())
def f(x, y):
    return torch.softmax(x @ y, -1).sum(0), (x.sin() * 2).amax(1), torch.nn.functional.gelu(y).mean(0)
x, y = torch.randn(64, 96), torch.randn(96, 80)
got = torch.compile(f, backend="braze", options={"on_unsupported": "error"})(x, y)
# Against eager in float64: eager's float32 (x.sin() * 2).amax(1) was wrong by 3e-4 in about
# half the rows in ~3% of fresh processes on the 2-core CPU (torch 2.15, without braze imported).
for a, b in zip(got, f(x.double(), y.double())):
    torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=1e-5)
print("compiled", _core.nvrtc_kernels_compiled(), "on workers", _core.nvrtc_worker_compiles())
try:
    _core.nvrtc_compile('extern "C" __global__ void k(float* x) { x[0] = undeclared; }', "sm_90")
except Exception as e:
    print("error", "undeclared" in str(e) and "NVRTC failed" in str(e))
"""


@pytest.mark.skipif(not braze.cuda.nvrtc_available(), reason="needs NVRTC")
@pytest.mark.parametrize("workers", [2, 0])
def test_nvrtc_worker_processes(tmp_path, workers):
    """[Note: NVRTC worker processes]: with workers started, a graph's CUDA kernels (a CPU graph
    checked with NVRTC, BRAZE_CHECK_CUDA) compile on them, a kernel that does not compile
    reports NVRTC's log as before, and the results match eager; BRAZE_NVRTC_WORKERS=0 starts
    none and compiles in-process. In a child process: the workers live as long as it."""
    import subprocess
    import sys

    env = dict(os.environ, BRAZE_CACHE_DIR=str(tmp_path), BRAZE_CHECK_CUDA="1", BRAZE_NVRTC_WORKERS=str(workers))
    out = subprocess.run([sys.executable, "-c", _WORKERS_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["started"] == str(workers)
    compiled = lines["compiled"].split()
    assert int(compiled[0]) >= 2, out.stdout
    # Every unit compiled went to a worker (units hold one or more kernels), or none did.
    assert (int(compiled[-1]) > 0) == (workers > 0), out.stdout
    assert lines["error"] == "True"


def _one_kernel_more(compiled):
    """Kernels newly compiled (by the counter `compiled`) for a graph of four reductions (three
    kernels: the column sums of x and of y read the same inputs as the row reductions and
    fuse, [Note: sibling fusion]), then
    for a graph of those four and one more whose first use of `y` numbers its buffer before
    `x`'s: the four are found in the cache only if a kernel's parameters follow its body's
    first use, not buffer ids. Results checked against eager."""
    def four(x, y):
        return x.sin().sum(0), (x * y).amax(1), torch.exp(y).mean(0), (x - y).abs().sum(1)

    def five(x, y):
        return (y.cos().sum(),) + four(x, y)

    x, y = torch.randn(64, 96), torch.randn(64, 96)
    new = []
    for f in (four, five):
        torch._dynamo.reset()
        n0 = compiled()
        got = torch.compile(f, backend="braze", options={"on_unsupported": "error"})(x, y)
        new.append(compiled() - n0)
        for a, b in zip(got, f(x, y)):
            torch.testing.assert_close(a, b)
    return new


_TUNE_CHILD = r"""
import sys, torch, braze
torch.manual_seed(int(sys.argv[2]))
mode = sys.argv[1]
x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
w = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
img = torch.randn(32, 128, 56, 56, device="cuda").to(memory_format=torch.channels_last)
k = torch.randn(128, 128, 3, 3, device="cuda") / 30
def f(x, w, img, k):
    return torch.relu(x @ w), torch.nn.functional.conv2d(img, k, padding=1).sigmoid()
n0, k0 = braze._core.tunings_timed(), braze._core.kernels_timed()
got = braze.compile(f, mode=mode, options={"on_unsupported": "error"})(x, w, img, k)
want = f(x, w, img, k)
torch.testing.assert_close(got[0], want[0], atol=0.5, rtol=0.02)
torch.testing.assert_close(got[1], want[1], atol=1e-2, rtol=1e-2)
kernels = braze._core.kernels_timed() - k0
print("timed", braze._core.tunings_timed() - n0 - kernels, kernels)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_max_autotune_times_once_and_default_times_nothing(tmp_path):
    """Mode 'default' picks cuBLASLt algorithms and cuDNN plans by the libraries' heuristics
    and times nothing; 'max-autotune' times the matmul's and the convolution's candidates and
    braze's own kernels' configurations ([Note: kernel configurations]), and a later process
    with the same cache directory reuses those choices from disk ([Note: remembered
    choices]) and times nothing. Each process's results match eager."""
    import os
    import subprocess
    import sys

    def timed(mode, seed):
        env = dict(os.environ, BRAZE_CACHE_DIR=str(tmp_path))
        env.pop("BRAZE_MATMUL_TUNE", None)
        out = subprocess.run([sys.executable, "-c", _TUNE_CHILD, mode, str(seed)], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        libraries, kernels = out.stdout.split("timed")[-1].split()
        return int(libraries), int(kernels)

    assert timed("default", 0) == (0, 0)
    libraries, kernels = timed("max-autotune", 1)
    assert libraries == 2 and kernels >= 1, (libraries, kernels)
    assert sorted({p.name.split("-")[0] for p in (tmp_path / "tune").iterdir()}) == ["cublaslt", "cudnn", "kernels"]
    assert timed("max-autotune", 2) == (0, 0)
    assert timed("max-autotune-no-cudagraphs", 3) == (0, 0)
