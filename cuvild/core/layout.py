"""What a model looks like to a request: its input table, and where every tensor that crosses
a part boundary lives in a request's arena block.

The input table is built once, at load; a request is checked against it once (count, dtype,
shape, the range of each dynamic dimension), by `check_inputs`. The layout gives each crossing
tensor an offset from the tensors' lifetimes: tensors that are never alive at the same time
share bytes (cuvild/core/arena.py `plan_offsets`). A request runs each part as soon as its
inputs are ready (cuvild/run/request.py), so parts that do not depend on each other may run
at once, in any order: a lifetime spans every step its producer and readers may run at
(`windows`), not the steps of the split's list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cuvild.core.arena import plan_offsets
from cuvild.core.dtypes import nbytes, oip_name


class BadInput(ValueError):
    """A request's inputs do not match the model (name, count, dtype or shape)."""

    kind = "invalid"


@dataclass
class Slot:
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class InputSpec:
    """One model input as the model was exported: -1 where a dimension is dynamic, with the
    range of each dynamic dimension."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    ranges: tuple[tuple[int, int, int], ...] = ()  # (dim, low, high) per dynamic dim


def input_table(specs: list[dict[str, Any]],
                dynamic: list[tuple[int, int, int, int]]) -> list[InputSpec]:
    """The input table of a model from its registry specs and its dynamic dims."""
    return [InputSpec(s["name"], s["dtype"], tuple(s["shape"]),
                      tuple((d, low, high) for i2, d, low, high in dynamic if i2 == i))
            for i, s in enumerate(specs)]


def check_inputs(model: str, table: Sequence[InputSpec],
                 given: Sequence[tuple[str, tuple[int, ...]]]) -> None:
    """Raise BadInput naming the first input whose (dtype, shape) does not fit the table."""
    if len(given) != len(table):
        raise BadInput(f"model {model} takes {len(table)} inputs "
                       f"({', '.join(s.name for s in table)}), got {len(given)}")
    for spec, (dtype, shape) in zip(table, given, strict=True):
        if dtype != spec.dtype:
            raise BadInput(f"input {spec.name}: expected dtype {spec.dtype} "
                           f"({oip_name(spec.dtype)}), got {dtype} ({oip_name(dtype)})")
        if len(shape) != len(spec.shape) or (not spec.ranges and tuple(shape) != spec.shape):
            raise BadInput(f"input {spec.name}: expected shape {list(spec.shape)}, got "
                           f"{list(shape)}")
        for d, want in enumerate(spec.shape):
            if want >= 0 and shape[d] != want:
                raise BadInput(f"input {spec.name}: dim {d} must be {want}, got {shape[d]}")
        for d, low, high in spec.ranges:
            if not low <= shape[d] <= high:
                top = "unbounded" if high >= 2**62 else high
                raise BadInput(f"input {spec.name}: dim {d} is {shape[d]}, outside the "
                               f"exported range [{low}, {top}]" + (
                                   " (torch.export gave it a minimum of 2: export with "
                                   "Dim(name, min=1) to serve 1)" if low == 2 else ""))


def dynamic_dims(ep: Any) -> list[tuple[int, int, int, int]]:
    """(input index, dim, low, high) for every symbolic dimension of the user inputs."""
    nodes = {n.name: n for n in ep.graph.nodes}
    ranges = {str(sym): r for sym, r in ep.range_constraints.items()}
    out = []
    for i, name in enumerate(ep.graph_signature.user_inputs):
        val = nodes[name].meta.get("val")
        for d, size in enumerate(getattr(val, "shape", ())):
            if isinstance(size, int):
                continue
            r = ranges.get(str(size.node.expr))
            low = _bound(r.lower if r is not None else None, 0)
            high = _bound(r.upper if r is not None else None, 2**62)
            out.append((i, d, low, high))
    return out


def _bound(value: Any, unbounded: int) -> int:
    """A range end as an int, `unbounded` where it has none. torch's own infinity (`int_oo`,
    what Dim("batch") with no max=, Dim.AUTO and Dim.DYNAMIC give) calls itself finite, so
    only a sympy Integer counts as a number."""
    return int(value) if getattr(value, "is_Integer", False) else unbounded


def _slot(val: Any) -> Slot:
    import torch

    if not isinstance(val, torch.Tensor):
        raise ValueError(f"a value crossing parts is not a tensor ({type(val).__name__})")
    if any(not isinstance(d, int) for d in val.shape):
        raise ValueError("a crossing tensor has a symbolic shape: lay out a dynamic-shape "
                         "model per concrete input shape")
    return Slot(str(val.dtype).removeprefix("torch."), tuple(int(d) for d in val.shape))


def layout(meta: dict[str, Any], split: Any) -> tuple[dict[str, Slot], int, int]:
    """Offsets for every tensor crossing a part boundary, from their lifetimes. `meta` maps
    value names to tensors (or fake tensors) with concrete shapes; `split` is the
    SplitProgram. Returns the slots, the footprint (the peak of live bytes) and what the same
    tensors would take without sharing."""
    slots: dict[str, Slot] = {}
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for name in split.inputs:
        slots[name], first[name], last[name] = _slot(meta[name]), 0, 0
    for part, (lo, hi) in zip(split.parts, windows(split), strict=True):
        for name in part.inputs:
            last[name] = max(last.get(name, hi), hi)
        for name in part.outputs:
            slots[name], first[name], last[name] = _slot(meta[name]), lo, hi
    for name in split.outputs:
        last[name] = len(split.parts) + 1  # read back after the last part
    sizes = {n: s.nbytes for n, s in slots.items()}
    offsets, footprint = plan_offsets(sizes, {n: (first[n], last[n]) for n in slots})
    for name, off in offsets.items():
        slots[name].offset = off
    return slots, footprint, sum(sizes.values())


def windows(split: Any) -> list[tuple[int, int]]:
    """Per part (steps 1..n, the split's order), the first and last step it may run at: from
    the first part that is not one it waits for, to the last that does not wait for it (a
    chain's part i: (i, i)). A value written by a part whose window starts after the windows
    of every reader of another have ended is written after they read it."""
    producer = {name: i for i, part in enumerate(split.parts) for name in part.outputs}
    before: list[set[int]] = []  # per part, the parts it waits for, directly or not
    for part in split.parts:
        waits: set[int] = set()
        for name in part.inputs:
            if name in producer:
                waits |= {producer[name], *before[producer[name]]}
        before.append(waits)
    n = len(split.parts)
    return [(1 + min((j for j in range(i) if j not in before[i]), default=i),
             1 + max((j for j in range(i, n) if i not in before[j]), default=i))
            for i in range(n)]
