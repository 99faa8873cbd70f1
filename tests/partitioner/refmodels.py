"""Reference models for partitioner tests and benchmarks (torchvision is not installed).

Each builder returns (module, example inputs); `costgraph(name)` exports one and caches its
CostGraph for the session, since export takes seconds on a 2-core host.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from cuvild.client.samples import EncoderLayer, ResNet18
from partitioner.costgraph import CostGraph
from partitioner.fxgraph import build_costgraph


class BertLike(nn.Module):
    """A 2-layer BERT-style encoder, hidden 256, 4 heads, with embeddings and a pooler."""

    def __init__(self, vocab: int = 30522, hidden: int = 256, layers: int = 2, seq: int = 128):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList(EncoderLayer(hidden, 4) for _ in range(layers))
        self.pool = nn.Linear(hidden, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.ln(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))
        for layer in self.layers:
            x = layer(x)
        return torch.tanh(self.pool(x[:, 0]))


def mlp() -> tuple[nn.Module, tuple]:
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                          nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1000))
    return model, (torch.randn(64, 1024),)


def resnet() -> tuple[nn.Module, tuple]:
    return ResNet18(), (torch.randn(1, 3, 224, 224),)


def bert() -> tuple[nn.Module, tuple]:
    return BertLike(), (torch.randint(0, 30522, (8, 128)),)


BUILDERS = {"resnet18-like": resnet, "bert-2layer-256": bert, "mlp-4x-linear": mlp}


@functools.cache
def exported(name: str) -> torch.export.ExportedProgram:
    model, example = BUILDERS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(model.eval(), example)


@functools.cache
def costgraph(name: str) -> CostGraph:
    return build_costgraph(exported(name))
