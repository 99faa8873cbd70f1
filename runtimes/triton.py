"""The GPU compile path: torch inductor turns a part into Triton kernels for a CUDA device.

How a part is compiled (control path, `TritonRuntime.compile`):
1. a copy of the part goes to the profile's device ("gpu0" -> cuda:0), cast to bf16/fp16 for
   those precisions; the caller's part stays on the host as the eager reference;
2. AOTInductor compiles it ahead of time: `torch.export.export` -> `aoti_compile_and_package`
   -> one `.pt2` package (Triton kernels as cubins, a C++ wrapper, the weights), loaded with
   `aoti_load_package`. The package is the compile-cache artifact: `save` copies it, `load`
   only loads it, so a restarted daemon compiles nothing;
3. where AOTInductor is missing, fails to build (e.g. no C++ compiler or CUDA headers on the
   host) or fails its check on the device (AOTI_BROKEN), inductor's `standalone_compile`
   compiles the part's GraphModule for the example inputs' shapes into one artifact that
   `save` writes into cuvild's compile cache (`part.inductor`) and `load` reads back with
   nothing traced or compiled. Only where that fails too does it fall back to
   `torch.compile(backend="inductor")`, which saves nothing (a restart recompiles, from
   inductor's own cache: the worker points it, and Triton's, at cuvild's cache directory).
   `path` and `aoti_error` on the executable say which path was taken and why.

Running (data path, `InductorExecutable.run`): host tensors are copied to the device (without
blocking when the caller's tensor is pinned), cast to the compute dtype there, run, and the
outputs are cast back to the inputs' dtype on the device and copied to host tensors. On a
CUDA device the worker's first request (`run_into`) captures the part as a CUDA graph
(runtimes/graphs.py: static input buffers, one replay, outputs copied straight into the
arena's views, one synchronisation); `devices.gpu.cuda_graphs: false` turns it off, and a
capture that fails leaves the part kernel by kernel (`graph` says which, and why).

Shapes are static: a part is compiled for its example inputs' shapes (they are in the compile
cache key, CompileSpec.shapes()).

Works with torch >= 2.6 (aoti_compile_and_package / aoti_load_package), tested with 2.11 and
2.13; triton is imported only where CUDA is present.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx

from partitioner.profile import DeviceProfile
from runtimes import graphs
from runtimes.base import (
    ROOT,
    CompileError,
    CompileSpec,
    Executable,
    Runtime,
    RuntimeUnavailable,
    child_env,
)

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PACKAGE = "part.pt2"  # the AOTInductor package inside a compile-cache directory
ARTIFACT = "part.inductor"  # or standalone_compile's artifact, its weights beside it:
WEIGHTS = "weights.bin"  # their bytes, in order; WEIGHTS_META: name, dtype, shape, offset each
WEIGHTS_META = "weights.json"
META = "triton.json"  # what `load` needs besides the package
META_FORMAT = 1
AOTI_ENV = "CUVILD_TRITON_AOTI"  # "0": compile with torch.compile, not AOTInductor
# A measured GPU profile's feature when AOTInductor failed its check there (aoti_check): its
# parts are compiled with torch.compile instead.
AOTI_BROKEN = "aoti-broken"
# Outputs at least this big are copied back into pinned host memory: a pinned device-to-host
# copy runs at full link speed, while for small tensors the plain copy is as fast and does
# not hold on to page-locked memory (torch's caching host allocator reuses the pinned blocks).
PINNED_OUTPUT_MIN_BYTES = 256 << 10


def cuda_device(profile: DeviceProfile) -> torch.device:
    """The torch device of a GPU profile: "gpu0" -> cuda:0."""
    match = re.fullmatch(r"gpu(\d+)", profile.id)
    if profile.kind != "gpu" or match is None:
        raise CompileError(f"triton: device {profile.id!r} (kind {profile.kind!r}) is not a CUDA "
                           "GPU; expected a gpu profile with an id like 'gpu0'")
    return torch.device("cuda", int(match.group(1)))


def aoti_missing() -> str | None:
    """None when this torch has AOTInductor's package API, else why not."""
    import torch._inductor as inductor

    needed = ("aoti_compile_and_package", "aoti_load_package")
    absent = [name for name in needed if not hasattr(inductor, name)]
    if absent:
        return f"torch {torch.__version__} has no torch._inductor.{', '.join(absent)}"
    return None


def aoti_check(device: torch.device, timeout_s: float = 600) -> str | None:
    """None when a small part AOTInductor compiles for `device` loads and answers right, in
    a child process; else why not. On the lent H200 (torch 2.11.0+cu130) loading the package
    a compile had just made killed the process with SIGSEGV (`aoti_load_package`), so the
    check runs where a crash costs nothing. The GPU profile runs it once per measurement."""
    code = ("import torch, runtimes.triton as t; "
            f"t.aoti_selftest(torch.device({device.type!r}, {device.index!r}))")
    return child_verdict([sys.executable, "-c", code], timeout_s)


def child_verdict(command: list[str], timeout_s: float) -> str | None:
    """None when `command` exits 0; else what went wrong, in one line."""
    try:
        done = subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"the AOTInductor check took over {timeout_s:.0f} s"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return (f"the AOTInductor check was killed by {signal.Signals(-done.returncode).name} "
                f"(torch {torch.__version__})")
    tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
    return f"the AOTInductor check failed: {tail[0][:300]}"


def aoti_selftest(device: torch.device) -> None:
    """Compile, load and run a small MLP with AOTInductor on `device`; raise unless it ran
    through AOTInductor and matches eager."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                              torch.nn.Linear(64, 8)).eval()
    x = torch.randn(4, 64)
    gm = torch.export.export(mlp, (x,)).module()
    executable = compile_part(gm, [x], device)
    if executable.path != "aoti":
        raise RuntimeError(f"AOTInductor did not build: {executable.aoti_error}")
    with torch.inference_mode():
        want = mlp(x)
    got = executable.run([x])[0]
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise RuntimeError(f"AOTInductor's answer is off eager by "
                           f"{(got - want).abs().max().item():.3g}")


@contextlib.contextmanager
def _on(device: torch.device) -> Iterator[None]:
    """Make `device` current while inductor compiles or loads: it targets the current GPU."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


def _load_package(path: Path, device: torch.device) -> Callable[..., Any]:
    """Load an AOTInductor package onto `device`; never compiles."""
    load = torch._inductor.aoti_load_package  # noqa: SLF001 - AOTInductor's API
    kwargs = {}
    # device_index picks the GPU explicitly where this torch has it; `_on` covers the rest.
    if device.index is not None and "device_index" in inspect.signature(load).parameters:
        kwargs["device_index"] = device.index
    with _on(device):
        return load(str(path), **kwargs)


@contextlib.contextmanager
def _strict_fp32(device: torch.device) -> Iterator[None]:
    """No TF32 in cuBLAS/cuDNN calls while an fp32 part runs: fp32 must mean fp32.

    Inductor leaves matmuls and convolutions to cuBLAS/cuDNN, which read these process-wide
    flags at call time; cuDNN's TF32 is on by default and alone costs ~1e-3 relative error
    (TOLERANCE["fp32"] is 1e-4). The flags are restored afterwards: other code in the process
    keeps its own choice.
    """
    if device.type != "cuda":
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    try:
        saved = (matmul.allow_tf32, cudnn.allow_tf32)
    except RuntimeError:  # set through torch's newer fp32_precision API: leave it as chosen
        yield
        return
    matmul.allow_tf32, cudnn.allow_tf32 = False, False
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


def _math(device: torch.device, compute: torch.dtype) -> contextlib.AbstractContextManager[None]:
    return _strict_fp32(device) if compute == torch.float32 else contextlib.nullcontext()


def device_input(t: torch.Tensor, device: torch.device, compute: torch.dtype) -> torch.Tensor:
    """A host input as the compiled part takes it: on `device`, contiguous, in `compute` dtype.

    The same conversion at compile and at run time, so the compiled code always sees the
    strides and dtypes it was built for (AOTInductor specialises on both; an engine's inputs
    may be views, e.g. a transposed tensor crossing a cut).
    """
    if t.device != device:
        # From pinned memory the copy is queued without waiting; `run` synchronises before it
        # returns, so the caller may reuse its buffer afterwards.
        t = t.to(device, non_blocking=t.device.type == "cpu" and t.is_pinned())
    if compute != torch.float32 and t.is_floating_point() and t.dtype != compute:
        t = t.to(compute)  # on the device: casting there is cheaper than on the host
    return t.contiguous()


def _arch(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


class InductorExecutable(Executable):
    """A part compiled by inductor for one device, called with host tensors."""

    runtime = "triton"

    def __init__(self, model: Callable[..., Any], device: torch.device, precision: str,
                 out_dtype: torch.dtype, package: Path | None = None,
                 aoti_error: str | None = None,
                 workdir: tempfile.TemporaryDirectory[str] | None = None,
                 artifact: Any = None, weights: Sequence[torch.Tensor] = ()) -> None:
        self.model = model
        self.device = device
        self.precision = precision
        self.compute_dtype = DTYPES[precision]
        self.out_dtype = out_dtype
        self.package = package  # AOTInductor's package
        self.artifact = artifact  # or standalone_compile's (None for both: torch.compile),
        self.weights = list(weights)  # whose first inputs are the part's weights, on the device
        self.path = ("aoti" if package is not None else "standalone" if artifact is not None
                     else "torch.compile")
        self.aoti_error = aoti_error
        self._workdir = workdir  # owns a freshly built package until the executable is dropped
        # a CUDA graph of the part (runtimes/graphs.py), captured at the first request
        self.graphed: graphs.Graphed | None = None
        self.want_graph = device.type == "cuda" and graphs.wanted()
        self.graph = ("" if device.type != "cuda" else
                      "cuda graph (captured at its first request)" if self.want_graph else
                      "kernel by kernel (devices.gpu.cuda_graphs is off)")

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype == self.compute_dtype != self.out_dtype:
            t = t.to(self.out_dtype)  # back to the inputs' dtype, on the device: half the copy
        if t.device.type == "cpu":
            return t
        if t.numel() * t.element_size() >= PINNED_OUTPUT_MIN_BYTES:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)
        return t.to("cpu")

    def run_into(self, inputs: Sequence[torch.Tensor], places: Sequence[Any]) -> list[Any]:
        """`run`, its outputs copied straight into `places` (the arena's views) where the
        part runs as a CUDA graph, which is captured here, on the thread that serves it."""
        if self.want_graph and self.graphed is None:
            self._capture(inputs)
        if self.graphed is not None:
            with torch.inference_mode(), _on(self.device):
                return self.graphed.run(inputs, places)
        return self.run(inputs)

    def _capture(self, inputs: Sequence[torch.Tensor]) -> None:
        try:
            with torch.inference_mode(), _on(self.device), _math(self.device,
                                                                 self.compute_dtype):
                self.graphed = graphs.Graphed(self.model, self.weights, inputs, self.device,
                                              self.compute_dtype, self.out_dtype)
            self.graph = "cuda graph"
        except Exception as e:  # noqa: BLE001 - it runs kernel by kernel, and says why
            self.want_graph, self.graphed = False, None
            self.graph = ("kernel by kernel: the CUDA graph capture failed "
                          f"({type(e).__name__}: {e})")
            log.warning("triton: %s", self.graph)

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.graphed is not None:
            with torch.inference_mode(), _on(self.device):
                return self.graphed.run(inputs)
        with torch.inference_mode(), _on(self.device), _math(self.device, self.compute_dtype):
            outs = self.model(*self.weights, *(device_input(t, self.device, self.compute_dtype)
                                               for t in inputs))
            if isinstance(outs, torch.Tensor):
                outs = (outs,)
            host = [self._to_host(o) for o in outs]
            if self.device.type == "cuda":
                # The pinned copies above are asynchronous: finish them before handing out.
                torch.cuda.current_stream(self.device).synchronize()
        return host

    def save(self, directory: Path) -> None:
        if self.package is None and self.artifact is None:
            raise NotImplementedError(
                "triton: this part was compiled with torch.compile (AOTInductor unavailable: "
                f"{self.aoti_error}); only inductor's own cache keeps it across restarts")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.package is not None:
            target = directory / PACKAGE
            if not (target.exists() and target.samefile(self.package)):
                shutil.copyfile(self.package, target)
        else:
            self.artifact.save(path=str(directory / ARTIFACT), format="binary")
            save_weights(directory, self.weights)
        meta = {"format": META_FORMAT, "precision": self.precision, "path": self.path,
                "out_dtype": str(self.out_dtype).removeprefix("torch."),
                "torch": torch.__version__, "arch": _arch(self.device)}
        (directory / META).write_text(json.dumps(meta, indent=1))


def _floating_dtype(inputs: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype outputs are returned in: that of the first floating input (fp32 if none)."""
    return next((t.dtype for t in inputs if t.is_floating_point()), torch.float32)


def compile_part(part: fx.GraphModule, example_inputs: Sequence[torch.Tensor],
                 device: torch.device, precision: str = "fp32",
                 aoti: bool = True) -> InductorExecutable:
    """Compile `part` with inductor for `device` (AOTInductor first, torch.compile fallback).

    `TritonRuntime.compile` calls this with the profile's CUDA device; it takes any device
    inductor supports so the packaging can be exercised on the host too. `aoti=False` forces
    the torch.compile path.
    """
    if precision not in DTYPES:
        raise CompileError(f"triton: precision must be one of {list(DTYPES)}, got {precision!r}")
    compute = DTYPES[precision]
    out_dtype = _floating_dtype(example_inputs)
    # A deep copy: Module.to() moves buffers in place, and the caller's part must stay on the
    # host as the eager reference (and for other devices' compiles).
    module = copy.deepcopy(part).to(device=device)
    if compute != torch.float32:
        module = module.to(compute)
    aoti_error = aoti_missing() if aoti else "disabled by the caller"
    if aoti_error is None:
        args = tuple(device_input(t, device, compute) for t in example_inputs)
        workdir = tempfile.TemporaryDirectory(prefix="cuvild-triton-")
        try:
            with _on(device), _math(device, compute):
                exported = torch.export.export(module, args)
                path = torch._inductor.aoti_compile_and_package(  # noqa: SLF001 - AOTInductor's API
                    exported, package_path=str(Path(workdir.name) / PACKAGE))
            model = _load_package(Path(path), device)
            return InductorExecutable(model, device, precision, out_dtype, Path(path),
                                      workdir=workdir)
        except Exception as e:  # any build failure: the fallback below may still work
            workdir.cleanup()
            aoti_error = f"{type(e).__name__}: {e}"
            log.warning("triton: AOTInductor failed, falling back to torch.compile: %s",
                        aoti_error)
    try:
        return _standalone(module, example_inputs, device, precision, out_dtype, aoti_error)
    except Exception as e:  # noqa: BLE001 - torch.compile below may still work
        log.warning("triton: standalone_compile failed, falling back to torch.compile (not "
                    "saved: a restart compiles again): %s: %s", type(e).__name__, e)
    executable = InductorExecutable(torch.compile(module, backend="inductor", dynamic=False),
                                    device, precision, out_dtype, aoti_error=aoti_error)
    try:
        # Compile now, through the very path `run` takes (dynamo guards on grad mode and the
        # TF32 flags): the data path must not compile.
        executable.run(example_inputs)
    except Exception as e:
        raise CompileError(f"triton: could not compile the part for {device}: torch.compile "
                           f"failed ({type(e).__name__}: {e}); AOTInductor: {aoti_error}") from e
    return executable


def _standalone(module: fx.GraphModule, example_inputs: Sequence[torch.Tensor],
                device: torch.device, precision: str, out_dtype: torch.dtype,
                aoti_error: str | None) -> InductorExecutable:
    """The part compiled by inductor's standalone_compile for the example inputs' shapes,
    its weights lifted to its first inputs (a loaded artifact holds the code, not the
    module's tensors), and run once through the path `run` takes."""
    from torch._inductor import standalone_compile

    compute = DTYPES[precision]
    lifted, weights = lift_weights(module)
    args = [device_input(t, device, compute) for t in example_inputs]
    with torch.no_grad(), _on(device), _math(device, compute):
        artifact = standalone_compile(lifted, [*weights, *args],
                                      dynamic_shapes="from_example_inputs")
    executable = InductorExecutable(artifact, device, precision, out_dtype,
                                    aoti_error=aoti_error, artifact=artifact, weights=weights)
    executable.run(example_inputs)
    return executable


def lift_weights(module: fx.GraphModule) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """A module of `module`'s graph with no tensors of its own: those it read with get_attr
    (its weights) are its first placeholders, in graph order; and those tensors."""
    graph = copy.deepcopy(module.graph)
    first = next((n for n in graph.nodes if n.op == "placeholder"), None)
    weights: list[torch.Tensor] = []
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        value = module
        for name in str(node.target).split("."):
            value = getattr(value, name)
        if not isinstance(value, torch.Tensor):
            continue
        with (graph.inserting_before(first) if first is not None
              else graph.inserting_before(node)):
            placeholder = graph.placeholder(f"weight_{len(weights)}")
        node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
        weights.append(value.detach())
    if any(n.op in ("get_attr", "call_module") for n in graph.nodes):
        raise CompileError("triton: the part reads modules, not only tensors: not lifted")
    return fx.GraphModule(torch.nn.Module(), graph), weights


def save_weights(directory: Path, weights: Sequence[torch.Tensor]) -> None:
    """The weights' bytes in one file and what they are in another (no pickle)."""
    meta, at = [], 0
    with open(directory / WEIGHTS, "wb") as f:
        for w in weights:
            data = w.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            f.write(data)
            meta.append({"dtype": str(w.dtype).removeprefix("torch."), "shape": list(w.shape),
                         "offset": at, "nbytes": len(data)})
            at += len(data)
    (directory / WEIGHTS_META).write_text(json.dumps(meta))


def load_weights(directory: Path, device: torch.device) -> list[torch.Tensor]:
    data = bytearray((directory / WEIGHTS).read_bytes())
    out = []
    for w in json.loads((directory / WEIGHTS_META).read_text()):
        raw = torch.frombuffer(data, dtype=torch.uint8, count=w["nbytes"], offset=w["offset"])
        out.append(raw.view(getattr(torch, w["dtype"])).reshape(w["shape"]).clone().to(device))
    return out


class TritonRuntime(Runtime):
    """CUDA GPUs through torch inductor, which generates Triton kernels."""

    name = "triton"
    kinds = ("gpu",)
    precisions = ("fp32", "bf16", "fp16")

    def __init__(self, aoti: bool | None = None) -> None:
        # False forces the torch.compile path (for comparing the two, or where this torch's
        # AOTInductor fails on the host): by default CUVILD_TRITON_AOTI=0 in the environment.
        self.aoti = os.environ.get(AOTI_ENV, "1") != "0" if aoti is None else aoti

    @classmethod
    def unavailable(cls) -> str | None:
        if torch.version.cuda is None and torch.version.hip is None:
            return f"no CUDA device: torch {torch.__version__} is a CPU-only build"
        if not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        try:
            import triton  # noqa: F401 - inductor generates Triton kernels: it must import
        except ImportError as e:
            return f"triton is not installed ({e})"
        return None

    @classmethod
    def version(cls) -> str:
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = "none"
        return f"torch {torch.__version__} cuda {torch.version.cuda} triton {triton_version}"

    def _device(self, spec: CompileSpec) -> torch.device:
        reason = self.unavailable()
        if reason:
            raise RuntimeUnavailable(f"runtime 'triton' is unavailable: {reason}")
        device = cuda_device(spec.device)
        if device.index >= torch.cuda.device_count():
            raise CompileError(f"triton: device {spec.device.id!r} is cuda:{device.index} but "
                               f"only {torch.cuda.device_count()} CUDA device(s) are visible")
        return device

    def compile(self, part: fx.GraphModule, spec: CompileSpec) -> Executable:
        if not spec.example_inputs:
            raise CompileError("triton: spec.example_inputs is empty; inductor compiles for "
                               "the shapes of real sample inputs")
        device = self._device(spec)
        if self.aoti and AOTI_BROKEN in spec.device.features:
            executable = compile_part(part, spec.example_inputs, device, spec.precision,
                                      aoti=False)
            executable.aoti_error = (f"{spec.device.id}'s profile says {AOTI_BROKEN}: "
                                     "AOTInductor failed its check there (aoti_check)")
            return executable
        return compile_part(part, spec.example_inputs, device, spec.precision, aoti=self.aoti)

    def load(self, directory: Path, spec: CompileSpec) -> Executable:
        """Load a package saved by `InductorExecutable.save`; compiles nothing."""
        device = self._device(spec)
        directory = Path(directory)
        return load_package_dir(directory, device, spec.precision)


def load_package_dir(directory: Path, device: torch.device,
                     precision: str) -> InductorExecutable:
    """Rebuild an executable from a directory `InductorExecutable.save` wrote."""
    meta_path, package, artifact = directory / META, directory / PACKAGE, directory / ARTIFACT
    if not meta_path.exists() or not (package.exists() or artifact.exists()):
        raise CompileError(f"triton: {directory} holds no saved part (expected {META} and "
                           f"{PACKAGE} or {ARTIFACT})")
    meta = json.loads(meta_path.read_text())
    expected = {"format": META_FORMAT, "precision": precision, "torch": torch.__version__,
                "arch": _arch(device)}
    stale = {k: meta.get(k) for k, v in expected.items() if meta.get(k) != v}
    if stale:
        # A package holds cubins for one GPU architecture and a wrapper built against one
        # torch: anything else must be recompiled, not loaded.
        raise CompileError(f"triton: saved part in {directory} does not fit here: saved "
                           f"{stale}, need { {k: expected[k] for k in stale} }")
    out_dtype = getattr(torch, meta["out_dtype"])
    if not package.exists():  # standalone_compile's: loaded, nothing traced or compiled
        from torch._inductor import CompiledArtifact

        loaded = CompiledArtifact.load(path=str(artifact), format="binary")
        return InductorExecutable(loaded, device, precision, out_dtype, artifact=loaded,
                                  weights=load_weights(directory, device))
    return InductorExecutable(_load_package(package, device), device, precision, out_dtype,
                              package)
