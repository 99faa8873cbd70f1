"""A dynamic-shape model's buckets: the model laid out and built for one concrete input shape,
on that shape's first request, and kept for the next. A model the load planned is planned
again per bucket, at the bucket's sizes (`plan_for`): a large batch may run on another device
than a single request.

Bounded both ways. A dynamic dimension above the runner's `max_dim` is refused (BadInput)
before anything is built for it. A model keeps at most `max_buckets` buckets: when a build
makes one more, the least recently used buckets that no request is running go (unloaded from
the workers), and one asked for again is restored from its load record (cuvild/load/warm.py:
written when a bucket is built, the last `RECORDS` of a model kept; a restart restores its
buckets the same way), else built again (from the compile cache). A bucket in use is never
evicted: the runner holds it while a request runs, and asks again for one evicted between
`resolve` and `run`.

Sizes are not rounded up to fewer buckets: that would pad a request's batch, and padding
changes the results of models that mix rows (attention or normalisation across the batch),
so each size gets its own bucket.

Only a build takes the model's own lock (and, then, evicts: builds and evictions of a model
reach the workers in order).

The runner never calls here: a request whose shapes have no bucket in the served snapshot
asks `Buckets.miss` for one future (the build runs on the buckets' own threads, so a request
that gives up by its deadline leaves it to finish for the next); a request holds a bucket
(`Bucket.hold`, cuvild/core/loaded.py) and eviction passes over one held.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cuvild.core.errors import InferError
from cuvild.core.layout import input_table, layout
from cuvild.core.loaded import LAST, Bucket, Family, LoadedModel, Shapes, cut_bytes
from cuvild.core.precision import Accuracy, PrecisionPolicy
from cuvild.load import precision, warm
from cuvild.load.builder import Builder
from cuvild.run.generate import CHUNKS, INPUTS
from protos.orders import Preload

log = logging.getLogger(__name__)
RECORDS = 32  # bucket load records kept on disk per model, the last written


class Buckets:
    """The dynamic-shape models' buckets: built on a miss, evicted past `max_buckets`."""

    def __init__(self, builder: Builder, max_buckets: int = 8) -> None:
        self.builder = builder
        self.max_buckets = max(1, max_buckets)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="bucket")

    def miss(self, model: LoadedModel, shapes: Shapes) -> Future[LoadedModel]:
        """The runner's ask: `model`'s bucket at `shapes`, built (or restored) off the
        request's thread; the future's result is the bucket, served."""
        return self._pool.submit(self.build, model, shapes)

    def build(self, model: LoadedModel, shapes: Shapes) -> LoadedModel:
        """The bucket from its load record (cuvild/load/warm.py) or, where it has none that
        serves, planned, laid out and built; served, then the oldest past `max_buckets`
        evicted."""
        with family(model).lock:
            bucket = family(model).buckets.get(shapes)
            if bucket is not None and not bucket.evicted:
                return bucket
            bucket = (restored(self.builder, model, shapes)
                       or cold(self.builder, model, shapes))
            owner = family(model).owner or model  # (a twin lives with its model)
            if self.builder.runner.served.models.get(owner.key) is not owner:
                self.builder.drop(bucket)  # unloaded while it was built
                raise InferError(f"model {model.key} is not loaded any more")
            family(model).buckets[shapes] = bucket
            self.builder.publish(bucket)
            self.evict(model)
            return bucket

    def evict(self, model: LoadedModel) -> None:
        """Unload the least recently used buckets past `max_buckets` that no request holds
        (under the model's build lock, so an eviction reaches the workers before a rebuild)."""
        kept = family(model).buckets
        over = len(kept) - self.max_buckets
        for shapes, bucket in sorted(kept.items(), key=lambda kv: kv[1].bucket.used):
            if over <= 0:
                break
            assert bucket.bucket is not None
            if bucket.bucket.evict():
                del kept[shapes]
                over -= 1
                log.info("bucket %s evicted (a model keeps %d)", bucket.key, self.max_buckets)
                self.builder.unload(bucket.key)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_TWINS = threading.Lock()


def last_logits(model: LoadedModel) -> LoadedModel:
    """A dynamic-shape model's twin for generation: the same model with its logits computed
    at the last position only (partitioner/split.py `last_rows`): a prompt's chunk then
    skips the head over every other position (a 128-token chunk of the 200M Llama: 245 ->
    210 ms on the 2-core EPYC). Its buckets are built, searched and evicted as the model's
    are, beside them, planned as the model is (not again per bucket), and go with the
    model; a sequence's state is the model's (the scope is a bucket's key up to its first
    "@"), so its chunks and the model's decode steps share one cache. Where the logits are
    no linear over positions, its buckets are the model's program as it is."""
    kept = family(model)
    with _TWINS:
        if kept.twin is None:
            kept.twin = dataclasses.replace(
                model, key=f"{model.key}@{LAST}", accuracy=None, warm=False,
                family=Family(kept.dims, replans=False, owner=model))
        return kept.twin


def step_lengths(model: LoadedModel, max_dim: int) -> tuple[int, ...]:
    """The lengths a generation's step may take on a language model (inputs `input_ids`
    [1, n] and `cache_position` [n]): CHUNKS within its dynamic length's range and at most
    `max_dim` (engine.max_dim: a longer one is refused, cuvild/core/loaded.py `check_dims`),
    largest first, else its one static length."""
    at = model.inputs.index(INPUTS[0])
    ranges = [(lo, hi) for i, dim, lo, hi in model.dynamic if i == at and dim == 1]
    if ranges:
        return tuple(c for c in CHUNKS if ranges[0][0] <= c <= min(ranges[0][1], max_dim))
    return tuple(model.table[at].shape[1:2])


def family(model: LoadedModel) -> Family:
    """A dynamic-shape model's Family (every function here is handed one)."""
    assert model.family is not None, f"model {model.key} has fixed shapes"
    return model.family


def restored(builder: Builder, model: LoadedModel, shapes: Shapes) -> LoadedModel | None:
    """The bucket as its load record has it (nothing planned, split or compiled: no torch),
    checked end to end; None where it has no record, or one that no longer serves."""
    if family(model).record_at is None:
        return None
    where = family(model).record_at / warm.BUCKETS / tag(shapes)
    record = warm.read(where)
    if record is None:
        return None
    key = f"{model.key}@{tag(shapes)}"
    try:
        bucket = warm.restore(builder, where, record, key, model.name, model.version,
                               model.archive, specs(model, shapes), model.policy)
    except Exception as e:  # noqa: BLE001 - never trusted blindly: built again
        log.warning("bucket %s: load record not used (%s); building it again", key, e)
        return None
    bucket.bucket, bucket.batcher = Bucket(model.key, shapes), model.batcher
    log.info("restored %s for input shapes %s from its load record", model.key,
             [list(s) for s in shapes])
    return bucket


def cold(builder: Builder, model: LoadedModel, shapes: Shapes) -> LoadedModel:
    import torch

    from cuvild.workers.build import sample_inputs

    reread(builder, model)
    assert family(model).split is not None
    plan, split, own = plan_for(builder, model, shapes)
    given = specs(model, shapes)
    inputs = sample_inputs(given, 0)  # (a check input, as a static model's load has)
    with torch.no_grad():
        values = split.trace(*inputs)
    slots, footprint, total = layout(values, split)
    routes = builder.make_routes(plan, split)
    by_device: dict[str, list[str]] = {}
    for route in routes:
        by_device.setdefault(route.device, []).append(route.id)
    bucket = LoadedModel(f"{model.key}@{tag(shapes)}", model.name, model.version, plan, routes,
                          model.inputs, model.outputs, input_table(given, []), slots,
                          footprint, total, model.archive, given,
                          parts_by_device=by_device,
                          bucket=Bucket(model.key, shapes, own_split=own))
    bucket.policy, bucket.state = model.policy, model.state
    bucket.cut_bytes = cut_bytes(bucket)
    bucket.part_input_shapes = {
        p.id: [list(values[n].shape) for n in p.inputs] for p in split.parts}
    log.info("building %s for input shapes %s%s", model.key, [list(s) for s in shapes],
             ": " + ", ".join(f"{r.id}@{r.device}" for r in routes) if own else "")
    policy = bucket.policy or PrecisionPolicy()
    decision = precision.decision_path(builder.cache_dir, bucket, policy,
                                       builder.devices.values())
    decided, recorded = precision.read_decision(decision)
    budgets = precision.arm(bucket, builder.devices, policy, decided)
    builder.build(bucket)
    if budgets:
        searched(builder, bucket, split, budgets, decision, recorded)
    if family(model).record_at is not None:
        write_record(builder, model, bucket, inputs, [values[n] for n in model.outputs])
    bucket.batcher = model.batcher
    return bucket


def searched(builder: Builder, bucket: LoadedModel, split: Any, budgets: dict[str, float],
             decision: Path, recorded: dict[str, Any] | None) -> None:
    """A bucket under a budget runs each part at its fastest precision that keeps the bucket
    within it, as a static model does (cuvild/load/precision.py), on random inputs of its
    shapes against torch eager, each from the program's initial state: the prefill chunks
    and the decode step of a language model each choose their own (a 64-token chunk's
    matrix products and a one-token step's matrix-vector products are fastest at different
    precisions). The choice is kept in the compile cache (`decision`): built again (a
    restart, an evicted bucket), only the chosen precision is built and checked, and the
    search runs again only if that check fails. (That check runs on the first
    CHECK_INPUTS of the search's inputs: the choice held on all of them, so the check asks
    only whether the build computes as it did: the 200M Llama's 128-token chunk rebuilt at
    a restart in 3.5 s, not 10.6.)"""
    policy = bucket.policy or PrecisionPolicy()
    budget = min(budgets.values())
    if recorded is not None:
        inputs, expected = _check_inputs(bucket, split, precision.CHECK_INPUTS)
        first = precision.check(builder.runner.run, bucket, inputs, expected)
        if first.error <= budget:
            bucket.accuracy = Accuracy.from_dict(recorded)
            bucket.accuracy.chosen = first
            precision.fix(builder.choose, bucket)
            return
        # the recorded choice no longer holds: search from everything
        log.warning("bucket %s: the recorded precisions measure %.1e > %.0e now; searching "
                    "again", bucket.key, first.error, budget)
        for route in bucket.routes:
            route.precisions = route.search
        builder.build(bucket)
    inputs, expected = _check_inputs(bucket, split)
    first = precision.check(builder.runner.run, bucket, inputs, expected)
    chosen, notes = precision.search(
        builder.runner.run, builder.choose, bucket, budgets, inputs, expected, first,
        more=lambda route, mixes: builder.build_mixes(bucket, route, mixes))
    precision.fix(builder.choose, bucket)
    bucket.accuracy = Accuracy(policy.mode, budget, len(inputs), False, 0.0, first, chosen,
                               notes)
    precision.write_decision(decision, bucket.routes, bucket.accuracy)
    log.info("bucket %s: %s", bucket.key, "; ".join(notes))


def again_at(builder: Builder, target: LoadedModel, shapes: Shapes, at: str,
             why: str) -> LoadedModel | None:
    """`target`'s bucket at `shapes` built again with each part its budget searched at `at`,
    recorded as that search's choice (`why` among its notes), so that a restart or an eviction
    builds it so too (and checks it: `searched`); its load record goes. The bucket built,
    or None where every searched part runs at `at` already, or the bucket is not built."""
    kept = family(target)
    with kept.lock:
        bucket = kept.buckets.get(shapes)
        if bucket is None or bucket.bucket is None or all(
                r.precision == at for r in bucket.routes if r.budget is not None):
            return None
        policy = bucket.policy or PrecisionPolicy()
        accuracy = bucket.accuracy or Accuracy(policy.mode, None, 0, False, 0.0)
        accuracy.notes = [*accuracy.notes, why]
        precision.write_decision(
            precision.decision_path(builder.cache_dir, bucket, policy, builder.devices.values()),
            bucket.routes, accuracy,
            {r.id: at if r.budget is not None else r.precision for r in bucket.routes})
        del kept.buckets[shapes]
        bucket.bucket.evicted = True
        if kept.record_at is not None:
            shutil.rmtree(kept.record_at / warm.BUCKETS / tag(shapes), ignore_errors=True)
    builder.unload(bucket.key)
    log.info("bucket %s: built again at %s (%s)", bucket.key, at, why)
    return builder.runner.miss(target, shapes).result()


def _check_inputs(bucket: LoadedModel, split: Any,
                  count: int | None = None) -> tuple[list[Any], list[Any]]:
    """Random inputs of the bucket's shapes (the search's SEARCH_SAMPLES, or the first
    `count` of them) and torch eager's outputs on each, from the program's initial state (a
    stateful part's)."""
    import torch

    from cuvild.workers.build import SEARCH_SAMPLES, sample_inputs
    from runtimes.torch_eager import remember_initial, reset

    inputs = [sample_inputs(bucket.input_specs, seed) for seed in range(count or SEARCH_SAMPLES)]
    expected = []
    with torch.no_grad():
        for x in inputs:
            for part in split.parts:
                remember_initial(part.module)
                reset(part.module)
            values = split.trace(*x)
            expected.append([values[n] for n in bucket.outputs])
    return inputs, expected


def write_record(builder: Builder, model: LoadedModel, bucket: LoadedModel,
                 inputs: list[Any], expected: list[Any]) -> None:
    """Write a bucket's load record, with its check: torch eager's outputs on one input and
    how far the bucket's are from them now (and what its precision search found)."""
    try:
        check = precision.check(builder.runner.run, bucket, [inputs], [expected])
    except Exception as e:  # noqa: BLE001 - a record saves a restart's build, no more
        log.warning("bucket %s: not recorded, its check run failed: %s", bucket.key, e)
        return
    policy = bucket.policy or PrecisionPolicy()
    if bucket.accuracy is None:  # (a searched bucket has its search's, over more inputs)
        bucket.accuracy = Accuracy(policy.mode, None, 1, False, 0.0, check, check)
    if not warm.recordable(bucket):  # (a part on the torch runtime has no cached build)
        log.info("bucket %s: no load record (a part has no cached build)", bucket.key)
        return
    assert bucket.bucket is not None
    kept = family(model).record_at / warm.BUCKETS
    try:
        warm.write(kept / tag(bucket.bucket.shapes), bucket, [inputs], [expected])
        records = sorted(kept.iterdir(), key=lambda p: p.stat().st_mtime)
        for old in records[:max(0, len(records) - RECORDS)]:  # the oldest go
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        log.warning("bucket %s: load record not written (%s)", bucket.key, e)


def reread(builder: Builder, model: LoadedModel) -> None:
    """A model restored from its load record reads its archive (torch) for a bucket of new
    shapes: its split, and its program where each bucket is planned at its own shapes."""
    kept = family(model)
    if kept.split is not None:
        return
    if kept.owner is not None:  # a twin: its model's split, the logits cut to the last row
        from partitioner.split import last_rows

        reread(builder, kept.owner)
        split = family(kept.owner).split
        kept.split = last_rows(split) or split
        return
    from cuvild.intake.safe_load import load_exported_program
    from partitioner.split import split_program

    if not kept.replans and not builder.workers.threaded:  # its workers, which will build
        for device in model.parts_by_device:  # its buckets, read it meanwhile (processes)
            builder.workers.of(device).call(Preload(model.archive))
    ep = load_exported_program(model.archive)
    builder.counters["archive_loads"] += 1
    kept.split = split_program(ep, [(p.id, p.nodes) for p in model.plan.parts])
    kept.program = ep if kept.replans else None


def tag(shapes: Shapes) -> str:
    return "x".join("-".join(map(str, shape)) for shape in shapes)


def specs(model: LoadedModel, shapes: Shapes) -> list[dict[str, Any]]:
    return [{**s, "shape": list(shape)} for s, shape in zip(model.input_specs, shapes,
                                                             strict=True)]


def plan_for(builder: Builder, model: LoadedModel, shapes: Shapes) -> tuple[Any, Any, bool]:
    """A bucket's plan and split, and whether they are its own: a model the load planned
    is planned again at the bucket's shapes (a batch of 8 may be placed on another device
    than a request of 1); where that places every node as the model's plan does, the
    model's own are used (and its split shared in the workers)."""
    kept = family(model)
    if kept.program is None or len(builder.devices) < 2:
        return model.plan, kept.split, False
    from partitioner.plan import plan_model
    from partitioner.split import split_program

    policy = model.policy or PrecisionPolicy()
    plan = plan_model(kept.program, list(builder.devices.values()), objective=model.objective,
                      support=builder.support(), corrections=builder.corrections.snapshot(),
                      sizes=sizes_of(kept.program, kept.dims, shapes),
                      precision=policy.mode, int8=bool(policy.calibration))
    if placement(plan) == placement(model.plan):
        return model.plan, kept.split, False
    return plan, split_program(kept.program, [(p.id, p.nodes) for p in plan.parts]), True


def placement(plan: Any) -> dict[str, str]:
    return {node: part.device for part in plan.parts for node in part.nodes}


def sizes_of(program: Any, dynamic: list[tuple[int, int, int, int]],
             shapes: Shapes) -> dict[str, int]:
    """The size each symbol of the program's inputs has at `shapes` ("s0" -> 8)."""
    nodes = {n.name: n for n in program.graph.nodes}
    names = program.graph_signature.user_inputs
    sizes = {}
    for i, d, _, _ in dynamic:
        expr = nodes[names[i]].meta["val"].shape[d].node.expr
        if expr.is_Symbol:
            sizes[str(expr)] = shapes[i][d]
    return sizes
