"""Attention calls in Dynamo's graph, before AOTAutograd traces them.

``F.scaled_dot_product_attention`` picks its kernel when AOTAutograd traces it: flash,
memory-efficient, cuDNN, or the math composition (two batched matmuls around a softmax,
upcast to f32 for bf16/f16 inputs). Under ``torch.compile`` Hugging Face models build their
padding mask as a broadcast view, e.g. ``(B, 1, S, S)`` with strides ``(0, S, 1, 0)``; a mask
whose last dim has stride 0 rules out every fused kernel, so eager's one fused kernel became
f32 matmuls and a softmax: BERT-base b16 s512 inference ran at 0.67x eager on the GPU.

:func:`dense_masks` gives such masks unit stride along their last dim (one small copy of the
mask per call), so the memory-efficient kernel takes them as in eager with a padding mask.
"""
from __future__ import annotations

import torch

_SDPA = {torch._C._nn.scaled_dot_product_attention}
if hasattr(torch.nn.functional, "scaled_dot_product_attention"):
    _SDPA.add(torch.nn.functional.scaled_dot_product_attention)

# A mask larger than this (elements) is left as it is rather than materialized.
MAX_MASK_ELEMENTS = 1 << 26


def _mask_of(node):
    """The call's mask and where it is: "attn_mask" (a keyword) or 3 (a position)."""
    if "attn_mask" in node.kwargs:
        return node.kwargs["attn_mask"], "attn_mask"
    if len(node.args) > 3:
        return node.args[3], 3
    return None, None


def dense_masks(gm: torch.fx.GraphModule) -> int:
    """Rewrites ``gm`` in place: CUDA attention masks with a stride-0 last dim are made
    contiguous before the attention call. Returns how many were."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        mask, where = _mask_of(node)
        if not isinstance(mask, torch.fx.Node):
            continue
        val = mask.meta.get("example_value", mask.meta.get("val"))
        if not isinstance(val, torch.Tensor) or val.device.type != "cuda" or val.dim() == 0:
            continue
        if val.stride(-1) != 0 or val.size(-1) <= 1 or val.numel() > MAX_MASK_ELEMENTS:
            continue
        with gm.graph.inserting_before(node):
            dense = gm.graph.call_method("contiguous", (mask,))
        dense.meta.update(mask.meta)
        dense.meta["example_value"] = val.contiguous()
        if where == "attn_mask":
            node.kwargs = {**node.kwargs, "attn_mask": dense}
        else:
            node.args = (*node.args[:3], dense, *node.args[4:])
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed

