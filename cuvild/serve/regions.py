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
import stat
import struct
import threading
from dataclasses import dataclass
from typing import Any

from cuvild.core.arena import SHM_DIR


class RegionError(ValueError):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "invalid" | "exists" | "not_found" | "denied" | "exhausted"


@dataclass(frozen=True)
class Region:
    name: str
    key: str  # as the client gave it, e.g. "/input_data"
    offset: int
    byte_size: int
    object_name: str
    inode: int  # workers open the object by name and check it is still this one


def _object_name(key: str) -> str:
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise RegionError("invalid", f"shared-memory key {key!r}: expected '/name' of a POSIX "
                                     "shared-memory object")
    return name


ARENA = re.compile(r"cuvil-\d+-")  # cuvild.core.arena.Arena's segment names
Caller = int | None  # the caller's uid over the unix socket (-1: unknown); None over TCP

# POSIX ACL xattr (linux/posix_acl_xattr.h): a version word, then (tag, perm, id) entries.
_ACL_XATTR = "system.posix_acl_access"
_ACL_ENTRY = struct.Struct("<HHI")
_ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP = 0x02, 0x04, 0x08


def _others_reach(fd: int, st: os.stat_result) -> str | None:
    """Who besides the owner and this daemon's user can open the object; None if nobody."""
    if st.st_mode & 0o007:
        return "every user (mode bits for others)"
    try:
        acl = os.getxattr(fd, _ACL_XATTR)
    except OSError:  # no ACL (or none supported): the group bits are the group's access
        return f"group {st.st_gid} (mode bits for the group)" if st.st_mode & 0o070 else None
    for offset in range(4, len(acl) - _ACL_ENTRY.size + 1, _ACL_ENTRY.size):
        tag, perm, ident = _ACL_ENTRY.unpack_from(acl, offset)
        if not perm & 0o6:
            continue
        if tag == _ACL_GROUP_OBJ:
            return f"group {st.st_gid} (ACL)"
        if tag == _ACL_GROUP:
            return f"group {ident} (ACL)"
        if tag == _ACL_USER and ident != os.getuid():
            return f"user {ident} (ACL)"
    return None


def check_room(regions: dict[tuple[Caller, str], Any], caller: Caller, name: str,
               byte_size: int, max_regions: int, max_bytes: int,
               kind: str = "shared-memory") -> None:
    """Refuse a caller's new region that exists, or that takes it past its count or bytes
    (shm.max_regions_per_caller, shm.max_bytes_per_caller): system and CUDA regions alike."""
    if (caller, name) in regions:
        raise RegionError("exists", f"{kind} region {name!r} is already registered")
    mine = [r for (c, _), r in list(regions.items()) if c == caller]
    if len(mine) >= max_regions:
        raise RegionError("exhausted", f"{len(mine)} {kind} regions registered already "
                                       f"(shm.max_regions_per_caller: {max_regions}); "
                                       "unregister some first")
    held = sum(r.byte_size for r in mine)
    if held + byte_size > max_bytes:
        raise RegionError("exhausted", f"{held} + {byte_size} bytes of {kind} regions exceed "
                                       f"shm.max_bytes_per_caller ({max_bytes})")


def keys(regions: dict[tuple[Caller, str], Any], caller: Caller, name: str,
         kind: str = "shared-memory") -> list[tuple[Caller, str]]:
    """The caller's region `name`, or all of the caller's when `name` is empty."""
    if not name:
        return [k for k in regions if k[0] == caller]
    if (caller, name) not in regions:
        raise RegionError("not_found", f"no {kind} region {name!r} is registered")
    return [(caller, name)]


class Regions:
    """Each caller's registered regions. Nothing is kept open: a region is a name checked
    (owner, privacy, size, inode) at registration and again, by stat, on every use."""

    def __init__(self, allowed_uids: list[int] | None = None, max_regions: int = 64,
                 max_bytes: int = 16 << 30) -> None:
        self.tcp_owners = set(allowed_uids or [])
        self.max_regions, self.max_bytes = max_regions, max_bytes
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

    def _open(self, key: str, obj: str) -> tuple[int, os.stat_result]:
        try:  # never follows a symlink
            fd = os.open(SHM_DIR / obj, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise RegionError("invalid", f"shared-memory object {key!r} does not exist") from None
        except PermissionError:
            raise RegionError("denied", f"cuvild (uid {os.getuid()}) may not open shared-memory "
                                        f"object {key!r}: create it mode 0600 and grant the "
                                        f"daemon's user alone: setfacl -m u:{os.getuid()}:rw "
                                        f"{SHM_DIR / obj}") from None
        except OSError as e:
            raise RegionError("invalid", f"{key!r} is not a usable shared-memory object: "
                                         f"{e.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise RegionError("invalid", f"{key!r} is not a shared-memory object")
        return fd, st

    def register(self, caller: Caller, name: str, key: str, offset: int,
                 byte_size: int) -> Region:
        if not name:
            raise RegionError("invalid", "region name is empty")
        obj = _object_name(key)
        if ARENA.match(obj):
            raise RegionError("denied", f"{key!r} is cuvild's own memory, not a client's")
        self._check_room(caller, name, byte_size)
        fd, st = self._open(key, obj)
        try:
            self._check_owner(caller, key, st.st_uid)
            reach = _others_reach(fd, st)
        finally:
            os.close(fd)
        if reach is not None:
            raise RegionError("denied", f"shared-memory object {key!r} can be read or written by "
                                        f"{reach}, not only by its owner and cuvild: create it "
                                        "mode 0600 (docs/OPERATIONS.md, client shared memory)")
        if byte_size <= 0 or offset < 0 or offset + byte_size > st.st_size:
            raise RegionError("invalid", f"region {name!r}: offset {offset} + byte_size "
                                         f"{byte_size} is outside {key!r} of {st.st_size} bytes")
        region = Region(name, key, offset, byte_size, obj, st.st_ino)
        with self._lock:
            self._check_room(caller, name, byte_size)  # again: a concurrent register may win
            self._regions[(caller, name)] = region
        return region

    def _check_room(self, caller: Caller, name: str, byte_size: int) -> None:
        check_room(self._regions, caller, name, byte_size, self.max_regions, self.max_bytes)

    def _keys(self, caller: Caller, name: str) -> list[tuple[Caller, str]]:
        return keys(self._regions, caller, name)

    def unregister(self, caller: Caller, name: str = "") -> list[Region]:
        """Drop the caller's region `name` (all of the caller's when empty); returns them."""
        with self._lock:
            return [self._regions.pop(k) for k in self._keys(caller, name)]

    def status(self, caller: Caller, name: str = "") -> list[Region]:
        with self._lock:
            return [self._regions[k] for k in self._keys(caller, name)]

    def locate(self, caller: Caller, name: str, offset: int, nbytes: int) -> tuple[Region, int]:
        """The region and the absolute offset in its object of [offset, offset + nbytes)."""
        region = self._regions.get((caller, name))
        if region is None:
            raise RegionError("invalid", f"unknown shared-memory region {name!r}")
        if offset < 0 or offset + nbytes > region.byte_size:
            raise RegionError("invalid", f"shared-memory region {name!r}: offset {offset} + "
                                         f"{nbytes} bytes is outside its {region.byte_size} "
                                         "bytes")
        # Workers open the object by name: it must still be the one registered, as large.
        try:
            st = os.stat(SHM_DIR / region.object_name, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is None or st.st_ino != region.inode:
            raise RegionError("invalid", f"shared-memory region {name!r}: object {region.key!r} "
                                         "was removed or replaced since it was registered; "
                                         "unregister and register it again")
        end = region.offset + offset + nbytes
        if st.st_size < end:
            raise RegionError("invalid", f"shared-memory region {name!r}: object {region.key!r} "
                                         f"shrank to {st.st_size} bytes, {end} are needed")
        return region, region.offset + offset

    def count(self) -> int:
        """Regions registered, every caller's."""
        return len(self._regions)

    def close(self) -> None:
        with self._lock:
            self._regions.clear()
