"""A model's load: plan, split, lay out and build it, settle each part's precision under the
policy and check it end to end against torch eager, then serve it (`prepare`).

A model loaded before (same archive, policy, devices, software) comes back from its load
record (warm.py) with nothing planned or compiled. A dynamic-shape model is served at once:
its buckets are built per concrete shape on first use (buckets.py). A part its device cannot
build is planned off it again (fallback.py).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cuvild.core.errors import InferError
from cuvild.core.layout import dynamic_dims, input_table, layout
from cuvild.core.loaded import Batching, Family, LoadedModel, State, cut_bytes
from cuvild.core.precision import Accuracy, PrecisionPolicy
from cuvild.load import fallback, guard, precision, warm
from cuvild.load.builder import Builder
from cuvild.run.batching import batcher_for

if TYPE_CHECKING:
    from partitioner.plan import Plan

log = logging.getLogger(__name__)
_ahead: list[threading.Thread] = []
_ahead_lock = threading.Lock()


def import_ahead() -> None:
    """Import what a cold load needs (torch, its export loader, the partitioner: ~2.3 s of a
    core on the 2-core dev host, torch 2.13) on a thread of its own, once a process. Called
    when an upload begins, so that it overlaps the upload and its inspection (in the
    forkserver's child) instead of following them; a daemon that only restores models
    from their records never calls it, and never imports torch."""
    with _ahead_lock:
        if _ahead:
            return
        _ahead.append(threading.Thread(target=_import_cold_path, name="import-ahead",
                                       daemon=True))
    _ahead[0].start()


def _import_cold_path() -> None:
    t0 = time.monotonic()
    from cuvild.intake.safe_load import load_exported_program  # noqa: F401
    from partitioner.plan import plan_model  # noqa: F401
    from partitioner.split import split_program  # noqa: F401

    log.debug("the load path imported ahead of the first upload (%.2f s)", time.monotonic() - t0)


def prepare(builder: Builder, key: str, name: str, version: str, archive: Path,  # noqa: C901, PLR0915 - the load's steps in order
            input_specs: list[dict[str, Any]], objective: str = "latency",
            plan: Plan | None = None, policy: PrecisionPolicy | None = None,
            progress: Callable[[str], None] | None = None, cold: bool = True,
            batching: Batching | None = None,
            banned: fallback.Banned | None = None,
            keep_record: bool = True, restore: bool = True) -> LoadedModel | None:
    """Plan, split, lay out and build a registered model, settle each part's precision
    under the policy (cuvild/load/precision.py) and check the whole model against
    torch eager; returns it ready to serve. A model loaded before (same archive, policy,
    devices, software) comes back from its load record (cuvild/load/warm.py) with
    nothing planned or compiled (cold=False: only so, else None); `progress` is told
    each phase. `batching`: how to merge concurrent requests of a model whose first
    dimension is dynamic (cuvild/run/batching.py; None or max_batch 1: not at all).
    A part its device cannot build is planned off it again (cuvild/load/fallback.py); a
    split planned here that is predicted less than guard.GAIN faster than one device is timed
    against the best single device's plan, and the faster served (cuvild/load/guard.py; a
    language model's at its warm-up, with the plan it is timed against in
    `family.alternative`: cuvild/load/warmup.py). `keep_record`: write its load record
    (not for the guard's second build); `restore=False`: build without trying the load
    record (a restore of it was tried and did not serve)."""
    policy = policy or PrecisionPolicy()
    say = progress or (lambda phase: None)
    record_at = warm.directory(builder.cache_dir, warm.key(
        str(archive), input_specs, objective, policy, builder.devices.values(), builder.runtimes))
    record = warm.read(record_at) if plan is None and restore else None
    if record is not None:
        say("restoring from the load record")
        try:
            return warm.restore(builder, record_at, record, key, name, version, str(archive),
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
    builder.counters["archive_loads"] += 1
    corrections, planned = builder.corrections.snapshot(), plan is None
    if plan is None:
        say("planning")
        plan = plan_model(ep, list(builder.devices.values()), objective=objective,
                          support=fallback.support(builder.support(), banned),
                          corrections=corrections, precision=policy.mode,
                          int8=bool(policy.calibration))
        plan.notes += fallback.notes(banned)
        builder.counters["planned"] += 1
    try:
        split = split_program(ep, [(p.id, p.nodes) for p in plan.parts])
    except ValueError as e:  # a split that cannot run as the program does whole
        plan = _one_device(builder, ep, plan, planned, e, objective, policy, banned,
                           corrections)
        split = split_program(ep, [(p.id, p.nodes) for p in plan.parts])
    dynamic = dynamic_dims(ep)
    state = state_of(ep)
    # (a dynamic-shape model's buckets are planned per shape, but a language model's all
    # run its one plan: timed against the alternative at its warm-up, cuvild/load/warmup.py)
    alternative = _alternative(builder, ep, plan, objective, policy, banned, corrections,
                               planned and (not dynamic or state is not None))
    if dynamic:  # laid out and built per concrete shape, on first use
        slots, footprint, total = {}, 0, 0
    else:
        slots, footprint, total = layout({n.name: n.meta.get("val") for n in ep.graph.nodes},
                                         split)
    model = LoadedModel(key, name, version, plan, builder.make_routes(plan, split),
                        list(split.inputs), list(split.outputs),
                        input_table(input_specs, dynamic), slots, footprint, total,
                        str(archive), input_specs, objective=objective,
                        family=Family(dynamic, split) if dynamic else None)
    for route in model.routes:
        model.parts_by_device.setdefault(route.device, []).append(route.id)
    model.cut_bytes = cut_bytes(model)
    model.state = state
    if model.state is not None:
        plan.notes.append(f"stateful: {model.state.buffers} buffers updated in place "
                          f"({model.state.nbytes / 1e6:.1f} MB a sequence, context "
                          f"{model.state.context}) are kept per sequence where their part runs "
                          "(on the torch runtime: the one that keeps them)")
        for part in plan.parts:  # (planned on the device's best runtime: said as it will run)
            part.runtime = "torch"
    if model.family:  # its buckets are planned and built at their shapes (buckets.py)
        model.policy = policy
        # one plan for every bucket where none was given, or the model keeps state (its
        # buckets, a prefill chunk and a decode step, must run where its state is)
        replans = planned and model.state is None
        model.family.program = ep if replans else None
        model.family.replans = replans
        # (the guard's second build keeps no records: they are the model's, by its key)
        model.family.record_at = record_at if keep_record else None
        model.family.alternative = alternative
        if model.state is not None and precision.under_budget(policy, plan):
            model.family.reference = ep
        if model.state is not None:  # (its sequences' steps share runs in its worker)
            model.unbatched = ("it keeps state per sequence: its sequences' steps share runs "
                               "in its worker instead (docs/GENERATION.md)")
        elif batching is not None and batching.max_batch > 1:
            say("checking that its rows can be batched")
            batcher_for(model, ep, batching, builder.runner)
        builder.publish(model)
        if keep_record:
            warm.write_dynamic(record_at, model)
        return model
    decision = precision.decision_path(builder.cache_dir, model, policy, builder.devices.values())
    decided, recorded = precision.read_decision(decision)
    budgets = precision.arm(model, builder.devices, policy, decided)
    inputs = precision.check_inputs(model, policy, searched=bool(budgets))
    expected, eager_ms = precision.reference(ep, inputs)
    del ep, split  # workers hold the parts; the daemon keeps only the wiring
    try:
        builder.build(model, policy=policy, progress=say)
    except fallback.BuildFailed as e:  # its nodes off that device, planned again
        banned = fallback.ban(e, plan if planned else None, banned, len(builder.devices))
        say(f"planning again: {e}")
        return fallback.again(e, lambda: prepare(
            builder, key, name, version, archive, input_specs, objective, policy=policy,
            progress=progress, batching=batching, banned=banned))
    say("checking end to end")
    model.accuracy = _settle(builder, model, policy, budgets, decision, recorded, inputs,
                             expected, eager_ms)
    precision.record_runs(plan, model.routes, corrections, builder.devices)
    plan.notes += precision.runtime_notes(model.routes) + model.accuracy.notes
    if alternative is not None:
        other_plan, ours, theirs = alternative
        say(f"timing the plan {theirs} against the one {ours}")
        try:
            # (a copy: its build writes the precisions it chose into the plan's parts, and
            # the plan served must search them again, within the budget)
            other = prepare(builder, f"{key}~one", name, version, archive, input_specs,
                            objective, plan=copy.deepcopy(other_plan), policy=policy,
                            keep_record=False)
        except Exception as e:  # noqa: BLE001 - the plan stands, and says why
            builder.unload(f"{key}~one")
            other = None
            plan.notes.append(guard.failed(ours, theirs, e))
        ours_ms = theirs_ms = 0.0
        if other is not None:
            try:
                builder.rebuild_lost(model)  # (a worker the other's build crashed: _again)
                ours_ms, theirs_ms = guard.timed(builder.runner.run, model, other, inputs)
            finally:
                builder.unload(other.key)
        if other is not None and theirs_ms < ours_ms:
            # served from the same plan, under the model's key (its parts: the compile cache)
            builder.drop(model)
            other_plan.notes.append(guard.note(ours_ms, theirs_ms, ours, theirs, False))
            return prepare(builder, key, name, version, archive, input_specs, objective,
                           plan=other_plan, policy=policy, progress=progress,
                           batching=batching)
        if other is not None:
            plan.notes.append(guard.note(ours_ms, theirs_ms, ours, theirs, True))
    builder.publish(model)
    if keep_record:
        try:
            warm.write(record_at, model, inputs, expected)
        except OSError as e:
            log.warning("model %s: load record not written (%s)", key, e)
    return model


def state_of(ep: Any) -> State | None:
    """What a stateful program keeps per sequence: the buffers its graph updates in place
    (transformers' static-cache export writes its KV cache with index_copy_), None if none."""
    from partitioner.fxgraph import updated

    buffers = {s.arg.name: s.target for s in ep.graph_signature.input_specs
               if s.kind.name == "BUFFER"}
    mutated: list[str] = []
    for node in ep.graph.nodes:
        value = updated(node)
        if value is not None and value.name in buffers and buffers[value.name] not in mutated:
            mutated.append(buffers[value.name])
    if not mutated:
        return None
    tensors = dict(ep.named_buffers())
    kept = [tensors[n] for n in mutated if n in tensors]
    lengths = [t.shape[2] for t in kept if t.dim() == 4]
    croppable = bool(lengths) and all(
        (t.dim() == 4 and t.shape[2] == lengths[0])
        or (t.dim() == 0 and not t.dtype.is_floating_point) for t in kept)
    return State(len(kept), sum(t.numel() * t.element_size() for t in kept),
                 min(lengths) if lengths else 0, croppable)


def _alternative(builder: Builder, ep: Any, plan: Any, objective: str, policy: PrecisionPolicy,
                 banned: Any, corrections: Any, guarded: bool) -> tuple[Any, str, str] | None:
    """The plan to time the planned one against before serving it (cuvild/load/guard.py),
    with how each is named: the profile's own plan where the lessons learned moved the
    model's heaviest part, else the best single device's where a split is predicted less
    than guard.GAIN faster; None where neither."""
    if not guarded:
        return None
    planned = _planner(builder, ep, objective, policy, banned)
    devices = list(builder.devices.values())
    if corrections:
        unlearned = planned(devices, None)
        if guard.moved_by_lessons(plan, unlearned):
            return (unlearned, f"as learned ({guard.heaviest(plan)})",
                    f"of the profile alone ({guard.heaviest(unlearned)})")
    if len({p.device for p in plan.parts}) < 2 or guard.annotated(ep):
        return None
    single = guard.single_plan(ep, devices, lambda program, one: planned(one, corrections))
    if guard.worth_timing(plan, single):
        return single, "split", f"all on {single.parts[0].device}"
    if single is not None:
        plan.notes.append(f"predicted {guard.cost(single) / guard.cost(plan):.2f}x "
                          f"faster than all on {single.parts[0].device}: served split "
                          "without timing both")
    return None


def _planner(builder: Builder, ep: Any, objective: str, policy: PrecisionPolicy,
             banned: Any) -> Callable[[list[Any], Any], Plan]:
    """The program planned on some devices (`on`) as the load plans it, with the lessons
    `learned` (None: the profile alone)."""
    from partitioner.plan import plan_model

    support = fallback.support(builder.support(), banned)

    def planned(on: list[Any], learned: Any) -> Plan:
        return plan_model(ep, on, objective=objective,
                          support={d.id: support[d.id] for d in on if d.id in support},
                          corrections=learned, precision=policy.mode,
                          int8=bool(policy.calibration))
    return planned


def _one_device(builder: Builder, ep: Any, plan: Plan, planned: bool, error: ValueError,
                objective: str, policy: PrecisionPolicy, banned: Any, corrections: Any) -> Plan:
    """The best single device's plan where the split planned here cannot run as the program
    does whole (partitioner/split.py: a value of the model's state read by another part
    between its updates in place); the error itself where the plan was given, or is on one
    device already, or no device runs the whole model."""
    if not planned or len({p.device for p in plan.parts}) < 2:
        raise error
    one = _planner(builder, ep, objective, policy, banned)
    single = guard.single_plan(ep, list(builder.devices.values()),
                               lambda program, on: one(on, corrections))
    if single is None:
        raise error
    single.notes.append(f"{guard.LABEL}: the split planned cannot keep the model's state as "
                        f"it runs whole ({error}): all on {single.parts[0].device}")
    log.info("%s", single.notes[-1])
    return single


def _settle(builder: Builder, model: LoadedModel, policy: PrecisionPolicy,
            budgets: dict[str, float], decision: Path, recorded: dict[str, Any] | None,
            inputs: list[Any], expected: list[Any], eager_ms: float) -> Accuracy:
    """Check the plan end to end, search the precisions under the budgets (or check the
    recorded choice again), and fix each part at what it will run."""
    first = precision.check(builder.runner.run, model, inputs, expected)
    try:
        precision.refuse_unusable(builder.runner.run, model, inputs, expected, first)
    except InferError:
        builder.drop(model)  # (never published: its workers let its parts go)
        raise
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
            builder.build(model, policy=policy)
            return _settle(builder, model, policy, budgets, decision, None, inputs, expected,
                           eager_ms)
    elif budgets:
        if not policy.calibration:
            accuracy.notes.append("int8 not tried: no calibration inputs were given")
        accuracy.chosen, notes = precision.search(
            builder.runner.run, builder.choose, model, budgets, inputs, expected, first,
            more=lambda route, mixes: builder.build_mixes(model, route, mixes, policy))
        accuracy.notes += notes
    precision.fix(builder.choose, model)
    if budgets and recorded is None:
        precision.write_decision(decision, model.routes, accuracy)
    return accuracy
