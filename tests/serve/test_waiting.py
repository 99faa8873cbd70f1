"""Waiting for READY: Client.load and `cuvilctl load` return once the model serves (or say
why it cannot), and OIP ServerReady holds a readiness probe while any model still loads.
One daemon for the module; each test loads its own models."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from daemons import DaemonProcess, own_registry_daemon, worker_processes

import cuvild
from cuvild.client import Client, LoadFailed, samples
from protos import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.daemon
BUILD_FAILED = r"InferError: building part p\d+ for cpu0 failed: .*fp16"


class Overflow(torch.nn.Module):
    """A part pinned to the CPU at fp16 whose inputs overflow fp16, so the load fails in that
    part on every host, each for its own reason: on a CPU without avx512_fp16 no runtime runs
    fp16 there; on one with it, OpenVINO runs it in fp16 and its outputs are inf/NaN, which
    the check refuses (it once took NaN for exact: tests/runtimes/test_error.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = cuvild.partition(device="cpu", precision="fp16")(torch.nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x * 1e6)


@pytest.fixture(scope="module")
def daemon_w(tmp_path_factory: pytest.TempPathFactory, state_root: Path,
             sock_dir: Path) -> Iterator[DaemonProcess]:
    daemon = own_registry_daemon(tmp_path_factory.mktemp("waiting"), state_root, sock_dir)
    yield daemon
    daemon.close()


def server_ready(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        return stub.ServerReady(inference_pb2.ServerReadyRequest(), timeout=10).ready


def cuvilctl(target: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cuvild.client.cli", "--target", target,
                           *args], capture_output=True, text=True, timeout=300)


def test_load_returns_once_ready_and_the_first_infer_runs(daemon_w):
    torch.manual_seed(0)
    model, x = samples.MLP(width=64, depth=2).eval(), torch.randn(2, 64)
    phases: list[str] = []
    with Client(daemon_w.target) as client:
        result = client.load("mlp", model, (x,), on_phase=phases.append)
        assert result["state"] == "ready", daemon_w.log()[-3000:]
        assert result["model"]["state"] == "ready" and result["wait_s"] > 0
        assert phases and result["phase"] == phases[-1]
        assert result["model"]["load_s"] > 0 and result["model"]["warm"] is False
        out = client.infer("mlp", x)["output0"]  # no polling in between
        with torch.no_grad():
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
        listed = next(m for m in client.models() if m["name"] == "mlp")
        assert {"phase", "warm", "load_s"} <= set(listed)
    # torch and the loader imported from the upload's start, beside its inspection
    assert "the load path imported ahead of the first upload" in daemon_w.log()


def test_no_wait_returns_while_loading_and_server_ready_holds(daemon_w):
    torch.manual_seed(1)
    model, x = samples.MLP(width=48, depth=3).eval(), torch.randn(2, 48)
    assert server_ready(daemon_w.target)
    with Client(daemon_w.target) as client:
        result = client.load("later", model, (x,), wait=False)
        assert result["state"] == "loading" and result["wait_s"] == 0
        assert not server_ready(daemon_w.target)  # a probe holds traffic while it builds
        ready = client.wait_ready("later", timeout=300)
        assert ready["state"] == "ready", daemon_w.log()[-3000:]
        assert server_ready(daemon_w.target)
        with torch.no_grad():
            torch.testing.assert_close(client.infer("later", x)["output0"], model(x),
                                       rtol=1e-4, atol=1e-5)


def test_a_failed_build_raises_naming_the_part(daemon_w):
    with Client(daemon_w.target) as client:
        with pytest.raises(LoadFailed, match=BUILD_FAILED) as err:
            client.load("overflow", Overflow().eval(), (torch.randn(2, 8),))
        assert err.value.name == "overflow" and err.value.version == "1"
        listed = next(m for m in client.models() if m["name"] == "overflow")
        assert listed["state"] == f"unavailable: {err.value}"
    assert server_ready(daemon_w.target)  # a failed model does not hold the others' traffic


def test_cuvilctl_load_waits_and_says_why_it_failed(daemon_w, tmp_path):
    torch.manual_seed(2)
    good, bad = tmp_path / "good.pt2", tmp_path / "bad.pt2"
    torch.export.save(cuvild.export(samples.MLP(width=32, depth=1).eval(),
                                    (torch.randn(2, 32),)), good)
    torch.export.save(cuvild.export(Overflow().eval(), (torch.randn(2, 8),)), bad)
    loaded = cuvilctl(daemon_w.target, "load", "good", str(good), "--json")
    assert loaded.returncode == 0, loaded.stderr
    result = json.loads(loaded.stdout)  # one document, printed once it is ready
    assert result["state"] == "ready" and result["model"]["name"] == "good"
    assert {"phase", "wait_s"} <= set(result)
    phases = [json.loads(line) for line in loaded.stderr.splitlines() if line.startswith("{")]
    assert phases and all(p["model"] == "good" and p["phase"] for p in phases)
    failed = cuvilctl(daemon_w.target, "load", "bad", str(bad))
    assert failed.returncode == 1
    assert "bad version 1 failed to load: InferError: building part" in failed.stderr
    assert "Traceback" not in failed.stderr
    status = cuvilctl(daemon_w.target, "status")
    assert status.returncode == 0 and "PHASE" in status.stdout
    assert "bad:1 unavailable: InferError: building part" in status.stdout


class OnNpu(torch.nn.Module):
    """Wholly on the emulated NPU (OpenVINO): every part has a cached build to restore."""

    def __init__(self) -> None:
        super().__init__()
        self.body = cuvild.partition(device="npu")(torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_restart_serves_from_the_load_record(make_daemon, tmp_path):
    """A restarted daemon serves a registered model from its load record: nothing read from
    the archive, planned or compiled (the daemon's load counters), the same outputs."""
    torch.manual_seed(0)
    net, x = OnNpu().eval(), torch.randn(2, 8)
    with torch.no_grad():
        expected = net(x)
    cache = tmp_path / "cache"
    first = make_daemon(cache_dir=str(cache))
    with Client(first.target) as client:
        loaded = client.load("onnpu", net, (x,))
        assert loaded["state"] == "ready" and loaded["model"]["warm"] is False
        (out,) = client.infer("onnpu", x).values()
        torch.testing.assert_close(out, expected)
        assert client.stats(interval=0.01)["loads"]["planned"] == 1
    first.stop()
    again = make_daemon(state_dir=first.state_dir, cache_dir=str(cache))
    with Client(again.target) as client:
        client.wait_ready("onnpu", timeout=120)
        (model,) = client.models()
        assert model["state"] == "ready" and model["warm"] is True, model
        assert model["phase"] == "ready"
        assert client.stats(interval=0.01)["loads"] == {"restored": 1}
        (out,) = client.infer("onnpu", x).values()
        torch.testing.assert_close(out, expected)
    # restored and served without torch, in the daemon and in its workers
    for pid in [again.proc.pid] + [int(p.name) for p in worker_processes(again.proc.pid)]:
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), pid
    assert "(from its load record)" in again.log()
    # nor in the uploads' inspector: a daemon that restores models starts it at an upload
    assert worker_processes(again.proc.pid, "forkserver") == []
    assert "archive inspector starting" not in again.log()
