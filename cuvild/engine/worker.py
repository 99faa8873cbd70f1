"""A device worker: one process per device, pinned to its cores, running compiled parts.

It takes typed orders (cuvild/engine/orders.py) from a pipe, one at a time, and answers each
with a Reply tagged with the order's id: on the main pipe, or on the `direct` pipe when the
daemon's calling thread reads the reply itself. Tensors never travel through the pipe, only
references into shared memory; the worker wraps them in place (`torch.frombuffer`, once per
place, then reused) and writes outputs into their slots.

The same `serve` loop runs in a process (the default: a crashing compiler or driver takes down
its worker and not the daemon) or in a thread of the daemon (`engine.workers: thread`, and
tests), where it shares its `Worker` with the daemon's threads under a lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from cuvild.engine.dtypes import nbytes
from cuvild.engine.orders import (
    Build,
    Built,
    Choose,
    Envelope,
    Forget,
    Order,
    Ran,
    Reply,
    Run,
    TensorRef,
    Unload,
)
from partitioner.profile import DeviceProfile

MAX_MAPPED = 256  # client objects a worker keeps mapped; past it they are re-opened
MAX_VIEWS = 4096  # tensor views kept per worker (arena blocks recur request after request)
# torch.export keeps global state: in the daemon (thread workers), one build at a time.
BUILDS_IN_PROCESS = threading.Lock()


class Worker:
    """The compiled parts of one device and the shared memory they read and write."""

    def __init__(self, device: DeviceProfile, cache_dir: str) -> None:
        from runtimes.cache import CompileCache

        self.device = device
        self.cache = CompileCache(Path(cache_dir))
        self.parts: dict[tuple[str, str], Any] = {}  # (model, part) -> Executable run
        # (model, part) -> precision -> Executable, while a precision search needs them
        self.variants: dict[tuple[str, str], dict[str, Any]] = {}
        self.segments: dict[tuple[str, int], Any] = {}  # (name, inode) -> Segment
        self.views: dict[TensorRef, Any] = {}
        self.closing: list[Any] = []  # unregistered client segments a runtime still views

    def handle(self, order: Order) -> Built | Ran | None:
        if isinstance(order, Run):
            return self.run(order)
        if isinstance(order, Build):
            return self.build(order)
        if isinstance(order, Forget):
            return self.forget(order)
        if isinstance(order, Choose):
            return self.choose(order)
        if isinstance(order, Unload):
            return self.unload(order)
        raise TypeError(f"unknown order {type(order).__name__}")

    # -- shared memory -----------------------------------------------------------------
    def tensor(self, ref: TensorRef) -> Any:
        """A tensor aliasing `ref`'s bytes; made once per place, then reused."""
        view = self.views.get(ref)
        if view is None:
            if len(self.views) >= MAX_VIEWS:
                self.views.clear()
            view = self.views[ref] = self._view(ref)
        return view

    def _view(self, ref: TensorRef) -> Any:
        import torch

        from cuvild.engine.arena import Segment

        # The arena's segment names are never reused. A client's object is pinned by the
        # inode it was registered with: a replacement under the same name is refused.
        key = (ref.segment, ref.inode)
        seg = self.segments.get(key)
        if seg is None:
            if ref.inode and len(self.segments) >= MAX_MAPPED:
                self._forget_client_segments()
            seg = self.segments[key] = Segment(ref.segment, 0, create=False, lock=False,
                                               inode=ref.inode)
        dtype = getattr(torch, ref.dtype)
        size = nbytes(ref.dtype, ref.shape)
        if size == 0:
            return torch.empty(ref.shape, dtype=dtype)
        return torch.frombuffer(seg.view(ref.offset, size), dtype=dtype).view(ref.shape)

    def _forget_client_segments(self) -> None:
        self.views.clear()  # they alias the mappings about to close
        self.closing += [self.segments.pop(key) for key in [k for k in self.segments if k[1]]]
        self._close_pending()

    def forget(self, order: Forget) -> None:
        """Unmap client objects whose regions were unregistered. A runtime may still hold
        its last input (OpenVINO's infer request does): those close after the next run."""
        gone = {tuple(k) for k in order.segments}
        for ref in [r for r in self.views if (r.segment, r.inode) in gone]:
            del self.views[ref]
        self.closing += [self.segments.pop(key) for key in gone & set(self.segments)]
        self._close_pending()

    def _close_pending(self) -> None:
        self.closing = [seg for seg in self.closing if not seg.close()]

    # -- parts -------------------------------------------------------------------------
    def build(self, order: Build) -> Built:
        from cuvild.engine.build import build_model_part, forget, variants

        try:
            built, tried = build_model_part(order, self.device, self.cache)
        finally:
            if order.last:  # the model's other parts are not needed here any more
                forget(order.split_key)
        key = (order.model, order.part)
        own = built[order.precisions[0]]
        self.parts[key] = own.executable
        if len(built) > 1:  # a precision search will choose among them
            self.variants[key] = {p: b.executable for p, b in built.items()}
        return Built(own.runtime, all(b.from_cache for b in built.values()), tried,
                     variants(built))

    def choose(self, order: Choose) -> None:
        key = (order.model, order.part)
        self.parts[key] = self.variants[key][order.precision]
        if order.final:  # the losing precisions' executables go
            del self.variants[key]

    def run(self, order: Run) -> Ran:
        exe = self.parts.get((order.model, order.part))
        if exe is None:
            raise KeyError(f"part {order.part} of model {order.model} is not built here")
        inputs = [self.tensor(r) for r in order.inputs]
        t0 = time.perf_counter()
        outputs = exe.run(inputs)
        run_ms = (time.perf_counter() - t0) * 1e3
        for out, ref in zip(outputs, order.outputs, strict=True):
            dst = self.tensor(ref)
            if tuple(out.shape) != tuple(ref.shape):
                raise ValueError(f"output shape {tuple(out.shape)} != planned {ref.shape}")
            if dst.data_ptr() != out.data_ptr():  # the runtime did not write in place
                dst.copy_(out)
        if self.closing:
            self._close_pending()
        return Ran(run_ms)

    def unload(self, order: Unload) -> None:
        from cuvild.engine.build import forget

        forget(order.model)
        for key in [k for k in self.parts if k[0] == order.model]:
            del self.parts[key]
            self.variants.pop(key, None)


def answer(worker: Worker, envelope: Envelope) -> Reply:
    """Carry out one order; every failure goes back to the caller as the reply's error."""
    try:
        return Reply(envelope.id, worker.handle(envelope.order))
    except Exception as e:  # noqa: BLE001
        return Reply(envelope.id, error=f"{type(e).__name__}: {e}")


def serve(conn: Any, direct: Any, device: DeviceProfile, cache_dir: str,
          inline: tuple[Worker, threading.Lock] | None = None) -> None:
    """The worker loop: one order at a time until the pipe closes or brings None. In a
    thread (`inline`), it shares its Worker with the daemon's threads, which run parts
    themselves under the lock."""
    if inline is None:
        _pin(device)
        _quiet()
        worker, lock = Worker(device, cache_dir), contextlib.nullcontext()
    else:
        worker, lock = inline
    while True:
        try:
            envelope = conn.recv()
        except (EOFError, OSError):
            return
        if envelope is None:
            return
        # One build at a time in the daemon, taken before this device's lock, so a build
        # waiting on another device's does not stall runs.
        one_build = (BUILDS_IN_PROCESS if inline and isinstance(envelope.order, Build)
                     else contextlib.nullcontext())
        with one_build, lock:
            reply = answer(worker, envelope)
        (direct if envelope.direct else conn).send(reply)


def _pin(device: DeviceProfile) -> None:
    """Own the device's cores with passive waits: spinning pools of two runtimes on shared
    cores slow each other by up to 1.6x (measured on the 2-core dev host)."""
    cores = device.cores or sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores)
    os.environ.update({"OMP_NUM_THREADS": str(len(cores)), "OMP_WAIT_POLICY": "PASSIVE",
                       "KMP_BLOCKTIME": "0"})
    import torch

    torch.set_num_threads(len(cores))


def _quiet() -> None:
    """Library chatter that says nothing to a cuvild user (torch's pytree deprecation on
    unpickling, the ONNX exporter's note that torchvision is absent)."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)


def process_main(conn: Any, direct: Any, device_dict: dict[str, Any], cache_dir: str) -> None:
    """The worker process's entry point (a spawned process gets the profile as a dict)."""
    serve(conn, direct, DeviceProfile.from_dict(device_dict), cache_dir)
