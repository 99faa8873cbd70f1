"""The Open Inference Protocol data plane (inference.GRPCInferenceService).

ModelInfer is the request path, read top to bottom in `ModelInfer`: find the served model
once; match the request's tensors to the model's inputs by name (the protocol's own rules);
have the engine check every input's dtype and shape against the model's input table (the one
check) and pick the bucket of a dynamic-shape model; take each input's bytes from the raw
contents, typed contents or a shared-memory region (read in place); run; return outputs as raw
bytes or write them into the client's regions.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

import cuvild
from cuvild.core.dtypes import BY_OIP, nbytes, oip_name
from cuvild.core.errors import InferError
from cuvild.core.layout import BadInput, check_inputs
from cuvild.core.loaded import LoadedModel, Out
from cuvild.intake.registry import RegistryError
from cuvild.load.models import ModelManager, ServedModel
from cuvild.serve import modelinfo
from cuvild.serve.cuda_regions import CudaRegions
from cuvild.serve.errors import Refused, abort, find, status
from cuvild.serve.limits import Gate
from cuvild.serve.oip_stream import StreamInfer
from cuvild.serve.regions import RegionError, Regions
from protos import inference_pb2 as pb
from protos import inference_pb2_grpc
from protos.orders import RawTensor, TensorRef

if TYPE_CHECKING:
    from cuvild.run.runner import Runner
    from cuvild.serve.metrics import Metrics
    from cuvild.serve.tracing import Tracer

log = logging.getLogger(__name__)


def _param(params: Any, key: str, where: str) -> Any:
    """A shared-memory parameter of a tensor, of the type the protocol gives it: the region's
    name a non-empty string, offsets and sizes integers >= 0; None when absent."""
    if key not in params:
        return None
    p = params[key]
    which = p.WhichOneof("parameter_choice")
    if key == "shared_memory_region":
        if which != "string_param" or not p.string_param:
            raise Refused("invalid", f"{where}: parameter {key!r} must "
                          f"be a region's name (string_param), got {which or 'no value'}")
        return p.string_param
    if which != "int64_param":
        raise Refused("invalid", f"{where}: parameter {key!r} must be "
                      f"an integer (int64_param), got {which or 'no value'}")
    value = getattr(p, which)
    if value < 0:
        raise Refused("invalid", f"{where}: parameter {key!r} must be "
                      f">= 0, got {value}")
    return value


def _deadline(context: grpc.ServicerContext) -> float | None:
    """The caller's deadline on the monotonic clock; None when it set none (the runner's
    run_timeout_s then bounds the run)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e6 else time.monotonic() + remaining


class InferenceService(StreamInfer, inference_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, models: ModelManager, runner: Runner | None, regions: Regions,
                 shm_enabled: bool = True,
                 peer_uid: Callable[[str], int | None] = lambda peer: None,
                 metrics: Metrics | None = None, tracer: Tracer | None = None,
                 gate: Gate | None = None, cuda: CudaRegions | None = None,
                 generator: Any = None) -> None:
        self.generator = generator  # a language model's tokens (ModelStreamInfer)
        self.gate = gate or Gate(32)  # this listener's threads for calls that may wait
        self.cuda = cuda or CudaRegions()  # the cuda_shared_memory extension's regions
        self.models = models  # what is registered and whether it is READY
        self.runner = runner  # what runs it (None: a front with no engine, in tests)
        self.regions = regions
        self.shm_enabled = shm_enabled
        self.peer_uid = peer_uid  # the caller's uid from context.peer() (cuvild/serve/front.py)
        self.metrics = metrics
        self.tracer = tracer

    # -- health and metadata ---------------------------------------------------------------
    def ServerLive(self, request, context):  # noqa: N802
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):  # noqa: N802
        """Ready once no registered model is still loading (each is READY or failed), as
        Triton's strict readiness: a readiness probe holds traffic until then. A failed model
        does not hold it; ModelReady and the model's state say which one failed. Nor is it
        ready while the model repository is read (its models are not all registered yet),
        or after a scan of it failed as a whole (a bug: the pod would serve nothing)."""
        models = self.models
        return pb.ServerReadyResponse(ready=not models.scanning and not models.scan_failed
                                      and not any(m.state == "LOADING" for m in models.all()))

    def ServerMetadata(self, request, context):  # noqa: N802
        extensions = ["model_repository"] + (["system_shared_memory", "cuda_shared_memory"]
                                             if self.shm_enabled else [])
        return pb.ServerMetadataResponse(name="cuvild", version=cuvild.__version__,
                                         extensions=extensions)

    def ModelReady(self, request, context):  # noqa: N802
        served = self.models.get(request.name, request.version)
        return pb.ModelReadyResponse(ready=served is not None and served.state == "READY")

    def _served(self, name: str, version: str, context: grpc.ServicerContext,
                ready: bool = True) -> ServedModel:
        try:
            return self._find(name, version, ready)
        except Refused as e:
            context.abort(e.code, str(e))
            raise

    def _find(self, name: str, version: str, ready: bool = True) -> ServedModel:
        return find(self.models, name, version, ready)

    def ModelMetadata(self, request, context):  # noqa: N802
        served = self._served(request.name, request.version, context, ready=False)
        versions = sorted({m.record.version for m in self.models.all()
                           if m.record.name == request.name})

        def meta(specs: list[dict[str, Any]]) -> list[Any]:
            return [pb.ModelMetadataResponse.TensorMetadata(
                name=t["name"], datatype=oip_name(t["dtype"]),
                shape=t["shape"]) for t in specs]

        return pb.ModelMetadataResponse(name=request.name, versions=versions,
                                        platform="pytorch_torch_export",
                                        inputs=meta(served.record.inputs),
                                        outputs=meta(served.record.outputs))

    def ModelConfig(self, request, context):  # noqa: N802
        served = self._served(request.name, request.version, context, ready=False)
        return pb.ModelConfigResponse(config=modelinfo.model_config(served))

    def ModelStatistics(self, request, context):  # noqa: N802
        """Every model's statistics, or (a name) every version's of it, or one version's."""
        if request.name:
            self._served(request.name, request.version, context, ready=False)  # NOT_FOUND
        served = [m for m in self.models.all() if (not request.name or (
            m.record.name == request.name and request.version in ("", m.record.version)))]
        return pb.ModelStatisticsResponse(model_stats=[
            modelinfo.model_statistics(self.metrics, m) for m in served])

    # -- inference -------------------------------------------------------------------------
    def ModelInfer(self, request, context):  # noqa: N802
        t0, t0_ns, epoch_ns = time.perf_counter(), time.perf_counter_ns(), time.time_ns()
        name, version = request.model_name, request.model_version
        tracing = (self.tracer.request(context.invocation_metadata(), name, version)
                   if self.tracer else contextlib.nullcontext())
        with tracing as span:
            try:
                served = self._find(name, version)
                name, version = served.record.name, served.record.version
                with self.gate.enter(context):
                    response, batch = self._infer(served, request, context, span, t0_ns,
                                                  epoch_ns)
            except (Refused, RegionError, BadInput, InferError) as e:
                code = status(e)
                if self.metrics:  # an unknown model's failures count under no name
                    known = self.models.get(name, version) is not None
                    self.metrics.failed(name if known else "", version if known else "",
                                        code.name, time.perf_counter() - t0)
                context.abort(code, str(e))
            except Exception:  # a bug: gRPC answers UNKNOWN; it is a failure all the same
                if self.metrics:
                    self.metrics.failed(name, version, grpc.StatusCode.UNKNOWN.name)
                raise
        if self.metrics:
            self.metrics.succeeded(name, version, time.perf_counter() - t0, batch)
        return response

    def _infer(self, served: ServedModel, request: Any, context: grpc.ServicerContext,
               span: Any, t0_ns: int, epoch_ns: int) -> tuple[Any, int]:
        """One request: its inputs checked and placed, the run, the response; and its
        batch size (the first input's first dimension) for the inference count."""
        runner = self.runner
        assert runner is not None
        caller = self.peer_uid(context.peer())
        tensors = self._match_inputs(served, request)
        declared = [(self._dtype(spec["name"], t), tuple(t.shape)) for spec, t in tensors]
        assert served.loaded is not None  # READY
        deadline = _deadline(context)
        # the request whole before a bucket is picked (or built: a compile), so that shapes
        # declared without their data build nothing and evict no one's bucket
        check_inputs(served.loaded.name, served.loaded.table, declared)
        # a CUDA region's tensors as references for the workers, unless the daemon gathers
        # the rows of a batch (cuvild/serve/cuda_regions.py)
        direct = self.cuda.direct and served.loaded.batcher is None
        inputs = self._inputs(request, tensors, declared, caller, direct)
        model = runner.resolve(served.loaded, declared, deadline=deadline)  # its bucket
        # The runner names values as in the graph; the protocol by position ("output0").
        graph_names = dict(zip([t["name"] for t in served.record.outputs], model.outputs,
                               strict=True))
        shapes = {n: model.slots[g].shape for n, g in graph_names.items()}
        wanted, output_refs, cuda_outputs = self._outputs(served, request, shapes, caller,
                                                          direct)
        timeline = [] if span is not None and span.is_recording() else None
        t_run = time.perf_counter()
        refs = {graph_names[n]: ref for n, ref in output_refs.items()}
        sequence = self._sequence(served.loaded, request)  # (the model's, not its bucket's)
        if sequence is None:
            results = runner.run_raw(model, inputs, refs, timeline=timeline, deadline=deadline)
        else:  # a step of a stateful model's sequence (Triton's sequence parameters)
            live, end = sequence
            results = runner.step(model, live, inputs, Out(refs, raw=True), timeline, deadline)
            if end:
                runner.sequences.end(live)
        if self.metrics:
            self.metrics.computed(model, time.perf_counter() - t_run)
        if cuda_outputs:
            results, names = list(results), [t["name"] for t in served.record.outputs]
            for name, (region, offset) in cuda_outputs.items():
                i = names.index(name)
                self.cuda.write(caller, region, offset, results[i])
                results[i] = None  # answered through the region
        if timeline:
            self.tracer.parts(span, model, timeline, t0_ns, epoch_ns)  # type: ignore[union-attr]
        batch = declared[0][1][0] if declared and declared[0][1] else 1
        return self._response(served, request, model, results, shapes, wanted), batch

    def _sequence(self, model: LoadedModel, request: Any) -> tuple[Any, bool] | None:
        """The live sequence a request steps (Triton's `sequence_id`, `sequence_start`,
        `sequence_end` parameters), and whether it ends it; None when it names none."""
        params = request.parameters
        given = params.get("sequence_id")
        seq = (given.string_param or (given.int64_param or given.uint64_param or "")
               if given is not None else "")
        start = bool(params["sequence_start"].bool_param) if "sequence_start" in params else False
        end = bool(params["sequence_end"].bool_param) if "sequence_end" in params else False
        if not seq:
            if start or end:
                raise BadInput("sequence_start and sequence_end need a sequence_id")
            return None
        if model.state is None:
            raise BadInput(f"model {model.name} keeps no state between requests: "
                           "sequence_id means nothing to it")
        runner = self.runner
        assert runner is not None
        seq = str(seq)
        live = (runner.sequences.begin(model.key, seq, sorted(model.parts_by_device)) if start
                else runner.sequences.get(model.key, seq))
        return live, end

    @staticmethod
    def _response(served: ServedModel, request: Any, model: LoadedModel, results: list[Any],
                  shapes: dict[str, tuple[int, ...]], wanted: dict[str, Any]) -> Any:
        response = pb.ModelInferResponse(model_name=served.record.name,
                                         model_version=served.record.version, id=request.id)
        raws = []
        for spec, value in zip(served.record.outputs, results, strict=True):
            name = spec["name"]
            if name not in wanted:
                continue
            out = response.outputs.add(name=name, shape=shapes[name],
                                       datatype=oip_name(spec["dtype"]))
            if value is None:  # written into the client's region
                for key, param in wanted[name].items():
                    out.parameters[key].CopyFrom(param)
            raws.append(value)
        if any(r is not None for r in raws):
            # Clients index raw contents by output position: shm outputs get empty entries.
            response.raw_output_contents.extend(r or b"" for r in raws)
        return response

    @staticmethod
    def _match_inputs(served: ServedModel, request: Any) -> list[tuple[dict[str, Any], Any]]:
        """The request's tensors in the model's input order, matched by name."""
        given: dict[str, Any] = {}
        for tensor in request.inputs:
            if tensor.name in given:
                raise Refused("invalid", f"input {tensor.name!r} given "
                                                                "twice")
            given[tensor.name] = tensor
        specs = served.record.inputs
        expected = [s["name"] for s in specs]
        unknown = sorted(set(given) - set(expected))
        missing = [n for n in expected if n not in given]
        if unknown or missing:
            raise Refused("invalid",
                          f"model {served.key} takes inputs {expected}; "
                          + (f"unknown {unknown} " if unknown else "")
                          + (f"missing {missing}" if missing else ""))
        return [(spec, given[spec["name"]]) for spec in specs]

    @staticmethod
    def _dtype(name: str, tensor: Any) -> str:
        dtype = BY_OIP.get(tensor.datatype)
        if dtype is None:
            raise Refused("invalid",
                          f"input {name!r}: unsupported datatype {tensor.datatype!r}")
        return dtype.name

    def _inputs(self, request: Any, tensors: list[tuple[dict[str, Any], Any]],
                declared: list[tuple[str, tuple[int, ...]]], caller: int | None,
                direct: bool = False) -> list[Any]:
        """Each input's bytes, of the dtype and shape the engine accepted."""
        # Raw contents belong, in request order, to the inputs that are not in shared memory.
        raw = list(request.raw_input_contents)
        not_shm = [t.name for t in request.inputs if "shared_memory_region" not in t.parameters]
        if raw and len(raw) != len(not_shm):
            raise Refused("invalid",
                          f"{len(raw)} raw_input_contents for {len(not_shm)} inputs not in "
                          "shared memory")
        data = dict(zip(not_shm, raw, strict=False))
        return [self._input(spec["name"], tensor, dtype, shape, data.get(spec["name"]), caller,
                            direct)
                for (spec, tensor), (dtype, shape) in zip(tensors, declared, strict=True)]

    def _input(self, name: str, tensor: Any, dtype: str, shape: tuple[int, ...],
               data: bytes | None, caller: int | None, direct: bool = False) -> Any:
        size = nbytes(dtype, shape)
        where = f"input {name!r}"
        region = _param(tensor.parameters, "shared_memory_region", where)
        if region is not None:
            if not self.shm_enabled:
                raise Refused("denied",
                              "shared memory is off for this listener (shm.allow_tcp_clients)")
            given = _param(tensor.parameters, "shared_memory_byte_size", where)
            if given is not None and given != size:
                raise Refused("invalid",
                              f"input {name!r}: shared_memory_byte_size {given} != {size} "
                              f"bytes of {tensor.datatype}{list(shape)}")
            offset = _param(tensor.parameters, "shared_memory_offset", where) or 0
            if self.cuda.has(caller, region):  # read by the workers, or staged here
                if direct:
                    return self.cuda.ref(caller, region, offset, dtype, shape, size)
                return RawTensor(self.cuda.read(caller, region, offset, size), dtype,
                                 shape)
            reg, absolute = self.regions.locate(caller, region, offset, size)
            return TensorRef(reg.object_name, absolute, dtype, shape, reg.inode)
        if data is not None:
            if len(data) != size:
                raise Refused("invalid",
                              f"input {name!r}: {len(data)} raw bytes, expected {size} for "
                              f"{tensor.datatype}{list(shape)}")
            return RawTensor(data, dtype, shape)  # the engine copies it once, into the arena
        field = BY_OIP[tensor.datatype].contents
        if field is None:
            raise Refused("invalid",
                          f"input {name!r}: {tensor.datatype} must be sent as raw contents")
        values = getattr(tensor.contents, field)
        count = size // BY_OIP[tensor.datatype].itemsize
        if len(values) != count:
            raise Refused("invalid",
                          f"input {name!r}: {len(values)} values in contents, expected {count}")
        import torch

        return torch.tensor(list(values), dtype=getattr(torch, dtype)).view(shape)

    def _outputs(self, served: ServedModel, request: Any, shapes: dict[str, tuple[int, ...]],
                 caller: int | None, direct: bool = False,
                 ) -> tuple[dict[str, Any], dict[str, Any], dict[str, tuple[str, int]]]:
        specs = {t["name"]: t for t in served.record.outputs}
        if not request.outputs:
            return {n: {} for n in specs}, {}, {}
        wanted: dict[str, Any] = {}
        refs: dict[str, TensorRef] = {}
        cuda: dict[str, tuple[str, int]] = {}  # output -> CUDA region, offset
        for out in request.outputs:
            if out.name not in specs:
                raise Refused("invalid",
                              f"unknown output {out.name!r}; model {served.key} has "
                              f"{sorted(specs)}")
            wanted[out.name] = {}
            where = f"output {out.name!r}"
            region = _param(out.parameters, "shared_memory_region", where)
            if region is None:
                continue
            if not self.shm_enabled:
                raise Refused("denied",
                              "shared memory is off for this listener (shm.allow_tcp_clients)")
            spec = specs[out.name]
            size = nbytes(spec["dtype"], shapes[out.name])
            given = _param(out.parameters, "shared_memory_byte_size", where)
            if given is not None and given < size:
                raise Refused("invalid",
                              f"output {out.name!r}: shared_memory_byte_size {given} < {size} "
                              "bytes needed")
            offset = _param(out.parameters, "shared_memory_offset", where) or 0
            wanted[out.name] = dict(out.parameters)
            if self.cuda.has(caller, region):  # by its worker, or after the run from host
                if direct:
                    refs[out.name] = self.cuda.ref(caller, region, offset, spec["dtype"],
                                                   shapes[out.name], size)
                else:
                    cuda[out.name] = (region, offset)
                continue
            reg, absolute = self.regions.locate(caller, region, offset, size)
            refs[out.name] = TensorRef(reg.object_name, absolute, spec["dtype"],
                                       shapes[out.name], reg.inode)
        return wanted, refs, cuda

    # -- repository ------------------------------------------------------------------------
    def RepositoryIndex(self, request, context):  # noqa: N802
        response = pb.RepositoryIndexResponse()
        for served in self.models.all():
            if request.ready and served.state != "READY":
                continue
            response.models.add(name=served.record.name, version=served.record.version,
                                state=served.state, reason=served.reason)
        if not request.ready:  # model repository entries that could not be registered
            for name, version, why in self.models.refusals():
                response.models.add(name=name, version=version, state="UNAVAILABLE",
                                    reason=why)
        return response

    def RepositoryModelLoad(self, request, context):  # noqa: N802
        """(Re)prepare a registered model; models arrive through cuvil.v1 LoadModel."""
        try:
            record = self.models.registry.get(request.model_name)
        except RegistryError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, f"{e}; upload it with `cuvilctl load`")
        try:
            served = self.models.submit(record)
        except RuntimeError:  # the prepare pool is shut down: the daemon is stopping
            context.abort(grpc.StatusCode.UNAVAILABLE, "cuvild is stopping")
        remaining = context.time_remaining()
        try:
            with self.gate.enter(context):
                served = self.models.wait_ready(request.model_name, timeout=min(
                    600.0, remaining if remaining is not None else 600.0))
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
            abort(context, e)
        return pb.SystemSharedMemoryRegisterResponse()

    def SystemSharedMemoryUnregister(self, request, context):  # noqa: N802
        caller = self._caller(context)
        try:
            gone = self.regions.unregister(caller, request.name)
        except RegionError as e:
            abort(context, e)
        # The workers unmap them too: an unlinked object lives as long as a mapping does.
        self.models.builder.forget_segments([(r.object_name, r.inode) for r in gone])
        return pb.SystemSharedMemoryUnregisterResponse()

    def SystemSharedMemoryStatus(self, request, context):  # noqa: N802
        caller = self._caller(context)
        try:
            regions = self.regions.status(caller, request.name)
        except RegionError as e:
            abort(context, e)
        response = pb.SystemSharedMemoryStatusResponse()
        for r in regions:
            response.regions[r.name].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(
                name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size))
        return response

    def CudaSharedMemoryRegister(self, request, context):  # noqa: N802
        caller = self._caller(context)
        try:
            self.cuda.register(caller, request.name, request.raw_handle,
                                       request.device_id, request.byte_size)
        except RegionError as e:
            abort(context, e)
        return pb.CudaSharedMemoryRegisterResponse()

    def CudaSharedMemoryUnregister(self, request, context):  # noqa: N802
        caller = self._caller(context)
        try:
            gone = self.cuda.unregister(caller, request.name)
        except RegionError as e:
            abort(context, e)
        self.models.builder.forget_segments([(r.object_name, 0) for r in gone])  # (theirs)
        return pb.CudaSharedMemoryUnregisterResponse()

    def CudaSharedMemoryStatus(self, request, context):  # noqa: N802
        caller = self._caller(context)
        try:
            regions = self.cuda.status(caller, request.name)
        except RegionError as e:
            abort(context, e)
        response = pb.CudaSharedMemoryStatusResponse()
        for r in regions:
            response.regions[r.name].CopyFrom(pb.CudaSharedMemoryStatusResponse.RegionStatus(
                name=r.name, device_id=r.device_id, byte_size=r.byte_size))
        return response
