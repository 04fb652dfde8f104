"""CPU linears through the best library kernel PyTorch ships ([Note: CPU linears], [Note: CPU
GEMM library]).

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
Inductor's freezing, which never repacks). Training graphs (forward and backward) pack
nothing: their weights change every step, and the activation's input is usually saved for the
backward anyway. Non-static weights, f64/f16, symbolic sizes and
``torch.backends.mkldnn.matmul.fp32_precision`` other than ``none``/``ieee`` are not packed:
they keep braze's own BLAS call (f32) or ``aten``, or, f32 only, take the unpacked oneDNN call
of [Note: CPU GEMM library]; every linear keeps those when ``BRAZE_CPU_LINEAR=0`` is set while
a graph compiles.

[Note: CPU GEMM library]
Which f32 GEMM PyTorch's wheel runs fastest depends on the CPU, not only on the shape: MKL
takes its AVX2 code on AMD processors even where they have AVX-512, and oneDNN does not. On
the 2-core AMD EPYC build machine (AVX-512) ``mkldnn._linear_pointwise`` took 0.41-0.48x the
time of ``addmm`` (MKL's ``sgemm``) from 64x256x256 to 1024x4096x4096, at f32 accuracy; on
Intel CPUs MKL has been the faster. So the choice is measured, once per process, when the first
CPU graph compiles (`f32_library`: a 128x512x512 product through each, ~3 ms): ``onednn``
where oneDNN takes under 0.8x of the BLAS's time, ``blas`` otherwise. With ``onednn``:

- every f32 ``mm``/``addmm`` (1-d bias) of static sizes with 2·M·N·K ≥ ``ONEDNN_MIN_FLOPS`` is
  a call of ``mkldnn._linear_pointwise`` (``mm(a, b)`` as ``linear(a, b.t())``, views as they
  are: oneDNN reads transposed operands at the same speed), in inference and training graphs,
  with a following relu or gelu fused as above when it is the matmul's only user. Smaller ones
  stay braze's own BLAS calls from Rust ([Note: CPU matmuls]): oneDNN's ~12 µs of fixed cost
  per call outweighs what it saves below about 4 MFLOP. Under dynamic shapes a matmul whose
  row count is symbolic (static N and K) is a oneDNN call where N·K ≥ ``ONEDNN_MIN_NK``: at
  one row oneDNN is then the BLAS's equal, from four rows on twice as fast;
- prepacked f32 linears (freeze_weights) use oneDNN's packed weights instead of MKL's.

With ``blas`` nothing changes: braze's BLAS calls, and MKL's packed GEMM under freeze_weights.
"""
from __future__ import annotations

import os
import weakref

import torch

aten = torch.ops.aten

#: 2·M·N·K from which an f32 matmul is a oneDNN call where oneDNN is the faster library
#: ([Note: CPU GEMM library]); below it braze's own BLAS call from Rust is quicker.
ONEDNN_MIN_FLOPS = 1 << 23
#: N·K from which a matmul of a symbolic row count M is a oneDNN call: at M = 1 (a decode
#: step) oneDNN is the BLAS's equal from 2^19 (768×768: 32.0 against 31.2 µs), twice as fast
#: from M = 4 on, on the build machine.
ONEDNN_MIN_NK = 1 << 19

_F32_LIBRARY = []  # the measured choice, made once per process
#: The calibration's best times in µs, {"blas": ..., "onednn": ...} (for explain and tests).
F32_TIMES = {}


def _full_f32() -> bool:
    """Whether oneDNN computes f32 matmuls in f32 (its ``fp32_precision`` setting, where this
    PyTorch has it, is not a narrower type)."""
    prec = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", "none")
    return prec in ("none", "ieee")


def f32_library() -> str:
    """The faster f32 GEMM library of this CPU among those PyTorch ships: "onednn" or "blas"
    ([Note: CPU GEMM library]), measured on the first call."""
    if not _F32_LIBRARY:
        _F32_LIBRARY.append(_measure_f32_library())
    return _F32_LIBRARY[0]


def _measure_f32_library() -> str:
    if not torch.backends.mkldnn.is_available() or not _full_f32():
        return "blas"
    import time

    from torch.utils._python_dispatch import _disable_current_modes

    # Real tensors in f32 whatever the compile runs under (a fake-tensor mode, autocast).
    with _disable_current_modes(), torch.no_grad(), torch.autocast("cpu", enabled=False):
        g = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(128, 512, generator=g), torch.randn(512, 512, generator=g), torch.randn(512, generator=g)
        wt = w.t()
        calls = {"blas": lambda: torch.addmm(b, x, wt), "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")}
        try:
            for name, f in calls.items():
                f()
                f()
                best = float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    f()
                    best = min(best, time.perf_counter() - t)
                F32_TIMES[name] = best * 1e6
        except RuntimeError:  # a build whose oneDNN lacks the op: the BLAS
            F32_TIMES.clear()
            return "blas"
    return "onednn" if F32_TIMES["onednn"] < 0.8 * F32_TIMES["blas"] else "blas"

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


class CpuLinear:
    """A library linear with a prepacked weight: called as ``(x, w, bias)`` with ``x`` 2-d,
    ``w`` the ``[N, K]`` weight (``[K, N]`` when `transposed`); returns the result viewed as
    ``out_shape``."""

    def __init__(self, kind, batch, out_shape, attr="none", algorithm="", transposed=False):
        # "mkl": MKL's packed GEMM (f32); "mkldnn": oneDNN with a packed weight (bf16, f32 where
        # oneDNN is the faster library); "onednn": oneDNN with the weight as it is, no packing
        # (any f32 matmul large enough, [Note: CPU GEMM library]).
        self.kind = kind
        self.transposed = transposed  # w is given as [K, N] (GPT-2's Conv1D); w.t() is packed
        self.batch = batch
        self.out_shape = None if out_shape is None else tuple(out_shape)  # None: as the call returns it (symbolic rows)
        self.attr = attr
        self.algorithm = algorithm
        self.cache = None  # (weakref to w, data_ptr, _version, packed)
        self.packs = 0  # how many times the weight was packed (tests read it)
        suffix = "" if attr == "none" else f"+{attr}" + (f"({algorithm})" if algorithm not in ("", "none") else "")
        self.__name__ = ("mkl._mkl_linear" if kind == "mkl" else "mkldnn._linear_pointwise") + suffix + ("" if kind == "onednn" else "[packed]")

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
            if self.kind == "onednn":
                r = torch.ops.mkldnn._linear_pointwise(x, w.t() if self.transposed else w, bias, self.attr, [], self.algorithm)
            elif self.kind == "mkl":
                r = torch.ops.mkl._mkl_linear(x, self.packed(w), w.t() if self.transposed else w, bias, self.batch)
            else:
                r = torch.ops.mkldnn._linear_pointwise(x, self.packed(w), bias, self.attr, [], self.algorithm)
        return r if self.out_shape is None or r.shape == self.out_shape else r.view(self.out_shape)

    def __repr__(self):
        return self.__name__


def _static_ints(v) -> bool:
    return isinstance(v, torch.Tensor) and all(isinstance(s, int) for s in (*v.shape, *v.stride()))


def _kind(dtype, prepack):
    """The CpuLinear kind of a matmul of `dtype`, with a weight to prepack or not, or None
    (braze's own BLAS call, or ATen's matmul)."""
    if dtype == torch.float32:
        if not _full_f32():
            return None
        if f32_library() == "onednn":
            return "mkldnn" if prepack else "onednn"
        return "mkl" if prepack and torch._C.has_mkl else None
    if dtype == torch.bfloat16 and prepack:
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
    """The library linears of a CPU graph: ({FX node: (CpuLinear, operand nodes)}, the FX nodes
    computed inside them). Prepacked where the weight is one of `static_inputs` (inference
    graphs under freeze_weights); unpacked oneDNN calls for large f32 matmuls where oneDNN is
    this CPU's faster library ([Note: CPU GEMM library])."""
    if (not torch.backends.mkldnn.is_available() or os.environ.get("BRAZE_CPU_LINEAR") == "0"
            or not any(n.op == "call_function" and n.target in (aten.mm.default, aten.addmm.default) for n in gm.graph.nodes)):
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
        if wt.op == "call_function" and (wt.target is aten.t.default or wt.target is aten.permute.default and list(wt.args[1]) == [1, 0]):
            w, transposed = wt.args[0], False
        else:  # x @ w with w [K, N] (GPT-2's Conv1D: addmm(b, x, w); a backward's mm(g, w))
            w, transposed = wt, True
        xv, wv, ov = x.meta.get("val"), w.meta.get("val"), n.meta.get("val")
        if not (_static_ints(wv) and isinstance(xv, torch.Tensor) and isinstance(ov, torch.Tensor)) or xv.dim() != 2 or wv.dim() != 2:
            continue
        n_out = wv.shape[1] if transposed else wv.shape[0]
        k = xv.shape[1]
        # Rows may be symbolic (dynamic shapes): then only an unpacked oneDNN call, by N·K.
        rows_static = _static_ints(xv) and _static_ints(ov)
        if not isinstance(k, int) or xv.dtype != wv.dtype or ov.dtype != wv.dtype or k == 0 or n_out == 0 or rows_static and ov.numel() == 0:
            continue
        prepack = rows_static and w in static and wv.is_contiguous()
        if not prepack and (2 * ov.numel() * k < ONEDNN_MIN_FLOPS if rows_static else n_out * k < ONEDNN_MIN_NK):
            continue
        kind = _kind(wv.dtype, prepack)
        if kind is None:
            continue
        if bias is not None:
            bv = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
            # oneDNN reads the bias as dense: a strided or broadcast one gave wrong sums.
            if not _static_ints(bv) or bv.dim() != 1 or bv.shape[0] != n_out or bv.dtype != wv.dtype or (n_out > 1 and bv.stride(0) != 1):
                continue
        root, inner, attr, algo = n, [], "none", ""
        if kind in ("mkldnn", "onednn") and len(n.users) == 1:
            u = next(iter(n.users))
            chain = []
            if u.target in _VIEWS and len(u.users) == 1 and rows_static:
                chain, u = [u], next(iter(u.users))
            src = chain[0] if chain else n
            act = _activation(u) if u.op == "call_function" else None
            if act is not None and u.args[0] is src:
                root, inner, (attr, algo) = u, [n, *chain], act
            else:
                silu = _silu(u, src, wv.dtype)
                if silu is not None:
                    root, inner, attr = silu[-1], [n, *chain, *silu[:-1]], "swish"
        spec = CpuLinear(kind, xv.shape[0] if rows_static else None, root.meta["val"].shape if rows_static else None, attr, algo, transposed)
        roots[root] = (spec, (x, w, bias))
        absorbed.update(inner)
    return roots, absorbed
