"""Issue 49's findings off the HTTP listener: a request that declares shapes without their data
builds nothing; what a killed daemon or client leaves in /dev/shm is reclaimed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from fast_helpers import close_to, eager, open_raw

from cuvild.client import Client, LoadFailed, samples
from cuvild.client.fast import FastSession
from protos import inference_pb2 as pb
from protos import inference_pb2_grpc

SHM = Path("/dev/shm")


def test_shapes_without_their_data_build_no_bucket(make_daemon) -> None:
    torch.manual_seed(0)
    model = samples.MLP(width=16, depth=1).eval()
    daemon = make_daemon()
    with Client(daemon.target) as client:
        client.load("dyn", model, (torch.randn(2, 16),),
                    dynamic_shapes=({0: torch.export.Dim("batch", max=64)},), batching=False)
        client.infer("dyn", torch.randn(2, 16))
        built = len(client.plan("dyn")["plan"]["buckets"])
        with grpc.insecure_channel(daemon.target) as channel:
            stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
            for rows in range(3, 13):  # more shapes than engine.max_buckets (8)
                request = pb.ModelInferRequest(model_name="dyn")
                request.inputs.add(name="x", datatype="FP32", shape=[rows, 16])
                with pytest.raises(grpc.RpcError) as err:
                    stub.ModelInfer(request, timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(client.plan("dyn")["plan"]["buckets"]) == built  # nothing compiled


def test_a_client_that_exits_without_close_leaves_no_segment(make_daemon, tmp_path) -> None:
    """A script that ends (or a client object dropped) without close(): the client unlinks
    the shared memory it created, on the shm and the fast paths."""
    torch.manual_seed(0)
    daemon = make_daemon()
    with Client(daemon.target) as client:
        client.load("mlp", samples.MLP(width=16, depth=1).eval(), (torch.randn(2, 16),))
    script = ("import torch, os\n"
              "from cuvild.client import Client\n"
              f"c = Client({daemon.target!r})\n"
              "c.infer('mlp', torch.randn(2, 16), shm=True)\n"
              f"f = Client({daemon.target!r}, fast=True)\n"
              "f.infer('mlp', torch.randn(2, 16))\n"
              "print(os.getpid())\n")  # and out, closing nothing
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    pid = done.stdout.split()[-1]
    assert not list(SHM.glob(f"cuvil-client-{pid}-*"))


def test_a_worker_draws_tqdm_bars_without_a_named_semaphore() -> None:
    """tqdm's default lock is a multiprocessing RLock: /dev/shm/sem.mp-*, left by a worker
    killed with its daemon (one a crash). A worker gives tqdm a thread lock first."""
    script = ("import multiprocessing.synchronize as s\n"
              "made = []\n"
              "orig = s.SemLock.__init__\n"
              "def init(self, *a, **k):\n"
              "    made.append(a)\n"
              "    orig(self, *a, **k)\n"
              "s.SemLock.__init__ = init\n"
              "from cuvild.workers.worker import thread_lock_for_tqdm\n"
              "thread_lock_for_tqdm()\n"
              "from tqdm import tqdm\n"
              "for _ in tqdm(range(3), disable=False): pass\n"
              "print(len(made))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "0"


def test_cuvilctl_clean_shm_removes_what_a_killed_client_left(tmp_path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    left = SHM / f"cuvil-client-{dead}-deadbeef"
    left.write_bytes(b"\0" * 64)
    mine = SHM / f"cuvil-client-{os.getpid()}-livelive"  # a live process's: kept
    mine.write_bytes(b"\0" * 64)
    try:
        cli = [sys.executable, "-m", "cuvild.client.cli", "clean-shm", "--json"]
        listed = subprocess.run([*cli, "--dry-run"], capture_output=True, text=True,
                                timeout=60, check=True)
        assert left.name in listed.stdout and left.exists()
        done = subprocess.run(cli, capture_output=True, text=True, timeout=60, check=True)
        assert left.name in done.stdout and mine.name not in done.stdout
        assert not left.exists() and mine.exists()
    finally:
        left.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)


def test_cuvilctl_into_a_closed_pipe_ends_quietly() -> None:
    """`cuvilctl ... | head -1`: a reader that has what it wanted closes the pipe; cuvilctl
    ends as a shell's tools do (141: SIGPIPE's status), with no traceback."""
    read, write = os.pipe()
    os.close(read)  # every write to stdout fails: EPIPE
    try:
        done = subprocess.run([sys.executable, "-m", "cuvild.client.cli", "clean-shm",
                               "--dry-run"], stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=60)
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == "", done.stderr[-2000:]


def _private_shm(mib: int) -> list[str] | None:
    """A command prefix that runs under a /dev/shm of `mib` MiB of its own (a mount
    namespace), or None where this host cannot make one."""
    wrap = ["unshare", "--mount", "sh", "-c",
            f'mount -t tmpfs -o size={mib}m tmpfs /dev/shm && exec "$0" "$@"']
    try:
        done = subprocess.run([*wrap, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return wrap if done.returncode == 0 else None


def test_a_full_dev_shm_refuses_the_request_and_the_daemon_serves_on(make_daemon) -> None:
    """/dev/shm full (the KServe pod gives it 2 GiB): an arena segment only ftruncate'd was a
    SIGBUS at its first write, killing the daemon. Its pages are reserved when it is made:
    the request that does not fit is refused RESOURCE_EXHAUSTED; the others are served."""
    wrap = _private_shm(16)
    if wrap is None:
        pytest.skip("needs `unshare --mount` and a tmpfs mount (CAP_SYS_ADMIN) for a small "
                    "/dev/shm of the daemon's own")
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).eval()
    daemon = make_daemon(start=False)
    daemon.wrap = wrap
    daemon.start()
    small, big = torch.randn(2, 1024), torch.randn(3072, 1024)  # big: 2 x 12 MiB a request
    with Client(daemon.target, timeout=120) as client:
        client.load("small", model, (small,))
        with pytest.raises(LoadFailed, match="is full"):  # its check request does not fit
            client.load("big", model, (big,))
        for _ in range(2):
            got = client.infer("small", small)["output0"]
            torch.testing.assert_close(got, model(small).detach(), rtol=1e-4, atol=1e-5)
    assert daemon.proc is not None and daemon.proc.poll() is None
    assert "ArenaFull" in daemon.log() and "SIGBUS" not in daemon.log()


def test_a_block_that_does_not_fit_is_resource_exhausted() -> None:
    from cuvild.core.arena import Arena
    from cuvild.core.errors import ArenaFull
    from cuvild.serve.errors import CODES

    arena = Arena("test-full", segment_bytes=1 << 20, lock=False)
    try:
        with pytest.raises(ArenaFull, match="is full") as err:
            arena.alloc(1 << 50)  # more than any /dev/shm holds
        assert CODES[err.value.kind].name == "RESOURCE_EXHAUSTED"
        assert arena.alloc(4096).size == 4096  # and it goes on
    finally:
        arena.close()


def test_cuda_regions_unix_callers_served_devices_and_counted_use(monkeypatch) -> None:
    """CUDA shared memory (issue 49, 8): a TCP/HTTP caller (no uid) cannot register (a CUDA IPC
    handle means something on this host alone); a device cuvild does not serve is refused
    before any CUDA call (no context made on it); a region unregistered while a request
    copies through it is closed when that copy is done, not under it. The copies themselves
    run on a lent GPU (tests/gpu/check_gpu.py)."""
    from cuvild.serve.cuda_regions import CudaRegion, CudaRegions
    from cuvild.serve.regions import RegionError

    regions = CudaRegions(devices={0})
    called = []
    monkeypatch.setattr(regions, "_runtime", lambda: called.append("runtime"))
    with pytest.raises(RegionError, match="unix socket") as err:
        regions.register(None, "r", b"\0" * 64, 0, 64)
    assert err.value.kind == "denied"
    with pytest.raises(RegionError, match="device 3 is not a GPU cuvild serves"):
        regions.register(1000, "r", b"\0" * 64, 3, 64)
    with pytest.raises(RegionError, match="no CUDA device is served") as err:
        CudaRegions(devices=set()).register(1000, "r", b"\0" * 64, 0, 64)
    assert err.value.kind == "unavailable" and called == []  # CUDA never touched
    closed = []
    monkeypatch.setattr(regions, "_close", closed.append)
    # a registered region, as register() leaves it on a GPU host (no GPU here to open one)
    regions._regions[(1000, "r")] = CudaRegion("r", 0, 64, pointer=0xbeef)  # noqa: SLF001
    with regions._using(1000, "r", 0, 64):  # noqa: SLF001 - what read() and write() hold
        regions.unregister(1000, "r")
        assert closed == []  # in use: kept open
    assert closed == [0xbeef]


def test_cuda_regions_hand_the_workers_references_checked_against_the_region() -> None:
    """With process workers a request's tensor in a CUDA region goes to the workers as a
    reference (issue 50, 5: cuvild/workers/cudamem.py opens it there), within the bytes the
    caller registered; unregistering it names what the workers close."""
    from cuvild.serve.cuda_regions import CudaRegion, CudaRegions
    from cuvild.serve.regions import RegionError
    from cuvild.workers import cudamem

    regions = CudaRegions(devices={0}, direct=True)
    name = cudamem.name(0, b"\1" * 64)
    regions._regions[(1000, "r")] = CudaRegion("r", 0, 64, 0xbeef,  # noqa: SLF001 - as
                                               object_name=name)  # register() leaves it
    ref = regions.ref(1000, "r", 16, "float32", (2, 4), 32)
    assert (ref.segment, ref.offset, ref.dtype, ref.shape, ref.inode) == (
        name, 16, "float32", (2, 4), 0)
    with pytest.raises(RegionError, match="offset 48 \\+ 32 bytes is outside its 64 bytes"):
        regions.ref(1000, "r", 48, "float32", (2, 4), 32)
    with pytest.raises(RegionError, match="unknown CUDA shared-memory region"):
        regions.ref(1001, "r", 0, "float32", (2, 4), 32)  # another caller's: not theirs
    regions._close = lambda pointer: None  # noqa: SLF001 - (nothing opened here)
    assert [r.object_name for r in regions.unregister(1000, "r")] == [name]


def test_status_names_each_parts_signed_artifact_and_a_tampered_one_is_rebuilt(
        make_daemon, tmp_path) -> None:
    torch.manual_seed(0)
    model, x = samples.MLP(width=16, depth=1).eval(), torch.randn(2, 16)
    cache = tmp_path / "cache"
    daemon = make_daemon(cache_dir=str(cache))
    with Client(daemon.target) as client:
        client.load("mlp", model, (x,))
        (summary,) = [m for m in client.status()["models"] if m["name"] == "mlp"]
    (part,) = summary["parts"]
    assert part["artifact"]["verified"] is True and len(part["artifact"]["hash"]) == 16
    assert part["artifact"]["runtime"] == part["runtime"] and part["artifact"]["runtime_version"]
    assert (daemon.state_dir / "cache.key").stat().st_mode & 0o777 == 0o600
    assert daemon.stop() == 0
    for entry in (cache / "compiled").iterdir():  # someone who can write the cache
        victim = next(p for p in sorted(entry.rglob("*")) if p.is_file()
                      and p.name not in ("meta.json", "manifest.json"))
        victim.write_bytes(victim.read_bytes() + b"\0")
    again = make_daemon(state_dir=daemon.state_dir, cache_dir=str(cache))
    with Client(again.target) as client:
        client.wait_ready("mlp")
        torch.testing.assert_close(client.infer("mlp", x)["output0"], model(x).detach(),
                                   rtol=1e-4, atol=1e-5)
    assert "failed verification (files changed" in again.log()
    assert again.log().count("load record not used") == 1  # tried once, then built


def test_an_open_nested_too_deep_is_refused_and_gives_its_slot_back(make_daemon) -> None:
    """JSON nested 5000 deep made json.loads raise RecursionError, which the open's handler
    did not catch: the thread died without releasing the caller's connection slot, and a few
    such opens locked the uid out of the daemon (gRPC too) until restart (issue 49)."""
    torch.manual_seed(0)  # (the MLP the tests above load: restored from its load record)
    model, x = samples.MLP(width=16, depth=1).eval(), torch.randn(2, 16)
    daemon = make_daemon(limits={"max_connections_per_uid": 3})
    with Client(daemon.target) as client:
        client.load("mlp", model, (x,))
    path = str(daemon.socket_path)
    for _ in range(6):  # twice the uid's slots
        for _attempt in range(50):  # the daemon gives the slot back just after its answer
            try:
                sock, reply, mm = open_raw(path, b"[" * 5000)
                break
            except (BrokenPipeError, ConnectionResetError):
                time.sleep(0.1)
        sock.close()
        assert mm is None and reply["code"] == "INVALID_ARGUMENT", reply
    with FastSession(path, "mlp", timeout=10) as session:
        close_to(session.run(x), eager(model, (x,)))
    with Client(daemon.target) as client:
        close_to(list(client.infer("mlp", x).values()), eager(model, (x,)))
