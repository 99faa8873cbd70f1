"""Model intake through the daemon: upload, list, survive restarts, refuse bad archives."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import sys
import threading
import time
import zipfile
from pathlib import Path

import grpc
import pytest
import torch

import cuvild
from cuvild.client import AlreadyExists, Client, InvalidArgument, NotFound
from protos import cuvil_pb2, cuvil_pb2_grpc

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/: daemons.py
from daemons import worker_processes  # noqa: E402


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = cuvild.partition(device="npu", precision="fp32")(torch.nn.Linear(8, 16))
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def seeded(seed: int = 0) -> tuple[Net, torch.Tensor]:
    """Net and an input, the same in every test for a seed: the same archive, so a daemon of
    a later test restores its build from the session's compile cache (tests/conftest.py)."""
    torch.manual_seed(seed)
    return Net().eval(), torch.randn(2, 8)


def save_archive(path: Path, seed: int = 0) -> Path:
    """The seeded Net's archive at `path`; saved through a buffer, so that its folder inside
    the zip is not named after the file and the bytes are the same whatever `path` is."""
    net, x = seeded(seed)
    buffer = io.BytesIO()
    torch.export.save(cuvild.export(net, (x,)), buffer)
    path.write_bytes(buffer.getvalue())
    return path


def raw_upload(target: str, data: bytes, *, name: str = "m", size: int | None = None,
               sha256: str | None = None) -> grpc.RpcError | cuvil_pb2.LoadModelResponse:
    header = cuvil_pb2.LoadModelHeader(
        name=name, sha256=sha256 or hashlib.sha256(data).hexdigest(),
        size_bytes=len(data) if size is None else size)

    def requests():
        yield cuvil_pb2.LoadModelRequest(header=header)
        for i in range(0, len(data), 1 << 16):
            yield cuvil_pb2.LoadModelRequest(chunk=data[i:i + (1 << 16)])

    with grpc.insecure_channel(target) as channel:
        try:
            return cuvil_pb2_grpc.ControlStub(channel).LoadModel(requests(), timeout=60)
        except grpc.RpcError as err:
            return err


def assert_no_residue(state_dir: Path) -> None:
    assert list((state_dir / "uploads").iterdir()) == []
    assert [p.name for p in (state_dir / "models").iterdir() if p.name != "index.json"] == []


def test_load_lists_and_survives_restart(make_daemon):
    d = make_daemon()
    seen = []
    with Client(d.target) as client:
        net, x = seeded()
        result = client.load("net", net, (x,),
                             progress=lambda sent, total: seen.append((sent, total)))
        assert result["already_present"] is False
        model = result["model"]
        assert model["annotated_nodes"] > 0 and model["num_nodes"] >= 3
        assert model["inputs"] == [{"name": "x", "dtype": "float32", "shape": [2, 8]}]
        assert seen and seen[-1][0] == seen[-1][1] == model["size_bytes"]
        assert [m["name"] for m in client.models()] == ["net"]
    d.stop()
    again = make_daemon(state_dir=d.state_dir)
    with Client(again.target) as client:
        models = client.models()
        assert [(m["name"], m["sha256"]) for m in models] == [("net", model["sha256"])]
        assert client.status()["models"][0]["name"] == "net"


def test_versions_replace_and_unload(make_daemon, tmp_path):
    d = make_daemon()
    a = save_archive(tmp_path / "a.pt2")
    b = save_archive(tmp_path / "b.pt2", seed=1)  # other weights: different content
    with Client(d.target) as client:
        client.load_file("m", a)
        assert client.load_file("m", a)["already_present"] is True
        with pytest.raises(AlreadyExists) as err:
            client.load_file("m", b)
        assert "new version, or replace it (Python: replace=True" in err.value.message
        client.load_file("m", b, version="2")
        assert sorted(m["version"] for m in client.models()) == ["1", "2"]
        client.load_file("m", b, replace=True)  # version 1 now has b's content
        assert len({m["sha256"] for m in client.models()}) == 1
        assert len(list((d.state_dir / "models").glob("*.pt2"))) == 1  # a's archive is gone
        removed = client.unload("m")
        assert {m["version"] for m in removed} == {"1", "2"}
        assert client.models() == []
        with pytest.raises(NotFound):
            client.unload("m")
    assert_no_residue(d.state_dir)


def test_bad_uploads_get_clear_errors_and_leave_nothing(make_daemon, tmp_path):
    d = make_daemon(limits={"max_model_bytes": 1 << 20})
    good = save_archive(tmp_path / "good.pt2").read_bytes()
    cases = {
        "truncated upload": raw_upload(d.target, good[: len(good) // 2], size=len(good)),
        "size_bytes: expected > 0": raw_upload(d.target, b""),
        "exceeds limits.max_model_bytes": raw_upload(d.target, b"x" * 10, size=(1 << 20) + 1),
        "sha256 mismatch": raw_upload(d.target, good, sha256="0" * 64),
        "zip": raw_upload(d.target, os.urandom(4096)),
        "more bytes than the declared": raw_upload(d.target, good, size=len(good) - 1),
        "name": raw_upload(d.target, good, name="../escape"),
    }
    for needle, reply in cases.items():
        assert isinstance(reply, grpc.RpcError), needle
        assert reply.code() == grpc.StatusCode.INVALID_ARGUMENT, (needle, reply.details())
        assert needle in reply.details(), (needle, reply.details())
    with Client(d.target) as client:  # still serving, nothing registered
        assert client.models() == []
    assert_no_residue(d.state_dir)


def test_bytes_that_are_no_zip_are_refused_without_starting_torch(make_daemon):
    """The inspector's forkserver (torch, resident) and the load path (torch in the daemon)
    start as an upload's first bytes arrive only where those begin as a zip does: junk is
    refused by the daemon itself, which stays as light as it was."""
    d = make_daemon()
    reply = raw_upload(d.target, b"\x80\x04 this is no zip at all" * 64)
    assert isinstance(reply, grpc.RpcError)
    assert reply.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a readable zip archive" in reply.details(), reply.details()
    assert worker_processes(d.proc.pid, "forkserver") == []
    assert "imported ahead" not in d.log()
    with Client(d.target) as client:
        assert client.models() == []


def test_crafted_archive_is_refused_and_runs_nothing(make_daemon, tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    import pickle

    good = save_archive(tmp_path / "good.pt2")
    crafted = tmp_path / "crafted.pt2"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(crafted, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if "sample_inputs" in item.filename:
                data = pickle.dumps(Payload())
            dst.writestr(item, data)
    d = make_daemon()
    reply = raw_upload(d.target, crafted.read_bytes())
    assert isinstance(reply, grpc.RpcError)
    assert reply.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "refused" in reply.details()
    assert not marker.exists()
    assert_no_residue(d.state_dir)


def test_sigkill_mid_upload_leaves_registry_consistent(make_daemon, tmp_path, shared_cache):
    d = make_daemon()
    archive = save_archive(tmp_path / "m.pt2")
    with Client(d.target) as client:
        client.load_file("kept", archive)
    data = archive.read_bytes() * 8  # a bigger upload that never finishes
    started = threading.Event()

    def requests():
        yield cuvil_pb2.LoadModelRequest(header=cuvil_pb2.LoadModelHeader(
            name="half", sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data)))
        yield cuvil_pb2.LoadModelRequest(chunk=data[: len(data) // 2])
        started.set()
        time.sleep(30)

    def upload():
        with grpc.insecure_channel(d.target) as channel:
            try:
                cuvil_pb2_grpc.ControlStub(channel).LoadModel(requests(), timeout=60)
            except grpc.RpcError:
                pass

    thread = threading.Thread(target=upload, daemon=True)
    thread.start()
    assert started.wait(30)
    deadline = time.monotonic() + 10
    while not any((d.state_dir / "uploads").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    (scratch,) = (shared_cache / "scratch").glob(f"cuvild-{d.proc.pid}-*")  # workers' TMPDIR
    d.signal(signal.SIGKILL)
    d.proc.wait(10)
    again = make_daemon(state_dir=d.state_dir)
    with Client(again.target) as client:
        assert [m["name"] for m in client.models()] == ["kept"]
    assert list((d.state_dir / "uploads").iterdir()) == []
    assert len(list((d.state_dir / "models").glob("*.pt2"))) == 1
    assert not scratch.exists()  # reclaimed by the next start, as the private directory is
    (own,) = (shared_cache / "scratch").glob(f"cuvild-{again.proc.pid}-*")
    assert again.stop() == 0 and not own.exists()  # removed at a clean stop


def test_cuvilctl_load_models_unload(make_daemon, tmp_path):
    import json
    import subprocess
    import sys

    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cuvild.client.cli", "--target", d.target,
                               *args], capture_output=True, text=True, timeout=120)

    d = make_daemon()
    archive = save_archive(tmp_path / "net.pt2")
    loaded = ctl("load", "net", str(archive))
    assert loaded.returncode == 0, loaded.stderr
    assert "net version 1 registered" in loaded.stdout
    listed = json.loads(ctl("models", "--json").stdout)
    assert [m["name"] for m in listed] == ["net"] and listed[0]["annotated_nodes"] > 0
    assert "net" in ctl("models").stdout
    refused = ctl("load", "net", str(tmp_path / "missing.pt2"))
    assert refused.returncode == 1 and "no such file" in refused.stderr
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"not a zip at all")
    refused = ctl("load", "bad", str(bad))
    assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert ctl("unload", "net").returncode == 0
    assert json.loads(ctl("models", "--json").stdout) == []


def test_dynamic_batch_through_the_protocol(make_daemon):
    from cuvild.client.samples import MLP

    torch.manual_seed(0)
    model = MLP(width=16, depth=1).eval()
    batch = torch.export.Dim("batch", min=1, max=4)
    d = make_daemon()
    with Client(d.target) as client:
        client.load("dyn", model, (torch.randn(2, 16),), dynamic_shapes=({0: batch},))
        deadline = time.monotonic() + 300
        while client.models()[0]["state"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.models()[0]["state"] == "ready"
        assert client.metadata("dyn")["inputs"][0]["shape"] == [-1, 16]
        for n in (1, 3):
            x = torch.randn(n, 16)
            for shm in (False, True):
                out = client.infer("dyn", x, shm=shm)["output0"]
                assert tuple(out.shape) == (n, 16)
                with torch.no_grad():
                    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
        with pytest.raises(InvalidArgument) as err:
            client.infer("dyn", torch.randn(5, 16))
        assert "dim 0 is 5, outside the exported range [1, 4]" in err.value.message


def test_thread_workers_serve_the_two_device_demo(make_daemon):
    """engine.workers: thread runs parts in the daemon's own threads (no worker processes);
    the demo layout's two devices still split the model and answer like eager."""
    from cuvild.client.samples import reference

    model, inputs = reference("demo")
    d = make_daemon(engine={"workers": "thread"})
    with Client(d.target) as client:
        client.load("demo", model, inputs)
        deadline = time.monotonic() + 300
        while client.models()[0]["state"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.models()[0]["state"] == "ready", d.log()[-2000:]
        devices = {p["device"] for p in client.plan("demo")["plan"]["parts"]}
        with torch.no_grad():
            expected = model(*inputs)
        for shm in (False, True):
            out = client.infer("demo", *inputs, shm=shm)["output0"]
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    outs: list[torch.Tensor] = []

    def hammer() -> None:  # concurrent requests: parts run in several request threads
        with Client(d.target) as c:
            outs.extend(c.infer("demo", *inputs)["output0"] for _ in range(5))

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outs) == 20
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert len(devices) == 2 and worker_processes(d.proc.pid) == []
