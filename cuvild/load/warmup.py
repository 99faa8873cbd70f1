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
Under a budget, a generation of the two is then checked against the program at fp32, and
where it measures over the budget their searched parts are built again at fp32 (`held`).

Then, where the load planned a split that another plan may beat (cuvild/load/guard.py: a
split predicted less than guard.GAIN faster than the best device alone, or a plan moved by
what the cost model learned), the warm-up builds that plan too, times a generation of each
in turn and serves the faster (`guarded`): a language model's split must be faster than one
device by measurement, as a static model's is. Both are timed eagerly, their steps run on
fresh state (no sequence: nothing starts a compile), and only the one served has its decode
step compiled, after (the 200M Llama split over the CPU and an NPU that holds half of it:
READY in 134 -> 114 s, the split's four stateful parts no longer compiled, 33 s, for a plan
then dropped).
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from cuvild.core.loaded import LoadedModel, Out
from cuvild.load import buckets, guard, warm
from cuvild.load.buckets import last_logits, step_lengths
from cuvild.run.generate import INPUTS, served_step
from protos.orders import RawTensor

if TYPE_CHECKING:
    from cuvild.load.builder import Builder
    from partitioner.plan import Plan

log = logging.getLogger(__name__)
ROUNDS = 3  # a guard's timed generations of each plan, in turn
STEPS = 8  # decode steps timed in each (the generation's others priced at their median)
SETTLE_S = 120.0  # the longest a load waits for its decode step's compile (~11 s the first
# time on a machine, inductor's headers built; 3-4 s after)
# what a worker says of a step it compiles now (runtimes/compiled_step.py `start`'s words;
# not imported from there: it imports torch, which the daemon loads only to build)
COMPILING = "while inductor compiles"


def warm_up(builder: Builder, model: LoadedModel, progress: Callable[[str], None],
            compile_step: bool = True) -> list[str]:
    """A language model's warm-up: of a dynamic length, its decode step and its twin's
    longest prompt chunk built (`runner.miss`: each bucket built, or restored from its load
    record); its decode step settled (`settle`), unless `compile_step` is False or its plan
    is still to be timed (`guarded` settles the one it serves). What was done, in words;
    nothing for a model that is no language model."""
    if model.state is None or sorted(model.inputs) != sorted(INPUTS):
        return []
    runner, describe = builder.runner, builder.describe
    lengths = step_lengths(model, runner.max_dim)
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
    pending = model.family is not None and model.family.alternative is not None
    compiles = 1 in lengths and compile_step and not pending
    if compiles:
        done += settled(runner, describe, model, progress)
    reference = model.family.reference if model.family is not None else None
    if reference is not None and 1 in lengths:
        model.family.reference = None  # (the program's tensors go with the check)
        progress("checking a generation against fp32")
        said = held(builder, model, reference, longest or 1, compiles, progress)
        model.plan.notes.append(said)
        done.append(said)
        if model.family.record_at is not None:  # (a restart serves it with the note)
            warm.write_dynamic(model.family.record_at, model)
    return done


CHECKED_STEPS = 16  # decode steps of the warm-up's generation check, after its prompt


def held(builder: Builder, model: LoadedModel, program: Any, prompt_len: int,
         compiles: bool = False, progress: Callable[[str], None] = lambda phase: None,
         budget: float | None = None) -> str:
    """A generation checked against the program at fp32 (`generation_error`) and, where it
    measures over the budget (the policy's, unless `budget` is given), the parts the budget
    searched built again at fp32 (cuvild/load/buckets.py `again_at`: the choice recorded, so
    a restart builds that too), checked again after each: the decode step's first (a
    generation compounds its error, step after step, and a prompt chunk's mix was held one
    step ahead already), then the longest prompt chunk's. `compiles`: the decode step is
    compiled again once rebuilt (`settle`). What was measured and done, in words."""
    assert model.state is not None
    steps = max(0, min(CHECKED_STEPS, model.state.context - prompt_len - 1))
    if budget is None:
        budget = model.policy.max_error if model.policy is not None else None
    fp32 = fp32_generation(model, program, prompt_len, steps)  # (once: each check reads it)
    error = generation_error(builder.runner, model, program, prompt_len, steps, fp32)
    said = checked_words(prompt_len, steps, error, budget)
    if budget is None or error <= budget:
        return said
    why = (f"built at fp32 again: a generation at the precisions searched measured "
           f"{error:.1e} against fp32, over the budget {budget:.0e}")
    rebuilt = []
    todo = [(model, 1, "its decode step")]
    if prompt_len > 1:
        todo.append((last_logits(model), prompt_len, f"its {prompt_len}-token prompt chunk"))
    for target, n, what in todo:
        progress(f"building {what} again at fp32")
        if buckets.again_at(builder, target, shapes(model, n), "fp32", why) is None:
            continue  # (its searched parts run fp32 already)
        rebuilt.append(what)
        if n == 1 and compiles:
            settle(builder.runner, builder.describe, model)
        error = generation_error(builder.runner, model, program, prompt_len, steps, fp32)
        if error <= budget:
            break
    if rebuilt:
        said += (f"; {' and '.join(rebuilt)} built again at fp32: error {error:.1e}"
                 + (": still OVER the budget" if error > budget else ""))
    else:
        said += " at fp32 too"
    if error > budget:
        log.warning("model %s: %s", model.key, said)
    return said


def checked_words(prompt_len: int, steps: int, error: float, budget: float | None) -> str:
    return (f"a generation checked at its load: a {prompt_len}-token prompt, then {steps} "
            f"steps fed fp32's tokens: error {error:.1e} against fp32"
            + (f" (budget {budget:.0e})" if budget is not None else "")
            + (": OVER the budget" if budget is not None and error > budget else ""))


def fp32_generation(model: LoadedModel, program: Any, prompt_len: int,
                    steps: int) -> tuple[list[int], list[np.ndarray], list[int]]:
    """A prompt of `prompt_len` random tokens (below the embedding's rows), and the program's
    fp32 logits and greedy tokens for it and `steps` steps after (`reference_generation`)."""
    high = next((s.get("high") for s in model.input_specs if s.get("name") == INPUTS[0]),
                None) or 2
    prompt = np.random.default_rng(0).integers(0, high, prompt_len).tolist()
    return prompt, *reference_generation(program, model.inputs, prompt, steps)


def generation_error(runner: Any, model: LoadedModel, program: Any, prompt_len: int,
                     steps: int, fp32: tuple[list[int], list[np.ndarray], list[int]] | None = None,
                     ) -> float:
    """A generation of the buckets served against the program at fp32: a prompt of
    `prompt_len` random tokens in one chunk, then `steps` decode steps fed the tokens fp32
    picks (teacher-forced, so one early difference does not change every later input);
    the last position's logits of each run against fp32's (`set_error`, the budget's
    metric). The prompt chunk's check holds its own logits and the step after it
    (runtimes/mixed.py `After`), the decode step's its own from a fresh state: this holds
    the two together over a generation, each reading the cache the others wrote. `fp32`:
    `fp32_generation`'s, where it was run already."""
    from runtimes.base import set_error

    prompt, want, tokens = fp32 or fp32_generation(model, program, prompt_len, steps)
    live = runner.sequences.begin(model.key, f"load-check-{time.monotonic_ns()}",
                                  sorted(model.parts_by_device))
    try:
        step = served_step(runner, model, last_logits(model), live)
        got = [step(prompt, 0)[-1]] + [step([t], prompt_len + i)[-1]
                                       for i, t in enumerate(tokens)]
    finally:
        runner.sequences.end(live, "ended (the load's generation check)")
    return set_error([[g] for g in got], [[w] for w in want])


def reference_generation(program: Any, names: list[str], prompt: list[int],
                         steps: int) -> tuple[list[np.ndarray], list[int]]:
    """fp32 torch eager's last logits for `prompt`, then for `steps` greedy tokens fed one
    at a time (the tokens fed: one per step), on the program's state (put back after)."""
    import torch
    import torch.utils._pytree as pytree

    from runtimes.base import reset
    from runtimes.torch_eager import remember_initial

    module, spec = program.module(), program.call_spec.in_spec
    remember_initial(module)

    def run(ids: list[int], position: int) -> np.ndarray:
        values = {INPUTS[0]: torch.tensor([ids]),
                  INPUTS[1]: torch.arange(position, position + len(ids))}
        args, kwargs = pytree.tree_unflatten([values[n] for n in names], spec)
        logits = pytree.tree_flatten(module(*args, **kwargs))[0][0]
        return logits[0, -1].float().numpy().copy()

    want, tokens = [], []
    with torch.no_grad():
        try:
            want.append(run(prompt, 0))
            for i in range(steps):
                tokens.append(int(np.argmax(want[-1])))
                want.append(run([tokens[-1]], len(prompt) + i))
        finally:
            reset(module)
    return want, tokens


def settled(runner: Any, describe: Callable[[str, str, str], str], model: LoadedModel,
            progress: Callable[[str], None]) -> list[str]:
    """`settle`, said as a phase; its words as a list (none where its worker says none)."""
    progress("compiling its decode step")
    said = settle(runner, describe, model)
    return [said] if said else []


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


def guarded(builder: Builder, model: LoadedModel,
            load: Callable[[str, Plan, bool], LoadedModel],
            progress: Callable[[str], None]) -> tuple[LoadedModel, list[str]]:
    """A warmed-up language model, or the plan it is timed against where that measures
    faster (`family.alternative`: cuvild/load/guard.py): that plan is built and warmed up
    under the key + "~one" (`load(key, plan, keep_record)`), a generation of each timed in
    turn (`generation_ms`, eagerly), the other dropped; where it wins, the model is built
    again on it under its own key (from the compile cache) and warmed up. The plan served
    says both figures; its decode step is compiled then (`settle`: the one served only).
    The model served, and what its compile did, in words."""
    kept = model.family.alternative if model.family else None
    if kept is None:
        return model, []
    model.family.alternative = None
    theirs_plan, ours, theirs = kept
    progress(f"timing the plan {theirs} against the one {ours}")
    try:
        # (a copy: its build writes the precisions it chose into the plan's parts)
        other = load(f"{model.key}~one", copy.deepcopy(theirs_plan), False)
        if other.family is not None:  # (timed only: a generation of it is not checked)
            other.family.reference = None
        warm_up(builder, other, lambda phase: None, compile_step=False)
        ours_ms, theirs_ms = generation_ms(builder.runner, [model, other])
    except Exception as e:  # noqa: BLE001 - the plan stands, and says why
        model.plan.notes.append(guard.failed(ours, theirs, e))
        return model, settled(builder.runner, builder.describe, model, progress)
    finally:
        builder.unload(f"{model.key}~one")
    if theirs_ms < ours_ms:
        builder.unload(model.key)
        theirs_plan.notes.append(guard.note(ours_ms, theirs_ms, ours, theirs, False, WHAT))
        served = load(model.key, theirs_plan, True)
        return served, warm_up(builder, served, progress)
    model.plan.notes.append(guard.note(ours_ms, theirs_ms, ours, theirs, True, WHAT))
    assert model.family is not None
    if model.family.record_at is not None:  # (a restart serves it with the note)
        warm.write_dynamic(model.family.record_at, model)
    return model, settled(builder.runner, builder.describe, model, progress)


WHAT = "a generation"  # what the guard's note says was timed


def generation_ms(runner: Any, models: list[LoadedModel],
                  rounds: int = ROUNDS) -> list[float]:
    """Per model, the generation its plan was priced for (partitioner/phases.py: a prompt
    of N tokens, then M tokens), measured eagerly: a prompt chunk of its longest length and
    STEPS decode steps at the positions after it, the models in turn, `rounds` times; the
    prompt's chunks at their median, the steps at theirs."""
    chunks: list[list[float]] = [[] for _ in models]
    steps: list[list[float]] = [[] for _ in models]
    for _ in range(rounds):
        for i, model in enumerate(models):
            chunk, step = _timed(runner, model)
            chunks[i] += chunk
            steps[i] += step
    out = []
    for model, chunk, step in zip(models, chunks, steps, strict=True):
        phases = model.plan.phases or {"prompt": 0, "generated": 1}
        longest = max((n for n in step_lengths(model, runner.max_dim) if n > 1), default=1)
        prompt = (math.ceil(phases["prompt"] / longest) * statistics.median(chunk) if chunk
                  else phases["prompt"] * statistics.median(step))
        out.append(prompt + phases["generated"] * statistics.median(step))
    return out


def _timed(runner: Any, model: LoadedModel) -> tuple[list[float], list[float]]:
    """`model`'s longest prompt chunk's ms (none where it takes one token a run) and its
    decode steps' after it, each run on fresh state (no sequence's: a sequence's first
    step would start its decode step's compile, runtimes/compiled_step.py; the state's copy
    costs both plans alike, the same bytes)."""
    longest = max((n for n in step_lengths(model, runner.max_dim) if n > 1), default=None)
    assert model.state is not None

    def run(target: LoadedModel, position: int, n: int) -> float:
        bucket = runner.resolve(target, [("int64", s) for s in shapes(model, n)])
        values = {INPUTS[0]: np.zeros((1, n), np.int64),
                  INPUTS[1]: np.arange(position, position + n, dtype=np.int64)}
        inputs = [RawTensor(values[name].tobytes(), "int64", values[name].shape)
                  for name in model.inputs]
        t0 = time.perf_counter()
        runner.execute(bucket, inputs, Out({}, raw=True))
        return (time.perf_counter() - t0) * 1e3

    chunk = [run(last_logits(model), 0, longest)] if longest else []
    start = longest or 0
    count = max(1, min(STEPS, model.state.context - start - 1))
    return chunk, [run(model, start + i, 1) for i in range(count)]
