"""Cheap facts about this host, read from the OS without importing torch or OpenVINO.

The daemon must be ready in well under a second when its device profiles are cached, and
importing torch alone takes longer than that, so the cache key (the fingerprint) is built
from what /proc, /dev and package metadata say.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

# Bumped whenever the micro-benchmarks change, so old cached numbers are not reused.
PROFILER_VERSION = 4  # 2: probes per runtime, conv efficiency; 3: OpenVINO int8; 4: handoff

# The ISA flags that matter to a compiler choosing kernels.
INTERESTING_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    "avx_vnni", "sve", "asimd",
)
SOFTWARE = ("torch", "openvino", "onnxruntime", "triton", "iree-base-runtime")


def cpuinfo() -> dict[str, Any]:
    """Model name and ISA flags of the first processor in /proc/cpuinfo."""
    name, flags = platform.processor() or platform.machine(), []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"name": name, "flags": flags}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name in ("", platform.machine(), platform.processor()):
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = value.split()
    return {"name": name, "flags": flags}


def cpu_features(flags: list[str]) -> list[str]:
    return [f for f in INTERESTING_FLAGS if f in flags]


def has_bf16(features: list[str]) -> bool:
    return "amx_bf16" in features or "avx512_bf16" in features


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def software_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in SOFTWARE:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = ""
    return versions


def accelerator_nodes() -> dict[str, Any]:
    """What the kernel exposes of GPUs and NPUs: enough to notice one was added or removed."""
    nvidia = {}
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            nvidia[info] = Path(info).read_text()
        except OSError:
            nvidia[info] = ""
    return {
        "nvidia": nvidia,
        "accel": sorted(glob.glob("/dev/accel/accel*")),  # Intel NPU and other DRM accel devices
        "dri": sorted(glob.glob("/dev/dri/renderD*")),  # Intel / AMD GPUs
    }


def memory_bytes() -> int:
    """The host's physical memory (what psutil.virtual_memory().total reads, from sysconf)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fingerprint(device_settings: dict[str, Any]) -> str:
    """Hash of the hardware, the software that measures it, and the device settings."""
    info = cpuinfo()
    facts = {
        "profiler": PROFILER_VERSION,
        "cpu": info["name"],
        "flags": cpu_features(info["flags"]),
        "cores": usable_cores(),
        "memory_gib": round(memory_bytes() / 2**30),
        "machine": platform.machine(),
        "accelerators": accelerator_nodes(),
        "software": software_versions(),
        "settings": device_settings,
    }
    blob = json.dumps(facts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
