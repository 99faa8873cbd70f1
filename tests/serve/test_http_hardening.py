"""The HTTP listener and the metrics port against a hostile client (issue 49, findings 1, 2
and 4): nothing is inflated, bodies are bounded and checked before they cost anything,
connections are capped and timed out, and every bad field is a 4xx naming it with no
traceback in the log. One daemon with small limits (limits.http) for the file."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemons import DaemonProcess, free_port, suite_config

from cuvild.client import Client, samples

pytestmark = pytest.mark.daemon
TOKEN = "t" * 40
LIMITS = {"max_body_bytes": 1 << 20, "max_json_bytes": 256 << 10, "max_connections": 24,
          "header_timeout_s": 1, "body_timeout_s": 2, "keepalive_s": 2, "bodies_at_once": 2}


class Bytes(torch.nn.Module):
    """Takes uint8 (an image's bytes): JSON data of 300 overflowed numpy into a 500."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * 2.0


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory, state_root: Path,
            sock_dir: Path) -> Iterator[tuple[DaemonProcess, str, str]]:
    workdir = tmp_path_factory.mktemp("http-hard")
    http, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = suite_config(workdir, workdir / "state", sock_dir,
                          listen={"http": http, "token": TOKEN},
                          limits={"http": LIMITS}, metrics={"listen": metrics})
    daemon = DaemonProcess(workdir, config, profiles=state_root).start()
    torch.manual_seed(0)
    with Client(daemon.target) as client:
        client.load("mlp", samples.MLP(width=16, depth=1).eval(), (torch.randn(2, 16),))
        client.load("bytes", Bytes(), (torch.zeros(2, 4, dtype=torch.uint8),))
    yield daemon, http, metrics
    daemon.close()


def post(address: str, path: str, body: bytes, headers: dict[str, str] | None = None,
         token: str = TOKEN) -> tuple[int, dict]:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=body, headers={
            "Authorization": f"Bearer {token}", "Content-Type": "application/json",
            **(headers or {})})
        reply = conn.getresponse()
        text = reply.read()
        return reply.status, json.loads(text) if text else {}
    finally:
        conn.close()


def tensor(datatype: str = "FP32", shape: list | None = None, data: list | None = None,
           name: str = "x", **extra: object) -> bytes:
    shape = [2, 16] if shape is None else shape
    data = [0.5] * 32 if data is None else data
    return json.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": shape,
                                   "data": data, **extra}]}).encode()


def threads_and_files(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def test_a_compressed_body_is_never_inflated(hostile):
    daemon, address, _ = hostile
    bomb = gzip.compress(b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2,16],"data":['
                         + b"0," * (8 << 20) + b"0]}]}")
    assert len(bomb) < 64 << 10  # 16 MiB of JSON in a few KB
    status, doc = post(address, "/v2/models/mlp/infer", bomb, {"Content-Encoding": "gzip"})
    assert status == 415 and "Content-Encoding" in doc["error"], doc
    status, doc = post(address, "/v2/models/mlp/infer", b" " * (2 << 20))
    assert status == 413, doc  # over limits.http.max_body_bytes
    status, doc = post(address, "/v2/models/mlp/infer", tensor(data=[0.5] * (100 << 10)))
    assert status == 413 and "limits.http.max_json_bytes" in doc["error"], doc
    status, doc = post(address, "/v2/models/nothing/infer", b"[" * (512 << 10))
    assert status == 404 and "unknown model 'nothing'" in doc["error"], doc


@pytest.mark.parametrize("body, says", [
    (tensor(datatype="INT32", data=[1] * 32), "expected dtype float32 (FP32), got int32"),
    (tensor(shape=[2, 17], data=[0.5] * 34), "shape [2, 17], the model takes [2, 16]"),
    (tensor(shape=[2**64 - 1, 16]), "'shape' must be a list of sizes"),
    (tensor(name="y"), "unknown input 'y'"),
    (tensor(parameters={"shared_memory_region": "r", "shared_memory_offset": 2**63}),
     "in [0, 2^63)"),
    (tensor(data="zeros"), "'data' must be a list of 32 values"),
])
def test_bad_fields_are_400s_naming_them(hostile, body, says):
    daemon, address, _ = hostile
    status, doc = post(address, "/v2/models/mlp/infer", body)
    assert status == 400 and says in doc["error"], (status, doc)


def test_values_and_headers_past_their_range_are_4xx_without_a_traceback(hostile):
    daemon, address, _ = hostile
    status, doc = post(address, "/v2/models/bytes/infer",
                       tensor("UINT8", [2, 4], [300] * 8))
    assert status == 400 and "'data' is not UINT8 values" in doc["error"], doc
    status, doc = post(address, "/v2/models/mlp/infer", tensor(),
                       {"Inference-Header-Content-Length": "\u00b2"})
    assert status == 400 and "Inference-Header-Content-Length" in doc["error"], doc
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:  # a non-ASCII token
        raw.sendall(b"GET /v2/models/mlp HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff"
                    b"\r\nConnection: close\r\n\r\n")
        assert raw.recv(64).startswith(b"HTTP/1.1 401"), "a bad token byte is a 401"
    status, doc = post(address, "/v2/models/bytes/infer", tensor("UINT8", [2, 4], [3] * 8))
    assert status == 200 and doc["outputs"][0]["data"] == [6.0] * 8, doc
    assert "Traceback" not in daemon.log()


def test_slow_and_idle_connections_are_closed_and_capped(hostile):
    """Half-sent requests (no token: the headers never end) are closed after
    header_timeout_s, idle ones after keepalive_s; past max_connections a new one gets a 503;
    the daemon's open files come back down."""
    daemon, address, _ = hostile
    host, port = address.split(":")
    assert daemon.proc is not None
    _, files0 = threads_and_files(daemon.proc.pid)
    held = []
    for _ in range(LIMITS["max_connections"] + 6):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n")  # never ends
        held.append(s)
    cap = LIMITS["max_connections"]
    for s in held[cap:]:
        s.settimeout(5)
        assert s.recv(12) == b"HTTP/1.1 503"  # past the cap: refused at once
    for s in held[:cap]:
        s.settimeout(10)
        assert s.recv(64) == b"", "closed by the daemon after header_timeout_s"
    for s in held:
        s.close()
    deadline = time.monotonic() + 5
    while threads_and_files(daemon.proc.pid)[1] > files0 + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert threads_and_files(daemon.proc.pid)[1] <= files0 + 2
    status, _ = post(address, "/v2/models/mlp/infer", tensor())  # and it serves
    assert status == 200


def test_the_metrics_port_holds_no_thread_or_file_per_idle_connection(hostile):
    daemon, _, metrics = hostile
    host, port = metrics.split(":")
    assert daemon.proc is not None
    threads0, files0 = threads_and_files(daemon.proc.pid)
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(40)]
    threads1, _ = threads_and_files(daemon.proc.pid)
    assert threads1 <= threads0 + 1  # prometheus_client's server: one thread a connection
    time.sleep(LIMITS["header_timeout_s"] + LIMITS["keepalive_s"] + 1)
    assert threads_and_files(daemon.proc.pid)[1] <= files0 + 2, "the idle ones were closed"
    for s in idle:
        s.close()
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/metrics")
    reply = conn.getresponse()
    assert reply.status == 200 and b"cuvil_inference_request_success" in reply.read()
    conn.close()
