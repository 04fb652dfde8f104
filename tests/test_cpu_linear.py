"""CPU linears through prepacked library kernels ([Note: CPU linears] in braze/cpu_linear.py)
and large f32 matmuls through oneDNN where it is this CPU's faster GEMM ([Note: CPU GEMM
library]): compared with eager on fresh random inputs under both f32 libraries whichever this
CPU measured faster, asserting which library call ran, that the packed weight is reused across
calls and repacked after an in-place update, and that training graphs pack nothing."""
import pytest
import torch
from torch import nn

import braze
from braze import cpu_linear
from braze.cpu_linear import CpuLinear
from braze.workloads import MatmulHeavy, TinyBlock

# Prepacked linears are opt-in: weights count as constant between version-counter bumps.
FREEZE = {"freeze_weights": True}

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")

BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.fixture(params=["blas", "onednn"])
def f32_lib(request, monkeypatch):
    """The f32 GEMM library, forced ([Note: CPU GEMM library]: measured per process otherwise)."""
    if request.param == "blas" and not torch._C.has_mkl:
        pytest.skip("prepacked f32 linears through the BLAS need MKL")
    monkeypatch.setattr(cpu_linear, "_F32_LIBRARY", [request.param])
    return request.param


def _packed_f32(lib, fused=""):
    """The extern name of a prepacked f32 linear under `lib` (MKL's path fuses no activation)."""
    return "mkl._mkl_linear[packed]" if lib == "blas" else f"mkldnn._linear_pointwise{fused}[packed]"


def _n_packed(ops):
    return sum(v for k, v in ops.items() if k.endswith("[packed]"))


def _specs():
    """The CpuLinear call sites of the graphs this test compiled."""
    out = [s for r in braze.stats.records for s in r.get("cpu_linears", ())]
    assert all(isinstance(s, CpuLinear) for s in out)
    return out


def _tol(dtype):
    return dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)


class MLP(nn.Module):
    def __init__(self, act, d=48, h=96, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(d, h, bias=bias)
        self.fc2 = nn.Linear(h, d, bias=bias)
        self.act = act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x))) + x


ACTS = {
    "relu": torch.relu,
    "gelu": nn.functional.gelu,
    "gelu_tanh": lambda t: nn.functional.gelu(t, approximate="tanh"),
    "silu": nn.functional.silu,
}

DTYPES = [torch.float32] + ([torch.bfloat16] if BF16 else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rank", [2, 3])
def test_mlp_matches_eager(dtype, act, bias, rank, f32_lib):
    if dtype != torch.float32 and f32_lib == "onednn":
        pytest.skip("bf16 linears take oneDNN under either f32 library")
    torch.manual_seed(0)
    m = MLP(ACTS[act], bias=bias).to(dtype).eval()
    c = torch.compile(m, backend="braze", options=FREEZE)
    shape = (5, 7, 48) if rank == 3 else (12, 48)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(shape, dtype=dtype)
            torch.testing.assert_close(c(x), m(x), **_tol(dtype))
    ops = braze.stats.extern_ops
    if dtype == torch.float32 and f32_lib == "blas":
        assert ops.get("mkl._mkl_linear[packed]") == 2, ops
    elif dtype == torch.float32:
        fused = {"relu": "+relu", "gelu": "+gelu", "gelu_tanh": "+gelu(tanh)", "silu": ""}[act]
        assert ops.get(f"mkldnn._linear_pointwise{fused}[packed]") == (2 if not fused else 1), ops
        assert _n_packed(ops) == 2, ops
    else:
        fused = {"relu": "+relu", "gelu": "+gelu", "gelu_tanh": "+gelu(tanh)", "silu": "+swish"}[act]
        assert ops.get(f"mkldnn._linear_pointwise{fused}[packed]") == 1, ops
        assert sum(v for k, v in ops.items() if k.startswith("mkldnn._linear_pointwise")) == 2, ops
    assert not any(k.startswith("aten.addmm") or k.startswith("aten.mm") for k in ops), ops


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prepacked_once_and_repacked_after_inplace_update(dtype, f32_lib):
    if dtype != torch.float32 and f32_lib == "onednn":
        pytest.skip("bf16 linears take oneDNN under either f32 library")
    torch.manual_seed(0)
    m = MatmulHeavy(64, 3).to(dtype).eval()
    c = torch.compile(m, backend="braze", options=FREEZE)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(16, 64, dtype=dtype)
            torch.testing.assert_close(c(x), m(x), **_tol(dtype))
        specs = _specs()
        assert len(specs) == 3 and all(s.packs == 1 for s in specs), [s.packs for s in specs]
        # An in-place update (what an optimizer step does) must be seen by the next call.
        m.linears[1].weight.mul_(-2.0)
        m.linears[1].weight.add_(0.1)
        x = torch.randn(16, 64, dtype=dtype)
        torch.testing.assert_close(c(x), m(x), **_tol(dtype))
        assert sorted(s.packs for s in specs) == [1, 1, 2]
        # copy_ (load_state_dict) too.
        m.linears[0].weight.copy_(torch.randn_like(m.linears[0].weight))
        x = torch.randn(16, 64, dtype=dtype)
        torch.testing.assert_close(c(x), m(x), **_tol(dtype))
        assert sorted(s.packs for s in specs) == [1, 2, 2]
        # Unchanged weights are not packed again.
        c(x)
        assert sorted(s.packs for s in specs) == [1, 2, 2]
    key = _packed_f32(f32_lib, "+relu") if dtype == torch.float32 else "mkldnn._linear_pointwise+relu[packed]"
    assert braze.stats.extern_ops.get(key) == 3, braze.stats.extern_ops


def test_tinyblock_inference_matches_eager(f32_lib):
    torch.manual_seed(0)
    m = TinyBlock(64, 4).eval()
    c = torch.compile(m, backend="braze", options=FREEZE)
    with torch.inference_mode():
        for _ in range(2):
            x = torch.randn(3, 10, 64)
            torch.testing.assert_close(c(x), m(x), atol=1e-4, rtol=1e-4)
    ops = braze.stats.extern_ops
    assert _n_packed(ops) == 2 and ops.get(_packed_f32(f32_lib, "+gelu")), ops


def test_activation_input_with_other_users_not_fused():
    """The linear's result is also returned: the activation cannot be fused into it."""
    if not BF16:
        pytest.skip("no bf16 oneDNN")

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x):
            y = self.fc(x)
            return torch.relu(y), y * 2

    torch.manual_seed(0)
    m = M().to(torch.bfloat16).eval()
    c = torch.compile(m, backend="braze", options=FREEZE)
    with torch.no_grad():
        x = torch.randn(8, 32, dtype=torch.bfloat16)
        for a, b in zip(c(x), m(x)):
            torch.testing.assert_close(a, b, **_tol(torch.bfloat16))
    assert braze.stats.extern_ops.get("mkldnn._linear_pointwise[packed]") == 1, braze.stats.extern_ops


def test_non_static_weight_keeps_aten():
    """A weight that is a plain input (not a parameter) may change every call: no packing."""
    def f(x, w, b):
        return torch.relu(nn.functional.linear(x, w, b))

    c = torch.compile(f, backend="braze", options=FREEZE)
    for _ in range(2):
        x, w, b = torch.randn(8, 16), torch.randn(24, 16), torch.randn(24)
        torch.testing.assert_close(c(x, w, b), f(x, w, b))
    assert not any("packed" in k for k in braze.stats.extern_ops), braze.stats.extern_ops


def test_training_step_keeps_plain_matmuls(f32_lib):
    torch.manual_seed(0)
    m = TinyBlock(64, 4)
    ref = TinyBlock(64, 4)
    ref.load_state_dict(m.state_dict())
    c = torch.compile(m, backend="braze", options=FREEZE)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        x = torch.randn(2, 6, 64)
        for mod, o, fn in ((m, opt, c), (ref, opt_ref, ref)):
            o.zero_grad()
            fn(x).square().mean().backward()
            o.step()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)
    assert not any("packed" in k for k in braze.stats.extern_ops), braze.stats.extern_ops
    # After training, inference on the updated weights uses the library linears.
    c.eval()
    with torch.no_grad():
        x = torch.randn(2, 6, 64)
        torch.testing.assert_close(c(x), ref.eval()(x), atol=1e-4, rtol=1e-4)
    assert _n_packed(braze.stats.extern_ops) == 2, braze.stats.extern_ops


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv1d_weight_layout(dtype):
    """GPT-2's Conv1D: addmm(bias, x, w) with the weight stored [K, N]."""
    class Conv1D(nn.Module):
        def __init__(self, k, n):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(k, n) * 0.1)
            self.bias = nn.Parameter(torch.randn(n) * 0.1)

        def forward(self, x):
            y = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
            return torch.relu(y.view(*x.shape[:-1], -1))

    torch.manual_seed(0)
    m = Conv1D(40, 56).to(dtype).eval()
    c = torch.compile(m, backend="braze", options=FREEZE)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(3, 5, 40, dtype=dtype)
            torch.testing.assert_close(c(x), m(x), **_tol(dtype))
        m.weight.add_(1.0)
        x = torch.randn(3, 5, 40, dtype=dtype)
        torch.testing.assert_close(c(x), m(x), **_tol(dtype))
    assert [s.packs for s in _specs()] == [2]
    assert any("packed" in k for k in braze.stats.extern_ops), braze.stats.extern_ops


def test_prepacking_is_opt_in():
    """Without freeze_weights, CPU linears stay plain ATen matmuls: a write through .data
    (which PyTorch's version counter does not see) can never leave a stale packed weight."""
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU()).eval()
    x = torch.randn(8, 64)
    c = torch.compile(m, backend="braze")
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x))
        m[0].weight.data.mul_(2.0)
        torch.testing.assert_close(c(x), m(x))
    assert not any("mkl" in k or "mkldnn" in k for k in braze.stats.extern_ops), braze.stats.extern_ops


def test_conv_weights_laid_out_once(compiled_graphs):
    """CPU inference convolutions run channels_last; with freeze_weights a parameter's
    channels_last copy is made once and reused ([Note: CPU convolutions]), and made again
    after an in-place update."""
    from braze.cpu_conv import CpuConv

    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.Conv2d(8, 8, 3, stride=2, groups=2), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
    c = torch.compile(m, backend="braze", options={**FREEZE, "on_unsupported": "error"})
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 3, 12, 12)
            torch.testing.assert_close(c(x), m(x), atol=1e-4, rtol=1e-4)
        (g,) = compiled_graphs
        convs = [e.target for e in g.externs.values() if isinstance(e.target, CpuConv)]
        assert len(convs) == 3 and all(s.copies == 1 for s in convs), [s.copies for s in convs]
        m[3].weight.mul_(-0.5)
        x = torch.randn(2, 3, 12, 12)
        torch.testing.assert_close(c(x), m(x), atol=1e-4, rtol=1e-4)
        assert sorted(s.copies for s in convs) == [1, 1, 2]


def test_f32_library_is_measured():
    """[Note: CPU GEMM library]: the choice is this CPU's measurement, by its rule."""
    if cpu_linear._F32_LIBRARY:
        cpu_linear._F32_LIBRARY.clear()
    lib = cpu_linear.f32_library()
    assert lib in ("blas", "onednn")
    t = cpu_linear.F32_TIMES
    assert set(t) == {"blas", "onednn"} and all(v > 0 for v in t.values()), t
    assert (lib == "onednn") == (t["onednn"] < 0.8 * t["blas"]), t


def test_large_f32_matmuls_follow_the_library(f32_lib):
    """Without freeze_weights: a matmul of 2·M·N·K >= ONEDNN_MIN_FLOPS is a oneDNN call (its relu
    fused) where oneDNN is the faster library, a smaller one stays braze's own BLAS call; under
    the BLAS both are braze's. Values are eager's either way."""
    if not braze._core.cpu_blas_ready():
        pytest.skip("the counts assume braze's own BLAS calls (an sgemm_ in this PyTorch)")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8)).eval()
    assert 2 * 64 * 512 * 512 >= cpu_linear.ONEDNN_MIN_FLOPS > 2 * 64 * 8 * 512
    c = torch.compile(m, backend="braze", options={"on_unsupported": "error"})
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(64, 512)
            torch.testing.assert_close(c(x), m(x), atol=1e-4, rtol=1e-4)
    rec = braze.stats.records[-1]
    if f32_lib == "onednn":
        assert rec["externs"] == {"mkldnn._linear_pointwise+relu": 1}, rec["externs"]
        assert rec["schedule"].count("matmul") == 1, rec["schedule"]
    else:
        assert not rec["externs"] and rec["schedule"].count("matmul") == 2, (rec["externs"], rec["schedule"])


def test_training_matmuls_follow_the_library(f32_lib):
    """A training step's forward and backward matmuls (weights as they are, transposed operands
    as views) through oneDNN where it is the faster library; gradients are eager's."""
    torch.manual_seed(0)
    m, ref = TinyBlock(128, 4), TinyBlock(128, 4)
    ref.load_state_dict(m.state_dict())
    c = torch.compile(m, backend="braze", options={"on_unsupported": "error"})
    n0 = len(braze.stats.records)
    for _ in range(2):
        x = torch.randn(2, 64, 128, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        for mod in (m, ref):
            mod.zero_grad(set_to_none=True)
        out, r = c(x), ref(xr)
        out.square().mean().backward()
        r.square().mean().backward()
        torch.testing.assert_close(out, r, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)
    recs = braze.stats.records[n0:]
    assert [r["kind"] for r in recs] == ["forward", "backward"]
    calls = [sum(v for k, v in r["externs"].items() if k.startswith("mkldnn._linear_pointwise")) for r in recs]
    # fc1 and fc2 forward; each one's input and weight gradients backward.
    assert calls == ([2, 4] if f32_lib == "onednn" else [0, 0]), [r["externs"] for r in recs]
    assert not any("[packed]" in k for r in recs for k in r["externs"])


def test_strided_bias_keeps_the_blas(f32_lib):
    """oneDNN reads a bias as dense: a broadcast or strided one (which gave wrong sums through
    `_linear_pointwise`) leaves the matmul to braze's BLAS call; values are eager's."""
    def f(x, w, b):
        return torch.addmm(b.expand(256) if b.dim() == 0 else b[::2], x, w.t())

    c = torch.compile(f, backend="braze", options={"on_unsupported": "error"})
    for b in (torch.tensor(0.5), torch.randn(512)):
        x, w = torch.randn(64, 512), torch.randn(256, 512)
        torch.testing.assert_close(c(x, w, b), f(x, w, b), atol=1e-4, rtol=1e-4)
    assert not any("linear" in k for r in braze.stats.records for k in r["externs"]), braze.stats.extern_ops


def test_dynamic_rows_follow_the_library(f32_lib, compiled_graphs):
    """Under dynamic=True a matmul's row count is symbolic: one of N·K >= ONEDNN_MIN_NK is a
    oneDNN call whatever the rows (0 and 1 included) where oneDNN is the faster library, a
    narrower one stays braze's BLAS call, and one compiled graph serves every batch."""
    if not braze._core.cpu_blas_ready():
        pytest.skip("the counts assume braze's own BLAS calls (an sgemm_ in this PyTorch)")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(768, 768), nn.ReLU(), nn.Linear(768, 64), nn.GELU()).eval()
    assert 768 * 768 >= cpu_linear.ONEDNN_MIN_NK > 768 * 64
    c = torch.compile(m, backend="braze", dynamic=True, options={"on_unsupported": "error"})
    with torch.no_grad():
        for b in (3, 17, 40):
            x = torch.randn(b, 5, 768)
            torch.testing.assert_close(c(x), m(x), atol=1e-4, rtol=1e-4)
        recs = list(braze.stats.records)
        assert len(recs) == 1 and len(compiled_graphs) == 1 and compiled_graphs[0].dynamic, recs
        assert recs[0]["externs"] == ({"mkldnn._linear_pointwise": 1} if f32_lib == "onednn" else {}), recs[0]["externs"]
        assert recs[0]["schedule"].count("matmul") == (1 if f32_lib == "onednn" else 2)
        for b in (0, 1):  # Dynamo's own specializations
            x = torch.randn(b, 5, 768)
            torch.testing.assert_close(c(x), m(x), atol=1e-4, rtol=1e-4)


def test_batched_matmuls_are_braze_blas_calls():
    """[Note: batched CPU matmuls]: a batch of small products (Swin's window attention: q @ k^T
    with k a transposed view, then p @ v), a baddbmm (its input added) and a batched product
    with a relu after it run as braze's BLAS calls, one call for the whole batch where MKL's
    `sgemm_batch_` is there; values and gradients are eager's, and no bmm is left to ATen."""
    if not braze._core.cpu_blas_ready():
        pytest.skip("braze's own BLAS calls need an sgemm_ in this PyTorch")
    torch.manual_seed(0)

    def f(q, k, v, r):
        p = torch.softmax(q @ k.transpose(-1, -2) * 0.17, dim=-1)
        return p @ v, torch.baddbmm(r, q, k.transpose(-1, -2)), torch.relu(q @ k.transpose(-1, -2))

    c = torch.compile(f, backend="braze", options={"on_unsupported": "error"})
    for batch in (96, 1):
        q, k, v = (torch.randn(batch, 49, 32, requires_grad=True) for _ in range(3))
        r = torch.randn(batch, 49, 49)
        q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        got, want = c(q, k, v, r), f(q2, k2, v2, r)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        sum(o.square().sum() for o in got).backward()
        sum(o.square().sum() for o in want).backward()
        for a, b in ((q, q2), (k, k2), (v, v2)):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-3, rtol=1e-4)
    assert not any("bmm" in k or "matmul" in k for k in braze.stats.extern_ops), braze.stats.extern_ops
    assert braze.stats.graphs_eager == 0, braze.stats.eager_reasons
