"""Build one part for its device: pick the runtime, check numerics, use the compile cache.

With `runtime="auto"` every runtime that can target the device and precision is compiled
(each time-boxed), run on the sample inputs (one, or every calibration sample), its relative
error against torch eager measured (runtimes/base.py `relative_error`), timed, and the
fastest one within the tolerance is kept: the precision's (`TOLERANCE`), or the error budget
the caller gives. Every candidate's time and error are recorded in the cache whatever the
tolerance, so a restarted daemon, or a load with another budget, picks again from the record
and loads the winner without compiling or timing anything.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import fx

from partitioner.profile import DeviceProfile
from runtimes import registry
from runtimes.base import (
    TOLERANCE,
    CompileError,
    CompileSpec,
    Executable,
    RuntimeUnavailable,
    relative_error,
)
from runtimes.cache import CompileCache, graph_digest

log = logging.getLogger(__name__)
TIMING_BUDGET_S = 0.5  # per candidate; at least 3 runs


@dataclass
class Candidate:
    runtime: str
    status: str  # "ok" | "unavailable" | "failed" | "timeout" | "inaccurate"
    reason: str = ""
    compile_s: float = 0.0
    rel_error: float = 0.0
    median_ms: float = 0.0
    cached: bool = False
    precision: str = "fp32"


@dataclass
class BuiltPart:
    runtime: str
    executable: Executable
    candidates: list[Candidate] = field(default_factory=list)
    from_cache: bool = False  # True when nothing was compiled
    compiled: list[str] = field(default_factory=list)  # runtimes compiled now


def time_ms(executable: Executable, inputs: Sequence[torch.Tensor]) -> float:
    executable.run(inputs)
    samples = []
    deadline = time.perf_counter() + TIMING_BUDGET_S
    while len(samples) < 3 or (time.perf_counter() < deadline and len(samples) < 50):
        t0 = time.perf_counter()
        executable.run(inputs)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _compile_boxed(runtime: Any, part: fx.GraphModule, spec: CompileSpec,
                   timeout_s: float) -> Executable:
    """Compile in a thread we stop waiting for after timeout_s, so one slow compiler cannot
    stall a load. (The thread finishes in the background; runtimes that compile in a
    subprocess, like llvm-cpu, are really stopped.)"""
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            result["exe"] = runtime.compile(part, spec)
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            result["error"] = e

    thread = threading.Thread(target=work, name=f"compile-{runtime.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{runtime.name} did not compile within {timeout_s:.0f} s")
    if "error" in result:
        raise result["error"]
    return result["exe"]


def candidates_for(device: DeviceProfile, precision: str, wanted: str) -> list[str]:
    names = list(registry.BY_KIND.get(device.kind, ()))
    if device.emulated and "torch" not in names:
        names.append("torch")  # an emulated device runs on the host: the reference works
    if device.runtimes:  # what the profile says can target this device
        names = [n for n in names if n in device.runtimes]
    if wanted != "auto":
        if wanted not in registry.RUNTIMES:
            raise RuntimeUnavailable(f"unknown runtime {wanted!r}")
        names = [wanted]
    return names


def placeholder_tensors(part: fx.GraphModule,
                        shapes: list[list[int]] | None = None) -> list[torch.Tensor]:
    """Zero tensors shaped like the part's inputs (from the graph's metadata, or `shapes` for
    a dynamic-shape part built for one bucket): enough to key the cache and to rebuild a
    cached executable, without running the model."""
    out = []
    placeholders = [n for n in part.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise CompileError(f"input {node.name} of the part has no tensor metadata")
        shape = shapes[i] if shapes is not None else [int(d) for d in val.shape]
        out.append(torch.zeros(shape, dtype=val.dtype))
    return out


# () -> (the part's inputs per sample, torch eager's outputs per sample)
Samples = Callable[[], tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]]


def build_part(part: fx.GraphModule, device: DeviceProfile, precision: str, samples: Samples,
               cache: CompileCache, runtime: str = "auto", timeout_s: float = 300.0,
               threads: int | None = None, input_shapes: list[list[int]] | None = None,
               tolerance: float | None = None, cache_tag: str = "") -> BuiltPart:
    """Compile (or load from cache) `part` for `device`; raise CompileError if nothing works.

    `samples()` returns real inputs for the part and torch eager's outputs for them, one
    sample or several (int8 calibrates on all of them); it is called only when something
    must be compiled (a cache hit runs nothing). `tolerance` bounds the relative error (the
    precision's TOLERANCE by default); `cache_tag` tells apart builds that depend on more
    than the part (int8: the calibration data).
    """
    tolerance = TOLERANCE[precision] if tolerance is None else tolerance
    spec = CompileSpec(device=device, precision=precision,
                       example_inputs=placeholder_tensors(part, input_shapes),
                       threads=threads or max(len(device.cores), 1))
    key_precision = f"{precision}:{cache_tag}" if cache_tag else precision
    part_key = cache.part_key(graph_digest(part), device, key_precision, spec.shapes())
    names = candidates_for(device, precision, runtime)
    recorded = cache.choice(part_key)
    if recorded:
        built = _load_recorded(part_key, recorded, spec, cache, part, names, tolerance)
        if built is not None:
            return built
    inputs, expected = samples()
    spec.example_inputs, spec.calibration = list(inputs[0]), [list(x) for x in inputs]
    tried: list[Candidate] = []
    executables: dict[str, Executable] = {}
    compiled: list[str] = []
    for name in names:
        cand, exe = _try(name, part, spec, inputs, expected, cache, part_key, timeout_s)
        cand.precision = precision
        tried.append(cand)
        if exe is not None:
            executables[name] = exe
            if not cand.cached:
                compiled.append(name)
    cache.record_choice(part_key, {"candidates": [asdict(c) for c in tried]})
    accurate = _judge(tried, tolerance)
    if not accurate:
        reasons = "; ".join(f"{c.runtime}: {c.status} ({c.reason})" for c in tried)
        error = CompileError(f"no runtime could build this part for {device.id} at "
                             f"{precision}: {reasons or 'no runtime targets this device'}")
        error.candidates = tried  # type: ignore[attr-defined] - what was tried, for reports
        raise error
    best = accurate[0].runtime
    return BuiltPart(best, executables[best], tried, from_cache=not compiled, compiled=compiled)


def _judge(candidates: list[Candidate], tolerance: float) -> list[Candidate]:
    """Mark the candidates over the tolerance inaccurate; the rest, fastest first."""
    for c in candidates:
        if c.status in ("ok", "inaccurate"):
            over = c.rel_error > tolerance
            c.status = "inaccurate" if over else "ok"
            c.reason = f"relative error {c.rel_error:.2e} > {tolerance:.0e}" if over else ""
    return sorted((c for c in candidates if c.status == "ok"), key=lambda c: c.median_ms)


def _load_recorded(part_key: str, recorded: dict[str, Any], spec: CompileSpec,
                   cache: CompileCache, part: fx.GraphModule, names: list[str],
                   tolerance: float) -> BuiltPart | None:
    """The winner of a recorded search under this tolerance, loaded from the cache; None when
    the record has no usable winner any more (then everything is built again)."""
    candidates = [Candidate(**c) for c in recorded.get("candidates", [])]
    accurate = [c for c in _judge(candidates, tolerance) if c.runtime in names]
    if not accurate:
        return None
    name = accurate[0].runtime
    try:
        rt = registry.get(name)
        if name == "torch":  # the reference has nothing to cache: "compiling" it is free
            return BuiltPart(name, rt.compile(part, spec), candidates, from_cache=True)
        entry = cache.lookup(cache.entry_key(part_key, name, rt.version()))
        if entry is None:
            return None
        exe = rt.load(entry, spec)
    except (RuntimeUnavailable, NotImplementedError, OSError, RuntimeError) as e:
        log.warning("cached %s build unusable (%s); rebuilding", name, e)
        return None
    return BuiltPart(name, exe, candidates, from_cache=True)


def _try(name: str, part: fx.GraphModule, spec: CompileSpec, inputs: list[list[torch.Tensor]],
         expected: list[list[torch.Tensor]], cache: CompileCache, part_key: str,
         timeout_s: float) -> tuple[Candidate, Executable | None]:
    """Compile (or load) one runtime's build, measure its error on every sample and its time.
    Status "ok" here means it runs; `_judge` then holds its error against the tolerance."""
    try:
        rt = registry.get(name)
    except RuntimeUnavailable as e:
        return Candidate(name, "unavailable", str(e)), None
    if not rt.can_target(spec.device, spec.precision):
        return Candidate(name, "unavailable", f"cannot target {spec.device.kind} at "
                                              f"{spec.precision}"), None
    key = cache.entry_key(part_key, name, rt.version())
    entry = cache.lookup(key)
    t0 = time.perf_counter()
    cached = False
    try:
        if entry is not None:
            exe, cached = rt.load(entry, spec), True
        else:
            if hasattr(rt, "timeout_s"):  # runtimes that compile in a subprocess stop it too
                rt.timeout_s = timeout_s
            exe = _compile_boxed(rt, part, spec, timeout_s)
    except TimeoutError as e:
        return Candidate(name, "timeout", str(e)), None
    except Exception as e:  # noqa: BLE001 - any compiler failure moves on to the next runtime
        log.info("%s failed on a part for %s: %s", name, spec.device.id, e)
        return Candidate(name, "failed", f"{type(e).__name__}: {e}"[:500]), None
    compile_s = time.perf_counter() - t0
    try:
        error = max(relative_error(exe.run(x), want) for x, want in zip(inputs, expected,
                                                                         strict=True))
    except Exception as e:  # noqa: BLE001
        return Candidate(name, "failed", f"run: {type(e).__name__}: {e}"[:500], compile_s), None
    if error == float("inf"):  # a wrong shape or dtype: never usable, whatever the budget
        return Candidate(name, "failed", "returned outputs of the wrong shape or dtype",
                         compile_s, error), None
    if entry is None:
        try:
            cache.store(key, exe.save, {"runtime": name, "device": spec.device.id,
                                        "precision": spec.precision})
        except NotImplementedError:
            pass  # this runtime has nothing to cache
    return Candidate(name, "ok", "", compile_s, error, time_ms(exe, spec.example_inputs),
                     cached), exe
