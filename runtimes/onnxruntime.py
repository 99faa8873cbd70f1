"""ONNX Runtime on the host CPU: a part exported to ONNX, run by the CPU execution provider.

Compile (control path, `ONNXRuntime.compile`): `torch.export.export(part, example_inputs)`, then
torch's ONNX exporter on the ExportedProgram (`torch.onnx.export(..., dynamo=True)`, which
needs the onnx and onnxscript packages). The TorchScript exporter (dynamo=False) also handles
the reference models, about 1 s faster per part, but torch deprecates it (a DeprecationWarning
since 2.9) and it loses the value names; the dynamo exporter keeps them ("x", "relu_8"), so
the ONNX file reads like the part. Shapes are static: a part is compiled per input shape.

Cache (`save` / `load`): the .onnx file, with its weights in part.onnx.data when the model is
over protobuf's 2 GB limit (the exporter decides). `load` opens a session on it; nothing is
exported again.

Run (data path, `ONNXExecutable.run`): inputs are bound as OrtValues over the torch tensors'
memory (`OrtValue.ortvalue_from_numpy`, no copy). Outputs are written by ORT straight into
torch tensors allocated for that run and bound by address, so nothing is copied and a result
the engine still holds is never overwritten: ORT reuses the buffers it allocates for bound
outputs from one run to the next. Parts whose output shapes are not static fall back to
ORT-allocated outputs, copied once.

int8 (a precision search's candidate, with calibration inputs): static QDQ quantization of the
exported model (`onnxruntime.quantization.quantize_static`: per-channel int8 weights, uint8
activations, ranges from the part's own calibration inputs). Measured on resnet18 b1, one
AVX2 core: 23 ms vs 40 ms in fp32, relative error 5e-2 (OpenVINO's NNCF int8: 20 ms, 4e-2).

Session options: intra_op_num_threads = spec.threads, inter_op_num_threads = 1 (parts run their
nodes sequentially), graph optimization level ALL, and no spinning
(session.intra_op.allow_spinning = "0"): ORT's spinning pools slowed the other runtimes on
2 cores by up to 1.6x here (shared/BASELINES.md).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runtimes.base import (
    CompileError,
    CompileSpec,
    Executable,
    Runtime,
    as_array,
    feed_order,
    installed,
    like_inputs,
    read_meta,
)

if TYPE_CHECKING:  # torch only to compile: a worker loading cached builds never imports it
    import onnxruntime as ort
    import torch
    from torch import fx

MODEL = "part.onnx"
META = "onnxruntime.json"
# 2: parts built through masks.empty_rows_zeroed (a format-1 entry's attention may average)
META_FORMAT = 2
EXPORTER_PACKAGES = ("onnx", "onnxscript")  # torch.onnx.export(dynamo=True) needs them
# onnxscript's constant folding tries each foldable node with onnx's reference evaluator and
# warns when one cannot be folded ("Evaluation failed: cannot reshape ..." on BERT): the node
# stays in the graph and runs in onnxruntime, so nothing failed. Its debugging, not ours.
logging.getLogger("onnxscript.optimizer._constant_folding").setLevel(logging.ERROR)
# Their IR passes log every step at INFO ("No unused functions to remove", "PassManager: No
# more graph changes detected"): 54 of a daemon's 74 lines loading a split language model.
for _chatty in ("onnx_ir", "onnxscript"):
    logging.getLogger(_chatty).setLevel(logging.WARNING)


def _quantization_advice(record: logging.LogRecord) -> bool:
    """False for what onnxruntime's Python tools log on the root logger itself below an
    error: its quantization's advice to pre-process, at every int8 build. A filter, not the
    root's level raised around the quantization (in a thread daemon every other thread lost
    its warnings meanwhile), and for good (two quantizations at once share it)."""
    return record.levelno >= logging.ERROR or not (
        record.name == "root" and "onnxruntime" in Path(record.pathname).parts)


logging.getLogger().addFilter(_quantization_advice)

# ONNX tensor element types -> numpy dtypes, for binding output buffers.
ONNX_DTYPES = {
    "tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16",
    "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int16)": "int16",
    "tensor(int8)": "int8", "tensor(uint8)": "uint8", "tensor(bool)": "bool",
}


def _ort() -> Any:
    import onnxruntime

    return onnxruntime


def session_options(threads: int) -> ort.SessionOptions:
    """Sequential execution on `threads` intra-op threads that sleep instead of spinning."""
    ort = _ort()
    options = ort.SessionOptions()
    options.intra_op_num_threads = max(int(threads), 1)
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


def open_session(path: Path, threads: int) -> ort.InferenceSession:
    return _ort().InferenceSession(str(path), session_options(threads),
                                   providers=["CPUExecutionProvider"])


class ONNXExecutable(Executable):
    runtime = "onnxruntime"

    def __init__(self, session: ort.InferenceSession, model_dir: Path, feed: list[int],
                 meta: dict[str, Any]) -> None:
        self.session = session
        self.model_dir = model_dir  # holds part.onnx (+ data) for `save`
        self.feed = feed
        self.meta = meta
        self._inputs = [i.name for i in session.get_inputs()]
        self._outputs = [(o.name, o.shape, ONNX_DTYPES.get(o.type))
                         for o in session.get_outputs()]
        self._static = all(dtype is not None and all(isinstance(d, int) for d in shape)
                           for _, shape, dtype in self._outputs)
        self._binding = session.io_binding()

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        ort = _ort()
        binding = self._binding
        # The OrtValues only point at the arrays' memory: keep both alive until the run ends
        # (a non-contiguous input's contiguous copy lives nowhere else).
        alive = []
        for name, i in zip(self._inputs, self.feed, strict=True):
            value = ort.OrtValue.ortvalue_from_numpy(as_array(inputs[i]))
            binding.bind_ortvalue_input(name, value)
            alive.append(value)
        if not self._static:
            for name, _, _ in self._outputs:
                binding.bind_output(name, "cpu")
            self.session.run_with_iobinding(binding)
            return like_inputs(inputs, [v.numpy().copy() for v in binding.get_outputs()])
        outputs = []
        for name, shape, dtype in self._outputs:
            out = np.empty(shape, dtype=dtype)
            binding.bind_output(name, "cpu", 0, out.dtype, list(shape), out.ctypes.data)
            outputs.append(out)
        self.session.run_with_iobinding(binding)
        return like_inputs(inputs, outputs)

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        for path in self.model_dir.iterdir():
            if path.name.startswith(MODEL):  # part.onnx and its external data, if any
                shutil.copy2(path, directory / path.name)
        (directory / META).write_text(json.dumps(self.meta, indent=1))


def quantize(path: Path, calibration: list[list[torch.Tensor]], names: list[str]) -> None:
    """Static int8 quantization of the .onnx at `path`, in place (QDQ format, per-channel int8
    weights, uint8 activations, ranges from the part's own calibration inputs)."""
    if not calibration:
        raise CompileError("onnxruntime: int8 needs calibration inputs (none were given)")
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    session_inputs = [i.name for i in _ort().InferenceSession(
        str(path), providers=["CPUExecutionProvider"]).get_inputs()]
    feed = feed_order(session_inputs, names)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.samples = iter(calibration)

        def get_next(self) -> dict[str, Any] | None:
            sample = next(self.samples, None)
            return None if sample is None else {
                name: sample[i].detach().contiguous().numpy()
                for name, i in zip(session_inputs, feed, strict=True)}

    quantized = path.with_name("quantized.onnx")  # (its advice: `_quantization_advice`)
    try:
        quantize_static(str(path), str(quantized), Reader(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        per_channel=True)
    except Exception as e:
        raise CompileError(f"onnxruntime: int8 quantization failed: {type(e).__name__}: "
                           f"{e}") from e
    quantized.replace(path)


class ONNXRuntime(Runtime):
    name = "onnxruntime"
    kinds = ("cpu",)
    precisions = ("fp32", "int8")  # int8: static QDQ quantization on calibration inputs

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            _ort()
        except ImportError as e:
            return f"onnxruntime is not installed ({e})"
        missing = [name for name in EXPORTER_PACKAGES if not installed(name)]
        if missing:
            return (f"{' and '.join(missing)} not installed: torch.onnx.export(dynamo=True) "
                    "needs them")
        return None

    @classmethod
    def version(cls) -> str:
        return _ort().__version__

    def compile(self, part: fx.GraphModule, spec: CompileSpec) -> Executable:
        """Export `part` to ONNX in a private directory and open a session on it."""
        if not self.can_target(spec.device, spec.precision):
            raise CompileError(f"onnxruntime runs fp32 and int8 on the host CPU only, not "
                               f"{spec.device.id} (kind {spec.device.kind!r}) at {spec.precision}")
        example = tuple(t.detach() for t in spec.example_inputs)
        workdir = Path(tempfile.mkdtemp(prefix="cuvil-ort-"))
        try:
            exe = self._build(part, example, workdir, spec.threads,
                              spec.calibration if spec.precision == "int8" else None)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        weakref.finalize(exe, shutil.rmtree, workdir, True)  # the export dies with it
        return exe

    def _build(self, part: fx.GraphModule, example: tuple[torch.Tensor, ...], workdir: Path,
               threads: int, calibration: list[list[torch.Tensor]] | None = None,
               ) -> ONNXExecutable:
        import torch

        from runtimes.masks import empty_rows_zeroed

        try:
            # (an attention row that attends nothing: zeros, as torch's, not an average)
            exported = torch.export.export(empty_rows_zeroed(part), example)
            program = torch.onnx.export(exported, example, dynamo=True, verbose=False)
            program.save(str(workdir / MODEL))  # external data only past 2 GB
        except Exception as e:
            raise CompileError(f"onnxruntime: ONNX export failed: {type(e).__name__}: {e}") from e
        if calibration is not None:
            quantize(workdir / MODEL, calibration, list(exported.graph_signature.user_inputs))
        try:
            session = open_session(workdir / MODEL, threads)
        except Exception as e:
            raise CompileError(f"onnxruntime: session creation failed: {e}") from e
        names = [i.name for i in session.get_inputs()]
        feed = feed_order(names, list(exported.graph_signature.user_inputs))
        meta = {"format": META_FORMAT, "feed": feed, "onnxruntime": self.version()}
        return ONNXExecutable(session, workdir, feed, meta)

    def load(self, directory: Path, spec: CompileSpec) -> Executable:
        """Open a session on a saved .onnx file; nothing is exported."""
        directory = Path(directory)
        meta = read_meta(directory / META, "onnxruntime", META_FORMAT)
        session = open_session(directory / MODEL, spec.threads)
        return ONNXExecutable(session, directory, list(meta["feed"]), meta)

