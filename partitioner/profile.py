"""Device profiles: what the partitioner knows of a device, as plain numbers.

The daemon measures these (runtimes/profiling/measure.py); a YAML file describes a machine
that is not here (`load_profiles`; the shipped shapes live in configs/profiles/). The
partitioner never sees a device, only its profile, so plans can be made and tested for any
machine. `RUNTIMES_BY_KIND` is the one table of which compile paths may serve a device kind;
runtimes/registry.py imports it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("cpu", "gpu", "npu")
DTYPES = ("fp32", "bf16", "fp16", "int8")
# Which runtimes may serve each device kind, best-known first (`auto` still measures them all).
RUNTIMES_BY_KIND: dict[str, tuple[str, ...]] = {
    "cpu": ("openvino", "onnxruntime", "llvm-cpu", "torch"),
    "gpu": ("triton",),
    "npu": ("openvino",),
}
# ... and those that serve a kind for stateful parts alone (a language model's cache, kept
# per sequence): torch eager on a GPU (runtimes/torch_cuda.py), where a stateless part is
# inductor's. A CPU keeps state with torch, in its own table; an NPU keeps none.
STATEFUL_BY_KIND: dict[str, tuple[str, ...]] = {"gpu": ("torch",)}
PROFILE_DIR = Path(__file__).resolve().parent.parent / "configs" / "profiles"


def holds_state(device: DeviceProfile) -> bool:
    """Whether a runtime can keep a model's state (buffers it updates in place) on `device`:
    torch on a CPU, on a GPU, or on an emulated device (which runs on the host)."""
    return (device.emulated or "torch" in RUNTIMES_BY_KIND.get(device.kind, ())
            or bool(STATEFUL_BY_KIND.get(device.kind)))


_NUMBER_KEYS = ("memory_gb", "mem_bw_gbs", "link_bw_gbs", "link_latency_us", "launch_us",
                "call_us", "kernel_us")
_LIST_KEYS = ("runtimes", "cores", "features")


@dataclass
class DeviceProfile:
    """One device as numbers. Units are in the field names."""

    id: str  # "cpu0", "gpu0", "npu0"
    kind: str  # one of KINDS
    name: str = ""  # human description, e.g. "Intel Xeon Platinum 8480+"
    emulated: bool = False  # served by another device (e.g. an NPU on OpenVINO's CPU plugin)
    memory_gb: float = 0.0
    peak_gflops: dict[str, float] = field(default_factory=dict)  # dtype -> measured GFLOP/s
    mem_bw_gbs: float = 0.0  # device memory read bandwidth
    link_bw_gbs: float = 0.0  # host <-> device copy bandwidth (host memcpy for host devices)
    link_latency_us: float = 0.0  # cost of the smallest host <-> device transfer
    launch_us: float = 0.0  # fixed overhead of one call into the device's runtime
    # A compiled part timed through its runtime's own `run` at profiling time (GPUs): one
    # call of a 1-kernel part, and each further kernel (from a ~20-kernel part); 0: not
    # measured, `launch_us` stands in (partitioner/corrections.py `prior`)
    call_us: float = 0.0
    kernel_us: float = 0.0
    runtimes: list[str] = field(default_factory=list)  # compile paths that can target it
    cores: list[int] = field(default_factory=list)  # host cores its worker is pinned to
    features: list[str] = field(default_factory=list)  # ISA / capability flags
    # op class (partitioner/flops.py category) -> share of the matmul peak its kernels reach,
    # as probed (e.g. conv 0.6); classes not listed run at the peak
    efficiency: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"device {self.id!r}: kind must be one of {KINDS}, got {self.kind!r}")
        unknown = set(self.peak_gflops) - set(DTYPES)
        if unknown:
            raise ValueError(
                f"device {self.id!r}: peak_gflops has unknown dtypes {sorted(unknown)}; "
                f"expected some of {DTYPES}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceProfile:
        known = set(cls.__dataclass_fields__)
        extra = set(data) - known
        if extra:
            raise ValueError(f"device profile: unknown keys {sorted(extra)}")
        return cls(**data)


# ---- from YAML -----------------------------------------------------------------------------

def load_profiles(path: str | Path) -> list[DeviceProfile]:
    """Profiles of the devices in a YAML file (a `devices:` list).

    Raises ValueError naming the file, the device and the key that was wrong.
    """
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from err
    return profiles_from_data(data, source=str(path))


def profiles_from_data(data: Any, source: str = "<data>") -> list[DeviceProfile]:
    """Profiles from already-parsed data: a dict with a `devices` list, or the list itself."""
    if isinstance(data, dict):
        unknown = set(data) - {"devices", "machine", "notes"}
        if unknown:
            raise ValueError(f"{source}: unknown top-level keys {sorted(unknown)}; "
                             "expected 'devices' (and optional 'machine', 'notes')")
        data = data.get("devices")
    if not isinstance(data, list) or not data:
        raise ValueError(f"{source}: 'devices' must be a non-empty list of device profiles")
    profiles = [_profile(entry, f"{source}: devices[{i}]") for i, entry in enumerate(data)]
    seen: set[str] = set()
    for p in profiles:
        if p.id in seen:
            raise ValueError(f"{source}: device id {p.id!r} appears twice")
        seen.add(p.id)
    return profiles


def shipped_profiles() -> dict[str, Path]:
    """Machine shapes shipped in configs/profiles/, by file stem."""
    return {p.stem: p for p in sorted(PROFILE_DIR.glob("*.yaml"))}


def load_shipped(name: str) -> list[DeviceProfile]:
    """Profiles of a shipped machine shape, e.g. load_shipped("ci-host")."""
    shipped = shipped_profiles()
    if name not in shipped:
        raise ValueError(f"no shipped profile {name!r}; have {sorted(shipped)}")
    return load_profiles(shipped[name])


def _profile(entry: Any, where: str) -> DeviceProfile:  # noqa: C901 - a check per profile field, each naming it
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be a mapping of profile fields, got {entry!r}")
    where = f"{where} ({entry.get('id', '?')})"
    known = set(DeviceProfile.__dataclass_fields__)
    unknown = set(entry) - known
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; known keys: {sorted(known)}")
    for key in ("id", "kind"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise ValueError(f"{where}: key {key!r} is required and must be a string")
    for key in _NUMBER_KEYS:
        value = entry.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{where}: key {key!r} must be a number >= 0, got {value!r}")
    peaks = entry.get("peak_gflops", {})
    if not isinstance(peaks, dict):
        raise ValueError(f"{where}: key 'peak_gflops' must map dtype -> GFLOP/s, got {peaks!r}")
    for dtype, value in peaks.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{where}: key 'peak_gflops.{dtype}' must be a number > 0")
    eff = entry.get("efficiency", {})
    if not isinstance(eff, dict) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 for v in eff.values()):
        raise ValueError(f"{where}: key 'efficiency' must map op class -> a share > 0, got {eff!r}")
    for key in _LIST_KEYS:
        if key in entry and not isinstance(entry[key], list):
            raise ValueError(f"{where}: key {key!r} must be a list, got {entry[key]!r}")
    data = dict(entry)
    data.setdefault("runtimes", list(RUNTIMES_BY_KIND.get(entry["kind"], ())))
    try:
        return DeviceProfile.from_dict(data)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from err
