"""OpenVINO: one compile path for the host CPU, Intel NPUs and Intel GPUs.

Compile (control path, `OpenVINORuntime.compile`):
1. `torch.export.export(part, example_inputs)`, then `openvino.convert_model(exported)`: the
   PyTorch frontend reads the ExportedProgram directly (it runs torch's decompositions itself);
2. the converted model comes out with dynamic input shapes; it is reshaped to the example
   inputs' shapes. NPUs need static shapes, and a part is compiled per shape anyway (shapes are
   in the compile-cache key), so every device gets a static model;
3. `core.compile_model` with a config that always names the inference precision: on a CPU with
   AMX the CPU plugin's default is bf16, so leaving it out would silently run fp32 parts in bf16.

Cache (`save` / `load`): the converted model as IR (part.xml/part.bin, weights kept fp32) and,
for NPU and GPU, whose compilers are slow, the compiled blob (part.blob). For the CPU plugin
the blob is no faster (measured: ResNet-18 0.10-0.18 s importing the blob vs 0.13 s compiling
the IR; the 268 MB MLP 2.4-3.7 s vs 1.3 s, as the IR's weights are memory-mapped) and doubles
the entry's size, so CPU entries hold the IR only. `load` imports the blob, or compiles the IR
when there is no blob or it no longer imports; it never converts again.

Run (data path, `OpenVINOExecutable.run`): inputs are handed over without copies
(`share_inputs=True` wraps the numpy views of the torch tensors). Outputs are copied once out
of the request's buffers (`share_outputs=False`): with shared outputs the arrays would be views
of the request's output tensors, which the next `infer` overwrites while the engine may still
hold the previous results (pipelined requests). Binding fresh caller buffers with
`set_output_tensor` measured no faster here and needs care: OpenVINO does not keep a shared
tensor's memory alive, so a freed buffer left bound is written into by the next infer.

Threads: INFERENCE_NUM_THREADS = spec.threads on the CPU plugin. OpenVINO has no passive-wait
setting: its oneTBB workers spin briefly after a task ("worker_wait"; OpenVINO's CPU guide,
"Composability of different threading runtimes", only suggests limiting threads on each side).
None of the CPU plugin's properties (2026.4: see `SUPPORTED_PROPERTIES`) controls waiting;
TBB_PARTITIONER chooses how work is split, not how idle threads wait. Measured here (ResNet-18,
2 threads): in the 20 ms after an infer the process used 0.3 ms of CPU, against 8 ms for ONNX
Runtime with spinning on and 4.3 ms for torch's OpenMP pool, so the spin is short.

Precisions: fp32 everywhere but the NPU (it takes an f32 hint but computes in fp16), bf16 on
the CPU plugin when the profile lists amx_bf16 or avx512_bf16, fp16 on NPU, GPU and CPUs with
avx512_fp16 / amx_fp16. Emulated devices run on the CPU plugin, so the CPU's rules apply.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partitioner.profile import DeviceProfile
from runtimes.base import (
    INT8_MIXED,
    CompileError,
    CompileSpec,
    Executable,
    Runtime,
    as_array,
    feed_order,
    like_inputs,
    read_meta,
    set_error,
)

if TYPE_CHECKING:  # torch only to compile: a worker loading cached builds never imports it
    import openvino as ov
    import torch
    from torch import fx

log = logging.getLogger(__name__)

# spec.precision -> INFERENCE_PRECISION_HINT. An int8 part is a model NNCF quantized: its
# FakeQuantize nodes pick the int8 kernels, the ops left unquantized stay in f32.
PRECISION_HINTS = {"fp32": "f32", "bf16": "bf16", "fp16": "f16", "int8": "f32",
                   INT8_MIXED: "f32"}
MODEL_XML = "part.xml"  # IR; save_model writes part.bin beside it
BLOB = "part.blob"  # compiled_model.export_model(), for NPU and GPU only
META = "openvino.json"
# 2: parts built through masks.empty_rows_zeroed (a format-1 entry's attention may give NaN)
META_FORMAT = 2

# torch's own op namespaces: another library's op has no rule in OpenVINO's PyTorch frontend
TORCH_NAMESPACES = frozenset({"aten", "prims", "quantized", "quantized_decomposed"})
# aten ops (overload packets, before or after torch's decompositions) that OpenVINO 2026.4's
# PyTorch frontend fails to convert, each verified with a one-op model on this host.
# kthvalue converts but returns the wrong shape, so it is treated as unsupported too.
UNSUPPORTED_OPS = frozenset({
    # FFT
    "aten.fft_fft", "aten.fft_ifft", "aten.fft_rfft", "aten.fft_irfft",
    "aten._fft_r2c", "aten._fft_c2c", "aten._fft_c2r",
    # linear algebra
    "aten.linalg_inv", "aten.linalg_inv_ex", "aten.linalg_det", "aten._linalg_det",
    "aten.linalg_slogdet", "aten._linalg_slogdet", "aten.linalg_cholesky",
    "aten.linalg_cholesky_ex", "aten.linalg_svd", "aten._linalg_svd", "aten.linalg_qr",
    "aten.linalg_eigh", "aten._linalg_eigh", "aten.linalg_eig", "aten.linalg_eigvals",
    "aten.linalg_solve", "aten._linalg_solve_ex", "aten.linalg_solve_triangular",
    "aten.linalg_pinv", "aten.linalg_matrix_exp", "aten.linalg_cross", "aten.diagonal",
    "aten.trace",
    # order statistics, scans, histograms, sampling
    "aten.median", "aten.nanmedian", "aten.mode", "aten.kthvalue", "aten.histc",
    "aten.bincount", "aten.cumprod", "aten.cummax", "aten.cummin", "aten.logcumsumexp",
    "aten.searchsorted", "aten.multinomial", "aten._unique2", "aten.unique_consecutive",
    "aten.pdist", "aten._pdist_forward", "aten.scatter_reduce", "aten.index_reduce",
    # special functions
    "aten.lgamma", "aten.digamma", "aten.polygamma", "aten.i0", "aten.special_i0",
    "aten.trunc", "aten.frac", "aten.hypot",
})


def _openvino() -> Any:
    import openvino

    return openvino


def ov_device(profile: DeviceProfile) -> str | None:
    """The OpenVINO device that serves `profile`, or None if OpenVINO cannot target it.

    The CPU and emulated devices run on the CPU plugin; a real NPU on "NPU"; a real GPU on
    "GPU" only when its profile lists openvino (a CUDA GPU does not).
    """
    if profile.kind == "cpu" or profile.emulated:
        return "CPU"
    if profile.kind == "npu":
        return "NPU"
    if profile.kind == "gpu" and "openvino" in profile.runtimes:
        return "GPU"
    return None


def device_precisions(profile: DeviceProfile) -> tuple[str, ...]:
    """Precisions OpenVINO can run on `profile`'s device, by its plugin and ISA features."""
    device = ov_device(profile)
    if device is None:
        return ()
    if device == "NPU":  # accepts an f32 hint, but the hardware computes in fp16
        return ("fp16",)
    if device == "GPU":
        return ("fp32", "fp16")
    found = ["fp32"]
    if {"amx_bf16", "avx512_bf16"} & set(profile.features):
        found.append("bf16")
    if {"amx_fp16", "avx512_fp16"} & set(profile.features):
        found.append("fp16")
    found.append("int8")  # the CPU plugin's int8 kernels: AMX, VNNI, else AVX2/AVX-512
    found.append(INT8_MIXED)  # the same, with the ops that cost the most error kept f32
    return tuple(found)


# int8+fp32: the most groups of quantized ops NNCF's accuracy control puts back to fp32, one
# at a time (each a compile and a validation): a bound on the build's time (a ResNet-18 at
# 64x64 took ~30 s to hold 5e-3 on the 2-core dev host).
RESTORE_ITERATIONS = 64
# ... and the seconds it may take: each iteration is a compile and a validation, and a part
# whose int8 is far off can spend all 64 (the BERT-like encoder took 324 s on the 2-core
# host and kept bf16). Past this the search stops and int8+fp32 is not built.
MIX_SEARCH_S = 120.0


class _OutOfTime(Exception):
    """Raised from NNCF's validation callback once the search is past MIX_SEARCH_S."""


def quantize(model: ov.Model, calibration: list[list[torch.Tensor]], feed: list[int],
             max_error: float | None = None, compile_: Any = None) -> ov.Model:
    """Post-training int8 quantization with NNCF (`nncf.quantize`, its defaults: symmetric
    weights, per-channel, fast bias correction) calibrated on the part's own inputs.

    With `max_error` (int8+fp32), NNCF's quantization with accuracy control instead: it
    ranks the quantized ops by what each costs the metric and puts the costliest back to fp32
    until it holds. The metric is the part's relative error against its fp32 build
    (`compile_` compiles a model for it), so `max_drop` is the error; it calibrates on half
    the inputs and validates on the other half. Refused if nothing is left int8."""
    if not calibration:
        raise CompileError("openvino: int8 needs calibration inputs (none were given)")
    import contextlib
    import io

    import nncf
    import numpy as np

    nncf.set_log_level(logging.ERROR)
    samples = [[as_array(sample[i]) for i in feed] for sample in calibration]
    with contextlib.redirect_stdout(io.StringIO()):  # NNCF's progress bars, not our log
        if max_error is None:
            return nncf.quantize(model, nncf.Dataset(samples), subset_size=len(samples))
        fp32 = compile_(model)
        # validated on the samples it did not calibrate on, so that what it keeps fp32 holds
        # beyond the inputs it saw (on its own calibration inputs a ResNet-18 at 1e-2 held
        # 3.7e-3 and read 1.2e-2 on held-out ones)
        held = samples[1::2] if len(samples) > 1 else samples
        samples = samples[::2]
        pairs = [(sample, [np.asarray(v) for v in fp32(sample).values()]) for sample in held]

        deadline = time.monotonic() + MIX_SEARCH_S
        validations = []

        def error(compiled: Any, items: Any) -> tuple[float, list[float]]:
            if time.monotonic() > deadline:
                raise _OutOfTime
            validations.append(1)
            outs = [[np.asarray(got) for got in compiled(sample).values()] for sample, _ in items]
            refs = [ref for _, ref in items]
            each = [set_error([out], [ref]) for out, ref in zip(outs, refs, strict=True)]
            # higher is better; fp32's is 1. The whole set's error decides (as the load's check
            # reads it); each sample's ranks the ops NNCF puts back
            return 1 - set_error(outs, refs), [1 - e for e in each]

        restorer = nncf.AdvancedAccuracyRestorerParameters(
            max_num_iterations=RESTORE_ITERATIONS, num_ranking_workers=1)
        try:
            mixed = nncf.quantize_with_accuracy_control(
                model, nncf.Dataset(samples), nncf.Dataset(pairs, lambda pair: pair[0]), error,
                max_drop=max_error, subset_size=len(samples),
                advanced_accuracy_restorer_parameters=restorer)
        except _OutOfTime:
            raise CompileError(f"openvino: {INT8_MIXED}: NNCF's accuracy control did not hold "
                               f"{max_error:.0e} within {MIX_SEARCH_S:.0f} s ({len(validations)}"
                               " validations): not built") from None
    if not any(op.get_type_name() == "FakeQuantize" for op in mixed.get_ordered_ops()):
        raise CompileError(f"openvino: {INT8_MIXED}: to hold {max_error:.0e}, NNCF's accuracy "
                           "control put every quantized op back to fp32 (nothing would run "
                           "int8)")  # (the label is what runs)
    return mixed


QUANTIZABLE = ("Convolution", "GroupConvolution", "MatMul", "ConvolutionBackpropData")


def kept_fp32(model: ov.Model) -> str:
    """Which of a quantized model's matmuls and convolutions NNCF left at fp32 (no
    FakeQuantize feeds them), for the plan's notes; "" when every one runs int8."""
    ops = [op for op in model.get_ordered_ops() if op.get_type_name() in QUANTIZABLE]
    kept = list(dict.fromkeys(
        graph_name(op) for op in ops
        if not any(i.get_source_output().get_node().get_type_name() == "FakeQuantize"
                   for i in op.inputs())))
    if not kept:
        return ""
    more = f" and {len(kept) - 6} more" if len(kept) > 6 else ""
    return (f"int8 except {len(kept)} of {len(ops)} matmuls/convolutions kept fp32 by NNCF's "
            f"accuracy control: {', '.join(kept[:6])}{more}")


def graph_name(op: Any, hops: int = 4) -> str:
    """The model's own name for an OpenVINO op: the converter names ops after the torch.export
    node they come from ("linear_3/aten.linear.default/MatMul" -> "linear_3"); an op that
    OpenVINO made itself ("Multiply_51935", from a decomposition or NNCF) takes the name of the
    nearest such op after it, then before it, within `hops`, marked "near"."""
    name = op.get_friendly_name()
    if "/" in name:
        return name.split("/")[0]
    seen, ring = {id(op)}, [op]
    for _ in range(hops):
        step = []
        for node in ring:
            for out in node.outputs():
                step += [t.get_node() for t in out.get_target_inputs()]
            step += [i.get_source_output().get_node() for i in node.inputs()]
        step = [n for n in step if id(n) not in seen and not seen.add(id(n))]
        for n in step:
            if "/" in n.get_friendly_name():
                return f"near {n.get_friendly_name().split('/')[0]}"
        ring = step
    return name


def compile_config(device: str, precision: str, threads: int) -> dict[str, Any]:
    """The compile_model config: precision always explicit, latency-oriented, thread count."""
    config: dict[str, Any] = {
        "INFERENCE_PRECISION_HINT": PRECISION_HINTS[precision],
        "PERFORMANCE_HINT": "LATENCY",  # one stream: a part runs one request at a time
    }
    if device == "CPU":
        config["INFERENCE_NUM_THREADS"] = max(int(threads), 1)
    return config


def check_precision(compiled: ov.CompiledModel, device: str, precision: str) -> None:
    """Raise CompileError unless the plugin resolved the precision hint to what was asked.

    A plugin may swap the hint for another without a word: the CPU plugin of 2026.4, asked
    for f16 on a CPU without avx512_fp16, runs bf16 (seen on an AVX512_BF16 EPYC), whose
    range is fp32's, so a part labelled fp16 would not overflow where fp16 does. A part's
    precision in the plan is what ran, so such a build is refused, naming both."""
    try:
        ran = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
    except Exception as e:  # noqa: BLE001 - a plugin that does not report it (NPU)
        log.debug("openvino: %s does not report its inference precision (%s)", device, e)
        return
    if ran != PRECISION_HINTS[precision]:
        raise CompileError(f"openvino on {device} runs {ran} when asked for "
                           f"{PRECISION_HINTS[precision]} ({precision}): this CPU cannot run "
                           f"{precision} in OpenVINO, whatever its profile lists")


def lowered(part: fx.GraphModule) -> str | None:
    """The element type a mixed-precision part's groups run at ("bf16", "f16"), None for any
    other part (runtimes/mixed.py marks the graphs it lowers): such a part is compiled with an
    f32 hint and its typed ops run low."""
    return {"bf16": "bf16", "fp16": "f16"}.get(getattr(part, "meta", {}).get("cuvil_mixed"))


def check_lowered(compiled: ov.CompiledModel, device: str, want: str) -> None:
    """Raise CompileError unless some of the part's compute ran at `want`: a plugin that
    cannot (a CPU without bf16) converts the graph back to f32, and the label would lie."""
    skip = {"Input", "Output", "Const", "Reorder", "Convert"}
    ran = 0
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if (str(info["layerType"].astype(str)) not in skip
                and str(info["runtimePrecision"].astype(str)) == want):
            ran += 1
    if not ran:
        raise CompileError(f"openvino on {device} ran none of the part's {want} operations at "
                           f"{want}: this device cannot run {want} in OpenVINO")


class OpenVINOExecutable(Executable):
    runtime = "openvino"

    def __init__(self, compiled: ov.CompiledModel, feed: list[int], meta: dict[str, Any],
                 model: ov.Model | None = None, source: Path | None = None) -> None:
        self.compiled = compiled
        self.feed = feed
        self.meta = meta
        self._model = model  # kept for `save` after a compile
        self._source = source  # the cache entry this was loaded from
        self._request = compiled.create_infer_request()
        self.note = str(meta.get("note", ""))

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        arrays = [as_array(inputs[i]) for i in self.feed]
        result = self._request.infer(arrays, share_inputs=True, share_outputs=False)
        return like_inputs(inputs, result.to_tuple())

    def save(self, directory: Path) -> None:
        ov = _openvino()
        directory = Path(directory)
        if self._model is not None:
            # compress_to_fp16 defaults to True: keep the weights as converted.
            ov.save_model(self._model, directory / MODEL_XML, compress_to_fp16=False)
        elif self._source is not None:
            for name in (MODEL_XML, Path(MODEL_XML).with_suffix(".bin").name):
                shutil.copy2(self._source / name, directory / name)
        else:
            raise RuntimeError("openvino: this executable has no model to save")
        meta = dict(self.meta, blob=False)
        if meta["device"] != "CPU":  # the module docstring says why not the CPU
            try:
                blob = self.compiled.export_model()  # bytes, or a BytesIO in recent versions
                data = blob.getvalue() if hasattr(blob, "getvalue") else blob
                (directory / BLOB).write_bytes(data)
                meta["blob"] = True
            except Exception as e:  # a plugin without EXPORT_IMPORT: the IR will do
                log.info("openvino: %s cannot export a compiled blob (%s)", meta["device"], e)
        (directory / META).write_text(json.dumps(meta, indent=1))


class OpenVINORuntime(Runtime):
    name = "openvino"
    kinds = ("cpu", "npu", "gpu")
    precisions = ("fp32", "bf16", "fp16", "int8", INT8_MIXED)

    def __init__(self) -> None:
        self._core: ov.Core | None = None

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            _openvino()
        except ImportError as e:
            return f"openvino is not installed ({e})"
        return None

    @classmethod
    def version(cls) -> str:
        return _openvino().get_version()

    @property
    def core(self) -> ov.Core:
        if self._core is None:
            self._core = _openvino().Core()
        return self._core

    def supports(self, node: fx.Node) -> bool:
        import torch

        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):  # noqa: SLF001 - torch._ops: its op classes
            return True
        if node.target.namespace not in TORCH_NAMESPACES:  # another library's op (its
            return False  # frontend has no rule: transformers' MoE experts, intake/foreign_ops.py)
        return str(node.target).rsplit(".", 1)[0] not in UNSUPPORTED_OPS

    def can_target(self, device: DeviceProfile, precision: str) -> bool:
        return device.kind in self.kinds and precision in device_precisions(device)

    def _target(self, spec: CompileSpec) -> str:
        device = ov_device(spec.device)
        if device is None or spec.precision not in device_precisions(spec.device):
            raise CompileError(
                f"openvino cannot target {spec.device.id} (kind {spec.device.kind!r}) at "
                f"{spec.precision}; it runs {device_precisions(spec.device) or 'nothing'} there")
        return device

    def compile(self, part: fx.GraphModule, spec: CompileSpec) -> Executable:
        """Export, convert, reshape to the example shapes and compile for the device."""
        import torch

        from runtimes.masks import empty_rows_zeroed

        ov = _openvino()
        device = self._target(spec)
        example = tuple(t.detach() for t in spec.example_inputs)
        try:  # (an attention row that attends nothing: zeros, as torch's, not NaN)
            exported = torch.export.export(empty_rows_zeroed(part), example)
        except Exception as e:
            raise CompileError(f"openvino: torch.export failed: {type(e).__name__}: {e}") from e
        try:
            model = ov.convert_model(exported)
        except Exception as e:
            raise CompileError(f"openvino: convert_model failed: {type(e).__name__}: {e}") from e
        part_inputs = list(exported.graph_signature.user_inputs)
        feed = feed_order([i.get_any_name() for i in model.inputs], part_inputs)
        config = compile_config(device, spec.precision, spec.threads)
        try:
            model.reshape({k: ov.PartialShape(list(example[i].shape))
                           for k, i in enumerate(feed)})
            if spec.precision in ("int8", INT8_MIXED):
                model = quantize(model, spec.calibration, feed, spec.max_error
                                 if spec.precision == INT8_MIXED else None,
                                 lambda m: self.core.compile_model(m, device, config))
            compiled = self.core.compile_model(model, device, config)
        except CompileError:
            raise
        except Exception as e:
            raise CompileError(f"openvino: compile_model on {device} failed: "
                               f"{type(e).__name__}: {e}") from e
        check_precision(compiled, device, spec.precision)
        low = lowered(part)
        if low:
            check_lowered(compiled, device, low)
        meta = {"format": META_FORMAT, "device": device, "config": config, "feed": feed,
                "openvino": self.version(), "lowered": low,
                "note": kept_fp32(model) if spec.precision == INT8_MIXED else ""}
        return OpenVINOExecutable(compiled, feed, meta, model=model)

    def load(self, directory: Path, spec: CompileSpec) -> Executable:
        """Import the compiled blob, or compile the saved IR; never converts again."""
        directory = Path(directory)
        meta = read_meta(directory / META, "openvino", META_FORMAT)
        device = self._target(spec)
        config = compile_config(device, spec.precision, spec.threads)
        compiled = None
        if meta.get("blob") and meta["device"] == device:
            try:
                compiled = self.core.import_model((directory / BLOB).read_bytes(), device, config)
            except Exception as e:  # e.g. a driver update: the IR still compiles
                log.warning("openvino: cached blob in %s did not import (%s)", directory, e)
        if compiled is None:
            compiled = self.core.compile_model(str(directory / MODEL_XML), device, config)
        check_precision(compiled, device, spec.precision)
        if meta.get("lowered"):
            check_lowered(compiled, device, meta["lowered"])
        meta = dict(meta, device=device, config=config)
        return OpenVINOExecutable(compiled, list(meta["feed"]), meta, source=directory)
