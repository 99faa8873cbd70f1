"""Cost model: how long an assignment of nodes to devices takes, and how much memory it needs.

A node on a device costs its roofline time, max(FLOPs / peak(dtype), bytes / memory bandwidth).
Nodes become parts (see partitioner.schedule); a part costs its device's call overhead once
plus its nodes, and each node that runs as a kernel of its own costs the device's per-kernel
time too (partitioner/corrections.py: `call + kernels x kernel + roofline`). A tensor
crossing between parts on different devices costs bytes / link bandwidth + link latency of
each non-host end: a copy between two accelerators goes through host memory, so it pays
both links. Graph inputs start, and graph outputs end, in host memory.

A node whose precision is `auto` (its annotation's, else the model's policy) is priced at the
fastest precision its device measured among those a search may lower it to (bf16, fp16; int8
when the model has calibration inputs): the precision it would run at, so that a device
whose bf16 or int8 is fast is seen as the better home before anything is built.

`latency` is one request's end-to-end time: parts run as soon as their inputs arrived and their
device is free, so parts on different devices overlap. `throughput` is the period of a full
pipeline: the busiest device or link. Ops a device cannot run cost infinity there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

from partitioner.corrections import KERNEL_CATEGORIES, Corrections, prior
from partitioner.costgraph import PRECISIONS, CostGraph, CostNode
from partitioner.profile import DeviceProfile, holds_state

OBJECTIVES = ("latency", "throughput")
# A non-strict annotation costs this much when not followed: a tie-break for cheap nodes,
# a tenth of the node's own time for costly ones.
PREFER_MIN_MS = 1e-3
PREFER_FRACTION = 0.1
BYTES_PER = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}

Support = Callable[[CostNode], bool] | Collection[str]


class PlacementError(ValueError):
    """No valid placement: a strict annotation or an op no device can run."""


class CostModel:
    """Costs of one CostGraph on one set of devices; assignments are lists of device indices."""

    def __init__(
        self,
        graph: CostGraph,
        devices: Sequence[DeviceProfile],
        objective: str = "latency",
        support: dict[str, Support] | None = None,
        corrections: Corrections | None = None,
        precision: str = "fp32",
        int8: bool = False,
    ) -> None:
        """`precision`: the model's policy ("fp32" or "auto"), for nodes no annotation gives
        one; `int8`: an `auto` search may try int8 (the model has calibration inputs)."""
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        if not devices:
            raise ValueError("no devices to place on")
        self.graph, self.devices, self.objective = graph, list(devices), objective
        self.policy = precision
        self.lower = ("bf16", "fp16", "int8") if int8 else ("bf16", "fp16")
        self.n, self.k = len(graph), len(devices)
        self.preds = graph.preds
        self.succs = graph.succs
        # (predecessor, bytes) per node: the inner loops' view of the edges
        self.in_edges = [
            [(u, graph.edge_bytes[(u, v)]) for u in graph.preds[v]] for v in range(self.n)
        ]
        self.is_host = [d.kind == "cpu" for d in devices]
        # What measured parts taught (partitioner/corrections.py): each device at the speed
        # of the runtime `auto` would pick for a node's class, and its call overhead.
        self.corrections = corrections or Corrections()
        fixed = [self.corrections.best_overhead(d.id, d.runtimes, prior(d)) for d in devices]
        self.call_ms = [f.call_ms for f in fixed]
        self.kernel_ms = [f.kernel_ms for f in fixed]
        self._links()
        # a part holds nodes of one precision request: a dtype, "auto" or none. fp32 asked
        # under an fp32 policy asks nothing the policy does not: the same request, so a
        # region annotated precision="fp32" that lands beside the rest of the model on one
        # device is one part with it, not two parts on that device with a cut between them
        self.precisions = [None, *PRECISIONS, "auto"]
        self.prec = [self.precisions.index(
            None if _precision(node) == "fp32" == precision else _precision(node))
            for node in graph.nodes]
        # roofline_ms is the profile's prediction; node_ms adds the learned scale, and a
        # kernel's launch where the node runs as a kernel of its own
        self.roofline_ms = [[self._node_ms(node, dev) for dev in devices] for node in graph.nodes]
        self.node_ms = [
            [ms * self.corrections.best_scale(dev.id, dev.runtimes, node.category)
             + (self.kernel_ms[d] if node.category in KERNEL_CATEGORIES else 0.0)
             for d, (ms, dev) in enumerate(zip(row, devices, strict=True))]
            for row, node in zip(self.roofline_ms, graph.nodes, strict=True)]
        self._support(support or {})
        self._constraints()
        self._io()

    # ---- per node and per transfer ----------------------------------------------------------

    def _node_ms(self, node: CostNode, dev: DeviceProfile) -> float:
        if not dev.peak_gflops:
            raise ValueError(f"device {dev.id!r}: peak_gflops is empty")
        if dev.mem_bw_gbs <= 0:
            raise ValueError(f"device {dev.id!r}: mem_bw_gbs must be > 0")
        asked = self.run_precision(node, dev) if self.is_auto(node) else _precision(node)
        dtype = asked if asked in PRECISIONS else node.dtype
        # integer/bool/scalar ops run at the fp32 rate; a device listing neither the dtype
        # nor fp32 gets its slowest listed rate, never an optimistic one
        peak = dev.peak_gflops.get(dtype) or dev.peak_gflops.get("fp32")
        peak = (peak or min(dev.peak_gflops.values())) * dev.efficiency.get(node.category, 1.0)
        moved = node.bytes_read + node.bytes_written
        if asked in BYTES_PER and node.dtype in BYTES_PER:
            moved = moved * BYTES_PER[asked] / BYTES_PER[node.dtype]
        return max(node.flops / (peak * 1e6), moved / (dev.mem_bw_gbs * 1e6))

    def is_auto(self, node: CostNode) -> bool:
        """Its precision is `auto`: its annotation's, else (none asked) the model's policy."""
        return (_precision(node) or self.policy) == "auto"

    def run_precision(self, node: CostNode, dev: DeviceProfile) -> str:
        """The precision an `auto` node would run at on `dev`: the fastest its profile
        measured among fp32 and the lower ones a search may try (fp32 nodes only)."""
        if node.dtype != "fp32":
            return node.dtype
        rates = {p: dev.peak_gflops.get(p, 0.0) for p in ("fp32", *self.lower)}
        return max(rates, key=lambda p: (rates[p], p == "fp32"))  # a tie stays fp32

    def _links(self) -> None:
        """Per-byte and fixed cost of a copy between any two places (index k is the host)."""
        per_byte, fixed = [], []
        for dev in self.devices:
            if dev.link_bw_gbs <= 0 and dev.kind != "cpu":
                raise ValueError(f"device {dev.id!r}: link_bw_gbs must be > 0")
            per_byte.append(1 / (dev.link_bw_gbs * 1e6) if dev.link_bw_gbs > 0 else 0.0)
            fixed.append(dev.link_latency_us / 1e3)
        k = self.k
        self.cut_per_byte = [[0.0] * (k + 1) for _ in range(k + 1)]
        self.cut_fixed = [[0.0] * (k + 1) for _ in range(k + 1)]
        for a in range(k + 1):
            for b in range(k + 1):
                ends = [x for x in (a, b) if x < k and not self.is_host[x]]
                if a == b or (not ends and k in (a, b)):
                    continue  # same place, or host memory <-> a host device: no copy
                if not ends:  # two host devices: one copy into the arena
                    ends = [b]
                self.cut_per_byte[a][b] = sum(per_byte[x] for x in ends)
                self.cut_fixed[a][b] = sum(fixed[x] for x in ends)
        self.device_link = [
            None if self.is_host[x] else (per_byte[x], fixed[x]) for x in range(k)
        ]

    def cut_ms(self, nbytes: float, src: int, dst: int) -> float:
        """Time to move `nbytes` from device src to device dst (HOST, or k, for host memory)."""
        if src == dst:
            return 0.0
        return nbytes * self.cut_per_byte[src][dst] + self.cut_fixed[src][dst]

    # ---- constraints: support, annotations --------------------------------------------------

    def _support(self, support: dict[str, Support]) -> None:
        """Ops a device's runtimes cannot run (`support`), and state a device cannot keep (a
        node updating a buffer in place, where no runtime keeps one: an NPU), cost infinity
        there."""
        ids = [d.id for d in self.devices]
        unknown = set(support) - set(ids)
        if unknown:
            raise ValueError(f"support: unknown device ids {sorted(unknown)}; have {ids}")
        self.unsupported: dict[int, list[int]] = {}
        for d, dev in enumerate(self.devices):
            spec, stateless = support.get(dev.id), not holds_state(dev)
            if spec is None and not stateless:
                continue
            for v, node in enumerate(self.graph.nodes):
                ok = not (stateless and node.updates_state) and (
                    spec is None or (spec(node) if callable(spec) else (
                        node.target not in spec and node.op not in spec)))
                if not ok:
                    self.node_ms[v][d] = math.inf
                    self.unsupported.setdefault(d, []).append(v)

    def matching(self, device: str) -> list[int]:
        """Devices an annotation names: a kind ("npu") means all of that kind, else an id."""
        return [d for d, dev in enumerate(self.devices) if device in (dev.kind, dev.id)]

    def _constraints(self) -> None:
        self.allowed: list[list[int]] = []
        self.penalty: list[list[float]] = []
        for v, node in enumerate(self.graph.nodes):
            ms = self.node_ms[v]
            runnable = [d for d in range(self.k) if ms[d] < math.inf]
            if not runnable:
                raise PlacementError(f"node {node.name!r} ({node.target}): no device can run it")
            ann = node.annotation
            pen = [0.0] * self.k
            if ann is not None and ann.device is not None:
                wanted = self.matching(ann.device)
                ok = [d for d in wanted if ms[d] < math.inf]
                if ann.strict:
                    self._check_strict(node, ann, wanted, ok)
                    runnable = ok
                elif ok:
                    cost = max(PREFER_MIN_MS, PREFER_FRACTION * min(ms[d] for d in ok))
                    pen = [0.0 if d in ok else cost for d in range(self.k)]
            self.allowed.append(runnable)
            self.penalty.append(pen)

    def _check_strict(self, node: CostNode, ann, wanted: list[int], ok: list[int]) -> None:
        have = ", ".join(d.id for d in self.devices)
        if not wanted:
            raise PlacementError(
                f"node {node.name!r}: strict annotation {ann.describe()} names no device of "
                f"this machine (have: {have}); annotate with strict=False to run it on the "
                f"best device there is, or serve from a config that has one (an emulated NPU: "
                f"devices.emulated, as configs/demo.yaml)"
            )
        if not ok:
            names = ", ".join(self.devices[d].id for d in wanted)
            raise PlacementError(
                f"node {node.name!r}: strict annotation {ann.describe()}, but {names} cannot "
                f"run {node.target or node.op}"
            )

    def _io(self) -> None:
        names = list(self.graph.input_bytes)
        ids = {name: i for i, name in enumerate(names)}
        self.node_inputs = [
            [(ids[x], self.graph.input_bytes[x]) for x in node.inputs] for node in self.graph.nodes
        ]
        self.out_bytes = [node.output_bytes for node in self.graph.nodes]

    # ---- memory -------------------------------------------------------------------------------

    def peak_bytes(self, assign: Sequence[int]) -> list[int]:  # noqa: C901 - one pass over the schedule with its lifetimes
        """Peak live bytes per device: resident parameters plus live activations.

        A tensor lives on its producer's device from its producer to its last consumer, and on
        each other device that consumes it up to its last consumer there; graph outputs live
        to the end, graph inputs from the start.
        """
        n, k = self.n, self.k
        delta = [[0] * (n + 2) for _ in range(k)]
        nodes = self.graph.nodes
        for u in range(n):
            node, d = nodes[u], assign[u]
            last: dict[int, int] = {}
            for w in self.succs[u]:
                last[assign[w]] = max(last.get(assign[w], u), w)
            end = n if node.is_output else max(last.values(), default=u)
            if node.bytes_written or last.keys() - {d}:
                delta[d][u] += node.out_bytes
                delta[d][end + 1] -= node.out_bytes
            for e, w in last.items():
                if e != d:
                    delta[e][u] += node.out_bytes
                    delta[e][w + 1] -= node.out_bytes
        used_inputs: dict[tuple[int, str], int] = {}
        used_params: set[tuple[int, str]] = set()
        for v, node in enumerate(nodes):
            for x in node.inputs:
                used_inputs[(assign[v], x)] = v
            for p in node.params:
                used_params.add((assign[v], p))
        for (d, x), last_use in used_inputs.items():
            delta[d][0] += self.graph.input_bytes[x]
            delta[d][last_use + 1] -= self.graph.input_bytes[x]
        peak = []
        for d in range(k):
            live = best = 0
            for change in delta[d]:
                live += change
                best = max(best, live)
            peak.append(best)
        for d, p in used_params:
            peak[d] += self.graph.param_bytes.get(p, 0)
        return peak

    def memory_over(self, assign: Sequence[int]) -> dict[int, int]:
        """Devices whose peak exceeds memory_gb (0 means unknown: never over), with the peak."""
        over = {}
        for d, peak in enumerate(self.peak_bytes(assign)):
            cap = self.devices[d].memory_gb * 1e9
            if cap > 0 and peak > cap:
                over[d] = peak
        return over


def _precision(node: CostNode) -> str | None:
    return node.annotation.precision if node.annotation else None
