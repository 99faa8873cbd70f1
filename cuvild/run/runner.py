"""The data plane's one object: a request from its checked inputs to its outputs.

The `Runner` owns the arena (each request's tensors), the doorbells that ring the workers
(bells.py), the limit on requests in flight and the daemon's readings of clients' regions; it
reads the snapshot of what is served (`served`, cuvild/core/served.py), which the control
plane (cuvild/load/builder.py) alone replaces. A request never calls the control plane:

1. `resolve` checks the inputs against the model's input table (the one check; BadInput names
   what is wrong). A static-shape model is served as it is. A dynamic-shape model's bucket for
   these shapes is looked up in the snapshot; a miss is one future asked of `miss` (the
   Builder builds it off the request's thread) and waited for by the deadline.
2. `run` hands a batched model's request to its queue (batching.py), which comes back to
   `execute` with the merged run; else `execute` at once.
3. `execute` takes a place in flight (a bucket is held, not evicted, while it runs), a block
   of the arena, puts the inputs in it, rings each part's worker as soon as its inputs are
   ready (request.py `run_parts` through bells.py `Rung`), reads the outputs, gives the
   block back. No planning, compiling or file I/O, and only short locks.
4. Each part's run time goes to the monitor and, once per part and load, at FEEDBACK_RUNS
   runs, to `measured` (wired to the cost model's corrections, on their own thread).

Every request has a deadline (by default `run_timeout_s` from its start): every wait of it
ends there with RunTimeout, and a worker that gave no reply for all of it is restarted. A
request whose worker died is run once more when the worker is back (inference is idempotent),
and fails with WorkerUnavailable only if that fails too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from cuvild.core.errors import (
    BadRegion,
    InferError,
    RunTimeout,
    WorkerLost,
    WorkerUnavailable,
)
from cuvild.core.layout import check_inputs
from cuvild.core.loaded import Out, check_dims
from cuvild.core.served import Monitor, Served, Timeline
from cuvild.run.bells import Bells, Rung
from cuvild.run.prefixes import Prefixes
from cuvild.run.request import FEEDBACK_RUNS, run_parts
from cuvild.run.sequences import Live, SequenceError, Sequences
from cuvild.workers.clientmem import DaemonRegions
from protos.orders import CopySequence, EndSequence, RawTensor, TensorRef

if TYPE_CHECKING:
    import torch

    from cuvild.core.arena import Arena, Block
    from cuvild.core.loaded import LoadedModel, Route, Shapes
    from cuvild.workers.workers import Workers

    Input = torch.Tensor | TensorRef | RawTensor  # a request's input, as it comes

log = logging.getLogger(__name__)
PREFIX_CACHE = 1 << 30  # bytes of kept sequences' state (engine.sequences.prefix_cache_mib)
# A bucket miss: the Builder's future for `model`'s bucket at these shapes.
Miss = Callable[["LoadedModel", "Shapes"], "Future[LoadedModel]"]


class Runner:
    def __init__(self, arena: Arena, workers: Workers, max_in_flight: int = 4,
                 run_timeout_s: float = 60.0, max_dim: int = 4096, max_sequences: int = 64,
                 sequence_idle_s: float = 300.0, prefix_cache_bytes: int = PREFIX_CACHE) -> None:
        """`run_timeout_s`: a request's deadline when its caller gives none, and how long a
        worker may give no reply before it is restarted; `max_dim`: the largest size built
        for a dynamic dimension (larger is refused before anything is built);
        `max_sequences` live at once, each ended after `sequence_idle_s` idle; finished
        generations' sequences kept up to `prefix_cache_bytes` of state (prefixes.py)."""
        self.arena = arena
        self.workers = workers
        self.served = Served()  # replaced whole by the Builder, never written here
        self.run_timeout_s = run_timeout_s
        self.max_dim = max_dim
        self.bells = Bells()  # the parts' doorbells (bells.py)
        self.regions = DaemonRegions()  # clients' regions the daemon reads and writes itself
        self.monitor: Monitor | None = None
        self.miss: Miss | None = None  # wired to the Builder's bucket builds
        # a model's parts measured (served or not: the load's guard times unpublished ones)
        self.measured: Callable[[LoadedModel], None] = lambda model: None
        self._in_flight = threading.BoundedSemaphore(max_in_flight)
        # a stateful model's sequences: their state is in its workers, by slot
        self.sequences = Sequences(lambda device: self.workers.of(device).generation,
                                   self._end_slot, max_sequences, sequence_idle_s)
        self.prefixes = Prefixes(self.sequences, self.copy_sequence, prefix_cache_bytes)

    # -- the verbs ---------------------------------------------------------------------------
    def resolve(self, model: LoadedModel, given: Sequence[tuple[str, tuple[int, ...]]],
                deadline: float | None = None) -> LoadedModel:
        """Check a request's inputs, (dtype name, shape) each in the model's order, against
        the model's input table. Returns the model, or for a dynamic-shape model its bucket
        for these shapes (a miss is built by the Builder, waited for until `deadline`)."""
        check_inputs(model.name, model.table, given)
        if model.family is None:
            return model
        check_dims(model, given, self.max_dim)
        shapes = tuple(tuple(shape) for _, shape in given)
        bucket = self.served.buckets.get((model.key, shapes))
        return bucket if bucket is not None else self._built(model, shapes, deadline)

    def infer(self, key: str, inputs: Sequence[torch.Tensor],
              deadline: float | None = None) -> list[torch.Tensor]:
        """Run model `key` on host tensors, for callers in this process: resolve, then run."""
        given = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in inputs]
        model = self.resolve(self.served.models[key], given, deadline)
        return self.run(model, inputs, deadline=deadline)  # type: ignore[return-value]

    def run(self, model: LoadedModel, inputs: Sequence[Input],
            refs: dict[str, TensorRef] | None = None, timeline: Timeline | None = None,
            deadline: float | None = None) -> list[torch.Tensor | None]:
        """One request of a resolved model; its outputs as fresh host tensors (None for those
        written in place in clients' regions, `refs`)."""
        return self._run(model, inputs, Out(refs or {}), timeline, deadline)

    def run_raw(self, model: LoadedModel, inputs: Sequence[Input],
                refs: dict[str, TensorRef] | None = None, timeline: Timeline | None = None,
                deadline: float | None = None) -> list[bytes | None]:
        """As `run`, the outputs as bytes (the block is reused at once)."""
        return self._run(model, inputs, Out(refs or {}, raw=True), timeline, deadline)

    def run_into(self, model: LoadedModel, inputs: Sequence[Input],
                 into: Sequence[memoryview], timeline: Timeline | None = None,
                 deadline: float | None = None) -> None:
        """As `run`, each output copied into its place."""
        self._run(model, inputs, Out(into=into), timeline, deadline)

    def step(self, model: LoadedModel, live: Live, inputs: Sequence[Input], out: Out,
             timeline: Timeline | None = None, deadline: float | None = None) -> list[Any]:
        """One request of sequence `live` (cuvild/run/sequences.py): on its state, one step
        at a time. Its worker dying under it ends the sequence (the state was there)."""
        with live.lock:
            if not self.sequences.alive(live):  # (ended between its steps: its state went)
                raise SequenceError(f"sequence {live.id!r} of model {live.key} ended before "
                                    "this step (engine.sequences.idle_timeout_s, its model's "
                                    "unload or its worker's restart)")
            live.last, live.holds = time.monotonic(), True
            try:
                return self.execute(model, inputs, out, timeline, deadline, live.slot)
            except WorkerUnavailable:
                self.sequences.end(live, "its state was lost: its worker died during a step "
                                         "(start it again)")
                raise

    def copy_sequence(self, source: Live, to: Live, length: int = 0,
                      timeout_s: float = 60.0) -> None:
        """Sequence `to` starts from `source`'s state (its steps so far; with `length`, cut
        back to its first `length` positions: `State.croppable`), on every worker that keeps
        it; once they all have it."""
        for device in source.workers:
            worker = self.workers.ready(device)
            if worker is None:
                raise WorkerUnavailable(f"{device}: its worker is restarting; the state to "
                                        "copy went with it")
            order = CopySequence(source.key, source.slot, to.slot, length)
            reply = worker.call(order).result(timeout_s)
            if not reply.ok:
                raise RuntimeError(f"{device}: the state did not copy: {reply.error}")
        to.holds = True

    def _end_slot(self, key: str, slot: int, devices: list[str]) -> None:
        for device in devices:
            worker = self.workers.ready(device)
            if worker is not None:  # (a dead one's state went with it)
                worker.call(EndSequence(key, slot))

    def _run(self, model: LoadedModel, inputs: Sequence[Input], out: Out,
             timeline: Timeline | None, deadline: float | None) -> list[Any]:
        """A batched model's request queues to share a run (batching.py), which comes back
        to `execute`; any other runs at once."""
        if model.batcher is not None:
            return model.batcher.run(model, inputs, out, deadline, timeline)
        return self.execute(model, inputs, out, timeline, deadline)

    def execute(self, model: LoadedModel, inputs: Sequence[Input], out: Out,
                timeline: Timeline | None = None, deadline: float | None = None,
                slot: int = 0) -> list[Any]:
        """One run of a resolved model. Inputs are tensors or raw bytes (copied into the arena)
        or references into shared memory (read in place by the first part); the outputs go
        where `out` says. A `timeline` list gets each part's dispatch and reply times.
        `deadline` (time.monotonic()) bounds every wait of the request (None: run_timeout_s
        from now): RunTimeout after it. `slot`: the sequence whose state a stateful model's
        parts run on (0: a fresh state)."""
        begun = time.monotonic()
        # may take a silent worker as hung (decided before the sum: `begun + t - begun` is
        # less than t where the sum crosses a power of two)
        patient = deadline is None or deadline - begun >= self.run_timeout_s
        deadline = begun + self.run_timeout_s if deadline is None else deadline
        # A sequence's step takes no place among the requests in flight: the sequences live
        # (engine.sequences.max_live) bound those, one step each at a time, and a decode step
        # waits in its worker for the other sequences' to share a run (a place each capped
        # those runs at max_in_flight, the worker waiting in vain for the rest)
        model = self._admit(model, deadline, placed=not slot)
        outstanding: Sequence[Future[Any]] = ()  # parts that may still write the block
        block = None
        try:
            refs = dict(out.refs)  # the request's tensors in clients' regions
            refs.update((n, v) for n, v in zip(model.inputs, inputs, strict=True)
                        if isinstance(v, TensorRef))
            block = self.arena.alloc(model.footprint)
            for attempt in (1, 2):
                self._place(model, block, inputs)  # (again for a retry: a later part may
                try:                               # have reused a spent input's bytes)
                    with Rung(self.bells, self.workers, model, block, refs, deadline,
                              self._serves, slot) as parts:
                        run_parts(self.workers, self._measure, model, parts, timeline,
                                  deadline, patient)
                    break
                except RunTimeout as e:
                    outstanding = e.outstanding
                    raise
                except InferError as e:
                    if slot and isinstance(e, WorkerLost):  # not again: its state is gone
                        raise WorkerUnavailable(f"{e}; the sequence's state was in it and is "
                                                "gone (start the sequence again)") from None
                    self._again(model, e, attempt, deadline, timeline)  # or raises
            return self._results(model, block, out)
        finally:
            if block is not None:
                self.arena.free_after(block, outstanding)
            if not slot:
                self._in_flight.release()
            if model.bucket is not None:
                model.bucket.let_go()

    # -- inside a request --------------------------------------------------------------------
    def _built(self, model: LoadedModel, shapes: Shapes, deadline: float | None) -> LoadedModel:
        """The bucket of `model` at `shapes`, asked of the Builder: waited for by the deadline
        (its build goes on after it: the next request finds it)."""
        if self.miss is None:
            raise InferError(f"model {model.key}: no builder for its shapes {shapes}")
        t0 = time.monotonic()
        future = self.miss(model, shapes)
        try:
            return future.result(timeout=None if deadline is None
                                 else max(0.0, deadline - t0))
        except FutureTimeout:
            raise RunTimeout(f"model {model.key}: its bucket for input shapes "
                             f"{[list(s) for s in shapes]} was not built in "
                             f"{time.monotonic() - t0:.1f} s (the request's deadline)") from None

    def _admit(self, model: LoadedModel, deadline: float, placed: bool = True) -> LoadedModel:
        """A place among the requests in flight by the deadline (`placed`) and a bucket held,
        not evicted, while its request runs (the one returned; one evicted since `resolve` is
        asked of the Builder again); `execute` gives both back."""
        t0, begun = time.perf_counter(), time.monotonic()
        while model.bucket is not None and not model.bucket.hold():
            family = self.served.models.get(model.bucket.of)
            if family is None:
                raise InferError(f"model {model.bucket.of} is not loaded any more")
            model = self._built(family, model.bucket.shapes, deadline)
        if placed and not self._in_flight.acquire(timeout=max(0.0, deadline - begun)):
            if model.bucket is not None:
                model.bucket.let_go()
            raise RunTimeout(f"model {model.key}: no place among the requests in flight in "
                             f"{time.monotonic() - begun:.1f} s (the request's deadline)")
        if self.monitor:
            self.monitor.queued(model, time.perf_counter() - t0)
        return model

    def _serves(self, model: LoadedModel) -> bool:
        """Whether `model` is the one served under its key now (its bells are kept)."""
        return self.served.models.get(model.key) is model

    def _measure(self, model: LoadedModel, route: Route, run_ms: float) -> None:
        """A part's run time, as its worker measured it: kept (the last 100), told to the
        monitor, and once per load, at FEEDBACK_RUNS runs, sent on to `measured`."""
        route.measured_ms.append(run_ms)
        del route.measured_ms[:-100]
        if self.monitor:
            self.monitor.part(model, route, run_ms / 1e3)
        if len(route.measured_ms) == FEEDBACK_RUNS and not route.fed_back:
            route.fed_back = True
            self.measured(model)

    def _place(self, model: LoadedModel, block: Block,
               inputs: Sequence[Input]) -> None:
        """The request's inputs into its block (those in clients' regions stay there)."""
        for name, value in zip(model.inputs, inputs, strict=True):
            if isinstance(value, RawTensor):
                self.arena.bytes(block, model.slots[name])[:] = value.data
            elif not isinstance(value, TensorRef):
                self.arena.tensor(block, model.slots[name]).copy_(value)

    def _again(self, model: LoadedModel, error: InferError, attempt: int, deadline: float,
               timeline: Timeline | None) -> None:
        """After a failed attempt: return to run the request again (its worker died the
        first time, and is back), else raise what the request answers."""
        if isinstance(error, WorkerLost):
            if attempt == 2:
                raise WorkerUnavailable(f"{error}; its worker had died during this request "
                                        "before, was restarted, and died again") from None
            log.warning("model %s: %s; running the request again once its worker is back",
                        model.key, error)
            t0 = time.monotonic()
            for device in error.devices:
                if not self.workers.wait_usable(device, deadline - time.monotonic()):
                    raise RunTimeout(f"{error}; its worker was not back in "
                                     f"{time.monotonic() - t0:.1f} s (the request's deadline)")
            if timeline is not None:
                timeline.clear()
            return
        if attempt == 2 and not isinstance(error, BadRegion):
            raise WorkerUnavailable(f"its worker died during this request and was restarted, "
                                    f"and the retry failed: {error}") from None
        raise error

    def _results(self, model: LoadedModel, block: Block, out: Out) -> list[Any]:
        """The outputs from the block, where `out` says."""
        if out.into is not None:
            for name, place in zip(model.outputs, out.into, strict=True):
                place[:] = self.arena.bytes(block, model.slots[name])
            return []
        if out.raw:
            return [None if n in out.refs else bytes(self.arena.bytes(block, model.slots[n]))
                    for n in model.outputs]
        return [None if n in out.refs else self.arena.tensor(block, model.slots[n]).clone()
                for n in model.outputs]
