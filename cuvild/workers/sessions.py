"""Fast-path sessions served by a device worker itself (the wire: protos/fastpath.py).

A model that is one part on a worker process has its fast-path sessions attached to that
worker (cuvild/serve/fast.py opens them): the daemon passes the client's connection and the
session's sealed memfd over the worker's pipe (SCM_RIGHTS), and from then on the client's
doorbell wakes the worker, which runs the part on the slot's inputs in place and writes the
outputs into the slot: one round trip between two processes per request, nothing pickled, no
copy of the inputs. The worker's loop polls its pipe and its sessions' sockets together
(`Sessions.wait`); a session ends when the client closes it (or dies), when its model is
unloaded here (the client then opens a new one), or with the worker. The engine's bells
(cuvild/run/bells.py) are served the same way, by `BellSession`.
"""

from __future__ import annotations

import bisect
import json
import mmap
import os
import select
import socket
import struct
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from cuvild.engine import views
from cuvild.engine.arena import align
from cuvild.engine.dtypes import nbytes
from cuvild.engine.spin import MOST_S, Spin
from protos import fastpath as wire
from protos.orders import Attach, TensorRef
from protos.sessions import (
    BELL,
    BELL_ELSEWHERE,
    BELL_ERRORS,
    BELL_NAME,
    SECONDS,
    STATS,
    STATS_BYTES,
    TENSOR_AT,
)

if TYPE_CHECKING:
    from cuvild.engine.loaded import LoadedModel

MAX_BLOCKS = 64  # a bell's views of arena blocks kept (a model's requests reuse a few blocks)


def slot_layout(model: LoadedModel, inputs: list[str], outputs: list[str],
                depth: int) -> dict[str, Any]:
    """Where a session's ring, error texts and each slot's inputs and outputs lie in its
    memfd (protos/fastpath.py); `inputs`, `outputs`: the names the session's client uses, in
    the model's order."""
    tensors: dict[str, list[dict[str, Any]]] = {"inputs": [], "outputs": []}
    at = 0
    for kind, names, graph in (("inputs", inputs, model.inputs),
                               ("outputs", outputs, model.outputs)):
        for name, value in zip(names, graph, strict=True):
            slot = model.slots[value]
            size = nbytes(slot.dtype, slot.shape)
            tensors[kind].append({"name": name, "dtype": slot.dtype,
                                  "shape": list(slot.shape), "offset": at, "nbytes": size})
            at += align(size, wire.ALIGN)
    slot_bytes = max(align(at, wire.ALIGN), wire.ALIGN)
    errors = align(depth * wire.ENTRY_BYTES, wire.ALIGN)
    first = align(errors + depth * wire.ERROR_BYTES, wire.ALIGN)
    return {"depth": depth, "ring": 0, "entry_bytes": wire.ENTRY_BYTES, "errors": errors,
            "error_bytes": wire.ERROR_BYTES,
            "slots": [first + k * slot_bytes for k in range(depth)],
            "size": max(first + depth * slot_bytes, mmap.PAGESIZE), **tensors}


_SUM, _COUNT = struct.Struct("<d"), struct.Struct("<Q")


def count_time(stats: mmap.mmap, seconds: float) -> None:
    """Add one request's doorbell-to-answer time to a session's histogram."""
    at = STATS.size
    (total,) = _SUM.unpack_from(stats, at)
    _SUM.pack_into(stats, at, total + seconds)
    at += _SUM.size + _COUNT.size * bisect.bisect_left(SECONDS, seconds)
    (n,) = _COUNT.unpack_from(stats, at)
    _COUNT.pack_into(stats, at, n + 1)


def run_into(exe: Any, inputs: list[Any], outputs: list[Any]) -> float:
    """Run a part on `inputs` and put its outputs into `outputs` (views of shared memory, of
    the planned shapes); the run's seconds."""
    t0 = time.perf_counter()
    got = exe.run(inputs)
    seconds = time.perf_counter() - t0
    for out, place in zip(got, outputs, strict=True):
        if tuple(out.shape) != tuple(place.shape):
            raise ValueError(f"output shape {tuple(out.shape)} != planned {tuple(place.shape)}")
        views.copy_into(place, out)
    return seconds


def fail(mm: mmap.mmap, layout: dict[str, Any], at: int, index: int, seq: int, slot: int,
         code: str, error: str) -> None:
    """Mark ring entry `index` (at offset `at`) FAILED with its error text."""
    if len(error) > wire.MAX_ERROR_TEXT:
        error = error[:wire.MAX_ERROR_TEXT] + "..."
    text = json.dumps({"code": code, "error": error}).encode()[:wire.ERROR_BYTES]
    where = layout["errors"] + index * wire.ERROR_BYTES
    mm[where:where + len(text)] = text
    wire.ENTRY.pack_into(mm, at, seq, slot, wire.FAILED, len(text))


class Session:
    def __init__(self, order: Attach, sock: socket.socket, memfd: int, stats_fd: int) -> None:
        self.model, self.part, self.layout = order.model, order.part, order.layout
        self.sock = sock
        self.exe: Any = None  # a weak reference to the part the session first ran
        try:
            self.mm = mmap.mmap(memfd, self.layout["size"])
            self.stats = mmap.mmap(stats_fd, STATS_BYTES)
        finally:
            os.close(memfd)
            os.close(stats_fd)

        self.inputs: list[list[Any]] = []
        self.outputs: list[list[Any]] = []

    def _places(self, exe: Any) -> None:
        """The slots' tensors, made once the part is known: numpy arrays for a runtime that
        takes them (OpenVINO, ONNX Runtime: 0.02-0.04 ms a run less than torch tensors on
        the dev host), torch tensors for the rest (views.py)."""
        lean = getattr(exe, "runtime", "") in views.NUMPY_RUNTIMES

        def place(base: int, t: dict[str, Any]) -> Any:
            shape = tuple(t["shape"])
            raw = memoryview(self.mm)[base + t["offset"]:base + t["offset"] + t["nbytes"]]
            if lean and t["dtype"] in views.NUMPY:
                return np.frombuffer(raw, t["dtype"]).reshape(shape)
            return (views.frombuffer(raw, t["dtype"], shape) if t["nbytes"]
                    else views.empty(t["dtype"], shape))

        slots = self.layout["slots"]
        self.inputs = [[place(b, t) for t in self.layout["inputs"]] for b in slots]
        self.outputs = [[place(b, t) for t in self.layout["outputs"]] for b in slots]

    def ring(self, parts: dict[tuple[str, str], Any]) -> bool:
        """Serve one doorbell; False when the session is over."""
        bell = self.read()
        return bell is not None and self.answer(bell, parts)

    def read(self) -> bytes | None:
        """The next doorbell (blocking); None when the session is over."""
        try:
            bell = self.sock.recv(wire.DOORBELL.size, socket.MSG_WAITALL)
        except OSError:
            return None
        return bell if len(bell) == wire.DOORBELL.size else None

    def answer(self, bell: bytes, parts: dict[tuple[str, str], Any]) -> bool:
        """Run the request rung for and answer it; False when the session is over."""
        rung = time.perf_counter()
        (seq,) = wire.DOORBELL.unpack(bell)
        depth = self.layout["depth"]
        index = seq % depth
        at = self.layout["ring"] + index * wire.ENTRY_BYTES
        got, slot, state, _ = wire.ENTRY.unpack_from(self.mm, at)
        exe = parts.get((self.model, self.part))
        if exe is None or (self.exe is not None and exe is not self.exe()):
            return False  # unloaded, or loaded again: the client opens a new session
        if self.exe is None:  # (weakly: an unloaded part is not kept alive by a session)
            self.exe = weakref.ref(exe)
            self._places(exe)
        try:
            if got != seq or state != wire.SUBMITTED:
                raise ValueError(f"ring entry {index} holds request {got} in state {state}, "
                                 f"the doorbell rang for request {seq} (state "
                                 f"{wire.SUBMITTED}: submitted)")
            if slot >= depth:
                raise ValueError(f"ring entry {index} names slot {slot}; the session has "
                                 f"slots 0..{depth - 1}")
        except ValueError as e:
            self._fail(at, index, seq, slot, "INVALID_ARGUMENT", str(e))
            return self._answer(bell)
        try:
            seconds = run_into(exe, self.inputs[slot], self.outputs[slot])
        except Exception as e:  # noqa: BLE001 - the request's failure, said to its client
            self._fail(at, index, seq, slot, "INTERNAL",
                       f"part {self.part} failed: {type(e).__name__}: {e}")
            return self._answer(bell)
        done, failed, busy = STATS.unpack_from(self.stats)
        STATS.pack_into(self.stats, 0, done + 1, failed, busy + seconds)
        count_time(self.stats, time.perf_counter() - rung)
        wire.ENTRY.pack_into(self.mm, at, seq, slot, wire.DONE, 0)
        return self._answer(bell)

    def _answer(self, bell: bytes) -> bool:
        try:
            self.sock.sendall(bell)
            return True
        except OSError:
            return False  # the client died mid-request

    def _fail(self, at: int, index: int, seq: int, slot: int, code: str, error: str) -> None:
        done, failed, busy = STATS.unpack_from(self.stats)
        STATS.pack_into(self.stats, 0, done, failed + 1, busy)
        fail(self.mm, self.layout, at, index, seq, slot, code, error)

    def close(self) -> None:
        self.sock.close()
        self.stats.close()
        self.inputs = self.outputs = []
        try:
            self.mm.close()
        except BufferError:  # a runtime still holds its last input: it goes with the worker
            pass


class BellSession:
    """A bell: the engine's doorbell for one part of a model, whose tensors lie in the
    request's arena block at offsets fixed at load (the order's layout: "inputs" and
    "outputs", each offset, dtype, shape). The record names the block, and the tensors the
    request has in clients' regions (checked on every use, mapped by the worker); the part
    runs on views of them, made once per place and kept (numpy arrays for the runtimes that
    take them, as a client's session has; a worker thread reads and writes clients' objects
    through their descriptors instead), and fails with the part's error (a part not built
    here, unloaded under its request, says so). The engine ends a bell by closing its socket."""

    def __init__(self, order: Attach, sock: socket.socket, memfd: int, stats_fd: int,
                 worker: Any) -> None:
        self.model, self.part, self.worker, self.sock = order.model, order.part, worker, sock
        self.places = {kind: [(t["offset"], t["dtype"], tuple(t["shape"]))
                              for t in order.layout[kind]] for kind in ("inputs", "outputs")}
        # the views of the blocks rung for, by (segment, offset, numpy views): blocks recur
        self.blocks: dict[tuple[str, int, bool], tuple[list[Any], list[Any]]] = {}
        try:
            self.mm = mmap.mmap(memfd, os.fstat(memfd).st_size)
            self.stats = mmap.mmap(stats_fd, STATS.size)
        finally:
            os.close(memfd)
            os.close(stats_fd)

    def ring(self, parts: dict[tuple[str, str], Any]) -> bool:
        try:
            bell = self.sock.recv(wire.DOORBELL.size, socket.MSG_WAITALL)
        except OSError:
            return False
        if len(bell) != wire.DOORBELL.size:
            return False
        (seq,) = wire.DOORBELL.unpack(bell)
        got, state, _, offset, name_len, elsewhere = BELL.unpack_from(self.mm, 0)
        done, failed, busy = STATS.unpack_from(self.stats)
        try:
            if got != seq or state != wire.SUBMITTED:
                raise ValueError(f"the record holds request {got} in state {state}, the bell "
                                 f"rang for request {seq}")
            seconds = self._run(parts, bytes(self.mm[BELL_NAME:BELL_NAME + name_len]).decode(),
                               offset, elsewhere)
        except Exception as e:  # noqa: BLE001 - the request's failure, told to the engine
            error = f"{type(e).__name__}: {e}"[:wire.MAX_ERROR_TEXT]
            text = json.dumps({"kind": getattr(e, "kind", ""), "error": error}).encode()[
                :BELL_ELSEWHERE - BELL_ERRORS]
            self.mm[BELL_ERRORS:BELL_ERRORS + len(text)] = text
            BELL.pack_into(self.mm, 0, seq, wire.FAILED, len(text), offset, name_len, elsewhere)
            STATS.pack_into(self.stats, 0, done, failed + 1, busy)
        else:
            BELL.pack_into(self.mm, 0, seq, wire.DONE, 0, offset, name_len, elsewhere)
            STATS.pack_into(self.stats, 0, done + 1, failed, busy + seconds)
        try:
            self.sock.sendall(bell)
            return True
        except OSError:
            return False

    def _run(self, parts: dict[tuple[str, str], Any], segment: str, offset: int,
             elsewhere: int) -> float:
        """The part on the request's views; its run's seconds."""
        exe = parts.get((self.model, self.part))
        if exe is None:
            raise KeyError(f"part {self.part} of model {self.model} is not built here")
        numpy = getattr(exe, "runtime", "") in views.NUMPY_RUNTIMES
        block = self.blocks.get((segment, offset, numpy))
        if block is None:
            if len(self.blocks) >= MAX_BLOCKS:
                self.blocks.clear()
            block = self.blocks[(segment, offset, numpy)] = tuple(  # type: ignore[assignment]
                [self.worker.tensor(TensorRef(segment, offset + at, dtype, shape), numpy)
                 for at, dtype, shape in self.places[kind]] for kind in ("inputs", "outputs"))
        inputs, outputs = block
        through: list[tuple[int, TensorRef]] = []  # outputs a worker thread writes with pwrite
        if elsewhere:  # in clients' regions: checked on every use
            inputs, outputs = list(inputs), list(outputs)
            at = BELL_ELSEWHERE
            for _ in range(elsewhere):
                kind, index, inode, where, length = TENSOR_AT.unpack_from(self.mm, at)
                name = bytes(self.mm[at + TENSOR_AT.size:at + TENSOR_AT.size + length])
                at += TENSOR_AT.size + length
                _, dtype, shape = self.places[("inputs", "outputs")[kind]][index]
                ref = TensorRef(name.decode(), where, dtype, shape, inode)
                if not (inode and self.worker.in_process):
                    (inputs, outputs)[kind][index] = self.worker.tensor(ref, numpy)
                elif kind == 0:  # (a worker thread never maps a client's object)
                    inputs[index] = self.worker.read(ref, numpy)
                else:
                    outputs[index] = (np.empty(shape, dtype) if numpy and dtype in views.NUMPY
                                      else views.empty(dtype, shape))
                    through.append((index, ref))
        seconds = run_into(exe, inputs, outputs)
        for index, ref in through:
            self.worker.write(outputs[index], ref)
        if self.worker.clients.closing:
            self.worker.clients.close_pending()
        return seconds

    def close(self) -> None:
        self.sock.close()
        self.stats.close()
        self.mm.close()
        self.blocks.clear()


class Sessions:
    """A worker's attached sessions (clients' fast-path sessions, the engine's bells),
    polled with its pipe."""

    def __init__(self, pipe_fd: int, worker: Any = None) -> None:
        self.worker = worker
        self.by_fd: dict[int, tuple[int, Session | BellSession]] = {}  # socket fd -> (order
        # id, session)
        self.poll = select.poll()
        self.pipe_fd = pipe_fd
        self.poll.register(pipe_fd, select.POLLIN)
        # a worker process spins a little before it sleeps (spin.py); one in the daemon's
        # threads never: it would hold the GIL the gRPC threads need
        self.spin = Spin(0.0 if getattr(worker, "in_process", False) else MOST_S)

    def take(self, envelope: Any, conn: Any) -> bool:
        """An Attach order: its three descriptors (the client's socket, the session's memfd,
        its counts' memfd) follow it on the pipe. False if the session could not be taken
        (answer the order at once: the client sees EOF and opens a new one)."""
        from multiprocessing.reduction import recvfds

        try:
            with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as pipe:
                sock_fd, memfd, stats_fd = recvfds(pipe, 3)
        except (OSError, RuntimeError, ValueError):
            return False
        sock = socket.socket(fileno=sock_fd)
        order = envelope.order
        try:
            session: Session | BellSession = (
                BellSession(order, sock, memfd, stats_fd, self.worker)
                if order.layout.get("kind") == "bell" else Session(order, sock, memfd, stats_fd))
        except Exception:  # noqa: BLE001
            sock.close()
            return False
        self.by_fd[sock.fileno()] = (envelope.id, session)
        self.poll.register(sock.fileno(), select.POLLIN)
        return True

    def wait(self, parts: dict[tuple[str, str], Any], lock: Any) -> tuple[list[int], bool]:
        """Serve the sessions rung until the pipe has an order or a session ended; returns
        the Attach order ids of the sessions that ended, and whether the pipe is ready."""
        while True:
            ended, pipe = [], False
            ready = self.spin.check(self._ready)
            if not ready:
                ready = self.poll.poll()
                self.spin.slept()
            for fd, _ in ready:
                if fd == self.pipe_fd:
                    pipe = True
                elif fd in self.by_fd:
                    with lock:
                        alive = self.by_fd[fd][1].ring(parts)
                    if not alive:
                        ended.append(self.end(fd))
            if pipe or ended:
                return ended, pipe

    def _ready(self) -> list[tuple[int, int]]:
        return self.poll.poll(0)

    def end(self, fd: int) -> int:
        rid, session = self.by_fd.pop(fd)
        self.poll.unregister(fd)
        session.close()
        return rid
