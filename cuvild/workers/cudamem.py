"""Clients' CUDA shared memory as a device worker uses it: opened here, never staged.

A client registers device memory by its CUDA IPC handle (cuvild/serve/cuda_regions.py); a
request then names bytes of it as TensorRef(`name(device, handle)`, offset, dtype, shape). The
daemon checked the bytes lie within what the caller registered. A worker opens each handle once
(`cudaIpcOpenMemHandle`, through cuda-python as the daemon does) and keeps the allocation as a
torch tensor over the client's memory (`__cuda_array_interface__`: no copy):

- on a GPU the part reads its input there and writes its output there, device to device (a
  CUDA graph's static inputs copied from it, its outputs copied into it), and the worker waits
  for its stream before it answers, so the client reads a finished output;
- on any other device an input is copied to the host once (`read`) and an output copied to
  the device after the run (`write`): one copy each, where the daemon staged through host
  memory twice (device -> request bytes -> arena, and back).

A handle is closed when its region is unregistered (the daemon's Forget) or the worker ends.
A handle that does not open, or bytes outside its allocation, fail the request as a bad
region (RegionGone: INVALID_ARGUMENT), not as the worker's fault.
The opener is a parameter (`open_handle`): tests give one over host memory.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

from cuvild.workers.clientmem import RegionGone

PREFIX = "cuda-ipc:"  # a TensorRef's segment that names a client's CUDA allocation
HANDLE_SIZE = 64  # CUDA_IPC_HANDLE_SIZE


def name(device_id: int, raw_handle: bytes) -> str:
    """The segment name a request's TensorRef gives a CUDA region: its device and handle."""
    return f"{PREFIX}{device_id}:{bytes(raw_handle).hex()}"


def is_cuda(segment: str) -> bool:
    return segment.startswith(PREFIX)


def parse(segment: str) -> tuple[int, bytes]:
    """(device, raw handle) of a name made by `name`."""
    device, _, handle = segment.removeprefix(PREFIX).partition(":")
    raw = bytes.fromhex(handle)
    if len(raw) != HANDLE_SIZE or not device.isdecimal():
        raise ValueError(f"not a CUDA region's name: {segment[:40]!r}")
    return int(device), raw


class _Memory:
    """An allocation as __cuda_array_interface__ describes it to torch (bytes, no copy)."""

    def __init__(self, pointer: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1",
                                         "data": (pointer, False), "version": 3,
                                         "strides": None}


def open_ipc(device_id: int, raw_handle: bytes) -> tuple[Any, Callable[[], None]]:
    """The client's allocation as a uint8 CUDA tensor, and what closes it."""
    import torch
    from cuda.bindings import driver, runtime

    def check(result: Any, what: str) -> Any:
        err = result[0]
        if int(err) != 0:  # cudaSuccess, CUDA_SUCCESS
            raise RuntimeError(f"{what}: {getattr(err, 'name', err)}")
        return result[1] if len(result) == 2 else result[1:]

    with torch.cuda.device(device_id):  # (the thread's device, as torch keeps it)
        handle = runtime.cudaIpcMemHandle_t()
        ctypes.memmove(handle.getPtr(), raw_handle, HANDLE_SIZE)
        pointer = int(check(runtime.cudaIpcOpenMemHandle(
            handle, runtime.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle"))
        try:
            base, size = check(driver.cuMemGetAddressRange(driver.CUdeviceptr(pointer)),
                               "cuMemGetAddressRange")
        except RuntimeError:
            runtime.cudaIpcCloseMemHandle(pointer)
            raise
        size = int(size) - (pointer - int(base))
        memory = torch.as_tensor(_Memory(pointer, size), device=f"cuda:{device_id}")

    def close() -> None:
        runtime.cudaIpcCloseMemHandle(pointer)

    return memory, close


class CudaObjects:
    """The CUDA regions this worker has opened, by name."""

    def __init__(self, open_handle: Callable[[int, bytes], tuple[Any, Callable[[], None]]]
                 = open_ipc) -> None:
        self.open_handle = open_handle
        self.open: dict[str, tuple[Any, Callable[[], None]]] = {}
        self._lock = threading.Lock()

    def tensor(self, segment: str, offset: int, dtype: str, shape: tuple[int, ...]) -> Any:
        """A tensor over the region's bytes (on its device)."""
        import torch

        from cuvild.core.dtypes import nbytes

        with self._lock:
            found = self.open.get(segment)
            if found is None:
                try:
                    found = self.open[segment] = self.open_handle(*parse(segment))
                except Exception as e:  # noqa: BLE001 - the request's region, not the worker
                    raise RegionGone(f"CUDA region: its IPC handle did not open here: "
                                     f"{type(e).__name__}: {e}") from None
        memory, size = found[0], nbytes(dtype, shape)
        if offset < 0 or offset + size > memory.numel():
            raise RegionGone(f"CUDA region: offset {offset} + {size} bytes is outside its "
                             f"{memory.numel()} bytes")
        return memory[offset:offset + size].view(getattr(torch, dtype)).view(shape)

    def read(self, segment: str, offset: int, dtype: str, shape: tuple[int, ...]) -> Any:
        """An input's bytes, copied to the host (for a part that does not run on the GPU)."""
        return self.tensor(segment, offset, dtype, shape).to("cpu", copy=True)

    def write(self, value: Any, segment: str, offset: int, dtype: str,
              shape: tuple[int, ...]) -> None:
        """An output copied into the region, finished before this returns."""
        import torch

        place = self.tensor(segment, offset, dtype, shape)
        place.copy_(torch.as_tensor(value).reshape(shape))
        self.settle(place)

    @staticmethod
    def settle(place: Any) -> None:
        """Wait for what was queued to write `place` (a device's stream; nothing on the
        host)."""
        if getattr(place, "is_cuda", False):
            import torch

            torch.cuda.current_stream(place.device).synchronize()

    def forget(self, segments: set[str]) -> None:
        with self._lock:
            gone = [self.open.pop(s) for s in segments if s in self.open]
        for _memory, close in gone:
            close()

    def close(self) -> None:
        self.forget(set(self.open))
