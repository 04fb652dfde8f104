"""Upsampling by whole factors, rewritten in Dynamo's graph before AOTAutograd traces it.

[Note: nearest upsampling as a broadcast] ``F.interpolate(x, mode="nearest")`` (and
``nn.Upsample``) decomposes, while AOTAutograd traces it, into a gather through computed index
vectors (``_unsafe_index``), whose backward is an accumulating ``_unsafe_index_put``: a scatter
with atomic adds that braze leaves to ATen. A feature pyramid's or a U-Net's training step paid
one ATen call, and its launch and zero fill, per upsampling (GhostNetV2: 14).

When every spatial size grows by a whole factor ``f`` (the usual ``scale_factor=2``), output
index ``j`` reads input ``j // f``: the upsampling is a broadcast of each input element over an
``f x f`` block, ``x[:, :, :, None, :, None].expand(..., f, ..., f).reshape(...)``. Its forward is
the same copy kernel, and its backward is the broadcast's: a sum over each block, a reduction
braze compiles. Channels-last inputs broadcast in their own order, so the result keeps eager's
strides.

Eager computes the source index as ``floor(j * scale)`` in float32 (``scale`` the float
reciprocal of the factor or ``in / out``), which is ``j // f`` except where rounding puts a
product just below a whole number. The rewrite is taken only after checking, at compile time,
that eager's own ``F.interpolate`` of an index-valued probe on the CPU (one channel, the same
spatial sizes and arguments) gives exactly the broadcast's result; otherwise, and for symbolic
sizes, the call stays as it was.

[Note: linear upsampling's gradient as shifts] The linear modes (``linear``, ``bilinear``,
``trilinear``; ``align_corners=False``) by whole factors keep their forward, a gather of two
neighbours per dim (written as phase-weighted shifted copies stacked and flattened, a 2x
bilinear upsampling of 4 x 64 x 32² on the CPU fused into a kernel of nested selects and masked
loads: 27 ms against the gather's 0.57), and get a backward of their own
(:class:`_LinearUpsample`): per spatial dim, output ``i * f + p`` (phase ``p``) took input ``i``
and its next neighbour (or its previous one, for phases left of the input's centre) with fixed
weights, the edge element clamped. So the gradient of input ``i`` is, per phase, the strided
slice ``g[p::f]`` and a copy of it shifted by one (pads of slices), weighted and summed: one
pointwise kernel per dim instead of ATen's accumulating ``index_put`` per corner (four for
bilinear). Checked at compile time against eager's gradient on a float64 probe.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

_SIGNATURE = inspect.signature(F.interpolate)
_MODES = ("nearest", "nearest-exact")
_LINEAR = ("linear", "bilinear", "trilinear")


def nearest_repeat(x: torch.Tensor, factors: tuple, channels_last: bool) -> torch.Tensor:
    """``x`` (N, C, *spatial) with each spatial element repeated ``factors[d]`` times along
    dim ``d``: a broadcast and a reshape (one copy). ``channels_last`` broadcasts in (N,
    *spatial, C) order, so the result is channels-last as eager's upsampling of such an input."""
    n, c, *sp = x.shape
    inner, grown, out = [], [], []
    for s, f in zip(sp, factors):
        inner += [s, 1]
        grown += [s, f]
        out.append(s * f)
    if not channels_last:
        return x.reshape([n, c, *inner]).expand([n, c, *grown]).reshape([n, c, *out])
    rank = x.dim()
    y = x.permute([0, *range(2, rank), 1])
    y = y.reshape([n, *inner, c]).expand([n, *grown, c]).reshape([n, *out, c])
    return y.permute([0, rank - 1, *range(1, rank - 1)])


def _shift(t: torch.Tensor, dim: int, start: int, length: int, left: int) -> torch.Tensor:
    """``t.narrow(dim, start, length)`` padded with zeros back to ``t``'s size along ``dim``,
    ``left`` zeros before it."""
    n = t.shape[dim]
    pad = [0, 0] * (t.dim() - 1 - dim) + [left, n - length - left]
    return F.pad(t.narrow(dim, start, length), pad)


def _linear_grad(g: torch.Tensor, dim: int, f: int) -> torch.Tensor:
    """The gradient, along ``dim``, of linear interpolation (``align_corners=False``) growing
    that dim by the whole factor ``f``, from the output's gradient ``g``."""
    n = g.shape[dim] // f
    out = None
    for p in range(f):
        gp = g.narrow(dim, p, n * f - f + 1)[(slice(None),) * dim + (slice(None, None, f),)]
        off = (p + 0.5) / f - 0.5  # source position of phase p, relative to its input
        if off >= 0:
            # Input i and i + 1 by 1 - off and off; the last input takes both.
            terms = [(1.0 - off, gp), (off, _shift(gp, dim, 0, n - 1, 1)), (off, _shift(gp, dim, n - 1, 1, n - 1))]
        else:
            # Inputs i - 1 and i by -off and 1 + off; phase p of input 0 clamps to input 0.
            w = 1.0 + off
            terms = [(w, gp), (1.0 - w, _shift(gp, dim, 1, n - 1, 0)), (1.0 - w, _shift(gp, dim, 0, 1, 0))]
        for c, t in terms:
            if c != 0:
                out = t * c if out is None else out + t * c
    return out


class _LinearUpsample(torch.autograd.Function):
    """Eager's linear interpolation forward; the gradient of [Note: linear upsampling's
    gradient as shifts]."""

    @staticmethod
    def forward(ctx, x, factors, kwargs):
        ctx.factors = factors
        ctx.dtype = x.dtype
        return F.interpolate(x, **dict(kwargs))

    @staticmethod
    def backward(ctx, g):
        return linear_upsample_grad(g, ctx.factors, ctx.dtype), None, None


def linear_upsample_grad(g: torch.Tensor, factors: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The input gradient of a linear upsampling by ``factors`` from the output's, in float32
    for half types (as eager's kernels accumulate)."""
    y = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
    for d, f in enumerate(factors):
        if f != 1:
            y = _linear_grad(y, d + 2, f)
    return y.to(dtype)


def linear_upsample(x: torch.Tensor, factors: tuple, kwargs: tuple) -> torch.Tensor:
    """``F.interpolate(x, **kwargs)`` with the gradient of [Note: linear upsampling's gradient
    as shifts]."""
    return _LinearUpsample.apply(x, factors, kwargs)


def _static_shape(v) -> tuple | None:
    if not isinstance(v, torch.Tensor) or not all(type(s) is int for s in v.shape):
        return None
    return tuple(v.shape)


def _has_node(v) -> bool:
    found = []
    torch.fx.node.map_aggregate(v, lambda a: found.append(a) if isinstance(a, torch.fx.Node) else None)
    return bool(found)


def _factors(node):
    """For an interpolate call braze may rewrite: the function replacing it and its arguments
    after the input; None when the call must stay."""
    try:
        bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    x = a["input"]
    linear = a["mode"] in _LINEAR
    if (a["mode"] not in _MODES and not linear) or a.get("antialias") or not isinstance(x, torch.fx.Node):
        return None
    if linear and a.get("align_corners"):
        return None
    if any(_has_node(v) for k, v in a.items() if k != "input"):
        return None
    xv = x.meta.get("example_value")
    yv = node.meta.get("example_value")
    xs, ys = _static_shape(xv), _static_shape(yv)
    if xs is None or ys is None or len(xs) not in (3, 4, 5) or len(ys) != len(xs) or xs[:2] != ys[:2]:
        return None
    if not xv.is_floating_point() or any(s == 0 for s in xs):
        return None
    if any(o % i for i, o in zip(xs[2:], ys[2:])):
        return None
    factors = tuple(o // i for i, o in zip(xs[2:], ys[2:]))
    if all(f == 1 for f in factors):
        return None  # a copy either way; a reshape alone could alias the input
    channels_last = len(ys) in (4, 5) and not yv.is_contiguous() and yv.is_contiguous(
        memory_format=torch.channels_last if len(ys) == 4 else torch.channels_last_3d)
    # Eager's own index arithmetic on a probe of the spatial sizes: each element its index.
    probe = torch.arange(1, 1 + torch.Size(xs[2:]).numel(), dtype=torch.float64).reshape(1, 1, *xs[2:])
    kwargs = {k: v for k, v in a.items() if k != "input"}
    try:
        want = F.interpolate(probe, **kwargs)
    except Exception:  # noqa: BLE001 - an argument eager rejects on the probe: leave the call
        return None
    if want.shape[2:] != ys[2:]:
        return None
    if linear:
        if any(s < 2 for s in xs[2:]):
            return None
        # The gradient against eager's, on the probe in float64.
        probe.requires_grad_(True)
        g = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        (eager_grad,) = torch.autograd.grad(F.interpolate(probe, **kwargs), probe, g)
        if not torch.allclose(linear_upsample_grad(g, factors, torch.float64), eager_grad, rtol=1e-12, atol=1e-12):
            return None
        return linear_upsample, (factors, tuple(kwargs.items()))
    if not torch.equal(want, nearest_repeat(probe, factors, False)):
        return None
    return nearest_repeat, (factors, channels_last)


def whole_factor_upsampling(gm: torch.fx.GraphModule) -> int:
    """Rewrites ``gm`` in place ([Note: nearest upsampling as a broadcast], [Note: linear
    upsampling's gradient as shifts]): each nearest or linear ``F.interpolate`` by whole
    factors on static sizes becomes :func:`nearest_repeat` or :func:`linear_upsample`. Returns
    how many calls were rewritten."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not F.interpolate:
            continue
        found = _factors(node)
        if found is None:
            continue
        fn, args = found
        x = node.args[0] if node.args else node.kwargs["input"]
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(fn, (x, *args))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
