"""The same-host fast path (protos/fastpath.py, cuvild/serve/fast.py, cuvild/client/fast.py):
the outputs torch eager gives, through Client(fast=True) and FastSession, on process and on
thread workers; many sessions at once; clients that die mid-request; a daemon that restarts
and a model loaded again under an open session; and the wire spoken by hand, where a bad ring
entry or open request is refused and the session or daemon goes on. Two daemons for the
module (process workers; thread workers with small connection limits); the restart,
`fast_path: false` and idle-session tests start their own."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from daemons import ROOT, DaemonProcess, daemon_config
from fast_helpers import (
    arena_objects,
    close_to,
    eager,
    eventually,
    open_raw,
    recv_exact,
    ring,
    server_ends,
    session_memory,
    slot_tensor,
)
from oip_helpers import SHM_DIR, Pair

import cuvild
from cuvild.client import Client, samples
from cuvild.client.fast import FastPathError, FastSession
from protos import fastpath as wire
from runtimes.cache import KEY_ENV

pytestmark = pytest.mark.daemon
# Builds try one runtime (the fast path does not care which one runs a part); every daemon
# of the module is on the session's compile cache and key, so a model built once (the MLP of
# seed 0 the `procs` daemon loads) is restored from its load record, not compiled again.
RUNTIMES = {"cpu": ["openvino"]}
PER_UID = 4  # the thread daemon's limits.max_connections_per_uid
IDLE_S = 3  # and its limits.idle_timeout_s (gRPC connections and fast-path sessions alike)
TWO_CORES = len(os.sched_getaffinity(0)) >= 2  # the emulated NPU has a core of its own
# Where a session is served: a one-part model's worker process, a one-part model's worker
# thread in the daemon, or the daemon's session thread through the engine (two parts).
PATHS = [("procs", "mlp"), ("threads", "mlp"), ("procs", "split")]
NEEDS_TWO_CORES = "the two-part model needs two cores (the emulated NPU has one of its own)"


def on_path(request: pytest.FixtureRequest, which: str, name: str) -> Served:
    if name == "split" and not TWO_CORES:
        pytest.skip(NEEDS_TWO_CORES)
    return request.getfixturevalue(which)


class Split(torch.nn.Module):
    """Two parts in two worker processes: the body on the emulated NPU, the head on the CPU
    (the session's request crosses both, not just the one worker of a single-part model)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = cuvild.partition(device="npu")(torch.nn.Linear(16, 32))
        self.head = cuvild.partition(device="cpu")(
            torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(32, 8)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@dataclass
class Served:
    daemon: DaemonProcess
    models: dict[str, tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]

    @property
    def path(self) -> str:
        return str(self.daemon.socket_path)


def start(workdir: Path, state_root: Path, sock_dir: Path, cache: Path,
          **extra: Any) -> DaemonProcess:
    """A started daemon with its own registry, seeded with the session's device profiles, on
    the session's compile cache and its signing key (as make_daemon's: tests/conftest.py)."""
    engine = {"runtimes": RUNTIMES, **extra.pop("engine", {})}
    config = daemon_config(workdir, workdir / "state", sock_dir, cache_dir=str(cache),
                           engine=engine, **extra)
    daemon = DaemonProcess(workdir, config, profiles=state_root)
    daemon.env[KEY_ENV] = str(state_root / "cache.key")
    return daemon.start()


def load(daemon: DaemonProcess, models: dict[str, Any]) -> None:
    with Client(daemon.target) as client:
        for name, (model, inputs) in models.items():
            result = client.load(name, model, inputs)
            assert result["state"] == "ready", daemon.log()[-3000:]


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory, state_root: Path, sock_dir: Path,
          shared_cache: Path) -> Iterator[Served]:
    """Process workers (the default): a one-part MLP, a wider one, a two-input model and
    (with two cores) a two-part model."""
    daemon = start(tmp_path_factory.mktemp("fast"), state_root, sock_dir, shared_cache)
    torch.manual_seed(0)
    models = {"mlp": (samples.MLP(width=16, depth=1).eval(), (torch.randn(2, 16),)),
              "wide": (samples.MLP(width=64, depth=2).eval(), (torch.randn(4, 64),)),
              "pair": (Pair().eval(), (torch.randn(2, 8), torch.randn(2, 4)))}
    if TWO_CORES:
        models["split"] = (Split().eval(), (torch.randn(3, 16),))
    try:
        load(daemon, models)
        yield Served(daemon, models)
    finally:
        daemon.close()


@pytest.fixture(scope="module")
def threads(tmp_path_factory: pytest.TempPathFactory, state_root: Path, sock_dir: Path,
            shared_cache: Path) -> Iterator[Served]:
    """Thread workers (parts run in the daemon), a small per-uid connection limit and a
    short idle timeout."""
    daemon = start(tmp_path_factory.mktemp("fast-threads"), state_root, sock_dir, shared_cache,
                   engine={"workers": "thread"},
                   limits={"max_connections_per_uid": PER_UID, "idle_timeout_s": IDLE_S})
    torch.manual_seed(0)
    models = {"mlp": (samples.MLP(width=16, depth=1).eval(), (torch.randn(2, 16),)),
              "pair": (Pair().eval(), (torch.randn(2, 8), torch.randn(2, 4)))}
    try:
        load(daemon, models)
        yield Served(daemon, models)
    finally:
        daemon.close()


# -- outputs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mlp", "wide", "pair", "split"])
def test_process_workers_match_eager(procs, name):
    if name not in procs.models:
        pytest.skip(NEEDS_TWO_CORES)
    model, inputs = procs.models[name]
    expected = eager(model, inputs)
    with Client(procs.daemon.target, fast=True) as client:
        got = client.infer(name, inputs)
        assert list(got) == [f"output{i}" for i in range(len(expected))]
        close_to(list(got.values()), expected)
        assert all(isinstance(t, torch.Tensor) for t in got.values())
        session = client.session(name)
        close_to(list(client.infer(name, list(inputs)).values()), expected)  # a sequence
        by_name = dict(zip((t["name"] for t in session.inputs), inputs, strict=True))
        close_to(list(client.infer(name, by_name).values()), expected)  # a dict
        if len(inputs) == 1:
            close_to(list(client.infer(name, inputs[0]).values()), expected)  # one tensor
        assert client.session(name) is session and session.opened == 1  # one per thread
    with FastSession(procs.path, name, depth=3) as session:
        for _ in range(5):  # past the ring's end: entries are reused
            out = session.run([x.numpy() for x in inputs])
            assert all(isinstance(o, np.ndarray) for o in out)
            close_to(out, expected)
        assert [t["shape"] for t in session.outputs] == [list(e.shape) for e in expected]


def test_a_dynamic_model_is_served_for_the_shapes_its_session_opens_with(procs):
    """A dynamic-shape model's session serves the bucket of its shapes: opened for the first
    request's (or the given ones), again for other shapes; batched (its requests share runs
    in the daemon) or not (the bucket's worker answers the doorbell). Bad shapes are said."""
    torch.manual_seed(0)
    model = samples.MLP(width=16, depth=1).eval()
    batch = torch.export.Dim("batch", max=8)
    with Client(procs.daemon.target) as client:
        for name, batching in (("dyn", None), ("dyn-solo", False)):
            client.load(name, model, (torch.randn(2, 16),), dynamic_shapes=({0: batch},),
                        batching=batching)
    for name in ("dyn", "dyn-solo"):
        with FastSession(procs.path, name) as session:
            assert session.dynamic and session.opened == 0  # opened by the first request
            for rows in (2, 3, 3, 2):
                x = torch.randn(rows, 16)
                close_to(session.run([x]), eager(model, (x,)))
            assert session.opened == 2  # for 2 rows, for 3; the one for 2 was kept open
    assert eventually(lambda: server_ends(procs.daemon) == 0)  # the sessions above ended
    with FastSession(procs.path, "dyn-solo", keep=2) as session:  # the last 2 stay open
        for rows in (1, 2, 3, 1, 3):
            x = torch.randn(rows, 16)
            close_to(session.run([x]), eager(model, (x,)))
        assert session.opened == 4  # 1 was closed when 3 opened, and opened again
        assert eventually(lambda: server_ends(procs.daemon) == 2), server_ends(procs.daemon)
    assert eventually(lambda: server_ends(procs.daemon) == 0)  # closed, the kept ones too
    with Client(procs.daemon.target, fast=True) as client:
        x = torch.randn(5, 16)
        close_to(list(client.infer("dyn", x).values()), eager(model, (x,)))
    with FastSession(procs.path, "dyn", shapes=[[4, 16]]) as session:
        assert session.opened == 1
        x = torch.randn(4, 16)
        close_to(session.run([x]), eager(model, (x,)))
    for shapes, says in (([[9, 16]], "outside the exported range"),
                         ([[2, 15]], "dim 1 must be 16"), ([[2, 16]] * 2, "takes 1"),
                         ([["2", 16]], "one list of sizes")):
        with pytest.raises(FastPathError, match=says) as err:
            FastSession(procs.path, "dyn", shapes=shapes, timeout=5)
        assert err.value.code == "INVALID_ARGUMENT"


def test_thread_workers_match_eager(threads):
    with Client(f"unix+fast://{threads.path}") as client:  # the target says fast
        assert client.fast
        for name, (model, inputs) in threads.models.items():
            expected = eager(model, inputs)
            close_to(list(client.infer(name, inputs).values()), expected)
            names = [t["name"] for t in client.session(name).inputs]
            close_to(list(client.infer(name, dict(zip(names, inputs, strict=True))).values()),
                     expected)
    model, inputs = threads.models["mlp"]
    with FastSession(threads.path, "mlp", version="1") as session:
        close_to(session.run(inputs[0]), eager(model, inputs))
        assert session.layout["version"] == "1"


@pytest.mark.parametrize("which, count", [("procs", 8), ("threads", PER_UID)])
def test_concurrent_sessions_each_get_their_own_outputs(request, which, count):
    """Threads with distinct inputs, half sharing one Client (a session per thread), half
    with their own; Client.close() ends every thread's session, threads still alive."""
    served = request.getfixturevalue(which)
    model, _ = served.models["mlp"]
    shared = Client(served.daemon.target, fast=True)
    errors: list[str] = []
    finished, closed = threading.Barrier(count + 1), threading.Event()

    def worker(i: int) -> None:
        client = shared if i % 2 else Client(served.daemon.target, fast=True)
        x = torch.randn(2, 16, generator=torch.Generator().manual_seed(100 + i))
        expected = eager(model, (x,))
        try:
            for _ in range(40):
                close_to(list(client.infer("mlp", x).values()), expected)
        except Exception as e:  # noqa: BLE001 - told to the test below
            errors.append(f"thread {i}: {type(e).__name__}: {e}")
        if client is not shared:
            client.close()
        finished.wait(60)
        closed.wait(60)  # alive while the shared client closes

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    kept = session_memory(served.daemon)
    for t in pool:
        t.start()
    try:
        finished.wait(120)
        assert not errors, errors
        half = count // 2  # the shared client's sessions, their threads still alive
        assert eventually(lambda: server_ends(served.daemon) == half), server_ends(served.daemon)
        shared.close()
        assert eventually(lambda: server_ends(served.daemon) == 0), server_ends(served.daemon)
        assert eventually(lambda: session_memory(served.daemon) <= kept + 1)  # mlp's last
    finally:
        shared.close()
        closed.set()
        for t in pool:
            t.join(60)


# -- clients that die, a daemon that restarts, a model loaded again -------------------------
KILLED = """
import sys
import numpy as np
from cuvild.client.fast import FastSession
session = FastSession(sys.argv[1], "mlp")
x = np.ones((2, 16), np.float32)
session.run(x)
print("open", flush=True)
while True:
    session.run(x)
"""


@pytest.mark.parametrize("which", ["threads", "procs"])
def test_killed_clients_leave_no_session_connection_or_memory(request, which):
    """Clients SIGKILLed mid-request, as many as the thread daemon's uid may hold: each
    session and its connection end with its client (there, the limit's sessions open again)
    and its memory goes; /dev/shm holds the daemon's arena and nothing more."""
    served = request.getfixturevalue(which)
    daemon, (model, inputs) = served.daemon, served.models["mlp"]
    expected = eager(model, inputs)
    before, kept = arena_objects(daemon), session_memory(daemon)
    clients = [subprocess.Popen([sys.executable, "-c", KILLED, served.path], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(PER_UID)]
    try:
        for proc in clients:
            assert proc.stdout.readline() == "open\n", proc.stderr.read()
        assert server_ends(daemon) == PER_UID and session_memory(daemon) >= PER_UID
        time.sleep(0.2)  # each mid-loop: most likely waiting on its answer
    finally:
        for proc in clients:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert eventually(lambda: server_ends(daemon) == 0), server_ends(daemon)
    assert eventually(lambda: session_memory(daemon) <= kept + 1), session_memory(daemon)
    sessions = [FastSession(served.path, "mlp", timeout=15) for _ in range(PER_UID)]
    try:
        for session in sessions:
            close_to(session.run(inputs), expected)
        if which == "threads":
            with pytest.raises(FastPathError) as err:  # one more than the uid may hold
                FastSession(served.path, "mlp", timeout=1)
            assert err.value.code == "UNAVAILABLE"
    finally:
        for session in sessions:
            session.close()
    with Client(daemon.target, fast=True) as client:
        close_to(list(client.infer("mlp", inputs).values()), expected)
    with Client(daemon.target) as client:  # and the Open Inference Protocol
        close_to(list(client.infer("mlp", inputs).values()), expected)
    assert eventually(lambda: session_memory(daemon) <= kept + 1), session_memory(daemon)
    assert arena_objects(daemon) == before
    assert not [p.name for p in SHM_DIR.iterdir() if "session" in p.name]
    assert daemon.proc.poll() is None


def test_a_restarted_daemon_serves_the_open_session(make_daemon):
    """The daemon stops under an open session and a new one starts on its socket and state:
    the session's next request waits for it, re-opens once and is answered."""
    torch.manual_seed(0)
    model, x = samples.MLP(width=16, depth=1).eval(), torch.randn(2, 16)
    expected = eager(model, (x,))
    settings = {"engine": {"runtimes": RUNTIMES}}
    first = make_daemon(**settings)
    load(first, {"mlp": (model, (x,))})
    session = FastSession(str(first.socket_path), "mlp", timeout=120)
    close_to(session.run(x), expected)
    assert first.stop() == 0
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["out"] = session.run(x)
        except Exception as e:  # noqa: BLE001 - told to the test below
            result["error"] = e

    waiting = threading.Thread(target=run)
    waiting.start()  # while no daemon serves
    second = make_daemon(state_dir=first.state_dir, listen={"unix": str(first.socket_path)},
                         **settings)
    waiting.join(150)
    assert "error" not in result, f"{result.get('error')!r}\n{second.log()[-3000:]}"
    close_to(result["out"], expected)
    assert session.opened == 2
    close_to(session.run(x), expected)
    assert session.opened == 2
    session.close()


@pytest.mark.parametrize("which, name", PATHS)
def test_a_model_loaded_again_reopens_the_session_and_an_unloaded_one_is_not_found(request,
                                                                                     which, name):
    """Loaded again under the same version (replace): the session's next request re-opens
    and is sent again, on the new weights or the new layout; unloaded: NOT_FOUND."""
    served = on_path(request, which, name)
    torch.manual_seed(4)
    x = torch.randn(2, 16)
    kind = Split if name == "split" else lambda: samples.MLP(width=16, depth=1)
    old, new, swap = kind().eval(), kind().eval(), f"swap_{name}"
    load(served.daemon, {swap: (old, (x,))})
    with FastSession(served.path, swap) as session, \
            Client(served.daemon.target, fast=True) as client:
        close_to(session.run(x), eager(old, (x,)))
        close_to(list(client.infer(swap, x).values()), eager(old, (x,)))
        with Client(served.daemon.target) as control:
            assert control.load(swap, new, (x,), replace=True)["state"] == "ready"
        close_to(session.run(x), eager(new, (x,)))  # RELOADED: re-opened, sent again
        assert session.opened == 2
        close_to(list(client.infer(swap, x).values()), eager(new, (x,)))
        narrow, x8 = samples.MLP(width=8, depth=1).eval(), torch.randn(2, 8)
        with Client(served.daemon.target) as control:  # loaded again with another layout
            assert control.load(swap, narrow, (x8,), replace=True)["state"] == "ready"
        with pytest.raises(FastPathError) as err:  # re-opened: the old input fits no more
            session.run(x)
        assert err.value.code == "INVALID_ARGUMENT" and "takes float32[2, 8]" in str(err.value)
        assert session.opened == 3
        close_to(session.run(x8), eager(narrow, (x8,)))
        with Client(served.daemon.target) as control:
            control.unload(swap)
        for call in (lambda: session.run(x8), lambda: client.infer(swap, x)):
            with pytest.raises(FastPathError) as err:
                call()
            assert err.value.code == "NOT_FOUND", err.value
    with pytest.raises(FastPathError) as err:
        FastSession(served.path, swap)
    assert err.value.code == "NOT_FOUND"


def test_the_fast_path_turned_off_is_unimplemented_and_grpc_serves(make_daemon):
    torch.manual_seed(0)
    model, x = samples.MLP(width=16, depth=1).eval(), torch.randn(2, 16)
    daemon = make_daemon(engine={"runtimes": RUNTIMES},
                         shm={"fast_path": False})
    load(daemon, {"mlp": (model, (x,))})
    with pytest.raises(FastPathError) as err:
        FastSession(str(daemon.socket_path), "mlp", timeout=5)
    assert err.value.code == "UNIMPLEMENTED", err.value
    with Client(daemon.target, fast=True) as client, pytest.raises(FastPathError) as err:
        client.infer("mlp", x)
    assert err.value.code == "UNIMPLEMENTED"
    with Client(daemon.target) as client:
        close_to(list(client.infer("mlp", x).values()), eager(model, (x,)))
        close_to(list(client.infer("mlp", x, shm=True).values()), eager(model, (x,)))


# -- refused, and the daemon goes on ---------------------------------------------------------
def test_bad_inputs_and_unknown_models_are_refused(procs):
    model, inputs = procs.models["mlp"]
    x = inputs[0]
    with Client(procs.daemon.target, fast=True) as client:
        bad = {"shape": torch.randn(3, 16), "dtype": x.double(), "count": [x, x],
               "names": {"y": x}, "too many names": {"x": x, "y": x}}
        for what, value in bad.items():
            with pytest.raises(FastPathError) as err:
                client.infer("mlp", value)
            assert err.value.code == "INVALID_ARGUMENT", what
        assert "float64[2, 16], model mlp takes float32[2, 16]" in str(
            pytest.raises(FastPathError, client.infer, "mlp", x.double()).value)
        for name, version in (("nothing", None), ("mlp", "9")):
            with pytest.raises(FastPathError) as err:
                client.infer(name, x, version=version)
            assert err.value.code == "NOT_FOUND" and repr(name) in str(err.value)
        close_to(list(client.infer("mlp", x).values()), eager(model, inputs))
        assert client.session("mlp").opened == 1  # a refused request keeps the session


@pytest.mark.parametrize("which, name", PATHS)
@pytest.mark.parametrize("case", ["slot past depth", "seq not rung", "not submitted"])
def test_a_bad_ring_entry_fails_alone(request, which, name, case):
    """Entries a buggy or hostile client writes: FAILED, INVALID_ARGUMENT naming the entry or
    slot; the next good request on the same session is answered."""
    served = on_path(request, which, name)
    model, inputs = served.models[name]
    sock, reply, mm = open_raw(served.path, {"model": name, "depth": 2})
    try:
        assert reply["ok"] and reply["depth"] == 2 and len(reply["slots"]) == 2, reply
        assert mm is not None and len(mm) == reply["size"]
        seq = 7  # ring entry 1
        if case == "slot past depth":
            state, error = ring(sock, mm, reply, seq, slot=5)
            assert "names slot 5; the session has slots 0..1" in error["error"]
        elif case == "seq not rung":
            state, error = ring(sock, mm, reply, seq, slot=0, entry_seq=seq + 100)
            assert f"ring entry 1 holds request {seq + 100}" in error["error"]
            assert f"rang for request {seq}" in error["error"]
        else:
            state, error = ring(sock, mm, reply, seq, slot=0, state=wire.FREE)
            assert f"ring entry 1 holds request {seq} in state {wire.FREE}" in error["error"]
        assert state == wire.FAILED and error["code"] == "INVALID_ARGUMENT", error
        base = reply["slots"][1]
        (spec,) = reply["inputs"]
        slot_tensor(mm, base, spec)[...] = inputs[0].numpy()
        state, error = ring(sock, mm, reply, seq + 1, slot=1)
        assert state == wire.DONE, error
        close_to([slot_tensor(mm, base, t).copy() for t in reply["outputs"]],
                 eager(model, inputs))
    finally:
        sock.close()
        mm.close()


@pytest.mark.parametrize("body, version, code, says", [
    (b"{not json", wire.VERSION, "INVALID_ARGUMENT", "Expecting property name"),
    (b"[]", wire.VERSION, "INVALID_ARGUMENT", '{"model": name'),
    ({"depth": 1}, wire.VERSION, "INVALID_ARGUMENT", '{"model": name'),
    ({"model": "mlp", "depth": 0}, wire.VERSION, "INVALID_ARGUMENT", "depth 0: 1..64"),
    ({"model": "mlp", "depth": 65}, wire.VERSION, "INVALID_ARGUMENT", "depth 65: 1..64"),
    ({"model": "mlp", "depth": "2"}, wire.VERSION, "INVALID_ARGUMENT", "depth '2'"),
    ({"model": "mlp"}, 2, "FAILED_PRECONDITION", "fast path version 2: this cuvild speaks 1"),
    ({"model": "nothing"}, wire.VERSION, "NOT_FOUND", "unknown model 'nothing'"),
])
def test_a_bad_open_request_is_refused(procs, body, version, code, says):
    sock, reply, mm = open_raw(procs.path, body, version)
    try:
        assert mm is None and reply["ok"] is False, reply
        assert reply["code"] == code and says in reply["error"], reply
        assert sock.recv(1) == b""  # and the daemon closed the socket
    finally:
        sock.close()
    model, inputs = procs.models["mlp"]
    with FastSession(procs.path, "mlp") as session:
        close_to(session.run(inputs), eager(model, inputs))


def test_a_client_slow_to_open_gets_its_session_and_nothing_else(procs):
    """gRPC greets a connection first (a SETTINGS frame, on the front's inner socket): the
    front holds that until the client spoke, so a late open request still gets only the
    fast path's reply."""
    model, inputs = procs.models["mlp"]
    sock, reply, mm = open_raw(procs.path, {"model": "mlp"}, pause=0.5)
    try:
        assert reply["ok"] and mm is not None, reply
        base, (spec,) = reply["slots"][0], reply["inputs"]
        slot_tensor(mm, base, spec)[...] = inputs[0].numpy()
        assert ring(sock, mm, reply, 1, slot=0) == (wire.DONE, None)
        close_to([slot_tensor(mm, base, t).copy() for t in reply["outputs"]],
                 eager(model, inputs))
    finally:
        sock.close()
        mm.close()


def test_a_silent_connection_is_closed_and_an_idle_session_opens_again(threads):
    """A connection that never speaks gets gRPC's greeting, then its close after the idle
    timeout; a session idle past it is closed too, and its client opens a new one by
    itself on its next request."""
    model, inputs = threads.models["mlp"]
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.settimeout(IDLE_S + 10)
    silent.connect(threads.path)
    with FastSession(threads.path, "mlp") as session:
        close_to(session.run(inputs), eager(model, inputs))
        got = b""
        while chunk := silent.recv(4096):
            got += chunk
        silent.close()
        assert got[3:4] == b"\x04"  # an HTTP/2 SETTINGS frame
        time.sleep(1.5)  # the session was idle past the timeout too
        close_to(session.run(inputs), eager(model, inputs))
        assert session.opened == 2


def test_idle_sessions_end_so_they_cannot_hold_the_connection_limits(make_daemon):
    """Sessions served by a worker process, idle past limits.idle_timeout_s, are ended by
    the daemon (an open session counts as one of its caller's connections): a caller at
    its limit is served again, and the idle clients open new sessions by themselves."""
    torch.manual_seed(0)
    model, x = samples.MLP(width=16, depth=1).eval(), torch.randn(2, 16)
    daemon = make_daemon(engine={"runtimes": RUNTIMES},
                         limits={"max_connections_per_uid": 2, "idle_timeout_s": 3})
    load(daemon, {"mlp": (model, (x,))})
    path = str(daemon.socket_path)
    first, second = FastSession(path, "mlp"), FastSession(path, "mlp")
    try:
        for session in (first, second):
            close_to(session.run(x), eager(model, (x,)))
        with pytest.raises(FastPathError) as err:  # the two hold this uid's connections
            FastSession(path, "mlp", timeout=0.5)  # (well within the idle timeout)
        assert err.value.code == "UNAVAILABLE", err.value
        deadline = time.monotonic() + 30
        while daemon.log().count("idle for") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert daemon.log().count("(limits.idle_timeout_s)") == 2, daemon.log()[-3000:]
        with FastSession(path, "mlp", timeout=10) as third:
            close_to(third.run(x), eager(model, (x,)))
        close_to(first.run(x), eager(model, (x,)))
        assert first.opened == 2
    finally:
        first.close()
        second.close()


def test_an_open_request_too_long_is_refused(procs):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(15)
    try:
        sock.connect(procs.path)
        sock.sendall(wire.OPEN.pack(wire.MAGIC, wire.VERSION, wire.MAX_OPEN_BYTES + 1))
        (length,) = wire.LENGTH.unpack(recv_exact(sock, wire.LENGTH.size))
        reply = json.loads(recv_exact(sock, length))
        assert reply["code"] == "INVALID_ARGUMENT" and "at most 65536" in reply["error"]
    finally:
        sock.close()
