"""`torch.no_grad()` regions of a forward, put back inline.

torch.export writes a region of a forward run under another grad mode (`with
torch.no_grad():`, `torch.set_grad_enabled(False)`; PhiMoE's router, for one) as a
`higher_order.wrap_with_set_grad_enabled` call of a submodule read by get_attr. cuvild only
runs inference, where the grad mode changes nothing of what is computed, so the region's
ops are put back into the graph they came from, as `ExportedProgram.run_decompositions()`
does when it retraces: the partitioner then prices and places them like every other op,
and no part receives a submodule as an input. Other higher-order ops stay as they are
(autocast changes what a region computes)."""

from __future__ import annotations

import operator

import torch
from torch import fx


def inline_grad_regions(ep: torch.export.ExportedProgram) -> int:
    """Inline every grad-mode region of `ep`'s graph in place; returns how many. (A region
    nested in another never gets here: torch's own deserializer refuses it, torch 2.13.)"""
    gm = ep.graph_module
    regions = [n for n in gm.graph.nodes if _region(gm, n)]
    for node in regions:
        _inline(ep, gm, node)
    if regions:
        gm.recompile()
    return len(regions)


def _region(gm: fx.GraphModule, node: fx.Node) -> bool:
    if (node.op != "call_function"
            or node.target is not torch.ops.higher_order.wrap_with_set_grad_enabled):
        return False
    body = getattr(gm, str(node.args[1].target))
    return (all(n.op in ("placeholder", "call_function", "output") for n in body.graph.nodes)
            and all(u.target is operator.getitem and isinstance(u.args[1], int)
                    for u in node.users))


def _inline(ep: torch.export.ExportedProgram, gm: fx.GraphModule, node: fx.Node) -> None:
    _, holder, *operands = node.args
    inner = list(getattr(gm, holder.target).graph.nodes)
    env = dict(zip([n for n in inner if n.op == "placeholder"], operands, strict=True))
    with gm.graph.inserting_before(node):
        for n in inner:
            if n.op == "call_function":
                env[n] = gm.graph.node_copy(n, lambda a: env[a])
    (output,) = [n for n in inner if n.op == "output"]
    renamed = {}
    for user in list(node.users):
        value = env[output.args[0][user.args[1]]]
        renamed[user.name] = value.name
        user.replace_all_uses_with(value)
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    if not holder.users:
        gm.graph.erase_node(holder)
        if not any(n.op == "get_attr" and n.target == holder.target for n in gm.graph.nodes):
            delattr(gm, holder.target)
    for spec in ep.graph_signature.output_specs:  # a region's value returned as it is
        if hasattr(spec.arg, "name") and spec.arg.name in renamed:
            spec.arg.name = renamed[spec.arg.name]
