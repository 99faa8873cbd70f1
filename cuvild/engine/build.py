"""Inside a device worker: turn (stored archive, plan, part id) into a compiled part.

The worker reads the model from the registry with the safe loader, cuts it along the plan
exactly as the daemon did (the split is deterministic), and builds its part through the
compile cache. Sample data for the numerics check is made only when something compiles.
"""

from __future__ import annotations

from typing import Any

import torch

from cuvild.engine.orders import Build
from partitioner.profile import DeviceProfile
from partitioner.split import SplitProgram, split_program
from runtimes.cache import CompileCache
from runtimes.select import BuiltPart, build_part

_splits: dict[str, SplitProgram] = {}  # model key -> split, while its parts are being built


def sample_inputs(specs: list[dict[str, Any]], seed: int = 0) -> list[torch.Tensor]:
    """Deterministic sample inputs from the model's input specs (zeros for integer inputs,
    which are often indices that random values would push out of range)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for spec in specs:
        dtype = getattr(torch, spec["dtype"])
        shape = [d if d >= 0 else 1 for d in spec["shape"]]
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(dtype))
        else:
            out.append(torch.zeros(shape, dtype=dtype))
    return out


def load_split(model: str, archive: str, parts: list[tuple[str, list[str]]]) -> SplitProgram:
    split = _splits.get(model)
    if split is None:
        from cuvild.intake.safe_load import load_exported_program

        ep = load_exported_program(archive)
        split = _splits[model] = split_program(ep, parts)
    return split


def forget(model: str) -> None:
    _splits.pop(model, None)


def build_model_part(order: Build, device: DeviceProfile, cache: CompileCache) -> BuiltPart:
    split = load_split(order.split_key, order.archive, order.assignment)
    part = next(p for p in split.parts if p.id == order.part)

    def samples() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # no_grad, not inference_mode: runtimes re-export the part with these tensors.
        with torch.no_grad():
            values = split.trace(*sample_inputs(order.input_specs))
        return [values[n] for n in part.inputs], [values[n] for n in part.outputs]

    return build_part(part.module, device, order.precision, samples, cache,
                      timeout_s=order.timeout_s, input_shapes=order.input_shapes)
