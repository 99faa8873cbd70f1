"""Attention over the keys it attends: a static KV cache's unwritten tail left out.

A language model exported with a static cache (transformers' export) attends over the whole
cache at every step, `context` positions, its mask removing those past the last written one:
a 128-token prompt at context 320 computes 320 keys a query, a decode step at position 10
computes 320 where 11 count, and each grouped-query layer first copies the whole cache to
repeat its heads. `attended` rewrites a part so that each attention with a boolean mask works
on the keys some query attends (`_attended`: the mask read once a run, up to its last True
key), the cache sliced before its heads are repeated. Exact: a key that no query attends adds
nothing to any query's softmax. A mask that attends nothing, and any attention this does not
recognise (no boolean mask, a key or value that is not the cache's view), run as exported.

For a compiler (runtimes/compiled_step.py), a count read from the mask is a value it would
specialise on, compiling again at every length: `attended(module, keys=True)` takes the count
as the length of a last input instead (KEYS, made by `keyed` before the compiled call, from
the part's `cache_position`: a causal query at position p attends no key past p; or, for a
later part of a split model, which gets its mask made by an earlier part, from that mask
input as the eager part reads it), one dimension inductor compiles dynamic, once. On the
200M Llama's fp16 decode step at context 2048 (2-core EPYC): 14.4 / 16.3 / 19.7 ms at
positions 128 / 1024 / 2046, against 18.2 / 19.5 / 24.4 ms eager and 28-34 ms compiled over
the whole cache.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten
KEYS = "attended_keys"  # `attended(..., keys=True)`'s last input, and its meta: where from
POSITION = "cache_position"  # the input a causal LM's step is at (transformers' export)
_SDPA = aten.scaled_dot_product_attention.default
# what lies between the cache and the attention's key or value (grouped-query heads repeated)
_CHAIN = {aten.unsqueeze.default, aten.expand.default, aten.reshape.default,
          aten.view.default, aten._unsafe_view.default, aten.alias.default}  # noqa: SLF001
# the attention op takes grouped-query heads itself (torch >= 2.5)
_GQA = "enable_gqa" in str(_SDPA._schema)  # noqa: SLF001 - the op's schema
_SIZED = {aten.expand.default, aten.reshape.default, aten.view.default,
          aten._unsafe_view.default}  # noqa: SLF001 - ops whose second argument is a size


def _attended(mask: torch.Tensor) -> int:
    """One past the last key that some query attends (the whole length where none does).
    Under vmap (sequences batched at their own positions: runtimes/torch_eager.py
    `run_batch`), of all the batch's sequences: the last that any of them attends."""
    while torch._C._functorch.is_batchedtensor(mask):  # noqa: SLF001 - functorch's own
        mask = torch._C._functorch.get_unwrapped(mask)  # noqa: SLF001
    keys = mask.reshape(-1, mask.shape[-1]).any(0).nonzero()
    return int(keys[-1]) + 1 if keys.numel() else mask.shape[-1]


def _shape(node: object) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _chain(node: fx.Node, length: int) -> list[fx.Node] | None:
    """The view ops from the cache to `node` (the attention's key or value), the cache's
    node first; None where they are not all views that keep `length` at dim -2."""
    chain = [node]
    while chain[-1].op == "call_function" and chain[-1].target in _CHAIN:
        chain.append(chain[-1].args[0])  # type: ignore[arg-type]
        if not isinstance(chain[-1], fx.Node):
            return None
    shapes = [_shape(n) for n in chain]
    if any(s is None or len(s) < 2 or s[-2] != length or any(not isinstance(d, int) for d in s)
           for s in shapes):
        return None
    return chain[::-1]


def _grouped(chain: list[fx.Node]) -> bool:
    """Whether `chain` (from `_chain`) repeats a [batch, heads, keys, dim] cache's heads
    for grouped-query attention: unsqueeze at 2, expand that dim, merge it into the heads
    (kv head h serves query heads h * groups .. h * groups + groups - 1)."""
    shapes = [_shape(n) for n in chain]
    if len(chain) != 4 or len(shapes[0] or ()) != 4:
        return False
    (b, h, s, d), targets = shapes[0], [n.target for n in chain[1:]]  # type: ignore[misc]
    return (targets[0] is aten.unsqueeze.default and chain[1].args[1] == 2
            and targets[1] is aten.expand.default and targets[2] in _SIZED - {aten.expand.default}
            and shapes[1] == (b, h, 1, s, d) and len(shapes[2] or ()) == 5
            and shapes[2][:2] == (b, h) and shapes[2][3:] == (s, d)  # type: ignore[index]
            and shapes[3] == (b, h * shapes[2][2], s, d))  # type: ignore[index]


def attended(module: fx.GraphModule, keys: bool = False) -> fx.GraphModule:
    """The part with its attentions on the keys they attend (the module itself where none
    is recognised; else a new module on the same tensors). With `keys`, the count is the
    length of a last input, KEYS (`keyed` gives it); the module itself where the part has
    nothing to count from (no `cache_position`, nor one mask input that every attention
    reads as it is), or its caches differ in length (a sliding window's beside the whole
    context's: one count would cut the longer one short)."""
    graph = copy.deepcopy(module.graph)
    given = _counted_from(graph) if keys else None
    if keys and given is None:
        return module
    count = _count_input(graph) if given is not None else None
    ends: dict[fx.Node, fx.Node] = {}
    lengths: set[int] = set()
    for node in list(graph.nodes):
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        mask_val = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        if (node.target is not _SDPA or not isinstance(mask_val, torch.Tensor)
                or mask_val.dtype != torch.bool):
            continue
        length = mask_val.shape[-1]
        chains = [_chain(a, length) if isinstance(a, fx.Node) else None for a in node.args[1:3]]
        if not isinstance(length, int) or any(c is None for c in chains):
            continue
        if mask not in ends:
            with graph.inserting_after(mask if count is None else count):
                ends[mask] = graph.call_function(_attended, (mask,)) if count is None else \
                    graph.call_function(aten.sym_size.int, (count, 0))
        _attend(graph, node, mask, ends[mask], length, chains)  # type: ignore[arg-type]
        lengths.add(length)
    if not ends or (given is not None and len(lengths) > 1):
        return module  # (caches of several lengths, a sliding window's: one count fits none)
    if given is not None:  # (its count at most the cache's)
        given = (*given[:2], lengths.pop())
    graph.eliminate_dead_code()  # the whole cache's repeated heads (in-place writes stay)
    out = fx.GraphModule(module, graph, class_name=type(module).__name__)
    out.meta.update(module.meta)
    if given is not None:
        out.meta[KEYS] = given
    return out


def _count_input(graph: fx.Graph) -> fx.Node:
    """KEYS, a new last input, after all the others (moved first: a split's part places each
    where it is first read)."""
    places = [n for n in graph.nodes if n.op == "placeholder"]
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for place in places:
        first.prepend(place)
    with graph.inserting_after(places[-1]):
        return graph.placeholder(KEYS)


def _attend(graph: fx.Graph, node: fx.Node, mask: fx.Node, end: fx.Node, length: int,
            chains: list[list[fx.Node]]) -> None:
    """Attention `node` on the keys up to `end`: its key, value and mask sliced."""
    grouped = _GQA and all(_grouped(c) for c in chains)
    with graph.inserting_before(node):
        key, value = (_sliced(graph, c[:1] if grouped else c, end, length) for c in chains)
        short = graph.call_function(aten.slice.Tensor, (mask, -1, 0, end))
    node.args = (node.args[0], key, value, *((short,) if len(node.args) > 3 else ()),
                 *node.args[4:])
    if "attn_mask" in node.kwargs:
        node.kwargs = {**node.kwargs, "attn_mask": short}
    if grouped:
        node.kwargs = {**node.kwargs, "enable_gqa": True}


def _sliced(graph: fx.Graph, chain: list[fx.Node], end: fx.Node, length: int) -> fx.Node:
    """The chain again from the cache sliced to `end` keys: the attention's new key/value
    (a size that named the cache's `length` at dim -2 names `end`)."""
    at = graph.call_function(aten.slice.Tensor, (chain[0], -2, 0, end))
    for node in chain[1:]:
        args = list(node.args)
        args[0] = at
        size = args[1] if node.target in _SIZED else None
        if isinstance(size, (list, tuple)) and len(size) >= 2 and size[-2] == length:
            args[1] = [*size[:-2], end, size[-1]]
        at = graph.call_function(node.target, tuple(args), dict(node.kwargs))
    return at


def _counted_from(graph: fx.Graph) -> tuple[str, int, int] | None:
    """Where `keyed` counts the keys from, as (how, its input's index, the cache's length:
    filled in by `attended`): the part's `cache_position` input ("position": one past the
    largest); else, for a later part of a split (its mask made by an earlier one), the one
    boolean mask input that every attention with a mask reads as it is ("mask": one past its
    last key some query attends, `_attended`); None where it has neither."""
    places = [n for n in graph.nodes if n.op == "placeholder"]
    names = [n.name for n in places]
    if POSITION in names:
        return ("position", names.index(POSITION), 0)
    masks = {node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
             for node in graph.nodes if node.target is _SDPA}
    masks.discard(None)
    mask = masks.pop() if len(masks) == 1 else None
    val = mask.meta.get("val") if isinstance(mask, fx.Node) else None
    if mask in places and isinstance(val, torch.Tensor) and val.dtype == torch.bool:
        return ("mask", places.index(mask), 0)
    return None


def keyed(module: fx.GraphModule, call: Callable[..., Any]) -> Callable[..., Any]:
    """`call` (a compiled `attended(module, keys=True)`) on a part's inputs: KEYS made from
    them, a tensor as long as the keys attended, one past the largest position or the mask
    input's last attended key (at least 2: a size of 1 would be compiled apart; a key more
    than attended adds nothing: its mask leaves it out), its length marked dynamic."""
    how, index, length = module.meta[KEYS]

    def run(*inputs: torch.Tensor) -> Any:
        count = (int(inputs[index].max()) + 1 if how == "position"
                 else _attended(inputs[index]))
        keys = torch.empty(max(min(count, length), 2))
        torch._dynamo.mark_dynamic(keys, 0)  # noqa: SLF001 - the one dynamic size
        return call(*inputs, keys)

    return run
