"""Sequences: the requests of a stateful model that share one state, as Triton's sequence
semantics have it (`sequence_id`, `sequence_start`, `sequence_end`).

A stateful model's parts update buffers in place (a language model's KV cache: transformers'
static-cache export). Each part keeps a copy of them per sequence slot in the worker that runs
it (runtimes/torch_eager.py `TorchExecutable.use`): on that device, never copied per step. A
request names its slot in its bell's record; slot 0 is a request outside any sequence (it
runs on a fresh state). Here the daemon keeps which slot each live sequence has:
- `begin` a sequence: a new slot (a sequence started again under a live id starts over);
  refused at `cap` live sequences;
- `get` it for a step: an unknown id, one ended, timed out or whose worker restarted since
  it began (its state went with the worker) each answer a clear error;
- `end` it (its last step, an idle timeout, the model's unload): the workers drop its state.
At the cap, a sequence the prefix cache keeps (cuvild/run/prefixes.py) ends first.
A sequence runs one step at a time (its lock): its steps are ordered by their callers.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from cuvild.core.errors import InferError
from cuvild.core.layout import BadInput

REMEMBERED = 1024  # ended sequences whose reason a late step is told
# Slots are unique in this process, whatever Runner gives them: a thread worker's state is
# kept by slot in the process (runtimes/torch_eager.py), beside other engines' (the tests').
_SLOTS = itertools.count(1)


class SequenceError(BadInput):
    """A step names a sequence that is not live (unknown, ended, timed out, its state lost)."""


class TooManySequences(InferError):
    """`cap` sequences are live: a new one waits for one to end."""

    kind = "exhausted"


@dataclass
class Live:
    key: str  # the model's
    id: str  # the caller's sequence_id
    slot: int
    workers: dict[str, int]  # device -> the worker's generation when it began
    last: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    holds: bool = False  # whether its workers hold state of it yet (a step ran, or a copy)


class Sequences:
    def __init__(self, generation: Callable[[str], int],
                 drop: Callable[[str, int, list[str]], None], cap: int = 64,
                 idle_s: float = 300.0) -> None:
        """`generation(device)`: its worker's start count; `drop(key, slot, devices)`: have
        those workers drop the slot's state; `cap` live sequences at most; a sequence idle
        `idle_s` ends."""
        self.generation, self.drop = generation, drop
        self.cap, self.idle_s = cap, idle_s
        self._live: dict[tuple[str, str], Live] = {}
        # at the cap, end a sequence nobody runs (the prefix cache's: cuvild/run/prefixes.py)
        # before refusing a new one: False where there is none
        self.spare: Callable[[], bool] = lambda: False
        self._gone: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._live)

    def begin(self, key: str, seq_id: str, devices: list[str]) -> Live:
        """A new sequence of model `key` on the workers of `devices`."""
        self.reap()
        while self._full(key, seq_id) and self.spare():
            pass
        with self._lock:
            old = self._live.pop((key, seq_id), None)
            if old is None and len(self._live) >= self.cap:
                raise TooManySequences(f"model {key}: {self.cap} sequences are live, the most "
                                       "this daemon keeps (engine.sequences.max_live); end "
                                       "one first")
            live = Live(key, seq_id, next(_SLOTS) & 0xFFFFFFFF or 1,
                        {d: self.generation(d) for d in devices})
            self._live[(key, seq_id)] = live
            self._gone.pop((key, seq_id), None)
        if old is not None:
            self.drop(key, old.slot, list(old.workers))
        return live

    def _full(self, key: str, seq_id: str) -> bool:
        with self._lock:
            return (key, seq_id) not in self._live and len(self._live) >= self.cap

    def get(self, key: str, seq_id: str) -> Live:
        """The live sequence for a step, or SequenceError saying why it is not."""
        self.reap()
        with self._lock:
            live = self._live.get((key, seq_id))
            reason = self._gone.get((key, seq_id))
        if live is None:
            raise SequenceError(f"sequence {seq_id!r} of model {key}: "
                                + (reason or "unknown (start it with sequence_start)"))
        lost = self._lost(live)
        if lost:
            self.end(live, f"its state was lost: the worker of {', '.join(lost)} restarted "
                           "since it began (start it again)")
            return self.get(key, seq_id)
        live.last = time.monotonic()
        return live

    def alive(self, live: Live) -> bool:
        """Whether `live` is live and its state still in its workers."""
        with self._lock:
            if self._live.get((live.key, live.id)) is not live:
                return False
        return not self._lost(live)

    def _lost(self, live: Live) -> list[str]:
        """The devices whose worker restarted since `live` began holding state there (one
        that holds none yet is on the workers there are now: begun while one restarted)."""
        if not live.holds:
            live.workers = {d: self.generation(d) for d in live.workers}
        return [d for d, g in live.workers.items() if self.generation(d) != g]

    def end(self, live: Live, reason: str = "ended (sequence_end)") -> None:
        with self._lock:
            if self._live.get((live.key, live.id)) is not live:
                return
            del self._live[(live.key, live.id)]
            self._gone[(live.key, live.id)] = reason
            while len(self._gone) > REMEMBERED:
                self._gone.popitem(last=False)
        self.drop(live.key, live.slot, list(live.workers))

    def drop_model(self, key: str, reason: str = "its model was unloaded") -> None:
        for live in [s for s in list(self._live.values()) if s.key == key]:
            self.end(live, reason)

    def reap(self) -> None:
        """End the sequences idle past idle_s."""
        now = time.monotonic()
        for live in [s for s in list(self._live.values()) if now - s.last > self.idle_s]:
            if live.lock.acquire(blocking=False):  # (not one taking a step now)
                try:
                    self.end(live, f"ended after {self.idle_s:g} s idle "
                                   "(engine.sequences.idle_timeout_s)")
                finally:
                    live.lock.release()
