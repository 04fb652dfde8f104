"""From an ATen FX graph to a braze graph (``_core.GraphBuilder``).

Each FX node is lowered by the function registered for its ATen op in ``LOWERINGS``; the
function emits braze IR ops through :class:`Lowerer`. A node without a lowering, or whose
lowering raises :class:`Unsupported`, becomes an ``extern`` node: a call of its own ATen
kernel at run time (a fallback, counted and reported). After every lowering the IR type is
checked against the FX node's FakeTensor; a mismatch is a braze bug and the node falls back.
"""
from __future__ import annotations

import math
import operator
import traceback
from dataclasses import dataclass, field

import torch
import torch.fx

from . import _core
from .cpu_conv import CpuConv, strided_pointwise, strided_pointwise_backward
from .decomp import pool_pair

aten = torch.ops.aten

DTYPES = {
    torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool",
}


class Unsupported(Exception):
    """braze does not lower this (op, arguments, dtype, device); fall back."""


def dt(d: torch.dtype) -> str:
    try:
        return DTYPES[d]
    except KeyError:
        raise Unsupported(f"dtype {d}") from None


# [Note: equal sizes] Sizes PyTorch knows equal only through a guard on a product (a
# cross-entropy's flattened targets `s38*s97` against its logits' rows `s14*s94`; a sum of two
# tensors reshaped flat): the shape environment keeps no replacement for them, so braze's
# IR, which compares size expressions, saw two sizes that do not broadcast and left the op to
# ATen. The graph only runs where Dynamo's guards hold, so each such product is declared
# equal to one representative of its class (`GraphBuilder.assume_equal`), and typing
# compares sizes through those rules; expressions keep PyTorch's spelling.
def _size_classes(gm):
    """(product, representative) for the sizes equal by an `Eq` guard of the graph's shape
    environment ([Note: equal sizes])."""
    import sympy

    env = None
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and getattr(v, "fake_mode", None) is not None:
            env = v.fake_mode.shape_env
        elif isinstance(v, torch.SymInt):
            env = v.node.shape_env
        if env is not None:
            break
    if env is None:
        return []
    parent = {}

    def find(e):
        while e in parent:
            e = parent[e]
        return e
    for g in getattr(env, "guards", ()):
        e = g.expr
        if isinstance(e, sympy.Eq) and not e.lhs.is_number and not e.rhs.is_number:
            a, b = find(e.lhs), find(e.rhs)
            if a != b:
                a, b = sorted((a, b), key=lambda x: (len(str(x)), str(x)))
                parent[b] = a
    return [(str(e).replace(" ", ""), str(find(e)).replace(" ", "")) for e in parent if e.is_Mul and all(x.is_Symbol for x in e.args)]


def sym_str(v) -> str:
    """A size (int or SymInt) as a braze size expression."""
    if isinstance(v, bool):
        raise Unsupported("bool used as a size")
    if isinstance(v, int):
        return str(v)
    if isinstance(v, torch.SymInt):
        node = v.node
        if hasattr(node, "maybe_as_int") and node.maybe_as_int() is not None:
            return str(node.maybe_as_int())
        return str(node.expr).replace(" ", "")
    raise Unsupported(f"size {v!r}")


def sym_val(v):
    """A size (int or SymInt) as an op attribute: an int, or a braze size expression."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    t = sym_str(v)
    return int(t) if t.lstrip("-").isdigit() else t


def _int_of_float(v):
    """For a SymFloat `ToFloat(e)` of an integer size expression `e`: `e` as a braze size
    expression; else None."""
    if not isinstance(v, torch.SymFloat):
        return None
    expr = v.node.expr
    if type(expr).__name__ != "ToFloat" or len(expr.args) != 1 or not getattr(expr.args[0], "is_integer", False):
        return None
    return str(expr.args[0]).replace(" ", "")


def sym_value(v):
    """A SymInt/SymFloat/SymBool as a Num when its value is known, else a SymRef."""
    node = v.node
    if isinstance(v, torch.SymInt) and hasattr(node, "maybe_as_int") and node.maybe_as_int() is not None:
        return Num(node.maybe_as_int())
    expr = node.expr
    if getattr(expr, "is_number", False):
        return Num(bool(expr) if isinstance(v, torch.SymBool) else (int(expr) if isinstance(v, torch.SymInt) else float(expr)))
    return SymRef(str(expr).replace(" ", ""))


def is_tensor_meta(v) -> bool:
    return isinstance(v, torch.Tensor)


@dataclass
class ExternCall:
    """How to call a fallback op at run time: the ATen target, args/kwargs with tensor
    operands replaced by ``Ref(k)``, and where each tensor result goes."""
    target: object
    args: tuple
    kwargs: dict
    out_paths: list  # per extern output: index path into the result (() for a bare tensor)
    name: str = ""
    host_outs: list = field(default_factory=list)  # (index path, Host slot) of results on the host

    @property
    def fresh(self):
        """Whether every tensor result is memory of its own: an ATen op whose schema marks no
        result as an alias (what functionalization relies on). Only such results may be
        overwritten by a kernel storing in place ([Note: in-place kernels])."""
        schema = getattr(self.target, "_schema", None)
        return isinstance(self.target, torch._ops.OpOverload) and schema is not None and all(r.alias_info is None for r in schema.returns)

    @property
    def operands_in_arena(self):
        """Whether the call's tensor operands may be views of an arena ([Note: extern operands
        in arenas] in braze-driver): an ATen op (it reads its operands on the current stream
        before it returns its results; a collective may read them later, on its own stream,
        while later kernels reuse those arena bytes), whose results are fresh memory (no view
        of an operand outlives the call) and whose schema mutates nothing (random ops
        qualify: they only advance the generator)."""
        return self.fresh and self.target.namespace in ("aten", "prims") and not self.target._schema.is_mutable


@dataclass(frozen=True)
class Host:
    """A tensor on another device than the graph's: a CPU scalar or RNG state in a CUDA
    graph. At run time it is a slot the runtime fills (from the call's arguments or an earlier
    call's results) and hands to the PyTorch calls that take it, as eager does.

    [Note: host scalars] A 0-dim one enters braze's kernels as a scalar, as eager passes it
    to its kernels by value: a constant (`torch.tensor(-inf)` in model code, lifted) as a
    literal; a graph input (a Python float under dynamic=True: Dynamo passes RMSNorm's eps
    as a CPU float64 tensor) through the size-symbol array, a symbol `sym` whose value is
    the scalar's (a float's bits, read back by `f64_from_bits`), read from the argument at
    each call. `casts`: dtype conversions on the way (convert_element_type on the host).
    Such a value computed on the host is lowered without a slot (`slot` None, `node` its FX
    node): the host call that makes it runs only if a PyTorch call or the outputs take it."""
    slot: int | None
    value: object = None
    sym: int | None = None
    dtype: torch.dtype | None = None
    casts: tuple = ()
    node: object = None


@dataclass(frozen=True)
class Ref:
    k: int


@dataclass(frozen=True)
class Num:
    """A Python number computed by a node (a size known at compile time): kept apart from IR
    value ids, which are ints too."""
    value: object


@dataclass(frozen=True)
class SymRef:
    """A SymInt, SymFloat or SymBool value (an extern argument, a graph output), evaluated at
    run time from the call's size symbols by ``_core.ScalarFn`` (Rust; no Python ``eval``)."""
    expr: str


@dataclass
class Lowered:
    builder: object
    externs: dict  # extern node id -> ExternCall
    outputs: list  # ("t", ir output position) | ("sym", expr) | ("const", value)
    input_nodes: list  # placeholder index -> ("tensor", (dtype, shape, strides)) | ("sym", expr) | ("other", value)
    fallbacks: dict = field(default_factory=dict)  # op name -> count
    lowered_ops: dict = field(default_factory=dict)
    reasons: dict = field(default_factory=dict)  # op name -> why it was not lowered
    device: torch.device = torch.device("cpu")
    # Per IR output: the FX output is a graph input itself or a view of one through view ops
    # (returned aliasing the input, as eager returns it; an input reached through clone or
    # other ops is copied instead). `_view_of_input`.
    passthrough: list = field(default_factory=list)
    # Per IR output: AOTAutograd rebuilds it as an alias of an input from the strides braze
    # returns it with, so it must come back as a view of that input, never a copy (the
    # runtime refuses the graph otherwise). Free-layout saved outputs are not rebuilt.
    must_alias: list = field(default_factory=list)
    # Tensor constants (get_attr) braze passes as extra inputs after the graph's own, in order.
    constants: list = field(default_factory=list)
    # Host values ([Host]): how many slots, and (slot, placeholder index) of those that are inputs.
    n_host: int = 0
    host_inputs: list = field(default_factory=list)
    host_syms: list = field(default_factory=list)
    # op name -> traceback of a lowering that raised something other than Unsupported: a braze
    # bug. The node still runs (through ATen), but the bug is reported and fails the tests.
    bugs: dict = field(default_factory=dict)
    # The prepacked CPU linears (cpu_linear.CpuLinear) the graph calls.
    cpu_linears: list = field(default_factory=list)
    # Input mutations kept in the graph ([Note: input mutations]): (IR output position of the
    # new value, placeholder index of the input, whether the value may be stored in place).
    mutations: list = field(default_factory=list)
    # op name -> count of calls run through PyTorch as islands: higher-order operators and
    # calls that return no tensor (asserts, effects).
    islands: dict = field(default_factory=dict)
    # Whether the graph's convolutions run channels_last ([Note: convolution layout]).
    conv_channels_last: bool = False
    # How many convolutions are braze's `conv` op ([Note: library convolutions]).
    library_convs: int = 0


class Lowerer:
    """Walks one FX graph into a GraphBuilder."""

    def __init__(self, gm: torch.fx.GraphModule, name: str, subcompile=None, static_inputs=(), input_strides=None,
                 conv_layout="auto", saved_from=None, library_convs=True, eager_random=False):
        self.gm = gm
        # Option eager_random: random ops call PyTorch's kernels ([Note: random values]).
        self.eager_random = eager_random
        # Channels_last convolutions on the GPU as braze's `conv` op, run by cuDNN from braze's
        # runs (option cudnn_convs); else ATen calls.
        self.library_convs = library_convs
        self.n_library_convs = 0
        # The conv_layout option, or for a backward the forward's choice (True / False)
        # ([Note: convolution layout]).
        self.conv_layout = conv_layout
        self.conv_cl = False
        # A forward's first output position that is a tensor saved for the backward (AOTAutograd's
        # num_forward), or None.
        self.saved_from = saved_from
        # Placeholder name -> the strides to compile it for instead of its FX metadata's
        # ([Note: saved outputs in their returned layout] in backend.py).
        self.input_strides = input_strides or {}
        # Placeholder positions AOTAutograd marks static (parameters, buffers): the same tensor
        # every call, so a CPU linear may keep their weights prepacked ([Note: CPU linears]).
        self.static_inputs = frozenset(static_inputs or ())
        self.cpu_linears = {}  # FX node -> (CpuLinear, operand nodes): the node is that library call
        self.absorbed = set()  # FX nodes computed inside a CpuLinear call of a later node
        # (GraphModule, name) -> boxed callable: how the subgraphs of cond and while_loop are
        # compiled (by braze; raises Unsupported when it cannot).
        self.subcompile = subcompile
        self.name = name
        self.sub_cache = {}  # id(GraphModule) -> compiled subgraph call (invoke_subgraph)
        self.b = _core.GraphBuilder(name)
        for product, size in _size_classes(gm):
            try:
                self.b.assume_equal(product, size)
            except _core.Unsupported:
                pass  # a size braze's expressions cannot spell
        self.env = {}
        self.types = {}  # ir id -> (torch dtype, tuple of size strings)
        self.externs = {}
        self.fallbacks = {}
        self.lowered_ops = {}
        self.reasons = {}
        self.device = None
        self.matmuls = {}  # ir id of a plain library matmul -> (tf32, operand ids)
        self.n_in = 0  # IR inputs so far (graph tensor inputs, then constants)
        self.n_host = 0
        self.host_inputs = []
        self.host_syms = []  # (symbol, argument index, float?) of 0-dim host inputs
        self.known_syms = None  # size symbols the inputs carry, once the walk starts
        self.next_sym = 0  # the next symbol number free for a host scalar, once the walk starts
        self.constants = []
        self.bugs = {}
        self.islands = {}
        self.relaid = {}  # ir id -> eager strides, for values braze lays out otherwise (channels_last convolutions)
        self.cl_inputs = {}  # ir id -> its channels_last layout made for a convolution
        self.arg_index = {}  # placeholder node -> its position among the graph's arguments
        self.input_layouts = {}  # ir id of a tensor input -> its strides as compiled (text)
        self.mutations = []  # (placeholder node, FX node of the new value): aten.copy_ into an input
        self.seed = None  # ir id of the call's random seed, drawn once the first random op needs it
        self.n_random = 0  # random ops so far: each draws from its own stream of the seed

    # ---- emitting IR -------------------------------------------------------------------
    def op(self, name: str, *ins: int, **attrs) -> int:
        """Adds op `name` of IR values `ins` with typed attributes (ints, floats, bools, names,
        sizes as ints or symbolic str, lists of those)."""
        try:
            return self.b.op(name, list(ins), attrs or None)
        except _core.Unsupported as e:
            raise Unsupported(str(e)) from None

    def dtype_of(self, i: int) -> torch.dtype:
        d, _ = self.b.node_type(i)
        return {v: k for k, v in DTYPES.items()}[d]

    def shape_of(self, i: int) -> list:
        return self.b.node_type(i)[1]

    def rank(self, i: int) -> int:
        return len(self.shape_of(i))

    def scalar(self, value, dtype: torch.dtype) -> int:
        if not dtype.is_floating_point and dtype != torch.bool and isinstance(value, float) and not value.is_integer():
            raise Unsupported("fractional scalar for an integer op")
        return self.op("scalar", value=_lit(value, dtype), dtype=dt(dtype))

    def cast(self, i: int, dtype: torch.dtype) -> int:
        if self.dtype_of(i) == dtype:
            return i
        return self.op("cast", i, dtype=dt(dtype))

    def tensor(self, x, dtype: torch.dtype | None = None) -> int:
        """An FX argument (node or Python number) as an IR value, cast to ``dtype``."""
        if isinstance(x, torch.fx.Node):
            v = self.env[x]
            if isinstance(v, Num):
                return self.tensor(v.value, dtype)
            if isinstance(v, Host):
                return self.host_scalar(v, dtype)
            if not isinstance(v, int):
                if isinstance(v, SymRef):
                    # A size used as a number (the mean's backward divides by the element
                    # count): a scalar of the size's value, read from the call's symbols.
                    val = x.meta.get("val")
                    if isinstance(val, torch.SymInt):
                        return _size_scalar(self, val, dtype or torch.int64)
                    inner = _int_of_float(val)
                    if inner is not None:
                        # `sym_float` of a size (std's decomposition passes its correction so)
                        return self.op("size", value=inner, dtype=dt(dtype or torch.float32))
                    raise Unsupported("symbolic number used as a tensor")
                raise Unsupported(f"{x} is not a tensor")
            return self.cast(v, dtype) if dtype is not None else v
        if isinstance(x, (bool, int, float)):
            if dtype is None:
                dtype = torch.bool if isinstance(x, bool) else (torch.int64 if isinstance(x, int) else torch.float32)
            return self.scalar(x, dtype)
        raise Unsupported(f"argument {type(x).__name__}")

    def size(self, v):
        """A size (int, SymInt or an FX node of one) as an op attribute: an int, or a symbolic
        size expression."""
        if isinstance(v, torch.fx.Node):
            r = self.env.get(v)
            if isinstance(r, SymRef):
                return r.expr
            if isinstance(r, Num) and isinstance(r.value, int):
                return r.value
            raise Unsupported("size from a tensor")
        return sym_val(v)

    def sizes(self, vs) -> list:
        return [self.size(v) for v in vs]

    # ---- the walk ------------------------------------------------------------------------
    def constant(self, val: torch.Tensor) -> int:
        """A tensor constant of the graph (get_attr): one element folds into the code as a
        scalar; anything larger becomes an extra input, passed by the runtime every call."""
        if isinstance(val, torch._subclasses.FakeTensor) or type(val) not in (torch.Tensor, torch.nn.Parameter):
            raise Unsupported(f"constant of type {type(val).__name__}")
        if val.layout != torch.strided:
            raise Unsupported(f"constant with layout {val.layout}")
        dt(val.dtype)
        if not check_tensor(val, self):
            return val.detach()  # on the host: passed as it is to the calls that take it
        if val.numel() <= 1:
            s = self.scalar(val.item() if val.numel() else 0, val.dtype)
            return s if val.dim() == 0 else self.op("expand", s, shape=self.sizes(val.shape))
        val = val.detach()
        shape = [str(s) for s in val.shape]
        strides = [str(s) for s in val.stride()]
        i = self.b.input(self.n_in, dt(val.dtype), shape, strides)
        self.n_in += 1
        self.constants.append(val)
        return i

    def host(self) -> Host:
        self.n_host += 1
        return Host(self.n_host - 1)

    def host_value(self, node, val) -> Host | None:
        """A 0-dim host result known to braze's kernels without its host call: a lifted
        constant, or a dtype conversion of a host scalar ([Note: host scalars])."""
        if not (is_tensor_meta(val) and val.dim() == 0 and val.device.type == "cpu"):
            return None
        t = node.target
        if t in (aten.lift_fresh_copy.default, aten.clone.default, aten.alias.default) or (
                t is aten._to_copy.default and node.kwargs.get("device") in (None, torch.device("cpu"))) or t is torch.ops.prims.convert_element_type.default:
            src = node.args[0]
            v = self.env.get(src) if isinstance(src, torch.fx.Node) else None
            if isinstance(v, torch.Tensor) and v.dim() == 0 and src.op == "get_attr":
                return Host(None, v.item(), None, v.dtype, (), node) if val.dtype == v.dtype else None
            if not isinstance(v, Host) or (v.value is None and v.sym is None):
                return None
            if v.value is not None:
                value = torch.tensor(v.value, dtype=v.dtype).to(val.dtype).item()
                return Host(None, value, None, val.dtype, (), node)
            casts = v.casts + ((val.dtype,) if val.dtype != (v.casts[-1] if v.casts else v.dtype) else ())
            return Host(None, None, v.sym, v.dtype, casts, node)
        return None

    def host_scalar(self, v: Host, dtype) -> int:
        """A 0-dim host value as a scalar of braze's kernels ([Note: host scalars])."""
        if v.value is not None:
            i = self.scalar(v.value, v.dtype)
        elif v.sym is not None:
            i = self.op("size", value=f"s{v.sym}", dtype="i64")
            if v.dtype.is_floating_point:
                i = self.op("f64_from_bits", i)
            i = self.cast(i, v.dtype)
            for d in v.casts:
                i = self.cast(i, d)
        else:
            raise Unsupported("a tensor on another device than the graph's")
        return self.cast(i, dtype) if dtype is not None else i

    def host_sym(self, node) -> int | None:
        """A size symbol carrying the 0-dim host input `node` into kernels, or None for a dtype
        that cannot travel as one ([Note: host scalars]). Numbered past every symbol of the
        graph's inputs."""
        val = node.meta["val"]
        if val.dim() != 0 or val.dtype not in (torch.float64, torch.float32, torch.int64, torch.int32, torch.bool):
            return None
        self.next_sym += 1
        return self.next_sym - 1

    def materialize(self, node, v: Host) -> Host:
        """The slot of a host value lowered without one: its host call, made now."""
        if v.slot is not None:
            return v
        for a in node.all_input_nodes:
            w = self.env.get(a)
            if isinstance(w, Host) and w.slot is None:
                self.env[a] = self.materialize(a, w)
        real = self.extern(node)
        real = Host(real.slot, v.value, v.sym, v.dtype, v.casts) if isinstance(real, Host) else real
        self.env[node] = real
        return real

    def run(self) -> Lowered:
        inputs = []
        outputs = []
        passthrough = []
        must_alias = []
        mutations = []
        self.device = _graph_device(self.gm)
        self.known_syms, self.next_sym = _input_syms(self.gm)
        if self.device.type == "cpu":
            from .cpu_linear import plan
            self.cpu_linears, self.absorbed = plan(self.gm, self.static_inputs)
        out_node = next((n for n in reversed(self.gm.graph.nodes) if n.op == "output"), None)
        graph_outs = set(out_node.all_input_nodes) if out_node is not None else set()
        self.conv_cl = conv_channels_last(self.gm, self.name.split("_")[0], self.device, self.conv_layout)
        # Saved tensors of a forward with channels_last convolutions come back in the strides
        # braze stores them with (the backward is compiled for those): a ReLU's output that the
        # next convolution reads channels_last is stored once, channels_last, not also in
        # eager's layout. (Elsewhere they keep eager's strides.)
        self.free_saved = set()
        out_args = []
        if out_node is not None:
            out_args = list(out_node.args[0]) if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
        if self.conv_cl and self.saved_from is not None:
            fixed = {a for a in out_args[:self.saved_from] if isinstance(a, torch.fx.Node)}
            self.free_saved = {a for a in out_args[self.saved_from:] if isinstance(a, torch.fx.Node) and a not in fixed}
        # Outputs in eager's layout, each made right after its value: a copy that runs at
        # the end instead would hold what it reads (GPT-2's qkv projections, for its key and
        # value cache) for the whole graph.
        laid_out = {}
        for node in self.gm.graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder":
                self.arg_index[node] = len(inputs)
                if is_tensor_meta(val) and (_is_effect_token(node) or not check_tensor(val, self)):
                    h = self.host()
                    n = None if _is_effect_token(node) else self.host_sym(node)
                    if n is not None:
                        h = Host(h.slot, sym=n, dtype=val.dtype)
                        self.host_syms.append((n, len(inputs), val.dtype.is_floating_point))
                    self.env[node] = h
                    self.host_inputs.append((h.slot, len(inputs)))
                    inputs.append(("host", h.slot))
                elif is_tensor_meta(val):
                    shape = [sym_str(s) for s in val.shape]
                    strides = [str(s) for s in self.input_strides[node.name]] if node.name in self.input_strides else [sym_str(s) for s in val.stride()]
                    self.env[node] = self.b.input(self.n_in, dt(val.dtype), shape, strides)
                    self.input_layouts[self.env[node]] = strides
                    inputs.append(("tensor", (val.dtype, shape, strides)))
                    self.n_in += 1
                elif isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                    self.env[node] = sym_value(val)
                    inputs.append(("sym", str(val.node.expr).replace(" ", "")))
                else:
                    self.env[node] = Num(val) if isinstance(val, (int, float)) else val
                    inputs.append(("other", val))
            elif node.op == "call_function":
                v = self.env[node] = self.lower_node(node)
                if node in graph_outs and isinstance(v, int) and node not in self.free_saved:
                    laid_out[node] = self.output_layout(node, v)
            elif node.op == "output":
                outs = []
                free = []  # (outputs position, IR value, passthrough) of saved tensors of free layout
                for a in out_args:
                    v = self.env.get(a) if isinstance(a, torch.fx.Node) else a
                    if isinstance(v, int) and isinstance(a, torch.fx.Node) and a in self.free_saved:
                        outputs.append(("t", None))
                        # (An input returned through its channels_last layout is that copy, unless
                        # the layout is elided: then it is the input itself, returned as it is.)
                        free.append((len(outputs) - 1, self.free_layout(a, v), a.op == "placeholder"))
                    elif isinstance(v, int) and isinstance(a, torch.fx.Node):
                        v = laid_out[a] if a in laid_out else self.output_layout(a, v)
                        outputs.append(("t", len(outs)))
                        outs.append(v)
                        passthrough.append(_view_of_input(a))
                        must_alias.append(passthrough[-1] and a.op != "placeholder")
                    elif isinstance(v, SymRef):
                        outputs.append(("sym", v.expr))
                    elif isinstance(v, Num):
                        outputs.append(("const", v.value))
                    elif isinstance(v, Host):
                        outputs.append(("host", self.materialize(a, v).slot))
                    elif isinstance(a, torch.fx.Node) and isinstance(v, (tuple, list)):
                        raise Unsupported("tuple output")
                    else:
                        outputs.append(("const", v))
                for dst, src in self.mutations:
                    mutations.append((len(outs), self.arg_index[dst], _in_place_ok(dst, src)))
                    outs.append(self.tensor(src, dst.meta["val"].dtype))
                    passthrough.append(False)
                    must_alias.append(False)
                # Free-layout outputs last: IR outputs from that position on come back in the
                # strides braze stores them with.
                free_from = len(outs) if free else None
                for pos, v, through in free:
                    outputs[pos] = ("t", len(outs))
                    outs.append(v)
                    passthrough.append(through)
                    must_alias.append(False)
                self.b.set_outputs(outs, free_from)
            elif node.op == "get_attr":
                val = _attr(self.gm, node.target)
                # Tensors are constants; subgraphs of higher-order operators (GraphModules)
                # and anything else are passed as they are to the calls that take them.
                self.env[node] = self.constant(val) if isinstance(val, torch.Tensor) else val
        for node in self.gm.graph.nodes:
            v = node.meta.get("val")
            if node.op == "call_function" and is_tensor_meta(v):
                check_tensor(v, self)
        return Lowered(self.b, self.externs, outputs, inputs, self.fallbacks, self.lowered_ops, self.reasons,
                       self.device or torch.device("cpu"), passthrough, must_alias=must_alias, constants=self.constants, bugs=self.bugs,
                       islands=self.islands, n_host=self.n_host, host_inputs=self.host_inputs, host_syms=self.host_syms,
                       cpu_linears=[spec for spec, _ in self.cpu_linears.values()], mutations=mutations,
                       conv_channels_last=self.conv_cl, library_convs=self.n_library_convs)

    def lower_node(self, node: torch.fx.Node):
        target = node.target
        val = node.meta.get("val")
        if target is operator.getitem:
            src, k = node.args
            return self.env[src][k]
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            unknown = val.node.expr.free_symbols - self.known_syms if self.known_syms is not None else ()
            if unknown:
                # A size only a tensor's data knows (nonzero's count): braze's runtime
                # evaluates sizes from the call's inputs alone.
                raise Unsupported("a size known only at run time: " + ", ".join(sorted(map(str, unknown))))
            return sym_value(val)
        if isinstance(val, (int, float)) and not isinstance(val, bool) or isinstance(val, bool) and _is_sym_op(target):
            return Num(val)
        if any(not check_tensor(t, self) for t in _tensors_in(val)):
            deferred = self.host_value(node, val)
            if deferred is not None:
                return deferred
            # A result on the host (a CPU scalar computed in a CUDA graph), or sized by a symbol
            # the inputs do not carry, comes from PyTorch.
            on_device = all(t.device == self.device for t in _tensors_in(val))
            self.reasons.setdefault(op_name(target), "result sized by a symbol no input carries" if on_device else "result on another device than the graph's")
            return self.extern(node)
        if node in self.absorbed:
            return None  # computed inside the library call of its only (transitive) user
        if node in self.cpu_linears:
            spec, operands = self.cpu_linears[node]
            self.reasons[spec.__name__] = ("oneDNN linear, this CPU's faster f32 GEMM library" if spec.kind == "onednn"
                                           else "library linear, weight prepacked once")
            return self.extern(node, target=spec, call_args=operands, name=spec.__name__, island=False)
        if target in _BRANCHING and self.subcompile is not None:
            try:
                return _BRANCHING[target](self, node)
            except Unsupported as e:  # a branch braze cannot compile: the operator as an island
                self.reasons[op_name(target)] = f"branch not compiled: {e}"
        fn = LOWERINGS.get(target) or LOWERINGS.get(getattr(target, "overloadpacket", None))
        if fn is not None:
            try:
                out = fn(self, node, *node.args, **node.kwargs)
                self.check(node, out)
                if isinstance(out, int) and is_tensor_meta(val):
                    out = self.eager_layout(out, val)
                name = op_name(target)
                self.lowered_ops[name] = self.lowered_ops.get(name, 0) + 1
                return out
            except Unsupported as e:
                self.reasons[op_name(target)] = f"{type(e).__name__}: {e}"
            except Exception as e:  # a braze bug: reported, and the node runs through ATen
                self.reasons[op_name(target)] = f"lowering error {type(e).__name__}: {e}"
                self.bugs[op_name(target)] = traceback.format_exc()
        else:
            self.reasons.setdefault(op_name(target), "no lowering")
        return self.extern(node)

    def check(self, node, out):
        vals = node.meta.get("val")
        if isinstance(out, tuple):
            for o, v in zip(out, vals):
                self.check_one(o, v)
        else:
            self.check_one(out, vals)

    def check_one(self, i, v):
        if v is None or i is None:
            return
        d, shape = self.b.node_type(i)
        want = [sym_str(s) for s in v.shape]
        # Symbolic sizes are compared as expressions: PyTorch may write `s1*(s0+s2)` where
        # braze's canonical form prints `s0*s1 + s1*s2`.
        if d != dt(v.dtype) or ([s.replace(" ", "") for s in shape] != want and not self.b.shape_is(i, want)):
            raise Unsupported(f"lowering produced {d}{shape}, expected {dt(v.dtype)}{want}")

    # Values whose memory is someone else's (or that are views of it): their strides are
    # already eager's, and storing them again would be a copy.
    _NO_LAYOUT = {"input", "extern_out", "permute", "expand", "reshape", "slice", "select", "scalar", "layout", "size", "iota"}

    def eager_layout(self, i: int, val) -> int:
        """A computed value whose eager strides are a dense permutation other than row-major
        (channels_last activations): wrapped in `layout`, so that if it is stored its buffer
        has eager's strides (what the convolution or the caller gets in eager) and its kernel
        iterates in that order."""
        order = _dense_order(val)
        if order is None or val.dim() < 2 or order == [d for d in range(val.dim()) if val.shape[d] != 1] or self.b.node_op(i) in self._NO_LAYOUT:
            return i
        return self.layout(i, val.stride())

    def free_layout(self, a: torch.fx.Node, i: int) -> int:
        """Saved output `a` lowered to `i`, returned in whatever strides braze stores it with: a
        convolution's input laid out channels_last (`self.cl_inputs`) is returned as that
        layout, so the value is stored once, channels_last (the layout is elided where `i` is
        stored in that order anyway)."""
        return self.cl_inputs.get(i, i)

    def layout(self, i: int, strides) -> int:
        """`i` stored with `strides` (a `layout` node)."""
        return self.op("layout", i, strides=[sym_val(x) for x in strides])

    _VIEW_OPS = ("permute", "expand", "reshape", "slice", "select")
    # ATen ops not tagged as views that return a view when they can (eager's strides are then
    # the view's, as braze's are).
    _MAYBE_VIEWS = ("_unsafe_view", "reshape", "_reshape_alias", "flatten", "unflatten", "view_as", "reshape_as")

    def output_layout(self, a: torch.fx.Node, i: int) -> int:
        """Output `a` lowered to `i`. When eager computes `a` as a fresh tensor (no view op:
        a clone, a cat with an empty tensor, `zeros_like`) but braze lowered it to a view of
        another value, the view's strides are not eager's (a clone of a sliced view is
        row-major in eager; the key/value cache's `cat` of GPT-2 is contiguous where the view
        strides through the qkv projection). Then `i` is wrapped in a `layout` with eager's
        strides, a copy as in eager: the caller, and the next graph compiled for eager's
        strides (the backward reading saved tensors, which copied 24 of them per GPT-2 step),
        get what eager gives."""
        if i in self.relaid:
            return self.layout(i, self.relaid[i])
        target = a.target if a.op == "call_function" else None
        if (not isinstance(target, torch._ops.OpOverload) or target.is_view
                or target._schema.name.split("::")[-1] in self._MAYBE_VIEWS):
            return i
        # A fresh tensor in eager: laid out in eager's strides where braze lowered it to a
        # view, or to a graph input in other strides (a clone or a copy in another memory
        # format, `x.contiguous(memory_format=torch.channels_last)`: the runtime would return a
        # copy in the input's strides).
        is_input = i in self.input_layouts
        va = a.meta.get("val")
        if not is_input and self.b.node_op(i) not in self._VIEW_OPS:
            # A clone (`.contiguous()`) of a fresh value braze computes in other strides
            # (`x.permute(0, 2, 1, 3).sin().contiguous()`: the sine follows its permuted
            # input in eager): the clone is the same IR value, so it gets eager's strides here.
            src = a.args[0] if target in (aten.clone.default, aten.lift_fresh_copy.default) and a.args else None
            vs = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
            if (is_tensor_meta(vs) and is_tensor_meta(va) and _dense_order(va) is not None
                    and _dense_order(vs) != _dense_order(va)):
                return self.layout(i, va.stride())
            return i
        if not is_tensor_meta(va) or _dense_order(va) is None:
            return i
        if is_input and [sym_str(s) for s in va.stride()] == self.input_layouts[i]:
            return i
        return self.layout(i, va.stride())

    def extern(self, node: torch.fx.Node, target=None, call_args=None, name=None, island=None, out_strides=None):
        """The node as a call of its own ATen kernel (or of `target` with `call_args`, FX
        arguments like the node's own). `island` overrides whether it counts as a PyTorch
        island (a callable that is no ATen op) or a library call. `out_strides`: the strides
        the call returns its first tensor in, or a dict of them by result path ((1,) for the
        second of a tuple), where they differ from the node's metadata."""
        val = node.meta.get("val")
        target = node.target if target is None else target
        name = name or op_name(target)
        if not callable(target):
            raise Unsupported(f"cannot call {target}")
        operands = []

        def ref(v):
            # An IR value (int id) becomes a tensor operand; tuples (the results of another
            # multi-output call) are walked; everything else is passed as it is.
            if isinstance(v, bool) or v is None:
                return v
            if isinstance(v, Num):
                return v.value
            if isinstance(v, int):
                operands.append(v)
                return Ref(len(operands) - 1)
            if isinstance(v, (list, tuple)):
                return type(v)(ref(x) for x in v)
            return v

        def sub(a):
            if isinstance(a, torch.fx.Node):
                v = self.env[a]
                if isinstance(v, Host) and v.slot is None:
                    v = self.materialize(a, v)
                if a.op == "get_attr" and not isinstance(v, int):
                    return v
                return ref(v)
            return a

        args = torch.fx.node.map_aggregate(node.args if call_args is None else call_args, sub)
        kwargs = torch.fx.node.map_aggregate(node.kwargs if call_args is None else {}, sub)
        outs, paths, host_outs = [], [], []
        if val is None and node.users and all(u.target is operator.getitem for u in node.users):
            # A multi-result call whose own metadata is missing (some higher-order operators):
            # its structure is what its getitem users read.
            n = max(u.args[1] for u in node.users) + 1
            val = [None] * n
            for u in node.users:
                val[u.args[1]] = u.meta.get("val")

        def walk(v, path):
            if is_tensor_meta(v) and not check_tensor(v, self):
                host_outs.append((path, self.host().slot))
            elif is_tensor_meta(v):
                if isinstance(out_strides, dict):  # result path -> strides
                    st = out_strides.get(path, v.stride())
                else:  # the first result's strides
                    st = out_strides if out_strides is not None and not outs else v.stride()
                outs.append((dt(v.dtype), [sym_str(s) for s in v.shape], [sym_str(s) for s in st]))
                paths.append(path)
            elif isinstance(v, (list, tuple)):
                for k, x in enumerate(v):
                    walk(x, path + (k,))

        walk(val, ())
        if island is None:
            island = not isinstance(target, torch._ops.OpOverload) or not outs
            effect = not outs or bool(host_outs) or _has_effect(target)
        else:
            effect = not outs or bool(host_outs)
        # The key travels through the Rust passes as the extern's target name.
        key = f"{name}#{len(self.externs)}"
        ids = self.b.extern_call(key, operands, outs, effect)
        self.externs[key] = ExternCall(target, args, kwargs, paths, name, host_outs)
        if island:
            self.islands[name] = self.islands.get(name, 0) + 1
        else:
            self.fallbacks[name] = self.fallbacks.get(name, 0) + 1
        hosts = dict(host_outs)
        if is_tensor_meta(val):
            return Host(hosts[()]) if () in hosts else ids[0]

        def rebuild(v, path):
            if is_tensor_meta(v):
                return Host(hosts[path]) if path in hosts else ids[paths.index(path)]
            if isinstance(v, (list, tuple)):
                return tuple(rebuild(x, path + (k,)) for k, x in enumerate(v))
            if isinstance(v, torch.SymInt):
                return SymRef(sym_str(v))
            return v

        return rebuild(val, ())


def _view_of_input(a: torch.fx.Node) -> bool:
    """Whether FX output `a` is a graph input or, through view ops alone, a view of one: eager
    returns it aliasing the input, so the runtime must not copy it (AOTAutograd rebuilds such
    an output from the input with the returned tensor's strides; a copy's are not the
    view's: an input expanded under dynamic shapes came back with contiguous strides, which
    it then applied to the input's storage)."""
    while a.op == "call_function" and isinstance(a.target, torch._ops.OpOverload) and a.target.is_view:
        src = a.args[0] if a.args else None
        if not isinstance(src, torch.fx.Node):
            return False
        a = src
    return a.op == "placeholder"


def _is_effect_token(node) -> bool:
    """Whether placeholder `node` is an effect token (AOTAutograd's [Side-Effectful Tokens]:
    read only as the token of `with_effects` calls). Its runtime wrapper passes None for it,
    so it is a host value handed to those calls as it comes."""
    with_effects = getattr(torch.ops.higher_order, "with_effects", None)
    return bool(node.users) and all(u.target is with_effects and u.args[0] is node and node not in u.args[1:] for u in node.users)


def check_tensor(v, lowerer=None) -> bool:
    """Checks a tensor braze may handle; False when it is a CPU tensor in a CUDA graph (a
    [Host] value: it stays with PyTorch)."""
    if v.layout != torch.strided:
        raise Unsupported(f"layout {v.layout}")
    if v.device.type not in ("cpu", "cuda"):
        raise Unsupported(f"device {v.device}")
    if lowerer is not None:
        if lowerer.device is None:
            lowerer.device = v.device
        elif v.device != lowerer.device:
            if v.device.type == "cpu" and lowerer.device.type == "cuda":
                return False
            raise Unsupported(f"mixed devices in one graph: {lowerer.device} and {v.device}")
        if lowerer.known_syms is not None and not _sizes_known(v, lowerer.known_syms):
            return False
    dt(v.dtype)
    return True


def _input_syms(gm):
    """(the size symbols a call's inputs carry: bare in an input's sizes or strides, or a
    SymInt input, what the runtime can find each call; the first symbol number past every
    symbol the inputs mention, free for host scalars)."""
    from .runtime import sym_names

    known, top = set(), -1
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta.get("val")
        parts = list(v.shape) + list(v.stride()) if is_tensor_meta(v) else [v]
        for s in parts:
            if isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                top = max([top, *sym_names(str(s.node.expr))])
                if isinstance(s, torch.SymInt) and s.node.expr.is_Symbol:
                    known.add(s.node.expr)
    return known, top + 1


def _sizes_known(v, known) -> bool:
    """Whether every symbol of a tensor's sizes and strides is one the inputs carry. A result
    sized by a symbol of its own (torch 2.11 sizes the RNG state that activation
    checkpointing saves by a fresh symbol) is an opaque value like a host one: PyTorch makes
    and takes it; braze's buffers, sized from the call's symbols, cannot hold it."""
    for s in (*v.shape, *v.stride()):
        if isinstance(s, torch.SymInt) and not s.node.expr.free_symbols <= known:
            return False
    return True


def _tensors_in(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors_in(x)]
    return []


def _dense_order(val):
    """The non-1 dims of tensor metadata `val`, outermost in memory first, when its strides
    are dense (a permutation of row-major, no gaps); `None` otherwise. Symbolic strides are
    ordered by their traced values and checked as expressions (a channels_last activation
    under dynamic shapes: strides `[C*H*W, 1, W*C, C]`)."""
    shape, strides = list(val.shape), list(val.stride())
    if any(not isinstance(x, int) for x in shape + strides):
        hints = [_hint(x) for x in strides]
        if None in hints or any(_hint(x) is None for x in shape):
            return None
        order = sorted((d for d in range(len(shape)) if _hint(shape[d]) != 1), key=lambda d: -hints[d])
    else:
        order = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -strides[d])
    expect = 1
    for d in reversed(order):
        if not _known_equal(strides[d], expect):
            return None
        expect = expect * shape[d]
    return order


def _hint(n):
    """A size's value (an int), or for a SymInt the value it had when traced (None if none
    is known): for layout choices, which need no exact size."""
    return n if isinstance(n, int) else getattr(n.node, "hint", None)


def _graph_device(gm):
    """The device a graph's kernels run on: its first CUDA tensor's, else the CPU (CPU
    tensors in a CUDA graph are host values; a graph of scalars alone runs on the CPU)."""
    first = None
    for node in gm.graph.nodes:
        for t in _tensors_in(node.meta.get("val")):
            if t.device.type == "cuda":
                return t.device
            first = first or t.device
    return first or torch.device("cpu")


def op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns = getattr(target, "namespace", "aten")
        return f"{ns}.{target.overloadpacket.__name__}.{target._overloadname}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    return getattr(target, "__name__", str(target))


def _attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


_SYM_OPS = {"sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "sym_max", "sym_min", "sym_not",
            "sym_float", "sym_int", "sym_ite", "sym_sum"}


def _is_sym_op(target) -> bool:
    """Python-level size arithmetic (operator.mul of SymInts, torch.sym_max, aten.sym_size):
    the value is already known when it is a plain number."""
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__ in _SYM_OPS
    mod = getattr(target, "__module__", "") or ""
    return mod in ("_operator", "operator", "math", "builtins") or getattr(target, "__name__", "") in _SYM_OPS


def _has_effect(target) -> bool:
    """A call eager runs even when its results are unused: random ops (they advance the
    generator), side-effecting ops and higher-order operators that carry effects or RNG state."""
    if isinstance(target, torch._ops.OpOverload):
        tags = getattr(target, "tags", ())
        return torch.Tag.nondeterministic_seeded in tags or target._schema.is_mutable
    if isinstance(target, torch._ops.HigherOrderOperator):
        n = target.name()
        return "rng" in n or "effects" in n or "auto_functionalized" in n or "print" in n
    return True


# ---- the lowering table -----------------------------------------------------------------

LOWERINGS = {}


def register(*ops):
    def deco(fn):
        for o in ops:
            if o is not None:
                LOWERINGS[o] = fn
        return fn
    return deco


def A(name):
    return getattr(aten, name, None)


def out_dtype(node):
    return node.meta["val"].dtype


UNARY = {
    "neg": "neg", "abs": "abs", "exp": "exp", "exp2": "exp2", "expm1": "expm1", "log": "log",
    "log2": "log2", "log10": "log10", "log1p": "log1p", "sqrt": "sqrt", "rsqrt": "rsqrt",
    "sin": "sin", "cos": "cos", "tan": "tan", "asin": "asin", "acos": "acos", "atan": "atan",
    "sinh": "sinh", "cosh": "cosh", "tanh": "tanh", "asinh": "asinh", "acosh": "acosh",
    "atanh": "atanh", "sigmoid": "sigmoid", "relu": "relu", "erf": "erf", "erfc": "erfc",
    "reciprocal": "reciprocal", "floor": "floor", "ceil": "ceil", "trunc": "trunc",
    "sign": "sign", "lgamma": "lgamma", "logical_not": "not", "bitwise_not": "bitwise_not",
    "isnan": "isnan", "isinf": "isinf",
}


def _unary(ir):
    def f(L, node, x, *rest, **kw):
        if rest or kw:
            raise Unsupported("extra arguments")
        od = out_dtype(node)
        if ir in ("not", "isnan", "isinf"):
            return L.op(ir, L.tensor(x))
        if ir in ("floor", "ceil", "trunc", "sign", "abs", "neg", "relu") and not od.is_floating_point:
            return L.op(ir, L.tensor(x, od)) if ir not in ("floor", "ceil", "trunc") else L.tensor(x, od)
        return L.op(ir, L.tensor(x, od))
    return f


for _n, _ir in UNARY.items():
    register(A(_n))(_unary(_ir))


@register(A("isposinf"), A("isneginf"))
def _isposinf(L, node, x):
    t = L.tensor(x)
    d = L.dtype_of(t)
    if not d.is_floating_point:
        return L.op("ne", t, t)  # integers are never infinite: all false
    inf = math.inf if node.target.overloadpacket is aten.isposinf else -math.inf
    return L.op("eq", t, L.scalar(inf, d))


@register(A("round"))
def _round(L, node, x, **kw):
    if kw.get("decimals", 0):
        raise Unsupported("round with decimals")
    od = out_dtype(node)
    return L.op("round", L.tensor(x, od)) if od.is_floating_point else L.tensor(x, od)


ARITH = {"add": "add", "sub": "sub", "mul": "mul", "maximum": "max", "minimum": "min",
         "atan2": "atan2", "hypot": "hypot", "copysign": "copysign", "pow": "pow", "fmod": "fmod",
         "remainder": "rem", "floor_divide": "floordiv", "bitwise_and": "bitwise_and",
         "bitwise_or": "bitwise_or", "bitwise_xor": "bitwise_xor",
         "bitwise_left_shift": "shl", "bitwise_right_shift": "shr"}
CMP = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}
LOGICAL = {"logical_and": "and", "logical_or": "or", "logical_xor": "xor"}


def _arith(ir):
    def f(L, node, a, b, alpha=None):
        od = out_dtype(node)
        ia, ib = L.tensor(a, od), L.tensor(b, od)
        if alpha is not None and alpha != 1:
            ib = L.op("mul", ib, L.scalar(alpha, od))
        return L.op(ir, ia, ib)
    return f


def _result_type(a, b):
    va = a.meta["val"] if isinstance(a, torch.fx.Node) else a
    vb = b.meta["val"] if isinstance(b, torch.fx.Node) else b
    return torch.result_type(va, vb)


def _cmp(ir):
    def f(L, node, a, b):
        ct = _result_type(a, b)
        return L.op(ir, L.tensor(a, ct), L.tensor(b, ct))
    return f


def _logical(ir):
    def f(L, node, a, b):
        return L.op(ir, L.tensor(a, torch.bool), L.tensor(b, torch.bool))
    return f


for _n, _ir in ARITH.items():
    register(A(_n))(_arith(_ir))
for _n, _ir in CMP.items():
    register(A(_n))(_cmp(_ir))
for _n, _ir in LOGICAL.items():
    register(A(_n))(_logical(_ir))


@register(A("rsub"))
def _rsub(L, node, a, b, alpha=1):
    od = out_dtype(node)
    ia, ib = L.tensor(a, od), L.tensor(b, od)
    if alpha != 1:
        ia = L.op("mul", ia, L.scalar(alpha, od))
    return L.op("sub", ib, ia)


@register(A("div"), A("true_divide"))
def _div(L, node, a, b, rounding_mode=None):
    od = out_dtype(node)
    if rounding_mode is None:
        return L.op("div", L.tensor(a, od), L.tensor(b, od))
    if rounding_mode == "floor":
        return L.op("floordiv", L.tensor(a, od), L.tensor(b, od))
    if rounding_mode == "trunc" and od.is_floating_point:
        return L.op("trunc", L.op("div", L.tensor(a, od), L.tensor(b, od)))
    raise Unsupported("div rounding mode")


@register(A("where"))
def _where(L, node, c, a=None, b=None):
    if a is None:
        raise Unsupported("where with one argument")
    od = out_dtype(node)
    return L.op("where", L.tensor(c, torch.bool), L.tensor(a, od), L.tensor(b, od))


@register(A("masked_fill"))
def _masked_fill(L, node, x, mask, value):
    od = out_dtype(node)
    return L.op("where", L.tensor(mask, torch.bool), L.tensor(value, od), L.tensor(x, od))


@register(A("clamp"))
def _clamp(L, node, x, min=None, max=None):
    od = out_dtype(node)
    r = L.tensor(x, od)
    if min is not None:
        r = L.op("max", r, L.tensor(min, od))
    if max is not None:
        r = L.op("min", r, L.tensor(max, od))
    return r


@register(A("clamp_min"))
def _clamp_min(L, node, x, lo):
    od = out_dtype(node)
    return L.op("max", L.tensor(x, od), L.tensor(lo, od))


@register(A("clamp_max"))
def _clamp_max(L, node, x, hi):
    od = out_dtype(node)
    return L.op("min", L.tensor(x, od), L.tensor(hi, od))


@register(A("hardtanh"))
def _hardtanh(L, node, x, lo=-1.0, hi=1.0):
    od = out_dtype(node)
    return L.op("min", L.op("max", L.tensor(x, od), L.scalar(lo, od)), L.scalar(hi, od))


@register(A("leaky_relu"))
def _leaky_relu(L, node, x, slope=0.01):
    od = out_dtype(node)
    t = L.tensor(x, od)
    return L.op("where", L.op("gt", t, L.scalar(0, od)), t, L.op("mul", t, L.scalar(slope, od)))


@register(A("gelu"))
def _gelu(L, node, x, approximate="none"):
    od = out_dtype(node)
    if approximate == "tanh" and len(x.users) == 1 and L.env.get(x) in L.matmuls and x.meta["val"].dtype == od and L.device.type == "cuda":
        # cuBLASLt's GELU epilogue is this tanh approximation: the matmul applies it.
        tf32, ins = L.matmuls[L.env[x]]
        return L.op("matmul", *ins, epilogue="gelu", tf32=tf32)
    ct = torch.float32 if od in (torch.float16, torch.bfloat16) else od
    t = L.tensor(x, ct)
    half = L.op("mul", t, L.scalar(0.5, ct))
    if approximate == "tanh":
        cube = L.op("mul", L.op("mul", t, t), t)
        inner = L.op("mul", L.op("add", t, L.op("mul", cube, L.scalar(0.044715, ct))), L.scalar(math.sqrt(2 / math.pi), ct))
        r = L.op("mul", half, L.op("add", L.op("tanh", inner), L.scalar(1.0, ct)))
    else:
        r = L.op("mul", half, L.op("add", L.op("erf", L.op("mul", t, L.scalar(1 / math.sqrt(2), ct))), L.scalar(1.0, ct)))
    return L.cast(r, od)


@register(A("sigmoid_backward"))
def _sigmoid_bw(L, node, g, y):
    od = out_dtype(node)
    gy, yy = L.tensor(g, od), L.tensor(y, od)
    return L.op("mul", gy, L.op("mul", yy, L.op("sub", L.scalar(1.0, od), yy)))


@register(A("tanh_backward"))
def _tanh_bw(L, node, g, y):
    od = out_dtype(node)
    gy, yy = L.tensor(g, od), L.tensor(y, od)
    return L.op("mul", gy, L.op("sub", L.scalar(1.0, od), L.op("mul", yy, yy)))


@register(A("threshold_backward"))
def _threshold_bw(L, node, g, x, threshold):
    od = out_dtype(node)
    xx = L.tensor(x)
    return L.op("where", L.op("le", xx, L.tensor(threshold, L.dtype_of(xx))), L.scalar(0, od), L.tensor(g, od))


@register(A("native_dropout_backward"))
def _dropout_bw(L, node, g, mask, scale):
    """Dropout's backward, `mask * grad * scale`, pointwise: it fuses with the gradient's
    producers and consumers instead of splitting the graph's run of kernels. 16-bit gradients
    are computed in float32 and rounded once, as eager's CUDA kernel does (its CPU kernel
    rounds once too: the mask product is exact)."""
    od = out_dtype(node)
    cd = torch.float32 if od in (torch.float16, torch.bfloat16) else od
    r = L.op("mul", L.op("mul", L.tensor(mask, cd), L.tensor(g, cd)), L.scalar(float(scale), cd))
    return L.cast(r, od)


# ---- random values --------------------------------------------------------------------
# [Note: random values] Random ops (dropout's mask, `bernoulli`, `rand`, `randn`) are braze's
# `rand` op: Philox values computed in the kernels that use them, so a dropout fuses with
# its neighbours instead of splitting the graph around an ATen call. Each compiled call
# draws one 63-bit seed from PyTorch's generator on the graph's device (`aten.randint`, the
# only ATen call this takes; under a CUDA graph it is captured like any random op, and every
# replay draws anew); every random op of the graph reads its own stream of that seed. So the
# values follow `torch.manual_seed` (the same seed gives the same values, run after run) but
# are not eager's: PyTorch's own kernels consume its generator otherwise, as Inductor's do.
# A dropout's mask is an output of the forward, saved for its backward as eager saves it.

def _seed(L, device) -> int:
    """The IR value of this call's random seed (a 0-dim int64 on `device`)."""
    if L.seed is None:
        key = f"rng_seed#{len(L.externs)}"
        (L.seed,) = L.b.extern_call(key, [], [("i64", [], [])], True)
        L.externs[key] = ExternCall(aten.randint.low, (0, 2**63 - 1, []), {"dtype": torch.int64, "device": device}, [()], "rng_seed")
    return L.seed


def _random(L, v, dist: str, dtype=None) -> int:
    """Random values of `v`'s shape (FX metadata) and `dtype` (default `v`'s) from `dist`."""
    if L.eager_random:
        raise Unsupported("option eager_random: PyTorch's own random kernels")
    dtype = dtype or v.dtype
    if not dtype.is_floating_point:
        raise Unsupported(f"random values of dtype {dtype}")
    seed = _seed(L, v.device)
    stream = L.n_random
    L.n_random += 1
    return L.op("rand", seed, dist=dist, shape=L.sizes(v.shape), stream=stream, dtype=dt(dtype))


def _no_generator(kw):
    if kw.get("generator") is not None:
        raise Unsupported("a random op with its own generator")


def _uniform_dtype(dtype):
    """The dtype a probability test draws its uniforms in (f64 for f64 operands)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@register(A("native_dropout"))
def _native_dropout(L, node, x, p, train=None):
    """`(x * keep / (1 - p), keep)` with `keep` true with probability 1 - p (eager's
    `native_dropout`); without training, `x` and a mask of ones."""
    out, mask = node.meta["val"]
    od = out.dtype
    if train is not None and not train:
        return L.tensor(x, od), L.op("expand", L.scalar(True, torch.bool), shape=L.sizes(mask.shape))
    cd = _uniform_dtype(od)
    keep = L.op("lt", _random(L, out, "uniform", cd), L.scalar(1.0 - float(p), cd))
    scale = 1.0 / (1.0 - float(p)) if float(p) < 1.0 else 0.0
    kept = L.op("mul", L.tensor(x, cd), L.scalar(scale, cd))
    return L.cast(L.op("where", keep, kept, L.scalar(0.0, cd)), od), keep


@register(A("bernoulli"))
def _bernoulli(L, node, x, p=None, **kw):
    """`bernoulli(x)` (each element 1 with probability x), `bernoulli(x, p)` (a float or a
    tensor of probabilities): 0 or 1 in x's dtype."""
    _no_generator(kw)
    v = node.meta["val"]
    cd = _uniform_dtype(v.dtype)
    prob = L.tensor(x if p is None else p, cd)
    return L.cast(L.op("lt", _random(L, v, "uniform", cd), prob), v.dtype)


@register(A("rand"), A("rand_like"))
def _rand(L, node, *a, **kw):
    _no_generator(kw)
    return _random(L, node.meta["val"], "uniform")


@register(A("randn"), A("randn_like"))
def _randn(L, node, *a, **kw):
    _no_generator(kw)
    return _random(L, node.meta["val"], "normal")


@register(A("uniform"))
def _uniform(L, node, x, lo=0.0, hi=1.0, **kw):
    """Uniform values on [lo, hi) of x's shape and dtype (functionalized `uniform_`)."""
    _no_generator(kw)
    v = node.meta["val"]
    cd = _uniform_dtype(v.dtype)
    u = _random(L, v, "uniform", cd)
    return L.cast(L.op("add", L.scalar(float(lo), cd), L.op("mul", u, L.scalar(float(hi) - float(lo), cd))), v.dtype)


@register(A("_to_copy"), torch.ops.prims.convert_element_type)
def _to_copy(L, node, x, *args, **kw):
    """A dtype cast (``_to_copy`` on one device; ``prims.convert_element_type``, which
    PyTorch's decompositions emit with symbolic sizes)."""
    v = node.meta["val"]
    src = x.meta["val"]
    if src.device != v.device:
        raise Unsupported("device copy")
    return L.tensor(x, v.dtype)


@register(A("clone"), A("alias"), A("lift_fresh_copy"), A("detach"))
def _identity(L, node, x, **kw):
    return L.tensor(x)


@register(A("copy_"))
def _copy_(L, node, dst, src, non_blocking=False):
    """[Note: input mutations] AOTAutograd keeps a graph input's data mutation in the graph
    (`keep_inference_input_mutations`) as `copy_(input, new value)` at its end: BatchNorm's
    running statistics in training. braze computes the new value as an extra output and the
    runtime writes it into the input: stored there in place by its kernel when that is safe
    (`_in_place_ok`), else copied after the call. A copy into anything but an input stays an
    ATen call."""
    v = dst.meta.get("val")
    if dst.op != "placeholder" or not is_tensor_meta(v) or not is_tensor_meta(src.meta.get("val")):
        raise Unsupported("copy_ into a value other than a graph input")
    if list(src.meta["val"].shape) != list(v.shape):
        raise Unsupported("copy_ with broadcasting")
    if any(d is dst for d, _ in L.mutations):
        raise Unsupported("an input mutated twice")
    L.mutations.append((dst, src))
    return None


def _in_place_ok(dst: torch.fx.Node, src: torch.fx.Node) -> bool:
    """Whether the kernel computing `src` may store it straight into input `dst`: every
    value computed from `dst` is elementwise (same shape, pointwise ops) and feeds `src`, so
    each element of `dst` is read, by the kernels before `src`'s or by `src`'s own at the
    element it writes, before it is overwritten."""
    shape = list(dst.meta["val"].shape)
    if src is dst or src.op != "call_function":
        return False
    # Everything computed from dst, which must be elementwise of dst's shape.
    todo = [u for u in dst.users if u.target is not torch.ops.aten.copy_.default]
    computed = set()
    while todo:
        n = todo.pop()
        if n in computed:
            continue
        t = n.target
        if t is torch.ops.aten._native_batch_norm_legit_functional.default and len(n.args) > 5 and n.args[5] and (n.args[3] is dst) != (n.args[4] is dst):
            # A BatchNorm in training reads a running statistic only for its own update, the
            # result at index 3 (mean) or 4 (variance), element by element ([Note: BatchNorm
            # lowered, not decomposed]).
            idx = 3 if n.args[3] is dst else 4
            for g in n.users:
                if g.target is operator.getitem and g.args[1] == idx:
                    computed.add(g)
                    todo.extend(u for u in g.users if u.target is not torch.ops.aten.copy_.default)
            continue
        computed.add(n)
        val = n.meta.get("val")
        if (not isinstance(t, torch._ops.OpOverload) or torch.Tag.pointwise not in t.tags
                or not is_tensor_meta(val) or list(val.shape) != shape):
            return False
        todo.extend(u for u in n.users if u.target is not torch.ops.aten.copy_.default)
    # Each of them must feed src. A path from one of them to src runs through values computed
    # from dst only, so the walk back from src stays inside `computed` (a BatchNorm's running
    # statistics: a few nodes, not the whole graph above src, which made ResNet-50's 159
    # updates cost a sixth of its forward's lowering).
    feeds = {src}
    todo = [src]
    while todo:
        n = todo.pop()
        for u in n.all_input_nodes:
            if u in computed and u not in feeds:
                feeds.add(u)
                todo.append(u)
    return computed <= feeds


@register(A("copy"))
def _copy(L, node, dst, src, non_blocking=False):
    v = node.meta["val"]
    return L.op("expand", L.tensor(src, v.dtype), shape=L.sizes(v.shape)) if list(src.meta["val"].shape) != list(v.shape) else L.tensor(src, v.dtype)


# ---- views ---------------------------------------------------------------------------

def _norm_dim(d, rank):
    return d + rank if d < 0 else d


@register(A("view"), A("_unsafe_view"), A("reshape"))
def _view(L, node, x, shape):
    v = node.meta["val"]
    return L.op("reshape", L.tensor(x), shape=L.sizes(v.shape))


@register(A("permute"))
def _permute(L, node, x, dims):
    r = L.rank(L.tensor(x))
    return L.op("permute", L.tensor(x), dims=[_norm_dim(d, r) for d in dims])


@register(A("t"), A("transpose"), A("numpy_T"))
def _transpose(L, node, x, d0=0, d1=1):
    t = L.tensor(x)
    r = L.rank(t)
    if r < 2:
        return t
    d0, d1 = _norm_dim(d0, r), _norm_dim(d1, r)
    p = list(range(r))
    p[d0], p[d1] = p[d1], p[d0]
    return L.op("permute", t, dims=list(p))


@register(A("expand"))
def _expand(L, node, x, shape, implicit=False):
    v = node.meta["val"]
    return L.op("expand", L.tensor(x), shape=L.sizes(v.shape))


@register(A("unsqueeze"), A("squeeze"), A("flatten"), A("unflatten"), A("view_as"), A("expand_as"))
def _reshape_like(L, node, x, *a, **kw):
    v = node.meta["val"]
    t = L.tensor(x)
    if L.shape_of(t) == [sym_str(s) for s in v.shape]:
        return t
    if node.target.overloadpacket is aten.expand_as:
        return L.op("expand", t, shape=L.sizes(v.shape))
    return L.op("reshape", t, shape=L.sizes(v.shape))


def _known_equal(a, b) -> bool:
    """Whether sizes `a` and `b` (ints or SymInts) are equal for every value of the size
    symbols (no guard is added)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    return statically_known_true(a == b)


def _row_major(shape, strides):
    """Whether `strides` are the row-major strides of `shape` (dims of size 1 aside)."""
    want = 1
    for n, st in reversed(list(zip(shape, strides))):
        if not _known_equal(n, 1) and not _known_equal(st, want):
            return False
        want = want * n
    return True


def _dense_view(x, size, stride, offset):
    """Whether `as_strided(x, size, stride, offset)` reads all of a row-major `x` in order:
    then it is a reshape of x (ResNet's flatten after the pool, as AOTAutograd writes it)."""
    v = x.meta.get("val")
    size, stride = ([a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in vs] for vs in (size, stride))
    if not all(isinstance(a, (int, torch.SymInt)) for a in (*size, *stride)):
        return False
    if not is_tensor_meta(v) or not _known_equal(v.storage_offset(), 0) or offset not in (None, 0):
        return False
    numel = 1
    for n in size:
        numel = numel * n
    return _known_equal(numel, v.numel()) and _row_major(v.shape, v.stride()) and _row_major(size, stride)


@register(A("as_strided"))
def _as_strided(L, node, x, size, stride, storage_offset=None):
    """A view of a row-major tensor's elements in order, as a reshape; other views of
    storage stay ATen's."""
    if not _dense_view(x, size, stride, storage_offset):
        raise Unsupported("as_strided other than a dense view in order")
    return L.op("reshape", L.tensor(x), shape=L.sizes(node.meta["val"].shape))


@register(A("as_strided_scatter"))
def _as_strided_scatter(L, node, base, src, size, stride, storage_offset=None):
    """`as_strided`'s backward where the view covers all of a row-major base in order:
    the base replaced by `src`."""
    if not _dense_view(base, size, stride, storage_offset):
        raise Unsupported("as_strided_scatter other than a dense view in order")
    v = node.meta["val"]
    return L.op("reshape", L.tensor(src, v.dtype), shape=L.sizes(v.shape))


@register(A("slice"))
def _slice(L, node, x, dim=0, start=None, end=None, step=1):
    src = x.meta["val"]
    v = node.meta["val"]
    dim = _norm_dim(dim, src.dim())
    size = src.shape[dim]
    start = 0 if start is None else start
    if isinstance(start, int) and isinstance(size, int):
        if start < 0:
            start += size
        start = min(max(start, 0), size)
    elif not isinstance(start, int) or start < 0:
        if not isinstance(start, (int, torch.fx.Node)) or isinstance(start, int) and start < 0:
            raise Unsupported("symbolic negative slice start")
    t = L.tensor(x)
    if step == 1 and start == 0 and sym_str(v.shape[dim]) == sym_str(size):
        return t
    return L.op("slice", t, dim=dim, start=L.size(start), len=sym_val(v.shape[dim]), step=int(step))


@register(A("split"), A("split_with_sizes"))
def _split(L, node, x, sizes, dim=0):
    """Pieces along `dim` as slice views of `x` (GPT-2 splits its fused q, k, v projection);
    an int is the pieces' size, the last one shorter."""
    src = x.meta["val"]
    d = _norm_dim(dim, src.dim())
    total = src.shape[d]
    if isinstance(sizes, int):
        if not isinstance(total, int) or sizes <= 0:
            raise Unsupported("split of a symbolic dim")
        sizes = [min(sizes, total - s) for s in range(0, total, sizes)] or [0]
    if not all(isinstance(n, int) for n in sizes):
        raise Unsupported("split with symbolic sizes")
    t = L.tensor(x)
    out, start = [], 0
    for n in sizes:
        out.append(t if n == total else L.op("slice", t, dim=d, start=start, len=n, step=1))
        start += n
    return tuple(out)


@register(A("unbind"))
def _unbind(L, node, x, dim=0):
    src = x.meta["val"]
    d = _norm_dim(dim, src.dim())
    if not isinstance(src.shape[d], int):
        raise Unsupported("unbind of a symbolic dim")
    t = L.tensor(x)
    return tuple(L.op("select", t, dim=d, index=i) for i in range(src.shape[d]))


@register(A("select"))
def _select(L, node, x, dim, index):
    src = x.meta["val"]
    dim = _norm_dim(dim, src.dim())
    if isinstance(index, int) and index < 0:
        if not isinstance(src.shape[dim], int):
            raise Unsupported("negative select on a symbolic dim")
        index += src.shape[dim]
    elif not isinstance(index, int):
        # A symbolic index counts from the end when negative, as ATen's select does at run
        # time. Asking its sign guards the graph on it (the traced value's sign; eager's
        # bounds check makes the wrapped index valid).
        iv = index.meta.get("val") if isinstance(index, torch.fx.Node) else index
        if not isinstance(iv, torch.SymInt):
            raise Unsupported("select with an index of unknown sign")
        if iv < 0:
            return L.op("select", L.tensor(x), dim=dim, index=sym_val(iv + src.shape[dim]))
    return L.op("select", L.tensor(x), dim=dim, index=L.size(index))


# ---- reductions ----------------------------------------------------------------------

def _dims(dims, rank):
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    out = sorted({_norm_dim(d, rank) for d in dims})
    return out


def _reduce(L, kind, t, dims, keepdim, correction=None):
    if L.rank(t) == 0:
        # A 0-dim tensor reduces over its one element and stays 0-dim.
        r = L.op(kind, L.op("reshape", t, shape=[1]), **_red_attrs([0], True, correction))
        return L.op("reshape", r, shape=[])
    return L.op(kind, t, **_red_attrs(dims, keepdim, correction))


def _red_attrs(dims, keepdim, correction):
    """A reduction's attributes (`correction` only for var)."""
    attrs = {"dims": list(dims), "keepdim": bool(keepdim)}
    if correction is not None:
        attrs["correction"] = int(correction)
    return attrs


@register(A("sum"))
def _sum(L, node, x, dims=None, keepdim=False, dtype=None):
    od = out_dtype(node)
    t = L.tensor(x)
    if od.is_floating_point:
        t = L.cast(t, od)
    r = _reduce(L, "sum", t, _dims(dims, L.rank(t)), keepdim)
    return L.cast(r, od)


# A scan lowered as a masked sum does n*n work per row: longer ones stay ATen's.
_SCAN_MAX_LEN = 4096
_SCAN_MAX_WORK = 1 << 26


@register(A("cumsum"))
def _cumsum(L, node, x, dim, dtype=None):
    """`cumsum` along a short dim as a masked sum, `y[..., i] = sum_j [j <= i] x[..., j]`: one
    reduction kernel, fused with what feeds it (transformers' packed-sequence check counts
    position jumps along a sequence). Exact for integers and booleans; for floats the order
    of the additions is a reduction's, not a running sum's. Scans over more than
    `_SCAN_MAX_LEN` elements, or `_SCAN_MAX_WORK` in all, and symbolic lengths stay ATen's."""
    return _scan(L, node, x, dim, "cumsum", "sum", 0)


@register(A("cumprod"))
def _cumprod(L, node, x, dim, dtype=None):
    """`cumprod` as `cumsum` is lowered, a masked product (`prod`'s backward calls it)."""
    return _scan(L, node, x, dim, "cumprod", "prod", 1)


def _scan(L, node, x, dim, name, kind, identity):
    """A scan along a short dim as the reduction `kind` of `x[..., j]` over `j <= i` (the
    others replaced by `identity`), see `_cumsum`."""
    v, xv = node.meta["val"], x.meta["val"]
    od = v.dtype
    t = L.tensor(x)
    if xv.dim() == 0:
        return L.cast(t, od)
    d = _norm_dim(dim, xv.dim())
    n = xv.shape[d]
    if not isinstance(n, int) or not all(isinstance(s, int) for s in xv.shape):
        raise Unsupported(f"{name} over symbolic sizes")
    if n == 0 or n > _SCAN_MAX_LEN or xv.numel() * n > _SCAN_MAX_WORK:
        raise Unsupported(f"{name} over a long or empty dim")
    t = L.cast(t, od)
    rank = xv.dim()
    perm = [i for i in range(rank) if i != d] + [d]
    if d != rank - 1:
        t = L.op("permute", t, dims=perm)
    rows = [xv.shape[i] for i in perm[:-1]]
    xe = L.op("expand", L.op("reshape", t, shape=rows + [1, n]), shape=rows + [n, n])
    pos = L.op("iota", len=n, start=0, step=1, dtype="i64")
    j, i = L.op("reshape", pos, shape=[1, n]), L.op("reshape", pos, shape=[n, 1])
    y = L.op(kind, L.op("where", L.op("le", j, i), xe, L.scalar(identity, od)), dims=[rank], keepdim=False)
    y = L.cast(y, od)
    if d != rank - 1:
        y = L.op("permute", y, dims=[perm.index(k) for k in range(rank)])
    return y


@register(A("prod"))
def _prod(L, node, x, dims=None, keepdim=False, dtype=None):
    od = out_dtype(node)
    t = L.tensor(x)
    if od.is_floating_point:
        t = L.cast(t, od)
    if isinstance(dims, int):
        dims = [dims]
    r = _reduce(L, "prod", t, _dims(dims, L.rank(t)), keepdim)
    return L.cast(r, od)


@register(A("mean"))
def _mean(L, node, x, dims=None, keepdim=False, dtype=None):
    od = out_dtype(node)
    t = L.tensor(x, od)
    ds = _dims(dims, L.rank(t))
    src = x.meta["val"]
    n = 1
    for d in ds:
        n = n * src.shape[d] if src.dim() else 1
    r = _reduce(L, "sum", t, ds, keepdim)
    return L.op("div", r, _size_scalar(L, n, od))


def _size_scalar(L, n, dtype):
    if isinstance(n, int):
        return L.scalar(n, dtype)
    return L.op("size", value=sym_val(n), dtype=dt(dtype))


@register(A("amax"), A("amin"))
def _amax(L, node, x, dims=(), keepdim=False):
    kind = "amax" if node.target.overloadpacket is aten.amax else "amin"
    t = L.tensor(x)
    return _reduce(L, kind, t, _dims(dims, L.rank(t)), keepdim)


@register(A("max"), A("min"))
def _max(L, node, x, dim=None, keepdim=False):
    is_max = node.target.overloadpacket is aten.max
    t = L.tensor(x)
    if isinstance(dim, torch.fx.Node) or (not isinstance(dim, int) and dim is not None):
        raise Unsupported("max of two tensors")  # aten.max.other is maximum
    if dim is None:
        return _reduce(L, "amax" if is_max else "amin", t, _dims(None, L.rank(t)), False)
    ds = _dims(dim, L.rank(t))
    vals = _reduce(L, "amax" if is_max else "amin", t, ds, keepdim)
    idx = _reduce(L, "argmax" if is_max else "argmin", t, ds, keepdim)
    return (vals, idx)


@register(A("argmax"), A("argmin"))
def _argmax(L, node, x, dim=None, keepdim=False):
    kind = "argmax" if node.target.overloadpacket is aten.argmax else "argmin"
    t = L.tensor(x)
    if dim is None:
        shape = L.shape_of(t)
        flat = L.op("reshape", t, shape=["*".join(f"({s})" for s in shape or ["1"])])
        r = L.op(kind, flat, **_red_attrs([0], False, None))
        if keepdim:
            r = L.op("reshape", r, shape=[1] * len(shape))
        return r
    return _reduce(L, kind, t, _dims(dim, L.rank(t)), keepdim)


@register(A("any"), A("all"))
def _any(L, node, x, dim=None, keepdim=False):
    kind = "any" if node.target.overloadpacket is aten.any else "all"
    t = L.tensor(x)
    return _reduce(L, kind, t, _dims(dim, L.rank(t)), keepdim)


def _correction(L, correction, unbiased):
    """The variance's correction: an int when it is one at compile time, else the FX node or
    float it was given (see `_variance`)."""
    if correction is None:
        return 1 if unbiased is None or unbiased else 0
    if isinstance(correction, torch.fx.Node) and isinstance(L.env.get(correction), Num):
        correction = L.env[correction].value
    if isinstance(correction, float) and correction.is_integer():
        correction = int(correction)
    return correction


def _variance(L, t, ds, keepdim, correction, n, od):
    """`var` over `ds` divided by `max(n - correction, 0)`, as eager divides. An int correction
    is the reduction's attribute; a fractional one, or one Dynamo made a symbol (a Python int
    that changed between calls), rescales the population variance: `var0 * n / max(n - c, 0)`,
    in float32 for half types."""
    if isinstance(correction, int) and not isinstance(correction, bool):
        return _reduce(L, "var", t, ds, keepdim, correction)
    acc = _acc_dtype(od)
    v = L.cast(_reduce(L, "var", t, ds, keepdim, 0), acc)
    nn = _size_scalar(L, n, acc)
    den = L.op("max", L.op("sub", nn, L.tensor(correction, acc)), L.scalar(0, acc))
    return L.cast(L.op("div", L.op("mul", v, nn), den), od)


def _numel_over(x, ds):
    src = x.meta["val"]
    return math.prod(src.shape[d] for d in ds) if src.dim() else 1


@register(A("var"))
def _var(L, node, x, dims=None, unbiased=None, keepdim=False, correction=None):
    if isinstance(dims, bool):
        unbiased, dims = dims, None
    od = out_dtype(node)
    t = L.tensor(x, od)
    ds = _dims(dims, L.rank(t))
    return _variance(L, t, ds, keepdim, _correction(L, correction, unbiased), _numel_over(x, ds), od)


@register(A("var_mean"))
def _var_mean(L, node, x, dims=None, unbiased=None, keepdim=False, correction=None):
    if isinstance(dims, bool):
        unbiased, dims = dims, None
    od = node.meta["val"][0].dtype
    t = L.tensor(x, od)
    ds = _dims(dims, L.rank(t))
    n = _numel_over(x, ds)
    var = _variance(L, t, ds, keepdim, _correction(L, correction, unbiased), n, od)
    mean = L.op("div", _reduce(L, "sum", t, ds, keepdim), _size_scalar(L, n, od))
    return (var, mean)


# ---- normalizations ------------------------------------------------------------------

def _acc_dtype(d):
    return torch.float32 if d in (torch.float16, torch.bfloat16) else d


@register(A("_softmax"))
def _softmax(L, node, x, dim, half_to_float):
    od = out_dtype(node)
    ct = _acc_dtype(od)
    t = L.tensor(x, ct)
    d = _norm_dim(dim, max(L.rank(t), 1))
    if L.rank(t) == 0:
        return L.cast(L.op("div", t, t), od)
    m = _reduce(L, "amax", t, [d], True)
    e = L.op("exp", L.op("sub", t, m))
    s = _reduce(L, "sum", e, [d], True)
    return L.cast(L.op("div", e, s), od)


@register(A("_log_softmax"))
def _log_softmax(L, node, x, dim, half_to_float):
    od = out_dtype(node)
    ct = _acc_dtype(od)
    t = L.tensor(x, ct)
    if L.rank(t) == 0:
        return L.cast(L.op("sub", t, t), od)
    d = _norm_dim(dim, L.rank(t))
    m = _reduce(L, "amax", t, [d], True)
    sh = L.op("sub", t, m)
    s = _reduce(L, "sum", L.op("exp", sh), [d], True)
    return L.cast(L.op("sub", sh, L.op("log", s)), od)


def _softmax_bw_operands(L, node, g, y, dim, what):
    """(out dtype, grad, output, dim) of a (log_)softmax backward, computed in the accumulation
    dtype."""
    od = out_dtype(node)
    ct = _acc_dtype(od)
    gg, yy = L.tensor(g, ct), L.tensor(y, ct)
    if L.rank(gg) == 0:
        raise Unsupported(f"0-dim {what} backward")
    return od, gg, yy, _norm_dim(dim, L.rank(gg))


@register(A("_softmax_backward_data"))
def _softmax_bw(L, node, g, y, dim, input_dtype):
    od, gg, yy, d = _softmax_bw_operands(L, node, g, y, dim, "softmax")
    gy = L.op("mul", gg, yy)
    s = _reduce(L, "sum", gy, [d], True)
    return L.cast(L.op("sub", gy, L.op("mul", yy, s)), od)


@register(A("_log_softmax_backward_data"))
def _log_softmax_bw(L, node, g, y, dim, input_dtype):
    od, gg, yy, d = _softmax_bw_operands(L, node, g, y, dim, "log_softmax")
    s = _reduce(L, "sum", gg, [d], True)
    return L.cast(L.op("sub", gg, L.op("mul", L.op("exp", yy), s)), od)


def _inv_std(L, var, eps, ct):
    """`1 / sqrt(var + eps)`."""
    return L.op("rsqrt", L.op("add", var, L.scalar(eps, ct)))


def _normalized(L, t, ds, n, eps, ct):
    """(biased variance, mean, inverse std, normalized `t`) over dims `ds` of `n` elements,
    the statistics keeping their dims: LayerNorm's and training BatchNorm's shared math."""
    var = _reduce(L, "var", t, ds, True, 0)
    mean = L.op("div", _reduce(L, "sum", t, ds, True), _size_scalar(L, n, ct))
    rstd = _inv_std(L, var, eps, ct)
    return var, mean, rstd, L.op("mul", L.op("sub", t, mean), rstd)


@register(A("native_layer_norm"))
def _layer_norm(L, node, x, normalized_shape, w, b, eps):
    vals = node.meta["val"]
    od = vals[0].dtype
    ct = _acc_dtype(od)
    t = L.tensor(x, ct)
    r = L.rank(t)
    k = len(normalized_shape)
    ds = list(range(r - k, r))
    src = x.meta["val"]
    n = math.prod(src.shape[d] for d in ds)
    _, mean, rstd, out = _normalized(L, t, ds, n, eps, ct)
    if w is not None:
        out = L.op("mul", out, L.tensor(w, ct))
    if b is not None:
        out = L.op("add", out, L.tensor(b, ct))
    return (L.cast(out, od), L.cast(mean, vals[1].dtype), L.cast(rstd, vals[2].dtype))


@register(A("native_layer_norm_backward"))
def _layer_norm_backward(L, node, g, x, normalized_shape, mean, rstd, w, b, mask):
    """(input's, weight's, bias's gradient) of a LayerNorm, each None where `mask` (or a
    missing weight or bias) does not ask for it: PyTorch's decomposition's math emitted
    directly (it cost about 10 ms of tracing per layer, [Note: BatchNorm lowered, not
    decomposed])."""
    vals = node.meta["val"]
    src = x.meta["val"]
    r = src.dim()
    axis = r - len(normalized_shape)
    inner, outer = list(range(axis, r)), list(range(axis))
    n = math.prod(src.shape[d] for d in inner)
    if src.numel() == 0:
        raise Unsupported("LayerNorm backward of an empty tensor")
    ct = _acc_dtype(src.dtype)
    gg, xx = L.tensor(g, ct), L.tensor(x, ct)
    rs = L.tensor(rstd, ct)
    x_hat = L.op("mul", L.op("sub", xx, L.tensor(mean, ct)), rs)
    gxh = L.op("mul", gg, L.tensor(w, ct)) if w is not None else gg
    a = L.op("mul", gxh, _size_scalar(L, n, ct))
    bsum = _reduce(L, "sum", gxh, inner, True)
    c3 = L.op("mul", x_hat, _reduce(L, "sum", L.op("mul", gxh, x_hat), inner, True))
    d_input = L.op("mul", L.op("div", rs, _size_scalar(L, n, ct)), L.op("sub", L.op("sub", a, bsum), c3))
    gx = L.op("mul", gg, x_hat)
    d_weight = (_reduce(L, "sum", gx, outer, False) if outer else gx) if w is not None else None
    d_bias = (_reduce(L, "sum", gg, outer, False) if outer else gg) if b is not None else None
    return tuple(L.cast(v, val.dtype) if want and v is not None and val is not None else None
                 for v, want, val in zip((d_input, d_weight, d_bias), mask, vals))


# [Note: BatchNorm lowered, not decomposed] BatchNorm and its backward are lowered here
# rather than decomposed while AOTAutograd traces: PyTorch's decompositions run each op of
# theirs through functionalization, proxy tracing and fake tensors, about 33 ms per layer's
# forward and backward pair, 2.9 s of ResNet-50 training's 14.9 s first call on the CPU. The
# IR is the decompositions' math (statistics in f32 for f16/bf16 inputs, the biased variance,
# eager's running-statistics update with the unbiased one), emitted directly.

def _bn_parts(L, x):
    """(input meta, rank, reduced dims, elements per channel, [C] -> [C, 1, ...] reshape) of
    a BatchNorm input [N, C, ...]."""
    src = x.meta["val"]
    r = src.dim()
    if r < 2:
        raise Unsupported("BatchNorm of a tensor of rank < 2")
    ds = [0] + list(range(2, r))
    n = math.prod(src.shape[d] for d in ds)
    shape = [sym_val(src.shape[1])] + [1] * (r - 2)
    return src, r, ds, n, (lambda v: L.op("reshape", v, shape=shape))


def _bn_float(L, v, n, ct):
    """`v / n` (a Python number over a size that may be symbolic) as a scalar of `ct`."""
    if isinstance(n, int):
        return L.scalar(v / n, ct)
    return L.op("div", L.scalar(v, ct), _size_scalar(L, n, ct))


def _bn_out_cast(L, v, val):
    """`v` cast to the FX result's dtype; an empty result where eager's is empty (the CPU's
    statistics of an evaluation-mode BatchNorm)."""
    if val.numel() == 0:
        return L.op("expand", L.scalar(0, val.dtype), shape=L.sizes(val.shape))
    return L.cast(v, val.dtype)


def _bn_affine(L, out, weight, bias, chan, ct):
    if weight is not None:
        out = L.op("mul", out, chan(L.tensor(weight, ct)))
    if bias is not None:
        out = L.op("add", out, chan(L.tensor(bias, ct)))
    return out


@register(A("_native_batch_norm_legit_functional"))
def _batch_norm_functional(L, node, x, weight, bias, running_mean, running_var, training, momentum, eps):
    """(output, saved mean, saved inverse std, new running mean, new running variance)."""
    vals = node.meta["val"]
    src, r, ds, n, chan = _bn_parts(L, x)
    ct = _acc_dtype(src.dtype)
    t = L.tensor(x, ct)
    rm, rv = L.tensor(running_mean, ct), L.tensor(running_var, ct)
    if not training:
        mean, rstd = rm, _inv_std(L, rv, eps, ct)
        out = L.op("mul", L.op("sub", t, chan(mean)), chan(rstd))
        new_rm, new_rv = rm, rv
    else:
        if isinstance(n, int) and n <= 1:
            raise Unsupported("BatchNorm training with one value per channel")
        var, mean_k, rstd_k, out = _normalized(L, t, ds, n, eps, ct)
        c = [sym_val(src.shape[1])]
        mean, rstd = L.op("reshape", mean_k, shape=c), L.op("reshape", rstd_k, shape=c)
        unbiased_scale = L.scalar(n / (n - 1), ct) if isinstance(n, int) else L.op(
            "div", _size_scalar(L, n, ct), L.op("sub", _size_scalar(L, n, ct), L.scalar(1, ct)))
        unbiased = L.op("mul", L.op("reshape", var, shape=c), unbiased_scale)
        keep = L.scalar(1 - momentum, ct)
        new_rm = L.op("add", L.op("mul", L.scalar(momentum, ct), mean), L.op("mul", keep, rm))
        new_rv = L.op("add", L.op("mul", L.scalar(momentum, ct), unbiased), L.op("mul", keep, rv))
    out = _bn_affine(L, out, weight, bias, chan, ct)
    return tuple(_bn_out_cast(L, v, val) for v, val in zip((out, mean, rstd, new_rm, new_rv), vals))


@register(A("_native_batch_norm_legit_no_training"))
def _batch_norm_eval(L, node, x, weight, bias, running_mean, running_var, momentum, eps):
    """Evaluation-mode BatchNorm: (output, mean, inverse std) from the running statistics."""
    vals = node.meta["val"]
    src, r, ds, n, chan = _bn_parts(L, x)
    ct = _acc_dtype(src.dtype)
    mean = L.tensor(running_mean, ct)
    rstd = _inv_std(L, L.tensor(running_var, ct), eps, ct)
    out = L.op("mul", L.op("sub", L.tensor(x, ct), chan(mean)), chan(rstd))
    out = _bn_affine(L, out, weight, bias, chan, ct)
    return tuple(_bn_out_cast(L, v, val) for v, val in zip((out, mean, rstd), vals))


@register(A("native_batch_norm_backward"))
def _batch_norm_backward(L, node, g, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, mask):
    """(input's, weight's, bias's gradient), each None where `mask` does not ask for it."""
    vals = node.meta["val"]
    src, r, ds, n, chan = _bn_parts(L, x)
    ct = _acc_dtype(src.dtype)
    gg, xx = L.tensor(g, ct), L.tensor(x, ct)
    if train:
        mean, invstd = L.tensor(save_mean, ct), L.tensor(save_invstd, ct)
    else:
        mean = L.tensor(running_mean, ct)
        invstd = _inv_std(L, L.tensor(running_var, ct), eps, ct)
    xmu = L.op("sub", xx, chan(mean))
    gsum = _reduce(L, "sum", gg, ds, False)
    dot = _reduce(L, "sum", L.op("mul", gg, xmu), ds, False)
    scale = chan(L.op("mul", invstd, L.tensor(weight, ct)) if weight is not None else invstd)
    if train:
        norm = _bn_float(L, 1.0, n, ct)
        grad_mean = chan(L.op("mul", gsum, norm))
        proj_scale = chan(L.op("mul", L.op("mul", dot, norm), L.op("mul", invstd, invstd)))
        gi = L.op("mul", L.op("sub", L.op("sub", gg, L.op("mul", xmu, proj_scale)), grad_mean), scale)
    else:
        gi = L.op("mul", gg, scale)
    outs = (gi, L.op("mul", dot, invstd), gsum)
    return tuple(L.cast(v, val.dtype) if want and val is not None else None for v, want, val in zip(outs, mask, vals))


# ---- matmul (CUDA: cuBLASLt with fused epilogue; CPU: the BLAS PyTorch ships) ---------

def _matmul_ok(L, node, *xs):
    """Library matmuls, in static shapes with operands of one dtype: on CUDA f32/f16/bf16
    through cuBLASLt; on the CPU f32 through PyTorch's own BLAS, called from braze's runs
    ([Note: CPU matmuls] in braze-runtime). Anything else is ATen's."""
    from . import cuda

    v = node.meta["val"]
    if L.device is not None and L.device.type == "cpu":
        if v.dtype != torch.float32 or not _core.cpu_blas_ready():
            raise Unsupported("matmul runs through ATen here")
    elif L.device is None or L.device.type != "cuda" or not cuda.cublaslt_ready():
        raise Unsupported("matmul runs through ATen here")
    if v.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise Unsupported(f"matmul on {v.dtype}")
    # The CPU's matmuls take their sizes from each call's symbols; cuBLASLt's are planned
    # (and tuned) for static ones.
    symbolic_ok = L.device.type == "cpu"
    for x in xs:
        m = x.meta["val"]
        if m.dtype != v.dtype:
            raise Unsupported("matmul operands differ in dtype")
        if not symbolic_ok and any(not isinstance(s, int) for s in list(m.shape) + list(m.stride())):
            raise Unsupported("matmul operands have symbolic sizes")
        if isinstance(m.numel(), int) and m.numel() == 0:
            raise Unsupported("matmul of an empty operand")
    if isinstance(v.numel(), int) and v.numel() == 0:
        raise Unsupported("matmul with an empty result")
    return bool(v.dtype == torch.float32 and L.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)


@register(A("mm"), A("bmm"))
def _mm(L, node, a, b):
    tf32 = _matmul_ok(L, node, a, b)
    return _plain_matmul(L, tf32, L.tensor(a), L.tensor(b))


@register(A("addmm"), A("baddbmm"))
def _addmm(L, node, bias, a, b, beta=1, alpha=1):
    """`beta * bias + alpha * (a @ b)`. A row-vector bias with no scaling is the matmul's own
    (cuBLASLt's bias epilogue, the BLAS's beta); otherwise the matmul is plain and the scaling
    and the broadcast bias are pointwise work that fuses into its consumers (BLOOM's
    `baddbmm(alibi, q, k, beta=1, alpha=1/sqrt(d))` before its softmax). As in eager, a zero
    `beta` ignores the bias, NaNs included."""
    tf32 = _matmul_ok(L, node, bias, a, b)
    if beta == 1 and alpha == 1 and bias.meta["val"].dim() == 1 and node.meta["val"].dim() == 2:
        return _plain_matmul(L, tf32, L.tensor(a), L.tensor(b), L.tensor(bias))
    dt = node.meta["val"].dtype
    if dt.is_complex or not (isinstance(beta, (int, float)) and isinstance(alpha, (int, float))):
        raise Unsupported("addmm/baddbmm with complex values or symbolic scaling")
    r = _plain_matmul(L, tf32, L.tensor(a), L.tensor(b))
    if alpha != 1:
        r = L.op("mul", r, L.scalar(alpha, dt))
    if beta == 0:
        return r
    t = L.tensor(bias, dt)
    if beta != 1:
        t = L.op("mul", t, L.scalar(beta, dt))
    return L.op("add", r, t)  # (binary ops broadcast)


def _plain_matmul(L, tf32, *ins):
    r = L.op("matmul", *ins, epilogue="none", tf32=tf32)
    L.matmuls[r] = (tf32, ins)
    return r


# ---- creation ------------------------------------------------------------------------

@register(A("full"))
def _full(L, node, size, value, **kw):
    v = node.meta["val"]
    s = L.scalar(value, v.dtype)
    if v.dim() == 0:
        return s
    return L.op("expand", s, shape=L.sizes(v.shape))


@register(A("zeros"), A("ones"), A("_efficientzerotensor"))
def _zeros(L, node, size, **kw):
    """Zeros or ones; `_efficientzerotensor` (autograd's zero gradient, `sgn`'s) is zeros."""
    v = node.meta["val"]
    s = L.scalar(1 if node.target.overloadpacket is aten.ones else 0, v.dtype)
    return s if v.dim() == 0 else L.op("expand", s, shape=L.sizes(v.shape))


@register(A("full_like"))
def _full_like(L, node, x, value, **kw):
    v = node.meta["val"]
    s = L.scalar(value, v.dtype)
    return s if v.dim() == 0 else L.op("expand", s, shape=L.sizes(v.shape))


@register(A("empty_like"), A("new_empty"), A("empty"), A("empty_strided"))
def _empty(L, node, *a, **kw):
    # Uninitialized memory may hold anything; zeros are one valid choice and need no buffer.
    v = node.meta["val"]
    s = L.scalar(0, v.dtype)
    return s if v.dim() == 0 else L.op("expand", s, shape=L.sizes(v.shape))


@register(A("fill"))
def _fill(L, node, x, value):
    v = node.meta["val"]
    s = L.tensor(value, v.dtype)
    if L.rank(s) != 0:
        raise Unsupported("fill with a non-scalar tensor")
    return s if v.dim() == 0 else L.op("expand", s, shape=L.sizes(v.shape))


@register(A("scalar_tensor"))
def _scalar_tensor(L, node, value, **kw):
    return L.scalar(value, node.meta["val"].dtype)


@register(A("arange"))
def _arange(L, node, *args, **kw):
    """``arange(end)``, ``arange(start, end)``, ``arange(start, end, step)`` as an iota of the
    result's length: the end may be a size symbol (a graph input with dynamic shapes). Integer
    start and step count directly; a float one (`arange(0, d, 2.0)` of positional encodings)
    gives `start + i * step` computed in float64 and rounded once, as ATen's CPU kernel
    computes it in double; into an integer type, float bounds count as ATen's kernel converts
    them (truncated)."""
    v = node.meta["val"]
    start, step = (0, 1) if len(args) == 1 else (args[0], args[2] if len(args) > 2 else 1)
    end = args[0] if len(args) == 1 else args[1]
    if not (isinstance(end, (int, float)) or _is_sym_int(end)) or isinstance(end, bool):
        raise Unsupported("arange with a bound computed at run time")
    if not v.dtype.is_floating_point and v.dtype != torch.bool and all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in (start, step)):
        # An integer result: ATen converts start and step to the integer type (truncating a
        # float's fraction) and takes the length from the float bounds (Funnel's
        # `arange(0, n, 1.0, dtype=torch.long)`).
        start, step = int(start), int(step)
    if isinstance(start, int) and isinstance(step, int) and not isinstance(start, bool) and not isinstance(step, bool) and step != 0:
        return L.op("iota", len=sym_val(v.shape[0]), start=start, step=step, dtype=dt(v.dtype))
    if not (isinstance(start, (int, float)) and isinstance(step, (int, float))) or not v.dtype.is_floating_point:
        raise Unsupported("arange with non-integer bounds")
    i = L.op("iota", len=sym_val(v.shape[0]), start=0, step=1, dtype="i64")
    x = L.op("add", L.op("mul", L.cast(i, torch.float64), L.scalar(float(step), torch.float64)), L.scalar(float(start), torch.float64))
    return L.cast(x, v.dtype)


def _is_sym_int(a):
    """An FX node holding an integer size (a SymInt)."""
    return isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.SymInt)


# ---- indexing ------------------------------------------------------------------------

@register(A("index_select"))
def _index_select(L, node, x, dim, index):
    t = L.tensor(x)
    i = L.tensor(index)
    if L.rank(t) == 0:
        # A 0-dim source takes one index, 0 (eager checks it): the value itself.
        return t
    if L.rank(i) == 0:
        i = L.op("reshape", i, shape=[1])
    return L.op("index_select", t, i, dim=_norm_dim(dim, L.rank(t)))


@register(A("index"))
@register(A("_unsafe_index"))
def _index(L, node, x, indices):
    """`x[i0, i1, ...]` with integer index tensors on some dims (`None` for a dim taken whole):
    one gather. The indexed dims are brought together (in front when a whole dim separates
    them, as eager places the result's dims then), flattened into one, and read through the
    linear index `sum_j i_j * stride_j` of the broadcast index tensors; negative indices count
    from the end. The result is `pre + broadcast(indices) + post`, as in eager: Swin's
    relative-position bias table; transformers' masks, which index a position grid with
    broadcast `arange`s; `_unsafe_index` (indices known in range) is the same read: the
    decompositions of `interpolate` (bilinear, nearest) gather through it. Boolean masks
    (sizes the data decides) stay ATen's."""
    xv = x.meta.get("val")
    if not is_tensor_meta(xv) or xv.dim() == 0:
        raise Unsupported("index into a 0-dim source")
    dims = [d for d, i in enumerate(indices) if i is not None]
    for d in dims:
        iv = indices[d].meta.get("val") if isinstance(indices[d], torch.fx.Node) else None
        if not is_tensor_meta(iv) or iv.dtype not in (torch.int64, torch.int32):
            raise Unsupported("index with a boolean or non-tensor index")
    if not dims:
        raise Unsupported("index with no index tensor")
    v = node.meta["val"]
    t = L.tensor(x)
    rank = xv.dim()
    if dims != list(range(dims[0], dims[-1] + 1)):  # separated: indexed dims to the front
        rest = [d for d in range(rank) if d not in dims]
        t = L.op("permute", t, dims=dims + rest)
        sizes = [xv.shape[d] for d in dims + rest]
        first = 0
    else:
        sizes = list(xv.shape)
        first = dims[0]
    m = len(dims)
    lin = None
    stride = 1
    for j in reversed(range(m)):
        n = sizes[first + j]
        i = L.tensor(indices[dims[j]], torch.int64)
        i = L.op("where", L.op("lt", i, L.scalar(0, torch.int64)), L.op("add", i, _size_scalar(L, n, torch.int64)), i)
        if j != m - 1:
            i = L.op("mul", i, _size_scalar(L, stride, torch.int64))
        lin = i if lin is None else L.op("add", i, lin)
        stride = stride * n
    bshape = torch.broadcast_shapes(*[indices[d].meta["val"].shape for d in dims])
    count = 1
    for b in bshape:
        count = count * b
    if L.shape_of(lin) != [sym_str(b) for b in bshape]:
        lin = L.op("expand", lin, shape=L.sizes(bshape))
    flat = L.op("reshape", lin, shape=[sym_val(count)])
    pre, post = sizes[:first], sizes[first + m:]
    if m > 1:
        t = L.op("reshape", t, shape=L.sizes(pre + [stride] + post))
    rows = L.op("index_select", t, flat, dim=first)
    return L.op("reshape", rows, shape=L.sizes(v.shape))


@register(A("flip"))
def _flip(L, node, x, dims):
    """`flip`: each dim read backwards through an index `n-1, n-2, ..., 0` (cumsum's backward
    flips the gradient, scans and flips back). Symbolic lengths stay ATen's."""
    xv = x.meta["val"]
    t = L.tensor(x)
    for d in sorted({_norm_dim(d, xv.dim()) for d in dims}):
        n = xv.shape[d]
        if not isinstance(n, int):
            raise Unsupported("flip along a symbolic size")
        if n > 1:
            t = L.op("index_select", t, L.op("iota", len=n, start=n - 1, step=-1, dtype="i64"), dim=d)
    return t


@register(A("embedding"))
def _embedding(L, node, w, idx, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    v = node.meta["val"]
    i = L.tensor(idx)
    n = idx.meta["val"].numel()
    flat = L.op("reshape", i, shape=[sym_val(n)])
    rows = L.op("index_select", L.tensor(w), flat, dim=0)
    return L.op("reshape", rows, shape=L.sizes(v.shape))


@register(A("gather"))
def _gather(L, node, x, dim, index, sparse_grad=False):
    t = L.tensor(x)
    if L.rank(t) == 0:
        raise Unsupported("gather on a 0-dim tensor")
    return L.op("gather", t, L.tensor(index), dim=_norm_dim(dim, L.rank(t)))


@register(A("scatter"))
def _scatter(L, node, x, dim, index, src=None, value=None, reduce=None):
    """`scatter` that writes one element per row along `dim` (`index` has size 1 there and
    the full size elsewhere: the loss's one-hot gradient) is pointwise: where the position
    along `dim` equals the row's index, the source, else `x`. Indices out of range write
    nothing here (eager raises; the loss validated its targets in the forward). Other
    scatters run through ATen."""
    v = node.meta["val"]
    r = v.dim()
    if reduce is not None or r == 0:
        raise Unsupported("scatter with a reduction or on a 0-dim tensor")
    d = _norm_dim(dim, r)
    ishape = list(index.meta["val"].shape)
    if len(ishape) != r or ishape[d] != 1 or any(ishape[k] != v.shape[k] for k in range(r) if k != d):
        raise Unsupported("scatter of more than one element per row")
    if src is None:
        src = value
    if isinstance(src, torch.fx.Node) and list(src.meta["val"].shape) != ishape:
        raise Unsupported("scatter source of another shape than the index")
    hit = L.op("eq", _dim_index(L, v.shape[d], d, r), L.cast(L.tensor(index), torch.int64))
    return L.op("where", hit, L.tensor(src, v.dtype), L.tensor(x, v.dtype))


@register(A("cat"))
def _cat(L, node, tensors, dim=0):
    v = node.meta["val"]
    parts = [t for t in tensors if not (t.meta["val"].dim() == 1 and t.meta["val"].shape[0] == 0)]
    if not parts:
        raise Unsupported("cat of empty tensors")
    ids = [L.tensor(t, v.dtype) for t in parts]
    if len(ids) == 1:
        return ids[0]
    return L.op("cat", *ids, dim=_norm_dim(dim, v.dim()))


def _dim_index(L, size, d, rank):
    """The index along dim `d` (i64), shaped to broadcast against a rank-`rank` tensor."""
    i = L.op("iota", len=L.size(size), start=0, step=1, dtype="i64")
    if rank == 1:
        return i
    shape = [1] * rank
    shape[d] = L.size(size)
    return L.op("reshape", i, shape=shape)


def _dim_mask(L, size, d, rank, lo, hi):
    """A bool mask broadcastable to a rank-`rank` tensor: True where index `d` is in [lo, hi)
    (bounds are ints or SymInts)."""
    i = _dim_index(L, size, d, rank)
    return L.op("and", L.op("ge", i, _size_scalar(L, lo, torch.int64)), L.op("lt", i, _size_scalar(L, hi, torch.int64)))


@register(A("slice_scatter"))
def _slice_scatter(L, node, base, src, dim=0, start=None, end=None, step=1):
    """`base` with `src` written into a slice of `dim`: `src` padded to `base`'s shape where
    the slice is, `base` elsewhere (one pointwise kernel; the backward of slicing and of
    `cat`, e.g. RoPE's rotate_half, is this on a zero base). A slice with a step (the
    backward of Swin's `x[:, 0::2, 1::2]` patch merging) spreads `src` first: each element
    followed by `step - 1` zeros."""
    v = node.meta["val"]
    r = v.dim()
    d = _norm_dim(dim, r)
    size = v.shape[d]
    start = 0 if start is None else start
    end = size if end is None else end
    if not all(isinstance(a, int) for a in (size, start, end)):
        if step != 1:
            raise Unsupported("slice_scatter with a step over symbolic sizes")
        return _slice_scatter_symbolic(L, v, base, src, d, start)
    start = min(max(start + size if start < 0 else start, 0), size)
    end = min(max(end + size if end < 0 else end, start), size)
    if step != 1:
        return _slice_scatter_stepped(L, v, base, src, d, start, end, step)
    if src.meta["val"].shape[d] != end - start:
        raise Unsupported("slice_scatter source does not fit the slice")
    b = L.tensor(base, v.dtype)
    x = L.tensor(src, v.dtype)
    if end - start == 0:
        return b
    pads = [p for k in range(r) for p in ((start, size - end) if k == d else (0, 0))]
    padded = L.op("pad", x, pads=list(pads), value=_lit(0, v.dtype)) if any(pads) else x
    if start == 0 and end == size:
        return padded
    return L.op("where", _dim_mask(L, size, d, r, start, end), padded, b)


def _slice_scatter_stepped(L, v, base, src, d, start, end, step):
    """`slice_scatter` along `d` of static size with a step > 1, `start` and `end` already in
    range: `src` spread to every `step`-th position from `start` (a reshape that adds a dim,
    padded with zeros to `step`, folded back), `base` elsewhere."""
    r, size = v.dim(), v.shape[d]
    if not isinstance(step, int) or step < 1:
        raise Unsupported("slice_scatter with a symbolic step")
    m = len(range(start, end, step))
    sv = src.meta["val"]
    if list(sv.shape[:d]) + list(sv.shape[d + 1:]) != list(v.shape[:d]) + list(v.shape[d + 1:]) or sv.shape[d] != m:
        raise Unsupported("slice_scatter source does not fit the slice")
    b = L.tensor(base, v.dtype)
    if m == 0:
        return b
    zero = _lit(0, v.dtype)
    shape = L.sizes(list(sv.shape))
    x = L.op("reshape", L.tensor(src, v.dtype), shape=shape[:d + 1] + [1] + shape[d + 1:])
    x = L.op("pad", x, pads=[p for k in range(r + 1) for p in ((0, step - 1) if k == d + 1 else (0, 0))], value=zero)
    x = L.op("reshape", x, shape=shape[:d] + [m * step] + shape[d + 1:])
    total = start + m * step
    x = L.op("pad", x, pads=[p for k in range(r) for p in ((start, max(size - total, 0)) if k == d else (0, 0))], value=zero)
    if total > size:
        x = L.op("slice", x, dim=d, start=0, len=size, step=1)
    i64 = torch.int64
    rel = L.op("sub", _dim_index(L, size, d, r), L.scalar(start, i64))
    on_step = L.op("eq", L.op("sub", rel, L.op("mul", L.op("floordiv", rel, L.scalar(step, i64)), L.scalar(step, i64))), L.scalar(0, i64))
    return L.op("where", L.op("and", _dim_mask(L, size, d, r, start, end), on_step), x, b)


def _const_size(n):
    """The value of a size (int or SymInt) when it is the same for every value of the size
    symbols, else None."""
    if isinstance(n, int):
        return n
    v = sym_value(n)
    return v.value if isinstance(v, Num) else None


def _slice_scatter_symbolic(L, v, base, src, d, start):
    """`slice_scatter` with symbolic sizes (dynamic shapes): `base` before the slice, `src`,
    `base` after it, concatenated along `d`, when the parts of `base` have constant lengths
    (the backward of `x[:, 1:]` or `x[:, :-1]`, as in a language model's shifted loss)."""
    size = v.shape[d]
    n = src.meta["val"].shape[d]
    lo = start.meta.get("val") if isinstance(start, torch.fx.Node) else start
    if not isinstance(lo, (int, torch.SymInt)):
        raise Unsupported("slice_scatter with a non-integer start")
    if isinstance(lo, int) and lo < 0:
        lo = size + lo
    head, tail = _const_size(lo), _const_size(size - lo - n)
    if head is None or tail is None or head < 0 or tail < 0:
        raise Unsupported("slice_scatter with symbolic bounds other than constant margins")
    b = L.tensor(base, v.dtype)
    parts = [L.op("slice", b, dim=d, start=0, len=head, step=1)] if head else []
    parts.append(L.tensor(src, v.dtype))
    if tail:
        parts.append(L.op("slice", b, dim=d, start=L.size(size - tail), len=tail, step=1))
    return parts[0] if len(parts) == 1 else L.op("cat", *parts, dim=d)


@register(A("select_scatter"))
def _select_scatter(L, node, base, src, dim, index):
    """`base` with `src` written at `index` of `dim` (the backward of `select`)."""
    v = node.meta["val"]
    r = v.dim()
    d = _norm_dim(dim, r)
    size = v.shape[d]
    if not isinstance(index, int):
        raise Unsupported("select_scatter with a symbolic index")
    index = index + size if index < 0 else index  # a SymInt when the size is symbolic
    shape = list(src.meta["val"].shape)
    shape.insert(d, 1)
    x = L.op("reshape", L.tensor(src, v.dtype), shape=L.sizes(shape))
    return L.op("where", _dim_mask(L, size, d, r, index, index + 1), x, L.tensor(base, v.dtype))


@register(A("stack"))
def _stack(L, node, tensors, dim=0):
    """`cat` of the tensors, each with a size-1 dim inserted at `dim`."""
    v = node.meta["val"]
    d = _norm_dim(dim, v.dim())
    shape = list(v.shape)
    shape[d] = 1
    ids = [L.op("reshape", L.tensor(t, v.dtype), shape=L.sizes(shape)) for t in tensors]
    return ids[0] if len(ids) == 1 else L.op("cat", *ids, dim=d)


def _channels_last_strides(shape):
    """The channels_last strides of a 4-d `shape` (ints or SymInts, as the sizes are)."""
    n, c, h, w = shape
    return [c * h * w, 1, w * c, c]


# [Note: convolution layout] cuDNN's fast kernels on the H100 and oneDNN's on the CPU are
# channels_last: given NCHW tensors, cuDNN converts them (ResNet-18 fp32 training on the H100:
# 1.45 of 7.2 ms per step in nchwToNhwc/nhwcToNchw kernels). Where `conv_channels_last` says
# so, a graph's 2-d convolutions run channels_last: the input is laid out channels_last (a
# `layout` that the kernel computing it writes directly, elided where it is stored that way
# anyway: the BatchNorm and ReLU after the previous convolution inherit its layout), the result
# is declared channels_last, and a graph output gets eager's strides back (`Lowerer.relaid`).
# In training, the forward's saved tensors stay channels_last (free-layout outputs, see
# `Lowerer.free_layout`), the backward is compiled for them, and its convolution_backward
# takes channels_last gradients and returns a channels_last input gradient. Weights stay
# as they are (ATen lays a weight out per call, a small copy; CPU inference lays a
# parameter out once under freeze_weights, and keeps eager's layout for a convolution whose
# weight outweighs its activations: [Note: weight-heavy CPU convolutions]).


def _conv_info(n, device=None):
    """(input numel, weight meta, groups, output spatial numel) of a 2-d, not transposed
    convolution or convolution_backward node with static sizes; None otherwise. For a CPU
    `device` the activations' sizes may be symbolic too (oneDNN; GPU convolutions with
    symbolic sizes keep eager's layout: not measured there): the counts are then their traced
    values (for layout choices, which need no exact size); None where a value is unknown."""
    symbolic = device is not None and device.type == "cpu"
    a = n.args
    if n.target is torch.ops.aten.convolution.default:
        x, w, transposed, groups, out = a[0], a[1], a[6], a[8], n.meta.get("val")
    else:
        x, w, transposed, groups, out = a[1], a[2], a[7], a[9], a[0].meta.get("val") if isinstance(a[0], torch.fx.Node) else None
    xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    wv = w.meta.get("val") if isinstance(w, torch.fx.Node) else None
    if transposed or not all(is_tensor_meta(v) for v in (xv, wv, out)) or xv.dim() != 4:
        return None
    if any(not isinstance(d, int) for d in wv.shape) or (not symbolic and any(not isinstance(d, int) for d in (*xv.shape, *out.shape))):
        return None
    xs, os_ = [_hint(d) for d in xv.shape], [_hint(d) for d in out.shape]
    if None in xs or None in os_:
        return None
    return math.prod(xs), wv, groups, os_[0] * os_[2] * os_[3]


def conv_channels_last(gm, kind, device, option) -> bool:
    """Whether the 2-d convolutions of `gm` (a graph of `kind`: inference, forward, backward)
    run channels_last ([Note: convolution layout]). `option`: the conv_layout option, or for a
    backward the forward's choice."""
    if isinstance(option, bool):
        return option
    convs = [n for n in gm.graph.nodes if n.op == "call_function"
             and n.target in (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)]
    if option == "eager" or device is None or not convs:
        return False
    infos = [_conv_info(n, device) for n in convs]
    if any(i is None for i in infos):
        return False
    if option == "channels_last":
        return True
    if device.type != "cuda":
        # oneDNN. Not where the weights ATen would lay out channels_last in every call
        # outweigh the activations (a batch of one: ResNet-18 inference 22 ms in eager's layout,
        # 36 channels_last). Inference gains otherwise (ResNet-18 b8 136 -> 108 ms). Training
        # steps gained only with grouped convolutions, whose NCHW kernels and gradients are
        # oneDNN's slow ones (b4 128², ms per step in eager's layout -> channels_last:
        # MobileNet-v3-small 23.2 -> 19.4, MNASNet 47.1 -> 38.4, EfficientNet-B0 66.7 -> 61.1,
        # RegNetY-400MF 56.0 -> 52.4, ConvNeXt-T 228.8 -> 227.3); without them they lost
        # (ResNet-18 60.3 -> 79.3).
        if kind != "inference" and not any(g > 1 for _, _, g, _ in infos):
            return False
        acts = sum(x for x, _, _, _ in infos)
        weights = sum(w.numel() for _, w, _, _ in infos if _cl_weight_differs(w))
        return acts >= weights
    # On the GPU: not when every convolution is small (few channels: little to gain), nor
    # where convolutions grouped across several channels per group (not depthwise) matter:
    # those ran slower channels_last. Depthwise convolutions (one channel per group) gain.
    if all(w.shape[0] <= 64 and w.shape[1] <= 64 for _, w, _, _ in infos):
        return False
    flops = [(sp * w.shape[0] * w.shape[1] * w.shape[2] * w.shape[3], g > 1 and w.shape[1] > 1) for _, w, g, sp in infos]
    grouped = sum(f for f, gr in flops if gr)
    if kind != "inference":
        return grouped == 0
    return grouped * 3 <= sum(f for f, _ in flops)


def _cl_operand(L, x):
    """FX tensor `x` as a channels_last IR value (one `layout` per value, remembered so that
    a saved output of `x` is returned as it)."""
    i = L.tensor(x)
    if i not in L.cl_inputs:
        L.cl_inputs[i] = L.layout(i, _channels_last_strides(list(x.meta["val"].shape)))
    return L.cl_inputs[i]


def _cl_weight_differs(w) -> bool:
    """Whether contiguous weight meta `w` (O, I, kH, kW) is not channels_last as it is (a
    kernel wider than 1x1 over more than one input channel): ATen would lay it out per call."""
    return is_tensor_meta(w) and w.dim() == 4 and w.is_contiguous() and not w.is_contiguous(memory_format=torch.channels_last)


def _cl_extern(L, node, cl_args, cl_results, **extern_kw):
    """`node` as an extern call ([Note: convolution layout]) whose FX tensor arguments
    `cl_args` are given channels_last (their layouts, elided where stored so) and whose
    results at `cl_results` (result paths: () for a lone tensor, (0,) for a tuple's first)
    are declared channels_last, a graph output among them getting eager's strides back."""
    val = node.meta["val"]

    def at(v, path):
        for k in path:
            v = v[k]
        return v
    saved = {a: L.env[a] for a in cl_args}
    for a in cl_args:
        L.env[a] = _cl_operand(L, a)
    try:
        out = L.extern(node, out_strides={p: _channels_last_strides(list(at(val, p).shape)) for p in cl_results}, **extern_kw)
    finally:
        L.env.update(saved)
    for p in cl_results:
        L.relaid[at(out, p)] = list(at(val, p).stride())
    return out


@register(A("convolution"))
def _convolution(L, node, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A 2-d convolution channels_last where the graph's convolutions run so ([Note:
    convolution layout]); elsewhere ATen's with eager's layouts."""
    src, val = x.meta["val"], node.meta["val"]
    wv = weight.meta.get("val")
    # On the GPU a library convolution ([Note: library convolutions]) where the option allows;
    # one channels_last in eager already (a channels_last model) needs no layout decision.
    library = (L.device.type == "cuda" and L.library_convs and _conv_info(node) is not None and src.dtype.is_floating_point
               and isinstance(weight, torch.fx.Node) and is_tensor_meta(wv) and wv.dtype == src.dtype)
    if library and _is_cl(src) and _is_cl(val):
        return _library_conv(L, node, x, weight, bias, stride, padding, dilation, groups, _cl_weight_differs(wv))
    if (not L.conv_cl or _conv_info(node, L.device) is None or not src.dtype.is_floating_point
            or not src.is_contiguous() or not val.is_contiguous()):
        raise Unsupported("convolution runs with eager's layout")
    # A parameter or buffer of a CPU graph whose weights are laid out once ([Note: CPU convolutions]).
    static_weight = (L.device.type == "cpu" and isinstance(weight, torch.fx.Node) and weight.op == "placeholder"
                     and L.arg_index.get(weight) in L.static_inputs)
    one = is_tensor_meta(wv) and wv.dim() == 4 and wv.is_contiguous() and not _cl_weight_differs(wv)
    if (L.device.type == "cpu" and L.saved_from is None and L.conv_layout == "auto" and (_cl_weight_differs(wv) or one)
            and _hint(wv.numel()) > (4 if one else 1) * ((_hint(src.numel()) or 0) + (_hint(val.numel()) or 0)) and not static_weight):
        # [Note: weight-heavy CPU convolutions] A channels_last convolution takes its weight
        # channels_last, and ATen lays a contiguous one out on every call: a strided copy
        # that, for a weight larger than the activations, costs more than the convolution's
        # operands in eager's layout (DeepLabV3's atrous 3x3 convolutions over 960 channels
        # at 8x8: 1.19 ms per call each). In inference such a convolution keeps eager's
        # layout; oneDNN then reorders the weight itself (a weight laid out once, under
        # freeze_weights, stays channels_last). Its input is given contiguous, as eager's: a
        # channels_last input (its producer stores the other convolutions' layout) made ATen
        # take the channels_last path and lay the weight out anyway (timm ResNet-26d's last
        # stage at 4x4: 512x512 3x3 convolutions 3.41 ms each against eager's 1.16). A 1x1
        # weight is channels_last as it is, but oneDNN's channels_last path is slow where it
        # is four times the activations (ResNeXt-50's last stage, 1024 -> 2048 channels at
        # 4x4 on 4 images: 1.86 ms against 0.83 in eager's layout); below that it was faster
        # or even. The kernels between the layouts keep their strides short ([Note: inner dim
        # by stride] in braze-codegen).
        L.reasons[op_name(node.target)] = "Unsupported: convolution runs with eager's layout (its weight outweighs its activations)"
        saved = L.env[x]
        L.env[x] = L.layout(L.tensor(x), list(src.stride()))
        try:
            return L.extern(node)
        finally:
            L.env[x] = saved
    if static_weight and is_tensor_meta(wv) and wv.dim() == 4 and wv.is_contiguous():
        # A parameter's channels_last copy made once ([Note: CPU convolutions]).
        spec = CpuConv(stride, padding, dilation, groups)
        L.reasons[spec.__name__] = "library convolution, weight laid out once"
        return _cl_extern(L, node, (x,), [()], target=spec, call_args=(x, weight, bias), name=spec.__name__, island=False)
    # On the GPU a weight ATen would lay out inside every call is laid out by a braze kernel; a
    # saved weight reaches the backward's convolution channels_last too. (Not on the CPU:
    # oneDNN reorders a weight into its blocked format anyway, and a channels_last copy first
    # made ResNet-18 b8 inference 153 -> 183 ms.)
    cl_weight = L.device.type == "cuda" and isinstance(weight, torch.fx.Node) and _cl_weight_differs(wv)
    if library:
        return _library_conv(L, node, x, weight, bias, stride, padding, dilation, groups, cl_weight)
    return _cl_extern(L, node, (x, weight) if cl_weight else (x,), [()])


def _is_cl(t) -> bool:
    """Whether tensor meta `t` is a dense 4-d channels_last tensor."""
    return is_tensor_meta(t) and t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)


def _library_conv(L, node, x, weight, bias, stride, padding, dilation, groups, cl_weight):
    """A channels_last 2-d convolution as braze's own `conv` op, run by cuDNN inside braze's
    runs ([Note: library convolutions] in braze-runtime): the input and weight channels_last
    (laid out by braze kernels where they are not), the result channels_last, a bias added
    by the kernel that reads the result."""
    from . import cuda

    val = node.meta["val"]
    if not cuda.cudnn_ready() or val.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise Unsupported("convolution through ATen (no cuDNN)")
    if not (cl_weight or weight.meta["val"].is_contiguous(memory_format=torch.channels_last)):
        raise Unsupported("convolution weight neither contiguous nor channels_last")
    c_to = _padded_channels(x.meta["val"], groups)
    if c_to:
        xi, wi = _channels_padded(L, x, c_to), _channels_padded(L, weight, c_to)
    else:
        xi = _cl_operand(L, x)
        wi = _cl_operand(L, weight) if cl_weight else L.tensor(weight)
    tf32 = val.dtype == torch.float32 and torch.backends.cudnn.allow_tf32
    pair = lambda v: [int(a) for a in pool_pair(v)]  # noqa: E731
    L.n_library_convs += 1
    r = L.op("conv", xi, wi, stride=pair(stride), padding=pair(padding), dilation=pair(dilation), groups=int(groups), tf32=tf32,
             strides=_channels_last_strides(list(val.shape)))
    if bias is not None:
        b = L.tensor(bias, val.dtype)
        r = L.op("add", r, L.op("reshape", b, shape=[sym_val(val.shape[1]), 1, 1]))
    L.relaid[r] = list(val.stride())
    return r


@register(A("convolution_backward"))
def _convolution_backward(L, node, grad_out, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask):
    """The backward of a channels_last convolution ([Note: convolution layout]): the gradient
    and the saved input channels_last (layouts elided where they are already), the input's
    gradient declared channels_last. Elsewhere ATen's with eager's layouts."""
    val = node.meta.get("val")
    gv, xv = grad_out.meta.get("val"), x.meta.get("val")
    wv = weight.meta.get("val") if isinstance(weight, torch.fx.Node) else None
    if (L.device.type == "cuda" and L.library_convs and _conv_info(node) is not None and isinstance(val, (list, tuple))
            and is_tensor_meta(wv) and gv.dtype == xv.dtype == wv.dtype and xv.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and ((L.conv_cl and gv.is_contiguous() and xv.is_contiguous() and (val[0] is None or val[0].is_contiguous()))
                 or (_is_cl(gv) and _is_cl(xv) and (val[0] is None or _is_cl(val[0]))))):
        return _library_conv_backward(L, node, grad_out, x, weight, stride, padding, dilation, groups, mask)
    # A CPU 1x1 convolution with a stride: its weight gradient as ATen gets it right ([Note:
    # strided 1x1 weight gradients] in cpu_conv.py).
    fix = (L.device.type == "cpu" and mask[1] and is_tensor_meta(wv) and strided_pointwise(wv.shape, stride, padding, transposed))
    call = {"target": strided_pointwise_backward, "island": False} if fix else {}
    if (not L.conv_cl or _conv_info(node, L.device) is None or not xv.dtype.is_floating_point or not gv.is_contiguous()
            or not isinstance(val, (list, tuple)) or (val[0] is not None and not val[0].is_contiguous())):
        if fix and _is_cl(xv):  # a channels_last model's, with eager's layouts
            return L.extern(node, **call)
        raise Unsupported("convolution_backward runs with eager's layouts")
    # On the GPU the weight as the forward laid it out, and its gradient (channels_last from
    # ATen) declared so: a braze kernel lays it into the parameter's strides.
    cl_weight = L.device.type == "cuda" and _cl_weight_differs(weight.meta.get("val"))
    args = (grad_out,) + ((x,) if xv.is_contiguous() else ()) + ((weight,) if cl_weight else ())
    results = [p for p, on in (((0,), True), ((1,), cl_weight)) if on and is_tensor_meta(val[p[0]])]
    return _cl_extern(L, node, args, results, **call)


def _padded_channels(xv, groups) -> int:
    """The channel count a library convolution's input is zero-padded to, 0 for none: a
    16-bit input of fewer than 8 channels (a stem's RGB image) padded to 8, which cuDNN's
    tensor-core engines need (16-byte rows). Unpadded, cuDNN's heuristic picks a generic
    engine for ResNet-50's 7x7 stem over 3 channels (bf16, b64: 0.77 ms on the H100, against
    0.39 + 0.05 ms for ATen's, whose engine pads the channels itself)."""
    c = xv.shape[1]
    if groups != 1 or xv.dtype not in (torch.float16, torch.bfloat16) or not isinstance(c, int) or c >= 8:
        return 0
    return 8


def _channels_padded(L, t, c_to):
    """FX tensor `t` (N, C, H, W) zero-padded to `c_to` channels, stored channels_last (one
    kernel reads `t` and writes it so)."""
    v = t.meta["val"]
    shape = list(v.shape)
    pads = [0, 0, 0, c_to - shape[1], 0, 0, 0, 0]
    i = L.tensor(t, v.dtype)
    p = L.op("pad", i, pads=list(pads), value=_lit(0, v.dtype))
    return L.layout(p, _channels_last_strides([shape[0], c_to] + shape[2:]))


def _library_conv_backward(L, node, grad_out, x, weight, stride, padding, dilation, groups, mask):
    """The gradients of a library convolution ([Note: library convolutions] in braze-runtime),
    each braze's own op: the input's (`conv dir=data`) and the weight's (`conv dir=filter`)
    run by cuDNN inside braze's runs, channels_last (graph outputs get eager's strides back),
    and the bias's a reduction of the output gradient over N, H, W."""
    from . import cuda

    if not cuda.cudnn_ready():
        raise Unsupported("convolution_backward through ATen (no cuDNN)")
    val = node.meta["val"]
    xv, wv = x.meta["val"], weight.meta["val"]
    gi = _cl_operand(L, grad_out)
    tf32 = xv.dtype == torch.float32 and torch.backends.cudnn.allow_tf32
    pair = lambda v: [int(a) for a in pool_pair(v)]  # noqa: E731
    common = dict(stride=pair(stride), padding=pair(padding), dilation=pair(dilation), groups=int(groups), tf32=tf32)
    dx = dw = db = None
    # Inputs of few channels padded as the forward's (`_padded_channels`); the gradients
    # computed for the padded channels and sliced.
    c_to = _padded_channels(xv, groups)
    c = xv.shape[1]
    unpad = lambda t: L.op("slice", t, dim=1, start=0, len=sym_val(c), step=1) if c_to else t  # noqa: E731
    if mask[0] and val[0] is not None:
        if c_to:
            wi = _channels_padded(L, weight, c_to)
        elif _cl_weight_differs(wv):
            wi = _cl_operand(L, weight)
        elif wv.is_contiguous(memory_format=torch.channels_last):
            wi = L.tensor(weight)
        else:
            raise Unsupported("convolution weight neither contiguous nor channels_last")
        shape = [xv.shape[0], c_to or c, xv.shape[2], xv.shape[3]]
        dx = unpad(L.op("conv", gi, wi, dir="data", spatial=[sym_val(xv.shape[2]), sym_val(xv.shape[3])], strides=_channels_last_strides(shape), **common))
        L.relaid[dx] = list(val[0].stride())
        L.n_library_convs += 1
    if mask[1] and val[1] is not None:
        xi = _channels_padded(L, x, c_to) if c_to else _cl_operand(L, x)
        shape = [wv.shape[0], c_to or wv.shape[1], wv.shape[2], wv.shape[3]]
        dw = unpad(L.op("conv", xi, gi, dir="filter", spatial=[sym_val(wv.shape[2]), sym_val(wv.shape[3])], strides=_channels_last_strides(shape), **common))
        L.relaid[dw] = list(val[1].stride())
        L.n_library_convs += 1
    if mask[2] and val[2] is not None:
        db = L.op("sum", gi, dims=[0, 2, 3], keepdim=False)
    return (dx, dw, db)


@register(A("max_pool2d_with_indices_backward"))
def _max_pool2d_backward(L, node, grad_out, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """braze's gather ([Note: max-pool backward by candidates]); where it does not apply,
    ATen's max-pool backward, in a graph of channels_last convolutions ([Note: convolution
    layout]) in the layout of `x` (channels_last there: ATen converts the gradient and indices
    to it, so they are given channels_last and its result is declared so), elsewhere with
    eager's layouts."""
    val = node.meta.get("val")
    out = _max_pool2d_backward_gather(L, node, grad_out, kernel_size, stride, padding, dilation, indices)
    if out is not None:
        return out
    metas = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in (grad_out, x, indices)]
    if (not L.conv_cl or not all(is_tensor_meta(v) and v.dim() == 4 and v.is_contiguous() for v in metas)
            or not is_tensor_meta(val) or not val.is_contiguous() or any(not isinstance(d, int) for v in metas for d in v.shape)):
        raise Unsupported("max_pool2d_with_indices_backward runs with eager's layouts")
    return _cl_extern(L, node, (grad_out, x, indices), [()])


def _max_pool2d_backward_gather(L, node, grad_out, kernel_size, stride, padding, dilation, indices):
    """The input gradient of a 2-d max pool as one pointwise computation, or None where it
    does not apply (dilation, symbolic sizes, integer gradients).

    [Note: max-pool backward by candidates]
    Input row `h` lies in the windows of the output rows `o` with `o * s <= h + p < o * s + k`:
    at most ceil(k / s) of them, `o_j = (h + p) // s - j` for `j < ceil(k / s)`, at window row
    `h + p - o_j * s`; columns the same. An input element's gradient is the sum, over its
    candidate outputs (four for ResNet's 3x3 stride-2 pool), of the output gradient where that
    output's maximum is this element: where its int8 window offset (decomp.py's
    ``_max_pool2d_with_offsets``) is this element's window position, or, when the indices did
    not come from offsets, where its index is this element's flat position. The candidates'
    rows and columns are 1-d values of the row and column alone (32-bit, [Note: 32-bit
    integer division]); the output gradient and offsets are read through `index_select`. It
    fuses into its consumers (a ReLU's backward, BatchNorm's backward reductions), and the
    int64 indices are never stored. ResNet-18 b32 fp32 training on the H100: ATen's kernel
    took 0.24 ms of a step and writing the indices for it 0.05 ms; with the gather the step
    went from 5.12 to 4.97 ms. On the 2-core CPU ResNet-18 b8 training steps took the same
    time either way (703 ms). An earlier form that summed every window position (nine taps of
    strided, shifted views, each with 64-bit index arithmetic) took 2.95 ms fused into
    BatchNorm's backward on the GPU, and twice ATen's time on the CPU."""
    val, gv = node.meta.get("val"), grad_out.meta.get("val")
    k, p, d = pool_pair(kernel_size), pool_pair(padding), pool_pair(dilation)
    s = pool_pair(stride) if stride else k
    if (len(k) != 2 or d != [1, 1] or not is_tensor_meta(val) or not is_tensor_meta(gv) or not val.dtype.is_floating_point
            or val.dim() not in (3, 4) or any(not isinstance(n, int) for n in (*val.shape, *gv.shape))):
        return None
    r = val.dim()
    (h, w), (ho, wo) = val.shape[-2:], gv.shape[-2:]
    ct, i32 = _acc_dtype(val.dtype), torch.int32
    src = indices.args if isinstance(indices, torch.fx.Node) and indices.target is _prim("_low_memory_max_pool_offsets_to_indices") else None
    if src is not None and not (pool_pair(src[1]) == k and (pool_pair(src[3]) if src[3] else k) == s and pool_pair(src[4]) == p):
        src = None
    if max(h, w) * (max(s) + max(k) + max(p) + 1) >= 2**31:
        return None

    def candidates(n_in, n_out, kk, ss, pp, dim):
        # Per candidate j: (output position, clamped for reading; valid; window position), 1-d.
        pos = L.op("iota", len=n_in, start=pp, step=1, dtype="i32")
        first = L.op("floordiv", pos, L.scalar(ss, i32))
        out = []
        for j in range(-(-kk // ss)):
            o = L.op("sub", first, L.scalar(j, i32))
            at = L.op("sub", pos, L.op("mul", o, L.scalar(ss, i32)))
            ok = L.op("and", L.op("and", L.op("ge", o, L.scalar(0, i32)), L.op("lt", o, L.scalar(n_out, i32))), L.op("lt", at, L.scalar(kk, i32)))
            read = L.op("min", L.op("max", o, L.scalar(0, i32)), L.scalar(n_out - 1, i32))
            out.append((read, _along(L, ok, n_in, dim, r), _along(L, at, n_in, dim, r)))
        return out

    if src is not None:
        def hit(f, rat, cat):
            # The output's window offset is this element's position in its window.
            return L.op("eq", L.cast(f, i32), L.op("add", L.op("mul", rat, L.scalar(k[1], i32)), cat))
        found = L.tensor(src[0])
    else:
        here = _flat_position(L, (h, w), r)

        def hit(f, rat, cat):
            return L.op("eq", f, here)
        found = L.tensor(indices)
    rows, cols = candidates(h, ho, k[0], s[0], p[0], r - 2), candidates(w, wo, k[1], s[1], p[1], r - 1)
    total = _sum_over_candidates(L, L.tensor(grad_out, ct), found, rows, cols, hit, r, ct)
    return L.eager_layout(L.cast(total, val.dtype), val)


def _sum_over_candidates(L, g, found, rows, cols, hit, r, ct):
    """A pool's input gradient in gather form: for each input element, the sum over its
    candidate outputs (`rows` x `cols`, each `(index to read, valid, extra)`: 1-d indices
    into the output's last two dims, masks and values broadcast against the input) of the
    output gradient `g` where the candidate is valid and `hit(found at the candidate, the
    row's extra, the column's)` says its maximum is this element."""
    zero, total = L.scalar(0, ct), None
    for ro, rok, rx in rows:
        for co, cok, cx in cols:
            def at(t):
                return L.op("index_select", L.op("index_select", t, ro, dim=r - 2), co, dim=r - 1)
            v = L.op("where", L.op("and", L.op("and", rok, cok), hit(at(found), rx, cx)), at(g), zero)
            total = v if total is None else L.op("add", total, v)
    return total


def _pool_window(L, x, val, kernel_size, stride, padding, dilation, ceil_mode, pad_value=-math.inf):
    """The window of a 2-d pool whose output is `val`: (kernel, strides, padding, rank,
    taps), the taps (row offset, column offset, value) being the shifted, strided views of
    the input padded with `pad_value` (a max pool's `-inf`), one per window position in
    row-major order. With `ceil_mode` the last windows may reach past the padded input:
    they are padded further with `pad_value` (a max pool's `-inf` never wins; an average
    pool's zeros add nothing, and its divisor, `_pool_divisor`, counts what they cover)."""
    k, p, d = pool_pair(kernel_size), pool_pair(padding), pool_pair(dilation)
    s = pool_pair(stride) if stride else k
    if len(k) != 2 or d != [1, 1]:
        raise Unsupported("pool2d: 2-d, no dilation")
    src = x.meta["val"]
    shape = list(src.shape)
    r = len(shape)
    if any(not isinstance(n, int) for n in shape + list(val.shape)) or not src.dtype.is_floating_point:
        raise Unsupported("pool2d of symbolic sizes or integers")
    ho, wo = val.shape[-2:]
    t = L.tensor(x)
    # Past the end: what the last window reads beyond the padded input (ceil_mode only).
    extra = [max(0, (o - 1) * st + kk - (n + 2 * pp)) for o, st, kk, n, pp in zip((ho, wo), s, k, shape[-2:], p)]
    if p[0] or p[1] or any(extra):
        pads = [0] * (2 * (r - 2)) + [p[0], p[0] + extra[0], p[1], p[1] + extra[1]]
        t = L.op("pad", t, pads=list(pads), value=pad_value)
    taps = []
    for di in range(k[0]):
        for dj in range(k[1]):
            v = L.op("slice", t, dim=r - 2, start=di, len=ho, step=s[0])
            taps.append((di, dj, L.op("slice", v, dim=r - 1, start=dj, len=wo, step=s[1])))
    return k, s, p, r, taps


def _window_max(L, taps):
    out = None
    for _, _, v in taps:
        out = v if out is None else L.op("max", out, v)
    return out


@register(A("max_pool2d_with_indices"))
def _max_pool2d(L, node, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """Max pooling whose indices nobody reads (inference) as the maximum of its window's
    shifted, strided views of the (-inf) padded input: one pointwise kernel that fuses the
    BatchNorm and ReLU before it (ResNet-50 b64 on the H100: ATen's pool took 0.22 ms after
    a separate BatchNorm-ReLU kernel). The indices (the backward's) stay ATen's. (Most max
    pools reach braze decomposed, decomp.py's ``_max_pool2d_with_offsets``.)"""
    for u in node.users:
        if u.target is not operator.getitem or (u.args[1] == 1 and u.users):
            raise Unsupported("max_pool2d indices are read: ATen's kernel")
    val = node.meta["val"][0]
    try:
        _, _, _, _, taps = _pool_window(L, x, val, kernel_size, stride, padding, dilation, ceil_mode)
    except Unsupported:
        # ATen's pool in a graph of channels_last convolutions (symbolic sizes on the CPU: a
        # braze window kernel there was slower than ATen's) takes and returns channels_last.
        if L.conv_cl and _is_cl_able(x.meta["val"]) and _is_cl_able(val):
            return _cl_extern(L, node, (x,), [(0,), (1,)])
        raise
    return (L.eager_layout(_window_max(L, taps), val), None)


def _is_cl_able(t) -> bool:
    """Whether tensor meta `t` is a dense row-major 4-d floating-point tensor (one a graph of
    channels_last convolutions holds channels_last instead)."""
    return is_tensor_meta(t) and t.dim() == 4 and t.is_contiguous() and t.dtype.is_floating_point


@register(A("avg_pool2d"))
def _avg_pool2d(L, node, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    """Average pooling as the sum of its window's shifted, strided views of the zero-padded
    input over the window's divisor (DenseNet's transitions; ResNet-D's shortcut pools, with
    `ceil_mode` and padding counted out): one pointwise kernel with what precedes it.
    Symbolic sizes stay ATen's."""
    val = node.meta["val"]
    ct = _acc_dtype(val.dtype)
    k, s, p, r, taps = _pool_window(L, x, val, kernel_size, stride, padding, 1, ceil_mode, pad_value=0)
    total = None
    for _, _, v in taps:
        v = L.cast(v, ct)
        total = v if total is None else L.op("add", total, v)
    div = _pool_divisor(L, r, x.meta["val"].shape[-2:], val.shape[-2:], k, s, p, count_include_pad, divisor_override, ct)
    return L.eager_layout(L.cast(L.op("div", total, div), val.dtype), val)


def _pool_divisor(L, r, size, out, k, s, p, count_include_pad, divisor_override, ct):
    """An average pool's divisor per output, as ATen's: `divisor_override`, else the window's
    extent within the padded input (with `count_include_pad`) or within the input itself.
    A scalar where every window has the whole kernel's, else a `[.., ho, wo]`-broadcast
    product of one factor per dim (the extents are separable)."""
    if divisor_override:
        return L.scalar(divisor_override, ct)
    dims = list(zip(size, out, k, s, p))

    def extent(j, n, kk, st, pp):
        b, e = j * st - pp, min(j * st - pp + kk, n + pp)
        return e - b if count_include_pad else min(e, n) - max(b, 0)
    if all(extent(j, n, kk, st, pp) == kk for n, o, kk, st, pp in dims for j in range(o)):
        return L.scalar(k[0] * k[1], ct)
    i64 = torch.int64
    factors = []
    for dim, (n, o, kk, st, pp) in enumerate(dims):
        # `extent` as arithmetic on the output index j.
        j = _dim_index(L, o, r - 2 + dim, r)
        b = L.op("sub", L.op("mul", j, L.scalar(st, i64)), L.scalar(pp, i64))
        e = L.op("min", L.op("add", b, L.scalar(kk, i64)), L.scalar(n + pp, i64))
        if not count_include_pad:
            b = L.op("max", b, L.scalar(0, i64))
            e = L.op("min", e, L.scalar(n, i64))
        factors.append(L.op("sub", e, b))
    return L.cast(L.op("mul", factors[0], factors[1]), ct)


def _shifted(L, t, dim, r, size, off, length, dtype):
    """`t` (rank `r`, `size` long on `dim`) read at `i + off` for `i` in [0, length), zeros
    where that falls outside: slices and zero pads."""
    zero = _lit(0, dtype)

    def pad(v, before, after):
        pads = [q for k in range(r) for q in ((before, after) if k == dim else (0, 0))]
        return L.op("pad", v, pads=pads, value=zero)
    if off < 0:
        t, size, off = pad(t, -off, 0), size - off, 0
    take = max(0, min(length, size - off))
    if take == 0:
        return pad(L.op("slice", t, dim=dim, start=0, len=0, step=1), 0, length)
    if off or take != size:
        t = L.op("slice", t, dim=dim, start=off, len=take, step=1)
    return pad(t, 0, length - take) if take < length else t


def _affine_index(L, n, abc):
    """The int32 `[n]` value `(iota * a + b) // c`, and its static values."""
    a, b, c = abc
    i32 = torch.int32
    x = L.op("iota", len=n, start=0, step=1, dtype="i32")
    return L.op("floordiv", L.op("add", L.op("mul", x, L.scalar(a, i32)), L.scalar(b, i32)), L.scalar(c, i32)), [(i * a + b) // c for i in range(n)]


def _along(L, v, n, dim, r):
    """A 1-d value of length `n` shaped to broadcast along `dim` of a rank-`r` tensor."""
    shape = [1] * r
    shape[dim] = n
    return L.op("reshape", v, shape=shape)


def _adaptive_windows(n_in, n_out):
    """ATen's adaptive pooling along one dim, as `(a, b, c)` of `(index * a + b) // c`:
    output `i` averages inputs `i * n_in // n_out` to `ceil((i + 1) * n_in / n_out) - 1`,
    so input `h` is in the windows of outputs `h * n_out // n_in` to `ceil((h + 1) * n_out /
    n_in) - 1`. Returns (first input, last input) per output and (first output, last
    output) per input."""
    return ((n_in, 0, n_out), (n_in, n_in - 1, n_out)), ((n_out, 0, n_in), (n_out, n_out - 1, n_in))


def _windowed_sum(L, t, dim, r, n_src, n_dst, first, last):
    """For each of `n_dst` destinations `d`, the sum of `t` along `dim` (length `n_src`)
    from `first(d)` to `last(d)` (affine indices, `_affine_index`): at most the longest
    range's reads through `index_select`, masked only where ranges differ in length."""
    lo, lo_v = _affine_index(L, n_dst, first)
    hi, hi_v = _affine_index(L, n_dst, last)
    lengths = [e - b + 1 for b, e in zip(lo_v, hi_v)]
    i32 = torch.int32
    total = None
    for j in range(max(lengths)):
        at = L.op("add", lo, L.scalar(j, i32))
        v = L.op("index_select", t, L.op("min", at, L.scalar(n_src - 1, i32)), dim=dim)
        if len(set(lengths)) > 1:
            v = L.op("where", _along(L, L.op("le", at, hi), n_dst, dim, r), v, L.scalar(0, L.dtype_of(t)))
        total = v if total is None else L.op("add", total, v)
    return total


def _window_lengths(L, n_out, first, last, dim, r, ct):
    """Each output's window length along `dim` in `ct`, broadcast there (a scalar when all
    are equal)."""
    lo, lo_v = _affine_index(L, n_out, first)
    hi, hi_v = _affine_index(L, n_out, last)
    lengths = {e - b + 1 for b, e in zip(lo_v, hi_v)}
    if len(lengths) == 1:
        return L.scalar(lengths.pop(), ct)
    n = L.op("add", L.op("sub", hi, lo), L.scalar(1, torch.int32))
    return _along(L, L.cast(n, ct), n_out, dim, r)


# The most reads an adaptive pool's output (or its gradient's input element) takes through
# braze's kernel: its windows' longest extents multiplied. Larger windows (a global pool over a
# big map) stay ATen's: each read is a line of the kernel.
ADAPTIVE_MAX_READS = 64


def _adaptive_sizes(val, src, global_ok=False):
    """(rank, input's last two sizes, output's) of a static 2-d adaptive pool whose windows
    (and, pooling up, whose outputs per input) are small enough, or raises; a global pool (a
    1x1 output) of any size where `global_ok`."""
    if (not is_tensor_meta(val) or not is_tensor_meta(src) or val.dim() not in (3, 4) or not val.dtype.is_floating_point
            or any(not isinstance(n, int) for n in (*val.shape, *src.shape))):
        raise Unsupported("adaptive pooling of symbolic sizes or integers")
    n_in, n_out = list(src.shape[-2:]), list(val.shape[-2:])
    if min(n_in + n_out) < 1 or max(n_in) * (max(n_out) + 1) >= 2**31:
        raise Unsupported("adaptive pooling of empty or very large sizes")
    if global_ok and n_out == [1, 1]:
        return val.dim(), n_in, n_out
    def most(n_in, n_out):
        # The longest window, and the most windows holding one input (`_adaptive_windows`).
        return max(max((i * n_in + n_in - 1) // n_out - i * n_in // n_out + 1 for i in range(n_out)),
                   max((h * n_out + n_out - 1) // n_in - h * n_out // n_in + 1 for h in range(n_in)))
    if most(n_in[0], n_out[0]) * most(n_in[1], n_out[1]) > ADAPTIVE_MAX_READS:
        raise Unsupported(f"adaptive pooling windows over {ADAPTIVE_MAX_READS} elements")
    return val.dim(), n_in, n_out


@register(A("_adaptive_avg_pool2d"))
def _adaptive_avg_pool2d(L, node, x, output_size):
    """Adaptive average pooling (VGG's and AlexNet's classifier pools at other than 224²
    images, pyramid pooling's levels) with ATen's windows, one dim after the other: the sum
    over each output's window (`_windowed_sum`) over its length. One pointwise kernel with
    what precedes it."""
    val = node.meta["val"]
    r, n_in, n_out = _adaptive_sizes(val, x.meta["val"])
    ct = _acc_dtype(val.dtype)
    t = L.tensor(x, ct)
    for k, dim in ((0, r - 2), (1, r - 1)):
        (first, last), _ = _adaptive_windows(n_in[k], n_out[k])
        t = L.op("div", _windowed_sum(L, t, dim, r, n_in[k], n_out[k], first, last), _window_lengths(L, n_out[k], first, last, dim, r, ct))
    return L.eager_layout(L.cast(t, val.dtype), val)


@register(A("_adaptive_avg_pool2d_backward"))
def _adaptive_avg_pool2d_backward(L, node, grad_out, x):
    """The input gradient of adaptive average pooling in gather form, one dim after the other:
    the output gradient over its window's length, summed over the outputs whose windows hold
    each input (`_adaptive_windows`). One pointwise kernel."""
    val = node.meta["val"]
    r, n_in, n_out = _adaptive_sizes(grad_out.meta["val"], val)
    ct = _acc_dtype(val.dtype)
    g = L.tensor(grad_out, ct)
    for k, dim in ((0, r - 2), (1, r - 1)):
        (first, last), (first_out, last_out) = _adaptive_windows(n_in[k], n_out[k])
        g = L.op("div", g, _window_lengths(L, n_out[k], first, last, dim, r, ct))
        g = _windowed_sum(L, g, dim, r, n_out[k], n_in[k], first_out, last_out)
    return L.eager_layout(L.cast(g, val.dtype), val)


@register(A("adaptive_max_pool2d"))
def _adaptive_max_pool2d(L, node, x, output_size):
    """Adaptive max pooling with ATen's windows (`_adaptive_windows`) and ATen's index: the
    flat input position of the first maximum in row-major order, a later NaN winning. Taken
    along the columns first, then the rows: each row's first maximum (its last NaN), then
    the first row whose maximum is greater (the last with a NaN), which is row-major order's
    choice. One pointwise kernel; the indices only where something reads them."""
    val, idx_val = node.meta["val"]
    r, n_in, n_out = _adaptive_sizes(val, x.meta["val"], global_ok=True)
    i64 = torch.int64
    wanted = any(u.target is operator.getitem and u.args[1] == 1 and u.users for u in node.users)
    if n_out == [1, 1]:
        # A global pool (CBAM's, timm's max and avg-max pools): reductions over the map. The
        # index is the first maximum (argmax over the flattened map), or where the map holds
        # NaN the last NaN's position.
        t, dims = L.tensor(x), [r - 2, r - 1]
        best = L.op("amax", t, dims=dims, keepdim=True)
        if not wanted:
            return (L.eager_layout(best, val), None)
        pos = _flat_position(L, n_in, r)
        last_nan = L.op("amax", L.op("where", L.op("isnan", t), pos, L.scalar(-1, i64)), dims=dims, keepdim=True)
        first = L.op("argmax", t, dims=dims, keepdim=True)
        at = L.op("where", L.op("ge", last_nan, L.scalar(0, i64)), last_nan, first)
        return (L.eager_layout(best, val), L.eager_layout(at, idx_val))
    best, at = L.tensor(x), None
    for k, dim in ((1, r - 1), (0, r - 2)):
        (first, last), _ = _adaptive_windows(n_in[k], n_out[k])
        lo, lo_v = _affine_index(L, n_out[k], first)
        hi, hi_v = _affine_index(L, n_out[k], last)
        uneven = len({e - b for b, e in zip(lo_v, hi_v)}) > 1
        pos = _along(L, L.cast(lo, i64), n_out[k], dim, r)
        b = a = None
        for j in range(max(e - b_ + 1 for b_, e in zip(lo_v, hi_v))):
            tap = L.op("add", lo, L.scalar(j, torch.int32))
            read = L.op("min", tap, L.scalar(n_in[k] - 1, torch.int32))
            v = L.op("index_select", best, read, dim=dim)
            # The position so far along the other dim comes with the value.
            w = L.op("index_select", at, read, dim=dim) if at is not None else None
            here = L.op("add", pos, L.scalar(j, i64))
            if b is None:
                b, a, p_ = v, w, here
                continue
            wins = L.op("or", L.op("gt", v, b), L.op("isnan", v))
            if uneven:
                wins = L.op("and", wins, _along(L, L.op("le", tap, hi), n_out[k], dim, r))
            b = L.op("where", wins, v, b)
            p_ = L.op("where", wins, here, p_)
            if w is not None:
                a = L.op("where", wins, w, a)
        best = b
        # Flat index: the row's position times the width plus the column's.
        at = p_ if at is None else L.op("add", L.op("mul", p_, L.scalar(n_in[1], i64)), a)
    out = L.eager_layout(best, val)
    return (out, L.eager_layout(at, idx_val) if wanted else None)


def _flat_position(L, size, r):
    """Each element's flat position `h * w_size + w` in the last two dims (i64), broadcast
    to rank `r`."""
    h, w = size
    return L.op("add", _along(L, L.op("iota", len=h, start=0, step=w, dtype="i64"), h, r - 2, r),
                _along(L, L.op("iota", len=w, start=0, step=1, dtype="i64"), w, r - 1, r))


@register(A("adaptive_max_pool2d_backward"))
def _adaptive_max_pool2d_backward(L, node, grad_out, x, indices):
    """The input gradient of adaptive max pooling in gather form: for each input element, the
    sum over the outputs whose windows hold it (`_adaptive_windows`, both dims) of the output
    gradient where that output's index is this element's flat position. One pointwise
    kernel."""
    val = node.meta["val"]
    r, n_in, n_out = _adaptive_sizes(grad_out.meta["val"], val, global_ok=True)
    ct, i32 = _acc_dtype(val.dtype), torch.int32
    g, idx = L.tensor(grad_out, ct), L.tensor(indices)
    here = _flat_position(L, n_in, r)
    if n_out == [1, 1]:
        # A global pool: the gradient where the element is the one index (both broadcast).
        return L.eager_layout(L.cast(L.op("where", L.op("eq", here, idx), g, L.scalar(0, ct)), val.dtype), val)
    cands = []
    for k, dim in ((0, r - 2), (1, r - 1)):
        _, (first, last) = _adaptive_windows(n_in[k], n_out[k])
        lo, lo_v = _affine_index(L, n_in[k], first)
        hi, hi_v = _affine_index(L, n_in[k], last)
        taps = []
        for j in range(max(e - b + 1 for b, e in zip(lo_v, hi_v))):
            o = L.op("add", lo, L.scalar(j, i32))
            taps.append((L.op("min", o, L.scalar(n_out[k] - 1, i32)), _along(L, L.op("le", o, hi), n_in[k], dim, r), None))
        cands.append(taps)
    total = _sum_over_candidates(L, g, idx, cands[0], cands[1], lambda f, _r, _c: L.op("eq", f, here), r, ct)
    return L.eager_layout(L.cast(total, val.dtype), val)


@register(A("avg_pool2d_backward"))
def _avg_pool2d_backward(L, node, grad_out, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """The input gradient of a 2-d average pool (DenseNet's transitions in training), in
    gather form: the output gradient divided by its window's divisor (`_pool_divisor`),
    spread onto a grid `stride` apart (reshaped next to zeros), and summed over the window's
    positions, each a shifted copy. One pointwise kernel. Symbolic sizes stay ATen's."""
    val = node.meta["val"]
    gv = grad_out.meta["val"]
    k, p = pool_pair(kernel_size), pool_pair(padding)
    s = pool_pair(stride) if stride else k
    if len(k) != 2:
        raise Unsupported("avg_pool2d_backward: 2-d windows")
    if any(not isinstance(n, int) for n in (*val.shape, *gv.shape)) or not val.dtype.is_floating_point:
        raise Unsupported("avg_pool2d_backward of symbolic sizes or integers")
    r = val.dim()
    (h, w), (ho, wo) = val.shape[-2:], gv.shape[-2:]
    ct = _acc_dtype(val.dtype)
    div = _pool_divisor(L, r, (h, w), (ho, wo), k, s, p, count_include_pad, divisor_override, ct)
    g = L.op("div", L.tensor(grad_out, ct), div)
    lead = [sym_val(n) for n in gv.shape[:-2]]
    cells = L.op("reshape", g, shape=lead + [ho, 1, wo, 1])
    if tuple(k) == tuple(s) and tuple(p) == (0, 0) and ho * s[0] <= h and wo * s[1] <= w:
        # [Note: tiled average-pool gradients] Windows that tile the input (kernel = stride,
        # no padding: DenseNet's transitions, 2x2 stride 2) give each input element exactly
        # one window: its gradient is that output's, repeated s0 x s1 times (an expand of
        # the output gradient), zero in rows and columns past the last window. The general
        # form below sums k0 x k1 shifted grids, of which all but one are zero here, and
        # computed the fused upstream gradient once per candidate (four times for 2x2).
        up = L.op("expand", cells, shape=lead + [ho, s[0], wo, s[1]])
        up = L.op("reshape", up, shape=lead + [ho * s[0], wo * s[1]])
        if ho * s[0] < h or wo * s[1] < w:
            up = L.op("pad", up, pads=[0, 0] * (r - 2) + [0, h - ho * s[0], 0, w - wo * s[1]], value=_lit(0, ct))
        return L.eager_layout(L.cast(up, val.dtype), val)
    # Output (oh, ow) lands at (oh * s0, ow * s1) of a grid of zeros.
    grid = L.op("pad", cells, pads=[0, 0] * (r - 2) + [0, 0, 0, s[0] - 1, 0, 0, 0, s[1] - 1], value=_lit(0, ct))
    grid = L.op("reshape", grid, shape=lead + [ho * s[0], wo * s[1]])
    # Input row i is in the window of output oh at position di when oh * s0 = i + p0 - di.
    total = None
    for di in range(k[0]):
        rows = _shifted(L, grid, r - 2, r, ho * s[0], p[0] - di, h, ct)
        for dj in range(k[1]):
            v = _shifted(L, rows, r - 1, r, wo * s[1], p[1] - dj, w, ct)
            total = v if total is None else L.op("add", total, v)
    return L.eager_layout(L.cast(total, val.dtype), val)


def _prim(name):
    """One of PyTorch's ``prims`` ops (the low-memory max-pool pair is registered by
    ``torch._inductor.inductor_prims``, which AOTAutograd's partitioner imports)."""
    try:
        import torch._inductor.inductor_prims  # noqa: F401
    except ImportError:
        return None
    return getattr(getattr(torch.ops.prims, name, None), "default", None)


@register(_prim("_low_memory_max_pool_with_offsets"))
def _max_pool2d_offsets(L, node, x, kernel_size, stride, padding, dilation, ceil_mode):
    """Max pooling with each output's offset in its window (int8; decomp.py's
    ``_max_pool2d_with_offsets``): one pointwise kernel over the window's shifted views, with
    ATen's choice of index: the first valid position starts the search, and a later one wins
    when it is greater or NaN; padded positions never win."""
    val, offv = node.meta["val"]
    k, s, p, r, taps = _pool_window(L, x, val, kernel_size, stride, padding, dilation, ceil_mode)
    if not any(u.target is operator.getitem and u.args[1] == 1 and u.users for u in node.users):
        return (L.eager_layout(_window_max(L, taps), val), None)
    (h, w), (ho, wo) = x.meta["val"].shape[-2:], val.shape[-2:]

    def valid(dim, size, n, tap, st, pad):
        # Output positions o whose input position o * st - pad + tap is inside [0, n).
        lo = max(0, -((tap - pad) // st))
        hi = min(size, (n - 1 + pad - tap) // st + 1)
        return _dim_mask(L, size, dim, r, lo, max(lo, hi))

    i8 = offv.dtype
    masks = [L.op("and", valid(r - 2, ho, h, di, s[0], p[0]), valid(r - 1, wo, w, dj, s[1], p[1])) for di, dj, _ in taps]
    off = L.scalar(0, i8)
    for n in reversed(range(len(taps))):
        off = L.op("where", masks[n], L.scalar(n, i8), off)
    best = L.scalar(-math.inf, x.meta["val"].dtype)
    for n, (_, _, v) in enumerate(taps):
        wins = L.op("and", masks[n], L.op("or", L.op("gt", v, best), L.op("isnan", v)))
        best = L.op("where", wins, v, best)
        off = L.op("where", wins, L.scalar(n, i8), off)
    return (L.eager_layout(best, val), L.eager_layout(off, offv))


@register(_prim("_low_memory_max_pool_offsets_to_indices"))
def _max_pool2d_offsets_to_indices(L, node, offsets, kernel_size, input_size, stride, padding, dilation):
    """The flat input index (ATen's max-pool indices) of each output's window offset:
    ``(o_h * s_h - p_h + off // k_w) * W + o_w * s_w - p_w + off % k_w``, computed in 32 bits
    where every term fits ([Note: 32-bit integer division] in braze-codegen) and widened to
    ATen's int64 at the end."""
    k, p, d = pool_pair(kernel_size), pool_pair(padding), pool_pair(dilation)
    s = pool_pair(stride) if stride else k
    val = node.meta["val"]
    shape = list(val.shape)
    r = len(shape)
    if len(k) != 2 or d != [1, 1] or any(not isinstance(n, int) for n in shape + list(input_size)):
        raise Unsupported("max_pool offsets to indices: 2-d, static, no dilation")
    i64 = torch.int64
    # The largest magnitude of any term: an output coordinate times the stride plus the window.
    bound = (max(shape[-2], shape[-1]) * max(s) + max(k) + max(p) + 1) * (input_size[-1] + 1)
    it = torch.int32 if bound < 2**31 else i64
    o = L.cast(L.tensor(offsets), it)
    kw = L.scalar(k[1], it)
    dh = L.op("floordiv", o, kw)
    dw = L.op("sub", o, L.op("mul", dh, kw))
    oh, ow = (L.cast(_dim_index(L, shape[j], r + j, r), it) for j in (-2, -1))
    ih = L.op("add", L.op("add", L.op("mul", oh, L.scalar(s[0], it)), L.scalar(-p[0], it)), dh)
    iw = L.op("add", L.op("add", L.op("mul", ow, L.scalar(s[1], it)), L.scalar(-p[1], it)), dw)
    return L.eager_layout(L.cast(L.op("add", L.op("mul", ih, L.scalar(input_size[-1], it)), iw), i64), val)


@register(A("constant_pad_nd"))
def _pad(L, node, x, pad, value=0):
    t = L.tensor(x)
    r = L.rank(t)
    pairs = [[0, 0] for _ in range(r)]
    for k in range(len(pad) // 2):
        d = r - 1 - k
        pairs[d] = [pad[2 * k], pad[2 * k + 1]]
    flat = [p for pr in pairs for p in pr]
    if any(not isinstance(p, int) for p in flat):
        pairs = [[p.meta["val"] if isinstance(p, torch.fx.Node) else p for p in pr] for pr in pairs]
        return _symbolic_pad(L, t, list(x.meta["val"].shape), pairs, value)
    shape = x.meta["val"].shape
    for d, (lo, hi) in enumerate(pairs):
        if lo < 0 or hi < 0:
            # Negative padding crops: a slice of the input.
            start, stop = max(-lo, 0), shape[d] - max(-hi, 0)
            if not isinstance(shape[d], int):
                raise Unsupported("negative padding on a symbolic dim")
            t = L.op("slice", t, dim=d, start=start, len=max(stop - start, 0), step=1)
            pairs[d] = [max(lo, 0), max(hi, 0)]
    flat = [p for pr in pairs for p in pr]
    if not any(flat):
        return t
    return L.op("pad", t, pads=list(flat), value=_lit(value, L.dtype_of(t)))


def _symbolic_pad(L, t, shape, pairs, value):
    """Padding by symbolic amounts (the attention mask padded to a multiple of 8 under
    dynamic shapes, for CUDA's memory-efficient attention): per padded dim, a `cat` of blocks
    of `value` around the tensor. Amounts not provably non-negative (a crop) stay ATen's."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not all(p >= 0 if isinstance(p, int) else statically_known_true(p >= 0) for pr in pairs for p in pr):
        raise Unsupported("symbolic padding of unknown sign")
    fill = L.scalar(value, L.dtype_of(t))
    for d, (lo, hi) in enumerate(pairs):
        if isinstance(lo, int) and isinstance(hi, int) and lo == 0 and hi == 0:
            continue
        parts = []
        for amount in (lo, None, hi):
            if amount is None:
                parts.append(t)
            elif not (isinstance(amount, int) and amount == 0):
                block = list(shape)
                block[d] = amount
                parts.append(L.op("expand", fill, shape=L.sizes(block)))
        t = L.op("cat", *parts, dim=d)
        shape[d] = shape[d] + lo + hi
    return t


def _lit(value, dtype):
    """A scalar of `dtype` as an op attribute: float, bool or int."""
    if dtype.is_floating_point:
        return float(value)
    if dtype == torch.bool:
        return bool(value)
    return int(value)


# ---- control flow: cond and while_loop with braze-compiled subgraphs ------------------

class _Cond:
    """Runs one of two compiled branches, chosen by the predicate at run time (a tensor
    predicate is read on the host, as eager's cond does)."""

    def __init__(self, t, f):
        self.t, self.f = t, f

    def __call__(self, pred, *operands):
        return tuple((self.t if bool(pred) else self.f)(list(operands)))


class _While:
    """Runs a compiled body while a compiled condition holds."""

    def __init__(self, cond, body, n_carried):
        self.cond, self.body, self.n = cond, body, n_carried

    def __call__(self, *operands):
        carried, extra = list(operands[: self.n]), list(operands[self.n:])
        while bool(self.cond(carried + extra)[0]):
            carried = list(self.body(carried + extra))
        return tuple(carried)


def _sub(L, node_or_gm, what):
    gm = L.env[node_or_gm] if isinstance(node_or_gm, torch.fx.Node) else node_or_gm
    if not isinstance(gm, torch.fx.GraphModule):
        raise Unsupported(f"{what} is not a graph")
    return L.subcompile(gm, f"{L.name}_{what}_{len(L.externs)}")


def _lower_cond(L, node):
    pred, t, f, operands = node.args[:4]
    call = _Cond(_sub(L, t, "true"), _sub(L, f, "false"))
    return L.extern(node, target=call, call_args=(pred, *operands), name="higher_order.cond[compiled]")


def _lower_while(L, node):
    cond, body, carried, extra = node.args[:4]
    call = _While(_sub(L, cond, "cond"), _sub(L, body, "body"), len(carried))
    return L.extern(node, target=call, call_args=(*carried, *extra), name="higher_order.while_loop[compiled]")


class _Subgraph:
    """One compiled subgraph called as a function (invoke_subgraph: repeated regions)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *operands):
        return tuple(self.fn(list(operands)))


def _lower_invoke_subgraph(L, node):
    gm, identifier, *operands = node.args
    sub = L.env[gm] if isinstance(gm, torch.fx.Node) else gm
    # A region invoked several times (the same GraphModule) is compiled once and reused.
    call = L.sub_cache.get(id(sub))
    if call is None:
        call = L.sub_cache[id(sub)] = _Subgraph(_sub(L, gm, "region"))
    return L.extern(node, target=call, call_args=tuple(operands), name="higher_order.invoke_subgraph[compiled]")


_BRANCHING = {}
for _op, _fn in (("cond", _lower_cond), ("while_loop", _lower_while), ("invoke_subgraph", _lower_invoke_subgraph)):
    _hop = getattr(torch.ops.higher_order, _op, None)
    if _hop is not None:
        _BRANCHING[_hop] = _fn


def lower_graph(gm: torch.fx.GraphModule, name: str, subcompile=None, static_inputs=(), input_strides=None,
                conv_layout="auto", saved_from=None, library_convs=True, eager_random=False) -> Lowered:
    # AOTAutograd calls its compilers with its fake mode active; the graph's constants are
    # real tensors and are read (item(), detach()) as such.
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return Lowerer(gm, name, subcompile, static_inputs, input_strides, conv_layout, saved_from, library_convs, eager_random).run()
