"""CUDA shared memory: the protocol's cuda_shared_memory extension.

A client allocates device memory, exports it as a CUDA IPC handle (`cudaIpcGetMemHandle`: 64
opaque bytes, as tritonclient.utils.cuda_shared_memory makes them) and registers the handle
under a name; requests then name the region for inputs and outputs, as with system shared
memory. The daemon opens each handle once (`cudaIpcOpenMemHandle`) through cuda-python, the
bindings tritonclient itself uses, and closes it at unregistration or when the caller's last
connection closes.

With process workers (`engine.workers: process`, the default) a request's tensor in a CUDA
region goes to the workers as a reference (`ref`: TensorRef of cuvild/workers/cudamem.py's
name for the handle), checked against the region here: each worker that reads or writes it
opens the handle itself, a part on a GPU reads its input and writes its output there, device
to device, and a part elsewhere copies it once (cuvild/workers/cudamem.py). Unregistering a
region has the workers close it (`object_name`, their Forget). A model that batches requests
(its batcher gathers the rows in the daemon), and thread workers (the daemon's process has
the handle open already), stage through host memory instead: an input is copied
device-to-host into the request, an output host-to-device after the run.

Checks: a handle must be 64 bytes, the device one this daemon serves (its GPUs, checked
before any CUDA call: a bogus handle makes no context on a device cuvild does not use), and
`byte_size` no larger than the allocation the handle names (read back from the driver), so no
request can reach past what the client exported. Only unix-socket callers may register: a
CUDA IPC handle means something on this host alone, and a TCP or HTTP caller has no uid the
daemon can check. A region is counted while a request copies through it: unregistering it
then closes the mapping once the last copy is done, never under one. Regions are per caller
and count against the same shm.max_regions_per_caller / max_bytes_per_caller as system
regions.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cuvild.serve.regions import Caller, RegionError, check_room, keys
from cuvild.workers import cudamem
from protos.orders import TensorRef

HANDLE_SIZE = cudamem.HANDLE_SIZE  # CUDA_IPC_HANDLE_SIZE (the workers' too)
KIND = "CUDA shared-memory"  # in its messages


@dataclass
class CudaRegion:
    name: str
    device_id: int
    byte_size: int
    pointer: int  # the device address in the daemon, from cudaIpcOpenMemHandle
    object_name: str = ""  # what a worker opens it by (cuvild/workers/cudamem.py `name`)
    users: int = 0  # requests copying through it now (under CudaRegions._lock)
    gone: bool = False  # unregistered: closed when the last user is done


class CudaRegions:
    def __init__(self, max_regions: int = 64, max_bytes: int = 16 << 30,
                 devices: set[int] | None = None, direct: bool = False) -> None:
        """`devices`: the CUDA device indices the daemon serves (its GPUs); None: any the
        host has (tests), an empty set: none (CUDA shared memory is then unavailable).
        `direct`: requests hand the workers references (process workers), not bytes."""
        self.max_regions, self.max_bytes = max_regions, max_bytes
        self.devices = devices
        self.direct = direct
        self._regions: dict[tuple[Caller, str], CudaRegion] = {}
        self._lock = threading.Lock()
        self._rt: Any = None

    # -- the CUDA runtime ------------------------------------------------------------------
    def _runtime(self) -> Any:
        if self._rt is None:
            try:
                from cuda.bindings import runtime
            except ImportError:
                raise RegionError("unavailable", "CUDA shared memory needs the cuda-python "
                                  "bindings in cuvild's environment (pip install "
                                  "cuda-python); none are installed") from None
            err, count = runtime.cudaGetDeviceCount()
            if err != runtime.cudaError_t.cudaSuccess or count == 0:
                raise RegionError("unavailable", "no CUDA device on this host")
            self._rt = runtime
        return self._rt

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        rt = self._runtime()
        result = fn(*args)
        err = result[0]
        if err != rt.cudaError_t.cudaSuccess:
            _, text = rt.cudaGetErrorString(err)
            text = text.decode() if isinstance(text, bytes) else str(text)
            raise RegionError("invalid", f"{what}: {getattr(err, 'name', err)} ({text})")
        return result[1] if len(result) == 2 else result[1:]

    def _device(self, device_id: int) -> None:
        """The calling thread works on this device (each gRPC thread may be another)."""
        rt = self._runtime()
        count = self._call("cudaGetDeviceCount", rt.cudaGetDeviceCount)
        if not 0 <= device_id < count:
            raise RegionError("invalid", f"CUDA device {device_id} does not exist: this host "
                                         f"has {count} (0..{count - 1})")
        self._call("cudaSetDevice", rt.cudaSetDevice, device_id)

    def _allocation_size(self, pointer: int) -> int | None:
        try:
            from cuda.bindings import driver

            err, _base, size = driver.cuMemGetAddressRange(driver.CUdeviceptr(pointer))
            return int(size) if err == driver.CUresult.CUDA_SUCCESS else None
        except Exception:  # an older binding: byte_size is then checked by each copy alone
            return None

    # -- the extension ---------------------------------------------------------------------
    def register(self, caller: Caller, name: str, raw_handle: bytes, device_id: int,
                 byte_size: int) -> CudaRegion:
        if not name:
            raise RegionError("invalid", "region name is empty")
        if len(raw_handle) != HANDLE_SIZE:
            raise RegionError("invalid", f"CUDA region {name!r}: raw_handle is "
                                         f"{len(raw_handle)} bytes, a CUDA IPC handle is "
                                         f"{HANDLE_SIZE} (cudaIpcGetMemHandle)")
        if byte_size <= 0:
            raise RegionError("invalid", f"CUDA region {name!r}: byte_size must be > 0")
        if caller is None:
            raise RegionError("denied", "CUDA shared memory is for callers on the unix socket: "
                                        "a CUDA IPC handle means something on this host alone")
        if self.devices is not None and not self.devices:
            raise RegionError("unavailable", "no CUDA device is served by this daemon "
                                             "(devices.gpu is off, or none was found)")
        if self.devices is not None and device_id not in self.devices:
            served = ", ".join(map(str, sorted(self.devices)))
            raise RegionError("invalid", f"CUDA region {name!r}: device {device_id} is not a "
                                         f"GPU cuvild serves (CUDA devices: {served})")
        with self._lock:
            self._check_room(caller, name, byte_size)
        rt = self._runtime()
        self._device(device_id)
        handle = rt.cudaIpcMemHandle_t()
        ctypes.memmove(handle.getPtr(), bytes(raw_handle), HANDLE_SIZE)
        pointer = int(self._call(f"CUDA region {name!r}: opening its IPC handle",
                                 rt.cudaIpcOpenMemHandle, handle,
                                 getattr(rt, "cudaIpcMemLazyEnablePeerAccess", 1)))
        size = self._allocation_size(pointer)
        if size is not None and byte_size > size:
            self._close(pointer)
            raise RegionError("invalid", f"CUDA region {name!r}: byte_size {byte_size} is "
                                         f"larger than the {size} bytes the handle names")
        region = CudaRegion(name, device_id, byte_size, pointer,
                            object_name=cudamem.name(device_id, raw_handle))
        with self._lock:
            try:
                self._check_room(caller, name, byte_size)  # a concurrent register may win
            except RegionError:
                self._close(pointer)
                raise
            self._regions[(caller, name)] = region
        return region

    def _check_room(self, caller: Caller, name: str, byte_size: int) -> None:
        check_room(self._regions, caller, name, byte_size, self.max_regions, self.max_bytes,
                   KIND)

    def _keys(self, caller: Caller, name: str) -> list[tuple[Caller, str]]:
        return keys(self._regions, caller, name, KIND)

    def _close(self, pointer: int) -> None:
        rt = self._rt
        if rt is not None:
            rt.cudaIpcCloseMemHandle(pointer)  # its error is nothing a caller could act on

    def unregister(self, caller: Caller, name: str = "") -> list[CudaRegion]:
        """Drop (and close) the caller's region `name`, or all of the caller's when empty; a
        region a request is copying through is closed when that copy is done."""
        with self._lock:
            gone = [self._regions.pop(k) for k in self._keys(caller, name)]
            idle = []
            for region in gone:
                region.gone = True
                if not region.users:
                    idle.append(region)
        for region in idle:
            self._close(region.pointer)
        return gone

    def status(self, caller: Caller, name: str = "") -> list[CudaRegion]:
        with self._lock:
            return [self._regions[k] for k in self._keys(caller, name)]

    def has(self, caller: Caller, name: str) -> bool:
        return (caller, name) in self._regions

    def count(self) -> int:
        return len(self._regions)

    @contextlib.contextmanager
    def _using(self, caller: Caller, name: str, offset: int, nbytes: int) -> Iterator[CudaRegion]:
        """The region, held open while the caller copies through it."""
        with self._lock:
            region = self._regions.get((caller, name))
            if region is None:
                raise RegionError("invalid", f"unknown CUDA shared-memory region {name!r}")
            if offset < 0 or offset + nbytes > region.byte_size:
                raise RegionError("invalid", f"CUDA region {name!r}: offset {offset} + "
                                             f"{nbytes} bytes is outside its "
                                             f"{region.byte_size} bytes")
            region.users += 1
        try:
            yield region
        finally:
            with self._lock:
                region.users -= 1
                last = region.gone and not region.users
            if last:  # unregistered while in use: closed now
                self._close(region.pointer)

    def ref(self, caller: Caller, name: str, offset: int, dtype: str,
            shape: tuple[int, ...], nbytes: int) -> TensorRef:
        """A reference to `nbytes` of the caller's region at `offset`, for the workers."""
        with self._using(caller, name, offset, nbytes) as region:
            return TensorRef(region.object_name, offset, dtype, shape)

    def read(self, caller: Caller, name: str, offset: int, nbytes: int) -> bytearray:
        """`nbytes` from the region at `offset`, copied to host memory."""
        out = bytearray(nbytes)
        with self._using(caller, name, offset, nbytes) as region:
            if nbytes:
                rt = self._runtime()
                self._device(region.device_id)
                host = (ctypes.c_char * nbytes).from_buffer(out)
                self._call(f"CUDA region {name!r}: copy to host", rt.cudaMemcpy,
                           ctypes.addressof(host), region.pointer + offset, nbytes,
                           rt.cudaMemcpyKind.cudaMemcpyDefault)
        return out

    def write(self, caller: Caller, name: str, offset: int, data: Any) -> None:
        """Copy `data` (bytes-like) into the region at `offset`."""
        view = memoryview(data).cast("B")
        with self._using(caller, name, offset, view.nbytes) as region:
            if view.nbytes:
                rt = self._runtime()
                self._device(region.device_id)
                staged = bytearray(view) if view.readonly else view
                host = (ctypes.c_char * view.nbytes).from_buffer(staged)
                self._call(f"CUDA region {name!r}: copy from host", rt.cudaMemcpy,
                           region.pointer + offset, ctypes.addressof(host), view.nbytes,
                           rt.cudaMemcpyKind.cudaMemcpyDefault)

    def close(self) -> None:
        with self._lock:
            gone, self._regions = list(self._regions.values()), {}
            for region in gone:
                region.gone = True
        for region in gone:
            if not region.users:
                self._close(region.pointer)
