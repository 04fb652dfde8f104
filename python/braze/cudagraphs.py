"""Whole-graph CUDA graphs for ``mode="reduce-overhead"``.

[Note: whole-graph replay] Under mode ``reduce-overhead`` (option ``whole_graph_replay``) a
compiled CUDA graph runs plainly on its first call (cuBLASLt, cuDNN and the driver do their
first-use work there), is captured on its second — braze's kernels, cuBLASLt matmuls and the
extern ATen calls (cuDNN convolutions, attention) alike — into one CUDA graph, and from then
on each call is one replay: no Python call loop, no per-kernel launches.

Memory. All of braze's whole graphs on a device capture into one memory pool, so a backward
reuses the memory its forward's temporaries had. The blocks of a graph's outputs stay the
graph's own (it keeps the tensors it captured them in): every replay writes its outputs to
the same addresses. An output alone in its block is returned as the same tensor by every
replay while the caller does not hold it ([Note: cached outputs], as PyTorch's CUDA-graph
trees do): a replay makes no tensor, storage or weak reference per output. What holds an
output is counted, not tracked: the Python references to the tensor, the C++ ones (autograd's
saved tensors), and the other tensors on its storage (views, a gradient autograd took).

Inputs. Parameters and buffers (AOTAutograd's static inputs) and outputs of another whole
graph (a backward's saved activations) are read where they are, at the address they had at
capture; any other tensor input is copied into a buffer of the graph's own first (a broadcast
input, such as the expanded gradient ``out.sum().backward()`` hands a backward, into a buffer
of its strides, by its distinct elements; a later call broadcasting it otherwise runs plainly).
An input the graph mutates that is not read in place is copied back after the replay.
An input that only braze's own kernels read is not copied at all ([Note: patched inputs] in
braze-runtime's graph_patch.rs): the kernel nodes reading it are found once after the capture
and, when a call's input is somewhere else, pointed at it (an input that is not 16-byte aligned
is copied as before).

How long outputs stay valid (as PyTorch documents for its CUDA-graph trees):

- A forward or inference graph's outputs are valid until the next call of the same graph.
  Outputs of the previous call still alive then are invalidated: reading one raises an error
  that says so (``clone()`` an output to keep it across calls), and the call returns a new
  tensor in its place. As with PyTorch's CUDA-graph trees this reaches the tensors the call
  returned, not views the caller made of them.
- Before any replay braze checks that it overwrites nothing alive: outputs of whole graphs
  captured after this one (their blocks may be blocks this graph's temporaries had), or a
  backward's own previous outputs still held (gradients accumulated over several backward
  calls). Then this call runs plainly instead (fresh memory, the same results), as does a call
  whose parameters moved. Outputs of graphs captured before it are never in the way: a graph
  keeps its output blocks for as long as it lives, so no later capture allocates there.

Graphs with symbolic sizes, host values (CPU tensors in a CUDA graph) or a failed capture run
plainly on every call, with one log line (``BRAZE_LOGS=cudagraphs``) saying why.
"""
from __future__ import annotations

import sys
import weakref

import torch

from . import _core

_POOLS = {}  # device index -> _Pool

_STALE = ("braze (mode='reduce-overhead'): this tensor is an output of a CUDA-graph replay that a later call of the "
          "same compiled graph overwrote. Clone outputs you keep across calls (out.clone()).")


class Stats:
    def __init__(self):
        self.captures = 0
        self.replays = 0
        self.plain_runs = 0  # calls of a captured graph that ran plainly (something alive in the way)
        self.invalidated = 0  # outputs of earlier replays made unreadable
        self.patched_inputs = 0  # inputs read where they are, not copied ([Note: patched inputs])
        self.not_captured = []  # (graph name, why)


stats = Stats()


def _distinct(t):
    """`t` with its broadcast dims (stride 0, as `expand` makes them) narrowed to one element:
    each of its distinct elements once, so a copy between two tensors of those strides writes
    every element once (a copy into an expanded tensor is an error in PyTorch)."""
    for d, (n, st) in enumerate(zip(t.shape, t.stride())):
        if st == 0 and n > 1:
            t = t.narrow(d, 0, 1)
    return t


class _Pool:
    """One device's memory pool and the whole graphs captured into it."""

    def __init__(self):
        self.handle = torch.cuda.graph_pool_handle()
        self.graphs = {}  # graph id -> (capture order, weak reference to the WholeGraph)
        self.captured = 0
        # The static inputs (parameters, buffers) of the graphs captured, by data pointer, for
        # as long as they live: a backward reading a parameter reads it in place too. (An
        # address alone would outlive its tensor: a later tensor there is no parameter.)
        self.static = weakref.WeakValueDictionary()

    def alive(self, since=0):
        """(graph id, output storage index) of the outputs in use now of the graphs captured
        `since` (a capture order) or later."""
        return [(gid, k) for gid, (order, ref) in list(self.graphs.items()) if order >= since and (g := ref()) is not None
                for k in g.live_storages()]


def _pool(device_index):
    p = _POOLS.get(device_index)
    if p is None:
        p = _POOLS[device_index] = _Pool()
    return p


def _storage_key(t):
    return t.untyped_storage().data_ptr()


class WholeGraph:
    """A CompiledGraph (CUDA, static sizes) run as one CUDA graph from its second call on."""

    _boxed_call = True

    def __init__(self, g, kind, static_inputs, log):
        self._boxed_call = True
        self.g = g
        self.name = g.name
        self.kind = kind
        self.static_inputs = frozenset(static_inputs)
        self.log = log
        self.calls = 0
        self.graph = None
        self.off = None  # why this graph runs plainly on every call
        self.patched = []  # inputs read where they are ([Note: patched inputs])
        if g.dynamic:
            self.off = "symbolic sizes"
        elif g.n_host:
            self.off = "host values (CPU tensors) in a CUDA graph"

    def __getattr__(self, k):  # the CompiledGraph's attributes (tools, tests)
        return getattr(self.g, k)

    def __call__(self, args):
        if self.off is not None:
            return self.g(args)
        self.calls += 1
        if self.calls == 1:
            return self.g(args)
        if self.graph is None:
            return self._capture(args)
        return self._replay(args)

    def _turn_off(self, why):
        self.off = why
        stats.not_captured.append((self.name, why))
        self.log(f"{self.name}: runs without a whole-graph CUDA graph: {why}")

    # Capture ----------------------------------------------------------------------------

    def _capture(self, args):
        tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        dev = self.g.device_index
        if any(not a.is_cuda or a.get_device() != dev for _, a in tensors):
            self._turn_off("an input is not on the graph's device")
            return self.g(args)
        pool = _pool(dev)
        alive = pool.alive()
        live_keys = {pool.graphs[g][1]().storage_ptrs[k]: (g, k) for g, k in alive}  # storage data pointer -> key of a live whole-graph output there
        # Inputs read in place: static ones and live outputs of whole graphs, their data
        # pointers by arg index (None for the rest, as the replay's C++ check takes them); the
        # rest are copied into the graph's own buffers.
        self.check_ptrs = [None] * len(args)
        self.copied = {}  # arg index -> the graph's buffer
        cap_args = list(args)
        for i, a in tensors:
            known = pool.static.get(a.data_ptr())
            if i in self.static_inputs or _storage_key(a) in live_keys or (known is not None and known.data_ptr() == a.data_ptr()):
                self.check_ptrs[i] = a.data_ptr()
            else:
                # A broadcast input (the gradient `sum().backward()` hands the backward is an
                # expanded scalar) keeps its stride-0 dims: the copy writes its distinct
                # elements once.
                buf = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                if torch._debug_has_internal_overlap(_distinct(buf)) != 0:
                    self._turn_off(f"input {i} has overlapping strides {tuple(a.stride())}")
                    return self.g(args)
                _distinct(buf).copy_(_distinct(a))
                self.copied[i] = buf
                cap_args[i] = buf
        for i in self.static_inputs:
            if i < len(args) and isinstance(args[i], torch.Tensor):
                pool.static[args[i].data_ptr()] = args[i]
        self.mutated = [i for i in self.g.mutated_args if i in self.copied]
        # What a replay checks and copies, in the forms its C++ calls take.
        self.check_idx = [i for i, ptr in enumerate(self.check_ptrs) if ptr is not None]
        self.broadcast = [(i, buf.stride()) for i, buf in self.copied.items() if 0 in buf.stride()]
        self.copy_idx = list(self.copied)
        # Inputs that only braze's kernels read: found in the captured graph to be read where
        # they are ([Note: patched inputs]); the graph is kept for that search.
        kernel_only = self.g.kernel_only_args()
        patchable = [i for i in self.copy_idx if not (0 in self.copied[i].stride()) and i not in self.mutated and i in kernel_only]
        try:
            graph = torch.cuda.CUDAGraph(keep_graph=True) if patchable else torch.cuda.CUDAGraph()
        except TypeError:  # a PyTorch without keep_graph
            graph, patchable = torch.cuda.CUDAGraph(), []
        torch.cuda.synchronize(dev)
        try:
            with torch.cuda.graph(graph, pool=pool.handle, capture_error_mode="thread_local"):
                outs = self.g(list(cap_args))
            if patchable:
                graph.instantiate()
        except Exception as e:  # noqa: BLE001 - any failure: this graph runs plainly from now on
            torch.cuda.synchronize(dev)
            self._turn_off(f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            return self.g(args)
        self.graph = graph
        self._find_patches(patchable)
        # The replay's input copy in its cheapest form: one tensor by `copy_`, several by one
        # `_foreach_copy_`; only a broadcast input narrows its source per call.
        self.copy_dst = [_distinct(self.copied[i]) for i in self.copy_idx]
        self.copy_one = len(self.copy_idx) == 1 and not self.broadcast
        self.pool = pool
        # Outputs: views of an input (returned as views of the current call's input), or
        # views of the graph's own blocks, kept here (returned as tensors viewing them).
        input_ptr = {_storage_key(cap_args[i]): i for i, _ in tensors}
        self.outs = []
        self.kept = []
        storages = {}
        for o in outs:
            if not isinstance(o, torch.Tensor):
                self.outs.append(("value", o))
                continue
            sp = _storage_key(o)
            if sp in input_ptr:
                i = input_ptr[sp]
                base = cap_args[i]
                if o.shape == base.shape and o.stride() == base.stride() and o.storage_offset() == base.storage_offset():
                    # The input itself (a parameter a forward saves for its backward): returned
                    # as the call's input object, as eager returns it, without a view.
                    self.outs.append(("arg", i))
                else:
                    self.outs.append(("input", i, o.shape, o.stride(), o.storage_offset() - base.storage_offset()))
                continue
            if sp not in storages:
                storages[sp] = len(storages)
                self.kept.append(o)
            meta = {"size": o.shape, "stride": o.stride(), "dtype": o.dtype, "device": o.device, "storage_offset": o.storage_offset()}
            self.outs.append(("own", storages[sp], meta))
        self.storage_ptrs = list(storages)
        self.storages = [torch._C._construct_storage_from_data_pointer(sp, k.device, k.untyped_storage().nbytes())
                         for sp, k in zip(storages, self.kept)]
        self.cdatas = [st._cdata for st in self.storages]
        # [Note: cached outputs] An output alone in its storage is returned as the same tensor
        # on every replay (as PyTorch's CUDA-graph trees do): no tensor, storage or weak
        # reference made per output and call. Outputs sharing a storage are made per call.
        per_storage = [0] * len(storages)
        for o in self.outs:
            if o[0] == "own":
                per_storage[o[1]] += 1
        # The cached outputs, returned by every replay; output index -> position there.
        self.cached = {j: n for n, j in enumerate(j for j, o in enumerate(self.outs) if o[0] == "own" and per_storage[o[1]] == 1)}
        self.cache = [self._new_output(self.outs[j]) for j in self.cached]
        self.cache_storage = [self.outs[j][1] for j in self.cached]
        self.own_only = len(self.cached) == len(self.outs)  # every output a cached one
        self.made = []  # (output storage index, weak reference) of the uncached outputs the latest call returned
        # What holds a storage when nothing outside this graph does: the storage object and
        # the cached tensors on it (an invalidated tensor lets go of its storage, and the one
        # replacing it takes its place).
        self.storage_base = list(map(torch._C._storage_Use_Count, self.cdatas))
        self.order = pool.captured
        pool.captured += 1
        pool.graphs[id(self)] = (self.order, weakref.ref(self))
        del live_keys
        stats.captures += 1
        self.log(f"{self.name}: captured as one CUDA graph ({sum(1 for o in self.outs if o[0] == 'own')} outputs in its own memory, "
                 f"{len(self.copy_idx)} inputs copied in, {len(self.patched)} read where they are, {len(self.check_idx)} read in place)")
        return self._launch(args, check=False)

    def _find_patches(self, patchable):
        """[Note: patched inputs] The copied inputs whose readers in the captured graph are
        all braze's kernels, taken off the replay's copy: each call points those kernels at
        the call's input instead."""
        self.patched = []  # [arg index, sites, the graph's own buffer's address, the strides captured]
        if not patchable:
            return
        raw, exec_ = self.graph.raw_cuda_graph(), self.graph.raw_cuda_graph_exec()
        for i in patchable:
            buf = self.copied[i]
            try:
                found = _core.graph_input_sites(raw, exec_, buf.data_ptr(), buf.untyped_storage().nbytes())
            except Exception as e:  # noqa: BLE001 - a driver call failed: the input stays copied
                found = f"{type(e).__name__}: {e}"
            if isinstance(found, str):
                self.log(f"{self.name}: input {i} is copied in: {found}")
                continue
            self.patched.append([i, found, buf.data_ptr(), buf.stride()])
            stats.patched_inputs += 1
        if self.patched:
            gone = {p[0] for p in self.patched}
            self.copy_idx = [i for i in self.copy_idx if i not in gone]
            self.log(f"{self.name}: inputs {sorted(gone)} read where they are, not copied "
                     f"({', '.join(str(len(p[1])) for p in self.patched)} kernel nodes)")

    def _point_patched(self, args):
        """Points each patched input's kernels at this call's input, or, for an input not
        16-byte aligned (braze's vector loads) or laid out otherwise than at the capture, at
        the graph's own buffer with the input copied in."""
        for i, sites, own, stride in self.patched:
            a = args[i]
            ptr = a.data_ptr()
            if ptr % 16 == 0 and a.stride() == stride:
                sites.point_at(ptr)
            else:
                sites.point_at(own)
                self.copied[i].copy_(a)

    # Replay -----------------------------------------------------------------------------

    def _replay(self, args):
        # Parameters and the live outputs of other graphs where they were at the capture (one
        # C++ call; shapes and strides are Dynamo's guards and the graphs' own outputs').
        if self.check_idx and not torch._C._tensors_data_ptrs_at_indices_equal(args, self.check_ptrs, self.check_idx):
            moved = next(i for i in self.check_idx if args[i].data_ptr() != self.check_ptrs[i])
            return self._plain(args, f"input {moved} moved since the capture")
        for i, stride in self.broadcast:
            if args[i].stride() != stride:
                return self._plain(args, f"input {i} is broadcast otherwise than at the capture")
        return self._launch(args, check=True)

    def _plain(self, args, why):
        stats.plain_runs += 1
        self.log(f"{self.name}: this call runs plainly: {why}")
        return self.g(args)

    def _new_output(self, o):
        t = torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata(o[2], self.storages[o[1]])
        # Registered so that autograd may still steal it as a .grad despite the cache's
        # reference (the registry is process-wide; Inductor's reset turns it off).
        torch._C._set_cached_tensors_enabled(True)
        torch._C._add_cached_tensor(t)
        return t

    def _held(self):
        """Per cached output, whether anything beyond the cache holds it: a Python reference
        (the count is 2 when only the cache's list and this call's argument do) or a C++ one
        (autograd's saved tensors: a use count above the Python object's 1)."""
        refs = list(map(sys.getrefcount, self.cache))
        uses = list(map(torch.Tensor._use_count, self.cache))
        return [r > 2 or u > 1 for r, u in zip(refs, uses)]

    def live_storages(self):
        """Indices of this graph's output storages something outside the graph uses now: a
        cached output held by the caller or by autograd (a saved activation), a view of one,
        an uncached output."""
        live = {k for k, held in zip(self.cache_storage, self._held()) if held}
        live.update(k for k, (n, base) in enumerate(zip(map(torch._C._storage_Use_Count, self.cdatas), self.storage_base)) if n > base)
        return live

    def _launch(self, args, check):
        pool = self.pool
        me = id(self)
        if check:
            # With no graph captured after this one, only its own outputs can be in the way.
            alive = [(me, k) for k in self.live_storages()] if pool.captured == self.order + 1 else pool.alive(self.order)
            stale = []
            for key in alive:
                if key[0] == me and self.kind != "backward":
                    stale.append(key[1])
                    continue
                what = "its own earlier outputs (gradients kept across backward calls?)" if key[0] == me else "outputs of a graph captured after it"
                return self._plain(args, f"{what} are alive in memory this graph writes")
            if stale:
                self._invalidate(stale)
        if self.patched:
            self._point_patched(args)
        if self.copy_one:
            self.copy_dst[0].copy_(args[self.copy_idx[0]])
        elif self.broadcast:
            torch._foreach_copy_(self.copy_dst, [_distinct(args[i]) for i in self.copy_idx])
        elif self.copy_idx:
            torch._foreach_copy_(self.copy_dst, [args[i] for i in self.copy_idx])
        self.graph.replay()
        stats.replays += 1
        for i in self.mutated:
            args[i].copy_(self.copied[i])
        if self.own_only:
            res = self.cache.copy()
            for t in res:
                if t._backward_hooks is not None:  # a hook the caller put on the previous call's output
                    t._backward_hooks = None
        else:
            res = []
            self.made = []
            for j, o in enumerate(self.outs):
                if j in self.cached:
                    t = self.cache[self.cached[j]]
                    if t._backward_hooks is not None:
                        t._backward_hooks = None
                    res.append(t)
                elif o[0] == "own":
                    t = torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata(o[2], self.storages[o[1]])
                    res.append(t)
                    self.made.append((o[1], weakref.ref(t)))
                elif o[0] == "arg":
                    res.append(args[o[1]])
                elif o[0] == "value":
                    res.append(o[1])
                else:
                    _, i, shape, stride, off = o
                    base = args[i]
                    res.append(base.as_strided(shape, stride, base.storage_offset() + off))
        args.clear()
        return res

    def _invalidate(self, storages):
        """Makes the outputs of the previous call in `storages` (indices) that are still held
        unreadable: their memory is about to be overwritten. Reading one raises (the tensors
        this graph returned; as with PyTorch's CUDA-graph trees, views the caller made of them
        are not reached). A cached output so retired is replaced by a new tensor."""
        stale = set(storages)
        cache = self.cache
        for (j, n), held in zip(self.cached.items(), self._held()):
            if held and self.outs[j][1] in stale:
                torch._C._set_cached_tensors_enabled(True)
                torch._C._remove_cached_tensor(cache[n])
                torch._C._set_storage_access_error_msg(cache[n], _STALE)
                stats.invalidated += 1
                cache[n] = self._new_output(self.outs[j])
        for k, w in self.made:
            t = w()
            if k in stale and t is not None:
                torch._C._set_storage_access_error_msg(t, _STALE)
                stats.invalidated += 1

    def __del__(self):
        pool = self.__dict__.get("pool")
        if pool is not None:
            pool.graphs.pop(id(self), None)
        cache = self.__dict__.get("cache", ())
        if cache and torch is not None:  # not at interpreter exit
            torch._C._set_cached_tensors_enabled(True)
            for t in cache:
                torch._C._remove_cached_tensor(t)


def wrap(g, kind, static_inputs, logs):
    """`g` wrapped for whole-graph replay when it runs on a GPU; `g` itself otherwise."""
    if not getattr(g, "cuda", False):
        return g

    def log(msg):
        if "cudagraphs" in logs:
            print(f"[braze:cudagraphs] {msg}", file=sys.stderr)
    return WholeGraph(g, kind, static_inputs, log)
