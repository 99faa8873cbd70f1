"""The one small interface every compile path implements (one file per runtime), and the
helpers the runtimes share.

A Runtime turns a part (a self-contained fx.GraphModule from partitioner/split.py) into an
Executable for one device. Executables take and return host torch tensors, without copies
where the library allows, and can be saved to and loaded from a compile-cache directory so a
restarted daemon does not compile again.

Importing this module does not import torch, so the registry, the profiler and the daemon can
use it (and `write_atomic`, the one way cuvild persists a file) without paying for torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from partitioner.profile import DeviceProfile

if TYPE_CHECKING:
    import torch
    from torch import fx

# Relative error allowed against torch eager, by the part's precision (a precision a user
# asked for); under an error budget (`precision="auto"`), the budget is the bound instead.
TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-2, "int8": 5e-2, "int8+fp32": 5e-2}
INITIAL = "cuvild_initial"  # a stateful part's meta: its state before any run (torch_eager.py)


def reset(module: Any) -> None:
    """Put a stateful part's state back as it was before any run (its meta's INITIAL,
    runtimes/torch_eager.py `remember_initial`): a run on a fresh state."""
    import operator

    import torch

    with torch.no_grad():
        for name, value in getattr(module, "meta", {}).get(INITIAL, {}).items():
            operator.attrgetter(name)(module).copy_(value)
MIXED = "+fp32"  # "bf16+fp32": a part at bf16 but for the groups kept fp32 (runtimes/mixed.py)
# a mix not built at first, its low precision alone holding its part: built if the end-to-end
# check refuses that (cuvild/workers/build.py `_needless_mix`, cuvild/load/precision.py)
MIX_DEFERRED = "not built yet"
# int8 but for the ops NNCF's accuracy control keeps fp32 (runtimes/openvino.py `quantize`)
INT8_MIXED = "int8" + MIXED


def compiled_as(precision: str) -> str:
    """The precision a runtime is asked to compile at: a mixed part's graph carries its own
    dtypes, so it is compiled as fp32 (and runs its lowered ops as they are typed); int8+fp32
    is the runtime's own (its quantizer keeps ops fp32)."""
    return "fp32" if precision.endswith(MIXED) and precision != INT8_MIXED else precision


class RuntimeUnavailable(RuntimeError):
    """A runtime that is not installed or cannot run here; the message says why."""


class CompileError(RuntimeError):
    """A runtime failed to compile a part; the message names the runtime and the cause."""


@dataclass
class CompileSpec:
    device: DeviceProfile
    precision: str = "fp32"
    example_inputs: list[torch.Tensor] = field(default_factory=list)  # real sample inputs
    threads: int = 1
    # int8: the part's inputs for each calibration sample (post-training quantization)
    calibration: list[list[torch.Tensor]] = field(default_factory=list)
    # int8+fp32: the error on the part's outputs its quantizer must hold (ops kept fp32)
    max_error: float | None = None

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(str(t.dtype), tuple(t.shape)) for t in self.example_inputs]


class Executable(ABC):
    """A compiled part. `run` is called from one thread at a time."""

    runtime: str = ""
    note: str = ""  # what its build decided that the plan should say (int8+fp32: ops kept fp32)

    @abstractmethod
    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Inputs in the part's order; outputs as host tensors in the part's order."""

    def save(self, directory: Path) -> None:
        """Write what `Runtime.load` needs to rebuild this without compiling."""
        raise NotImplementedError(f"{self.runtime} executables are not cached")

    def aside(self) -> float:
        """Seconds of its last run spent on work of its own that is not the part's (a
        decode step timing its compiled form against the eager one: runtimes/compiled_step.py),
        for its run time to leave out (cuvild/workers/sessions.py); read once."""
        return 0.0


class Runtime(ABC):
    name: ClassVar[str]
    kinds: ClassVar[tuple[str, ...]]  # device kinds it can target
    precisions: ClassVar[tuple[str, ...]] = ("fp32",)

    @classmethod
    def unavailable(cls) -> str | None:
        """None when usable here, else why not (e.g. "openvino is not installed")."""
        return None

    @classmethod
    def version(cls) -> str:
        """Goes into the compile-cache key: a new version recompiles."""
        return ""

    def supports(self, node: fx.Node) -> bool:
        """Whether this runtime can run `node` (feeds the partitioner's support data)."""
        return True

    def can_target(self, device: DeviceProfile, precision: str) -> bool:
        return device.kind in self.kinds and precision in self.precisions

    def why_not(self, device: DeviceProfile, precision: str) -> str:
        """Why `can_target` says no (the plan's notes)."""
        return f"cannot target {device.kind} at {precision}"

    @abstractmethod
    def compile(self, part: fx.GraphModule, spec: CompileSpec) -> Executable:
        """Compile `part` for `spec.device`; raise CompileError naming the cause."""

    def load(self, directory: Path, spec: CompileSpec) -> Executable:
        """Rebuild an Executable saved by `Executable.save`."""
        raise NotImplementedError(f"{self.name} has no compile cache")


# ---- helpers the runtimes share ---------------------------------------------------------

def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (a missing parent package, or
    one set to None in sys.modules, counts as not installed)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def feed_order(model_inputs: Sequence[str], part_inputs: Sequence[str]) -> list[int]:
    """For each input the compiled model takes, its position among the part's inputs.

    Matched by name (converters keep the placeholder names and may drop unused inputs);
    by position when the names do not match but the counts do.
    """
    if all(name in part_inputs for name in model_inputs):
        return [list(part_inputs).index(name) for name in model_inputs]
    if len(model_inputs) == len(part_inputs):
        return list(range(len(part_inputs)))
    raise CompileError(f"model inputs {list(model_inputs)} do not match the part's inputs "
                       f"{list(part_inputs)}")


def as_array(value: Any) -> Any:
    """A numpy view of a host tensor (no copy unless it is not contiguous); arrays as they
    are."""
    if isinstance(value, np.ndarray):
        return value
    return value.detach().contiguous().numpy()


def like_inputs(inputs: Sequence[Any], outputs: Sequence[Any]) -> list[Any]:
    """A run's numpy outputs as torch tensors when its inputs were torch tensors, else as
    numpy arrays: a worker that never imported torch runs OpenVINO and ONNX Runtime parts on
    numpy views (cuvild/workers/worker.py)."""
    arrays = (isinstance(inputs[0], np.ndarray) if inputs
              else "torch" not in sys.modules)
    if arrays:
        return list(outputs)
    import torch

    return [torch.from_numpy(a) for a in outputs]


def read_meta(path: Path, runtime: str, format: int) -> dict[str, Any]:
    """A cache entry's own metadata file; RuntimeError when it was written in another format
    (the compile cache then rebuilds the entry)."""
    meta = json.loads(path.read_text())
    if meta.get("format") != format:
        raise RuntimeError(f"{runtime}: {path.parent} has cache format {meta.get('format')}, "
                           f"expected {format}")
    return meta


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


LEFTOVER_AGE_S = 3600.0  # a temp older than this was left by a crash, not a write in progress


def remove_leftovers(root: Path, *patterns: str, older_than_s: float = LEFTOVER_AGE_S) -> int:
    """Remove the `.tmp-*` files and directories a crash left under `root` (glob patterns such
    as "compiled/.tmp-*", "*/.tmp-*"). Only old ones: another worker or daemon sharing the
    directory may be writing a young one now. Returns how many were removed."""
    removed, now = 0, time.time()
    for pattern in patterns:
        for leftover in root.glob(pattern):
            try:
                if now - leftover.lstat().st_mtime < older_than_s:
                    continue
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    leftover.unlink(missing_ok=True)
                removed += 1
            except OSError:
                continue
    return removed


ROOT = Path(__file__).resolve().parents[1]  # the directory that holds runtimes/


def child_env() -> dict[str, str]:
    """The environment of a child Python that imports our packages, however this process
    was started (venv or checkout): the repository first on PYTHONPATH, then the caller's."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash at any point leaves the old file or the new
    one, never a mix: write a temp file in the same directory, fsync it, rename it over
    `path`, fsync the directory. Leftover temp files are named `.tmp-*`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- the error metric ------------------------------------------------------------------
# One definition, used by every check and every report (docs/PRECISION.md): the relative
# error of outputs against torch eager fp32 is max |y - y_eager| / max |y_eager|, per output,
# and the worst over all outputs. Over a set of inputs (a model's check inputs, a held-out
# set) both maxima run over the whole set (`set_error`): the error is read against the range
# the outputs take, not against each input's own.

def relative_error(outputs: Any, expected: Any) -> float:
    """max |a - b| / max |b|, the worst over the outputs (tensors or sequences of them): 0
    when equal, infinite when a shape or dtype differs (a runtime that returns the wrong
    thing is never accurate), and for integer outputs 1 when any element differs."""
    if not isinstance(outputs, (list, tuple)):
        outputs, expected = [outputs], [expected]
    worst = 0.0
    for out, ref in zip(outputs, expected, strict=True):
        if out.shape != ref.shape or out.dtype != ref.dtype:
            return float("inf")
        if not ref.is_floating_point():
            worst = max(worst, float((out != ref).any()))
            continue
        worst = max(worst, array_error(out.detach().float().numpy(),
                                       ref.detach().float().numpy()))
    return worst


def array_error(out: np.ndarray, ref: np.ndarray) -> float:
    """`relative_error` of one floating-point output, in numpy (a restored model checks its
    parts without torch). A value that is not finite where eager's is (an overflow to inf, a
    NaN) makes the error infinite: NaN compares false with every bound, so it must never reach
    one (max() and `err > tol` would both take a NaN for accurate). Where eager itself gives
    inf or NaN, the output must give the same there; the rest is measured as usual."""
    if out.shape != ref.shape:
        return float("inf")
    if out.size == 0:
        return 0.0
    out64, ref64 = out.astype(np.float64), ref.astype(np.float64)
    finite = np.isfinite(ref64)
    special_same = (out64 == ref64) | (np.isnan(out64) & np.isnan(ref64))
    if not np.where(finite, np.isfinite(out64), special_same).all():
        return float("inf")
    if not finite.any():
        return 0.0
    scale = max(float(np.abs(ref64[finite]).max()), 1e-12)
    return float(np.abs(out64[finite] - ref64[finite]).max()) / scale


def set_error(outputs: Sequence[Any], expected: Sequence[Any]) -> float:
    """`relative_error` over a set of inputs: `outputs[i]` and `expected[i]` are one input's
    outputs (a tensor, an array or a sequence of them). Per output, the largest |a - b| on any
    input over the largest |b| on any input; the worst over the outputs. On one input it is
    `relative_error`, and it is never above the worst input's own.

    Why the set's range and not each input's: an input whose outputs happen to sit near zero
    reads a rounding as a large error. A random-weight ViT-B's two logits measured max 0.021
    on one check input and 0.26-0.87 on the other three; bf16 put 3.5e-3 on it, as on the
    others, and per input that read 1.7e-1 (with 1.4e-2-2.1e-2 elsewhere), which alone kept
    every layer at fp32 under a 1e-2 budget (docs/PRECISION.md)."""
    if len(outputs) != len(expected):
        return float("inf")
    rows = [(list(o) if isinstance(o, (list, tuple)) else [o],
             list(e) if isinstance(e, (list, tuple)) else [e])
            for o, e in zip(outputs, expected, strict=True)]
    if not rows:
        return 0.0
    worst = 0.0
    for k in range(len(rows[0][1])):
        outs, refs = [], []
        for got, want in rows:
            if len(got) != len(want) or len(want) != len(rows[0][1]):
                return float("inf")
            if _dtype(got[k]) != _dtype(want[k]):
                return float("inf")  # a runtime that returns another dtype is never accurate
            out, ref = _array(got[k]), _array(want[k])
            if out.shape != ref.shape:
                return float("inf")
            outs.append(out.reshape(-1))
            refs.append(ref.reshape(-1))
        out, ref = np.concatenate(outs), np.concatenate(refs)
        if not np.issubdtype(ref.dtype, np.floating):
            worst = max(worst, float((out != ref).any()))
        else:
            worst = max(worst, array_error(out, ref))
    return worst


def _dtype(value: Any) -> str:
    return str(value.dtype).removeprefix("torch.")


def _array(value: Any) -> np.ndarray:
    """A tensor (bf16 and fp16 read as fp32, as `relative_error` does) or an array, in numpy."""
    if hasattr(value, "detach"):
        value = value.detach()
        if value.is_floating_point():
            value = value.float()
        return value.cpu().numpy()
    return np.asarray(value)


def unusable(outputs: Any, expected: Any) -> str:
    """Why `relative_error` found `outputs` unusable (infinitely far from `expected`)."""
    if not isinstance(outputs, (list, tuple)):
        outputs, expected = [outputs], [expected]
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        if out.shape != ref.shape or out.dtype != ref.dtype:
            return (f"returned output {i} as {out.dtype} {tuple(out.shape)}; torch eager's is "
                    f"{ref.dtype} {tuple(ref.shape)}")
        if ref.is_floating_point():
            bad = int((~out.isfinite() & ref.isfinite()).sum())
            if bad:
                return (f"returned inf or NaN in {bad} of {out.numel()} values of output {i} "
                        "where torch eager's are finite (an overflow of the precision, or "
                        "the runtime's own NaN)")
    return "returned inf or NaN unlike torch eager's"


def top1_agreement(outputs: Any, expected: Any) -> float | None:
    """For classifier-shaped outputs (2-D float, rows of at least two scores), the share of
    rows whose arg-max matches eager's, the lowest over the outputs; None when none is."""
    if not isinstance(outputs, (list, tuple)):
        outputs, expected = [outputs], [expected]
    shares = [float((out.argmax(-1) == ref.argmax(-1)).float().mean())
              for out, ref in zip(outputs, expected, strict=True)
              if ref.dim() == 2 and ref.shape[-1] > 1 and ref.is_floating_point()
              and out.shape == ref.shape]
    return min(shares) if shares else None
