"""Client shared-memory regions (the protocol's system shared-memory extension).

A client creates a POSIX shared-memory object, registers (name, key, offset, byte_size), and
then names the region in its inputs and outputs; the device workers read and write those
bytes in place. Every use is bounds-checked against the registered region.

Ownership: grpcio does not expose the peer's credentials (SO_PEERCRED) to a servicer, so a
region is accepted only when its object is owned by the daemon's own user or by a uid listed
in `shm.allowed_uids`; the socket itself is 0660, so only the daemon's user and group connect.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass

from runtimes.arena import SHM_DIR, Segment


class RegionError(ValueError):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "invalid" | "exists" | "not_found" | "denied"


@dataclass
class Region:
    name: str
    key: str  # as the client gave it, e.g. "/input_data"
    offset: int
    byte_size: int
    segment: Segment

    @property
    def object_name(self) -> str:
        return self.segment.name


def _object_name(key: str) -> str:
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or name in (".", ".."):
        raise RegionError("invalid", f"shared-memory key {key!r}: expected '/name' of a POSIX "
                                     "shared-memory object")
    return name


class Regions:
    def __init__(self, allowed_uids: list[int] | None = None) -> None:
        self.allowed_uids = {os.getuid(), *(allowed_uids or [])}
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> Region:
        if not name:
            raise RegionError("invalid", "region name is empty")
        obj = _object_name(key)
        with self._lock:
            if name in self._regions:
                raise RegionError("exists", f"shared-memory region {name!r} is already "
                                            "registered")
        try:
            st = os.stat(SHM_DIR / obj)
        except FileNotFoundError:
            raise RegionError("invalid", f"shared-memory object {key!r} does not exist") from None
        if not stat.S_ISREG(st.st_mode):
            raise RegionError("invalid", f"{key!r} is not a shared-memory object")
        if st.st_uid not in self.allowed_uids:
            raise RegionError("denied", f"shared-memory object {key!r} is owned by uid "
                                        f"{st.st_uid}, not by a user allowed to share memory "
                                        "with cuvild (shm.allowed_uids)")
        if byte_size <= 0 or offset < 0 or offset + byte_size > st.st_size:
            raise RegionError("invalid", f"region {name!r}: offset {offset} + byte_size "
                                         f"{byte_size} is outside {key!r} of {st.st_size} bytes")
        region = Region(name, key, offset, byte_size, Segment(obj, 0, create=False, lock=False))
        with self._lock:
            self._regions[name] = region
        return region

    def unregister(self, name: str = "") -> None:
        with self._lock:
            names = [name] if name else list(self._regions)
            if name and name not in self._regions:
                raise RegionError("not_found", f"no shared-memory region {name!r} is registered")
            regions = [self._regions.pop(n) for n in names]
        for region in regions:
            region.segment.close()

    def status(self, name: str = "") -> list[Region]:
        with self._lock:
            if name and name not in self._regions:
                raise RegionError("not_found", f"no shared-memory region {name!r} is registered")
            return [self._regions[name]] if name else list(self._regions.values())

    def locate(self, name: str, offset: int, nbytes: int) -> tuple[Region, int]:
        """The region and the absolute offset in its object of [offset, offset + nbytes)."""
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise RegionError("invalid", f"unknown shared-memory region {name!r}")
        if offset < 0 or offset + nbytes > region.byte_size:
            raise RegionError("invalid", f"shared-memory region {name!r}: offset {offset} + "
                                         f"{nbytes} bytes is outside its {region.byte_size} "
                                         "bytes")
        return region, region.offset + offset

    def close(self) -> None:
        self.unregister()
