"""One request's way through a model's parts, by its deadline.

`run_parts` dispatches each part to its worker as soon as its inputs are ready (independent
parts run at once; requests in flight pipeline across devices), through one of two transports
(`Parts`): bells (cuvild/run/bells.py `Rung`: a doorbell per part, the request's block
named in a record) or pickled `Run` orders (`Orders` here: thread workers, records too small
for the request's regions). The loop, its deadline and its failures are the same for both.
Every wait has the request's deadline (time.monotonic()): for a worker's restart, for a reply
read directly, for the replies of parts in flight. When it passes, the request fails with
RunTimeout naming the part it waited for, its device and the seconds; and when the caller
gave the request at least the engine's `run_timeout_s` (it was patient), the worker that gave
no reply in all that time is taken as hung: it is killed and restarted. Parts still out when
a request gives up may still write its block: the RunTimeout's `outstanding` futures complete
when they no longer can.

A worker that died fails the request with WorkerLost (the engine runs it once more when the
worker is back); a part that names a client region no longer holding its bytes fails it with
BadRegion.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any, Protocol

from cuvild.engine.errors import BadRegion, InferError, RunTimeout, WorkerLost
from cuvild.engine.plane import Served, Timeline
from cuvild.workers.handle import ReplyTimeout, WorkerDied
from protos.orders import Reply, Run, TensorRef

if TYPE_CHECKING:
    from cuvild.engine.arena import Block
    from cuvild.engine.loaded import LoadedModel, Route

FEEDBACK_RUNS = 20  # a part's measured runs that teach the cost model (once per load)
# A request's timeline, when it is traced: (route, dispatched, replied), perf_counter_ns.
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


def measured(engine: Served, model: LoadedModel, route: Route, run_ms: float) -> None:
    """A part's run time, as its worker measured it: kept (the last 100), told to the
    monitor, and once per load, at FEEDBACK_RUNS runs, taught to the cost model."""
    route.measured_ms.append(run_ms)
    del route.measured_ms[:-100]
    if engine.monitor:
        engine.monitor.part(model, route, run_ms / 1e3)
    if len(route.measured_ms) == FEEDBACK_RUNS and not route.fed_back:
        route.fed_back = True
        engine.corrections.later(engine.feedback, model.key)


def usable(engine: Served, route: Route, deadline: float) -> None:
    """Wait, by the deadline, for the part's worker to be back if it is being restarted."""
    t0 = time.monotonic()
    if not engine.workers.wait_usable(route.device, deadline - t0):
        raise RunTimeout(f"part {route.id} on {route.device}: its worker was being restarted "
                         f"and was not back in {time.monotonic() - t0:.1f} s (the request's "
                         "deadline)")


class Orders:
    """A request's parts sent to their workers as pickled `Run` orders, the replies read by
    each worker's reader thread; a part alone in the engine is called and its reply read in
    the request's thread (no reader thread between). The transport `run_parts` drives where
    bells do not fit (thread workers, a record too small for the request's regions)."""

    def __init__(self, engine: Served, model: LoadedModel, block: Block,
                 refs: dict[str, TensorRef]) -> None:
        self.engine, self.model, self.block, self.refs = engine, model, block, refs
        self.running: dict[Future[Reply], Route] = {}
        self.done: list[Answer] = []  # answered as they were sent (alone)
        self.late: tuple[Route, int] | None = None  # alone, and no reply by the deadline

    def _ref(self, name: str) -> TensorRef:
        return self.refs.get(name) or self.engine.arena.ref(self.block, self.model.slots[name])

    def out(self) -> bool:
        return bool(self.running or self.done or self.late)

    def send(self, route: Route, deadline: float, alone: bool) -> None:
        worker = self.engine.workers.of(route.device)
        order = Run(self.model.key, route.id, [self._ref(n) for n in route.inputs],
                    [self._ref(n) for n in route.outputs])
        if not alone or self.engine.active != 1:  # (others: queued in the worker's pipe,
            self.running[worker.call(order)] = route  # read by its reader thread)
            return
        try:
            self.done.append(_answer(route, worker.run(order, deadline)))
        except WorkerDied as e:
            self.done.append(_answer(route, e))
        except ReplyTimeout as e:
            if e.late is not None:  # sent: the block waits for its reply
                e.late.generation = e.generation  # type: ignore[attr-defined]
                self.running[e.late] = route
            self.late = (route, e.generation)

    def wait(self, deadline: float) -> list[Answer]:
        if self.done or self.late:
            done, self.done = self.done, []
            return done
        finished, _ = wait(list(self.running), timeout=max(0.0, deadline - time.monotonic()),
                           return_when=FIRST_COMPLETED)
        answers = []
        for future in finished:
            route = self.running.pop(future)
            try:
                answers.append(_answer(route, future.result()))
            except WorkerDied as e:
                answers.append(_answer(route, e))
        return answers

    def pending(self) -> list[tuple[Route, int]]:
        """The parts out, with the start (generation) of the worker each went to."""
        out = [(r, getattr(f, "generation", 0)) for f, r in self.running.items()]
        return out + ([self.late] if self.late and self.late[0] not in self.running.values()
                      else [])

    def outstanding(self) -> list[Future[Any]]:
        return list(self.running)


def _answer(route: Route, reply: Reply | WorkerDied) -> Answer:
    where = f"part {route.id} on {route.device} ({route.runtime})"
    if isinstance(reply, WorkerDied):
        return route, WorkerLost(f"{where} failed: {reply}", {route.device}), 0.0
    if not reply.ok or reply.result is None:
        error = BadRegion if reply.kind == "invalid" else InferError
        return route, error(f"{where} failed: {reply.error}"), 0.0
    return route, None, reply.result.run_ms  # type: ignore[union-attr]


def run_parts(engine: Served, model: LoadedModel, parts: Parts, timeline: Timeline | None,
              deadline: float, patient: bool) -> None:
    """Run the request's parts through `parts` (Orders here, bells.Rung): each part starts
    as soon as its inputs are ready; the answers are waited for by the deadline.
    (`engine`: the Engine, which imports this module.)"""
    ready = set(model.inputs)
    waiting = list(model.routes)
    sent: dict[str, tuple[float, int]] = {}  # monotonic (the deadline's), perf_counter_ns
    failure: InferError | None = None
    dead: set[str] = set()
    try:
        while waiting or parts.out():
            startable = ([r for r in waiting if all(i in ready for i in r.inputs)]
                         if failure is None else [])
            # Nothing to overlap with: the transport may wait for the part's answer as it
            # sends it (a bell's blocking read; a Run's reply read in this thread when no
            # other request is in flight)
            alone = len(startable) == 1 and not parts.out()
            for route in startable:
                waiting.remove(route)
                usable(engine, route, deadline)
                sent[route.id] = (time.monotonic(), time.perf_counter_ns())
                parts.send(route, deadline, alone)
            if not parts.out():
                break
            answers = parts.wait(deadline)
            if not answers:
                raise _expired(engine, parts.pending(), sent, patient)
            traced = (timeline, sent) if timeline is not None else None
            failed = _take(engine, model, answers, ready, dead, traced)  # (each answer)
            failure = failure or failed
    except RunTimeout as e:
        e.outstanding = parts.outstanding()  # type: ignore[attr-defined]
        raise
    finally:
        for device in dead:
            engine.workers.revive_later(device)
    if failure is not None:
        raise failure


def _take(engine: Served, model: LoadedModel, answers: list[Answer], ready: set[str],
          dead: set[str], traced: tuple[Timeline, dict[str, tuple[float, int]]] | None,
          ) -> InferError | None:
    """Take the parts' answers: a done part's outputs are ready (its run time measured, its
    span on the timeline); the first failure is returned (WorkerLost: every device lost)."""
    failure: InferError | None = None
    for route, error, run_ms in answers:
        if error is None:
            measured(engine, model, route, run_ms)
            if traced is not None:
                traced[0].append((route, traced[1][route.id][1], time.perf_counter_ns()))
            ready.update(route.outputs)
            continue
        if isinstance(error, WorkerLost):
            dead.add(route.device)
            error = WorkerLost(str(error), dead)
        failure = failure or error
    return failure


def _expired(engine: Served, pending: list[tuple[Route, int]], sent: dict[str, tuple[float, int]],
             patient: bool) -> RunTimeout:
    """The deadline passed with parts out: the first sent is named; with a patient request,
    their workers are taken as hung (killed and restarted)."""
    route = min((r for r, _ in pending), key=lambda r: sent[r.id][0])
    killed = patient and any([engine.workers.hung(r.device, gen) for r, gen in pending])
    return RunTimeout(f"part {route.id} on {route.device} ({route.runtime}) gave no reply in "
                      f"{time.monotonic() - sent[route.id][0]:.1f} s (the request's deadline)"
                      + ("; its worker was stopped and is being restarted" if killed else ""))
