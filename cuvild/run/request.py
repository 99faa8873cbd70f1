"""One request's way through a model's parts, by its deadline.

`run_parts` dispatches each part to its worker as soon as its inputs are ready (independent
parts run at once; requests in flight pipeline across devices), through the request's bells
(`Parts`: cuvild/run/bells.py `Rung`, a doorbell per part, the request's block named in a
record). Every wait has the request's deadline (time.monotonic()): for a worker's restart,
for a part alone's answer, for the answers of parts in flight. When it passes, the request
fails with RunTimeout naming the part it waited for, its device and the seconds; and when
the caller gave the request at least the runner's `run_timeout_s` (it was patient), the
worker that gave no reply in all that time is taken as hung: it is killed and restarted.
Parts still out when a request gives up may still write its block: the RunTimeout's
`outstanding` futures complete when they no longer can.

A worker that died fails the request with WorkerLost (the runner runs it once more when the
worker is back); a part that names a client region no longer holding its bytes fails it with
BadRegion.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from cuvild.core.errors import InferError, RunTimeout, WorkerLost

if TYPE_CHECKING:
    from cuvild.core.loaded import LoadedModel, Route
    from cuvild.core.served import Timeline
    from cuvild.workers.workers import Workers

FEEDBACK_RUNS = 20  # a part's measured runs that teach the cost model (once per load)
# A part's answer: its failure (None: done; WorkerLost: its worker died) and its run time, ms.
Answer = tuple["Route", "InferError | None", float]


class Parts(Protocol):
    """How a request's parts reach their workers and answer (`run_parts` drives it)."""

    def out(self) -> bool: ...  # parts sent and not yet answered, or answers not yet taken

    def send(self, route: Route, deadline: float, alone: bool) -> None: ...  # alone: no other
    # part of the request is out or startable

    def wait(self, deadline: float) -> list[Answer]: ...  # none: the deadline passed

    def pending(self) -> list[tuple[Route, int]]: ...  # parts out, their workers' starts

    def outstanding(self) -> list[Future[Any]]: ...  # done once the block is free of them


Measure = Callable[["LoadedModel", "Route", float], None]  # a part's run time, ms


def usable(workers: Workers, route: Route, deadline: float) -> None:
    """Wait, by the deadline, for the part's worker to be back if it is being restarted."""
    t0 = time.monotonic()
    if not workers.wait_usable(route.device, deadline - t0):
        raise RunTimeout(f"part {route.id} on {route.device}: its worker was being restarted "
                         f"and was not back in {time.monotonic() - t0:.1f} s (the request's "
                         "deadline)")


def run_parts(workers: Workers, measure: Measure, model: LoadedModel, parts: Parts,
              timeline: Timeline | None, deadline: float, patient: bool) -> None:
    """Run the request's parts through `parts` (bells.Rung): each part starts as soon as
    its inputs are ready; the answers are waited for by the deadline, and each part's run
    time is handed to `measure`."""
    ready = set(model.inputs)
    waiting = list(model.routes)
    sent: dict[str, tuple[float, int]] = {}  # monotonic (the deadline's), perf_counter_ns
    failure: InferError | None = None
    dead: set[str] = set()
    try:
        while waiting or parts.out():
            startable = ([r for r in waiting if all(i in ready for i in r.inputs)]
                         if failure is None else [])
            # Nothing to overlap with: the part's answer is waited for as it is sent (a
            # bell's blocking read)
            alone = len(startable) == 1 and not parts.out()
            for route in startable:
                waiting.remove(route)
                usable(workers, route, deadline)
                sent[route.id] = (time.monotonic(), time.perf_counter_ns())
                parts.send(route, deadline, alone)
            if not parts.out():
                break
            answers = parts.wait(deadline)
            if not answers:
                raise _expired(workers, parts.pending(), sent, patient)
            traced = (timeline, sent) if timeline is not None else None
            failed = _take(measure, model, answers, ready, dead, traced)  # (each answer)
            failure = failure or failed
    except RunTimeout as e:
        e.outstanding = parts.outstanding()
        raise
    finally:
        for device in dead:
            workers.revive_later(device)
    if failure is not None:
        raise failure


def _take(measure: Measure, model: LoadedModel, answers: list[Answer], ready: set[str],
          dead: set[str], traced: tuple[Timeline, dict[str, tuple[float, int]]] | None,
          ) -> InferError | None:
    """Take the parts' answers: a done part's outputs are ready (its run time measured, its
    span on the timeline); the first failure is returned (WorkerLost: every device lost)."""
    failure: InferError | None = None
    for route, error, run_ms in answers:
        if error is None:
            measure(model, route, run_ms)
            if traced is not None:
                traced[0].append((route, traced[1][route.id][1], time.perf_counter_ns()))
            ready.update(route.outputs)
            continue
        if isinstance(error, WorkerLost):
            dead.add(route.device)
            error = WorkerLost(str(error), dead)
        failure = failure or error
    return failure


def _expired(workers: Workers, pending: list[tuple[Route, int]], sent: dict[str, tuple[float, int]],
             patient: bool) -> RunTimeout:
    """The deadline passed with parts out: the first sent is named; with a patient request,
    their workers are taken as hung (killed and restarted)."""
    route = min((r for r, _ in pending), key=lambda r: sent[r.id][0])
    killed = patient and any([workers.hung(r.device, gen) for r, gen in pending])
    return RunTimeout(f"part {route.id} on {route.device} ({route.runtime}) gave no reply in "
                      f"{time.monotonic() - sent[route.id][0]:.1f} s (the request's deadline)"
                      + ("; its worker was stopped and is being restarted" if killed else ""))
