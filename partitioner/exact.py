"""Exact placement for small graphs: dynamic programming on chains, branch and bound on DAGs.

Both minimise schedule.objective exactly (parts as partitioner.schedule forms them); `exhaustive`
is the definition they are tested against.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from partitioner import schedule
from partitioner.cost import CostModel
from partitioner.schedule import HOST, objective

EPS = 1e-12


@dataclass
class ExactResult:
    assign: list[int]
    value: float
    proven: bool  # False when the search budget ran out before the bound closed
    visited: int


def is_chain(model: CostModel) -> bool:
    """A straight line whose inputs enter at the first node and whose output leaves the last.

    On such a graph the latency is a sum over nodes and boundaries, which is what the DP adds.
    """
    n = model.n
    if n == 0:
        return False
    for v in range(n):
        if model.preds[v] != ([v - 1] if v else []):
            return False
        if v and model.node_inputs[v]:
            return False
        if v < n - 1 and model.out_bytes[v]:
            return False
    return True


def chain_dp(model: CostModel) -> ExactResult:
    """Optimal latency placement of a chain in O(n * devices^2)."""
    if model.objective != "latency" or not is_chain(model):
        raise ValueError("chain_dp needs a chain (see is_chain) and the latency objective")
    n = model.n
    in_bytes = sum(dict(model.node_inputs[0]).values())
    cost = [math.inf] * model.k
    for d in model.allowed[0]:
        cost[d] = model.node_ms[0][d] + model.call_ms[d] + model.penalty[0][d]
        cost[d] += model.cut_ms(in_bytes, HOST, d) if in_bytes else 0.0
    back: list[list[int]] = [[-1] * model.k]
    for v in range(1, n):
        nbytes = model.in_edges[v][0][1]
        new, choice = [math.inf] * model.k, [-1] * model.k
        for d in model.allowed[v]:
            for e in model.allowed[v - 1]:
                if cost[e] == math.inf:
                    continue
                same = e == d and model.prec[v] == model.prec[v - 1]
                step = 0.0 if same else model.call_ms[d] + model.cut_ms(nbytes, e, d)
                if cost[e] + step < new[d]:
                    new[d], choice[d] = cost[e] + step, e
            new[d] += model.node_ms[v][d] + model.penalty[v][d]
        cost = new
        back.append(choice)
    out = model.out_bytes[n - 1]
    final = [c + (model.cut_ms(out, d, HOST) if out else 0.0) for d, c in enumerate(cost)]
    d = min(range(model.k), key=final.__getitem__)
    value = final[d]
    assign = [0] * n
    for v in range(n - 1, -1, -1):
        assign[v] = d
        d = back[v][d]
    return ExactResult(assign, value, True, n * model.k * model.k)


class Bound:
    """Lower bounds on every completion of a partial assignment (nodes 0..m-1 placed).

    Adding a node never makes a schedule shorter, so the partial schedule bounds the full one.
    For latency, a node w not yet placed also finishes no earlier than the part of a placed
    predecessor v, plus the copy and launch if w goes elsewhere, plus w's own time and the
    longest path behind it (`tail[w][d]`: the critical path from w on device d to the end,
    with every node on its best device for that path, copies and launches included, no
    waiting for busy devices). For throughput, the busiest device carries at least an equal
    share of all work.
    """

    def __init__(self, model: CostModel) -> None:
        self.model = model
        n, k = model.n, model.k
        inf = math.inf
        tail = [[inf] * k for _ in range(n)]
        for v in range(n - 1, -1, -1):
            for d in model.allowed[v]:
                after = model.cut_ms(model.out_bytes[v], d, HOST) if model.out_bytes[v] else 0.0
                for w in model.succs[v]:
                    after = max(after, self._step(v, w, d, tail))
                tail[v][d] = model.node_ms[v][d] + after
        self.tail = tail
        # per placed v: (w, bound from v's finish per device of v) for each successor w
        self.behind = [[(w, [self._step(v, w, d, tail) for d in range(k)]) for w in model.succs[v]]
                       for v in range(n)]
        cheapest = [min(model.node_ms[v][d] for d in model.allowed[v]) for v in range(n)]
        self.rest_work = [0.0] * (n + 1)  # cheapest work of nodes m..n-1
        self.sources = [0.0] * (n + 1)  # longest tail of a source among nodes m..n-1
        for v in range(n - 1, -1, -1):
            self.rest_work[v] = self.rest_work[v + 1] + cheapest[v]
            start = inf
            if not model.preds[v]:
                in_bytes = sum(dict(model.node_inputs[v]).values())
                for d in model.allowed[v]:
                    arrive = model.cut_ms(in_bytes, HOST, d) if in_bytes else 0.0
                    start = min(start, arrive + tail[v][d])
            self.sources[v] = max(self.sources[v + 1], start if start < inf else 0.0)

    def _step(self, v: int, w: int, d: int, tail: list[list[float]]) -> float:
        """Least time from v's finish (on d) to the end through w."""
        model = self.model
        nbytes = model.graph.edge_bytes[(v, w)]
        best = math.inf
        for e in model.allowed[w]:
            move = 0.0 if e == d else model.cut_ms(nbytes, d, e) + model.call_ms[e]
            best = min(best, move + tail[w][e])
        return best

    def __call__(self, assign: Sequence[int], m: int) -> float:
        model = self.model
        r = schedule.run(model, assign, m)
        if model.objective == "throughput":
            spread = (sum(r.busy) + self.rest_work[m]) / model.k
            return max(r.period, spread) + r.penalty
        bound = max(r.latency, self.sources[m])
        finish, part_of, behind = r.finish, r.part_of, self.behind
        for v in range(m):
            for w, after in behind[v]:
                if w >= m:
                    t = finish[part_of[v]] + after[assign[v]]
                    if t > bound:
                        bound = t
        return bound + r.penalty


def branch_and_bound(
    model: CostModel, incumbent: Sequence[int] | None = None, max_visits: int = 200_000
) -> ExactResult:
    """Optimal placement of a small DAG by depth-first search over nodes in order.

    A partial assignment of the first m nodes is pruned when its Bound reaches the best full
    assignment found; the result is exact unless `max_visits` runs out (then `proven` is
    False and the result is the best found).
    """
    n = model.n
    lower_bound = Bound(model)
    best = list(incumbent) if incumbent is not None else None
    best_value = math.inf
    if best is not None and not model.memory_over(best):
        best_value = objective(model, best)
    order = [sorted(model.allowed[v], key=lambda d, v=v: model.node_ms[v][d]) for v in range(n)]
    assign = [0] * n
    visits = 0
    exhausted = False

    def dfs(v: int) -> None:
        nonlocal best, best_value, visits, exhausted
        for d in order[v]:
            if visits >= max_visits:
                exhausted = True
                return
            visits += 1
            assign[v] = d
            bound = lower_bound(assign, v + 1)
            if bound >= best_value - EPS * max(1.0, best_value):
                continue
            if v + 1 < n:
                dfs(v + 1)
            elif not model.memory_over(assign):
                best, best_value = list(assign), bound

    if n:
        dfs(0)
    return ExactResult(best or [], best_value if n else 0.0, not exhausted, visits)


def exhaustive(model: CostModel) -> ExactResult:
    """Every assignment, one by one: the definition of optimal (tests only; k^n of them)."""
    best, best_value, count = None, math.inf, 0
    for assign in itertools.product(*model.allowed):
        count += 1
        value = objective(model, assign)
        if value < best_value and not model.memory_over(assign):
            best, best_value = list(assign), value
    return ExactResult(best or [], best_value, True, count)
