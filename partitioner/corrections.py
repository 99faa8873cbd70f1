"""What the cost model learns from measured parts: per (device, runtime, op class), how much
slower than its roofline a runtime really runs, and per (device, runtime) what one call costs.

A part on device d with runtime r is predicted as

    overhead(d, r) + sum over op classes c of scale(d, r, c) * roofline_ms(c)

where roofline_ms(c) is the part's uncorrected time for its nodes of class c (`Part.class_ms`),
overhead starts at the profile's measured per-call cost of the runtime and every scale at 1.

Learning rule (`observe`, one measured part): with the current prediction split into the
call and the compute, a part whose compute is under a quarter of what it measured says
little about compute: it is a sample of the call overhead (measured minus compute). Any
other part is a sample of each of its classes' scale: the current scale times
(measured - overhead) / compute, weighted by the class's share of the compute. Each
correction is the weighted median of its last `KEEP` samples, so one noisy or outlying
measurement cannot swing it, and a consistently 2x slow runtime converges to 2x in one step.
Ratios are clamped to [1/50, 50]: a broken measurement cannot make a device look free.

Plain data (`to_dict` / `from_dict`); the engine keeps it under state_dir per hardware
fingerprint, so a second model on the same host is predicted with what the first taught.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KEEP = 16  # samples kept per correction
COMPUTE_BOUND = 0.25  # a part whose compute is less than this share of its time: overhead
CLAMP = 50.0
CALL = "@call"  # the class name under which a (device, runtime) call overhead is kept


@dataclass
class Correction:
    samples: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)

    def add(self, value: float, weight: float = 1.0) -> None:
        self.samples = [*self.samples, value][-KEEP:]
        self.weights = [*self.weights, weight][-KEEP:]

    def value(self) -> float:
        """Weighted median of the samples kept."""
        pairs = sorted(zip(self.samples, self.weights, strict=True))
        half = sum(w for _, w in pairs) / 2
        seen = 0.0
        for value, weight in pairs:
            seen += weight
            if seen >= half:
                return value
        return pairs[-1][0]


class Corrections:
    def __init__(self, entries: Mapping[str, Correction] | None = None) -> None:
        self.entries: dict[str, Correction] = dict(entries or {})

    @staticmethod
    def key(device: str, runtime: str, cls: str) -> str:
        return f"{device}/{runtime}/{cls}"

    def __bool__(self) -> bool:
        return bool(self.entries)

    # -- reading ---------------------------------------------------------------------------
    def scale(self, device: str, runtime: str, cls: str) -> float:
        entry = self.entries.get(self.key(device, runtime, cls))
        return entry.value() if entry and entry.samples else 1.0

    def overhead_ms(self, device: str, runtime: str, default_ms: float) -> float:
        entry = self.entries.get(self.key(device, runtime, CALL))
        return entry.value() if entry and entry.samples else default_ms

    def price(self, device: str, runtime: str, class_ms: Mapping[str, float],
              default_overhead_ms: float) -> float:
        """Predicted ms of a part with these roofline ms per class on (device, runtime)."""
        return self.overhead_ms(device, runtime, default_overhead_ms) + sum(
            self.scale(device, runtime, c) * ms for c, ms in class_ms.items())

    def best_scale(self, device: str, runtimes: list[str], cls: str) -> float:
        """The scale of the runtime `auto` would pick for this class: the lowest learned one
        (1.0, the roofline, when none of the device's runtimes has been measured)."""
        learned = [self.scale(device, r, cls) for r in runtimes
                   if self.key(device, r, cls) in self.entries]
        return min(learned) if learned else 1.0

    def best_overhead_ms(self, device: str, runtimes: list[str], default_ms: float) -> float:
        learned = [self.overhead_ms(device, r, default_ms) for r in runtimes
                   if self.key(device, r, CALL) in self.entries]
        return min(learned) if learned else default_ms

    def describe(self, device: str | None = None) -> list[str]:
        """One line per correction that differs from the default, e.g.
        'cpu0/openvino/conv x1.83 (4 parts)'."""
        lines = []
        for key, entry in sorted(self.entries.items()):
            if not entry.samples or (device and not key.startswith(f"{device}/")):
                continue
            what = (f"{entry.value():.3f} ms a call" if key.endswith(f"/{CALL}")
                    else f"x{entry.value():.2f}")
            lines.append(f"{key} {what} ({len(entry.samples)} measured part(s))")
        return lines

    # -- learning --------------------------------------------------------------------------
    def observe(self, device: str, runtime: str, class_ms: Mapping[str, float],
                default_overhead_ms: float, measured_ms: float) -> None:
        """Learn from one part measured at `measured_ms` (see the module docstring)."""
        if measured_ms <= 0:
            return
        overhead = self.overhead_ms(device, runtime, default_overhead_ms)
        scaled = {c: self.scale(device, runtime, c) * ms for c, ms in class_ms.items() if ms > 0}
        compute = sum(scaled.values())
        if compute < COMPUTE_BOUND * measured_ms:
            call = max(measured_ms - compute, 0.0)
            self._add(self.key(device, runtime, CALL), call, 1.0)
            return
        ratio = min(max((measured_ms - overhead) / compute, 1 / CLAMP), CLAMP)
        for c, ms in scaled.items():
            value = self.scale(device, runtime, c) * ratio
            self._add(self.key(device, runtime, c), value, ms / compute)

    def _add(self, key: str, value: float, weight: float) -> None:
        self.entries.setdefault(key, Correction()).add(value, weight)

    # -- plain data ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {k: {"samples": e.samples, "weights": e.weights}
                for k, e in sorted(self.entries.items())}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Corrections:
        entries = {}
        for key, value in data.items():
            samples = [float(x) for x in value.get("samples", [])][-KEEP:]
            weights = [float(x) for x in value.get("weights", [])][-KEEP:]
            if len(samples) != len(weights) or key.count("/") != 2:
                raise ValueError(f"corrections: malformed entry {key!r}")
            entries[key] = Correction(samples, weights)
        return cls(entries)
