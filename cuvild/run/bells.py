"""Bells: the parts of a request rung in their worker processes, not sent as pickled orders.

Each part of a model on a worker process gets bells in its worker (cuvild/workers/sessions.py
`BellSession`): a socketpair and a one-page record. Where the part's tensors lie in a
request's arena block is fixed at load (the model's slots, cuvild/engine/layout.py) and told
to the worker once, when the bell is made; so a request rings a part by writing its block's
place into the record (seq, offset, segment) and sending 8 bytes, and the worker answers
with the same 8 bytes once the part's outputs are in the block. A pickled `Run` and its
`Reply` cost 0.26 ms a round trip through multiprocessing's pipes on the 2-core dev host, a
doorbell 0.07 ms, and no reader thread stands between the worker and the request.

A request holds one set of bells, a bell per part, for its run; a model gets sets as its
concurrent requests need them (at most the engine's requests in flight). Parts run as soon
as their inputs are ready (independent parts at once, their bells polled together), by the
request's deadline, in `request.run_parts` (the loop pickled orders take too): a part past the
deadline fails the request with RunTimeout (and its bell, closed once its late answer comes,
holds the block until then); a worker that died fails it with WorkerLost (the engine runs it
again once the worker is back).

A request's tensors in clients' regions (OIP shared memory) are named in the record after
the block (object, inode, offset), and the worker checks and maps them as it would a `Run`'s:
read and written in place, never copied by the daemon. A record they do not fit in (about
40 tensors of short names) goes as `Run`s.
"""

from __future__ import annotations

import json
import mmap
import select
import socket
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from cuvild.engine.errors import BadRegion, InferError, WorkerLost
from cuvild.engine.plane import Served
from cuvild.run.lanes import Attached, Pool
from cuvild.run.request import Answer, Timeline, run_parts
from protos import fastpath as wire
from protos.orders import Attach, TensorRef
from protos.sessions import BELL, BELL_ELSEWHERE, BELL_ERRORS, BELL_NAME, STATS, TENSOR_AT

if TYPE_CHECKING:
    from cuvild.engine.arena import Block
    from cuvild.engine.loaded import LoadedModel, Route
    from cuvild.workers.handle import WorkerHandle


class Bell(Attached):
    """One part's bell in its worker."""

    def __init__(self, worker: WorkerHandle, model: LoadedModel, route: Route) -> None:
        def places(names: list[str]) -> list[dict[str, Any]]:
            return [{"offset": model.slots[n].offset, "dtype": model.slots[n].dtype,
                     "shape": list(model.slots[n].shape)} for n in names]

        self.route, self.device = route, route.device
        self.names = {"inputs": route.inputs, "outputs": route.outputs}
        layout = {"kind": "bell", "inputs": places(route.inputs),
                  "outputs": places(route.outputs)}
        super().__init__(worker, Attach(model.key, route.id, layout), mmap.PAGESIZE,
                         f"bell-{model.name}")
        self.busy = 0.0

    def record(self, block: Block, refs: dict[str, TensorRef]) -> bool:
        """Write the request's record: its block, and its tensors in clients' regions;
        False if they do not fit in it."""
        name = block.segment.encode()
        at, count = BELL_ELSEWHERE, 0
        if len(name) > BELL_ERRORS - BELL_NAME:
            return False
        for kind, names in enumerate(self.names.values()):
            for index, tensor in enumerate(names):
                ref = refs.get(tensor)
                if ref is None:
                    continue
                where = ref.segment.encode()
                if at + TENSOR_AT.size + len(where) > mmap.PAGESIZE:
                    return False
                TENSOR_AT.pack_into(self.mm, at, kind, index, ref.inode, ref.offset,
                                    len(where))
                at += TENSOR_AT.size
                self.mm[at:at + len(where)] = where
                at, count = at + len(where), count + 1
        self.mm[BELL_NAME:BELL_NAME + len(name)] = name
        self.seq += 1
        BELL.pack_into(self.mm, 0, self.seq, wire.SUBMITTED, 0, block.offset, len(name),
                       count)
        return True

    def ring(self) -> None:
        self.busy = STATS.unpack_from(self.stats)[2]
        self.sock.sendall(wire.DOORBELL.pack(self.seq))

    def answer(self) -> tuple[InferError | None, float]:
        """The answer to the last ring, once it came (the socket is readable): the part's
        failure (None: done; BadRegion for a client's region that no longer holds its
        bytes) and its run time in ms. WorkerLost if the worker died."""
        where = f"part {self.route.id} on {self.device} ({self.route.runtime})"
        try:
            answer = self.sock.recv(wire.DOORBELL.size, socket.MSG_WAITALL)
        except OSError:
            answer = b""
        if answer != wire.DOORBELL.pack(self.seq):
            self.lost()
            raise WorkerLost(f"{where} failed: its worker died", {self.device})
        _, state, error_len, _, _, _ = BELL.unpack_from(self.mm, 0)
        if state != wire.DONE:
            text = bytes(self.mm[BELL_ERRORS:BELL_ERRORS + error_len]).decode(errors="replace")
            try:
                said = json.loads(text)
            except ValueError:
                said = {"error": text}
            error = BadRegion if said.get("kind") == "invalid" else InferError
            return error(f"{where} failed: {said.get('error', '')}"), 0.0
        return None, (STATS.unpack_from(self.stats)[2] - self.busy) * 1e3

    def late(self) -> Future[Any]:
        """A future that completes once this bell's worker can no longer write the block of
        the ring that timed out: its answer came, or the worker died. The bell then closes."""
        future: Future[Any] = Future()

        def wait() -> None:
            try:
                self.sock.settimeout(None)
                self.sock.recv(wire.DOORBELL.size, socket.MSG_WAITALL)
            except OSError:
                pass
            self.close()
            future.set_result(None)

        self.closed = True  # never taken again
        threading.Thread(target=wait, name="bell-late", daemon=True).start()
        return future

    def close(self) -> None:
        self.closed = True
        self.sock.close()
        for mm in (self.mm, self.stats):
            mm.close()


class Bells(Pool[dict[str, Bell]]):
    """Every model's idle sets of bells."""

    def __init__(self) -> None:
        super().__init__(lambda bells: all(b.usable() for b in bells.values()), _close)

    def take(self, engine: Served, model: LoadedModel) -> dict[str, Bell] | None:
        """An idle set of `model`'s bells, by part (made if none is idle); None where its
        parts cannot be rung: worker threads, a worker being restarted."""
        if engine.in_process or model.evicted:
            return None
        bells = self.reuse(model.key)
        if bells is not None:
            return bells
        for device in {r.device for r in model.routes}:
            if engine.workers.ready(device) is None:
                return None
        made: dict[str, Bell] = {}
        try:
            for route in model.routes:
                made[route.id] = Bell(engine.workers[route.device], model, route)
        except OSError:
            _close(made)
            return None
        return made

    def give(self, engine: Served, model: LoadedModel, bells: dict[str, Bell]) -> None:
        self.keep(model.key, bells, engine.models.get(model.key) is model)

    def run(self, engine: Served, model: LoadedModel, block: Block, refs: dict[str, TensorRef],
            timeline: Timeline | None, deadline: float, patient: bool) -> bool:
        """Run the request's parts on bells; False where it takes none (the caller then
        sends them the usual way). `refs`: the request's tensors in clients' regions."""
        if any(not r.inode for r in refs.values()):
            return False
        bells = self.take(engine, model)
        if bells is None:
            return False
        try:
            if not all(b.record(block, refs) for b in bells.values()):
                return False
            run_parts(engine, model, Rung(bells), timeline, deadline, patient)
            return True
        finally:
            self.give(engine, model, bells)


class Rung:
    """A request's parts rung on its set of bells (the transport `run_parts` drives): each
    part's record is written already; a ring is 8 bytes, its answer polled with the others'."""

    def __init__(self, bells: dict[str, Bell]) -> None:
        self.bells = bells
        self.running: dict[int, tuple[Route, Bell]] = {}  # by the bell's socket
        self.done: list[Answer] = []  # a ring that failed: its worker is gone
        self.poll = select.poll()

    def out(self) -> bool:
        return bool(self.running or self.done)

    def send(self, route: Route, deadline: float, alone: bool) -> None:
        bell = self.bells[route.id]
        try:
            bell.ring()
        except OSError:
            bell.lost()  # (its worker is gone: the set is not given back)
            self.done.append((route, WorkerLost(f"part {route.id} on {route.device} failed: "
                                                "its worker died", {route.device}), 0.0))
            return
        self.running[bell.sock.fileno()] = (route, bell)
        self.poll.register(bell.sock.fileno(), select.POLLIN)

    def wait(self, deadline: float) -> list[Answer]:
        if self.done:
            done, self.done = self.done, []
            return done
        answers: list[Answer] = []
        for fd, _ in self.poll.poll(max(0.0, deadline - time.monotonic()) * 1e3):
            route, bell = self.running.pop(fd)
            self.poll.unregister(fd)
            try:
                error, run_ms = bell.answer()
            except WorkerLost as e:
                error, run_ms = e, 0.0
            answers.append((route, error, run_ms))
        return answers

    def pending(self) -> list[tuple[Route, int]]:
        return [(route, bell.generation) for route, bell in self.running.values()]

    def outstanding(self) -> list[Future[Any]]:
        return [bell.late() for _, bell in self.running.values()]


def _close(bells: dict[str, Bell]) -> None:
    for bell in bells.values():
        if not bell.closed:
            bell.close()
