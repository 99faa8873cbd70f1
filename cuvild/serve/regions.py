"""Client shared-memory regions (the protocol's system shared-memory extension).

A client creates a POSIX shared-memory object, registers (name, key, offset, byte_size), and
then names the region in its inputs and outputs; the device workers read and write those
bytes in place. Every use is bounds-checked against the registered region.

Ownership: over the unix socket the caller's uid is known (SO_PEERCRED, read by the front in
cuvild/serve/front.py), and a caller may register only objects it owns (root may register any).
A TCP caller has no uid; when `shm.allow_tcp_clients` lets it share memory at all, the
object must be owned by a uid in `shm.allowed_uids`. Nobody may register cuvild's own
segments (`cuvil-<pid>-...`, the arenas in which requests' tensors live).

Regions are per caller: a name registered by one uid is invisible to every other uid (and
TCP callers share one namespace of their own), so nobody can read or overwrite a region by
guessing its name.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass

from cuvild.engine.arena import SHM_DIR, Segment


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

    @property
    def inode(self) -> int:
        """Workers open the object by name and check it is still this one."""
        return self.segment.stat.st_ino


def _object_name(key: str) -> str:
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or name in (".", ".."):
        raise RegionError("invalid", f"shared-memory key {key!r}: expected '/name' of a POSIX "
                                     "shared-memory object")
    return name


ARENA = re.compile(r"cuvil-\d+-")  # cuvild.engine.arena.Arena's segment names
Caller = int | None  # the caller's uid over the unix socket (-1: unknown); None over TCP


class Regions:
    def __init__(self, allowed_uids: list[int] | None = None) -> None:
        self.tcp_owners = set(allowed_uids or [])
        self._regions: dict[tuple[Caller, str], Region] = {}
        self._lock = threading.Lock()

    def _check_owner(self, caller: Caller, key: str, owner: int) -> None:
        if caller is None:
            if owner not in self.tcp_owners:
                raise RegionError("denied", f"shared-memory object {key!r} is owned by uid "
                                            f"{owner}; TCP clients may share only objects of "
                                            "the uids in shm.allowed_uids")
        elif caller not in (0, owner):
            raise RegionError("denied", f"shared-memory object {key!r} is owned by uid {owner}, "
                                        f"not by the caller (uid {caller}); register only "
                                        "objects you created")

    def register(self, caller: Caller, name: str, key: str, offset: int,
                 byte_size: int) -> Region:
        if not name:
            raise RegionError("invalid", "region name is empty")
        obj = _object_name(key)
        if ARENA.match(obj):
            raise RegionError("denied", f"{key!r} is cuvild's own memory, not a client's")
        with self._lock:
            if (caller, name) in self._regions:
                raise RegionError("exists", f"shared-memory region {name!r} is already "
                                            "registered")
        try:
            segment = Segment(obj, 0, create=False, lock=False)  # never follows a symlink
        except FileNotFoundError:
            raise RegionError("invalid", f"shared-memory object {key!r} does not exist") from None
        except PermissionError:
            raise RegionError("denied", f"cuvild (uid {os.getuid()}) may not open shared-memory "
                                        f"object {key!r}: give the daemon's user or group read "
                                        "and write access (e.g. mode 0660)") from None
        except (OSError, ValueError) as e:
            raise RegionError("invalid", f"{key!r} is not a usable shared-memory object: "
                                         f"{e}") from None
        try:
            self._check_owner(caller, key, segment.stat.st_uid)
            if byte_size <= 0 or offset < 0 or offset + byte_size > segment.size:
                raise RegionError("invalid", f"region {name!r}: offset {offset} + byte_size "
                                             f"{byte_size} is outside {key!r} of "
                                             f"{segment.size} bytes")
        except RegionError:
            segment.close()
            raise
        region = Region(name, key, offset, byte_size, segment)
        with self._lock:
            if (caller, name) in self._regions:  # a concurrent register of the same name won
                region.segment.close()
                raise RegionError("exists", f"shared-memory region {name!r} is already "
                                            "registered")
            self._regions[(caller, name)] = region
        return region

    def _keys(self, caller: Caller, name: str) -> list[tuple[Caller, str]]:
        if not name:
            return [k for k in self._regions if k[0] == caller]
        if (caller, name) not in self._regions:
            raise RegionError("not_found", f"no shared-memory region {name!r} is registered")
        return [(caller, name)]

    def unregister(self, caller: Caller, name: str = "") -> list[Region]:
        """Drop the caller's region `name` (all of the caller's when empty); returns them."""
        with self._lock:
            regions = [self._regions.pop(k) for k in self._keys(caller, name)]
        for region in regions:
            region.segment.close()
        return regions

    def status(self, caller: Caller, name: str = "") -> list[Region]:
        with self._lock:
            return [self._regions[k] for k in self._keys(caller, name)]

    def locate(self, caller: Caller, name: str, offset: int, nbytes: int) -> tuple[Region, int]:
        """The region and the absolute offset in its object of [offset, offset + nbytes)."""
        with self._lock:
            region = self._regions.get((caller, name))
        if region is None:
            raise RegionError("invalid", f"unknown shared-memory region {name!r}")
        if offset < 0 or offset + nbytes > region.byte_size:
            raise RegionError("invalid", f"shared-memory region {name!r}: offset {offset} + "
                                         f"{nbytes} bytes is outside its {region.byte_size} "
                                         "bytes")
        # Workers open the object by name: it must still be the one registered.
        try:
            inode = os.stat(SHM_DIR / region.object_name, follow_symlinks=False).st_ino
        except FileNotFoundError:
            inode = 0
        if inode != region.inode:
            raise RegionError("invalid", f"shared-memory region {name!r}: object {region.key!r} "
                                         "was removed or replaced since it was registered; "
                                         "unregister and register it again")
        return region, region.offset + offset

    def count(self) -> int:
        """Regions registered, every caller's."""
        return len(self._regions)

    def close(self) -> None:
        with self._lock:
            regions, self._regions = list(self._regions.values()), {}
        for region in regions:
            region.segment.close()
