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
