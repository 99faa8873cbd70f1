"""Bells: the parts of a request rung in their workers, not sent as pickled orders.

The runner's one doorbell: every request rings its parts this way, a one-part model's as a
split model's, on worker processes or threads. Each part of a model gets bells in its worker
(cuvild/workers/sessions.py `Session`): a socketpair and a record (a page, more for a
part with many tensors). Where the part's tensors lie in a request's arena block is fixed at
load (the model's slots, cuvild/core/layout.py) and told to the worker once, when the bell
is made; so a request rings a part by writing its block's place into the record (seq,
offset, segment) and sending 8 bytes, and the worker answers with the same 8 bytes once the
part's outputs are in the block. A pickled `Run` and its `Reply` (what parts were sent
before) cost 0.26 ms a round trip through multiprocessing's pipes on the 2-core dev host, a
doorbell 0.07 ms, and no reader thread stands between the worker and the request.

A request holds one set of bells, a bell per part, for its run; a model gets sets as its
concurrent requests need them (at most the runner's requests in flight). Parts run as soon
as their inputs are ready (independent parts at once, their bells polled together; a part
alone is waited for with one blocking read), by the request's deadline, in
`request.run_parts`: a part past the deadline fails the
request with RunTimeout (and its bell, closed once its late answer comes, holds the block
until then); a worker that died fails it with WorkerLost (the runner runs it again once the
worker is back).

A request's tensors in clients' regions (OIP shared memory) are named in the record after
the block (object, inode, offset; the record has room for every tensor of the part at the
longest name an object can have), and the worker checks and maps them: read and written in
place, never copied by the daemon (a worker thread reads and writes them through their
descriptors instead, so that a shrunk object cannot fault the daemon).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from cuvild.core.errors import BadRegion, InferError, WorkerLost
from cuvild.run.request import Answer, usable
from protos import fastpath as wire
from protos.orders import Attach, TensorRef
from protos.shared import (
    BELL,
    BELL_ELSEWHERE,
    BELL_ERRORS,
    BELL_NAME,
    NAME_MAX,
    STATS,
    TENSOR_AT,
    bell_bytes,
)

if TYPE_CHECKING:
    from cuvild.core.arena import Block
    from cuvild.core.loaded import LoadedModel, Route
    from cuvild.workers.handle import WorkerHandle
    from cuvild.workers.workers import Workers

LOST_WAIT_S = 5.0  # how long a closed bell waits to learn whether its worker died


class Bell:
    """One part's bell in its worker: its socket, its record (a page), its counts, and the
    Attach's future (done when the worker let it go)."""

    def __init__(self, worker: WorkerHandle, model: LoadedModel, route: Route) -> None:
        def places(names: list[str]) -> list[dict[str, Any]]:
            return [{"offset": model.slots[n].offset, "dtype": model.slots[n].dtype,
                     "shape": list(model.slots[n].shape)} for n in names]

        self.route, self.device = route, route.device
        self.names = {"inputs": route.inputs, "outputs": route.outputs}
        order = Attach(model.key, route.id, {"kind": "bell", "inputs": places(route.inputs),
                                             "outputs": places(route.outputs)})
        ours, theirs = socket.socketpair()
        memfd = os.memfd_create(f"cuvild-bell-{model.name}", os.MFD_CLOEXEC)
        stats_fd = os.memfd_create("cuvild-bell-counts", os.MFD_CLOEXEC)
        size = bell_bytes(len(route.inputs) + len(route.outputs))
        try:
            os.ftruncate(memfd, size)
            os.ftruncate(stats_fd, mmap.PAGESIZE)
            self.mm = mmap.mmap(memfd, size)
            self.stats = mmap.mmap(stats_fd, STATS.size)
            self.generation = worker.generation  # the worker's start it is attached to
            self.ended = worker.attach(order, [theirs.fileno(), memfd, stats_fd])
        finally:
            theirs.close()
            os.close(memfd)
            os.close(stats_fd)
        self.sock, self.seq, self.closed = ours, 0, False
        self.busy, self.read_timeout = 0.0, 0.0  # the counts' busy time at the ring; SO_RCVTIMEO

    def usable(self) -> bool:
        return not self.closed and not self.ended.done()

    def lost(self) -> None:
        """Its socket closed under a request: close it, and wait until its worker has said
        the bell ended or its reader has seen the worker die. The socket closes as the
        process exits, before its pipes say so or it can be reaped: a restart decided in that
        gap (Workers._revive) found the dying worker alive and let the retry meet it."""
        self.close()
        with contextlib.suppress(Exception):
            self.ended.exception(timeout=LOST_WAIT_S)

    def point(self, block: Block, refs: dict[str, TensorRef], slot: int = 0) -> None:
        """Write the request's record: its block, its tensors in clients' regions, and its
        sequence slot (0: none)."""
        name = block.segment.encode()
        at, count = BELL_ELSEWHERE, 0
        if len(name) > BELL_ERRORS - BELL_NAME:
            raise ValueError(f"arena segment name {block.segment!r} is too long for a bell")
        for kind, names in enumerate(self.names.values() if refs else ()):
            for index, tensor in enumerate(names):
                ref = refs.get(tensor)
                if ref is None:
                    continue
                where = ref.segment.encode()
                if len(where) > NAME_MAX:  # (no such object can be registered)
                    raise BadRegion(f"shared-memory object {ref.segment!r}: name over "
                                    f"{NAME_MAX} bytes")
                TENSOR_AT.pack_into(self.mm, at, kind, index, ref.inode, ref.offset,
                                    len(where))
                at += TENSOR_AT.size
                self.mm[at:at + len(where)] = where
                at, count = at + len(where), count + 1
        self.mm[BELL_NAME:BELL_NAME + len(name)] = name
        self.seq += 1
        BELL.pack_into(self.mm, 0, self.seq, wire.SUBMITTED, 0, block.offset, len(name),
                       count, slot)

    def ring(self) -> None:
        self.busy = STATS.unpack_from(self.stats)[2]
        self.sock.sendall(wire.DOORBELL.pack(self.seq))

    def answer(self, deadline: float | None = None) -> tuple[InferError | None, float]:
        """The answer to the last ring: the part's failure (None: done; BadRegion for a
        client's region that no longer holds its bytes) and its run time in ms. Read once
        the socket is readable, or (`deadline`, time.monotonic()) waited for by the deadline:
        TimeoutError after it. WorkerLost if the worker died."""
        where = f"part {self.route.id} on {self.device} ({self.route.runtime})"
        if deadline is not None:
            self._limit(max(0.001, round(deadline - time.monotonic(), 2)))
        try:
            answer = self.sock.recv(wire.DOORBELL.size, socket.MSG_WAITALL)
        except (BlockingIOError, TimeoutError):
            raise TimeoutError(where) from None
        except OSError:
            answer = b""
        if answer != wire.DOORBELL.pack(self.seq):
            self.lost()
            raise WorkerLost(f"{where} failed: its worker died", {self.device})
        _, state, error_len, *_ = BELL.unpack_from(self.mm, 0)
        if state != wire.DONE:
            text = bytes(self.mm[BELL_ERRORS:BELL_ERRORS + error_len]).decode(errors="replace")
            try:
                said = json.loads(text)
            except ValueError:
                said = {"error": text}
            error = BadRegion if said.get("kind") == "invalid" else InferError
            return error(f"{where} failed: {said.get('error', '')}"), 0.0
        return None, (STATS.unpack_from(self.stats)[2] - self.busy) * 1e3

    def _limit(self, seconds: float) -> None:
        """The socket's read timeout (the kernel's: a blocking read is one system call);
        0: none."""
        if seconds != self.read_timeout:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                 struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))
            self.read_timeout = seconds

    def late(self) -> Future[Any]:
        """A future that completes once this bell's worker can no longer write the block of
        the ring that timed out: its answer came, or the worker died. The bell then closes."""
        future: Future[Any] = Future()

        def wait() -> None:
            try:
                self._limit(0)
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


Set = dict[str, "Bell"]  # a request's bells, by part


class Bells:
    """Every model's idle sets of bells: a request takes one and gives it back; one whose
    worker died, or whose model was unloaded or replaced meanwhile, is closed instead."""

    def __init__(self) -> None:
        self._idle: dict[str, list[Set]] = {}
        self._lock = threading.Lock()

    def idle(self) -> dict[str, list[Set]]:
        """The idle sets, by model key (a copy)."""
        with self._lock:
            return {key: list(items) for key, items in self._idle.items() if items}

    def drop(self, key: str) -> None:
        """Close the sets of model `key` (unloaded)."""
        with self._lock:
            items = self._idle.pop(key, [])
        for item in items:
            _close(item)

    def take(self, workers: Workers, model: LoadedModel, deadline: float) -> Set:
        """An idle set of `model`'s bells, by part, or one made now (a worker being restarted
        is waited for, by the deadline: RunTimeout; one found dead is revived: WorkerLost)."""
        with self._lock:
            idle = self._idle.get(model.key)
            while idle:
                bells = idle.pop()
                if _usable(bells):
                    return bells
                _close(bells)
        made: Set = {}
        try:
            for route in model.routes:
                usable(workers, route, deadline)
                worker = workers.of(route.device)
                if not worker.alive():
                    workers.revive_later(route.device)
                    raise WorkerLost(f"part {route.id} on {route.device} failed: its worker "
                                     "died", {route.device})
                made[route.id] = Bell(worker, model, route)
        except BaseException:
            _close(made)
            raise
        return made

    def give(self, model: LoadedModel, bells: Set, served: bool) -> None:
        """A set back after its request (one closed under it, or of a model no longer
        `served`, is not kept; a worker that died meanwhile is seen when the set is next
        taken)."""
        if not served or any(b.closed for b in bells.values()):
            _close(bells)
            return
        with self._lock:
            self._idle.setdefault(model.key, []).append(bells)


class Rung:
    """A request's parts rung on a set of its model's bells, taken from `pool` for the
    request and given back when it is left (`with Rung(...) as parts`; the transport
    `run_parts` drives). Every part's record is written first (the request's block, its
    tensors in clients' regions: `refs`; BadRegion before any part runs); a ring is 8 bytes,
    its answer read at once (a part alone) or polled with the others'."""

    def __init__(self, pool: Bells, workers: Workers, model: LoadedModel, block: Block,
                 refs: dict[str, TensorRef], deadline: float,
                 serves: Callable[[LoadedModel], bool], slot: int = 0) -> None:
        """`serves(model)`: whether the model is still the one served under its key (its
        bells are kept for its next request); `slot`: the request's sequence's (0: none)."""
        self.pool, self.model, self.serves = pool, model, serves
        self.bells = pool.take(workers, model, deadline)
        try:
            for bell in self.bells.values():
                bell.point(block, refs, slot)
        except BaseException:
            pool.give(model, self.bells, serves(model))
            raise
        self.running: dict[int, tuple[Route, Bell]] = {}  # by the bell's socket
        self.done: list[Answer] = []  # answered as it was rung (alone), or its worker is gone
        self.poll: Any = None  # made for the first part left out

    def __enter__(self) -> Rung:
        return self

    def __exit__(self, *_: object) -> None:
        self.pool.give(self.model, self.bells, self.serves(self.model))

    def out(self) -> bool:
        return bool(self.running or self.done)

    def send(self, route: Route, deadline: float, alone: bool) -> None:
        """Ring the part; one `alone` (nothing else out) is waited for here, with one
        blocking read (an answer not in by the deadline stays out: `wait` then has none)."""
        bell = self.bells[route.id]
        try:
            bell.ring()
        except OSError:
            bell.lost()  # (its worker is gone: the set is not given back)
            self.done.append((route, WorkerLost(f"part {route.id} on {route.device} failed: "
                                                "its worker died", {route.device}), 0.0))
            return
        if alone:
            try:
                self.done.append((route, *bell.answer(deadline)))
                return
            except WorkerLost as e:
                self.done.append((route, e, 0.0))
                return
            except TimeoutError:
                pass
        self.running[bell.sock.fileno()] = (route, bell)
        self.poll = self.poll or select.poll()
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


def _usable(bells: Set) -> bool:
    return all(b.usable() for b in bells.values())


def _close(bells: Set) -> None:
    for bell in bells.values():
        if not bell.closed:
            bell.close()
