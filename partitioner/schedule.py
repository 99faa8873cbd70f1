"""Simulate one assignment: form parts, price the cuts, run parts on their devices in order.

`run` is the lean inner loop placement calls thousands of times (plain lists, no objects per
part); `simulate` dresses its result as a Schedule for plans and reports. Both see the model
only through CostModel's precomputed tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from partitioner.cost import CostModel

HOST = -1  # where graph inputs come from and graph outputs go


@dataclass
class PartTiming:
    device: int
    precision: int  # index into CostModel.precisions
    nodes: list[int]
    compute_ms: float  # call + nodes (kernels included)
    start_ms: float = 0.0
    finish_ms: float = 0.0


@dataclass
class CutTiming:
    src: int  # part index, or HOST for graph inputs
    dst: int  # part index, or HOST for graph outputs
    bytes: int
    ms: float
    tensors: list[int] = field(default_factory=list)  # producing node indices (none for inputs)


@dataclass
class Schedule:
    """The predicted run of one assignment."""

    value: float  # the objective plus preference penalties: what placement minimises
    latency_ms: float
    period_ms: float
    penalty_ms: float
    part_of: list[int]
    parts: list[PartTiming]
    cuts: list[CutTiming]
    busy_ms: list[float]


class Run:
    """Result of `run`: per-part lists and the transfers, indexed by part."""

    __slots__ = ("value", "latency", "period", "penalty", "part_of", "dev", "prec", "compute",
                 "start", "finish", "busy", "pairs", "moved")


def run(model: CostModel, assign: Sequence[int], m: int) -> Run:
    """Simulate the first m nodes of `assign` (see CostModel for the rules)."""
    r = Run()
    _form_parts(model, assign, m, r)
    _price_cuts(model, m, r)
    _timeline(model, r)
    r.penalty = sum(model.penalty[v][assign[v]] for v in range(m))
    r.value = (r.latency if model.objective == "latency" else r.period) + r.penalty
    return r


def _form_parts(model: CostModel, assign: Sequence[int], m: int, r: Run) -> None:
    """Parts whose quotient graph is acyclic.

    A node's rank is the largest rank of its predecessors, plus one across a change of device
    or precision; a part is all nodes of one (rank, device, precision). Every edge between
    parts goes to a strictly higher rank, so parts in rank order are a topological order.
    """
    labels = len(model.precisions)
    width = model.k * labels
    preds, prec = model.preds, model.prec
    rank = [0] * m
    lab = [0] * m
    key = [0] * m
    for v in range(m):
        lv = assign[v] * labels + prec[v]
        best = 0
        for u in preds[v]:
            x = rank[u] if lab[u] == lv else rank[u] + 1
            if x > best:
                best = x
        rank[v] = best
        lab[v] = lv
        key[v] = best * width + lv
    keys = sorted(set(key))
    order = {kk: i for i, kk in enumerate(keys)}
    r.part_of = [order[kk] for kk in key]
    r.dev = [(kk % width) // labels for kk in keys]
    r.prec = [kk % labels for kk in keys]
    compute = [model.call_ms[d] for d in r.dev]
    node_ms = model.node_ms
    part_of = r.part_of
    for v in range(m):
        compute[part_of[v]] += node_ms[v][assign[v]]
    r.compute = compute


def _price_cuts(model: CostModel, m: int, r: Run) -> None:
    """Bytes per (src part, dst part); a tensor goes once to each part that reads it."""
    part_of = r.part_of
    moved: dict[tuple[int, int], int] = {}
    for v in range(m):
        pv = part_of[v]
        for u, b in model.in_edges[v]:
            if part_of[u] != pv and moved.get((u, pv), -1) < b:
                moved[(u, pv)] = b
    pairs: dict[tuple[int, int], int] = {}
    for (u, pv), b in moved.items():
        key = (part_of[u], pv)
        pairs[key] = pairs.get(key, 0) + b
    seen: set[tuple[int, int]] = set()
    for v in range(m):
        pv = part_of[v]
        for x, b in model.node_inputs[v]:
            if (x, pv) not in seen:
                seen.add((x, pv))
                pairs[(HOST, pv)] = pairs.get((HOST, pv), 0) + b
        if model.out_bytes[v]:
            pairs[(pv, HOST)] = pairs.get((pv, HOST), 0) + model.out_bytes[v]
    r.pairs, r.moved = pairs, moved


def _timeline(model: CostModel, r: Run) -> None:  # noqa: C901 - the simulation's event loop
    """Parts in rank order, each as soon as its inputs arrived and its device is free."""
    k = model.k
    per_byte, fixed = model.cut_per_byte, model.cut_fixed
    dev, compute = r.dev, r.compute
    inbound: list[list[tuple[int, int]]] = [[] for _ in dev]
    outbound: list[tuple[int, int]] = []
    for (s, d), b in r.pairs.items():
        if d == HOST:
            outbound.append((s, b))
        else:
            inbound[d].append((s, b))
    free = [0.0] * k
    busy = [0.0] * k
    link_in = [0.0] * k
    link_out = [0.0] * k
    link = model.device_link  # per device: (ms per byte, ms per copy), None for host devices
    start = [0.0] * len(dev)
    finish = [0.0] * len(dev)
    latency = 0.0
    for p, d in enumerate(dev):
        t = free[d]
        for s, b in inbound[p]:
            sd = dev[s] if s != HOST else k
            ready = (finish[s] if s != HOST else 0.0) + b * per_byte[sd][d] + fixed[sd][d]
            if ready > t:
                t = ready
            if sd != d:
                if sd < k and link[sd]:
                    link_out[sd] += b * link[sd][0] + link[sd][1]
                if link[d]:
                    link_in[d] += b * link[d][0] + link[d][1]
        start[p] = t
        finish[p] = free[d] = t + compute[p]
        busy[d] += compute[p]
        if finish[p] > latency:
            latency = finish[p]
    for s, b in outbound:
        sd = dev[s]
        done = finish[s] + b * per_byte[sd][k] + fixed[sd][k]
        if done > latency:
            latency = done
        if link[sd]:
            link_out[sd] += b * link[sd][0] + link[sd][1]
    r.start, r.finish, r.busy, r.latency = start, finish, busy, latency
    r.period = max(busy + link_in + link_out) if k else 0.0


def objective(model: CostModel, assign: Sequence[int]) -> float:
    """The objective of a full assignment: what placement minimises."""
    return run(model, assign, model.n).value


def simulate(model: CostModel, assign: Sequence[int], m: int | None = None) -> Schedule:
    """`run` of the first m nodes (all by default), dressed as a Schedule with parts, cuts and
    the tensors each cut moves."""
    m = model.n if m is None else m
    r = run(model, assign, m)
    parts = [
        PartTiming(r.dev[p], r.prec[p], [], r.compute[p], r.start[p], r.finish[p])
        for p in range(len(r.dev))
    ]
    for v in range(m):
        parts[r.part_of[v]].nodes.append(v)
    tensors: dict[tuple[int, int], list[int]] = {}
    for u, pv in r.moved:
        tensors.setdefault((r.part_of[u], pv), []).append(u)
    k = model.k
    cuts = []
    for (s, d), b in r.pairs.items():
        sd = r.dev[s] if s != HOST else k
        dd = r.dev[d] if d != HOST else k
        names = tensors.get((s, d), [])
        if d == HOST:
            names = [v for v in parts[s].nodes if model.out_bytes[v]]
        cuts.append(CutTiming(s, d, b, model.cut_ms(b, sd, dd), sorted(names)))
    return Schedule(r.value, r.latency, r.period, r.penalty, r.part_of, parts, cuts, r.busy)
