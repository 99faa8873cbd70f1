"""How a request fails in the engine. Each class has a `kind` the serving layer maps to a
status: "internal" (a part failed), "deadline" (the request's deadline passed), "unavailable"
(a worker died, was restarted, and the one retry failed too), "invalid" (the request named a
client region that no longer holds its bytes)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any


class InferError(RuntimeError):
    """A request failed; the message names the part, the device and the cause."""

    kind = "internal"


class RunTimeout(InferError):
    """The request's deadline passed: waiting for a place in flight, a worker's restart, a
    bucket's build or a part's reply (the message names the part, the device and the seconds
    waited). A worker that gave no reply for the engine's whole `run_timeout_s` was killed and
    is being restarted."""

    kind = "deadline"
    # Parts the request gave up on: until these complete they may still write its block.
    outstanding: Sequence[Future[Any]] = ()


class WorkerUnavailable(InferError):
    """A part's worker died during the request, was restarted, and running the request once
    more on it failed too."""

    kind = "unavailable"


class BadRegion(InferError):
    """A client's shared-memory region no longer holds the bytes the request names (its
    object was shrunk, replaced or removed since it was registered)."""

    kind = "invalid"


class WorkerLost(InferError):
    """Inside the engine: a part's worker died; `run` retries the request once, then raises
    WorkerUnavailable. `devices` are the dead workers' devices."""

    kind = "unavailable"

    def __init__(self, message: str, devices: set[str]) -> None:
        super().__init__(message)
        self.devices = devices


class ArenaFull(InferError):
    """No shared memory left for the request's block: /dev/shm (a tmpfs, 2 GiB in the KServe
    pod) cannot hold another arena segment. The request is refused; the daemon goes on."""

    kind = "exhausted"

