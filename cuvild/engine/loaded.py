"""What the engine keeps of a prepared model: one route per part (its device, runtime,
precision and the tensors it reads and writes) and the wiring of a request through them."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cuvild.engine.layout import InputSpec, Slot
from cuvild.engine.orders import Built, Variant

if TYPE_CHECKING:
    from partitioner.plan import Plan
    from partitioner.split import SplitProgram


@dataclass
class Route:
    id: str
    device: str
    precision: str
    inputs: list[str]
    outputs: list[str]
    runtime: str = ""
    built: Built | None = None
    measured_ms: list[float] = field(default_factory=list)
    fed_back: bool = False  # its measurements have taught the cost model
    # The precisions to build it at (its own first, then a search's candidates) and the
    # error budget of the others; once built, the best runtime at each precision.
    precisions: list[str] = field(default_factory=list)
    search: list[str] = field(default_factory=list)  # every precision a search may try
    tolerance: float | None = None
    budget: float | None = None  # the model's end-to-end budget under `auto` (a mix aims under it)
    variants: dict[str, Variant] = field(default_factory=dict)


@dataclass
class LoadedModel:
    key: str
    name: str
    version: str
    plan: Plan
    routes: list[Route]
    inputs: list[str]  # graph value names, in the model's order
    outputs: list[str]
    table: list[InputSpec]  # what a request is checked against, once
    slots: dict[str, Slot]
    footprint: int  # bytes per request: the peak of live tensors
    total_bytes: int  # what the same tensors would take without sharing
    archive: str = ""
    input_specs: list[dict[str, Any]] = field(default_factory=list)
    parts_by_device: dict[str, list[str]] = field(default_factory=dict)
    # Dynamic shapes: (input index, dim, low, high) per symbolic input dim; the split is kept
    # to lay out and build one variant per concrete shape (bucket) on first use.
    dynamic: list[tuple[int, int, int, int]] = field(default_factory=list)
    split: SplitProgram | None = None
    # its buckets, least recently used first (cuvild/load/buckets.py)
    variants: OrderedDict[tuple[tuple[int, ...], ...], LoadedModel] = field(
        default_factory=OrderedDict)
    variant_lock: threading.Lock = field(default_factory=threading.Lock)
    base_key: str = ""
    shapes: tuple[tuple[int, ...], ...] = ()  # a bucket's input shapes
    users: int = 0  # a bucket's requests running now: it is not evicted under them
    evicted: bool = False  # a bucket unloaded to keep its model's count bounded
    part_input_shapes: dict[str, list[list[int]]] = field(default_factory=dict)
    policy: Any = None  # the PrecisionPolicy it was built under (cuvild/load/precision.py)
    cut_bytes: int = 0  # bytes one request hands from part to part through the arena
    accuracy: Any = None  # what the load measured end to end (precision.Accuracy)
    warm: bool = False  # loaded from its load record (cuvild/load/warm.py)
    # A dynamic-shape model's load record: its buckets' records are kept under it
    record_at: Any = None
    replans: bool = False  # the engine planned it: each bucket is planned at its shapes
    # A dynamic-shape model the engine planned keeps its program: each bucket is planned
    # again at its own shapes (cuvild/load/buckets.py), and one placed otherwise has its
    # own split (own_split)
    program: Any = None
    objective: str = "latency"
    own_split: bool = False
    # Dynamic batching (cuvild/run/batching.py): the model's queue, shared by its buckets,
    # or why it is not batched ("" when it was not asked)
    batcher: Any = None
    unbatched: str = ""

    @property
    def split_key(self) -> str:
        """What a worker caches this model's split under: a bucket shares its model's,
        unless it was planned apart."""
        return self.base_key if self.base_key and not self.own_split else self.key


def cut_bytes(model: LoadedModel) -> int:
    """Bytes one request hands from a part to another (0 before a dynamic model's layout)."""
    produced = {n for r in model.routes for n in r.outputs}
    crossing = produced & {n for r in model.routes for n in r.inputs}
    return sum(model.slots[n].nbytes for n in crossing if n in model.slots)


def part_stats(model: LoadedModel) -> dict[str, Any]:
    """Predicted vs measured time per part (the profile feedback)."""
    predicted = {p.id: p.predicted_ms for p in model.plan.parts}
    out = {}
    for r in model.routes:
        ms = sorted(r.measured_ms)
        out[r.id] = {"device": r.device, "runtime": r.runtime,
                     "predicted_ms": predicted.get(r.id, 0.0),
                     "measured_ms": ms[len(ms) // 2] if ms else None,
                     "candidates": r.built.candidates if r.built else []}
    return out


def bucket_stats(model: LoadedModel) -> list[dict[str, Any]]:
    """A dynamic-shape model's buckets, most recently used last: the input shapes, and where
    each part runs for them (the runtime is chosen per bucket, by timing it at its shapes)."""
    return [{"shapes": [list(s) for s in shapes], "key": variant.key,
             "parts": [{**stats, "id": part} for part, stats in part_stats(variant).items()]}
            for shapes, variant in list(model.variants.items())]
