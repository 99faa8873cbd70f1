"""Python client for cuvild's control plane (cuvil.v1)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpc

from cuvild.config import default_socket
from protos import cuvil_pb2, cuvil_pb2_grpc

SYSTEM_SOCKET = "/run/cuvild/cuvild.sock"


def default_target() -> str:
    """$CUVIL_TARGET, else the systemd service's socket if present, else this user's."""
    if os.environ.get("CUVIL_TARGET"):
        return os.environ["CUVIL_TARGET"]
    if Path(SYSTEM_SOCKET).exists():
        return f"unix://{SYSTEM_SOCKET}"
    return f"unix://{default_socket()}"


def profile_dict(dev: cuvil_pb2.DeviceProfile) -> dict[str, Any]:
    """The stable JSON shape of a device: the same keys as partitioner.profile.DeviceProfile."""
    return {
        "id": dev.id, "kind": dev.kind, "name": dev.name, "emulated": dev.emulated,
        "memory_gb": dev.memory_gb, "peak_gflops": dict(sorted(dev.peak_gflops.items())),
        "mem_bw_gbs": dev.mem_bw_gbs, "link_bw_gbs": dev.link_bw_gbs,
        "link_latency_us": dev.link_latency_us, "launch_us": dev.launch_us,
        "runtimes": list(dev.runtimes), "cores": list(dev.cores), "features": list(dev.features),
    }


class Client:
    """A connection to one cuvild. `target` is `unix:///path/to.sock` or `host:port`."""

    def __init__(self, target: str | None = None, timeout: float = 30.0) -> None:
        self.target = target or default_target()
        self.timeout = timeout
        self._channel = grpc.insecure_channel(self.target)
        self._control = cuvil_pb2_grpc.ControlStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def status(self) -> dict[str, Any]:
        """Daemon version, uptime, devices with their profiles, loaded models."""
        r = self._control.GetStatus(cuvil_pb2.GetStatusRequest(), timeout=self.timeout)
        return {
            "version": r.version,
            "pid": r.pid,
            "uptime_s": round(r.uptime_s, 3),
            "config": r.config_path,
            "profile": {"source": r.profile_source, "seconds": round(r.profile_seconds, 3),
                        "fingerprint": r.fingerprint},
            "devices": [profile_dict(d) for d in r.devices],
            "models": [{"name": m.name, "version": m.version, "sha256": m.sha256,
                        "size_bytes": m.size_bytes, "state": m.state} for m in r.models],
        }

    def profile(self, refresh: bool = False, timeout: float = 600.0) -> dict[str, Any]:
        """Device profiles; refresh=True re-measures them (seconds to minutes)."""
        r = self._control.ProfileDevices(cuvil_pb2.ProfileDevicesRequest(refresh=refresh),
                                         timeout=timeout)
        return {
            "profile": {"source": r.profile_source, "seconds": round(r.profile_seconds, 3),
                        "fingerprint": r.fingerprint},
            "devices": [profile_dict(d) for d in r.devices],
        }
