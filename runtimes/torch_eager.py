"""The reference runtime: the part's GraphModule run by torch eager on the host.

It is what every other runtime is checked against, and the null backend that lets the
engine and its tests run anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx

from partitioner.profile import DeviceProfile
from runtimes.base import CompileSpec, Executable, Runtime


class TorchExecutable(Executable):
    runtime = "torch"

    def __init__(self, module: fx.GraphModule, dtype: torch.dtype | None) -> None:
        self.module = module
        self.dtype = dtype

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.inference_mode():
            if self.dtype is None:
                return list(self.module(*inputs))
            with torch.autocast("cpu", dtype=self.dtype):
                outs = self.module(*inputs)
            return [o.float() if o.is_floating_point() else o for o in outs]


class TorchRuntime(Runtime):
    name = "torch"
    kinds = ("cpu",)
    precisions = ("fp32", "bf16")

    @classmethod
    def version(cls) -> str:
        return torch.__version__

    def can_target(self, device: DeviceProfile, precision: str) -> bool:
        # Emulated devices run on the host CPU, so the reference can stand in for them.
        return (device.kind == "cpu" or device.emulated) and precision in self.precisions

    def compile(self, part: fx.GraphModule, spec: CompileSpec) -> Executable:
        return TorchExecutable(part, torch.bfloat16 if spec.precision == "bf16" else None)
