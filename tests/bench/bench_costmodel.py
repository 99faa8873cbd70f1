"""Cost model fidelity, one run on this host (CPU worker on one core, an NPU emulated by
OpenVINO's CPU plugin on the other, as `make demo`):

    python tests/bench/bench_costmodel.py [--json] [--quick]

1. The device profile: each runtime's matmul and conv probes (GFLOP/s, spread of one probe),
   the profile's peaks against the best runtime's matmul, and how much a second probe run
   moves them (the profile should not change because a probe was noisy).
2. Predicted vs measured per part for resnet18, the BERT-like encoder, the MLP and the demo
   net, planned by the cost model and built with `auto`: before feedback (the profile alone),
   after one round of feedback (every model's measured parts taught the corrections), and
   from the other models only (what a new model on this host is predicted with).
3. The shipped xeon-amx-h100 profile with partial GPU coverage: the plan vs an ORT-style
   greedy assignment on resnet18-like (goal <= 0.8x).
4. The lent H200 (configs/profiles/h200.yaml, measured there on 2026-12-04;
   tests/partitioner/h200_replay.py): each GPU part that run measured (torch.compile path,
   p50 on the device) against the cost model's prediction from the profile's prior alone and
   after learning from its daemon's first two GPU parts, and where the models that daemon
   loaded next are placed (and, where the lessons moved them, which the load's timing of both
   plans serves by what the H200 measured of each). No GPU needed.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests" / "bench"))

import cuvild  # noqa: E402
from cuvild.client.samples import reference  # noqa: E402
from cuvild.config import parse  # noqa: E402
from cuvild.core.arena import Arena  # noqa: E402
from cuvild.engine.engine import Engine  # noqa: E402
from cuvild.intake.summary import summarize  # noqa: E402
from partitioner.corrections import Corrections, Prior, prior  # noqa: E402
from runtimes.profiling import hardware  # noqa: E402
from runtimes.profiling.measure import measure  # noqa: E402

MODELS = ("resnet18", "bert4", "mlp", "demo")
REQUESTS = 30


def layout() -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0))
    devices: dict[str, Any] = {"cpu": {"cores": cores[:1]}, "gpu": {"enabled": False}}
    if len(cores) > 1:
        devices["emulated"] = [{"id": "npu0", "kind": "npu", "runtime": "openvino",
                                "cores": cores[1:2]}]
    return parse({"devices": devices}).device_settings()


def profile_section(settings: dict[str, Any], repeats: int) -> tuple[list, dict[str, Any]]:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        devices, probed = measure(settings)
        runs.append((devices, probed, time.perf_counter() - t0))
    devices, probed, seconds = runs[0]
    report: dict[str, Any] = {"probe_seconds": [round(r[2], 2) for r in runs], "devices": {}}
    for dev in devices:
        found = probed.get(dev.id, {})
        best_mm = {}
        for results in found.values():
            for key, (gflops, _) in results.items():
                op, dtype = key.split("/")
                if op == "matmul":
                    best_mm[dtype] = max(best_mm.get(dtype, 0.0), gflops)
        moved = {k: round(abs(runs[-1][0][devices.index(dev)].peak_gflops.get(k, v) / v - 1), 3)
                 for k, v in dev.peak_gflops.items()} if repeats > 1 else {}
        report["devices"][dev.id] = {
            "peak_gflops": {k: round(v, 1) for k, v in dev.peak_gflops.items()},
            "efficiency": dev.efficiency,
            "peak_vs_best_runtime_matmul": {k: round(dev.peak_gflops[k] / v, 3)
                                            for k, v in best_mm.items() if k in dev.peak_gflops},
            "second_probe_moved_peak_by": moved,
            "probes": {rt: {k: [round(g, 1), round(s, 3)] for k, (g, s) in res.items()}
                       for rt, res in found.items()},
        }
    return devices, report


def serve_and_measure(engine: Engine, tmp: Path) -> dict[str, dict[str, Any]]:
    """Prepare each model (planned by the cost model, built with auto), serve REQUESTS, and
    return every part's plan data and its median measured ms."""
    out = {}
    for name in MODELS:
        model, inputs = reference(name)
        ep = cuvild.export(model, inputs)
        path = tmp / f"{name}.pt2"
        torch.export.save(ep, path)
        t0 = time.perf_counter()
        loaded = engine.prepare(name, name, "1", path, summarize(ep)["inputs"])
        build_s = time.perf_counter() - t0
        for _ in range(REQUESTS):
            engine.infer(name, inputs)
        parts = {p.id: p for p in loaded.plan.parts}
        out[name] = {"build_s": round(build_s, 1), "parts": {
            r.id: {"device": r.device, "runtime": r.runtime, "class_ms": parts[r.id].class_ms,
                   "kernels": parts[r.id].kernels, "before_ms": parts[r.id].predicted_ms,
                   "measured_ms": statistics.median(r.measured_ms)}
            for r in loaded.routes}}
    return out


def learn(measured: dict[str, Any], priors: dict[str, Prior],
          models: tuple[str, ...]) -> Corrections:
    learned = Corrections()
    for name in models:
        for p in measured[name]["parts"].values():
            learned.observe(p["device"], p["runtime"], p["class_ms"], p["kernels"],
                            priors[p["device"]], p["measured_ms"], name)
    return learned


def fidelity_section(devices: list, tmp: Path) -> dict[str, Any]:
    arena = Arena(f"{os.getpid()}-costbench")
    engine = Engine(devices, tmp / "cache", arena, max_in_flight=4)
    try:
        measured = serve_and_measure(engine, tmp)
    finally:
        engine.close()
        arena.close()
    priors = {d.id: prior(d) for d in devices}
    everyone = learn(measured, priors, MODELS)
    rows, worst_after = [], 0.0
    for name in MODELS:
        others = learn(measured, priors, tuple(m for m in MODELS if m != name))
        for pid, p in measured[name]["parts"].items():
            args = p["device"], p["runtime"], p["class_ms"], p["kernels"], priors[p["device"]]
            after, new = everyone.price(*args), others.price(*args)
            m = p["measured_ms"]
            worst_after = max(worst_after, abs(after / m - 1))
            rows.append({"model": name, "part": pid, "device": p["device"],
                         "runtime": p["runtime"], "measured_ms": round(m, 3),
                         "before_ms": round(p["before_ms"], 3), "before_x": round(
                             p["before_ms"] / m, 2),
                         "after_ms": round(after, 3), "after_x": round(after / m, 2),
                         "others_only_x": round(new / m, 2)})
    return {"parts": rows, "worst_after_pct": round(100 * worst_after, 1),
            "build_s": {n: measured[n]["build_s"] for n in MODELS},
            "corrections": everyone.describe()}


def placement_section() -> list[dict[str, Any]]:
    """The plan vs the ORT-style greedy, and the optimum branch and bound proves (where it
    does) for the same cost model: a bound on what any placement could reach."""
    sys.path.insert(0, str(ROOT / "tests" / "partitioner"))
    import refmodels
    from bench_partitioner import GPU_GAPS, reference_plans

    from partitioner.cost import CostModel
    from partitioner.exact import branch_and_bound
    from partitioner.place import scalable
    from partitioner.profile import load_shipped

    rows = [r for r in reference_plans("partial") if r["profile"] == "xeon-amx-h100"]
    devices = load_shipped("xeon-amx-h100")
    for row in rows:
        gpus = [d.id for d in devices if d.kind == "gpu"]
        model = CostModel(refmodels.costgraph(row["model"]), devices,
                          support={g: GPU_GAPS[row["model"]] for g in gpus})
        exact = branch_and_bound(model, scalable(model), 2_000_000)
        row["optimum_ms"] = round(exact.value, 4)
        row["optimum_proven"] = exact.proven
    return rows


def h200_section() -> dict[str, Any]:
    """Section 4: the lent H200's GPU parts, measured vs predicted, and where the models its
    daemon loaded next are placed (tests/partitioner/h200_replay.py)."""
    sys.path.insert(0, str(ROOT / "tests" / "partitioner"))
    import h200_replay

    corrections, devices = h200_replay.learned()
    gpu = next(d for d in devices if d.kind == "gpu")
    return {"parts": h200_replay.parts(corrections, devices),
            "learned": corrections.describe(gpu.id, {gpu.id: prior(gpu)}),
            "placed": h200_replay.placed(corrections, devices)}


def main() -> dict[str, Any]:
    quick = "--quick" in sys.argv
    settings = layout()
    info = hardware.cpuinfo()
    report: dict[str, Any] = {"host": {"cpu": info["name"], "flags": hardware.cpu_features(
        info["flags"]), "cores": len(os.sched_getaffinity(0))}}
    devices, report["profile"] = profile_section(settings, 1 if quick else 2)
    tmp = Path(tempfile.mkdtemp(prefix="cuvil-costbench-"))
    try:
        report["fidelity"] = fidelity_section(devices, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report["placement"] = placement_section()
    report["h200"] = h200_section()
    return report


def show(r: dict[str, Any]) -> None:
    print(f"host: {r['host']['cpu']}, {r['host']['cores']} cores, flags {r['host']['flags']}")
    prof = r["profile"]
    print(f"probe time {prof['probe_seconds']} s")
    for dev, d in prof["devices"].items():
        print(f"  {dev}: peaks {d['peak_gflops']} GFLOP/s, efficiency {d['efficiency']}, "
              f"peak / best runtime's matmul {d['peak_vs_best_runtime_matmul']}, "
              f"a second probe moved the peaks by {d['second_probe_moved_peak_by']}")
        for rt, probes in d["probes"].items():
            print(f"    {rt:<12} " + "  ".join(f"{k} {g:.0f} ({s:.0%})"
                                               for k, (g, s) in probes.items()))
    f = r["fidelity"]
    print(f"\npredicted / measured per part (x = predicted / measured), builds {f['build_s']} s")
    print(f"  {'model':<9}{'part':<5}{'device':<7}{'runtime':<12}{'measured':>9}"
          f"{'before':>9}{'x':>6}{'after':>9}{'x':>6}{'others':>8}")
    for p in f["parts"]:
        print(f"  {p['model']:<9}{p['part']:<5}{p['device']:<7}{p['runtime']:<12}"
              f"{p['measured_ms']:>9.3f}{p['before_ms']:>9.3f}{p['before_x']:>6.2f}"
              f"{p['after_ms']:>9.3f}{p['after_x']:>6.2f}{p['others_only_x']:>8.2f}")
    print(f"  worst part after one round of feedback: {f['worst_after_pct']}% off (goal 25%)")
    print("  learned: " + "; ".join(f["corrections"]))
    print()
    for row in r["placement"]:
        bound = "proven optimum" if row["optimum_proven"] else "best found by branch and bound"
        print(f"xeon-amx-h100, partial GPU coverage, {row['model']:<16} plan "
              f"{row['plan_ms']:.3f} ms vs ORT-style greedy {row['ort_greedy_ms']:.3f} ms = "
              f"{row['plan_ms'] / row['ort_greedy_ms']:.3f}x (goal <= 0.8x); {bound} "
              f"{row['optimum_ms']:.3f} ms = {row['optimum_ms'] / row['ort_greedy_ms']:.3f}x")


    h = r["h200"]
    print("\nthe lent H200 (2026-12-04; torch.compile path): GPU part measured vs predicted "
          "(the profile's prior alone; learned from its daemon's first two GPU parts)")
    for p in h["parts"]:
        print(f"  {p['model']:<9} b{p['batch']:<3} {p['precision']} {p['kernels']:>3} kernels: "
              f"measured {p['measured_ms']:.3f} ms, prior {p['prior_ms']:.3f} ms, learned "
              f"{p['learned_ms']:.3f} ms = {p['learned_over_measured']:.2f}x (goal 0.5-2x)")
    print("  learned: " + "; ".join(h["learned"]))
    for label, row in h["placed"].items():
        print(f"  {label}: learned plan {row['learned']}, the profile alone "
              f"{row['profile_alone']}; " + (f"both timed at load, served on {row['served_on']}"
                                             if row["timed"] else "not timed (same device)"))


if __name__ == "__main__":
    result = main()
    if "--json" in sys.argv:
        print(json.dumps(result, indent=2))
    else:
        show(result)
