"""The Open Inference Protocol over HTTP/REST (`listen.http`), as KServe v2 and Triton serve it.

Each request becomes the protocol's gRPC message and goes through the same servicer as a
gRPC call (cuvild/serve/oip.py `InferenceService`): one request path, one set of checks,
metrics and traces. aiohttp serves the HTTP on an event loop of its own thread; the servicer
runs on a thread pool the size of `limits.rpc_threads`, with a gate of its own, as a gRPC
listener does.

  GET  /v2                                     server metadata
  GET  /v2/health/live, /v2/health/ready       200, or 503 while not ready (no token asked:
                                               probes carry none, and these say nothing more)
  GET  /v2/models/{m}[/versions/{v}]           model metadata
  GET  /v2/models/{m}[/versions/{v}]/ready     200 or 400
  GET  /v2/models/{m}[/versions/{v}]/config    Triton's model configuration (modelinfo.py)
  GET  /v2/models[/{m}[/versions/{v}]]/stats   Triton's model statistics
  POST /v2/models/{m}[/versions/{v}]/infer     JSON tensors, and the binary tensor data
                                               extension (Inference-Header-Content-Length)
  POST /v2/repository/index                    the models and their states
  POST /v2/repository/models/{m}/load|unload   prepare a registered model again (answers
                                               once it is READY) / stop serving it
  POST /v2/systemsharedmemory/region/{r}/register        {"key", "offset", "byte_size"}
  GET  /v2/systemsharedmemory[/region/{r}]/status
  POST /v2/systemsharedmemory[/region/{r}]/unregister
  GET  /metrics                                the Prometheus metrics (metrics.enabled), as
                                               metrics.listen serves them, with the token

Errors are `{"error": "..."}` with the status Triton gives (400 bad request, 404 unknown
model or route, 405 wrong method, 503 not ready or busy). System shared memory follows the
rule of the TCP gRPC listener: off unless `shm.allow_tcp_clients`, and then only objects
owned by a uid in `shm.allowed_uids` (an HTTP caller, like a TCP one, has no uid the daemon
can check; both share one set of regions, as holders of one token). Inputs and outputs name
a region with the protocol's `shared_memory_region`, `shared_memory_offset`,
`shared_memory_byte_size` parameters. CUDA shared memory is gRPC only. A model arrives by
upload (`cuvilctl load`) or from the model repository, not by HTTP.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import orjson
from aiohttp import web

from cuvild.serve import modelinfo
from protos import inference_pb2 as pb

log = logging.getLogger(__name__)
MAX_BODY = 256 << 20  # as the gRPC listeners' message limit
HEADER_LENGTH = "Inference-Header-Content-Length"
NUMPY = {"BOOL": np.bool_, "UINT8": np.uint8, "INT8": np.int8, "INT16": np.int16,
         "INT32": np.int32, "INT64": np.int64, "FP16": np.float16, "FP32": np.float32,
         "FP64": np.float64}  # JSON data; BF16 travels as binary data only
STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
          grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
          grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
          grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.FAILED_PRECONDITION: 400}
OPEN = ("/v2/health/live", "/v2/health/ready")
SHM = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Call:
    """What the servicer reads of a gRPC call, for one HTTP request."""

    def __init__(self, request: web.Request) -> None:
        self.headers = [(k.lower(), v) for k, v in request.headers.items()]
        self.remote = request.remote or ""

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise Aborted(code, message)

    def time_remaining(self) -> float | None:
        return None  # engine.run_timeout_s bounds the run

    def peer(self) -> str:
        return f"http:{self.remote}"

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.headers  # traceparent, as gRPC metadata carries it

    def cancel(self) -> None:
        pass


def bad(message: str) -> Aborted:
    return Aborted(grpc.StatusCode.INVALID_ARGUMENT, message)


def infer_request(name: str, version: str, body: bytes,
                  header_length: str | None) -> tuple[Any, set[str], bool]:
    """The protocol's ModelInferRequest for an HTTP body; the outputs asked as binary data,
    and whether every output is (binary_data_output)."""
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise bad(f"{HEADER_LENGTH} {header_length!r}: expected 0..{len(body)}")
        head, binary = body[:int(header_length)], memoryview(body)[int(header_length):]
    else:
        head, binary = body, memoryview(b"")
    try:
        doc = orjson.loads(head or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise bad("expected a JSON object with an 'inputs' list")
    request = pb.ModelInferRequest(model_name=name, model_version=version,
                                   id=str(doc.get("id", "")))
    at = 0
    for tensor in doc["inputs"]:
        raw, at = _input(request, tensor, binary, at)
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
    servicer checks their values)."""
    for key in SHM:
        value = params.get(key)
        if value is None:
            continue
        if isinstance(value, str):
            into[key].string_param = value
        elif isinstance(value, int) and not isinstance(value, bool):
            into[key].int64_param = value
        else:
            raise bad(f"{where}: parameter {key!r} must be a string or an integer, "
                      f"got {value!r}")


def _input(request: Any, tensor: Any, binary: memoryview, at: int) -> tuple[bytes | None, int]:
    if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
        raise bad("each of 'inputs' needs a 'name', a 'shape' and a 'datatype'")
    name, shape, datatype = tensor["name"], tensor.get("shape"), tensor.get("datatype")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise bad(f"input {name!r}: 'shape' must be a list of sizes, got {shape!r}")
    if not isinstance(datatype, str):
        raise bad(f"input {name!r}: 'datatype' must be a string, got {datatype!r}")
    params = tensor.get("parameters") or {}
    if not isinstance(params, dict):
        raise bad(f"input {name!r}: 'parameters' must be an object")
    added = request.inputs.add(name=name, datatype=datatype, shape=shape)
    if "shared_memory_region" in params:
        _shm_params(added.parameters, params, f"input {name!r}")
        return None, at
    size = params.get("binary_data_size")
    if size is not None:
        if not _count(size) or at + size > len(binary):
            raise bad(f"input {name!r}: binary_data_size {size!r} is past the body's "
                      f"{len(binary)} binary bytes")
        return bytes(binary[at:at + size]), at + size
    return _json_data(name, datatype, shape, tensor.get("data")), at


def _count(value: Any) -> bool:
    """A JSON integer >= 0 (not a bool, which Python takes for an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _json_data(name: str, datatype: str, shape: list[int], data: Any) -> bytes:
    if datatype not in NUMPY:
        raise bad(f"input {name!r}: {datatype} data must be sent as binary data "
                  f"(binary_data_size)")
    try:
        array = np.asarray(data, dtype=NUMPY[datatype])
    except (TypeError, ValueError) as e:
        raise bad(f"input {name!r}: 'data' is not {datatype} values: {e}") from None
    if array.size != int(np.prod(shape)):
        raise bad(f"input {name!r}: {array.size} values in 'data', expected {int(np.prod(shape))} "
                  f"for {datatype}{shape}")
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


def reply(doc: Any, status: int = 200) -> web.Response:
    """A JSON answer typed exactly `application/json` (aiohttp's json_response adds a charset,
    which KServe's client does not take for JSON, losing the error's message)."""
    return web.Response(body=orjson.dumps(doc), status=status,
                        content_type="application/json")


def error(status: int, message: str) -> web.Response:
    return reply({"error": message}, status)


class RestServer:
    """The HTTP listener: `start` binds (raises OSError when it cannot), `stop` drains."""

    def __init__(self, service: Any, address: str, threads: int, token: str | None = None,
                 tls: ssl.SSLContext | None = None, drain_s: float = 10.0,
                 metrics: Any = None) -> None:
        self.service, self.drain_s, self.metrics = service, drain_s, metrics
        self.host, _, port = address.rpartition(":")
        self.host, self.port = self.host.strip("[]"), int(port)
        self.token, self.tls = token, tls
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="http")
        self.loop = asyncio.new_event_loop()
        self.runner: web.AppRunner | None = None
        self.thread = threading.Thread(target=self.loop.run_forever, name="http", daemon=True)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._guard])
        models = ["/v2/models/{name}", "/v2/models/{name}/versions/{version}"]
        app.router.add_get("/v2", self._server)
        app.router.add_get("/v2/health/live", self._live)
        app.router.add_get("/v2/health/ready", self._ready)
        app.router.add_get("/v2/models/stats", self._stats)  # before a model named "stats"
        for base in models:
            app.router.add_get(base + "/config", self._config)
            app.router.add_get(base + "/stats", self._stats)
            app.router.add_get(base, self._metadata)
            app.router.add_get(base + "/ready", self._model_ready)
            app.router.add_post(base + "/infer", self._infer)
        app.router.add_post("/v2/repository/index", self._index)
        app.router.add_post("/v2/repository/models/{name}/load", self._load)
        app.router.add_post("/v2/repository/models/{name}/unload", self._unload)
        shm = "/v2/systemsharedmemory"
        app.router.add_post(shm + "/region/{region}/register", self._shm_register)
        for base in (shm, shm + "/region/{region}"):
            app.router.add_get(base + "/status", self._shm_status)
            app.router.add_post(base + "/unregister", self._shm_unregister)
        if self.metrics is not None:
            app.router.add_get("/metrics", self._metrics)
        return app

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)
        log.info("HTTP/REST (Open Inference Protocol) on %s:%d", self.host, self.port)

    async def _start(self) -> None:
        # stop() waits up to drain_s for requests in progress, as gRPC's grace
        self.runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=self.drain_s)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, self.port, ssl_context=self.tls).start()

    def stop(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(
                timeout=self.drain_s + 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- handlers ----------------------------------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        if self.token and request.path not in OPEN:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return error(401, "missing or wrong bearer token (Authorization header)")
        try:
            return await handler(request)
        except Aborted as e:
            return error(STATUS.get(e.code, 500), str(e))
        except web.HTTPException as e:  # no such route or method: the protocol's JSON error
            if e.status < 400:
                raise
            return error(e.status, f"{e.reason}: {request.method} {request.path}")

    async def _call(self, method: str, message: Any, request: web.Request) -> Any:
        call = Call(request)
        return await self.loop.run_in_executor(
            self.pool, getattr(self.service, method), message, call)

    async def _server(self, request: web.Request) -> web.Response:
        meta = await self._call("ServerMetadata", pb.ServerMetadataRequest(), request)
        return reply({"name": meta.name, "version": meta.version,
                                  "extensions": [e for e in meta.extensions
                                                 if e != "cuda_shared_memory"]})

    # The status answers (Triton, the protocol); the JSON bodies are KServe's model server's,
    # which kserve.InferenceRESTClient reads.
    async def _live(self, request: web.Request) -> web.Response:
        return reply({"live": True})

    async def _ready(self, request: web.Request) -> web.Response:
        ready = await self._call("ServerReady", pb.ServerReadyRequest(), request)
        return reply({"ready": ready.ready}, status=200 if ready.ready else 503)

    async def _metadata(self, request: web.Request) -> web.Response:
        m = request.match_info
        meta = await self._call("ModelMetadata", pb.ModelMetadataRequest(
            name=m["name"], version=m.get("version", "")), request)
        tensors = [[{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                    for t in group] for group in (meta.inputs, meta.outputs)]
        return reply({"name": meta.name, "versions": list(meta.versions),
                                  "platform": meta.platform, "inputs": tensors[0],
                                  "outputs": tensors[1]})

    async def _config(self, request: web.Request) -> web.Response:
        m = request.match_info
        answer = await self._call("ModelConfig", pb.ModelConfigRequest(
            name=m["name"], version=m.get("version", "")), request)
        return reply(modelinfo.config_json(answer.config))

    async def _stats(self, request: web.Request) -> web.Response:
        m = request.match_info
        answer = await self._call("ModelStatistics", pb.ModelStatisticsRequest(
            name=m.get("name", ""), version=m.get("version", "")), request)
        return reply({"model_stats": [modelinfo.statistics_json(s)
                                      for s in answer.model_stats]})

    async def _model_ready(self, request: web.Request) -> web.Response:
        m = request.match_info
        ready = await self._call("ModelReady", pb.ModelReadyRequest(
            name=m["name"], version=m.get("version", "")), request)
        return reply({"name": m["name"], "ready": ready.ready},
                                 status=200 if ready.ready else 400)

    async def _infer(self, request: web.Request) -> web.Response:
        m = request.match_info
        message, binary_out, everything = infer_request(
            m["name"], m.get("version", ""), await request.read(),
            request.headers.get(HEADER_LENGTH))
        response = await self._call("ModelInfer", message, request)
        return infer_response(response, binary_out, everything)

    async def _index(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            ready = bool(orjson.loads(body or b"{}").get("ready", False))
        except (ValueError, AttributeError):
            raise bad("expected a JSON object, e.g. {\"ready\": true}") from None
        index = await self._call("RepositoryIndex", pb.RepositoryIndexRequest(ready=ready),
                                 request)
        return reply([{"name": i.name, "version": i.version, "state": i.state,
                                   "reason": i.reason} for i in index.models])


    async def _load(self, request: web.Request) -> web.Response:
        await self._call("RepositoryModelLoad", pb.RepositoryModelLoadRequest(
            model_name=request.match_info["name"]), request)
        return reply({})

    async def _unload(self, request: web.Request) -> web.Response:
        await self._call("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(
            model_name=request.match_info["name"]), request)
        return reply({})

    async def _metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        text = await self.loop.run_in_executor(self.pool, generate_latest, self.metrics.registry)
        return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _shm_register(self, request: web.Request) -> web.Response:
        try:
            doc = orjson.loads(await request.read() or b"{}")
        except (ValueError, UnicodeDecodeError):
            doc = None
        doc = doc if isinstance(doc, dict) else {}
        key, offset, size = doc.get("key"), doc.get("offset", 0), doc.get("byte_size")
        if not isinstance(key, str) or not _count(offset) or not _count(size):
            raise bad('expected a JSON object {"key": "/name", "offset": int, "byte_size": int}')
        await self._call("SystemSharedMemoryRegister", pb.SystemSharedMemoryRegisterRequest(
            name=request.match_info["region"], key=key, offset=offset, byte_size=size), request)
        return reply({})

    async def _shm_status(self, request: web.Request) -> web.Response:
        status = await self._call("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest(
            name=request.match_info.get("region", "")), request)
        return reply([{"name": r.name, "key": r.key, "offset": r.offset,
                                   "byte_size": r.byte_size} for r in status.regions.values()])

    async def _shm_unregister(self, request: web.Request) -> web.Response:
        await self._call("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest(
            name=request.match_info.get("region", "")), request)
        return reply({})


def tls_context(cert: str | None, key: str | None, client_ca: str | None) -> ssl.SSLContext | None:
    """listen.tls for the HTTP listener: the same cert and key; client_ca asks for client
    certificates (mutual TLS)."""
    if not cert:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    if client_ca:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
