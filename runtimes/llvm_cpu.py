"""llvm-cpu: a part compiled to native x86/Arm code by IREE (torch-mlir import, LLVM codegen).

Path of one part: torch.export of the part's GraphModule -> iree-turbine imports it to MLIR
(torch dialect, weights inlined) -> the `iree-compile` tool, run as a subprocess so a caller's
time box really stops it -> a .vmfb module -> loaded by IREE's `local-task` CPU driver.

Threads: IREE builds its task executor (the worker threads) once per process, from global
flags, when the first local-task device is made. The first part loaded in a process therefore
fixes the worker count and pinning for every later one; cuvild runs one worker process per
device, so that is one count per device. Workers wait passively (IREE's default spin of 0 µs),
which keeps them from starving another runtime's threads on a small host.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch.utils import dlpack

from runtimes.base import CompileError, CompileSpec, Executable, Runtime, installed

log = logging.getLogger(__name__)

# Flags chosen by measurement on the development host (see docs/RUNTIMES.md): O3 and
# im2col for convolutions made ResNet-18 about 3x faster than IREE's defaults.
COMPILE_FLAGS = (
    "--iree-input-type=torch",
    "--iree-hal-target-device=local",
    "--iree-hal-local-target-device-backends=llvm-cpu",
    "--iree-llvmcpu-target-cpu=host",  # the host's ISA (AVX-512 here); the cache key has it
    "--iree-opt-level=O3",
    "--iree-global-opt-use-im2col-for-convs",
)
VMFB = "module.vmfb"
META = "iree.json"  # not meta.json: the compile cache writes that one into the same directory
ENTRY = "main"  # the function name iree-turbine gives an exported program
ALIGNMENT = 64  # IREE imports host memory only at this alignment; anything else is copied
RELEASE_WAIT_S = 1.0  # how long run() waits for IREE to let go of its inputs
_PACKAGES = {"iree.compiler": "iree-base-compiler", "iree.runtime": "iree-base-runtime",
             "iree.turbine": "iree-turbine"}

_device_lock = threading.Lock()
_device: Any = None  # the process's local-task HalDevice, made on first use
_device_threads = 0


def local_device(threads: int, cores: Sequence[int] = ()) -> tuple[Any, int]:
    """The process's IREE CPU device and its worker count (fixed by the first caller).

    Workers are pinned to `cores`, or to this process's CPU affinity when the daemon narrowed
    it, so IREE stays on the worker's own cores; otherwise they float like torch's threads.
    """
    global _device, _device_threads
    import iree.runtime as ireert

    with _device_lock:
        if _device is None:
            affinity = sorted(os.sched_getaffinity(0))
            allowed = list(cores) or (affinity if len(affinity) < (os.cpu_count() or 0) else [])
            if len(allowed) >= threads:
                ids = ",".join(str(c) for c in allowed[:threads])
                ireert.flags.parse_flags(f"--task_topology_cpu_ids={ids}")
            else:  # unpinned; IREE's default mode would pin to the first physical cores
                ireert.flags.parse_flags(f"--task_topology_group_count={threads}")
            _device = ireert.get_device("local-task")
            _device_threads = threads
        elif threads != _device_threads:
            log.warning("llvm-cpu: %d threads asked for, but this process's IREE workers are "
                        "already %d (one executor per process)", threads, _device_threads)
    return _device, _device_threads


class IREEExecutable(Executable):
    """A loaded .vmfb. Inputs go in and outputs come out by DLPack, without copies."""

    runtime = "llvm-cpu"

    def __init__(self, vmfb: Path, meta: dict[str, Any], threads: int,
                 cores: Sequence[int] = ()) -> None:
        import iree.runtime as ireert

        self._rt = ireert
        self.vmfb = vmfb
        self.meta = meta
        self.device, self.threads = local_device(threads, cores)
        instance = ireert.VmInstance()
        hal = ireert.create_hal_module(instance, self.device)
        # mmap: the weights inside the module are paged in from the file, not copied.
        module = ireert.VmModule.mmap(instance, str(vmfb))
        self._context = ireert.VmContext(instance, modules=(hal, module))
        self._main = module.lookup_function(ENTRY)
        if self._main is None:
            raise CompileError(f"llvm-cpu: {vmfb} has no function {ENTRY!r}")

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        expected = self.meta["inputs"]
        if len(inputs) != len(expected):
            raise ValueError(f"llvm-cpu: expected {len(expected)} inputs, got {len(inputs)}")
        for i, (tensor, (dtype, shape)) in enumerate(zip(inputs, expected, strict=True)):
            if str(tensor.dtype) != dtype or list(tensor.shape) != shape:
                raise ValueError(f"llvm-cpu: input {i} is {tensor.dtype}{list(tensor.shape)}, "
                                 f"compiled for {dtype}{shape}")
        lent = [_importable(t) for t in inputs]  # our own aliases, see _wait_returned
        held = [dlpack.to_dlpack(t) for t in lent]  # our own hold on each, dropped on this thread
        baseline = [t._use_count() for t in lent]  # noqa: SLF001 - the C++ count (see _wait_returned)
        args = self._rt.VmVariantList(len(lent))
        for tensor in lent:
            args.push_ref(self.device.from_dlpack_capsule(dlpack.to_dlpack(tensor)))
        results = self._rt.VmVariantList(len(self.meta["outputs"]))
        self._context.invoke(self._main, args, results)
        del args
        # kDLCPU = 1: the buffers are host memory; torch holds IREE's buffer until it is freed.
        outputs = [torch.from_dlpack(self.device.create_dlpack_capsule(
                       results.get_as_object(i, self._rt.HalBufferView), 1, 0))
                   for i in range(len(results))]
        _wait_returned(lent, held, baseline)
        return outputs

    def save(self, directory: Path) -> None:
        shutil.copyfile(self.vmfb, directory / VMFB)
        (directory / META).write_text(json.dumps(self.meta, indent=1))


def _importable(tensor: torch.Tensor) -> torch.Tensor:
    """A new alias of `tensor` when IREE can use its memory in place, else a contiguous aligned
    copy; either way a tensor object only this module holds."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()  # torch's allocator aligns to 64 bytes
    if tensor.data_ptr() % ALIGNMENT:
        tensor = tensor.clone()
    return tensor


_stuck: list[Any] = []  # inputs IREE kept past RELEASE_WAIT_S, and our capsules: never freed


def _wait_returned(lent: list[torch.Tensor], held: list[Any], baseline: list[int]) -> None:
    """Return once IREE has dropped its references to the `lent` input aliases.

    IREE releases an imported buffer on the thread that retires the work, often a worker a few
    microseconds after `invoke` returns. Were that the last reference, torch would free the
    tensor's Python object on the IREE thread, taking the GIL there, and a process exiting at
    that moment aborts ("PyGILState_Release: thread state ... must be current"). Waiting here
    (0-2 yields, under 0.3 ms, in measurements) keeps every free on the calling thread.

    Torch also touches the Python object when a tensor's C++ count falls from 2 to 1 (its
    PyObject preservation decrefs the object then, under the GIL, on the thread that drops the
    count). `held`, our own unconsumed DLPack capsule of each alias, keeps IREE's drop above
    that step: without it, 6 of 3,000 encoder inputs were freed on an IREE worker, under load.
    """
    deadline = time.monotonic() + RELEASE_WAIT_S
    while any(t._use_count() > n for t, n in zip(lent, baseline, strict=True)):  # noqa: SLF001 - the C++ count
        if time.monotonic() > deadline:
            log.warning("llvm-cpu: IREE still holds an input after %.1f s; keeping it",
                        RELEASE_WAIT_S)
            _stuck.extend(lent)
            _stuck.extend(held)
            return
        time.sleep(0)


def _decompositions() -> dict[Any, Any]:
    """iree-turbine's default table (what its own nn.Module path applies) plus attention as
    matmul + softmax + matmul: IREE's fused CPU attention kernel ran a BERT attention 13x
    slower than the decomposed form here (22 ms vs 1.7 ms), and torch eager takes 0.7 ms."""
    from iree.turbine.aot.decompositions import current_aot_decompositions
    from torch.export import default_decompositions

    table = current_aot_decompositions()
    aten = torch.ops.aten
    attention = (aten.scaled_dot_product_attention.default,  # -> one of the two below
                 aten._scaled_dot_product_flash_attention_for_cpu.default,  # noqa: SLF001 - an aten op's name
                 aten._scaled_dot_product_attention_math.default)  # noqa: SLF001 - an aten op's name
    core = default_decompositions()
    table.update({op: core[op] for op in attention})
    return table


def _signature(ep: torch.export.ExportedProgram) -> dict[str, Any]:
    """Input and output dtypes and shapes, read from the exported graph."""
    graph = ep.graph
    user_inputs = set(ep.graph_signature.user_inputs)
    inputs = [n.meta["val"] for n in graph.nodes if n.op == "placeholder" and n.name in user_inputs]
    outputs = [a.meta["val"] for a in graph.output_node().args[0]]
    return {"inputs": [[str(v.dtype), list(v.shape)] for v in inputs],
            "outputs": [[str(v.dtype), list(v.shape)] for v in outputs]}


class IREERuntime(Runtime):
    name = "llvm-cpu"
    kinds = ("cpu",)
    precisions = ("fp32",)

    def __init__(self, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s  # bounds the whole compile; iree-compile is killed past it

    @classmethod
    def unavailable(cls) -> str | None:
        missing = [pkg for mod, pkg in _PACKAGES.items() if not installed(mod)]
        if missing:
            return f"{', '.join(missing)} not installed"
        from iree.compiler.tools.binaries import find_tool

        try:
            find_tool("iree-compile")
        except Exception as e:  # noqa: BLE001 - any lookup failure means we cannot compile
            return f"iree-compile not found ({e})"
        return None

    @classmethod
    def version(cls) -> str:
        flags = hashlib.sha256(" ".join(COMPILE_FLAGS).encode()).hexdigest()[:8]
        return f"{importlib.metadata.version('iree-base-compiler')} flags {flags}"

    def compile(self, part: fx.GraphModule, spec: CompileSpec) -> Executable:
        if spec.precision not in self.precisions:
            raise CompileError(f"llvm-cpu: precision {spec.precision!r} is not supported; "
                               f"expected one of {self.precisions}")
        deadline = time.monotonic() + self.timeout_s
        work = Path(tempfile.mkdtemp(prefix="cuvil-iree-"))
        try:
            meta = self._import(part, spec, work / "part.mlirbc")
            self._run_compiler(work / "part.mlirbc", work / VMFB, deadline - time.monotonic())
            (work / "part.mlirbc").unlink()
            exe = IREEExecutable(work / VMFB, meta, spec.threads, spec.device.cores)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        weakref.finalize(exe, shutil.rmtree, work, True)  # the mapped file may go: Linux keeps it
        return exe

    def load(self, directory: Path, spec: CompileSpec) -> Executable:
        meta = json.loads((directory / META).read_text())
        return IREEExecutable(directory / VMFB, meta, spec.threads, spec.device.cores)

    @staticmethod
    def _import(part: fx.GraphModule, spec: CompileSpec, target: Path) -> dict[str, Any]:
        """The part as MLIR bytecode at `target`; returns its input/output signature."""
        from iree.turbine import aot

        try:
            ep = torch.export.export(part, tuple(spec.example_inputs), strict=False)
            ep = ep.run_decompositions(_decompositions())
            aot.export(ep).save_mlir(target)
        except Exception as e:
            raise CompileError(f"llvm-cpu: import to MLIR failed: {type(e).__name__}: {e}") from e
        return {**_signature(ep), "compiler": IREERuntime.version(), "flags": COMPILE_FLAGS}

    @staticmethod
    def _run_compiler(source: Path, target: Path, timeout_s: float) -> None:
        from iree.compiler.tools.binaries import find_tool

        command = [find_tool("iree-compile"), str(source), *COMPILE_FLAGS, "-o", str(target)]
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=max(timeout_s, 0.01))
        except subprocess.TimeoutExpired:
            raise CompileError(f"llvm-cpu: iree-compile did not finish within the time box "
                               f"({timeout_s:.1f} s left of it)") from None
        if done.returncode != 0:
            raise CompileError(f"llvm-cpu: iree-compile failed (exit {done.returncode}): "
                               f"{done.stderr.strip()[-2000:]}")
