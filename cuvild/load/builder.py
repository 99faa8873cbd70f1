"""The control plane's one object: it has the workers build, switch and drop parts, and it
alone changes what is served.

The `Builder` publishes every change of the served models as a new snapshot to the runner
(cuvild/core/served.py: `publish`, `withdraw`), teaches the cost model what the parts
measured (`feedback`, on the corrections' thread) and owns the counters of what loads did.
Its steps are driven from this room: prepare.py (a model's load), warm.py (load records and a
revived worker's parts), buckets.py (a dynamic-shape model's bucket on a miss).
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
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cuvild.core.errors import InferError, RunTimeout
from cuvild.core.loaded import LoadedModel, Route
from cuvild.core.precision import PrecisionPolicy
from cuvild.load import fallback, precision
from cuvild.load.corrections import CorrectionStore, Lesson
from cuvild.run.request import FEEDBACK_RUNS
from cuvild.workers.handle import WorkerDied
from partitioner.corrections import prior
from protos.orders import Build, Built, Choose, Describe, Described, Forget, Reply, Unload
from runtimes import registry

if TYPE_CHECKING:
    from cuvild.run.runner import Runner
    from cuvild.workers.workers import Workers
    from partitioner.plan import Plan
    from partitioner.profile import DeviceProfile
    from partitioner.split import SplitProgram

log = logging.getLogger(__name__)
DESCRIBE_S = 2.0


class Builder:
    def __init__(self, devices: Sequence[DeviceProfile], cache_dir: Path, workers: Workers,
                 runner: Runner, build_timeout_s: float = 600.0,
                 compile_timeout_s: float = 300.0, corrections_path: Path | None = None,
                 runtimes: dict[str, list[str]] | None = None) -> None:
        """`runtimes`: device id or kind -> the runtimes its parts may be built with."""
        self.devices = {d.id: d for d in devices}
        self.cache_dir = cache_dir
        self.workers = workers
        self.runner = runner
        self.runtimes = runtimes or {}
        self.build_timeout_s = build_timeout_s
        self.compile_timeout_s = compile_timeout_s
        self.corrections = CorrectionStore(corrections_path)
        # loads' "archive_loads", "planned", parts "built", "compiled", "restored" (warm.py)
        self.counters: Counter[str] = Counter()
        self._publishing = threading.Lock()

    def publish(self, model: LoadedModel) -> None:
        """Serve `model` under its key (a bucket also under its shapes): a new snapshot."""
        with self._publishing:
            self.runner.served = self.runner.served.adding(model)

    def withdraw(self, key: str) -> LoadedModel | None:
        """Stop serving model `key` (a new snapshot); returns what was served."""
        with self._publishing:
            model = self.runner.served.models.get(key)
            self.runner.served = self.runner.served.without(key)
        self.runner.bells.drop(key)
        self.runner.sequences.drop_model(key)  # (a stateful model's live sequences end)
        return model

    def support(self) -> dict[str, Any]:
        """Per device, whether one of its runtimes can run a node (runtimes/registry.py)."""
        return registry.support(self.devices.values(), self.runtimes)

    @staticmethod
    def make_routes(plan: Plan, split: SplitProgram) -> list[Route]:
        by_id = {p.id: p for p in plan.parts}
        return [Route(p.id, by_id[p.id].device, by_id[p.id].precision, p.inputs, p.outputs)
                for p in split.parts]

    def build(self, model: LoadedModel, only_device: str | None = None,  # noqa: PLR0913
              policy: PrecisionPolicy | None = None, deadline: float | None = None,
              progress: Callable[[str], None] | None = None, only_part: str | None = None,
              defer_mix: bool = True) -> None:
        """Have the workers build the model's parts (`only_part`: that one), waiting for them
        until `deadline` (time.monotonic(); None: build_timeout_s from now). A part its worker
        cannot build raises fallback.BuildFailed (the load plans it off that device).
        `defer_mix` False: a mix is built even where its low precision alone holds its part
        (the precision search asks for it so, once the end-to-end check refused that)."""
        policy = policy or model.policy or PrecisionPolicy()
        assignment = [(p.id, p.nodes) for p in model.plan.parts]
        parts = {p.id: p for p in model.plan.parts}
        todo = [(device, i, pid) for device, part_ids in model.parts_by_device.items()
                if not only_device or device == only_device for i, pid in enumerate(part_ids)
                if not only_part or pid == only_part]
        futures: list[tuple[Route, Build, Any, int, Future[Reply]]] = []
        for k, (device, i, pid) in enumerate(todo, 1):
            route = next(r for r in model.routes if r.id == pid)
            label = f"building part {k} of {len(todo)} on {device}"
            order = Build(
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
                    parts[pid], self.devices[device], route.precisions or [route.precision]),
                defer_mix=defer_mix)
            told = progress and (lambda text, label=label: progress(f"{label}: {text}"))
            worker = self.workers.of(device)
            futures.append((route, order, told, worker.generation,
                            worker.call(order, told=told)))
        model.policy = policy
        t0 = time.monotonic()
        deadline = t0 + self.build_timeout_s if deadline is None else deadline
        for k, (route, order, told, generation, future) in enumerate(futures, 1):
            route.generation = generation
            if progress:
                progress(f"building part {k} of {len(futures)} on {route.device}")
            try:
                try:
                    reply = future.result(timeout=max(0.0, deadline - time.monotonic()))
                except WorkerDied as e:
                    reply, route.generation = self._again(route, order, told, e, deadline)
            except FutureTimeout:
                raise RunTimeout(f"building part {route.id} for {route.device}: no reply in "
                                 f"{time.monotonic() - t0:.1f} s") from None
            if not reply.ok or not isinstance(reply.result, Built):
                raise fallback.BuildFailed(f"building part {route.id} for {route.device} "
                                           f"failed: {reply.error}", route.id, route.device)
            self.counters["built"] += 1
            self.counters["compiled"] += not reply.result.from_cache
            route.runtime, route.built = reply.result.runtime, reply.result
            route.variants = {v.precision: v for v in reply.result.variants}
            route.precision = (route.precisions or [route.precision])[0]
        self.rebuild_lost(model)

    def build_mixes(self, model: LoadedModel, route: Route, mixes: list[str],
                    policy: PrecisionPolicy | None = None) -> None:
        """Build the mixes `route`'s build left for later (runtimes/base.py MIX_DEFERRED),
        asked for by the precision search: that part again at its own precision (from the
        compile cache) and at `mixes`; its earlier candidates kept for the reports."""
        before = route.built.candidates if route.built else []
        precisions, route.precisions = route.precisions, [route.precision, *mixes]
        try:
            self.build(model, policy=policy, only_part=route.id, defer_mix=False)
        finally:
            route.precisions = precisions
        if route.built is not None:
            route.built = replace(route.built, candidates=[
                *(c for c in before if c["precision"] not in mixes),
                *(c for c in route.built.candidates if c["precision"] in mixes)])

    def rebuild_lost(self, model: LoadedModel) -> None:
        """Build again, at the precisions chosen for them, the parts of `model` whose worker
        died since it built them and was revived under another build (`_again`; a revived
        worker puts back only the parts of models served)."""
        lost = {r.device for r in model.routes
                if r.generation >= 0 and r.generation != self.workers.of(r.device).generation}
        for device in sorted(lost):
            log.warning("model %s: building its parts on %s again (their worker died)",
                        model.key, device)
            chosen = {r.id: r.precision for r in model.routes if r.device == device}
            self.build(model, only_device=device)
            for route in model.routes:
                if route.device == device and route.precision != chosen[route.id]:
                    self.choose(model, route, chosen[route.id])

    def _again(self, route: Route, order: Build, told: Any, died: WorkerDied,
               deadline: float) -> tuple[Reply, int]:
        """A Build whose worker died under it. The worker is revived (its served parts put
        back); where a compile killed it (runtimes/crashes.py: OpenVINO 2026.4's SIGFPE on
        an AMX Xeon, AOTInductor's load on torch 2.11), the build is sent once more, and
        the search leaves that compile out. A death of no known compile, or a second one, is
        a build that failed: the part is planned again off that device. (Parts built by the
        start that died are gone with it: `rebuild_lost`.)"""
        self.workers.revive_later(route.device)
        if died.compiles and self.workers.wait_usable(route.device,
                                                      deadline - time.monotonic()):
            log.warning("building part %s for %s again: %s", route.id, route.device, died)
            worker = self.workers.of(route.device)
            try:
                generation = worker.generation
                return worker.call(order, told=told).result(
                    timeout=max(0.0, deadline - time.monotonic())), generation
            except WorkerDied as e:
                self.workers.revive_later(route.device)
                died = e
        raise fallback.BuildFailed(f"building part {route.id} for {route.device} failed: "
                                   f"{died}", route.id, route.device) from None

    def choose(self, model: LoadedModel, route: Route, at: str, final: bool = False) -> None:
        """Have the part's worker run it at precision `at` (built before)."""
        reply = self.workers.of(route.device).call(Choose(model.key, route.id, at, final)).result(
            timeout=self.build_timeout_s)
        if not reply.ok:
            raise InferError(f"part {route.id} on {route.device}: {reply.error}")
        route.precision, route.runtime = at, route.variants[at].runtime

    def describe(self, key: str, part: str, device: str) -> str:
        """How built part `part` of model (or bucket) `key` runs now, as its worker says (a
        decode step compiled or eager, and why); "" where it says nothing, or nothing in time
        (a status query waits DESCRIBE_S at most, behind the run in progress)."""
        try:
            reply = self.workers.of(device).call(Describe(key, part)).result(timeout=DESCRIBE_S)
        except Exception:  # noqa: BLE001 - a worker busy or gone has nothing to add
            return ""
        return reply.result.text if reply.ok and isinstance(reply.result, Described) else ""

    def unload(self, key: str, wait_s: float = 0.0) -> None:
        """Stop serving model `key` (a dynamic-shape model's buckets with it) and have its
        workers drop it; with `wait_s`, wait that long for them to have let it go (a
        fast-path session a worker serves then ends at its next request)."""
        model = self.withdraw(key)
        if model is None:
            return
        twin = model.family.twin if model.family else None
        for kept in (model, twin) if twin else (model,):
            for bucket in list(kept.family.buckets.values()) if kept.family else []:
                assert bucket.bucket is not None
                bucket.bucket.evicted = True
                self.unload(bucket.key, wait_s)
            self.drop(kept, wait_s)

    def drop(self, model: LoadedModel, wait_s: float = 0.0) -> None:
        """Have the workers of a model no longer served let its parts go."""
        unloads = [self.workers[d].call(Unload(model.key)) for d in model.parts_by_device
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
            self.runner.regions.forget(set(segments))

    def feedback(self, model: LoadedModel, min_runs: int = 3) -> int:
        """Teach the cost model what `model`'s parts measured (their median time on the
        runtime each runs on); returns how many parts taught it. The runner sends a model
        here (through the corrections' thread) when a part reaches FEEDBACK_RUNS, served or
        not: the plan a load's guard (cuvild/load/guard.py) timed and did not serve teaches
        too, else the lesson that misplaced it would misplace the next model again."""
        if model.bucket:  # a bucket's parts are not the plan's shapes
            return 0
        parts = {p.id: p for p in model.plan.parts}
        taught = []
        for route in model.routes:
            part = parts.get(route.id)
            runs = sorted(route.measured_ms[:FEEDBACK_RUNS])  # (the runs that triggered it)
            if part is None or not part.class_ms or len(runs) < min_runs:
                continue
            device = self.devices[route.device]
            taught.append(Lesson(  # priced as precision.record_runs prices it
                route.device, precision.runtime_key(route.runtime, route.precision),
                precision.at(part.class_ms, device, route.precision), part.kernels,
                prior(device), runs[len(runs) // 2], model.name))
            route.fed_back = True
        self.corrections.learn(taught)
        return len(taught)
