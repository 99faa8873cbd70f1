"""What a hostile or careless local user could do to a daemon on its default config, each
closed (the hardening issue's findings, by number): between users (1-2), denial of service
by one user (3-7), wrong answers to bad input (12-13, 15). The engine's own findings (8, 13
in the workers, 14) are in tests/engine/test_hardening.py, the archives' (9-11) in
tests/intake/test_bounds.py."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
import tritonclient.grpc as grpcclient
from oip_helpers import (
    AS_OTHER_USER,
    LIMITS,
    NOBODY,
    SHM_DIR,
    connect_as,
    refused,
    status_of,
)

from cuvild import config as config_mod
from cuvild.client import Client, samples
from cuvild.client.infer_io import grant
from cuvild.core.arena import Arena
from protos import cuvil_pb2, cuvil_pb2_grpc, inference_pb2, inference_pb2_grpc

other_user = pytest.mark.skipif(not AS_OTHER_USER, reason="needs root on x86-64 or aarch64 "
                                                          "to connect as another user")


def _inference(target: str) -> tuple[grpc.Channel, inference_pb2_grpc.GRPCInferenceServiceStub]:
    channel = grpc.insecure_channel(target)
    return channel, inference_pb2_grpc.GRPCInferenceServiceStub(channel)


def _object(nbytes: int = 4096, mode: int = 0o600) -> Path:
    path = SHM_DIR / f"hardtest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, nbytes)
    os.close(fd)
    os.chmod(path, mode)
    return path


def _pid_of(daemon) -> int:  # noqa: ANN001
    return daemon.proc.pid


# -- 1. tenants' tensors are their own -------------------------------------------------------
@pytest.mark.parametrize("mode", [0o660, 0o640, 0o604, 0o644])
def test_objects_other_users_can_reach_are_refused(hardened, mode):
    daemon, _, _ = hardened
    path = _object(mode=mode)
    channel, stub = _inference(daemon.target)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.SystemSharedMemoryRegister(inference_pb2.SystemSharedMemoryRegisterRequest(
                name="open", key=f"/{path.name}", offset=0, byte_size=4096), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "not only by its owner and cuvild" in err.value.details()
        assert "mode 0600" in err.value.details()
    finally:
        channel.close()
        path.unlink()


def test_the_clients_own_regions_are_private(hardened):
    daemon, x, y = hardened
    with Client(daemon.target) as client:
        got = client.infer("mlp", x, shm=True)["output0"]
        torch.testing.assert_close(got, y)
        name = client._region.name  # noqa: SLF001 - white-box: the test reads _region
        mode = stat.S_IMODE(os.stat(SHM_DIR / name).st_mode)
    assert mode == 0o600, oct(mode)


@other_user
def test_grant_lets_the_daemons_user_alone_in(tmp_path):
    """What the client does when the daemon runs as another user: an ACL entry for that user;
    the object's group and everyone else still get nothing."""
    path = _object()
    try:
        grant(str(path), NOBODY)
        assert _opens_as(NOBODY, path)
        assert not _opens_as(NOBODY - 1, path)
    finally:
        path.unlink()


def _opens_as(uid: int, path: Path) -> bool:
    import ctypes

    from oip_helpers import SYSCALLS

    libc = ctypes.CDLL(None, use_errno=True)
    setresuid, setfsuid = SYSCALLS[os.uname().machine]
    result: list[bool] = []

    def attempt() -> None:
        libc.syscall(setfsuid, uid)  # file access checks use the fs uid
        try:
            os.close(os.open(path, os.O_RDWR))
            result.append(True)
        except PermissionError:
            result.append(False)
        finally:
            libc.syscall(setfsuid, 0)

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join()
    return result[0]


# -- 2. directories another user made or can write --------------------------------------------
@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make another user's directory")
@pytest.mark.parametrize("key", ["state_dir", "cache_dir", "listen.unix"])
def test_directories_of_another_user_are_refused(tmp_path, key):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    data: dict = {"state_dir": str(tmp_path / "s"), "cache_dir": str(tmp_path / "c")}
    if key == "listen.unix":
        data["listen"] = {"unix": str(theirs / "cuvild.sock")}
    else:
        data[key] = str(theirs)
    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.parse(data)
    assert err.value.key == key
    assert f"{theirs} is owned by uid {NOBODY}" in str(err.value)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_directories_others_can_write_are_refused(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.raises(config_mod.ConfigError, match="writable by other users"):
        config_mod.parse({"cache_dir": str(shared), "state_dir": str(tmp_path / "s")})


def test_own_private_directories_are_accepted(tmp_path):
    cfg = config_mod.parse({"cache_dir": str(tmp_path / "c"), "state_dir": str(tmp_path / "s")})
    assert stat.S_IMODE(os.stat(cfg.cache_dir).st_mode) == 0o700


# -- 3. arena names cannot be taken first -----------------------------------------------------
def test_arena_names_are_unpredictable_and_squatting_them_fails_nothing():
    instance = f"{os.getpid()}-squat"
    squatted = [SHM_DIR / f"cuvil-{instance}-{i}" for i in range(8)]  # the old names
    for path in squatted:
        path.write_bytes(b"")
    arena = Arena(instance, segment_bytes=1 << 16, lock=False)
    try:
        blocks = [arena.alloc(1 << 16) for _ in range(3)]
        names = {b.segment for b in blocks}
        assert len(names) == 3
        assert all(len(n.rsplit("-", 1)[1]) == 16 for n in names)
    finally:
        arena.close()
        for path in squatted:
            path.unlink()


def test_a_squatted_arena_name_is_drawn_again(monkeypatch):
    import cuvild.core.arena as arena_mod

    taken = SHM_DIR / f"cuvil-{os.getpid()}-dup-{'0' * 16}"
    taken.write_bytes(b"")
    draws = iter(["0" * 16, "1" * 16])
    monkeypatch.setattr(arena_mod.secrets, "token_hex", lambda n: next(draws))
    arena = Arena(f"{os.getpid()}-dup", segment_bytes=1 << 16, lock=False)
    try:
        assert arena.alloc(64).segment.endswith("1" * 16)
    finally:
        arena.close()
        taken.unlink()


# -- 4. descriptors and regions ---------------------------------------------------------------
def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_regions_hold_no_descriptor_are_capped_and_go_with_the_connection(hardened):
    daemon, _, _ = hardened
    pid = _pid_of(daemon)
    objects = [_object() for _ in range(5)]
    channel, stub = _inference(daemon.target)
    try:
        stub.SystemSharedMemoryStatus(inference_pb2.SystemSharedMemoryStatusRequest(),
                                      timeout=10)  # connected: its sockets counted
        before = _fds(pid)
        for i, path in enumerate(objects[:4]):
            stub.SystemSharedMemoryRegister(inference_pb2.SystemSharedMemoryRegisterRequest(
                name=f"r{i}", key=f"/{path.name}", offset=0, byte_size=4096), timeout=10)
        assert _fds(pid) <= before + 1  # nothing kept open per region
        with pytest.raises(grpc.RpcError) as err:
            stub.SystemSharedMemoryRegister(inference_pb2.SystemSharedMemoryRegisterRequest(
                name="r4", key=f"/{objects[4].name}", offset=0, byte_size=4096), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "shm.max_regions_per_caller" in err.value.details()
    finally:
        channel.close()
    # The caller's last connection closed: its regions are gone, a new one starts empty.
    deadline = time.monotonic() + 10
    while True:
        channel, stub = _inference(daemon.target)
        with channel:
            status = stub.SystemSharedMemoryStatus(
                inference_pb2.SystemSharedMemoryStatusRequest(), timeout=10)
        if not status.regions or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert dict(status.regions) == {}
    for path in objects:
        path.unlink()


def test_the_open_file_limit_is_raised_to_the_hard_one(hardened):
    daemon, _, _ = hardened
    limits = Path(f"/proc/{_pid_of(daemon)}/limits").read_text()
    line = next(row for row in limits.splitlines() if row.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    assert soft == hard, line


# -- 5. idle connections ----------------------------------------------------------------------
@other_user
def test_one_users_connections_leave_room_for_the_others(hardened):
    daemon, _, _ = hardened
    path = str(daemon.socket_path)
    os.chmod(path, 0o666)  # let `nobody` connect, for this test only
    try:
        held = [connect_as(NOBODY, path) for _ in range(40)]
    finally:
        os.chmod(path, 0o660)
    try:
        time.sleep(0.5)
        closed = 0
        for s in held:
            s.settimeout(0.05)
            try:
                closed += s.recv(1) == b""
            except TimeoutError:
                pass
        assert closed == 40 - LIMITS["max_connections_per_uid"]
        threads = int(next(line.split()[1] for line in
                           Path(f"/proc/{_pid_of(daemon)}/status").read_text().splitlines()
                           if line.startswith("Threads:")))
        assert threads < 80, f"{threads} threads for {len(held)} idle connections"
        channel, stub = _inference(daemon.target)
        with channel:
            assert stub.ServerLive(inference_pb2.ServerLiveRequest(), timeout=5).live
    finally:
        for s in held:
            s.close()


def test_idle_connections_are_closed_and_clients_reconnect(hardened):
    """One wait past the limit for all three (each its own, one after another, kept a
    worker of the suite idle 12 s): a silent socket is closed, a channel idle past the limit
    reconnects, and its shared-memory region, which went with the connection, is registered
    again."""
    daemon, x, y = hardened
    idle = socket.socket(socket.AF_UNIX)
    idle.connect(str(daemon.socket_path))
    idle.settimeout(LIMITS["idle_timeout_s"] + 10)
    with Client(daemon.target) as client:
        torch.testing.assert_close(client.infer("mlp", x, shm=True)["output0"], y)
        time.sleep(LIMITS["idle_timeout_s"] + 1.5)
        while idle.recv(4096):  # gRPC's own SETTINGS frame, then the close
            pass
        idle.close()
        torch.testing.assert_close(client.infer("mlp", x, shm=True)["output0"], y)
        torch.testing.assert_close(client.infer("mlp", x)["output0"], y)


# -- 6. stalled uploads -----------------------------------------------------------------------
def _stalled_upload(target: str) -> tuple[grpc.Channel, grpc.Future, threading.Event]:
    """A LoadModel stream that sends its header and then nothing."""
    channel = grpc.insecure_channel(target)
    stub = cuvil_pb2_grpc.ControlStub(channel)
    release = threading.Event()

    def requests() -> Iterator[cuvil_pb2.LoadModelRequest]:
        yield cuvil_pb2.LoadModelRequest(header=cuvil_pb2.LoadModelHeader(
            name=f"stall{uuid.uuid4().hex[:6]}", sha256="0" * 64, size_bytes=1 << 20))
        release.wait(60)

    return channel, stub.LoadModel.future(requests(), timeout=60), release


def test_stalled_uploads_are_cancelled_and_counted_once_for_every_listener(hardened):
    daemon, _, _ = hardened
    uploads = daemon.state_dir / "uploads"
    stalls = [_stalled_upload(daemon.target) for _ in range(2)]
    try:
        deadline = time.monotonic() + 10
        while len(list(uploads.iterdir())) < 2:  # both hold a slot
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with grpc.insecure_channel(daemon.tcp) as channel:  # the TCP listener: same count
            with pytest.raises(grpc.RpcError) as err:
                cuvil_pb2_grpc.ControlStub(channel).LoadModel(iter([cuvil_pb2.LoadModelRequest(
                    header=cuvil_pb2.LoadModelHeader(name="third", sha256="0" * 64,
                                                     size_bytes=16))]), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for _, future, _ in stalls:  # cancelled by the daemon after upload_idle_s
            with pytest.raises(grpc.RpcError) as err:
                future.result(timeout=30)
            assert err.value.code() in (grpc.StatusCode.CANCELLED,
                                        grpc.StatusCode.DEADLINE_EXCEEDED)
        deadline = time.monotonic() + 10
        while list(uploads.iterdir()):  # their part files removed
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "cancelling an upload: it sent nothing" in daemon.log()
    finally:
        for channel, _, release in stalls:
            release.set()
            channel.close()


def test_the_upload_watchdog_goes_with_the_last_upload():
    """No daemon thread wakes for nothing: the watchdog lives while uploads do."""
    from cuvild.serve.limits import Uploads

    class Context:
        def cancel(self) -> None:
            pass

    uploads = Uploads(slots=2, idle_s=0.2, max_s=60)
    for _ in range(2):  # and comes back with the next upload
        with uploads.slot(Context()):
            watchdog = uploads._watchdog  # noqa: SLF001 - white-box: the test reads _watchdog
            assert watchdog is not None and watchdog.is_alive()
        watchdog.join(timeout=5)
        assert not watchdog.is_alive() and uploads._watchdog is None  # noqa: SLF001 - white-box: the test reads _watchdog


# -- 7. long calls cannot starve health ---------------------------------------------------------
def test_health_answers_while_long_calls_fill_the_handlers(hardened):
    daemon, x, _ = hardened
    with Client(daemon.target) as client:  # a model still building holds its load calls
        client.load("slow", samples.MLP(width=32, depth=3).eval(), (torch.randn(1, 32),),
                    wait=False)
    channel, stub = _inference(daemon.target)
    calls = [stub.RepositoryModelLoad.future(
        inference_pb2.RepositoryModelLoadRequest(model_name="slow"), timeout=120)
        for _ in range(16)]
    try:
        live = []
        for _ in range(20):
            t0 = time.perf_counter()
            assert stub.ServerLive(inference_pb2.ServerLiveRequest(), timeout=2).live
            stub.ServerReady(inference_pb2.ServerReadyRequest(), timeout=2)  # "slow" loads: no
            live.append(time.perf_counter() - t0)
        codes = []
        for call in calls:
            try:
                call.result()
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes  # past the slots: answered at once
    finally:
        channel.close()


# -- 12, 13, 15. bad input gets a clear answer ---------------------------------------------------
def _shm_request(region: str, **params: object) -> inference_pb2.ModelInferRequest:
    request = inference_pb2.ModelInferRequest(model_name="mlp")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[2, 16])
    tensor.parameters["shared_memory_region"].string_param = region
    for key, value in params.items():
        param = tensor.parameters[key]
        if value is None:
            param.SetInParent()  # present, with no value
        elif isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, str):
            param.string_param = value
        else:
            param.int64_param = value
    return request


@pytest.mark.parametrize("params,named", [
    ({"shared_memory_offset": "1.5"}, "shared_memory_offset"),
    ({"shared_memory_offset": "8"}, "shared_memory_offset"),
    ({"shared_memory_offset": True}, "shared_memory_offset"),
    ({"shared_memory_offset": None}, "shared_memory_offset"),
    ({"shared_memory_byte_size": None}, "shared_memory_byte_size"),
    ({"shared_memory_byte_size": "128"}, "shared_memory_byte_size"),
])
def test_shared_memory_parameters_of_the_wrong_type_are_named(hardened, params, named):
    daemon, _, _ = hardened
    channel, stub = _inference(daemon.target)
    with channel, pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(_shm_request("any", **params), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in err.value.details()


def test_a_region_parameter_with_no_value_is_named(hardened):
    daemon, _, _ = hardened
    request = _shm_request("x")
    request.inputs[0].parameters["shared_memory_region"].Clear()
    request.inputs[0].parameters["shared_memory_region"].SetInParent()
    channel, stub = _inference(daemon.target)
    with channel, pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "shared_memory_region" in err.value.details()


def test_a_region_shrunk_after_registration_is_refused(hardened):
    daemon, x, y = hardened
    triton = grpcclient.InferenceServerClient(url=daemon.target)
    path = _object(x.numel() * 4)
    try:
        with open(path, "r+b") as f:
            f.write(x.numpy().tobytes())
        triton.register_system_shared_memory("shrinks", f"/{path.name}", x.numel() * 4)
        inp = grpcclient.InferInput("x", list(x.shape), "FP32")
        inp.set_shared_memory("shrinks", x.numel() * 4)
        got = triton.infer("mlp", [inp]).as_numpy("output0")
        torch.testing.assert_close(torch.from_numpy(got), y)
        os.truncate(path, 0)
        err = refused(lambda: triton.infer("mlp", [inp]))
        assert status_of(err) == grpc.StatusCode.INVALID_ARGUMENT
        assert "shrank to 0 bytes" in err.message()
        got = triton.infer("mlp", [_raw_input(x)]).as_numpy("output0")  # still serving
        torch.testing.assert_close(torch.from_numpy(got), y)
    finally:
        triton.unregister_system_shared_memory()
        triton.close()
        path.unlink()


def _raw_input(x: torch.Tensor) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x.numpy())
    return inp


@pytest.mark.parametrize("field", ["name", "version"])
def test_names_and_versions_with_a_trailing_newline_are_refused(tmp_path, field):
    from cuvild.intake.registry import Registry, RegistryError

    registry = Registry(tmp_path, 1 << 20)
    header = {"name": "m", "version": "1", "sha256": "0" * 64, "size_bytes": 16,
              "replace": False}
    header[field] += "\n"  # `$` matches before a final newline: names are matched whole
    with pytest.raises(RegistryError, match=field) as err:
        registry.begin_upload(header)
    assert err.value.kind == "invalid"


def test_undecodable_requests_cannot_flood_the_log(hardened):
    daemon, _, _ = hardened
    with grpc.insecure_channel(daemon.target) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for _ in range(40):
            with pytest.raises(grpc.RpcError):
                call(b"\xff\xff\xff\xff not a protobuf", timeout=10)
        lines = daemon.log().count("Exception deserializing")
        assert 1 <= lines <= 5, lines
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(inference_pb2.ServerLiveRequest(), timeout=5).live
