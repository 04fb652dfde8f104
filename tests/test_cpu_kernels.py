"""CPU kernels: OpenMP thread count follows torch.set_num_threads, the module cache key holds
the host CPU, and the vectorized max/min/argmax/Welford reductions match eager (NaN inputs,
rows of every length around the vector block, changed thread counts) on fresh random inputs."""
import os
import re
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import braze

pytestmark = pytest.mark.skipif(os.environ.get("BRAZE_TEST_DEVICE", "cpu") != "cpu", reason="CPU kernels")


def compiled(fn, **kw):
    return torch.compile(fn, backend="braze", **kw)


_SEPARATE_RUNTIME = r"""
import ctypes, os, sys, threading
# A copy of the system libgomp under another name, loaded before anything links it: the
# CC wrapper below renames the modules' DT_NEEDED libgomp.so.1 to it, so braze's kernels run
# on an OpenMP runtime whose settings PyTorch never touches (as with a PyTorch built with a
# renamed or different OpenMP runtime).
gomq = ctypes.CDLL(sys.argv[1])  # RTLD_LOCAL: PyTorch keeps binding its own
import torch, braze
f = torch.compile(lambda x: (x.sin() * 2 + 1).cos(), backend="braze")
x = torch.randn(256, 1024)
seen = []
for n in (1, 2, 1):
    torch.set_num_threads(n)
    f(x)
    seen.append((n, gomq.omp_get_max_threads()))
def work():
    torch.set_num_threads(1)
    f(x)
    seen.append((1, gomq.omp_get_max_threads()))
t = threading.Thread(target=work); t.start(); t.join()
print(seen)
assert all(a == b for a, b in seen), seen
"""

_CC_WRAPPER = r"""#!SHEBANG
import subprocess, sys
r = subprocess.call(["gcc"] + sys.argv[1:])
out = sys.argv[sys.argv.index("-o") + 1] if "-o" in sys.argv else ""
if r == 0 and out.endswith(".so"):
    b = open(out, "rb").read()
    open(out, "wb").write(b.replace(b"libgomp.so.1\0", b"libgomq.so.1\0"))
sys.exit(r)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF and libgomp")
def test_kernels_use_torch_thread_count_on_another_openmp_runtime(tmp_path):
    """braze's kernels run on torch.get_num_threads() threads even when the OpenMP runtime
    they link is not PyTorch's: the kernels' runtime's thread setting follows
    torch.set_num_threads in the calling thread, main or fresh."""
    import shutil
    import subprocess

    if not shutil.which("gcc"):
        pytest.skip("no gcc")
    so = subprocess.run(["gcc", "-print-file-name=libgomp.so.1"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(so) or not os.path.exists(so):
        pytest.skip("no libgomp.so.1")
    data = open(os.path.realpath(so), "rb").read()
    if not data.startswith(b"\x7fELF") or b"libgomp.so.1\0" not in data:
        pytest.skip("libgomp.so.1 is not a plain ELF library")
    gomq = tmp_path / "libgomq.so.1"
    gomq.write_bytes(data.replace(b"libgomp.so.1\0", b"libgomq.so.1\0"))
    cc = tmp_path / "cc.py"
    cc.write_text(_CC_WRAPPER.replace("SHEBANG", sys.executable))
    cc.chmod(0o755)
    env = dict(os.environ, CC=str(cc), BRAZE_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", _SEPARATE_RUNTIME, str(gomq)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]


@pytest.mark.parametrize("n", [1, 2])
def test_kernels_use_torch_thread_count_in_a_fresh_thread(n):
    """A thread that never ran a PyTorch op runs braze's kernels on torch.get_num_threads()
    threads (the same OpenMP runtime as PyTorch's here, or not; see above)."""
    f = compiled(lambda x: (x.sin() * 2 + 1).cos())
    x = torch.randn(256, 1024)
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        f(x)  # compile in the main thread
        seen = {}

        def work():
            r = f(x)
            seen["ok"] = torch.allclose(r, (x.sin() * 2 + 1).cos(), atol=1e-5)
            seen["torch"] = torch.get_num_threads()

        t = threading.Thread(target=work)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(old)
    assert seen["ok"] and seen["torch"] == n


def test_results_follow_changed_thread_count():
    f = compiled(lambda x: (torch.amax(x, -1), torch.var_mean(x, -1), torch.softmax(x, -1)))
    old = torch.get_num_threads()
    try:
        for n in (1, 2, 1, max(old, 1)):
            torch.set_num_threads(n)
            x = torch.randn(300, 1000)
            torch.testing.assert_close(f(x), (torch.amax(x, -1), torch.var_mean(x, -1), torch.softmax(x, -1)))
    finally:
        torch.set_num_threads(old)


def test_cache_key_has_cpu_identity(tmp_path, monkeypatch):
    """The same source compiled in the same cache dir under another CPU identity is a
    different entry; the identity holds the target flags -march=native expands to."""
    from braze import _core

    assert hasattr(_core, "cpu_id")
    ident = _core.cpu_id()
    assert ident.strip(), "empty CPU identity"
    if sys.platform.startswith("linux") and os.uname().machine == "x86_64":
        assert "-march=" in ident or "flags" in ident


# Shapes: rows shorter than, equal to and longer than the vector block, with tails, and
# several outer dims.
SHAPES = [(7, 5), (3, 16), (5, 31), (4, 32), (6, 33), (2, 3, 100), (64, 1000), (1024, 4096)]


def _nan_variants(x):
    out = [x]
    y = x.clone()
    y.view(-1)[:: max(1, y.numel() // 7)] = float("nan")  # a few NaNs in some rows
    out.append(y)
    z = x.clone()
    z[..., -1] = float("nan")  # NaN in the tail of every row
    out.append(z)
    w = x.clone()
    w[..., 0] = float("nan")  # NaN first
    out.append(w)
    return out


def _close(a, b):
    torch.testing.assert_close(a, b, equal_nan=True, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", ["amax", "amin", "max_dim", "min_dim", "argmax", "argmin", "max_all", "softmax"])
def test_max_min_match_eager_with_nan(op, shape):
    fns = {
        "amax": lambda x: torch.amax(x, dim=-1),
        "amin": lambda x: torch.amin(x, dim=-1),
        "max_dim": lambda x: torch.max(x, dim=-1),
        "min_dim": lambda x: torch.min(x, dim=-1),
        "argmax": lambda x: torch.argmax(x, dim=-1),
        "argmin": lambda x: torch.argmin(x, dim=-1),
        "max_all": lambda x: x.max(),
        "softmax": lambda x: torch.softmax(x, -1),
    }
    fn = fns[op]
    f = compiled(fn, dynamic=False)
    for x in _nan_variants(torch.randn(shape)):
        _close(f(x), fn(x))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_max_ties_and_infinities(shape):
    """argmax/argmin return the first index among equal values; -inf/inf rows."""
    x = torch.randint(-3, 3, shape).float()
    fn = lambda x: (torch.argmax(x, -1), torch.argmin(x, -1), torch.max(x, -1), torch.amin(x, -1))
    f = compiled(fn, dynamic=False)
    _close(f(x), fn(x))
    y = torch.full(shape, float("-inf"))
    _close(f(y), fn(y))
    z = torch.full(shape, float("inf"))
    _close(f(z), fn(z))


def test_max_and_min_are_openmp_reductions():
    """A row max or min is an `omp simd` max/min reduction with a NaN flag ([Note: simd
    max]), not per-lane arrays, and matches eager with and without NaN."""
    fn = lambda x: (torch.amax(x, -1), torch.amin(x * 2, -1), x.sum(-1))
    f = compiled(fn, dynamic=False)
    n0 = len(braze.stats.records)
    for x in _nan_variants(torch.randn(64, 1000)):
        _close(f(x), fn(x))
    src = "\n".join(r["source"] for r in braze.stats.records[n0:] if r.get("source"))
    assert "reduction(max:" in src and "reduction(min:" in src and "reduction(|:" in src, src
    assert "_v[32]" not in src, src


def test_softmax_computes_exp_once():
    """A CPU softmax stores exp(x - max) in its sum pass and divides it in place ([Note:
    stored for reload]): one `exp` per element in the generated C. Not where the last pass
    reads another buffer (it might share the output's memory) or stores another dtype; all
    match eager, NaN rows included."""
    f = compiled(lambda x: torch.softmax(x, -1), dynamic=False)
    n0 = len(braze.stats.records)
    for x in _nan_variants(torch.randn(48, 1000)):
        _close(f(x), torch.softmax(x, -1))
    src = "\n".join(r["source"] for r in braze.stats.records[n0:] if r.get("source"))
    body = src[src.index("void braze_"):]
    assert body.count("expf(") == 1, body
    g = compiled(lambda x, y: torch.softmax(x, -1) * y, dynamic=False)
    h = compiled(lambda x: torch.softmax(x, -1).to(torch.bfloat16), dynamic=False)
    x, y = torch.randn(48, 1000), torch.randn(48, 1000)
    _close(g(x, y), torch.softmax(x, -1) * y)
    torch.testing.assert_close(h(x), torch.softmax(x, -1).to(torch.bfloat16))


@pytest.mark.parametrize("n", [7, 255, 256, 257, 1000, 4099])
def test_variance_is_chunked(n):
    """A row variance is computed in chunks merged by Chan's formula ([Note: chunked
    Welford]), not per-lane arrays; values match eager for rows around the chunk size, with
    NaN, and with a common offset a hundred times the spread (where a one-pass sum of
    squares would lose the variance)."""
    fn = lambda x: (x.var(-1), torch.var_mean(x, -1, correction=0), F.layer_norm(x, (n,)))
    f = compiled(fn, dynamic=False)
    n0 = len(braze.stats.records)
    for x in _nan_variants(torch.randn(33, n)):
        _close(f(x), fn(x))
    x = torch.randn(33, n) + 100  # f32 rounding of values near 100: a looser tolerance
    torch.testing.assert_close(f(x), fn(x), rtol=1e-3, atol=1e-3)
    src = "\n".join(r["source"] for r in braze.stats.records[n0:] if r.get("source"))
    assert "bz_c" in src and "_v[32]" not in src, src


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_variance_correction_changing_or_fractional(dtype):
    """`correction` passed as a Python number that changes between calls (Dynamo makes it a
    symbolic int; `std` decomposes it to a symbolic float) or that is fractional: braze's
    kernels, not ATen's, divide by `max(n - correction, 0)` as eager does (inf at and past
    n), forward and backward."""
    torch._dynamo.reset()

    def f(x, c):
        v, m = torch.var_mean(x, (0, 2), correction=c)
        return v * m, torch.std(x, 1, correction=c)

    c = compiled(f, options={"on_unsupported": "error"})
    before = dict(braze.stats.extern_ops)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    for corr in (0, 1, 2, 0.5, 3, 1.5, 6, 9):
        x = torch.randn(4, 6, 5, dtype=dtype, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager: "degrees of freedom is <= 0"
            got, want = c(x, corr), f(xr, corr)
        torch.testing.assert_close(got, want, equal_nan=True, **tol)
        if corr < 5:
            g = [torch.randn_like(t) for t in want]
            torch.autograd.backward(got, g)
            torch.autograd.backward(want, g)
            torch.testing.assert_close(x.grad, xr.grad, **tol)
    assert braze.stats.extern_ops == before, braze.stats.extern_ops


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.bfloat16, torch.float16])
def test_max_min_other_dtypes(dtype):
    fn = lambda x: (torch.amax(x, -1), torch.amin(x, 1), torch.argmax(x, -1), torch.max(x, -1))
    f = compiled(fn, dynamic=False)
    if dtype.is_floating_point:
        x = torch.randn(37, 203).to(dtype)
        x[3, 100] = float("nan")
    else:
        x = torch.randint(-1000, 1000, (37, 203), dtype=dtype)
    torch.testing.assert_close(f(x), fn(x), equal_nan=True)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", ["var_mean", "var", "std", "var_unbiased0", "layer_norm", "var_mean_dims", "var_outer_and_last"])
def test_welford_matches_eager(op, shape):
    n = shape[-1]
    w, b = torch.randn(n), torch.randn(n)
    fns = {
        "var_mean": lambda x: torch.var_mean(x, dim=-1),
        "var": lambda x: torch.var(x, dim=-1),
        "std": lambda x: torch.std(x, dim=-1, keepdim=True),
        "var_unbiased0": lambda x: torch.var(x, dim=-1, correction=0),
        "layer_norm": lambda x: F.layer_norm(x, (n,), w, b),
        "var_mean_dims": lambda x: torch.var_mean(x, dim=list(range(1, x.dim()))),
        # Two reduced dims apart (BatchNorm's statistics): chunks of the last, the first around.
        "var_outer_and_last": lambda x: torch.var_mean(x, dim=[0, x.dim() - 1]),
    }
    fn = fns[op]
    f = compiled(fn, dynamic=False)
    tol = 1e-4 if op == "layer_norm" else 2e-5
    for x in [torch.randn(shape), *_nan_variants(torch.randn(shape))[1:]]:
        torch.testing.assert_close(f(x), fn(x), equal_nan=True, rtol=tol, atol=tol)
    # A large offset makes a sum-of-squares variance lose every digit; Welford keeps them
    # (float32: compared with float64 at a float32-sized tolerance). layer_norm's mean is a
    # plain float32 sum of values near 1000 (the decomposition's), hence its looser bound.
    x = torch.randn(shape) * 3 + 1000.0
    r64 = fns[op](x.double()) if op != "layer_norm" else F.layer_norm(x.double(), (n,), w.double(), b.double())
    tol = 2e-2 if op == "layer_norm" else 1e-4
    torch.testing.assert_close(f(x), r64, rtol=tol, atol=tol, check_dtype=False)


def test_welford_float64_and_dynamic():
    fn = lambda x: torch.var_mean(x, dim=-1)
    f = compiled(fn, dynamic=True)
    for n in (5, 40, 129):
        x = torch.randn(9, n, dtype=torch.float64)
        torch.testing.assert_close(f(x), fn(x))
        y = torch.randn(9, n)
        torch.testing.assert_close(f(y), fn(y), rtol=2e-5, atol=2e-5)


def _sources_of(f, *args):
    n0 = len(braze.stats.records)
    out = f(*args)
    return out, "\n".join(r["source"] for r in braze.stats.records[n0:] if r.get("source"))


@pytest.mark.parametrize("shape", [(8,), (4, 6), (3, 5, 7)])
def test_small_static_kernels_run_without_a_parallel_region(shape):
    """A kernel whose static size is below the parallel threshold has no `omp parallel`
    (entering the OpenMP runtime for a team of one was most of a tiny kernel's time: `x + 1`
    on 8 elements, 0.80 -> 0.29 us per run); a large one keeps it, a dynamic one branches on
    its size between the two, and all match eager."""
    fn = lambda x: (x.sin() * 2 + 1, x.sum(-1))
    x = torch.randn(*shape)
    torch._dynamo.reset()
    out, src = _sources_of(compiled(fn, dynamic=False), x)
    _close(out, fn(x))
    assert "braze_" in src and "omp parallel" not in src, src
    big = torch.randn(256, 1024)
    torch._dynamo.reset()
    out, src = _sources_of(compiled(fn, dynamic=False), big)
    _close(out, fn(big))
    assert "omp parallel" in src
    if len(shape) > 1:  # (a 1-d row sum has no parallel loop in any case)
        torch._dynamo.reset()
        out, src = _sources_of(compiled(fn, dynamic=True), x)
        _close(out, fn(x))
        # A symbolic size branches between the parallel nest and a serial one.
        assert "omp parallel" in src and ">= 32768) {" in src and "} else {" in src, src


def test_call_loop_in_rust(compiled_graphs):
    """A whole call is one Rust call ([Note: the call loop in Rust]): a graph of kernel runs
    and a graph with an extern call in the middle both match eager on fresh inputs, call after
    call, an input of another layout copied into the compiled one; the debugging hook sees
    every step in plan order, kernels and the ATen call, with the live buffers."""
    from braze import _core

    torch._dynamo.reset()
    fn = lambda x: (x * 2 + 1).relu() - x.mean(-1, keepdim=True)
    f = compiled(fn, dynamic=False)
    for _ in range(3):
        x = torch.randn(16, 64)
        _close(f(x), fn(x))
    xt = torch.randn(64, 16).t()  # another layout: copied into the compiled one
    _close(f(xt), fn(xt))
    assert isinstance(compiled_graphs[-1].static_exec, _core.Executor)
    torch._dynamo.reset()
    g = lambda x: (torch.cummax(x.sin(), -1).values * 2).cos()  # cummax runs through ATen
    fg = compiled(g, dynamic=False)
    for _ in range(2):
        x = torch.randn(16, 64)
        _close(fg(x), g(x))
    cg = compiled_graphs[-1]
    seen = []
    x = torch.randn(16, 64)
    out = cg([x], on_step=lambda kind, what, bufs: seen.append((kind, what, sum(t is not None for t in bufs))))
    _close(out[0], g(x))
    assert [k for k, _, _ in seen] == [0, 1, 0], seen
    assert seen[1][1] is torch.ops.aten.cummax.default and all(n > 0 for _, _, n in seen), seen
    # The executor holds a bound method of its graph: the pair is freed once dropped.
    import gc
    import weakref
    ref = weakref.ref(cg)
    del cg, fg, f, seen
    compiled_graphs.clear()
    torch._dynamo.reset()
    gc.collect()
    assert ref() is None, gc.get_referrers(ref())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hw", [1, 2, 9, 56])
def test_steady_masked_loads(dtype, hw):
    """A max pool or pad over channels_last tensors masks each window tap per row of
    channels ([Note: steady masked loads]): the row's pointer (the input's, or zeros off the
    edge) is picked once before the vectorized loop instead of a gathered load per vector.
    Values match eager, NaN and -inf included, down to inputs smaller than the window (taps
    off the edge at every output). A pad along the last dim splits its rows instead."""
    pool = lambda x: F.max_pool2d(torch.relu(x), 3, 2, 1)
    pad = lambda x: F.pad(x, (1, 1, 2, 0)) * 2
    f, g = compiled(pool, dynamic=False), compiled(pad, dynamic=False)
    n0 = len(braze.stats.records)
    x = torch.randn(2, 32, hw, hw)
    x.view(-1)[::7] = float("nan")
    x.view(-1)[3::11] = float("-inf")
    x = x.to(dtype).contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(f(x), pool(x), equal_nan=True)
    torch.testing.assert_close(g(x), pad(x), equal_nan=True)
    src = "\n".join(r["source"] for r in braze.stats.records[n0:] if r.get("source"))
    assert "bz_zeros;" in src, src
    # A contiguous pad masks the last dim itself: no row pointer there, when its rows are
    # long (a row at most twice its pad's mask is cut into pieces: [Note: row segments]).
    n1 = len(braze.stats.records)
    y = torch.randn(2, 3, hw, hw).to(dtype)
    torch.testing.assert_close(compiled(pad, dynamic=False)(y), pad(y))
    src = "\n".join(r["source"] for r in braze.stats.records[n1:] if r.get("source"))
    # Rows long enough split into border and interior ([Note: interior rows]): the interior
    # knows the last dim's mask true and walks its row.
    if hw > 2:
        assert "for (int64_t i2 = 1; i2 <" in src or "for (int64_t i3 = 1; i3 <" in src, src


@pytest.mark.parametrize("window", [(3, 2, 1), (2, 2, 0), (3, 1, 1), (5, 3, 2)])
@pytest.mark.parametrize("hw", [(37, 29), (4, 3)])
def test_interior_rows(window, hw):
    """A max pool over NCHW tensors in training (its window's maximum and the argmax offsets
    the backward reads) splits each output row into its border and its interior ([Note:
    interior rows]): in the interior the taps' masks and the argmax's window comparisons
    are known true, so the taps walk their rows without gathers. Values, the input's
    gradient (through the offsets) and NaN/-inf handling match eager, for windows that
    overlap, tile, and reach past both borders, down to rows shorter than the window."""
    k, s, p = window
    f = lambda x: F.max_pool2d(torch.relu(x), k, s, p)
    x = torch.randn(2, 8, *hw)
    x.view(-1)[::13] = float("nan")
    x.view(-1)[5::17] = float("-inf")
    xr = x.clone().requires_grad_(True)
    x.requires_grad_(True)
    n0 = len(braze.stats.records)
    out = compiled(f, dynamic=False)(x)
    ref = f(xr)
    torch.testing.assert_close(out, ref, equal_nan=True)
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, equal_nan=True)
    src = "\n".join(r["source"] for r in braze.stats.records[n0:] if r.get("source"))
    wo = ref.shape[-1]
    if wo >= 8 and p > 0:  # a row long enough to have an interior, and a border to split off
        assert "for (int64_t i2 = 1; i2 <" in src or "for (int64_t i3 = 1; i3 <" in src, src


@pytest.mark.parametrize("window", [(3, 2, 1), (3, 1, 1), (5, 3, 2)])
def test_interior_rows_of_narrow_taps(window):
    """[Note: interior rows] for 16-bit taps: a bf16 max pool over an NCHW activation in
    inference (a ResNet stem's BatchNorm, ReLU and pool under CPU autocast) has no argmax, but
    its taps are bf16, which x86 cannot gather: its rows split into border and interior too
    (the interior walks its taps at their stride). Values match eager's, NaN included."""
    k, s, p = window
    bn = torch.nn.BatchNorm2d(8).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    f = lambda x: F.max_pool2d(torch.relu(bn(x)), k, s, p)
    x = torch.randn(2, 8, 40, 37).to(torch.bfloat16)
    x.view(-1)[::29] = float("nan")
    n0 = len(braze.stats.records)
    with torch.no_grad():
        out = compiled(f, dynamic=False, options={"on_unsupported": "error", "conv_layout": "eager"})(x)
        ref = f(x)
    torch.testing.assert_close(out, ref, equal_nan=True)
    src = "\n".join(r["source"] for r in braze.stats.records[n0:] if r.get("source"))
    assert "for (int64_t i2 = 1; i2 <" in src or "for (int64_t i3 = 1; i3 <" in src, src


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cat_rows_cut_into_pieces(dtype):
    """[Note: row segments]: a concatenation along channels of channels_last sources (an
    Inception block's branches, each with its own pointwise work) and a max pool of it run
    each row in pieces, one per source, where every other source's mask is known false:
    one loop per piece, no source evaluated outside its channels. Values match eager, NaN
    included."""
    def f(a, b, c, d):
        y = torch.cat([torch.relu(a * 2 + 1), torch.relu(b), c.sigmoid(), d], 1)
        return y, F.max_pool2d(y, 3, 1, 1, ceil_mode=True)

    xs = [torch.randn(2, ch, 9, 9) for ch in (16, 32, 8, 8)]
    xs[1].view(-1)[::5] = float("nan")
    xs = [x.to(dtype).contiguous(memory_format=torch.channels_last) for x in xs]
    n0 = len(braze.stats.records)
    got = compiled(f, dynamic=False, options={"on_unsupported": "error"})(*xs)
    for g, w in zip(got, f(*xs)):
        torch.testing.assert_close(g, w, equal_nan=True)
        assert g.stride() == w.stride()
    src = "\n".join(r["source"] for r in braze.stats.records[n0:] if r.get("source"))
    for lo, hi in ((0, 16), (16, 48), (48, 56), (56, 64)):
        assert f"{lo}..{hi}" in src, src


def test_cat_pieces_of_one_form_share_code():
    """[Note: piece groups]: a DenseNet dense block (each layer's BatchNorm and ReLU over the
    channels_last concatenation of all earlier outputs), in inference (a row kernel per
    layer) and in a training step (BatchNorm statistics: column kernels), compared with
    eager on fresh inputs. The 8-channel sources' pieces share one loop over a table of
    their pointers instead of a loop each, and their values and gradients match eager."""
    import copy

    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self, c0=16, g=8, layers=6):
            super().__init__()
            self.norms = torch.nn.ModuleList(torch.nn.BatchNorm2d(c0 + i * g) for i in range(layers))
            self.convs = torch.nn.ModuleList(torch.nn.Conv2d(c0 + i * g, g, 1, bias=False) for i in range(layers))

        def forward(self, x):
            feats = [x]
            for n, c in zip(self.norms, self.convs):
                feats.append(c(torch.relu(n(torch.cat(feats, 1)))))
            return torch.cat(feats, 1)

    for train in (False, True):
        m = Block().to(memory_format=torch.channels_last).train(train)
        ref = copy.deepcopy(m)
        x = torch.randn(2, 16, 6, 6).contiguous(memory_format=torch.channels_last)
        n0 = len(braze.stats.records)
        c = torch.compile(m, backend="braze", options={"on_unsupported": "error"})
        if train:
            x.requires_grad_(True)
            xr = x.detach().clone().requires_grad_(True)
            c(x).square().sum().backward()
            ref(xr).square().sum().backward()
            torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)
            for a, b in zip(m.parameters(), ref.parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)
            for a, b in zip(m.buffers(), ref.buffers()):
                torch.testing.assert_close(a, b)
        else:
            with torch.no_grad():
                torch.testing.assert_close(c(x), ref(x))
        assert braze.stats.graphs_eager == 0
        src = "\n".join(r["source"] for r in braze.stats.records[n0:] if r.get("source"))
        # The last layer's input: 16 channels, then five 8-channel sources in one group.
        assert "16..24, 24..32, 32..40, 40..48, 48..56" in src, src
        if train:
            assert "switch (bz_group[x % nch])" in src, src


def test_weight_heavy_convolution_keeps_eager_layout(monkeypatch):
    """[Note: weight-heavy CPU convolutions]: in a CPU inference graph whose convolutions run
    channels_last, one whose weight outweighs its activations (DeepLabV3's atrous 3x3
    convolutions at 8x8) keeps eager's layout instead of ATen laying its weight out
    channels_last on every call: its input reaches ATen contiguous, as eager's (a channels_last
    one took ATen's channels_last path, weight layout and all); values match eager."""
    from braze import runtime

    seen = []
    plain = runtime._callable

    def recording(target):
        fn = plain(target)
        if target is not torch.ops.aten.convolution.default:
            return fn

        def call(x, w, *rest):
            seen.append((tuple(x.shape), x.stride(), w.stride()))
            return fn(x, w, *rest)
        return call
    monkeypatch.setattr(runtime, "_callable", recording)
    torch.manual_seed(0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Conv2d(3, 32, 3, padding=1)
            self.b = torch.nn.Conv2d(32, 256, 3, padding=2, dilation=2)

        def forward(self, x):
            return torch.relu(self.b(F.avg_pool2d(torch.relu(self.a(x)), 32)))

    m = M().eval()
    x = torch.randn(2, 3, 128, 128)
    with torch.no_grad():
        got = compiled(m, dynamic=False, options={"on_unsupported": "error"})(x)
        torch.testing.assert_close(got, m(x), rtol=1e-4, atol=1e-4)
    rec = braze.stats.records[-1]
    assert rec["externs"] == {"aten.convolution.default": 2}, rec["externs"]
    assert "outweighs" in rec["extern_reasons"]["aten.convolution.default"], rec["extern_reasons"]
    # The first convolution still runs channels_last: its input is laid out by a braze copy.
    assert any(name.startswith("braze_poi_copy") for name, _ in rec["kernels"]), rec["kernels"]
    # A weight-heavy convolution right after a channels_last one (timm ResNet-26d's last
    # stage): the ReLU between them is stored contiguous for it.
    seq = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, stride=16, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(64, 512, 3, stride=2, padding=1)).eval()
    x = torch.randn(8, 3, 128, 128)
    seen.clear()
    with torch.no_grad():
        torch.testing.assert_close(compiled(seq, dynamic=False, options={"on_unsupported": "error"})(x), seq(x), rtol=1e-4, atol=1e-4)
    assert [s[:2] for s in seen] == [((8, 3, 128, 128), (49152, 1, 384, 3)), ((8, 64, 8, 8), (4096, 64, 8, 1))], seen
    # A 1x1 convolution whose weight is more than four times its activations (ResNeXt-50's
    # last stage) too; one below that stays channels_last.
    seq = torch.nn.Sequential(torch.nn.Conv2d(3, 256, 3, stride=16, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(256, 1024, 1),
                              torch.nn.ReLU(), torch.nn.Conv2d(1024, 64, 1)).eval()
    x = torch.randn(2, 3, 64, 64)
    seen.clear()
    with torch.no_grad():
        torch.testing.assert_close(compiled(seq, dynamic=False, options={"on_unsupported": "error"})(x), seq(x), rtol=1e-4, atol=1e-4)
    assert [s[:2] for s in seen] == [((2, 3, 64, 64), (12288, 1, 192, 3)), ((2, 256, 4, 4), (4096, 16, 4, 1)), ((2, 1024, 4, 4), (16384, 1, 4096, 1024))], seen


def test_kernel_between_layouts_keeps_its_store_strides_short():
    """[Note: inner dim by stride]: a pointwise kernel storing one value NCHW and another
    channels_last over rows too short to tile (8x8) runs the channels innermost, where the
    channels_last store is contiguous and the NCHW one 256 bytes apart, instead of the last
    dim, where the channels_last stores were 4 KiB apart (one L1 set); values and strides
    are eager's."""
    torch.manual_seed(0)
    x = torch.randn(4, 1024, 8, 8).contiguous(memory_format=torch.channels_last)
    y = torch.randn(4, 1024, 8, 8)

    def f(y, x):
        h = y * 2 + x
        return h, (h.relu() + 1).contiguous(memory_format=torch.channels_last)

    n0 = len(braze.stats.records)
    got = compiled(f, dynamic=False, options={"on_unsupported": "error"})(y, x)
    for g, w in zip(got, f(y, x)):
        torch.testing.assert_close(g, w)
        assert g.stride() == w.stride()
    (rec,) = braze.stats.records[n0:]
    assert len(rec["kernels"]) == 1, rec["kernels"]
    loops = re.findall(r"#pragma omp simd\s*\n\s*for \(int64_t i\d+ = 0; i\d+ < (\d+);", rec["source"])
    assert loops == ["1024"], rec["source"]


def test_wide_load_groups_not_forced_to_vectorize():
    """[Note: wide load groups]: an 8 x 8 average pool of an NCHW activation stored
    channels_last reads 64 neighbouring elements 4096 floats apart per channel; under `omp
    simd` GCC vectorized them as one interleaved group and took 91 s to compile the module.
    That loop has no `omp simd` (GCC's cost model decides); a pool stored in the input's own
    layout keeps it. Values are eager's."""
    x = torch.randn(2, 64, 64, 64)

    def f(x):
        return F.avg_pool2d(x, 8).contiguous(memory_format=torch.channels_last), F.avg_pool2d(x * 2, 2)

    got = compiled(f, dynamic=False, options={"on_unsupported": "error"})(x)
    for a, b in zip(got, f(x)):
        assert a.stride() == b.stride()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    src = braze.stats.records[-1]["source"]
    kernels = {m.group(1): m.group(2) for m in re.finditer(r"\nvoid (braze_\w+)\(.*?\n(.*?)\n}\n", src, re.S)}
    wide = [body for body in kernels.values() if "4096*i3 + 455]" in body]
    assert len(wide) == 1 and "omp simd" not in wide[0], src
    assert any("omp simd" in body for name, body in kernels.items() if body not in wide), src


def test_column_variances_fold_blocks_across_threads():
    """[Note: column Welford in blocks] and [Note: column chunk width]: channels_last
    variances (BatchNorm's statistics in training) gather rows in blocks and fold each block
    into the column's Welford state, instead of a division per element; a 64-channel kernel is
    cut into chunks narrower than 64 columns so both threads work. Values against float64
    (within a few times eager's error, with a tail block and a mean far from zero), two reduced
    dims that do not merge, and a BatchNorm + ReLU training step against eager."""
    torch.manual_seed(0)

    def stats(x, dims, correction):
        return torch.var_mean(x, dims, correction=correction)

    base = torch.randn(3, 6, 36, 64) * 2 + 3
    cases = [
        (torch.randn(4, 64, 21, 17).contiguous(memory_format=torch.channels_last) * 3 + 5, (0, 2, 3), 0),
        (torch.randn(3, 5, 7, 96) - 4, (0, 1, 2), 1),
        (base[:, 1:, 3:, :], (0, 1, 2), 0),
    ]
    n0 = len(braze.stats.records)
    for x, dims, corr in cases:
        torch._dynamo.reset()  # each case's correction a constant, not a symbolic int
        got = compiled(stats, options={"on_unsupported": "error"})(x, dims, corr)
        want = stats(x.double(), dims, corr)
        for g, w, e in zip(got, want, stats(x, dims, corr)):
            err = ((g.double() - w).abs() / w.abs()).max().item()
            err_eager = ((e.double() - w).abs() / w.abs()).max().item()
            assert err <= max(4 * err_eager, 5e-7), (err, err_eager)
        assert not braze.stats.records[-1]["externs"], braze.stats.records[-1]["externs"]
    src = "\n".join(r["source"] for r in braze.stats.records[n0:] if r.get("source"))
    kernels = "".join(part.split("\n}\n", 1)[0] for part in src.split("void braze_")[1:])
    assert kernels and "bz_wdivd(" not in kernels, kernels
    assert "bz_c" in src and "bz_nb" in src, src
    # 64 columns: four chunks of 16.
    assert "const int64_t nch = (64 + 16 - 1) / 16;" in src, src

    bn = torch.nn.BatchNorm2d(64)
    ref = torch.nn.BatchNorm2d(64)
    ref.load_state_dict(bn.state_dict())
    x = torch.randn(2, 64, 20, 20).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    c = torch.compile(lambda x: torch.relu(bn(x)), backend="braze", options={"on_unsupported": "error"})
    y = c(x)
    yr = torch.relu(ref(xr))
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bn.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bn.running_var, ref.running_var)
    assert braze.stats.graphs_eager == 0
