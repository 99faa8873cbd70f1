"""Traces of requests with OpenTelemetry: a span per ModelInfer, a child per part (from its
dispatch to its reply) and per cut (a tensor handed from one part to the next).

Off unless `tracing.exporter` is set: "file" writes one JSON object per span and line to
`tracing.path`; "otlp" sends them to `tracing.endpoint` (OTLP over HTTP, e.g. a collector's
http://host:4318/v1/traces). `tracing.sample_rate` is the share of requests traced; a caller's
W3C `traceparent` (gRPC metadata) continues its trace into cuvild and its sampling decision
holds. Spans are exported by a batch processor's thread, never on the request's; a request
that is not sampled costs one sampler call.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cuvild.core.loaded import LoadedModel
    from cuvild.core.served import Timeline


class JsonLinesExporter:
    """An OpenTelemetry SpanExporter writing each span as one JSON line."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - open for life

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        with self._lock:
            for span in spans:
                self._file.write(json.dumps(json.loads(span.to_json()), separators=(",", ":"))
                                 + "\n")
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class Tracer:
    def __init__(self, exporter: str, path: str | None, endpoint: str | None,
                 sample_rate: float) -> None:
        from opentelemetry.propagate import extract
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        import cuvild

        if exporter == "file":
            spans: Any = JsonLinesExporter(str(path))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            spans = OTLPSpanExporter(endpoint=endpoint)
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": "cuvild",
                                      "service.version": cuvild.__version__}),
            sampler=ParentBased(TraceIdRatioBased(sample_rate)))
        self.provider.add_span_processor(BatchSpanProcessor(spans))
        self.tracer = self.provider.get_tracer("cuvild")
        self._extract = extract

    @contextmanager
    def request(self, metadata: Sequence[tuple[str, Any]], model: str,
                version: str) -> Iterator[Any]:
        """The span of one ModelInfer, a child of the caller's trace when it sent one."""
        carrier = {k: v for k, v in metadata if isinstance(v, str)}
        with self.tracer.start_as_current_span(
                "ModelInfer", context=self._extract(carrier),
                attributes={"cuvil.model": model, "cuvil.version": version}) as span:
            yield span

    def parts(self, span: Any, model: LoadedModel, timeline: Timeline, t0_ns: int,
              epoch_ns: int) -> None:
        """Child spans of a request's parts and cuts, from the engine's timeline
        (perf_counter_ns times, placed on the wall clock by `epoch_ns` at `t0_ns`)."""
        from opentelemetry import trace

        if not span.is_recording():
            return
        parent = trace.set_span_in_context(span)

        def wall(ns: int) -> int:
            return epoch_ns + (ns - t0_ns)

        done: dict[str, int] = {}
        for route, start, end in timeline:
            part = self.tracer.start_span(
                f"part {route.id}", context=parent, start_time=wall(start),
                attributes={"cuvil.part": route.id, "cuvil.device": route.device,
                            "cuvil.runtime": route.runtime, "cuvil.precision": route.precision})
            part.end(end_time=wall(end))
            done[route.id] = end
            for other in model.routes:  # the cuts into this part: from a part that finished
                crossing = [n for n in route.inputs if n in other.outputs]
                if crossing and other.id in done:
                    nbytes = sum(model.slots[n].nbytes for n in crossing if n in model.slots)
                    cut = self.tracer.start_span(
                        f"cut {other.id} -> {route.id}", context=parent,
                        start_time=wall(done[other.id]), attributes={
                            "cuvil.bytes": nbytes, "cuvil.tensors": crossing[:8]})
                    cut.end(end_time=wall(max(start, done[other.id])))

    def close(self) -> None:
        self.provider.shutdown()
