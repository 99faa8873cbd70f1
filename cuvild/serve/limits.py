"""What one caller may hold of the daemon: handler threads, uploads, log lines, descriptors.

Each bound exists because a local user held the daemon without it (the hardening issue):
- `Gate`: calls that may wait (inference, uploads, model loads, profiling, replans) take a
  slot; a listener's last RESERVED handler threads stay for health and status, so ServerLive
  answers while every other thread waits on a model. Past the slots a call is answered
  RESOURCE_EXHAUSTED at once instead of queueing behind them.
- `Uploads`: one count of LoadModel streams for the daemon (every listener), each cancelled
  when it sends nothing for `idle_s` or runs past `max_s` (the registry removes its part file).
- `QuietLog`: gRPC logs every undecodable request with a traceback; anyone who can connect
  could fill the journal. At most a few lines a minute get through, and the count of the rest.
- `raise_nofile`: the soft descriptor limit up to the hard one (systemd: LimitNOFILE).
"""

from __future__ import annotations

import contextlib
import logging
import resource
import threading
import time
from collections.abc import Iterator

import grpc

log = logging.getLogger(__name__)
RESERVED = 4  # handler threads per listener that long calls never take


class Gate:
    def __init__(self, threads: int) -> None:
        self.slots = max(1, threads - RESERVED)
        self._free = threading.BoundedSemaphore(self.slots)

    @contextlib.contextmanager
    def enter(self, context: grpc.ServicerContext) -> Iterator[None]:
        _take(self._free, context, f"{self.slots} calls are in progress on this listener "
                                   "(limits.rpc_threads less the ones kept for health); retry "
                                   "shortly")
        try:
            yield
        finally:
            self._free.release()


def _take(slots: threading.BoundedSemaphore, context: grpc.ServicerContext, full: str) -> None:
    """A slot, or the call ends at once with RESOURCE_EXHAUSTED saying `full`."""
    if not slots.acquire(blocking=False):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, full)


class _Stream:
    def __init__(self, context: grpc.ServicerContext) -> None:
        self.context = context
        self.started = self.active = time.monotonic()
        self.received = False  # the client sent its last message: the daemon is working
        self.why: str | None = None  # set when the watchdog cancelled it


class Uploads:
    def __init__(self, slots: int, idle_s: float, max_s: float) -> None:
        self.slots, self.idle_s, self.max_s = slots, idle_s, max_s
        self._free = threading.BoundedSemaphore(slots)
        self._streams: set[_Stream] = set()
        self._lock = threading.Lock()
        self._watchdog: threading.Thread | None = None

    @contextlib.contextmanager
    def slot(self, context: grpc.ServicerContext) -> Iterator[_Stream]:
        _take(self._free, context, f"{self.slots} uploads already in progress "
                                   "(limits.max_concurrent_uploads); retry later")
        stream = _Stream(context)
        with self._lock:
            self._streams.add(stream)
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="uploads",
                                                  daemon=True)
                self._watchdog.start()
        try:
            yield stream
        finally:
            with self._lock:
                self._streams.discard(stream)
            self._free.release()

    def _watch(self) -> None:
        """Watch the uploads in progress; gone once there are none (the next one starts it
        again): the daemon keeps no thread that wakes for nothing."""
        while True:
            time.sleep(min(1.0, self.idle_s / 4))
            now = time.monotonic()
            with self._lock:
                if not self._streams:
                    self._watchdog = None
                    return
                streams = list(self._streams)
            for s in streams:
                if s.why is not None:
                    continue
                if not s.received and now - s.active > self.idle_s:
                    s.why = f"sent nothing for {self.idle_s:.0f} s (limits.upload_idle_s)"
                elif now - s.started > self.max_s:
                    s.why = f"still going after {self.max_s:.0f} s (limits.upload_max_s)"
                else:
                    continue
                log.warning("cancelling an upload: it %s", s.why)
                s.context.cancel()


class QuietLog(logging.Filter):
    """Let `per_minute` records through each minute, without tracebacks after the first."""

    def __init__(self, per_minute: int = 5) -> None:
        super().__init__()
        self.per_minute = per_minute
        self._window = 0.0
        self._passed = self._dropped = 0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._window >= 60:
                if self._dropped:
                    record.msg = f"{record.msg} ({self._dropped} similar lines suppressed)"
                self._window, self._passed, self._dropped = now, 0, 0
            if self._passed >= self.per_minute:
                self._dropped += 1
                return False
            self._passed += 1
            if self._passed > 1:
                record.exc_info, record.exc_text = None, None
            return True


def quiet_grpc_logs() -> None:
    for name in ("grpc._common", "grpc._server"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietLog) for f in logger.filters):
            logger.addFilter(QuietLog())


def raise_nofile() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard limit; returns (soft, hard) in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, e)
    return soft, hard
