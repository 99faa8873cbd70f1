"""A bounded fuzz of the daemon's two doors, with a fixed seed: mutated inference requests and
mutated model archives. Whatever they are, the answer is a clear status (never UNKNOWN, the
status of an unhandled exception), and the daemon serves correct results afterwards."""

from __future__ import annotations

import io
import json
import random
import zipfile
from collections import Counter
from pathlib import Path

import grpc
import torch

from cuvild.client import Client, CuvildError, samples
from protos import inference_pb2, inference_pb2_grpc

SEED = 20261130
REQUESTS = 300
ARCHIVES = 24
DATATYPES = ["FP32", "FP32", "FP16", "INT64", "BOOL", "BYTES", "UINT8", "FP99", ""]
PARAMS = ["shared_memory_region", "shared_memory_offset", "shared_memory_byte_size",
          "binary_data_size", "junk"]


def _base(x: torch.Tensor) -> inference_pb2.ModelInferRequest:
    request = inference_pb2.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.numpy().tobytes())
    return request


def _set_param(param: inference_pb2.InferParameter, rng: random.Random) -> None:
    choice = rng.randrange(6)
    if choice == 0:
        param.string_param = rng.choice(["", "nope", "1.5", "-3", "\x00", "r" * 300])
    elif choice == 1:
        param.int64_param = rng.choice([-1, 0, 7, 1 << 40, -(1 << 62)])
    elif choice == 2:
        param.bool_param = rng.random() < 0.5
    elif choice in (3, 4):
        param.int64_param = rng.choice([1 << 62, -7, 65, 3])
    else:
        param.SetInParent()  # present, no value


def _mutate(request: inference_pb2.ModelInferRequest, rng: random.Random) -> None:  # noqa: C901 - a branch per kind of mutation
    tensor = request.inputs[0]
    kind = rng.randrange(10)
    if kind == 0:
        request.model_name = rng.choice(["", "mlp\n", "nope", "m" * 500, "ml\u00e9", "../mlp"])
    elif kind == 1:
        request.model_version = rng.choice(["0", "-1", "\n", "9" * 40])
    elif kind == 2:
        tensor.name = rng.choice(["", "y", "x\n", "x" * 300])
    elif kind == 3:
        tensor.datatype = rng.choice(DATATYPES)
    elif kind == 4:
        del tensor.shape[:]
        tensor.shape.extend(rng.choice([-1, 0, 1, 2, 16, 1 << 20, 1 << 62, -(1 << 62)])
                            for _ in range(rng.randrange(0, 6)))
    elif kind == 5:
        raw = request.raw_input_contents
        if raw and rng.random() < 0.5:
            raw[0] = raw[0][: rng.randrange(len(raw[0]) + 1)]
        else:
            raw.append(rng.randbytes(rng.randrange(0, 256)))
    elif kind == 6:
        del request.raw_input_contents[:]
        tensor.contents.fp32_contents.extend(rng.random() for _ in range(rng.randrange(0, 64)))
    elif kind == 7:
        for _ in range(rng.randrange(1, 4)):
            _set_param(tensor.parameters[rng.choice(PARAMS)], rng)
    elif kind == 8:
        out = request.outputs.add(name=rng.choice(["output0", "nope", ""]))
        for _ in range(rng.randrange(0, 3)):
            _set_param(out.parameters[rng.choice(PARAMS)], rng)
    else:
        extra = request.inputs.add(name=rng.choice(["x", "z"]), datatype="FP32", shape=[2, 16])
        if rng.random() < 0.5:
            _set_param(extra.parameters[rng.choice(PARAMS)], rng)


def test_mutated_requests_get_clear_answers(hardened):
    daemon, x, y = hardened
    rng = random.Random(SEED)
    codes: Counter[str] = Counter()
    unknown: list[str] = []
    with grpc.insecure_channel(daemon.target) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        garbage = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for i in range(REQUESTS):
            request = _base(x)
            for _ in range(rng.randrange(1, 4)):
                _mutate(request, rng)
            try:
                if i % 25 == 0:  # not even a protobuf
                    garbage(rng.randbytes(rng.randrange(1, 512)), timeout=30)
                else:
                    stub.ModelInfer(request, timeout=30)
                codes["OK"] += 1
            except grpc.RpcError as e:
                codes[e.code().name] += 1
                if e.code() == grpc.StatusCode.UNKNOWN:
                    unknown.append(f"{request}\n-> {e.details()}")
        assert not unknown, f"{len(unknown)} UNKNOWN answers; first:\n{unknown[0]}"
        assert stub.ServerLive(inference_pb2.ServerLiveRequest(), timeout=5).live
        reply = stub.ModelInfer(_base(x), timeout=30)
    got = torch.frombuffer(bytearray(reply.raw_output_contents[0]), dtype=torch.float32)
    torch.testing.assert_close(got.view(y.shape), y)
    print(f"fuzzed requests: {dict(codes)}")


def _archive(x: torch.Tensor) -> bytes:
    model = samples.MLP(width=16, depth=1).eval()
    buf = io.BytesIO()
    torch.export.save(torch.export.export(model, (x,)), buf)
    return buf.getvalue()


def _rezip(data: bytes, entry: str, change) -> bytes:  # noqa: ANN001
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            body = src.read(info)
            dst.writestr(info, change(body) if info.filename.endswith(entry) else body)
    return out.getvalue()


def _mutate_json(body: bytes, rng: random.Random) -> bytes:
    """Change one scalar somewhere in a JSON document to a hostile value."""
    doc = json.loads(body)
    nodes: list[tuple[object, object]] = []

    def walk(node: object) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) \
            if isinstance(node, list) else ()
        for key, value in items:
            if isinstance(value, (dict, list)):
                walk(value)
            else:
                nodes.append((node, key))

    walk(doc)
    parent, key = rng.choice(nodes)
    parent[key] = rng.choice([1 << 40, -1, 0, "Integer(Float('1e99999'))", "__import__('os')",
                              "torch.ops.aten.add.Tensor", None, 3.5, "x" * 10000, [1] * 1000])
    return json.dumps(doc).encode()


def test_mutated_archives_are_refused_or_served(hardened, tmp_path: Path):
    daemon, x, y = hardened
    rng = random.Random(SEED)
    base = _archive(x)
    codes: Counter[str] = Counter()
    accepted: list[str] = []
    with Client(daemon.target, timeout=60) as client:
        for i in range(ARCHIVES):
            kind = i % 4
            if kind == 0:  # flipped bytes
                data = bytearray(base)
                for _ in range(rng.randrange(1, 8)):
                    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
                data = bytes(data)
            elif kind == 1:  # cut short
                data = base[: rng.randrange(len(base))]
            else:  # a hostile value in the graph or the weights' config
                entry = "models/model.json" if kind == 2 else "model_weights_config.json"
                data = _rezip(base, entry, lambda b: _mutate_json(b, rng))
            path = tmp_path / f"fuzz{i}.pt2"
            path.write_bytes(data)
            try:
                client.load_file(f"fuzz{i}", path, wait=False)  # the upload is what is fuzzed
                codes["OK"] += 1
                accepted.append(f"fuzz{i}")
            except CuvildError as e:
                codes[e.code] += 1
                assert e.code != "UNKNOWN", e.message
        for name in accepted:  # what got in is built or failed cleanly, and goes again
            client.unload(name)
        torch.testing.assert_close(client.infer("mlp", x)["output0"], y)
    assert codes["UNKNOWN"] == 0
    print(f"fuzzed archives: {dict(codes)}")
