"""Attention rows whose boolean mask attends no key, computed as torch computes them.

torch's scaled_dot_product_attention gives such a row zeros (its safe softmax, torch >= 2.5);
OpenVINO's gives NaN and ONNX Runtime's the values' average (a softmax over -inf everywhere).
Real inputs have such rows: ModernBERT's local attention over a padded sequence (a padded
query whose window holds only padding), the first queries of a left-padded batch through a
decoder. A NaN there does not stay there: the next layer's attention multiplies it by a zero
weight in every row that masks it out, and 0 x NaN is NaN (a mean-pooled embedding of such a
row is NaN whole).

`empty_rows_zeroed(part)` gives each attention with a boolean mask a mask in which an empty
row attends every key, and zeroes that row's output after: every other row is computed as
before, bit for bit. The runtimes whose attention differs (runtimes/openvino.py,
runtimes/onnxruntime.py) compile the part through it.
"""

from __future__ import annotations

import copy

import torch
from torch import fx

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default


def _mask(node: fx.Node) -> fx.Node | None:
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    val = mask.meta.get("val") if isinstance(mask, fx.Node) else None
    return mask if isinstance(val, torch.Tensor) and val.dtype == torch.bool else None


def empty_rows_zeroed(module: fx.GraphModule) -> fx.GraphModule:
    """The part with each boolean-masked attention's empty rows zeroed (a new module on the
    same tensors), or the part itself where it has no boolean-masked attention."""
    if not any(n.target is _SDPA and _mask(n) is not None for n in module.graph.nodes):
        return module
    graph = copy.deepcopy(module.graph)
    made: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}  # a mask's (attends, widened): once, for
    for node in [n for n in graph.nodes if n.target is _SDPA]:  # every layer that reads it
        mask = _mask(node)
        if mask is None:
            continue
        if mask not in made:
            with graph.inserting_after(mask):
                attends = graph.call_function(aten.any.dim, (mask, -1, True))
            with graph.inserting_after(attends):
                empty = graph.call_function(aten.logical_not.default, (attends,))
            with graph.inserting_after(empty):
                made[mask] = attends, graph.call_function(aten.logical_or.default, (mask, empty))
        attends, widened = made[mask]
        node.replace_input_with(mask, widened)
        with graph.inserting_after(node):
            zeroed = graph.call_function(aten.mul.Tensor, (node, attends))
        node.replace_all_uses_with(zeroed, delete_user_cb=lambda user, z=zeroed: user is not z)
    graph.lint()
    out = fx.GraphModule(module, graph, class_name=type(module).__name__)
    out.meta.update(module.meta)
    return out
