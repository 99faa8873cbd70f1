"""What the cost model learns from measured parts: per (device, runtime, op class), how much
slower than its roofline a runtime really runs, and per (device, runtime) what a call and
each kernel of a part cost.

A part on device d with runtime r (a runtime's key names its precision, "triton@bf16": the
scales are kept per key, the overhead per runtime) is predicted as

    call(d, r) + kernels x kernel(d, r) + sum over op classes c of scale(d, r, c) x roofline(c)

`kernels` is the number of the part's nodes that run as a kernel of their own on a GPU
(`Part.kernels`); roofline(c) is the part's uncorrected time for its nodes of class c
(`Part.class_ms`). Every scale starts at 1; call and kernel start at the device's `Prior`:
the profile's `call_us` / `kernel_us` where profiling timed a compiled 1-kernel and
~20-kernel part through the runtime's own `run` (a *measured* prior), else its `launch_us`
(an eager op's queueing rate) for both on a GPU, and for the call alone elsewhere.

Learning rule (`observe`, one measured part): a part whose compute is under a quarter of
what it measured is a sample of the overhead, (kernels, measured - compute); any other part
is a sample of each of its classes' scale: the current scale times (measured - overhead) /
compute, weighted by the class's share of the compute. A scale is the weighted median of its
last `KEEP` samples, clamped to [1/50, 50]. The overhead is fitted from its samples:
- where they span kernel counts (the largest at least twice the smallest), on any device,
  the slope is the median of pairwise slopes and the call the median of what is left
  (Theil-Sen: one outlier moves neither; an OpenVINO part of 20 ops costs more than one of
  none on the CPU or NPU too); where they do not, and the device has a kernel cost at all,
  the call stays at its prior and the rest is the kernels' (a GPU part's time beyond one
  call is its launches: on the lent H200 two resnet18 parts learned as a 1.6 ms *call*
  put every later model on the CPU); a device without one (CPU, NPU) learns its call;
- a measured prior is worth `PRIOR_MODELS` models: the fit moves from it by m / (m + 2)
  for samples from m models, and never beyond `BAND` times or a `BAND`th of it;
- a call is never larger than the smallest part measured on that device.

Plain data (`to_dict` / `from_dict`); the engine keeps it under state_dir per hardware
fingerprint, so a second model on the same host is predicted with what the first taught.
Overheads learned in the old one-constant form ("@call") are dropped on reading.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from partitioner.profile import DeviceProfile

KEEP = 16  # samples kept per correction
COMPUTE_BOUND = 0.25  # a part whose compute is less than this share of its time: overhead
CLAMP = 50.0
OVERHEAD = "@overhead"  # the class name under which a (device, runtime) overhead is kept
PRIOR_MODELS = 2.0  # a measured prior counts as this many models' samples
BAND = 4.0  # a measured prior bounds what is learned to [prior / BAND, prior x BAND]
SPAN = 2.0  # samples span kernel counts when the largest is this many times the smallest


class Prior(NamedTuple):
    """A device's call and per-kernel cost before anything is learned (ms)."""

    call_ms: float
    kernel_ms: float
    measured: bool = False  # timed through a compiled part at profiling time


def prior(device: DeviceProfile) -> Prior:
    """The device's prior (see the module docstring)."""
    if device.call_us > 0:
        return Prior(device.call_us / 1e3, device.kernel_us / 1e3, True)
    return Prior(device.launch_us / 1e3, device.launch_us / 1e3 if device.kind == "gpu" else 0.0)


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


@dataclass
class Overhead:
    """A (device, runtime)'s overhead samples: per part, its kernels and its time beyond
    compute, with the model it came from; and the smallest part measured there."""

    kernels: list[int] = field(default_factory=list)
    spent_ms: list[float] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    smallest_ms: float = 0.0  # 0: none measured

    def add(self, kernels: int, spent_ms: float, model: str) -> None:
        self.kernels = [*self.kernels, kernels][-KEEP:]
        self.spent_ms = [*self.spent_ms, spent_ms][-KEEP:]
        self.models = [*self.models, model][-KEEP:]

    def saw(self, measured_ms: float) -> None:
        self.smallest_ms = min(self.smallest_ms or measured_ms, measured_ms)

    def fit(self, start: Prior, smallest_ms: float) -> Prior:
        """(call, kernel) from the samples, shrunk toward and bounded by a measured prior."""
        if not self.spent_ms:
            return start
        n, y = self.kernels, self.spent_ms
        if max(n) >= SPAN * max(min(n), 1) and len(set(n)) > 1:
            kernel = max(statistics.median(
                (y[j] - y[i]) / (n[j] - n[i]) for i in range(len(n)) for j in range(len(n))
                if n[j] > n[i]), 0.0)
            call = statistics.median(yi - kernel * ni for yi, ni in zip(y, n, strict=True))
        elif start.kernel_ms <= 0:
            call, kernel = statistics.median(y), 0.0
        else:
            call = start.call_ms
            kernel = statistics.median((yi - call) / max(ni, 1) for yi, ni in zip(y, n,
                                                                                 strict=True))
        if start.measured:
            trust = len(set(self.models)) / (len(set(self.models)) + PRIOR_MODELS)
            call = _bounded(start.call_ms + trust * (call - start.call_ms), start.call_ms)
            kernel = _bounded(start.kernel_ms + trust * (kernel - start.kernel_ms),
                              start.kernel_ms)
        if smallest_ms > 0:
            call = min(call, smallest_ms)
        return Prior(max(call, 0.0), max(kernel, 0.0), start.measured)


def base(runtime: str) -> str:
    """The runtime of a runtime key ("triton@bf16" -> "triton")."""
    return runtime.split("@", 1)[0]


def _bounded(value: float, around: float) -> float:
    return min(max(value, around / BAND), around * BAND) if around > 0 else value


class Corrections:
    def __init__(self, entries: Mapping[str, Correction] | None = None,
                 overheads: Mapping[str, Overhead] | None = None) -> None:
        self.entries: dict[str, Correction] = dict(entries or {})
        self.overheads: dict[str, Overhead] = dict(overheads or {})

    @staticmethod
    def key(device: str, runtime: str, cls: str) -> str:
        return f"{device}/{runtime}/{cls}"

    def __bool__(self) -> bool:
        return bool(self.entries or self.overheads)

    # -- reading ---------------------------------------------------------------------------
    def scale(self, device: str, runtime: str, cls: str) -> float:
        entry = self.entries.get(self.key(device, runtime, cls))
        return entry.value() if entry and entry.samples else 1.0

    def overhead(self, device: str, runtime: str, start: Prior) -> Prior:
        """The (call, kernel) cost learned for (device, runtime), else `start`: one for all
        precisions of a runtime (a launch costs the same whatever the dtype)."""
        entry = self.overheads.get(self.key(device, base(runtime), OVERHEAD))
        return entry.fit(start, self.smallest_ms(device)) if entry else start

    def smallest_ms(self, device: str) -> float:
        """The smallest part measured on the device, any runtime (0: none)."""
        seen = [e.smallest_ms for k, e in self.overheads.items()
                if k.startswith(f"{device}/") and e.smallest_ms > 0]
        return min(seen, default=0.0)

    def price(self, device: str, runtime: str, class_ms: Mapping[str, float], kernels: int,
              start: Prior) -> float:
        """Predicted ms of a part with these roofline ms per class and this many kernels on
        (device, runtime)."""
        fixed = self.overhead(device, runtime, start)
        return fixed.call_ms + kernels * fixed.kernel_ms + sum(
            self.scale(device, runtime, c) * ms for c, ms in class_ms.items())

    def best_scale(self, device: str, runtimes: list[str], cls: str) -> float:
        """The scale of the runtime `auto` would pick for this class: the lowest learned one
        (1.0, the roofline, when none of the device's runtimes has been measured)."""
        learned = [self.scale(device, r, cls) for r in runtimes
                   if self.key(device, r, cls) in self.entries]
        return min(learned) if learned else 1.0

    def best_overhead(self, device: str, runtimes: list[str], start: Prior) -> Prior:
        """The lowest call and kernel cost learned among the device's runtimes, else `start`."""
        learned = [self.overhead(device, r, start) for r in runtimes
                   if self.key(device, r, OVERHEAD) in self.overheads]
        if not learned:
            return start
        return Prior(min(p.call_ms for p in learned), min(p.kernel_ms for p in learned),
                     start.measured)

    def describe(self, device: str | None = None,
                 priors: Mapping[str, Prior] | None = None) -> list[str]:
        """One line per correction, e.g. 'cpu0/openvino/conv x1.83 (4 parts)' or
        'gpu0/triton/@overhead 0.011 ms a call + 0.047 ms a kernel (2 parts, 2 models)'."""
        lines = []
        for key, entry in sorted(self.entries.items()):
            if entry.samples and (not device or key.startswith(f"{device}/")):
                lines.append(f"{key} x{entry.value():.2f} ({len(entry.samples)} measured "
                             "part(s))")
        for key, over in sorted(self.overheads.items()):
            dev, runtime, _ = key.split("/")
            if over.spent_ms and (not device or dev == device):
                start = (priors or {}).get(dev, Prior(0.0, 0.0))
                fit = self.overhead(dev, runtime, start)
                lines.append(f"{key} {fit.call_ms:.3f} ms a call + {fit.kernel_ms:.4f} ms a "
                             f"kernel ({len(over.spent_ms)} measured part(s), "
                             f"{len(set(over.models))} model(s))")
        return lines

    # -- learning --------------------------------------------------------------------------
    def observe(self, device: str, runtime: str, class_ms: Mapping[str, float], kernels: int,
                start: Prior, measured_ms: float, model: str = "") -> None:
        """Learn from one part measured at `measured_ms` (see the module docstring)."""
        if measured_ms <= 0:
            return
        fixed = self.overhead(device, runtime, start)
        over = self.overheads.setdefault(self.key(device, base(runtime), OVERHEAD), Overhead())
        over.saw(measured_ms)
        scaled = {c: self.scale(device, runtime, c) * ms for c, ms in class_ms.items() if ms > 0}
        compute = sum(scaled.values())
        if compute < COMPUTE_BOUND * measured_ms:
            over.add(kernels, max(measured_ms - compute, 0.0), model)
            return
        spent = fixed.call_ms + kernels * fixed.kernel_ms
        ratio = min(max((measured_ms - spent) / compute, 1 / CLAMP), CLAMP)
        for c, ms in scaled.items():
            value = self.scale(device, runtime, c) * ratio
            self.entries.setdefault(self.key(device, runtime, c), Correction()).add(
                value, ms / compute)

    # -- plain data ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {k: {"samples": e.samples, "weights": e.weights}
                                for k, e in sorted(self.entries.items())}
        for k, o in sorted(self.overheads.items()):
            data[k] = {"kernels": o.kernels, "spent_ms": o.spent_ms, "models": o.models,
                       "smallest_ms": o.smallest_ms}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Corrections:
        entries, overheads = {}, {}
        for key, value in data.items():
            if key.count("/") != 2 or not isinstance(value, Mapping):
                raise ValueError(f"corrections: malformed entry {key!r}")
            if key.endswith("/@call"):
                continue  # the old one-constant overhead (see the module docstring)
            if key.endswith(f"/{OVERHEAD}"):
                overheads[key] = _overhead(key, value)
                continue
            samples = [float(x) for x in value.get("samples", [])][-KEEP:]
            weights = [float(x) for x in value.get("weights", [])][-KEEP:]
            if len(samples) != len(weights):
                raise ValueError(f"corrections: malformed entry {key!r}")
            entries[key] = Correction(samples, weights)
        return cls(entries, overheads)


def _overhead(key: str, value: Mapping[str, Any]) -> Overhead:
    kernels = [int(x) for x in value.get("kernels", [])][-KEEP:]
    spent = [float(x) for x in value.get("spent_ms", [])][-KEEP:]
    models = [str(x) for x in value.get("models", [])][-KEEP:]
    if not len(kernels) == len(spent) == len(models):
        raise ValueError(f"corrections: malformed entry {key!r}")
    return Overhead(kernels, spent, models, float(value.get("smallest_ms", 0.0)))


def kernel_count(categories: Sequence[str]) -> int:
    """How many of these op classes run as a kernel of their own on a GPU."""
    return sum(c in KERNEL_CATEGORIES for c in categories)


# Ops a GPU runs as a kernel of their own (inductor fuses elementwise ops and views into
# them): at batch 1 their launches, not the roofline, are a small model's time (on the lent
# H200 resnet18's roofline is 0.09 ms and its part ran 2.1 ms: 43 such ops; bert4 0.16 ms
# against 0.87: 28).
KERNEL_CATEGORIES = frozenset({"matmul", "conv", "attention", "rnn", "norm", "softmax",
                               "reduction", "pool"})
