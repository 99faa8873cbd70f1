"""cuvild: run one PyTorch model across every processor a host has."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Re-exported lazily: importing cuvild (the daemon, the CLI) must not import torch.
_LAZY = {
    "partition": ("partitioner.annotate", "partition"),
    "export": ("partitioner.annotate", "export"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'cuvild' has no attribute {name!r}")
