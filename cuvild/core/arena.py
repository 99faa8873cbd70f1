"""The shared-memory arena: where tensors cross between parts, workers and clients.

Named POSIX shared-memory segments (mode 0600, named `cuvil-<instance>-<random>`: the prefix
lets a restarted daemon reclaim what a crashed one left, the random part keeps anyone from
taking a name before the daemon does), page-locked with mlock (and, where CUDA
is present, registered with the driver so host<->GPU copies are DMA), sub-allocated per request
with 64-byte alignment. Any process that knows a segment's name maps the same bytes, so a
tensor written by one part is read in place by the next: torch.frombuffer, numpy views,
openvino.Tensor(shared_memory=True) and ORT OrtValues all wrap it without a copy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)
ALIGN = 64
SHM_DIR = Path("/dev/shm")
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def _address(mm: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


class Segment:
    """One named shared-memory segment mapped into this process."""

    def __init__(self, name: str, size: int, create: bool, lock: bool = True,
                 inode: int = 0) -> None:
        """Create `name` of `size` bytes, or open an existing one (its own size). Opening
        never follows a symlink; with `inode` it fails unless the object is that one."""
        self.name, self.size, self.owner = name, size, create
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(SHM_DIR / name, flags, 0o600)
        try:
            self.stat = os.fstat(fd)
            if inode and self.stat.st_ino != inode:
                raise FileNotFoundError(f"shared-memory object {name!r} was replaced since it "
                                        "was registered; register the region again")
            if create:
                # Reserve its pages now: a tmpfs that is full answers ENOSPC here, where a
                # file only ftruncate'd would be a SIGBUS at the first write to a new page
                # (the daemon or a worker killed by a full /dev/shm).
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError:
                    os.unlink(SHM_DIR / name)
                    raise
            else:
                if not stat.S_ISREG(self.stat.st_mode):
                    raise ValueError(f"{name!r} is not a shared-memory object")
                self.size = size = self.stat.st_size
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.locked = lock and self._mlock()
        self.cuda_registered = False
        # what this process made goes with it, close() or not: a client script that ends
        # without closing its Client, a dropped object (at exit, or when collected)
        self._unlink = weakref.finalize(self, _unlink, SHM_DIR / name) if create else None

    def _mlock(self) -> bool:
        if _libc.mlock(ctypes.c_void_p(_address(self.mm)), ctypes.c_size_t(self.size)) != 0:
            err = ctypes.get_errno()
            log.warning("mlock of %s (%d bytes) failed: %s; raise LimitMEMLOCK to page-lock",
                        self.name, self.size, os.strerror(err))
            return False
        return True

    def register_cuda(self) -> bool:
        """Make the mapping DMA-able for CUDA copies (cudaHostRegister)."""
        try:
            import torch

            if not torch.cuda.is_available():
                return False
            rc = torch.cuda.cudart().cudaHostRegister(_address(self.mm), self.size, 0)
            self.cuda_registered = int(rc) == 0
        except (ImportError, RuntimeError, AttributeError) as e:
            log.warning("cudaHostRegister of %s failed: %s", self.name, e)
        return self.cuda_registered

    def view(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"range [{offset}, {offset + nbytes}) is outside segment "
                             f"{self.name!r} of {self.size} bytes")
        return memoryview(self.mm)[offset:offset + nbytes]

    def array(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape)) if shape else 1
        return np.frombuffer(self.view(offset, count * dtype.itemsize), dtype=dtype).reshape(shape)

    def close(self) -> bool:
        """Unmap (and unlink, if this process made it); False if a view of it is still alive
        somewhere (the mapping then stays until a later close, or the process's exit)."""
        if self.cuda_registered:
            import torch

            torch.cuda.cudart().cudaHostUnregister(_address(self.mm))
            self.cuda_registered = False
        if self._unlink is not None:
            if self.owner:
                self._unlink()  # (once: a finalizer runs at most one time)
            else:  # handed over: another process unlinks it
                self._unlink.detach()
        try:
            self.mm.close()
        except BufferError:
            log.debug("segment %s still has exported views", self.name)
            return False
        return True


@dataclass
class Block:
    segment: str
    offset: int
    size: int


class Arena:
    """The daemon's segments and a first-fit allocator over them (thread-safe)."""

    # A segment is page-locked, so all of it is resident from its first request: 8 MiB holds
    # a few requests of most models (resnet18 b1: 0.6 MiB each); a bigger block gets a
    # segment of its own size. (64 MiB made the arena a fifth of a warm daemon tree's PSS.)
    def __init__(self, instance: str, segment_bytes: int = 8 << 20, lock: bool = True) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", instance):
            raise ValueError(f"arena instance name {instance!r}: use letters, digits, _ . -")
        self.prefix = f"cuvil-{instance}-"
        self.segment_bytes = segment_bytes
        self.lock_pages = lock
        self.segments: dict[str, Segment] = {}
        self._free: dict[str, list[tuple[int, int]]] = {}  # segment -> sorted (offset, size)
        self._mutex = threading.Lock()
        self._count = 0

    def _new_segment(self, at_least: int) -> Segment:
        size = max(self.segment_bytes, align(at_least, mmap.PAGESIZE))
        for attempt in range(8):  # names are unguessable; a collision is only bad luck
            name = f"{self.prefix}{secrets.token_hex(8)}"
            try:
                seg = Segment(name, size, create=True, lock=self.lock_pages)
                break
            except FileExistsError:
                log.warning("shared-memory name %s is taken; drawing another", name)
                if attempt == 7:
                    raise
            except OSError as e:  # ENOSPC: /dev/shm is full
                from cuvild.core.errors import ArenaFull

                raise ArenaFull(f"no shared memory for a block of {size} bytes: {SHM_DIR} is "
                                f"full ({e.strerror}); requests in flight hold "
                                f"{self.in_use_unlocked()} bytes of the arena") from None
        self._count += 1
        self.segments[name] = seg
        self._free[name] = [(0, size)]
        return seg

    def alloc(self, nbytes: int) -> Block:
        nbytes = align(max(nbytes, 1))
        with self._mutex:
            for name, holes in self._free.items():
                for i, (off, size) in enumerate(holes):
                    if size >= nbytes:
                        holes[i:i + 1] = [(off + nbytes, size - nbytes)] if size > nbytes else []
                        return Block(name, off, nbytes)
            seg = self._new_segment(nbytes)
            holes = self._free[seg.name]
            off, size = holes[0]
            holes[:] = [(off + nbytes, size - nbytes)] if size > nbytes else []
            return Block(seg.name, 0, nbytes)

    def free(self, block: Block) -> None:
        with self._mutex:
            holes = self._free[block.segment]
            holes.append((block.offset, block.size))
            holes.sort()
            merged: list[tuple[int, int]] = []
            for off, size in holes:  # coalesce neighbours
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((off, size))
            holes[:] = merged

    def free_after(self, block: Block, outstanding: Sequence[Future[Any]]) -> None:
        """Free the block once every future (a part still running on it) is done."""
        left = [f for f in outstanding if not f.done()]
        if not left:
            self.free(block)
            return
        count, lock = [len(left)], threading.Lock()

        def done(_: Future[Any]) -> None:
            with lock:
                count[0] -= 1
                last = count[0] == 0
            if last:
                self.free(block)

        for future in left:
            future.add_done_callback(done)

    # A request's tensors in its block (`slot`: a cuvild/core/layout.py Slot).
    def ref(self, block: Block, slot: Any) -> Any:
        from protos.orders import TensorRef

        return TensorRef(block.segment, block.offset + slot.offset, slot.dtype, slot.shape)

    def bytes(self, block: Block, slot: Any) -> memoryview:
        return self.segments[block.segment].view(block.offset + slot.offset, slot.nbytes)

    def tensor(self, block: Block, slot: Any) -> Any:
        import torch

        if slot.nbytes == 0:
            return torch.empty(slot.shape, dtype=getattr(torch, slot.dtype))
        raw = self.bytes(block, slot)
        return torch.frombuffer(raw, dtype=getattr(torch, slot.dtype)).view(slot.shape)

    def in_use(self) -> int:
        with self._mutex:
            return self.in_use_unlocked()

    def in_use_unlocked(self) -> int:
        free = sum(size for holes in self._free.values() for _, size in holes)
        return sum(s.size for s in self.segments.values()) - free

    def close(self) -> None:
        with self._mutex:
            for seg in self.segments.values():
                seg.close()
            self.segments.clear()
            self._free.clear()


def reclaim_stale(prefix: str = "cuvil-", dry_run: bool = False) -> list[str]:
    """Unlink segments of processes that are gone (names carry the creating pid): a daemon's
    at its start, a killed client's by `cuvilctl clean-shm` ("cuvil-client-"). Only this
    user's (root: anyone's); `dry_run` only names them."""
    removed = []
    for path in SHM_DIR.glob(f"{prefix}*"):
        match = re.match(rf"{re.escape(prefix)}(\d+)-", path.name)
        if not match or _alive(int(match.group(1))):
            continue
        try:
            if os.getuid() not in (0, path.lstat().st_uid):
                continue
            if not dry_run:
                path.unlink(missing_ok=True)
        except OSError:
            continue
        removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def plan_offsets(sizes: dict[str, int], lifetimes: dict[str, tuple[int, int]]) -> tuple[
        dict[str, int], int]:
    """Offsets for tensors so that ones alive at the same time never overlap.

    Greedy by size (as TFLite's arena planner): place the largest first at the lowest offset
    that does not collide with an already placed tensor whose lifetime overlaps. Returns the
    offsets and the footprint (the peak, not the sum).
    """
    placed: list[tuple[int, int, int, int]] = []  # offset, size, first, last
    offsets: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        size, (first, last) = align(sizes[name]), lifetimes[name]
        clashes = sorted((o, s) for o, s, f, lst in placed if not (lst < first or last < f))
        offset = 0
        for o, s in clashes:
            if offset + size <= o:
                break
            offset = max(offset, o + s)
        placed.append((offset, size, first, last))
        offsets[name] = offset
    footprint = max((o + s for o, s, _, _ in placed), default=0)
    return offsets, footprint
