"""What KServe's own Python SDK says about cuvild, run in a process of its own: the kserve
package registers the protocol's messages (package `inference`) in protobuf's default pool, as
tritonclient.grpc does, so the two cannot be imported into one process (pytest's).

    python tests/serve/kserve_sdk.py manifests configs/kserve
    python tests/serve/kserve_sdk.py clients HTTP_ADDR GRPC_ADDR TOKEN INPUT.npy

Prints one JSON object on its last line."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import kserve
import kserve.models
import kubernetes.client.models
import numpy as np
import yaml
from kserve.api_client import ApiClient

MANIFESTS = {"cluster-serving-runtime.yaml": "V1alpha1ClusterServingRuntime",
             "inference-service.yaml": "V1beta1InferenceService",
             "cuvild-config.yaml": "V1Secret"}
PRIMITIVE: dict[str, Any] = {"str": str, "int": int, "bool": bool, "float": (int, float),
                             "object": object}


def sdk(data: Any, kind: str) -> Any:
    """`data` (a manifest's YAML) as the SDK's object of type `kind`: a kserve model class
    (OpenAPI-generated: a key it does not map fails here), a kubernetes one (pydantic, extra
    keys forbidden, required fields checked), or 'list[X]' / 'dict(str, X)' / a primitive."""
    if kind.startswith("list["):
        return [sdk(d, kind[5:-1]) for d in data]
    if kind.startswith("dict("):
        value = kind[5:-1].split(", ", 1)[1]
        return {k: sdk(v, value) for k, v in data.items()}
    if kind in PRIMITIVE:
        if not isinstance(data, PRIMITIVE[kind]):
            raise TypeError(f"expected {kind}, got {data!r}")
        return data
    klass = getattr(kserve.models, kind, None)
    if klass is None:
        return getattr(kubernetes.client.models, kind).model_validate(data)
    fields = {v: k for k, v in klass.attribute_map.items()}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise KeyError(f"{kind} has no field {unknown}")
    return klass(**{fields[k]: sdk(v, klass.openapi_types[fields[k]]) for k, v in data.items()})


def within(given: Any, back: Any) -> bool:
    """Every field of `given` is in `back` with the same value (the SDK adds defaults)."""
    if isinstance(given, dict):
        return isinstance(back, dict) and all(k in back and within(v, back[k])
                                              for k, v in given.items())
    if isinstance(given, list):
        return (isinstance(back, list) and len(given) == len(back)
                and all(within(a, b) for a, b in zip(given, back, strict=True)))
    return bool(given == back)


def manifests(folder: str) -> dict[str, Any]:
    result = {}
    for name, kind in MANIFESTS.items():
        data = yaml.safe_load((Path(folder) / name).read_text())
        try:
            back = ApiClient().sanitize_for_serialization(sdk(data, kind))
            result[name] = {"kind": kind, "round_trip": within(data, back)}
        except Exception as e:  # noqa: BLE001 - reported to the test, which names the file
            result[name] = {"kind": kind, "error": f"{type(e).__name__}: {e}"}
    try:
        sdk({"spec": {"protocolVersion": ["v2"]}}, "V1alpha1ClusterServingRuntime")
        result["misspelt field refused"] = False
    except KeyError:
        result["misspelt field refused"] = True
    return result


async def clients(http: str, grpc_address: str, token: str, x: np.ndarray) -> dict[str, Any]:
    def request(binary: bool) -> kserve.InferRequest:
        given = kserve.InferInput("x", list(x.shape), "FP32")
        given.set_data_from_numpy(x, binary_data=binary)
        return kserve.InferRequest(model_name="mlp", infer_inputs=[given], request_id="k1")

    auth = {"Authorization": f"Bearer {token}"}
    out: dict[str, Any] = {}
    rest = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", retries=0))
    try:
        base = f"http://{http}"
        out["rest_ready"] = [await rest.is_server_ready(base, headers=auth),
                             await rest.is_model_ready(base, "mlp", headers=auth)]
        for binary in (True, False):
            reply = await rest.infer(base, request(binary), model_name="mlp", headers=dict(auth))
            out[f"rest_{'binary' if binary else 'json'}"] = {
                "id": reply.id, "output": reply.outputs[0].as_numpy().tolist()}
    finally:
        await rest.close()
    metadata = (("authorization", f"Bearer {token}"),)
    async with kserve.InferenceGRPCClient(grpc_address, retries=0) as client:
        out["grpc_ready"] = [await client.is_server_ready(headers=metadata),
                             await client.is_model_ready("mlp", headers=metadata)]
        reply = await client.infer(request(True), headers=metadata)
        out["grpc"] = {"id": reply.id, "output": reply.outputs[0].as_numpy().tolist()}
    return out


if __name__ == "__main__":
    if sys.argv[1] == "manifests":
        print(json.dumps(manifests(sys.argv[2])))
    else:
        http, grpc_address, token, path = sys.argv[2:6]
        print(json.dumps(asyncio.run(clients(http, grpc_address, token, np.load(path)))))
