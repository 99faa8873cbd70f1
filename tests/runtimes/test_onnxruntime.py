"""ONNX Runtime: reference models whole and split in two against torch eager, the compile
cache, outputs that outlive the next run, and the not-installed state."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from small_models import small_model

from partitioner.annotate import export
from partitioner.profile import DeviceProfile
from partitioner.split import SplitProgram, split_program
from runtimes import registry
from runtimes.base import (
    TOLERANCE,
    CompileError,
    CompileSpec,
    Executable,
    RuntimeUnavailable,
    relative_error,
)

# torch's pytree deprecation and the exporter's note that torchvision ops are not registered.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from runtimes.onnxruntime import ONNXRuntime  # noqa: E402

MODELS = ("resnet18", "bert4", "mlp")
THREADS = min(2, len(os.sched_getaffinity(0)))
CPU = DeviceProfile(id="cpu0", kind="cpu", cores=list(range(THREADS)),
                    runtimes=["onnxruntime"])




def whole(ep: torch.export.ExportedProgram) -> SplitProgram:
    return split_program(ep, {n.name: "all" for n in ep.graph.nodes if n.op == "call_function"})


def halves(ep: torch.export.ExportedProgram) -> SplitProgram:
    compute = [n.name for n in ep.graph.nodes if n.op == "call_function"]
    return split_program(ep, {n: "a" if i < len(compute) // 2 else "b"
                              for i, n in enumerate(compute)})


def compile_parts(program: SplitProgram, inputs: Sequence[torch.Tensor]) -> dict[str, Executable]:
    values = program.trace(*inputs)
    runtime = ONNXRuntime()
    return {p.id: runtime.compile(p.module, CompileSpec(
        device=CPU, threads=THREADS, example_inputs=[values[n].detach() for n in p.inputs]))
        for p in program.parts}


def run_split(program: SplitProgram, executables: dict[str, Executable],
              inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    values: dict[str, Any] = dict(zip(program.inputs, inputs, strict=True))
    for part in program.parts:
        outputs = executables[part.id].run([values[n] for n in part.inputs])
        values.update(zip(part.outputs, outputs, strict=True))
    return [values[n] for n in program.outputs]


class Case:
    """One reference model's architecture at batch 1 (narrower: small_models.py): eager
    outputs and its whole/half splits."""

    def __init__(self, name: str) -> None:
        model, self.inputs = small_model(name)
        with torch.inference_mode():
            out = model(*self.inputs)
        self.expected = list(out) if isinstance(out, tuple) else [out]
        ep = export(model, self.inputs)
        self.splits = {"whole": whole(ep), "half": halves(ep)}
        self.executables: dict[str, dict[str, Executable]] = {}

    def compiled(self, split: str) -> dict[str, Executable]:
        if split not in self.executables:
            self.executables[split] = compile_parts(self.splits[split], self.inputs)
        return self.executables[split]


@pytest.fixture(scope="module")
def cases() -> Callable[[str], Case]:
    """Each reference model exported (and each split compiled) once for the module."""
    made: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in made:
            made[name] = Case(name)
        return made[name]

    return get


@pytest.mark.parametrize("split", ["whole", "half"])
@pytest.mark.parametrize("name", MODELS)
def test_fp32_matches_eager(cases: Callable[[str], Case], name: str, split: str) -> None:
    case = cases(name)
    executables = case.compiled(split)
    assert len(executables) == (1 if split == "whole" else 2)
    outputs = run_split(case.splits[split], executables, case.inputs)
    assert relative_error(outputs, case.expected) <= TOLERANCE["fp32"]


def test_session_settings(cases: Callable[[str], Case]) -> None:
    (exe,) = cases("mlp").compiled("whole").values()
    config = exe.session.get_session_options().get_session_config_entry(
        "session.intra_op.allow_spinning")
    assert config == "0"
    assert exe.session.get_session_options().intra_op_num_threads == THREADS
    assert exe.session.get_providers() == ["CPUExecutionProvider"]


def test_outputs_survive_the_next_run(cases: Callable[[str], Case]) -> None:
    case = cases("mlp")
    (exe,) = case.compiled("whole").values()
    first = exe.run(case.inputs)
    kept = [t.clone() for t in first]
    exe.run([-x for x in case.inputs])
    assert all(torch.equal(a, b) for a, b in zip(first, kept, strict=True))


def test_save_load_does_not_export(cases: Callable[[str], Case], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    case = cases("resnet18")
    (exe,) = case.compiled("whole").values()
    exe.save(tmp_path)
    assert (tmp_path / "part.onnx").exists()
    before = exe.run(case.inputs)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("load must not export again")

    monkeypatch.setattr(torch.onnx, "export", refuse)
    monkeypatch.setattr(torch.export, "export", refuse)
    spec = CompileSpec(device=CPU, threads=THREADS, example_inputs=list(case.inputs))
    loaded = ONNXRuntime().load(tmp_path, spec)
    assert relative_error(loaded.run(case.inputs), before) <= 1e-6


def test_data_dependent_output_shape() -> None:
    # nonzero's row count is known only at run time: ORT allocates it and it is copied out.
    class Positive(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.nonzero(x > 0), x * 2

    x = torch.randn(4, 5)
    program = whole(export(Positive(), (x,)))
    executables = compile_parts(program, (x,))
    first = run_split(program, executables, (x,))
    assert all(torch.equal(a, b) for a, b in zip(first, Positive()(x), strict=True))
    second = run_split(program, executables, (-x,))
    assert all(torch.equal(a, b) for a, b in zip(second, Positive()(-x), strict=True))
    assert torch.equal(first[0], torch.nonzero(x > 0))  # not overwritten by the second run


def test_refuses_other_devices_and_precisions() -> None:
    runtime = ONNXRuntime()
    npu = DeviceProfile(id="npu0", kind="npu", emulated=True, cores=[1])
    assert not runtime.can_target(npu, "fp32") and not runtime.can_target(CPU, "bf16")
    part = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(CompileError, match="fp32 and int8 on the host CPU"):
        runtime.compile(part, CompileSpec(device=CPU, precision="bf16",
                                          example_inputs=[torch.ones(2)]))


def test_int8_quantizes_on_the_calibration_inputs(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 8, 3)).eval()
    x = torch.randn(1, 3, 32, 32)
    (part,) = whole(export(model, (x,))).parts
    calibration = [[torch.randn(1, 3, 32, 32)] for _ in range(8)]
    runtime = ONNXRuntime()
    with pytest.raises(CompileError, match="needs calibration inputs"):
        runtime.compile(part.module, CompileSpec(device=CPU, precision="int8",
                                                 example_inputs=[x], threads=THREADS))
    level = logging.getLogger().level
    with caplog.at_level(logging.INFO):
        exe = runtime.compile(part.module, CompileSpec(device=CPU, precision="int8",
                                                       example_inputs=[x], threads=THREADS,
                                                       calibration=calibration))
    assert "pre-process" not in caplog.text  # its advice, dropped
    assert logging.getLogger().level == level
    with torch.no_grad():
        error = relative_error(exe.run([x]), [model(x)])
    assert 0 < error < 0.25  # quantized: close, not exact
    exe.save(tmp_path)
    again = runtime.load(tmp_path, CompileSpec(device=CPU, precision="int8",
                                               example_inputs=[x], threads=THREADS))
    assert relative_error(again.run([x]), exe.run([x])) == 0


@pytest.mark.parametrize("module", ["onnxruntime", "onnxscript"])
def test_unavailable_when_a_package_is_missing(monkeypatch: pytest.MonkeyPatch,
                                               module: str) -> None:
    assert ONNXRuntime.unavailable() is None
    monkeypatch.setitem(sys.modules, module, None)  # importing it now fails
    reason = ONNXRuntime.unavailable()
    assert isinstance(reason, str) and module in reason
    with pytest.raises(RuntimeUnavailable, match=module):
        registry.get("onnxruntime")


def test_the_exporters_passes_say_nothing_below_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """onnx_ir's and onnxscript's passes log each step at INFO ("No unused functions to
    remove"): 54 of a daemon's 74 lines loading a split language model. Only their
    warnings reach cuvild's log."""
    model, inputs = small_model("mlp")
    caplog.set_level("DEBUG")
    compile_parts(whole(export(model, inputs)), inputs)
    said = [r for r in caplog.records if r.name.split(".")[0] in ("onnx_ir", "onnxscript")]
    assert not [r for r in said if r.levelno < 30], [r.getMessage() for r in said][:5]


def test_the_quantizations_advice_alone_is_dropped() -> None:
    """onnxruntime's quantization advises pre-processing on the root logger at every int8
    compile; a filter on the root drops what onnxruntime's own files log there below an
    error, and nothing else (the root's level stays as it was: a thread daemon's other threads
    log through it)."""
    from runtimes.onnxruntime import _quantization_advice

    def record(name: str, path: str, level: int = logging.WARNING) -> logging.LogRecord:
        return logging.LogRecord(name, level, path, 1, "advice", None, None)

    site = "/venv/lib/python3.12/site-packages/onnxruntime/quantization/quantize.py"
    assert _quantization_advice in logging.getLogger().filters
    assert not _quantization_advice(record("root", site))
    assert _quantization_advice(record("root", site, logging.ERROR))  # an error: kept
    assert _quantization_advice(record("root", "/srv/cuvild/runtimes/select.py"))
    assert _quantization_advice(record("onnxruntime.x", site))  # its own loggers: as they are
