"""The daemon as a user meets it: a real subprocess, a real unix socket, real gRPC."""

from __future__ import annotations

import json
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import yaml
from daemons import worker_processes
from grpc_health.v1 import health_pb2, health_pb2_grpc

import cuvild
from cuvild.client import Client
from cuvild.client.samples import MLP
from protos import cuvil_pb2, cuvil_pb2_grpc
from runtimes.cache import KEY_ENV

ROOT = Path(__file__).resolve().parents[2]


def cuvilctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "import sys; from cuvild.client.cli import main; "
                           "sys.exit(main())", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_status_shows_measured_cpu(daemon):
    with Client(daemon.target) as client:
        status = client.status()
    cpu = next(d for d in status["devices"] if d["kind"] == "cpu")
    assert cpu["peak_gflops"]["fp32"] > 0
    assert cpu["mem_bw_gbs"] > 0
    assert cpu["link_bw_gbs"] > 0 and cpu["launch_us"] > 0
    assert cpu["emulated"] is False
    assert status["models"] == []
    assert status["profile"]["source"] in ("measured", "cache")


def test_emulated_device_is_flagged(daemon):
    with Client(daemon.target) as client:
        devices = client.status()["devices"]
    emulated = [d for d in devices if d["emulated"]]
    if len(devices) < 2:
        pytest.skip("needs 2 cores for the emulated NPU layout")
    assert [d["id"] for d in emulated] == ["npu0"]
    assert emulated[0]["kind"] == "npu" and emulated[0]["peak_gflops"]["fp32"] > 0
    assert "emulated" in emulated[0]["name"].lower()


def test_socket_mode_and_ready(daemon):
    mode = stat.S_IMODE(daemon.socket_path.stat().st_mode)
    assert mode == 0o660
    assert any("READY=1" in m for m in daemon.messages)


def test_the_inspector_starts_with_unknown_bytes_and_known_ones_need_no_torch(make_daemon,
                                                                               tmp_path):
    """A fresh daemon runs no inspector (its forkserver imports torch: seconds of CPU, ~370
    MB) until the header of an upload of bytes never inspected; what the inspection accepted
    is kept in the compile cache, signed, so a second daemon sharing the cache and its key
    registers the same bytes uninspected and, their load record there too, serves them with
    no torch in any process (cuvild/intake/verdicts.py)."""
    cache, key = tmp_path / "cache", tmp_path / "cache.key"

    def fresh() -> Any:
        d = make_daemon(start=False, cache_dir=str(cache))
        d.env[KEY_ENV] = str(key)
        return d.start()

    torch.manual_seed(0)
    model, x = MLP(width=16, depth=1).eval(), torch.randn(2, 16)
    first = fresh()
    assert worker_processes(first.proc.pid, "forkserver") == []
    with Client(first.target) as client:
        client.load("mlp", model, (x,))
    assert "inspected before" not in first.log()
    (forkserver,) = worker_processes(first.proc.pid, "forkserver")
    # its listening socket in the daemon's private directory (gone with it, even killed),
    # not in a /tmp/pymp-* of its own
    sockets = [line.split()[-1] for line in Path("/proc/net/unix").read_text().splitlines()[1:]
               if len(line.split()) > 7]
    ours = [s for s in sockets if f"/cuvild-{first.proc.pid}-" in s and "/listener-" in s]
    assert ours, [s for s in sockets if "listener-" in s]
    # and its (so its workers') temporary files in the daemon's scratch directory, on disk
    # beside the compile cache, gone with it too (ONNX exports stayed in /tmp/cuvil-ort-*)
    env = dict(v.split("=", 1) for v in (forkserver / "environ").read_text().split("\0") if v)
    scratch = Path(env["TMPDIR"])
    assert scratch.parent.name == "scratch" and scratch.name.startswith(
        f"cuvild-{first.proc.pid}-") and scratch.is_dir(), scratch
    first.stop()
    (verdict,) = (cache / "inspected").glob("*.json")
    second = fresh()
    with Client(second.target) as client:
        client.load("mlp", model, (x,))
        with torch.no_grad():
            torch.testing.assert_close(client.infer("mlp", x)["output0"], model(x),
                                       rtol=1e-4, atol=1e-5)
    assert f"archive {verdict.stem[:12]}: inspected before" in second.log()
    assert "(from its load record)" in second.log()
    assert worker_processes(second.proc.pid, "forkserver") == []
    for pid in [second.proc.pid] + [int(p.name) for p in worker_processes(second.proc.pid)]:
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), pid


def test_health_and_reflection(daemon):
    with grpc.insecure_channel(daemon.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "cuvil.v1.Control"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(stub.ServerReflectionInfo(iter([request]), timeout=10))
        names = {s.name for s in reply.list_services_response.service}
        assert {"cuvil.v1.Control", "inference.GRPCInferenceService",
                "grpc.health.v1.Health"} <= names


def test_cuvilctl_status_human_and_json(daemon):
    human = cuvilctl("--target", daemon.target, "status")
    assert human.returncode == 0, human.stderr
    assert "cpu0" in human.stdout and "FP32 GFLOP/s" in human.stdout
    as_json = cuvilctl("--target", daemon.target, "status", "--json")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert {"version", "uptime_s", "devices", "models", "profile"} <= set(doc)
    assert set(doc["devices"][0]) >= {"peak_gflops", "mem_bw_gbs", "link_bw_gbs",
                                      "link_latency_us", "launch_us", "memory_gb"}


def test_cuvilctl_dead_daemon_is_one_line_exit_1(tmp_path):
    result = cuvilctl("--target", f"unix://{tmp_path}/absent.sock", "--timeout", "2", "status")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "cannot reach cuvild" in result.stderr
    assert "Traceback" not in result.stderr


def test_sigterm_exits_0_and_removes_socket(make_daemon):
    d = make_daemon()
    d.signal(signal.SIGTERM)
    assert d.stop() == 0
    assert not d.socket_path.exists()
    d.wait_for("STOPPING=1", timeout=5)


def test_warm_start_uses_cached_profile(make_daemon):
    first = make_daemon()  # may measure (when the session has no cached profile yet)
    first.stop()
    d = make_daemon(state_dir=first.state_dir)
    with Client(d.target) as client:
        status = client.status()
    assert status["profile"]["source"] == "cache"
    # Readiness is timed by `make bench`; tests only check the cache was used.
    print(f"warm start ready in {d.ready_s:.3f} s (spawn to READY=1)")


def test_stale_socket_is_replaced(make_daemon):
    d = make_daemon(start=False)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(d.socket_path))  # bound, never listening, then closed: a crashed run
    stale.close()
    d.start()
    with Client(d.target) as client:
        assert client.status()["version"]


def test_live_socket_is_refused(make_daemon, daemon):
    d = make_daemon(start=False, listen={"unix": str(daemon.socket_path)})
    d.start(wait=False)
    assert d.proc.wait(60) == 1
    assert "already serving" in d.log()
    with Client(daemon.target) as client:  # the running one is untouched
        assert client.status()["version"]


def test_sighup_reloads_and_survives_bad_config(make_daemon, monkeypatch):
    d = make_daemon(start=False)
    # (started as a user would, without the test process's inductor and Triton cache settings
    # (tests/daemons.py): its workers keep those caches under its cache_dir)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_of_the_tests")
    d.start()
    config = yaml.safe_load(d.config_path.read_text())
    config["log_level"] = "debug"  # (the workers' too: said by the one the next load starts)
    config.setdefault("shm", {})["fast_path"] = False  # read at start only: said so
    config.setdefault("limits", {})["max_connections"] = 9
    config.setdefault("engine", {})["runtimes"] = {"cpu": ["torch"]}  # applied
    d.config_path.write_text(yaml.safe_dump(config))
    d.signal(signal.SIGHUP)
    d.wait_for("config reloaded", timeout=60)
    assert "reload: limits.max_connections, shm.fast_path take(s) effect on restart" in d.log()
    torch.manual_seed(0)
    with Client(d.target) as client:  # the next load plans with the runtimes reloaded
        on_cpu = cuvild.partition(device="cpu")(MLP(width=16, depth=1).eval())
        client.load("mlp", on_cpu, (torch.randn(2, 16),))
        parts = client.plan("mlp")["plan"]["parts"]
        assert {p["runtime"] for p in parts if p["device"].startswith("cpu")} == {"torch"}
    cache = Path(yaml.safe_load(d.config_path.read_text())["cache_dir"])
    workers = worker_processes(d.proc.pid)
    assert workers
    for worker in workers:
        env = dict(v.split(b"=", 1) for v in (worker / "environ").read_bytes().split(b"\0")
                   if b"=" in v)
        assert env.get(b"TORCHINDUCTOR_CACHE_DIR") == str(cache / "inductor").encode()
        assert env.get(b"TRITON_CACHE_DIR") == str(cache / "triton").encode()
    assert "DEBUG cuvild.workers.worker [cuvil-cpu0]: log level debug, as the daemon's config " \
           "reload set it" in d.log(), d.log()[-3000:]
    d.config_path.write_text("listen: {unix: 7}\n")
    d.signal(signal.SIGHUP)
    d.wait_for("reload failed", timeout=60)
    with grpc.insecure_channel(d.target) as channel:
        stub = cuvil_pb2_grpc.ControlStub(channel)
        assert stub.GetStatus(cuvil_pb2.GetStatusRequest(), timeout=10).version
    assert d.stop() == 0


def test_cuvilctl_reload_answers_once_reloaded(make_daemon):
    """`cuvilctl reload`: what `kill -HUP` did, without finding the daemon's pid (its process is
    a Python script: `pidof cuvild` finds nothing), over the socket, answered once done."""
    d = make_daemon()
    config = yaml.safe_load(d.config_path.read_text())
    config.setdefault("limits", {})["max_connections"] = 9  # read at start only: said so
    d.config_path.write_text(yaml.safe_dump(config))
    cli = [sys.executable, "-m", "cuvild.client.cli", "--target", d.target, "reload"]
    done = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["ok"] and result["on_restart"] == ["limits.max_connections"], result
    assert result["config_path"] == str(d.config_path)
    d.config_path.write_text("listen: {unix: 7}\n")
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "reload failed, the running config stays" in done.stderr
    with Client(d.target) as client:
        assert client.status()["version"]


def test_profile_refresh_remeasures(daemon):
    with Client(daemon.target) as client:
        result = client.profile(refresh=True)
    assert result["profile"]["source"] == "measured"
    assert result["devices"][0]["peak_gflops"]["fp32"] > 0
