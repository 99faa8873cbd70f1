"""Device profiles: what the partitioner knows of a device, as plain numbers.

The daemon measures these (runtimes/profiling/measure.py); a YAML file can describe a
machine that is not here. The partitioner never sees a device, only its profile, so plans
can be made and tested for any machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

KINDS = ("cpu", "gpu", "npu")
DTYPES = ("fp32", "bf16", "fp16", "int8")


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
    runtimes: list[str] = field(default_factory=list)  # compile paths that can target it
    cores: list[int] = field(default_factory=list)  # host cores its worker is pinned to
    features: list[str] = field(default_factory=list)  # ISA / capability flags

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
