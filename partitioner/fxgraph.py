"""Read a torch.export graph into a CostGraph: shapes from the fake tensors in node.meta["val"].

Symbolic sizes are replaced by their hints (the example inputs' sizes), so costs are those of
the example batch, or by the sizes given (`sizes`: a dynamic-shape model planned for one
concrete shape, say a batch of 8). getitem nodes that pick one value from a tuple result are
folded into the op that produced the tuple: a cut between them would move a tuple no runtime
can compile as a part boundary, and the plan still lists their names in the producer's part.
"""

from __future__ import annotations

from contextvars import ContextVar
from math import prod
from typing import Any

import torch
from torch.fx.experimental import symbolic_shapes

from partitioner import flops
from partitioner.costgraph import ANNOTATION_KEY, Annotation, CostGraph, CostNode, Edge

# A symbolic size's hint, under the name this torch gives it: optimization_hint from 2.13,
# size_hint in 2.11 (the GPU machines' torch; its hint_int warns that it is size_hint).
optimization_hint = next(getattr(symbolic_shapes, name) for name in
                         ("optimization_hint", "size_hint", "hint_int")
                         if hasattr(symbolic_shapes, name))

DTYPE_NAMES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "int8",
    torch.uint8: "int8", torch.float64: "fp64", torch.int64: "int64", torch.int32: "int32",
    torch.bool: "bool",
}  # fmt: skip
SCALAR_BYTES = 8  # a SymInt or Python number crossing a cut
# The sizes a build_costgraph call gives its symbols, by name (None: the hints).
_SIZES: ContextVar[dict[str, int] | None] = ContextVar("sizes", default=None)
# Shape queries read no data: a cut into one moves nothing but the dependency.
SHAPE_QUERIES = {"sym_size", "sym_numel", "sym_stride", "sym_storage_offset"}


def build_costgraph(ep: Any, sizes: dict[str, int] | None = None) -> CostGraph:
    """CostGraph of an ExportedProgram; node names are the graph's own. `sizes`: symbol name
    ("s0") -> size, used instead of the hints."""
    token = _SIZES.set(sizes or None)
    try:
        return _build(ep)
    finally:
        _SIZES.reset(token)


def updated(node: Any) -> Any:
    """The value an aten op updates in place (its first argument), None for any other node."""
    target, args = node.target, node.args
    if (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)  # noqa: SLF001 - aten's op type
            and target._schema.is_mutable and args and isinstance(args[0], torch.fx.Node)):  # noqa: SLF001 - its schema
        return args[0]
    return None


def keeps_state(ep: Any) -> bool:
    """The program updates buffers in place (transformers' static-cache export writes its
    KV cache with index_copy_): it keeps state from one run to the next."""
    buffers = {s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "BUFFER"}
    return any(getattr(updated(n), "name", None) in buffers for n in ep.graph.nodes)


def input_symbols(ep: Any) -> dict[str, tuple[int, int]]:
    """Each symbol that is a size of the program's inputs ("s0"), with its range (an end
    torch leaves open, its own infinity included, reads 2**62)."""
    ranges = {str(sym): r for sym, r in ep.range_constraints.items()}
    nodes = {n.name: n for n in ep.graph.nodes}
    out = {}
    for name in ep.graph_signature.user_inputs:
        for size in getattr(nodes[name].meta.get("val"), "shape", ()):
            expr = getattr(getattr(size, "node", None), "expr", None)
            if expr is None or not expr.is_Symbol:
                continue
            r = ranges.get(str(expr))
            low, high = (getattr(r, "lower", None), getattr(r, "upper", None))
            out[str(expr)] = (int(low) if getattr(low, "is_Integer", False) else 0,
                              int(high) if getattr(high, "is_Integer", False) else 2**62)
    return out


def _build(ep: Any) -> CostGraph:
    graph = ep.graph_module.graph
    params, user_inputs = _placeholder_kinds(ep)
    compute = [n for n in graph.nodes if n.op == "call_function"]
    owner = {n: _fold_target(n) for n in compute}  # node -> the compute node that stands for it
    kept = [n for n in compute if owner[n] is n]
    index = {n: i for i, n in enumerate(kept)}
    aliases: dict[Any, list[str]] = {n: [] for n in kept}
    for n in compute:
        if owner[n] is not n:
            aliases[owner[n]].append(n.name)

    edges: dict[tuple[int, int], list] = {}
    nodes = []
    for n in kept:
        nodes.append(_cost_node(n, params, user_inputs, aliases[n]))
    for n in compute:
        dst = index[owner[n]]
        for a in n.all_input_nodes:
            if a.op != "call_function" or owner[a] is owner[n]:
                continue
            key = (index[owner[a]], dst)
            entry = edges.setdefault(key, [0, []])
            if a.name not in entry[1]:
                if _short_name(n.target) not in SHAPE_QUERIES:
                    entry[0] += _value_bytes(a.meta.get("val"))
                entry[1].append(a.name)
    _mark_outputs(graph, owner, index, nodes)
    param_bytes = {name: _value_bytes(n.meta.get("val")) for n, name in _by_name(graph, params)}
    input_bytes = {
        name: _value_bytes(n.meta.get("val")) for n, name in _by_name(graph, user_inputs)
    }
    return CostGraph(
        nodes,
        [Edge(s, d, b, tuple(t)) for (s, d), (b, t) in sorted(edges.items())],
        param_bytes,
        input_bytes,
    )


def _placeholder_kinds(ep: Any) -> tuple[set[str], set[str]]:
    from torch.export.graph_signature import InputKind

    params, user_inputs = set(), set()
    for spec in ep.graph_signature.input_specs:
        name = getattr(spec.arg, "name", None)
        if name is None:
            continue
        if spec.kind == InputKind.USER_INPUT:
            user_inputs.add(name)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            params.add(name)
    return params, user_inputs


def _by_name(graph: Any, names: set[str]) -> list[tuple[Any, str]]:
    return [(n, n.name) for n in graph.nodes if n.op == "placeholder" and n.name in names]


def _fold_target(node: Any) -> Any:
    """The compute node a getitem-of-a-tuple stands for; other nodes stand for themselves."""
    while _short_name(node.target) == "getitem" and node.args:
        src = node.args[0]
        if getattr(src, "op", None) != "call_function":
            break
        if not isinstance(src.meta.get("val"), (tuple, list)):
            break
        node = src
    return node


def _cost_node(node: Any, params: set[str], user_inputs: set[str], aliases: list[str]) -> CostNode:
    op = _short_name(node.target)
    val = node.meta.get("val")
    in_shapes, read = [], 0
    for a in _flat_args(node):
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            in_shapes.append(_shape(v))
            read += _value_bytes(v)
        else:
            in_shapes.append(None)
    out_shape = _shape(val)
    out_bytes = _value_bytes(val)
    kind = flops.category(op)
    written = out_bytes
    if kind == "view":
        read = written = 0
    elif op == "embedding" and in_shapes and in_shapes[0] is not None:
        # only the looked-up rows of the table are read
        read = out_bytes + _value_bytes(node.args[1].meta.get("val"))
    args = [_shape(a.meta.get("val")) if isinstance(a, torch.fx.Node) else a for a in node.args]
    inputs = [a.name for a in node.all_input_nodes if a.op == "placeholder"]
    if op in SHAPE_QUERIES:
        inputs, read = [], 0
    return CostNode(
        name=node.name,
        target=str(node.target),
        op=op,
        category=kind,
        flops=flops.op_flops(op, in_shapes, out_shape, args),
        bytes_read=read,
        bytes_written=written,
        out_bytes=out_bytes,
        dtype=_dtype_name(val),
        params=tuple(a for a in inputs if a in params),
        inputs=tuple(a for a in inputs if a in user_inputs),
        annotation=Annotation.from_meta(node.meta.get("custom", {}).get(ANNOTATION_KEY)),
        aliases=tuple(aliases),
        updates_state=getattr(updated(node), "name", None) in params,
        fx_node=node,
    )


def _mark_outputs(graph: Any, owner: dict, index: dict, nodes: list[CostNode]) -> None:
    for n in graph.nodes:
        if n.op != "output":
            continue
        for a in n.all_input_nodes:
            if a.op == "call_function":
                node = nodes[index[owner[a]]]
                node.output_bytes += max(_value_bytes(a.meta.get("val")), 1)
                node.output_names += (a.name,)


def _flat_args(node: Any) -> list[Any]:
    """Positional then keyword arguments, with lists of nodes (cat, stack) flattened."""
    out = []
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in a):
            out.extend(a)
        else:
            out.append(a)
    return out


def _short_name(target: Any) -> str:
    text = str(target)
    if text.startswith("aten."):
        return text.split(".")[1]
    return getattr(target, "__name__", text).split(".")[0]


def _hint(size: Any) -> int:
    if isinstance(size, int):
        return size
    given = _SIZES.get()
    expr = getattr(getattr(size, "node", None), "expr", None)
    if given and expr is not None and hasattr(expr, "free_symbols"):
        known = {sym: given[sym.name] for sym in expr.free_symbols if sym.name in given}
        if len(known) == len(expr.free_symbols):
            return int(expr.xreplace(known))
    try:
        return int(optimization_hint(size))
    except Exception:  # an unbacked size has no hint: cost it as 1, like torch's own fallback
        hint = getattr(getattr(size, "node", None), "hint", None)
        return int(hint) if hint is not None else 1


def _shape(val: Any) -> tuple[int, ...] | None:
    """Shape with sizes hinted; a tuple result gives its first tensor's (the main output)."""
    if isinstance(val, (list, tuple)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    if isinstance(val, torch.Tensor):
        return tuple(_hint(s) for s in val.shape)
    return None


def _value_bytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return prod(_hint(s) for s in val.shape) * val.dtype.itemsize
    if isinstance(val, (list, tuple)):
        return sum(_value_bytes(v) for v in val)
    if val is None:
        return 0
    return SCALAR_BYTES


def _dtype_name(val: Any) -> str:
    if isinstance(val, (list, tuple)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    if isinstance(val, torch.Tensor):
        return DTYPE_NAMES.get(val.dtype, str(val.dtype).replace("torch.", ""))
    return "scalar"
