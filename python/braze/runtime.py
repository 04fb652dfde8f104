"""Running a compiled graph: the plan from ``_core.Compiled``, prepared once per size set
and handed to Rust, which runs a whole call ([Note: the call loop in Rust] in braze-py's
exec.rs): buffers from PyTorch's allocator, runs of kernels, extern (ATen) calls, frees and
the outputs. Python picks a dynamic graph's plan and finishes what is not a tensor.
"""
from __future__ import annotations

import operator
import re
import struct
from typing import Any, NamedTuple, Optional, Union

import torch

from . import _core
from .lowering import DTYPES, ExternCall, Host, Ref, SymRef, Unsupported

_TORCH_DTYPES = {v: k for k, v in DTYPES.items()}
_UNUSED = 0xFFFFFFFF  # an extern result nothing reads
_NO_SYMS: list = []
#: Plans a dynamic graph keeps, by the symbol values they were built for (oldest dropped).
_PLANS_KEPT = 16


_SYM = re.compile(r"\bs(\d+)\b")


# A prepared plan ([Note: the call loop in Rust]): `CompiledGraph._plan` resolves the compiled
# plan's sizes for one size set into these; `_executor` hands them to Rust once, and debugging
# tools (`benchmarks/step_probe.py`, `call_parts.py`, `model_host.py`) read them by name.
class NewBuf(NamedTuple):
    """A buffer allocated before its step."""
    buf: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype


class ReuseBuf(NamedTuple):
    """A buffer that takes the tensor of `dying`, which dies at the step writing it
    ([Note: in-place kernels] in braze-sched); restrided to `shape`, `stride` when
    `restride`."""
    buf: int
    dying: int
    restride: bool
    shape: tuple
    stride: tuple


class InputBuf(NamedTuple):
    """A buffer stored straight into the graph input `arg` it becomes ([Note: input
    mutations] in lowering.py)."""
    buf: int
    arg: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype


class ExternWork(NamedTuple):
    """An extern (ATen) call: the callable, its argument template (`_template`), the operand
    views it reads as (buffer, (sizes, strides, offset) or None), its results as (buffer,
    path in the returned value, shape, strides), the operands in the window's arena as
    (buffer, dtype, shape, strides, element offset), the target, and its host values' slots."""
    fn: Any
    template: tuple
    views: tuple
    results: tuple
    in_arena: tuple
    target: Any
    host_outs: tuple


class PlanStep(NamedTuple):
    """One plan step: what it allocates first (`NewBuf`, `ReuseBuf`, `InputBuf`), its work
    (the plan step number of a run of kernels and matmuls, or an `ExternWork`), what it frees
    after, the arena window it opens (bytes, 0 if none) and whether that window closes after
    it."""
    allocs: tuple
    work: Union[int, ExternWork]
    frees: tuple
    arena_opens: int
    arena_closes: bool

    @property
    def is_extern(self) -> bool:
        return isinstance(self.work, ExternWork)


class PlanInputs(NamedTuple):
    """The graph's inputs as columns: index into the tensor arguments (constants after
    them), buffer, shape, strides."""
    args: list
    bufs: list
    shapes: list
    strides: list


class PlanOutput(NamedTuple):
    """A tensor output: its buffer, the view of it returned ((sizes, strides, offset) or
    None) and whether it is returned as a copy (an input's buffer the graph does not return
    as itself: clone(x) must not alias x)."""
    buf: int
    view: Optional[tuple]
    copy: bool


class Prepared(NamedTuple):
    """A plan with one size set's values: inputs, steps, tensor outputs, whether the outputs
    are returned as the executor makes them (`simple`), and the (output, input) copies into
    mutated inputs made after the call."""
    inputs: PlanInputs
    steps: list
    outputs: list
    simple: bool
    copies: tuple


def sym_names(expr: str):
    """The numbers of the size symbols an expression mentions (`s3` -> 3)."""
    return {int(m) for m in _SYM.findall(expr)}


def _f64_bits(t) -> int:
    """A host scalar's value as the i64 holding its float64 bits."""
    return struct.unpack("<q", struct.pack("<d", float(t)))[0]


class SymResolver:
    """Finds the value of every size symbol from the call's inputs. A symbol that no input
    carries as a bare size, stride or SymInt makes the graph unsupported (it runs eagerly)."""

    def __init__(self, input_nodes, needed, host_syms=()):
        self.num_syms = max(needed, default=-1) + 1
        self.sources = {}
        # 0-dim host inputs carried into kernels as symbols ([Note: host scalars] in
        # lowering): values, not sizes, so not part of the plan's key (a value that changes
        # every call rebuilds no plan); `with_values` writes them into each call's symbols.
        self.values = tuple((n, i, is_float) for n, i, is_float in host_syms if n in needed)
        for i, (kind, info) in enumerate(input_nodes):
            if kind == "sym":
                self._add(info, ("int", i, 0))
            elif kind == "tensor":
                _, shape, strides = info
                for d, s in enumerate(shape):
                    self._add(s, ("size", i, d))
                for d, s in enumerate(strides):
                    self._add(s, ("stride", i, d))
        missing = sorted(n for n in needed if n not in self.sources and all(n != v[0] for v in self.values))
        if missing:
            raise Unsupported("size symbol(s) " + ", ".join(f"s{n}" for n in missing) + " not found among the inputs")
        self.sources = {n: src for n, src in self.sources.items() if n in needed}
        self.order = tuple(self.sources.values())
        # The symbols whose values change per call (host scalars): an instance of the plan
        # evaluates its extern calls' other size arguments once ([Note: plan templates]).
        self.varying = [n for n, _, _ in self.values]
        # Symbols that Dynamo passes as int arguments (the usual case): the key is one C call.
        if self.order and all(kind == "int" for kind, _, _ in self.order):
            pick = operator.itemgetter(*[i for _, i, _ in self.order])
            self.key = (lambda args: (pick(args),)) if len(self.order) == 1 else pick

    def _add(self, expr, src):
        if expr.startswith("s") and expr[1:].isdigit():
            self.sources.setdefault(int(expr[1:]), src)

    def key(self, args):
        """The values of the needed symbols, in `sources` order (a plan cache key)."""
        return tuple([int(args[i]) if kind == "int" else (args[i].shape[d] if kind == "size" else args[i].stride(d))
                      for kind, i, d in self.order])

    def with_values(self, syms, args):
        """`syms` with this call's host scalars written in (a new list)."""
        out = list(syms)
        for n, i, is_float in self.values:
            out[n] = _f64_bits(args[i]) if is_float else int(args[i])
        return out

    def expand(self, key):
        """The full symbol list (`syms[n]` is `sN`) from `key`'s values."""
        out = [0] * self.num_syms
        for n, v in zip(self.sources, key):
            out[n] = v
        return out


class CompiledGraph:
    """A callable running one FX graph through braze's kernels (boxed calling convention)."""

    _boxed_call = True

    def __init__(self, compiled, lowered, name):
        # An instance attribute, so wrappers made with functools.wraps (torch._dynamo.disable
        # wraps backward graphs) keep the boxed calling convention.
        self._boxed_call = True
        self.c = compiled
        self.name = name
        self.externs = lowered.externs
        self.input_nodes = lowered.input_nodes
        self.out_spec = lowered.outputs
        needed = set(compiled.syms)
        for kind, v in self.out_spec:
            if kind == "sym":
                needed |= sym_names(v)
        for call in self.externs.values():
            torch.fx.node.map_aggregate((call.args, call.kwargs), lambda a: needed.update(sym_names(a.expr)) if isinstance(a, SymRef) else None)
        self.dynamic = bool(needed)
        self.syms = SymResolver(self.input_nodes, needed, lowered.host_syms)
        self.tensor_inputs = [i for i, (k, _) in enumerate(self.input_nodes) if k == "tensor"]
        # Tensor constants of the graph follow its tensor inputs.
        self.constants = list(lowered.constants)
        # Host values (CPU tensors of a CUDA graph): slots filled from inputs and extern results.
        self.n_host = lowered.n_host
        self.host_inputs = list(lowered.host_inputs)
        self.bufs = compiled.buffers
        self.steps = compiled.steps
        self.frees = compiled.frees
        self.reuse = compiled.reuse  # filtered below, once the extern calls are known
        self.allocs = compiled.allocs
        self.outputs = compiled.outputs
        # An output held in an input's buffer is copied unless the graph returns that input
        # itself (saved inputs of a forward graph, for one): clone(x) must not alias x.
        self.copy_out = [self.bufs[b][0] == "input" and not p for (b, _), p in zip(self.outputs, lowered.passthrough)]
        # Outputs that are views of inputs in the FX graph but copies here: AOTAutograd's
        # forward and inference wrappers rebuild them from the input, with the copy's strides
        # when the views had symbolic arguments (backend.py refuses such graphs; backward
        # graphs' outputs are not rebuilt).
        self.copied_aliases = [k for k, ((b, _), alias) in enumerate(zip(self.outputs, lowered.must_alias))
                               if alias and self.bufs[b][0] != "input"]
        self.mutations = list(lowered.mutations)
        self.mutated_args = sorted({arg for _, arg, _ in self.mutations})
        self.device = lowered.device
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.device_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            # PyTorch's current stream as a raw handle (what Inductor uses; cheaper than
            # building a Stream object per call).
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            self.raw_stream = raw if raw is not None else (lambda i: torch.cuda.current_stream(i).cuda_stream)
        self.empty = _allocator(self.device)
        self.ext_calls = {}
        for s in self.steps:
            if s[0] == "extern":
                self.ext_calls[s[3]] = self.externs[s[3]]
        # [Note: in-place kernels]: the plan's reuse pairs whose dying tensor is memory of
        # its own (a temp, or a fresh extern result) and of the same dtype.
        producer = {o: self.ext_calls[st[3]] for st in self.steps if st[0] == "extern" for o in st[5]}
        self.reuse = [(o, i) for o, i in self.reuse
                      if self.bufs[o][2] == self.bufs[i][2]
                      and (self.bufs[i][0] == "temp" or (self.bufs[i][0] == "extern" and producer[i].fresh))]
        self.n_bufs = len(self.bufs)
        self.arena_bytes = compiled.arena_bytes
        self.arena_windows = compiled.arena_windows
        self.arena_offsets = compiled.arena_offsets
        # [Note: CPU arenas] A CPU arena is kept between calls (by size; one per call running at
        # once) instead of allocated per call: an allocation of more than glibc's mmap
        # threshold is a fresh mapping whose pages fault in on first touch and are unmapped on
        # free, with every OpenMP thread's TLB flushed. ResNet-50's CPU training step (b2,
        # bf16, three arenas of 10.7 MiB in all), interleaved in one process: median 323 ms
        # with arenas made per call, 284 ms with them kept. No tensor view of arena memory escapes a call (kernels address it; an extern call reading an operand there returns fresh results, [Note: extern operands in arenas]),
        # so a closed window's arena is free for the next call. CUDA arenas come from
        # PyTorch's caching allocator, which already keeps its blocks.
        self.keeps_arenas = self.device.type == "cpu" and bool(self.arena_windows)
        self.plans = {}  # needed symbol values -> (syms, executor) of a dynamic graph
        if not self.dynamic:
            self.static = self._layouts(compiled.eval([]))
            self.static_plan = self._plan(*self.static)
            self.static_exec = self._executor(self.static_plan, [])
        else:
            # [Note: plan templates] (braze-py's exec.rs): a dynamic graph's plan is prepared
            # once with every size, stride and view offset an index into the values of its
            # size expressions; a call with new sizes evaluates those (`Compiled.eval`) and
            # instantiates the template in Rust. Building the plan in Python per new size set
            # cost 0.29 ms of a 2.7 ms GPT-2 call on the 2-core CPU.
            self.template_plan = self._plan(*self._layouts(list(range(compiled.num_exprs))), consts=compiled.const_exprs)
            self.template_exec = self._executor(self.template_plan, [], template=True)

    def kernel_only_args(self):
        """The argument indices of tensor inputs that only braze's kernels read ([Note:
        patched inputs] in braze-runtime): no extern call, matmul or convolution takes their
        buffer, the graph neither mutates them nor returns a copy of them."""
        if not self.cuda or self.dynamic:
            return set()
        taken = set(self.c.library_reads)
        taken.update(a[0] for s in self.steps if s[0] == "extern" for a in s[4])
        taken.update(b for (b, _), copy in zip(self.outputs, self.copy_out) if copy)
        ti = self.tensor_inputs
        ins = [(b, ti[row[1]]) for b, row in enumerate(self.bufs) if row[0] == "input" and 0 <= row[1] < len(ti)]
        return {i for _, i in ins} - {i for b, i in ins if b in taken} - set(self.mutated_args)

    def _in_layout(self, t, shape, stride, stream):
        """`t`, or a copy of it laid out with `stride` when its layout differs."""
        if t.stride() != stride and not _same_layout(t, shape, stride):
            return self._relayout(t, shape, stride, stream)
        return t

    def _relayout(self, t, shape, stride, stream):
        """A copy of input `t` laid out with `stride`: on the GPU one braze kernel launched
        from Rust (PyTorch's copy_ of an expanded or transposed view costs far more host
        time), elsewhere PyTorch's copy."""
        if self.cuda and t.get_device() == self.device_index and t.dim() <= 8:
            out = self.empty(shape, stride, t.dtype)
            _core.relayout(self.device_index, t.data_ptr(), t.stride(), out.data_ptr(), stride, shape, t.element_size(), stream)
            return out
        return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device).copy_(t)

    def _layouts(self, vals):
        shapes = [tuple(vals[i] for i in b[3]) for b in self.bufs]
        strides = [tuple(vals[i] for i in b[4]) for b in self.bufs]
        return vals, shapes, strides

    def _plan(self, vals, shapes, strides, consts=None):
        """Per-step work with every size resolved: built once for a static graph, a
        `Prepared` plan. A dynamic graph's template ([Note: plan templates]) is built from
        `vals` that are the expressions' indices, with `consts` (each expression's value where
        it is a constant) for the decisions that compare sizes."""
        concrete = list if consts is None else (lambda t: [consts[i] for i in t])
        dts = [_TORCH_DTYPES[b[2]] for b in self.bufs]
        ins = [b for b, b_ in enumerate(self.bufs) if b_[0] == "input"]
        inputs = PlanInputs([self.bufs[b][1] for b in ins], ins, [shapes[b] for b in ins], [strides[b] for b in ins])
        # [Note: input mutations] (lowering.py): a new input value whose buffer is a temp of
        # the input's layout is stored by its kernel straight into the input ("in place");
        # the others are copied into it after the call.
        in_place, copies = {}, []
        allocated = {b for a in self.allocs for b in a}
        out_bufs = [b for b, _ in self.outputs]
        for pos, arg, ok in self.mutations:
            b, view = self.outputs[pos]
            want_shape = [int(x) if x.isdigit() else None for x in self.input_nodes[arg][1][1]]
            want_strides = [int(x) if x.isdigit() else None for x in self.input_nodes[arg][1][2]]
            if (ok and view is None and b in allocated and out_bufs.count(b) == 1 and None not in want_shape + want_strides
                    and concrete(shapes[b]) == want_shape and concrete(strides[b]) == want_strides):
                in_place[b] = arg
            else:
                copies.append((pos, arg))
        self.in_place_mutations = len(in_place)
        # [Note: in-place kernels] (braze-sched): a temp outside the arenas takes the tensor of
        # a buffer that dies at the kernel writing it, when that tensor's memory is the
        # buffer's own: a temp, or a fresh result of an extern call (never an input's memory
        # or a view an op returned).
        reuse = {o: i for o, i in self.reuse if o not in in_place}
        self.reused = len(reuse)

        def alloc(b):
            if b in in_place:
                return InputBuf(b, in_place[b], shapes[b], strides[b], dts[b])
            if b in reuse:
                i = reuse[b]
                return ReuseBuf(b, i, shapes[b] != shapes[i] or strides[b] != strides[i], shapes[b], strides[b])
            return NewBuf(b, shapes[b], strides[b], dts[b])

        steps = []
        # Arena windows ([Note: arena windows] in braze-driver): bytes to allocate before a
        # step, and whether the window ends after it.
        opens = {lo: n for lo, _, n in self.arena_windows}
        closes = {hi for _, hi, _ in self.arena_windows}
        offs = self.arena_offsets
        for s, step in enumerate(self.steps):
            work = s
            if step[0] != "kernels":
                _, _, _, target, args, outs = step
                call = self.ext_calls[target]
                views = tuple((b, None if v is None else (tuple(vals[i] for i in v[0]), tuple(vals[i] for i in v[1]), vals[v[2]])) for b, v in args)
                results = tuple((o, path, shapes[o], strides[o]) for o, path in zip(outs, call.out_paths) if o != _UNUSED)
                # Operands in the window's arena ([Note: extern operands in arenas] in
                # braze-driver): views of it, as (buffer, dtype, shape, strides, element offset).
                in_arena = tuple((b, dts[b], shapes[b], strides[b], offs[b] // dts[b].itemsize)
                                 for b in dict.fromkeys(b for b, _ in args) if offs[b] >= 0)
                work = ExternWork(_callable(call.target), _template(call), views, results, in_arena, call.target, tuple(call.host_outs))
            steps.append(PlanStep(tuple(alloc(b) for b in self.allocs[s]), work, tuple(self.frees[s]), opens.get(s, 0), s in closes))
        outs = []
        for (b, view), copy in zip(self.outputs, self.copy_out):
            v = None
            if view is not None:
                sizes, st, off = view
                v = (tuple(vals[i] for i in sizes), tuple(vals[i] for i in st), vals[off])
            outs.append(PlanOutput(b, v, copy))
        simple = len(self.out_spec) == len(outs) and all(k == "t" for k, _ in self.out_spec)
        return Prepared(inputs, steps, outs, simple, tuple(copies))

    def _executor(self, prepared: Prepared, syms, template=False):
        """The Rust executor of a prepared plan ([Note: the call loop in Rust] in braze-py's
        exec.rs) for the symbol values `syms`: the steps as tagged rows, handed over once and
        kept there as typed steps."""
        ti, consts = self.tensor_inputs, self.constants
        pi = prepared.inputs
        inputs = [(ti[k], None, b, sh, st) if k < len(ti) else (-1, consts[k - len(ti)], b, sh, st)
                  for k, b, sh, st in zip(pi.args, pi.bufs, pi.shapes, pi.strides)]
        steps = []
        for st in prepared.steps:
            rows = []
            for a in st.allocs:
                if isinstance(a, ReuseBuf):
                    rows.append(("reuse", a.buf, a.dying, a.restride, a.shape, a.stride))
                elif isinstance(a, InputBuf):
                    rows.append(("input", a.buf, a.arg, a.shape, a.stride, a.dtype))
                else:
                    rows.append(("new", a.buf, a.shape, a.stride, a.dtype))
            w = st.work
            if not st.is_extern:
                steps.append((rows, w, list(st.frees), st.arena_opens, st.arena_closes, None))
            else:
                steps.append((rows, w.target, list(st.frees), st.arena_opens, st.arena_closes,
                              (w.fn, w.template, list(w.views), list(w.results), list(w.in_arena), list(w.host_outs))))
        outs = [tuple(o) for o in prepared.outputs]
        return self.c.executor(inputs, steps, outs, self.empty, self._in_layout, list(syms),
                               self.keeps_arenas, template)

    @property
    def arena_pool(self):
        """The arenas kept for the next calls, by bytes ([Note: CPU arenas]; each plan's
        executor keeps its own), or None where they are not kept."""
        if not self.keeps_arenas:
            return None
        pool = {}
        for ex in ([self.static_exec] if not self.dynamic else [hit[1] for hit in self.plans.values()]):
            for n, ts in ex.arena_pool().items():
                pool.setdefault(n, []).extend(ts)
        return pool

    def output_strides(self):
        """The strides of each tensor output (in the graph's output order) as returned, or
        None for a graph with symbolic sizes."""
        if self.dynamic:
            return None
        _, _, strides = self.static
        return [tuple(strides[o.buf]) if o.view is None else tuple(o.view[1]) for o in self.static_plan.outputs]

    def __call__(self, args, on_step=None):
        """Runs the graph on `args` (boxed: the list may be cleared by callers). `on_step`, for
        debugging tools (`benchmarks/step_probe.py`): called after each plan step, before
        its buffers are freed, as `on_step(kind, what, bufs)` with kind 0 (a run of kernels
        and matmuls; `what` its plan step) or 1 (an extern call; `what` its target), and
        `bufs` the live tensors by buffer id."""
        if self.dynamic:
            # Plans by symbol values: a loop calling with the sizes it called with before
            # reuses the plan (and the symbol values as the runs take them) instead of
            # evaluating and rebuilding it.
            key = self.syms.key(args)
            hit = self.plans.get(key)
            if hit is None:
                syms = self.syms.expand(key)
                hit = (syms, self.template_exec.instantiate(self.c.eval(syms), syms, self.syms.varying))
                if len(self.plans) >= _PLANS_KEPT:
                    del self.plans[next(iter(self.plans))]
                self.plans[key] = hit
            syms, ex = hit
            simple, copies = self.template_plan.simple, self.template_plan.copies
            run_syms = None
            if self.syms.values:
                syms = self.syms.with_values(syms, args)
                run_syms = self.c.sym_vals(syms)
        else:
            syms, ex, run_syms = _NO_SYMS, self.static_exec, None
            simple, copies = self.static_plan.simple, self.static_plan.copies
        hosts = None
        if self.n_host:
            hosts = [None] * self.n_host
            for slot, i in self.host_inputs:
                hosts[slot] = args[i]
        # Inputs the graph mutates are kept for the stores into them ([Note: inputs freed at
        # their last use]: the call clears `args`).
        margs = extra = None
        if self.mutated_args:
            margs, extra = {a: args[a] for a in self.mutated_args}, []
        stream = self.raw_stream(self.device_index) if self.cuda else 0
        outs = ex.call(args, stream, syms, run_syms, margs, hosts, extra, on_step)
        for pos, arg in copies:
            margs[arg].copy_(outs[pos])
        if extra:
            for _, arg, t in extra:
                margs[arg].copy_(t)
        if simple:
            return outs
        res = []
        for kind, v in self.out_spec:
            if kind == "t":
                res.append(outs[v])
            elif kind == "sym":
                res.append(_eval_sym(v, syms))
            elif kind == "host":
                res.append(hosts[v])
            else:
                res.append(v)
        return res


def _callable(target):
    """What the call loop calls for extern `target`: an ATen OpOverload's C++ operator itself
    (its Python `__call__` only forwards to it; one frame less per call, ~1 us of a cuDNN
    convolution's ~30 us of host time)."""
    op = getattr(target, "_op", None) if isinstance(target, torch._ops.OpOverload) else None
    return op if callable(op) else target


def _allocator(device):
    """(shape, stride, dtype) -> new tensor on `device`. PyTorch's own fast allocators (what
    Inductor's generated code calls: no argument parsing) where they exist and the device is
    unambiguous; torch.empty_strided otherwise."""
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    if device.type == "cpu" and hasattr(guards, "_empty_strided_cpu"):
        return guards._empty_strided_cpu
    # _empty_strided_cuda allocates on the current device: used only when there is one.
    if device.type == "cuda" and hasattr(guards, "_empty_strided_cuda") and torch.cuda.device_count() == 1:
        return guards._empty_strided_cuda
    return lambda shape, stride, dtype: torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _template(call):
    """An extern call's arguments as the executor fills them per call ([Note: the call loop in
    Rust]): (positional rows, keyword rows), each row tagged: ("c", value) used as it is, ("t",
    k) operand k, ("s", expr) a size expression, ("h", slot) a host value, ("l"/"u"/"d", rows) a
    list, tuple or dict holding any of those. A convolution's stride and padding lists stay one
    value, made once."""
    return [_arg_row(a) for a in call.args], [(k, _arg_row(v)) for k, v in call.kwargs.items()]


def _arg_row(a):
    if isinstance(a, Ref):
        return ("t", a.k)
    if isinstance(a, SymRef):
        return ("s", a.expr)
    if isinstance(a, Host):
        return ("h", a.slot)
    if isinstance(a, (list, tuple, dict)):
        items = list(a.items()) if isinstance(a, dict) else list(enumerate(a))
        rows = [(k, _arg_row(v)) for k, v in items]
        if all(r[0] == "c" for _, r in rows):
            return ("c", a)
        if isinstance(a, dict):
            return ("d", rows)
        return ("l" if isinstance(a, list) else "u", [r for _, r in rows])
    return ("c", a)


def _same_layout(t, shape, strides):
    """Strides only matter on dims of size > 1."""
    if tuple(t.shape) != tuple(shape):
        return False
    return all(a == b for a, b, n in zip(t.stride(), strides, shape) if n > 1)


_SCALAR_FNS: dict = {}


def _eval_sym(expr, syms):
    """The value of a SymInt/SymFloat/SymBool expression for this call's symbols (in Rust)."""
    fn = _SCALAR_FNS.get(expr)
    if fn is None:
        fn = _SCALAR_FNS[expr] = _core.ScalarFn(expr)
    return fn(syms)
