"""The Open Inference Protocol (KServe v2 gRPC) through unchanged clients: tritonclient for
health, metadata, inference (raw, typed, system shared memory) and errors; grpc reflection.

Importing tritonclient and protos.inference_pb2 (through cuvild.client) in one process is
itself checked here: both define the protobuf package "inference", so ours lives in a
private descriptor pool (Makefile, PRIVATE_POOL).

One daemon for the module, with three small models loaded once: an MLP (one part), the demo
model (backbone pinned to the emulated NPU: two parts in two worker processes) and a
two-input model (for requests that mix shared memory and raw inputs).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tritonclient.utils import InferenceServerException

from cuvild.client import Client, samples
from protos import inference_pb2 as pb
from protos import inference_pb2_grpc

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's helpers
from conftest import (  # noqa: E402
    DaemonProcess,
    daemon_config,
    read_text,
    worker_processes,
)

READY_TIMEOUT_S = 240.0
SHM_DIR = Path("/dev/shm")
KEY_PREFIX = f"oiptest-{os.getpid()}-"  # this test's own regions: never "cuvil-<pid>-"


class Pair(torch.nn.Module):
    """Two inputs and two outputs: a request may put some in shared memory, others raw."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(a) + b, torch.relu(a) * 2.0


@dataclass
class Served:
    name: str
    inputs: list[np.ndarray]
    expected: np.ndarray  # the first output
    input_names: list[str] = field(default_factory=list)
    output_name: str = ""
    all_expected: list[np.ndarray] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)


@dataclass
class Env:
    daemon: DaemonProcess
    models: dict[str, Served]
    keys: list[str] = field(default_factory=list)  # every shm key this module created


def _served(name: str, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> Served:
    with torch.inference_mode():
        out = model(*inputs)
    outs = [t.numpy().copy() for t in (out if isinstance(out, tuple) else (out,))]
    return Served(name, [t.numpy().copy() for t in inputs], outs[0], all_expected=outs)


def _wait_ready(client: Client, names: set[str], daemon: DaemonProcess) -> None:
    """Models prepare in the background: wait until none of them is loading."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = {m["name"]: m["state"] for m in client.status()["models"]}
        if names <= set(states) and not any(states[n] == "loading" for n in names):
            break
        time.sleep(0.2)
    bad = {n: states.get(n) for n in names if states.get(n) != "ready"}
    assert not bad, f"models not ready: {bad}\n{daemon.log()[-4000:]}"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, state_root: Path,
        sock_dir: Path) -> Iterator[Env]:
    workdir = tmp_path_factory.mktemp("oip")
    state_dir = workdir / "state"  # its own registry; the session's device profiles
    if (state_root / "profiles").exists():
        shutil.copytree(state_root / "profiles", state_dir / "profiles")
    daemon = DaemonProcess(workdir, daemon_config(workdir, state_dir, sock_dir)).start()
    if not (state_root / "profiles").exists() and (state_dir / "profiles").exists():
        shutil.copytree(state_dir / "profiles", state_root / "profiles")
    torch.manual_seed(0)
    mlp = samples.MLP(width=64, depth=2).eval()
    demo, demo_inputs = samples.reference("demo")
    pair = Pair().eval()
    wanted = {
        "mlp": (mlp, (torch.randn(2, 64),)),
        "demo": (demo, demo_inputs),
        "pair": (pair, (torch.randn(2, 8), torch.randn(2, 4))),
    }
    models = {}
    try:
        with Client(daemon.target) as client:
            for name, (model, inputs) in wanted.items():
                summary = client.load(name, model, inputs)["model"]
                models[name] = served = _served(name, model, inputs)
                served.input_names = [t["name"] for t in summary["inputs"]]
                served.output_names = [t["name"] for t in summary["outputs"]]
                served.output_name = served.output_names[0]
            _wait_ready(client, set(wanted), daemon)
        yield Env(daemon, models)
    finally:
        daemon.close()
        for path in SHM_DIR.glob(f"{KEY_PREFIX}*"):  # only if a test failed midway
            path.unlink(missing_ok=True)


@pytest.fixture
def triton(env: Env) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(url=env.daemon.target)
    yield client
    client.close()


@pytest.fixture
def stub(env: Env) -> Iterator[inference_pb2_grpc.GRPCInferenceServiceStub]:
    """Our generated stub, for requests tritonclient never builds (typed, malformed)."""
    with grpc.insecure_channel(env.daemon.target) as channel:
        yield inference_pb2_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture
def regions(env: Env, triton: grpcclient.InferenceServerClient) -> Iterator[Callable[..., Any]]:
    """Factory: regions(nbytes, register=True) -> (region name, key, handle); cleaned up after."""
    made: list[tuple[str, Any, bool]] = []

    def make(nbytes: int, register: bool = True) -> tuple[str, str, Any]:
        name = f"r{uuid.uuid4().hex[:8]}"
        key = f"/{KEY_PREFIX}{name}"
        handle = shm.create_shared_memory_region(name, key, nbytes)
        env.keys.append(key)
        if register:
            triton.register_system_shared_memory(name, key, nbytes)
        made.append((name, handle, register))
        return name, key, handle

    yield make
    registered = {r["name"] for r in
                  triton.get_system_shared_memory_status(as_json=True).get("regions", {}).values()}
    for name, handle, _ in made:
        if name in registered:
            triton.unregister_system_shared_memory(name)
        shm.destroy_shared_memory_region(handle)


def rel_error(got: np.ndarray, expected: np.ndarray) -> float:
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-12))


def raw_infer(triton: grpcclient.InferenceServerClient, served: Served) -> np.ndarray:
    inputs = []
    for name, value in zip(served.input_names, served.inputs, strict=True):
        inp = grpcclient.InferInput(name, list(value.shape), "FP32")
        inp.set_data_from_numpy(value)
        inputs.append(inp)
    result = triton.infer(served.name, inputs,
                          outputs=[grpcclient.InferRequestedOutput(served.output_name)])
    return result.as_numpy(served.output_name)


def refused(call: Callable[[], Any]) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value


def status_of(err: InferenceServerException) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, err.status().removeprefix("StatusCode."))


def one_input(served: Served, name: str | None = None, value: np.ndarray | None = None,
              datatype: str = "FP32") -> grpcclient.InferInput:
    value = served.inputs[0] if value is None else value
    inp = grpcclient.InferInput(name or served.input_names[0], list(value.shape), datatype)
    inp.set_data_from_numpy(value)
    return inp


# -- 1. health, metadata, repository ---------------------------------------------------------
def test_unix_url_health_and_server_metadata(triton):
    assert triton.is_server_live() and triton.is_server_ready()
    meta = triton.get_server_metadata(as_json=True)
    assert meta["name"] == "cuvild" and meta["version"]
    assert {"model_repository", "system_shared_memory"} <= set(meta["extensions"])


def test_model_ready_and_metadata(env, triton):
    assert triton.is_model_ready("mlp") and triton.is_model_ready("demo")
    assert triton.is_model_ready("mlp", "1")
    assert not triton.is_model_ready("no-such-model")
    assert not triton.is_model_ready("mlp", "7")
    meta = triton.get_model_metadata("mlp")
    mlp = env.models["mlp"]
    assert meta.name == "mlp" and list(meta.versions) == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        (mlp.input_names[0], "FP32", [2, 64])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [
        (mlp.output_name, "FP32", [2, 64])]
    demo = triton.get_model_metadata("demo")
    assert [list(t.shape) for t in demo.inputs] == [[1, 3, 64, 64]]
    assert [(t.datatype, list(t.shape)) for t in demo.outputs] == [("FP32", [1, 10])]
    err = refused(lambda: triton.get_model_metadata("no-such-model"))
    assert status_of(err) == grpc.StatusCode.NOT_FOUND and "no-such-model" in err.message()


def test_repository_index(triton):
    index = triton.get_model_repository_index(as_json=True)["models"]
    assert {(m["name"], m["version"], m["state"]) for m in index} == {
        ("mlp", "1", "READY"), ("demo", "1", "READY"), ("pair", "1", "READY")}


# -- 2. raw contents (what tritonclient sends) -----------------------------------------------
@pytest.mark.parametrize("name", ["mlp", "demo", "pair"])
def test_infer_raw_matches_eager(env, triton, name):
    served = env.models[name]
    assert rel_error(raw_infer(triton, served), served.expected) < 1e-4


def test_infer_all_outputs_by_default(env, triton):
    served = env.models["pair"]
    inputs = []
    for name, value in zip(served.input_names, served.inputs, strict=True):
        inputs.append(grpcclient.InferInput(name, list(value.shape), "FP32"))
        inputs[-1].set_data_from_numpy(value)
    result = triton.infer("pair", inputs, request_id="both")
    assert result.get_response().id == "both"
    assert [o.name for o in result.get_response().outputs] == served.output_names
    for name, expected in zip(served.output_names, served.all_expected, strict=True):
        assert rel_error(result.as_numpy(name), expected) < 1e-4


def test_demo_runs_as_two_parts_on_two_devices(env):
    line = next((ln for ln in env.daemon.log().splitlines() if "model demo:1 ready" in ln), "")
    devices = {m.group(1) for m in re.finditer(r"@([\w.-]+)/", line)}
    assert len(devices) == 2, line  # e.g. "p0@npu0/openvino, p1@cpu0/openvino"


# -- 3. typed contents (tritonclient never sends them: through our generated stub) ----------
def test_infer_typed_contents(env, stub):
    served = env.models["mlp"]
    x = served.inputs[0]
    request = pb.ModelInferRequest(model_name="mlp", id="typed-1", inputs=[
        pb.ModelInferRequest.InferInputTensor(
            name=served.input_names[0], datatype="FP32", shape=list(x.shape),
            contents=pb.InferTensorContents(fp32_contents=x.ravel().tolist()))])
    response = stub.ModelInfer(request, timeout=30)
    assert response.id == "typed-1" and response.model_name == "mlp"
    (out,) = response.outputs
    assert (out.name, out.datatype, list(out.shape)) == (served.output_name, "FP32", [2, 64])
    got = np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(out.shape)
    assert rel_error(got, served.expected) < 1e-4


# -- 4. system shared memory -----------------------------------------------------------------
def shm_input(served: Served, regions: Callable[..., Any]) -> grpcclient.InferInput:
    x = served.inputs[0]
    name, _, handle = regions(x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    inp = grpcclient.InferInput(served.input_names[0], list(x.shape), "FP32")
    inp.set_shared_memory(name, x.nbytes)
    return inp


@pytest.mark.parametrize("name", ["mlp", "demo"])
def test_infer_shared_memory_inputs(env, triton, regions, name):
    served = env.models[name]
    result = triton.infer(name, [shm_input(served, regions)])
    assert rel_error(result.as_numpy(served.output_name), served.expected) < 1e-4
    status = triton.get_system_shared_memory_status(as_json=True)["regions"]
    assert len(status) == 1


@pytest.mark.parametrize("name", ["mlp", "demo"])
def test_infer_shared_memory_inputs_and_outputs(env, triton, regions, name):
    served = env.models[name]
    inp = shm_input(served, regions)
    out_name, _, out_handle = regions(served.expected.nbytes)
    out = grpcclient.InferRequestedOutput(served.output_name)
    out.set_shared_memory(out_name, served.expected.nbytes)
    result = triton.infer(name, [inp], outputs=[out])
    got = shm.get_contents_as_numpy(out_handle, np.float32, list(served.expected.shape)).copy()
    assert rel_error(got, served.expected) < 1e-4
    meta = result.get_output(served.output_name)
    assert list(meta.shape) == list(served.expected.shape)
    assert meta.parameters["shared_memory_region"].string_param == out_name
    assert len(result.get_response().raw_output_contents) == 0  # nothing raw came back


def test_one_region_with_offsets_for_input_and_output(env, triton, regions):
    """Input at offset 0 and output after it (at an offset) in the same region."""
    served = env.models["mlp"]
    x = served.inputs[0]
    at = x.nbytes + 64
    name, _, handle = regions(at + served.expected.nbytes)
    shm.set_shared_memory_region(handle, [x])
    inp = grpcclient.InferInput(served.input_names[0], list(x.shape), "FP32")
    inp.set_shared_memory(name, x.nbytes)
    out = grpcclient.InferRequestedOutput(served.output_name)
    out.set_shared_memory(name, served.expected.nbytes, offset=at)
    triton.infer("mlp", [inp], outputs=[out])
    again = shm.get_contents_as_numpy(handle, np.float32, [2, 64]).copy()
    assert np.array_equal(again, x)  # the input was read, not overwritten
    got = shm.get_contents_as_numpy(handle, np.float32, [2, 64], offset=at).copy()
    assert rel_error(got, served.expected) < 1e-4


def test_mixed_shared_memory_and_raw_inputs(env, triton, regions):
    served = env.models["pair"]
    a, b = served.inputs
    name, _, handle = regions(a.nbytes)
    shm.set_shared_memory_region(handle, [a])
    in_a = grpcclient.InferInput(served.input_names[0], list(a.shape), "FP32")
    in_a.set_shared_memory(name, a.nbytes)
    in_b = grpcclient.InferInput(served.input_names[1], list(b.shape), "FP32")
    in_b.set_data_from_numpy(b)
    result = triton.infer("pair", [in_a, in_b])
    assert rel_error(result.as_numpy(served.output_name), served.expected) < 1e-4


def test_mixed_shared_memory_and_raw_outputs(env, triton, regions):
    served = env.models["pair"]
    first, second = served.all_expected
    name, _, handle = regions(first.nbytes)
    out0 = grpcclient.InferRequestedOutput(served.output_names[0])
    out0.set_shared_memory(name, first.nbytes)
    out1 = grpcclient.InferRequestedOutput(served.output_names[1])
    inputs = []
    for in_name, value in zip(served.input_names, served.inputs, strict=True):
        inputs.append(grpcclient.InferInput(in_name, list(value.shape), "FP32"))
        inputs[-1].set_data_from_numpy(value)
    result = triton.infer("pair", inputs, outputs=[out0, out1])
    got = shm.get_contents_as_numpy(handle, np.float32, list(first.shape)).copy()
    assert rel_error(got, first) < 1e-4
    assert rel_error(result.as_numpy(served.output_names[1]), second) < 1e-4


def test_recreated_region_with_the_same_key_is_read_afresh(env, triton):
    """tritonclient's examples reuse fixed keys: register, infer, unregister, destroy, again."""
    served = env.models["mlp"]
    key = f"/{KEY_PREFIX}reused"
    env.keys.append(key)
    for scale in (1.0, 2.0, 3.0):
        x = (served.inputs[0] * scale).astype(np.float32)
        handle = shm.create_shared_memory_region("reused", key, x.nbytes)
        try:
            shm.set_shared_memory_region(handle, [x])
            triton.register_system_shared_memory("reused", key, x.nbytes)
            inp = grpcclient.InferInput(served.input_names[0], list(x.shape), "FP32")
            inp.set_shared_memory("reused", x.nbytes)
            got = triton.infer("mlp", [inp]).as_numpy(served.output_name)
        finally:
            triton.unregister_system_shared_memory("reused")
            shm.destroy_shared_memory_region(handle)
        expected = raw_infer(triton, Served("mlp", [x], served.expected, served.input_names,
                                            served.output_name))
        assert rel_error(got, expected) < 1e-4, f"scale {scale}: stale region contents"


# -- 5. errors: clear statuses, and the daemon still serves ----------------------------------
def test_infer_errors_name_the_problem(env, triton):
    served = env.models["mlp"]
    x = served.inputs[0]
    in_name = served.input_names[0]
    cases: list[tuple[str, Callable[[], Any], grpc.StatusCode, list[str]]] = [
        ("unknown model", lambda: triton.infer("no-such-model", [one_input(served)]),
         grpc.StatusCode.NOT_FOUND, ["unknown model", "no-such-model"]),
        ("unknown model version", lambda: triton.infer("mlp", [one_input(served)],
                                                       model_version="9"),
         grpc.StatusCode.NOT_FOUND, ["unknown model", "'9'"]),
        ("wrong input name", lambda: triton.infer("mlp", [one_input(served, name="nope")]),
         grpc.StatusCode.INVALID_ARGUMENT, ["'nope'", f"missing ['{in_name}']"]),
        ("no input", lambda: triton.infer("mlp", []),
         grpc.StatusCode.INVALID_ARGUMENT, [f"missing ['{in_name}']"]),
        ("extra input", lambda: triton.infer("mlp", [one_input(served),
                                                     one_input(served, name="extra")]),
         grpc.StatusCode.INVALID_ARGUMENT, ["unknown ['extra']"]),
        ("input twice", lambda: triton.infer("mlp", [one_input(served), one_input(served)]),
         grpc.StatusCode.INVALID_ARGUMENT, [in_name, "twice"]),
        ("wrong dtype", lambda: triton.infer("mlp", [one_input(
            served, value=x.astype(np.float64), datatype="FP64")]),
         grpc.StatusCode.INVALID_ARGUMENT, [in_name, "FP32", "FP64"]),
        ("unsupported dtype", lambda: triton.infer("mlp", [one_input(
            served, value=x.astype(np.uint16), datatype="UINT16")]),
         grpc.StatusCode.INVALID_ARGUMENT, [in_name, "UINT16"]),
        ("wrong shape", lambda: triton.infer("mlp", [one_input(
            served, value=np.zeros((3, 64), np.float32))]),
         grpc.StatusCode.INVALID_ARGUMENT, [in_name, "shape", "[2, 64]", "[3, 64]"]),
        ("wrong rank", lambda: triton.infer("mlp", [one_input(
            served, value=x.reshape(2, 8, 8))]),
         grpc.StatusCode.INVALID_ARGUMENT, [in_name, "shape"]),
        ("unknown output", lambda: triton.infer(
            "mlp", [one_input(served)], outputs=[grpcclient.InferRequestedOutput("nope")]),
         grpc.StatusCode.INVALID_ARGUMENT, ["unknown output 'nope'", served.output_name]),
    ]
    for what, call, code, needles in cases:
        err = refused(call)
        assert status_of(err) == code, (what, err)
        for needle in needles:
            assert needle in err.message(), (what, needle, err.message())
    assert rel_error(raw_infer(triton, served), served.expected) < 1e-4  # still serving


def test_malformed_requests_through_the_stub(env, stub, triton):
    served = env.models["mlp"]
    x = served.inputs[0]
    in_name = served.input_names[0]

    def request(**fields: Any) -> pb.ModelInferRequest:
        tensor = pb.ModelInferRequest.InferInputTensor(name=in_name, datatype="FP32",
                                                       shape=list(x.shape))
        return pb.ModelInferRequest(model_name="mlp", inputs=[tensor], **fields)

    few_values = request()
    few_values.inputs[0].contents.fp32_contents.extend([1.0] * 10)
    cases = {
        "raw bytes": request(raw_input_contents=[x.tobytes()[:-4]]),
        "raw_input_contents for 1 inputs": request(raw_input_contents=[x.tobytes()] * 2),
        "10 values in contents, expected 128": few_values,
    }
    for needle, req in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(req, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (needle, err.value)
        assert needle in err.value.details(), (needle, err.value.details())
        if needle == "raw bytes":
            assert in_name in err.value.details() and str(x.nbytes) in err.value.details()
    assert rel_error(raw_infer(triton, served), served.expected) < 1e-4


def test_shared_memory_errors(env, triton, regions):
    served = env.models["mlp"]
    x = served.inputs[0]
    name, key, handle = regions(x.nbytes)
    shm.set_shared_memory_region(handle, [x])

    def infer_in(region: str, nbytes: int, offset: int = 0) -> Any:
        inp = grpcclient.InferInput(served.input_names[0], list(x.shape), "FP32")
        inp.set_shared_memory(region, nbytes, offset=offset)
        return triton.infer("mlp", [inp])

    def infer_out(region: str, nbytes: int, offset: int = 0) -> Any:
        out = grpcclient.InferRequestedOutput(served.output_name)
        out.set_shared_memory(region, nbytes, offset=offset)
        return triton.infer("mlp", [one_input(served)], outputs=[out])

    _, spare_key, _ = regions(4096, register=False)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases: list[tuple[str, Callable[[], Any], grpc.StatusCode, list[str]]] = [
        ("unknown input region", lambda: infer_in("no-such-region", x.nbytes),
         invalid, ["unknown shared-memory region", "no-such-region"]),
        ("unknown output region", lambda: infer_out("no-such-region", x.nbytes),
         invalid, ["no-such-region"]),
        ("input past the end", lambda: infer_in(name, x.nbytes, offset=64),
         invalid, [name, "outside"]),
        ("output past the end", lambda: infer_out(name, x.nbytes, offset=4),
         invalid, [name, "outside"]),
        ("input byte size", lambda: infer_in(name, x.nbytes - 4),
         invalid, ["shared_memory_byte_size", str(x.nbytes - 4)]),
        ("output byte size too small", lambda: infer_out(name, x.nbytes - 4),
         invalid, ["shared_memory_byte_size", str(x.nbytes - 4)]),
        ("register twice", lambda: triton.register_system_shared_memory(name, key, x.nbytes),
         grpc.StatusCode.ALREADY_EXISTS, [name, "already registered"]),
        ("no such key", lambda: triton.register_system_shared_memory(
            "ghost", f"/{KEY_PREFIX}ghost", 64), invalid, [f"/{KEY_PREFIX}ghost", "not exist"]),
        ("bad key", lambda: triton.register_system_shared_memory("bad", "/a/b", 64),
         invalid, ["'/a/b'"]),
        ("register past the object", lambda: triton.register_system_shared_memory(
            "big", spare_key, 8192), invalid, ["outside", "4096"]),
        ("register offset past the object", lambda: triton.register_system_shared_memory(
            "off", spare_key, 64, offset=4096 - 32), invalid, ["outside"]),
        ("register zero bytes", lambda: triton.register_system_shared_memory(
            "zero", spare_key, 0), invalid, ["byte_size 0"]),
        ("unregister unknown", lambda: triton.unregister_system_shared_memory("no-such-region"),
         grpc.StatusCode.NOT_FOUND, ["no-such-region"]),
        ("status of unknown", lambda: triton.get_system_shared_memory_status("no-such-region"),
         grpc.StatusCode.NOT_FOUND, ["no-such-region"]),
    ]
    for what, call, code, needles in cases:
        err = refused(call)
        assert status_of(err) == code, (what, err)
        for needle in needles:
            assert needle in err.message(), (what, needle, err.message())
    registered = triton.get_system_shared_memory_status(as_json=True)["regions"]
    assert {r["name"] for r in registered.values()} == {name}  # no failed one stuck
    status = triton.get_system_shared_memory_status(name, as_json=True)["regions"][name]
    assert (status["key"], int(status["byte_size"])) == (key, x.nbytes)
    infer_in(name, x.nbytes)  # the region still works, and so does the daemon
    assert rel_error(raw_infer(triton, served), served.expected) < 1e-4


def test_cuda_shared_memory_is_refused_clearly(triton):
    err = refused(lambda: triton.register_cuda_shared_memory("c", b"\0" * 64, 0, 64))
    assert status_of(err) == grpc.StatusCode.UNIMPLEMENTED and "CUDA" in err.message()


# -- 6. reflection ---------------------------------------------------------------------------
def test_reflection_lists_and_describes_both_services(env):
    from google.protobuf import descriptor_pb2

    services = ("inference.GRPCInferenceService", "cuvil.v1.Control")
    requests = [reflection_pb2.ServerReflectionRequest(list_services="")] + [
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=s) for s in services]
    with grpc.insecure_channel(env.daemon.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        listed, *described = list(stub.ServerReflectionInfo(iter(requests), timeout=30))
    assert set(services) <= {s.name for s in listed.list_services_response.service}
    methods = {}
    for service, reply in zip(services, described, strict=True):  # what grpcurl describe does
        assert not reply.HasField("error_response"), (service, reply.error_response)
        files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                 for raw in reply.file_descriptor_response.file_descriptor_proto]
        methods.update({f"{f.package}.{svc.name}": {m.name for m in svc.method}
                        for f in files for svc in f.service})
    assert {"ModelInfer", "SystemSharedMemoryRegister"} <= methods[services[0]]
    assert {"LoadModel", "GetStatus"} <= methods[services[1]]


# -- 6b. whose shared memory: the caller's uid over the unix socket -------------------------
def test_a_replaced_object_is_refused_until_registered_again(env, triton, regions):
    """Workers open a region's object by name; a new object under that name is not the one
    whose owner was checked, so it is refused (Triton keeps mapping the old one)."""
    served = env.models["mlp"]
    x = served.inputs[0]
    name, key, handle = regions(x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    inp = grpcclient.InferInput(served.input_names[0], list(x.shape), "FP32")
    inp.set_shared_memory(name, x.nbytes)
    triton.infer("mlp", [inp])
    (SHM_DIR / key[1:]).unlink()
    fresh = shm.create_shared_memory_region(name + "-new", key, x.nbytes)
    try:
        shm.set_shared_memory_region(fresh, [x])
        err = refused(lambda: triton.infer("mlp", [inp]))
        assert status_of(err) == grpc.StatusCode.INVALID_ARGUMENT
        assert "replaced since it was registered" in err.message()
        triton.unregister_system_shared_memory(name)
        triton.register_system_shared_memory(name, key, x.nbytes)
        got = triton.infer("mlp", [inp]).as_numpy(served.output_name)
        assert rel_error(got, served.expected) < 1e-4
    finally:
        shm.destroy_shared_memory_region(fresh)


def test_workers_unmap_a_region_once_it_is_unregistered(env, triton, regions):
    """An unlinked object lives as long as somebody maps it: unregistering must unmap it in
    the workers too, or a client could pin /dev/shm memory through cuvild."""
    served = env.models["demo"]  # two parts on two workers
    x = served.inputs[0]
    name, key, handle = regions(x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    inp = grpcclient.InferInput(served.input_names[0], list(x.shape), "FP32")
    inp.set_shared_memory(name, x.nbytes)
    triton.infer("demo", [inp])
    workers = worker_processes(env.daemon.proc.pid)

    def mapped() -> list[str]:
        return [w.name for w in workers if f"/dev/shm/{key[1:]}" in read_text(w / "maps")]

    assert mapped(), "a worker should map the region it read"
    triton.unregister_system_shared_memory(name)
    raw_infer(triton, served)  # OpenVINO lets go of its last input on its next run
    deadline = time.monotonic() + 10
    while mapped():
        assert time.monotonic() < deadline, f"still mapped by workers {mapped()}"
        time.sleep(0.1)


NOBODY = 65534
# Per-thread credential syscalls (glibc's wrappers would change every thread of the process).
SYSCALLS = {"x86_64": (117, 122), "aarch64": (147, 151)}  # setresuid, setfsuid


def connect_as(uid: int, path: str) -> socket.socket:
    """A unix connection whose SO_PEERCRED says `uid`: connect from a thread whose effective
    uid is `uid` (its file-system uid stays root, to reach the socket's private directory)."""
    libc = ctypes.CDLL(None, use_errno=True)
    setresuid, setfsuid = SYSCALLS[os.uname().machine]
    result: dict[str, Any] = {}

    def connect() -> None:
        if libc.syscall(setresuid, -1, uid, -1) != 0:
            result["error"] = OSError(ctypes.get_errno(), "setresuid")
            return
        try:
            libc.syscall(setfsuid, 0)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            result["sock"] = sock
        except OSError as e:
            result["error"] = e
        finally:
            assert libc.syscall(setresuid, -1, 0, -1) == 0

    thread = threading.Thread(target=connect)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["sock"]


def relay(conn: socket.socket, tmp_path: Path) -> str:
    """A gRPC target whose first connection is relayed over `conn`."""
    path = str(tmp_path / "as-other-user.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def serve() -> None:
        client, _ = listener.accept()
        listener.close()
        threading.Thread(target=pump, args=(client, conn), daemon=True).start()
        pump(conn, client)

    threading.Thread(target=serve, daemon=True).start()
    return f"unix:{path}"


@pytest.mark.skipif(os.getuid() != 0 or os.uname().machine not in SYSCALLS,
                    reason="needs root on x86-64 or aarch64 to connect as another user")
def test_another_user_cannot_use_objects_or_regions_it_does_not_own(env, triton, regions,
                                                                    tmp_path):
    """Over the unix socket the caller's uid comes from SO_PEERCRED: a client connected as
    `nobody` may not register root's object nor name root's region, but may use its own."""
    served = env.models["mlp"]
    x = served.inputs[0]
    root_region, root_key, handle = regions(x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    socket_path = env.daemon.target.removeprefix("unix:")
    os.chmod(socket_path, 0o666)  # let `nobody` connect, for this test only
    try:
        conn = connect_as(NOBODY, socket_path)
    finally:
        os.chmod(socket_path, 0o660)
    other = grpcclient.InferenceServerClient(url=relay(conn, tmp_path))
    mine_name, mine_key, mine = regions(x.nbytes, register=False)
    os.chown(SHM_DIR / mine_key[1:], NOBODY, NOBODY)
    shm.set_shared_memory_region(mine, [x])
    try:
        err = refused(lambda: other.register_system_shared_memory("t", root_key, x.nbytes))
        assert status_of(err) == grpc.StatusCode.PERMISSION_DENIED
        assert f"owned by uid 0, not by the caller (uid {NOBODY})" in err.message()
        inp = grpcclient.InferInput(served.input_names[0], list(x.shape), "FP32")
        inp.set_shared_memory(root_region, x.nbytes)
        err = refused(lambda: other.infer("mlp", [inp]))
        assert status_of(err) == grpc.StatusCode.INVALID_ARGUMENT
        assert f"unknown shared-memory region {root_region!r}" in err.message()
        assert other.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
        other.register_system_shared_memory(mine_name, mine_key, x.nbytes)
        inp.set_shared_memory(mine_name, x.nbytes)
        got = other.infer("mlp", [inp]).as_numpy(served.output_name)
        assert rel_error(got, served.expected) < 1e-4
        # ...and root's own view is untouched by nobody's region of the same name.
        assert root_region in triton.get_system_shared_memory_status(as_json=True)["regions"]
        other.unregister_system_shared_memory(mine_name)
    finally:
        other.close()


# -- 7. shared memory left behind (keep last: it stops the module's daemon) ------------------
def test_stopped_daemon_leaves_no_shared_memory(env, triton):
    served = env.models["demo"]
    raw_infer(triton, served)  # the arena exists even when this test runs alone
    pid = env.daemon.proc.pid
    arena = sorted(p.name for p in SHM_DIR.glob(f"cuvil-{pid}-*"))
    assert arena, "the daemon's arena should be in /dev/shm while it serves"
    triton.unregister_system_shared_memory()  # all
    assert env.daemon.stop() == 0
    assert sorted(p.name for p in SHM_DIR.glob(f"cuvil-{pid}-*")) == []
    assert [k for k in env.keys if (SHM_DIR / k.lstrip("/")).exists()] == []
    assert list(SHM_DIR.glob(f"{KEY_PREFIX}*")) == []
    assert shm.mapped_shared_memory_regions() == []
