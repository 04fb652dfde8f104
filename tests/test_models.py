"""End-to-end: the seed workloads, training, graph breaks, dynamic shapes, mutation and
the user-facing surface (entry point, modes, options, explain, logs). Every check compares
against eager PyTorch on fresh random inputs."""
import copy
import re
import subprocess
import sys
import warnings

import pytest
import torch

import braze
from braze.workloads import MatmulHeavy, PointwiseHeavy, TinyBlock


def compiled(fn, **kw):
    return torch.compile(fn, backend="braze", **kw)


def randomize(m):
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 and "weight" in "" else 0.0))
    return m


def test_entry_point_registered():
    from torch._dynamo.backends.registry import list_backends

    assert "braze" in list_backends(exclude_tags=())


def test_pointwise_heavy_is_one_kernel(device):
    m = randomize(PointwiseHeavy(256)).to(device)
    x = torch.randn(64, 256, device=device)
    before = braze.stats.kernels
    c = compiled(m)
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x))
    rec = braze.stats.records[-1]
    assert rec["status"] == "compiled"
    assert len(rec["kernels"]) == 1, rec["kernels"]
    assert braze.stats.kernels - before == 1


def test_matmul_heavy(device):
    m = MatmulHeavy(128, 3).to(device)
    x = torch.randn(32, 128, device=device)
    with torch.no_grad():
        torch.testing.assert_close(compiled(m)(x), m(x))
    rec = braze.stats.records[-1]
    assert rec["status"] == "compiled"
    if device == "cuda" or braze._core.cpu_blas_ready():
        # Library matmuls (cuBLASLt; the CPU's BLAS from Rust, [Note: CPU matmuls]) with bias
        # and relu fused: no kernels, no ATen calls, one call into Rust.
        assert rec["schedule"].count("matmul") == 3 and not rec["externs"] and not rec["kernels"]
    else:
        # Without a BLAS braze can call, the matmuls are ATen calls; bias add and relu are one
        # kernel after each.
        assert sum(n for op, n in rec["externs"].items() if "mm" in op) == 3


def test_tinyblock_inference(device):
    m = TinyBlock(64, 4).to(device).eval()
    randomize(m)
    x = torch.randn(4, 16, 64, device=device)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(m)(x), m(x), rtol=1e-4, atol=1e-4)


def test_tinyblock_training_step(device):
    torch.manual_seed(0)
    m = TinyBlock(64, 4).to(device)
    m2 = TinyBlock(64, 4).to(device)
    m2.load_state_dict(m.state_dict())
    x = torch.randn(4, 16, 64, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    c = compiled(m2)
    for _ in range(2):
        out, out2 = m(x), c(x2)
        torch.testing.assert_close(out2, out, rtol=1e-4, atol=1e-4)
        g = torch.randn_like(out)
        out.backward(g)
        out2.backward(g)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-4, atol=1e-4)
    for (n, p), (_, p2) in zip(m.named_parameters(), m2.named_parameters()):
        torch.testing.assert_close(p2.grad, p.grad, rtol=1e-4, atol=1e-4, msg=n)
    kinds = {r["kind"] for r in braze.stats.records[-2:]}
    assert kinds == {"forward", "backward"}
    assert all(r["status"] == "compiled" for r in braze.stats.records[-2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matmul_layouts(device, dtype):
    """mm, addmm (linear), bmm with transposed and sliced operands, a relu epilogue and
    pointwise work after the product."""
    if device == "cpu" and dtype != torch.float32:
        pytest.skip("half matmuls on CPU are ATen's")

    def f(a, b, w, bias, x, y):
        r1 = torch.relu(a @ b.t())
        r2 = torch.nn.functional.linear(a, w, bias) * 2 + 1
        r3 = torch.bmm(x, y.transpose(1, 2))
        r4 = a[:, 1:9] @ b[:, 1:9].t()
        return r1, r2, r3, r4

    g = lambda *s: torch.randn(*s, device=device, dtype=dtype)
    args = (g(16, 32), g(24, 32), g(8, 32), g(8), g(3, 5, 7), g(3, 6, 7))
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    prec = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for o, r in zip(compiled(f)(*args), f(*args)):
            torch.testing.assert_close(o, r, **tol)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prec


class _Conv1D(torch.nn.Module):
    """GPT-2's linear: `addmm(b, x, W)` with W stored [in, out] (its weight gradient is
    `xᵀ dY`, the output gradient as the matmul's b)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_in, n_out) * 0.05)
        self.bias = torch.nn.Parameter(torch.randn(n_out) * 0.05)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


def test_bias_gradient_epilogues(device):
    """A bf16 training step of nn.Linear (`dW = dYᵀ X`) and Conv1D (`dW = Xᵀ dY`) layers: each
    bias gradient `sum(dY, 0)` is cuBLASLt's BGRAD epilogue of its weight gradient's matmul
    ([Note: bias-gradient epilogues]), not a reduction kernel. The plan is checked on fake CUDA
    tensors everywhere (braze's GPU plan without a GPU); on a GPU the step runs with the
    epilogues asked for (option `bias_grad_epilogues`, off by default) and every gradient matches eager's,
    whether cuBLASLt took them or refused and the graph was compiled again without them."""
    from braze import plan_memory

    opts = {"bias_grad_epilogues": True}

    class LinearBackward(torch.nn.Module):
        def forward(self, g, x, h):
            # The second sum as CUDA's autograd writes it under autocast: in f32, rounded back.
            return g.t() @ x, g.sum(0), x.t() @ h, h.sum(0, keepdim=True, dtype=torch.float32).to(h.dtype)

    bf = torch.bfloat16
    shapes = {"g": (512, 256), "x": (512, 128), "h": (512, 64)}
    inputs = {k: torch.randn(*s, dtype=bf) for k, s in shapes.items()}
    graph, lowered = plan_memory.inference_plan(LinearBackward(), inputs, autocast=None, options=opts)
    sched = graph.c.schedule
    assert sched.count("bias gradient") == 2 and "kernel" not in sched and not lowered.fallbacks, sched
    # Off by default: the sums are reduction kernels.
    graph, _ = plan_memory.inference_plan(LinearBackward(), inputs, autocast=None)
    assert "bias gradient" not in graph.c.schedule and graph.c.schedule.count("kernel") == 2, graph.c.schedule
    if device != "cuda":
        return
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), _Conv1D(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).to(device)
    ref = copy.deepcopy(m)
    x = torch.randn(8, 32, 64, device=device)
    c = compiled(m, options={"on_unsupported": "error", **opts})
    before = len(braze.stats.records)
    for mod, fn in ((m, c), (ref, ref)):
        with torch.autocast("cuda", dtype=bf):
            y = fn(x)
        (y.float() ** 2).mean().backward()
    recs = braze.stats.records[before:]
    assert all(r["status"] == "compiled" and not r["externs"] for r in recs), [(r["name"], r["externs"]) for r in recs]
    bwd = [r for r in recs if r["name"].startswith("backward")][0]["schedule"]
    assert bwd.count(", bias gradient buf") == 3 or bwd.startswith("// bias-gradient epilogue refused"), bwd
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        scale = q.grad.abs().max().item()
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2 * scale, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_matmuls_as_reductions(device, dtype):
    """[Note: small matmuls]: on the GPU a matmul of at most 2^18 multiply-adds is braze's own
    reduction, not a library call. The plan is checked on fake CUDA tensors everywhere: two
    TinyBlock(64) on 2×64 are four kernels and no matmul (per block the first linear with the
    LayerNorm's statistics computed in an earlier pass, [Note: embedded reductions], and the
    normalization inlined; the second with GELU and scale inlined).
    On a GPU a training step's outputs and gradients match eager's, with no ATen call and no
    library matmul forward or backward."""
    from braze import plan_memory

    torch.manual_seed(0)
    model = torch.nn.Sequential(TinyBlock(64), TinyBlock(64)).to(dtype).eval()
    graph, lowered = plan_memory.inference_plan(model, {"input": torch.randn(2, 64, dtype=dtype)}, autocast=None)
    sched = graph.c.schedule
    assert "matmul" not in sched and sched.count("kernel ") == 4 and not lowered.fallbacks, sched
    if device != "cuda":
        return
    m = model.to(device).train()
    ref = copy.deepcopy(m)
    x = torch.randn(2, 64, device=device, dtype=dtype)
    c = compiled(m, options={"on_unsupported": "error"})
    before = len(braze.stats.records)
    outs = []
    for fn in (c, ref):
        y = fn(x)
        (y.float() ** 2).sum().backward()
        outs.append(y)
    recs = braze.stats.records[before:]
    assert len(recs) == 2 and all(r["status"] == "compiled" and not r["externs"] and "matmul" not in r["schedule"] for r in recs), recs
    # The tanh GELU a CUDA linear takes as its epilogue, expanded again.
    lin = torch.nn.Linear(64, 96).to(device, dtype)
    with torch.no_grad():
        want = torch.nn.functional.gelu(lin(x), approximate="tanh")
        got = compiled(lambda t: torch.nn.functional.gelu(lin(t), approximate="tanh"), options={"on_unsupported": "error"})(x)
    assert "matmul" not in braze.stats.records[-1]["schedule"]
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(outs[0], outs[1], **tol)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        scale = max(q.grad.abs().max().item(), 1.0)
        torch.testing.assert_close(p.grad, q.grad, rtol=tol["rtol"], atol=tol["atol"] * scale, msg=name)


def test_small_matmul_epilogues_on_the_cpu(device, monkeypatch):
    """[Note: small matmuls]' numerics where CI can run them: the GPU's pass on the CPU
    (BRAZE_SMALL_MATMULS_CPU). Linears with bias, relu and residual epilogues, a 3-d linear, a
    batched product with a residual: each is a reduction (no matmul left) and matches eager."""
    if device != "cpu" or not braze._core.cpu_blas_ready():
        pytest.skip("the CPU's BLAS matmuls, made small reductions by the test hook")
    monkeypatch.setenv("BRAZE_SMALL_MATMULS_CPU", "1")
    F = torch.nn.functional

    def f(x, w1, b1, w2, b2, r, w3, r3, p, q, rb):
        h = F.relu(F.linear(x, w1, b1))
        y = F.linear(h, w2, b2) + r
        v = F.linear(h.view(2, 8, 64), w3) + r3
        u = torch.bmm(p, q) + rb
        return h, y, v, u

    torch.manual_seed(0)
    g = torch.randn
    args = (g(16, 32), g(64, 32) * 0.3, g(64), g(32, 64) * 0.3, g(32), g(16, 32), g(32, 64) * 0.3, g(2, 8, 32), g(3, 5, 7), g(3, 7, 6), g(3, 5, 6))
    outs = compiled(f, dynamic=False, options={"on_unsupported": "error"})(*args)
    for o, r in zip(outs, f(*args)):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
        assert o.stride() == r.stride()
    rec = braze.stats.records[-1]
    assert rec["status"] == "compiled" and "matmul" not in rec["schedule"] and not rec["externs"], rec["schedule"]
    # LayerNorm + MLP blocks, a training step: the statistics and normalized rows are saved for
    # the backward (graph outputs), so they keep a kernel of their own ([Note: embedded
    # reductions]); values and gradients are eager's.
    model = torch.nn.Sequential(*[TinyBlock(64) for _ in range(3)])
    ref = copy.deepcopy(model)
    x = torch.randn(2, 64)
    n0 = len(braze.stats.records)
    for fn in (compiled(model, dynamic=False, options={"on_unsupported": "error"}), ref):
        (fn(x) ** 2).sum().backward()
    fw = [r for r in braze.stats.records[n0:] if r["kind"] == "forward"][0]
    assert len(fw["kernels"]) == 9 and not fw["externs"], fw["kernels"]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4 * max(1.0, q.grad.abs().max().item()), msg=name)
    # Degenerate sizes: K = 1 (an outer product), M = N = 1 (a dot product), batched ones.
    for sa, sb in (((4, 1), (1, 5)), ((1, 8), (8, 1)), ((1, 1), (1, 1)), ((3, 1, 4), (3, 4, 1)), ((2, 3, 1), (2, 1, 5))):
        a, b = torch.randn(*sa), torch.randn(*sb)
        torch.testing.assert_close(compiled(torch.matmul, dynamic=False, options={"on_unsupported": "error"})(a, b), a @ b)
        assert "matmul" not in braze.stats.records[-1]["schedule"], (sa, sb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matmul_epilogues(device, dtype):
    """linear + tanh-gelu rides on the matmul (cuBLASLt's GELU epilogue is the tanh form), a
    residual add becomes the matmul's C operand (also through the reshape of a 3-d linear);
    exact gelu stays a fused kernel after the matmul. `rt.t() + linear(h, w2)` is laid out
    column-major as eager returns it, so its add stays one pointwise kernel that writes that
    layout (a C operand would need the residual copied and the sum copied again)."""
    if device == "cpu" and dtype != torch.float32:
        pytest.skip("half matmuls on CPU are ATen's")
    F = torch.nn.functional

    def f(x, w1, b1, w2, b2, r, rt, w3, r3, p, q, rb):
        h = F.gelu(F.linear(x, w1, b1), approximate="tanh")
        y = F.linear(h, w2, b2) + r
        z = rt.t() + F.linear(h, w2)
        e = F.gelu(F.linear(x, w1))
        v = F.linear(h.view(2, 256, 64), w3, b2) + r3  # 3-d linear: a reshape between
        u = torch.bmm(p, q) + rb  # batched: the residual has a batch stride
        return h, y, z, e, v, u

    g = lambda *s: torch.randn(*s, device=device, dtype=dtype)
    # Each matmul above [Note: small matmuls]'s size, so cuBLASLt computes it.
    args = (g(512, 32), g(64, 32) * 0.3, g(64), g(32, 64) * 0.3, g(32), g(512, 32), g(32, 512), g(32, 64) * 0.3, g(2, 256, 32), g(3, 64, 128) * 0.3, g(3, 128, 64), g(3, 64, 64))
    tol = {"rtol": 5e-5, "atol": 5e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    prec = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        outs = compiled(f)(*args)
        for o, r in zip(outs, f(*args)):
            torch.testing.assert_close(o, r, **tol)
            assert o.stride() == r.stride()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prec
    if dtype == torch.float32:
        # The two gelu forms differ by up to 5e-4: the result is the tanh one, not erf's.
        exact = F.gelu(F.linear(args[0], args[1], args[2]))
        assert (outs[0] - exact).abs().max() > 1e-4
    rec = braze.stats.records[-1]
    assert rec["status"] == "compiled"
    if device == "cuda":
        sched = rec["schedule"]
        assert sched.count("matmul %") == 6, sched
        # Kernels: the column-major add and the exact gelu; the tanh gelu and the other
        # residual adds are inside matmuls.
        assert len(rec["kernels"]) == 2, rec["kernels"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_misaligned_matmul_rows(device, dtype):
    """A vocabulary head whose rows are not a multiple of 16 bytes (1001 columns): on CUDA the
    matmuls run at a padded size (1008 bf16 or 1004 f32 columns; cuBLASLt's aligned kernels),
    the loss reads the logits from the padded rows, the backward pads the logits gradient once
    for both its matmuls, and the logits the user gets are a view of the padded rows (as
    Inductor returns them); on the CPU they are row-major as in eager."""
    if device == "cpu" and dtype != torch.float32:
        pytest.skip("half matmuls on CPU are ATen's")
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 1001, bias=False).to(device, dtype)
    head2 = torch.nn.Linear(64, 1001, bias=False).to(device, dtype)
    head2.load_state_dict(head.state_dict())

    def step(h, x, t):
        logits = h(torch.tanh(x))
        return torch.nn.functional.cross_entropy(logits.float(), t), logits

    x = torch.randn(48, 64, device=device, dtype=dtype, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    t = torch.randint(0, 1001, (48,), device=device)
    c = compiled(lambda x, t: step(head2, x, t))
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    prec = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        (loss, logits), (loss2, logits2) = step(head, x, t), c(x2, t)
        torch.testing.assert_close(loss2, loss, **tol)
        torch.testing.assert_close(logits2, logits, **tol)
        padded = 1008 if dtype == torch.bfloat16 else 1004
        assert logits2.stride() == ((padded, 1) if device == "cuda" else logits.stride())
        loss.backward()
        loss2.backward()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prec
    torch.testing.assert_close(x2.grad, x.grad, **tol)
    torch.testing.assert_close(head2.weight.grad, head.weight.grad, **tol)
    recs = braze.stats.records[-2:]
    assert [r["kind"] for r in recs] == ["forward", "backward"]
    assert all(r["status"] == "compiled" for r in recs)
    if device == "cuda":
        fw, bw = recs[0]["schedule"], recs[1]["schedule"]
        row = f"{padded}*i"
        assert fw.count("matmul %") == 1 and row in fw, fw
        assert bw.count("matmul %") == 2 and row in bw, bw


def test_softmax_and_layernorm_fuse(device):
    def f(x, w, b):
        return torch.softmax(torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b), dim=-1)

    x, w, b = (torch.randn(8, 33, device=device), torch.randn(33, device=device), torch.randn(33, device=device))
    torch.testing.assert_close(compiled(f)(x, w, b), f(x, w, b))
    rec = braze.stats.records[-1]
    assert len(rec["kernels"]) <= 2, rec["kernels"]


class GPTBlock(torch.nn.Module):
    """Embedding, causal self-attention through scaled_dot_product_attention, MLP, layer norms
    and a cross-entropy loss: the small GPT-style block of issue 3."""

    def __init__(self, vocab=97, d=64, heads=4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.ln1, self.ln2, self.lnf = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.head = torch.nn.Linear(d, vocab)
        self.heads = heads

    def forward(self, idx, targets):
        b, t = idx.shape
        x = self.emb(idx)
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=-1)
        shape = (b, t, self.heads, -1)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))
        logits = self.head(self.lnf(x))
        return torch.nn.functional.cross_entropy(logits.view(b * t, -1), targets.view(-1))


def test_gpt_block_training(device):
    torch.manual_seed(0)
    m = GPTBlock().to(device)
    m2 = GPTBlock().to(device)
    m2.load_state_dict(m.state_dict())
    idx = torch.randint(0, 97, (3, 16), device=device)
    tgt = torch.randint(0, 97, (3, 16), device=device)
    c = compiled(m2)
    for _ in range(2):
        loss, loss2 = m(idx, tgt), c(idx, tgt)
        torch.testing.assert_close(loss2, loss, rtol=1e-4, atol=1e-4)
        loss.backward()
        loss2.backward()
    for (n, p), (_, p2) in zip(m.named_parameters(), m2.named_parameters()):
        torch.testing.assert_close(p2.grad, p.grad, rtol=1e-4, atol=1e-4, msg=n)
    assert all(r["status"] == "compiled" for r in braze.stats.records[-2:])


def test_graph_breaks_give_eager_results():
    def f(x):
        y = x.sin()
        if y.sum().item() > 0:  # data-dependent branch: a graph break
            y = y * 2
        print("side effect", file=sys.stderr)
        return y.cos() + x.max().item()

    for _ in range(3):
        x = torch.randn(16, 8)
        torch.testing.assert_close(compiled(f)(x), f(x))


def test_dynamic_shapes_recompile_symbolically(device):
    def f(x, y):
        return (x * y.sum(dim=-1, keepdim=True)).relu() + x.mean()

    c = compiled(f)
    for n in (8, 11, 17, 3):
        x, y = torch.randn(n, 7, device=device), torch.randn(n, 5, device=device)
        torch.testing.assert_close(c(x, y), f(x, y))
    assert braze.stats.graphs_eager == 0 or all("sym" not in r for _, r in braze.stats.eager_reasons)


def test_dynamic_true(device):
    def f(x):
        return torch.softmax(x * 2, dim=-1) + x.sum(0)

    c = compiled(f, dynamic=True)
    for n, k in ((4, 6), (9, 6), (5, 13)):
        x = torch.randn(n, k, device=device)
        torch.testing.assert_close(c(x), f(x))


def test_matmuls_with_dynamic_sizes(device):
    """Linears, a transposed-weight mm and a bmm under dynamic=True, called with several
    sizes (one of them 1): on the CPU they are braze's BLAS matmuls, their sizes read from
    each call's symbols ([Note: CPU matmuls]), with the relu and residual epilogues; on CUDA
    (symbolic sizes) ATen's. Training too: the backward's matmuls take the same path."""
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(24, 40).to(device), torch.nn.Linear(40, 24).to(device)

    def f(x, y, z):
        h = torch.relu(lin1(x))
        out = lin2(h) + x
        return out, torch.bmm(y, z.transpose(1, 2)) * 0.5, y[:, 0] @ lin1.weight[:, :y.shape[-1]].t()

    c = compiled(f, dynamic=True)
    for n, b in ((5, 2), (1, 3), (13, 1)):
        args = (torch.randn(n, 24, device=device, requires_grad=True), torch.randn(b, n, 16, device=device), torch.randn(b, 7, 16, device=device))
        got, want = c(*args), f(*args)
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_, atol=1e-4, rtol=1e-4)
        grads = torch.autograd.grad(sum(o.square().sum() for o in got), [args[0], lin1.weight])
        ref = torch.autograd.grad(sum(o.square().sum() for o in want), [args[0], lin1.weight])
        for g_, w_ in zip(grads, ref):
            torch.testing.assert_close(g_, w_, atol=1e-3, rtol=1e-4)
    assert braze.stats.graphs_eager == 0
    if device == "cpu" and braze._core.cpu_blas_ready():
        recs = [r for r in braze.stats.records if r.get("status") == "compiled"]
        assert recs and all(not any("mm" in op for op in r["externs"]) for r in recs), [r["externs"] for r in recs]
        assert any("matmul" in r["schedule"] and re.search(r"\bs\d+\b", r["schedule"]) for r in recs)


def test_input_mutation_and_inplace():
    def f(x, y):
        x.add_(1)
        y.mul_(2).sin_()
        return x * y

    a, b = torch.randn(5, 4), torch.randn(5, 4)
    a2, b2 = a.clone(), b.clone()
    out = compiled(f)(a2, b2)
    ref = f(a, b)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(a2, a)
    torch.testing.assert_close(b2, b)


@pytest.mark.parametrize("case", ["zero_size", "noncontiguous", "broadcast", "scalar", "expanded"])
def test_odd_inputs(case, device):
    def f(x, y):
        return torch.tanh(x) * y + 1

    if case == "zero_size":
        x, y = torch.randn(0, 4), torch.randn(4)
    elif case == "noncontiguous":
        x, y = torch.randn(6, 10).t(), torch.randn(12, 10)[::2].t()
    elif case == "broadcast":
        x, y = torch.randn(3, 1, 5), torch.randn(4, 1)
    elif case == "scalar":
        x, y = torch.randn(()), torch.randn(())
    else:
        x, y = torch.randn(1, 5).expand(4, 5), torch.randn(4, 5)
    x, y = x.to(device), y.to(device)
    torch.testing.assert_close(compiled(f)(x, y), f(x, y))


def test_outputs_are_views_and_fresh():
    def f(x):
        y = x + 1
        return y.t(), y[1:], x.clone()

    x = torch.randn(4, 6)
    outs, refs = compiled(f)(x), f(x)
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r)
        assert o.stride() == r.stride()
    outs[2].add_(1)  # must not write into x
    torch.testing.assert_close(x + 0, refs[2])


def test_cloned_views_have_eager_strides(device):
    """A clone of a strided view is row-major in eager (of a dense permutation it keeps the
    permutation): braze returns those strides, not the view's (a graph compiled for eager's
    strides, such as the backward that reads saved tensors, would copy it again)."""

    def f(x):
        y = x + 1
        return y[:, ::2].clone(), y.view(4, 6, 3, 8)[:, :, 0].transpose(1, 2).clone(), y.t().clone(), y[1:3].clone()

    x = torch.randn(24, 24, device=device)
    for o, r in zip(compiled(f)(x), f(x)):
        torch.testing.assert_close(o, r)
        assert o.stride() == r.stride()
    rec = braze.stats.records[-1]
    assert rec["status"] == "compiled" and not rec["externs"]


@pytest.mark.parametrize("source", ["contiguous", "channels_last", "sliced"])
def test_copies_of_inputs_have_eager_strides(device, source):
    """A graph that copies its input into a memory format (`x.contiguous(memory_format=
    torch.channels_last)`, `x.to(memory_format=...)`, a clone) returns eager's strides: braze
    lowers the copy to the input itself, and the copy the runtime makes of a returned input
    kept the input's strides (a contiguous result where eager's is channels_last)."""
    cl, cf = torch.channels_last, torch.contiguous_format
    fns = [lambda t: t.contiguous(memory_format=cl), lambda t: t.to(memory_format=cl), lambda t: t.clone(memory_format=cf),
           lambda t: t.clone(), lambda t: t.contiguous(), lambda t: t.to(torch.float16, memory_format=cl)]
    x = torch.randn(4, 16, 6, 12, device=device)
    x = {"contiguous": x, "channels_last": x.contiguous(memory_format=cl), "sliced": x[..., ::2]}[source]
    for f in fns:
        torch._dynamo.reset()
        out, ref = compiled(f, options={"on_unsupported": "error"})(x), f(x)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        assert out.stride() == ref.stride(), (source, out.stride(), ref.stride())
        assert (out.data_ptr() == x.data_ptr()) == (ref.data_ptr() == x.data_ptr())
        rec = braze.stats.records[-1]
        assert rec["status"] == "compiled" and not rec["externs"], rec


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_max_pool_inference_is_fused(device, layout):
    """Max pooling in inference lowers to one kernel with the BatchNorm and ReLU before it
    (windows of 3, 2 and 3 with padding, stride 2 and 1; NaN propagates as in eager) and
    keeps eager's strides; in training its indices feed the backward and it stays ATen's."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(8).to(device).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)

    def f(x):
        y = torch.relu(bn(x))
        return (torch.nn.functional.max_pool2d(y, 3, 2, 1), torch.nn.functional.max_pool2d(x, 2),
                torch.nn.functional.max_pool2d(x, 3, 1, 1))

    x = torch.randn(2, 8, 15, 14, device=device)
    x[0, 1, 3, 4] = float("nan")
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    with torch.no_grad():
        for o, r in zip(compiled(f)(x), f(x)):
            torch.testing.assert_close(o, r, equal_nan=True)
            assert o.stride() == r.stride()
    rec = braze.stats.records[-1]
    assert rec["status"] == "compiled" and not rec["externs"], rec["externs"]
    xg = x.detach().clone().requires_grad_(True)
    xg2 = x.detach().clone().requires_grad_(True)
    g = lambda x: torch.nn.functional.max_pool2d(torch.relu(x), 3, 2, 1).sum()
    g(xg).backward()
    compiled(g)(xg2).backward()
    torch.testing.assert_close(xg2.grad, xg.grad, equal_nan=True)


def test_cpu_inference_convolutions_run_channels_last():
    """On the CPU an inference graph's convolutions run channels_last (oneDNN's fast layout):
    the input image is laid out once, the BatchNorm, ReLU, max pool and residual kernels
    after a convolution write channels_last, the next convolution takes their result as it
    is, and the graph's outputs have eager's strides."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.b1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8)
            self.c2, self.b2 = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8)
            self.fc = torch.nn.Linear(8, 5)

        def forward(self, x):
            y = torch.nn.functional.max_pool2d(torch.relu(self.b1(self.c1(x))), 3, 2, 1)
            z = torch.relu(self.b2(self.c2(y)) + y)
            return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(z, 1), 1)), self.c2(z)

    m = Net().eval()
    with torch.no_grad():
        for b in (m.b1, m.b2):
            b.running_mean.uniform_(-1, 1)
            b.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        outs, refs = compiled(m)(x), m(x)
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)
        assert o.stride() == r.stride()
    rec = braze.stats.records[-1]
    assert rec["status"] == "compiled" and rec["kind"] == "inference"
    copies = [k for k, _ in rec["kernels"] if "copy" in k]
    # The input's layout and the returned convolution's eager strides; nothing between.
    assert len(copies) == 2, rec["kernels"]
    # conv_layout='eager' keeps eager's layouts: no copies at all, the same values.
    torch._dynamo.reset()
    with torch.no_grad():
        outs = compiled(m, options={"on_unsupported": "error", "conv_layout": "eager"})(x)
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)
    rec = braze.stats.records[-1]
    assert rec["status"] == "compiled" and not [k for k, _ in rec["kernels"] if "copy" in k], rec["kernels"]


class _ConvNet(torch.nn.Module):
    """Convolution, BatchNorm, ReLU, max pool and a residual add, as in a ResNet."""

    def __init__(self, c=8):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(3, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c)
        self.c2, self.b2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c)
        self.c3 = torch.nn.Conv2d(c, c, 1)
        self.fc = torch.nn.Linear(c, 5)

    def forward(self, x):
        y = torch.nn.functional.max_pool2d(torch.relu(self.b1(self.c1(x))), 3, 2, 1)
        z = torch.relu(self.b2(self.c2(y)) + y)
        z = torch.relu(self.c3(z)) + z
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(z, 1), 1))


def test_training_convolutions_run_channels_last(device, relayouts, compiled_graphs):
    """With conv_layout='channels_last' ([Note: convolution layout]) a training step of a
    contiguous convnet runs its convolutions channels_last: the forward lays out the input
    image once and nothing else, returns the activations it saves for the backward
    channels_last, and the backward, compiled for them, copies no activation between layouts
    (on the CPU ATen's channels_last weight gradients are relaid into the parameters' strides;
    on the GPU braze's kernels lay the 3x3 weights out and their gradients back). Outputs, gradients and BatchNorm's running statistics are eager's."""
    torch.manual_seed(0)
    m = _ConvNet().to(device)
    ref = copy.deepcopy(m)
    x = torch.randn(4, 3, 16, 16, device=device)
    copies = relayouts
    n0 = len(braze.stats.records)
    c = compiled(m, options={"on_unsupported": "error", "conv_layout": "channels_last"})
    # cuDNN's TF32 kernels differ between layouts by more than fp32 rounding; this checks layouts.
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        for _ in range(2):
            copies.clear()
            for mod in (m, ref):
                mod.zero_grad(set_to_none=True)
            out = c(x)
            out.square().sum().backward()
            r = ref(x)
            r.square().sum().backward()
            torch.testing.assert_close(out, r, rtol=1e-4, atol=1e-4)
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-4)
    for a, b in zip(m.buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    fw, bw = [r for r in braze.stats.records[n0:]]
    assert (fw["kind"], bw["kind"]) == ("forward", "backward")
    # The input image, and on the GPU the two 3x3 weights.
    assert len([k for k, _ in fw["kernels"] if "copy" in k]) == (3 if device == "cuda" else 1), fw["kernels"]
    if device == "cuda":
        assert copies == []
    else:
        weights = {tuple(p.shape) for p in m.parameters() if p.dim() == 4}
        assert copies and all(name.startswith("backward") and shape in weights for name, shape in copies), copies
    # The saved activations (4-d, a batch stride of at least 8 channels of 8x8; the weights,
    # saved too, have smaller ones) come back channels_last.
    saved = [st for st in compiled_graphs[0].output_strides() if len(st) == 4 and st[0] >= 512]
    assert len(saved) >= 4 and all(st[1] == 1 for st in saved), saved


class _StridedShortcut(torch.nn.Module):
    """MobileOne's stem (timm FastViT): a 3x3 and a 1x1 convolution, both with stride 2, over
    an RGB image, each with BatchNorm, summed."""

    def __init__(self, cin=3, c=48):
        super().__init__()
        self.kxk = torch.nn.Conv2d(cin, c, 3, 2, 1, bias=False)
        self.scale = torch.nn.Conv2d(cin, c, 1, 2, bias=False)
        self.b1, self.b2 = torch.nn.BatchNorm2d(c), torch.nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.nn.functional.gelu(self.b1(self.kxk(x)) + self.b2(self.scale(x)))


@pytest.mark.parametrize("layout", ["braze", "model"])
@pytest.mark.parametrize("cin", [3, 16])
def test_strided_1x1_weight_gradients(device, layout, cin):
    """[Note: strided 1x1 weight gradients] (cpu_conv.py): the weight gradient of a 1x1
    convolution with a stride, over a channels_last input, whether braze chose the layout
    (`conv_layout="channels_last"`) or the model is channels_last. ATen's CPU kernel gets it
    wrong for an input of 3 channels (relative errors near 1, sometimes a crash); braze's
    gradients are those of eager's contiguous (NCHW) step."""
    torch.manual_seed(0)
    m = _StridedShortcut(cin).to(device)
    ref = copy.deepcopy(m)
    x = torch.randn(2, cin, 32, 32, device=device)
    if layout == "model":
        m = m.to(memory_format=torch.channels_last)
    opts = {"on_unsupported": "error", "conv_layout": "channels_last" if layout == "braze" else "eager"}
    c = compiled(m, options=opts)
    xin = x.to(memory_format=torch.channels_last) if layout == "model" else x
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        c(xin).square().mean().backward()
        ref(x).square().mean().backward()
    for (n, a), b in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=n)
    calls = braze.stats.extern_ops
    if device == "cpu":
        assert calls.get("aten.convolution_backward[strided 1x1]") == 1, calls


def test_channels_last_batch_of_one(device, relayouts):
    """A batch of one channels_last: braze's buffers get PyTorch's strides on their size-1
    dims (batch stride C*H*W), which ATen reads as channels_last. With batch stride 1 each
    convolution took its operand for NCHW, copied it and returned NCHW, which the call then
    laid out again (43 copies per ResNet-50 call)."""
    torch.manual_seed(0)
    m = _ConvNet(16).to(device).eval()
    x = torch.randn(1, 3, 16, 16, device=device)
    c = compiled(m, options={"on_unsupported": "error", "conv_layout": "channels_last"})
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        for _ in range(2):
            torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
    assert relayouts == []
    rec = braze.stats.records[-1]
    assert rec["status"] == "compiled" and rec["kind"] == "inference"


def test_dynamic_cpu_convolutions_run_channels_last(relayouts):
    """Under dynamic=True a CPU inference convnet's convolutions run channels_last as with
    static sizes ([Note: convolution layout]; the layout choice reads the sizes' traced
    values): they kept eager's layout, and ResNet-18 b8 224² took 170-200 ms per call on the
    2-core CPU against 122-125 channels_last (Inductor 129). One graph serves two image sizes;
    the input is laid out once, nothing else is copied, outputs are eager's. (The sizes share
    their parity: PyTorch 2.11's max pool guards on it, and recompiles for the other.)"""
    torch.manual_seed(0)
    m = _ConvNet(16).eval()
    n0 = len(braze.stats.records)
    c = compiled(m, options={"on_unsupported": "error"}, dynamic=True)
    with torch.no_grad():
        for h, w in ((20, 18), (14, 22), (20, 18)):
            x = torch.randn(4, 3, h, w)
            relayouts.clear()
            torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
            assert relayouts == []
    recs = braze.stats.records[n0:]
    assert [r["kind"] for r in recs] == ["inference"], [r["name"] for r in recs]
    rec = recs[0]
    assert re.search(r"\bs\d+\b", rec["schedule"]), "not compiled with symbolic sizes"
    assert not any("eager's layout" in why for why in rec["extern_reasons"].values()), rec["extern_reasons"]
    # The input image laid out channels_last by one kernel; the convolutions' results come
    # back channels_last and the kernels after them keep that layout.
    assert len([k for k, _ in rec["kernels"] if "copy" in k]) == 1, rec["kernels"]


def _conv_stack(device, model_layout, out_channels):
    """A stack of convolutions of every kind the library convolutions take (stride and a
    3-channel stem, dilation and depthwise groups, 1x1 with bias, rectangular kernels) with
    BatchNorm and activations between, and its input, both in `model_layout`."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Conv2d(3, 96, 3, stride=2, padding=1, bias=False), torch.nn.BatchNorm2d(96), torch.nn.ReLU(),
        torch.nn.Conv2d(96, 96, 3, padding=2, dilation=2, groups=96), torch.nn.ReLU(),
        torch.nn.Conv2d(96, 128, 1), torch.nn.Hardswish(),
        torch.nn.Conv2d(128, out_channels, (3, 5), stride=(1, 2), padding=(1, 0)),
    ).to(device)
    x = torch.randn(4, 3, 33, 31, device=device)
    if model_layout == "channels_last":
        m, x = m.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    return m, x


@pytest.mark.parametrize("model_layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_library_convolutions(device, dtype, model_layout, relayouts):
    """On the GPU channels_last convolutions are braze's own `conv` op, run by cuDNN inside
    braze's runs ([Note: library convolutions]): no ATen convolution is called, whatever the
    stride, padding, dilation, groups (depthwise included) or bias, in a contiguous model
    laid out channels_last by braze or a channels_last one, and the results are eager's,
    in eager's strides. With cudnn_convs=False the same graph calls ATen's convolution."""
    if device != "cuda":
        pytest.skip("library convolutions run on the GPU")
    m, x = _conv_stack(device, model_layout, 128)
    m.eval()
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    for cudnn_convs in (True, False):
        torch._dynamo.reset()
        n0 = len(braze.stats.records)
        c = compiled(m, options={"on_unsupported": "error", "conv_layout": "channels_last", "cudnn_convs": cudnn_convs})
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32), \
                torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            for _ in range(3):  # the third call replays the run as a CUDA graph
                out, ref = c(x), m(x)
                torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
                assert out.stride() == ref.stride()
        (rec,) = braze.stats.records[n0:]
        convs = [k for k in rec["externs"] if "convolution" in k]
        assert bool(convs) != cudnn_convs, rec["externs"]
    assert relayouts == []


@pytest.mark.parametrize("model_layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, "tf32", torch.bfloat16])
def test_library_convolution_training(device, dtype, model_layout):
    """A training step's convolutions and their gradients are braze's own ops on the GPU
    ([Note: library convolutions]): no ATen convolution or convolution_backward in either
    graph; outputs, every gradient (input, weights, biases) and BatchNorm's statistics are
    eager's, with cuDNN's TF32 engines (its default for fp32) and without."""
    if device != "cuda":
        pytest.skip("library convolutions run on the GPU")
    tf32 = dtype == "tf32"
    dtype = torch.float32 if tf32 else dtype
    m, x = _conv_stack(device, model_layout, 64)
    ref = copy.deepcopy(m)
    x.requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    n0 = len(braze.stats.records)
    c = compiled(m, options={"on_unsupported": "error", "conv_layout": "channels_last"})
    tol = 1e-2 if tf32 else {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32), torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32):
        for _ in range(2):
            for mod in (m, ref):
                mod.zero_grad(set_to_none=True)
            x.grad = xr.grad = None
            out, r = c(x), ref(xr)
            out.float().square().mean().backward()
            r.float().square().mean().backward()
            torch.testing.assert_close(out, r, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad, xr.grad, rtol=tol, atol=tol)
    for (name, a), b in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=tol, msg=name)
        # Strides as AccumulateGrad's layout contract reads them: those of size-1 dims move no
        # element and eager's own differ between ops (a depthwise filter's [C, 1, kH, kW]).
        strides = lambda t: [s for s, n in zip(t.stride(), t.shape) if n != 1]  # noqa: E731
        assert strides(a.grad) == strides(b.grad), name
    for a, b in zip(m.buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    recs = braze.stats.records[n0:]
    assert [r["kind"] for r in recs] == ["forward", "backward"]
    for r in recs:
        assert not [k for k in r["externs"] if "convolution" in k], r["externs"]


def test_convolution_workspace_of_its_own(device):
    """[Note: convolution workspaces] (braze-sched): a cuDNN plan that needs more workspace
    than the libraries' shared 32 MiB gets a buffer of its own, placed by memory planning.
    ResNet's 7×7 stem over 3 channels at b32 224² in fp32: the weight gradient's first
    engines need ~130 MB. The step's results are eager's, and the next calls (the third
    replays its run as a CUDA graph, the workspace's address in the key) agree too."""
    if device != "cuda":
        pytest.skip("library convolutions run on the GPU")
    torch.manual_seed(0)
    m = torch.nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False).cuda().to(memory_format=torch.channels_last)
    ref = copy.deepcopy(m)
    n0 = len(braze.stats.records)
    c = compiled(m, options={"on_unsupported": "error", "conv_layout": "channels_last"})
    for _ in range(3):
        x = torch.randn(32, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
        m.weight.grad = ref.weight.grad = None
        out, r = c(x), ref(x)
        g = torch.randn_like(r)
        out.backward(g)
        r.backward(g)
        # TF32 (cuDNN's default for fp32) over 147 and 401408 products: tolerances scaled.
        torch.testing.assert_close(out, r, rtol=1e-2, atol=3e-3 * r.abs().max().item())
        torch.testing.assert_close(m.weight.grad, ref.weight.grad, rtol=1e-2, atol=3e-3 * ref.weight.grad.abs().max().item())
    recs = braze.stats.records[n0:]
    assert [r["kind"] for r in recs] == ["forward", "backward"]
    assert not [k for r in recs for k in r["externs"] if "convolution" in k]
    assert ", workspace buf" in recs[1]["schedule"], recs[1]["schedule"]


def _traced(model, x):
    from torch.fx.experimental.proxy_tensor import make_fx
    return make_fx(lambda x: model(x), pre_dispatch=False)(x)


def test_conv_layout_choice():
    """Which graphs run their convolutions channels_last under conv_layout='auto' ([Note:
    convolution layout]): on the GPU convnets of more than a few channels, not those with
    convolutions grouped over several channels per group (depthwise ones are fine); on the
    CPU graphs whose activations outweigh their non-1x1 weights, in training only those with
    grouped convolutions; never under 'eager'; always under 'channels_last'."""
    from braze.lowering import conv_channels_last
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    x = torch.randn(2, 3, 32, 32)
    wide = _traced(_ConvNet(96).eval(), x)
    small = _traced(_ConvNet(8).eval(), x)
    grouped = _traced(torch.nn.Sequential(torch.nn.Conv2d(3, 128, 3), torch.nn.Conv2d(128, 128, 3, groups=4)), x)
    depthwise = _traced(torch.nn.Sequential(torch.nn.Conv2d(3, 128, 3), torch.nn.Conv2d(128, 128, 3, groups=128)), x)
    plain = _traced(torch.nn.Sequential(torch.nn.Linear(32, 32)), x)
    assert conv_channels_last(wide, "forward", cuda, "auto")
    assert conv_channels_last(wide, "inference", cuda, "auto")
    assert not conv_channels_last(small, "forward", cuda, "auto")
    assert conv_channels_last(small, "forward", cuda, "channels_last")
    assert not conv_channels_last(grouped, "forward", cuda, "auto")
    assert conv_channels_last(depthwise, "forward", cuda, "auto")
    assert not conv_channels_last(wide, "forward", cuda, "eager")
    assert not conv_channels_last(plain, "inference", cuda, "channels_last")
    assert conv_channels_last(small, "inference", cpu, "auto")
    # On the CPU not where the weights ATen lays out per call outweigh the activations.
    assert not conv_channels_last(_traced(_ConvNet(96).eval(), torch.randn(1, 3, 8, 8)), "inference", cpu, "auto")
    # CPU training: only graphs with grouped (or depthwise) convolutions, whose NCHW kernels
    # and gradients are oneDNN's slow ones.
    assert not conv_channels_last(wide, "forward", cpu, "auto")
    assert conv_channels_last(grouped, "forward", cpu, "auto") and conv_channels_last(depthwise, "forward", cpu, "auto")
    # A backward follows its forward's choice.
    assert conv_channels_last(plain, "backward", cuda, True) and not conv_channels_last(wide, "backward", cuda, False)


def test_unsupported_dtype_falls_back():
    def f(x):
        return (x * 2).abs()

    x = torch.randn(4, dtype=torch.complex64)
    with pytest.warns(UserWarning, match="runs eagerly: Unsupported: dtype torch.complex64"):
        torch.testing.assert_close(compiled(f, options={"on_unsupported": "warn"})(x), f(x))
    assert braze.stats.graphs_eager >= 1
    # Under on_unsupported="error" (the suite's default) the same graph is an error.
    torch._dynamo.reset()
    with pytest.raises(Exception, match="complex64"):
        compiled(f, options={"on_unsupported": "error"})(x)


def test_unlowered_op_runs_through_aten():
    def f(x):
        return torch.cummax(x.sin(), 0).values * 2  # cummax: an extern call between fused kernels

    x = torch.randn(7, 3)
    torch.testing.assert_close(compiled(f)(x), f(x))
    rec = braze.stats.records[-1]
    assert rec["status"] == "compiled" and any("cummax" in k for k in rec["externs"])


def test_dtypes_half_and_int(device):
    def f(x, i):
        return (x.float().exp() * 0.5).to(x.dtype), (i * 3 + 1) // 2, i > 2, x.sum(-1), x.amax(0)

    for dt in (torch.float16, torch.bfloat16, torch.float64):
        x, i = torch.randn(9, 5, dtype=dt, device=device), torch.randint(-5, 5, (9, 5), device=device)
        for o, r in zip(compiled(f)(x, i), f(x, i)):
            torch.testing.assert_close(o, r)


def test_mode_and_option_errors():
    with pytest.raises(braze.BrazeConfigError, match="valid modes"):
        braze.compile(lambda x: x, mode="ultra")
    with pytest.raises(braze.BrazeConfigError, match="valid options"):
        braze.compile(lambda x: x, options={"nope": 1})
    for mode in braze.MODES:
        f = braze.compile(lambda x: x * 2 + 1, mode=mode)
        x = torch.randn(3)
        torch.testing.assert_close(f(x), x * 2 + 1)
        torch._dynamo.reset()


def test_explain_reports_kernels_and_breaks():
    def f(x):
        y = x.sin() + 1
        print("break")
        return y.softmax(-1)

    out = braze.explain(f)(torch.randn(4, 8))
    text = str(out)
    assert out.graph_break_count >= 1
    assert "braze_poi_fused" in text and "braze_red_fused" in text
    assert "compile:" in text


def test_logs_print_generated_code():
    code = (
        "import torch, braze\n"
        "f = torch.compile(lambda x: torch.sin(x) + torch.cos(x), backend='braze')\n"
        "f(torch.randn(8))\n"
    )
    env = {"BRAZE_LOGS": "output_code,fusion,graph"}
    import os

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    assert "braze_poi_fused_add_cos_sin_0" in r.stderr
    assert "[braze:fusion]" in r.stderr and "[braze:graph]" in r.stderr


def test_cat_of_flattened_view(device):
    """A masked load whose index divides a compound expression ((i - 1) // 25)."""
    def f(x):
        flat = x.reshape(-1)
        return torch.cat([torch.ones(1, device=x.device), flat[:-1] * 2])

    x = torch.randn(5, 5, 5, device=device)
    torch.testing.assert_close(compiled(f)(x), f(x))


def test_long_row_reductions(device):
    """Few rows of many elements (split into partial reductions on the GPU)."""
    def f(x, y):
        return (x * 2).sum(), x.amax(), y.sum(-1, keepdim=True), (y > 0).any(-1)

    x = torch.randn(300000, device=device)
    y = torch.randn(3, 2 ** 17, device=device)
    for o, r in zip(compiled(f)(x, y), f(x, y)):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-2)


def test_cuda_graph_replay(device, compiled_graphs):
    """A graph called again with the same buffers replays a captured CUDA graph; new values
    in those buffers, new buffers, and alternating buffer sets all give eager's results."""
    if device != "cuda":
        pytest.skip("CUDA graphs: GPU only")

    def f(x, w):
        # The row sums are an output, so they stay a kernel of their own ([Note: embedded
        # reductions]): a run of two kernels, which is what replays.
        s = torch.sigmoid(x).sum(-1, keepdim=True)
        return torch.relu(x @ w) * s, s

    x, w = torch.randn(64, 32, device=device), torch.randn(32, 16, device=device)
    others = [torch.randn(64, 32, device=device) for _ in range(2)]
    c = compiled(f)
    for i in range(5):
        x.copy_(torch.randn_like(x))  # same pointer, new values: a replay must read them
        # (x @ w is braze's reduction on the GPU, [Note: small matmuls]: f32 sums in another
        # order than cuBLAS's.)
        torch.testing.assert_close(c(x, w), f(x, w), rtol=1e-5, atol=1e-4)
    (g,) = compiled_graphs
    assert len(braze.stats.records[-1]["kernels"]) == 2
    assert g.c.replays >= 3
    for i in range(6):  # two buffer sets in turn, then a fresh one each call
        y = others[i % 2] if i < 4 else torch.randn(64, 32, device=device)
        torch.testing.assert_close(c(y, w), f(y, w), rtol=1e-5, atol=1e-4)


def test_relayout_kernels_compile():
    """The GPU copy of inputs into their compiled layout is a fixed NVRTC source: it must
    compile (checked wherever NVRTC is found, GPU or not)."""
    from braze import cuda

    if not cuda.nvrtc_available():
        pytest.skip("NVRTC not found")
    assert braze._core.nvrtc_compile(braze._core.relayout_source(), "sm_90") > 0


def test_arena_reuses_memory_by_lifetime(device, compiled_graphs):
    """Intermediates whose lifetimes do not overlap share the per-call arena: a chain of
    softmaxes stores each result once, yet the arena holds about two of them, not all."""
    def f(x):
        for i in range(6):  # alternating dims: each softmax is its own kernel, its input stored
            x = torch.softmax(x * 1.5, dim=i % 2)
        return x

    x = torch.randn(64, 1024, device=device)
    torch.testing.assert_close(compiled(f)(x), f(x))
    g = compiled_graphs[-1]
    temps = [b for b in g.bufs if b[0] == "temp"]
    one = 64 * 1024 * 4
    assert len(temps) >= 4, g.bufs
    assert g.arena_bytes <= 2 * one + 4096, (g.arena_bytes, len(temps))


def test_arena_windows_split_long_graphs(device, compiled_graphs):
    """A graph of layers whose intermediates are large next to what crosses between layers
    gets several arena windows ([Note: arena windows]): each is allocated for its steps only,
    so one layer's intermediates are not held while later layers run. Values must not
    change: a window's buffers are addressed from its own arena."""
    def f(x):
        for i in range(6):
            h = torch.softmax(x * 1.5, dim=0)
            x = x + torch.softmax(h * 0.5 + x, dim=1) * 0.1
        return x

    x = torch.randn(1024, 1024, device=device)
    c = compiled(f)
    for _ in range(2):
        torch.testing.assert_close(c(x), f(x))
    g = compiled_graphs[-1]
    wins = g.arena_windows
    assert len(wins) >= 2, wins
    assert all(a[1] < b[0] for a, b in zip(wins, wins[1:])), wins
    assert g.arena_bytes == max(w[2] for w in wins)


def test_runs_end_where_large_buffers_die(device, compiled_graphs):
    """[Note: runs cut where memory dies] (braze-driver): a run of kernels frees what dies in it
    only when it ends, so a 32 MiB input read by the first kernel alone ends that run there;
    the kernels after it run as a run of their own, with the input already released."""
    def f(a, b):
        x = (a.sin() * 2).amax(dim=0)
        return (b * 3 + x).softmax(-1).cos()

    a = torch.randn(2048, 4096, device=device)
    b = torch.randn(64, 4096, device=device)
    torch.testing.assert_close(compiled(f)(a, b), f(a, b))
    g = compiled_graphs[-1]
    big = [i for i, buf in enumerate(g.bufs) if buf[0] == "input" and buf[1] == 0]
    runs = [s for s, st in enumerate(g.steps) if st[0] == "kernels"]
    dies = [s for s in runs if big[0] in g.frees[s]]
    assert len(runs) >= 2 and dies and dies[0] < runs[-1], (g.steps, g.frees)


def test_pointwise_kernels_store_in_place_of_dying_buffers(device, compiled_graphs, monkeypatch):
    """[Note: in-place kernels]: an MLP's activation is stored over the matmul result it reads
    (which dies there), so the arena holds one hidden activation, not two; a kernel that reads
    its dying operand transposed must not, and values are eager's either way. (On the CPU the
    matmuls are braze's BLAS items here: through oneDNN the activation is fused into the call,
    [Note: CPU GEMM library].)"""
    from braze import cpu_linear

    monkeypatch.setattr(cpu_linear, "_F32_LIBRARY", ["blas"])
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 64)).to(device)
    x = torch.randn(256, 64, device=device)
    c = compiled(mlp, options={"on_unsupported": "error"})
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(c(x), mlp(x))
    g = compiled_graphs[-1]
    assert g.c.in_place >= 2, g.c.schedule
    hidden = 256 * 1024 * 4
    assert g.arena_bytes <= 2 * hidden + 4096, g.arena_windows

    w = torch.randn(64, 64, device=device)

    def transposed(x):
        h = x @ w
        return (h.t().contiguous() * 2).sin()

    x = torch.randn(64, 64, device=device)
    torch.testing.assert_close(compiled(transposed)(x), transposed(x), rtol=1e-5, atol=1e-4)  # a small matmul
    assert compiled_graphs[-1].c.in_place == 0, compiled_graphs[-1].c.schedule


def test_extern_results_taken_in_place_only_when_fresh(device, compiled_graphs):
    """A convolution's result (an extern call's fresh tensor) that dies at the BatchNorm+ReLU
    kernel reading it is that kernel's output memory; results an op may alias (views, calls
    of other callables) are never overwritten."""
    from braze.lowering import ExternCall

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                            torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU()).to(device).eval()
    x = torch.randn(4, 8, 32, 32, device=device).to(memory_format=torch.channels_last)
    c = compiled(m, options={"on_unsupported": "error"})
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
    g = compiled_graphs[-1]
    assert g.reused >= 1, (g.c.reuse, g.c.schedule)
    aten = torch.ops.aten
    assert ExternCall(aten.convolution.default, (), {}, []).fresh
    assert not ExternCall(aten.as_strided.default, (), {}, []).fresh
    assert not ExternCall(aten.split.Tensor, (), {}, []).fresh
    assert not ExternCall(lambda x: x, (), {}, []).fresh


def test_backward_frees_saved_activations_as_it_goes(device, compiled_graphs):
    """[Note: inputs freed at their last use]: a backward graph called with a list it may
    clear drops each input (a saved activation) after its last reader, so the caller's
    memory for it is freed mid-graph, as eager frees it; `retain_graph` keeps them for a
    second backward. Gradients are eager's either way."""
    import weakref

    torch.manual_seed(0)
    # Convolutions are library calls: steps of their own between runs of kernels.
    m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.Tanh()) for _ in range(4)]).to(device)
    x = torch.randn(4, 8, 16, 16, device=device, requires_grad=True)
    c = compiled(m, options={"on_unsupported": "error"})
    c(x).sum().backward()
    want = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    y = c(x).sum()
    y.backward(retain_graph=True)
    y.backward()  # the saved activations are still there for a second backward
    for p, w in zip(m.parameters(), want):
        torch.testing.assert_close(p.grad, 2 * w)
    from braze import runtime

    orig = runtime.CompiledGraph.__call__
    seen = []

    def traced(self, args, on_step=None):
        if not self.name.startswith("backward"):
            return orig(self, args, on_step)
        refs = [weakref.ref(t) for t in args if isinstance(t, torch.Tensor)]
        dead = []
        out = orig(self, args, lambda kind, what, bufs: dead.append(sum(r() is None for r in refs)))
        seen.append((dead, args))
        return out
    runtime.CompiledGraph.__call__ = traced
    try:
        m.zero_grad(set_to_none=True)
        c(x).sum().backward()
    finally:
        runtime.CompiledGraph.__call__ = orig
    for p, w in zip(m.parameters(), want):
        torch.testing.assert_close(p.grad, w)
    (dead, args), = seen
    assert not args, "the boxed argument list is handed over"
    assert dead[len(dead) // 2] > 0 and dead[-1] >= 3, dead


def test_on_step_sees_every_plan_step(device, compiled_graphs):
    """`CompiledGraph.__call__(args, on_step=...)` (the hook of `benchmarks/step_probe.py`)
    is called once per plan step, with each step's kind and live buffers, and leaves the
    result as it is."""
    def f(x):
        return torch.softmax(x * 2, dim=0).sum(1) + x.mean()

    x = torch.randn(64, 32, device=device)
    with torch.no_grad():
        torch.testing.assert_close(compiled(f)(x), f(x))
    g = compiled_graphs[-1]
    seen = []
    out = g([x], on_step=lambda kind, what, bufs: seen.append((kind, sum(t is not None for t in bufs))))
    torch.testing.assert_close(out[0], f(x))
    assert len(seen) == len(g.steps) and all(k in (0, 1) and live > 0 for k, live in seen), seen


def test_cpu_arenas_kept_between_calls(device, compiled_graphs):
    """[Note: CPU arenas]: on the CPU a graph's arenas are kept between calls and reused (the
    same memory on the next call), and results stay right on new inputs (nothing of the
    previous call leaks through); on CUDA PyTorch's caching allocator keeps them instead."""
    def f(x):
        for i in range(4):
            x = torch.softmax(x * 1.5, dim=i % 2) + x
        return x

    c = compiled(f)
    x = torch.randn(256, 512, device=device)
    torch.testing.assert_close(c(x), f(x))
    g = compiled_graphs[-1]
    assert g.arena_windows, "expected arena buffers"
    if device != "cpu":
        assert g.arena_pool is None
        return
    kept = {n: [t.data_ptr() for t in ts] for n, ts in g.arena_pool.items()}
    assert kept and all(kept.values()), g.arena_pool
    for _ in range(3):
        x = torch.randn(256, 512, device=device)
        torch.testing.assert_close(c(x), f(x))
    assert {n: [t.data_ptr() for t in ts] for n, ts in g.arena_pool.items()} == kept
    # Calls from several threads at once (runs release the GIL) each take their own arena.
    import threading
    errors = []

    def worker(seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(10):
            x = torch.randn(256, 512, generator=gen)
            try:
                torch.testing.assert_close(c(x), f(x))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_batchnorm_running_stats_stored_in_place(device, compiled_graphs):
    """BatchNorm's running statistics in training are input mutations AOTAutograd keeps in the
    graph ([Note: input mutations]): braze's kernels store the new values straight into the
    buffers (no copy after the call), and they match eager's step after step."""
    import copy

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                            torch.nn.Conv2d(8, 4, 3), torch.nn.BatchNorm2d(4)).to(device)
    ref = copy.deepcopy(m)
    c = compiled(m, options={"on_unsupported": "error"})
    for _ in range(3):
        x = torch.randn(2, 3, 10, 10, device=device)
        c(x).sum().backward()
        ref(x).sum().backward()
    for (name, a), b in zip(m.named_buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, msg=name)
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)
    fw = compiled_graphs[0]
    # Mean, variance and batch count of both layers, all stored in place.
    assert len(fw.mutations) == 6 and fw.in_place_mutations == 6, fw.mutations
    assert braze.stats.graphs_eager == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batchnorm_lowered_not_decomposed(device, dtype):
    """[Note: BatchNorm lowered, not decomposed]: a training step's BatchNorm (1-d over
    (N, C, L) and 2-d, channels_last, without affine weights) and its backward, and the
    evaluation-mode BatchNorm after it, are lowered by braze itself: the ATen ops reach the
    lowering (none falls back), and outputs, gradients and running statistics match eager."""
    import copy

    torch.manual_seed(0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = torch.nn.Conv2d(3, 8, 3, bias=False)  # a bias before BatchNorm has a zero gradient
            self.b2 = torch.nn.BatchNorm2d(8, affine=False)
            self.b1 = torch.nn.BatchNorm1d(8)

        def forward(self, x):
            y = torch.relu(self.b2(self.c(x)))
            return self.b1(y.flatten(2)).sigmoid()

    m = M().to(device=device, dtype=dtype).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(m)
    before = dict(braze.stats.lowered_ops)
    c = compiled(m, options={"on_unsupported": "error"})
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for _ in range(2):
        x = torch.randn(4, 3, 12, 12, device=device, dtype=dtype).to(memory_format=torch.channels_last)
        xr = x.clone().requires_grad_()
        x.requires_grad_()
        out, want = c(x), ref(xr)
        torch.testing.assert_close(out, want, **tol)
        out.float().square().sum().backward()
        want.float().square().sum().backward()
        torch.testing.assert_close(x.grad, xr.grad, **({"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else tol))
    for a, b in zip(m.parameters(), ref.parameters()):
        # bf16 weight gradients sum bf16 products whose roundings differ: compared as vectors.
        err = (a.grad.float() - b.grad.float()).norm() / b.grad.float().norm()
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), err
    for (name, a), b in zip(m.named_buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, msg=name, **tol)
    m.eval(), ref.eval()
    with torch.no_grad():
        x = torch.randn(4, 3, 12, 12, device=device, dtype=dtype)
        torch.testing.assert_close(c(x), ref(x), **tol)
    lowered = {k: v - before.get(k, 0) for k, v in braze.stats.lowered_ops.items() if v != before.get(k, 0)}
    assert lowered.get("aten._native_batch_norm_legit_functional.default") == 2, lowered
    assert lowered.get("aten.native_batch_norm_backward.default") == 2, lowered
    assert lowered.get("aten._native_batch_norm_legit_no_training.default") == 2, lowered
    assert not any("batch_norm" in op for op in braze.stats.extern_ops), braze.stats.extern_ops
    assert braze.stats.graphs_eager == 0


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_backward_lowered_not_decomposed(device, affine):
    """LayerNorm's backward reaches braze's lowering (no decomposition while AOTAutograd
    traces, [Note: BatchNorm lowered, not decomposed]); gradients of the input, weight and
    bias match eager's, over one and two normalized dims."""
    torch.manual_seed(0)
    for shape in ([32], [8, 32]):
        ln = torch.nn.LayerNorm(shape, elementwise_affine=affine).to(device)
        if affine:
            with torch.no_grad():
                ln.weight.normal_(), ln.bias.normal_()
        before = braze.stats.lowered_ops.get("aten.native_layer_norm_backward.default", 0)
        c = compiled(lambda t: ln(t).tanh(), options={"on_unsupported": "error"})
        x = torch.randn(4, 6, 8, 32, device=device)
        xr = x.clone().requires_grad_()
        x.requires_grad_()
        c(x).sum().backward()
        grads = [p.grad.clone() for p in ln.parameters()]
        ln.zero_grad()
        ln(xr).tanh().sum().backward()
        torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)
        for a, p in zip(grads, ln.parameters()):
            torch.testing.assert_close(a, p.grad, atol=1e-4, rtol=1e-4)
        assert braze.stats.lowered_ops.get("aten.native_layer_norm_backward.default", 0) == before + 1
    assert braze.stats.graphs_eager == 0


def test_input_mutation_read_after_it_is_copied(device, compiled_graphs):
    """An input's new value that is also read by later values cannot be stored in place while
    the input is still being read; it is copied into the input after the call."""
    def f(x, y):
        y.add_(x)
        return y * 2 + x.sum()

    x, y = torch.randn(8, 16, device=device), torch.randn(8, 16, device=device)
    y_ref = y.clone()
    out = compiled(f, options={"on_unsupported": "error"})(x, y)
    ref = f(x, y_ref)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(y, y_ref)
    (g,) = compiled_graphs
    assert len(g.mutations) == 1 and g.in_place_mutations == 0, g.mutations


def test_channels_last_values_keep_eager_strides(device, compiled_graphs):
    """A value eager lays out channels_last is stored channels_last (its kernel iterates in
    that order): outputs come back with eager's strides, and the convolution that reads a
    fused BN+ReLU result gets the layout it gets in eager (no relayout copy)."""
    conv1 = torch.nn.Conv2d(8, 16, 3, padding=1).to(device).to(memory_format=torch.channels_last)
    conv2 = torch.nn.Conv2d(16, 8, 1).to(device).to(memory_format=torch.channels_last)

    def f(x):
        h = (conv1(x) * 1.5 + 0.25).relu()
        return conv2(h).sigmoid(), (x * 2).relu()

    x = torch.randn(2, 8, 12, 12, device=device).to(memory_format=torch.channels_last)
    with torch.no_grad():
        out, ref = compiled(f)(x), f(x)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert a.stride() == b.stride(), (a.stride(), b.stride())
    g = compiled_graphs[-1]
    _, shapes, strides = g.static
    four_d = [(shapes[b], strides[b]) for b, buf in enumerate(g.bufs) if buf[0] == "temp" and len(shapes[b]) == 4]
    assert four_d, g.bufs
    for shape, stride in four_d:  # every stored 4-d intermediate is channels_last, as in eager
        n, c, h, w = shape
        assert stride == (h * w * c, 1, w * c, c), (shape, stride)


@pytest.mark.parametrize("train", [False, True])
def test_permuted_matmul_results_keep_their_order(device, compiled_graphs, train):
    """[Note: permuted views keep their order] (braze-ir's memory_order.rs): ConvNeXt's MLP
    runs on NHWC rows (row-major matrix products) and permutes back to NCHW for the layer
    scale and the residual add. Those values lie channels_last in memory, as in eager, so the
    kernels computing them walk memory in that order and store them channels_last; before,
    they were stored row-major NCHW and their kernels strided by the channels on every
    access. timm's ConvNeXt (small widths), channels_last, bf16 autocast, against eager."""
    timm = pytest.importorskip("timm")
    from timm.models.convnext import ConvNeXt

    torch.manual_seed(0)
    m = ConvNeXt(depths=(2, 1, 1, 1), dims=(24, 40, 40, 40), num_classes=10).to(device).to(memory_format=torch.channels_last).train(train)
    x = torch.randn(2, 3, 64, 64, device=device).to(memory_format=torch.channels_last)
    ref_m = copy.deepcopy(m)
    c = compiled(m, options={"on_unsupported": "error"})
    with torch.autocast(device, dtype=torch.bfloat16), torch.set_grad_enabled(train):
        out, ref = c(x), ref_m(x)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    if train:
        out.float().pow(2).mean().backward()
        ref.float().pow(2).mean().backward()
        for (name, p), q in zip(m.named_parameters(), ref_m.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=5e-2, atol=5e-3, msg=name)
    assert braze.stats.graphs_eager == 0
    for g in compiled_graphs:
        _, shapes, strides = g.static
        for b, buf in enumerate(g.bufs):
            # Activations in NCHW logical order (channels 24 or 40, square maps); the NHWC
            # rows the norms and matrix products work on are row-major in both. The last
            # stage (2 x 2) is left out: its gradient starts as the global pool's broadcast,
            # which has no memory order of its own.
            if buf[0] != "temp" or len(shapes[b]) != 4 or shapes[b][0] != 2 or shapes[b][1] not in (24, 40):
                continue
            n, ch, h, w = shapes[b]
            if h == w > 2:
                assert strides[b] == (h * w * ch, 1, w * ch, ch), (shapes[b], strides[b])


@pytest.mark.parametrize("how", ["option", "mode"])
def test_cuda_graphs_option_and_mode(how, device, compiled_graphs):
    """options={"cuda_graphs": False}, or mode="max-autotune-no-cudagraphs", launches kernels
    one by one: no replays, same results. Both are validated like every option."""
    kw = {"options": {"cuda_graphs": False}} if how == "option" else {"mode": "max-autotune-no-cudagraphs"}
    from braze.config import Config
    assert Config.make(kw.get("mode"), kw.get("options")).cuda_graphs is False
    assert Config.make(None, {"matmul_tune": False}).matmul_tune is False
    assert Config.make().matmul_tune is False and Config.make("reduce-overhead").matmul_tune is False
    assert Config.make("max-autotune").matmul_tune is True and Config.make("max-autotune-no-cudagraphs").matmul_tune is True
    assert Config.make("max-autotune", {"matmul_tune": False}).matmul_tune is False
    assert Config.make(None, {"cudnn_convs": False}).cudnn_convs is False and Config.make().cudnn_convs is True
    with pytest.raises(braze.BrazeConfigError, match="cudnn_convs"):
        Config.make(None, {"cudnn_convs": 1})
    with pytest.raises(braze.BrazeConfigError, match="cuda_graphs"):
        Config.make(None, {"cuda_graphs": "no"})

    def f(x, w):
        return torch.relu(x @ w) * torch.sigmoid(x).sum(-1, keepdim=True)

    x, w = torch.randn(64, 32, device=device), torch.randn(32, 16, device=device)
    c = braze.compile(f, **kw)
    for _ in range(4):
        torch.testing.assert_close(c(x, w), f(x, w), rtol=1e-5, atol=1e-4)  # a small matmul
    (g,) = compiled_graphs
    assert g.c.replays == 0


@pytest.mark.parametrize("layout,channels", [("contiguous", 64), ("channels_last", 64), ("channels_last", 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batchnorm_training_statistics(device, layout, channels, dtype, monkeypatch):
    """BatchNorm2d in training mode, forward and backward, at a size where its statistics
    (and their gradients) reduce 65 536 elements per channel: on the GPU each reduction runs
    in two stages (per-image partials, then their combination; the variance by the law of
    total variance), and a channels_last input is reduced in memory order (C innermost, a
    column kernel) on either device. Outputs, running statistics and gradients match eager.
    On the CPU the GPU's split runs too (BRAZE_SPLIT_REDUCTIONS_CPU, an H100's 132 SMs), so
    its numerics are checked on every machine. With 16 channels (MobileNet-v3-small's stem)
    no dim alone gives enough parts: the batch and a divisor of H do together."""
    F = torch.nn.functional
    monkeypatch.setenv("BRAZE_SPLIT_REDUCTIONS_CPU", "264")
    mf = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    C = channels
    x0 = (torch.randn(16, C, 64, 64, device=device) * 3 + 1.5).to(dtype).contiguous(memory_format=mf)
    w0, b0 = torch.randn(C, device=device), torch.randn(C, device=device)

    def f(x, w, b, rm, rv):
        return F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1).relu()

    outs, grads, stats = [], [], []
    for fn in (compiled(f), f):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        rm, rv = torch.zeros(C, device=device), torch.ones(C, device=device)
        y = fn(x, w, b, rm, rv)
        y.float().square().mean().backward()
        outs.append(y)
        grads.append((x.grad, w.grad, b.grad))
        stats.append((rm, rv))
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(outs[0], outs[1], **tol)
    assert outs[0].stride() == outs[1].stride()
    for a, b in zip(grads[0] + stats[0], grads[1] + stats[1]):
        torch.testing.assert_close(a, b, **tol)
    fwd = next(r for r in braze.stats.records if r["kind"] == "forward")
    sched = "\n".join(r["schedule"] for r in braze.stats.records if r.get("schedule"))
    if layout == "channels_last":
        assert " column " in sched, fwd["schedule"]
    # Stage 1 keeps one more dim than C, as few parts as give the GPU enough blocks: the
    # batch (16 parts; N, C merged into one loop dim and H, W into another) when contiguous;
    # channels_last is a column kernel (8 points per block) and wants 8x the points, more than
    # the batch gives, so H is kept (64 parts) and N, W are reduced. 16 channels want 264
    # parts: the batch's 16 times 32 parts of H (rows of 2 × 64).
    stage1 = {64: "outer=[1024] inner=[4096]" if layout == "contiguous" else "outer=[64, 64] inner=[16, 64] column",
              16: "outer=[16, 32, 16] inner=[128] column"}[C]
    assert stage1 in fwd["schedule"], fwd["schedule"]


def test_split_stage_stores_its_input(device, monkeypatch):
    """[Note: split dims] (braze-sched): the backward of BatchNorm + hardswish over 16
    channels, channels_last, split for the GPU (BRAZE_SPLIT_REDUCTIONS_CPU on the CPU) into
    the batch's 16 times 32 parts of H. Stage 1 reads the gradient through hardswish with H
    split in two dims; that gradient is also read by the input-gradient kernel, so it is
    stored, by stage 1's kernel itself (one kernel walking its elements, not a pointwise kernel
    and then stage 1 reading it back). That gradient is the only value stage 1 stores besides
    its two partial sums: the taken-over kernel's other stores (values the first fusion
    round stored for several readers, all now inside stage 1) are dead and dropped ([Note:
    dead stores]). Values are eager's."""
    monkeypatch.setenv("BRAZE_SPLIT_REDUCTIONS_CPU", "264")
    torch.manual_seed(0)
    m0 = torch.nn.Sequential(torch.nn.BatchNorm2d(16), torch.nn.Hardswish()).to(device)
    x0 = torch.randn(16, 16, 64, 64, device=device).to(memory_format=torch.channels_last)
    outs = []
    for compile_it in (True, False):
        m = copy.deepcopy(m0)
        x = x0.clone().requires_grad_()
        fn = compiled(m, options={"on_unsupported": "error"}) if compile_it else m
        y = fn(x)
        y.square().sum().backward()
        outs.append((y, x.grad, m[0].weight.grad, m[0].bias.grad, m[0].running_mean, m[0].running_var))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    bwd = next(r for r in reversed(braze.stats.records) if r["kind"] == "backward")
    names = [k for k, _ in bwd["kernels"]]
    # Stage 1 (storing the gradient), stage 2, the input gradient.
    assert len(names) == 3 and names[0].startswith("braze_red_"), bwd["schedule"]
    assert len(bwd["kernels"][0][1]) == 3, bwd["schedule"]


@pytest.mark.parametrize("channels", [64, 96])
def test_batchnorm_per_channel_math_hoisted(device, channels):
    """[Note: column-invariant hoisting]: an inference BatchNorm + ReLU + max pool over a
    channels_last activation computes its per-channel `1 / sqrt(var + eps)` once per thread,
    before the grid-stride loop, and reads the padded pool window with masked wide loads.
    Large enough that each GPU thread takes several steps (its column must stay fixed); 96
    channels are 24 threads per row, which the block size is not a multiple of, so the grid
    is rounded. Values are eager's."""
    torch.manual_seed(channels)
    bn = torch.nn.BatchNorm2d(channels).to(device).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    pool = torch.nn.MaxPool2d(3, 2, 1)

    def f(x):
        return pool(torch.relu(bn(x))), torch.relu(bn(x) + x)

    x = torch.randn(8, channels, 96, 96, device=device).to(memory_format=torch.channels_last)
    c = compiled(f, options={"on_unsupported": "error"})
    with torch.no_grad():
        for _ in range(2):
            x.normal_()
            for got, want in zip(c(x), f(x)):
                torch.testing.assert_close(got, want)
    rec = braze.stats.records[-1]
    assert not rec["externs"], rec["externs"]
    src = rec["source"] if device == "cuda" else rec.get("cuda_source")
    if src is None:
        pytest.skip("NVRTC not found: the CUDA source was not generated")
    assert "Column-invariant values" in src, src
    assert "if (j == 0 && t" in src, src  # the pool's masked wide loads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_blocks_fill_sectors(device, dtype, monkeypatch):
    """[Note: column geometry] (braze-codegen): BatchNorm statistics and sums over N, H, W of
    a channels_last activation are column reductions. They run as vector columns ([Note:
    vector columns]: 8 bytes of points per thread, 512 threads); long columns take 8 threads
    across points by 64 along the rows. Split for the GPU (BRAZE_SPLIT_REDUCTIONS_CPU on the
    CPU: 96 channels want 44 parts, the batch's 16 times 4 parts of H), stage 1's columns are
    100 rows long, so its blocks take fewer threads along the rows as long as its grid keeps
    128 blocks of its 6144 points: f32 (2 points a thread) 16 threads across by 32 along, bf16
    (4 points a thread) stays at 8 by 64. Values are eager's (the combinations over the y
    threads), the argmax over N's too."""
    monkeypatch.setenv("BRAZE_SPLIT_REDUCTIONS_CPU", "264")
    x = torch.randn(16, 96, 20, 20, device=device, dtype=dtype).to(memory_format=torch.channels_last)
    x[:, 5] += 100  # a channel whose mean is far from 0: Welford's combination is exercised

    def f(x):
        var, mean = torch.var_mean(x.float(), (0, 2, 3), correction=0)
        return var, mean, x.float().abs().sum((0, 2, 3)), x.argmax(0)

    out = compiled(f, options={"on_unsupported": "error"})(x)
    for got, want in zip(out, f(x)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    rec = braze.stats.records[-1]
    assert not rec["externs"], rec["externs"]
    src = rec["source"] if device == "cuda" else rec.get("cuda_source")
    if src is None:
        pytest.skip("NVRTC not found: the CUDA source was not generated")
    lanes = 8 // dtype.itemsize
    xt, yt = (16, 32) if lanes == 2 else (8, 64)
    assert f"bz_colv_welford<{xt}, {yt}, {lanes}>" in src and f"bz_colv_reduce<{xt}, {yt}, {lanes}>" in src, src
    if device == "cpu":  # the NVRTC check holds the scalar fallback too: its blocks take as many points
        assert f"bz_col_welford<{xt * lanes}, {yt // lanes}>" in src, src


def test_split_stage_two_threads_have_rows(device, monkeypatch):
    """[Note: column geometry]: the statistics of a 120-channel activation at 14×14 (MobileNet-
    v3-small's) split by the batch into 32 parts; stage 2 combines 32 partial rows for each
    of 120 channels. Its grid can never reach the column floor of 128 blocks, and doubling
    its threads along the rows toward it gave each channel 64 threads for 32 rows; it now
    stops at one row a thread (16 channels by 32 threads). Values are eager's."""
    monkeypatch.setenv("BRAZE_SPLIT_REDUCTIONS_CPU", "264")
    x = torch.randn(32, 120, 14, 14, device=device).to(memory_format=torch.channels_last)
    x[:, 7] += 50

    def f(x):
        return torch.var_mean(x, (0, 2, 3), correction=0)

    out = compiled(f, options={"on_unsupported": "error"})(x)
    for got, want in zip(out, f(x)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    rec = braze.stats.records[-1]
    src = rec["source"] if device == "cuda" else rec.get("cuda_source")
    if src is None:
        pytest.skip("NVRTC not found: the CUDA source was not generated")
    kernels = re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(", src)
    assert len([k for k in kernels if not k.endswith("_scalar")]) == 2, kernels
    assert "bz_col_reduce<16, 32>" in src and "bz_col_reduce<8, 64>" not in src, src


@pytest.mark.parametrize("head_dim", [64, 20])
def test_rotary_halves_read_wide(device, head_dim):
    """[Note: lane-uniform masks] (braze-codegen): rotary embeddings' `rotate_half` is a
    concatenation of a head's two halves; in a bf16 kernel its masks are the same for the 8
    lanes of a vector step when the halves are whole vectors (64-wide heads), and the kernel
    reads both halves with wide loads (4 lanes of 8 bytes here: the f32 frequencies are the
    widest buffer). With 20-wide heads (halves of 10) they are not, and the kernel stays
    scalar. Values are eager's either way."""
    b, h, s = 2, 4, 40
    q = torch.randn(b, h, s, head_dim, device=device, dtype=torch.bfloat16)
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    pos = torch.arange(s, device=device).float()

    def f(q, inv, pos):
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        x1, x2 = q[..., : head_dim // 2], q[..., head_dim // 2:]
        return q * cos + torch.cat((-x2, x1), dim=-1) * sin

    c = compiled(f, options={"on_unsupported": "error"})
    for _ in range(2):
        q.normal_()
        torch.testing.assert_close(c(q, inv, pos), f(q, inv, pos), rtol=2e-2, atol=2e-2)
    rec = braze.stats.records[-1]
    assert not rec["externs"], rec["externs"]
    src = rec["source"] if device == "cuda" else rec.get("cuda_source")
    if src is None:
        pytest.skip("NVRTC not found: the CUDA source was not generated")
    wide_masked = re.findall(r"if \(j == 0 && t\d+\) \*\(uint2\*\)w\d+ = \*\(const uint2\*\)\(b", src)
    if head_dim == 64:
        assert len(wide_masked) >= 2, src  # both halves of q, 4 bf16 lanes at once
    else:
        assert not wide_masked, src


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_variance_in_chunks(device, dtype):
    """[Note: Welford in chunks] (braze-codegen): a vector column kernel's variance sums each
    chunk's deviations from the mean so far and merges the chunk as Chan et al. do. Channels
    whose mean is 10³ times their spread, one of constant value and one of mixed scales keep
    float64's variance to within what eager's Welford keeps, over rows long enough for many
    chunks per thread (and, on the GPU, a split into parts). (Eager's CPU kernel sums in
    float64, its CUDA kernel in f32: hence the floor of 5e-4.)"""
    torch.manual_seed(0)
    x = torch.randn(32, 64, 40, 40, device=device)
    x[:, :16] = x[:, :16] * 0.1 + 100.0
    x[:, 16] = 3.0
    x[:, 17] *= torch.logspace(-3, 3, 40, device=device)[None, :, None]
    x = x.to(dtype).contiguous(memory_format=torch.channels_last)

    def f(x):
        return torch.var_mean(x.float(), (0, 2, 3), correction=1)

    got = compiled(f, options={"on_unsupported": "error"})(x)
    want = torch.var_mean(x.double(), (0, 2, 3), correction=1)
    eager = f(x)
    for g, w, e in zip(got, want, eager):
        err = ((g.double() - w).abs() / w.abs().clamp_min(1e-30)).max().item()
        err_eager = ((e.double() - w).abs() / w.abs().clamp_min(1e-30)).max().item()
        assert err <= max(2 * err_eager, 5e-4), (err, err_eager)
    rec = braze.stats.records[-1]
    assert not rec["externs"], rec["externs"]
    src = rec["source"] if device == "cuda" else rec.get("cuda_source")
    if src is None:
        pytest.skip("NVRTC not found: the CUDA source was not generated")
    assert "bz_ix r0 = cr + " in src and "_v[j] * m) + m * m * fw" in src, src


def test_column_sums_in_blocks(device):
    """[Note: column sums in blocks] (braze-codegen's openmp.rs): the sums of a channels_last
    BatchNorm's backward over 2 x 112 x 112 points per channel (a column kernel) stay within a
    few times eager's error against float64; adding the 25 088 rows one at a time into one
    accumulator per column was 40 times eager's on the CPU."""
    torch.manual_seed(0)
    x = (torch.randn(2, 64, 112, 112, device=device) + 1.0).contiguous(memory_format=torch.channels_last)

    def f(x):
        return x.sum((0, 2, 3)), (x * x).sum((0, 2, 3))

    got = compiled(f, options={"on_unsupported": "error"})(x)
    want = f(x.double())
    for g, w, e in zip(got, want, f(x)):
        err = ((g.double() - w).abs() / w.abs()).max().item()
        err_eager = ((e.double() - w).abs() / w.abs()).max().item()
        assert err <= max(8 * err_eager, 1e-6), (err, err_eager)
    assert not braze.stats.records[-1]["externs"]


def test_batchnorm_mean_over_many_chunks(device):
    """[Note: chunked Welford] (braze-codegen's openmp.rs): the sums of a chunked Welford pass
    (a BatchNorm's mean over 8 x 112 x 112 points per channel, NCHW) add each chunk's sum into
    a double; a float total over the 392 chunks was 3.2e-6 from float64's where eager's was
    5.7e-8 on the CPU, and VOLO's stem gradients 100 times eager's error. The variance and the
    mean stay within a few times eager's error."""
    torch.manual_seed(0)
    x = torch.randn(8, 32, 112, 112, device=device) * 2 + 0.5

    def f(x):
        return torch.var_mean(x, (0, 2, 3), correction=0)

    got = compiled(f, options={"on_unsupported": "error"})(x)
    want = f(x.double())
    for g, w, e in zip(got, want, f(x)):
        err = ((g.double() - w).abs() / w.abs()).max().item()
        err_eager = ((e.double() - w).abs() / w.abs()).max().item()
        # Eager's CUDA kernel sums in f32 too: a looser floor there.
        assert err <= max(4 * err_eager, 5e-7 if device == "cpu" else 2e-6), (err, err_eager)
    assert not braze.stats.records[-1]["externs"], braze.stats.records[-1]["externs"]


def test_short_column_reductions_run_a_thread_per_point(device):
    """A global average pool of a channels_last activation (49 elements for each of many
    channels and images) runs one thread per output on the GPU, every load coalesced across
    neighbouring threads, instead of a column block per 8 outputs; values are eager's, with
    the BatchNorm + ReLU before it fused in."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(2048).to(device).eval()
    with torch.no_grad():
        bn.running_var.uniform_(0.5, 2.0)
        bn.running_mean.uniform_(-1, 1)

    def f(x, r):
        return torch.relu(bn(x) + r).mean(dim=(2, 3))

    x = torch.randn(16, 2048, 7, 7, device=device).to(memory_format=torch.channels_last)
    r = torch.randn_like(x)
    with torch.no_grad():
        torch.testing.assert_close(compiled(f, options={"on_unsupported": "error"})(x, r), f(x, r))
    rec = braze.stats.records[-1]
    src = rec["source"] if device == "cuda" else rec.get("cuda_source")
    if src is None:
        pytest.skip("NVRTC not found: the CUDA source was not generated")
    red = src[src.index("braze_red"):]
    red = red[:red.index("\n}\n")]
    assert "bz_col_reduce" not in red and "#pragma unroll 8" in red, red


def test_unaligned_inputs_take_the_scalar_fallback(device, compiled_graphs):
    """[Note: lazy scalar fallback]: vector kernels hold only their wide loop; a call whose
    input is a slice at an odd element offset (not 16-byte aligned) runs the kernel's scalar
    version, compiled on first use, and an aligned call after it the vector one. Values are
    eager's for both, in bf16 and f32, with a BatchNorm-style per-channel operand (hoisted)."""
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        scale = torch.rand(256, device=device) + 0.5

        def f(x):
            return torch.relu(x.float() * torch.rsqrt(scale + 1e-5) + 1.0).to(x.dtype)

        c = compiled(f, dynamic=False, options={"on_unsupported": "error"})
        flat = torch.randn(64 * 256 + 1, device=device, dtype=dtype)
        aligned = flat[:-1].view(64, 256)
        odd = flat[1:].view(64, 256)  # 2 or 4 bytes past a 16-byte boundary
        for x in (aligned, odd, aligned, odd):
            torch.testing.assert_close(c(x), f(x))
        # On the CPU the NVRTC check compiles every fallback (the GPU compiles one on demand).
        src = braze.stats.records[-1].get("cuda_source") if device == "cpu" else None
        if src:
            assert "_scalar(" in src and "loop for unaligned pointers" in src, src


def test_vector_rows(device, compiled_graphs):
    """[Note: vector rows]: block-per-row reductions read 16 bytes per thread and step when
    the innermost reduced dim allows it: NCHW BatchNorm statistics (a variance folded per
    step), its backward's two sums, and a softmax whose rows are long (three passes, the last
    storing wide). Values are eager's for aligned inputs and for a slice at an odd element
    offset (the scalar fallback), in f32 and bf16."""
    def f(x, g, acc=torch.float32):
        var, mean = torch.var_mean(x.to(acc), (0, 2, 3), correction=1)
        gs = g.to(acc).sum((0, 2, 3))
        gx = (g.to(acc) * (x.to(acc) - mean[None, :, None, None])).sum((0, 2, 3))
        return var, mean, gs, gx

    def soft(x):
        return torch.softmax(x.float() * 1.5, dim=-1).to(x.dtype)

    shape = (8, 16, 28, 28)
    n = torch.Size(shape).numel()
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        c = compiled(f, dynamic=False, options={"on_unsupported": "error"})
        flat, gflat = (torch.randn(n + 1, device=device, dtype=dtype) * 2 + 1 for _ in range(2))
        for off in (0, 1, 0):
            x, g = (t[off:off + n].view(shape) for t in (flat, gflat))
            want = f(x, g, torch.float64)
            for a, b in zip(c(x, g), want):
                torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-3)
        src = braze.stats.records[-1].get("cuda_source") if device == "cpu" else None
        v = 16 // dtype.itemsize
        if src:
            assert src.count(f"rv * {v}") >= 2 and "vx" in src, src
        cs = compiled(soft, dynamic=False, options={"on_unsupported": "error"})
        rows = torch.randn(6 * 4096 + 1, device=device, dtype=dtype)
        for off in (0, 1):
            x = rows[off:off + 6 * 4096].view(6, 4096)
            torch.testing.assert_close(cs(x), soft(x), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3 if dtype == torch.bfloat16 else 1e-6)
        src = braze.stats.records[-1].get("cuda_source") if device == "cpu" else None
        if src:
            assert src.count(f"rv * {v}") >= 3, src


def test_vector_columns(device, compiled_graphs):
    """[Note: vector columns]: column reductions read several neighbouring points per thread
    with one wide load: channels_last BatchNorm statistics and backward sums, a bias
    gradient (a sum over rows) and a max over rows, in f32 and bf16, for aligned inputs and
    a slice at an odd element offset (the scalar fallback). Values are eager's."""
    def f(x, g, mean, acc=torch.float32):
        # The statistics, and the backward's sums over a saved mean: single-pass kernels.
        var, m = torch.var_mean(x.to(acc), (0, 2, 3), correction=0)
        gs = g.to(acc).sum((0, 2, 3))
        gx = (g.to(acc) * (x.to(acc) - mean.to(acc)[None, :, None, None])).sum((0, 2, 3))
        return var, m, gs, gx

    def cols(m, acc=torch.float32):
        return m.to(acc).sum(0), m.amax(0)

    shape = (4, 64, 24, 24)
    n = torch.Size(shape).numel()
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        c = compiled(f, dynamic=False, options={"on_unsupported": "error"})
        cc = compiled(cols, dynamic=False, options={"on_unsupported": "error"})
        flat, gflat = (torch.randn(n + 1, device=device, dtype=dtype) * 2 + 1 for _ in range(2))
        for off in (0, 1, 0):
            x, g = (t[off:off + n].view(shape[0], shape[2], shape[3], shape[1]).permute(0, 3, 1, 2) for t in (flat, gflat))
            assert x.is_contiguous(memory_format=torch.channels_last)
            mean = torch.randn(shape[1], device=device)
            want = f(x, g, mean, torch.float64)
            for a, b in zip(c(x, g, mean), want):
                torch.testing.assert_close(a.double(), b, rtol=1e-3, atol=1e-3)
            m = flat[off:off + 768 * 40].view(768 // 2, 80)
            for a, b in zip(cc(m), (m.double().sum(0), m.amax(0))):
                torch.testing.assert_close(a.double(), b.double(), rtol=1e-3, atol=1e-3)
        src = braze.stats.records[-2].get("cuda_source") if device == "cpu" else None
        if src:
            assert "bz_colv_welford<" in src and "bz_colv_reduce<" in src, src


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cluster_columns(device, dtype):
    """[Note: cluster columns] (braze-codegen): a BatchNorm + hardswish over few channels with
    rows too short to split (MobileNet-v3-small's 576 × 7 × 7 at batch 32, channels_last) runs
    its backward (two sums, then the gradient store: one kernel of two passes) as clusters of
    blocks that share their channels and split the rows; the forward's statistics (a variance)
    keep a block per group of channels, as option column_clusters=False keeps all. Running
    statistics, outputs and gradients are eager's."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.BatchNorm2d(576), torch.nn.Hardswish()).to(device)
    ref = copy.deepcopy(m)
    x = (torch.randn(32, 576, 7, 7, device=device) * 2 + 1).to(memory_format=torch.channels_last)
    x[:, 3] += 50  # a channel far from 0: Welford's merge across the cluster is exercised
    x = x.to(dtype).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    c = compiled(m, options={"on_unsupported": "error"})
    with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        y, yr = c(x), ref(xr)
    g = torch.randn_like(yr)
    y.backward(g)
    yr.backward(g)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y, yr, **tol)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    # Parameter gradients are sums of 1568 products: in bf16 compared with float64's, braze
    # within twice eager's error.
    exact = copy.deepcopy(ref).double()
    for p in exact.parameters():
        p.grad = None
    exact(x.detach().double()).backward(g.double())
    for p, q, e in zip(m.parameters(), ref.parameters(), exact.parameters()):
        err, err_eager = ((t.grad.double() - e.grad).abs().max().item() for t in (p, q))
        assert err <= 2 * err_eager + 1e-3, (err, err_eager)
    torch.testing.assert_close(m[0].running_mean, ref[0].running_mean, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(m[0].running_var, ref[0].running_var, rtol=1e-4, atol=1e-4)
    recs = [r for r in braze.stats.records if r.get("status") == "compiled"]
    assert len(recs) == 2 and not any(r["externs"] for r in recs), [r["externs"] for r in recs]
    srcs = [r["source"] if device == "cuda" else r.get("cuda_source") for r in recs]
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters: Hopper and newer")
    if srcs[0] is None:
        pytest.skip("NVRTC not found: the CUDA source was not generated")
    assert "__cluster_dims__" not in srcs[0], srcs[0]
    assert re.search(r"__cluster_dims__\([2-8], 1, 1\)", srcs[1]) and "bz_cluster_reduce<" in srcs[1], srcs[1]
    # Option column_clusters=False: one block per group of channels, the same values.
    torch._dynamo.reset()
    off = compiled(copy.deepcopy(ref), options={"on_unsupported": "error", "column_clusters": False})
    with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        torch.testing.assert_close(off(x), y, **tol)
    rec = braze.stats.records[-1]
    assert "__cluster_dims__" not in (rec["source"] if device == "cuda" else rec["cuda_source"])


def test_extern_operands_live_in_arenas(device, compiled_graphs):
    """[Note: extern operands in arenas] (braze-driver): the attention call's operands, made
    by braze's kernels, are views of the arena (in bytes of buffers that died before them)
    rather than tensors of their own allocated for the whole run; the call's results are
    fresh, so nothing of the arena escapes. Values are eager's over repeated calls (the CPU
    reuses arenas between calls)."""
    torch.manual_seed(0)
    w = torch.randn(64, 192, device=device) * 0.1

    def f(x):
        h = torch.softmax(x * 1.5, dim=-1) + x
        qkv = (h @ w).view(2, 128, 3, 4, 16).permute(2, 0, 3, 1, 4)
        o = torch.nn.functional.scaled_dot_product_attention(qkv[0].sin(), qkv[1] * 0.5, qkv[2] + 1.0)
        return o.transpose(1, 2).reshape(2, 128, 64) + x

    c = compiled(f, options={"on_unsupported": "error"})
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 128, 64, device=device)
            torch.testing.assert_close(c(x), f(x), rtol=1e-4, atol=1e-4)
    g = compiled_graphs[-1]
    offs = g.arena_offsets
    ext_args = [b for st in g.steps if st[0] != "kernels" for b, _ in st[4]]
    assert ext_args and any(offs[b] >= 0 for b in ext_args), (ext_args, offs, g.c.schedule)


def test_freed_buffers_are_released(device, compiled_graphs):
    """[Note: no stray references] (runtime.py): a buffer the plan frees after a step (an
    extern call's result, an arena view handed to one as an operand) is unreachable from
    the next step on: nothing of the call loop keeps it, or the arena it views, alive.
    Checked with weak references through `on_step`, on a graph of extern calls (attention,
    matmuls on the CPU) between kernels; values are eager's."""
    import weakref

    torch.manual_seed(0)
    w = torch.randn(64, 192, device=device) * 0.1

    def f(x, w):
        h = torch.softmax(x * 1.5, dim=-1) + x
        qkv = (h @ w).view(2, 128, 3, 4, 16).permute(2, 0, 3, 1, 4)
        o = torch.nn.functional.scaled_dot_product_attention(qkv[0].sin(), qkv[1] * 0.5, qkv[2] + 1.0)
        o = o.transpose(1, 2).reshape(2, 128, 64) + x
        o = torch.nn.functional.scaled_dot_product_attention(o.view(2, 128, 4, 16).transpose(1, 2).cos(), qkv[1], qkv[2])
        return o.transpose(1, 2).reshape(2, 128, 64) * 2.0

    x = torch.randn(2, 128, 64, device=device)
    with torch.no_grad():
        c = compiled(f, options={"on_unsupported": "error"})
        torch.testing.assert_close(c(x, w), f(x, w), rtol=1e-4, atol=1e-4)
        g = compiled_graphs[-1]
        kept = {b for b, _ in g.outputs} | {i for _, i in g.reuse} | {o for o, _ in g.reuse}
        refs, late = [], []

        def seen(kind, what, bufs):
            late.extend(b for b, r in refs if r() is not None)
            refs.clear()
            for b in g.frees[len(seen.steps)]:
                if bufs[b] is not None and b not in kept and g.bufs[b][0] != "input":
                    refs.append((b, weakref.ref(bufs[b])))
            seen.steps.append(kind)
        seen.steps = []
        x = torch.randn(2, 128, 64, device=device)
        torch.testing.assert_close(g([x, w], on_step=seen)[0], f(x, w), rtol=1e-4, atol=1e-4)
    assert 1 in seen.steps and len(seen.steps) == len(g.steps), seen.steps
    assert not late, f"buffers still referenced after their free: {late}"


def test_row_kernel_reloads_stored_sum_and_writes_in_place(device, compiled_graphs):
    """[Note: stored values reloaded] (braze-sched): a LayerNorm over a residual sum that is
    also stored reads the stored sum back in its second pass instead of reloading the
    operands, so the sum takes the memory of the matmul result it consumed ([Note: in-place
    kernels] for row reductions), and on CUDA the warp-per-row kernel keeps the stored values
    in registers ([Note: persistent rows]). Values are eager's, fp32 and bf16."""
    import re

    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        w = (torch.randn(64, 64, device=device) * 0.2).to(dtype)

        def f(x, a, w):
            h = x + (a @ w).sin()
            y = torch.nn.functional.layer_norm(h, (64,))
            return (y @ w) + h

        x, a = (torch.randn(8, 32, 64, device=device, dtype=dtype) for _ in range(2))
        c = compiled(f, options={"on_unsupported": "error"})
        tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 8e-2}  # bf16 rounding of h
        torch.testing.assert_close(c(x, a, w), f(x, a, w), **tol)
        x, a = (torch.randn(8, 32, 64, device=device, dtype=dtype) for _ in range(2))
        torch.testing.assert_close(c(x, a, w), f(x, a, w), **tol)
        if dtype != torch.float32:
            continue  # bf16 on the CPU recomputes the sum in the last kernel instead of storing it
        rec = braze.stats.records[-1]
        sched = rec["schedule"]
        red = sched[sched.index("kernel braze_red"):]
        red = red[:red.index("\nmatmul")]
        stored = re.search(r"store buf(\d+)\[", red).group(1)
        second = red[red.index("pass 1:"):]
        assert f"load buf{stored}[" in second and "sin" not in second, red
        g = compiled_graphs[-1]
        mm = int(re.search(r"matmul %\d+: buf(\d+) =", sched).group(1))
        offs = g.arena_offsets
        assert (offs[mm] >= 0 and offs[mm] == offs[int(stored)]) or (int(stored), mm) in g.reuse, (sched, offs, g.reuse)
        src = rec.get("cuda_source") if device == "cpu" else None
        if src:
            assert re.search(r"b%s\[[^\]]+\] = (t\d+); c\d+\[j\] = \1;" % stored, src), src


def test_persistent_rows_hold_per_row_loads(device):
    """[Note: persistent rows]: a norm's weight, the same for every row, is read again in the
    later passes and not held in registers, which go to the row's own values: an RMSNorm
    backward holds the incoming gradient and the input (Llama's held its weight and reloaded
    its input). Values and gradients are eager's."""
    import re

    class RMSNorm(torch.nn.Module):  # Llama's (transformers' LlamaRMSNorm)
        def __init__(self, n, eps=1e-6):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(n))
            self.eps = eps

        def forward(self, h):
            var = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
            return self.weight * (h * torch.rsqrt(var + self.eps)).to(h.dtype)

    torch.manual_seed(0)
    norm = RMSNorm(512).to(device)
    x = torch.randn(4, 24, 512, device=device, requires_grad=True)
    g = torch.randn(4, 24, 512, device=device)
    n0 = len(braze.stats.records)
    c = compiled(norm, options={"on_unsupported": "error"})
    out = c(x)
    (dx, dw) = torch.autograd.grad(out, (x, norm.weight), g)
    ref = norm(x)
    (rdx, rdw) = torch.autograd.grad(ref, (x, norm.weight), g)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dx, rdx, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw, rdw, rtol=1e-4, atol=1e-4)
    recs = braze.stats.records[n0:]
    assert len(recs) == 2 and all(r["status"] == "compiled" and not r["externs"] for r in recs), recs
    src = recs[1].get("cuda_source") if device == "cpu" else None
    if src:
        held = re.findall(r"= b\d+\[([^\]]+)\]; c\d+\[j\] =", src)
        assert len(held) >= 2 and all("i0" in h for h in held), (held, src)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_programmatic_launch(device, compiled_graphs, mode):
    """[Note: programmatic launch] (braze-runtime): every generated CUDA kernel waits for the
    kernel before it first thing; on Hopper and newer they launch with programmatic dependent
    launch (option `programmatic_launch`, on by default), and a chain of kernels each reading
    all of the one before (a normalization's statistics, then its use, twelve times over) gives
    eager's values on every call, in both modes, with the option on and off."""

    def f(x):
        for _ in range(12):
            x = torch.tanh((x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True) + 1e-5)) + x.sum() * 1e-3
        return x

    for on in (True, False):
        torch._dynamo.reset()
        compiled_graphs.clear()
        c = braze.compile(f, mode=mode, options={"on_unsupported": "error", "programmatic_launch": on})
        for _ in range(4):
            x = torch.randn(48, 300, device=device)
            torch.testing.assert_close(c(x), f(x), rtol=1e-4, atol=1e-4)
        src = braze.stats.records[-1]["source"] if device == "cuda" else braze.stats.records[-1].get("cuda_source")
        if device == "cuda" or braze.cuda.nvrtc_available():  # (a CPU graph's CUDA code: BRAZE_CHECK_CUDA)
            kernels = re.findall(r'__global__ void __launch_bounds__\(\d+\) (\w+)\([^)]*\) \{\n  (\S+)', src)
            assert kernels and all(first == "bz_entry();" for _, first in kernels), kernels
        (g,) = compiled_graphs
        hopper = device == "cuda" and torch.cuda.get_device_capability()[0] >= 9
        assert g.c.programmatic_launch == (on and hopper)
