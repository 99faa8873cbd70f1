"""The same-host fast path, the daemon's side (the wire: protos/fastpath.py).

A client that opens a session on the unix socket (the front hands it over on its first
bytes, after SO_PEERCRED and the per-uid connection limits, cuvild/serve/front.py) gets a
sealed memfd holding a request ring and the model's input and output slots; from then on a
request is a ring entry and an 8-byte doorbell on its own connection: no gRPC, no protobuf,
nothing pickled, no check of the request's shapes (they were fixed when the session opened:
a dynamic-shape model's session is opened for its client's shapes, and serves the model's
bucket for them, cuvild/load/buckets.py). Who answers the doorbell: for a one-part model,
its worker itself (a process or, with `engine.workers: thread`, a thread: the session is
attached to it, cuvild/workers/sessions.py), running the part on the slot in place; for any
other model, and for a batched one (its requests queue to share runs with other clients'),
the session's thread through `Runner.run` (inputs copied once into the arena, as raw OIP
inputs are, outputs once into the slot). The client never maps the daemon's arena, and no
process of ours maps an object the client can shrink (the memfd is sealed), so no client can
make the daemon or a worker fault.

The session ends when its connection closes (the client closed it or died: its memory goes
with the last mapping, its connection counts no more), when its model is unloaded or loaded
again (the client opens a new one), when it ran no request for `limits.idle_timeout_s`
(`FastPath.sweep`: the daemon's loop looks each second), or with its worker or the daemon.
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from cuvild.core.errors import InferError
from cuvild.core.layout import BadInput
from cuvild.core.loaded import one_part
from cuvild.serve.errors import Refused, find, status
from cuvild.workers.sessions import fail, slot_layout
from protos import fastpath as wire
from protos.orders import Attach, RawTensor
from protos.shared import STATS, STATS_BYTES, TIMES

if TYPE_CHECKING:
    from cuvild.core.loaded import LoadedModel
    from cuvild.load.models import ModelManager, ServedModel
    from cuvild.run.runner import Runner
    from cuvild.serve.metrics import Metrics

log = logging.getLogger(__name__)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
OPEN_BUILD_S = 600.0  # a new bucket's build, waited for by the session that opens it
COUNTS = 2 + len(TIMES.unpack(bytes(TIMES.size)))  # a session's counts(): done, failed, TIMES


def _code(error: BaseException) -> str:
    """The code a fast-path reply carries: its status's name, or the wire's own RELOADED."""
    return wire.RELOADED if getattr(error, "kind", "") == wire.RELOADED else status(error).name


def _recv_exact(sock: socket.socket, n: int, have: bytes = b"") -> bytes:
    data = bytearray(have)
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the client closed the session")
        data += chunk
    return bytes(data)


def layout(served: ServedModel, model: LoadedModel, depth: int) -> dict[str, Any]:
    """The session's memory, with the model's tensors under the protocol's names."""
    return {"ok": True, "name": served.record.name, "version": served.record.version,
            "dynamic": model is not served.loaded,  # a bucket: these shapes only
            **slot_layout(model, [t["name"] for t in served.record.inputs],
                          [t["name"] for t in served.record.outputs], depth)}


class ClientSession:
    """One client's session: its connection, its memfd mapped here, its thread."""

    def __init__(self, fast: FastPath, sock: socket.socket, uid: int, served: ServedModel,
                 model: LoadedModel, depth: int, done: Callable[[], None]) -> None:
        self.fast, self.sock, self.uid, self.served, self.done = fast, sock, uid, served, done
        self.ended, self.attached = False, False
        self._closing = threading.Lock()  # the worker's end and the session's own may race
        self.handled, self.busy = 0, False  # requests the daemon ran for it; one running
        self.seen, self.last = 0.0, time.monotonic()  # its activity at the last sweep, when
        self.model = model  # the served model, or its bucket for the session's shapes
        self.model_id = (served.record.name, served.record.version)
        self.layout = layout(served, self.model, depth)
        fd = os.memfd_create(f"cuvild-session-{served.record.name}",
                             os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.layout["size"])
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)  # the client cannot shrink it under us
            self.mm = mmap.mmap(fd, self.layout["size"])
            reply = json.dumps(self.layout).encode()
            socket.send_fds(sock, [wire.LENGTH.pack(len(reply)) + reply], [fd])
            stats_fd = os.memfd_create("cuvild-session-counts", os.MFD_CLOEXEC)
            try:
                os.ftruncate(stats_fd, mmap.PAGESIZE)
                self.stats = mmap.mmap(stats_fd, STATS_BYTES)
                ended = self._attach(fd, stats_fd)
            finally:
                os.close(stats_fd)
        finally:
            os.close(fd)  # the mapping here, the client's and a worker's descriptors keep it
        if ended is not None:  # the worker serves it: only the counts stay mapped here
            self.attached = True
            self.mm.close()
            # Our end of the connection stays open until the session ends, to end it when
            # idle (`FastPath.sweep`: shut down, the worker and the client see EOF). Added
            # last: a session that ended already (its client closed it at once) closes here.
            ended.add_done_callback(lambda _: self.close())
            return
        view = memoryview(self.mm)
        # Per slot, the inputs as the engine takes raw bytes and the outputs' places.
        self.inputs = [[RawTensor(view[base + t["offset"]:base + t["offset"] + t["nbytes"]],
                                  t["dtype"], tuple(t["shape"]))  # type: ignore[arg-type]
                        for t in self.layout["inputs"]] for base in self.layout["slots"]]
        self.outputs = [[view[base + t["offset"]:base + t["offset"] + t["nbytes"]]
                         for t in self.layout["outputs"]] for base in self.layout["slots"]]
        self.batch = (self.layout["inputs"][0]["shape"] or [1])[0] if self.layout["inputs"] else 1

    def _attach(self, memfd: int, stats_fd: int) -> Future[Any] | None:
        """Hand a one-part model's session to its worker (cuvild/workers/sessions.py: the
        client's doorbell then wakes the worker itself): the future of its end there. None
        where the daemon serves it (several parts, a batched model, a worker being
        restarted)."""
        if not one_part(self.model) or self.model.batcher is not None:
            return None  # (a batched model's requests queue in the daemon to share runs)
        route = self.model.routes[0]
        worker = self.fast.runner.workers.ready(route.device)
        if worker is None:
            return None
        ended = worker.attach(Attach(self.model.key, route.id, self.layout),
                              [self.sock.fileno(), memfd, stats_fd])
        if ended.done() and ended.exception() is not None:
            return None
        return ended

    def serve(self) -> None:
        try:
            while True:
                try:
                    bell = self.sock.recv(wire.DOORBELL.size, socket.MSG_WAITALL)
                except OSError:
                    break
                if len(bell) < wire.DOORBELL.size:
                    break  # closed (a partial doorbell is a client that died mid-write)
                (seq,) = wire.DOORBELL.unpack(bell)
                self.busy = True  # (not idle, however long it runs)
                try:
                    self.handle(seq)
                finally:
                    self.busy, self.handled = False, self.handled + 1
                try:
                    self.sock.sendall(bell)
                except OSError:
                    break  # the client died mid-request: its session ends here
        finally:
            self.close()

    def handle(self, seq: int) -> None:
        t0 = time.perf_counter()
        name, version = self.served.record.name, self.served.record.version
        depth, ring = self.layout["depth"], self.layout["ring"]
        index, slot = seq % depth, 0
        at = ring + index * wire.ENTRY_BYTES
        try:
            try:
                _, _, slot = wire.submitted(self.mm, ring, depth, seq)
            except wire.BadEntry as e:
                raise Refused("invalid", str(e)) from None
            if not self.fast.models.current(self.served):
                raise self._gone()
            self.fast.runner.run_into(self.model, self.inputs[slot], self.outputs[slot])
        except (Refused, InferError) as e:
            code = _code(e)
            self._fail(at, index, seq, slot, code, str(e))
            if self.fast.metrics:
                self.fast.metrics.failed(name, version, code)
            return
        except Exception as e:  # a bug: said as such, the session goes on
            log.exception("fast path: request %d of a session on %s failed", seq, name)
            self._fail(at, index, seq, slot, "INTERNAL", f"{type(e).__name__}: {e}")
            return
        wire.ENTRY.pack_into(self.mm, at, seq, slot, wire.DONE, 0)
        if self.fast.metrics:
            seconds = time.perf_counter() - t0
            self.fast.metrics.computed(self.model, seconds)
            self.fast.metrics.succeeded(name, version, seconds, self.batch)

    def _gone(self) -> Refused:
        served = self.fast.models.get(self.served.record.name, self.served.record.version)
        if served is not None and served is not self.served:
            return Refused(wire.RELOADED, f"model {self.served.key} was loaded again since "
                           "this session opened: open a new session")
        if served is None:
            return Refused("not_found", f"model {self.served.key} was unloaded")
        return Refused("unavailable", f"model {self.served.key} is "
                       f"{self.served.state.lower()}: {self.served.reason}")

    def _fail(self, at: int, index: int, seq: int, slot: int, code: str, error: str) -> None:
        fail(self.mm, self.layout, at, index, seq, slot, code, error)

    def counts(self) -> list[float]:
        """Requests done and failed that a worker ran on this session's memory (the others
        are in the request metrics already), and the histogram of the ones done: seconds
        summed, requests per bucket (protos/shared.py, TIMES)."""
        if not self.attached or self.stats.closed:
            return [0] * COUNTS
        done, failed, _ = STATS.unpack_from(self.stats)
        return [done, failed, *TIMES.unpack_from(self.stats, STATS.size)]

    def activity(self) -> float:
        """Requests run for it, by the daemon and by a worker: it was idle if unchanged."""
        return self.handled + sum(self.counts()[:2])

    def close(self) -> None:
        """End the session once: its connection closed and given back to the front (or its
        caller's uid would hold a slot of `limits.max_connections_per_uid` until restart)."""
        with self._closing:
            if self.ended:
                return
            self.ended = True
        try:
            self.fast.forget(self)
        finally:
            try:
                self.sock.close()
            finally:
                self.done()
        self.stats.close()
        self.inputs, self.outputs = [], []
        try:
            self.mm.close()
        except BufferError:  # a view is still out (a request in flight at shutdown)
            log.debug("fast-path session memory still referenced; it goes with the process")


class FastPath:
    """The sessions of one daemon."""

    def __init__(self, models: ModelManager, runner: Runner,
                 metrics: Metrics | None = None) -> None:
        self.models, self.runner, self.metrics = models, runner, metrics
        self._sessions: set[ClientSession] = set()  # served here, by their threads
        self._attached: set[ClientSession] = set()  # served by their model's worker process
        # (name, version) -> requests done, failed, of ended sessions
        self._ended: dict[tuple[str, str], list[float]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def sessions(self) -> int:
        return len(self._sessions) + len(self._attached)

    def accept(self, sock: socket.socket, uid: int, first: bytes,
               done: Callable[[], None]) -> None:
        """A connection whose first bytes are the fast path's magic (the front's hand-off):
        open its session on a thread of its own."""
        threading.Thread(target=self._open, args=(sock, uid, first, done),
                         name=f"fast-{uid}", daemon=True).start()

    def _open(self, sock: socket.socket, uid: int, first: bytes,
              done: Callable[[], None]) -> None:
        try:
            sock.setblocking(True)
            sock.settimeout(10.0)  # for the open; a session then waits as long as it likes
            head = _recv_exact(sock, wire.OPEN.size, first[:wire.OPEN.size])
            magic, version, length = wire.OPEN.unpack(head)
            if version != wire.VERSION:
                raise Refused("precondition", f"fast path version {version}: this "
                              f"cuvild speaks {wire.VERSION}")
            if length > wire.MAX_OPEN_BYTES:
                raise Refused("invalid", f"open request of {length} bytes (at most "
                              f"{wire.MAX_OPEN_BYTES})")
            body = _recv_exact(sock, length, first[wire.OPEN.size:])
            served, model, depth = self._model(json.loads(body))
            sock.settimeout(None)
            if self._closed:
                raise Refused("unavailable", "cuvild is stopping")
            # (not under the lock: an attached session may end, and forget itself, at once)
            session = ClientSession(self, sock, uid, served, model, depth, done)
            with self._lock:
                if not session.ended:
                    (self._attached if session.attached else self._sessions).add(session)
        except Exception as e:  # noqa: BLE001 - whatever it was, the slot is given back
            # a refusal, or bad bytes (ValueError, RecursionError from JSON nested 5000 deep,
            # EOF): the caller's connection slot is released, or its uid is locked out of
            # the daemon until restart; anything else is a bug, said, and still released
            known = (Refused, ValueError, EOFError, OSError, RecursionError)
            code = _code(e) if isinstance(e, Refused) else (
                "INVALID_ARGUMENT" if isinstance(e, known) else "INTERNAL")
            if not isinstance(e, known):
                log.exception("fast path: opening a session of uid %d failed", uid)
            log.debug("fast path: refused a session of uid %d: %s", uid, e)
            reply = json.dumps({"ok": False, "code": code, "error": str(e)[:1000],
                                **getattr(e, "said", {})}).encode()
            try:
                sock.sendall(wire.LENGTH.pack(len(reply)) + reply)
            except OSError:
                pass
            sock.close()
            done()
            return
        log.debug("fast path: uid %d opened a session on %s%s", uid, served.key,
                  " (served by its worker)" if session.attached else "")
        if not session.attached:
            session.serve()

    def _model(self, request: Any) -> tuple[ServedModel, LoadedModel, int]:
        """The open request's model and depth; with "shapes" (a dynamic-shape model's
        inputs), the model's bucket for them, built if it is new (cuvild/load/buckets.py)."""
        if not isinstance(request, dict) or not isinstance(request.get("model"), str):
            raise Refused("invalid", 'open request: expected {"model": name, ...}')
        name, version = request["model"], str(request.get("version") or "")
        depth = request.get("depth", 1)
        if isinstance(depth, bool) or not isinstance(depth, int) or not (
                1 <= depth <= wire.MAX_DEPTH):
            raise Refused("invalid", f"depth {depth!r}: 1..{wire.MAX_DEPTH}")
        served = find(self.models, name, version)
        assert served.loaded is not None  # (READY)
        shapes = request.get("shapes")
        if shapes is None:
            if served.loaded.dynamic:
                raise Refused("precondition", f"model {served.key} has dynamic input "
                              'shapes: open the session with "shapes", those of your inputs',
                              dynamic=True, inputs=[
                                  {"name": t["name"], "dtype": spec.dtype,
                                   "shape": list(spec.shape)}
                                  for t, spec in zip(served.record.inputs,
                                                     served.loaded.table, strict=True)])
            return served, served.loaded, depth
        if not isinstance(shapes, list) or not all(
                isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                for shape in shapes):
            raise Refused("invalid", f"shapes {shapes!r}: one list of sizes >= 0 per "
                          "input")
        dtypes = [spec.dtype for spec in served.loaded.table]  # (a count that differs is
        given = [(dtypes[i] if i < len(dtypes) else "", tuple(shape))  # said by resolve)
                 for i, shape in enumerate(shapes)]
        try:
            model = self.runner.resolve(served.loaded, given,
                                        deadline=time.monotonic() + OPEN_BUILD_S)
        except BadInput as e:
            raise Refused("invalid", str(e)) from None
        except InferError as e:  # its bucket could not be built in time, or at all
            raise Refused(e.kind, str(e)) from None
        return served, model, depth

    def forget(self, session: ClientSession) -> None:
        counts = session.counts()
        with self._lock:
            if session in self._sessions or session in self._attached:
                _add(self._ended.setdefault(session.model_id, [0] * COUNTS), counts)
            self._sessions.discard(session)
            self._attached.discard(session)

    def counts(self) -> dict[tuple[str, str], list[float]]:
        """Per model (name, version), what a worker ran on a session's memory (ended
        sessions' and open ones'), for the metrics: as `ClientSession.counts`."""
        with self._lock:
            totals = {k: list(v) for k, v in self._ended.items()}
            sessions = list(self._sessions | self._attached)
        for session in sessions:
            _add(totals.setdefault(session.model_id, [0] * COUNTS), session.counts())
        return totals

    def sweep(self, idle_s: float) -> int:
        """End the sessions that ran no request for `idle_s` (`limits.idle_timeout_s`, the
        time after which gRPC closes a silent connection): each open session counts as one
        of its caller's connections, so sessions left open and idle would hold those limits
        against everyone. The client sees EOF on its next doorbell and opens a new session
        (the Python client does so by itself, about a millisecond). Returns how many ended."""
        now = time.monotonic()
        with self._lock:
            sessions = list(self._sessions | self._attached)
        ended = 0
        for session in sessions:
            try:
                activity = session.activity()
            except ValueError:  # its counts were unmapped: it ended meanwhile
                continue
            if activity != session.seen or session.busy:
                session.seen, session.last = activity, now
            elif now - session.last >= idle_s and not session.ended:
                log.info("fast path: closing a session of uid %d on %s, idle for %.0f s "
                         "(limits.idle_timeout_s)", session.uid, session.served.key,
                         now - session.last)
                try:
                    session.sock.shutdown(socket.SHUT_RDWR)
                    ended += 1
                except OSError:
                    pass
        return ended

    def close(self, timeout: float = 5.0) -> None:
        """End every session (a request running finishes first); wait for them a while."""
        with self._lock:
            self._closed = True
            sessions = list(self._sessions)
        for session in sessions:
            try:
                session.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        while self._sessions and time.monotonic() < deadline:
            time.sleep(0.01)


def _add(totals: list[float], counts: list[float]) -> None:
    for k, n in enumerate(counts):
        totals[k] += n
