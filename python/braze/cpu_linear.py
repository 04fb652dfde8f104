"""CPU linears through the best library kernel PyTorch ships ([Note: CPU linears]).

[Note: CPU linears]
On the CPU braze does not generate matmuls; it calls a library. For an inference graph, an
``addmm(bias, x, t(w))`` or ``mm(x, t(w))`` whose weight ``w`` is a static input of the graph
(a parameter or buffer: AOTAutograd's ``static_input_indices``, the same tensor every call)
(or ``addmm(bias, x, w)`` with ``w`` a static ``[K, N]`` input, GPT-2's ``Conv1D``) becomes a
call of a prepacked kernel:

- f32: MKL's packed GEMM, ``mkl._mkl_linear`` over ``mkl._mkl_reorder_linear_weight`` (what
  Inductor's freezing passes use for f32). MKL's path takes no activation, so relu, gelu and
  residual adds stay in braze's kernels after it. oneDNN's ``mkldnn._linear_pointwise`` with a
  fused activation was measured no faster than ``addmm`` on the development CPU (Sapphire
  Rapids, AVX-512), and MKL's packed GEMM 7-17% faster than ``addmm`` at 1 thread.
- bf16: oneDNN, ``mkldnn._linear_pointwise`` over ``mkldnn._reorder_linear_weight`` (AMX where
  the CPU has it), with a following relu or gelu (exact or tanh) fused as the primitive's
  post-op when it is the linear's only user (also through the view a 3-d ``linear`` puts
  between), and silu as braze's decomposition leaves it (an f32 ``x * sigmoid(x)`` between
  casts) as oneDNN's ``swish``. Prepacked and fused it took 0.5-0.8x the time of ``addmm`` plus the activation.
- Residual adds are not fused: ``mkldnn._linear_pointwise.binary`` cost a fixed ~3 ms per call
  on the development machine (2.7 ms at M=1, N=K=768), far more than the add it saves.

The packed weight is cached on the call site and reused while the weight is the same tensor
object (a weak reference), at the same address and with the same ``_version``; an in-place
update (an optimizer step, ``copy_`` under ``no_grad``) bumps the version and the next call
repacks. Writes through ``.data`` do not bump ``_version`` and are not seen (as with
Inductor's freezing, which never repacks). Training graphs (forward and backward) keep plain
``aten.mm``/``addmm``: their weights change every step, and the activation's input is usually
saved for the backward anyway. Non-static weights, f64/f16, symbolic sizes and
``torch.backends.mkldnn.matmul.fp32_precision`` other than ``none``/``ieee`` keep ``aten``;
so does every linear when ``BRAZE_CPU_LINEAR=0`` is set while a graph compiles.
"""
from __future__ import annotations

import os
import weakref

import torch

aten = torch.ops.aten

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


class CpuLinear:
    """A library linear with a prepacked weight: called as ``(x, w, bias)`` with ``x`` 2-d,
    ``w`` the ``[N, K]`` weight (``[K, N]`` when `transposed`); returns the result viewed as
    ``out_shape``."""

    def __init__(self, kind, batch, out_shape, attr="none", algorithm="", transposed=False):
        self.kind = kind  # "mkl" (f32) | "mkldnn" (bf16)
        self.transposed = transposed  # w is given as [K, N] (GPT-2's Conv1D); w.t() is packed
        self.batch = batch
        self.out_shape = tuple(out_shape)
        self.attr = attr
        self.algorithm = algorithm
        self.cache = None  # (weakref to w, data_ptr, _version, packed)
        self.packs = 0  # how many times the weight was packed (tests read it)
        suffix = "" if attr == "none" else f"+{attr}" + (f"({algorithm})" if algorithm not in ("", "none") else "")
        self.__name__ = ("mkl._mkl_linear" if kind == "mkl" else "mkldnn._linear_pointwise") + suffix + "[packed]"

    def packed(self, w):
        c = self.cache
        if c is not None and c[0]() is w and c[1] == w.data_ptr() and c[2] == w._version:
            return c[3]
        wn = w.t() if self.transposed else w
        with torch.no_grad():
            if self.kind == "mkl":
                p = torch.ops.mkl._mkl_reorder_linear_weight(wn, self.batch)
            else:
                p = torch.ops.mkldnn._reorder_linear_weight(wn, self.batch)
        self.packs += 1
        self.cache = (weakref.ref(w), w.data_ptr(), w._version, p)
        return p

    def __call__(self, x, w, bias=None):
        with torch.no_grad():
            p = self.packed(w)
            if self.kind == "mkl":
                r = torch.ops.mkl._mkl_linear(x, p, w.t() if self.transposed else w, bias, self.batch)
            else:
                r = torch.ops.mkldnn._linear_pointwise(x, p, bias, self.attr, [], self.algorithm)
        return r if r.shape == self.out_shape else r.view(self.out_shape)

    def __repr__(self):
        return self.__name__


def _static_ints(v) -> bool:
    return isinstance(v, torch.Tensor) and all(isinstance(s, int) for s in (*v.shape, *v.stride()))


def _kind(dtype):
    if dtype == torch.float32:
        if not torch._C.has_mkl or torch.backends.mkldnn.matmul.fp32_precision not in ("none", "ieee"):
            return None
        return "mkl"
    if dtype == torch.bfloat16:
        return "mkldnn" if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported() else None
    return None


def _activation(node):
    """(attr, algorithm) of a unary op oneDNN fuses as a post-op, or None."""
    if node.target is aten.relu.default:
        return "relu", ""
    if node.target is aten.gelu.default:
        approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return "gelu", approx
    return None


def _silu(u, src, dtype):
    """The nodes of silu as braze's decomposition leaves it on a low-precision value `src`
    (`u` its only user): ``c = _to_copy(src, f32); _to_copy(c * sigmoid(c), dtype)``, or None."""
    if (u.target is not aten._to_copy.default or u.args[0] is not src or u.kwargs.get("dtype") != torch.float32
            or set(u.kwargs) - {"dtype"} or len(u.users) != 2):
        return None
    sig = next((v for v in u.users if v.target is aten.sigmoid.default), None)
    mul = next((v for v in u.users if v.target is aten.mul.Tensor), None)
    if sig is None or mul is None or len(sig.users) != 1 or set(mul.args) != {u, sig} or len(mul.args) != 2 or len(mul.users) != 1:
        return None
    back = next(iter(mul.users))
    if back.target is not aten._to_copy.default or back.kwargs.get("dtype") != dtype or set(back.kwargs) - {"dtype"}:
        return None
    return [u, sig, mul, back]


def plan(gm: torch.fx.GraphModule, static_inputs):
    """The CPU linears of an inference graph: ({FX node: (CpuLinear, operand nodes)}, the FX
    nodes computed inside them)."""
    if not torch.backends.mkldnn.is_available() or os.environ.get("BRAZE_CPU_LINEAR") == "0":
        return {}, set()
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    static = {places[i] for i in static_inputs if i < len(places)}
    roots, absorbed = {}, set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (aten.mm.default, aten.addmm.default):
            continue
        if n.target is aten.addmm.default:
            if len(n.args) != 3 or n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
                continue
            bias, x, wt = n.args
        else:
            (x, wt), bias = n.args, None
        if not isinstance(wt, torch.fx.Node) or not isinstance(x, torch.fx.Node):
            continue
        if wt in static:  # x @ w with w [K, N] (GPT-2's Conv1D: addmm(b, x, w))
            w, transposed = wt, True
        elif wt.target is aten.t.default or wt.target is aten.permute.default and list(wt.args[1]) == [1, 0]:
            w, transposed = wt.args[0], False
        else:
            continue
        if w not in static:
            continue
        xv, wv, ov = x.meta.get("val"), w.meta.get("val"), n.meta.get("val")
        n_out = wv.shape[1] if transposed else wv.shape[0]
        if not all(_static_ints(v) for v in (xv, wv, ov)) or xv.dim() != 2 or wv.dim() != 2:
            continue
        if not wv.is_contiguous() or xv.dtype != wv.dtype or ov.dtype != wv.dtype or ov.numel() == 0 or xv.shape[1] == 0:
            continue
        kind = _kind(wv.dtype)
        if kind is None:
            continue
        if bias is not None:
            bv = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
            if not _static_ints(bv) or bv.dim() != 1 or bv.shape[0] != n_out or bv.dtype != wv.dtype:
                continue
        root, inner, attr, algo = n, [], "none", ""
        if kind == "mkldnn" and len(n.users) == 1:
            u = next(iter(n.users))
            chain = []
            if u.target in _VIEWS and len(u.users) == 1:
                chain, u = [u], next(iter(u.users))
            src = chain[0] if chain else n
            act = _activation(u) if u.op == "call_function" else None
            if act is not None and u.args[0] is src:
                root, inner, (attr, algo) = u, [n, *chain], act
            else:
                silu = _silu(u, src, wv.dtype)
                if silu is not None:
                    root, inner, attr = silu[-1], [n, *chain, *silu[:-1]], "swish"
        spec = CpuLinear(kind, xv.shape[0], root.meta["val"].shape, attr, algo, transposed)
        roots[root] = (spec, (x, w, bias))
        absorbed.update(inner)
    return roots, absorbed
