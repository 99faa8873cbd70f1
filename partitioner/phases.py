"""A language model's plan priced for a generation: its prefill and its decode steps apart.

A model that keeps state (a causal LM exported with its KV cache as buffers) runs twice over:
once over the prompt (the prefill: matrix products over every prompt position, compute-bound),
then once per generated token (a decode step: a matrix-vector product per weight, bound by
the bytes read). One forward pass at the example's shape prices neither: a layer worth a GPU
for the prefill may read its weights little faster there than on the CPU, and the decode
steps are most of a generation's time. So the program is priced at two shapes, a prefill
chunk and a one-token step, and placed once for the `Generation` it typically serves: the
prefill's runs plus `generated` decode steps, each node's time the sum over those runs (its
cache must stay where its attention runs, so both phases share one placement). The plan's
parts are priced per decode step; `Plan.phases` holds each phase's predicted time for the plan,
for the peers' memory-only rule and for each device alone (`figures`).

The sum is exact for parts that run one after another (a decoder's layers do); where parts on
two devices overlap, the predicted generation is a little optimistic. A split predicted less
than SPLIT_GAIN faster than the best device alone gives way to that device (`one_device`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from partitioner.cost import CostModel
from partitioner.schedule import objective, simulate

PROMPT = 128  # tokens of a typical prompt: what a generation's plan is priced for
GENERATED = 128  # tokens generated after it
# A split must be predicted this much faster than the best device alone that holds the
# model, or that device serves it alone: a gain smaller than this is within what the cost
# model mispredicts (a larger one, up to cuvild/load/guard.py's GAIN, is timed against that
# device at the load's warm-up before the split serves).
SPLIT_GAIN = 1.1


@dataclass(frozen=True)
class Generation:
    """What a stateful model's plan is priced for: `prompt` tokens run in `runs` chunks of
    `chunk` tokens (1 where the program was exported for one token), then `generated`
    decode steps."""

    prompt: int = PROMPT
    generated: int = GENERATED
    chunk: int = 1

    @property
    def runs(self) -> int:
        return math.ceil(self.prompt / self.chunk)

    def describe(self) -> str:
        chunks = ("token by token" if self.chunk == 1 else "in one run" if self.runs == 1
                  else f"in {self.runs} runs of {self.chunk}")
        return (f"a {self.prompt}-token prompt {chunks}, then {self.generated} decode "
                "step(s)")


def shapes(symbols: dict[str, tuple[int, int]], want: Generation
           ) -> tuple[Generation, dict[str, int], dict[str, int]]:
    """The generation as the program can run it, and its symbols' sizes at a prefill chunk
    and at a decode step. `symbols`: each symbolic size of the program's inputs and its range
    (a length exported dynamic: the prompt in one chunk, as long as the program takes);
    none: every run takes the example's shape, the prompt token by token."""
    if not symbols:
        return Generation(want.prompt, want.generated, 1), {}, {}
    prompt = max(1, min(want.prompt, *(high for _, high in symbols.values())))
    prefill = {name: max(low, prompt) for name, (low, _) in symbols.items()}
    decode = {name: max(low, 1) for name, (low, _) in symbols.items()}
    return Generation(prompt, want.generated, prompt), prefill, decode


def combined(prefill: CostModel, decode: CostModel, gen: Generation) -> CostModel:
    """One CostModel whose every time is a generation's: the prefill's `runs` plus the
    decode's `generated` of it (node and call times, copies: bytes and each copy's latency).
    Memory is the prefill's (the larger activations; the weights are the same)."""
    if [n.name for n in prefill.graph.nodes] != [n.name for n in decode.graph.nodes]:
        raise ValueError("the prefill and decode graphs differ in their nodes")
    a, b = gen.runs, gen.generated

    def mix(x: float, y: float) -> float:
        return a * x + b * y

    model = copy.copy(prefill)
    model.node_ms = [[mix(x, y) for x, y in zip(p, d, strict=True)]
                     for p, d in zip(prefill.node_ms, decode.node_ms, strict=True)]
    model.roofline_ms = [[mix(x, y) for x, y in zip(p, d, strict=True)]
                         for p, d in zip(prefill.roofline_ms, decode.roofline_ms, strict=True)]
    model.penalty = [[mix(x, y) for x, y in zip(p, d, strict=True)]
                     for p, d in zip(prefill.penalty, decode.penalty, strict=True)]
    model.call_ms = [mix(x, y) for x, y in zip(prefill.call_ms, decode.call_ms, strict=True)]
    model.kernel_ms = [mix(x, y) for x, y in zip(prefill.kernel_ms, decode.kernel_ms,
                                                 strict=True)]
    model.in_edges = [[(u, mix(x, y)) for (u, x), (_, y) in zip(p, d, strict=True)]
                      for p, d in zip(prefill.in_edges, decode.in_edges, strict=True)]
    model.node_inputs = [[(i, mix(x, y)) for (i, x), (_, y) in zip(p, d, strict=True)]
                         for p, d in zip(prefill.node_inputs, decode.node_inputs, strict=True)]
    model.out_bytes = [mix(x, y) for x, y in zip(prefill.out_bytes, decode.out_bytes,
                                                 strict=True)]
    runs = a + b
    model.cut_fixed = [[f * runs for f in row] for row in prefill.cut_fixed]
    model.device_link = [None if link is None else (link[0], link[1] * runs)
                         for link in prefill.device_link]
    # (the edges priced by the searches' moves; the nodes' own bytes stay the prefill's,
    # which the memory check reads)
    model.graph = copy.copy(prefill.graph)
    model.graph.edge_bytes = {key: mix(x, decode.graph.edge_bytes[key])
                              for key, x in prefill.graph.edge_bytes.items()}
    model.graph.edges = [dataclasses.replace(e, bytes=model.graph.edge_bytes[(e.src, e.dst)])
                         for e in prefill.graph.edges]
    return model


def holders(model: CostModel) -> list[int]:
    """The devices that can run every node and hold the whole model alone."""
    return [d for d in range(model.k) if all(d in allowed for allowed in model.allowed)
            and not model.memory_over([d] * model.n)]


def one_device(whole: CostModel, assign: list[int]) -> tuple[list[int], list[str]]:
    """`assign`, or the best device alone that can run and hold the whole model where the
    split is predicted less than SPLIT_GAIN faster than it (`whole`: the generation's cost
    model), with a note saying so."""
    used = sorted(set(assign))
    if len(used) < 2:
        return assign, []
    alone = {d: objective(whole, [d] * whole.n) for d in holders(whole)}
    if not alone:
        return assign, []
    best = min(alone, key=alone.__getitem__)
    gain = alone[best] / max(objective(whole, assign), 1e-12)
    if gain >= SPLIT_GAIN:
        return assign, []
    names = ", ".join(whole.devices[d].id for d in used)
    return [best] * whole.n, [
        f"one device: the split over {names} was predicted {gain:.2f}x as fast as "
        f"{whole.devices[best].id} alone, under the {SPLIT_GAIN}x a split must gain: "
        f"{whole.devices[best].id} alone"]


def figures(prefill: CostModel, decode: CostModel, gen: Generation, assign: Sequence[int],
            rule: tuple[Sequence[int], int] | None = None) -> dict[str, Any]:
    """Plan.phases: the generation priced, and each phase's predicted time for this plan,
    for the peers' memory-only rule (`rule`: its placement and device, where memory bound
    the plan) and for each device alone (None where a node cannot run there or the model
    does not fit its memory)."""
    def priced(where: Sequence[int]) -> dict[str, float]:
        first = simulate(prefill, where).latency_ms
        step = simulate(decode, where).latency_ms
        return {"prefill_ms": first * gen.runs, "step_ms": step,
                "total_ms": first * gen.runs + step * gen.generated}

    held = holders(prefill)
    alone = {dev.id: priced([d] * prefill.n) if d in held else None
             for d, dev in enumerate(prefill.devices)}
    out: dict[str, Any] = {"prompt": gen.prompt, "chunk": gen.chunk, "runs": gen.runs,
                           "generated": gen.generated, "plan": priced(assign), "alone": alone}
    if rule is not None:
        out["memory_rule"] = {**priced(rule[0]), "device": prefill.devices[rule[1]].id}
    return out
