"""Clients' shared-memory objects as a device worker uses them: checked on every use.

A client registers a region of a POSIX shared-memory object of its own; a request names bytes
of it as TensorRef(object name, offset, dtype, shape, inode). The client can shrink or replace
the object at any time, and touching a mapping past a shrunk object's end raises SIGBUS. So:

- every use checks the object's current size (fstat of a kept descriptor) against the bytes
  the request names; a request naming bytes the object no longer has fails with RegionGone
  (kind "invalid") before anything touches them;
- a worker process maps the object (runtimes read inputs and write outputs in place). A shrink
  between the check and the access can still SIGBUS it: that kills only the worker, which the
  engine restarts before it runs the request once more (whose check then fails);
- a worker thread in the daemon (`engine.workers: thread`) never maps a client object: it
  reads inputs with preadv into a fresh buffer (a shrink makes a short read: RegionGone) and
  writes outputs with pwrite, so no truncate can SIGBUS the daemon.

A worker keeps at most MAX_OBJECTS objects open, the least recently used going first (each
costs a descriptor, and a mapping with its own duplicated descriptor).
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable

from cuvild.core.arena import SHM_DIR

MAX_OBJECTS = 64

Key = tuple[str, int]  # (object name, inode)


class RegionGone(ValueError):
    """The client's object no longer holds the bytes a request names."""

    kind = "invalid"


class ClientObject:
    """One client object, opened once (never through a symlink, and only if it is still the
    object registered)."""

    def __init__(self, name: str, inode: int) -> None:
        self.name = name
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise RegionGone(f"client object {name!r} is gone; register the region "
                             "again") from None
        except OSError as e:
            raise RegionGone(f"client object {name!r} cannot be opened: "
                             f"{e.strerror}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_ino != inode:
            os.close(fd)
            raise RegionGone(f"client object {name!r} was replaced since it was registered; "
                             "register the region again")
        self.fd = fd
        self.mm: mmap.mmap | None = None
        self.old: list[mmap.mmap] = []  # smaller mappings of an object that grew

    def check(self, offset: int, nbytes: int) -> None:
        """Raise RegionGone unless the object still holds [offset, offset + nbytes)."""
        size = os.fstat(self.fd).st_size
        if offset < 0 or offset + nbytes > size:
            raise RegionGone(f"client object {self.name!r} is {size} bytes now; the request "
                             f"names bytes [{offset}, {offset + nbytes}) of it (it was shrunk "
                             "since it was registered)")

    def view(self, offset: int, nbytes: int) -> memoryview:
        """The bytes, mapped (a worker process): checked, and mapped again if it grew."""
        self.check(offset, nbytes)
        if self.mm is None or len(self.mm) < offset + nbytes:
            if self.mm is not None:
                self.old.append(self.mm)
            self.mm = mmap.mmap(self.fd, os.fstat(self.fd).st_size, mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE)
        return memoryview(self.mm)[offset:offset + nbytes]

    def read(self, offset: int, out: memoryview) -> None:
        """Fill `out` from the object's bytes at `offset`, without mapping them."""
        done, want = 0, len(out)
        while done < want:
            got = os.preadv(self.fd, [out[done:]], offset + done)
            if got <= 0:
                self.check(offset, want)  # names the sizes
                raise RegionGone(f"client object {self.name!r} ended at {offset + done} "
                                 f"while bytes [{offset}, {offset + want}) were read")
            done += got

    def write(self, offset: int, data: memoryview) -> None:
        """Write `data` at `offset` without mapping the object (a shrink after the check
        makes the object grow back, never a fault)."""
        self.check(offset, len(data))
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], offset + done)

    def close(self) -> bool:
        """Unmap and close; False while a view of a mapping is still alive somewhere (call
        again later)."""
        for mm in [*self.old, *([self.mm] if self.mm is not None else [])]:
            try:
                mm.close()
            except BufferError:
                return False
        self.old, self.mm = [], None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        return True


class ClientObjects:
    """The client objects a worker holds open, least recently used first. `dropped` is told
    of each object about to close, so its owner lets go of the views aliasing it."""

    def __init__(self, dropped: Callable[[Key], None], limit: int = MAX_OBJECTS) -> None:
        self.open: OrderedDict[Key, ClientObject] = OrderedDict()
        self.closing: list[ClientObject] = []
        self.dropped = dropped
        self.limit = limit

    def get(self, name: str, inode: int) -> ClientObject:
        key = (name, inode)
        obj = self.open.get(key)
        if obj is not None:
            self.open.move_to_end(key)
            return obj
        obj = self.open[key] = ClientObject(name, inode)
        while len(self.open) > self.limit:
            self._close(*self.open.popitem(last=False))
        return obj

    def forget(self, keys: set[Key]) -> None:
        for key in keys & set(self.open):
            self._close(key, self.open.pop(key))

    def _close(self, key: Key, obj: ClientObject) -> None:
        self.dropped(key)
        self.closing.append(obj)
        self.close_pending()

    def close_pending(self) -> None:
        """Close what no runtime views any more (OpenVINO's infer request holds its last
        input until the next run)."""
        self.closing = [obj for obj in self.closing if not obj.close()]


class DaemonRegions:
    """Client objects the daemon itself reads and writes (a batch's gather and scatter):
    never mapped, so no client can make the daemon fault; shared by the daemon's threads."""

    def __init__(self) -> None:
        self._objects = ClientObjects(lambda key: None)
        self._lock = threading.Lock()

    def read(self, name: str, inode: int, offset: int, out: memoryview) -> None:
        with self._lock:  # (held while its descriptor is used: `forget` closes it)
            self._objects.get(name, inode).read(offset, out)

    def write(self, name: str, inode: int, offset: int, data: memoryview) -> None:
        with self._lock:
            self._objects.get(name, inode).write(offset, data)

    def forget(self, keys: set[Key]) -> None:
        with self._lock:
            self._objects.forget(keys)
