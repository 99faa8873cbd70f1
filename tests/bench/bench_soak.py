"""Soak (a `make bench` section, `make bench SECTION=soak`): SOAK_S seconds of valid and hostile
HTTP and gRPC traffic against one daemon, as issue 49 asked. Hostile: gzip bodies, bodies over
the limit, JSON nested deep, wrong dtypes and shapes, shapes of 2^64-1, UINT8 values of 300,
bad header lengths, non-ASCII tokens, half-sent requests and idle connections on the HTTP and
metrics ports, shapes without data, fast-path opens nested 5000 deep. Valid: tritonclient
requests over gRPC and HTTP, timed. Every loop is bounded in count and in time, on loopback
and the unix socket only.

Reported: crashes (the daemon must stay up), peak RSS of the daemon's process tree against
its idle RSS plus what the valid requests' working set added, open files and threads after
against before, and the valid requests' p50/p99."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests"))
import grpc  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from daemons import DaemonProcess, free_port, suite_config  # noqa: E402

from cuvild.client import Client, samples  # noqa: E402
from protos import fastpath as wire  # noqa: E402
from protos import inference_pb2 as pb  # noqa: E402
from protos import inference_pb2_grpc  # noqa: E402

SOAK_S = float(os.environ.get("SOAK_S", "60"))
MAX_HOSTILE = 20000  # requests, whatever the time
TOKEN = "s" * 40


def tree(pid: int) -> list[int]:
    """The daemon and its descendants (workers, forkserver)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        todo += [int(c) for c in children]
    return out


def rss_mib(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def files_threads(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def thread_names(pid: int) -> dict[str, int]:
    names: dict[str, int] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    return names


def http_post(address: str, path: str, body: bytes, headers: dict[str, str]) -> int:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {TOKEN}",
                                                       **headers})
        reply = conn.getresponse()
        reply.read()
        return reply.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


def hostile_http(address: str) -> list[tuple[bytes, dict[str, str]]]:
    def tensor(datatype: str, shape: list[int], data: object) -> bytes:
        return json.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": shape,
                                       "data": data}]}).encode()
    bomb = gzip.compress(b'{"inputs":[{"name":"x","data":[' + b"0," * (1 << 20) + b"0]}]}")
    return [(bomb, {"Content-Encoding": "gzip"}),
            (b" " * (2 << 20), {}),
            (b"[" * 100_000, {}),
            (tensor("INT32", [2, 16], [1] * 32), {}),
            (tensor("FP32", [2**64 - 1, 16], [0.5] * 32), {}),
            (tensor("FP32", [3, 16], [0.5] * 48), {}),
            (tensor("FP32", [2, 16], [0.5] * 32), {"Inference-Header-Content-Length": "\u00b2"}),
            (tensor("FP32", [2, 16], "zeros"), {})]


def hostile_sockets(http_address: str, metrics_address: str, sock_path: str) -> None:
    """Half-sent requests and idle connections, and fast-path opens nested deep (each closed
    by the test after a moment: the daemon's own timeouts are what the soak shows)."""
    held = []
    for address in (http_address, metrics_address):
        host, port = address.split(":")
        for _ in range(20):
            try:
                s = socket.create_connection((host, int(port)), timeout=5)
                s.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n")
                held.append(s)
            except OSError:
                pass
    for _ in range(5):
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(sock_path)
            body = b"[" * 5000
            s.sendall(wire.OPEN.pack(wire.MAGIC, wire.VERSION, len(body)) + body)
            s.recv(64)
            held.append(s)
        except OSError:
            pass
    time.sleep(0.5)
    for s in held:
        s.close()


def main() -> None:  # noqa: C901, PLR0915 - set up, warm up, soak, report, in order
    work, sock = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp(dir="/tmp"))
    http, tcp, metrics = (f"127.0.0.1:{free_port()}" for _ in range(3))
    config = suite_config(work, work / "state", sock, log_level="info",
                          listen={"http": http, "tcp": tcp, "token": TOKEN},
                          metrics={"listen": metrics},
                          limits={"http": {"header_timeout_s": 2, "keepalive_s": 5}})
    daemon = DaemonProcess(work, config).start()
    try:
        torch.manual_seed(0)
        model, x = samples.MLP(width=16, depth=2).eval(), torch.randn(2, 16)
        with Client(daemon.target) as client:
            client.load("mlp", model, (x,))
            client.load("dyn", model, (x,), batching=False,
                        dynamic_shapes=({0: torch.export.Dim("batch", max=64)},))
        assert daemon.proc is not None
        pid = daemon.proc.pid
        xn = x.numpy()
        meta = [("authorization", f"Bearer {TOKEN}")]
        g = grpcclient.InferenceServerClient(url=tcp)
        h = httpclient.InferenceServerClient(url=http)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        # the baseline after a warm-up: the listeners' thread pools grow on first use (up
        # to limits.rpc_threads) and stay; that is their size, not a leak
        for _ in range(200):
            given = grpcclient.InferInput("x", [2, 16], "FP32")
            given.set_data_from_numpy(xn)
            g.infer("mlp", [given], headers=dict(meta))
            hg = httpclient.InferInput("x", [2, 16], "FP32")
            hg.set_data_from_numpy(xn)
            h.infer("mlp", [hg], headers=dict(auth))
        for body, headers in hostile_http(http):
            http_post(http, "/v2/models/mlp/infer", body, headers)
        time.sleep(8)
        idle_rss = rss_mib(tree(pid))
        files0, threads0 = files_threads(pid)
        names0 = thread_names(pid)
        stop = time.monotonic() + SOAK_S
        valid: list[float] = []
        counts = {"hostile http": 0, "hostile grpc": 0, "socket rounds": 0, "valid": 0}
        peak = [idle_rss]

        def watch() -> None:
            while time.monotonic() < stop + 1:
                peak[0] = max(peak[0], rss_mib(tree(pid)))
                time.sleep(0.2)

        def valid_loop() -> None:
            while time.monotonic() < stop and counts["valid"] < 100_000:
                given = grpcclient.InferInput("x", [2, 16], "FP32")
                given.set_data_from_numpy(xn)
                t0 = time.perf_counter()
                g.infer("mlp", [given], headers=dict(meta))
                valid.append((time.perf_counter() - t0) * 1e3)
                hg = httpclient.InferInput("x", [2, 16], "FP32")
                hg.set_data_from_numpy(xn)
                t0 = time.perf_counter()
                h.infer("mlp", [hg], headers=dict(auth))
                valid.append((time.perf_counter() - t0) * 1e3)
                counts["valid"] += 2

        def hostile_loop() -> None:
            bodies = hostile_http(http)
            with grpc.insecure_channel(tcp) as channel:
                stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
                i = 0
                while time.monotonic() < stop and i < MAX_HOSTILE:
                    body, headers = bodies[i % len(bodies)]
                    http_post(http, "/v2/models/mlp/infer", body, headers)
                    counts["hostile http"] += 1
                    request = pb.ModelInferRequest(model_name="dyn")
                    request.inputs.add(name="x", datatype="FP32", shape=[3 + i % 60, 16])
                    try:  # shapes without their data: must build nothing
                        stub.ModelInfer(request, timeout=10, metadata=meta)
                    except grpc.RpcError:
                        pass
                    counts["hostile grpc"] += 1
                    if i % 50 == 0:
                        hostile_sockets(http, metrics, str(daemon.socket_path))
                        counts["socket rounds"] += 1
                    i += 1

        threads = [threading.Thread(target=f) for f in (watch, valid_loop, hostile_loop)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=SOAK_S + 120)
        g.close()
        h.close()
        alive = daemon.proc.poll() is None
        time.sleep(8)  # past the header and keep-alive timeouts
        files1, threads1 = files_threads(pid) if alive else (-1, -1)
        names1 = thread_names(pid) if alive else {}
        grew = {n: names1.get(n, 0) - names0.get(n, 0) for n in set(names0) | set(names1)
                if names1.get(n, 0) != names0.get(n, 0)}
        with Client(daemon.target) as client:
            buckets = len(client.plan("dyn")["plan"].get("buckets", []))
        # what the valid requests hold: one request's tensors and replies, per client, small
        print(f"soak {SOAK_S:.0f} s: daemon alive {alive}; requests: {counts}")
        print(f"  RSS of the daemon's tree: idle {idle_rss:.0f} MiB, peak {peak[0]:.0f} MiB "
              f"({peak[0] / idle_rss:.2f}x idle)")
        print(f"  open files {files0} -> {files1}, threads {threads0} -> {threads1}; "
              f"buckets of 'dyn' built by shapes without data: {buckets}")
        print(f"  threads by name, after vs before: {grew or 'the same'}")
        print(f"  valid requests (tritonclient gRPC + HTTP, interleaved): n={len(valid)} "
              f"p50 {statistics.median(valid):.2f} ms, p99 {np.percentile(valid, 99):.2f} ms")
        crashed = "Traceback" in daemon.log()
        print(f"  tracebacks in the daemon's log: {crashed}")
    finally:
        daemon.close()


if __name__ == "__main__":
    main()
