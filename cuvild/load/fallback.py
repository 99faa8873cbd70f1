"""A part no runtime of its device could build is planned again off that device.

The planner knows which ops each device's runtimes support in principle (runtimes/registry.py
`support`), not every shape or attribute a runtime's compiler refuses: OpenVINO's CPU plugin
refuses an AvgPool whose kernel is wider than its input (EfficientNet's head), which torch,
ONNX Runtime and IREE run. When such a part lands on a device whose only runtime is OpenVINO
(an NPU, emulated or not), the engine bans the part's nodes from that device and plans the
model again, saying so in the plan; a part strictly pinned there fails as before, with the
build's own error. Planned again, other nodes may take the banned ones' place on that device
and fail as well (a compiler that crashes on whatever it is given): they are banned too, up
to MAX_BANS times a device. A worker that dies while building (a compiler's crash:
AOTInductor's package load on torch 2.11 did on an H200) is revived and the part built once
more without the compile that killed it (cuvild/load/builder.py `_again`); where that fails
too, or the death named no compile, it is such a failed build.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cuvild.core.errors import InferError

Banned = dict[str, tuple[set[str], str, int]]  # device id -> (node names, why, times banned)
MAX_BANS = 3  # a device's re-plans, each a whole load's planning and builds


class BuildFailed(InferError):
    """No runtime of a part's device could build it (`part`, `device`). Internal: when it
    escapes the re-plan it is raised as the plain InferError callers have always seen."""

    def __init__(self, message: str, part: str, device: str) -> None:
        super().__init__(message)
        self.part, self.device = part, device


def ban(error: BuildFailed, plan: Any, banned: Banned | None, devices: int) -> Banned:
    """`banned` with the failed part's nodes off its device (beside those banned before);
    re-raises `error` when there is nowhere else to go (a plan given, not made: None; one
    device; that device banned MAX_BANS times, or these nodes already)."""
    banned = dict(banned or {})
    part = next((p for p in plan.parts if p.id == error.part), None) if plan else None
    nodes, _, times = banned.get(error.device, (set(), "", 0))
    if part is None or devices < 2 or times >= MAX_BANS or set(part.nodes) <= nodes:
        raise InferError(str(error)) from None
    banned[error.device] = (nodes | set(part.nodes), str(error), times + 1)
    return banned


def again(error: BuildFailed, replan: Callable[[], Any]) -> Any:
    """replan(), or the build's own error when the nodes cannot go elsewhere (a strict
    @partition pins them to that device: the planner raises PlacementError)."""
    from partitioner.cost import PlacementError

    try:
        return replan()
    except PlacementError:
        raise InferError(str(error)) from None


def support(base: dict[str, Any], banned: Banned | None) -> dict[str, Any]:
    """The planner's `support` with the banned nodes unsupported on their devices."""
    if not banned:
        return base
    out = dict(base)
    for device, (nodes, _, _) in banned.items():
        out[device] = _without(nodes, base.get(device))
    return out


def _without(nodes: set[str], inner: Callable[[Any], bool] | None) -> Callable[[Any], bool]:
    def supported(cnode: Any) -> bool:
        return cnode.name not in nodes and (inner is None or inner(cnode))
    return supported


def notes(banned: Banned | None) -> list[str]:
    return [f"{len(nodes)} node(s) planned again off {device}: {' '.join(why.split())[:300]}"
            + (f" ({times} builds failed there)" if times > 1 else "")
            for device, (nodes, why, times) in (banned or {}).items()]
