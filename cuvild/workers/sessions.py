"""Sessions a device worker serves itself: the one way a part runs.

Two kinds of doorbell are attached to a worker (`Attach`: the daemon passes a socket and a
memfd over the worker's pipe, SCM_RIGHTS), and one class serves both (`Session`):
- a client's fast-path session on a one-part model (cuvild/serve/fast.py opens it; the wire
  is protos/fastpath.py): its sealed memfd holds a request ring and the input and output
  slots; the client's doorbell wakes the worker, which runs the part on the slot in place;
- the engine's bell for a part of a model (cuvild/run/bells.py): its record names the
  request's arena block and the request's tensors in clients' regions (protos/shared.py).
Either way one round trip per request, nothing pickled, no copy of the inputs. The worker's
loop polls its pipe and its sessions' sockets together (`Sessions.wait`); a client's session
ends when the client closes it (or dies), when its model is unloaded here (the client then
opens a new one), or with the worker; a bell, when the engine closes it.
"""

from __future__ import annotations

import bisect
import json
import logging
import mmap
import os
import select
import socket
import struct
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cuvild.core import views
from cuvild.core.arena import align
from cuvild.core.dtypes import nbytes
from cuvild.core.spin import MOST_S, Spin
from cuvild.workers import cudamem
from protos import fastpath as wire
from protos.orders import Attach, TensorRef
from protos.shared import (
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
    from cuvild.core.loaded import LoadedModel

log = logging.getLogger(__name__)
MAX_BLOCKS = 64  # a session's views of the places it was rung for, kept (they recur)
# how long a part that batches sequences' steps (a language model's decode step) waits for
# the steps of the other sequences that stepped on it lately (its `expected`), to share a run
GATHER_S = 0.002
MISSES = 8
Rung = tuple[int, Any, float]  # a doorbell: its request's seq, the part it rang for, when


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


def run_into(exe: Any, inputs: list[Any], outputs: list[Any], slot: int = 0,
             scope: str = "") -> float:
    """Run a part on `inputs` and put its outputs into `outputs` (views of shared memory, of
    the planned shapes); the run's seconds. A stateful part runs on sequence `slot` of model
    `scope` (0: a fresh state)."""
    use = getattr(exe, "use", None)
    if use is not None:
        use(slot, scope)
    t0 = time.perf_counter()
    into = getattr(exe, "run_into", None)  # a runtime that writes into the places itself
    got = into(inputs, outputs) if into is not None else exe.run(inputs)
    aside = getattr(exe, "aside", None)  # (its own work in the run: not the part's time)
    seconds = time.perf_counter() - t0 - (aside() if aside is not None else 0.0)
    for out, place in zip(got, outputs, strict=True):
        if tuple(out.shape) != tuple(place.shape):
            raise ValueError(f"output shape {tuple(out.shape)} != planned {tuple(place.shape)}")
        views.copy_into(place, out)
    return seconds


def run_together(exe: Any, steps: list[tuple[int, int, list[Any], list[Any]]],
                 scope: str) -> float:
    """One step of several sequences of model `scope` (each (k, slot, inputs, outputs)) in
    one run of a part that batches them (runtimes/torch_eager.py `run_batch`), each output
    put in its place; the seconds per step."""
    t0 = time.perf_counter()
    got = exe.run_batch([slot for _, slot, _, _ in steps], [ins for _, _, ins, _ in steps],
                        scope)
    for outs, (_, _, _, places) in zip(got, steps, strict=True):
        for out, place in zip(outs, places, strict=True):
            if tuple(out.shape) != tuple(place.shape):
                raise ValueError(f"output shape {tuple(out.shape)} != planned "
                                 f"{tuple(place.shape)}")
            views.copy_into(place, out)
    return (time.perf_counter() - t0) / len(steps)


def batches(rung: list[tuple[int, Rung]]) -> list[tuple[list[int], list[Rung]]]:
    """The doorbells rung, in order, those for one part that batches sequences together."""
    groups: dict[int, tuple[list[int], list[Rung]]] = {}
    out: list[tuple[list[int], list[Rung]]] = []
    for fd, r in rung:
        if getattr(r[1], "batches", False) and id(r[1]) in groups:
            groups[id(r[1])][0].append(fd)
            groups[id(r[1])][1].append(r)
            continue
        out.append(([fd], [r]))
        if getattr(r[1], "batches", False):
            groups[id(r[1])] = out[-1]
    return out


def fail(mm: mmap.mmap, layout: dict[str, Any], at: int, index: int, seq: int, slot: int,
         code: str, error: str) -> None:
    """Mark ring entry `index` (at offset `at`) FAILED with its error text."""
    if len(error) > wire.MAX_ERROR_TEXT:
        error = error[:wire.MAX_ERROR_TEXT] + "..."
    text = json.dumps({"code": code, "error": error}).encode()[:wire.ERROR_BYTES]
    where = layout["errors"] + index * wire.ERROR_BYTES
    mm[where:where + len(text)] = text
    wire.ENTRY.pack_into(mm, at, seq, slot, wire.FAILED, len(text))


class Slots:
    """A client's fast-path session's ring (protos/fastpath.py): the entry at seq % depth names
    a slot of the session's own memory, and holds the request's state and failure."""

    def __init__(self, layout: dict[str, Any], mm: mmap.mmap, part: str) -> None:
        self.layout, self.mm, self.part = layout, mm, part
        self.at = self.index = self.slot = 0  # the entry of the request being served

    def where(self, seq: int) -> tuple[str | None, int, int, int]:
        depth, ring = self.layout["depth"], self.layout["ring"]
        self.index, self.slot = seq % depth, 0  # (where a refusal is written)
        self.at = ring + self.index * wire.ENTRY_BYTES
        _, _, self.slot = wire.submitted(self.mm, ring, depth, seq)
        return None, self.layout["slots"][self.slot], 0, 0  # (no sequence: a fresh state)

    def done(self, seq: int) -> None:
        wire.ENTRY.pack_into(self.mm, self.at, seq, self.slot, wire.DONE, 0)

    def failed(self, seq: int, e: Exception, refused: bool) -> None:
        if refused:
            fail(self.mm, self.layout, self.at, self.index, seq, self.slot, "INVALID_ARGUMENT",
                 str(e))
        else:
            fail(self.mm, self.layout, self.at, self.index, seq, self.slot, "INTERNAL",
                 f"part {self.part} failed: {type(e).__name__}: {e}")


class Record:
    """An engine's bell's record (protos/shared.py BELL): the request's arena block, and the
    tensors the request has in clients' regions (TENSOR_AT entries)."""

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm
        # the request's block offset, name length, tensors elsewhere, sequence slot
        self.kept = (0, 0, 0, 0)

    def where(self, seq: int) -> tuple[str | None, int, int, int]:
        got, state, _, offset, name_len, elsewhere, slot = BELL.unpack_from(self.mm, 0)
        self.kept = (offset, name_len, elsewhere, slot)
        if got != seq or state != wire.SUBMITTED:
            raise ValueError(f"the record holds request {got} in state {state}, the bell "
                             f"rang for request {seq}")
        return (bytes(self.mm[BELL_NAME:BELL_NAME + name_len]).decode(), offset, elsewhere,
                slot)

    def done(self, seq: int) -> None:
        BELL.pack_into(self.mm, 0, seq, wire.DONE, 0, *self.kept)

    def failed(self, seq: int, e: Exception, refused: bool) -> None:
        error = f"{type(e).__name__}: {e}"[:wire.MAX_ERROR_TEXT]
        text = json.dumps({"kind": getattr(e, "kind", ""), "error": error}).encode()[
            :BELL_ELSEWHERE - BELL_ERRORS]
        self.mm[BELL_ERRORS:BELL_ERRORS + len(text)] = text
        BELL.pack_into(self.mm, 0, seq, wire.FAILED, len(text), *self.kept)


class Session:
    """One doorbell into one part, served by its worker: a client's fast-path session (its
    ring names a slot of its own memory: `Slots`) or the engine's bell (its record names a
    block of the daemon's arena, and the request's tensors in clients' regions: `Record`).
    Where the part's tensors lie from a slot's or a block's start is fixed when it is attached
    (the order's layout: "inputs" and "outputs", each offset, dtype, shape). The part runs on
    views of the request's place, made once per place and kept (numpy arrays for the runtimes
    that take them: OpenVINO, ONNX Runtime, 0.02-0.04 ms a run less than torch tensors on the
    dev host); clients' regions are checked on every use, mapped by a worker process and read
    and written through their descriptors by a worker thread. A failure is the request's,
    written where its caller reads it. A client's session ends when the client closes it or
    its model is unloaded or loaded again here (the client opens a new one); a bell, when the
    engine closes it."""

    def __init__(self, order: Attach, sock: socket.socket, memfd: int, stats_fd: int,
                 worker: Any) -> None:
        self.model, self.part, self.worker, self.sock = order.model, order.part, worker, sock
        self.places = {kind: [(t["offset"], t["dtype"], tuple(t["shape"]))
                              for t in order.layout[kind]] for kind in ("inputs", "outputs")}
        # the views of the places rung for, by (segment, start, numpy views): places recur
        self.blocks: dict[tuple[str | None, int, bool], tuple[list[Any], list[Any]]] = {}
        self.exe: Any = None  # a client's session: a weak reference to the part it first ran
        try:
            self.mm = mmap.mmap(memfd, os.fstat(memfd).st_size)
            self.stats = mmap.mmap(stats_fd, STATS_BYTES)
        finally:
            os.close(memfd)
            os.close(stats_fd)
        self.record: Slots | Record = (Record(self.mm) if order.layout.get("kind") == "bell"
                                       else Slots(order.layout, self.mm, order.part))

    def ring(self, parts: dict[tuple[str, str], Any]) -> bool:
        """Serve one doorbell: the request rung for is run on its views, its outcome written
        where its caller reads it (and counted), and the doorbell sent back. False when the
        session is over."""
        rung = self.receive(parts)
        return rung is not None and self.ring_alone(rung)

    def ring_alone(self, rung: Rung) -> bool:
        """Serve a doorbell received: its request run alone."""
        try:
            place = self.record.where(rung[0])
        except Exception as e:  # noqa: BLE001 - the request's failure, told to its caller
            return self.answer(rung, e, refused=True)
        return self.answer(rung, lambda: self._run(rung[1], *place))

    def receive(self, parts: dict[tuple[str, str], Any]) -> Rung | None:
        """The doorbell rung: (request seq, the part, when); None when the session is over."""
        try:
            bell = self.sock.recv(wire.DOORBELL.size, socket.MSG_WAITALL)
        except OSError:
            return None
        exe = parts.get((self.model, self.part))
        if len(bell) != wire.DOORBELL.size or not self._serves(exe):
            return None
        return wire.DOORBELL.unpack(bell)[0], exe, time.perf_counter()

    def answer(self, rung: Rung, outcome: Callable[[], float] | float | Exception,
               refused: bool = False) -> bool:
        """Run the request (`outcome` a callable: the run, its seconds) or take how it went
        (its seconds, or its failure), write that where its caller reads it (and count it),
        and send the doorbell back. False when the caller is gone."""
        seq, _, when = rung
        done, failed, busy = STATS.unpack_from(self.stats)
        try:
            if isinstance(outcome, Exception):
                raise outcome
            seconds = outcome() if callable(outcome) else outcome
        except Exception as e:  # noqa: BLE001 - the request's failure, told to its caller
            self.record.failed(seq, e, refused)
            STATS.pack_into(self.stats, 0, done, failed + 1, busy)
        else:
            self.record.done(seq)
            STATS.pack_into(self.stats, 0, done + 1, failed, busy + seconds)
            if isinstance(self.record, Slots):  # (the engine times its own requests)
                count_time(self.stats, time.perf_counter() - when)
        try:
            self.sock.sendall(wire.DOORBELL.pack(seq))
            return True
        except OSError:
            return False  # the caller died mid-request

    def _serves(self, exe: Any) -> bool:
        """A client's session serves the part it first ran: not once its model is unloaded,
        or loaded again here (its client opens a new session). A bell is closed by the engine."""
        if isinstance(self.record, Record):
            return True
        if exe is None or (self.exe is not None and exe is not self.exe()):
            return False
        self.exe = self.exe or weakref.ref(exe)  # (weakly: not kept alive by a session)
        return True

    def _run(self, exe: Any, segment: str | None, start: int, elsewhere: int,
             slot: int) -> float:
        """The part on the request's views (a stateful part on its sequence `slot`'s state:
        runtimes/torch_eager.py); its run's seconds."""
        numpy = getattr(exe, "runtime", "") in views.NUMPY_RUNTIMES
        inputs, outputs = self.views(exe, segment, start)
        through: list[tuple[int, TensorRef]] = []  # outputs a worker thread writes with pwrite
        settle = False  # an output in a client's CUDA region, written by the part
        if elsewhere:  # in clients' regions: checked on every use
            inputs, outputs = list(inputs), list(outputs)
            at = BELL_ELSEWHERE
            for _ in range(elsewhere):
                kind, index, inode, where, length = TENSOR_AT.unpack_from(self.mm, at)
                name = bytes(self.mm[at + TENSOR_AT.size:at + TENSOR_AT.size + length])
                at += TENSOR_AT.size + length
                _, dtype, shape = self.places[("inputs", "outputs")[kind]][index]
                ref = TensorRef(name.decode(), where, dtype, shape, inode)
                # in place: a client's object in a worker process, its CUDA region on a GPU
                cuda = cudamem.is_cuda(ref.segment)
                if self.worker.on_gpu if cuda else not (inode and self.worker.threaded):
                    (inputs, outputs)[kind][index] = self.worker.tensor(ref, numpy)
                    settle |= cuda and kind == 1
                elif kind == 0:  # (a worker thread never maps a client's object)
                    inputs[index] = self.worker.read(ref, numpy)
                else:
                    outputs[index] = views.wrap(None, dtype, shape, numpy)
                    through.append((index, ref))
        # a bucket's key is its model's and "@shapes": a sequence's state is the model's
        seconds = run_into(exe, inputs, outputs, slot, self.model.partition("@")[0])
        for index, ref in through:
            self.worker.write(outputs[index], ref)
        if settle:  # outputs written on the device: finished before the client reads them
            for out in outputs:
                cudamem.CudaObjects.settle(out)
        if self.worker.clients.closing:
            self.worker.clients.close_pending()
        return seconds

    def views(self, exe: Any, segment: str | None, start: int) -> tuple[list[Any], list[Any]]:
        """The part's inputs and outputs at a request's place (made once per place, kept)."""
        if exe is None:
            raise KeyError(f"part {self.part} of model {self.model} is not built here")
        numpy = getattr(exe, "runtime", "") in views.NUMPY_RUNTIMES
        block = self.blocks.get((segment, start, numpy))
        if block is None:
            if len(self.blocks) >= MAX_BLOCKS:
                self.blocks.clear()
            block = self.blocks[(segment, start, numpy)] = tuple(  # type: ignore[assignment]
                [self._view(segment, start + at, dtype, shape, numpy)
                 for at, dtype, shape in self.places[kind]] for kind in ("inputs", "outputs"))
        return block

    def _view(self, segment: str | None, at: int, dtype: str, shape: tuple[int, ...],
              numpy: bool) -> Any:
        """A tensor at `at` in the daemon's arena segment `segment` (the worker's view), or in
        this session's own memory (None)."""
        if segment is not None:
            return self.worker.tensor(TensorRef(segment, at, dtype, shape), numpy)
        size = nbytes(dtype, shape)
        return views.wrap(memoryview(self.mm)[at:at + size] if size else None, dtype, shape,
                          numpy)

    def close(self) -> None:
        self.sock.close()
        self.stats.close()
        self.blocks.clear()
        try:
            self.mm.close()
        except BufferError:  # a runtime still holds its last input: it goes with the worker
            pass


class Sessions:
    """A worker's attached sessions (clients' fast-path sessions, the engine's bells),
    polled with its pipe."""

    def __init__(self, pipe_fd: int, worker: Any) -> None:
        self.worker = worker
        self.by_fd: dict[int, tuple[int, Session]] = {}  # socket fd -> (order id, session)
        self.poll = select.poll()
        self.pipe_fd = pipe_fd
        self.poll.register(pipe_fd, select.POLLIN)
        # a worker process spins a little before it sleeps (spin.py); one in the daemon's
        # threads never: it would hold the GIL the gRPC threads need
        self.spin = Spin(0.0 if worker.threaded else MOST_S)
        self._misses: dict[int, int] = {}  # by id of a part that batches: waits in vain

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
            session = Session(order, sock, memfd, stats_fd, self.worker)
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
            rung: list[tuple[int, Rung]] = []
            pipe = self._receive(ready, parts, lock, rung, ended)
            if any(getattr(r[1], "batches", False) for _, r in rung):
                pipe |= self._gather(parts, lock, rung, ended)
            for fds, rungs in batches(rung):
                with lock:
                    alive = self._serve(fds, rungs)
                ended += [self.end(fd) for fd, ok in zip(fds, alive, strict=True) if not ok]
            if pipe or ended:
                return ended, pipe

    def _receive(self, ready: list[tuple[int, int]], parts: dict[tuple[str, str], Any],
                 lock: Any, rung: list[tuple[int, Rung]], ended: list[int]) -> bool:
        """Take the doorbells of the ready sessions into `rung` (those over into `ended`);
        whether the pipe is ready."""
        pipe = False
        for fd, _ in ready:
            if fd == self.pipe_fd:
                pipe = True
            elif fd in self.by_fd and all(fd != f for f, _ in rung):
                with lock:
                    got = self.by_fd[fd][1].receive(parts)
                if got is None:
                    ended.append(self.end(fd))
                else:
                    rung.append((fd, got))
        return pipe

    def _gather(self, parts: dict[tuple[str, str], Any], lock: Any,
                rung: list[tuple[int, Rung]], ended: list[int]) -> bool:
        """Wait up to GATHER_S for the steps of the other sequences that stepped on a part that
        batches them (its `expected`) to ring too, so that they share its run; whether the pipe
        became ready meanwhile. A part whose last MISSES waits gained nothing (one caller
        stepping its sequences in turn) waits only every MISSES-th time."""
        pipe, until, before = False, time.monotonic() + GATHER_S, len(rung)
        wanted = {id(r[1]): r[1] for _, r in rung if getattr(r[1], "batches", False)}
        missed = {k: self._misses.get(k, 0) for k in wanted}
        if all(m >= MISSES and m % MISSES for m in missed.values()):
            for k in wanted:
                self._misses[k] = missed[k] + 1
            return False
        waited = False
        while not pipe:
            if all(exe.expected() <= sum(r[1] is exe for _, r in rung)
                   for exe in wanted.values()):
                break
            left = until - time.monotonic()
            if left <= 0:
                break
            waited = True
            more = self.poll.poll(max(1, int(left * 1000)) if self.worker.threaded else 0)
            pipe = self._receive(more, parts, lock, rung, ended)
        if len(self._misses) > 1024:  # (parts long unloaded)
            self._misses.clear()
        for k in wanted:
            self._misses[k] = missed[k] + 1 if waited and len(rung) == before else 0
        return pipe

    def _serve(self, fds: list[int], rungs: list[Rung]) -> list[bool]:
        """Serve doorbells of one part: alone, or (several sequences' steps of a part that
        batches them) in one run; whether each session is still there."""
        sessions = [self.by_fd[fd][1] for fd in fds]
        if len(fds) == 1:
            return [sessions[0].ring_alone(rungs[0])]
        exe, alive = rungs[0][1], [True] * len(fds)
        steps: list[tuple[int, int, list[Any], list[Any]]] = []  # (k, slot, inputs, outputs)
        for k, (session, rung) in enumerate(zip(sessions, rungs, strict=True)):
            try:
                segment, start, elsewhere, slot = session.record.where(rung[0])
                if elsewhere or not slot:
                    raise ValueError("not a sequence's step in the arena")
                steps.append((k, slot, *session.views(exe, segment, start)))
            except Exception:  # noqa: BLE001 - served alone, as ever
                alive[k] = session.ring_alone(rung)
        if steps:
            try:
                seconds = run_together(exe, steps, sessions[0].model.partition("@")[0])
            except Exception as e:  # noqa: BLE001 - each alone: a failure is its own request's
                log.warning("part %s of %s: its sequences run alone from now on (%s: %s)",
                            sessions[0].part, sessions[0].model, type(e).__name__, e)
                exe.batches = False
                for k, *_ in steps:
                    alive[k] = sessions[k].ring_alone(rungs[k])
            else:
                for k, *_ in steps:
                    alive[k] = sessions[k].answer(rungs[k], seconds)
        return alive

    def _ready(self) -> list[tuple[int, int]]:
        return self.poll.poll(0)

    def end(self, fd: int) -> int:
        rid, session = self.by_fd.pop(fd)
        self.poll.unregister(fd)
        session.close()
        return rid
