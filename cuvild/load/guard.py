"""Never worse than the best single device, by measurement (the GPU issue, item 2).

A plan that splits a model across devices on its own (no annotation names a device) and is
predicted less than GAIN faster than the best single device may be the cost model's mistake:
a mispriced profile, a link dearer than measured, hand-offs the roofline does not see. So the
load builds the best single device's plan too (`single_plan`: the model planned on each device
alone, the fastest predicted), times both end to end in turn on the check inputs (`timed`),
and serves the faster; the plan's notes say which, with both figures. A split predicted at
least GAIN faster is served without the second build (the note says so).

The same holds for what the cost model learned (the GPU issue, item 1): where the corrections
learned from measured parts move a model's heaviest part (the most GFLOPs) to another device
than the profile alone would put it on (`moved_by_lessons`), both plans are built and timed
before the model is served on the learned one: a lesson from one model must not send the next
to a device that measures slower (on the lent H200, a learned GPU overhead put a bf16
ResNet-18 on the CPU: 22.7 ms there against 1.8 ms on the GPU).

A language model (it keeps state; a dynamic length) is planned for a whole generation, a
prompt's chunks and then the decode steps (partitioner/phases.py), and compared so (`cost`);
its buckets are built at its warm-up, so its two plans are timed there, on a generation of
each (cuvild/load/warmup.py `guarded`), not on the check inputs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from partitioner.costgraph import ANNOTATION_KEY

if TYPE_CHECKING:
    from cuvild.core.loaded import LoadedModel
    from partitioner.plan import Plan
    from partitioner.profile import DeviceProfile

GAIN = 1.5  # a split predicted at least this much faster than one device is not timed
ROUNDS = 5  # rounds of timing, each model in turn on every check input


def annotated(program: Any) -> bool:
    """Whether any node of the program carries an annotation that names a device."""
    return any(((n.meta.get("custom") or {}).get(ANNOTATION_KEY) or {}).get("device")
               for n in program.graph.nodes)


def single_plan(program: Any, devices: Sequence[DeviceProfile],
                plan: Callable[[Any, list[DeviceProfile]], Plan]) -> Plan | None:
    """The best single device's plan (`plan(program, [device])` on each), None if none can
    run the whole model."""
    best = None
    for device in devices:
        try:
            alone = plan(program, [device])
        except Exception:  # noqa: BLE001 - that device cannot run the whole model
            continue
        if best is None or cost(alone) < cost(best):
            best = alone
    return best


def cost(plan: Plan) -> float:
    """What a plan is predicted to take: a request, or a whole generation where it was
    priced for one (a stateful model's: its parts are priced per decode step)."""
    return plan.phases["plan"]["total_ms"] if plan.phases else plan.predicted_ms


def worth_timing(split: Plan, single: Plan | None) -> bool:
    """A split predicted less than GAIN faster than the best single device."""
    return (single is not None and len({p.device for p in split.parts}) > 1
            and cost(single) < GAIN * cost(split))


def heaviest(plan: Plan) -> str:
    """The device of the plan's part with the most work."""
    return max(plan.parts, key=lambda p: (p.gflops, p.predicted_ms)).device


def moved_by_lessons(learned: Plan, unlearned: Plan) -> bool:
    """The corrections moved the model's heaviest part to another device."""
    return heaviest(learned) != heaviest(unlearned)


def timed(run: Callable[[LoadedModel, list[Any]], Any], first: LoadedModel,
          second: LoadedModel, inputs: list[list[Any]]) -> tuple[float, float]:
    """Median ms of a request of each model, timed in turn on every check input."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(ROUNDS):
        for model, kept in zip((first, second), times, strict=True):
            for x in inputs:
                t0 = time.perf_counter()
                run(model, x)
                kept.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


LABEL = "never worse than one device"  # what the guard's notes in a plan start with


def note(ours_ms: float, theirs_ms: float, ours: str, theirs: str, kept_ours: bool,
         what: str = "end to end") -> str:
    """e.g. 'never worse than one device: measured end to end 6.300 ms split vs 0.540 ms all
    on npu0; serving all on npu0 (11.67x)'."""
    kept, ratio = (ours, theirs_ms / ours_ms) if kept_ours else (theirs, ours_ms / theirs_ms)
    return (f"{LABEL}: measured {what} {ours_ms:.3f} ms {ours} vs {theirs_ms:.3f} ms "
            f"{theirs}; serving {kept} ({ratio:.2f}x)")


def failed(ours: str, theirs: str, e: BaseException) -> str:
    """The plan's note where the one to time it against did not build or run."""
    return (f"{LABEL}: the plan {theirs} did not build or run ({type(e).__name__}: {e}); "
            f"serving the one {ours}")
