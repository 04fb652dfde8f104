"""braze's direct autograd path (python/braze/autograd.py): graphs AOTAutograd's metadata
proves simple run through braze's own autograd.Function; every other graph keeps
AOTAutograd's runtime wrappers. Both give eager's values and gradients."""
import pytest
import torch

import braze


def compiled(fn, **kw):
    return torch.compile(fn, backend="braze", **kw)


def grads_match(f, inputs, cf, loss=lambda outs: sum((o.float() * torch.randn_like(o.float())).sum() for o in outs)):
    """Runs f eagerly and compiled on copies of `inputs`, backpropagates the same random
    weighting of the differentiable outputs, compares outputs and every input's gradient."""
    ins = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    ins2 = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    out, out2 = f(*ins), cf(*ins2)
    out = out if isinstance(out, tuple) else (out,)
    out2 = out2 if isinstance(out2, tuple) else (out2,)
    for a, b in zip(out2, out):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert a.requires_grad == b.requires_grad
    diff = [i for i, o in enumerate(out) if o.requires_grad]
    torch.manual_seed(1)
    loss([out[i] for i in diff]).backward()
    torch.manual_seed(1)
    loss([out2[i] for i in diff]).backward()
    for x, x2 in zip(ins, ins2):
        if x.requires_grad:
            torch.testing.assert_close(x2.grad, x.grad, rtol=1e-4, atol=1e-4)
    return out2


def _mlp(x, w1, b1, w2):
    return torch.nn.functional.gelu(x @ w1 + b1) @ w2


def _mlp_inputs(device):
    return [torch.randn(8, 16, device=device, requires_grad=True), torch.randn(16, 32, device=device, requires_grad=True),
            torch.randn(32, device=device, requires_grad=True), torch.randn(32, 16, device=device, requires_grad=True)]


def test_training_graph_runs_direct(device):
    torch._dynamo.reset()
    n = braze.stats.direct_graphs
    out = grads_match(_mlp, _mlp_inputs(device), compiled(_mlp))
    assert type(out[0].grad_fn).__name__ == "_BrazeFunctionBackward"
    assert braze.stats.direct_graphs == n + 1
    assert {r.get("runtime") for r in braze.stats.records[-2:]} == {"direct"}


def test_option_keeps_aot_wrappers(device):
    torch._dynamo.reset()
    out = grads_match(_mlp, _mlp_inputs(device), compiled(_mlp, options={"direct_autograd": False}))
    assert type(out[0].grad_fn).__name__ == "CompiledFunctionBackward"


def test_inference_graph_runs_direct(device):
    torch._dynamo.reset()
    ins = [x.detach() for x in _mlp_inputs(device)]
    with torch.no_grad():
        torch.testing.assert_close(compiled(_mlp)(*ins), _mlp(*ins), rtol=1e-4, atol=1e-4)
    assert braze.stats.records[-1]["runtime"] == "direct"


def test_dynamic_graphs_run_direct_and_reuse_plans(device, compiled_graphs):
    """A graph with dynamic sizes (Dynamo passes them as SymInt arguments) runs direct, in
    inference and training, and keeps one plan per size it was called with."""
    torch._dynamo.reset()
    c = compiled(_mlp, dynamic=True)
    w = [x.detach() for x in _mlp_inputs(device)[1:]]
    with torch.no_grad():
        for n in (8, 8, 12, 8, 12):
            x = torch.randn(n, 16, device=device)
            torch.testing.assert_close(c(x, *w), _mlp(x, *w), rtol=1e-4, atol=1e-4)
    assert braze.stats.records[-1]["runtime"] == "direct"
    (g,) = compiled_graphs
    assert g.dynamic and len(g.plans) == 2, list(g.plans)
    torch._dynamo.reset()
    for n in (8, 12):
        ins = _mlp_inputs(device)
        ins[0] = torch.randn(n, 16, device=device, requires_grad=True)
        grads_match(_mlp, ins, compiled(_mlp, dynamic=True))


def test_non_differentiable_and_unused_outputs(device):
    def f(x, w):
        y = torch.tanh(x @ w)
        return y, y.argmax(-1), (x.detach() * 2).sum(-1), y.sum(-1)

    torch._dynamo.reset()
    ins = [torch.randn(6, 5, device=device, requires_grad=True), torch.randn(5, 7, device=device, requires_grad=True)]
    out = grads_match(f, ins, compiled(f))
    assert out[1].dtype == torch.int64 and not out[1].requires_grad and not out[2].requires_grad
    # Only the first output feeds the loss: the last one's gradient is materialized as zeros.
    ins2 = [x.detach().clone().requires_grad_(True) for x in ins]
    compiled(f)(*ins2)[0].sum().backward()
    ins[0].grad = ins[1].grad = None
    f(*ins)[0].sum().backward()
    torch.testing.assert_close(ins2[0].grad, ins[0].grad, rtol=1e-4, atol=1e-4)


def test_gradient_with_other_layout(device):
    """A tangent whose strides differ from the layout the backward was compiled for."""
    torch._dynamo.reset()
    ins = _mlp_inputs(device)
    cf = compiled(_mlp)
    ins2 = [x.detach().clone().requires_grad_(True) for x in ins]
    g = torch.randn(16, 8, device=device).t()
    _mlp(*ins).backward(g)
    cf(*ins2).backward(g)
    for x, x2 in zip(ins, ins2):
        torch.testing.assert_close(x2.grad, x.grad, rtol=1e-4, atol=1e-4)


def test_retain_graph_and_double_backward(device):
    torch._dynamo.reset()
    ins = _mlp_inputs(device)
    out = compiled(_mlp)(*ins)
    out.sum().backward(retain_graph=True)
    first = ins[1].grad.clone()
    out.sum().backward()
    torch.testing.assert_close(ins[1].grad, 2 * first)
    x = torch.randn(4, 3, device=device, requires_grad=True)
    y = compiled(lambda t: torch.sin(t) * t)(x)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


def _mutates_input(x, w, counter):
    counter.add_(1)
    return torch.sin(x @ w) * counter


def _returns_view_of_input(x, w):
    return torch.cos(x @ w), x.t()


def _returns_view_of_intermediate(x, w):
    y = torch.sin(x @ w)
    return y, y.view(-1)


@pytest.mark.parametrize("fn", [_mutates_input, _returns_view_of_input, _returns_view_of_intermediate])
def test_aot_wrappers_kept_where_needed(fn, device):
    torch._dynamo.reset()
    x = torch.randn(5, 4, device=device, requires_grad=True)
    w = torch.randn(4, 3, device=device, requires_grad=True)
    ins = [x, w] + ([torch.zeros((), device=device)] if fn is _mutates_input else [])
    n = len(braze.stats.aot_wrapped)
    grads_match(fn, ins, compiled(fn))
    assert len(braze.stats.aot_wrapped) == n + 1, braze.stats.aot_wrapped[n:]
    assert braze.stats.records[-1]["runtime"].startswith("AOTAutograd's wrappers (")


def test_training_loop_matches_eager(device, compiled_graphs):
    """Several training steps, compiled against eager: parameters change in place between steps
    (the same pointers with new values, which is what CUDA-graph replays see) and the
    gradients are dropped each step, as in a real loop."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = [x.detach().clone().requires_grad_(True) for x in _mlp_inputs(device)]
    mine = [x.detach().clone().requires_grad_(True) for x in ref]
    cf = compiled(_mlp)
    graphs = compiled_graphs
    g = torch.randn(8, 16, device=device)
    for step in range(8):
        out2 = cf(*mine)
        out2.backward(g)
        out = _mlp(*ref)
        out.backward(g)
        torch.testing.assert_close(out2, out, rtol=1e-4, atol=1e-4)
        del out, out2
        with torch.no_grad():
            for a, b in zip(ref, mine):
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-4, msg=f"step {step}")
                a.grad = b.grad = None
                a.copy_(torch.randn_like(a))  # an in-place update, the same for both
                b.copy_(a)
    if device == "cuda":
        # Both graphs (forward and backward) run several items: once their buffers repeat
        # they replay.
        assert all(g.c.replays >= 3 for g in graphs), [(g.name, g.c.replays) for g in graphs]


def test_backward_called_inside_a_compiled_function(device):
    """Dynamo breaks the graph at .backward() and runs it from compiled code, where its
    frame hook is active: braze's backward must run (untraced) and give eager's gradients."""
    torch._dynamo.reset()

    def train_step(x, w1, b1, w2):
        loss = _mlp(x, w1, b1, w2).sum()
        loss.backward()
        return loss.detach()

    ins = _mlp_inputs(device)
    ins2 = [x.detach().clone().requires_grad_(True) for x in ins]
    torch.testing.assert_close(compiled(train_step)(*ins2), train_step(*ins), rtol=1e-4, atol=1e-4)
    for x, x2 in zip(ins, ins2):
        torch.testing.assert_close(x2.grad, x.grad, rtol=1e-4, atol=1e-4)


def _pool_grads_match(f, x, saved_hook=None, **tol):
    """`f` compiled (no graph run eagerly) against eager on copies of `x`: outputs (NaN where
    eager's are) and `x`'s gradients for one random output gradient; `saved_hook` sees the
    compiled call's saved tensors. Returns eager's output."""
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(saved_hook or (lambda t: t), lambda t: t):
        out = compiled(f, options={"on_unsupported": "error"})(a)
    ref = f(b)
    torch.testing.assert_close(out, ref, equal_nan=True)
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(a.grad, b.grad, equal_nan=True, **tol)
    return ref


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_max_pool_saves_int8_window_offsets(device, layout):
    """Training through a max pool saves each output's int8 offset in its window, not ATen's
    int64 indices (decomp.py's _max_pool2d_with_offsets; the backward recomputes the indices),
    and the gradient goes where eager's does: ties (ReLU zeros, equal values) to the first
    maximum, NaN to the last NaN, windows whose valid elements are all -inf to their first
    valid element, never to padding."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 13, 11, device=device).round()  # many ties
    x[0, 0, :5, :5] = float("-inf")
    x[0, 1, 3, 3] = float("nan")
    x[1, 2, 6:9, 6:9] = float("nan")
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)

    def f(x):
        return torch.nn.functional.max_pool2d(torch.relu(x * 2) - x, 3, 2, 1)

    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    pooled = tuple(_pool_grads_match(f, x, pack).shape)
    assert (torch.int8, pooled) in saved, saved
    assert (torch.int64, pooled) not in saved, saved
    assert "aten.max_pool2d_with_indices.default" not in braze.stats.extern_ops, braze.stats.extern_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_pool_backward_by_candidates(device, dtype):
    """The max-pool backward is braze's gather over each input's candidate windows ([Note:
    max-pool backward by candidates]): eager's gradients for overlapping windows (ResNet's
    3x3 stride 2), windows that touch, gaps between windows (stride over kernel),
    rectangular windows, `ceil_mode`, both layouts, ties, NaN and all -inf windows, and for a
    window too large for int8 offsets (the int64 indices compared); no ATen pool backward
    runs."""
    torch.manual_seed(0)
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)  # eager's CPU sums in bf16
    cases = [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2, stride=2), dict(kernel_size=2, stride=3),
             dict(kernel_size=(3, 2), stride=(2, 3), padding=(1, 0)), dict(kernel_size=3, stride=2, ceil_mode=True),
             dict(kernel_size=12, stride=4, padding=2)]
    for kw in cases:
        for shape, layout in (((2, 4, 29, 23), "contiguous"), ((2, 4, 29, 23), "channels_last"), ((3, 17, 14), "contiguous")):
            x = torch.randn(*shape, device=device).round().to(dtype)  # many ties
            x[..., 0, :5, :5] = float("-inf")
            x[..., 1, 3, 3] = float("nan")
            if layout == "channels_last":
                x = x.to(memory_format=torch.channels_last)

            def f(x):
                return torch.nn.functional.max_pool2d(torch.relu(x * 2) - x, **kw)

            torch._dynamo.reset()
            before = dict(braze.stats.extern_ops)
            _pool_grads_match(f, x, **tol)
            new = {k for k, n in braze.stats.extern_ops.items() if n != before.get(k, 0)}
            assert "aten.max_pool2d_with_indices_backward.default" not in new, (kw, shape, new)
            assert ("aten.max_pool2d_with_indices.default" in new) == (kw["kernel_size"] == 12), (kw, new)


def test_loss_backward_through_bf16_casts_needs_no_row_sum(device):
    """A masked-LM loss whose log-probabilities go through bf16 and back (as under bf16
    autocast): log-softmax's backward sums the one-hot loss gradient over each row, rounded
    to bf16 and back; the sum is the selected value ([one_hot_sums] through casts), so the
    backward's first kernel is pointwise, with no vocabulary-wide buffer besides the
    gradient. Values and gradients are eager's, ignored targets included."""
    torch.manual_seed(0)
    w = (torch.randn(1000, 64, device=device) * 0.1).requires_grad_()
    x = torch.randn(256, 64, device=device, requires_grad=True)
    t = torch.randint(0, 1000, (256,), device=device)
    t[::7] = -100

    def f(x, w, t):
        logits = x.to(torch.bfloat16) @ w.to(torch.bfloat16).t()
        logp = torch.log_softmax(logits.float(), -1).to(torch.bfloat16)
        return torch.nn.functional.nll_loss(logp.float(), t)

    c = compiled(f, options={"on_unsupported": "error"})
    n0 = len(braze.stats.records)
    loss = c(x, w, t)
    loss.backward()
    got = (loss.detach(), x.grad, w.grad)
    x.grad = w.grad = None
    ref = f(x, w, t)
    ref.backward()
    torch.testing.assert_close(got[0], ref.detach())
    torch.testing.assert_close(got[1], x.grad, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(got[2], w.grad, rtol=1e-3, atol=1e-5)
    bw = [r for r in braze.stats.records[n0:] if r["name"].startswith("backward")]
    assert bw, [r["name"] for r in braze.stats.records[n0:]]
    sched = bw[-1]["schedule"]
    wide = [line for line in sched.splitlines() if line.startswith("kernel") and "1000]" in line.split("inner=")[1]]
    assert not wide, sched


def test_padded_logits_reach_the_backward_without_copies(device, relayouts):
    """On the GPU braze returns logits as the padded matmul's view ([Note: padded matmuls]);
    the backward reads them as a saved tensor and is compiled for the layout the forward
    returns them in ([Note: saved outputs in their returned layout]): no input of the
    backward is copied into another layout, the unused logits' zero gradient included.
    Gradients are eager's."""
    if device != "cuda":
        pytest.skip("matmuls are padded on the GPU only")
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 1001, device=device)
    x = torch.randn(512, 64, device=device)
    t = torch.randint(0, 1001, (512,), device=device)

    def f(x, t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = lin(x)
            loss = torch.nn.functional.cross_entropy(logits.float(), t)
        return loss, logits

    c = compiled(f, options={"on_unsupported": "error"})
    for _ in range(2):
        lin.zero_grad(set_to_none=True)
        loss, logits = c(x, t)
        assert logits.stride() == (1008, 1)  # the padded view: the case under test
        loss.backward()
    got = [p.grad.clone() for p in lin.parameters()]
    assert relayouts == []
    lin.zero_grad(set_to_none=True)
    ref, _ = f(x, t)
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach())
    for g, p in zip(got, lin.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-2, atol=1e-3)


_probe_seen = []


@torch.library.custom_op("braze_test::autocast_probe", mutates_args=())
def _autocast_probe(x: torch.Tensor) -> torch.Tensor:
    """An extern call that records whether autocast is on when it runs."""
    _probe_seen.append(torch.is_autocast_enabled(x.device.type))
    return x.clone()


@_autocast_probe.register_fake
def _(x):
    return torch.empty_like(x)


_autocast_probe.register_autograd(lambda ctx, g: g)


def _mlp_probe(x, w1, b1, w2):
    return _autocast_probe(torch.nn.functional.gelu(x @ w1 + b1)) @ w2


def test_graphs_compiled_under_autocast_run_direct_with_autocast_off(device):
    """A graph traced under autocast has its casts in it ([Note: autocast around compiled
    graphs]): it runs direct, and its extern calls (the probe) run with autocast off, as under
    AOTAutograd's wrappers, where they would otherwise be autocast a second time. Outputs and
    gradients match eager's under the same autocast (bf16 tolerance)."""
    torch._dynamo.reset()
    ins = _mlp_inputs(device)
    ins2 = [x.detach().clone().requires_grad_() for x in ins]
    n = braze.stats.direct_graphs
    with torch.autocast(device, dtype=torch.bfloat16):
        ref = _mlp_probe(*ins)
        c = compiled(_mlp_probe)
        c(*ins2)  # compiles
        _probe_seen.clear()
        out = c(*ins2)
    assert _probe_seen == [False]
    assert braze.stats.direct_graphs == n + 1
    assert type(out.grad_fn).__name__ == "_BrazeFunctionBackward"
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    for a, b in zip(ins2, ins):
        torch.testing.assert_close(a.grad, b.grad, rtol=3e-2, atol=3e-2)
    # Inference too.
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        torch._dynamo.reset()
        c = compiled(_mlp_probe)
        c(*[x.detach() for x in ins])
        _probe_seen.clear()
        torch.testing.assert_close(c(*[x.detach() for x in ins]).float(), _mlp_probe(*[x.detach() for x in ins]).float(), rtol=2e-2, atol=2e-2)
    assert _probe_seen == [False, True]  # compiled, then eager
    assert braze.stats.records[-1]["runtime"] == "direct"
