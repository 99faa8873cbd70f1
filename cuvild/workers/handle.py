"""The daemon's end of one device worker: send an order, get its reply.

`call` sends an order and returns a Future that the handle's reader thread completes. `run`
sends a Run whose reply comes back on a second pipe that the calling thread reads itself,
which saves a thread wake-up per call (about 0.1 ms on the 2-core dev host) when its request
is alone in the engine; with a worker in a thread (`in_process=True`), `run` executes the part
in the calling thread. The worker's death is EOF on the pipes: pending calls fail with
WorkerDied and the engine's Workers (workers.py) revive it.

Every wait has a deadline: `run` gives up at its own (ReplyTimeout, whose `late` future
completes when the reply comes after all, or the worker dies), and the engine waits on
`call`'s futures until its. `kill` ends a worker that stopped answering: a process is killed;
a thread cannot be, so it is abandoned (it answers nothing more; only the order it is stuck
in completes, when it returns) and `restart` starts a fresh one beside it. Each start is a
`generation`: a kill names the one it means, so a worker is killed once, never its successor.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import select
import socket
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from cuvild.intake import forks
from cuvild.workers.worker import Worker, answer, process_main, serve
from partitioner.profile import DeviceProfile
from protos.orders import Attach, Envelope, Order, Progress, Reply, Run


class WorkerDied(RuntimeError):
    pass


class ReplyTimeout(RuntimeError):
    """No reply by the deadline. Until `late` completes (None: nothing was sent), the order
    may still read and write its tensors."""

    def __init__(self, message: str, generation: int, late: Future[Reply] | None = None) -> None:
        super().__init__(message)
        self.generation, self.late = generation, late


class WorkerHandle:
    def __init__(self, device: DeviceProfile, cache_dir: Path, in_process: bool = False) -> None:
        self.device = device
        self.cache_dir = str(cache_dir)
        self.in_process = in_process
        self._ids = itertools.count()
        self._pending: dict[int, Future[Reply]] = {}
        self._told: dict[int, Any] = {}  # order id -> its progress callback
        self._send_lock = threading.Lock()
        self._direct_lock = threading.Lock()
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
        direct_ours, direct_theirs = ctx.Pipe(duplex=False)
        self.generation += 1
        self.broken = False
        self._pending = {}  # this generation's: a dead one's reader fails only its own
        if self.in_process:
            self.inline = (Worker(self.device, self.cache_dir, in_process=True),
                            threading.Lock())
            self.process = threading.Thread(target=serve, args=(
                theirs, direct_theirs, self.device, self.cache_dir, self.inline),
                name=f"worker-{self.device.id}", daemon=True)
        else:
            self.process = ctx.Process(target=process_main, name=f"cuvil-{self.device.id}",
                                       args=(theirs, direct_theirs, self.device.to_dict(),
                                             self.cache_dir), daemon=True)
        self.process.start()
        del theirs, direct_theirs
        self.conn, self.direct = ours, direct_ours
        # select.poll, not Connection.poll (a selector made per call: +0.1 ms a request)
        self._ready = select.poll()
        self._ready.register(direct_ours.fileno(), select.POLLIN)
        self._reader = threading.Thread(target=self._read,
                                        args=(ours, self._pending, self.generation),
                                        name=f"reply-{self.device.id}", daemon=True)
        self._reader.start()

    def _died(self, detail: str = "") -> WorkerDied:
        code = getattr(self.process, "exitcode", None)
        return WorkerDied(f"worker for {self.device.id} died"
                          + (f" (exit code {code})" if code is not None else "")
                          + (f": {detail}" if detail else ""))

    def _read(self, conn: Any, pending: dict[int, Future[Reply]], generation: int) -> None:
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
        error = self._died()
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
        """Send `order`; the future's `generation` is the worker's start it went to. `told`
        is called with each Progress the order sends before its reply (on the reader's
        thread)."""
        future: Future[Reply] = Future()
        with self._send_lock:
            rid = next(self._ids)
            future.generation = self.generation  # type: ignore[attr-defined]
            self._pending[rid] = future
            if told is not None:
                self._told[rid] = told
            try:
                self.conn.send(Envelope(rid, order))
            except (OSError, ValueError, BrokenPipeError) as e:
                self._broke(future.generation)  # type: ignore[attr-defined]
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
            future.generation = self.generation  # type: ignore[attr-defined]
            self._pending[rid] = future
            try:
                self.conn.send(Envelope(rid, order))
                with socket.fromfd(self.conn.fileno(), socket.AF_UNIX,
                                   socket.SOCK_STREAM) as pipe:
                    sendfds(pipe, fds)
            except (OSError, ValueError) as e:
                self._broke(future.generation)  # type: ignore[attr-defined]
                self._pending.pop(rid, None)
                future.set_exception(WorkerDied(f"worker for {self.device.id} is gone: {e}"))
        return future

    def run(self, order: Run, deadline: float) -> Reply:
        """A Run whose reply this thread reads itself (one at a time per worker), by the
        `deadline` (time.monotonic()); a worker in a thread runs the part in this thread
        (a part that hangs there holds this thread: only waiting for it has a deadline)."""
        if self.in_process:
            return self._run_inline(order, deadline)
        generation = self.generation
        if not self._direct_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise ReplyTimeout(f"the worker for {self.device.id} was busy with another "
                               "request's part", generation)
        handed_on = False
        try:
            direct, ready, generation = self.direct, self._ready, self.generation
            with self._send_lock:
                rid = next(self._ids)
                self.conn.send(Envelope(rid, order, direct=True))
            while True:  # a reply left by a caller that failed mid-call is skipped
                left = deadline - time.monotonic()
                if left <= 0 or not ready.poll(min(left * 1e3 + 1, 2**31 - 1)):
                    late: Future[Reply] = Future()
                    threading.Thread(target=self._drain, args=(direct, rid, late, generation),
                                     name=f"late-{self.device.id}", daemon=True).start()
                    handed_on = True  # the drain thread releases the direct lock
                    raise ReplyTimeout(f"the worker for {self.device.id} gave no reply",
                                       generation, late)
                reply: Reply = direct.recv()
                if reply.id == rid:
                    return reply
        except (EOFError, OSError, ValueError) as e:
            self._broke(generation)
            raise self._died(str(e)) from None
        finally:
            if not handed_on:
                self._direct_lock.release()

    def _drain(self, direct: Any, rid: int, late: Future[Reply], generation: int) -> None:
        """Wait for a timed-out run's reply, holding the direct pipe meanwhile."""
        try:
            while True:
                reply: Reply = direct.recv()
                if reply.id == rid:
                    late.set_result(reply)
                    return
        except (EOFError, OSError, ValueError) as e:
            self._broke(generation)
            late.set_exception(self._died(str(e)))
        finally:
            self._direct_lock.release()

    def _run_inline(self, order: Run, deadline: float) -> Reply:
        worker, lock = self.inline
        generation = self.generation
        while not lock.acquire(timeout=min(0.05, max(0.0, deadline - time.monotonic()))):
            if worker.abandoned:
                raise self._died("it stopped answering and was replaced")
            if time.monotonic() >= deadline:
                raise ReplyTimeout(f"the worker for {self.device.id} was busy with another "
                                   "part", generation)
        try:
            if not worker.begin(-1):
                raise self._died("it stopped answering and was replaced")
            try:
                return answer(worker, Envelope(-1, order))
            finally:
                worker.begin(None)
        finally:
            lock.release()

    def kill(self, generation: int) -> bool:
        """End start `generation` of the worker if it is still the current one and alive
        (it stopped answering); True if this call ended it. A process is killed (its pending
        calls fail when its pipes close); a thread is abandoned: its pending calls fail now,
        but for the one it is stuck in."""
        with self._kill_lock:
            if generation != self.generation or self.broken:
                return False
            self.broken = True
            if not self.in_process:
                self.process.kill()
                return True
            running = self.inline[0].abandon()
            error = self._died("it stopped answering and was replaced")
            for rid, future in list(self._pending.items()):
                if rid != running:
                    self._pending.pop(rid, None)
                    if not future.done():
                        future.set_exception(error)
            return True

    def alive(self) -> bool:
        return not self.broken and self.process.is_alive()

    def restart(self) -> None:
        with self._direct_lock:  # no direct run reads a pipe while it is replaced
            self._stop()
            self.restarts += 1
            self._start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._direct_lock.acquire(timeout=timeout):
            try:
                self._stop(timeout)
            finally:
                self._direct_lock.release()
        else:
            self._stop(timeout)

    def _stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to end and wait for it (an abandoned thread is not waited for:
        it ends when the part it is stuck in returns). Its reader closes the main pipe."""
        try:
            with self._send_lock:
                self.conn.send(None)
        except (OSError, ValueError):
            pass
        if not (self.in_process and self.broken):
            self.process.join(timeout)
            if not self.in_process and self.process.is_alive():
                self.process.kill()
                self.process.join()
        self.direct.close()


def stop_all(handles: Iterable[WorkerHandle]) -> None:
    """Stop the workers together: a process with torch loaded takes a second or two to
    exit, and one after another those add up (a daemon's stop, a test's teardown)."""
    stops = [threading.Thread(target=h.stop, name=f"stop {h.device.id}", daemon=True)
             for h in handles]
    for stop in stops:
        stop.start()
    for stop in stops:
        stop.join()
