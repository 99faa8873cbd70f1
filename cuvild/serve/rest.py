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
  POST /v2/models/{m}[/versions/{v}]/generate[_stream], /v1/completions: a language model's
                                               tokens (cuvild/serve/generate_http.py)

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import orjson
from aiohttp import web

from cuvild.config import HttpLimits
from cuvild.core.dtypes import oip_name
from cuvild.serve import generate_http, modelinfo
from cuvild.serve.errors import STATUS, Refused, find
from cuvild.serve.httpguard import Listener, body
from cuvild.serve.jsontensors import (
    HEADER_LENGTH,
    INT64_MAX,
    Inputs,
    bad,
    infer_request,
    infer_response,
    is_count,
)
from protos import inference_pb2 as pb

log = logging.getLogger(__name__)
OPEN = ("/v2/health/live", "/v2/health/ready")


class Call:
    """What the servicer reads of a gRPC call, for one HTTP request."""

    def __init__(self, request: web.Request) -> None:
        self.headers = [(k.lower(), v) for k, v in request.headers.items()]
        self.remote = request.remote or ""

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise Refused.of(code, message)

    def time_remaining(self) -> float | None:
        return None  # engine.run_timeout_s bounds the run

    def peer(self) -> str:
        return f"http:{self.remote}"

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.headers  # traceparent, as gRPC metadata carries it

    def cancel(self) -> None:
        pass


def reply(doc: Any, status: int = 200) -> web.Response:
    """A JSON answer typed exactly `application/json` (aiohttp's json_response adds a charset,
    which KServe's client does not take for JSON, losing the error's message)."""
    return web.Response(body=orjson.dumps(doc), status=status,
                        content_type="application/json")


def error(status: int, message: str, path: str = "") -> web.Response:
    """An error answer: `{"error": message}`, or on OpenAI's routes (`path` /v1/...) its
    error object, which its clients read."""
    if generate_http.is_openai(path):
        return reply({"error": generate_http.error_object(status, message)}, status)
    return reply({"error": message}, status)


class RestServer:
    """The HTTP listener: `start` binds (raises OSError when it cannot), `stop` drains."""

    def __init__(self, service: Any, address: str, threads: int, token: str | None = None,
                 tls: ssl.SSLContext | None = None, drain_s: float = 10.0,
                 metrics: Any = None, limits: HttpLimits | None = None,
                 generator: Any = None) -> None:
        self.service, self.metrics = service, metrics
        self.generator = generator  # cuvild/serve/generation.py (None: no generation routes)
        self.limits = limits or HttpLimits()
        host, _, port = address.rpartition(":")
        self.token = token
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="http")
        self.threads = threads
        self.bodies: asyncio.Semaphore | None = None  # made on the listener's loop
        self.listener = Listener(self.app(), host.strip("[]"), int(port), self.limits, "http",
                                 tls, drain_s)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes,
                              middlewares=[self._guard])
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
        if self.generator is not None:
            generate_http.register(app, self)
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
        self.listener.start()
        log.info("HTTP/REST (Open Inference Protocol) on %s:%d", self.listener.host,
                 self.listener.port)

    def stop(self) -> None:
        """Stop taking connections; requests in progress get drain_s (gRPC's grace)."""
        self.listener.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- handlers ----------------------------------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        if self.token and request.path not in OPEN:
            # bytes as sent (a header's non-ASCII arrives as surrogates): never an exception
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, f"Bearer {self.token}".encode()):
                return error(401, "missing or wrong bearer token (Authorization header)",
                             request.path)
        try:
            with self.listener.guard.handling(request):
                return await handler(request)
        except Refused as e:
            return error(e.http or STATUS.get(e.code, 500), str(e), request.path)
        except web.HTTPException as e:  # no such route or method, too large, too slow: JSON
            if e.status < 400:
                raise
            return error(e.status, f"{e.reason}: {request.method} {request.path}",
                         request.path)
        except Exception as e:  # a bug: one line, the traceback at debug, a JSON 500
            log.error("HTTP %s %s failed: %s: %s", request.method, request.path,
                      type(e).__name__, str(e)[:200])
            log.debug("HTTP %s %s failed", request.method, request.path, exc_info=True)
            return error(500, f"internal error ({type(e).__name__}); the daemon's log says more",
                         request.path)

    async def _call(self, method: str, message: Any, request: web.Request) -> Any:
        call = Call(request)
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, getattr(self.service, method), message, call)

    async def _body(self, request: web.Request, parse: Callable[[bytes], Any]) -> Any:
        """The request's body read and parsed (`parse`, off the event loop), at most
        limits.http.bodies_at_once at a time: the rest wait their turn, their bytes unread."""
        if self.bodies is None:
            self.bodies = asyncio.Semaphore(self.limits.bodies_at_once)
        async with self.bodies:
            data = await body(request, self.limits)
            return await asyncio.get_running_loop().run_in_executor(self.pool, parse, data)

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
        name, version = m["name"], m.get("version", "")
        inputs = self._inputs_of(name, version)  # 404 before a byte of the body is read
        length = request.headers.get(HEADER_LENGTH)
        message, binary_out, everything = await self._body(request, lambda data: infer_request(
            name, version, data, length, self.limits.max_json_bytes, inputs))
        response = await self._call("ModelInfer", message, request)
        return infer_response(response, binary_out, everything)

    def _inputs_of(self, name: str, version: str) -> Inputs:
        """What the model takes, to check a body against before parsing its tensors."""
        served = find(self.service.models, name, version, ready=False)
        return {t["name"]: (oip_name(t["dtype"]), list(t["shape"]))
                for t in served.record.inputs}

    async def _index(self, request: web.Request) -> web.Response:
        data = await body(request, self.limits)
        try:
            ready = bool(orjson.loads(data or b"{}").get("ready", False))
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

        text = await asyncio.get_running_loop().run_in_executor(self.pool, generate_latest,
                                                                 self.metrics.registry)
        return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _shm_register(self, request: web.Request) -> web.Response:
        try:
            doc = orjson.loads(await body(request, self.limits) or b"{}")
        except (ValueError, UnicodeDecodeError):
            doc = None
        doc = doc if isinstance(doc, dict) else {}
        key, offset, size = doc.get("key"), doc.get("offset", 0), doc.get("byte_size")
        if not isinstance(key, str) or not is_count(offset) or not is_count(size) or max(
                offset, size) > INT64_MAX:
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
