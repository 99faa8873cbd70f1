"""A language model's warm-up: what its load does before it is READY, so that its first
generation runs at speed (engine.sequences.warm_up), as Triton's model warmup and
OpenVINO GenAI's pipeline do.

A dynamic-length model's buckets are built at their first use (cuvild/load/buckets.py); a
generation needs two of them at once, its decode step and its twin's longest prompt chunk
(the 200M Llama: 14.3 s of a first request at fp32, 43 s under a budget), so the load builds
both (a model exported for one token a step has its one shape built by the load itself).
Its decode step is then compiled by inductor in its worker (runtimes/compiled_step.py)
at a sequence's first step, the steps running eagerly meanwhile, and timed at the next: the
load runs those steps on a sequence of its own, waiting for the compile (up to SETTLE_S), so
that no request shares the cores with it. Other chunk lengths are built at their first use.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cuvild.core.loaded import LoadedModel, Out
from cuvild.load.buckets import last_logits, step_lengths
from cuvild.run.generate import INPUTS
from protos.orders import RawTensor

SETTLE_S = 120.0  # the longest a load waits for its decode step's compile (~11 s the first
# time on a machine, inductor's headers built; 3-4 s after)
# what a worker says of a step it compiles now (runtimes/compiled_step.py `start`'s words;
# not imported from there: it imports torch, which the daemon loads only to build)
COMPILING = "while inductor compiles"


def warm(runner: Any, describe: Callable[[str, str, str], str], model: LoadedModel,
         progress: Callable[[str], None]) -> list[str]:
    """A language model's warm-up: of a dynamic length, its decode step and its twin's
    longest prompt chunk built (`runner.miss`: each bucket built, or restored from its load
    record); its decode step settled (`settle`). What was done, in words; nothing for a
    model that is no language model."""
    if model.state is None or sorted(model.inputs) != sorted(INPUTS):
        return []
    lengths = step_lengths(model)
    longest = max((n for n in lengths if n > 1), default=None)
    wanted = []
    if model.family is not None:  # (of one shape, the load itself built it)
        wanted += [(model, 1, "its decode step")] if 1 in lengths else []
        if longest is not None:
            wanted.append((last_logits(model), longest, f"its {longest}-token prompt chunk"))
    done = []
    for target, n, what in wanted:
        progress(f"building {what}")
        runner.miss(target, shapes(model, n)).result()
        done.append(f"built {what}")
    if 1 in lengths:
        progress("compiling its decode step")
        said = settle(runner, describe, model)
        if said:
            done.append(said)
    return done


def shapes(model: LoadedModel, n: int) -> tuple[tuple[int, ...], ...]:
    """A step's input shapes for n tokens, in the model's input order."""
    return tuple((1, n) if name == INPUTS[0] else (n,) for name in model.inputs)


def settle(runner: Any, describe: Callable[[str, str, str], str], model: LoadedModel,
           limit_s: float = SETTLE_S) -> str:
    """Two decode steps on a sequence of the load's own: the first has the worker compile
    the step, the second (once the compile is done, or `limit_s` passed) times it against
    the eager one. How the step runs then, in words ("" where its worker says nothing)."""
    bucket = runner.resolve(model, [("int64", s) for s in shapes(model, 1)])
    live = runner.sequences.begin(model.key, f"load-warm-up-{time.monotonic_ns()}",
                                  sorted(model.parts_by_device))

    def step(position: int) -> None:
        values = {INPUTS[0]: np.zeros((1, 1), np.int64),
                  INPUTS[1]: np.array([position], np.int64)}
        inputs = [RawTensor(values[n].tobytes(), "int64", values[n].shape)
                  for n in model.inputs]
        runner.step(bucket, live, inputs, Out({}, raw=True))

    def now() -> list[str]:
        return [describe(bucket.key, r.id, r.device) for r in bucket.routes]

    try:
        step(0)
        deadline = time.monotonic() + limit_s
        while any(COMPILING in said for said in now()) and time.monotonic() < deadline:
            time.sleep(0.25)
        step(1)
    finally:
        runner.sequences.end(live, "ended (the load's warm-up)")
    return "; ".join(said for said in now() if said)
