"""CPU convolutions of inference graphs with their weights laid out once ([Note: CPU convolutions]).

[Note: CPU convolutions]
braze runs a CPU inference graph's 2-d convolutions channels_last (`lowering._convolution`).
oneDNN then wants the weight channels_last too, and given a contiguous (NCHW) parameter it
converts it on every call: 17 weight copies per ResNet-18 b8 call, 4.2 ms of ~100 on the 2-core
build machine. When the weight is a static input of the graph (a parameter or buffer, the same
tensor every call), ``CpuConv`` keeps a channels_last copy, reused while the weight is the same
tensor object (a weak reference), at the same address and with the same ``_version`` (an
in-place update bumps it and the next call copies again), as ``CpuLinear`` keeps its packed
weights ([Note: CPU linears]). Writes through ``.data`` are not seen, as there.
"""
from __future__ import annotations

import weakref

import torch

aten = torch.ops.aten


class CpuConv:
    """``aten.convolution`` with a cached channels_last weight: called as ``(x, w, bias)``."""

    __name__ = "aten.convolution[channels_last weight]"

    def __init__(self, stride, padding, dilation, groups):
        self.stride, self.padding, self.dilation, self.groups = list(stride), list(padding), list(dilation), groups
        self.cache = None  # (weakref to w, data_ptr, _version, channels_last copy)
        self.copies = 0  # how many times the weight was laid out (tests read it)

    def weight(self, w):
        c = self.cache
        if c is not None and c[0]() is w and c[1] == w.data_ptr() and c[2] == w._version:
            return c[3]
        with torch.no_grad():
            wc = w.contiguous(memory_format=torch.channels_last)
        self.copies += 1
        self.cache = (weakref.ref(w), w.data_ptr(), w._version, wc)
        return wc

    def __call__(self, x, w, bias=None):
        with torch.no_grad():
            return aten.convolution.default(x, self.weight(w), bias, self.stride, self.padding, self.dilation, False, [0, 0], self.groups)

    def __repr__(self):
        return self.__name__


def strided_pointwise(weight_shape, stride, padding, transposed) -> bool:
    """Whether a 2-d convolution is a 1x1 one with a stride and no padding (a ResNet
    shortcut's, MobileOne's scale branch): [Note: strided 1x1 weight gradients]."""
    return (not transposed and len(weight_shape) == 4 and tuple(weight_shape[2:]) == (1, 1)
            and any(int(s) != 1 for s in stride) and all(int(p) == 0 for p in padding))


# [Note: strided 1x1 weight gradients] ATen's CPU `convolution_backward` (torch 2.15, oneDNN)
# computes the weight gradient of a 1x1 convolution with a stride wrongly when the input is
# channels_last and has few channels (3 or 4: MobileOne's stem; 16 was right), and at times
# writes out of bounds (a crash later, at exit): relative errors of 0.5-1.0 against the NCHW
# call. A channels_last CPU training graph (`conv_layout="auto"` with grouped convolutions,
# or a channels_last model) calls it so. The weight gradient of such a convolution is that of
# a stride-1 one over the input's strided subsample (`x[:, :, ::s, ::s]`, which ATen gets
# right), so braze computes it that way, and the input's and bias's gradients as before.
def strided_pointwise_backward(grad_out, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask):
    """``aten.convolution_backward`` of a strided 1x1 convolution (`strided_pointwise`), its
    weight gradient over the input's strided subsample."""
    dx = db = dw = None
    if mask[0] or mask[2]:
        dx, _, db = aten.convolution_backward(grad_out, x, weight, bias_sizes, stride, padding, dilation, transposed,
                                              output_padding, groups, [mask[0], False, mask[2]])
    if mask[1]:
        xs = x[:, :, :: int(stride[0]), :: int(stride[1])]
        _, dw, _ = aten.convolution_backward(grad_out, xs, weight, bias_sizes, [1, 1], padding, dilation, transposed,
                                             output_padding, groups, [False, True, False])
    return dx, dw, db


strided_pointwise_backward.__name__ = "aten.convolution_backward[strided 1x1]"
