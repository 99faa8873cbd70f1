"""The engine: a plan becomes a served model.

Control path (`prepare`, once per model): load the archive safely, plan it on the measured
devices, split it, lay out every crossing tensor in one arena block per request (tensors whose
lifetimes do not overlap share bytes), and have each device's worker build its parts.

Data path: `resolve` checks a request's inputs against the model's input table (once) and,
for a dynamic-shape model, picks the bucket for its shapes (buckets.py); a batched model's
request queues to share a run (batching.py); `run` takes a block, puts the inputs in it,
rings each part's worker as soon as its inputs are ready (run/bells.py: every part, on
worker processes or threads), reads the outputs, gives the block back. No planning,
compiling or file I/O, and only short locks (a batch waits apart).

Every request has a deadline (by default `run_timeout_s` from its start): every wait of it
ends there with RunTimeout, and a worker that gave no reply for all of it is restarted. A
request whose worker died is run once more when the worker is back (inference is idempotent),
and fails with WorkerUnavailable only if that fails too. Errors carry a `kind` for the serving
layer (cuvild/engine/errors.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cuvild.engine.arena import Arena
from cuvild.engine.errors import (
    BadRegion,
    InferError,
    RunTimeout,
    WorkerLost,
    WorkerUnavailable,
)
from cuvild.engine.layout import (
    BadInput,
    check_inputs,
    dynamic_dims,
    input_table,
    layout,
)
from cuvild.engine.loaded import Family, LoadedModel, Route, cut_bytes, part_stats
from cuvild.engine.plane import Monitor
from cuvild.load import buckets, fallback, precision, warm
from cuvild.load.corrections import CorrectionStore
from cuvild.load.precision import Accuracy, PrecisionPolicy
from cuvild.run.batching import Batching, batcher_for
from cuvild.run.bells import Bells, Rung
from cuvild.run.request import FEEDBACK_RUNS, Timeline, run_parts
from cuvild.workers.clientmem import DaemonRegions
from cuvild.workers.handle import WorkerDied, WorkerHandle
from cuvild.workers.workers import Workers
from partitioner.profile import DeviceProfile
from protos.orders import (
    Build,
    Built,
    Choose,
    Forget,
    RawTensor,
    Reply,
    TensorRef,
    Unload,
)
from runtimes import registry

if TYPE_CHECKING:
    import torch

    from cuvild.engine.arena import Block
    from partitioner.plan import Plan
    from partitioner.split import SplitProgram

log = logging.getLogger(__name__)
__all__ = ["FEEDBACK_RUNS", "BadInput", "BadRegion", "Engine", "InferError", "LoadedModel",
           "Route", "RunTimeout", "Timeline", "WorkerUnavailable", "cut_bytes"]


class Engine:
    def __init__(self, devices: Sequence[DeviceProfile], cache_dir: Path, arena: Arena,
                 in_process: bool = False, max_in_flight: int = 4,
                 build_timeout_s: float = 600.0, compile_timeout_s: float = 300.0,
                 corrections_path: Path | None = None, run_timeout_s: float = 60.0,
                 max_buckets: int = 8, max_dim: int = 4096,
                 runtimes: dict[str, list[str]] | None = None) -> None:
        """`run_timeout_s`: a request's deadline when its caller gives none, and how long a
        worker may give no reply before it is restarted; `max_buckets`: input shapes kept per
        dynamic-shape model, up to `max_dim`; `runtimes`: device id or kind -> runtimes."""
        self.devices = {d.id: d for d in devices}
        self.cache_dir = cache_dir
        self.arena = arena
        self.in_process = in_process
        self.workers = Workers(self.devices, cache_dir, in_process, run_timeout_s,
                               self._restore)
        self.models: dict[str, LoadedModel] = {}
        self._in_flight = threading.BoundedSemaphore(max_in_flight)
        self.buckets_lock = threading.Lock()  # buckets' recency and use counts
        self.run_timeout_s = run_timeout_s
        self.max_buckets = max(1, max_buckets)
        self.max_dim = max_dim
        self.runtimes = runtimes or {}
        self.build_timeout_s = build_timeout_s
        self.compile_timeout_s = compile_timeout_s
        self.corrections = CorrectionStore(corrections_path)
        self.monitor: Monitor | None = None
        self.bells = Bells()  # the parts on worker processes: their doorbells (bells.py)
        self.regions = DaemonRegions()  # clients' regions the daemon reads and writes itself
        # loads' "archive_loads", "planned", parts "built", "compiled", "restored" (warm.py)
        self.counters: Counter[str] = Counter()

    def support(self) -> dict[str, Any]:
        """Per device, whether one of its runtimes can run a node (runtimes/registry.py)."""
        return registry.support(self.devices.values(), self.runtimes)

    # -- control path ----------------------------------------------------------------------
    def prepare(self, key: str, name: str, version: str, archive: Path,  # noqa: C901, PLR0915 - the load's steps in order; to split by plane
                input_specs: list[dict[str, Any]], objective: str = "latency",
                plan: Plan | None = None, policy: PrecisionPolicy | None = None,
                progress: Callable[[str], None] | None = None, cold: bool = True,
                batching: Batching | None = None,
                banned: fallback.Banned | None = None) -> LoadedModel | None:
        """Plan, split, lay out and build a registered model, settle each part's precision
        under the policy (cuvild/load/precision.py) and check the whole model against
        torch eager; returns it ready to serve. A model loaded before (same archive, policy,
        devices, software) comes back from its load record (cuvild/load/warm.py) with
        nothing planned or compiled (cold=False: only so, else None); `progress` is told
        each phase. `batching`: how to merge concurrent requests of a model whose first
        dimension is dynamic (cuvild/run/batching.py; None or max_batch 1: not at all).
        A part its device cannot build is planned off it again (cuvild/load/fallback.py)."""
        policy = policy or PrecisionPolicy()
        say = progress or (lambda phase: None)
        record_at = warm.directory(self.cache_dir, warm.key(
            str(archive), input_specs, objective, policy, self.devices.values(), self.runtimes))
        record = warm.read(record_at) if plan is None else None
        if record is not None:
            say("restoring from the load record")
            try:
                return warm.restore(self, record_at, record, key, name, version, str(archive),
                                    input_specs, policy, objective, batching)
            except Exception as e:  # noqa: BLE001 - never trusted blindly: built again
                log.warning("model %s: load record not used (%s); building it again", key, e)
        if not cold:
            return None
        from cuvild.intake.safe_load import load_exported_program  # (torch: cold path only)
        from partitioner.plan import plan_model
        from partitioner.split import split_program

        say("reading the archive")
        ep = load_exported_program(archive)
        self.counters["archive_loads"] += 1
        corrections, planned = self.corrections.snapshot(), plan is None
        if plan is None:
            say("planning")
            plan = plan_model(ep, list(self.devices.values()), objective=objective,
                              support=fallback.support(self.support(), banned),
                              corrections=corrections, precision=policy.mode,
                              int8=bool(policy.calibration))
            plan.notes += fallback.notes(banned)
            self.counters["planned"] += 1
        split = split_program(ep, [(p.id, p.nodes) for p in plan.parts])
        dynamic = dynamic_dims(ep)
        if dynamic:  # laid out and built per concrete shape, on first use
            slots, footprint, total = {}, 0, 0
        else:
            slots, footprint, total = layout({n.name: n.meta.get("val") for n in ep.graph.nodes},
                                             split)
        model = LoadedModel(key, name, version, plan, self.make_routes(plan, split),
                            list(split.inputs), list(split.outputs),
                            input_table(input_specs, dynamic), slots, footprint, total,
                            str(archive), input_specs, objective=objective,
                            family=Family(dynamic, split) if dynamic else None)
        for route in model.routes:
            model.parts_by_device.setdefault(route.device, []).append(route.id)
        model.cut_bytes = cut_bytes(model)
        if model.family:  # its buckets are planned and built at their shapes (buckets.py)
            model.policy = policy
            model.family.program = ep if planned else None  # (else: one plan)
            model.family.replans, model.family.record_at = planned, record_at
            if batching is not None and batching.max_batch > 1:
                say("checking that its rows can be batched")
                batcher_for(model, ep, batching)
            self.models[key] = model
            warm.write_dynamic(record_at, model)
            return model
        parts = {p.id: p for p in plan.parts}
        budgets: dict[str, float] = {}
        decision = precision.decision_path(self.cache_dir, model, policy, self.devices.values())
        decided, recorded = precision.read_decision(decision)
        for route in model.routes:
            route.precisions, budget = precision.candidates(
                parts[route.id], self.devices[route.device], policy)
            route.search = list(route.precisions)
            if budget is not None:
                budgets[route.id], route.tolerance = budget, precision.part_bound(budget)
                route.budget = budget
                if decided and route.id in decided:  # a restart builds only what was chosen
                    route.precisions = [decided[route.id]]
        inputs = precision.check_inputs(model, policy, searched=bool(budgets))
        expected, eager_ms = precision.reference(ep, inputs)
        del ep, split  # workers hold the parts; the daemon keeps only the wiring
        try:
            self.build(model, policy=policy, progress=say)
        except fallback.BuildFailed as e:  # its nodes off that device, planned again
            banned = fallback.ban(e, plan if planned else None, banned, len(self.devices))
            say(f"planning again: {e}")
            return fallback.again(e, lambda: self.prepare(
                key, name, version, archive, input_specs, objective, policy=policy,
                progress=progress, batching=batching, banned=banned))
        say("checking end to end")
        model.accuracy = self._settle(model, policy, budgets, decision, recorded, inputs,
                                      expected, eager_ms)
        precision.record_runs(plan, model.routes, corrections, self.devices)
        plan.notes += precision.runtime_notes(model.routes) + model.accuracy.notes
        self.models[key] = model
        try:
            warm.write(record_at, model, inputs, expected)
        except OSError as e:
            log.warning("model %s: load record not written (%s)", key, e)
        return model

    def _settle(self, model: LoadedModel, policy: PrecisionPolicy, budgets: dict[str, float],
                decision: Path, recorded: dict[str, Any] | None,
                inputs: list[Any], expected: list[Any], eager_ms: float) -> Accuracy:
        """Check the plan end to end, search the precisions under the budgets (or check the
        recorded choice again), and fix each part at what it will run."""
        first = precision.check(self, model, inputs, expected)
        accuracy = Accuracy("auto" if budgets else "fp32", min(budgets.values(), default=None),
                            len(inputs), bool(policy.calibration), eager_ms, first, first)
        if recorded is not None and budgets:
            if first.error <= min(budgets.values()):
                accuracy = Accuracy.from_dict(recorded)
                accuracy.chosen = first
            else:  # the recorded choice no longer holds: search again, from everything
                log.warning("model %s: the recorded precisions measure %.1e > %.0e now; "
                            "searching again", model.key, first.error, min(budgets.values()))
                for route in model.routes:
                    route.precisions = route.search
                self.build(model, policy=policy)
                return self._settle(model, policy, budgets, decision, None, inputs, expected,
                                    eager_ms)
        elif budgets:
            if not policy.calibration:
                accuracy.notes.append("int8 not tried: no calibration inputs were given")
            accuracy.chosen, notes = precision.search(self, model, budgets, inputs, expected,
                                                      first)
            accuracy.notes += notes
        for route in model.routes:
            if len(route.variants) > 1:  # the losers' executables go from the workers
                self.choose(model, route, route.precision, final=True)
                route.variants = {route.precision: route.variants[route.precision]}
            route.precisions = [route.precision]  # what a revived worker rebuilds
        if budgets and recorded is None:
            precision.write_decision(decision, model.routes, accuracy)
        return accuracy

    def choose(self, model: LoadedModel, route: Route, at: str, final: bool = False) -> None:
        """Have the part's worker run it at precision `at` (built before)."""
        reply = self.workers.of(route.device).call(Choose(model.key, route.id, at, final)).result(
            timeout=self.build_timeout_s)
        if not reply.ok:
            raise InferError(f"part {route.id} on {route.device}: {reply.error}")
        route.precision, route.runtime = at, route.variants[at].runtime

    def feedback(self, key: str, min_runs: int = 3) -> int:
        """Teach the cost model what model `key`'s parts measured (their median time on the
        runtime each runs on); returns how many parts taught it. Control path: the data path
        only submits it, once per part and load, when a part reaches FEEDBACK_RUNS."""
        model = self.models.get(key)
        if model is None or model.bucket:  # a bucket's parts are not the plan's shapes
            return 0
        parts = {p.id: p for p in model.plan.parts}
        taught = []
        for route in model.routes:
            part = parts.get(route.id)
            runs = sorted(route.measured_ms[:FEEDBACK_RUNS])  # (the runs that triggered it)
            if part is None or not part.class_ms or len(runs) < min_runs:
                continue
            taught.append((route.device, route.runtime, part.class_ms,
                           self.devices[route.device].launch_us / 1e3, runs[len(runs) // 2]))
            route.fed_back = True
        self.corrections.learn(taught)
        return len(taught)

    @staticmethod
    def make_routes(plan: Plan, split: SplitProgram) -> list[Route]:
        by_id = {p.id: p for p in plan.parts}
        return [Route(p.id, by_id[p.id].device, by_id[p.id].precision, p.inputs, p.outputs)
                for p in split.parts]

    def build(self, model: LoadedModel, only_device: str | None = None,
               policy: PrecisionPolicy | None = None, deadline: float | None = None,
               progress: Callable[[str], None] | None = None) -> None:
        """Have the workers build the model's parts, waiting for them until `deadline`
        (time.monotonic(); None: build_timeout_s from now)."""
        policy = policy or model.policy or PrecisionPolicy()
        assignment = [(p.id, p.nodes) for p in model.plan.parts]
        parts = {p.id: p for p in model.plan.parts}
        todo = [(device, i, pid) for device, part_ids in model.parts_by_device.items()
                if not only_device or device == only_device for i, pid in enumerate(part_ids)]
        futures: list[tuple[Route, Future[Reply]]] = []
        for k, (device, i, pid) in enumerate(todo, 1):
            route = next(r for r in model.routes if r.id == pid)
            label = f"building part {k} of {len(todo)} on {device}"
            futures.append((route, self.workers.of(device).call(Build(
                model=model.key, part=pid, archive=model.archive, assignment=assignment,
                precisions=route.precisions or [route.precision],
                input_specs=model.input_specs, timeout_s=self.compile_timeout_s,
                split_key=model.split_key,
                input_shapes=model.part_input_shapes.get(pid),
                last=model.split_key == model.key and i == len(model.parts_by_device[device]) - 1,
                tolerance=route.tolerance, budget=route.budget, calibration=policy.calibration,
                calibration_tag=policy.calibration_tag,
                allowed=registry.allowed_runtimes(self.runtimes, self.devices[device]),
                floor_ms=None if model.bucket else precision.floors(
                    parts[pid], self.devices[device], route.precisions or [route.precision])),
                told=progress and (lambda text, label=label: progress(f"{label}: {text}")))))
        model.policy = policy
        t0 = time.monotonic()
        deadline = t0 + self.build_timeout_s if deadline is None else deadline
        for k, (route, future) in enumerate(futures, 1):
            if progress:
                progress(f"building part {k} of {len(futures)} on {route.device}")
            try:
                reply = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise RunTimeout(f"building part {route.id} for {route.device}: no reply in "
                                 f"{time.monotonic() - t0:.1f} s") from None
            except WorkerDied as e:  # a compiler crashed it (AOTInductor's load on torch
                # 2.11 did on an H200): as a build that failed, so the part is planned again
                # off that device; the worker is revived for the next build
                raise fallback.BuildFailed(f"building part {route.id} for {route.device} "
                                           f"failed: {e}", route.id, route.device) from None
            if not reply.ok or not isinstance(reply.result, Built):
                raise fallback.BuildFailed(f"building part {route.id} for {route.device} "
                                           f"failed: {reply.error}", route.id, route.device)
            self.counters["built"] += 1
            self.counters["compiled"] += not reply.result.from_cache
            route.runtime, route.built = reply.result.runtime, reply.result
            route.variants = {v.precision: v for v in reply.result.variants}
            route.precision = (route.precisions or [route.precision])[0]

    def unload(self, key: str, wait_s: float = 0.0) -> None:
        """Stop serving model `key`; with `wait_s`, wait that long for its workers to have
        let it go (a fast-path session a worker serves then ends at its next request)."""
        model = self.models.pop(key, None)
        self.bells.drop(key)
        if model is None:
            return
        with self.buckets_lock:
            variants = list(model.family.buckets.values()) if model.family else []
            for variant in variants:
                assert variant.bucket is not None
                variant.bucket.evicted = True
        for variant in variants:
            self.unload(variant.key, wait_s)
        unloads = [self.workers[d].call(Unload(key)) for d in model.parts_by_device
                   if d in self.workers]
        deadline = time.monotonic() + wait_s
        for future in unloads if wait_s else ():
            with contextlib.suppress(Exception):  # (a dead worker let go of it too)
                future.result(timeout=max(0.0, deadline - time.monotonic()))

    def forget_segments(self, segments: list[tuple[str, int]]) -> None:
        """Have every worker unmap these client objects (name, inode); no reply awaited."""
        if segments:
            for worker in list(self.workers.values()):
                worker.call(Forget(segments))
            self.regions.forget(set(segments))

    def close(self) -> None:
        self.workers.close()

    # -- data path -------------------------------------------------------------------------
    def resolve(self, model: LoadedModel, given: Sequence[tuple[str, tuple[int, ...]]],
                deadline: float | None = None) -> LoadedModel:
        """Check a request's inputs, (dtype name, shape) each in the model's order, against
        the model's input table (the one check; BadInput names what is wrong). Returns the
        model, or for a dynamic-shape model its bucket for these shapes, built on first use
        (waited for until `deadline`, time.monotonic(); None: build_timeout_s)."""
        check_inputs(model.name, model.table, given)
        if not model.dynamic:
            return model
        buckets.check_dims(model, given, self.max_dim)
        shapes = tuple(tuple(shape) for _, shape in given)
        return buckets.bucket(self, model, shapes, deadline)

    def infer(self, key: str, inputs: Sequence[torch.Tensor],
              deadline: float | None = None) -> list[torch.Tensor]:
        """Run model `key` on host tensors, for callers in this process: resolve, then run."""
        given = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in inputs]
        model = self.resolve(self.models[key], given, deadline)
        return self.run(model, inputs, deadline=deadline)  # type: ignore[return-value]

    def run(self, model: LoadedModel, inputs: Sequence[torch.Tensor | TensorRef | RawTensor],
            output_refs: dict[str, TensorRef] | None = None, raw: bool = False,
            timeline: Timeline | None = None, deadline: float | None = None,
            into: Sequence[memoryview] | None = None,
            batched: bool = False) -> list[torch.Tensor | bytes | None]:
        """Run one request of a resolved model (inputs already checked by `resolve`). Inputs
        are tensors or raw bytes (copied into the arena) or references into shared memory
        (read in place by the first part); outputs named in output_refs are written in place
        there (None is returned for them), the rest come back as fresh host tensors, or with
        raw=True as bytes (the block is reused at once), or with `into` copied there (one place
        per output; nothing is returned). A `timeline` list gets each part's dispatch and
        reply times (a traced request takes the path an untraced one takes; batched, it gets
        the parts of its batch's run). `deadline` (time.monotonic()) bounds every wait of the
        request (None: run_timeout_s from now): RunTimeout after it. A request whose worker
        died runs once more when the worker is back; WorkerUnavailable if that fails too. A
        batched model's requests share runs (cuvild/run/batching.py), which come back here
        `batched`."""
        if model.batcher is not None and not batched:
            return model.batcher.run(self, model, inputs, output_refs or {}, raw, into,
                                     deadline, timeline)
        output_refs = output_refs or {}
        begun = time.monotonic()
        deadline = begun + self.run_timeout_s if deadline is None else deadline
        patient = deadline - begun >= self.run_timeout_s  # may take a silent worker as hung
        model = self._admit(model, deadline)
        outstanding: Sequence[Future[Any]] = ()  # parts that may still write the block
        block = None
        try:
            refs = dict(output_refs)  # the request's tensors in clients' regions
            refs.update((n, v) for n, v in zip(model.inputs, inputs, strict=True)
                        if isinstance(v, TensorRef))
            block = self.arena.alloc(model.footprint)
            for attempt in (1, 2):
                self._place(model, block, inputs)  # (again for a retry: a later part may
                try:                               # have reused a spent input's bytes)
                    with Rung(self.bells, self, model, block, refs, deadline) as parts:
                        run_parts(self, model, parts, timeline, deadline, patient)
                    break
                except InferError as e:
                    outstanding = getattr(e, "outstanding", ())
                    self._again(model, e, attempt, deadline, timeline)  # or raises
            return self._results(model, block, output_refs, raw, into)
        finally:
            if block is not None:
                self.arena.free_after(block, outstanding)
            self._in_flight.release()
            buckets.release(self, model)

    def _admit(self, model: LoadedModel, deadline: float) -> LoadedModel:
        """A place among the requests in flight, by the deadline, for the model (a bucket
        held, not evicted, while its request runs: the one returned); `run` gives both back."""
        t0, begun = time.perf_counter(), time.monotonic()
        model = buckets.hold(self, model, deadline)
        if not self._in_flight.acquire(timeout=max(0.0, deadline - begun)):
            buckets.release(self, model)
            raise RunTimeout(f"model {model.key}: no place among the requests in flight in "
                             f"{time.monotonic() - begun:.1f} s (the request's deadline)")
        if self.monitor:
            self.monitor.queued(model, time.perf_counter() - t0)
        return model

    def _place(self, model: LoadedModel, block: Block,
               inputs: Sequence[torch.Tensor | TensorRef | RawTensor]) -> None:
        """The request's inputs into its block (those in clients' regions stay there)."""
        for name, value in zip(model.inputs, inputs, strict=True):
            if isinstance(value, RawTensor):
                self.arena.bytes(block, model.slots[name])[:] = value.data
            elif not isinstance(value, TensorRef):
                self.arena.tensor(block, model.slots[name]).copy_(value)

    def _again(self, model: LoadedModel, error: InferError, attempt: int, deadline: float,
               timeline: Timeline | None) -> None:
        """After a failed attempt: return to run the request again (its worker died the
        first time, and is back), else raise what the request answers."""
        if isinstance(error, RunTimeout):
            raise error
        if isinstance(error, WorkerLost):
            if attempt == 2:
                raise WorkerUnavailable(f"{error}; its worker had died during this request "
                                        "before, was restarted, and died again") from None
            log.warning("model %s: %s; running the request again once its worker is back",
                        model.key, error)
            self._await(error, deadline)
            if timeline is not None:
                timeline.clear()
            return
        if attempt == 2 and not isinstance(error, BadRegion):
            raise WorkerUnavailable(f"its worker died during this request and was restarted, "
                                    f"and the retry failed: {error}") from None
        raise error

    def _results(self, model: LoadedModel, block: Block, output_refs: dict[str, TensorRef],
                 raw: bool, into: Sequence[memoryview] | None) -> list[Any]:
        """The outputs from the block: copied `into` places, as bytes (`raw`) or tensors
        (None for those written in clients' regions)."""
        if into is not None:
            for name, place in zip(model.outputs, into, strict=True):
                place[:] = self.arena.bytes(block, model.slots[name])
            return []
        if raw:
            return [None if n in output_refs else bytes(self.arena.bytes(block, model.slots[n]))
                    for n in model.outputs]
        return [None if n in output_refs else self.arena.tensor(block, model.slots[n]).clone()
                for n in model.outputs]

    def _await(self, lost: WorkerLost, deadline: float) -> None:
        """Wait for the dead workers' restart, by the deadline."""
        t0 = time.monotonic()
        for device in lost.devices:
            if not self.workers.wait_usable(device, deadline - time.monotonic()):
                raise RunTimeout(f"{lost}; its worker was not back in "
                                 f"{time.monotonic() - t0:.1f} s (the request's deadline)")

    def _restore(self, device: str, worker: WorkerHandle) -> None:
        """Put a restarted worker's parts back (Workers revives it)."""
        for model in list(self.models.values()):
            # (a dynamic-shape model's own parts are never built: its buckets are)
            if device in model.parts_by_device and not model.evicted and not model.dynamic:
                self._rebuild(model, device)
                if model.evicted:  # evicted meanwhile: not kept there either
                    worker.call(Unload(model.key))

    def _rebuild(self, model: LoadedModel, device: str) -> None:
        """A revived worker's parts of `model`: loaded from the cache as a load record would
        be, else built again."""
        if warm.recordable(model):
            try:
                return warm.load_parts(self, model, only_device=device)
            except warm.Stale as e:
                log.warning("model %s: %s; building its parts again", model.key, e)
        self.build(model, only_device=device)

    def stats(self, key: str) -> dict[str, Any]:
        """Predicted vs measured time per part (the profile feedback)."""
        return part_stats(self.models[key])
