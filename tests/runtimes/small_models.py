"""The reference models' architectures (cuvild/client/samples.py `reference`) at a size a
runtime's correctness tests compile in a second or two: the same operators and graphs as
resnet18, bert4 and the MLP, narrower (the full MLP alone is 268 MB of weights through each
exporter, whole and split)."""

from __future__ import annotations

import torch

from cuvild.client import samples


def small_model(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """resnet18, bert4 or mlp, narrower, in eval mode, and an input of batch 1 (seeded)."""
    torch.manual_seed(0)
    if name == "mlp":
        return samples.MLP(width=512).eval(), (torch.randn(1, 512),)
    if name == "bert4":  # attention goes through the SDPA decomposition
        return samples.Encoder(layers=2, hidden=256, heads=4).eval(), (torch.randn(1, 128, 256),)
    if name == "resnet18":
        return samples.ResNet18(num_classes=10, width=16).eval(), (torch.randn(1, 3, 64, 64),)
    raise ValueError(f"unknown model {name!r}: resnet18, bert4 or mlp")
