"""Lanes: the engine's own fast-path sessions to a one-part model's worker process.

A request to a model that is one part on a worker process takes a lane when its inputs are
raw bytes (an OIP request's) or in clients' shared-memory regions: the daemon is then the
session's client (cuvild/workers/sessions.py): it copies the inputs into the lane's slot (a
client's region read with preadv, never mapped), rings an 8-byte doorbell on a socketpair
and reads the outputs from the slot (or writes them into the client's region). Nothing is
pickled and no arena block is taken: a pickled `Run` and
its `Reply` through multiprocessing's pipes measured 0.26 ms a round trip on the 2-core dev
host, the doorbell 0.07 ms. A lane carries one request at a time; a model gets lanes as its
concurrent requests need them (at most the engine's requests in flight). A lane whose worker
died, or whose request timed out, is dropped; the engine then runs the request its usual way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from cuvild.engine.errors import BadRegion, InferError, RunTimeout, WorkerLost
from cuvild.engine.plane import Served
from cuvild.run.request import Timeline, measured
from cuvild.workers.clientmem import RegionGone
from cuvild.workers.sessions import slot_layout
from protos import fastpath as wire
from protos.orders import Attach, RawTensor, TensorRef
from protos.sessions import STATS

if TYPE_CHECKING:
    from cuvild.engine.loaded import LoadedModel, Route
    from cuvild.workers.handle import WorkerHandle

log = logging.getLogger(__name__)
T = TypeVar("T")
LOST_WAIT_S = 5.0  # how long a closed session waits to learn whether its worker died


def one_part(model: LoadedModel) -> bool:
    """Whether the model is one part that takes the model's inputs and gives its outputs,
    in order: a session's slots (the model's) are then the part's own."""
    return (len(model.routes) == 1 and model.routes[0].inputs == model.inputs
            and model.routes[0].outputs == model.outputs)


class Attached:
    """A session of the engine's own in a worker process (a lane's, a bell's): its socket,
    its memory (`size` bytes), its counts, and the Attach's future (done when it ends)."""

    def __init__(self, worker: WorkerHandle, order: Attach, size: int, label: str) -> None:
        ours, theirs = socket.socketpair()
        memfd = os.memfd_create(f"cuvild-{label}", os.MFD_CLOEXEC)
        stats_fd = os.memfd_create(f"cuvild-{label.split('-')[0]}-counts", os.MFD_CLOEXEC)
        try:
            os.ftruncate(memfd, size)
            os.ftruncate(stats_fd, mmap.PAGESIZE)
            self.mm = mmap.mmap(memfd, size)
            self.stats = mmap.mmap(stats_fd, STATS.size)
            self.ended = worker.attach(order, [theirs.fileno(), memfd, stats_fd])
        finally:
            theirs.close()
            os.close(memfd)
            os.close(stats_fd)
        self.generation: int = getattr(self.ended, "generation", 0)  # the worker's start
        self.sock, self.seq, self.closed = ours, 0, False

    def usable(self) -> bool:
        return not self.closed and not self.ended.done()

    def lost(self) -> None:
        """Its socket closed under a request: close it, and wait until its worker has said
        the session ended or its reader has seen the worker die. The socket closes as the
        process exits, before its pipes say so or it can be reaped: a restart decided in that
        gap (Workers._revive) found the dying worker alive and let the retry meet it."""
        self.close()  # (a Lane's or a Bell's)
        with contextlib.suppress(Exception):
            self.ended.exception(timeout=LOST_WAIT_S)


class Lane(Attached):
    def __init__(self, worker: WorkerHandle, model: LoadedModel, route: Route) -> None:
        self.model, self.route = model, route
        self.layout = slot_layout(model, list(model.inputs), list(model.outputs), 1)
        super().__init__(worker, Attach(model.key, route.id, self.layout), self.layout["size"],
                         f"lane-{model.name}")
        self.wait = -1.0
        base, view = self.layout["slots"][0], memoryview(self.mm)
        self.inputs = [view[base + t["offset"]:base + t["offset"] + t["nbytes"]]
                       for t in self.layout["inputs"]]
        self.outputs = [view[base + t["offset"]:base + t["offset"] + t["nbytes"]]
                        for t in self.layout["outputs"]]

    def run(self, engine: Served, inputs: Sequence[RawTensor | TensorRef],  # noqa: C901 - the dispatch loop; one for bells and lanes is planned
            output_refs: dict[str, TensorRef], raw: bool, into: Sequence[memoryview] | None,
            deadline: float, timeline: Timeline | None = None) -> list[Any]:
        """One request; RunTimeout, WorkerLost (the lane is then closed), BadRegion or
        InferError. Inputs in a client's region are read into the slot, outputs named in
        `output_refs` written from it (engine.regions: never mapped in the daemon); a
        `timeline` gets the part's ring and answer times."""
        route = self.route
        for place, value in zip(self.inputs, inputs, strict=True):
            if isinstance(value, TensorRef):
                try:
                    engine.regions.read(value.segment, value.inode, value.offset, place)
                except RegionGone as e:
                    raise BadRegion(f"part {route.id} on {route.device}: {e}") from None
            else:
                place[:] = value.data
        self.seq += 1
        wire.ENTRY.pack_into(self.mm, 0, self.seq, 0, wire.SUBMITTED, 0)
        busy = STATS.unpack_from(self.stats)[2]
        bell = wire.DOORBELL.pack(self.seq)
        wait = max(0.001, round(deadline - time.monotonic(), 2))
        rung = time.perf_counter_ns()
        try:
            if wait != self.wait:  # the kernel's limit: one system call per wait
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                     struct.pack("ll", int(wait), int(wait % 1 * 1e6)))
                self.wait = wait
            self.sock.sendall(bell)
            answer = self.sock.recv(wire.DOORBELL.size, socket.MSG_WAITALL)
        except (BlockingIOError, TimeoutError):
            self.close()  # its late answer is nobody's
            raise RunTimeout(f"part {route.id} on {route.device} ({route.runtime}) gave no "
                             "reply by the request's deadline") from None
        except OSError:
            answer = b""
        where = f"part {route.id} on {route.device} ({route.runtime})"
        if answer != bell:
            self.lost()
            raise WorkerLost(f"{where} failed: its worker died", {route.device})
        _, _, state, error_len = wire.ENTRY.unpack_from(self.mm, 0)
        if state != wire.DONE:
            text = bytes(self.mm[self.layout["errors"]:self.layout["errors"] + error_len])
            raise InferError(f"{where} failed: {json.loads(text or b'{}').get('error', '')}")
        measured(engine, self.model, route, (STATS.unpack_from(self.stats)[2] - busy) * 1e3)
        if timeline is not None:
            timeline.append((route, rung, time.perf_counter_ns()))
        if into is not None and not output_refs:
            for place, out in zip(into, self.outputs, strict=True):
                place[:] = out
            return []
        return self._outputs(engine, output_refs, raw)

    def _outputs(self, engine: Served, output_refs: dict[str, TensorRef], raw: bool) -> list[Any]:
        """Outputs named in `output_refs` written into their regions (None for them), the
        others as bytes (raw) or fresh tensors."""
        out: list[Any] = []
        for name, place, t in zip(self.model.outputs, self.outputs, self.layout["outputs"],
                                  strict=True):
            ref = output_refs.get(name)
            if ref is not None:
                try:
                    engine.regions.write(ref.segment, ref.inode, ref.offset, place)
                except RegionGone as e:
                    raise BadRegion(f"output {name}: {e}") from None
                out.append(None)
            elif raw:
                out.append(bytes(place))
            else:
                import torch

                out.append(torch.frombuffer(bytearray(place), dtype=getattr(
                    torch, t["dtype"])).view(t["shape"]))
        return out

    def close(self) -> None:
        self.closed = True
        self.sock.close()
        self.inputs = self.outputs = []
        for mm in (self.mm, self.stats):
            try:
                mm.close()
            except BufferError:
                pass


class Pool(Generic[T]):
    """Idle sessions of the engine's own (a lane, a set of bells), by model: a request takes
    one and gives it back; one whose worker died, or whose model was unloaded or replaced
    meanwhile, is closed instead of kept."""

    def __init__(self, usable: Callable[[T], bool], close: Callable[[T], None]) -> None:
        self.usable, self.close = usable, close  # (of its kind of session)
        self._idle: dict[str, list[T]] = {}
        self._lock = threading.Lock()

    def idle(self) -> dict[str, list[T]]:
        """The idle sessions, by model key (a copy)."""
        with self._lock:
            return {key: list(items) for key, items in self._idle.items() if items}

    def reuse(self, key: str) -> T | None:
        """An idle session of model `key`, if one is usable."""
        with self._lock:
            idle = self._idle.get(key)
            while idle:
                item = idle.pop()
                if self.usable(item):
                    return item
                self.close(item)
        return None

    def keep(self, key: str, item: T, current: bool) -> None:
        """Give a session back (`current`: its model is still the one served as `key`)."""
        if not current or not self.usable(item):
            self.close(item)
            return
        with self._lock:
            self._idle.setdefault(key, []).append(item)

    def drop(self, key: str) -> None:
        """Close the sessions of model `key` (unloaded)."""
        with self._lock:
            items = self._idle.pop(key, [])
        for item in items:
            self.close(item)


class Lanes(Pool[Lane]):
    """Every model's idle lanes."""

    def __init__(self) -> None:
        super().__init__(Lane.usable, Lane.close)

    def take(self, engine: Served, model: LoadedModel) -> Lane | None:
        """An idle lane of `model` (one is made if none is idle); None where the model does
        not take lanes: several parts, a worker thread, a worker being restarted."""
        if engine.in_process or not one_part(model) or model.evicted:
            return None
        lane = self.reuse(model.key)
        if lane is not None:
            return lane
        route = model.routes[0]
        worker = engine.workers.ready(route.device)
        if worker is None:
            return None
        try:
            return Lane(worker, model, route)
        except OSError:
            return None

    def run(self, engine: Served, model: LoadedModel, inputs: Sequence[Any],
            output_refs: dict[str, TensorRef], raw: bool, into: Sequence[memoryview] | None,
            deadline: float, timeline: Timeline | None = None,
            patient: bool = False) -> list[Any] | None:
        """The request on a lane of `model`; None where it takes none (then, as after its
        worker died, the engine runs it the usual way: that one waits for the worker).
        Inputs are raw bytes or in clients' regions; outputs may be written into theirs.
        A patient request (its deadline at least the engine's run_timeout_s) that gets no
        answer by then takes the worker as hung: it is killed and restarted."""
        if not all(isinstance(v, RawTensor) or isinstance(v, TensorRef) and v.inode
                   for v in inputs) or any(not r.inode for r in output_refs.values()):
            return None
        lane = self.take(engine, model)
        if lane is None:
            return None
        try:
            return lane.run(engine, inputs, output_refs, raw, into, deadline, timeline)
        except RunTimeout as e:
            if patient and engine.workers.hung(lane.route.device, lane.generation):
                raise RunTimeout(f"{e}; its worker was stopped and is being restarted") from None
            raise
        except WorkerLost as e:
            engine.workers.revive_later(model.routes[0].device)
            log.warning("model %s: %s; running the request again once its worker is back",
                        model.key, e)
            return None
        finally:
            self.give(engine, lane)

    def give(self, engine: Served, lane: Lane) -> None:
        self.keep(lane.model.key, lane, engine.models.get(lane.model.key) is lane.model)
