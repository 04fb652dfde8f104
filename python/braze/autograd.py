"""Calling braze's compiled graphs straight from autograd, without AOTAutograd's runtime wrappers.

AOTAutograd traces, decomposes and partitions every graph braze compiles. At run time it also
wraps the compiled forward and backward in Python that replays input mutations, regenerates
output aliases, unwraps tensor subclasses, threads RNG state and effect tokens, and checks and
re-lays-out tangents. For a graph that needs none of that, those wrappers are pure host time
(on the H100 the seed training step was host-bound, see BENCHMARKS.md). This module reads
AOTAutograd's own metadata for each graph and, where it shows none of those features in use,
returns a direct path instead:

* inference graphs: the compiled graph itself;
* training graphs: one ``torch.autograd.Function`` whose forward runs the compiled forward
  and saves what it returns for the backward, and whose backward runs the compiled
  backward. braze's runtime already copies a tangent whose layout differs from the one its
  kernels were compiled for, which is what AOTAutograd's tangent handling is for.

Anything the checks do not prove simple keeps AOTAutograd's wrappers (``Capture.why`` says
which check failed; ``BRAZE_LOGS=graph`` prints it).
"""
from __future__ import annotations

import threading

import torch
from torch.autograd.function import once_differentiable

_state = threading.local()


class Capture:
    """What braze's compilers saw during one AOTAutograd call (one Dynamo graph)."""

    def __init__(self, example_inputs):
        self.example_inputs = example_inputs
        self.forward = None  # (kind, compiled callable, fx graph, fw_metadata)
        self.backward = None  # (compiled callable, fx graph)
        self.why = None
        self.names = []  # braze's names of the graphs compiled
        # Forward output name -> the strides braze returns it with, where they differ from
        # eager's ([Note: saved outputs in their returned layout] in backend.py).
        self.relaid_outputs = {}
        # Whether the forward's convolutions ran channels_last (its backward's then do too).
        self.conv_channels_last = None

    def __enter__(self):
        self.prev = getattr(_state, "capture", None)
        _state.capture = self
        return self

    def __exit__(self, *exc):
        _state.capture = self.prev


def current():
    """The Capture of the AOTAutograd call running on this thread, or None."""
    return getattr(_state, "capture", None)


def record(kind, name, fn, gm):
    """Called by braze's compilers with each graph AOTAutograd hands them."""
    cap = current()
    if cap is None:
        return
    cap.names.append(name)
    if kind == "backward":
        cap.backward = (fn, gm)
    else:
        ctx = torch._guards.TracingContext.try_get()
        cap.forward = (kind, fn, gm, getattr(ctx, "fw_metadata", None))


def direct_path(cap: Capture, gm: torch.fx.GraphModule):
    """A callable running the captured graphs without AOTAutograd's runtime wrappers,
    or None (with ``cap.why`` set) where they are needed."""
    why = _not_simple(cap, gm)
    if why is not None:
        cap.why = why
        return None
    kind, fw, fw_gm, meta = cap.forward
    # [Note: autocast around compiled graphs] A graph traced under autocast has its casts in
    # it; run with autocast still on, the extern ATen calls in it (matmuls, convolutions)
    # would be autocast again (an f32 matmul the graph keeps f32 would run in bf16). As
    # AOTAutograd's wrappers do, the graphs run with autocast off when it was on at compile time.
    amp = torch._C._is_any_autocast_enabled()
    if kind == "inference":
        if amp:
            def infer_amp(*args):
                with torch._C._DisableAutocast():
                    return fw(list(args))
            return infer_amp

        def infer(*args):
            return fw(list(args))
        return infer
    bw, bw_gm = cap.backward
    try:
        return _training_path(fw, fw_gm, meta, bw, bw_gm, amp)
    except _NotSimple as e:
        cap.why = str(e)
        return None


class _NotSimple(Exception):
    pass


def _not_simple(cap, gm):
    if cap.forward is None:
        return "no forward graph was compiled"
    kind, _, fw_gm, meta = cap.forward
    if meta is None:
        return "AOTAutograd's metadata is not available"
    if kind == "forward" and cap.backward is None:
        return "the backward graph was not compiled ahead of time"
    if next(gm.parameters(), None) is not None or next(gm.buffers(), None) is not None:
        return "the graph holds parameters or buffers of its own"
    for x in cap.example_inputs:
        if isinstance(x, torch.Tensor):
            if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.is_complex():
                return "an input is a tensor subclass or complex"
        elif not isinstance(x, (int, float, bool, torch.SymInt)):
            # A SymInt (a dynamic size Dynamo passes as an argument) is an int at run time.
            return "an input is neither a tensor, a size nor a constant"
    if getattr(torch._dynamo.config, "compiled_autograd", False):
        return "compiled autograd is enabled"
    n_in = sum(1 for n in fw_gm.graph.nodes if n.op == "placeholder")
    if n_in != len(cap.example_inputs):
        return "AOTAutograd changed the inputs (deduplicated or synthetic bases)"
    try:
        if any(i.mutates_data or i.mutates_metadata for i in meta.input_info):
            return "the graph mutates an input"
        for o in meta.output_info:
            if o.output_type.name != "non_alias" or not issubclass(o.raw_type, torch.Tensor):
                return "an output aliases an input or an intermediate, or is not a tensor"
        if meta.num_intermediate_bases or meta.tokens or meta.is_rng_op_functionalized or getattr(meta, "num_outputs_rng_offset", 0):
            return "the graph has intermediate bases, effect tokens or functionalized RNG"
    except AttributeError as e:  # metadata of a PyTorch version this was not written for
        return f"AOTAutograd's metadata lacks {e.name!r}"
    return None


def _training_path(fw, fw_gm, meta, bw, bw_gm, amp):
    n_out = meta.num_outputs
    if n_out == 0:
        raise _NotSimple("the graph returns nothing")
    out_node = next(n for n in fw_gm.graph.nodes if n.op == "output")
    fw_outs = list(out_node.args[0])
    saved = fw_outs[n_out:]
    if not all(isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor) for n in saved):
        raise _NotSimple("the forward saves something other than tensors for the backward")
    saved_at = {n.name: i for i, n in enumerate(saved)}
    grad_outs = [i for i, o in enumerate(meta.output_info) if o.requires_grad]
    nondiff = tuple(i for i, o in enumerate(meta.output_info) if not o.requires_grad)
    # Each backward input: a saved tensor (named as the forward output it is) or a tangent
    # (tangents_1, tangents_2, ... in the order of the outputs that require grad).
    bw_args = []
    tangents = 0
    for n in bw_gm.graph.nodes:
        if n.op != "placeholder":
            continue
        if n.name in saved_at:
            bw_args.append(saved_at[n.name])
        elif n.name.startswith("tangents"):
            if tangents >= len(grad_outs):
                raise _NotSimple("more tangents than outputs that require grad")
            bw_args.append(-1 - grad_outs[tangents])
            tangents += 1
        else:
            raise _NotSimple(f"backward input {n.name} is neither saved by the forward nor a tangent")
    if tangents != len(grad_outs):
        raise _NotSimple("fewer tangents than outputs that require grad")
    n_in = sum(1 for n in fw_gm.graph.nodes if n.op == "placeholder")
    n_grads = len(next(n for n in bw_gm.graph.nodes if n.op == "output").args[0])
    if n_grads != n_in:
        raise _NotSimple("the backward does not return one gradient per input")
    plan = _Plan(fw, bw, n_out, nondiff, tuple(bw_args), amp)
    apply = _BrazeFunction.apply

    def run(*args):
        return apply(plan, *args)
    return run


# Older PyTorch lacks the query: then the backward always goes through torch._dynamo.disable.
_eval_frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", lambda: True)


class _Plan:
    __slots__ = ("fw", "bw", "bw_no_dynamo", "n_out", "nondiff", "bw_args", "amp")

    def __init__(self, fw, bw, n_out, nondiff, bw_args, amp):
        # The backward runs from the autograd engine, maybe on a thread where Dynamo is
        # active (a backward called inside a compiled function): there it must not be traced
        # (AOTAutograd disables Dynamo the same way). Elsewhere it is called directly.
        self.fw = fw
        self.bw = bw
        self.bw_no_dynamo = torch._dynamo.disable(bw)
        self.n_out = n_out
        self.nondiff = nondiff
        self.bw_args = bw_args
        self.amp = amp  # compiled under autocast: run with it off ([Note: autocast around compiled graphs])


class _BrazeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, *args):
        if plan.amp:
            with torch._C._DisableAutocast():
                outs = plan.fw(list(args))
        else:
            outs = plan.fw(list(args))
        n = plan.n_out
        ctx.plan = plan
        ctx.save_for_backward(*outs[n:])
        user = tuple(outs[:n])
        if plan.nondiff:
            ctx.mark_non_differentiable(*(user[i] for i in plan.nondiff))
        return user

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        plan = ctx.plan
        saved = ctx.saved_tensors
        args = [saved[i] if i >= 0 else grads[-1 - i] for i in plan.bw_args]
        # [Note: inputs freed at their last use] (runtime.py): `args` becomes the only
        # reference to the saved activations (AOTAutograd's backward does the same), unless
        # the graph is kept for another backward (retain_graph).
        del saved, grads
        clear = getattr(ctx, "maybe_clear_saved_tensors", None)
        if clear is not None:
            clear()
        cb = _eval_frame_callback()
        bw = plan.bw if cb is None or cb is False else plan.bw_no_dynamo
        if plan.amp:
            with torch._C._DisableAutocast():
                return (None, *bw(args))
        return (None, *bw(args))
