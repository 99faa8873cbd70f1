"""An HTTP inference body as the protocol's ModelInferRequest, and a response as its JSON.

KServe v2 / Triton's HTTP form: a JSON head (`inputs`, `outputs`, `parameters`), tensors as
JSON `data` or as binary data after the head (Inference-Header-Content-Length), or in a
shared-memory region. Everything a client sends is checked before it costs anything: the
head's size (limits.http.max_json_bytes), each input's name, datatype and shape against the
model's declared inputs before its data is turned into an array (JSON tensors cost ~10x their
bytes as Python objects and arrays), and every number against the range protobuf and numpy
take; each refusal is a `Refused` naming the field, never an exception of numpy's or
protobuf's (once 500s with a traceback each, issue 49).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from cuvild.core.dtypes import BY_OIP, TABLE
from cuvild.serve.errors import Refused
from protos import inference_pb2 as pb

HEADER_LENGTH = "Inference-Header-Content-Length"
# JSON data's numpy types, from the one dtype table; BF16 travels as binary data only
NUMPY = {d.oip: np.dtype(d.name) for d in TABLE if d.oip and d.numpy}
SHM = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")
INT64_MAX = (1 << 63) - 1  # protobuf's int64 (shapes, shared-memory offsets and sizes)
_DIGITS = re.compile(r"[0-9]{1,15}")  # ASCII digits only: str.isdigit() takes "²"


def bad(message: str) -> Refused:
    return Refused("invalid", message)


def too_large(message: str) -> Refused:
    return Refused("exhausted", message, http=413)


Inputs = dict[str, tuple[str, list[int]]]  # a model's inputs: name -> (OIP datatype, shape)


def infer_request(name: str, version: str, body: bytes, header_length: str | None,
                  max_json_bytes: int, inputs: Inputs) -> tuple[Any, set[str], bool]:
    """The protocol's ModelInferRequest for an HTTP body to a model that takes `inputs`; the
    outputs asked as binary data, and whether every output is (binary_data_output)."""
    if header_length is not None:
        if not _DIGITS.fullmatch(header_length) or int(header_length) > len(body):
            raise bad(f"{HEADER_LENGTH} {header_length!r}: expected 0..{len(body)}")
        head, binary = body[:int(header_length)], memoryview(body)[int(header_length):]
    else:
        head, binary = body, memoryview(b"")
    if len(head) > max_json_bytes:
        raise too_large(f"the JSON part of the request is {len(head)} bytes, over "
                        f"{max_json_bytes} (limits.http.max_json_bytes): send large tensors "
                        f"as binary data ({HEADER_LENGTH}) or in shared memory")
    try:
        doc = orjson.loads(head or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise bad("expected a JSON object with an 'inputs' list")
    request = pb.ModelInferRequest(model_name=name, model_version=version,
                                   id=str(doc.get("id", ""))[:1024])
    at = 0
    for tensor in doc["inputs"]:
        raw, at = _input(request, tensor, binary, at, inputs)
        if raw is not None:  # None: in shared memory
            request.raw_input_contents.append(raw)
    if at != len(binary):
        raise bad(f"{len(binary) - at} byte(s) of binary data follow the inputs' binary_data_size")
    outputs, params = doc.get("outputs") or [], doc.get("parameters") or {}
    if not isinstance(outputs, list) or not isinstance(params, dict):
        raise bad("'outputs' must be a list and 'parameters' an object")
    return request, _outputs(request, outputs), bool(params.get("binary_data_output"))


def _outputs(request: Any, outputs: list[Any]) -> set[str]:
    """The outputs asked for, into `request`; those asked as binary data."""
    binary_out: set[str] = set()
    for out in outputs:
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise bad("each of 'outputs' needs a 'name'")
        params = out.get("parameters") or {}
        if not isinstance(params, dict):
            raise bad(f"output {out['name']!r}: 'parameters' must be an object")
        _shm_params(request.outputs.add(name=out["name"]).parameters, params,
                    f"output {out['name']!r}")
        if params.get("binary_data"):
            binary_out.add(out["name"])
    return binary_out


def _shm_params(into: Any, params: dict[str, Any], where: str) -> None:
    """The protocol's shared-memory parameters of a JSON tensor, as gRPC carries them (the
    servicer checks their values against the region)."""
    for key in SHM:
        value = params.get(key)
        if value is None:
            continue
        if isinstance(value, str):
            into[key].string_param = value
        elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT64_MAX:
            into[key].int64_param = value
        else:
            raise bad(f"{where}: parameter {key!r} must be a string or an integer in "
                      f"[0, 2^63), got {str(value)[:40]}")


def _checked(name: str, datatype: Any, shape: Any, inputs: Inputs) -> None:
    """A tensor's name, datatype and shape against the model's inputs (before its data)."""
    if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= INT64_MAX
            for d in shape):
        raise bad(f"input {name!r}: 'shape' must be a list of sizes, got {str(shape)[:80]}")
    if not isinstance(datatype, str):
        raise bad(f"input {name!r}: 'datatype' must be a string, got {str(datatype)[:40]}")
    if name not in inputs:
        raise bad(f"unknown input {name!r}; the model takes {sorted(inputs)}")
    want, want_shape = inputs[name]
    if datatype != want:
        given = BY_OIP[datatype].name if datatype in BY_OIP else "?"
        raise bad(f"input {name!r}: expected dtype {BY_OIP[want].name} ({want}), got "
                  f"{given} ({datatype[:20]})")
    if len(shape) != len(want_shape) or any(w >= 0 and s != w
                                            for s, w in zip(shape, want_shape, strict=True)):
        raise bad(f"input {name!r}: shape {shape}, the model takes {want_shape} (-1: any)")


def _input(request: Any, tensor: Any, binary: memoryview, at: int,
           inputs: Inputs) -> tuple[bytes | None, int]:
    if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
        raise bad("each of 'inputs' needs a 'name', a 'shape' and a 'datatype'")
    name, shape, datatype = tensor["name"], tensor.get("shape"), tensor.get("datatype")
    _checked(name, datatype, shape, inputs)
    params = tensor.get("parameters") or {}
    if not isinstance(params, dict):
        raise bad(f"input {name!r}: 'parameters' must be an object")
    added = request.inputs.add(name=name, datatype=datatype, shape=shape)
    if "shared_memory_region" in params:
        _shm_params(added.parameters, params, f"input {name!r}")
        return None, at
    size = params.get("binary_data_size")
    if size is not None:
        if not is_count(size) or at + size > len(binary):
            raise bad(f"input {name!r}: binary_data_size {str(size)[:40]} is past the body's "
                      f"{len(binary)} binary bytes")
        return bytes(binary[at:at + size]), at + size
    return _json_data(name, datatype, shape, tensor.get("data")), at


def is_count(value: Any) -> bool:
    """A JSON integer >= 0 (not a bool, which Python takes for an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _json_data(name: str, datatype: str, shape: list[int], data: Any) -> bytes:
    if datatype not in NUMPY:
        raise bad(f"input {name!r}: {datatype} data must be sent as binary data "
                  f"(binary_data_size)")
    count = math.prod(shape)
    if not isinstance(data, list) or (count and len(data) != count
                                      and not (shape and len(data) == shape[0])):
        raise bad(f"input {name!r}: 'data' must be a list of {count} values (flat, or nested "
                  f"as {shape})")
    try:
        array = np.asarray(data, dtype=NUMPY[datatype])
    except (TypeError, ValueError, OverflowError) as e:
        raise bad(f"input {name!r}: 'data' is not {datatype} values: {e}") from None
    if array.size != count:
        raise bad(f"input {name!r}: {array.size} values in 'data', expected {count} for "
                  f"{datatype}{shape}")
    return array.tobytes()


def infer_response(response: Any, binary_out: set[str], everything: bool) -> web.Response:
    outputs, blobs = [], []
    raws = list(response.raw_output_contents) or [b""] * len(response.outputs)
    for out, raw in zip(response.outputs, raws, strict=True):
        item: dict[str, Any] = {"name": out.name, "datatype": out.datatype,
                                "shape": list(out.shape)}
        if "shared_memory_region" in out.parameters:  # written into the caller's region
            item["parameters"] = {k: getattr(p, p.WhichOneof("parameter_choice"))
                                  for k, p in out.parameters.items() if k in SHM}
        elif everything or out.name in binary_out or out.datatype not in NUMPY:
            item["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            item["data"] = np.frombuffer(raw, dtype=NUMPY[out.datatype])
        outputs.append(item)
    doc: dict[str, Any] = {"model_name": response.model_name,
                           "model_version": response.model_version, "outputs": outputs}
    if response.id:
        doc["id"] = response.id
    head = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return web.Response(body=head, content_type="application/json")
    return web.Response(body=b"".join([head, *blobs]), content_type="application/octet-stream",
                        headers={HEADER_LENGTH: str(len(head))})
