"""What the safe-loader tests share: small models to export, and tools to craft archives from
real ones (read an entry, rewrite entries)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import torch


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(4, 8)
        self.l2 = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2).flatten(1)


class Pair(torch.nn.Module):
    """Two inputs tied by a shared dynamic dim: torch emits guards_code for it."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x[:, :-1] + y[:, 1:]


class WithState(torch.nn.Module):
    """Persistent + non-persistent buffers, a lifted tensor constant and a tied weight."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.tied = self.lin  # same parameters under two names
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0]))
        self.register_buffer("shift", torch.arange(3.0), persistent=False)
        self.const = torch.tensor([0.5, -0.5, 0.25])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tied(x * self.scale + self.shift) + self.const



def _root(src: Path) -> str:
    with zipfile.ZipFile(src) as z:
        return z.namelist()[0].split("/")[0]


def entry(src: Path, rel: str) -> bytes:
    with zipfile.ZipFile(src) as z:
        return z.read(f"{_root(src)}/{rel}")


def model_json(src: Path) -> dict:
    return json.loads(entry(src, "models/model.json"))


def rewrite(src: Path, dst: Path, edits: dict[str, bytes | str | None]) -> Path:
    """Copy ``src`` to ``dst`` replacing (value), deleting (None) or adding entries."""
    root = _root(src)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for name in zin.namelist():
            rel = name[len(root) + 1 :]
            if rel not in edits:
                zout.writestr(name, zin.read(name))
            elif edits[rel] is not None:
                zout.writestr(name, edits[rel])  # type: ignore[arg-type]
        for rel, value in edits.items():
            if value is not None and f"{root}/{rel}" not in zin.namelist():
                zout.writestr(f"{root}/{rel}", value)
    return dst
