"""The daemon's end of one device worker: send an order, get its reply.

`call` sends an order and returns a Future that the handle's reader thread completes. `run`
sends a Run whose reply comes back on a second pipe that the calling thread reads itself,
which saves a thread wake-up per call (about 0.1 ms on the 2-core dev host) when its request
is alone in the engine; with a worker in a thread (`in_process=True`), `run` executes the part
in the calling thread. The worker's death is EOF on the pipes: pending calls fail with
WorkerDied and the engine revives it.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from cuvild.engine.orders import Envelope, Order, Reply, Run
from cuvild.engine.worker import Worker, answer, process_main, serve
from partitioner.profile import DeviceProfile


class WorkerDied(RuntimeError):
    pass


class WorkerHandle:
    def __init__(self, device: DeviceProfile, cache_dir: Path, in_process: bool = False) -> None:
        self.device = device
        self.cache_dir = str(cache_dir)
        self.in_process = in_process
        self._ids = itertools.count()
        self._pending: dict[int, Future[Reply]] = {}
        self._send_lock = threading.Lock()
        self._direct_lock = threading.Lock()
        self.process: Any = None
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        # The worker's end goes only into the process's arguments (dropped after start), so
        # the worker's death is EOF on ours.
        direct_ours, direct_theirs = ctx.Pipe(duplex=False)
        if self.in_process:
            self._inline = (Worker(self.device, self.cache_dir), threading.Lock())
            self.process = threading.Thread(target=serve, args=(
                theirs, direct_theirs, self.device, self.cache_dir, self._inline),
                name=f"worker-{self.device.id}", daemon=True)
        else:
            self.process = ctx.Process(target=process_main, name=f"cuvil-{self.device.id}",
                                       args=(theirs, direct_theirs, self.device.to_dict(),
                                             self.cache_dir), daemon=True)
        self.process.start()
        del theirs, direct_theirs
        self.conn, self.direct = ours, direct_ours
        self._reader = threading.Thread(target=self._read, args=(ours,),
                                        name=f"reply-{self.device.id}", daemon=True)
        self._reader.start()

    def _died(self, detail: str = "") -> WorkerDied:
        code = getattr(self.process, "exitcode", None)
        return WorkerDied(f"worker for {self.device.id} died"
                          + (f" (exit code {code})" if code is not None else "")
                          + (f": {detail}" if detail else ""))

    def _read(self, conn: Any) -> None:
        while True:
            try:
                reply: Reply = conn.recv()
            except (EOFError, OSError):
                break
            future = self._pending.pop(reply.id, None)
            if future is not None:
                future.set_result(reply)
        error = self._died()
        for rid in list(self._pending):
            future = self._pending.pop(rid, None)
            if future is not None and not future.done():
                future.set_exception(error)

    def call(self, order: Order) -> Future[Reply]:
        future: Future[Reply] = Future()
        with self._send_lock:
            rid = next(self._ids)
            self._pending[rid] = future
            try:
                self.conn.send(Envelope(rid, order))
            except (OSError, ValueError, BrokenPipeError) as e:
                self._pending.pop(rid, None)
                future.set_exception(WorkerDied(f"worker for {self.device.id} is gone: {e}"))
        return future

    def run(self, order: Run) -> Reply:
        """A Run whose reply this thread reads itself (one at a time per worker); a worker
        in a thread runs the part in this thread."""
        if self.in_process:
            worker, lock = self._inline
            with lock:
                return answer(worker, Envelope(-1, order))
        with self._direct_lock:
            try:
                with self._send_lock:
                    rid = next(self._ids)
                    self.conn.send(Envelope(rid, order, direct=True))
                while True:  # a reply left by a caller that failed mid-call is skipped
                    reply: Reply = self.direct.recv()
                    if reply.id == rid:
                        return reply
            except (EOFError, OSError, ValueError) as e:
                raise self._died(str(e)) from None

    def alive(self) -> bool:
        return self.process.is_alive()

    def restart(self) -> None:
        with self._direct_lock:  # no direct run reads a pipe while it is replaced
            self.stop()
            self.restarts += 1
            self._start()

    def stop(self, timeout: float = 10.0) -> None:
        try:
            with self._send_lock:
                self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(timeout)
        if not self.in_process and self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()
        self.direct.close()
