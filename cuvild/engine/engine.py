"""The engine: the device workers, the data plane and the control plane, wired once.

- `Workers` (cuvild/workers/workers.py): one per device, started on first use, revived when
  one dies (its parts put back by warm.revive);
- `Runner` (cuvild/run/runner.py): the data plane; it reads the snapshot of what is served;
- `Builder` (cuvild/load/builder.py): the control plane; it alone publishes that snapshot,
  and `Buckets` (cuvild/load/buckets.py) builds a dynamic-shape model's bucket on a miss.

Nothing is handed the engine: the daemon hands each room the object it uses. `prepare`,
`infer` and `close` are here for callers in this process (tests, benches, the daemon's start).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cuvild.core.arena import Arena
from cuvild.core.loaded import LoadedModel
from cuvild.load import prepare, warm
from cuvild.load.buckets import Buckets
from cuvild.load.builder import Builder
from cuvild.run.runner import PREFIX_CACHE, Runner
from cuvild.workers.workers import Workers
from partitioner.profile import DeviceProfile

if TYPE_CHECKING:
    import torch


class Engine:
    def __init__(self, devices: Sequence[DeviceProfile], cache_dir: Path, arena: Arena,
                 workers: str = "process", max_in_flight: int = 4,
                 build_timeout_s: float = 600.0, compile_timeout_s: float = 300.0,
                 corrections_path: Path | None = None, run_timeout_s: float = 60.0,
                 max_buckets: int = 8, max_dim: int = 4096,
                 runtimes: dict[str, list[str]] | None = None, max_sequences: int = 64,
                 sequence_idle_s: float = 300.0, prefix_cache_bytes: int = PREFIX_CACHE) -> None:
        """`workers`: "process" or "thread" (`engine.workers`); `run_timeout_s`: a request's
        deadline when its caller gives none, and how long a worker may give no reply before
        it is restarted; `max_buckets`: input shapes kept per dynamic-shape model, up to
        `max_dim`; `runtimes`: device id or kind -> runtimes; `max_sequences` of stateful
        models live at once, each ended after `sequence_idle_s` idle, and finished ones kept
        up to `prefix_cache_bytes` of state for later prompts (cuvild/run/prefixes.py)."""
        self.workers = Workers({d.id: d for d in devices}, cache_dir, workers,
                               run_timeout_s, lambda device, worker: warm.revive(
                                   self.builder, device, worker))
        self.runner = Runner(arena, self.workers, max_in_flight, run_timeout_s, max_dim,
                             max_sequences, sequence_idle_s, prefix_cache_bytes)
        self.builder = Builder(devices, cache_dir, self.workers, self.runner,
                               build_timeout_s, compile_timeout_s, corrections_path, runtimes)
        self.buckets = Buckets(self.builder, max_buckets)
        self.runner.miss = self.buckets.miss
        # a model's parts measured: the cost model learns from them on its own thread
        self.runner.measured = lambda model: self.builder.corrections.later(
            self.builder.feedback, model)

    @property
    def arena(self) -> Arena:
        return self.runner.arena

    def prepare(self, key: str, name: str, version: str, archive: Path,
                input_specs: list[dict[str, Any]], **options: Any) -> LoadedModel | None:
        """Load a model (cuvild/load/prepare.py says how and what `options` are)."""
        return prepare.prepare(self.builder, key, name, version, archive, input_specs,
                               **options)

    def infer(self, key: str, inputs: Sequence[torch.Tensor],
              deadline: float | None = None) -> list[torch.Tensor]:
        """Run model `key` on host tensors (Runner.infer)."""
        return self.runner.infer(key, inputs, deadline)

    def close(self) -> None:
        self.buckets.close()
        self.workers.close()
        self.builder.corrections.close()
