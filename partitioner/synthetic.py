"""Seeded random cost graphs and plain device sets, for tests and benchmarks (no torch)."""

from __future__ import annotations

import random

from partitioner.costgraph import CostGraph, CostNode, Edge
from partitioner.profile import DeviceProfile


def random_dag(n: int, seed: int, window: int = 6, max_preds: int = 3) -> CostGraph:
    """A layered-looking DAG: each node reads 1..max_preds of the `window` nodes before it.

    Costs span compute-bound (1e10 FLOPs) to tiny ops, with a tenth of free views, so that
    both devices and transfers matter.
    """
    rng = random.Random(seed)
    nodes, edges = [], []
    for v in range(n):
        view = v > 0 and rng.random() < 0.1
        out = int(10 ** rng.uniform(3, 7))
        flops = 0.0 if view else 10 ** rng.uniform(5, 10)
        nodes.append(CostNode(
            name=f"n{v}",
            target="view" if view else "op",
            op="view" if view else "op",
            category="view" if view else "matmul",
            flops=flops,
            bytes_read=0 if view else int(10 ** rng.uniform(3, 7)),
            bytes_written=0 if view else out,
            out_bytes=out,
            inputs=("x",) if v == 0 or rng.random() < 0.02 else (),
        ))  # fmt: skip
        if v:
            lo = max(0, v - window)
            for u in sorted(rng.sample(range(lo, v), min(v - lo, rng.randint(1, max_preds)))):
                edges.append(Edge(u, v, nodes[u].out_bytes))
    has_succ = {e.src for e in edges}
    for v, node in enumerate(nodes):
        if v not in has_succ:
            node.output_bytes = node.out_bytes
    return CostGraph(nodes, edges, input_bytes={"x": 1 << 16})


def random_chain(n: int, seed: int) -> CostGraph:
    """A straight line of n nodes with random costs; input at the head, output at the tail."""
    graph = random_dag(n, seed, window=1, max_preds=1)
    for node in graph.nodes[1:]:
        node.inputs = ()
    for node in graph.nodes[:-1]:
        node.output_bytes = 0
    return graph


def sample_devices(kinds: str = "cpu,gpu,npu") -> list[DeviceProfile]:
    """A host CPU, a fast GPU behind PCIe and a mid NPU with a costly launch."""
    table = {
        "cpu": dict(peak_gflops={"fp32": 1000.0, "bf16": 4000.0}, mem_bw_gbs=100.0,
                    link_bw_gbs=50.0, link_latency_us=1.0, launch_us=5.0),
        "gpu": dict(peak_gflops={"fp32": 20000.0, "bf16": 100000.0}, mem_bw_gbs=1000.0,
                    link_bw_gbs=25.0, link_latency_us=10.0, launch_us=10.0),
        "npu": dict(peak_gflops={"fp32": 5000.0, "int8": 20000.0}, mem_bw_gbs=200.0,
                    link_bw_gbs=20.0, link_latency_us=30.0, launch_us=50.0),
    }  # fmt: skip
    return [
        DeviceProfile(id=f"{kind}0", kind=kind, memory_gb=16.0, runtimes=[kind], **table[kind])
        for kind in kinds.split(",")
    ]
