"""Nearest upsampling by whole factors, rewritten in Dynamo's graph before AOTAutograd traces it.

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

The linear modes (``linear``, ``bilinear``, ``trilinear``; ``align_corners=False``) by whole
factors are the same kind of gather (two source elements per dim) and get the same rewrite:
output ``i * f + p`` mixes input ``i`` with its previous or next neighbour (the edge element
repeated at the borders, as eager clamps) by a weight that depends only on the phase ``p``. Each
spatial dim becomes ``f`` weighted sums of shifted copies stacked along a new dim and flattened
into it, computed in float32 for half types as eager's kernels do; the backward is slices and
sums. The probe check compares with eager's float64 result to 1e-9 (a wrong neighbour or
weight is off by a whole step of the probe).
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

_SIGNATURE = inspect.signature(F.interpolate)
_MODES = ("nearest", "nearest-exact")


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


def _shifted(x: torch.Tensor, dim: int, by: int) -> torch.Tensor:
    """``x`` moved one step along ``dim`` (``by`` -1: each element's previous neighbour, +1:
    its next), the edge element repeated."""
    n = x.shape[dim]
    if by < 0:
        return torch.cat([x.narrow(dim, 0, 1), x.narrow(dim, 0, n - 1)], dim)
    return torch.cat([x.narrow(dim, 1, n - 1), x.narrow(dim, n - 1, 1)], dim)


def linear_repeat(x: torch.Tensor, factors: tuple, channels_last: bool) -> torch.Tensor:
    """Linear interpolation (``align_corners=False``) of ``x`` (N, C, *spatial) growing spatial
    dim ``d`` by the whole factor ``factors[d]``, one dim after another, in float32 for half
    types; channels-last inputs interpolate in (N, *spatial, C) order."""
    dtype = x.dtype
    y = x.float() if dtype in (torch.float16, torch.bfloat16) else x
    rank = x.dim()
    if channels_last:
        y = y.permute([0, *range(2, rank), 1])
        dims = range(1, rank - 1)
    else:
        dims = range(2, rank)
    for dim, f in zip(dims, factors):
        if f == 1:
            continue
        prev, nxt = _shifted(y, dim, -1), _shifted(y, dim, 1)
        phases = []
        for p in range(f):
            off = (p + 0.5) / f - 0.5  # source position of output p, relative to input 0
            a, b, w = (prev, y, 1.0 + off) if off < 0 else (y, nxt, off)
            phases.append(a if w == 0 else a * (1.0 - w) + b * w)
        y = torch.stack(phases, dim + 1).flatten(dim, dim + 1)
    if channels_last:
        y = y.permute([0, rank - 1, *range(1, rank - 1)])
    return y.to(dtype)


_LINEAR = {"linear": 3, "bilinear": 4, "trilinear": 5}


def _static_shape(v) -> tuple | None:
    if not isinstance(v, torch.Tensor) or not all(type(s) is int for s in v.shape):
        return None
    return tuple(v.shape)


def _has_node(v) -> bool:
    found = []
    torch.fx.node.map_aggregate(v, lambda a: found.append(a) if isinstance(a, torch.fx.Node) else None)
    return bool(found)


def _factors(node):
    """For an interpolate call braze may rewrite: the function replacing it, the whole
    factors and whether its result is channels-last; None when it must stay."""
    try:
        bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    x = a["input"]
    mode = a["mode"]
    linear = mode in _LINEAR
    if (mode not in _MODES and not linear) or a.get("antialias") or not isinstance(x, torch.fx.Node):
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
        if not torch.allclose(want, linear_repeat(probe, factors, False), rtol=0, atol=1e-9):
            return None
        return linear_repeat, factors, channels_last
    if not torch.equal(want, nearest_repeat(probe, factors, False)):
        return None
    return nearest_repeat, factors, channels_last


def nearest_as_broadcasts(gm: torch.fx.GraphModule) -> int:
    """Rewrites ``gm`` in place ([Note: nearest upsampling as a broadcast]): each nearest or
    linear ``F.interpolate`` by whole factors on static sizes becomes :func:`nearest_repeat`
    or :func:`linear_repeat`. Returns how many calls were rewritten."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not F.interpolate:
            continue
        found = _factors(node)
        if found is None:
            continue
        fn, factors, channels_last = found
        x = node.args[0] if node.args else node.kwargs["input"]
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(fn, (x, factors, channels_last))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
