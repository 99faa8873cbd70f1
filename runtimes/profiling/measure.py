"""Device profiles for this host: measured once, cached under state_dir by fingerprint.

Each measurement runs in a subprocess pinned to the cores its device's worker will own
(runtimes/profiling/benchmarks.py). Subprocesses whose core sets are disjoint run at the same
time, as their workers will; overlapping ones run one after another so they do not disturb
each other.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partitioner.profile import DeviceProfile
from runtimes.base import child_env, write_atomic
from runtimes.profiling import hardware

log = logging.getLogger(__name__)
NOTE = "note: "  # a stderr line of the benchmarks that the log repeats
MEASURE_TIMEOUT_S = 300


class ProfilingError(RuntimeError):
    """Measuring a device failed; the message carries the benchmark's own error."""


@dataclass
class ProfileResult:
    devices: list[DeviceProfile]
    source: str  # "measured" or "cache"
    seconds: float  # how long getting them took now
    fingerprint: str


def _specs(settings: dict[str, Any]) -> list[dict[str, Any]]:
    cpu = settings["cpu"]
    specs = [{
        "task": "host",
        "cores": cpu["cores"],
        "cpu": cpu["enabled"],
        "gpu": settings["gpu"],
        "openvino": settings["openvino"],
    }]
    for dev in settings["emulated"]:
        specs.append({"task": "emulated", **dev})
    return specs


def _measure_one(spec: dict[str, Any]) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "runtimes.profiling.benchmarks", json.dumps(spec)],
        capture_output=True, text=True, timeout=MEASURE_TIMEOUT_S, env=child_env(),
    )
    if proc.returncode != 0:
        what = spec.get("id", "host devices")
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise ProfilingError(f"measuring {what} failed: {tail[0]}")
    for line in proc.stderr.splitlines():  # what the measurement wants said, e.g. AOTInductor
        if line.startswith(NOTE):
            log.warning("%s", line.removeprefix(NOTE))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _disjoint(specs: list[dict[str, Any]]) -> bool:
    seen: set[int] = set()
    for spec in specs:
        cores = set(spec.get("cores") or hardware.usable_cores())
        if cores & seen:
            return False
        seen |= cores
    return True


def measure(settings: dict[str, Any]) -> tuple[list[DeviceProfile], dict[str, Any]]:
    """Run the micro-benchmarks for the host devices and every emulated device. Returns the
    profiles and, per device, what each runtime's probes measured (GFLOP/s, spread)."""
    specs = _specs(settings)
    workers = len(specs) if _disjoint(specs) else 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = [d for group in pool.map(_measure_one, specs) for d in group]
    probed = {d["id"]: d.pop("probe") for d in results if d.get("probe")}
    for d in results:
        for runtime, why in d.pop("probe_errors", {}).items():
            log.warning("%s: the %s probe failed, its kernels are not in the profile: %s",
                        d["id"], runtime, why)
    for dev_id, found in probed.items():
        log.info("%s probes (GFLOP/s, spread): %s", dev_id, "; ".join(
            f"{rt} {key} {gflops:.0f} ({spread:.0%})" for rt, results in found.items()
            for key, (gflops, spread) in results.items()))
    return [DeviceProfile.from_dict(d) for d in results], probed


def _apply_overrides(devices: list[DeviceProfile],
                     overrides: dict[str, dict[str, Any]]) -> list[DeviceProfile]:
    for dev in devices:
        for key, value in overrides.get(dev.id, {}).items():
            if key == "peak_gflops":
                dev.peak_gflops = {**dev.peak_gflops, **value}
            else:
                setattr(dev, key, value)
    return devices


def cache_path(state_dir: Path, fingerprint: str) -> Path:
    return state_dir / "profiles" / f"{fingerprint}.json"


def load_or_measure(state_dir: Path, settings: dict[str, Any],
                    overrides: dict[str, dict[str, Any]] | None = None,
                    refresh: bool = False) -> ProfileResult:
    """Cached profiles when the fingerprint matches, otherwise measure and cache them."""
    t0 = time.perf_counter()
    fp = hardware.fingerprint(settings)
    path = cache_path(state_dir, fp)
    for leftover in path.parent.glob(".tmp-*"):  # a crash mid-write
        leftover.unlink(missing_ok=True)
    if not refresh and path.exists():
        try:
            cached = json.loads(path.read_text())
            devices = [DeviceProfile.from_dict(d) for d in cached["devices"]]
            devices = _apply_overrides(devices, overrides or {})
            return ProfileResult(devices, "cache", time.perf_counter() - t0, fp)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring unreadable profile cache %s: %s", path, e)
    log.info("measuring devices (fingerprint %s)", fp)
    devices, probed = measure(settings)
    write_atomic(path, json.dumps({"fingerprint": fp, "measured_at": time.time(),
                                   "devices": [d.to_dict() for d in devices],
                                   "probes": probed}, indent=1).encode())
    devices = _apply_overrides(devices, overrides or {})
    return ProfileResult(devices, "measured", time.perf_counter() - t0, fp)
