"""Reference models for partitioner tests and benchmarks (torchvision is not installed).

Each builder returns (module, example inputs); `costgraph(name)` exports one and caches its
CostGraph for the session, since export takes seconds on a 2-core host.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from partitioner.costgraph import CostGraph, from_exported_program


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNetLike(nn.Module):
    """ResNet-18's layout (stem, 4 stages of 2 basic blocks, pooled classifier)."""

    def __init__(self, width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
            blocks += [BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden)
        self.ff1 = nn.Linear(hidden, 4 * hidden)
        self.ff2 = nn.Linear(4 * hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        x = self.ln1(x + self.out(a.transpose(1, 2).reshape(b, s, h)))
        return self.ln2(x + self.ff2(nn.functional.gelu(self.ff1(x))))


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
    return ResNetLike(), (torch.randn(1, 3, 224, 224),)


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
    return from_exported_program(exported(name))
