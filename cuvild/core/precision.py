"""The precision a model is built under, and what its load measured of it (the search that
settles both is cuvild/load/precision.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class PrecisionPolicy:
    mode: str = "fp32"  # "fp32" | "auto"
    max_error: float = 1e-2  # the budget of `auto`
    calibration: str = ""  # an .npz of model inputs, one row per sample ("": none)
    calibration_tag: str = ""  # its digest


@dataclass
class Check:
    """One end-to-end measurement of the served plan on the check inputs."""

    error: float
    top1: float | None
    p50_ms: float


@dataclass
class Accuracy:
    """What the load measured: `cuvilctl compare`'s report."""

    policy: str
    max_error: float | None
    inputs: int  # check inputs
    calibrated: bool  # the check inputs are the user's calibration inputs
    eager_ms: float
    fp32: Check | None = None  # every part at its own precision, before any lowering
    chosen: Check | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Accuracy:
        checks = {k: Check(**data[k]) if data.get(k) else None for k in ("fp32", "chosen")}
        return cls(**{**data, **checks})
