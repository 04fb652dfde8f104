"""max-autotune's configurations of braze's own kernels (issue 10 item 3, [Note: kernel
configurations] in braze-codegen): every candidate configuration computes what eager does,
the search keeps one, and its choice is remembered across processes.

On the CPU the graphs run braze's C kernels, and every candidate configuration of their CUDA
kernels is compiled by NVRTC (BRAZE_CHECK_CUDA, as CI runs it). On the GPU each configuration
index is forced in turn (BRAZE_KERNEL_CONFIG) and run against eager."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import braze
from braze import _core
from braze.config import Config

#: More than any kernel's candidate count: forcing index i runs candidate i % count of each.
MAX_CANDIDATES = 11  # a column kernel's: 6 geometries, 2 unrollings, scalar, 2 clusters


class Block(torch.nn.Module):
    """A transformer MLP block: warp-per-row LayerNorm, bias-gradient column sums, a
    row softmax and pointwise epilogues."""

    def __init__(self, d=192):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 2 * d)
        self.out = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.out(F.gelu(self.fc(self.ln(x))))
        return x + h, h.softmax(-1)


def _reductions(x):
    """Long rows (a block per row), tiny rows (a thread per row), columns, arg-reductions."""
    return x.log_softmax(-1), x.view(-1, 4).sum(-1), x.sum(0), x.amax(0), x.argmax(0), torch.var_mean(x.float(), 0)


class ConvBN(torch.nn.Module):
    """BatchNorm statistics and backward sums of a channels_last activation (column
    Welford kernels, hoisted per-channel pointwise kernels)."""

    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(32)

    def forward(self, x):
        return F.relu(self.bn(x))


def _cases(device):
    g = torch.Generator().manual_seed(0)
    yield "block", Block(), lambda: torch.randn(8, 64, 192, generator=g), True
    yield "reductions", _reductions, lambda: torch.randn(96, 3000, generator=g), False
    yield "conv_bn", ConvBN(), lambda: torch.randn(8, 32, 20, 20, generator=g).to(memory_format=torch.channels_last), True


def _run(fn, x, train, dtype, device):
    x = x.to(device=device, dtype=dtype).requires_grad_(train)
    out = fn(x)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))]
    flat = []
    for o in outs:
        flat.extend(o if isinstance(o, (tuple, list)) else (o,))
    if train:
        sum((o.float() * (i + 1)).mean() for i, o in enumerate(flat) if o.is_floating_point()).backward()
        flat.append(x.grad)
        if isinstance(fn, torch.nn.Module):
            flat.extend(p.grad for p in fn.parameters())
    return flat


def _check(name, fn, make, train, dtype, device):
    x = make()
    model = fn.to(device=device, dtype=dtype) if isinstance(fn, torch.nn.Module) else fn
    if isinstance(model, torch.nn.Module):
        model.zero_grad(set_to_none=True)
    want = _run(model, x, train, dtype, device)
    if isinstance(model, torch.nn.Module):
        model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    c = torch.compile(model, backend="braze", options={"kernel_tune": True, "on_unsupported": "error"})
    got = _run(c, x, train, dtype, device)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for i, (a, b) in enumerate(zip(got, want)):
        if a.dtype == torch.int64:
            assert torch.equal(a, b), f"{name} output {i}"
        else:
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name} output {i}: {m}")
    assert braze.stats.graphs_eager == 0


def test_modes_turn_kernel_tune_on():
    assert Config.make("max-autotune").kernel_tune
    assert Config.make("max-autotune-no-cudagraphs").kernel_tune
    assert not Config.make("default").kernel_tune
    assert not Config.make("reduce-overhead").kernel_tune
    assert not Config.make("max-autotune", {"kernel_tune": False}).kernel_tune


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_every_configuration_matches_eager(device, dtype, monkeypatch, tmp_path):
    """Each candidate index forced on every tuned kernel (GPU), or every candidate compiled
    by NVRTC beside the C kernels (CPU), against eager on fresh inputs."""
    monkeypatch.setenv("BRAZE_CACHE_DIR", str(tmp_path))
    if device == "cpu":
        before = _core.nvrtc_kernels_compiled()
        for name, fn, make, train in _cases(device):
            _check(name, fn, make, train, dtype, device)
        tuned = _core.nvrtc_kernels_compiled() - before
        monkeypatch.setenv("BRAZE_CACHE_DIR", str(tmp_path / "plain"))
        before = _core.nvrtc_kernels_compiled()
        for name, fn, make, train in _cases(device):
            torch._dynamo.reset()
            model = fn.to(dtype=dtype) if isinstance(fn, torch.nn.Module) else fn
            c = torch.compile(model, backend="braze")
            _run(c, make(), train, dtype, device)
        plain = _core.nvrtc_kernels_compiled() - before
        if os.environ.get("BRAZE_CHECK_CUDA") == "1" and braze.cuda.nvrtc_available():
            # Several configurations of most kernels were compiled.
            print("nvrtc kernels: tuned", tuned, "plain", plain)
            assert tuned > 3 * plain > 0, (tuned, plain)
        return
    for i in range(MAX_CANDIDATES):
        monkeypatch.setenv("BRAZE_KERNEL_CONFIG", str(i))
        for name, fn, make, train in _cases(device):
            _check(f"{name} (configuration {i})", fn, make, train, dtype, device)


CHILD = r'''
import sys, torch, braze
from braze import _core
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.Linear(256, 256), torch.nn.GELU()).cuda().to(torch.bfloat16)
x = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
c = torch.compile(m, backend="braze", mode="max-autotune-no-cudagraphs")
torch.testing.assert_close(c(x), m(x), rtol=2e-2, atol=2e-2)
print("timed", _core.kernels_timed())
'''


def test_search_is_remembered_across_processes(device, tmp_path):
    """max-autotune times the kernels once; a later process with the same cache times none."""
    if device != "cuda":
        pytest.skip("times kernels on the GPU")
    env = dict(os.environ, BRAZE_CACHE_DIR=str(tmp_path))
    env.pop("BRAZE_KERNEL_CONFIG", None)
    runs = [subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    timed = [int(r.stdout.split("timed")[-1]) for r in runs]
    assert timed[0] > 0 and timed[1] == 0, timed
