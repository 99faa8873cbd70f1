"""What the fast-path tests share: eager's outputs, waiting for a condition, what a daemon
and its workers hold (session memory, connections, arena objects), and the wire spoken by
hand, as another language would."""

from __future__ import annotations

import json
import mmap
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from daemons import DaemonProcess, read_text, worker_processes
from oip_helpers import SHM_DIR

from protos import fastpath as wire


def eager(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    with torch.inference_mode():
        out = model(*inputs)
    return list(out) if isinstance(out, tuple) else [out]


def close_to(got: list[Any], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.as_tensor(g), e, rtol=1e-4, atol=1e-5)


def eventually(check: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def session_memory(daemon: DaemonProcess) -> int:
    """Session memfds mapped in the daemon and its workers (a memfd is never in /dev/shm:
    /proc/<pid>/maps is where it shows). A part's runtime may hold its last input, so the
    last session that ran a part may stay mapped until that part's next request."""
    pids = [daemon.proc.pid] + [int(p.name) for p in worker_processes(daemon.proc.pid)]
    return sum(read_text(Path(f"/proc/{pid}/maps")).count("memfd:cuvild-session")
               for pid in pids)


def server_ends(daemon: DaemonProcess) -> int:
    """Connections open on the daemon's side of its unix socket (the daemon's or a worker's
    descriptor: /proc/net/unix names the socket's path for each accepted one)."""
    path = str(daemon.socket_path)
    return sum(1 for line in read_text(Path("/proc/net/unix")).splitlines()
               if line.endswith(" " + path) and line.split()[5] == "03")  # SS_CONNECTED


def arena_objects(daemon: DaemonProcess) -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"cuvil-{daemon.proc.pid}-*")}


# -- the wire by hand ------------------------------------------------------------------------
def recv_exact(sock: socket.socket, n: int) -> bytes:
    return sock.recv(n, socket.MSG_WAITALL) if n else b""


def open_raw(path: str, body: bytes | dict[str, Any], version: int = wire.VERSION,
             pause: float = 0.0) -> tuple[socket.socket, dict[str, Any], Any]:
    """Open a session as another language would: (socket, reply, the memfd mapped or None);
    `pause` seconds between connect and the open request."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(15)
    sock.connect(path)
    time.sleep(pause)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    sock.sendall(wire.OPEN.pack(wire.MAGIC, version, len(data)) + data)
    head, fds, _, _ = socket.recv_fds(sock, wire.LENGTH.size, 1)
    (length,) = wire.LENGTH.unpack(head + recv_exact(sock, wire.LENGTH.size - len(head)))
    reply = json.loads(recv_exact(sock, length))
    mm = None
    if fds:
        mm = mmap.mmap(fds[0], reply["size"])
        for fd in fds:
            os.close(fd)
    return sock, reply, mm


def ring(sock: socket.socket, mm: Any, reply: dict[str, Any], seq: int, slot: int,
         state: int = wire.SUBMITTED, entry_seq: int | None = None) -> tuple[int, Any]:
    """Write ring entry seq % depth, ring for `seq`; (the entry's state, its error JSON)."""
    index = seq % reply["depth"]
    at = reply["ring"] + index * reply["entry_bytes"]
    wire.ENTRY.pack_into(mm, at, seq if entry_seq is None else entry_seq, slot, state, 0)
    sock.sendall(wire.DOORBELL.pack(seq))
    assert recv_exact(sock, wire.DOORBELL.size) == wire.DOORBELL.pack(seq)
    got, _, state, error_len = wire.ENTRY.unpack_from(mm, at)
    assert got == seq  # the daemon's answer names the request it was rung for
    if state != wire.FAILED:
        return state, None
    where = reply["errors"] + index * reply["error_bytes"]
    return state, json.loads(bytes(mm[where:where + error_len]))


def slot_tensor(mm: Any, base: int, spec: dict[str, Any]) -> np.ndarray:
    count = int(np.prod(spec["shape"]))
    return np.frombuffer(mm, spec["dtype"], count, base + spec["offset"]).reshape(spec["shape"])
