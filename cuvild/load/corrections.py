"""The cost model's learned corrections, kept on disk for the engine.

`partitioner/corrections.py` holds the learning rule and the numbers (plain data); this keeps
them under `state_dir/corrections/<hardware fingerprint>.json` (a new host, or new hardware,
starts from the profile again), written with `write_atomic` after each lesson, read at start
(an unreadable file is logged and replaced, never trusted). Lessons are learned on one
background thread: the request path only hands them over.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from partitioner.corrections import Corrections, Prior
from runtimes.base import write_atomic

log = logging.getLogger(__name__)


class Lesson(NamedTuple):
    """One measured part, as the corrections learn from it."""

    device: str
    runtime: str  # its key: "triton@bf16" (cuvild/load/precision.py runtime_key)
    class_ms: Mapping[str, float]
    kernels: int
    prior: Prior
    measured_ms: float
    model: str


class CorrectionStore:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._corrections = self._read()

    def _read(self) -> Corrections:
        if self.path is None or not self.path.exists():
            return Corrections()
        try:
            return Corrections.from_dict(json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("ignoring unreadable cost corrections %s: %s", self.path, e)
            return Corrections()

    def snapshot(self) -> Corrections:
        """A copy to plan with: lessons learned meanwhile do not change a plan being made."""
        with self._lock:
            return Corrections.from_dict(self._corrections.to_dict())

    def learn(self, parts: list[Lesson]) -> None:
        """Observe each measured part (partitioner/corrections.py `observe`), then persist."""
        if not parts:
            return
        with self._lock:
            for p in parts:
                self._corrections.observe(p.device, p.runtime, p.class_ms, p.kernels, p.prior,
                                          p.measured_ms, p.model)
            data = json.dumps(self._corrections.to_dict(), indent=1).encode()
            if self.path is not None:
                write_atomic(self.path, data)
        log.info("cost model learned from %d measured part(s)", len(parts))

    def later(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the lessons' own thread (made on first use)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="feedback")
            pool = self._pool
        pool.submit(fn, *args)

    def close(self) -> None:
        """Let the lessons' thread end (a lesson being learned is finished first)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
