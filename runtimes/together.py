"""When several sequences' decode steps share one run of a part, and at which precision
(runtimes/torch_eager.py `run_batch`: torch's vmap over the sequences' rows of the pool).

At fp32 they always do: the weights are read once for all, and a product of several rows
gives what one row's does (7e-6 apart on the 200M Llama's logits). Below fp32 the kernels
the precision search checked are one row's (oneDNN's bf16 product of several rows gave
logits 3e-2 apart from one row's; torch's fp16 product of several rows is another kernel
than its one-row GEMV, and slower than fp32's on CPUs without fp16 units: 4 rows of a
2816x1024 linear 539 us against 138 us for one). So a decode step below fp32 runs a batch on
an fp32 twin of itself (its weights packed for several rows, built at its first batch),
which is the reference the budget is measured against: within it by construction. That
reads twice the bytes a step below fp32 reads, so it pays only from some number of
sequences on: on the 2-core EPYC, the 200M Llama's fp16 step 16.5 ms alone, its fp32 twin
50 ms for 2 sequences (slower than 2 x 16.5), 41 ms for 4 (1.6x), 48 ms for 8 (2.8x). What
pays is measured, not guessed: per number of sequences, the batch's time (its first run
untimed: oneDNN makes its kernels then) against that many steps alone; one that did not pay
is tried again every RETRY-th time (the steps alone get faster once compiled, a busy host
changes both). The twin is made only where the memory left holds it twice over (the host's
MemAvailable, or its cgroup's limit where nearer): a 7B model's fp32 weights are 28 GB.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
RETRY = 64  # a batch size that did not pay is tried again this often
WEIGHT = 0.2  # of a new time in its running mean


def _mean(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)


def available() -> int | None:
    """Bytes of memory this process may still take: the host's MemAvailable, or what its
    cgroup (v2) limit leaves where that is less; None where neither is known."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
        group = Path("/sys/fs/cgroup") / Path(
            Path("/proc/self/cgroup").read_text().partition("::")[2].strip()).relative_to("/")
        limit = (group / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((group / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


class Together:
    """How one part's sequences share runs. `exact`: the part runs at fp32 (its batches run
    on the part itself); else `twin` makes its fp32 twin, or None: its sequences step alone."""

    def __init__(self, exact: bool, twin: Callable[[], Any] | None, precision: str,
                 twin_bytes: int = 0) -> None:
        self.exact, self.precision = exact, precision
        self._make_twin, self._twin, self.twin_bytes = twin, None, twin_bytes
        self.possible = exact or twin is not None
        self.runs = self.steps = 0  # runs of several sequences, and their steps
        self._alone: float | None = None  # seconds a step alone, its running mean
        self._took: dict[int, float] = {}  # sequences -> seconds of their run together
        self._tried: set[int] = set()  # batch sizes run once (their first run not timed)
        self._declined: dict[int, int] = {}  # batch sizes that did not pay: times since

    def module(self, own: Any) -> Any:
        """What a batch runs: the part itself at fp32, else its fp32 twin."""
        if self.exact:
            return own
        if self._twin is None:
            assert self._make_twin is not None
            self._twin = self._make_twin()
            log.info("several sequences step together on an fp32 twin of a %s decode step",
                     self.precision)
        return self._twin

    def pays(self, count: int) -> bool:
        """Whether `count` sequences' steps run as one batch now."""
        if self.exact:
            return True
        if not self.possible or self._alone is None:
            return False  # (their steps alone, timed first)
        if self._twin is None and not self._affordable():
            return False
        took = self._took.get(count)
        if took is None or took < count * self._alone:
            return True
        declined = self._declined[count] = self._declined.get(count, 0) + 1
        return declined % RETRY == 0

    def worth_waiting(self, count: int) -> bool:
        """Whether a batch of `count` sequences is worth waiting for (cuvild/workers/
        sessions.py gathers the steps of the sequences that stepped lately): one `pays` would
        run (not a size that did not pay: rung together all the same, it may be tried again)."""
        if self.exact:
            return True
        took = self._took.get(count)
        return self.possible and self._alone is not None and (
            took is None or took < count * self._alone)

    def _affordable(self) -> bool:
        """Whether the memory left holds the twin twice over; if not, the sequences step
        alone from now on (said once)."""
        left = available()
        if left is None or left >= 2 * self.twin_bytes:
            return True
        self.possible = False
        log.warning("several sequences step one by one on a %s decode step: its fp32 twin "
                    "would take %.1f GB, %.1f GB of memory are left", self.precision,
                    self.twin_bytes / 1e9, left / 1e9)
        return False

    def alone(self, seconds: float) -> None:
        """A sequence's step ran alone in `seconds`."""
        self._alone = _mean(self._alone, seconds)

    def ran(self, count: int, seconds: float) -> None:
        """`count` sequences' steps ran as one batch in `seconds`."""
        self.runs, self.steps = self.runs + 1, self.steps + count
        if self.exact:
            return
        if count not in self._tried:
            self._tried.add(count)
            return
        retried = self._declined.pop(count, 0)  # (a size tried again: its time now)
        self._took[count] = seconds if retried else _mean(self._took.get(count), seconds)

    def describe(self) -> str:
        """How its sequences' steps have shared runs so far (`cuvilctl partition`)."""
        said = (f"{self.steps} steps of several sequences in {self.runs} runs "
                f"({self.steps / self.runs:.1f} a run)" if self.runs else "")
        if self.exact or not self._took or self._alone is None:
            return said
        alone = self._alone
        times = ", ".join(f"{n} {'together' if t < n * alone else 'one by one'} "
                          f"({t * 1e3:.1f} ms against {n} x {alone * 1e3:.1f})"
                          for n, t in sorted(self._took.items()))
        return f"{said + ' ' if said else ''}at fp32 beside its {self.precision} steps " \
               f"alone: {times}"
