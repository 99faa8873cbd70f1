"""Scalable placement: coarsen, list-schedule, sweep, refine.

1. coarsen: a node with a single predecessor joins that predecessor's group when the
   predecessor feeds only it (a chain) or when the node is a free view; nodes with different
   constraints never share a group. Only a group's first node has edges from outside, so
   contracting groups keeps the graph acyclic.
2. greedy: groups in topological order go to the device that finishes them earliest, counting
   transfers from their predecessors and a launch when they start a new part (HEFT-like);
   for throughput, to the device that keeps the busiest device least busy.
3. sweep: a few passes moving each group to its cheapest device under a sequential cost
   (work + copies + a launch per copy), each move priced from the group's own edges: the fast
   path that lets 50k-node graphs place in seconds.
4. refine: first-improvement local search moving whole parts, groups and, on small graphs,
   single nodes to other devices, each move priced by a full schedule.simulate, within a
   budget of simulated node visits; on small graphs, iterated (kick_and_refine).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from partitioner.cost import CostModel
from partitioner.schedule import HOST, objective, simulate

NODE_MOVES_UP_TO = 400  # nodes; beyond this, local search moves only parts and groups
PAIR_MOVES_UP_TO = 40  # nodes; up to this, local search also moves both ends of an edge
EVAL_WORK = 1_000_000  # node+edge visits local search may spend (simulate is O(nodes+edges))
EPS = 1e-9


def coarsen(model: CostModel) -> list[list[int]]:
    """Groups of nodes that placement moves together, in topological order of their heads."""
    nodes = model.graph.nodes
    sig = [(tuple(model.allowed[v]), model.prec[v], nodes[v].annotation) for v in range(model.n)]
    group_of = [-1] * model.n
    groups: list[list[int]] = []
    for v in range(model.n):
        preds = model.preds[v]
        if len(preds) == 1:
            u = preds[0]
            free = nodes[v].flops == 0 and nodes[v].bytes_written == 0
            if sig[u] == sig[v] and (len(model.succs[u]) == 1 or free):
                group_of[v] = group_of[u]
                groups[group_of[v]].append(v)
                continue
        group_of[v] = len(groups)
        groups.append([v])
    return groups


def greedy(model: CostModel, groups: list[list[int]]) -> list[int]:  # noqa: C901 - the greedy pass with its guards
    """Initial assignment by list scheduling groups (see module docstring)."""
    k = model.k
    group_of = [0] * model.n
    for g, members in enumerate(groups):
        for v in members:
            group_of[v] = g
    dev = [0] * len(groups)
    finish = [0.0] * len(groups)
    free = [0.0] * k
    busy = [0.0] * k
    assign = [0] * model.n
    for g, members in enumerate(groups):
        incoming: dict[int, float] = {}
        in_bytes = 0
        out = 0
        for v in members:
            for u, b in model.in_edges[v]:
                if group_of[u] != g:
                    incoming[group_of[u]] = incoming.get(group_of[u], 0) + b
            in_bytes += sum(b for _, b in model.node_inputs[v])
            out += model.out_bytes[v]
        best, best_score, best_finish = -1, math.inf, 0.0
        for d in model.allowed[members[0]]:
            work = sum(model.node_ms[v][d] for v in members)
            penalty = sum(model.penalty[v][d] for v in members)
            ready = model.cut_ms(in_bytes, HOST, d) if in_bytes else 0.0
            joins = False
            moved = 0.0
            for p, b in incoming.items():
                if dev[p] == d:
                    joins = True
                    ready = max(ready, finish[p])
                else:
                    t = model.cut_ms(b, dev[p], d)
                    moved += t
                    ready = max(ready, finish[p] + t)
            work += 0.0 if joins else model.call_ms[d]
            end = max(ready, free[d]) + work
            if model.objective == "latency":
                score = end + (model.cut_ms(out, d, HOST) if out else 0.0)
            else:
                score = max(max(busy), busy[d] + work) + moved
            score += penalty
            if score < best_score:
                best, best_score, best_finish = d, score, end
        dev[g], finish[g] = best, best_finish
        free[best] = best_finish
        busy[best] += sum(model.node_ms[v][best] for v in members)
        for v in members:
            assign[v] = best
    return assign


def single_device(model: CostModel, d: int) -> list[int]:
    """Everything on device d, except nodes that cannot or may not run there (cheapest instead)."""
    return [
        d if d in model.allowed[v] else min(model.allowed[v], key=model.node_ms[v].__getitem__)
        for v in range(model.n)
    ]


def sweep(  # noqa: C901 - the sweep and its moves in one loop
    model: CostModel, assign: list[int], groups: list[list[int]], passes: int = 4
) -> list[int]:
    """Move groups to their cheapest device under the sequential cost; O(passes * edges)."""
    assign = list(assign)
    group_of = [0] * model.n
    for g, members in enumerate(groups):
        for v in members:
            assign[v] = assign[members[0]]
            group_of[v] = g
    ins: list[list[tuple[int, int]]] = [[] for _ in groups]  # (outside node, bytes)
    outs: list[list[tuple[int, int]]] = [[] for _ in groups]
    for v in range(model.n):
        for u, b in model.in_edges[v]:
            if group_of[u] != group_of[v]:
                ins[group_of[v]].append((u, b))
                outs[group_of[u]].append((v, b))
    launch, cut = model.call_ms, model.cut_ms
    for _ in range(passes):
        moved = 0
        for g, members in enumerate(groups):
            options = model.allowed[members[0]]
            if len(options) < 2:
                continue
            costs = []
            for d in options:
                c = sum(model.node_ms[v][d] + model.penalty[v][d] for v in members)
                for u, b in ins[g]:
                    if assign[u] != d:
                        c += cut(b, assign[u], d) + launch[d]
                for w, b in outs[g]:
                    if assign[w] != d:
                        c += cut(b, d, assign[w]) + launch[assign[w]]
                for v in members:
                    for _, b in model.node_inputs[v]:
                        c += cut(b, HOST, d)
                    if model.out_bytes[v]:
                        c += cut(model.out_bytes[v], d, HOST)
                costs.append(c)
            here = options.index(assign[members[0]]) if assign[members[0]] in options else 0
            best = min(range(len(options)), key=costs.__getitem__)
            if costs[best] < costs[here] - EPS * max(1.0, costs[here]):
                for v in members:
                    assign[v] = options[best]
                moved += 1
        if not moved:
            break
    return assign


def refine(
    model: CostModel,
    assign: list[int],
    groups: list[list[int]],
    work_budget: int = EVAL_WORK,
    max_passes: int = 8,
) -> tuple[list[int], float, int]:
    """First-improvement local search; returns the assignment, its value and the work spent.

    Moves: a whole part, a coarse group or (small graphs) one node to another device; when
    none helps, (small graphs) both ends of an edge at once, which finds swaps.
    """
    assign = list(assign)
    best = objective(model, assign)
    check_memory = not model.memory_over(assign)
    size = model.n + len(model.graph.edges) + 1
    evals = max(1, work_budget // size)
    evals_left = evals
    pairs = False
    for _ in range(max_passes):
        improved = False
        for move in _pair_moves(model, assign) if pairs else _unit_moves(model, assign, groups):
            if evals_left <= 0:
                return assign, best, evals * size
            evals_left -= 1
            trial = list(assign)
            for v, d in move:
                trial[v] = d
            value = objective(model, trial)
            if value < best - EPS * max(1.0, best):
                if check_memory and model.memory_over(trial):
                    continue
                assign, best, improved = trial, value, True
        if not improved:
            if pairs or model.n > PAIR_MOVES_UP_TO:
                break
            pairs = True
        else:
            pairs = False
    return assign, best, (evals - evals_left) * size


def _unit_moves(model: CostModel, assign: list[int], groups: list[list[int]]):
    units = [part.nodes for part in simulate(model, assign).parts]
    units += [g for g in groups if len(g) > 1]
    if model.n <= NODE_MOVES_UP_TO:
        units += [[v] for v in range(model.n)]
        units += beside_heaviest(model, assign)
    for unit in units:
        for d in common_allowed(model, unit):
            if any(assign[v] != d for v in unit):
                yield [(v, d) for v in unit]


def beside_heaviest(model: CostModel, assign: list[int], top: int = 4) -> list[list[int]]:
    """For the heaviest nodes, the nodes on their device that could run beside them.

    Those are neither ancestors nor descendants of the heavy node; moving them together to
    another device is the move that buys concurrency, and no single-node move finds it.
    """
    n = model.n
    below = [0] * n  # bitmask of descendants
    for v in range(n - 1, -1, -1):
        mask = 0
        for w in model.succs[v]:
            mask |= below[w] | (1 << w)
        below[v] = mask
    above = [0] * n
    for v in range(n):
        mask = 0
        for u in model.preds[v]:
            mask |= above[u] | (1 << u)
        above[v] = mask
    heavy = sorted(range(n), key=lambda v: -model.node_ms[v][assign[v]])[:top]
    units = []
    for h in heavy:
        related = below[h] | above[h] | (1 << h)
        beside = [v for v in range(n) if assign[v] == assign[h] and not related >> v & 1]
        if beside:
            units.append(beside)
    return units


def _pair_moves(model: CostModel, assign: list[int]):
    for e in model.graph.edges:
        for du in model.allowed[e.src]:
            for dw in model.allowed[e.dst]:
                if du != assign[e.src] and dw != assign[e.dst]:
                    yield [(e.src, du), (e.dst, dw)]


def kick_and_refine(
    model: CostModel,
    assign: list[int],
    groups: list[list[int]],
    rounds: int = 100,
    patience: int = 30,
    work_budget: int = EVAL_WORK,
    seed: int = 0,
) -> tuple[list[int], float]:
    """Iterated local search: move a few neighbouring nodes at random, refine, keep if better.

    Single-node moves get stuck where the better plan needs a handful of nodes to move
    together (a side branch to another device to run beside the main one); a kick gets there.
    Stops after `rounds` kicks, `patience` kicks in a row that found nothing better, or when
    the refines have spent `work_budget` node visits.
    """
    rng = random.Random(seed)
    best, best_value, spent = refine(model, assign, groups)
    stale = 0
    for _ in range(rounds):
        if stale >= patience or spent >= work_budget:
            break
        stale += 1
        trial = list(best)
        seeds = [rng.randrange(model.n)]
        seen = set(seeds)
        size = rng.randint(1, 4)
        while seeds and size:
            v = seeds.pop(rng.randrange(len(seeds)))
            options = [d for d in model.allowed[v] if d != trial[v]]
            if options:
                trial[v] = rng.choice(options)
                size -= 1
            near = [w for w in model.preds[v] + model.succs[v] if w not in seen]
            seen.update(near)
            seeds += near
        trial, value, used = refine(model, trial, groups, min(EVAL_WORK // 4, work_budget - spent))
        spent += used
        if value < best_value - EPS * max(1.0, best_value) and not model.memory_over(trial):
            best, best_value, stale = trial, value, 0
    return best, best_value


def common_allowed(model: CostModel, unit: Sequence[int]) -> list[int]:
    allowed = set(model.allowed[unit[0]])
    for v in unit[1:]:
        allowed &= set(model.allowed[v])
        if not allowed:
            break
    return sorted(allowed)
