"""Partitioner benchmark: placement time, optimality gap, and plans of the reference models.

    python tests/bench/bench_partitioner.py [--json] [--quick]

1. Time of plan_model on seeded random DAGs of 1k, 10k and 50k nodes (3 devices).
2. Gap of the scalable method against branch and bound on 200 random DAGs of 6..30 nodes.
   Branch and bound starts from the scalable result and stops after a visit budget: where it
   stops early the "exact" value is the best it found (an upper bound on the optimum), and
   the report counts how many instances it proved.
3. Predicted ms of the plan, the best single device and an ORT-style greedy assignment
   (every node on the highest-priority device that supports it, GPU > NPU > CPU, cuts not
   considered when assigning, but priced when predicting) on each shipped profile: once with
   every op supported everywhere, once with partial GPU coverage (a few common ops the GPU
   path lacks, the case where fallback placement matters).
All numbers come from the cost model (predictions), measured side by side in one run.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "partitioner"))

from partitioner.cost import CostModel  # noqa: E402
from partitioner.exact import branch_and_bound  # noqa: E402
from partitioner.place import scalable  # noqa: E402
from partitioner.plan import plan_model  # noqa: E402
from partitioner.profile import load_shipped, shipped_profiles  # noqa: E402
from partitioner.schedule import objective  # noqa: E402
from partitioner.synthetic import random_dag, sample_devices  # noqa: E402

PRIORITY = ("gpu", "npu", "cpu")
# Ops the GPU path is taken to lack in the "partial" scenario, per reference model.
GPU_GAPS = {
    "resnet18-like": {"max_pool2d", "adaptive_avg_pool2d", "add"},
    "bert-2layer-256": {"layer_norm", "gelu", "embedding"},
    "mlp-4x-linear": {"relu"},
}


def placement_times(sizes: list[int]) -> list[dict]:
    rows = []
    for n in sizes:
        graph = random_dag(n, seed=n)
        t0 = time.perf_counter()
        plan = plan_model(graph, sample_devices())
        seconds = time.perf_counter() - t0
        rows.append({"nodes": n, "edges": len(graph.edges), "seconds": round(seconds, 3),
                     "parts": len(plan.parts), "predicted_ms": round(plan.predicted_ms, 3)})
    return rows


def optimality_gap(count: int, max_visits: int) -> dict:
    devices = sample_devices()
    gaps, proven_gaps, proven, seconds = [], [], 0, {"scalable": 0.0, "exact": 0.0}
    by_size: dict[str, list[float]] = {"6-14": [], "15-22": [], "23-30": []}
    for seed in range(count):
        n = random.Random(seed).randint(6, 30)
        model = CostModel(random_dag(n, seed), devices)
        t0 = time.perf_counter()
        heuristic = scalable(model)
        t1 = time.perf_counter()
        exact = branch_and_bound(model, heuristic, max_visits)
        seconds["scalable"] += t1 - t0
        seconds["exact"] += time.perf_counter() - t1
        gap = objective(model, heuristic) / exact.value - 1
        gaps.append(gap)
        by_size["6-14" if n <= 14 else "15-22" if n <= 22 else "23-30"].append(gap)
        if exact.proven:
            proven += 1
            proven_gaps.append(gap)
    return {
        "graphs": count, "nodes": "6..30", "devices": 3, "exact_visit_budget": max_visits,
        "proven_optimal": proven,
        "median_gap_pct": round(100 * statistics.median(gaps), 3),
        "worst_gap_pct": round(100 * max(gaps), 3),
        "worst_gap_pct_proven": round(100 * max(proven_gaps), 3) if proven_gaps else None,
        "zero_gap": sum(g < 1e-9 for g in gaps),
        "worst_gap_pct_by_nodes": {k: round(100 * max(v), 3) for k, v in by_size.items() if v},
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
    }  # fmt: skip


def ort_greedy(model: CostModel) -> list[int]:
    """Each node on the highest-priority device kind that can run it; cuts not considered."""
    rank = {kind: i for i, kind in enumerate(PRIORITY)}
    return [min(model.allowed[v], key=lambda d: rank[model.devices[d].kind])
            for v in range(model.n)]


def reference_plans(scenario: str) -> list[dict]:
    import refmodels

    rows = []
    for name in refmodels.BUILDERS:
        graph = refmodels.costgraph(name)
        for profile in shipped_profiles():
            devices = load_shipped(profile)
            gpus = [d.id for d in devices if d.kind == "gpu"]
            if scenario == "partial" and not gpus:
                continue
            support = {g: GPU_GAPS[name] for g in gpus} if scenario == "partial" else None
            model = CostModel(graph, devices, support=support)
            t0 = time.perf_counter()
            plan = plan_model(graph, devices, support=support)
            seconds = time.perf_counter() - t0
            single = {d.id: objective(model, [i] * model.n) for i, d in enumerate(devices)
                      if all(i in allowed for allowed in model.allowed)}
            best = min(single, key=single.__getitem__)
            rows.append({
                "model": name, "profile": profile, "scenario": scenario, "nodes": len(graph),
                "plan_ms": round(plan.predicted_ms, 4),
                "plan_devices": sorted({p.device for p in plan.parts}),
                "parts": len(plan.parts),
                "best_single": best, "best_single_ms": round(single[best], 4),
                "ort_greedy_ms": round(objective(model, ort_greedy(model)), 4),
                "plan_seconds": round(seconds, 3),
            })  # fmt: skip
    return rows


def main() -> None:
    quick = "--quick" in sys.argv
    report = {
        "placement_time": placement_times([1000, 10000] if quick else [1000, 10000, 50000]),
        "optimality_gap": optimality_gap(40 if quick else 200, 50_000),
        "reference_models": reference_plans("full") + reference_plans("partial"),
    }
    if "--json" in sys.argv:
        print(json.dumps(report, indent=2))
        return
    print("placement time (plan_model, random DAGs, 3 devices)")
    for row in report["placement_time"]:
        print(f"  {row['nodes']:>6} nodes {row['edges']:>6} edges  {row['seconds']:7.3f} s  "
              f"{row['parts']} parts")
    gap = report["optimality_gap"]
    print(f"\noptimality gap, scalable vs branch and bound ({gap['graphs']} random DAGs of "
          f"{gap['nodes']} nodes, {gap['devices']} devices)")
    print(f"  median {gap['median_gap_pct']}%  worst {gap['worst_gap_pct']}%  "
          f"(worst among proven {gap['worst_gap_pct_proven']}%); equal on {gap['zero_gap']}; "
          f"exact proven on {gap['proven_optimal']}/{gap['graphs']} "
          f"(budget {gap['exact_visit_budget']} visits); time {gap['seconds']}")
    print(f"  worst gap by size: {gap['worst_gap_pct_by_nodes']} (plan_model uses branch and "
          "bound itself up to 14 nodes)")
    print("\nreference models: predicted ms (plan / best single device / ORT-style greedy)")
    for r in report["reference_models"]:
        print(f"  {r['scenario']:<7} {r['model']:<16} {r['profile']:<14} "
              f"plan {r['plan_ms']:>9.4f} on {','.join(r['plan_devices']):<15} "
              f"single {r['best_single_ms']:>9.4f} ({r['best_single']})  "
              f"ort {r['ort_greedy_ms']:>9.4f}")


if __name__ == "__main__":
    main()
