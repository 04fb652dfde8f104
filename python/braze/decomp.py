"""braze's decomposition table for AOTAutograd.

Ops listed here are rewritten by AOTAutograd into simpler ATen ops that braze lowers
(pointwise math, reductions, views). Ops braze lowers directly (softmax, layer_norm,
gelu, var_mean, ...) or calls as extern kernels (mm, convolution, attention) are not here.
"""
from __future__ import annotations

import functools

import torch
from torch._decomp import get_decompositions

aten = torch.ops.aten

_NAMES = [
    "native_layer_norm_backward", "gelu_backward", "silu", "silu_backward", "mish", "mish_backward",
    "hardswish", "hardswish_backward", "hardsigmoid", "hardsigmoid_backward", "hardtanh_backward",
    "leaky_relu_backward", "elu", "elu_backward", "softplus", "softplus_backward", "logit", "logit_backward",
    "mse_loss", "mse_loss_backward", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "binary_cross_entropy_backward", "binary_cross_entropy_with_logits", "nll_loss_forward",
    "addcmul", "addcdiv", "lerp", "logsumexp", "std", "std_mean", "rsub", "masked_fill",
    "full_like", "zeros_like", "ones_like", "new_zeros", "new_ones", "new_full", "new_empty",
    "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
    "native_batch_norm_backward", "native_group_norm_backward", "xlogy", "clamp_min", "clamp_max",
    "log_sigmoid_forward", "log_sigmoid_backward", "glu", "glu_backward", "sgn", "frac", "deg2rad",
    "rad2deg", "square", "hardshrink", "softshrink", "celu", "selu", "relu6", "tril", "triu",
    "linspace", "logspace", "diag_embed", "trace", "prelu", "_prelu_kernel", "_prelu_kernel_backward",
    "_to_copy", "rms_norm", "_fused_rms_norm", "_fused_rms_norm_backward", "slice_backward",
    "select_backward", "nan_to_num", "aminmax", "threshold",
]


@functools.lru_cache(None)
def decomposition_table():
    ops = []
    for name in _NAMES:
        packet = getattr(aten, name, None)
        if packet is not None and name != "_to_copy":
            ops.append(packet)
    return get_decompositions(ops)
