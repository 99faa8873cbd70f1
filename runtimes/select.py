"""Build one part for its device: pick the runtime, check numerics, use the compile cache.

With `runtime="auto"` every runtime that can target the device and precision is compiled
(each time-boxed), run on the sample inputs (one, or every calibration sample), its relative
error against torch eager measured (runtimes/base.py `set_error`), timed, and the
fastest one within the tolerance is kept: the precision's (`TOLERANCE`), or the error budget
the caller gives. Every candidate's time and error are recorded in the cache whatever the
tolerance, so a restarted daemon, or a load with another budget, picks again from the record
and loads the winner without compiling or timing anything.

Compiling every runtime makes a cold build cost the sum of their compile times (12-20 s a
part here), while on one machine the same runtime usually wins. So each search also feeds a
prior kept in the compile cache per device digest and precision (`CompileCache.prior`): per
runtime, the searches it won, its time relative to the winner's in its last 20 searches, its
compile times. A search tries the runtimes in the prior's order (most wins first, ties: the
lower median ratio; runtimes with no recorded time after them, in registry order, which is
best-known first), and once some candidate is accurate it skips (status "skipped", with the
reason) a runtime that, on this device:
- lost each of its recorded searches, at least SKIP_MIN_SEARCHES of them, by SKIP_RATIO or
  more: a 1.3x margin is well beyond timing noise, so it would not have won this one either;
- or is expected (its median compile time here) to take longer than what is left of one
  compile time box (`timeout_s`, counted from the start of the search): once there is an
  answer the search stays within one box instead of waiting out a slow compiler again.
A runtime skipped RETRY_AFTER searches in a row is tried again, so an upgrade that makes it
faster is noticed.

And whatever the history, the search stops once an accurate candidate runs within NEAR_FLOOR
(1.25x) of the part's roofline floor (`floor_ms`: the cost model's time at the device's
measured peaks, which are the best runtime's own kernels on it): no runtime can then be more
than 20% faster, so the rest are skipped. Measured here, the first runtime tried (OpenVINO)
ran resnet18 at 0.94x, the BERT-like encoder at 1.12x and the MLP at 1.09x of their floors,
so a first cold build compiles one runtime instead of four. With neither history nor floor
nothing is skipped: every candidate is tried as before.
`allowed` (config `engine.runtimes`, see registry.allowed_runtimes) restricts the candidates.

The accurate candidates within CLOSE (1.5x) of the fastest are then timed again in turn
(`retime_close`), so that two close runtimes are compared on the same host state, not each
at the moment its compile ended.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx

from partitioner.profile import DeviceProfile
from runtimes import crashes, registry
from runtimes.base import (
    INT8_MIXED,
    MIXED,
    TOLERANCE,
    CompileError,
    CompileSpec,
    Executable,
    RuntimeUnavailable,
    compiled_as,
    relative_error,
    set_error,
    unusable,
)
from runtimes.cache import CompileCache, graph_digest
from runtimes.mixed import RUNTIMES as MIXED_RUNTIMES
from runtimes.mixed import Mix
from runtimes.mixed import again as mixed_again
from runtimes.mixed import choose as choose_mix
from runtimes.mixed import low_of as mixed_low
from runtimes.registry import STATEFUL_RUNTIMES
from runtimes.torch_eager import decode_step, state_of

log = logging.getLogger(__name__)
TIMING_BUDGET_S = 0.5  # per candidate; at least 3 runs
SKIP_RATIO = 1.3  # a runtime this much slower than the winner in every recorded search...
SKIP_MIN_SEARCHES = 3  # ...of at least this many is not tried once one candidate is accurate
RETRY_AFTER = 10  # searches a runtime is skipped in a row before it is tried again
NEAR_FLOOR = 1.25  # an accurate candidate this close to the roofline floor ends the search
CLOSE = 1.5  # accurate candidates timed within this of the fastest are timed again, in turn
BLOCK_RUNS, BLOCK_S = 20, 0.02  # ...in blocks of runs back to back: at most so many, so long
# a lower precision's build whose second run takes this much longer than a higher precision
# already built is not measured further (its error on every sample would be time lost: fp16
# on a CPU without fp16 units, a 128-token prompt of the 200M Llama, 1014 ms a run vs 232 at
# fp32, 20 s of the first request's 56 s under a budget)
SLOWER = 1.25
CRASHED = ("it killed its worker process compiling this part here before (runtimes/"
           "crashes.py: not tried on it again)")


@dataclass
class Candidate:
    runtime: str
    status: str  # "ok" | "unavailable" | "failed" | "timeout" | "inaccurate" | "skipped"
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
    part_key: str = ""  # the compile problem (cache.part_key): a restart loads it by this


def time_ms(executable: Executable, inputs: Sequence[torch.Tensor]) -> float:
    executable.run(inputs)
    samples = []
    deadline = time.perf_counter() + TIMING_BUDGET_S
    while len(samples) < 3 or (time.perf_counter() < deadline and len(samples) < 50):
        t0 = time.perf_counter()
        executable.run(inputs)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def retime_close(tried: list[Candidate], executables: dict[str, Executable],
                 inputs: Sequence[torch.Tensor], tolerance: float) -> None:
    """Time again the accurate candidates within CLOSE of the fastest, in turn
    (`time_in_turn`), and keep those medians. Each was first timed alone, right after its
    compile: on a 2-core host the drift between those moments flipped which of two close
    runtimes won from one load of the same tiny MLP to the next (ONNX Runtime 0.017-0.032 ms
    against llvm-cpu 0.027-0.029)."""
    accurate = _judge(tried, tolerance)
    close = [c for c in accurate
             if c.runtime in executables and c.median_ms <= CLOSE * accurate[0].median_ms]
    if len(close) < 2:
        return
    times = time_in_turn({c.runtime: executables[c.runtime] for c in close}, inputs)
    for c in close:
        c.median_ms = times[c.runtime]


def time_in_turn(executables: dict[str, Executable],
                 inputs: Sequence[torch.Tensor]) -> dict[str, float]:
    """Each executable's median ms a run, timed in turn so that what else the host does at
    the time weighs on all alike. In turn means blocks, not single runs: a block runs one
    back to back as it will serve, up to BLOCK_RUNS runs or BLOCK_S (its first run, after
    another's, is not counted unless it is the block's only one: a part that runs longer than
    BLOCK_S), the order of the blocks reversed every other round, at least 3 rounds, at most 5
    or TIMING_BUDGET_S each. (One run of each in turn made both ONNX Runtime and llvm-cpu 2x
    slower on a tiny MLP, each cooling the other's caches and thread pool: not how either
    would serve.)"""
    names = list(executables)
    samples: dict[str, list[float]] = {n: [] for n in names}
    deadline = time.perf_counter() + TIMING_BUDGET_S * len(names)
    rounds = 0
    while rounds < 3 or (time.perf_counter() < deadline and rounds < 5):
        for name in names if rounds % 2 == 0 else reversed(names):
            block, block_end = [], time.perf_counter() + BLOCK_S
            while len(block) < BLOCK_RUNS and (not block or time.perf_counter() < block_end):
                t0 = time.perf_counter()
                executables[name].run(inputs)
                block.append((time.perf_counter() - t0) * 1e3)
            samples[name] += block[1:] or block
        rounds += 1
    return {n: statistics.median(samples[n]) for n in names}


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


def order_by_prior(names: list[str], prior: dict[str, dict[str, Any]]) -> list[str]:
    """The runtimes that won most searches first (ties: the lower median ratio to the
    winner); those with no recorded time after them, in their given order."""
    known = sorted((n for n in names if prior.get(n, {}).get("ratios")),
                   key=lambda n: (-prior[n]["wins"], statistics.median(prior[n]["ratios"])))
    return known + [n for n in names if n not in known]


def skip_reason(name: str, prior: dict[str, dict[str, Any]], time_left_s: float,
                timeout_s: float) -> str:
    """Why `name` need not be tried once an accurate candidate exists; "" to try it."""
    t = prior.get(name)
    if not t or t["skipped"] >= RETRY_AFTER:
        return ""
    ratios, compile_s = t["ratios"], t["compile_s"]
    if len(ratios) >= SKIP_MIN_SEARCHES and min(ratios) >= SKIP_RATIO:
        return (f"lost every one of {len(ratios)} recorded searches on this device by "
                f">={SKIP_RATIO}x (median {statistics.median(ratios):.1f}x)")
    if compile_s and statistics.median(compile_s) > time_left_s:
        return (f"expected to compile in {statistics.median(compile_s):.0f} s (median of "
                f"{len(compile_s)} on this device), more than the {max(time_left_s, 0):.0f} s "
                f"left of the {timeout_s:.0f} s box")
    return ""


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


def build_part(part: fx.GraphModule, device: DeviceProfile, precision: str, samples: Samples,  # noqa: C901 - the search, its early stops beside it
               cache: CompileCache, runtime: str = "auto", timeout_s: float = 300.0,
               threads: int | None = None, input_shapes: list[list[int]] | None = None,
               tolerance: float | None = None, cache_tag: str = "",
               allowed: list[str] | None = None, floor_ms: float | None = None,
               progress: Callable[[str], None] | None = None,
               mix_target: float | None = None,
               slower_than: tuple[str, float] | None = None) -> BuiltPart:
    """Compile (or load from cache) `part` for `device`; raise CompileError if nothing works.

    `samples()` returns real inputs for the part and torch eager's outputs for them, one
    sample or several (int8 calibrates on all of them); it is called only when something
    must be compiled (a cache hit runs nothing). `tolerance` bounds the relative error (the
    precision's TOLERANCE by default); `cache_tag` tells apart builds that depend on more
    than the part (int8: the calibration data). `allowed` limits the runtimes tried (None:
    every one that can target the device); `floor_ms`, the part's roofline time here, ends
    the search early (see the module docstring); `progress` is told each runtime as it is
    tried. `mix_target`: the error a mixed precision's part aims at (runtimes/mixed.py; by
    default half of `tolerance`). `slower_than`: (a precision, its ms) of the part already
    built: a build that runs SLOWER than it is skipped before its error is measured (not a
    mixed precision's: the search that made it measured its error already, runtimes/mixed.py
    or NNCF's accuracy control).
    """
    tolerance = own_tolerance(precision) if tolerance is None else tolerance
    spec = CompileSpec(device=device, precision=compiled_as(precision),
                       example_inputs=placeholder_tensors(part, input_shapes),
                       threads=threads or max(len(device.cores), 1))
    mix_target = mix_target or tolerance / 2
    if precision == INT8_MIXED:  # what the quantizer's accuracy control holds
        spec.max_error = mix_target
    part_key, names = _problem(part, spec, precision, cache, cache_tag, mix_target, runtime,
                               allowed)
    recorded = cache.choice(part_key)
    if recorded:
        built = _load_recorded(part_key, recorded, spec, cache, part, names, tolerance)
        if built is not None:
            built.part_key = part_key
            return built
    inputs, expected = samples()
    spec.example_inputs, spec.calibration = list(inputs[0]), [list(x) for x in inputs]
    part, chosen = _mix(part, precision, mix_target, inputs, expected, spec, names, timeout_s,
                        (cache.root, part_key))
    tried: list[Candidate] = []
    executables: dict[str, Executable] = {}
    compiled: list[str] = []
    prior = cache.prior(device, precision) if runtime == "auto" else {}
    start = time.perf_counter()
    for name in order_by_prior(names, prior):
        accurate = [c for c in tried if c.status == "ok" and c.rel_error <= tolerance]
        if accurate:
            left = timeout_s - (time.perf_counter() - start)
            reason = (near_floor(min(accurate, key=lambda c: c.median_ms), floor_ms)
                      or skip_reason(name, prior, left, timeout_s))
            if reason:
                tried.append(Candidate(name, "skipped", reason, precision=precision))
                continue
        if progress and not crashes.crashed(cache.root, part_key, name):
            progress(name)
        cand, exe = _try_marked(name, part, spec, inputs, expected, cache, part_key, timeout_s,
                                None if precision.endswith(MIXED) else slower_than)
        cand.precision = precision
        if exe is not None and cand.status == "ok" and (chosen is not None or exe.note):
            # which groups stayed fp32, and why (a mix); which ops the quantizer kept fp32
            cand.reason = chosen.describe() if chosen is not None else exe.note
        tried.append(cand)
        if exe is not None:
            executables[name] = exe
            if not cand.cached:
                compiled.append(name)
    retime_close(tried, executables, spec.example_inputs, tolerance)
    cache.record_choice(part_key, _choice(tried, chosen))
    accurate = _judge(tried, tolerance)
    if runtime == "auto" and len(names) > 1:  # a real choice: teach the prior
        cache.record_search(device, precision, [asdict(c) for c in tried],
                            accurate[0].runtime if accurate else None)
    if not accurate:
        reasons = "; ".join(f"{c.runtime}: {c.status} ({c.reason})" for c in tried)
        none = ("no runtime targets this device" if allowed is None else
                f"none of the allowed runtimes {allowed} (engine.runtimes) targets this device")
        error = CompileError(f"no runtime could build this part for {device.id} at "
                             f"{precision}: {reasons or none}")
        error.candidates = tried  # type: ignore[attr-defined] - what was tried, for reports
        raise error
    best = accurate[0].runtime
    return BuiltPart(best, executables[best], tried, from_cache=not compiled, compiled=compiled,
                     part_key=part_key)


def _mix(part: fx.GraphModule, precision: str, target: float,
         inputs: list[list[torch.Tensor]], expected: list[list[torch.Tensor]],
         spec: CompileSpec, names: list[str], timeout_s: float,
         marks: tuple[Path, str]) -> tuple[fx.GraphModule, Mix | None]:
    """A mixed precision's graph: at its low precision but for the groups that must stay
    fp32 to hold `target`, as the first runtime that builds it measures (runtimes/mixed.py);
    others as they are. Its compiles are marked as the search's are (`marks`: the cache's
    root and the part key, runtimes/crashes.py): one that killed a worker is left out."""
    low = mixed_low(precision)
    if low is None:
        return part, None
    if not names:
        error = CompileError(f"{precision}: none of the runtimes that run a graph's own dtypes "
                             f"({', '.join(MIXED_RUNTIMES)}) may build for {spec.device.id}")
        error.candidates = [Candidate("mixed", "skipped", str(error),  # type: ignore[attr-defined]
                                      precision=precision)]
        raise error

    def measure(module: fx.GraphModule) -> float:
        for name in names:
            try:
                rt = registry.get(name)
            except RuntimeUnavailable:
                continue
            if not rt.can_target(spec.device, spec.precision) or crashes.crashed(*marks, name):
                continue
            try:
                with crashes.attempt(*marks, name):
                    exe = _compile_boxed(rt, module, spec, timeout_s)
                return set_error([exe.run(x) for x in inputs], expected)
            except Exception as e:  # noqa: BLE001 - the mix cannot be measured: no mix
                raise CompileError(f"{name}: {type(e).__name__}: {e}"[:500]) from e
        raise CompileError(f"none of {names} can build a mixed part for {spec.device.id}")

    try:
        return choose_mix(part, low, target, inputs, expected, measure=measure)
    except Exception as e:  # noqa: BLE001 - no mix is no failure: said in the part's report
        error = e if isinstance(e, CompileError) else CompileError(
            f"{precision}: {type(e).__name__}: {e}"[:500])
        error.candidates = [Candidate("mixed", "skipped", str(error),  # type: ignore[attr-defined]
                                      precision=precision)]
        raise error from (None if error is e else e)


def _problem(part: fx.GraphModule, spec: CompileSpec, precision: str, cache: CompileCache,
             cache_tag: str, mix_target: float, runtime: str,
             allowed: list[str] | None) -> tuple[str, list[str]]:
    """The part's compile-cache key and the runtimes that may build it."""
    mix = mixed_low(precision)
    if mix or precision == INT8_MIXED:  # what it keeps fp32 depends on the error it aims
        # at: a build per target
        cache_tag = f"{cache_tag}:{mix_target:.1e}" if cache_tag else f"{mix_target:.1e}"
    key_precision = f"{precision}:{cache_tag}" if cache_tag else precision
    part_key = cache.part_key(graph_digest(part), spec.device, key_precision, spec.shapes())
    stateful = bool(state_of(part))
    # (a mix runs on a runtime that runs a graph's own dtypes; a stateful part's prompt chunk
    # on torch, which folds its weights' casts: runtimes/mixed.py. Not a decode step's: fp16
    # halves the bytes it reads already, and its mix searched 35 s of the 200M Llama's load
    # to lose to it.)
    mixes = (*MIXED_RUNTIMES, *STATEFUL_RUNTIMES) if mix and stateful and not decode_step(
        part, spec.example_inputs) else MIXED_RUNTIMES
    names = [n for n in registry.candidates_for(spec.device, spec.precision, runtime, stateful)
             if (allowed is None or n in allowed) and (not mix or n in mixes)]
    if stateful:  # buffers updated in place (a KV cache): kept per sequence by torch
        kept = [n for n in names if n in STATEFUL_RUNTIMES]
        if not kept and mix and STATEFUL_RUNTIMES[0] not in mixes:
            raise CompileError(f"{precision} is not tried for a decode step (its fp16 "
                               "halves the bytes it reads already)")
        if not kept:
            raise CompileError(
                f"the part updates its buffers in place (a language model's cache): only "
                f"{', '.join(STATEFUL_RUNTIMES)} keeps them per sequence, and it cannot "
                f"target {spec.device.id} at {precision} (tried for: {names})")
        names = kept
    return part_key, names


def own_tolerance(precision: str) -> float:
    """A precision's tolerance where no budget gives one (a mix, bf16+fp32: its low one's)."""
    return TOLERANCE.get(precision) or TOLERANCE[mixed_low(precision) or "fp32"]


def near_floor(best: Candidate, floor_ms: float | None) -> str:
    """Why the search may stop at `best`: it runs near the part's roofline floor ("": no)."""
    if not floor_ms or best.median_ms > NEAR_FLOOR * floor_ms:
        return ""
    return (f"{best.runtime} runs it in {best.median_ms:.2f} ms, within {NEAR_FLOOR}x of its "
            f"roofline floor here ({floor_ms:.2f} ms): no runtime can be clearly faster")


def _judge(candidates: list[Candidate], tolerance: float) -> list[Candidate]:
    """Mark the candidates over the tolerance inaccurate; the rest, fastest first."""
    for c in candidates:
        if c.status in ("ok", "inaccurate"):
            over = c.rel_error > tolerance
            c.status = "inaccurate" if over else "ok"
            if over:
                c.reason = f"relative error {c.rel_error:.2e} > {tolerance:.0e}"
            elif c.reason.startswith("relative error "):  # judged under another tolerance
                c.reason = ""  # (an accurate one keeps what its build said: a mix's groups)
    return sorted((c for c in candidates if c.status == "ok"), key=lambda c: c.median_ms)


def _choice(tried: list[Candidate], chosen: Mix | None) -> dict[str, Any]:
    """A search's record: its candidates, and a mix's groups kept fp32 (a runtime that
    caches no build, torch, makes the mix again from them: `_load_recorded`)."""
    record: dict[str, Any] = {"candidates": [asdict(c) for c in tried]}
    if chosen is not None:
        record["mix"] = {"low": chosen.low, "kept": chosen.kept}
    return record


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
    if crashes.crashed(cache.root, part_key, name):  # (searched again: it is left out there)
        return None
    try:
        with crashes.attempt(cache.root, part_key, name):
            return _recorded(name, part_key, recorded, spec, cache, part, candidates)
    except (RuntimeUnavailable, NotImplementedError, OSError, RuntimeError) as e:
        log.warning("cached %s build unusable (%s); rebuilding", name, e)
        return None


def _recorded(name: str, part_key: str, recorded: dict[str, Any], spec: CompileSpec,
              cache: CompileCache, part: fx.GraphModule,
              candidates: list[Candidate]) -> BuiltPart | None:
    """`_load_recorded`'s load of the winner `name`."""
    rt = registry.get(name)
    if name == "torch":  # the reference has nothing to cache: "compiling" it is free
        mix = recorded.get("mix")  # (a mix: lowered again as the search chose)
        made = part if not mix else mixed_again(part, mix["low"], mix["kept"],
                                                spec.example_inputs)
        return BuiltPart(name, rt.compile(made, spec), candidates, from_cache=True)
    key = cache.entry_key(part_key, name, rt.version())
    entry = cache.lookup(key)
    if entry is None:
        return None
    exe = _load_entry(rt, cache, key, entry, spec)
    if exe is None:
        return None
    return BuiltPart(name, exe, candidates, from_cache=True)


def _load_entry(rt: Any, cache: CompileCache, key: str, entry: Any,
                spec: CompileSpec) -> Executable | None:
    """A cached build, or None when it does not load (corrupt, or from a runtime that changed
    its format): then the entry is dropped, so that it is compiled again and stored anew."""
    try:
        return rt.load(entry, spec)
    except Exception as e:  # noqa: BLE001 - whatever is wrong with it, it is rebuilt
        log.warning("cached %s build %s does not load (%s: %s); compiling it again", rt.name,
                    key, type(e).__name__, e)
        cache.drop(key)
        return None


def _slower(exe: Executable, spec: CompileSpec, than: tuple[str, float] | None,
            ) -> tuple[str, float] | None:
    """(why, its ms) where `exe` runs SLOWER than `than`'s (precision, ms) twice, after a run
    that warms it (one run on a busy host can be twice its time)."""
    if than is None:
        return None
    exe.run(spec.example_inputs)
    ms = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        exe.run(spec.example_inputs)
        ms = (time.perf_counter() - t0) * 1e3
        if ms <= than[1] * SLOWER:
            return None
    return (f"{ms:.1f} ms a run against {than[1]:.1f} ms at {than[0]}: not faster, its error "
            f"not measured"), ms


def _try_marked(name: str, part: fx.GraphModule, spec: CompileSpec,
                inputs: list[list[torch.Tensor]], expected: list[list[torch.Tensor]],
                cache: CompileCache, part_key: str, timeout_s: float,
                slower_than: tuple[str, float] | None) -> tuple[Candidate, Executable | None]:
    """`_try`, marked as a compile in progress (runtimes/crashes.py); one that killed a worker
    here before is not tried again."""
    if crashes.crashed(cache.root, part_key, name):
        return Candidate(name, "failed", CRASHED), None
    with crashes.attempt(cache.root, part_key, name):
        return _try(name, part, spec, inputs, expected, cache, part_key, timeout_s, slower_than)


def _try(name: str, part: fx.GraphModule, spec: CompileSpec, inputs: list[list[torch.Tensor]],  # noqa: C901 - one candidate: load or compile, check, time, store
         expected: list[list[torch.Tensor]], cache: CompileCache, part_key: str,
         timeout_s: float, slower_than: tuple[str, float] | None = None,
         ) -> tuple[Candidate, Executable | None]:
    """Compile (or load) one runtime's build, measure its error on every sample and its time.
    Status "ok" here means it runs; `_judge` then holds its error against the tolerance.
    "skipped" where it runs SLOWER than `slower_than` (build_part)."""
    try:
        rt = registry.get(name)
    except RuntimeUnavailable as e:
        return Candidate(name, "unavailable", str(e)), None
    if not rt.can_target(spec.device, spec.precision):
        return Candidate(name, "unavailable", rt.why_not(spec.device, spec.precision)), None
    key = cache.entry_key(part_key, name, rt.version())
    entry = cache.lookup(key)
    t0 = time.perf_counter()
    cached = False
    exe = _load_entry(rt, cache, key, entry, spec) if entry is not None else None
    try:
        if exe is not None:
            cached = True
        else:
            entry = None
            if hasattr(rt, "timeout_s"):  # runtimes that compile in a subprocess stop it too
                rt.timeout_s = timeout_s
            exe = _compile_boxed(rt, part, spec, timeout_s)
    except TimeoutError as e:  # its time spent tells the prior how slow it compiles here
        return Candidate(name, "timeout", str(e), time.perf_counter() - t0), None
    except Exception as e:  # noqa: BLE001 - any compiler failure moves on to the next runtime
        log.info("%s failed on a part for %s: %s", name, spec.device.id, e)
        return Candidate(name, "failed", f"{type(e).__name__}: {e}"[:500],
                         time.perf_counter() - t0), None
    compile_s = time.perf_counter() - t0
    try:
        slower = _slower(exe, spec, slower_than)
        if slower:
            return Candidate(name, "skipped", slower[0], compile_s, median_ms=slower[1]), None
        outputs = [exe.run(x) for x in inputs]
        error = set_error(outputs, expected)
        if error == float("inf"):  # never usable, whatever the budget: say where
            why = next((unusable(got, want) for got, want in zip(outputs, expected, strict=True)
                        if relative_error(got, want) == float("inf")),
                       "returned outputs unlike torch eager's")
            return Candidate(name, "failed", why, compile_s, error), None
    except Exception as e:  # noqa: BLE001
        return Candidate(name, "failed", f"run: {type(e).__name__}: {e}"[:500], compile_s), None
    if entry is None:
        try:
            cache.store(key, exe.save, {"runtime": name, "runtime_version": rt.version(),
                                        "device": spec.device.id,
                                        "precision": spec.precision})
        except NotImplementedError:
            pass  # this runtime has nothing to cache
    return Candidate(name, "ok", "", compile_s, error, time_ms(exe, spec.example_inputs),
                     cached), exe
