"""Device workers: one process per device, pinned to its cores, running compiled parts.

The daemon talks to a worker with one small verb set over a pipe (`build`, `run`, `unload`,
`ping`); tensors never travel through the pipe, only references into shared memory
(segment name, offset, dtype, shape). Replies come back through a reader thread that
completes Futures, except for a `run` sent with `WorkerHandle.run`: its reply comes on a
second pipe that the calling thread reads itself, which saves a thread wake-up per call
(about 0.1 ms on the 2-core dev host) when its request is alone in the engine.
The same `serve` loop runs in a process (the default: a crashing compiler or driver takes
down its worker and not the daemon) or in a thread of the daemon (in_process=True, i.e.
`engine.workers: thread`, and in tests), where direct runs execute in the calling thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple

from partitioner.profile import DeviceProfile

log = logging.getLogger(__name__)
MAX_MAPPED = 256  # client objects a worker keeps mapped; past it they are re-opened
_BUILDS_IN_PROCESS = threading.Lock()
MAX_VIEWS = 4096  # tensor views kept per worker (arena blocks recur request after request)


ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4,
            "uint32": 4, "int64": 8, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4,
            "float64": 8, "complex64": 8, "complex128": 16}


def itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype name (a table: no tensor is made per call)."""
    size = ITEMSIZE.get(dtype)
    if size is None:
        import torch

        size = ITEMSIZE[dtype] = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return size


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = itemsize(dtype)
    for d in shape:
        n *= d
    return n


class TensorRef(NamedTuple):
    """Where a tensor lives: a named shared-memory segment and a place in it."""

    segment: str
    offset: int
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]
    inode: int = 0  # a client's region: the object registered (0: the daemon's arena)


class RawTensor(NamedTuple):
    """An input as a request's bytes (C order, native byte order), copied once, into the
    arena."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]


class WorkerDied(RuntimeError):
    pass


# ---- inside the worker ------------------------------------------------------------------

class _Worker:
    def __init__(self, device: DeviceProfile, cache_dir: str) -> None:
        from runtimes.cache import CompileCache

        self.device = device
        self.cache = CompileCache(Path(cache_dir))
        self.parts: dict[tuple[str, str], Any] = {}  # (model, part) -> Executable
        self.segments: dict[tuple[str, int], Any] = {}  # (name, inode) -> Segment
        self.views: dict[TensorRef, Any] = {}
        self.closing: list[Any] = []  # unregistered client segments a runtime still views

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

    def forget(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Unmap client objects whose regions were unregistered. A runtime may still hold
        its last input (OpenVINO's infer request does): those close after the next run."""
        gone = {tuple(k) for k in msg["segments"]}
        for ref in [r for r in self.views if (r.segment, r.inode) in gone]:
            del self.views[ref]
        self.closing += [self.segments.pop(key) for key in gone & set(self.segments)]
        self._close_pending()
        return {}

    def _close_pending(self) -> None:
        self.closing = [seg for seg in self.closing if not seg.close()]

    def build(self, msg: dict[str, Any]) -> dict[str, Any]:
        from cuvild.engine.build import build_model_part, forget

        try:
            built = build_model_part(msg, self.device, self.cache)
        finally:
            if msg.get("last"):  # the model's other parts are not needed here any more
                forget(msg.get("split_key", msg["model"]))
        self.parts[(msg["model"], msg["part"])] = built.executable
        return built.report()

    def run(self, msg: dict[str, Any]) -> dict[str, Any]:
        exe = self.parts.get((msg["model"], msg["part"]))
        if exe is None:
            raise KeyError(f"part {msg['part']} of model {msg['model']} is not built here")
        inputs = [self.tensor(r) for r in msg["inputs"]]
        t0 = time.perf_counter()
        outputs = exe.run(inputs)
        run_ms = (time.perf_counter() - t0) * 1e3
        for out, ref in zip(outputs, msg["outputs"], strict=True):
            dst = self.tensor(ref)
            if tuple(out.shape) != tuple(ref.shape):
                raise ValueError(f"output shape {tuple(out.shape)} != planned {ref.shape}")
            if dst.data_ptr() != out.data_ptr():  # the runtime did not write in place
                dst.copy_(out)
        if self.closing:
            self._close_pending()
        return {"run_ms": run_ms}

    def unload(self, msg: dict[str, Any]) -> dict[str, Any]:
        from cuvild.engine.build import forget

        forget(msg["model"])
        for key in [k for k in self.parts if k[0] == msg["model"]]:
            del self.parts[key]
        return {}


def serve(conn: Any, direct: Any, device: DeviceProfile, cache_dir: str,
          inline: tuple[_Worker, threading.Lock] | None = None) -> None:
    """The worker loop: one request at a time, replies tagged with the request's id (those
    of direct runs on the `direct` pipe). In a thread (`inline`), it shares its _Worker with
    the daemon's threads, which run parts themselves under the lock."""
    if inline is None:
        _pin(device)
        _quiet()
        worker, lock = _Worker(device, cache_dir), contextlib.nullcontext()
    else:
        worker, lock = inline
    handlers = {"build": worker.build, "run": worker.run, "unload": worker.unload,
                "forget": worker.forget,
                "ping": lambda msg: {"pid": os.getpid()}}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        # torch.export keeps global state: in the daemon, one build at a time (taken before
        # this device's lock, so a build waiting on another device's does not stall runs).
        one_build = _BUILDS_IN_PROCESS if inline and msg.get("op") == "build" else None
        with one_build or contextlib.nullcontext(), lock:
            reply = _handle(handlers, msg)
        (direct if msg.get("direct") else conn).send(reply)


def _handle(handlers: dict[str, Any], msg: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"id": msg["id"], "ok": True, **handlers[msg["op"]](msg)}
    except Exception as e:  # noqa: BLE001 - every failure goes back to the caller
        return {"id": msg["id"], "ok": False, "error": f"{type(e).__name__}: {e}"}


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


def _process_main(conn: Any, direct: Any, device_dict: dict[str, Any], cache_dir: str) -> None:
    serve(conn, direct, DeviceProfile.from_dict(device_dict), cache_dir)


# ---- on the daemon's side ----------------------------------------------------------------

class WorkerHandle:
    """The daemon's end of one worker: send a verb, get a Future of the reply."""

    def __init__(self, device: DeviceProfile, cache_dir: Path, in_process: bool = False) -> None:
        self.device = device
        self.cache_dir = str(cache_dir)
        self.in_process = in_process
        self._ids = itertools.count()
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._send_lock = threading.Lock()
        self._direct_lock = threading.Lock()
        self.process: Any = None
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        # The worker's end goes only into the process's arguments (dropped after start), so
        # the worker's death is EOF on ours.
        direct_ours, direct_theirs = ctx.Pipe(duplex=False)
        if self.in_process:
            self._inline = (_Worker(self.device, self.cache_dir), threading.Lock())
            self.process = threading.Thread(target=serve, args=(
                theirs, direct_theirs, self.device, self.cache_dir, self._inline),
                name=f"worker-{self.device.id}", daemon=True)
        else:
            self.process = ctx.Process(target=_process_main, name=f"cuvil-{self.device.id}",
                                       args=(theirs, direct_theirs, self.device.to_dict(),
                                             self.cache_dir), daemon=True)
        self.process.start()
        del theirs, direct_theirs
        self.conn, self.direct = ours, direct_ours
        self._reader = threading.Thread(target=self._read, args=(ours,),
                                        name=f"reply-{self.device.id}", daemon=True)
        self._reader.start()

    def _read(self, conn: Any) -> None:
        while True:
            try:
                reply = conn.recv()
            except (EOFError, OSError):
                break
            future = self._pending.pop(reply["id"], None)
            if future is not None:
                future.set_result(reply)
        code = getattr(self.process, "exitcode", None)
        error = WorkerDied(f"worker for {self.device.id} died"
                           + (f" (exit code {code})" if code is not None else ""))
        for rid in list(self._pending):
            future = self._pending.pop(rid, None)
            if future is not None and not future.done():
                future.set_exception(error)

    def call(self, op: str, **fields: Any) -> Future[dict[str, Any]]:
        future: Future[dict[str, Any]] = Future()
        with self._send_lock:
            rid = next(self._ids)
            self._pending[rid] = future
            try:
                self.conn.send({"id": rid, "op": op, **fields})
            except (OSError, ValueError, BrokenPipeError) as e:
                self._pending.pop(rid, None)
                future.set_exception(WorkerDied(f"worker for {self.device.id} is gone: {e}"))
        return future

    def run(self, **fields: Any) -> dict[str, Any]:
        """A `run` whose reply this thread reads itself (one at a time per worker); a worker
        in a thread runs the part in this thread."""
        if self.in_process:
            worker, lock = self._inline
            with lock:
                return _handle({"run": worker.run}, {"id": -1, "op": "run", **fields})
        with self._direct_lock:
            try:
                with self._send_lock:
                    rid = next(self._ids)
                    self.conn.send({"id": rid, "op": "run", "direct": True, **fields})
                while True:  # a reply left by a caller that failed mid-call is skipped
                    reply = self.direct.recv()
                    if reply["id"] == rid:
                        return reply
            except (EOFError, OSError, ValueError) as e:
                code = getattr(self.process, "exitcode", None)
                raise WorkerDied(f"worker for {self.device.id} died"
                                 + (f" (exit code {code})" if code is not None else "")
                                 + (f": {e}" if str(e) else "")) from None

    def alive(self) -> bool:
        return self.process.is_alive()

    def restart(self) -> None:
        with self._direct_lock:  # no direct run reads a pipe while it is replaced
            self.stop()
            self.restarts += 1
            self._start()

    def stop(self, timeout: float = 10.0) -> None:
        try:
            with self._send_lock:
                self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(timeout)
        if not self.in_process and self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()
        self.direct.close()
