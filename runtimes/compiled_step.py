"""A language model's decode step compiled by inductor at its first use, kept where it is faster.

A decode step computes one row: its time is the weights read once (the matrix-vector products)
and ~1000 small ops run one by one from Python, each cast, norm, rotary and cache write its own
dispatch. Inductor fuses the small ops into a few C++ loops and calls the products as they are
(the torch runtime's own: oneDNN's packed weights at fp32, torch's fp16 matrix-vector product),
as vLLM compiles its model before serving. The 200M Llama's decode step on the 2-core EPYC:
15.4 -> 12.6 ms at fp16; at fp32 (its products ~3/4 of the step) no faster, so it stays eager.

Tiered as a JIT is: a stateful part built for one row (`wanted`) runs eagerly until its first
step of a sequence, which compiles it (`tier_up`; ~15 s for that model here, inductor's cache
under the compile cache directory making a restart's shorter). That step, on copies of its
sequence's state (a prompt's cache), checks the compiled step against the part as exported
(fp32) beside the eager step, and times both, alternating; the compiled step serves only if
its error is within 1.25x of the eager step's and it runs within FASTER of its time, else
the part stays eager (the reason logged, as any failure to compile: no C++ compiler, a
graph inductor refuses). A precision search's variants never run a sequence, so only the
variant chosen is compiled.

What it compiles is the part without runtimes/attention.py's slicing (a key length read
from the mask each step would compile again at every length): the compiled step attends the
whole static cache, so where that costs more than it saves (a long context early in a
sequence) the timing keeps the eager step. Steps of several sequences batched together
(`run_batch`) run eagerly. `engine.sequences.compile_steps: false` turns it off (ENV).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from runtimes.base import TOLERANCE, set_error

log = logging.getLogger(__name__)
ENV = "CUVILD_COMPILE_STEPS"  # "0": decode steps stay eager (engine.sequences.compile_steps)
FASTER = 0.95  # the compiled step serves where it takes at most this share of the eager one's
RUNS = 5  # timed runs of each, alternating


class Step(Protocol):
    """What `tier_up` needs of the torch runtime's executable."""

    module: torch.fx.GraphModule

    def run_on(self, module: torch.fx.GraphModule, call: Callable[..., Any],
               inputs: Sequence[torch.Tensor], state: dict[str, torch.Tensor],
               ) -> list[torch.Tensor]: ...

    def serve_compiled(self, module: torch.fx.GraphModule,
                       compiled: Callable[..., Any]) -> None: ...


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def wanted(state: Sequence[str], rows: dict[str, int]) -> bool:
    """Whether a part is compiled at its first sequence step: it keeps state and every
    linear computes one row (a decode step)."""
    return bool(state) and bool(rows) and set(rows.values()) == {1} and enabled()


def tier_up(exe: Step, source: Callable[[], torch.fx.GraphModule],
            reference: torch.fx.GraphModule, inputs: Sequence[torch.Tensor],
            state: dict[str, torch.Tensor]) -> str:
    """Compile `source()` (the part as `exe` runs it, for inductor), check it and time it
    against `exe`'s own module on a sequence's step (`inputs` on copies of its `state`);
    where it holds and is faster, `exe` runs it from now on. What was decided, for the log.

    Held: its error against `reference` (the part as exported, fp32) within 1.25x of the
    eager step's own (a step at fp16 rounds differently wherever anything moves, ~7e-4 on
    the 200M Llama's logits, its eager error 2.5e-3), at least fp32's tolerance."""
    try:
        module = source()
        compiled = torch.compile(module, dynamic=False)
        t0 = time.perf_counter()
        got = exe.run_on(module, compiled, inputs, state)  # (compiles)
        compile_s = time.perf_counter() - t0
        want = exe.run_on(exe.module, exe.module, inputs, state)
        exact = exe.run_on(reference, reference, inputs, state)
        error, own = set_error([got], [exact]), set_error([want], [exact])
        if not error <= max(1.25 * own, TOLERANCE["fp32"]):
            return f"stays eager: compiled {error:.1e} from fp32, eager {own:.1e}"
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(RUNS):
            for name, (mod, call) in (("eager", (exe.module, exe.module)),
                                      ("compiled", (module, compiled))):
                t0 = time.perf_counter()
                exe.run_on(mod, call, inputs, state)
                times[name].append((time.perf_counter() - t0) * 1e3)
    except Exception as e:  # noqa: BLE001 - any compile failure leaves the step eager
        return f"stays eager: inductor failed: {type(e).__name__}: {str(e)[:300]}"
    eager, fast = statistics.median(times["eager"]), statistics.median(times["compiled"])
    said = (f"compiled by inductor in {compile_s:.1f} s: {eager:.2f} -> {fast:.2f} ms a step, "
            f"error {error:.1e} (eager {own:.1e})")
    if fast > FASTER * eager:
        return f"stays eager: {said}, not faster"
    exe.serve_compiled(module, compiled)
    return f"{said}, serves compiled"

