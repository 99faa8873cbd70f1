"""The cuvil.v1 Control service: the daemon's control plane over gRPC."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import grpc

import cuvild
from cuvild.core.loaded import bucket_stats, part_stats
from cuvild.intake.registry import ModelRecord, Registry, RegistryError
from cuvild.intake.summary import inspect_archive, start_inspector, zip_head
from cuvild.load import prepare
from cuvild.serve.chat import options_from as chat_options
from cuvild.serve.errors import abort
from cuvild.serve.limits import Gate, Uploads
from partitioner.profile import DeviceProfile
from protos import cuvil_pb2, cuvil_pb2_grpc
from runtimes.profiling.measure import ProfileResult, ProfilingError

if TYPE_CHECKING:
    from concurrent.futures import Future

    from cuvild.load.models import ModelManager, ServedModel
    from cuvild.serve.generation import Generator
    from cuvild.serve.metrics import Metrics

log = logging.getLogger(__name__)


def profile_to_pb(dev: DeviceProfile) -> cuvil_pb2.DeviceProfile:
    return cuvil_pb2.DeviceProfile(
        id=dev.id, kind=dev.kind, name=dev.name, emulated=dev.emulated,
        memory_gb=dev.memory_gb, peak_gflops=dev.peak_gflops, mem_bw_gbs=dev.mem_bw_gbs,
        link_bw_gbs=dev.link_bw_gbs, link_latency_us=dev.link_latency_us,
        launch_us=dev.launch_us, runtimes=dev.runtimes, cores=dev.cores, features=dev.features,
        efficiency=dev.efficiency,
    )


def record_to_pb(record: ModelRecord) -> cuvil_pb2.ModelSummary:
    fields = asdict(record)
    fields.pop("calibration")  # a file's digest: the count says what a user needs to know
    specs = {k: [cuvil_pb2.TensorSpec(name=t["name"], dtype=t["dtype"], shape=t["shape"])
                 for t in fields.pop(k)] for k in ("inputs", "outputs")}  # not "high": internal
    return cuvil_pb2.ModelSummary(state="registered", measured_error=-1, **fields, **specs)


def parts_json(routes: list[Any]) -> str:
    """A served model's parts for `cuvilctl status --json`: where each runs, and the signed
    compile-cache entry it runs from (its hash, what built it, verified at load)."""
    import json

    return json.dumps([{"id": r.id, "device": r.device, "runtime": r.runtime,
                        "precision": r.precision,
                        "artifact": r.built.artifact if r.built is not None else {}}
                       for r in routes])


def by_bucket(measured: dict[str, Any], buckets: list[dict[str, Any]]) -> dict[str, Any]:
    """A dynamic-shape model's parts as its buckets run them: the runtimes chosen per input
    shape, and the time measured at the shapes served last (its own top-level parts never run,
    so they say no runtime and no time)."""
    out = {}
    for pid, m in measured.items():
        runs = [(b["shapes"], part) for b in buckets for part in b["parts"] if part["id"] == pid]
        runtimes = sorted({part["runtime"] for _, part in runs if part["runtime"]})
        timed = [(shapes, part) for shapes, part in runs if part["measured_ms"] is not None]
        entry = {**m, "runtime": "/".join(runtimes) or "per input shape, once served"}
        if timed:
            shapes, part = timed[-1]  # most recently used last
            entry["measured_ms"], entry["shapes"] = part["measured_ms"], shapes
        out[pid] = entry
    return out


def buckets_text(buckets: list[dict[str, Any]]) -> str:
    """A dynamic-shape model's buckets for `cuvilctl partition`: shapes -> part on device."""
    lines = ["", "buckets (built per input shape; a part's runtime is chosen per bucket):"]
    for b in buckets:
        shapes = " ".join("x".join(map(str, s)) for s in b["shapes"])
        parts = ", ".join(
            f"{p['id']} {p['device']}/{p['runtime']}"
            + (f" {p['precision']}" if p.get("precision", "fp32") != "fp32" else "")
            + (f" {p['measured_ms']:.2f} ms" if p["measured_ms"] is not None else "")
            for p in b["parts"])
        last = " (generation: logits of the last position)" if b.get("logits") else ""
        lines.append(f"  {shapes}{last}: {parts}")
        lines += [f"    {note}" for note in b.get("precision", [])]
        lines += [f"    {p['id']}: {p['step']}" for p in b["parts"] if p.get("step")]
    return "\n".join(lines if buckets else [*lines, "  none built yet"]) + "\n"


def with_steps(parts: list[dict[str, Any]], key: str,
               describe: Callable[[str, str, str], str]) -> list[str]:
    """Each torch part of model (or bucket) `key` with how its steps run now (`step`: a
    language model's decode step compiled by inductor or eager, and why), as its worker says;
    the lines for `cuvilctl partition`."""
    lines = []
    for part in parts:
        if part.get("runtime") == "torch":
            said = describe(key, part["id"], part["device"])
            if said:
                part["step"] = said
                lines.append(f"{part['id']}: {said}")
    return lines


def _start_ahead() -> None:
    """What an upload of new bytes will need, started while the rest of them arrive: the
    inspector's forkserver (torch) and, in the daemon, the load path (torch, its export
    loader, the partitioner)."""
    try:
        start_inspector()
    except Exception:  # noqa: BLE001 - the inspection starts it then, or says why
        log.warning("intake: the archive inspector did not start ahead of the upload",
                    exc_info=True)
    prepare.import_ahead()


class ControlService(cuvil_pb2_grpc.ControlServicer):
    """Answers status, profiling and model registry requests."""

    def __init__(self, profiles: Callable[[], ProfileResult],
                 reprofile: Callable[[], ProfileResult], config_path: str,
                 registry: Registry, uploads: Uploads, gate: Gate,
                 models: ModelManager | None = None, metrics: Metrics | None = None,
                 reload: Callable[[], Future[dict[str, Any]]] | None = None,
                 generator: Generator | None = None) -> None:
        self._profiles = profiles
        self._generator = generator  # a language model's tokens (Generate)
        self._reload = reload  # asks the daemon's main thread for a reload (cuvild/serve/daemon.py)
        self._reprofile = reprofile
        self._config_path = config_path
        self._registry = registry
        self._models = models
        self._metrics = metrics
        self._started = time.monotonic()
        self._refresh_lock = threading.Lock()
        self._uploads = uploads  # one count for the daemon, shared by every listener
        self._gate = gate  # this listener's threads for calls that may wait

    def GetStatus(self, request: cuvil_pb2.GetStatusRequest,
                  context: grpc.ServicerContext) -> cuvil_pb2.GetStatusResponse:
        result = self._profiles()
        return cuvil_pb2.GetStatusResponse(
            version=cuvild.__version__,
            uptime_s=time.monotonic() - self._started,
            devices=[profile_to_pb(d) for d in result.devices],
            models=[self._summary(r) for r in self._registry.list()],
            profile_source=result.source,
            profile_seconds=result.seconds,
            fingerprint=result.fingerprint,
            config_path=self._config_path,
            pid=os.getpid(),
            repository_refused=[cuvil_pb2.RepositoryRefusal(name=n, version=v, reason=why)
                                for n, v, why in (self._models.refusals() if self._models
                                                  else [])],
        )

    def ProfileDevices(self, request: cuvil_pb2.ProfileDevicesRequest,
                       context: grpc.ServicerContext) -> cuvil_pb2.ProfileDevicesResponse:
        if request.refresh:
            # One measurement at a time: two would disturb each other's numbers.
            if not self._refresh_lock.acquire(blocking=False):
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              "a device profiling run is already in progress; try again shortly")
            try:
                with self._gate.enter(context):
                    result = self._reprofile()
            except ProfilingError as e:
                context.abort(grpc.StatusCode.INTERNAL, str(e))
            finally:
                self._refresh_lock.release()
        else:
            result = self._profiles()
        return cuvil_pb2.ProfileDevicesResponse(
            devices=[profile_to_pb(d) for d in result.devices],
            profile_source=result.source,
            profile_seconds=result.seconds,
            fingerprint=result.fingerprint,
        )

    # -- models ----------------------------------------------------------------------------
    def _summary(self, record: ModelRecord) -> cuvil_pb2.ModelSummary:
        summary = record_to_pb(record)
        served = self._models.get(record.name, record.version) if self._models else None
        if served is not None:
            summary.state = served.state.lower() + (f": {served.reason}" if served.reason else "")
            # what `Client.load(wait=True)` and `cuvilctl status` show while it loads
            summary.phase, summary.warm = served.phase, served.warm
            summary.load_seconds = served.prepare_s
            if served.loaded is not None:
                summary.parts_json = parts_json(served.loaded.routes)
            accuracy = served.loaded.accuracy if served.loaded else None
            if accuracy is not None:  # the policy in force, and what the load measured
                summary.precision, summary.max_error = accuracy.policy, accuracy.max_error or 0
                if accuracy.chosen is not None:
                    summary.measured_error = accuracy.chosen.error
            self._batching(summary, served)
        return summary

    def _batching(self, summary: cuvil_pb2.ModelSummary, served: ServedModel) -> None:
        """The batching in force for a served model, and what it has done."""
        asked = self._models.batching(served.record)  # type: ignore[union-attr]
        summary.max_batch, summary.max_delay_us = asked.max_batch, asked.max_delay_us
        loaded = served.loaded
        if loaded is None or not loaded.dynamic:  # (a static model has nothing to batch)
            return
        if loaded.batcher is None:
            summary.batching = f"off: {loaded.unbatched}" if loaded.unbatched else "off"
            return
        stats = loaded.batcher.stats()
        summary.batching, summary.max_batch = "on", stats["max_batch"]  # (within the range)
        summary.batch_sizes.update(stats["sizes"])
        summary.batched_requests = stats["requests"]
        summary.queue_ms_p50, summary.queue_ms_p99 = (stats["queue_ms"]["p50"],
                                                      stats["queue_ms"]["p99"])

    def LoadModel(self, request_iterator: Iterator[cuvil_pb2.LoadModelRequest],
                  context: grpc.ServicerContext) -> cuvil_pb2.LoadModelResponse:
        with self._gate.enter(context), self._uploads.slot(context) as stream:
            t0 = time.perf_counter()
            try:
                record, present = self._receive(request_iterator, stream)
            except RegistryError as e:
                abort(context, e)
            except ValueError as e:  # the archive was refused by the safe loader
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"model archive refused: {e}")
            except Exception:
                if stream.why:  # cancelled by the uploads' watchdog; the part file is gone
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"upload cancelled: it {stream.why}")
                raise
        seconds = time.perf_counter() - t0
        if self._models is not None:
            try:
                self._models.submit(record)
            except RuntimeError:  # the prepare pool is shut down: the daemon is stopping
                context.abort(grpc.StatusCode.UNAVAILABLE, f"model {record.name} is registered "
                              "but cuvild is stopping; it loads at the next start")
        log.info("model %s:%s %s (%d bytes, %.2f s)", record.name, record.version,
                 "already registered" if present else "registered", record.size_bytes, seconds)
        # The model as it is served now ("loading" and its phase, or "ready" when the same
        # archive was loaded before), so a client that does not wait knows where it stands.
        return cuvil_pb2.LoadModelResponse(model=self._summary(record),
                                           already_present=present, seconds=seconds)

    def _receive(self, requests: Iterator[cuvil_pb2.LoadModelRequest],
                 stream: Any) -> tuple[ModelRecord, bool]:
        first = next(requests, None)
        if first is None or first.WhichOneof("part") != "header":
            raise RegistryError("invalid", "the first LoadModel message must be the header")
        h = first.header
        ahead = not self._registry.known(h.sha256)  # (bytes inspected before are not again)
        upload = self._registry.begin_upload({
            "name": h.name, "version": h.version, "sha256": h.sha256,
            "size_bytes": h.size_bytes, "replace": h.replace, "precision": h.precision,
            "max_error": h.max_error, "calibration_bytes": h.calibration_bytes,
            "calibration_sha256": h.calibration_sha256, "max_batch": h.max_batch,
            "max_delay_us": h.max_delay_us})
        try:
            for message in requests:
                stream.active = time.monotonic()
                part = message.WhichOneof("part")
                if part == "chunk":
                    if ahead:  # the first bytes: what may be an archive gets its tools now
                        ahead = False
                        if zip_head(message.chunk):
                            _start_ahead()
                    upload.write(message.chunk)
                elif part == "calibration_chunk":
                    upload.write_calibration(message.calibration_chunk)
                else:
                    raise RegistryError("invalid", "LoadModel got a second header")
            stream.received = True  # checking the archive is ours to time, not the client's
        except BaseException:  # includes the client cancelling mid-stream
            upload.abort()
            raise
        return upload.finish(
            lambda path: inspect_archive(path, self._registry.max_model_bytes))

    def UnloadModel(self, request: cuvil_pb2.UnloadModelRequest,
                    context: grpc.ServicerContext) -> cuvil_pb2.UnloadModelResponse:
        try:
            removed = self._registry.remove(request.name, request.version)
        except RegistryError as e:
            abort(context, e)
        if self._models is not None:
            self._models.remove(request.name, request.version)
        return cuvil_pb2.UnloadModelResponse(removed=[record_to_pb(r) for r in removed])

    def ListModels(self, request: cuvil_pb2.ListModelsRequest,
                   context: grpc.ServicerContext) -> cuvil_pb2.ListModelsResponse:
        return cuvil_pb2.ListModelsResponse(
            models=[self._summary(r) for r in self._registry.list()])

    def GetPlan(self, request: cuvil_pb2.GetPlanRequest,
                context: grpc.ServicerContext) -> cuvil_pb2.GetPlanResponse:
        import json

        from partitioner import report

        served = self._models.get(request.name, request.version) if self._models else None
        if served is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r}")
        measured: dict = {}
        if request.replan:
            try:
                with self._gate.enter(context):
                    plan = self._replan(served, request.objective or "latency")
            except ValueError as e:  # PlacementError: an annotation no device can honour
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        elif served.loaded is None:
            detail = served.reason or "still loading"
            context.abort(grpc.StatusCode.UNAVAILABLE, f"model {served.key} has no plan yet: "
                                                       f"{detail}")
        else:
            plan = served.loaded.plan
            measured = part_stats(served.loaded)
        shown, explain = plan.to_dict(), report.explain(plan)
        describe = self._models.builder.describe if self._models else (lambda *_: "")
        if not request.replan and served.loaded is not None and served.loaded.dynamic:
            shown["buckets"] = bucket_stats(served.loaded)  # where each input shape runs
            for bucket in shown["buckets"]:
                with_steps(bucket["parts"], bucket["key"], describe)
            explain += buckets_text(shown["buckets"])
            measured = by_bucket(measured, shown["buckets"])
        elif not request.replan and served.loaded is not None:
            parts = [{**stats, "id": pid} for pid, stats in measured.items()]
            said = with_steps(parts, served.loaded.key, describe)
            for part in parts:
                if part.get("step"):
                    measured[part["id"]]["step"] = part["step"]
            explain += "".join(f"{line}\n" for line in said)
        return cuvil_pb2.GetPlanResponse(plan_json=json.dumps(shown), explain=explain,
                                         measured_json=json.dumps(measured),
                                         dot=report.to_dot(plan))

    def Compare(self, request: cuvil_pb2.CompareRequest,
                context: grpc.ServicerContext) -> cuvil_pb2.CompareResponse:
        import json

        served = self._models.get(request.name, request.version) if self._models else None
        if served is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r}")
        loaded = served.loaded
        if loaded is None:  # (it may have one later: UNAVAILABLE, a status to retry on)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"model {served.key} has no comparison "
                          f"yet: {served.reason or 'still loading'}")
        if loaded.accuracy is None:  # (it never will)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"model {served.key} has no "
                          "comparison: a dynamic-shape model is checked per input shape, as "
                          "each is built; `cuvilctl partition` gives each one's precision")
        measured = part_stats(served.loaded)
        parts = [{"id": p.id, "device": p.device, "runtime": p.runtime,
                  "precision": p.precision, "error": p.error,
                  "predicted_ms": p.predicted_ms, "measured_ms": measured[p.id]["measured_ms"],
                  "candidates": measured[p.id]["candidates"]} for p in loaded.plan.parts]
        report = {"model": served.key, **loaded.accuracy.to_dict(), "parts": parts}
        return cuvil_pb2.CompareResponse(report_json=json.dumps(report))

    def GetStats(self, request: cuvil_pb2.GetStatsRequest,
                 context: grpc.ServicerContext) -> cuvil_pb2.GetStatsResponse:
        import json

        if self._metrics is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "metrics are off (metrics.enabled: false in the config)")
        stats = self._metrics.snapshot()
        if self._models is not None:  # what loads did since start (cuvild/load/warm.py)
            stats["loads"] = dict(self._models.builder.counters)
        return cuvil_pb2.GetStatsResponse(stats_json=json.dumps(stats))

    def Reload(self, request: cuvil_pb2.ReloadRequest,
               context: grpc.ServicerContext) -> cuvil_pb2.ReloadResponse:
        """Reload the config as SIGHUP does, answered once done (`cuvilctl reload`)."""
        if self._reload is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this daemon cannot reload")
        remaining = context.time_remaining()
        try:
            with self._gate.enter(context):
                outcome = self._reload().result(timeout=min(
                    120.0, remaining if remaining is not None else 120.0))
        except TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the reload is still running "
                          "(the daemon's log says when it is done)")
        return cuvil_pb2.ReloadResponse(ok=outcome["ok"], error=outcome.get("error", ""),
                                        config_path=outcome["config_path"],
                                        on_restart=outcome.get("on_restart", []))

    def Generate(self, request: cuvil_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[cuvil_pb2.GenerateResponse]:
        """Each token as it comes (cuvild/serve/generation.py); the generation, and its
        sequence, end when the caller goes."""
        if self._generator is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this daemon serves no generation")
        options: dict[str, Any] = {
            "max_tokens": request.max_tokens or 16, "temperature": request.temperature,
            "top_k": request.top_k, "top_p": request.top_p or 1.0, "stop": list(request.stop),
            "frequency_penalty": request.frequency_penalty,
            "presence_penalty": request.presence_penalty,
            "logit_bias": dict(request.logit_bias), "ignore_eos": request.ignore_eos,
            "repetition_penalty": request.repetition_penalty or 1.0, "min_p": request.min_p,
            "min_tokens": request.min_tokens}
        if request.structured:
            options["structured"] = request.structured
        if request.HasField("seed"):
            options["seed"] = request.seed
        try:
            chat = [{"role": m.role, "content": m.content} for m in request.messages]
            gen = self._generator.open(request.name, request.version,
                                       prompt=None if request.text or chat
                                       else list(request.input_ids),
                                       text=request.text or None, options=options,
                                       messages=chat or None,
                                       chat_options=chat_options(request.chat_options))
            with contextlib.closing(gen.tokens()) as tokens:
                for index, (token, piece) in enumerate(tokens):
                    if not context.is_active():
                        return
                    yield cuvil_pb2.GenerateResponse(token_id=token, text=piece, index=index)
        except Exception as e:  # noqa: BLE001 - its kind decides the status
            abort(context, e)

    def _replan(self, served, objective: str):  # noqa: ANN001, ANN202
        """A fresh plan, priced with what measured parts taught the cost model (this model's
        own measurements first, when it has served requests)."""
        from cuvild.intake.safe_load import load_exported_program
        from partitioner.plan import plan_model

        builder = self._models.builder
        ep = load_exported_program(self._registry.archive_path(served.record.sha256))
        if served.loaded is not None:
            builder.feedback(served.loaded)
        policy = self._models.policy(served.record)
        return plan_model(ep, self._profiles().devices, objective=objective,
                          support=builder.support(), corrections=builder.corrections.snapshot(),
                          precision=policy.mode, int8=bool(policy.calibration))
