"""A workaround for torch's fake CUDA guard on a CUDA build of torch with no CUDA device.

Entering a FakeTensorMode (torch.export.load, torch.compile, our archive reader) on such a
host calls `torch._C._ensureCUDADeviceGuardSet()`, which stores a guard object owned by the
calling thread (a `thread_local` in c10's DeviceGuardImplInterface.cpp) in the process-wide
registry. When that thread ends the registry points at freed memory, and the next thread to
enter a fake mode crashes the process (SIGSEGV). Seen with torch 2.11.0+cu130 on a host with
no GPU: a worker's build thread read an archive and ended, the next build's thread died with
the worker (`PYTHONFAULTHANDLER`: `FakeTensorMode.__enter__`). PyPI's torch for Linux is a
CUDA build, so a user's CPU-only host meets it; the CPU wheel never registers the guard.

`hold()` makes the first registration from a thread that never ends: the caller's, when it
is the main thread, else a parked one of its own. Later registrations see a guard with
devices and leave it alone.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_held = False


def hold() -> None:
    """Register torch's fake CUDA guard from a thread that outlives every other (once a
    process; a no-op where torch has no CUDA, or sees a device)."""
    global _held
    with _lock:
        if _held:
            return
        _held = True
        import torch

        if not torch.cuda._is_compiled() or _nvml_devices(torch) > 0:  # noqa: SLF001
            return  # (NVML's count: on a GPU host, nothing here initialises CUDA)
        if torch.cuda.is_available():
            return
        if threading.current_thread() is threading.main_thread():
            torch._C._ensureCUDADeviceGuardSet()  # noqa: SLF001
            return
        ready = threading.Event()

        def park() -> None:
            torch._C._ensureCUDADeviceGuardSet()  # noqa: SLF001
            ready.set()
            threading.Event().wait()  # the guard lives as long as this thread

        threading.Thread(target=park, name="cuvild-cuda-guard", daemon=True).start()
        ready.wait()


def _nvml_devices(torch: object) -> int:
    """The GPUs NVML sees (-1 without NVML: a host with no NVIDIA driver)."""
    try:
        return int(torch.cuda._device_count_nvml())  # type: ignore[attr-defined]  # noqa: SLF001
    except Exception:  # noqa: BLE001 - an older or other torch: ask CUDA instead
        return -1
