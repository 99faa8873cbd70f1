"""The engine's device workers: one per device, started on first use, supervised.

`Workers` owns their start, the hang rule and revival; the engine keeps what a worker serves.
A request that finds a worker dead (or one that gave no reply for a patient request's whole
deadline, `hung`) hands it to `revive_later`: the device is marked not usable at once (so a
retry waits for it, `wait_usable`), and a thread restarts the worker and calls `restore`
(handed in by the engine: it puts the device's parts back from the compile cache), then marks
it usable again. One device's restart never waits for another's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cuvild.workers.handle import KINDS, WorkerHandle, stop_all
from partitioner.profile import DeviceProfile
from protos.orders import LogLevel

log = logging.getLogger(__name__)


class Workers:
    def __init__(self, devices: dict[str, DeviceProfile], cache_dir: Path, kind: str,
                 run_timeout_s: float, restore: Callable[[str, WorkerHandle], None]) -> None:
        """`kind`: "process" or "thread" (handle.KINDS), for every worker of the daemon;
        `restore(device, worker)`: put the device's parts back in its restarted worker."""
        self.devices = devices
        self.cache_dir = cache_dir
        self.kind = KINDS[kind]
        self.threaded = self.kind.threaded  # (each a thread of the daemon)
        self.run_timeout_s = run_timeout_s
        self.restore = restore
        self._handles: dict[str, WorkerHandle] = {}
        # the log level a config reload set (None: the daemon's at start, which a worker
        # reads from its environment); told to every worker started or revived after it
        self.log_level: str | None = None
        self._usable: dict[str, threading.Event] = {}  # cleared while a worker is revived
        self._revive_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()  # making a worker (control path only)

    def of(self, device: str) -> WorkerHandle:
        """The device's worker, started if it has none."""
        worker = self._handles.get(device)
        if worker is None:
            with self._lock:
                worker = self._handles.get(device)
                if worker is None:
                    self._usable[device] = threading.Event()
                    self._usable[device].set()
                    self._revive_locks[device] = threading.Lock()
                    worker = self._handles[device] = self.kind(self.devices[device],
                                                               self.cache_dir)
                    self._tell_level(worker)
        return worker

    def ready(self, device: str) -> WorkerHandle | None:
        """The device's worker if it is alive and not being revived: a request may ring it."""
        worker = self._handles.get(device)
        if worker is None or not worker.alive() or not self._usable[device].is_set():
            return None
        return worker

    def wait_usable(self, device: str, timeout: float) -> bool:
        """Wait up to `timeout` s for the device's worker to be back if it is being revived."""
        return self._usable[device].wait(max(0.0, timeout))

    def __getitem__(self, device: str) -> WorkerHandle:
        return self._handles[device]

    def __contains__(self, device: str) -> bool:
        return device in self._handles

    def items(self) -> list[tuple[str, WorkerHandle]]:
        return list(self._handles.items())

    def values(self) -> list[WorkerHandle]:
        return list(self._handles.values())

    def hung(self, device: str, generation: int) -> bool:
        """Kill start `generation` of a worker that gave no reply for a request's whole
        deadline, and restart it; True if this call killed it."""
        if not self._handles[device].kill(generation):
            return False
        log.error("worker for %s gave no reply for %.1f s; restarting it", device,
                  self.run_timeout_s)
        self.revive_later(device)
        return True

    def revive_later(self, device: str) -> None:
        self._usable[device].clear()  # before the thread starts: a retry waits for it
        threading.Thread(target=self._revive, args=(device,), name=f"revive-{device}",
                         daemon=True).start()

    def _revive(self, device: str) -> None:
        """Restart a dead worker and have its parts put back (`restore`)."""
        with self._revive_locks[device]:
            try:
                worker = self._handles[device]
                if worker.alive():
                    return
                log.error("worker for %s died; restarting it", device)
                t0 = time.perf_counter()
                worker.restart()
                self._tell_level(worker)
                self.restore(device, worker)
                log.info("worker for %s back in %.2f s", device, time.perf_counter() - t0)
            except Exception:
                log.exception("restarting the worker for %s failed", device)
            finally:
                self._usable[device].set()

    def set_log_level(self, level: str) -> None:
        """Every worker's log level from now on (a config reload's `log_level`)."""
        self.log_level = level
        for worker in self.values():
            self._tell_level(worker)

    def _tell_level(self, worker: WorkerHandle) -> None:
        if self.log_level is not None and worker.alive():
            worker.call(LogLevel(self.log_level))  # (its reply is not waited for)

    def close(self) -> None:
        stop_all(list(self._handles.values()))
        self._handles.clear()
