"""The same-host fast path, the client's side: `FastSession` (the wire: protos/fastpath.py).

A session is opened once per model on the daemon's unix socket and maps the daemon's sealed
memfd: then each request copies its inputs into a slot, writes a ring entry and rings an
8-byte doorbell; the reply is the same 8 bytes back, the outputs are in the slot. No gRPC,
no protobuf. A dynamic-shape model's session is opened for the shapes of its first request
(or `shapes`), and one more for each new set of shapes; the last `keep` (4) stay open, so
a client that alternates a few batch sizes opens each once (each open session counts as
one of the caller's connections on the daemon). A session is for one thread at a time
(`Client(fast=True)` keeps one per thread and model). When the daemon restarts, or the model
is loaded again, the next request opens a new session and is sent again (inference is
idempotent), waiting up to `timeout` for the daemon and the model to be back; past that it
fails with FastPathError("UNAVAILABLE").
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cuvild.client.errors import CuvildError, convert_hint
from cuvild.core.spin import MOST_S, Spin
from protos import fastpath as wire

KEEP = 4  # a dynamic model's sessions kept open, one per set of shapes


# A fast-path request or session failed: the client's one error family, so
# FastPathError("NOT_FOUND", ...) is a NotFound, as the gRPC path raises it.
FastPathError = CuvildError


class _Gone(Exception):
    """The daemon closed the session (it stopped or restarted)."""


def _key(shapes: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(s) for s in shapes)


def _shut(sock: socket.socket | None, mm: mmap.mmap | None) -> None:
    if sock is not None:
        sock.close()
    if mm is not None:
        try:
            mm.close()
        except BufferError:  # a caller still holds a view of it: it goes with that
            pass


def _array(mm: mmap.mmap, at: int, dtype: str, shape: list[int]) -> Any:
    """A view of the session's memory: numpy where it has the dtype, else torch's."""
    count = int(np.prod(shape)) if shape else 1
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:  # bfloat16 and such
        import torch

        buf = memoryview(mm)[at:at + count * torch.empty((), dtype=getattr(
            torch, dtype)).element_size()]
        return torch.frombuffer(buf, dtype=getattr(torch, dtype)).view(shape)
    return np.frombuffer(mm, np_dtype, count, at).reshape(shape)


@dataclass
class _Open:
    """One open session: its connection, its memory, what the daemon said of it (`layout`),
    the views of its input and output slots, and the SO_RCVTIMEO set on its socket."""

    sock: socket.socket
    mm: mmap.mmap
    layout: dict[str, Any]
    ins: list[list[Any]] = field(default_factory=list)
    outs: list[list[Any]] = field(default_factory=list)
    wait: float = -1.0

    def close(self) -> None:
        sock, mm = self.sock, self.mm
        self.ins = self.outs = []  # its views of the memory go first
        _shut(sock, mm)


class FastSession:
    def __init__(self, socket_path: str, model: str, version: str = "", depth: int = 1,
                 timeout: float = 30.0, shapes: Sequence[Sequence[int]] | None = None,
                 keep: int = KEEP, spin_us: float = MOST_S * 1e6) -> None:
        """`shapes`: a dynamic-shape model's input shapes to open the session for (else those
        of its first request); `keep`: how many sets of shapes stay open (at least 1);
        `spin_us`: the longest this thread checks for an answer before it sleeps on the
        doorbell, learnt from the answers' times (cuvild/core/spin.py; 0: never)."""
        self.path, self.model, self.version = socket_path, model, version
        self.depth, self.timeout, self.keep = depth, timeout, max(1, keep)
        self._kept: dict[tuple[tuple[int, ...], ...], _Open] = {}  # by shapes, oldest
        # first: the open sessions of a dynamic model other than the current one
        self.shapes = [list(s) for s in shapes] if shapes is not None else None
        self.now: _Open | None = None  # the current session
        self.layout: dict[str, Any] = {}  # the current session's (its inputs, before one)
        self.dynamic = False  # the model's shapes are dynamic: a session has the request's
        self._seq = 0
        self.opened = 0  # sessions opened: 1, then one more per re-open
        self._spin = Spin(spin_us / 1e6)
        self._open(time.monotonic() + timeout)

    @property
    def inputs(self) -> list[dict[str, Any]]:
        return self.layout["inputs"]

    @property
    def outputs(self) -> list[dict[str, Any]]:
        return self.layout["outputs"]

    # -- the session ---------------------------------------------------------------------
    def _open(self, deadline: float) -> None:
        """Open a session, waiting for the daemon (restarting) and the model (loading)."""
        while True:
            try:
                return self._open_once()
            except FastPathError as e:
                if e.code != "UNAVAILABLE" or time.monotonic() >= deadline:
                    raise
            except (FileNotFoundError, ConnectionError, TimeoutError, _Gone) as e:  # (reset:
                # the front refused it, over a connection limit)
                if time.monotonic() >= deadline:
                    raise FastPathError("UNAVAILABLE", f"cannot open a session on "
                                        f"{self.path}: {e}") from None
            time.sleep(0.05)

    def _open_once(self) -> None:  # noqa: C901 - the open handshake's steps and failures in order
        self._close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.path)
            body = json.dumps({"model": self.model, "version": self.version,
                               "depth": self.depth, **({"shapes": self.shapes}
                                                       if self.shapes is not None else {})
                               }).encode()
            sock.sendall(wire.OPEN.pack(wire.MAGIC, wire.VERSION, len(body)) + body)
            data, fds, _, _ = socket.recv_fds(sock, wire.MAX_OPEN_BYTES, 1)
            if not data:
                raise _Gone("the daemon closed the connection")
            (length,) = wire.LENGTH.unpack(data[:wire.LENGTH.size].ljust(wire.LENGTH.size,
                                                                         b"\0"))
            if length > wire.MAX_OPEN_BYTES:
                raise FastPathError("UNIMPLEMENTED", f"{self.path} does not serve the fast "
                                    "path (shm.fast_path: false, or an older cuvild)")
            data = bytearray(data)
            while len(data) < wire.LENGTH.size + length:
                chunk = sock.recv(wire.LENGTH.size + length - len(data))
                if not chunk:
                    raise _Gone("the daemon closed the connection while opening")
                data += chunk
            try:
                reply = json.loads(bytes(data[wire.LENGTH.size:]))
            except ValueError:
                raise FastPathError("UNIMPLEMENTED", f"{self.path} does not serve the fast "
                                    "path (shm.fast_path: false, or an older cuvild)") from None
            if not reply.get("ok") and reply.get("dynamic") and self.shapes is None:
                self.dynamic, self.layout = True, {"inputs": reply["inputs"]}
                sock.close()  # opened for the first request's shapes
                return
            if not reply.get("ok"):
                raise FastPathError(reply.get("code", "UNKNOWN"), reply.get("error", ""))
            if len(fds) != 1:
                raise FastPathError("INTERNAL", "the session's memory did not arrive")
            mm = mmap.mmap(fds[0], reply["size"])
        except BaseException:
            sock.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        sock.settimeout(None)
        self.layout = reply
        self.dynamic = bool(reply.get("dynamic"))
        self.opened += 1
        self.now = _Open(sock, mm, reply, [
            [_array(mm, base + t["offset"], t["dtype"], t["shape"]) for t in reply["inputs"]]
            for base in reply["slots"]], [
            [_array(mm, base + t["offset"], t["dtype"], t["shape"]) for t in reply["outputs"]]
            for base in reply["slots"]])

    def _close(self) -> None:
        now, self.now = self.now, None
        if now is not None:
            now.close()

    def close(self) -> None:
        self._close()
        self._forget_kept()

    def _switch(self, shapes: list[list[int]]) -> None:
        """Make the session for `shapes` the current one: a kept one, or none (the request
        opens it). The current one is kept, the oldest closed past `keep`."""
        if self.now is not None and self.shapes is not None:
            self._kept[_key(self.shapes)] = self.now
            self.now = None
        self.shapes = shapes
        kept = self._kept.pop(_key(shapes), None)
        if kept is not None:
            self.now, self.layout = kept, kept.layout
        while len(self._kept) >= self.keep:  # with the current one, `keep` are open
            self._kept.pop(next(iter(self._kept))).close()

    def _forget_kept(self) -> None:
        """Close the kept sessions (the daemon restarted or the model was loaded again: they
        are as stale as the current one, or the session is closed)."""
        while self._kept:
            self._kept.popitem()[1].close()

    def __enter__(self) -> FastSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests --------------------------------------------------------------------------
    def ordered(self, inputs: Any) -> list[Any]:
        """Inputs as the model takes them: a tensor, a sequence in order, or a dict by name."""
        names = [t["name"] for t in self.inputs]
        if isinstance(inputs, Mapping):
            missing = [n for n in names if n not in inputs]
            unknown = sorted(set(inputs) - set(names))
            if missing or unknown:
                raise FastPathError("INVALID_ARGUMENT", f"model {self.model} takes inputs "
                                    f"{names}; " + (f"unknown {unknown} " if unknown else "")
                                    + (f"missing {missing}" if missing else ""))
            return [inputs[n] for n in names]
        if not isinstance(inputs, Sequence) or hasattr(inputs, "shape"):
            inputs = [inputs]
        if len(inputs) != len(names):
            raise FastPathError("INVALID_ARGUMENT", f"model {self.model} takes "
                                f"{len(names)} inputs {names}, got {len(inputs)}")
        return list(inputs)

    def run(self, inputs: Any, timeout: float | None = None) -> list[Any]:
        """One request; returns the outputs in the model's order, as fresh numpy arrays
        (torch tensors for dtypes numpy lacks)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        values = self.ordered(inputs)
        if self.dynamic:  # a session per set of shapes
            shapes = [list(getattr(v, "shape", np.shape(v))) for v in values]
            if shapes != self.shapes:
                self._switch(shapes)
        for attempt in (1, 2):
            if self.now is None:
                self._open(deadline)
            try:
                return self._request(values, deadline)
            except _Gone:
                if attempt == 2:
                    raise FastPathError("UNAVAILABLE", "the daemon closed the session twice "
                                        "during one request") from None
            except FastPathError as e:
                if e.code != wire.RELOADED or attempt == 2:
                    raise
            self._close()  # a re-open: the daemon restarted, or the model was loaded again
            self._forget_kept()
        raise AssertionError("unreachable")

    def _request(self, values: list[Any], deadline: float) -> list[Any]:
        now = self.now
        assert now is not None
        self._seq += 1
        seq, slot = self._seq, 0
        index = seq % now.layout["depth"]
        for spec, place, value in zip(self.inputs, now.ins[slot], values, strict=True):
            self._put(spec, place, value)
        at = now.layout["ring"] + index * now.layout["entry_bytes"]
        wire.ENTRY.pack_into(now.mm, at, seq, slot, wire.SUBMITTED, 0)
        return self._ring(now, seq, slot, at, index, deadline)

    def _ring(self, now: _Open, seq: int, slot: int, at: int, index: int,  # noqa: C901 - one ring round trip: write, bell, wait, read, in order
              deadline: float) -> list[Any]:
        """Send the doorbell for ring entry `index` (seq) of session `now`; read the answer."""
        bell = wire.DOORBELL.pack(seq)
        # The wait's limit is the kernel's (SO_RCVTIMEO, set when it changes): a blocking
        # socket reads the answer in one system call, where a Python timeout polls first.
        wait = max(0.001, round(deadline - time.monotonic(), 2))
        try:
            if wait != now.wait:
                now.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack(
                    "ll", int(wait), int(wait % 1 * 1e6)))
                now.wait = wait
            now.sock.sendall(bell)
            mm = now.mm  # (answered: the entry's state is no longer SUBMITTED)
            spun = self._spin.check(lambda: wire.ENTRY.unpack_from(mm, at)[2] != wire.SUBMITTED)
            answer = now.sock.recv(wire.DOORBELL.size, socket.MSG_WAITALL)
            if not spun:
                self._spin.slept()
        except (BlockingIOError, TimeoutError):
            answer = b""
            timed_out = True
        except OSError as e:
            raise _Gone(str(e)) from None
        else:
            timed_out = False
        if timed_out or 0 < len(answer) < wire.DOORBELL.size:
            self._close()  # a late answer would be taken for the next request's
            raise FastPathError("DEADLINE_EXCEEDED", f"model {self.model}: no answer in "
                                "time")
        if not answer:
            raise _Gone("the daemon closed the session")
        got, _, state, error_len = wire.ENTRY.unpack_from(now.mm, at)
        if answer != bell or got != seq:
            self._close()
            raise FastPathError("INTERNAL", f"the answer was for request "
                                f"{wire.DOORBELL.unpack(answer)[0]}, not {seq}")
        if state == wire.DONE:
            return [np.array(out) if isinstance(out, np.ndarray) else out.clone()
                    for out in now.outs[slot]]
        where = now.layout["errors"] + index * now.layout["error_bytes"]
        try:
            error = json.loads(bytes(now.mm[where:where + error_len]))
        except ValueError:
            error = {"code": "INTERNAL", "error": f"request {seq} failed (state {state})"}
        raise FastPathError(error.get("code", "UNKNOWN"), error.get("error", ""))

    def _put(self, spec: dict[str, Any], place: Any, value: Any) -> None:
        if hasattr(value, "detach"):  # a torch tensor
            value = value.detach().cpu()
            if isinstance(place, np.ndarray):
                value = value.numpy()
        else:
            value = np.asarray(value)
        dtype = str(getattr(value, "dtype", "")).removeprefix("torch.")
        if list(value.shape) != spec["shape"] or dtype != spec["dtype"]:
            fix = f"; {convert_hint(spec['dtype'])}" if dtype != spec["dtype"] else ""
            raise FastPathError("INVALID_ARGUMENT", f"input {spec['name']!r}: {dtype}"
                                f"{list(value.shape)}, model {self.model} takes "
                                f"{spec['dtype']}{spec['shape']}{fix}")
        if isinstance(place, np.ndarray):
            np.copyto(place, value)
        else:
            place.copy_(value)
