"""The daemon's end of one device worker: send an order, get its reply.

`call` sends an order and returns a Future that the handle's reader thread completes;
`attach` hands the worker a session or a bell (its socket and memory follow the order on the
pipe), whose future completes when it ends. Parts run only when rung that way
(cuvild/run/bells.py). The worker's death is EOF on the pipe: pending calls fail with
WorkerDied and Workers (workers.py) revive it.

One verb set, two kinds, chosen once for the daemon (`engine.workers`, `KINDS`): a
`ProcessWorker` runs in a process of its own; a `ThreadWorker` in a thread of the daemon.
`kill` ends a worker that stopped answering: a process is killed; a thread cannot be, so it
is abandoned (its sessions and pending calls fail now; it ends once the part it is stuck in
returns) and `restart` starts a fresh one beside it. Each start is a `generation`: a kill
names the one it means, so a worker is killed once, never its successor.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import socket
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from cuvild.intake import forks
from cuvild.workers.worker import Worker, process_main, serve
from partitioner.profile import DeviceProfile
from protos.orders import Attach, Envelope, Order, Progress, Reply
from runtimes import crashes

log = logging.getLogger(__name__)
ENDED_S = 5.0  # how long a reader waits for a worker whose pipe closed to have ended


class WorkerDied(RuntimeError):
    """A worker start ended under a call; `compiles`: the compiles it died in
    ("<part key>-<runtime>", runtimes/crashes.py), where a crash signal killed it."""

    def __init__(self, text: str, compiles: list[str] | None = None) -> None:
        super().__init__(text)
        self.compiles = compiles or []


class WorkerHandle:
    """The daemon's end of a worker, whatever runs it (ProcessWorker, ThreadWorker)."""

    threaded = False  # a thread of the daemon (its memory, its faults)

    def __init__(self, device: DeviceProfile, cache_dir: Path) -> None:
        self.device = device
        self.cache_dir = str(cache_dir)
        self._ids = itertools.count()
        self._pending: dict[int, Future[Reply]] = {}
        self._told: dict[int, Any] = {}  # order id -> its progress callback
        self._send_lock = threading.Lock()
        self._kill_lock = threading.Lock()
        self.process: Any = None
        self.restarts = 0
        self.generation = 0
        self.broken = False  # its pipes saw EOF, or it was killed
        self._start()

    def _start(self) -> None:
        # Forked from the daemon's forkserver once it runs (torch imported there once: a cold
        # worker starts ~1.7 s of CPU sooner); spawned before that (a restored model's worker
        # serves its records with no torch: cuvild/intake/forks.py).
        ctx = forks.context() if forks.running() else mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        # The worker's end goes only into the process's arguments (dropped after start), so
        # the worker's death is EOF on ours.
        self.generation += 1
        self.broken = False
        self._pending = {}  # this generation's: a dead one's reader fails only its own
        self.process = self._launch(ctx, theirs)
        self.process.start()
        del theirs
        self.conn = ours
        self._reader = threading.Thread(target=self._read,
                                        args=(ours, self._pending, self.generation,
                                              self.process),
                                        name=f"reply-{self.device.id}", daemon=True)
        self._reader.start()

    def _launch(self, ctx: Any, theirs: Any) -> Any:
        """What runs the worker (a Process or a Thread, not started), on pipe end `theirs`."""
        raise NotImplementedError

    def _end(self) -> None:
        """End a start that stopped answering (`kill`, under its lock)."""
        raise NotImplementedError

    def _join(self, timeout: float) -> None:
        """Wait for a stopped start to end."""
        self.process.join(timeout)

    def _died(self, detail: str = "", process: Any = None) -> WorkerDied:
        """The error of a start that died; with its `process`, how it ended (and the compile
        that killed it, remembered: runtimes/crashes.py)."""
        code = self._ended(process) if process is not None else None
        how = crashes.describe(code)
        named = crashes.confirm(Path(self.cache_dir), process.pid, code) if how else []
        text = f"worker for {self.device.id} died" + (f" ({how})" if how else "")
        if named:
            text += (f" building with {', '.join(n.partition('-')[2] for n in named)}"
                     " (not tried on that part here again)")
        if code:
            log.error("%s", text)
        return WorkerDied(text + (f": {detail}" if detail else ""), named)

    def _ended(self, process: Any) -> int | None:
        """The exit code of a start whose pipe closed (None: a thread's, or not known)."""
        return None

    def _read(self, conn: Any, pending: dict[int, Future[Reply]], generation: int,
              process: Any) -> None:
        while True:
            try:
                reply: Reply = conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(reply.result, Progress):  # a Build's news; its reply comes later
                told = self._told.get(reply.id)
                if told is not None:
                    told(reply.result.text)
                continue
            self._told.pop(reply.id, None)
            future = pending.pop(reply.id, None)
            if future is not None and not future.done():
                future.set_result(reply)
        self._broke(generation)
        error = self._died(process=process)
        for rid in list(pending):
            future = pending.pop(rid, None)
            if future is not None and not future.done():
                future.set_exception(error)
        conn.close()

    def _broke(self, generation: int) -> None:
        """Start `generation` is dead (its pipes closed): it is not `alive` any more."""
        if generation == self.generation:
            self.broken = True

    def call(self, order: Order, told: Any = None) -> Future[Reply]:
        """Send `order` to the worker's current start. `told` is called with each Progress
        the order sends before its reply (on the reader's thread)."""
        future: Future[Reply] = Future()
        with self._send_lock:
            rid = next(self._ids)
            generation = self.generation
            self._pending[rid] = future
            if told is not None:
                self._told[rid] = told
            try:
                self.conn.send(Envelope(rid, order))
            except (OSError, ValueError, BrokenPipeError) as e:
                self._broke(generation)
                self._pending.pop(rid, None)
                future.set_exception(WorkerDied(f"worker for {self.device.id} is gone: {e}"))
        return future

    def attach(self, order: Attach, fds: list[int]) -> Future[Reply]:
        """Send a fast-path session to the worker process (cuvild/workers/sessions.py): the
        order, then the client's socket and the session's memfd (SCM_RIGHTS) right behind
        it on the pipe. The future completes when the session ends (or the worker dies)."""
        from multiprocessing.reduction import sendfds

        future: Future[Reply] = Future()
        with self._send_lock:
            rid = next(self._ids)
            generation = self.generation
            self._pending[rid] = future
            try:
                self.conn.send(Envelope(rid, order))
                with socket.fromfd(self.conn.fileno(), socket.AF_UNIX,
                                   socket.SOCK_STREAM) as pipe:
                    sendfds(pipe, fds)
            except (OSError, ValueError) as e:
                self._broke(generation)
                self._pending.pop(rid, None)
                future.set_exception(WorkerDied(f"worker for {self.device.id} is gone: {e}"))
        return future

    def kill(self, generation: int) -> bool:
        """End start `generation` of the worker if it is still the current one and alive
        (it stopped answering); True if this call ended it."""
        with self._kill_lock:
            if generation != self.generation or self.broken:
                return False
            self.broken = True
            self._end()
            return True

    def alive(self) -> bool:
        return not self.broken and self.process.is_alive()

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self._start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to end and wait for it (an abandoned thread is not waited for:
        it ends when the part it is stuck in returns). Its reader closes the main pipe."""
        try:
            with self._send_lock:
                self.conn.send(None)
        except (OSError, ValueError):
            pass
        self._join(timeout)


class ProcessWorker(WorkerHandle):
    """A worker in a process of its own: forked from the daemon's forkserver once it runs,
    else spawned; killed when it stops answering (its pending calls fail when its pipes
    close)."""

    def _launch(self, ctx: Any, theirs: Any) -> Any:
        return ctx.Process(target=process_main, name=f"cuvil-{self.device.id}",
                           args=(theirs, self.device.to_dict(), self.cache_dir), daemon=True)

    def _end(self) -> None:
        self.process.kill()

    def _ended(self, process: Any) -> int | None:
        process.join(ENDED_S)  # (its pipe closed as it ended: reaped at once)
        return process.exitcode

    def _join(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class ThreadWorker(WorkerHandle):
    """A worker in a thread of the daemon (`engine.workers: thread`): `worker` is its
    Worker; abandoned when it stops answering (its pending calls, and its sessions' and
    bells' Attaches, fail now), and not waited for at stop once abandoned."""

    threaded = True

    def _launch(self, ctx: Any, theirs: Any) -> Any:
        self.worker = Worker(self.device, self.cache_dir, threaded=True)
        return threading.Thread(target=serve, args=(theirs, self.device, self.cache_dir,
                                                    self.worker),
                                name=f"worker-{self.device.id}", daemon=True)

    def _end(self) -> None:
        self.worker.abandoned = True
        error = self._died("it stopped answering and was replaced")
        for rid, future in list(self._pending.items()):
            self._pending.pop(rid, None)
            if not future.done():
                future.set_exception(error)

    def _join(self, timeout: float) -> None:
        if not self.broken:
            self.process.join(timeout)


KINDS: dict[str, type[WorkerHandle]] = {"process": ProcessWorker, "thread": ThreadWorker}


def stop_all(handles: Iterable[WorkerHandle]) -> None:
    """Stop the workers together: a process with torch loaded takes a second or two to
    exit, and one after another those add up (a daemon's stop, a test's teardown)."""
    stops = [threading.Thread(target=h.stop, name=f"stop {h.device.id}", daemon=True)
             for h in handles]
    for stop in stops:
        stop.start()
    for stop in stops:
        stop.join()
