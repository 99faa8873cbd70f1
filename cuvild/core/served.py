"""What the data plane reads: an immutable snapshot of the served models and their buckets,
and what watches the requests it runs.

The control plane (cuvild/load/builder.py) alone makes a new `Served` and hands it to the
runner (cuvild/run/runner.py) in one assignment; a request reads the snapshot it started
with, and never writes one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from cuvild.core.loaded import LoadedModel, Route, Shapes, Timeline

__all__ = ["Monitor", "Served", "Timeline"]


@dataclass(frozen=True)
class Served:
    """The models served now by key, and the buckets built of dynamic-shape models by
    (model key, input shapes). A bucket is also served by its own key (the fast path's
    sessions and the stats name it)."""

    models: Mapping[str, LoadedModel] = field(default_factory=lambda: MappingProxyType({}))
    buckets: Mapping[tuple[str, Shapes], LoadedModel] = field(
        default_factory=lambda: MappingProxyType({}))

    def adding(self, model: LoadedModel) -> Served:
        """This snapshot with `model` served (a bucket under its shapes too)."""
        buckets = dict(self.buckets)
        if model.bucket is not None:
            buckets[(model.bucket.of, model.bucket.shapes)] = model
        return Served(MappingProxyType({**self.models, model.key: model}),
                      MappingProxyType(buckets))

    def without(self, key: str) -> Served:
        """This snapshot without model `key` (a bucket's shapes go with it)."""
        gone = self.models.get(key)
        return Served(MappingProxyType({k: m for k, m in self.models.items() if k != key}),
                      MappingProxyType({k: b for k, b in self.buckets.items() if b is not gone}))


class Monitor(Protocol):
    """What watches the runner (cuvild/serve/metrics.py): told of each request's wait for a
    place in flight and of each part's run, on the request's thread (keep it cheap)."""

    def queued(self, model: LoadedModel, seconds: float) -> None: ...

    def part(self, model: LoadedModel, route: Route, seconds: float) -> None: ...

    def batched(self, model: LoadedModel, rows: int, waits: list[float]) -> None: ...
