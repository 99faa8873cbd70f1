"""The one small interface every compile path implements (one file per runtime).

A Runtime turns a part (a self-contained fx.GraphModule from partitioner/split.py) into an
Executable for one device. Executables take and return host torch tensors, without copies
where the library allows, and can be saved to and loaded from a compile-cache directory so a
restarted daemon does not compile again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import fx

from partitioner.profile import DeviceProfile

# Relative error allowed against torch eager, by the part's precision.
TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-2, "int8": 5e-2}


class RuntimeUnavailable(RuntimeError):
    """A runtime that is not installed or cannot run here; the message says why."""


class CompileError(RuntimeError):
    """A runtime failed to compile a part; the message names the runtime and the cause."""


@dataclass
class CompileSpec:
    device: DeviceProfile
    precision: str = "fp32"
    example_inputs: list[torch.Tensor] = field(default_factory=list)  # real sample inputs
    threads: int = 1

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(str(t.dtype), tuple(t.shape)) for t in self.example_inputs]


class Executable(ABC):
    """A compiled part. `run` is called from one thread at a time."""

    runtime: str = ""

    @abstractmethod
    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Inputs in the part's order; outputs as host tensors in the part's order."""

    def save(self, directory: Path) -> None:
        """Write what `Runtime.load` needs to rebuild this without compiling."""
        raise NotImplementedError(f"{self.runtime} executables are not cached")


class Runtime(ABC):
    name: ClassVar[str]
    kinds: ClassVar[tuple[str, ...]]  # device kinds it can target
    precisions: ClassVar[tuple[str, ...]] = ("fp32",)

    @classmethod
    def unavailable(cls) -> str | None:
        """None when usable here, else why not (e.g. "openvino is not installed")."""
        return None

    @classmethod
    def version(cls) -> str:
        """Goes into the compile-cache key: a new version recompiles."""
        return ""

    def supports(self, node: fx.Node) -> bool:
        """Whether this runtime can run `node` (feeds the partitioner's support data)."""
        return True

    def can_target(self, device: DeviceProfile, precision: str) -> bool:
        return device.kind in self.kinds and precision in self.precisions

    @abstractmethod
    def compile(self, part: fx.GraphModule, spec: CompileSpec) -> Executable:
        """Compile `part` for `spec.device`; raise CompileError naming the cause."""

    def load(self, directory: Path, spec: CompileSpec) -> Executable:
        """Rebuild an Executable saved by `Executable.save`."""
        raise NotImplementedError(f"{self.name} has no compile cache")
