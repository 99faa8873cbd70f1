"""Fragments: parts too small to pay for their own launch and copies.

A part is below break-even when its work is less than its device's launch overhead plus the
copies between it and other parts. Such a part moves onto a neighbour's device unless the
whole plan then gets more than FRAGMENT_TOLERANCE slower than before any merge (the merges
together cost at most that much): a fragment that pays for itself in the plan (it saves
copying a graph output back, or runs beside a longer branch) stays, and a note says what
merging it would cost.
"""

from __future__ import annotations

import math

from partitioner.cost import CostModel
from partitioner.heuristic import EPS, common_allowed
from partitioner.schedule import HOST, Schedule, objective, simulate

BATCH_ABOVE = 3000  # nodes: above, all fragments of a round merge at once, one simulate per round
# A fragment is one more compile unit, worker hop and copy: worth merging even when the model
# predicts the plan gets this much slower (a fraction of the plan's value).
FRAGMENT_TOLERANCE = 0.01


def fragments(model: CostModel, schedule: Schedule) -> list[int]:
    """Parts below break-even: their work is less than their launch plus their cuts to parts."""
    cut_ms = [0.0] * len(schedule.parts)
    for c in schedule.cuts:
        if HOST not in (c.src, c.dst):
            cut_ms[c.src] += c.ms
            cut_ms[c.dst] += c.ms
    found = []
    for p, part in enumerate(schedule.parts):
        launch = model.call_ms[part.device]
        if cut_ms[p] > 0 and part.compute_ms - launch < launch + cut_ms[p]:
            found.append(p)
    return found


def merge_fragments(
    model: CostModel, assign: list[int], max_rounds: int = 50
) -> tuple[list[int], list[str]]:
    """Merge parts below break-even into a neighbour's device (see the module docstring)."""
    assign = list(assign)
    notes: list[str] = []
    settled: set[tuple[int, ...]] = set()
    batch = model.n > BATCH_ABOVE
    schedule = simulate(model, assign)
    limit = schedule.value * (1 + FRAGMENT_TOLERANCE) + EPS  # for all the merges together
    for _ in range(max_rounds):
        todo = [p for p in fragments(model, schedule)
                if tuple(schedule.parts[p].nodes) not in settled]
        if not todo:
            break
        todo.sort(key=lambda p: schedule.parts[p].compute_ms)
        trial = list(assign)
        for p in todo if batch else todo[:1]:
            part = schedule.parts[p]
            target, value = _merge_target(model, schedule, p, assign, batch)
            settled.add(tuple(part.nodes))
            what = f"{len(part.nodes)} node(s) ({model.graph.describe(part.nodes)})"
            here = model.devices[part.device].id
            if target is None:
                notes.append(f"fragment of {what} stays on {here}: no neighbour may run it")
                continue
            if not batch and value > limit:
                notes.append(
                    f"fragment of {what} stays on {here} below break-even: merging it into "
                    f"{model.devices[target].id} makes the plan {value - schedule.value:.4f} ms "
                    "slower (it saves copies elsewhere or runs beside a longer branch)"
                )
                continue
            for v in part.nodes:
                trial[v] = target
            change = "" if batch else f" ({value - schedule.value:+.4f} ms)"
            notes.append(f"merged fragment of {what} from {here} into "
                         f"{model.devices[target].id}{change}")
        merged = simulate(model, trial)
        if merged.value <= limit:
            assign, schedule = trial, merged
        elif batch:
            notes.append("merging the remaining fragments would make the plan slower: kept")
            break
    return assign, notes


def _merge_target(model, schedule, p, assign, batch) -> tuple[int | None, float]:
    """The neighbour device to merge part p into, and the plan's value after the merge."""
    part = schedule.parts[p]
    weight: dict[int, float] = {}
    for c in schedule.cuts:
        if HOST in (c.src, c.dst) or p not in (c.src, c.dst):
            continue
        other = schedule.parts[c.dst if c.src == p else c.src].device
        if other != part.device:
            weight[other] = weight.get(other, 0.0) + c.ms
    allowed = set(common_allowed(model, part.nodes))
    options = [d for d in weight if d in allowed]
    if not options:
        return None, math.inf
    if batch:
        return max(options, key=weight.__getitem__), math.inf
    best, best_value = None, math.inf
    for d in options:
        trial = list(assign)
        for v in part.nodes:
            trial[v] = d
        value = objective(model, trial)
        if value < best_value:
            best, best_value = d, value
    return best, best_value
