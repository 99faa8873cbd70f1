"""The Open Inference Protocol (KServe v2 gRPC) through unchanged clients: tritonclient for
health, metadata, inference (raw and typed) and errors; grpc reflection. Shared memory is in
test_oip_shm.py; both run against the session's `env` daemon (conftest.py).

Importing tritonclient and protos.inference_pb2 (through cuvild.client) in one process is
itself checked by these tests (conftest.py imports both): both define the protobuf package
"inference", so ours lives in a private descriptor pool (Makefile, PRIVATE_POOL).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from oip_helpers import (
    one_input,
    raw_infer,
    refused,
    rel_error,
    status_of,
)

from cuvild.client import Client
from protos import inference_pb2 as pb


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


def test_replan_prices_parts_with_what_they_measured(env, triton):
    """--replan teaches the cost model the served parts' measured times first: the fresh
    plan says which corrections it used, and a part it keeps where it was is predicted at
    what it measured."""
    served = env.models["demo"]
    for _ in range(5):
        raw_infer(triton, served)
    with Client(env.daemon.target, timeout=120) as client:
        before = client.plan("demo")
        after = client.plan("demo", replan=True)
    notes = [n for n in after["plan"]["notes"] if n.startswith("cost corrections learned")]
    assert notes and "npu0/openvino" in notes[0], after["plan"]["notes"]
    measured = {p: m["measured_ms"] for p, m in before["measured"].items()}
    assert all(ms is not None and ms > 0 for ms in measured.values()), before["measured"]
    backbone = next(p for p in after["plan"]["parts"] if p["device"] == "npu0")
    assert backbone["predicted_ms"] == pytest.approx(measured["p0"], rel=0.5)


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


def test_cuda_shared_memory_without_a_gpu_is_refused_clearly(triton):
    """On a host with a GPU, tests/gpu/check_gpu.py runs the extension end to end."""
    import base64

    handle = base64.b64encode(b"\0" * 64)  # tritonclient's get_raw_handle() form
    err = refused(lambda: triton.register_cuda_shared_memory("c", handle, 0, 64))
    assert status_of(err) == grpc.StatusCode.UNAVAILABLE, err.message()
    assert "cuda-python" in err.message() or "no CUDA device" in err.message()
    short = base64.b64encode(b"\0" * 10)
    err = refused(lambda: triton.register_cuda_shared_memory("c", short, 0, 64))
    assert status_of(err) == grpc.StatusCode.INVALID_ARGUMENT and "64" in err.message()
    err = refused(lambda: triton.register_cuda_shared_memory("c", handle, 0, 0))
    assert status_of(err) == grpc.StatusCode.INVALID_ARGUMENT and "byte_size" in err.message()
    err = refused(lambda: triton.unregister_cuda_shared_memory("nothing"))
    assert status_of(err) == grpc.StatusCode.NOT_FOUND
    assert triton.get_cuda_shared_memory_status(as_json=True).get("regions", {}) == {}


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
