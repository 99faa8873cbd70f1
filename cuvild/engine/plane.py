"""The engine as each plane sees it. The modules that serve a request (request.py,
bells.py, batching.py) and those that build and restore models (buckets.py, warm.py) are
handed the engine (cuvild/engine/engine.py) but may not import it, which imports them: they
name what they read of it here, and engine.Engine is both."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from cuvild.engine.arena import Arena
from cuvild.engine.loaded import LoadedModel, Route
from cuvild.load.corrections import CorrectionStore
from cuvild.workers.clientmem import DaemonRegions
from cuvild.workers.workers import Workers
from partitioner.profile import DeviceProfile

if TYPE_CHECKING:
    from partitioner.plan import Plan
    from partitioner.split import SplitProgram

Timeline = list[tuple[Route, int, int]]  # a traced request's parts: route, start, end (ns)


class Monitor(Protocol):
    """What watches the engine (cuvild/serve/metrics.py): told of each request's wait for a
    place in flight and of each part's run, on the request's thread (keep it cheap)."""

    def queued(self, model: LoadedModel, seconds: float) -> None: ...

    def part(self, model: LoadedModel, route: Route, seconds: float) -> None: ...

    def batched(self, model: LoadedModel, rows: int, waits: list[float]) -> None: ...


class Served(Protocol):
    """The data plane's view: the models, the workers that run their parts, the daemon's
    arena and its readings of clients' regions, and what learns from each run."""

    models: dict[str, LoadedModel]
    workers: Workers
    arena: Arena
    regions: DaemonRegions
    corrections: CorrectionStore
    monitor: Monitor | None
    run_timeout_s: float

    def feedback(self, key: str, min_runs: int = 3) -> int: ...

    def resolve(self, model: LoadedModel, given: Sequence[tuple[str, tuple[int, ...]]],
                deadline: float | None = None) -> LoadedModel: ...

    def run(self, model: LoadedModel, inputs: Sequence[Any],
            output_refs: dict[str, Any] | None = None, raw: bool = False,
            timeline: Timeline | None = None, deadline: float | None = None,
            into: Sequence[memoryview] | None = None, batched: bool = False) -> list[Any]: ...


class Builds(Protocol):
    """The control plane's view: the devices, the models and their buckets, and the steps
    that build, check and drop them."""

    devices: dict[str, DeviceProfile]
    models: dict[str, LoadedModel]
    workers: Workers
    corrections: CorrectionStore
    counters: Counter[str]
    buckets_lock: threading.Lock
    max_buckets: int
    build_timeout_s: float

    def support(self) -> dict[str, Any]: ...

    @staticmethod
    def make_routes(plan: Plan, split: SplitProgram) -> list[Route]: ...

    def build(self, model: LoadedModel, only_device: str | None = None,
              policy: Any = None, deadline: float | None = None,
              progress: Callable[[str], None] | None = None) -> None: ...

    def unload(self, key: str, wait_s: float = 0.0) -> None: ...

    def run(self, model: LoadedModel, inputs: Sequence[Any],
            output_refs: dict[str, Any] | None = None, raw: bool = False,
            timeline: Timeline | None = None, deadline: float | None = None,
            into: Sequence[memoryview] | None = None) -> list[Any]: ...
