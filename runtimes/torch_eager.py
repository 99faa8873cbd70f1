"""The reference runtime: the part's GraphModule run by torch eager on the host.

It is what every other runtime is checked against, and the null backend that lets the
engine and its tests run anywhere.

It is also the runtime of stateful parts: a part whose graph updates some of its buffers in
place (`state_of`: a language model's KV cache, as transformers' static-cache export writes
it with index_copy_) runs on a copy of those buffers per sequence (`use(slot, scope)`;
cuvild/run/sequences.py), swapped in before a run: the state stays where the part runs and
is never copied per step. The copies are this process's, by (scope, slot): the scope is the
model's key, so the buckets of a dynamic-shape model (a prefill chunk of 64 tokens, a
decode step of 1) share a sequence's cache. Slot 0 is a request outside any sequence: a
fresh copy each run. `drop_sequence` / `drop_scope` let them go.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx

from partitioner.profile import DeviceProfile
from runtimes.base import CompileSpec, Executable, Runtime


def updated(node: fx.Node) -> fx.Node | None:
    """The value an aten op updates in place (its first argument), None for any other node."""
    target, args = node.target, node.args
    if (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)  # noqa: SLF001 - aten's op type
            and target._schema.is_mutable and args and isinstance(args[0], fx.Node)):  # noqa: SLF001 - its schema
        return args[0]
    return None


def state_of(module: fx.GraphModule) -> list[str]:
    """The module's attributes (buffers) its graph updates in place, in graph order."""
    found: list[str] = []
    for node in module.graph.nodes:
        value = updated(node)
        if value is not None and value.op == "get_attr" and value.target not in found:
            found.append(str(value.target))
    return found


def _attr(module: torch.nn.Module, name: str) -> torch.Tensor:
    for part in name.split("."):
        module = getattr(module, part)
    return module  # type: ignore[return-value]


def _set_attr(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    *path, last = name.split(".")
    for part in path:
        module = getattr(module, part)
    setattr(module, last, value)


INITIAL = "cuvild_initial"  # a stateful module's meta: its state before any run
# this process's sequences' state: (scope, slot) -> buffer name -> tensor
_SEQUENCES: dict[tuple[str, int], dict[str, torch.Tensor]] = {}


def drop_sequence(scope: str, slot: int) -> None:
    """Sequence `slot` of model `scope` ended: its state goes."""
    _SEQUENCES.pop((scope, slot), None)


def drop_scope(scope: str) -> None:
    """Model `scope` was unloaded: every sequence's state of it goes."""
    for key in [k for k in list(_SEQUENCES) if k[0] == scope]:
        _SEQUENCES.pop(key, None)


def remember_initial(module: fx.GraphModule) -> list[str]:
    """Keep the module's state as it is now (before any run) in its meta; its state's names."""
    state = state_of(module)
    if state and INITIAL not in module.meta:
        module.meta[INITIAL] = {n: _attr(module, n).detach().clone() for n in state}
    return state


def reset(module: fx.GraphModule) -> None:
    """Put the state remembered by `remember_initial` back (a run on a fresh state)."""
    with torch.no_grad():
        for name, value in module.meta.get(INITIAL, {}).items():
            _attr(module, name).copy_(value)


class TorchExecutable(Executable):
    runtime = "torch"

    def __init__(self, module: fx.GraphModule, dtype: torch.dtype | None) -> None:
        self.module = module
        self.dtype = dtype
        self.state = remember_initial(module)  # what a sequence keeps: runs change it in place
        self.initial: dict[str, torch.Tensor] = module.meta.get(INITIAL, {})
        # the module's own buffers, put back after each run: a module is shared (a split's
        # part is cached per model, its buckets' executables run it) and reset by builds
        self.home = {n: _attr(module, n) for n in self.state}
        self._next = ("", 0)  # the sequence (scope, slot) of the next run (slot 0: none)

    def use(self, slot: int, scope: str = "") -> None:
        """Run the next call on sequence `slot` of model `scope` (its state made from the
        initial values at its first step); without it, or with slot 0, on a fresh copy."""
        self._next = (scope, slot)

    def _install(self) -> None:
        (scope, slot), self._next = self._next, ("", 0)
        kept = _SEQUENCES.setdefault((scope, slot), {}) if slot else {}
        for name, value in self.initial.items():
            tensor = kept.get(name)
            if tensor is None:
                tensor = kept[name] = value.clone()
            _set_attr(self.module, name, tensor)

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if not self.state:
            return self._run(inputs)
        self._install()
        try:
            return self._run(inputs)
        finally:
            for name, tensor in self.home.items():
                _set_attr(self.module, name, tensor)

    def _run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
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
