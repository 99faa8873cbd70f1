"""The one visible place that maps runtime names to their modules.

A runtime module is imported only when first asked for, so a library that is not installed
costs nothing and shows up as a reason, not a crash.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

from partitioner.profile import RUNTIMES_BY_KIND, STATEFUL_BY_KIND, DeviceProfile
from runtimes.base import Runtime, RuntimeUnavailable

RUNTIMES = {
    "torch": "runtimes.torch_eager:TorchRuntime",  # reference: torch eager on the host
    "openvino": "runtimes.openvino:OpenVINORuntime",  # CPU, NPU, Intel GPU
    "onnxruntime": "runtimes.onnxruntime:ONNXRuntime",  # CPU
    "llvm-cpu": "runtimes.llvm_cpu:IREERuntime",  # CPU, LLVM through IREE
    "triton": "runtimes.triton:TritonRuntime",  # CUDA GPUs, inductor -> Triton
}

# Which runtimes may serve each device kind, and those that serve it for stateful parts
# alone: the partitioner's tables, so that planning and building agree on them.
BY_KIND = RUNTIMES_BY_KIND
STATEFUL_RUNTIMES = ("torch",)  # those that keep a part's in-place state per sequence


def runtime_class(name: str) -> type[Runtime]:
    if name not in RUNTIMES:
        raise RuntimeUnavailable(f"unknown runtime {name!r}; expected one of {sorted(RUNTIMES)}")
    module_name, class_name = RUNTIMES[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RuntimeUnavailable(f"runtime {name!r} is not installed ({e})") from None
    return getattr(module, class_name)


def get(name: str) -> Runtime:
    """An instance of runtime `name`; RuntimeUnavailable says why it cannot be used here."""
    cls = runtime_class(name)
    reason = cls.unavailable()
    if reason:
        raise RuntimeUnavailable(f"runtime {name!r} is unavailable: {reason}")
    return cls()


def report() -> dict[str, str | None]:
    """Every runtime with None (usable) or the reason it is not."""
    out: dict[str, str | None] = {}
    for name in RUNTIMES:
        try:
            get(name)
            out[name] = None
        except RuntimeUnavailable as e:
            out[name] = str(e)
    return out


def allowed_runtimes(cfg_runtimes: dict[str, list[str]],
                     device: DeviceProfile) -> list[str] | None:
    """The runtimes config `engine.runtimes` lets `auto` try on `device`: the list under its
    id, else under its kind; None (every runtime) when neither is there."""
    for key in (device.id, device.kind):
        if key in cfg_runtimes:
            return list(cfg_runtimes[key])
    return None


def support(devices: Iterable[DeviceProfile],
            cfg_runtimes: dict[str, list[str]]) -> dict[str, Callable[[Any], bool]]:
    """Per device, whether one of the runtimes it may use can run a node: ops no runtime of a
    device supports cost infinity there, so the planner places them elsewhere and says why. A
    node that updates a buffer in place (a language model's cache) runs only where a runtime
    that keeps state per sequence may build (`STATEFUL_RUNTIMES`, as the build asks:
    runtimes/select.py `_problem`): a model is never planned where its state cannot live."""
    out: dict[str, Callable[[Any], bool]] = {}
    for dev in devices:
        allowed = allowed_runtimes(cfg_runtimes, dev)
        usable = _usable(candidates_for(dev, "fp32", "auto"), allowed)
        keeps = [rt for rt in _usable([n for n in candidates_for(dev, "fp32", "auto", True)
                                       if n in STATEFUL_RUNTIMES], allowed)
                 if rt.can_target(dev, "fp32")]

        def supported(cnode: Any, runtimes: list[Runtime] = usable,
                      keeps: list[Runtime] = keeps) -> bool:
            node = getattr(cnode, "fx_node", None)
            among = keeps if getattr(cnode, "updates_state", False) else runtimes
            return node is None or any(rt.supports(node) for rt in among)

        out[dev.id] = supported
    return out


def _usable(names: list[str], allowed: list[str] | None) -> list[Runtime]:
    """The runtimes named that config allows and that are installed here."""
    kept = []
    for name in names:
        if allowed is not None and name not in allowed:
            continue
        try:
            kept.append(get(name))
        except RuntimeUnavailable:
            continue
    return kept


def candidates_for(device: DeviceProfile, precision: str, wanted: str,
                   stateful: bool = False) -> list[str]:
    """The runtimes that may build a part (`stateful`: one that updates its buffers in
    place) for `device`: all its kind's that its profile lists, or `wanted` alone."""
    names = list(BY_KIND.get(device.kind, ()))
    if device.emulated and "torch" not in names:
        names.append("torch")  # an emulated device runs on the host: the reference works
    if device.runtimes:  # what the profile says can target this device
        names = [n for n in names if n in device.runtimes]
    if stateful:  # (whether it can here, the runtime's can_target says: no profile lists it)
        names += [n for n in STATEFUL_BY_KIND.get(device.kind, ()) if n not in names]
        if device.emulated and "torch" not in names:  # (as above: the profile lists what
            names.append("torch")  # the device's own runtimes measured)
    if wanted != "auto":
        if wanted not in RUNTIMES:
            raise RuntimeUnavailable(f"unknown runtime {wanted!r}")
        names = [wanted]
    return names
