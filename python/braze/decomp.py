"""braze's decomposition table for AOTAutograd.

Ops listed here are rewritten by AOTAutograd into simpler ATen ops that braze lowers
(pointwise math, reductions, views). Ops braze lowers directly (softmax, layer_norm,
gelu, var_mean, ...) or calls as extern kernels (mm, convolution, attention) are not here.
"""
from __future__ import annotations

import functools
import operator

import torch
from torch._decomp import get_decompositions

aten = torch.ops.aten

_NAMES = [
    # (LayerNorm's backward is lowered, not decomposed: lowering.py's _layer_norm_backward.)
    "gelu_backward", "silu", "silu_backward", "mish", "mish_backward",
    "hardswish", "hardswish_backward", "hardsigmoid", "hardsigmoid_backward", "hardtanh_backward",
    "leaky_relu_backward", "elu", "elu_backward", "softplus", "softplus_backward", "logit", "logit_backward",
    "mse_loss", "mse_loss_backward", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "binary_cross_entropy_backward", "binary_cross_entropy_with_logits", "nll_loss_forward",
    "addcmul", "addcdiv", "lerp", "logsumexp", "std", "std_mean", "rsub", "masked_fill",
    "full_like", "zeros_like", "ones_like", "new_zeros", "new_ones", "new_full", "new_empty",
    # BatchNorm's functional, evaluation-mode and backward ops are lowered, not decomposed
    # ([Note: BatchNorm lowered, not decomposed] in lowering.py).
    "native_group_norm", "native_batch_norm", "_native_batch_norm_legit", "native_group_norm_backward", "xlogy", "clamp_min", "clamp_max",
    "log_sigmoid_forward", "log_sigmoid_backward", "glu", "glu_backward", "sgn", "frac", "deg2rad",
    "rad2deg", "square", "hardshrink", "softshrink", "celu", "selu", "relu6", "tril", "triu",
    "linspace", "logspace", "diag_embed", "trace", "prelu", "_prelu_kernel", "_prelu_kernel_backward",
    "_to_copy", "rms_norm", "_fused_rms_norm", "_fused_rms_norm_backward", "slice_backward",
    "select_backward", "nan_to_num", "aminmax", "threshold",
    # roll as two slices and a cat (Swin's shifted windows).
    "roll",
    # Softmax as amax/sub/exp/sum (the kernels are the same), so AOTAutograd's partitioner may
    # recompute its pointwise part in the backward from the saved input and row statistics
    # instead of saving the f32 result: a language model's log-softmax over the vocabulary
    # (4096 x 32000) was saved as 524 MB of f32 and written in the forward.
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    # Softmax whose fully masked rows give 0 (attention's math path, T5's training step).
    "_safe_softmax",
    # The loss's backward as full + scatter (one pointwise kernel with the softmax backward;
    # see _full_like below for why that matters).
    "nll_loss_backward",
    # Losses over spatial targets (a segmentation model's cross-entropy): the 2-d loss as the
    # 1-d one's gather, where and sums.
    "nll_loss2d_forward", "nll_loss2d_backward",
    # Data movement as views, gathers and pads: channel and pixel shuffles, repeat, the
    # reflected and replicated pads (gathers through clamped or mirrored indices).
    "repeat", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle",
    "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d", "replication_pad2d",
    "replication_pad3d", "reflection_pad1d_backward", "reflection_pad2d_backward", "reflection_pad3d_backward",
    # Vector norms (F.normalize, cosine similarity) as reductions of powers.
    "linalg_vector_norm", "norm", "soft_margin_loss",
    # Their backward ops, and the allocation and masked gather the pads' backward ops use.
    "huber_loss_backward", "smooth_l1_loss_backward", "soft_margin_loss_backward", "new_empty_strided",
    "_unsafe_masked_index",
    # Weight normalization (Wav2Vec2's positional convolution) as a norm, a division and a
    # product; unfold's im2col as gathers through computed indices (TNT's, VOLO's and
    # ConvBERT's unfolds). (col2im's decomposition is an accumulating index_put, ATen's
    # anyway.)
    "_weight_norm_interface", "im2col",
]


def _full_like(x, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None,
               memory_format=torch.preserve_format):
    """``full_like`` of a row-major tensor as ``full`` of its shape: the result no longer
    reads ``x``, so AOTAutograd's partitioner does not count ``x`` as needed by the backward
    (the loss's backward builds its gradient with ``full_like(log_probs, 0)``, which kept the
    f32 log-softmax of the whole vocabulary saved instead of recomputed). Other layouts keep
    PyTorch's decomposition (their strides follow ``x``)."""
    if layout not in (None, torch.strided) or (memory_format == torch.preserve_format and not x.is_contiguous()):
        return NotImplemented
    return torch.full(x.shape, fill_value, dtype=dtype or x.dtype, device=device or x.device,
                      pin_memory=bool(pin_memory))


def _detach(x):
    """``detach`` in the joint graph (autograd's formulas detach the results they save, e.g.
    log-softmax's) as ``alias``, a view to AOTAutograd's partitioner: a ``detach`` user made
    the log-probabilities count as materialized in the backward, so they were saved (f32, the
    whole vocabulary) rather than recomputed from the logits. There is no autograd below this
    point, so the two are the same."""
    return aten.alias.default(x)


def pool_pair(v):
    """A pooling argument (an int or a list of one or two) as a list of two."""
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * 2 if len(v) == 1 else v


def _max_pool2d_with_offsets(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """``max_pool2d_with_indices`` as the window maximum with each output's int8 offset in its
    window, then the offsets turned into ATen's flat int64 indices (PyTorch's two
    ``prims._low_memory_max_pool_*`` ops). AOTAutograd's partitioner recomputes the second
    in the backward, so a training step saves 1 byte per pooled element instead of 8
    (ResNet-50 b64: 12 MiB instead of 98). Windows over 127 elements, dilation, integer
    inputs and symbolic sizes (which braze's lowering of the pair does not take) keep ATen's
    op."""
    k, p, d = pool_pair(kernel_size), pool_pair(padding), pool_pair(dilation)
    s = pool_pair(stride) if stride else k
    prims = torch.ops.prims
    if (d != [1, 1] or k[0] * k[1] > 127 or x.dim() not in (3, 4) or not x.dtype.is_floating_point
            or not all(isinstance(n, int) for n in x.shape) or not hasattr(prims, "_low_memory_max_pool_with_offsets")):
        return NotImplemented
    vals, offsets = prims._low_memory_max_pool_with_offsets(x, k, s, p, d, ceil_mode)
    indices = prims._low_memory_max_pool_offsets_to_indices(offsets, k, x.shape[-2:], s, p, d)
    return vals, indices


@functools.lru_cache(None)
def decomposition_table():
    ops = []
    for name in _NAMES:
        packet = getattr(aten, name, None)
        if packet is not None and name not in ("_to_copy", "full_like"):
            ops.append(packet)
    table = get_decompositions(ops)
    table[aten.full_like.default] = _full_like
    table[aten.detach.default] = _detach
    table[aten.max_pool2d_with_indices.default] = _max_pool2d_with_offsets
    for op in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default):
        table[op] = _in_f32(table[op])
    return table


def _in_f32(decomposed):
    """A loss's decomposition run in f32 for 16-bit inputs, its results rounded once, as ATen's
    CUDA kernels sum and divide in f32 (the decomposition alone rounds the sum to 16 bits and
    then the mean: two roundings)."""
    def run(self, target, weight, reduction, ignore_index):
        if self.dtype not in (torch.float16, torch.bfloat16):
            return decomposed(self, target, weight, reduction, ignore_index)
        out, total = decomposed(self.float(), target, None if weight is None else weight.float(), reduction, ignore_index)
        return out.to(self.dtype), total.to(self.dtype)
    return run


def drop_unread_batch_norm_stats(joint: torch.fx.GraphModule) -> None:
    """In training, BatchNorm's backward does not read the running statistics its schema
    takes: they are dropped from the joint graph before partitioning, so the partitioner does
    not save the updated statistics for the backward and the forward can store them in place
    ([Note: BatchNorm lowered, not decomposed] in lowering.py)."""
    changed = False
    for n in joint.graph.nodes:
        if n.target is aten.native_batch_norm_backward.default and len(n.args) > 7 and n.args[7] is True:
            if n.args[3] is not None or n.args[4] is not None:
                n.args = (*n.args[:3], None, None, *n.args[5:])
                changed = True
    if changed:
        joint.recompile()


def recomputable_batch_norm_outputs(joint: torch.fx.GraphModule) -> None:
    """[Note: BatchNorm outputs recomputable] In training, BatchNorm's normalized output is
    rewritten in the joint graph as pointwise ops of its input and the saved mean and inverse
    std (the op's own output left unread), so that AOTAutograd's partitioner can recompute it
    in the backward from what BatchNorm's backward saves anyway, as it does for Inductor's
    decomposed BatchNorm. Left as the op's output ([Note: BatchNorm lowered, not decomposed]
    in lowering.py) it was saved whenever the activation's backward reads it (hardswish,
    SiLU, GELU): MobileNet-v3's forward wrote each BatchNorm + hardswish layer's normalized
    values and its backward read them back, a full activation each way."""
    g = joint.graph
    changed = False
    for n in list(g.nodes):
        if n.target is not aten._native_batch_norm_legit_functional.default or len(n.args) < 8 or not n.args[5]:
            continue
        x, w, b = n.args[0], n.args[1], n.args[2]
        xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        vals = n.meta.get("val")
        if not isinstance(xv, torch.Tensor) or xv.dim() < 2 or not isinstance(xv.shape[1], int) or vals is None:
            continue
        fake = getattr(xv, "fake_mode", None)
        items = {u.args[1]: u for u in n.users if u.target is operator.getitem}
        out = items.get(0)
        if fake is None or out is None or not out.users:
            continue
        ct = torch.float32 if xv.dtype in (torch.float16, torch.bfloat16) else xv.dtype
        if any(not isinstance(v, torch.Tensor) or v.dtype != ct for v in vals[1:3]):
            continue  # statistics saved rounded (the CPU's bf16 BatchNorm): the op's own output is exact
        shape = [1, xv.shape[1]] + [1] * (xv.dim() - 2)
        anchor = [n]

        def add(target, *args):
            with g.inserting_after(anchor[0]):
                node = g.call_function(target, args)
            vals_in = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
            with fake:
                node.meta["val"] = target(*vals_in)
            anchor[0] = node
            return node

        def as_ct(v):
            return v if v.meta["val"].dtype == ct else add(torch.ops.prims.convert_element_type.default, v, ct)

        stats = []
        for k in (1, 2):
            if k in items:
                anchor[0].append(items[k])
                anchor[0] = items[k]
            else:
                with g.inserting_after(anchor[0]):
                    items[k] = g.call_function(operator.getitem, (n, k))
                items[k].meta["val"] = vals[k]
                anchor[0] = items[k]
            stats.append(items[k])
        mean = add(aten.view.default, as_ct(stats[0]), shape)
        rstd = add(aten.view.default, as_ct(stats[1]), shape)
        y = add(aten.mul.Tensor, add(aten.sub.Tensor, as_ct(x), mean), rstd)
        if w is not None:
            y = add(aten.mul.Tensor, y, add(aten.view.default, as_ct(w), shape))
        if b is not None:
            y = add(aten.add.Tensor, y, add(aten.view.default, as_ct(b), shape))
        if out.meta["val"].dtype != ct:
            y = add(torch.ops.prims.convert_element_type.default, y, out.meta["val"].dtype)
        out.replace_all_uses_with(y)
        g.erase_node(out)
        changed = True
    if changed:
        joint.recompile()
