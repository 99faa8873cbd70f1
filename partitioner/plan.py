"""The Plan: parts (nodes, device, runtime, precision), cuts between them, predicted times.

A Plan is plain data (`to_dict` / `from_dict` round-trip through JSON); partitioner/report.py
prints it as tables (`explain`) and draws it (`to_dot`). `plan_model` is the one entry point
from a model to a Plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from partitioner import phases
from partitioner.corrections import Corrections, kernel_count, prior
from partitioner.cost import CostModel, Support
from partitioner.costgraph import PRECISIONS, CostGraph
from partitioner.phases import Generation
from partitioner.place import memory_rule, place
from partitioner.profile import DeviceProfile, load_profiles, profiles_from_data
from partitioner.schedule import HOST, simulate

IO = "host"  # the src of graph-input copies and the dst of graph-output copies


@dataclass
class Part:
    id: str
    device: str
    runtime: str
    precision: str
    nodes: list[str]  # graph node names, in graph order (folded getitems follow their op)
    predicted_ms: float  # call + kernels + nodes
    gflops: float = 0.0
    start_ms: float = 0.0
    finish_ms: float = 0.0
    # The profile's (roofline) ms of the part's nodes per op class, before any correction:
    # what a measured part teaches the corrections with, and what they re-price it from.
    class_ms: dict[str, float] = field(default_factory=dict)
    # The precision request of the part's nodes: "fixed" (a dtype was asked for), "auto"
    # (the fastest precision within max_error, else the model's budget) or "" (the model's
    # precision policy decides). `error` is the relative error the part measured at its
    # precision against torch eager, once it is built (runtimes/base.py relative_error).
    policy: str = ""
    max_error: float | None = None
    error: float | None = None
    # how many of its nodes run as a kernel of their own on a GPU (partitioner/corrections.py)
    kernels: int = 0


@dataclass
class Cut:
    src: str  # part id, or "host" for graph inputs
    dst: str  # part id, or "host" for graph outputs
    bytes: int
    predicted_ms: float
    tensors: list[str] = field(default_factory=list)  # graph values that cross


@dataclass
class Plan:
    parts: list[Part]
    cuts: list[Cut]
    predicted_ms: float  # the objective: latency, or the pipeline period for throughput
    peak_bytes: dict[str, int]
    objective: str = "latency"
    notes: list[str] = field(default_factory=list)
    latency_ms: float = 0.0
    period_ms: float = 0.0
    method: str = ""
    proven_optimal: bool = False
    # a stateful model's generation, priced (partitioner/phases.py `figures`); {} otherwise
    phases: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; `cuts` holds copies between parts and to/from the host."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        data = dict(data)
        data["parts"] = [Part(**p) for p in data.get("parts", [])]
        data["cuts"] = [Cut(**c) for c in data.get("cuts", [])]
        return cls(**data)


def plan_model(
    model: Any,
    devices: Sequence[DeviceProfile | dict[str, Any]] | str | Path,
    objective: str = "latency",
    support: dict[str, Support] | None = None,
    method: str = "auto",
    corrections: Corrections | None = None,
    sizes: dict[str, int] | None = None,
    precision: str = "fp32",
    int8: bool = False,
    generation: Generation | None = None,
) -> Plan:
    """Plan a model (ExportedProgram or CostGraph) on devices (profiles, dicts or a YAML path).

    `objective` is "latency" (one request end to end) or "throughput" (pipeline period).
    `support` maps a device id to a predicate on CostNode (True: the device can run it; the
    node's `fx_node` is the graph node when the graph came from a program) or a collection
    of op names it cannot run; devices without an entry run everything. `corrections` are
    what measured parts taught the cost model (partitioner/corrections.py); the plan's notes
    say which applied. `sizes` prices a dynamic-shape program at these sizes of its symbols
    ("s0" -> 8) instead of its example's. `precision` is the model's policy ("fp32", "auto"):
    an `auto` node is priced at the precision its device would run it at (`int8`: the model
    has calibration inputs, so int8 may be tried); the plan's notes say which.
    A program that keeps state (it updates buffers in place: a language model's cache) is
    priced for a generation (partitioner/phases.py: `generation`, else a 128-token prompt and
    128 tokens generated), its prefill and its decode steps apart; so is a pair of CostGraphs
    (prefill, decode) with `generation` given. Its parts are priced per decode step and
    `Plan.phases` holds each phase's figures.
    Raises PlacementError when a strict annotation cannot be honoured or no device can run
    a node, ValueError on bad profiles or arguments.
    """
    if isinstance(devices, (str, Path)):
        devices = load_profiles(devices)
    elif any(isinstance(d, dict) for d in devices):
        devices = profiles_from_data([d if isinstance(d, dict) else d.to_dict() for d in devices])

    def costed(graph: CostGraph) -> CostModel:
        return CostModel(graph, devices, objective, support, corrections, precision, int8)

    phased = None if sizes else _phase_graphs(model, generation)
    if phased is None:
        cost = costed(model if isinstance(model, CostGraph) else _costgraph(model, sizes))
        placement = place(cost, method)
        assign = placement.assign
        plan = build_plan(cost, assign, placement.notes, placement.method,
                          placement.proven_optimal)
    else:
        gen, first, step = phased[0], costed(phased[1]), costed(phased[2])
        whole = phases.combined(first, step, gen)
        placement = place(whole, method)
        assign, alone = phases.one_device(whole, placement.assign)
        said = (f"priced for a generation, {gen.describe()}: the parts' times are a decode "
                "step's, the notes' the whole generation's")
        plan = build_plan(step, assign, [said, *(alone or placement.notes)], placement.method,
                          placement.proven_optimal and not alone)
        rule = memory_rule(whole)
        if rule is not None and all(d == rule[1] for d in rule[0]):
            rule = None  # (all of it fits its fastest device: that device alone, below)
        plan.phases = phases.figures(first, step, gen, assign, rule)
        cost = step
    priced = _priced_lower(cost, assign)
    if priced:
        plan.notes.append("priced at the precision `auto` would run: " + ", ".join(priced))
    if corrections:
        priors = {d.id: prior(d) for d in cost.devices}
        used = [line for dev in sorted({p.device for p in plan.parts})
                for line in corrections.describe(dev, priors)]
        if used:
            plan.notes.append("cost corrections learned from measured parts: " + "; ".join(used))
    return plan


def _priced_lower(cost: CostModel, assign: Sequence[int]) -> list[str]:
    """'cpu0 at bf16' for each device whose `auto` nodes were priced below fp32."""
    found: dict[str, set[str]] = {}
    for node, d in zip(cost.graph.nodes, assign, strict=True):
        if cost.is_auto(node):
            found.setdefault(cost.devices[d].id, set()).add(
                cost.run_precision(node, cost.devices[d]))
    return [f"{dev} at {'/'.join(sorted(p - {'fp32'}))}" for dev, p in sorted(found.items())
            if p - {"fp32"}]


def build_plan(
    cost: CostModel,
    assign: Sequence[int],
    notes: Sequence[str] = (),
    method: str = "",
    proven_optimal: bool = False,
) -> Plan:
    """The Plan of an assignment under a cost model."""
    schedule = simulate(cost, assign)
    graph, devices = cost.graph, cost.devices
    parts = []
    for p, timing in enumerate(schedule.parts):
        dev = devices[timing.device]
        names = []
        class_ms: dict[str, float] = {}
        for v in timing.nodes:
            names += [graph.nodes[v].name, *graph.nodes[v].aliases]
            cls = graph.nodes[v].category
            class_ms[cls] = class_ms.get(cls, 0.0) + cost.roofline_ms[v][timing.device]
        asked = cost.precisions[timing.precision]
        budgets = [graph.nodes[v].annotation.max_error for v in timing.nodes  # type: ignore
                   if graph.nodes[v].annotation and graph.nodes[v].annotation.max_error]
        parts.append(Part(
            id=f"p{p}",
            device=dev.id,
            runtime=dev.runtimes[0] if dev.runtimes else "",
            precision=(asked if asked in PRECISIONS
                       else _dominant_dtype(graph, timing.nodes)),
            nodes=names,
            predicted_ms=timing.compute_ms,
            gflops=sum(graph.nodes[v].flops for v in timing.nodes) / 1e9,
            start_ms=timing.start_ms,
            finish_ms=timing.finish_ms,
            class_ms={c: ms for c, ms in sorted(class_ms.items()) if ms > 0},
            policy="auto" if asked == "auto" else "fixed" if asked else "",
            max_error=min(budgets) if budgets else None,
            kernels=kernel_count([graph.nodes[v].category for v in timing.nodes]),
        ))  # fmt: skip
    cuts = []
    for c in sorted(schedule.cuts, key=lambda c: (c.src != HOST, c.src, c.dst == HOST, c.dst)):
        tensors = []
        for v in c.tensors:
            tensors += _crossing_values(graph, v, schedule.part_of, c.dst)
        cuts.append(Cut(
            src=IO if c.src == HOST else f"p{c.src}",
            dst=IO if c.dst == HOST else f"p{c.dst}",
            bytes=int(c.bytes),
            predicted_ms=c.ms,
            tensors=tensors,
        ))  # fmt: skip
    peak = cost.peak_bytes(assign) if cost.n else [0] * cost.k
    return Plan(
        parts=parts,
        cuts=cuts,
        predicted_ms=schedule.value - schedule.penalty_ms,
        peak_bytes={dev.id: int(b) for dev, b in zip(devices, peak, strict=True)},
        objective=cost.objective,
        notes=list(notes),
        latency_ms=schedule.latency_ms,
        period_ms=schedule.period_ms,
        method=method,
        proven_optimal=proven_optimal,
    )


def _crossing_values(graph: CostGraph, u: int, part_of: list[int], dst: int) -> list[str]:
    """Names of u's values a part needs (getitems of a tuple result name their own values)."""
    if dst == HOST:
        return list(graph.nodes[u].output_names) or [graph.nodes[u].name]
    names: list[str] = []
    for w in graph.succs[u]:
        if part_of[w] == dst:
            names += [t for t in graph.edge_at[(u, w)].tensors if t not in names]
    return names or [graph.nodes[u].name]


def _dominant_dtype(graph: CostGraph, nodes: list[int]) -> str:
    counts = Counter(graph.nodes[v].dtype for v in nodes if graph.nodes[v].dtype in _FLOATS)
    return counts.most_common(1)[0][0] if counts else "fp32"


_FLOATS = ("fp32", "bf16", "fp16", "int8")


def _phase_graphs(model: Any, generation: Generation | None
                  ) -> tuple[Generation, CostGraph, CostGraph] | None:
    """A generation's (prefill, decode) graphs: of a program that keeps state, at a prefill
    chunk's and a decode step's sizes; a given pair of graphs as they are; None for anything
    else (a model without state is planned for one forward pass)."""
    if isinstance(model, tuple):
        if generation is None:
            raise ValueError("a (prefill, decode) pair of graphs needs its generation")
        return generation, model[0], model[1]
    if isinstance(model, CostGraph):
        return None
    from partitioner.fxgraph import input_symbols, keeps_state  # (torch: a real model only)

    if not keeps_state(model):
        return None

    gen, first, step = phases.shapes(input_symbols(model), generation or Generation())
    return gen, _costgraph(model, first), _costgraph(model, step)


def _costgraph(model: Any, sizes: dict[str, int] | None = None) -> CostGraph:
    from partitioner.fxgraph import build_costgraph  # imports torch: only for a real model

    return build_costgraph(model, sizes)
