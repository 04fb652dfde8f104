"""The Dynamo backend: ``torch.compile(model, backend="braze")`` lands here.

AOTAutograd (PyTorch) functionalizes the graph, applies braze's decomposition table and
splits forward from backward; each resulting ATen graph is lowered to braze IR and
compiled by the Rust core. A graph braze cannot compile runs eagerly with a warning that
names the reason; single ops braze does not lower run through their ATen kernels.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import warnings

import torch

from . import _core, cpu_heap, cuda, cudagraphs
from . import autograd as direct
from .attention import dense_masks
from .upsample import whole_factor_upsampling
from .config import Config
from .decomp import decomposition_table, drop_unread_batch_norm_stats, recomputable_batch_norm_outputs
from .lowering import Unsupported, is_tensor_meta, lower_graph
from .runtime import CompiledGraph


class Stats:
    """Counters over the life of the process (``braze.stats``)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.graphs_compiled = 0
        self.graphs_eager = 0
        self.eager_reasons = []
        self.kernels = 0
        self.extern_ops = {}
        self.lowered_ops = {}
        self.records = []  # one dict per compiled or fallen-back graph (used by explain)
        self.direct_graphs = 0  # Dynamo graphs run without AOTAutograd's runtime wrappers
        self.aot_wrapped = []  # (graph names, why AOTAutograd's wrappers were kept)
        self.islands = {}  # op name -> calls run through PyTorch inside compiled graphs (HOPs, effects)
        self.lowering_errors = []  # (graph name, op name, traceback): braze bugs, never hidden

    def __repr__(self):
        return (f"braze.Stats(graphs_compiled={self.graphs_compiled}, graphs_eager={self.graphs_eager}, "
                f"kernels={self.kernels}, extern_ops={self.extern_ops}, direct_graphs={self.direct_graphs})")


stats = Stats()
_graph_counter = [0]


def _log(cfg: Config, name: str, title: str, text: str):
    if name in cfg.logs:
        print(f"[braze:{name}] {title}\n{text}", file=sys.stderr)


def compile_fx_graph(gm: torch.fx.GraphModule, example_inputs, *, cfg: Config, kind: str):
    """Compiles one ATen FX graph; returns a boxed callable (or the graph itself on fallback)."""
    _graph_counter[0] += 1
    name = f"{kind}_{_graph_counter[0]}"
    t0 = time.perf_counter()
    record = {"name": name, "kind": kind, "fx_nodes": len(gm.graph.nodes)}
    try:
        def lower(library_convs):
            return lower_graph(gm, name, functools.partial(_compile_subgraph, cfg=cfg), _static_inputs(kind) if cfg.freeze_weights else (),
                               _saved_strides(gm) if kind == "backward" else None, _conv_layout(kind, cfg), _saved_from(kind),
                               library_convs=library_convs, eager_random=cfg.eager_random)
        lowered = lower(cfg.cudnn_convs)
        t1 = time.perf_counter()
        try:
            compiled = _build(lowered, cfg)
        except (_core.InternalError, _core.EnvironmentError_) as e:
            # cuDNN refused a convolution (no algorithm, a failed query): the graph's
            # convolutions go back to ATen rather than the whole graph to eager.
            if not (cfg.cudnn_convs and "cuDNN" in str(e)):
                raise
            warnings.warn(f"braze: graph {name}: {e}; its convolutions run through ATen", stacklevel=2)
            lowered = lower(False)
            compiled = _build(lowered, cfg)
        t2 = time.perf_counter()
        fn = CompiledGraph(compiled, lowered, name)
        if fn.copied_aliases and kind != "backward" and (fn.dynamic or not _view_replay()):
            # AOTAutograd replays an aliased output's views on the input when they have no
            # symbolic arguments; otherwise it applies the returned copy's strides to the
            # input's storage.
            raise Unsupported("an output that is a view of an input could not be kept a strided view of it")
        if kind == "forward" and cfg.keep_cpu_heap and fn.device.type == "cpu" and not cpu_heap.kept():
            # [Note: a kept CPU heap]: the saved activations are freed and allocated again each step.
            if cpu_heap.keep():
                _log(cfg, "compile", f"{name}: CPU heap", "kept between steps (glibc trim threshold 1 GiB, mmap threshold 32 MiB)")
        if kind == "forward":
            _note_relaid_outputs(gm, lowered, fn)
            cap = direct.current()
            if cap is not None:
                cap.conv_channels_last = lowered.conv_channels_last
        if cfg.whole_graph_replay:
            fn = cudagraphs.wrap(fn, kind, () if kind == "backward" else _static_input_indices(), cfg.logs)
    except (Unsupported, _core.Unsupported, _core.InternalError, _core.EnvironmentError_) as e:
        reason = f"{type(e).__name__}: {e}"
        stats.graphs_eager += 1
        stats.eager_reasons.append((name, reason))
        record.update(status="eager", reason=reason, compile_s=time.perf_counter() - t0)
        stats.records.append(record)
        if cfg.on_unsupported == "error":
            raise
        if cfg.on_unsupported == "warn":
            warnings.warn(f"braze: graph {name} runs eagerly: {reason}", stacklevel=2)
        fn = _eager(gm)
        direct.record(kind, name, fn, gm)
        return fn
    direct.record(kind, name, fn, gm)
    stats.graphs_compiled += 1
    stats.kernels += len(compiled.kernels)
    for op, n in lowered.fallbacks.items():
        stats.extern_ops[op] = stats.extern_ops.get(op, 0) + n
    for op, n in lowered.lowered_ops.items():
        stats.lowered_ops[op] = stats.lowered_ops.get(op, 0) + n
    for op, n in lowered.islands.items():
        stats.islands[op] = stats.islands.get(op, 0) + n
    for op, tb in lowered.bugs.items():
        # A lowering that raised something other than Unsupported is a braze bug: the node ran
        # through ATen, so results are right, but it is reported whatever on_unsupported says.
        stats.lowering_errors.append((name, op, tb))
        warnings.warn(f"braze: bug in the lowering of {op} (graph {name}); it runs through ATen:\n{tb}", stacklevel=2)
    times = {"lower": t1 - t0, **dict(compiled.times), "total": time.perf_counter() - t0}
    record.update(status="compiled", kernels=compiled.kernels, externs=dict(lowered.fallbacks), extern_reasons=dict(lowered.reasons), times=times,
                  islands=dict(lowered.islands), constants=len(lowered.constants), cpu_linears=list(lowered.cpu_linears),
                  cached=compiled.cached, source=compiled.source, schedule=compiled.schedule)
    if compiled.cuda_source:  # a CPU graph whose CUDA code was checked with NVRTC (BRAZE_CHECK_CUDA)
        record["cuda_source"] = compiled.cuda_source
    stats.records.append(record)
    _log(cfg, "compile", f"{name}: compile stages", _stages(times) + (" (from the disk cache)" if compiled.cached else ""))
    _log(cfg, "graph", f"{name}: IR before passes", compiled.graph_before)
    _log(cfg, "graph", f"{name}: IR after passes", compiled.graph_after)
    if "fusion" in cfg.logs:
        groups = "\n".join(f"  {k}: stores {', '.join(r)}" for k, r in compiled.kernels)
        why = "\n".join("  " + m for m in compiled.fusion_log) or "  (every root fused where its shape allowed)"
        _log(cfg, "fusion", f"{name}: {len(compiled.kernels)} kernel(s)", groups + "\n not fused:\n" + why)
    _log(cfg, "schedule", f"{name}: schedule", compiled.schedule)
    _log(cfg, "output_code", f"{name}: generated C", compiled.source)
    if lowered.fallbacks:
        _log(cfg, "fallbacks", f"{name}: ops run through ATen", "\n".join(f"  {k} x{v}: {lowered.reasons.get(k, '')}" for k, v in lowered.fallbacks.items()))
    return fn


# [Note: saved outputs in their returned layout] braze returns some forward outputs with
# strides other than eager's: a padded matmul's result is returned as the padded view
# ([Note: padded matmuls] in braze-passes). When the backward reads such an output as a saved
# tensor, AOTAutograd's metadata gives it eager's strides; compiled for those, the backward
# copied BERT-base's saved logits (477 MiB) into them every step. A saved tensor is a forward
# output of the same name, so the backward is compiled for the strides the forward returns
# it with.


def _view_replay() -> bool:
    return bool(getattr(torch._functorch.config, "view_replay_for_aliased_outputs", False))


def _note_relaid_outputs(gm, lowered, fn):
    cap = direct.current()
    strides = fn.output_strides()
    if cap is None or strides is None:
        return
    out = next(n for n in gm.graph.nodes if n.op == "output")
    args = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    relaid = {}
    for a, (kind, k) in zip(args, lowered.outputs):
        val = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        if kind == "t" and is_tensor_meta(val) and all(isinstance(s, int) for s in (*val.shape, *val.stride())) and strides[k] != tuple(val.stride()):
            relaid[a.name] = strides[k]
    cap.relaid_outputs = relaid


def _conv_layout(kind, cfg):
    """The conv_layout option, or for a backward its forward's choice ([Note: convolution
    layout] in lowering.py): the saved activations come in the layout the forward chose."""
    cap = direct.current()
    if kind == "backward" and cap is not None and cap.conv_channels_last is not None:
        return cap.conv_channels_last
    return cfg.conv_layout


def _saved_from(kind):
    """A forward's first output position that is a tensor saved for the backward (AOTAutograd's
    metadata), or None."""
    if kind != "forward":
        return None
    ctx = torch._guards.TracingContext.try_get()
    n = getattr(getattr(ctx, "fw_metadata", None), "num_forward", None)
    return n if isinstance(n, int) else None


def _saved_strides(gm):
    cap = direct.current()
    if cap is None or not cap.relaid_outputs:
        return None
    return {n.name: cap.relaid_outputs[n.name] for n in gm.graph.nodes
            if n.op == "placeholder" and n.name in cap.relaid_outputs and not n.name.startswith("tangents")}


def _static_input_indices():
    """Positions of the graph's inputs AOTAutograd marks static (parameters, buffers)."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None)
    return tuple(getattr(meta, "static_input_indices", None) or ())


def _static_inputs(kind):
    """Positions of an inference graph's inputs AOTAutograd marks static (parameters,
    buffers): with option freeze_weights, CPU linears keep their weights prepacked ([Note: CPU
    linears]). Training graphs get none: their weights change every step."""
    return _static_input_indices() if kind == "inference" else ()


def _build(lowered, cfg: Config, plan_only=False):
    """Passes, scheduling, code generation and the compiler for a lowered graph, for the
    device its tensors live on (NVRTC for CUDA, the C compiler for the CPU). `plan_only`
    (CUDA): the plan alone, made without a GPU ([Note: plans without a GPU] in
    braze-driver; `braze.plan_memory`)."""
    device = lowered.device
    arena_externs = [k for k, call in lowered.externs.items() if call.operands_in_arena]
    if device.type == "cuda":
        if plan_only:
            target = "cuda:0"
        else:
            why = cuda.cuda_ready()
            if why is not None:
                raise Unsupported(why)
            target = f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
        # Under whole-graph replay the runs of kernels are captured with the rest: no replay
        # of their own.
        return lowered.builder.compile(device=target, cuda_graphs=cfg.cuda_graphs and not cfg.whole_graph_replay, matmul_tune=cfg.matmul_tune, kernel_tune=cfg.kernel_tune, arena_externs=arena_externs,
                                        elide_layouts=lowered.conv_channels_last or lowered.library_convs > 0, plan_only=plan_only, bias_grads=cfg.bias_grad_epilogues,
                                        programmatic_launch=cfg.programmatic_launch, column_clusters=cfg.column_clusters)
    check = os.environ.get("BRAZE_CHECK_CUDA") == "1" and cuda.nvrtc_available()
    return lowered.builder.compile(device="cpu", check_cuda=check, kernel_tune=cfg.kernel_tune, arena_externs=arena_externs, column_clusters=cfg.column_clusters)


def _compile_subgraph(gm, name, *, cfg):
    """A subgraph of cond or while_loop compiled by braze (a boxed callable); raises
    Unsupported when it cannot be, and the operator then runs as a PyTorch island."""
    t0 = time.perf_counter()
    try:
        lowered = lower_graph(gm, name, functools.partial(_compile_subgraph, cfg=cfg))
        compiled = _build(lowered, cfg)
        fn = CompiledGraph(compiled, lowered, name)
    except (Unsupported, _core.Unsupported, _core.InternalError, _core.EnvironmentError_) as e:
        raise Unsupported(f"subgraph {name}: {type(e).__name__}: {e}") from None
    stats.kernels += len(compiled.kernels)
    for op, tb in lowered.bugs.items():
        stats.lowering_errors.append((name, op, tb))
    stats.records.append({"name": name, "kind": "subgraph", "status": "compiled", "fx_nodes": len(gm.graph.nodes),
                          "kernels": compiled.kernels, "externs": dict(lowered.fallbacks), "islands": dict(lowered.islands),
                          "extern_reasons": dict(lowered.reasons), "times": {**dict(compiled.times), "total": time.perf_counter() - t0},
                          "cached": compiled.cached, "source": compiled.source, "schedule": compiled.schedule})
    return fn


def _stages(times) -> str:
    return ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items())


#: A first call slower than this (seconds) says where its time went, once per process.
SLOW_FIRST_CALL_S = 5.0
_slow_reported = [False]


def _report_slow_compile(names, seconds, cfg):
    recs = [r for r in stats.records if r["name"] in names]
    own = sum(r.get("times", {}).get("total", r.get("compile_s", 0.0)) for r in recs)
    if seconds < SLOW_FIRST_CALL_S or _slow_reported[0] or cfg.on_unsupported == "silent":
        return
    _slow_reported[0] = True
    stages = {}
    for r in recs:
        for k, v in r.get("times", {}).items():
            if k != "total":
                stages[k] = stages.get(k, 0.0) + v
    warnings.warn(
        f"braze: compiling {', '.join(names)} took {seconds:.1f} s: braze {own:.1f} s ({_stages(stages)}), "
        f"AOTAutograd's tracing and partitioning {max(seconds - own, 0.0):.1f} s. "
        "braze.explain(fn)(*args) or BRAZE_LOGS=compile show it per graph (said once per process).", stacklevel=3)


def _eager(gm):
    def run(args):
        return gm(*args)
    run._boxed_call = True
    return run


def braze_backend(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None, **kwargs):
    """The ``torch_dynamo_backends`` entry point."""
    if kwargs:
        raise TypeError(f"braze backend: unexpected arguments {sorted(kwargs)}")
    cfg = Config.make(mode, options)
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            cuda.start_warm_up(t.device.index if t.device.index is not None else torch.cuda.current_device())
            break
    dense_masks(gm)
    whole_factor_upsampling(gm)
    cap = direct.Capture(example_inputs)
    t0 = time.perf_counter()
    with cap, _backward_ahead_of_time(cfg):
        compiled = _aot_backend(cfg)(gm, example_inputs)
    _report_slow_compile(cap.names, time.perf_counter() - t0, cfg)
    fn = direct.direct_path(cap, gm) if cfg.direct_autograd else None
    if fn is None and cfg.direct_autograd:
        stats.aot_wrapped.append((cap.names, cap.why))
        _log(cfg, "graph", f"{', '.join(cap.names)}: AOTAutograd's runtime wrappers kept", cap.why)
    runtime = "direct" if fn is not None else f"AOTAutograd's wrappers ({cap.why or 'option direct_autograd=False'})"
    for r in stats.records[-len(cap.names):] if cap.names else []:
        if r["name"] in cap.names:
            r["runtime"] = runtime
    if fn is not None:
        stats.direct_graphs += 1
        return fn
    return compiled


def _backward_ahead_of_time(cfg: Config):
    """AOTAutograd compiles a backward graph at its first use unless told otherwise; the
    direct autograd path needs it compiled with the forward."""
    fc = torch._functorch.config
    if cfg.direct_autograd and hasattr(fc, "force_non_lazy_backward_lowering"):
        return fc.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


def _partition(joint, joint_inputs, **kwargs):
    """The min-cut partitioner, after the joint-graph rewrites braze needs first."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    drop_unread_batch_norm_stats(joint)
    recomputable_batch_norm_outputs(joint)
    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


@functools.lru_cache(None)
def _aot_backend(cfg: Config):
    from torch._dynamo.backends.common import aot_autograd

    fw = functools.partial(compile_fx_graph, cfg=cfg, kind="forward")
    bw = functools.partial(compile_fx_graph, cfg=cfg, kind="backward")
    inf = functools.partial(compile_fx_graph, cfg=cfg, kind="inference")
    return aot_autograd(
        fw_compiler=fw,
        bw_compiler=bw,
        inference_compiler=inf,
        decompositions=decomposition_table() if cfg.decompose else {},
        partition_fn=_partition,
        # Input mutations stay in the graph as copy_ nodes ([Note: input mutations]).
        keep_inference_input_mutations=True,
    )
