"""Inside a device worker: turn (stored archive, plan, part id) into a compiled part, at each
precision asked for.

The worker reads the model from the registry with the safe loader, cuts it along the plan
exactly as the daemon did (the split is deterministic), and builds its part through the
compile cache. Sample data for the numerics check (one random sample, two where the second
pads a row; under an error budget, those of the end-to-end check; or every calibration
sample the user gave) is made only when something compiles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from cuvild.core.loaded import LAST
from partitioner.profile import DeviceProfile
from partitioner.split import SplitProgram, last_rows, split_program
from protos.orders import Build, Variant
from runtimes.base import INT8_MIXED, MIX_DEFERRED, MIXED, CompileError
from runtimes.cache import CompileCache
from runtimes.select import BuiltPart, Candidate, build_part, placeholder_tensors, time_in_turn
from runtimes.torch_eager import decode_step, remember_initial, reset, state_of

# model key -> (what it was split from: archive and plan, its split), while its parts are
# being built. The plan is part of it: a model planned again under its key (a build that
# failed, fallback.py), or loaded again in this process (thread workers outlive an engine),
# must not get the split of its last plan.
_splits: dict[str, tuple[tuple[Any, ...], SplitProgram]] = {}
# archive -> its program, read ahead of the Build that splits it (`preload`); the last PRELOADS
_programs: dict[str, Any] = {}
PRELOADS = 2


# A part searched under a budget is measured on the random inputs the model is then checked
# on end to end (precision.check_inputs: the same seeds). A model's error varies up to 10x
# from one input to the next (bf16 Swin-T: median 7.8e-3, worst of 32 2.5e-2; checked on 4
# inputs at 9.2e-3, it read 3.8e-2 on 4 others), so they are many, and a mixed part aims at
# MIX_SHARE of the budget on all of them (the rest is room for inputs it never saw).
SEARCH_SAMPLES = 16
MIX_SHARE = 0.8
# int8+fp32 is held by NNCF's accuracy control on half the calibration inputs (it calibrates
# on the other half): fewer, and a user's, so it keeps more room.
INT8_MIX_SHARE = 0.5


def sample_inputs(specs: list[dict[str, Any]], seed: int = 0) -> list[torch.Tensor]:
    """Deterministic sample inputs from the model's input specs. An integer input that
    indexes an embedding (intake found its table's rows: spec["high"]) gets random ids below
    that; other integer and bool inputs are ones: indices of unknown range, which random
    values would push out of it, or masks, where zeros mask everything out. But for a
    transformer's `attention_mask` of two rows or more, on odd seeds: its last row is
    left-padded (its first half 0), as a decoder's batch is, so that a check sees the
    queries that attend no key (zeros in torch; OpenVINO gave NaN, which spread to every
    row: runtimes/masks.py)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for spec in specs:
        dtype = getattr(torch, spec["dtype"])
        shape = [d if d >= 0 else 1 for d in spec["shape"]]
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(dtype))
        elif spec.get("high"):
            out.append(torch.randint(0, spec["high"], shape, generator=gen, dtype=dtype))
        else:
            ones = torch.ones(shape, dtype=dtype)
            if seed % 2 and padded(spec):
                ones[-1, :shape[1] // 2] = 0
            out.append(ones)
    return out


def padded(spec: dict[str, Any]) -> bool:
    """Whether `sample_inputs` pads this input's last row on odd seeds."""
    shape = [d if d >= 0 else 1 for d in spec["shape"]]
    return spec.get("name") == "attention_mask" and len(shape) == 2 and min(shape) > 1


def calibration_inputs(path: str, specs: list[dict[str, Any]]) -> list[list[torch.Tensor]]:
    """The model's inputs for each calibration sample: one array per input name in the .npz,
    samples along the first axis (checked at upload: cuvild/intake/registry.py)."""
    with np.load(path, allow_pickle=False) as data:
        arrays = [data[spec["name"]] for spec in specs]
    return [[torch.from_numpy(np.ascontiguousarray(a[i])) for a in arrays]
            for i in range(len(arrays[0]))]


def load_split(model: str, archive: str, parts: list[tuple[str, list[str]]]) -> SplitProgram:
    made_of = (archive, tuple((pid, tuple(nodes)) for pid, nodes in parts))
    kept = _splits.get(model)
    if kept is not None and kept[0] == made_of:
        return kept[1]
    base, _, variant = model.partition("@")
    if variant == LAST:  # a generation twin: logits at the last position
        whole = load_split(base, archive, parts)
        split = last_rows(whole) or whole
    else:
        from cuvild.intake.safe_load import load_exported_program

        ep = _programs.pop(archive, None)
        ep = load_exported_program(archive) if ep is None else ep
        split = split_program(ep, parts)
        for p in split.parts:  # a stateful part's state before any run (its sequences')
            remember_initial(p.module)
    _splits[model] = (made_of, split)
    return split


def preload(archive: str) -> None:
    """Read `archive` (the safe loader) for the Build that splits it next. The daemon asks
    where it reads the archive itself before it sends the Builds (a restored language model's
    first bucket): the 200M Llama's 800 MB read in ~3.7 s each, one after the other until
    now. Kept until that Build takes it, the last PRELOADS only."""
    from cuvild.intake.safe_load import load_exported_program

    if archive in _programs:
        return
    _programs[archive] = load_exported_program(archive)
    while len(_programs) > PRELOADS:
        _programs.pop(next(iter(_programs)))


def forget(model: str) -> None:
    _splits.pop(model, None)


def build_model_part(order: Build, device: DeviceProfile, cache: CompileCache,
                     told: Callable[[str], None] | None = None,
                     ) -> tuple[dict[str, BuiltPart], list[dict[str, Any]]]:
    """The part built at each precision of the order that some runtime runs within its
    tolerance (the first precision must build: CompileError otherwise), and every candidate
    tried at every precision, for the reports."""
    split = load_split(order.split_key, order.archive, order.assignment)
    part = next(p for p in split.parts if p.id == order.part)
    made: list[tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]] = []
    # At its own precision alone, a part is checked on one sample, and on seed 1's too where
    # that one holds a padded row (`padded`): a build that gives NaN there fails, and another
    # runtime is taken. Not for a model that keeps state (a language model's cache): a part's
    # inputs read from that state are the state itself, which the next sample changes.
    own = 2 if (any(padded(s) for s in order.input_specs)
                and not any(state_of(p.module) for p in split.parts)) else 1

    def samples() -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        if not made:
            models = (calibration_inputs(order.calibration, order.input_specs)
                      if order.calibration else
                      [sample_inputs(order.input_specs, seed)
                       for seed in range(SEARCH_SAMPLES if order.budget else own)])
            inputs, outputs = [], []
            # no_grad, not inference_mode: runtimes re-export the part with these tensors.
            with torch.no_grad():
                for model_inputs in models:
                    for p in split.parts:  # each sample on a fresh state (stateful parts)
                        reset(p.module)
                    values = split.trace(*model_inputs)
                    inputs.append([values[n] for n in part.inputs])
                    outputs.append([values[n] for n in part.outputs])
            made.append((inputs, outputs))
        return made[0]

    built: dict[str, BuiltPart] = {}
    tried: list[dict[str, Any]] = []
    # (a decode step is never mixed, runtimes/select.py: no mix of its is left for later)
    decode = any(p.endswith(MIXED) for p in order.precisions) and bool(
        state_of(part.module)) and decode_step(
        part.module, placeholder_tensors(part.module, order.input_shapes))
    # (a part that gives the model's outputs: its own error is what the check reads there)
    final = any(name in split.outputs for name in part.outputs)
    for i, precision in enumerate(order.precisions):
        needless = _needless_mix(precision, built, order, tried, decode, final)
        if needless:  # its plain low precision holds already: a mix could only be slower
            tried.append(asdict(Candidate("mixed", "skipped", needless, precision=precision)))
            continue
        try:
            built[precision] = b = build_part(
                part.module, device, precision, samples, cache, timeout_s=order.timeout_s,
                input_shapes=order.input_shapes,
                # fp32 always at its own tolerance; a lower precision of a search within
                # the budget, also when a restart builds only the one chosen
                tolerance=None if precision == "fp32" else order.tolerance,
                cache_tag=order.calibration_tag if precision in ("int8", INT8_MIXED) else "",
                mix_target=order.budget * (INT8_MIX_SHARE if precision == INT8_MIXED
                                           else MIX_SHARE) if order.budget else None,
                allowed=order.allowed, floor_ms=(order.floor_ms or {}).get(precision),
                progress=told and (lambda name, p=precision: told(f"trying {name} at {p}")),
                slower_than=_own_time(built, order.precisions[0]) if order.budget else None)
            tried += [asdict(c) for c in b.candidates]
        except CompileError as e:
            if i == 0:
                raise
            tried += [asdict(c) for c in getattr(e, "candidates", [])]
    if order.budget and len(built) > 1:
        retime(built, tried, samples()[0][0])
    return built, tried


def retime(built: dict[str, BuiltPart], tried: list[dict[str, Any]],
           inputs: list[torch.Tensor]) -> None:
    """The precisions built for a search timed again, in turn (runtimes/select.py
    time_in_turn), their medians kept for the search and the reports. Each was timed right
    after its own build: with the host's other core busy, a ResNet's int8 (0.6x its fp32 alone)
    measured 0.433 ms against 0.314 at fp32, and the search kept fp32."""
    times = time_in_turn({p: b.executable for p, b in built.items()}, inputs)
    for precision, b in built.items():
        for c in b.candidates:
            if c.runtime == b.runtime and c.status == "ok":
                c.median_ms = times[precision]
        for c in tried:
            if (c["precision"], c["runtime"], c["status"]) == (precision, b.runtime, "ok"):
                c["median_ms"] = times[precision]


def _own_time(built: dict[str, BuiltPart], own: str) -> tuple[str, float] | None:
    """(a precision, its ms) once built (the part's own: a lower precision's build slower
    than it could never be chosen, and is not measured further: runtimes/select.py SLOWER)."""
    b = built.get(own)
    ms = next((c.median_ms for c in b.candidates if c.runtime == b.runtime and c.median_ms > 0),
              0.0) if b is not None else 0.0
    return (own, ms) if ms > 0 else None


def _needless_mix(precision: str, built: dict[str, BuiltPart], order: Build,  # noqa: PLR0913
                  tried: list[dict[str, Any]], decode: bool = False, final: bool = True,
                  ) -> str:
    """Why a mixed precision need not be built ("" when it must): the part built at its low
    precision alone is already within what the mix would aim at, or ran no faster than at its
    own precision on any runtime (a mix keeps groups of it at the own precision, chosen by
    their error: it runs slower still). The ranking and the builds of a mix cost a load tens
    of seconds: 15 of the demo's 18 s under `auto` on an AMX Xeon, for a 0.02 ms part. Where
    the low precision alone built within the budget on the part but over the mix's target,
    the mix waits (`order.defer_mix`, MIX_DEFERRED): the precision search builds it only if
    the end-to-end check refuses the low precision alone (cuvild/load/precision.py `search`;
    the demo's int8 held there, 5.5e-3 of 1e-2, and its int8+fp32 search cost 14 s). A part
    that gives the model's outputs (`final`) and is over the budget alone has its mix built
    at once: its error is what the check reads (a language model's prompt chunk at bf16,
    1.2e-2: deferred, its load took 16.6 s more, the part's check inputs traced again and
    its own precision loaded again). An earlier part's error can shrink on the way out (the
    demo's convolutions at int8: 5.5e-3 at the model's output)."""
    low = precision.removesuffix(MIXED) if precision.endswith(MIXED) else None
    if low is None or not order.budget:
        return ""
    slower = _no_faster(low, built, order, tried)
    if slower or low not in built:
        return slower
    b = built[low]
    error = min(c.rel_error for c in b.candidates if c.runtime == b.runtime and c.status == "ok")
    target = order.budget * (INT8_MIX_SHARE if precision == INT8_MIXED else MIX_SHARE)
    if error <= target:
        return f"not built: {low} alone measures {error:.1e} <= {target:.0e} on this part"
    if not order.defer_mix or decode or (final and error > order.budget):
        return ""
    return (f"{MIX_DEFERRED}: {low} alone measures {error:.1e}"
            + (f" <= {order.budget:.0e} on this part" if final
               else " on this part (not the model's outputs)")
            + "; the mix is built if the end-to-end check refuses it")


def _no_faster(low: str, built: dict[str, BuiltPart], order: Build,
               tried: list[dict[str, Any]]) -> str:
    """Why `low`'s mix need not be built where `low` alone ran no faster than the fastest
    precision built so far ("" otherwise): its own, or a lower one that holds already (fp16
    where bf16 is over the budget). A mix keeps groups at fp32 and runs slower than `low`
    alone, so it could only win where `low` alone is faster than every build beside it."""
    times = [t for t in (_own_time(built, p) for p in built if p != low) if t is not None]
    ran = [c["median_ms"] for c in tried if c["precision"] == low and c["median_ms"] > 0]
    if not times or not ran:
        return ""
    best = min(times, key=lambda t: t[1])
    if min(ran) < best[1]:
        return ""
    return (f"not built: {low} alone ran {min(ran):.3g} ms at best against {best[1]:.3g} ms at "
            f"{best[0]}; a mix of {low} and fp32 is no faster")


def variants(built: dict[str, BuiltPart]) -> list[Variant]:
    out = []
    for precision, b in built.items():
        winner = next(c for c in b.candidates if c.runtime == b.runtime and c.status == "ok")
        out.append(Variant(precision, b.runtime, winner.median_ms, winner.rel_error,
                           b.part_key))
    return out


def eager(ep: Any) -> Any:
    """`ep` on torch eager as the engine sees a model: its inputs flat, in the graph's order
    (keyword ones included), its outputs a flat list (dicts and nested containers too)."""
    import torch.utils._pytree as pytree

    module, spec = ep.module(), ep.call_spec.in_spec
    stateful = bool(remember_initial(module))

    def run(*inputs: Any) -> list[Any]:
        if stateful:  # each call on a fresh state, as a request outside a sequence runs
            reset(module)
        args, kwargs = pytree.tree_unflatten(list(inputs), spec)
        out = module(*args, **kwargs)
        return pytree.tree_flatten(out, is_leaf=lambda x: x is None)[0]

    return run
