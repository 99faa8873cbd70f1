"""The torch runtime's parts on a CUDA GPU: a language model's steps, whose state (its KV
cache) must live where the part runs.

Stateless GPU parts are inductor's (runtimes/triton.py: compiled, run as CUDA graphs). A
stateful part is the torch runtime's wherever it runs (runtimes/torch_eager.py keeps its state
per sequence), so on a GPU it runs there eagerly: its weights and initial state copied to the
device once (`on_device`, one copy shared by the part's buckets, as its lowered weights are),
each sequence's state a row of a pool on the device (runtimes/state.py: the pool is made where
the initial state is), the step's inputs copied in and its outputs (a step's logits) copied
back to the host, the copy back waiting for the step.

Not yet here: a compiled or CUDA-graphed decode step on the GPU (each step is launched kernel
by kernel), and batched steps of several sequences there (they run one by one).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence

import torch
from torch import fx

from partitioner.profile import DeviceProfile
from runtimes.triton import cuda_device

# device copies of a part's tensors, by (id of the host tensor, device): the buckets built from
# one part share them (as runtimes/derived.py shares lowered weights)
_COPIES: dict[tuple[int, str], torch.Tensor] = {}


def target(device: DeviceProfile) -> torch.device | None:
    """The CUDA device a part for `device` runs on; None where it runs on the host (a CPU, or
    an emulated device)."""
    if device.kind != "gpu" or device.emulated:
        return None
    return cuda_device(device)


def unavailable(device: DeviceProfile) -> str | None:
    """Why the torch runtime cannot run on GPU profile `device` here (None: it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    index = cuda_device(device).index
    if index >= torch.cuda.device_count():
        return (f"{device.id} is cuda:{index} but only {torch.cuda.device_count()} CUDA "
                "device(s) are visible")
    return None


def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, copied once per (tensor, device) while the host tensor lives."""
    if tensor.device == device:
        return tensor
    key = (id(tensor), str(device))
    found = _COPIES.get(key)
    if found is None:
        found = _COPIES[key] = tensor.detach().to(device)
        weakref.finalize(tensor, _COPIES.pop, key, None)
    return found


def on_device(module: fx.GraphModule, device: torch.device | None,
              initial_key: str) -> fx.GraphModule:
    """The module with every tensor it reads (weights, state buffers) and its initial state
    (its meta's `initial_key`) on `device`; the module itself where `device` is None."""
    if device is None:
        return module
    attrs: dict[str, torch.Tensor] = {}
    for node in module.graph.nodes:
        if node.op == "get_attr":
            value = module
            for part in str(node.target).split("."):
                value = getattr(value, part)
            attrs[str(node.target)] = (copy_to(value, device) if isinstance(value, torch.Tensor)
                                       else value)
    moved = fx.GraphModule(attrs, copy.deepcopy(module.graph))
    moved.meta.update(module.meta)
    if initial_key in module.meta:
        moved.meta[initial_key] = {n: copy_to(v, device)
                                   for n, v in module.meta[initial_key].items()}
    return moved


def inputs_on(inputs: Sequence[torch.Tensor], device: torch.device | None
              ) -> list[torch.Tensor]:
    """A step's host inputs on `device` (pinned ones copied without waiting: the step's own
    stream orders them)."""
    if device is None:
        return list(inputs)
    return [t.to(device, non_blocking=t.device.type == "cpu" and t.is_pinned())
            for t in inputs]

