"""The Open Inference Protocol over HTTP/REST (listen.http, cuvild/serve/rest.py): tritonclient's
HTTP client and KServe's own REST and gRPC clients unchanged, plain JSON as curl sends it, system
shared memory under the TCP rule, Triton's errors and statuses."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
import yaml
from daemons import DaemonProcess, free_port, suite_config
from tritonclient.utils import InferenceServerException

from cuvild.client import Client, samples
from protos import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.daemon
HERE = Path(__file__).parent
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, state_root: Path,
           sock_dir: Path) -> Iterator[tuple[DaemonProcess, str, torch.nn.Module]]:
    """A daemon on HTTP and TCP gRPC (both with the token), TCP/HTTP shared memory allowed
    for this uid's objects."""
    workdir = tmp_path_factory.mktemp("rest")
    address = f"127.0.0.1:{free_port()}"
    config = suite_config(workdir, workdir / "state", sock_dir,
                          listen={"http": address, "tcp": f"127.0.0.1:{free_port()}",
                                  "token": TOKEN},
                          shm={"allow_tcp_clients": True, "allowed_uids": [os.getuid()]})
    daemon = DaemonProcess(workdir, config, profiles=state_root).start()
    torch.manual_seed(3)
    model = samples.MLP(width=16, depth=2).eval()
    with Client(daemon.target) as client:
        client.load("mlp", model, (torch.randn(2, 16),))
    yield daemon, address, model
    daemon.close()


def grpc_address(daemon: DaemonProcess) -> str:
    """The daemon's TCP gRPC listener, from the config it was started with."""
    return yaml.safe_load(daemon.config_path.read_text())["listen"]["tcp"]


def call(address: str, path: str, body: Any = None, token: str | None = TOKEN,
         headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{address}{path}", data=data,
                                     method="POST" if data is not None else "GET",
                                     headers={**({"Authorization": f"Bearer {token}"}
                                                 if token else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read(), dict(reply.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def test_tritonclient_http_infers_with_binary_and_json_data(served):
    daemon, address, model = served
    x = torch.randn(2, 16)
    want = model(x).detach().numpy()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    triton = httpclient.InferenceServerClient(url=address)
    try:
        assert triton.is_server_live() and triton.is_server_ready()
        assert triton.is_model_ready("mlp", headers=auth)
        meta = triton.get_model_metadata("mlp", headers=auth)
        assert meta["inputs"][0]["datatype"] == "FP32" and meta["outputs"][0]["name"] == "output0"
        for binary in (True, False):
            given = httpclient.InferInput(meta["inputs"][0]["name"], list(x.shape), "FP32")
            given.set_data_from_numpy(x.numpy(), binary_data=binary)
            # (a copy: tritonclient adds Inference-Header-Content-Length to the dict it gets)
            result = triton.infer("mlp", [given], headers=dict(auth), outputs=[
                httpclient.InferRequestedOutput("output0", binary_data=binary)])
            np.testing.assert_allclose(result.as_numpy("output0"), want, rtol=1e-4, atol=1e-5)
        every = triton.infer("mlp", [given], headers=dict(auth))  # no outputs named: all
        np.testing.assert_allclose(every.as_numpy("output0"), want, rtol=1e-4, atol=1e-5)
    finally:
        triton.close()


def test_plain_json_health_metadata_and_index(served):
    daemon, address, model = served
    assert call(address, "/v2/health/live", token=None)[0] == 200  # probes carry no token
    assert call(address, "/v2/health/ready", token=None)[0] == 200
    status, body, _ = call(address, "/v2")
    assert status == 200 and json.loads(body)["name"] == "cuvild"
    x = np.arange(32, dtype=np.float32).reshape(2, 16) / 32
    status, body, _ = call(address, "/v2/models/mlp/versions/1/infer", {
        "id": "r1", "inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32",
                                "data": x.tolist()}]})
    assert status == 200, body
    reply = json.loads(body)
    assert reply["id"] == "r1" and reply["model_version"] == "1"
    got = np.array(reply["outputs"][0]["data"], dtype=np.float32).reshape(
        reply["outputs"][0]["shape"])
    np.testing.assert_allclose(got, model(torch.from_numpy(x)).detach().numpy(), rtol=1e-4,
                               atol=1e-5)
    status, body, _ = call(address, "/v2/repository/index", {})
    assert status == 200 and {"name": "mlp", "version": "1", "state": "READY",
                              "reason": ""} in json.loads(body)
    assert call(address, "/v2/repository/models/mlp/unload", {})[0] == 200
    assert call(address, "/v2/health/ready", token=None)[0] == 200  # nothing left loading
    assert call(address, "/v2/models/mlp/ready")[0] == 400
    status, body, _ = call(address, "/v2/repository/models/mlp/load", {})
    assert status == 200, body  # once READY again (from its load record)
    assert call(address, "/v2/models/mlp/ready")[0] == 200
    status, body, _ = call(address, "/v2/repository/models/nope/load", {})
    assert status == 404 and "cuvilctl load" in json.loads(body)["error"]


def test_metrics_share_the_http_port_behind_the_token(served):
    daemon, address, _ = served
    status, body, headers = call(address, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert b'cuvil_inference_request_success_total{model="mlp",version="1"}' in body
    assert call(address, "/metrics", token=None)[0] == 401


def test_errors_are_json_with_tritons_statuses(served):
    daemon, address, _ = served
    status, body, _ = call(address, "/v2", token="wrong")
    assert status == 401 and "bearer token" in json.loads(body)["error"]
    status, body, _ = call(address, "/v2/models/nope/infer", {"inputs": []})
    assert status == 404 and "unknown model 'nope'" in json.loads(body)["error"]
    status, body, _ = call(address, "/v2/models/nope")
    assert status == 404
    assert call(address, "/v2/models/nope/ready")[0] == 400
    bad_shape = {"inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32",
                             "data": [1.0, 2.0]}]}
    status, body, _ = call(address, "/v2/models/mlp/infer", bad_shape)
    assert status == 400 and "2 values in 'data', expected 32" in json.loads(body)["error"]
    status, body, _ = call(address, "/v2/models/mlp/infer", b"{not json")
    assert status == 400 and "not JSON" in json.loads(body)["error"]
    wrong_type = {"inputs": [{"name": "x", "shape": [2, 16], "datatype": "INT64",
                              "data": list(range(32))}]}
    status, body, _ = call(address, "/v2/models/mlp/infer", wrong_type)
    assert status == 400 and "error" in json.loads(body)
    head = json.dumps({"inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32",
                                   "parameters": {"binary_data_size": 128}}]}).encode()
    status, body, _ = call(address, "/v2/models/mlp/infer", head + b"\0" * 16,
                           headers={"Inference-Header-Content-Length": str(len(head))})
    assert status == 400 and "binary_data_size 128" in json.loads(body)["error"]


def test_kserve_rest_and_grpc_clients_infer_unchanged(served, tmp_path):
    """KServe's own clients (kserve.InferenceRESTClient with the v2 protocol, binary and JSON
    tensors; kserve.InferenceGRPCClient) match eager. In a process of their own: kserve and
    tritonclient.grpc cannot share one (tests/serve/kserve_sdk.py)."""
    daemon, address, model = served
    x = torch.randn(2, 16)
    want = model(x).detach().numpy()
    np.save(tmp_path / "x.npy", x.numpy())
    done = subprocess.run([sys.executable, str(HERE / "kserve_sdk.py"), "clients", address,
                           grpc_address(daemon), TOKEN, str(tmp_path / "x.npy")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["rest_ready"] == [True, True] and got["grpc_ready"] == [True, True]
    for way in ("rest_binary", "rest_json", "grpc"):
        assert got[way]["id"] == "k1", way
        np.testing.assert_allclose(np.array(got[way]["output"], dtype=np.float32), want,
                                   rtol=1e-4, atol=1e-5, err_msg=way)


def test_system_shared_memory_over_http_as_over_tcp(served):
    """tritonclient.http registers, infers with an input and an output in one region, lists
    and unregisters; the object must be owned by a uid in shm.allowed_uids (the TCP rule)."""
    daemon, address, model = served
    x = torch.randn(2, 16)
    want = model(x).detach().numpy()
    name, key = "hx", f"/cuvil-resttest-{os.getpid()}"
    handle = shm.create_shared_memory_region(name, key, x.numpy().nbytes + want.nbytes)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    triton = httpclient.InferenceServerClient(url=address)
    try:
        assert "system_shared_memory" in triton.get_server_metadata(headers=auth)["extensions"]
        shm.set_shared_memory_region(handle, [x.numpy()])
        triton.register_system_shared_memory(name, key, x.numpy().nbytes + want.nbytes,
                                             headers=auth)
        (status,) = triton.get_system_shared_memory_status(headers=auth)
        assert status == {"name": name, "key": key, "offset": 0,
                          "byte_size": x.numpy().nbytes + want.nbytes}
        given = httpclient.InferInput("x", list(x.shape), "FP32")
        given.set_shared_memory(name, x.numpy().nbytes)
        out = httpclient.InferRequestedOutput("output0")
        out.set_shared_memory(name, want.nbytes, offset=x.numpy().nbytes)
        result = triton.infer("mlp", [given], outputs=[out], headers=dict(auth))
        assert result.get_output("output0")["parameters"]["shared_memory_region"] == name
        got = shm.get_contents_as_numpy(handle, np.float32, list(want.shape),
                                        offset=x.numpy().nbytes)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        triton.unregister_system_shared_memory(name, headers=auth)
        assert triton.get_system_shared_memory_status(headers=auth) == []
    finally:
        triton.close()
        shm.destroy_shared_memory_region(handle)


def test_a_key_with_a_nul_byte_is_invalid_on_both_protocols(served):
    """'/adv\\x00x' once answered UNKNOWN ("embedded null byte") over gRPC: a bad key is
    INVALID_ARGUMENT (HTTP 400) naming it, over gRPC and HTTP alike."""
    daemon, address, _ = served
    key = "/adv\x00x"
    with grpc.insecure_channel(grpc_address(daemon)) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.SystemSharedMemoryRegister(inference_pb2.SystemSharedMemoryRegisterRequest(
                name="adv", key=key, byte_size=64), timeout=10,
                metadata=[("authorization", f"Bearer {TOKEN}")])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert repr(key) in err.value.details()
    status, body, _ = call(address, "/v2/systemsharedmemory/region/adv/register",
                           {"key": key, "byte_size": 64})
    assert status == 400 and repr(key) in json.loads(body)["error"]
    status, body, _ = call(address, "/v2/systemsharedmemory/region/adv/register", {"key": 7})
    assert status == 400 and "byte_size" in json.loads(body)["error"]


def test_mutated_json_bodies_get_clear_statuses(served):
    """A bounded fuzz over the JSON body (fixed seed): every answer is 200 or 4xx with a JSON
    error, never a 5xx, and the model still answers correctly afterwards."""
    daemon, address, model = served
    rng = random.Random(20261204)
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)
    values: list[Any] = [None, "", "x", -1, 0, 2, 1 << 40, 1.5, True, [], {}, [[1]], ["a"],
                         {"shared_memory_region": "nope"}, {"binary_data_size": 8},
                         {"shared_memory_region": 3}, "\x00"]
    statuses: dict[int, int] = {}
    for _ in range(150):
        doc: dict[str, Any] = {"inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32",
                                           "data": x.tolist()}]}
        tensor, output = doc["inputs"][0], {"name": "output0"}
        if rng.random() < 0.5:
            doc["outputs"] = [output]
        for _ in range(rng.randrange(1, 4)):
            where = rng.choice([doc, tensor, tensor, output])
            where[rng.choice(["name", "shape", "datatype", "data", "parameters", "inputs",
                              "outputs", "id"])] = rng.choice(values)
        status, body, _ = call(address, "/v2/models/mlp/infer", doc)
        statuses[status] = statuses.get(status, 0) + 1
        assert status == 200 or (400 <= status < 500 and "error" in json.loads(body)), \
            (status, body, doc)
    print(f"fuzzed JSON bodies: {statuses}")
    status, body, _ = call(address, "/v2/models/mlp/infer", {"inputs": [
        {"name": "x", "shape": [2, 16], "datatype": "FP32", "data": x.tolist()}]})
    got = np.array(json.loads(body)["outputs"][0]["data"], dtype=np.float32).reshape(2, -1)
    np.testing.assert_allclose(got, model(torch.from_numpy(x)).detach().numpy(), rtol=1e-4,
                               atol=1e-5)


def test_an_http_listener_needs_a_token_off_loopback(tmp_path, sock_dir):
    from cuvild import config

    base = suite_config(tmp_path, tmp_path / "state", sock_dir)
    with pytest.raises(config.ConfigError, match="listen.token"):
        config.parse({**base, "listen": {**base["listen"], "http": "0.0.0.0:8000"}})
    with pytest.raises(config.ConfigError, match="listen.http"):
        config.parse({**base, "listen": {**base["listen"], "http": "8000",
                                         "insecure_loopback": True}})
    ok = config.parse({**base, "listen": {**base["listen"], "http": "127.0.0.1:8000",
                                          "insecure_loopback": True}})
    assert ok.http == "127.0.0.1:8000"


def test_shared_memory_off_is_refused_with_403(tmp_path):
    """`shm.allow_tcp_clients: false` (the default): the HTTP listener refuses every shared-
    memory route, as the TCP gRPC listener does (in-process: no daemon, no model needed)."""
    from cuvild.serve.oip import InferenceService
    from cuvild.serve.regions import Regions
    from cuvild.serve.rest import RestServer

    address = f"127.0.0.1:{free_port()}"
    server = RestServer(InferenceService(None, None, Regions(), shm_enabled=False), address, 2)
    server.start()
    try:
        for path, body in [("/v2/systemsharedmemory/region/r/register",
                            {"key": "/x", "byte_size": 64}),
                           ("/v2/systemsharedmemory/status", None),
                           ("/v2/systemsharedmemory/unregister", {})]:
            status, reply, _ = call(address, path, body, token=None)
            assert status == 403, (path, reply)
            assert "shm.allow_tcp_clients" in json.loads(reply)["error"], path
    finally:
        server.stop()


def test_model_config_statistics_and_unknown_routes_over_http(served):
    """tritonclient.http's get_model_config / get_inference_statistics, and an unknown route
    or method answered with the protocol's JSON error (not aiohttp's plain text, which
    tritonclient read as 'Parse error at offset 3'); a wrong dtype is refused naming both."""
    _, address, _ = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    triton = httpclient.InferenceServerClient(url=address)
    try:
        config = triton.get_model_config("mlp", headers=auth)
        assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [2, 16]}]
        assert config["max_batch_size"] == 0 and config["backend"] == "cuvild"
        x = np.ones((2, 16), dtype=np.float32)
        given = httpclient.InferInput("x", [2, 16], "FP32")
        given.set_data_from_numpy(x)
        triton.infer("mlp", [given], headers=dict(auth))
        stats = triton.get_inference_statistics("mlp", headers=auth)["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] >= 1
        assert stats["inference_stats"]["compute_infer"]["ns"] > 0
        assert triton.get_inference_statistics(headers=auth)["model_stats"][0]["name"] == "mlp"
        wrong = httpclient.InferInput("x", [2, 16], "INT32")
        wrong.set_data_from_numpy(x.astype(np.int32))
        with pytest.raises(InferenceServerException, match=r"float32 \(FP32\), got int32"):
            triton.infer("mlp", [wrong], headers=dict(auth))
        with pytest.raises(InferenceServerException, match="unknown model"):
            triton.get_model_config("nothing", headers=auth)
    finally:
        triton.close()
    for method_path, status in ((("GET", "/v2/nothing"), 404),
                                (("POST", "/v2/models/mlp/config"), 405)):
        method, path = method_path
        code, body, headers = call(address, path, body=b"{}" if method == "POST" else None)
        assert code == status, (path, code, body)
        assert headers["Content-Type"] == "application/json"
        assert path in json.loads(body)["error"]


def test_sigterm_drains_and_closes_the_http_listener(served):  # last: it stops the daemon
    daemon, address, _ = served
    assert daemon.stop() == 0
    host, port = address.split(":")
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=2):
        pass
