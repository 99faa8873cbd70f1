"""A dynamic-shape model's buckets: the model laid out and built for one concrete input shape,
on that shape's first request, and kept for the next. A model the engine planned is planned
again per bucket, at the bucket's sizes (`plan_for`): a large batch may run on another device
than a single request.

Bounded both ways. A dynamic dimension above the engine's `max_dim` is refused (BadInput)
before anything is built for it. A model keeps at most `max_buckets` buckets: when a build
makes one more, the least recently used buckets that no request is running go (unloaded from
the workers), and one asked for again is simply built again (from the compile cache). A bucket
in use is never evicted: `hold` counts a request in, and rebuilds a bucket evicted between
`resolve` and `run`.

Sizes are not rounded up to fewer buckets: that would pad a request's batch, and padding
changes the results of models that mix rows (attention or normalisation across the batch),
so each size gets its own bucket.

Only a build takes the model's own lock (and, then, evicts: builds and evictions of a model
reach the workers in order); buckets already built are served under a short lock that only
keeps the recency order and the use counts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from cuvild.engine.errors import InferError, RunTimeout
from cuvild.engine.layout import BadInput, input_table, layout
from cuvild.engine.loaded import LoadedModel, cut_bytes

Engine = Any  # cuvild/engine/engine.py, which imports this module
log = logging.getLogger(__name__)
Shapes = tuple[tuple[int, ...], ...]


def check_dims(model: LoadedModel, given: Sequence[tuple[str, tuple[int, ...]]],
               max_dim: int) -> None:
    """Refuse a dynamic dimension above `max_dim` (BadInput names the input, the dimension
    and the limit)."""
    for i, d, _, _ in model.dynamic:
        size = given[i][1][d]
        if size > max_dim:
            raise BadInput(f"input {model.table[i].name}: dim {d} is {size}, above the "
                           f"largest this server builds for a dynamic dimension ({max_dim})")


def bucket(engine: Engine, model: LoadedModel, shapes: Shapes,
           deadline: float | None = None) -> LoadedModel:
    """The bucket of `model` for `shapes`, built on first use (waited for by `deadline`,
    time.monotonic(); None: the engine's build_timeout_s)."""
    with engine._buckets_lock:
        variant = model.variants.get(shapes)
        if variant is not None:
            model.variants.move_to_end(shapes)
            return variant
    return build(engine, model, shapes, deadline)


def hold(engine: Engine, model: LoadedModel, deadline: float | None) -> LoadedModel:
    """Count a request in on its bucket, so that it is not evicted while the request runs;
    a bucket evicted since `resolve` is built again. A model that is no bucket is itself."""
    while model.base_key:
        with engine._buckets_lock:
            if not model.evicted:
                model.users += 1
                return model
        base = engine.models.get(model.base_key)
        if base is None:
            raise InferError(f"model {model.base_key} is not loaded any more")
        model = bucket(engine, base, model.shapes, deadline)
    return model


def release(engine: Engine, model: LoadedModel) -> None:
    if model.base_key:
        with engine._buckets_lock:
            model.users -= 1


def build(engine: Engine, model: LoadedModel, shapes: Shapes,
          deadline: float | None) -> LoadedModel:
    import torch

    assert model.split is not None
    t0 = time.monotonic()
    if not model.variant_lock.acquire(
            timeout=-1 if deadline is None else max(0.0, deadline - t0)):
        raise RunTimeout(f"model {model.key}: waited {time.monotonic() - t0:.1f} s for "
                         "another bucket's build (the request's deadline)")
    try:
        with engine._buckets_lock:
            variant = model.variants.get(shapes)
        if variant is not None:
            return variant
        plan, split, own = plan_for(engine, model, shapes)
        dtypes = [getattr(torch, s.dtype) for s in model.table]
        with torch.no_grad():
            values = split.trace(*[torch.zeros(shape, dtype=dt)
                                   for shape, dt in zip(shapes, dtypes, strict=True)])
        slots, footprint, total = layout(values, split)
        tag = "x".join("-".join(map(str, shape)) for shape in shapes)
        specs = [{**s, "shape": list(shape)}
                 for s, shape in zip(model.input_specs, shapes, strict=True)]
        routes = engine._routes(plan, split)
        by_device: dict[str, list[str]] = {}
        for route in routes:
            by_device.setdefault(route.device, []).append(route.id)
        variant = LoadedModel(f"{model.key}@{tag}", model.name, model.version, plan, routes,
                              model.inputs, model.outputs, input_table(specs, []), slots,
                              footprint, total, model.archive, specs,
                              parts_by_device=by_device, base_key=model.key, shapes=shapes,
                              own_split=own)
        variant.policy, variant.batcher = model.policy, model.batcher
        variant.cut_bytes = cut_bytes(variant)
        variant.part_input_shapes = {
            p.id: [list(values[n].shape) for n in p.inputs] for p in split.parts}
        log.info("building %s for input shapes %s%s", model.key, [list(s) for s in shapes],
                 ": " + ", ".join(f"{r.id}@{r.device}" for r in routes) if own else "")
        engine._build(variant, deadline=deadline)
        with engine._buckets_lock:
            model.variants[shapes] = variant
            engine.models[variant.key] = variant
        evict(engine, model)
        return variant
    finally:
        model.variant_lock.release()


def plan_for(engine: Engine, model: LoadedModel, shapes: Shapes) -> tuple[Any, Any, bool]:
    """A bucket's plan and split, and whether they are its own: a model the engine planned
    is planned again at the bucket's shapes (a batch of 8 may be placed on another device
    than a request of 1); where that places every node as the model's plan does, the
    model's own are used (and its split shared in the workers)."""
    if model.program is None or len(engine.devices) < 2:
        return model.plan, model.split, False
    from partitioner.plan import plan_model
    from partitioner.split import split_program

    plan = plan_model(model.program, list(engine.devices.values()), objective=model.objective,
                      support=engine.support(), corrections=engine.corrections.snapshot(),
                      sizes=sizes_of(model.program, model.dynamic, shapes))
    if placement(plan) == placement(model.plan):
        return model.plan, model.split, False
    return plan, split_program(model.program, [(p.id, p.nodes) for p in plan.parts]), True


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


def evict(engine: Engine, model: LoadedModel) -> None:
    """Unload the least recently used buckets past `max_buckets` that no request is running
    (under the model's build lock, so an eviction reaches the workers before a rebuild)."""
    gone = []
    with engine._buckets_lock:
        over = len(model.variants) - engine.max_buckets
        for shapes, variant in list(model.variants.items()):
            if over <= 0:
                break
            if variant.users == 0:
                del model.variants[shapes]
                variant.evicted = True
                gone.append(variant)
                over -= 1
    for variant in gone:
        log.info("bucket %s evicted (a model keeps %d)", variant.key, engine.max_buckets)
        engine.unload(variant.key)
