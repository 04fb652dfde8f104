"""mode="reduce-overhead": whole compiled graphs captured into one CUDA graph and replayed
(python/braze/cudagraphs.py, [Note: whole-graph replay]). Values and gradients are eager's on
fresh inputs every call; the tests count captures, replays and plain runs, so a graph that
silently stopped replaying fails them."""
import pytest
import torch

import braze
from braze import cudagraphs
from braze.config import Config


def counts():
    s = cudagraphs.stats
    return s.captures, s.replays, s.plain_runs


def test_modes_turn_whole_graph_replay_on():
    assert Config.make("reduce-overhead").whole_graph_replay is True
    assert Config.make("max-autotune").whole_graph_replay is True
    assert Config.make("default").whole_graph_replay is False
    assert Config.make("max-autotune-no-cudagraphs").whole_graph_replay is False
    assert Config.make("reduce-overhead", {"whole_graph_replay": False}).whole_graph_replay is False
    with pytest.raises(braze.BrazeConfigError, match="whole_graph_replay"):
        Config.make(None, {"whole_graph_replay": "yes"})


def _block(d):
    return torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d), torch.nn.LayerNorm(d))


def _twins(make, device):
    """Two copies of one model made by `make` under seed 0: eager's reference and braze's."""
    torch.manual_seed(0)
    ref = make().to(device)
    mine = make().to(device)
    mine.load_state_dict(ref.state_dict())
    return ref, mine


def test_inference_replays_with_fresh_inputs(device):
    torch.manual_seed(0)
    m = _block(64).to(device).eval()
    c = braze.compile(m, mode="reduce-overhead", options={"on_unsupported": "error"})
    before = counts()
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(32, 64, device=device)
            torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
    caps, reps, plain = (a - b for a, b in zip(counts(), before))
    if device == "cpu":
        assert (caps, reps) == (0, 0)  # CPU graphs run as they are
    else:
        assert caps == 1 and reps == 4 and plain == 0, (caps, reps, plain)  # calls 2-5


@pytest.mark.parametrize("reader", ["kernel", "relayout"])
def test_inputs_only_kernels_read_are_not_copied(device, reader):
    """[Note: patched inputs] An input only braze's kernels read (a LayerNorm's; the relayout
    of an NCHW input for channels_last convolutions) is read where it is by each replay, not
    copied into the graph's buffer: fresh inputs at new addresses, one input twice, one not
    16-byte aligned (copied in instead) and an aligned one after it all give eager's values."""
    if device != "cuda":
        pytest.skip("CUDA graphs")
    torch.manual_seed(0)
    if reader == "kernel":
        m = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 64)).to(device).eval()
        shape, opts = (32, 64), {}
    else:
        m = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU()).to(device).eval()
        shape, opts = (8, 3, 32, 32), {"conv_layout": "channels_last"}
    c = braze.compile(m, mode="reduce-overhead", options={"on_unsupported": "error", **opts})
    before, patched = counts(), cudagraphs.stats.patched_inputs
    n = torch.Size(shape).numel()
    xs = [torch.randn(shape, device=device) for _ in range(4)]
    same = torch.randn(shape, device=device)
    xs += [same, same, torch.randn(n + 1, device=device)[1:].view(shape), torch.randn(shape, device=device)]
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
    caps, reps, plain = (a - b for a, b in zip(counts(), before))
    assert caps == 1 and reps == len(xs) - 1 and plain == 0, (caps, reps, plain)
    assert cudagraphs.stats.patched_inputs == patched + 1


def test_earlier_outputs_are_invalidated(device):
    """A call's outputs stay valid until the next call of the same graph; reading one after
    that raises instead of returning the newer call's values."""
    if device != "cuda":
        pytest.skip("CUDA graphs")
    m = _block(32).to(device).eval()
    c = braze.compile(m, mode="reduce-overhead")
    xs = [torch.randn(8, 32, device=device) for _ in range(4)]
    with torch.no_grad():
        c(xs[0])
        c(xs[1])  # captured
        y2 = c(xs[2])
        kept = y2.clone()
        y3 = c(xs[3])
        with pytest.raises(RuntimeError, match="reduce-overhead"):
            y2 + 1
        torch.testing.assert_close(kept, m(xs[2]), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y3, m(xs[3]), rtol=1e-4, atol=1e-4)


def test_dropped_outputs_are_returned_again_without_copies(device):
    """[Note: cached outputs] An output the caller dropped is returned again by the next
    replay as the same tensor (no tensor made per output and call); one still held is
    invalidated and a new tensor takes its place."""
    if device != "cuda":
        pytest.skip("CUDA graphs")
    m = _block(32).to(device).eval()
    c = braze.compile(m, mode="reduce-overhead", options={"on_unsupported": "error"})
    xs = [torch.randn(8, 32, device=device) for _ in range(5)]
    with torch.no_grad():
        c(xs[0])
        c(xs[1])  # captured
        before = cudagraphs.stats.invalidated
        y = c(xs[2])
        first = id(y)
        torch.testing.assert_close(y, m(xs[2]), rtol=1e-4, atol=1e-4)
        del y
        y = c(xs[3])
        assert id(y) == first and torch._C._is_cached_tensor(y)
        torch.testing.assert_close(y, m(xs[3]), rtol=1e-4, atol=1e-4)
        assert cudagraphs.stats.invalidated == before
        z = c(xs[4])  # y still held: invalidated, z a new tensor
        assert id(z) != first and cudagraphs.stats.invalidated == before + 1
        torch.testing.assert_close(z, m(xs[4]), rtol=1e-4, atol=1e-4)
        with pytest.raises(RuntimeError, match="reduce-overhead"):
            y.sum()


def test_forward_without_backward_replays(device):
    """Training-mode forwards whose outputs are dropped without a backward (an evaluation in
    train mode): each replays (the saved tensors of the one before, held by its never-run
    backward, are invalidated), and training after them replays and matches eager."""
    if device != "cuda":
        pytest.skip("CUDA graphs")
    ref, mine = _twins(lambda: _block(32), device)
    c = braze.compile(mine, mode="reduce-overhead", options={"on_unsupported": "error"})
    x = torch.randn(16, 32, device=device)
    for _ in range(3):  # the same loss as below: a backward's gradient input keeps its strides
        c(x).square().mean().backward()
        ref(x).square().mean().backward()
    before = counts()
    for _ in range(3):
        c(torch.randn(16, 32, device=device))  # dropped, no backward
    for _ in range(2):
        for net, fn in ((ref, ref), (mine, c)):
            net.zero_grad(set_to_none=True)
            fn(x).square().mean().backward()
        for a, b in zip(mine.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
    caps, reps, plain = (a - b for a, b in zip(counts(), before))
    assert caps == 0 and reps == 7 and plain == 0, (caps, reps, plain)


def test_a_dead_parameters_address_is_not_a_parameter(device):
    """A graph's capture reads parameters of earlier captures in place (a backward's weights);
    a tensor that later sits where a freed parameter was is an ordinary input, copied in, so
    later calls with it elsewhere replay (they ran plainly: its address was taken for a
    parameter's, and it "moved")."""
    if device != "cuda":
        pytest.skip("CUDA graphs")
    import gc
    m1 = _block(32).to(device)
    c1 = braze.compile(m1, mode="reduce-overhead")
    for _ in range(3):
        c1(torch.randn(16, 32, device=device)).sum().backward()
    ptr, shape = m1[0].weight.data_ptr(), m1[0].weight.shape
    del m1, c1
    torch._dynamo.reset()
    gc.collect()
    held = []
    for _ in range(64):  # the allocator hands the freed block out again
        held.append(torch.empty(shape, device=device))
        if held[-1].data_ptr() == ptr:
            break
    else:
        pytest.skip("the freed parameter's block was not handed out again")
    there = held.pop()
    f = braze.compile(lambda a: a * 2 + 1, mode="reduce-overhead")
    f(torch.randn(shape, device=device))
    there.normal_()
    torch.testing.assert_close(f(there), there * 2 + 1)  # captured with the input at that address
    before = counts()
    for _ in range(3):
        a = torch.randn(shape, device=device)
        torch.testing.assert_close(f(a), a * 2 + 1)
    assert counts()[1:] == (before[1] + 3, before[2]), (counts(), before)


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(16)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.head(y.mean((2, 3)))


@pytest.mark.parametrize("model", ["mlp", "conv"])
def test_training_loop_matches_eager(model, device):
    """Forward and backward both replay from their second call on (the capture's own run
    counts as a replay; cuDNN convolutions and BatchNorm's running-stat updates inside the
    captured graphs); every step's loss, the weights after the
    optimizer's steps and the running statistics are eager's."""
    ref, mine = _twins((lambda: _block(32)) if model == "mlp" else _ConvNet, device)
    shape = (16, 32) if model == "mlp" else (4, 8, 12, 12)
    c = braze.compile(mine, mode="reduce-overhead", options={"on_unsupported": "error"})
    opts = [torch.optim.SGD(p.parameters(), lr=0.1) for p in (ref, mine)]
    before = counts()
    for _ in range(5):
        x = torch.randn(*shape, device=device)
        t = torch.randn(16, 32, device=device) if model == "mlp" else torch.randint(0, 10, (4,), device=device)
        losses = []
        for net, fn, opt in ((ref, ref, opts[0]), (mine, c, opts[1])):
            out = fn(x)
            loss = torch.nn.functional.mse_loss(out, t) if model == "mlp" else torch.nn.functional.cross_entropy(out, t)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
    for a, b in zip(mine.state_dict().values(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    caps, reps, plain = (a - b for a, b in zip(counts(), before))
    if device == "cuda":
        assert caps == 2 and reps == 8 and plain == 0, (caps, reps, plain)


def test_gradients_kept_across_backward_calls(device):
    """Gradient accumulation: the second backward of a step would overwrite the first's
    gradients, still held in .grad, so it runs plainly; the sums are eager's."""
    if device != "cuda":
        pytest.skip("CUDA graphs")
    ref, mine = _twins(lambda: _block(32), device)
    c = braze.compile(mine, mode="reduce-overhead")
    before = counts()
    for _ in range(3):
        for net, fn in ((ref, ref), (mine, c)):
            net.zero_grad(set_to_none=True)
        for _ in range(2):
            x = torch.randn(16, 32, device=device)
            ref(x).square().mean().backward()
            c(x).square().mean().backward()
        for a, b in zip(mine.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
    assert counts()[2] > before[2]  # plain runs happened
    assert counts()[1] > before[1]  # and replays too


def test_random_ops_draw_fresh_numbers_each_replay(device):
    """Dropout inside a replayed graph draws new numbers on every replay (PyTorch's CUDA
    generator advances through captured graphs), as eager does on every call."""
    if device != "cuda":
        pytest.skip("CUDA graphs")
    drop = torch.nn.Dropout(0.5).train()
    c = braze.compile(lambda x: drop(x) * 2, mode="reduce-overhead")
    x = torch.ones(4096, device=device)
    before = counts()
    outs = [c(x).clone() for _ in range(4)]
    assert counts()[1] - before[1] == 3
    assert not torch.equal(outs[2], outs[3]) and not torch.equal(outs[1], outs[2])
    for o in outs:  # kept elements are scaled by 1 / (1 - p), then doubled
        assert set(o.unique().tolist()) <= {0.0, 4.0}
        assert 0.4 < (o != 0).float().mean().item() < 0.6


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_broadcast_gradient_is_copied_in(device, mode):
    """`model(x).float().sum().backward()` hands the backward graph an expanded gradient (all
    strides 0): its capture copies the distinct element into a buffer of those strides, and
    replays run with eager's gradients (the benchmark's training step failed to capture it)."""
    ref, mine = _twins(lambda: _block(32), device)
    c = braze.compile(mine, mode=mode, options={"on_unsupported": "error"})
    before, refused = counts(), len(cudagraphs.stats.not_captured)
    for _ in range(4):
        x = torch.randn(16, 32, device=device)
        for net, fn in ((ref, ref), (mine, c)):
            net.zero_grad(set_to_none=True)
            fn(x).float().sum().backward()
        for a, b in zip(mine.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)
    caps, reps, plain = (a - b for a, b in zip(counts(), before))
    if device == "cuda":
        assert caps == 2 and reps == 6 and plain == 0, (caps, reps, plain)
        assert len(cudagraphs.stats.not_captured) == refused, cudagraphs.stats.not_captured[refused:]


def test_random_values_fresh_every_replay(device):
    """[Note: random values] A training block with dropout replays as one CUDA graph, and
    every replay draws a new seed (the seed's `randint` is captured as PyTorch's random ops
    are): masks differ from call to call, follow `torch.manual_seed`, and each backward uses
    its own forward's mask."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.5)).to(device).train()
    c = braze.compile(m, mode="reduce-overhead", options={"on_unsupported": "error"})
    x = torch.randn(32, 64, device=device)
    before = counts()
    masks = []
    for i in range(5):
        if i == 3:
            torch.manual_seed(42)
        if i == 4:
            torch.manual_seed(42)
        m.zero_grad(set_to_none=True)
        y = c(x)
        y.sum().backward()
        kept = y != 0
        masks.append(kept.clone())
        assert abs(kept.float().mean().item() - 0.5) < 0.05
        # dL/db of the linear is the column count of kept elements, each scaled by 2.
        torch.testing.assert_close(m[0].bias.grad, kept.float().sum(0) * 2)
    for r in braze.stats.records:
        assert not r["externs"], r["extern_reasons"]
    assert len({tuple(k.flatten().tolist()) for k in masks[:4]}) == 4
    assert torch.equal(masks[3], masks[4])
    caps, reps, plain = (a - b for a, b in zip(counts(), before))
    if device == "cuda":
        assert caps == 2 and reps >= 6 and plain == 0, (caps, reps, plain)
