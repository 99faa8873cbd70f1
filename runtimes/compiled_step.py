"""A language model's decode step compiled by inductor at its first use, kept where it is faster.

A decode step computes one row: its time is the weights read once (the matrix-vector products)
and ~1000 small ops run one by one from Python, each cast, norm, rotary and cache write its own
dispatch. Inductor fuses the small ops into a few C++ loops and calls the products as they are
(the torch runtime's own: oneDNN's packed weights at fp32, torch's fp16 matrix-vector product),
as vLLM compiles its model before serving. The 200M Llama's decode step on the 2-core EPYC:
15.4 -> 12.6 ms at fp16; at fp32 (its products ~3/4 of the step) the timing decides either way.

Tiered as a JIT is: a stateful part built for one row (`wanted`) runs eagerly, and its first
step of a sequence starts a thread that compiles it (`start`, `tier_up`; 3-4 s for that model
here from a warm cache, 26-31 s into an empty one; inductor's cache is under the compile cache
directory), the steps running eagerly meanwhile: a compile that outlasted a request's deadline
would have the worker taken as hung. The thread, on copies of that step (its inputs, its
sequence's state: a prompt's cache) and on modules of its own, checks the compiled step against
the part as exported (fp32) beside the eager step; the next run, in the serving thread, times
both, alternating (~0.3 s once). The compiled step serves from then on only if its error is
within 1.25x of the eager step's and it runs within FASTER of its time, else the part stays
eager (the reason logged, as any failure to compile: no C++ compiler, a graph inductor
refuses). A precision search's variants never run a sequence, so only the variant chosen is
compiled.

What it compiles attends the keys written so far, as the eager step does
(runtimes/attention.py), their count an input's length that inductor compiles as a dynamic
size, once (a count read from the mask would compile again at every length): on the 200M
Llama's fp16 step at context 2048, 14.4-19.7 ms from position 128 to 2046 against 18.2-24.4
eager, where compiled over the whole static cache it ran 28-34 ms at every position and the
timing kept the eager step. A later part of a split (no `cache_position`) counts from its mask
input (the second half of that model split in two, fp16 at context 2048: 7.8-11.7 ms against
10.0-13.4 eager, 14.3-15.6 compiled over the whole cache); a part whose caches differ in
length is compiled over the whole cache, as before. Steps of several sequences
batched together (`run_batch`) run eagerly. `engine.sequences.compile_steps: false` turns it
off (ENV).
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from runtimes.attention import KEYS, keyed
from runtimes.base import TOLERANCE, set_error

log = logging.getLogger(__name__)
ENV = "CUVILD_COMPILE_STEPS"  # "0": decode steps stay eager (engine.sequences.compile_steps)
FASTER = 0.95  # the compiled step serves where it takes at most this share of the eager one's
RUNS = 5  # timed runs of each, alternating


class Sources(NamedTuple):
    """What a tier-up builds, each a new module on the part's tensors (the serving thread's
    modules are never touched from the compiling one)."""

    compiled: Callable[[], torch.fx.GraphModule]  # what inductor compiles
    eager: Callable[[], torch.fx.GraphModule]  # the eager step, timed beside it
    exported: Callable[[], torch.fx.GraphModule]  # the part as exported (fp32): the reference


class Step(Protocol):
    """What `tier_up` needs of the torch runtime's executable; `step` says where its decode
    step stands, for `cuvilctl partition` (cuvild/serve/control.py `with_steps`)."""

    step: str

    def run_on(self, module: torch.fx.GraphModule, call: Callable[..., Any],
               inputs: Sequence[torch.Tensor], state: dict[str, torch.Tensor],
               ) -> list[torch.Tensor]: ...

    def offer(self, offer: Offer) -> None: ...


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def decode_step(state: Sequence[str], rows: dict[str, int]) -> bool:
    """Whether a part is a decode step: it keeps state and every linear computes one row."""
    return bool(state) and bool(rows) and set(rows.values()) == {1}


def wanted(state: Sequence[str], rows: dict[str, int]) -> bool:
    """Whether a part is compiled at its first sequence step: a decode step, where
    engine.sequences.compile_steps is on."""
    return decode_step(state, rows) and enabled()


WAITING = "decode step eager; compiled by inductor from a sequence's first step here"
OFF = "decode step eager (engine.sequences.compile_steps is off)"
ON_GPU = "decode step eager, kernel by kernel (not compiled on a GPU yet)"


class Offer(NamedTuple):
    """A compiled step that held the check, for the serving thread to time (`faster`)."""

    module: torch.fx.GraphModule
    compiled: Callable[..., Any]
    eager: torch.fx.GraphModule
    inputs: list[torch.Tensor]
    state: dict[str, torch.Tensor]
    said: str  # how it was compiled and checked


def start(exe: Step, sources: Sources, inputs: Sequence[torch.Tensor],
          state: dict[str, torch.Tensor]) -> threading.Thread:
    """`tier_up` in a thread of its own, on copies of a sequence's step (`inputs`, `state`)
    taken now: the step it was taken from, and those after it, run eagerly meanwhile (a
    compile that outlasted a request's deadline would have the worker taken as hung)."""
    inputs = [t.clone() for t in inputs]
    state = {n: v.clone() for n, v in state.items()}
    exe.step = "decode step eager while inductor compiles it"

    def run() -> None:
        refused = tier_up(exe, sources, inputs, state)
        if refused:
            log.info("a decode step stays eager: %s", refused)
            exe.step = f"decode step eager: {refused}"

    thread = threading.Thread(target=run, name="cuvild-compile-step", daemon=True)
    thread.start()
    return thread


def tier_up(exe: Step, sources: Sources, inputs: list[torch.Tensor],
            state: dict[str, torch.Tensor]) -> str:
    """Compile `sources.compiled` and check it against the eager step on a sequence's step
    (`inputs` on copies of its `state`); where it holds, offer it to `exe`, whose serving
    thread times it (`faster`: timed here, beside the steps it serves, on two cores it
    measured the serving, not the step). Why not, or "" where it was offered.

    Held: its error against the part as exported (fp32) within 1.25x of the eager step's own
    (a step at fp16 rounds differently wherever anything moves, ~7e-4 on the 200M Llama's
    logits, its eager error 2.5e-3), at least fp32's tolerance."""
    try:
        module, eager, exported = sources.compiled(), sources.eager(), sources.exported()
        compiled = torch.compile(module, dynamic=False)
        if KEYS in module.meta:  # its attentions' key count an input's length: dynamic
            compiled = keyed(module, compiled)
        t0 = time.perf_counter()
        got = exe.run_on(module, compiled, inputs, state)  # (compiles)
        compile_s = time.perf_counter() - t0
        want = exe.run_on(eager, eager, inputs, state)
        exact = exe.run_on(exported, exported, inputs, state)
        error, own = set_error([got], [exact]), set_error([want], [exact])
    except Exception as e:  # noqa: BLE001 - any compile failure leaves the step eager
        return f"inductor failed: {type(e).__name__}: {str(e)[:300]}"
    if not error <= max(1.25 * own, TOLERANCE["fp32"]):
        return f"compiled {error:.1e} from fp32, eager {own:.1e}"
    said = f"compiled by inductor in {compile_s:.1f} s, error {error:.1e} (eager {own:.1e})"
    log.info("a decode step %s: timed at its next run", said)
    exe.step = f"decode step eager until timed against its compiled form ({said})"
    exe.offer(Offer(module, compiled, eager, inputs, state, said))
    return ""


def faster(exe: Step, offer: Offer) -> bool:
    """Whether `offer` runs within FASTER of the eager step's time (RUNS of each, alternating,
    on copies of its step), said in the log."""
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    try:
        for _ in range(RUNS):
            for name, (mod, call) in (("eager", (offer.eager, offer.eager)),
                                      ("compiled", (offer.module, offer.compiled))):
                t0 = time.perf_counter()
                exe.run_on(mod, call, offer.inputs, offer.state)
                times[name].append((time.perf_counter() - t0) * 1e3)
    except Exception as e:  # noqa: BLE001 - the step stays eager
        log.info("a decode step stays eager: its timing failed: %s: %s", type(e).__name__, e)
        exe.step = f"decode step eager: its compiled form's timing failed ({type(e).__name__})"
        return False
    eager, fast = statistics.median(times["eager"]), statistics.median(times["compiled"])
    kept = fast <= FASTER * eager
    log.info("a decode step %s: %s, %.2f -> %.2f ms a step", "serves compiled" if kept
             else "stays eager, not faster", offer.said, eager, fast)
    exe.step = (f"decode step {offer.said}: {eager:.2f} -> {fast:.2f} ms a step" if kept else
                f"decode step eager: compiled it ran {fast:.2f} ms a step against {eager:.2f} "
                f"ms eager, not {100 * (1 - FASTER):.0f}% faster")
    return kept
