"""Prometheus metrics of the daemon, and the recent figures `cuvilctl stats` shows.

One registry of cuvild's own (not the library's global one). Per model and version (labels
`model`, `version`): request success and failure counts, inference count, queue / compute /
end-to-end duration histograms; per part: run duration by device and runtime, and the bytes
its cuts move; per device: busy seconds (its `rate()` is the busy fraction); and, read when
scraped, the arena's bytes in use, registered client regions, worker restarts, build
durations and models by state. docs/OPERATIONS.md lists them with Triton's nearest.

Updates happen on the request's thread after its answer is computed (the servicer's) or as a
part's reply is read (the engine's, through `Monitor`): a counter or histogram update is a
lock-free-ish few microseconds; bench_serving prices them per request, on against off.
The HTTP endpoint serves `metrics.listen` (off by default; a bare port binds loopback).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import statistics
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from cuvild.config import HttpLimits
from protos.shared import SECONDS

if TYPE_CHECKING:
    from cuvild.core.loaded import LoadedModel, Route
    from cuvild.load.models import ModelManager
    from cuvild.run.runner import Runner
    from cuvild.serve.regions import Regions

log = logging.getLogger(__name__)
MODEL = ("model", "version")
# From a tenth of a millisecond to a minute: CPU parts of tiny models up to cold NPU calls
# (the engine's, as a worker counts a fast-path session's requests in them).
BUCKETS = SECONDS
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # rows per batched run
RECENT = 1000  # end-to-end times kept per model for stats' p50/p99
METRICS_CONNECTIONS = 16  # a scraper or two: the metrics port holds no more open


class FastPath(Protocol):
    """The fast path's sessions (cuvild/serve/fast.py), as the metrics read them."""

    def sessions(self) -> int: ...

    def counts(self) -> dict[tuple[str, str], list[float]]: ...


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.success = Counter("cuvil_inference_request_success", "Successful inference "
                               "requests", MODEL, registry=r)
        self.failure = Counter("cuvil_inference_request_failure", "Failed inference requests, "
                               "by gRPC status", (*MODEL, "code"), registry=r)
        self.inferences = Counter("cuvil_inference_count", "Inferences served (a request of "
                                  "batch n counts n)", MODEL, registry=r)
        self.queue = Histogram("cuvil_inference_queue_duration_seconds", "Time a request "
                               "waited for a place in flight", MODEL, buckets=BUCKETS,
                               registry=r)
        self.compute = Histogram("cuvil_inference_compute_duration_seconds", "Time a request "
                                 "spent in the engine (inputs in, parts, outputs out)", MODEL,
                                 buckets=BUCKETS, registry=r)
        self.request = Histogram("cuvil_inference_request_duration_seconds", "End-to-end "
                                 "time of a request in the servicer", MODEL, buckets=BUCKETS,
                                 registry=r)
        self.parts = Histogram("cuvil_part_run_duration_seconds", "Run time of one part in "
                               "its worker", (*MODEL, "part", "device", "runtime"),
                               buckets=BUCKETS, registry=r)
        self.cut_bytes = Counter("cuvil_cut_bytes", "Bytes crossing between parts through the "
                                 "arena", MODEL, registry=r)
        self.busy = Counter("cuvil_device_busy_seconds", "Seconds a device ran parts; rate() "
                            "is its busy fraction", ("device",), registry=r)
        self.batch_rows = Histogram("cuvil_batch_size", "Rows per run of a batched model "
                                    "(requests merged by the dynamic batcher)", MODEL,
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_queue = Histogram("cuvil_batch_queue_duration_seconds", "Time a request "
                                     "waited in its model's batch queue", MODEL,
                                     buckets=BUCKETS, registry=r)
        # a language model's generations (cuvild/serve/generation.py), as vLLM counts them;
        # each is also a request above (success or failure, its whole time end to end)
        self.first_token = Histogram("cuvil_generation_time_to_first_token_seconds", "Time from "
                                     "a generation request to its first token", MODEL,
                                     buckets=BUCKETS, registry=r)
        self.between_tokens = Histogram("cuvil_generation_inter_token_latency_seconds", "Time "
                                        "between a generation's tokens, after the first",
                                        MODEL, buckets=BUCKETS, registry=r)
        self.prompt_tokens = Counter("cuvil_generation_prompt_tokens", "Prompt tokens of "
                                     "generation requests", MODEL, registry=r)
        self.tokens = Counter("cuvil_generation_tokens", "Tokens generated", MODEL, registry=r)
        self.cached_tokens = Counter("cuvil_generation_prompt_cached_tokens", "Prompt tokens "
                                     "a kept sequence held already (the prefix cache): not run "
                                     "again", MODEL, registry=r)
        self._recent: dict[tuple[str, str], collections.deque[float]] = {}
        # (kind, model, version) -> recent generation times: "first" token, "between" tokens
        self._recent_tokens: dict[tuple[str, str, str], collections.deque[float]] = {}
        self._last: dict[tuple[str, str], float] = {}  # a model's last success, time.time()
        self._failed_s: collections.Counter[tuple[str, str]] = collections.Counter()
        self._children: dict[tuple[str, ...], Any] = {}  # labels() resolved once per series
        self.fast: FastPath | None = None  # its sessions' counts, read when asked
        self._server: Any = None
        self._render: Any = None  # the metrics port's one rendering thread
        self._started = time.monotonic()

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (str(id(metric)), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # -- the request path ------------------------------------------------------------------
    def succeeded(self, name: str, version: str, seconds: float, batch: int) -> None:
        self._child(self.success, name, version).inc()
        self._child(self.inferences, name, version).inc(batch)
        self._child(self.request, name, version).observe(seconds)
        recent = self._recent.get((name, version))
        if recent is None:
            recent = self._recent[(name, version)] = collections.deque(maxlen=RECENT)
        recent.append(seconds)
        self._last[(name, version)] = time.time()

    def failed(self, name: str, version: str, code: str, seconds: float = 0.0) -> None:
        self._child(self.failure, name, version, code).inc()
        self._failed_s[(name, version)] += seconds

    def token(self, name: str, version: str, seconds: float, first: bool) -> None:
        """A generation's token, `seconds` after its request began (`first`) or after the
        token before it."""
        kind = "first" if first else "between"
        self._child(self.first_token if first else self.between_tokens, name,
                    version).observe(seconds)
        self._child(self.tokens, name, version).inc()
        recent = self._recent_tokens.get((kind, name, version))
        if recent is None:
            recent = self._recent_tokens[(kind, name, version)] = collections.deque(
                maxlen=RECENT)
        recent.append(seconds)

    def generation(self, name: str, version: str, prompt: int, seconds: float,
                   code: str | None, cached: int = 0) -> None:
        """A generation's end: its prompt's tokens (`cached` of them held by a kept
        sequence), and the request, succeeded (`code` None) or failed (a gRPC status name;
        CANCELLED: its caller left)."""
        self._child(self.prompt_tokens, name, version).inc(prompt)
        self._child(self.cached_tokens, name, version).inc(cached)
        if code is None:
            self.succeeded(name, version, seconds, 1)
        else:
            self.failed(name, version, code, seconds)

    def computed(self, model: LoadedModel, seconds: float) -> None:
        self._child(self.compute, model.name, model.version).observe(seconds)
        if model.cut_bytes:
            self._child(self.cut_bytes, model.name, model.version).inc(model.cut_bytes)

    # the engine's Monitor
    def queued(self, model: LoadedModel, seconds: float) -> None:
        self._child(self.queue, model.name, model.version).observe(seconds)

    def part(self, model: LoadedModel, route: Route, seconds: float) -> None:
        self._child(self.parts, model.name, model.version, route.id, route.device,
                    route.runtime).observe(seconds)
        self._child(self.busy, route.device).inc(seconds)

    def batched(self, model: LoadedModel, rows: int, waits: list[float]) -> None:
        self._child(self.batch_rows, model.name, model.version).observe(rows)
        queue = self._child(self.batch_queue, model.name, model.version)
        for wait in waits:
            queue.observe(wait)

    # -- read when scraped -----------------------------------------------------------------
    def watch(self, models: ModelManager, runner: Runner, regions: Regions,
              fast: FastPath | None = None) -> None:
        self.fast = fast
        self.registry.register(_State(models, runner, regions, fast))

    def serve(self, listen: str, limits: HttpLimits | None = None) -> str:
        """Serve /metrics on HOST:PORT (a bare PORT: loopback); returns where. An HTTP
        listener of the daemon's (cuvild/serve/httpguard.py): its connections capped (at
        most METRICS_CONNECTIONS) and timed out, a scrape rendered on one thread at a time,
        where prometheus_client's server gave each connection a thread and no timeout."""
        from aiohttp import web

        from cuvild.serve.httpguard import Listener

        limits = limits or HttpLimits()
        limits = dataclasses.replace(limits, max_connections=min(limits.max_connections,
                                                                 METRICS_CONNECTIONS))
        render = self._render = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="metrics")

        async def scrape(request: web.Request) -> web.Response:
            text = await asyncio.get_running_loop().run_in_executor(
                render, generate_latest, self.registry)
            return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application(client_max_size=1 << 16)
        app.router.add_get("/metrics", scrape)
        host, _, port = listen.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        self._server = Listener(app, host, int(port), limits, "metrics")
        self._server.start()
        return f"http://{host}:{self._server.port}/metrics"

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._render.shutdown(wait=False)

    # -- cuvilctl stats --------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Cumulative counts, recent latency quantiles and busy seconds: two snapshots a
        moment apart give rates and busy fractions (cuvilctl stats)."""
        models: dict[str, Any] = {}
        for metric in self.registry.collect():
            for s in metric.samples:
                field = _COUNTED.get(s.name)
                if field is None:
                    continue
                # requests for no known model count under "" (cuvilctl: unknown models)
                key = f"{s.labels['model']}:{s.labels['version']}" if s.labels["model"] else ""
                entry = models.setdefault(key, {"success": 0, "failure": 0, "inferences": 0})
                entry[field] = entry.get(field, 0) + int(s.value)
        for (name, version), recent in list(self._recent.items()):
            if recent:
                models.setdefault(f"{name}:{version}", {"success": 0, "failure": 0,
                                                        "inferences": 0})["latency_ms"] = \
                    quantiles(recent)
        for (kind, name, version), recent in list(self._recent_tokens.items()):
            if recent:  # a generation's first token, and those after it
                models.setdefault(f"{name}:{version}", {"success": 0, "failure": 0,
                                                        "inferences": 0})[
                    "first_token_ms" if kind == "first" else "inter_token_ms"] = \
                    quantiles(recent)
        # Fast-path requests a worker ran on the session's memory count here too; their times
        # are only in the histogram the worker keeps (protos/shared.py TIMES), so their
        # quantiles are its buckets' bounds, over every such request since the daemon started.
        for (name, version), (done, failed, _, *per_bucket) in (self.fast.counts() if self.fast
                                                                 else {}).items():
            entry = models.setdefault(f"{name}:{version}", {"success": 0, "failure": 0,
                                                            "inferences": 0})
            entry["success"] += done
            entry["failure"] += failed
            entry["inferences"] += done
            if done:
                entry["fast_latency_ms"] = {"p50": at_most(per_bucket, 0.5),
                                            "p99": at_most(per_bucket, 0.99), "n": int(done)}
        busy = {s.labels["device"]: s.value for m in self.busy.collect() for s in m.samples
                if s.name == "cuvil_device_busy_seconds_total"}
        return {"at": time.monotonic() - self._started, "models": models, "devices": busy}


    def statistics(self, name: str, version: str) -> dict[str, Any]:
        """What Triton's ModelStatistics says of a model, from these metrics: counts and
        summed seconds of its successes (fast-path requests a worker ran included), failures,
        queue waits (a place in flight, and the batch queue) and runs in the engine; the
        inferences (rows) and executions (runs: batched requests share one)."""
        key = (name, version)

        def summed(*metrics: Any) -> tuple[float, float]:  # (count, seconds)
            count = total = 0.0
            for metric in metrics:
                for family in metric.collect():
                    for s in family.samples:
                        if (s.labels.get("model"), s.labels.get("version")) != key:
                            continue
                        if s.name.endswith("_count") or s.name.endswith("_total"):
                            count += s.value
                        elif s.name.endswith("_sum"):
                            total += s.value
            return count, total

        done, took = summed(self.request)
        fast = self.fast.counts().get(key) if self.fast else None
        if fast:
            done, took = done + fast[0], took + fast[2]
        failed, _ = summed(self.failure)
        inferences, _ = summed(self.inferences)
        runs, _ = summed(self.batch_rows)
        computed = summed(self.compute)
        return {"success": (done, took), "fail": (failed + (fast[1] if fast else 0),
                                                  self._failed_s.get(key, 0.0)),
                "queue": tuple(map(sum, zip(summed(self.queue), summed(self.batch_queue),
                                            strict=True))),
                "compute_infer": computed,
                "inference_count": inferences + (fast[0] if fast else 0),
                "execution_count": (runs or computed[0]) + (fast[0] if fast else 0),
                "last_inference": self._last.get(key, 0.0)}


_COUNTED = {"cuvil_inference_request_success_total": "success",  # stats' cumulative counts
            "cuvil_inference_request_failure_total": "failure",
            "cuvil_inference_count_total": "inferences",
            "cuvil_generation_tokens_total": "tokens"}


def quantiles(recent: collections.deque[float]) -> dict[str, float]:
    """p50 and p99, in ms, of recent times in seconds, and how many."""
    times = sorted(recent)
    return {"p50": statistics.median(times) * 1e3,
            "p99": times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3, "n": len(times)}


def at_most(per_bucket: list[float], q: float) -> float | None:
    """The bound, in ms, of the histogram bucket (requests per bucket of SECONDS, the last
    past them all) that holds quantile `q`; None in the last."""
    total, seen = sum(per_bucket), 0.0
    for bound, count in zip(SECONDS, per_bucket, strict=False):
        seen += count
        if seen >= q * total:
            return bound * 1e3
    return None


class _State(Collector):
    """Gauges read at scrape time from what the daemon holds: nothing to update per request."""

    def __init__(self, models: ModelManager, runner: Runner, regions: Regions,
                 fast: FastPath | None) -> None:
        self.models, self.runner, self.regions, self.fast = models, runner, regions, fast

    def collect(self) -> Iterator[Any]:
        engine = self.runner
        yield _gauge("cuvil_arena_bytes_in_use", "Arena bytes held by requests in flight",
                     [([], engine.arena.in_use())])
        yield _gauge("cuvil_shm_regions", "Client shared-memory regions registered",
                     [([], self.regions.count())])
        restarts = CounterMetricFamily("cuvil_worker_restarts", "Device workers restarted "
                                       "after dying", labels=["device"])
        for device, worker in list(engine.workers.items()):
            restarts.add_metric([device], worker.restarts)
        yield restarts
        served = self.models.all()
        states: dict[str, int] = collections.Counter(m.state for m in served)
        yield _gauge("cuvil_models", "Models by state", [([s], n) for s, n in states.items()],
                     ["state"])
        yield _gauge("cuvil_sequences_live", "Sequences live (generations, clients' "
                     "sequence_id ones and those the prefix cache keeps), their state held in "
                     "the workers", [([], len(engine.sequences))])
        yield _gauge("cuvil_sequences_kept", "Finished generations' sequences the prefix "
                     "cache keeps for later prompts", [([], len(engine.prefixes))])
        if self.fast is not None:
            yield _gauge("cuvil_fast_path_sessions", "Same-host fast-path sessions open",
                         [([], self.fast.sessions())])
            ran = CounterMetricFamily(
                "cuvil_fast_path_requests", "Fast-path requests a worker ran on the session's "
                "memory (not in the request counters and histograms above)",
                labels=[*MODEL, "outcome"])
            took = HistogramMetricFamily(
                "cuvil_fast_path_request_duration_seconds", "Time from doorbell to answer of "
                "the fast-path requests a worker ran (not in the request histograms above)",
                labels=list(MODEL))
            for (name, version), (done, failed, total, *per) in self.fast.counts().items():
                ran.add_metric([name, version, "success"], done)
                ran.add_metric([name, version, "failure"], failed)
                bounds = [*map(str, BUCKETS), "+Inf"]
                took.add_metric([name, version], list(zip(bounds, itertools.accumulate(per),
                                                          strict=True)), total)
            yield ran
            yield took
        yield _gauge("cuvil_model_build_seconds", "How long a model's last load took (plan, "
                     "compile, check)", [([m.record.name, m.record.version], m.prepare_s)
                                         for m in served if m.prepare_s], list(MODEL))


def _gauge(name: str, doc: str, values: list[tuple[list[str], float]],
           labels: list[str] | None = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels or [])
    for label_values, value in values:
        family.add_metric(label_values, value)
    return family

