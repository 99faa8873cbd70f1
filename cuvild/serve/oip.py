"""The Open Inference Protocol data plane (inference.GRPCInferenceService).

ModelInfer is the request path: check the request against the model's metadata, take each
input from raw bytes, typed contents or a shared-memory region (read in place), run the
engine, and return outputs as raw bytes or write them into the client's regions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

import cuvild
from cuvild.engine.engine import BadInput, InferError
from cuvild.engine.models import ModelManager, ServedModel
from cuvild.engine.worker import RawTensor, TensorRef, itemsize, nbytes
from cuvild.intake.registry import RegistryError
from cuvild.serve.regions import RegionError, Regions
from protos import inference_pb2 as pb
from protos import inference_pb2_grpc

log = logging.getLogger(__name__)

# OIP datatype <-> torch dtype name, and the typed-contents field that carries it.
DATATYPES = {
    "BOOL": ("bool", "bool_contents"), "UINT8": ("uint8", "uint_contents"),
    "INT8": ("int8", "int_contents"), "INT16": ("int16", "int_contents"),
    "INT32": ("int32", "int_contents"), "INT64": ("int64", "int64_contents"),
    "FP16": ("float16", None), "BF16": ("bfloat16", None),
    "FP32": ("float32", "fp32_contents"), "FP64": ("float64", "fp64_contents"),
}
TORCH_TO_OIP = {torch_name: oip for oip, (torch_name, _) in DATATYPES.items()}
CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "exists": grpc.StatusCode.ALREADY_EXISTS,
         "not_found": grpc.StatusCode.NOT_FOUND, "denied": grpc.StatusCode.PERMISSION_DENIED}


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _param(params: Any, key: str) -> Any:
    if key not in params:
        return None
    p = params[key]
    return getattr(p, p.WhichOneof("parameter_choice"))


class InferenceService(inference_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, models: ModelManager, regions: Regions, shm_enabled: bool = True,
                 peer_uid: Callable[[str], int | None] = lambda peer: None) -> None:
        self.models = models
        self.regions = regions
        self.shm_enabled = shm_enabled
        self.peer_uid = peer_uid  # the caller's uid from context.peer() (cuvild/serve/front.py)

    # -- health and metadata ---------------------------------------------------------------
    def ServerLive(self, request, context):  # noqa: N802
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):  # noqa: N802
        return pb.ServerReadyResponse(ready=True)

    def ServerMetadata(self, request, context):  # noqa: N802
        extensions = ["model_repository"] + (["system_shared_memory"] if self.shm_enabled else [])
        return pb.ServerMetadataResponse(name="cuvild", version=cuvild.__version__,
                                         extensions=extensions)

    def ModelReady(self, request, context):  # noqa: N802
        served = self.models.get(request.name, request.version)
        return pb.ModelReadyResponse(ready=served is not None and served.state == "READY")

    def _served(self, name: str, version: str, context: grpc.ServicerContext,
                ready: bool = True) -> ServedModel:
        served = self.models.get(name, version)
        if served is None:
            what = f"{name!r}" + (f" version {version!r}" if version else "")
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {what}")
        if ready and served.state != "READY":
            detail = f": {served.reason}" if served.reason else " (still loading)"
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"model {served.key} is {served.state.lower()}{detail}")
        return served

    def ModelMetadata(self, request, context):  # noqa: N802
        served = self._served(request.name, request.version, context, ready=False)
        versions = sorted({m.record.version for m in self.models.all()
                           if m.record.name == request.name})

        def meta(specs: list[dict[str, Any]]) -> list[Any]:
            return [pb.ModelMetadataResponse.TensorMetadata(
                name=t["name"], datatype=TORCH_TO_OIP.get(t["dtype"], t["dtype"].upper()),
                shape=t["shape"]) for t in specs]

        return pb.ModelMetadataResponse(name=request.name, versions=versions,
                                        platform="pytorch_torch_export",
                                        inputs=meta(served.record.inputs),
                                        outputs=meta(served.record.outputs))

    # -- inference -------------------------------------------------------------------------
    def ModelInfer(self, request, context):  # noqa: N802

        served = self._served(request.model_name, request.model_version, context)
        try:
            caller = self.peer_uid(context.peer())
            inputs = self._inputs(served, request, caller)
            loaded = self.models.engine.resolve(served.key, inputs)  # per shape if dynamic
            # The engine names values as in the graph; the protocol by position ("output0").
            graph_names = dict(zip([t["name"] for t in served.record.outputs], loaded.outputs,
                                   strict=True))
            shapes = {n: loaded.slots[g].shape for n, g in graph_names.items()}
            wanted, output_refs = self._outputs(served, request, shapes, caller)
            results = self.models.engine.infer(
                loaded.key, inputs, {graph_names[n]: ref for n, ref in output_refs.items()},
                raw=True)
        except Refused as e:
            context.abort(e.code, str(e))
        except RegionError as e:
            context.abort(CODES[e.kind], str(e))
        except BadInput as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except InferError as e:
            context.abort(grpc.StatusCode.INTERNAL, str(e))
        response = pb.ModelInferResponse(model_name=served.record.name,
                                         model_version=served.record.version, id=request.id)
        specs = {t["name"]: t for t in served.record.outputs}
        raws = []
        for name, value in zip([t["name"] for t in served.record.outputs], results, strict=True):
            if name not in wanted:
                continue
            spec = specs[name]
            out = response.outputs.add(name=name, shape=shapes[name],
                                       datatype=TORCH_TO_OIP[spec["dtype"]])
            if value is None:  # written into the client's region
                for key, param in wanted[name].items():
                    out.parameters[key].CopyFrom(param)
                raws.append(None)
            else:
                raws.append(value)
        if any(r is not None for r in raws):
            # Clients index raw contents by output position: shm outputs get empty entries.
            response.raw_output_contents.extend(r or b"" for r in raws)
        return response

    def _inputs(self, served: ServedModel, request: Any, caller: int | None) -> list[Any]:
        specs = served.record.inputs
        given = {}
        for i, tensor in enumerate(request.inputs):
            if tensor.name in given:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"input {tensor.name!r} given "
                                                                "twice")
            given[tensor.name] = (i, tensor)
        expected = [s["name"] for s in specs]
        unknown = sorted(set(given) - set(expected))
        missing = [n for n in expected if n not in given]
        if unknown or missing:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"model {served.key} takes inputs {expected}; "
                          + (f"unknown {unknown} " if unknown else "")
                          + (f"missing {missing}" if missing else ""))
        # Raw contents belong, in request order, to the inputs that are not in shared memory.
        raw = list(request.raw_input_contents)
        not_shm = [t.name for t in request.inputs if "shared_memory_region" not in t.parameters]
        if raw and len(raw) != len(not_shm):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{len(raw)} raw_input_contents for {len(not_shm)} inputs not in "
                          "shared memory")
        data = dict(zip(not_shm, raw, strict=False))
        return [self._input(spec, given[spec["name"]][1], data.get(spec["name"]), caller)
                for spec in specs]

    def _input(self, spec: dict[str, Any], tensor: Any, data: bytes | None,
               caller: int | None) -> Any:
        import torch

        name = spec["name"]
        if tensor.datatype not in DATATYPES:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"input {name!r}: unsupported datatype {tensor.datatype!r}")
        dtype, field = DATATYPES[tensor.datatype]
        if dtype != spec["dtype"]:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"input {name!r}: expected datatype {TORCH_TO_OIP[spec['dtype']]}, "
                          f"got {tensor.datatype}")
        shape = tuple(tensor.shape)
        if len(shape) != len(spec["shape"]) or any(
                want not in (-1, got) for want, got in zip(spec["shape"], shape, strict=True)):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"input {name!r}: expected shape {spec['shape']}, got {list(shape)}")
        size = nbytes(dtype, shape)
        region = _param(tensor.parameters, "shared_memory_region")
        if region is not None:
            if not self.shm_enabled:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                              "shared memory is off for this listener (shm.allow_tcp_clients)")
            given = _param(tensor.parameters, "shared_memory_byte_size")
            if given is not None and given != size:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"input {name!r}: shared_memory_byte_size {given} != {size} "
                              f"bytes of {tensor.datatype}{list(shape)}")
            offset = _param(tensor.parameters, "shared_memory_offset") or 0
            reg, absolute = self.regions.locate(caller, region, offset, size)
            return TensorRef(reg.object_name, absolute, dtype, shape, reg.inode)
        if data is not None:
            if len(data) != size:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"input {name!r}: {len(data)} raw bytes, expected {size} for "
                              f"{tensor.datatype}{list(shape)}")
            return RawTensor(data, dtype, shape)  # the engine copies it once, into the arena
        if field is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"input {name!r}: {tensor.datatype} must be sent as raw contents")
        values = getattr(tensor.contents, field)
        count = size // itemsize(dtype)
        if len(values) != count:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"input {name!r}: {len(values)} values in contents, expected {count}")
        return torch.tensor(list(values), dtype=getattr(torch, dtype)).view(shape)

    def _outputs(self, served: ServedModel, request: Any, shapes: dict[str, tuple[int, ...]],
                 caller: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
        specs = {t["name"]: t for t in served.record.outputs}
        if not request.outputs:
            return {n: {} for n in specs}, {}
        wanted, refs = {}, {}
        for out in request.outputs:
            if out.name not in specs:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"unknown output {out.name!r}; model {served.key} has "
                              f"{sorted(specs)}")
            wanted[out.name] = {}
            region = _param(out.parameters, "shared_memory_region")
            if region is None:
                continue
            if not self.shm_enabled:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                              "shared memory is off for this listener (shm.allow_tcp_clients)")
            spec = specs[out.name]
            size = nbytes(spec["dtype"], shapes[out.name])
            given = _param(out.parameters, "shared_memory_byte_size")
            if given is not None and given < size:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"output {out.name!r}: shared_memory_byte_size {given} < {size} "
                              "bytes needed")
            offset = _param(out.parameters, "shared_memory_offset") or 0
            reg, absolute = self.regions.locate(caller, region, offset, size)
            refs[out.name] = TensorRef(reg.object_name, absolute, spec["dtype"],
                                       shapes[out.name], reg.inode)
            wanted[out.name] = dict(out.parameters)
        return wanted, refs

    # -- repository ------------------------------------------------------------------------
    def RepositoryIndex(self, request, context):  # noqa: N802
        response = pb.RepositoryIndexResponse()
        for served in self.models.all():
            if request.ready and served.state != "READY":
                continue
            response.models.add(name=served.record.name, version=served.record.version,
                                state=served.state, reason=served.reason)
        return response

    def RepositoryModelLoad(self, request, context):  # noqa: N802
        """(Re)prepare a registered model; models arrive through cuvil.v1 LoadModel."""
        try:
            record = self.models.registry.get(request.model_name)
        except RegistryError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, f"{e}; upload it with `cuvilctl load`")
        served = self.models.submit(record)
        try:
            served = self.models.wait_ready(request.model_name)
        except TimeoutError as e:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        if served.state != "READY":
            context.abort(grpc.StatusCode.INTERNAL, f"model {served.key}: {served.reason}")
        return pb.RepositoryModelLoadResponse()

    def RepositoryModelUnload(self, request, context):  # noqa: N802
        """Stop serving the model (it stays registered: `cuvilctl unload` deletes it)."""
        if self.models.get(request.model_name) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model_name!r}")
        self.models.remove(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory ---------------------------------------------------------------------
    def _caller(self, context: grpc.ServicerContext) -> int | None:
        if not self.shm_enabled:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          "shared memory is off for this listener (shm.allow_tcp_clients)")
        return self.peer_uid(context.peer())

    def SystemSharedMemoryRegister(self, request, context):  # noqa: N802
        caller = self._caller(context)
        try:
            self.regions.register(caller, request.name, request.key, request.offset,
                                  request.byte_size)
        except RegionError as e:
            context.abort(CODES[e.kind], str(e))
        return pb.SystemSharedMemoryRegisterResponse()

    def SystemSharedMemoryUnregister(self, request, context):  # noqa: N802
        caller = self._caller(context)
        try:
            gone = self.regions.unregister(caller, request.name)
        except RegionError as e:
            context.abort(CODES[e.kind], str(e))
        # The workers unmap them too: an unlinked object lives as long as a mapping does.
        self.models.engine.forget_segments([(r.object_name, r.inode) for r in gone])
        return pb.SystemSharedMemoryUnregisterResponse()

    def SystemSharedMemoryStatus(self, request, context):  # noqa: N802
        caller = self._caller(context)
        try:
            regions = self.regions.status(caller, request.name)
        except RegionError as e:
            context.abort(CODES[e.kind], str(e))
        response = pb.SystemSharedMemoryStatusResponse()
        for r in regions:
            response.regions[r.name].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(
                name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size))
        return response

    def _no_cuda(self, context: grpc.ServicerContext) -> None:
        import torch

        reason = ("CUDA shared memory is not supported by this cuvild yet"
                  if torch.cuda.is_available() else "no CUDA device on this host")
        context.abort(grpc.StatusCode.UNIMPLEMENTED, reason)

    def CudaSharedMemoryRegister(self, request, context):  # noqa: N802
        self._no_cuda(context)

    def CudaSharedMemoryUnregister(self, request, context):  # noqa: N802
        self._no_cuda(context)

    def CudaSharedMemoryStatus(self, request, context):  # noqa: N802
        return pb.CudaSharedMemoryStatusResponse()
