"""Real torch.export.save archives, made once for the intake tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.export.pt2_archive.constants
from archives import MLP, ConvNet, Pair, WithState


@pytest.fixture(scope="session")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Real torch.export.save archives plus the eager modules they came from."""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("legit")
    batch = torch.export.Dim("batch", min=1, max=64)
    cols = torch.export.Dim("cols", min=3, max=64)
    specs: dict[str, tuple[torch.nn.Module, tuple[torch.Tensor, ...], object]] = {
        "mlp": (MLP(), (torch.randn(2, 4),), None),
        "conv": (ConvNet().eval(), (torch.randn(2, 3, 10, 10),), None),
        "state": (WithState(), (torch.randn(2, 3),), None),
        "dyn": (MLP(), (torch.randn(2, 4),), ({0: batch},)),
        "pair": (Pair(), (torch.randn(4, 5), torch.randn(4, 5)), ({0: batch, 1: cols},) * 2),
    }
    result = {}
    for name, (module, args, dynamic) in specs.items():
        ep = torch.export.export(module, args, dynamic_shapes=dynamic)
        if name == "mlp":  # the partitioner's annotations
            calls = [n for n in ep.graph.nodes if n.op == "call_function"]
            for i, node in enumerate(calls):
                node.meta["custom"] = {"cuvil.partition": {"device": f"dev{i}", "pin": i == 0}}
        path = out / f"{name}.pt2"
        torch.export.save(ep, path)
        result[name] = (path, module)
    return result
