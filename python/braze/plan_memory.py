"""The memory a GPU plan allocates, computed on a machine without a GPU ([Note: plans without a
GPU] in braze-driver): a model's inference graph traced on fake CUDA tensors, lowered and
planned as braze would on an H100/H200, then its plan walked step by step the way the call
loop allocates and frees ([Note: the call loop in Rust]).

    python -m braze.plan_memory resnet50      (bench_models names; inference, GPU sizes)

It is a model of the run, not a measurement: an extern call's results count from its step
(views an op returns count as new memory), ATen's and the libraries' workspaces do not count,
and the caching allocator's rounding and fragmentation are left out. It checks what braze's
planning decides (which buffers share an arena window, when each is allocated and freed);
`benchmarks/mem_peak.py` measures the real peak on a GPU.
"""
import contextlib
import sys

import torch

MiB = 2**20


@contextlib.contextmanager
def _as_on_a_gpu():
    """Fake CUDA tensors behave as on a GPU with cuDNN: braze's library lowerings are taken,
    and a convolution of a channels_last input or weight returns channels_last (cuDNN's
    choice; without a GPU, PyTorch's fake convolution picks a contiguous result)."""
    from braze import cuda

    det = torch._C._conv_determine_backend_memory_format
    saved = cuda.cudnn_ready, cuda.cublaslt_ready

    def gpu_format(inp, w, backend):
        def cl(t):
            return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()

        if inp.is_cuda and (cl(inp) or cl(w)):
            return torch.channels_last
        return det(inp, w, backend)

    cuda.cudnn_ready = cuda.cublaslt_ready = lambda: True
    torch._C._conv_determine_backend_memory_format = gpu_format
    try:
        yield
    finally:
        cuda.cudnn_ready, cuda.cublaslt_ready = saved
        torch._C._conv_determine_backend_memory_format = det


def inference_plan(model, inputs, autocast=torch.bfloat16, name="inference_0", options=None):
    """The plan braze makes for `model(**inputs)` in inference on a GPU, with the default
    options or `options` (as torch.compile takes them): `model` and `inputs` (a dict of keyword arguments) are CPU tensors whose shapes,
    dtypes and strides the fake CUDA ones take (weights are not read). Returns (the graph as
    the runtime holds it, not callable: `CompiledGraph` with its `Prepared` plan, lowered
    graph)."""
    from torch._decomp import decomposition_table as torch_decomps
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.func import functional_call

    from braze.backend import _build
    from braze.config import Config
    from braze.decomp import decomposition_table
    from braze.lowering import lower_graph
    from braze.runtime import CompiledGraph

    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # Eager's batch_norm on CUDA reaches cuDNN's; AOTAutograd's graphs hold the native one.
    decomps = {**decomposition_table(), **{k: v for k, v in torch_decomps.items() if "cudnn_batch_norm" in str(k)}}

    def fake(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")

    def f(params, xs):
        # torch.autocast refuses "cuda" without a GPU; its dispatch keys do not.
        torch.set_autocast_enabled("cuda", autocast is not None)
        if autocast is not None:
            torch.set_autocast_dtype("cuda", autocast)
        try:
            return functional_call(model, params, (), xs)
        finally:
            torch.set_autocast_enabled("cuda", False)

    with _as_on_a_gpu():
        with torch.no_grad(), mode:
            params = {k: fake(v) for k, v in state.items()}
            xs = {k: fake(x) for k, x in inputs.items()}
            gm = make_fx(torch.func.functionalize(f, remove="mutations"), decomposition_table=decomps, tracing_mode="fake")(params, xs)
        # Functionalization leaves a result's restride (adaptive pooling's) in place.
        for n in gm.graph.nodes:
            if n.target is torch.ops.aten.as_strided_.default:
                n.target = torch.ops.aten.as_strided.default
        gm.recompile()
        lowered = lower_graph(gm, name)
        graph = CompiledGraph(_build(lowered, Config.make(options=options), plan_only=True), lowered, name)
    return graph, lowered


def simulate(graph):
    """Bytes allocated within one call of `graph` (a static `CompiledGraph`), step by step,
    walking its `Prepared` plan as the call loop does: a window's arena from the step that
    opens it to the one that closes it, a `NewBuf` from its step to the step that frees it (a
    `ReuseBuf` in the memory of the buffer it takes, an `InputBuf` in an input's), an extern
    call's results from its step; outputs are never freed. Returns (peak bytes, [(plan step,
    bytes at its peak, bytes after it)])."""
    from braze.runtime import _TORCH_DTYPES, NewBuf, ReuseBuf

    _, shapes, strides = graph.static

    def nbytes(b):
        sizes, st = shapes[b], strides[b]
        extent = 0 if 0 in sizes else 1 + sum((n - 1) * s for n, s in zip(sizes, st))
        return extent * _TORCH_DTYPES[graph.bufs[b][2]].itemsize

    prepared = graph.static_plan
    outputs = {o.buf for o in prepared.outputs}
    owned, live, arena, peak, trace = {}, 0, 0, 0, []
    for s, st in enumerate(prepared.steps):
        if st.arena_opens:
            arena = st.arena_opens
            live += arena
        for a in st.allocs:
            if isinstance(a, NewBuf):
                owned[a.buf] = nbytes(a.buf)
                live += owned[a.buf]
            elif isinstance(a, ReuseBuf):
                owned[a.buf] = owned.pop(a.dying, 0)
        if st.is_extern:
            for o, _, _, _ in st.work.results:
                if o not in owned:
                    owned[o] = nbytes(o)
                    live += owned[o]
        at = live
        for b in st.frees:
            if b in owned and b not in outputs:
                live -= owned.pop(b)
        if st.arena_closes:
            live -= arena
            arena = 0
        peak = max(peak, at)
        trace.append((s, at, live))
    return peak, trace


def main():
    from braze import bench_models as bm

    for name in sys.argv[1:] or ["resnet50"]:
        build, make_inputs, desc = bm._configs(True)[name][:3]
        torch.manual_seed(0)
        model = build().eval()
        inputs = make_inputs(torch.device("cpu"))[0]
        graph, lowered = inference_plan(model, inputs, torch.bfloat16 if bm.autocast_of(name) else None)
        peak, trace = simulate(graph)
        print(f"== {desc}, inference: {len(graph.static_plan.steps)} plan steps, {len(graph.arena_windows)} arena windows, "
              f"ATen calls {dict(lowered.fallbacks)}; peak {peak / MiB:.1f} MiB above the inputs")
        top = sorted(trace, key=lambda r: -r[1])[:3]
        print("  highest steps (step, MiB during, MiB after):", [(s, round(a / MiB, 1), round(b / MiB, 1)) for s, a, b in top])


if __name__ == "__main__":
    main()
