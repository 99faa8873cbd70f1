"""Who is calling: the unix socket's front (SO_PEERCRED) and per-caller shared-memory regions."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from cuvild.core.arena import SHM_DIR, Arena
from cuvild.serve.front import Front
from cuvild.serve.regions import RegionError, Regions

ME = os.getuid()
OTHER = ME + 4242  # a uid that owns nothing here


@pytest.fixture
def front(tmp_path: Path) -> Iterator[tuple[Front, grpc.Server]]:
    """A front over a gRPC server whose one method echoes its payload after the caller's uid."""
    fr = Front(str(tmp_path / "public.sock"))

    def whoami(payload: bytes, context: grpc.ServicerContext) -> bytes:
        return f"{fr.uid_of(context.peer())}|".encode() + payload

    server = grpc.server(futures.ThreadPoolExecutor(2),
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.T", {"Who": grpc.unary_unary_rpc_method_handler(whoami)})])
    assert server.add_insecure_port(f"unix:{fr.inner_path}")
    server.start()
    fr.start()
    yield fr, server
    server.stop(None).wait()
    fr.close()


def call(target: str, payload: bytes = b"") -> tuple[str, bytes]:
    with grpc.insecure_channel(target, options=[("grpc.max_receive_message_length",
                                                 64 << 20)]) as channel:
        uid, _, echoed = channel.unary_unary("/t.T/Who")(payload, timeout=30).partition(b"|")
    return uid.decode(), echoed


def test_the_servicer_learns_the_callers_uid(front):
    fr, _ = front
    assert call(f"unix:{fr.public_path}") == (str(ME), b"")
    payload = os.urandom(8 << 20)  # the relay copies large messages intact
    assert call(f"unix:{fr.public_path}", payload) == (str(ME), payload)


def test_only_the_front_can_name_a_caller(front):
    fr, _ = front
    # Straight to gRPC's socket (only the daemon's user can): no name, no uid.
    assert call(f"unix:{fr.inner_path}")[0] == "None"
    assert fr.uid_of("ipv4:127.0.0.1:5555") is None
    assert fr.uid_of("unix:") is None
    assert fr.uid_of(f"unix-abstract:cuvild-{fr.tag}-0123456789abcdef01234567") is None
    assert fr.caller("unix:") == -1  # the unix listener's servicers: nobody's uid


def test_names_carry_a_nonce_not_the_uid_and_are_forgotten_on_close(front):
    fr, _ = front
    peers: list[str] = []

    def remember(payload: bytes, context: grpc.ServicerContext) -> bytes:
        peers.append(context.peer())
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(1))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.T", {"Who": grpc.unary_unary_rpc_method_handler(remember)})])
    inner = fr.inner_path + ".2"
    server.add_insecure_port(f"unix:{inner}")
    server.start()
    fr.inner_path, original = inner, fr.inner_path
    try:
        call(f"unix:{fr.public_path}")
    finally:
        fr.inner_path = original
        server.stop(None).wait()
    (peer,) = peers
    assert peer.startswith(f"unix-abstract:cuvild-{fr.tag}-") and f"-u{ME}" not in peer
    deadline = time.monotonic() + 10
    while fr.uid_of(peer) is not None:  # the channel closed: the relay drops its nonce
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert fr.caller(peer) == -1


def test_connections_past_the_cap_are_dropped_and_the_front_keeps_serving(front):
    fr, _ = front
    fr.max_connections = 2
    held = [socket.socket(socket.AF_UNIX) for _ in range(2)]
    for s in held:
        s.connect(fr.public_path)
    deadline = time.monotonic() + 10
    while fr.connections() < 2:  # both relayed
        assert time.monotonic() < deadline
        time.sleep(0.05)
    extra = socket.socket(socket.AF_UNIX)
    extra.connect(fr.public_path)
    extra.settimeout(10)
    assert extra.recv(1) == b""  # closed by the front
    extra.close()
    held.pop().close()
    while fr.connections() > 1:  # the relay sees the close
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert call(f"unix:{fr.public_path}")[0] == str(ME)  # room again
    for s in held:
        s.close()


def test_sockets_and_directory_are_private(front):
    fr, _ = front
    assert stat.S_IMODE(os.stat(fr.public_path).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(os.path.dirname(fr.inner_path)).st_mode) == 0o700


def test_close_removes_the_socket_and_the_private_directory(tmp_path):
    fr = Front(str(tmp_path / "p.sock"))
    fr.start()
    probe = socket.socket(socket.AF_UNIX)
    probe.connect(fr.public_path)  # accepted; the relay to the (absent) server fails and drops it
    probe.close()
    fr.close()
    assert not os.path.exists(fr.public_path)
    assert not os.path.exists(os.path.dirname(fr.inner_path))


def test_a_front_that_never_bound_leaves_the_path_alone(tmp_path):
    path = tmp_path / "someone-elses.sock"
    path.write_text("")
    Front(str(path)).close()
    assert path.exists()


# -- regions: per caller, owned by the caller ----------------------------------------------
@pytest.fixture
def obj() -> Iterator[str]:
    name = f"cuvil-test-peers-{uuid.uuid4().hex[:8]}"
    (SHM_DIR / name).write_bytes(b"\0" * 4096)
    (SHM_DIR / name).chmod(0o600)  # its owner's alone (with cuvild, which runs as us)
    yield "/" + name
    (SHM_DIR / name).unlink(missing_ok=True)


def test_a_caller_registers_only_objects_it_owns(obj):
    regions = Regions()
    try:
        with pytest.raises(RegionError, match=f"owned by uid {ME}, not by the caller "
                                              f"\\(uid {OTHER}\\)") as err:
            regions.register(OTHER, "r", obj, 0, 4096)
        assert err.value.kind == "denied"
        regions.register(ME, "r", obj, 0, 4096)
    finally:
        regions.close()


def test_tcp_callers_share_only_allowed_owners(obj):
    with pytest.raises(RegionError, match="TCP clients may share only"):
        Regions().register(None, "r", obj, 0, 4096)  # not even the daemon's own user
    regions = Regions(allowed_uids=[ME])
    try:
        regions.register(None, "r", obj, 0, 4096)
    finally:
        regions.close()


@pytest.mark.parametrize("caller", [ME, 0, None])
def test_nobody_registers_cuvilds_own_arena(caller):
    arena = Arena(f"{os.getpid()}-peers")
    try:
        block = arena.alloc(4096)
        regions = Regions(allowed_uids=[ME])
        with pytest.raises(RegionError, match="cuvild's own memory") as err:
            regions.register(caller, "a", f"/{block.segment}", 0, 4096)
        assert err.value.kind == "denied"
    finally:
        arena.close()


def test_regions_are_invisible_to_other_callers(obj):
    regions = Regions()
    try:
        regions.register(ME, "mine", obj, 0, 4096)
        assert regions.locate(ME, "mine", 0, 16)[1] == 0
        for caller in (OTHER, None):
            with pytest.raises(RegionError, match="unknown shared-memory region 'mine'"):
                regions.locate(caller, "mine", 0, 16)
            assert regions.status(caller) == []
            with pytest.raises(RegionError, match="no shared-memory region 'mine'"):
                regions.unregister(caller, "mine")
            regions.unregister(caller)  # "all of mine": none, and not the other caller's
        assert [r.name for r in regions.status(ME)] == ["mine"]
        # Names are per caller: root registering "mine" does not collide with uid ME's.
        if ME != 0:
            regions.register(0, "mine", obj, 0, 4096)
    finally:
        regions.close()


def test_symlinks_are_not_followed(obj, tmp_path):
    link = SHM_DIR / f"cuvil-test-peers-link-{uuid.uuid4().hex[:8]}"
    link.symlink_to(SHM_DIR / obj[1:])
    regions = Regions()
    try:
        with pytest.raises(RegionError, match="not a usable shared-memory object"):
            regions.register(ME, "r", "/" + link.name, 0, 4096)
    finally:
        link.unlink()
        regions.close()


def test_a_killed_daemons_private_directory_is_reclaimed(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"cuvild-{dead.pid}-abc123"
    stale.mkdir()
    (stale / "grpc.sock").write_text("")
    alive = tmp_path / f"cuvild-{os.getpid()}-def456"  # a live daemon's: kept
    alive.mkdir()
    fr = Front(str(tmp_path / "p.sock"))
    try:
        assert not stale.exists() and alive.exists()
        assert os.path.dirname(fr.inner_path).startswith(str(tmp_path / f"cuvild-{os.getpid()}-"))
    finally:
        fr.close()
