"""What is kept of a prepared model: one route per part (its device, runtime, precision and
the tensors it reads and writes) and the wiring of a request through them; a dynamic-shape
model's family of buckets, and what a bucket is besides a model."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cuvild.core.layout import BadInput, InputSpec, Slot
from cuvild.core.precision import Accuracy, PrecisionPolicy
from protos.orders import Built, TensorRef, Variant

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from partitioner.plan import Plan
    from partitioner.split import SplitProgram


@dataclass(frozen=True)
class Batching:
    """`max_batch`: rows merged into one run at most (1: off); `max_delay_us`: how long the
    oldest queued request may wait for others."""

    max_batch: int = 8
    max_delay_us: int = 500


@dataclass(frozen=True)
class Out:
    """Where a request's outputs go (one mode per caller): those named in `refs` are written
    in place in clients' regions (None stands for them); the rest are copied `into` places
    (one per output; nothing is returned), or returned as bytes (`raw`) or as fresh tensors."""

    refs: Mapping[str, TensorRef] = field(default_factory=dict)
    raw: bool = False
    into: Sequence[memoryview] | None = None


class Queue(Protocol):
    """A batched model's queue (cuvild/run/batching.py `Batcher`), shared by its buckets: a
    request goes in and comes back answered, from its batch's run."""

    settings: Batching

    def run(self, model: LoadedModel, inputs: Sequence[Any], out: Out,
            deadline: float | None, timeline: Timeline | None = None) -> list[Any]: ...

    def stats(self) -> dict[str, Any]: ...


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
    generation: int = -1  # the start of its device's worker that built it (-1: not known)


Shapes = tuple[tuple[int, ...], ...]  # a request's input shapes, one tuple per input
Timeline = list[tuple[Route, int, int]]  # a traced request's parts: route, start, end (ns)


@dataclass
class Family:
    """What a dynamic-shape model keeps to build a bucket per concrete input shape on first use
    (cuvild/load/buckets.py)."""

    dims: list[tuple[int, int, int, int]]  # (input index, dim, low, high) per symbolic dim
    split: SplitProgram | None = None  # its split: a bucket is laid out from it
    # where the engine planned it, its program: each bucket is planned again at its shapes
    program: ExportedProgram | None = None
    replans: bool = False
    record_at: Path | None = None  # its load record's folder: its buckets' records under it
    # its buckets, in the order they were built (recency: each one's Bucket.used)
    buckets: OrderedDict[Shapes, LoadedModel] = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # held by a bucket's build
    # generation's twin of the model: its logits at the last position only (LAST; made by
    # cuvild/load/buckets.py last_logits); in a twin's Family, the model it is the twin of
    twin: LoadedModel | None = None
    owner: LoadedModel | None = None
    # a language model's plan to time its own against at its warm-up, with how each is named
    # (cuvild/load/guard.py, cuvild/load/warmup.py `guarded`); None once timed, or none
    alternative: tuple[Plan, str, str] | None = None
    # a language model under a budget: its program, until its warm-up has checked a
    # generation of the buckets served against it at fp32 (cuvild/load/warmup.py `held`)
    reference: ExportedProgram | None = None


LAST = "last"  # a model's key + "@" + LAST: its generation twin (its sequences the model's)


@dataclass
class Bucket:
    """What a bucket (a dynamic-shape model built for one input shape) is besides a model.
    The data plane holds it while a request runs (`hold`, `let_go`: its use count and when it
    was last used); the control plane evicts it only when no request holds it (`evict`)."""

    of: str  # its model's key
    shapes: Shapes
    users: int = 0  # its requests running now: it is not evicted under them
    evicted: bool = False  # unloaded to keep its model's count bounded
    own_split: bool = False  # planned at its own shapes, apart from its model's plan
    used: float = field(default_factory=time.monotonic)  # its last request's start (or build)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def hold(self) -> bool:
        """Count a request in; False when the bucket was evicted (build it again)."""
        with self.lock:
            if self.evicted:
                return False
            self.users += 1
            self.used = time.monotonic()
            return True

    def let_go(self) -> None:
        with self.lock:
            self.users -= 1

    def evict(self) -> bool:
        """Mark it evicted unless a request holds it; True if it was."""
        with self.lock:
            if self.users:
                return False
            self.evicted = True
            return True


@dataclass
class State:
    """What a stateful model keeps between the steps of a sequence (cuvild/run/sequences.py):
    its buffers updated in place, their bytes per sequence, and the longest sequence they
    hold (a KV cache's length, dim 2 of its [batch, heads, length, dim] tensors; 0: none).
    `croppable`: a static KV cache, every layer's as long as the context, and the counts of
    positions written (0-d integers), nothing else: cut back to its first n positions by
    setting the counts to n (cuvild/run/prefixes.py; not a sliding window's rolling one)."""

    buffers: int
    nbytes: int
    context: int
    croppable: bool = False


@dataclass
class LoadedModel:
    """A prepared model as every plane reads it: a static-shape model, a dynamic-shape one
    (`family`: it serves no request itself, its buckets do) or a bucket (`bucket`)."""

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
    part_input_shapes: dict[str, list[list[int]]] = field(default_factory=dict)
    policy: PrecisionPolicy | None = None  # what it was built under
    cut_bytes: int = 0  # bytes one request hands from part to part through the arena
    accuracy: Accuracy | None = None  # what the load measured end to end
    warm: bool = False  # loaded from its load record (cuvild/load/warm.py)
    objective: str = "latency"
    # Dynamic batching (cuvild/run/batching.py): the model's queue, shared by its buckets,
    # or why it is not batched ("" when it was not asked)
    batcher: Queue | None = None
    unbatched: str = ""
    family: Family | None = None  # a dynamic-shape model's
    bucket: Bucket | None = None  # a bucket's
    state: State | None = None  # a stateful model's (a language model's cache)

    @property
    def dynamic(self) -> list[tuple[int, int, int, int]]:
        """Its symbolic input dims ([] for a static-shape model and for a bucket)."""
        return self.family.dims if self.family else []

    @property
    def evicted(self) -> bool:
        return self.bucket is not None and self.bucket.evicted

    @property
    def split_key(self) -> str:
        """What a worker caches this model's split under: a bucket shares its model's,
        unless it was planned apart."""
        return self.bucket.of if self.bucket and not self.bucket.own_split else self.key


def check_dims(model: LoadedModel, given: Sequence[tuple[str, tuple[int, ...]]],
               max_dim: int) -> None:
    """Refuse a dynamic dimension above `max_dim` (BadInput names the input, the dimension
    and the limit)."""
    for i, d, _, _ in model.dynamic:
        size = given[i][1][d]
        if size > max_dim:
            raise BadInput(f"input {model.table[i].name}: dim {d} is {size}, above the "
                           f"largest this server builds for a dynamic dimension ({max_dim})")


def cut_bytes(model: LoadedModel) -> int:
    """Bytes one request hands from a part to another (0 before a dynamic model's layout)."""
    produced = {n for r in model.routes for n in r.outputs}
    crossing = produced & {n for r in model.routes for n in r.inputs}
    return sum(model.slots[n].nbytes for n in crossing if n in model.slots)


def one_part(model: LoadedModel) -> bool:
    """Whether the model is one part that takes the model's inputs and gives its outputs,
    in order: a fast-path session's slots (the model's) are then the part's own."""
    return (len(model.routes) == 1 and model.routes[0].inputs == model.inputs
            and model.routes[0].outputs == model.outputs)


def part_stats(model: LoadedModel) -> dict[str, Any]:
    """Predicted vs measured time per part (the profile feedback)."""
    predicted = {p.id: p.predicted_ms for p in model.plan.parts}
    out = {}
    for r in model.routes:
        ms = sorted(r.measured_ms)
        out[r.id] = {"device": r.device, "runtime": r.runtime, "precision": r.precision,
                     "predicted_ms": predicted.get(r.id, 0.0),
                     "measured_ms": ms[len(ms) // 2] if ms else None,
                     "candidates": r.built.candidates if r.built else []}
    return out


def bucket_stats(model: LoadedModel) -> list[dict[str, Any]]:
    """A dynamic-shape model's buckets, most recently used last: the input shapes, and where
    each part runs for them (the runtime is chosen per bucket, by timing it at its shapes;
    under a budget its precision too, and `precision` says why)."""
    twin = model.family.twin if model.family else None
    kept = [(s, b, False) for s, b in model.family.buckets.items()] if model.family else []
    kept += [(s, b, True) for s, b in twin.family.buckets.items()] if twin and twin.family \
        else []
    kept.sort(key=lambda item: item[1].bucket.used if item[1].bucket else 0.0)
    return [{"shapes": [list(s) for s in shapes], "key": bucket.key,
             "parts": [{**stats, "id": part} for part, stats in part_stats(bucket).items()],
             "precision": bucket.accuracy.notes if bucket.accuracy else [],
             **({"logits": "last position (generation)"} if last else {})}
            for shapes, bucket, last in kept]
