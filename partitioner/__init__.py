"""cuvild's partitioner: cost graph, device cost model, placement and the Plan.

`partitioner.plan_model(model, devices)` is the entry point. Names are re-exported lazily so
that importing the package (or partitioner.profile) costs nothing and never imports torch.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "plan_model": ("partitioner.plan", "plan_model"),
    "Plan": ("partitioner.plan", "Plan"),
    "CostGraph": ("partitioner.costgraph", "CostGraph"),
    "CostModel": ("partitioner.cost", "CostModel"),
    "PlacementError": ("partitioner.cost", "PlacementError"),
    "load_profiles": ("partitioner.profile", "load_profiles"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'partitioner' has no attribute {name!r}")
