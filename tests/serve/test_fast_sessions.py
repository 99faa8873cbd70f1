"""A fast-path session gives its caller's connection slot back exactly once, however it
ends: the worker it was attached to may end it before the daemon's open finished (its
client closed it at once), two ends may race, and a hand-off may fail. A slot not given
back locks the caller's uid out once `limits.max_connections_per_uid` are held."""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cuvild.serve import fast
from cuvild.serve.fast import ClientSession, FastPath
from cuvild.serve.front import Front


class Worker:
    """A worker that takes the session's descriptors and, like a worker whose client
    closed at once, has already ended it when `attach` returns (or ends it later)."""

    def __init__(self, at_once: bool) -> None:
        self.at_once = at_once
        self.ended: Future[Any] = Future()

    def attach(self, order: Any, fds: list[int]) -> Future[Any]:
        assert len(fds) == 3
        if self.at_once:
            self.ended.set_result(None)
        return self.ended


def session(monkeypatch: pytest.MonkeyPatch, worker: Worker) -> tuple[ClientSession, list[int],
                                                                        socket.socket]:
    monkeypatch.setattr(fast, "layout", lambda served, model, depth: {"size": 4096})
    monkeypatch.setattr(fast, "one_part", lambda model: True)
    route = SimpleNamespace(device="cpu", id="p0")
    model = SimpleNamespace(key="m", routes=[route], batcher=None)
    served = SimpleNamespace(record=SimpleNamespace(name="m", version="1"))
    runner = SimpleNamespace(workers=SimpleNamespace(ready=lambda device: worker))
    path = FastPath(models=None, runner=runner)  # type: ignore[arg-type]
    ours, theirs = socket.socketpair()
    released: list[int] = []
    s = ClientSession(path, ours, os.getuid(), served, model, 1,  # type: ignore[arg-type]
                      lambda: released.append(1))
    return s, released, theirs


def test_a_session_its_worker_ended_before_the_open_finished_gives_its_slot_back(monkeypatch):
    s, released, theirs = session(monkeypatch, Worker(at_once=True))
    assert s.attached and s.ended and released == [1]
    assert s.sock.fileno() == -1 and theirs.recv(1 << 16, socket.MSG_DONTWAIT)  # the layout
    assert theirs.recv(1) == b""  # then EOF: ours is closed


def test_a_session_ends_once_whoever_ends_it(monkeypatch):
    worker = Worker(at_once=False)
    s, released, theirs = session(monkeypatch, worker)
    assert s.attached and not s.ended and released == []
    closers = [threading.Thread(target=s.close) for _ in range(4)]
    for t in closers:
        t.start()
    worker.ended.set_result(None)  # and the worker's end, all at once
    for t in closers:
        t.join(10)
    assert s.ended and released == [1]
    theirs.close()


def test_a_hand_off_that_fails_gives_the_slot_back(tmp_path: Path):
    """The front's `on_session` raising (no thread could start): the connection is closed
    and its uid's slot freed, so the uid's next connection is taken."""
    calls: list[socket.socket] = []

    def on_session(sock: socket.socket, uid: int, first: bytes, done: Any) -> None:
        calls.append(sock)
        if len(calls) == 1:
            raise RuntimeError("can't start new thread")
        sock.close()
        done()

    fr = Front(str(tmp_path / "public.sock"), max_per_uid=1, on_session=on_session)
    inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    inner.bind(fr.inner_path)
    inner.listen(8)
    fr.start()
    try:
        for _ in range(2):
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.settimeout(10)
            client.connect(fr.public_path)
            client.sendall(fast.wire.MAGIC)
            assert client.recv(1) == b""  # closed by the front, then by the session
            client.close()
        deadline = time.monotonic() + 10
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(calls) == 2 and fr.refused == 0
    finally:
        fr.close()
        inner.close()
