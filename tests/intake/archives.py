"""What the safe-loader tests share: small models to export, and tools to craft archives from
real ones (read an entry, rewrite entries)."""

from __future__ import annotations

import io
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


def rewrite(
    src: Path, dst: Path, edits: dict[str, bytes | str | None], *, deflate: bool = False
) -> Path:
    """Copy ``src`` to ``dst`` replacing (value), deleting (None) or adding entries; the
    replaced and added ones deflated if ``deflate`` (tiny on disk, large inflated)."""
    root = _root(src)
    method = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for name in zin.namelist():
            rel = name[len(root) + 1 :]
            if rel not in edits:
                zout.writestr(name, zin.read(name))
            elif edits[rel] is not None:
                zout.writestr(name, edits[rel], compress_type=method)  # type: ignore[arg-type]
        for rel, value in edits.items():
            if value is not None and f"{root}/{rel}" not in zin.namelist():
                zout.writestr(f"{root}/{rel}", value, compress_type=method)
    return dst


def torch_save_with_pickle(template: bytes, pickle_bytes: bytes) -> bytes:
    """A torch.save zip like ``template`` whose data.pkl is ``pickle_bytes`` (stored, as
    torch writes it; deflate the outer entry to make the archive small)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(template)) as zin, zipfile.ZipFile(out, "w") as zout:
        for name in zin.namelist():
            data = pickle_bytes if name.endswith("/data.pkl") else zin.read(name)
            zout.writestr(name, data)
    return out.getvalue()


class Expanded(torch.nn.Module):
    """A buffer that is a small stride-0 expansion of one element (legit, and tiny)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ones", torch.ones(1).expand(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ones
