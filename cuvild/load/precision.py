"""Precision under an error budget, and the end-to-end check of every served model.

A model is loaded with a precision policy: `fp32` (exact, the default, as ONNX Runtime and
Triton Inference Server do) or `auto` with an error budget (`max_error`). The error is one
metric everywhere (runtimes/base.py `set_error`): max |y - y_eager| / max |y_eager| of the
outputs against torch eager fp32, both maxima over all the inputs checked (the error against
the range the outputs take), the worst over the outputs; for classifier-shaped outputs the
top-1 agreement is reported beside it.

Under `auto` each part is built at its own precision and at the lower ones its device runs
fast (bf16 and fp16 where the profile measured them; int8, post-training quantized, only when
calibration inputs were given), each by every runtime that can. A part's own error is no
verdict on the model's (the demo's backbone measures 6e-2 in int8 on its features and 7e-3 on
the model's outputs: the head averages it down; errors may as well compound), so a lower
precision is kept for a part only as a sanity bound (`part_bound`: ten times the budget, at
least 5e-2), and the budget is held end to end: the whole model on every check input
(the calibration inputs, else a few random ones) against torch eager. The search lowers the
most expensive parts first, each to its fastest precision that keeps the whole model within
the budget, and backs a part off when the check fails. The decision is kept in the compile
cache; a restart builds only the chosen precisions, checks once, and searches again only if
that check fails.

Every static-shape model gets the end-to-end check at load, whatever its policy: it is what
`cuvilctl compare` and `cuvilctl status` report (eager vs the fp32 plan vs the chosen plan).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cuvild.core.errors import InferError
from cuvild.core.precision import Accuracy, Check, PrecisionPolicy
from partitioner.corrections import prior
from runtimes.base import (
    INT8_MIXED,
    MIX_DEFERRED,
    MIXED,
    set_error,
    top1_agreement,
    unusable,
    write_atomic,
)

if TYPE_CHECKING:
    import torch

    from cuvild.core.loaded import LoadedModel, Route
    from partitioner.plan import Part
    from partitioner.profile import DeviceProfile

log = logging.getLogger(__name__)
MODES = ("fp32", "auto")
LOWER = ("bf16", "fp16", "int8")  # the precisions a search may lower a part to, in this order
# engine.sequences.mixed_prompt (the daemon sets it; its workers inherit it): a language
# model's prompt chunks may run mixed, bf16 but for their sensitive groups (`mixed_prompt`;
# unset: on, as the setting's default)
MIXED_PROMPT_ENV = "CUVILD_MIXED_PROMPT"
# The least budget int8+fp32 is tried under: one int8 op is ~1/256 off, so below this nearly
# every op would go back to fp32 (NNCF's accuracy control spends a build per op it puts back).
INT8_MIXED_FLOOR = 1e-3
CHECK_INPUTS = 4  # random check inputs when no calibration inputs were given (and no
# budget: then build.SEARCH_SAMPLES)
COMPUTE_CLASSES = ("matmul", "conv", "attention")  # what a lower precision speeds up




def at(class_ms: dict[str, float], device: DeviceProfile, precision: str) -> dict[str, float]:
    """A part's roofline ms per class at a precision: compute classes at the device's
    measured peak for that dtype (unchanged where the profile has none)."""
    fp32, lower = device.peak_gflops.get("fp32"), device.peak_gflops.get(precision)
    if precision == "fp32" or not fp32 or not lower:
        return class_ms
    return {c: ms * fp32 / lower if c in COMPUTE_CLASSES else ms for c, ms in class_ms.items()}


def floors(part: Part, device: DeviceProfile, precisions: list[str]) -> dict[str, float]:
    """The part's roofline time on the device at each precision (the cost model's, before
    any correction learned from measurements): a build's search stops near it."""
    if not part.class_ms:
        return {}
    start = prior(device)
    return {p: sum(at(part.class_ms, device, p).values()) + start.call_ms
            + part.kernels * start.kernel_ms
            for p in precisions}


def part_bound(budget: float) -> float:
    """The error a lower precision may show on a part's own outputs and still be tried end to
    end: a bound against broken builds, not the budget."""
    return min(0.5, max(10 * budget, 0.05))


def mixed_prompt() -> bool:
    """Whether engine.sequences.mixed_prompt is on (`candidates`)."""
    return os.environ.get(MIXED_PROMPT_ENV, "1") == "1"


def host_mix(device: DeviceProfile) -> bool:
    """Whether a stateful part (a prompt chunk) on `device` may be mixed: with
    engine.sequences.mixed_prompt, on a device that runs on the host (a CPU, an emulated
    one). The mix's search runs the part in torch eager on the host, over a hundred runs of
    the chunk (runtimes/mixed.py): on the device's own cores for a CPU, but for a GPU's
    part, a model sized for the GPU run on the host's."""
    return mixed_prompt() and (device.kind == "cpu" or device.emulated)


def under_budget(policy: PrecisionPolicy, plan: Any) -> bool:
    """Whether a precision search may lower some part of `plan` (a budget: `auto`, for the
    whole model or a part's annotation)."""
    return policy.mode == "auto" or any(p.policy == "auto" for p in plan.parts)


def runtime_key(runtime: str, precision: str) -> str:
    """The name a (runtime, precision) pair is learned and priced under by the cost model."""
    return runtime if precision == "fp32" else f"{runtime}@{precision}"


def candidates(part: Part, device: DeviceProfile, policy: PrecisionPolicy,
               stateful: bool = False) -> tuple[list[str], float | None]:
    """[the part's own precision, then the lower ones a search may try], and its budget.
    A stateful model's part (a language model's step) also tries fp16 on a CPU with F16C
    whose matrix units lack it: a decode step reads every weight once a token, and halving
    their bytes is what makes it faster (runtimes/torch_eager.py). Its mix (bf16 but for
    the groups kept fp32, held on the cache it leaves too: runtimes/mixed.py `After`) on
    a device of the host's, unless engine.sequences.mixed_prompt is off (`host_mix`)."""
    auto = part.policy == "auto" or (part.policy == "" and policy.mode == "auto")
    if not auto or part.precision != "fp32":
        return [part.precision], None
    lower = [p for p in LOWER if (p in device.peak_gflops or (
        p == "fp16" and stateful and "f16c" in device.features)) and p != "int8"]
    # and the first of them with the fewest groups kept fp32 (runtimes/mixed.py): what a part
    # runs when one sensitive layer would send all of it back to fp32
    lower += [f"{p}{MIXED}" for p in lower[:1] if not stateful or host_mix(device)]
    budget = part.max_error or policy.max_error
    if policy.calibration:  # int8, then int8 but for the ops that cost the most error
        lower += ["int8"] + ([INT8_MIXED] if budget >= INT8_MIXED_FLOOR else [])
    return ["fp32", *lower], budget


def arm(model: LoadedModel, devices: dict[str, DeviceProfile], policy: PrecisionPolicy,
        decided: dict[str, str] | None = None) -> dict[str, float]:
    """Give each route the precisions to build (its own, then those a search may lower it
    to; only the `decided` one where a search chose before) and the bound a lower one's own
    error must keep; returns the budgets of the parts that are searched, by part id."""
    parts = {p.id: p for p in model.plan.parts}
    budgets: dict[str, float] = {}
    for route in model.routes:
        route.precisions, budget = candidates(parts[route.id], devices[route.device], policy,
                                              stateful=model.state is not None)
        route.search = list(route.precisions)
        if budget is not None:
            budgets[route.id], route.tolerance = budget, part_bound(budget)
            route.budget = budget
            if decided and route.id in decided:  # a restart builds only what was chosen
                route.precisions = [decided[route.id]]
    return budgets


def fix(choose: Choose, model: LoadedModel) -> None:
    """Each part at the precision it will run: the other variants' executables go from the
    workers, and a revived worker rebuilds only the chosen one."""
    for route in model.routes:
        if len(route.variants) > 1:
            choose(model, route, route.precision, True)
            route.variants = {route.precision: route.variants[route.precision]}
        route.precisions = [route.precision]


def check_inputs(model: LoadedModel, policy: PrecisionPolicy,
                 searched: bool = False) -> list[list[torch.Tensor]]:
    """The inputs the whole model is checked on: the calibration inputs, else random ones
    (more where a precision search holds a budget on them)."""
    from cuvild.workers.build import SEARCH_SAMPLES, calibration_inputs, sample_inputs

    if policy.calibration:
        return calibration_inputs(policy.calibration, model.input_specs)
    count = SEARCH_SAMPLES if searched else CHECK_INPUTS
    return [sample_inputs(model.input_specs, seed) for seed in range(count)]


def reference(ep: Any, inputs: list[list[torch.Tensor]]) -> tuple[list[list[torch.Tensor]],
                                                                  float]:
    """torch eager fp32's outputs for each input, and its median time, in this process."""
    import torch

    from cuvild.workers.build import eager

    module = eager(ep)
    outputs, times = [], []
    with torch.no_grad():
        module(*inputs[0])
        for x in inputs:
            t0 = time.perf_counter()
            outputs.append(module(*x))
            times.append((time.perf_counter() - t0) * 1e3)
    return outputs, statistics.median(times)


Run = Callable[["LoadedModel", list[Any]], list[Any]]  # the runner's run: outputs of inputs
Choose = Callable[..., None]  # the builder's choose: (model, route, precision[, final])


def check(run: Run, model: LoadedModel, inputs: list[list[torch.Tensor]],
          expected: list[list[torch.Tensor]]) -> Check:
    """The plan as it is served now (`run`), on every check input."""
    import torch

    shares, times = [], []
    for x, want in zip(inputs, expected, strict=True):
        t0 = time.perf_counter()
        got = run(model, x)
        times.append((time.perf_counter() - t0) * 1e3)
        shares.append((got, want))
    top1 = None
    if shares:  # over all inputs at once: one row per input and output
        outs = [torch.cat([g[i] for g, _ in shares]) for i in range(len(shares[0][0]))]
        refs = [torch.cat([w[i] for _, w in shares]) for i in range(len(shares[0][1]))]
        top1 = top1_agreement(outs, refs)
    error = set_error([g for g, _ in shares], [w for _, w in shares])
    return Check(error, top1, statistics.median(times))


def refuse_unusable(run: Run, model: LoadedModel, inputs: list[list[torch.Tensor]],
                    expected: list[list[torch.Tensor]], first: Check) -> None:
    """Raise InferError where the plan at every part's own precision is unusable against
    torch eager on the check inputs (inf or NaN where eager's outputs are finite, another
    shape or dtype): no precision brings it back, and serving it would answer wrongly
    without a word. Each part passed its own build's check on fewer inputs (the worker's
    one or two samples), so this names the input and the parts, and what to change."""
    if first.error != float("inf"):
        return
    why, seen = "returned inf or NaN unlike torch eager's", "the check inputs"
    for i, (x, want) in enumerate(zip(inputs, expected, strict=True)):
        got = run(model, x)
        if set_error([got], [want]) == float("inf"):
            with contextlib.suppress(Exception):  # (an output that is no tensor: said plainly)
                why = unusable([g for g in got if g is not None],
                               [w for w in want if w is not None])
            seen = f"check input {i} of {len(inputs)}"
            break
    parts = ", ".join(f"{r.id} on {r.device} ({r.runtime}, {r.precision})" for r in model.routes)
    raise InferError(f"refused: as built, the model {why}, on {seen} ({parts}); nothing is "
                     "served. engine.runtimes can leave that runtime out for its device")


def search(run: Run, choose: Choose, model: LoadedModel, budgets: dict[str, float],  # noqa: PLR0913
           inputs: list[list[torch.Tensor]], expected: list[list[torch.Tensor]],
           start: Check, more: Callable[[Route, list[str]], None] | None = None,
           ) -> tuple[Check, list[str]]:
    """Lower the most expensive parts first, each to its fastest precision that keeps the
    whole model within its budget; returns the final check and what happened, as notes.
    Where every faster variant of a part is refused and its build left a mix for later
    (MIX_DEFERRED: its low precision alone held the part), `more(route, mixes)` builds it,
    and it is tried too."""
    notes: list[str] = []
    now = start
    routes = sorted((r for r in model.routes if r.id in budgets),
                    key=lambda r: -r.variants[r.precision].median_ms)
    for route in routes:
        budget, own, tried = budgets[route.id], route.precision, set()
        while True:
            here = route.variants[own]
            faster = sorted((v for p, v in route.variants.items()
                             if p != own and p not in tried and v.median_ms < here.median_ms),
                            key=lambda v: v.median_ms)
            if not faster and not tried:
                notes.append(f"{route.id} stays {own}: no lower precision ran faster within "
                             f"{budget:.0e} on {route.device}{_why_not(route)}")
            trial = _lowered(run, choose, model, route, faster, inputs, expected, budget,
                             notes, tried)
            if trial is not None:
                now = trial
                break
            mixes = _deferred(route)
            if more is None or not mixes:
                break
            log.info("model %s: %s: building the mixes it left for later (%s)", model.key,
                     route.id, ", ".join(mixes))
            more(route, mixes)
    return now, notes


def _lowered(run: Run, choose: Choose, model: LoadedModel, route: Route, faster: list[Any],
             inputs: list[list[torch.Tensor]], expected: list[list[torch.Tensor]],
             budget: float, notes: list[str], tried: set[str]) -> Check | None:
    """The first of `faster` (the route's variants, fastest first) that keeps the model
    within `budget`, chosen (its check returned); each refused one backed off."""
    own = route.precision
    here = route.variants[own]
    for variant in faster:
        tried.add(variant.precision)
        choose(model, route, variant.precision)
        trial = check(run, model, inputs, expected)
        if trial.error <= budget:
            notes.append(f"{route.id} runs {variant.precision} on {variant.runtime}: "
                         f"{variant.median_ms:.2f} ms vs {here.median_ms:.2f} ms at {own}, "
                         f"end-to-end error {trial.error:.1e} <= {budget:.0e}"
                         + _kept(route, variant.precision))
            return trial
        notes.append(f"{route.id} {variant.precision} refused: end-to-end error "
                     f"{trial.error:.1e} > {budget:.0e}")
        choose(model, route, own)  # backed off
    return None


def _deferred(route: Route) -> list[str]:
    """The mixes the route's build left for later and has not built since."""
    candidates = route.built.candidates if route.built else []
    return [c["precision"] for c in candidates if c["status"] == "skipped"
            and c["reason"].startswith(MIX_DEFERRED) and c["precision"] not in route.variants]


def _kept(route: Route, precision: str) -> str:
    """For a mixed precision, which groups stayed fp32 and why (its build's own words)."""
    if not precision.endswith(MIXED) or route.built is None:
        return ""
    said = [c["reason"] for c in route.built.candidates
            if c["precision"] == precision and c["status"] == "ok" and c["reason"]]
    return f" ({said[0]})" if said else ""


def _why_not(route: Route) -> str:
    """The lower precisions a part tried, and why each was not kept: slower than its own
    precision, over the part's sanity bound, or failing to build."""
    candidates = route.built.candidates if route.built else []
    own = route.variants.get(route.precision)
    tried, slow = [], set()  # (lower precisions said to be no faster)
    for p in dict.fromkeys(c["precision"] for c in candidates):
        if p == route.precision:
            continue
        if p in route.variants and own is not None:
            # both figures, to the digit that tells them apart, and the clock they come from
            # (the runtime call alone at build; `cuvilctl partition` MEASURED is the part as
            # served, hop and arena included)
            v = route.variants[p]
            slow.add(p)
            tried.append(f"{p} ran {v.median_ms:.3g} ms on {v.runtime} vs {own.median_ms:.3g} "
                         f"ms at {route.precision} on {own.runtime}, not faster (runtime call "
                         "alone, median at build)")
            continue
        cands = [c for c in candidates if c["precision"] == p]
        inaccurate = [c for c in cands if c["status"] == "inaccurate"]
        slower = [c for c in cands if c["status"] == "skipped"
                  and "its error not measured" in (c.get("reason") or "")]
        if slower and own is not None:  # (runtimes/select.py SLOWER)
            c = min(slower, key=lambda c: c["median_ms"])
            slow.add(p)
            tried.append(f"{p} ran {c['median_ms']:.3g} ms on {c['runtime']} vs "
                         f"{own.median_ms:.3g} ms at {route.precision} on {own.runtime}, not "
                         "faster (a run at build; its error not measured)")
        elif inaccurate:
            best = min(inaccurate, key=lambda c: c["rel_error"])
            tried.append(f"{p} error {best['rel_error']:.1e} on {best['runtime']}")
        elif all(c["status"] == "skipped" for c in cands):  # not tried, on purpose
            reason = (cands[0].get("reason") or "").removeprefix("not built: ")
            low = p.removesuffix(MIXED)
            if low in slow and reason.startswith(f"{low} alone ran"):  # (said just before)
                reason = f"{low} alone was no faster"
            tried.append(f"{p} not tried: {reason}" if reason else f"{p} not tried")
        else:
            failed = ", ".join(f"{c['runtime']} {c['status']}" for c in cands
                               if c["status"] != "skipped")
            tried.append(f"{p} did not build ({failed})")
    return f" ({'; '.join(tried)})" if tried else ""


# ---- the decision, kept in the compile cache --------------------------------------------

def decision_path(cache_dir: Path, model: LoadedModel, policy: PrecisionPolicy,
                  devices: Sequence[DeviceProfile]) -> Path:
    """Where the precision search of this model (or bucket), plan, policy and devices is
    recorded."""
    what = {"archive": Path(model.archive).name, "parts": [(p.id, p.device, p.nodes) for p in
                                                           model.plan.parts],
            "policy": asdict(policy) | {"calibration": ""},
            "devices": sorted((d.id, d.name, tuple(sorted(d.features))) for d in devices)}
    if model.state is not None and mixed_prompt():  # (its chunks' candidates differ)
        what["mixed_prompt"] = True
    if model.bucket is not None:  # a dynamic model's bucket searches at its own shapes
        what["shapes"] = [list(shape) for shape in model.bucket.shapes]
        if "@" in model.bucket.of:  # a twin's (its program computes less)
            what["of"] = model.bucket.of.partition("@")[2]
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir / "choices" / f"precision-{key}.json"


def read_decision(path: Path) -> tuple[dict[str, str] | None, dict[str, Any] | None]:
    """The recorded precision per part and the accuracy measured then; (None, None) when
    there is no record or it does not read (then the search runs again)."""
    try:
        data = json.loads(path.read_text())
        parts = {str(k): str(v) for k, v in data["parts"].items()}
        Accuracy.from_dict(data["accuracy"])
        return parts, data["accuracy"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, None


def write_decision(path: Path, routes: list[Route], accuracy: Accuracy,
                   parts: dict[str, str] | None = None) -> None:
    """Record the precision each part runs at (`parts`, else each route's own)."""
    chosen = parts if parts is not None else {r.id: r.precision for r in routes}
    write_atomic(path, json.dumps({"parts": chosen, "accuracy": accuracy.to_dict()},
                                  indent=1).encode())


def runtime_notes(routes: Sequence[Any]) -> list[str]:
    """The plan's word on each part whose first choice of runtime could not run it: which
    runtimes failed there and why, and the one it runs on instead (a model OpenVINO's CPU
    plugin refuses, say an EfficientNet's oversized AvgPool, served on ONNX Runtime); and on
    how each GPU part's kernels are launched (as a CUDA graph, or kernel by kernel and why)."""
    notes = []
    for route in routes:
        built = getattr(route, "built", None)
        failed = [c for c in getattr(built, "candidates", None) or []
                  if c.get("status") in ("failed", "timeout", "unavailable")
                  and c.get("runtime") != route.runtime]
        if failed:
            why = "; ".join(f"{c['runtime']} {c['status']}: "
                            f"{' '.join(str(c.get('reason', '')).split())[:200]}" for c in failed)
            notes.append(f"{route.id} on {route.device} runs on {route.runtime}: {why}")
        graph = getattr(built, "graph", "")
        if graph:  # a GPU part: as one CUDA graph, or kernel by kernel and why
            notes.append(f"{route.id} on {route.device} runs as a {graph}" if
                         graph.startswith("cuda graph") else
                         f"{route.id} on {route.device} runs {graph}")
    return notes


def record_runs(plan: Any, routes: Sequence[Any], corrections: Any,
                devices: dict[str, DeviceProfile]) -> None:
    """The plan records what each part really runs on (runtime, precision, error) and its
    time there, with what was learned (partitioner/corrections.py)."""
    for part in plan.parts:
        route = next((r for r in routes if r.id == part.id), None)
        if route is not None:
            variant = route.variants.get(route.precision)
            part.runtime, part.precision = route.runtime, route.precision
            part.error = variant.rel_error if variant else None
            if part.class_ms:
                device = devices[part.device]
                part.predicted_ms = corrections.price(
                    part.device, runtime_key(part.runtime, part.precision),
                    at(part.class_ms, device, part.precision), part.kernels, prior(device))
