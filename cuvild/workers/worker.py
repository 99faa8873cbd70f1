"""A device worker: one process per device, pinned to its cores, running compiled parts.

It takes typed orders (protos/orders.py) from a pipe and answers each with a Reply
tagged with the order's id. Forgets are answered by the loop that reads the pipe; Builds,
Restores, Chooses and Unloads, in their own order, by a second thread, so a bucket's build
(seconds) never holds up the runs of the parts already built. Parts run only when rung:
clients' fast-path sessions and the engine's bells (a part of a request rung through a record
naming its arena block), attached to the worker (`Attach`, cuvild/workers/sessions.py), are
served by the same loop, which then polls the pipe and their sockets together. Tensors never
travel through the pipe, only places in shared memory: the arena's are wrapped in place (once
per place, then reused: numpy arrays in a worker that never needed torch,
cuvild/core/views.py); a client's are checked on every use (cuvild/workers/clientmem.py).

The same `serve` loop runs in a process (the default: a crashing compiler or driver takes down
its worker and not the daemon) or in a thread of the daemon (`engine.workers: thread`, and
tests), where client objects are read and written through their descriptors, never mapped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any

from cuvild.core import views
from cuvild.core.dtypes import NUMPY, nbytes
from cuvild.intake import cuda_guard
from cuvild.workers import cudamem
from cuvild.workers.clientmem import ClientObjects, Key
from cuvild.workers.sessions import Sessions
from cuvild.workers.trim import give_back
from partitioner.profile import DeviceProfile
from protos.orders import (
    Attach,
    Build,
    Built,
    Choose,
    CopySequence,
    Describe,
    Described,
    EndSequence,
    Envelope,
    Forget,
    LogLevel,
    Order,
    Preload,
    Progress,
    Reply,
    Restore,
    TensorRef,
    Unload,
)

log = logging.getLogger(__name__)
MAX_VIEWS = 4096  # tensor views kept per worker (arena blocks recur request after request)
# torch.export keeps global state: in the daemon (thread workers), one build at a time.
BUILDS_IN_THREADS = threading.Lock()
CONTROL = (Build, Preload, Choose, Unload, Restore)  # answered by the worker's build thread,
# in order


class Worker:
    """The compiled parts of one device and the shared memory they read and write."""

    def __init__(self, device: DeviceProfile, cache_dir: str, threaded: bool = False) -> None:
        from runtimes.cache import CompileCache

        self.device = device
        self.threaded = threaded  # a thread of the daemon: client objects are never mapped
        self.cache = CompileCache(Path(cache_dir))
        # inductor's and Triton's own caches under cuvild's (where the caller named none; a
        # daemon's workers inherit its setting, cuvild/serve/daemon.py)
        for env, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
            os.environ.setdefault(env, str(Path(cache_dir) / sub))
        self.parts: dict[tuple[str, str], Any] = {}  # (model, part) -> Executable run
        # (model, part) -> precision -> Executable, while a precision search needs them
        self.variants: dict[tuple[str, str], dict[str, Any]] = {}
        self.segments: dict[str, Any] = {}  # the daemon's arena segments, by name
        self.clients = ClientObjects(self._drop_views)
        self.cuda = cudamem.CudaObjects()  # clients' CUDA regions (cuvild/workers/cudamem.py)
        self.on_gpu = device.kind == "gpu" and not device.emulated
        self.views: dict[TensorRef, Any] = {}
        self.arrays: dict[TensorRef, Any] = {}  # numpy views, for the runtimes that take them
        self.numpy_views = False  # some views are numpy arrays (torch not imported then)
        # A worker thread the daemon gave up on (a part hung) answers nothing more but the
        # ring it is stuck in, and ends once that returns.
        self.abandoned = False
        self.told: Any = None  # while a Build runs: tells the daemon what it is doing
        # builds dropped since the memory was last given back (Control, cuvild/workers/trim.py)
        self.litter = False

    def handle(self, order: Order) -> Built | Described | None:
        if isinstance(order, Build):
            return self.build(order)
        if isinstance(order, Restore):
            return self.restore(order)
        if isinstance(order, Preload):
            from cuvild.workers.build import preload

            cuda_guard.hold()  # before this thread's first fake tensors (intake/cuda_guard.py)
            preload(order.archive)
            return None
        if isinstance(order, Forget):
            return self.forget(order)
        if isinstance(order, Choose):
            return self.choose(order)
        if isinstance(order, Unload):
            return self.unload(order)
        if isinstance(order, (EndSequence, CopySequence)):
            return self.sequence_state(order)
        if isinstance(order, Describe):
            return self.describe(order)
        if isinstance(order, LogLevel):  # (a thread worker's is the daemon's: the same)
            logging.getLogger().setLevel(order.level.upper())
            log.debug("log level %s, as the daemon's config reload set it", order.level)
            return None
        raise TypeError(f"unknown order {type(order).__name__}")

    # -- shared memory -----------------------------------------------------------------
    def tensor(self, ref: TensorRef, numpy: bool = False) -> Any:
        """A tensor aliasing `ref`'s bytes; made once per place, then reused (`numpy`: a numpy
        array where numpy has the dtype, for the runtimes that take them). A client's object
        is checked to still hold the bytes, on every use. A client's CUDA region: a tensor
        over its device memory."""
        if cudamem.is_cuda(ref.segment):
            return self.cuda.tensor(ref.segment, ref.offset, ref.dtype, ref.shape)
        if ref.inode:
            self.clients.get(ref.segment, ref.inode).check(ref.offset,
                                                           nbytes(ref.dtype, ref.shape))
        if numpy and ref.dtype in NUMPY:
            array = self.arrays.get(ref)
            if array is None:
                if len(self.arrays) >= MAX_VIEWS:
                    self.arrays.clear()
                array = self.arrays[ref] = self._view(ref, numpy=True)
            return array
        if self.numpy_views and "torch" in sys.modules:  # torch came (a build, a runtime
            self.views.clear()  # that needs it): its parts get torch tensors from now on
            self.numpy_views = False
        view = self.views.get(ref)
        if view is None:
            if len(self.views) >= MAX_VIEWS:
                self.views.clear()
            view = self.views[ref] = self._view(ref)
            self.numpy_views |= views.lean(ref.dtype)
        return view

    def _view(self, ref: TensorRef, numpy: bool = False) -> Any:
        size = nbytes(ref.dtype, ref.shape)
        if not size:
            return views.wrap(None, ref.dtype, ref.shape, numpy)
        if ref.inode:  # pinned to the inode it was registered with: a replacement is refused
            raw = self.clients.get(ref.segment, ref.inode).view(ref.offset, size)
        else:  # the arena's segment names are never reused
            from cuvild.core.arena import Segment

            seg = self.segments.get(ref.segment)
            if seg is None:
                seg = self.segments[ref.segment] = Segment(ref.segment, 0, create=False,
                                                           lock=False)
                if self.device.kind == "gpu":  # copies to and from it without staging
                    seg.register_cuda()
            raw = seg.view(ref.offset, size)
        return views.wrap(raw, ref.dtype, ref.shape, numpy)

    def read(self, ref: TensorRef, numpy: bool = False) -> Any:
        """A worker thread's input in a client's object: a fresh copy read through the
        descriptor (a shrunk object is a short read, not a SIGBUS in the daemon); or one
        copied to the host from a client's CUDA region."""
        if cudamem.is_cuda(ref.segment):
            host = self.cuda.read(ref.segment, ref.offset, ref.dtype, ref.shape)
            return host.numpy() if numpy and ref.dtype in NUMPY else host
        size = nbytes(ref.dtype, ref.shape)
        if not size:
            return views.wrap(None, ref.dtype, ref.shape, numpy)
        buf = bytearray(size)
        self.clients.get(ref.segment, ref.inode).read(ref.offset, memoryview(buf))
        return views.wrap(buf, ref.dtype, ref.shape, numpy)

    def write(self, value: Any, ref: TensorRef) -> None:
        """A worker thread's output into a client's object, through the descriptor (or
        copied into a client's CUDA region)."""
        if cudamem.is_cuda(ref.segment):
            self.cuda.write(value, ref.segment, ref.offset, ref.dtype, ref.shape)
            return
        data = views.as_bytes(value, ref.dtype)
        if data.nbytes:
            self.clients.get(ref.segment, ref.inode).write(ref.offset, data)

    def _drop_views(self, key: Key) -> None:
        for kept in (self.views, self.arrays):
            for ref in [r for r in kept if (r.segment, r.inode) == key]:
                del kept[ref]

    def forget(self, order: Forget) -> None:
        """Unmap client objects whose regions were unregistered. A runtime may still hold
        its last input (OpenVINO's infer request does): those close after the next run."""
        self.clients.forget({(name, inode) for name, inode in order.segments})
        self.cuda.forget({name for name, _ in order.segments if cudamem.is_cuda(name)})

    # -- parts -------------------------------------------------------------------------
    def build(self, order: Build) -> Built:
        import torch

        from cuvild.workers.build import build_model_part, forget, variants

        cuda_guard.hold()  # before this thread's first fake tensors (intake/cuda_guard.py)
        if not self.threaded:  # this worker's cores (torch may be imported only now)
            torch.set_num_threads(len(os.sched_getaffinity(0)))

        try:
            built, tried = build_model_part(order, self.device, self.cache, self.told)
        finally:
            if order.last:  # the model's other parts are not needed here any more
                forget(order.split_key)
            # what a search made and dropped, given back once the orders in hand are done
            self.litter = self.litter or len(order.precisions) > 1
        key = (order.model, order.part)
        own = built[order.precisions[0]]
        if len(built) > 1:  # a precision search will choose among them
            self.variants[key] = {p: b.executable for p, b in built.items()}
        self.parts[key] = own.executable
        return Built(own.runtime, all(b.from_cache for b in built.values()), tried,
                     variants(built), self._artifact(own.part_key, own.runtime),
                     getattr(own.executable, "graph", ""))

    def _artifact(self, part_key: str, runtime: str) -> dict[str, Any]:
        """The signed cache entry a part runs from: its hash, what built it, verified."""
        from runtimes import registry

        if not part_key or runtime == "torch":  # the reference: nothing compiled, no entry
            return {}
        try:
            version = registry.get(runtime).version()
        except Exception:  # noqa: BLE001 - an entry it cannot name is shown as none
            return {}
        return self.cache.artifact(self.cache.entry_key(part_key, runtime, version))

    def restore(self, order: Restore) -> Built:
        """A part's executable straight from the compile cache (a load record's): torch is
        not imported for it (a loaded build needs no example tensors)."""
        from runtimes import crashes, registry
        from runtimes.base import CompileSpec, compiled_as

        rt = registry.get(order.runtime)
        if "torch" in sys.modules:  # a runtime of torch's: it may trace with fake tensors
            cuda_guard.hold()
        entry = self.cache.lookup(self.cache.entry_key(order.part_key, order.runtime,
                                                       rt.version()))
        if entry is None:
            raise LookupError(f"no cached {order.runtime} {rt.version()} build of part "
                              f"{order.part} (evicted, or built by another version)")
        if crashes.crashed(self.cache.root, order.part_key, order.runtime):
            raise LookupError(f"the {order.runtime} build of part {order.part} killed its "
                              "worker before (runtimes/crashes.py): built again")
        spec = CompileSpec(self.device, compiled_as(order.precision),
                           threads=max(len(self.device.cores), 1))
        with crashes.attempt(self.cache.root, order.part_key, order.runtime):
            executable = rt.load(entry, spec)
        self.parts[(order.model, order.part)] = executable
        return Built(order.runtime, True, artifact=self._artifact(order.part_key, order.runtime),
                     graph=getattr(executable, "graph", ""))

    def choose(self, order: Choose) -> None:
        key = (order.model, order.part)
        self.parts[key] = self.variants[key][order.precision]
        if order.final:  # the losing precisions' executables go
            del self.variants[key]
            self.litter = True

    def describe(self, order: Describe) -> Described:
        """How the part runs now, as its executable says (`describe`: a decode step's tier,
        its sequences' shared runs)."""
        said = getattr(self.parts.get((order.model, order.part)), "describe", None)
        return Described(said() if callable(said) else "")

    def sequence_state(self, order: EndSequence | CopySequence) -> None:
        """A sequence's state on every part of its model here: gone (it ended), or copied
        from another's (it starts from that one's steps)."""
        if "runtimes.torch_eager" not in sys.modules:  # (the runtime that keeps state)
            return
        from runtimes.torch_eager import copy_sequence, drop_sequence

        if isinstance(order, CopySequence):
            copy_sequence(order.model, order.source, order.slot, order.length)
        else:
            drop_sequence(order.model, order.slot)

    def unload(self, order: Unload) -> None:
        from cuvild.workers.build import forget

        forget(order.model)
        if "runtimes.torch_eager" in sys.modules:
            from runtimes.torch_eager import drop_scope

            drop_scope(order.model)
        for key in [k for k in list(self.parts) if k[0] == order.model]:
            self.parts.pop(key, None)
            self.variants.pop(key, None)
        self.litter = True


def answer(worker: Worker, envelope: Envelope) -> Reply:
    """Carry out one order; every failure goes back to the caller as the reply's error."""
    try:
        return Reply(envelope.id, worker.handle(envelope.order))
    except Exception as e:  # noqa: BLE001
        return Reply(envelope.id, error=f"{type(e).__name__}: {e}")


def serve(conn: Any, device: DeviceProfile, cache_dir: str,  # noqa: C901 - the worker's loop: a branch per order
          threaded: Worker | None = None) -> None:
    """The worker loop until the pipe closes or brings None (or, in a thread, the daemon
    gave up on it): rings and Forgets here, one at a time, the control orders on a second
    thread. In a thread of the daemon, `threaded` is its Worker (the handle abandons it)."""
    if threaded is None:
        _pin(device)
        _quiet()
    worker, lock = threaded or Worker(device, cache_dir), threading.Lock()
    sending = threading.Lock()

    def reply(envelope: Envelope, answered: Reply) -> None:
        with sending, contextlib.suppress(OSError, ValueError):  # the daemon let go of us
            conn.send(answered)

    control = Control(worker, lock, reply, BUILDS_IN_THREADS if threaded else None)
    sessions: Sessions | None = None  # sessions and bells served here, from the first Attach
    while True:
        try:
            while sessions is not None and sessions.by_fd:
                ended, pipe = sessions.wait(worker.parts, lock)
                if worker.abandoned:
                    return
                for rid in ended:  # an Attach's reply says its session is over
                    reply(Envelope(rid, None), Reply(rid))  # type: ignore[arg-type]
                if pipe:
                    break
            envelope = conn.recv()
        except (EOFError, OSError):
            return
        if envelope is None or worker.abandoned:
            return
        if isinstance(envelope.order, Attach):
            sessions = sessions or Sessions(conn.fileno(), worker)
            if not sessions.take(envelope, conn):
                reply(envelope, Reply(envelope.id))  # over at once
            continue
        if isinstance(envelope.order, CONTROL):
            control.put(envelope)
            continue
        with lock:
            answered = answer(worker, envelope)
        reply(envelope, answered)


class Control:
    """The build thread: Builds, Chooses and Unloads, in the order they came, beside the
    runs. It lives only while it has orders: an idle second thread in a worker process was
    measured to cost each run 0.1 ms. In the daemon (thread workers), one build at a time
    across devices (`one_build`), and never under the device's lock, which the runs take."""

    def __init__(self, worker: Worker, lock: threading.Lock, reply: Any,
                 one_build: threading.Lock | None) -> None:
        self.worker, self.lock, self.reply, self.one_build = worker, lock, reply, one_build
        self.orders: deque[Envelope] = deque()
        self.mutex = threading.Lock()
        self.running = False

    def put(self, envelope: Envelope) -> None:
        with self.mutex:
            self.orders.append(envelope)
            if self.running:
                return
            self.running = True
        threading.Thread(target=self._drain, name=f"build-{self.worker.device.id}",
                         daemon=True).start()

    def _drain(self) -> None:
        while True:
            with self.mutex:
                tidy = not self.orders and self.worker.litter and self.one_build is None
                if (not self.orders and not tidy) or self.worker.abandoned:
                    self.running = False
                    return
                envelope = self.orders.popleft() if not tidy else None
            if envelope is None:  # the orders in hand done: what their builds dropped goes
                self.worker.litter = False  # back to the system, once (a worker process's:
                give_back()  # a collection walks all of the daemon's objects in a thread)
                continue
            if isinstance(envelope.order, (Build, Preload)):  # (beside the runs: minutes)
                def told(text: str, envelope: Envelope = envelope) -> None:
                    if not self.worker.abandoned:
                        self.reply(envelope, Reply(envelope.id, Progress(text)))

                with self.one_build or contextlib.nullcontext():
                    self.worker.told = told
                    try:
                        answered = answer(self.worker, envelope)
                    finally:
                        self.worker.told = None
            else:
                with self.lock:
                    answered = answer(self.worker, envelope)
            if not self.worker.abandoned:
                self.reply(envelope, answered)


# How OpenMP's threads wait between parallel regions (read when its library loads: set before
# torch is imported, cuvild/workers/omp_env.py). Passive where two devices' workers share
# cores: spinning pools of two runtimes on shared cores slow each other by up to 1.6x
# (measured on the 2-core dev host). Else a short spin: a language model's decode step runs
# ~600 small parallel ops a token, and waking sleeping threads for each cost the 200M
# Llama's fp16 step 32.7 ms instead of 19.9 (2-core EPYC, torch 2.13).
OMP_PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
OMP_SHORT_SPIN = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}
OMP_WAIT_ENV = "CUVILD_OMP_WAIT"  # "spin" (set by the daemon where no cores are shared)


def omp_env() -> None:
    """Set this process's OpenMP wait settings (as OMP_WAIT_ENV says)."""
    settings = OMP_SHORT_SPIN if os.environ.get(OMP_WAIT_ENV) == "spin" else OMP_PASSIVE
    if "OMP_WAIT_POLICY" not in settings:
        os.environ.pop("OMP_WAIT_POLICY", None)
    os.environ.update(settings)


def shares_cores(devices: list[DeviceProfile]) -> bool:
    """Whether two devices computing on the host's cores (CPUs, emulated devices) have their
    workers on a core in common (a device that names no cores has them all)."""
    every = set(os.sched_getaffinity(0))
    seen: set[int] = set()
    for device in devices:
        if device.kind == "cpu" or device.emulated:
            cores = set(device.cores) or every
            if cores & seen:
                return True
            seen |= cores
    return False


def _pin(device: DeviceProfile) -> None:
    """Own the device's cores, with OpenMP's waits as `omp_env` says."""
    cores = device.cores or sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores)
    omp_env()  # (torch reads them as it loads: a spawned worker imports it only to build)
    os.environ["OMP_NUM_THREADS"] = str(len(cores))
    if "torch" in sys.modules:  # imported already (forked from the daemon's forkserver, or
        # with the spawning program's main module):
        import torch  # its pool was sized for every core; this thread runs the parts

        torch.set_num_threads(len(cores))


def _quiet() -> None:
    """Library chatter that says nothing to a cuvild user (torch's pytree deprecation on
    unpickling, the ONNX exporter's note that torchvision is absent)."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)


LOG_LEVEL_ENV = "CUVILD_LOG_LEVEL"  # the daemon's log_level at start: its workers' too


def process_main(conn: Any, device_dict: dict[str, Any], cache_dir: str) -> None:
    """The worker process's entry point (a spawned process gets the profile as a dict). It
    leaves without the interpreter's teardown (~1 s with torch: cuvild/workers/quick_exit.py)."""
    from cuvild.workers.quick_exit import quick_exit

    with contextlib.suppress(OSError):  # `ps`/`top` name it (a forked one's command line is
        # the forkserver's, a spawned one's python's)
        Path("/proc/self/comm").write_text(f"cuvil-{device_dict['id']}"[:15])
    thread_lock_for_tqdm()
    level = os.environ.get(LOG_LEVEL_ENV)
    if level:  # its log lines beside the daemon's, naming the worker
        logging.basicConfig(level=level.upper(), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s [%(processName)s]: "
                                   "%(message)s")
    serve(conn, DeviceProfile.from_dict(device_dict), cache_dir)
    quick_exit(0)


def thread_lock_for_tqdm() -> None:
    """tqdm's default lock (torch.export and NNCF draw progress bars while a part builds) is a
    multiprocessing RLock: a named semaphore in /dev/shm (sem.mp-*) that outlives a worker
    killed with the daemon (SIGKILL), one a crash, with no owner to reclaim it by. A worker's
    bars are drawn by its own threads only: a thread lock does, and leaves nothing behind."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())
