"""Placement: choose a device for every node, then say why wherever the choice is surprising.

`place` picks the method: the chain DP for chains (latency), branch and bound for graphs of
up to `exact_up_to` nodes, else the scalable heuristic (partitioner.heuristic). Whatever the
method, fragments below break-even are merged into a neighbour, the plan must fit each
device's memory, and every node placed away from its annotation or from its cheapest device
is explained in the notes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from partitioner import heuristic
from partitioner.cost import CostModel, PlacementError
from partitioner.exact import branch_and_bound, chain_dp, is_chain
from partitioner.fragments import merge_fragments
from partitioner.schedule import Schedule, objective, simulate

METHODS = ("auto", "chain", "exact", "scalable")
EXACT_UP_TO = 14  # nodes: branch and bound stays well under a second up to about here
KICKS_UP_TO = 200  # nodes: iterated local search below, one local search above
PRICED_GROUPS = 25  # groups of moved nodes whose reason is priced by a simulate each


@dataclass
class Placement:
    """An assignment (device index per node), its predicted run and the reasons behind it."""

    assign: list[int]
    schedule: Schedule
    method: str
    proven_optimal: bool
    notes: list[str] = field(default_factory=list)


def place(
    model: CostModel,
    method: str = "auto",
    exact_up_to: int = EXACT_UP_TO,
    max_visits: int = 200_000,
) -> Placement:
    """Place model.graph on model.devices, minimising model.objective."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if model.n == 0:
        return Placement([], simulate(model, []), "empty", True)
    if method == "auto":
        if model.objective == "latency" and is_chain(model):
            method = "chain"
        else:
            method = "exact" if model.n <= exact_up_to else "scalable"
    proven = False
    if method == "chain":
        assign, proven = chain_dp(model).assign, True
    else:
        assign = scalable(model)
        if method == "exact":
            result = branch_and_bound(model, assign, max_visits)
            assign, proven = result.assign or assign, result.proven
    searched = assign
    assign, notes = merge_fragments(model, assign)
    assign, fitted = fit_memory(model, assign)
    notes += fitted
    if fitted:  # memory bound the plan: beside the rule the peers use, the faster kept
        assign, said = against_memory_rule(model, assign)
        notes += said
    schedule = simulate(model, assign)
    notes += explain_moves(model, assign, schedule)
    return Placement(assign, schedule, method, proven and assign == searched, notes)


def scalable(model: CostModel) -> list[int]:
    """Coarsen, start from the best of list scheduling and every single device, refine."""
    groups = heuristic.coarsen(model)
    starts = [heuristic.greedy(model, groups)]
    starts += [heuristic.single_device(model, d) for d in range(model.k)]
    best = min(starts, key=lambda assign: objective(model, assign))
    swept = heuristic.sweep(model, best, groups)
    if objective(model, swept) < objective(model, best):
        best = swept
    if model.n <= KICKS_UP_TO:
        return heuristic.kick_and_refine(model, best, groups)[0]
    return heuristic.refine(model, best, groups)[0]


def fit_memory(
    model: CostModel, assign: list[int], rounds: int = 20
) -> tuple[list[int], list[str]]:
    """Move nodes off devices whose peak memory exceeds memory_gb, by speed: of the nodes
    that hold weights (else of any), first those that lose the least time per byte they
    free (an embedding lookup, or a memory-bound layer whose weights the other device reads
    nearly as fast, before a compute-bound one of the same size), each to its cheapest other
    device."""
    assign = list(assign)
    notes = []
    for _ in range(rounds):
        over = model.memory_over(assign)
        if not over:
            return assign, notes
        d, peak = max(over.items(), key=lambda item: item[1])
        cap = model.devices[d].memory_gb * 1e9
        movable = [v for v in range(model.n) if assign[v] == d and len(model.allowed[v]) > 1]
        if not movable:
            raise PlacementError(
                f"device {model.devices[d].id!r}: the plan needs {peak / 1e9:.2f} GB there but "
                f"memory_gb is {model.devices[d].memory_gb}, and no node on it may move"
            )
        # weights are what stays resident: nodes that hold some go first (moving a weightless
        # op frees a transient activation and adds a cut each side)
        weighted = [v for v in movable if model.graph.nodes[v].params]
        movable = (weighted or movable)
        movable.sort(key=lambda v: _loss_per_byte(model, assign, v, d))
        freed, moved = 0, []
        for v in movable:
            others = [e for e in model.allowed[v] if e != d and e not in over]
            if not others:
                continue
            assign[v] = min(others, key=model.node_ms[v].__getitem__)
            moved.append(v)
            freed += _resident_bytes(model, v)
            if freed >= peak - cap:
                break
        if not moved:
            raise PlacementError(f"device {model.devices[d].id!r}: over memory and nowhere to go")
        notes.append(
            f"moved {len(moved)} node(s) ({model.graph.describe(moved)}) off "
            f"{model.devices[d].id}: the plan needed {peak / 1e9:.2f} GB there, "
            f"{model.devices[d].memory_gb} GB fit"
        )
    raise PlacementError("could not fit the plan in device memory after moving nodes")


def _loss_per_byte(model: CostModel, assign: list[int], v: int, d: int) -> float:
    """What moving node v off device d costs per byte it frees there: its time on its
    cheapest other device less its time on d, and the copies of its inputs and outputs that
    would cross between them; a node that frees nothing last."""
    others = [e for e in model.allowed[v] if e != d]
    freed = _resident_bytes(model, v)
    if not others or freed <= 0:
        return math.inf
    e = min(others, key=model.node_ms[v].__getitem__)
    copies = sum(model.cut_ms(model.graph.edge_bytes[(u, v)], d, e)
                 for u in model.graph.preds[v] if assign[u] == d)
    copies += sum(model.cut_ms(model.graph.edge_bytes[(v, w)], e, d)
                  for w in model.graph.succs[v] if assign[w] == d)
    return (model.node_ms[v][e] - model.node_ms[v][d] + copies) / freed


def memory_rule(model: CostModel) -> tuple[list[int], int] | None:
    """The placement the peers make of a model larger than their fastest device
    (accelerate's device_map="auto"; llama.cpp's layer offload counts layers the same way):
    nodes in graph order on the fastest device (the least time for the whole model alone)
    while their weights fit its memory_gb, every node from the first that does not on the
    CPU; and that device. None where there is no CPU, no device with a memory size, or a
    node that must run elsewhere."""
    cpu = next((d for d, dev in enumerate(model.devices) if dev.kind == "cpu"), None)
    sized = [d for d, dev in enumerate(model.devices) if dev.memory_gb > 0 and d != cpu]
    if cpu is None or not sized:
        return None
    fastest = min(sized, key=lambda d: sum(ms[d] for ms in model.node_ms))
    cap, held, used, full = model.devices[fastest].memory_gb * 1e9, set(), 0, False
    assign = []
    for v, node in enumerate(model.graph.nodes):
        new = {p for p in node.params if p not in held}
        weight = sum(model.graph.param_bytes.get(p, 0) for p in new)
        full = full or used + weight > cap
        on = cpu if full or fastest not in model.allowed[v] else fastest
        if on not in model.allowed[v]:
            return None
        if on == fastest:
            held, used = held | new, used + weight
        assign.append(on)
    return assign, fastest


def against_memory_rule(model: CostModel, assign: list[int]) -> tuple[list[int], list[str]]:
    """The plan beside the peers' memory rule (`memory_rule`), both priced: the rule's where
    it is predicted faster and fits, and a note with both figures."""
    found = memory_rule(model)
    if found is None:
        return assign, []
    rule, fastest = found
    ours, theirs = objective(model, assign), objective(model, rule)
    on = sum(1 for d in rule if d == fastest)
    said = (f"memory-only rule (the peers': nodes in order on {model.devices[fastest].id} "
            f"while its weights fit, the rest on the CPU; {on} of {len(rule)} nodes there): "
            f"predicted {theirs:.3g} ms")
    if theirs < ours and not model.memory_over(rule):
        return rule, [f"{said}, faster than placing by speed ({ours:.3g} ms): used"]
    return assign, [f"{said}; this plan, by speed, {ours:.3g} ms "
                    f"({theirs / max(ours, 1e-12):.2f}x faster)"]


def _resident_bytes(model: CostModel, v: int) -> int:
    node = model.graph.nodes[v]
    return sum(model.graph.param_bytes.get(p, 0) for p in node.params) + node.out_bytes


def explain_moves(model: CostModel, assign: list[int], schedule: Schedule) -> list[str]:  # noqa: C901 - a sentence per kind of move
    """Reasons for nodes placed away from their annotation or their cheapest device."""
    nodes = model.graph.nodes
    ids = [dev.id for dev in model.devices]
    base = schedule.value - schedule.penalty_ms
    notes = []
    for d, vs in _unsupported_summary(model).items():
        ops = sorted({nodes[v].target or nodes[v].op for v in vs})
        notes.append(f"{ids[d]} cannot run {len(vs)} node(s): {', '.join(ops[:6])}")
    by_reason: dict[tuple, list[int]] = {}
    for v, node in enumerate(nodes):
        ann, d = node.annotation, assign[v]
        fastest = min(range(model.k), key=model.node_ms[v].__getitem__)
        if ann is not None and ann.device is not None and d not in model.matching(ann.device):
            by_reason.setdefault(("preference", ann, d), []).append(v)
        elif model.node_ms[v][d] > model.node_ms[v][fastest] * (1 + 1e-9):
            if ann is not None and ann.device is not None:
                by_reason.setdefault(("annotated", ann, d, fastest), []).append(v)
            else:
                by_reason.setdefault(("kept", schedule.part_of[v], d, fastest), []).append(v)
    priced = 0
    budget = min(PRICED_GROUPS, heuristic.EVAL_WORK // (model.n + len(model.graph.edges) + 1))
    for key, vs in sorted(by_reason.items(), key=lambda item: -len(item[1])):
        what = f"{len(vs)} node(s) ({model.graph.describe(vs)})"
        if key[0] == "annotated":
            notes.append(f"{what} on {ids[key[2]]} as annotated {key[1].describe()}; "
                         f"alone they would run fastest on {ids[key[3]]}")
            continue
        if key[0] == "preference":
            ann, d = key[1], key[2]
            wanted = [e for e in model.matching(ann.device)
                      if all(model.node_ms[v][e] < math.inf for v in vs)]
            if not wanted:
                notes.append(f"{what} annotated {ann.describe()} placed on {ids[d]}: "
                             f"no {ann.device} device can run them")
                continue
            target = wanted[0]
            prefix = f"{what} annotated {ann.describe()} placed on {ids[d]}"
        else:
            target = key[3]
            prefix = (f"{what} in part {key[1]} on {ids[key[2]]}, "
                      f"though alone faster on {ids[target]}")
        if priced >= budget:
            notes.append(f"{prefix}: kept with their neighbours to save cuts and launches")
            continue
        priced += 1
        trial = list(assign)
        for v in vs:
            trial[v] = target
        moved = simulate(model, trial)
        delta = moved.value - moved.penalty_ms - base
        if target in model.memory_over(trial):
            notes.append(f"{prefix}: {ids[target]}'s memory ({model.devices[target].memory_gb:g}"
                         " GB) holds no more; they lose the least time there per byte")
        elif delta > 0:
            notes.append(f"{prefix}: moving them to {ids[target]} makes the plan "
                         f"{delta:.4f} ms slower")
        else:
            notes.append(f"{prefix}: moving them to {ids[target]} alone would change the plan by "
                         f"{delta:+.4f} ms; the search kept them here")
    return notes


def _unsupported_summary(model: CostModel) -> dict[int, list[int]]:
    return {d: vs for d, vs in model.unsupported.items() if vs}
