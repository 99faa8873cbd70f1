"""What the lent H200 measured (2026-12-04), replayed through the cost model with no GPU:
its GPU parts against their predictions, and where the models its daemon loaded next are
placed once the corrections have learned from its first two GPU parts, as that daemon did.

Used by tests/partitioner/test_gpu_pricing.py and section 4 of tests/bench/bench_costmodel.py.
Every figure here was measured there (tests/gpu/check_gpu.py's gpu_summary.json of the
second run, and check_daemon.py's notes); the profile is configs/profiles/h200.yaml.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import cuvild
from cuvild.client.samples import reference
from cuvild.load import guard
from partitioner.annotate import partition
from partitioner.corrections import Corrections, prior
from partitioner.plan import plan_model
from partitioner.profile import load_shipped

ROOT = Path(__file__).resolve().parents[2]
# Parts compiled by inductor (the torch.compile path: AOTInductor crashed there), p50 ms on
# the GPU, device-resident inputs.
PARTS = {("resnet18", 1, "fp32"): 2.239, ("resnet18", 1, "bf16"): 1.814,
         ("resnet18", 16, "fp32"): 3.122, ("resnet18", 16, "bf16"): 1.739,
         ("bert4", 1, "fp32"): 0.874, ("bert4", 1, "bf16"): 0.738}
# Its daemon's GPU parts, in the order it measured them (ms): the CPU+GPU split model's
# backbone (41 kernels), then resnet18 at fp32 served all on the GPU (43).
DAEMON = (2.1185, 2.1336)
# The bf16 ResNet-18 the daemon then placed on the CPU measured 22.7 ms there (its part on
# the GPU: PARTS[("resnet18", 1, "bf16")]).
BF16_RESNET18_ON = {"cpu0": 22.7, "gpu0": PARTS[("resnet18", 1, "bf16")]}


def learned() -> tuple[Corrections, list[Any]]:
    """The corrections after the daemon's two GPU parts, and the H200's profiles."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import check_daemon

    devices = load_shipped("h200")
    gpu = next(d for d in devices if d.kind == "gpu")
    corrections = Corrections()
    steps = [check_daemon.split_model(), reference("resnet18")]
    served = (devices, [gpu])
    for (model, args), measured, on in zip(steps, DAEMON, served, strict=True):
        plan = plan_model(cuvild.export(model, args), on, corrections=corrections)
        part = next(p for p in plan.parts if p.device == gpu.id)
        corrections.observe(gpu.id, "triton", part.class_ms, part.kernels, prior(gpu),
                            measured, type(model).__name__)
    return corrections, devices


def parts(corrections: Corrections, devices: list[Any]) -> list[dict[str, Any]]:
    """Each recorded part: measured, predicted by the profile's prior alone, and after."""
    gpu = next(d for d in devices if d.kind == "gpu")
    rows = []
    for (name, batch, precision), measured in PARTS.items():
        model, args = reference(name, batch)
        if precision != "fp32":
            model = partition(precision=precision)(model)
        (part,) = plan_model(cuvild.export(model, args), [gpu]).parts
        before = Corrections().price(gpu.id, "triton", part.class_ms, part.kernels, prior(gpu))
        after = corrections.price(gpu.id, "triton", part.class_ms, part.kernels, prior(gpu))
        rows.append({"model": name, "batch": batch, "precision": precision,
                     "kernels": part.kernels, "measured_ms": measured,
                     "prior_ms": round(before, 3), "learned_ms": round(after, 3),
                     "learned_over_measured": round(after / measured, 2)})
    return rows


def later_models() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    """The models the daemon loaded after those parts: batching's MLP and a bf16 ResNet-18."""
    torch.manual_seed(0)
    width = 2048
    mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width),
                        nn.GELU(), nn.Linear(width, width)).eval()
    return {"mlp 2048 b16": (mlp, (torch.randn(16, width),)),
            "resnet18 bf16": (partition(precision="bf16")(reference("resnet18")[0]),
                              reference("resnet18")[1])}


def placed(corrections: Corrections, devices: list[Any]) -> dict[str, dict[str, Any]]:
    """Where each later model goes: planned with what was learned, planned by the profile
    alone, and, where the lessons moved its heaviest part, which the load's timing of both
    (cuvild/load/guard.py) serves, by what the H200 measured of each."""
    out = {}
    for label, (model, args) in later_models().items():
        ep = cuvild.export(model, args)
        ours = plan_model(ep, devices, corrections=corrections)
        theirs = plan_model(ep, devices)
        row: dict[str, Any] = {
            "learned": [(p.device, p.precision, round(p.predicted_ms, 3)) for p in ours.parts],
            "profile_alone": [(p.device, p.precision, round(p.predicted_ms, 3))
                              for p in theirs.parts],
            "timed": guard.moved_by_lessons(ours, theirs)}
        row["served_on"] = guard.heaviest(ours)
        if row["timed"]:  # by what the H200 measured on each (only the bf16 model's recorded)
            measured = BF16_RESNET18_ON if label == "resnet18 bf16" else {}
            both = (guard.heaviest(ours), guard.heaviest(theirs))
            row["served_on"] = (min(both, key=measured.__getitem__)
                                if all(d in measured for d in both) else "not recorded")
        out[label] = row
    return out
