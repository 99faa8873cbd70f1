"""One request's way through a model's parts, by its deadline.

`run_parts` dispatches each part to its worker as soon as its inputs are ready (independent
parts run at once; requests in flight pipeline across devices). Every wait has the request's
deadline (time.monotonic()): for a worker's restart, for a reply read directly, for the
replies of parts in flight. When it passes, the request fails with RunTimeout naming the part
it waited for, its device and the seconds; and when the caller gave the request at least the
engine's `run_timeout_s` (it was patient), the worker that gave no reply in all that time is
taken as hung: it is killed and restarted. Parts still out when a request gives up may still
write its block: the RunTimeout's `outstanding` futures complete when they no longer can.

A worker that died fails the request with WorkerLost (the engine runs it once more when the
worker is back); a part that names a client region no longer holding its bytes fails it with
BadRegion.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any

from cuvild.engine.errors import BadRegion, InferError, RunTimeout, WorkerLost
from cuvild.engine.handle import ReplyTimeout, WorkerDied, WorkerHandle
from cuvild.engine.orders import Reply, Run, TensorRef

if TYPE_CHECKING:
    from cuvild.engine.arena import Block
    from cuvild.engine.loaded import LoadedModel, Route

FEEDBACK_RUNS = 20  # a part's measured runs that teach the cost model (once per load)
# A request's timeline, when it is traced: (route, dispatched, replied), perf_counter_ns.
Timeline = list[tuple["Route", int, int]]


def measured(engine: Any, model: LoadedModel, route: Route, run_ms: float) -> None:
    """A part's run time, as its worker measured it: kept (the last 100), told to the
    monitor, and once per load, at FEEDBACK_RUNS runs, taught to the cost model."""
    route.measured_ms.append(run_ms)
    del route.measured_ms[:-100]
    if engine.monitor:
        engine.monitor.part(model, route, run_ms / 1e3)
    if len(route.measured_ms) == FEEDBACK_RUNS and not route.fed_back:
        route.fed_back = True
        engine.corrections.later(engine.feedback, model.key)


def usable(engine: Any, route: Route, deadline: float) -> None:
    """Wait, by the deadline, for the part's worker to be back if it is being restarted."""
    t0 = time.monotonic()
    if not engine.workers.wait_usable(route.device, deadline - t0):
        raise RunTimeout(f"part {route.id} on {route.device}: its worker was being restarted "
                         f"and was not back in {time.monotonic() - t0:.1f} s (the request's "
                         "deadline)")


def run_parts(engine: Any, model: LoadedModel, block: Block, refs: dict[str, TensorRef],  # noqa: C901, PLR0915 - the dispatch loop; one for bells and lanes is planned
              timeline: Timeline | None, deadline: float, patient: bool) -> None:
    """Run the request's parts (`engine`: the Engine, which imports this module)."""
    def ref(name: str) -> TensorRef:
        return refs.get(name) or engine.arena.ref(block, model.slots[name])

    dispatched: dict[str, int] = {}  # perf_counter_ns, for a timeline
    sent: dict[str, float] = {}  # time.monotonic() of each part's dispatch
    ready = set(model.inputs)
    waiting = list(model.routes)
    running: dict[Future[Reply], Route] = {}
    failure: InferError | None = None
    dead: set[str] = set()

    def finish(route: Route, reply: Reply | WorkerDied) -> InferError | None:
        where = f"part {route.id} on {route.device} ({route.runtime})"
        if isinstance(reply, WorkerDied):
            dead.add(route.device)
            return WorkerLost(f"{where} failed: {reply}", dead)
        if not reply.ok or reply.result is None:
            error = BadRegion if reply.kind == "invalid" else InferError
            return error(f"{where} failed: {reply.error}")
        measured(engine, model, route, reply.result.run_ms)  # type: ignore[union-attr]
        if timeline is not None:
            timeline.append((route, dispatched[route.id], time.perf_counter_ns()))
        ready.update(route.outputs)
        return None

    def start(route: Route) -> tuple[WorkerHandle, Run]:
        waiting.remove(route)
        worker = engine.workers.of(route.device)
        usable(engine, route, deadline)
        sent[route.id] = time.monotonic()
        if timeline is not None:
            dispatched[route.id] = time.perf_counter_ns()
        return worker, Run(model.key, route.id, [ref(n) for n in route.inputs],
                           [ref(n) for n in route.outputs])

    def expired(route: Route, hung: list[tuple[str, int]]) -> RunTimeout:
        waited = time.monotonic() - sent[route.id]
        killed = patient and any([engine.workers.hung(device, gen) for device, gen in hung])
        return RunTimeout(f"part {route.id} on {route.device} ({route.runtime}) gave no reply "
                          f"in {waited:.1f} s (the request's deadline)"
                          + ("; its worker was stopped and is being restarted" if killed
                             else ""))

    try:
        while waiting or running:
            startable = ([r for r in waiting if all(i in ready for i in r.inputs)]
                         if failure is None else [])
            if len(startable) == 1 and not running and engine.active == 1:
                # Nothing to overlap with: call and read the reply in this thread. (With
                # other requests in flight, queueing in the worker's pipe keeps it busy.)
                route = startable[0]
                worker, order = start(route)
                try:
                    reply: Reply | WorkerDied = worker.run(order, deadline)
                except WorkerDied as e:
                    reply = e
                except ReplyTimeout as e:
                    if e.late is not None:  # sent: the block waits for its reply
                        running[e.late] = route
                    raise expired(route, [(route.device, e.generation)]) from None
                failure = finish(route, reply)
                continue
            for route in startable:
                worker, order = start(route)
                running[worker.call(order)] = route
            if not running:
                break
            done, _ = wait(list(running), timeout=max(0.0, deadline - time.monotonic()),
                           return_when=FIRST_COMPLETED)
            if not done:
                first = min(running.values(), key=lambda r: sent[r.id])
                raise expired(first, [(r.device, getattr(f, "generation", 0))
                                      for f, r in running.items()])
            for future in done:
                route = running.pop(future)
                try:
                    reply = future.result()
                except WorkerDied as e:
                    reply = e
                failed = finish(route, reply)
                failure = failure or failed
    except RunTimeout as e:
        e.outstanding = list(running)  # type: ignore[attr-defined]
        raise
    finally:
        for device in dead:
            engine.workers.revive_later(device)
    if failure is not None:
        raise failure
